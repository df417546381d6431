"""The bounded-KV-read drill, on any single-pair bring-up started with KV_READS (test_launch.py's, and
test_kv_reads.py's under kv_load_failure_policy: fail). The decode's test hooks report one request's read in
progress past connector.kv_read_timeout_s (as a read whose target never progresses looks) and hold another's until
the prefill's KV lease may have run out: a read may start only while it can end (1 s timeout, plus the proxy's hop)
inside the 8 s lease, so one held 7 s is not started. Each check compares with the session's aggregated reference."""

from __future__ import annotations

import json
import random

from pdctl import protocol
from pdctl.launch.probe import parse_metrics
from tests.e2e.conftest import get_text, hooks_env, pdctl
from tests.e2e.faults import complete, fresh_prompt

KV_READS = ["--set", "connector.kv_read_timeout_s=1", "--set", 'connector.extra_config={"kv_lease_duration": 8}',
            *hooks_env("decode", READ_STALL_S=4, READ_STALL_MATCH="stall-read", READ_DELAY_S=7,
                       READ_DELAY_MATCH="late-read")]


def log(up, name: str) -> str:
    return (up.state_dir / "logs" / f"{name}.log").read_text(errors="replace")


def ask(up, rid: str, prompt: list[int]):
    return complete(up.urls["proxy"], {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0},
                    {"X-Request-Id": rid})


def tokens(answer) -> str:
    return json.loads(answer.text)["choices"][0]["text"]


def reference(up, prompt: list[int]) -> str:
    return tokens(complete(up.reference, {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}))


def metric(up, name: str) -> float:
    return parse_metrics(get_text(up.urls["decode-0"] + "/metrics")).get(f"vllm:{name}_total", 0.0)


def lines(up, name: str, *marks: str) -> list[str]:
    return [ln for ln in log(up, "decode-0").splitlines() if name in ln and any(m in ln for m in marks)]


def check_probed(up) -> None:
    probes = up.status["probes"]
    assert list(probes) == ["prefill-0 -> decode-0"] and 0 < probes["prefill-0 -> decode-0"] < 2.0, probes
    assert "pdctl-probe-prefill-0-decode-0" in log(up, "decode-0")


def check_timed_out(up) -> None:
    prompt = fresh_prompt(random.Random(11), 150)
    before = metric(up, "pdctl_kv_reads_timed_out"), metric(up, "pdctl_kv_recomputed_requests")
    a = ask(up, "stall-read-1", prompt)
    assert a.ok, a.error
    assert tokens(a) == reference(up, prompt)
    (line,) = lines(up, "stall-read-1", protocol.READ_TIMED_OUT_MARK)
    assert "kv_load_failure_policy recompute" in line
    # the counters, in the decode's /metrics and in `pdctl status`
    assert metric(up, "pdctl_kv_reads_timed_out") == before[0] + 1
    assert metric(up, "pdctl_kv_recomputed_requests") == before[1] + 1
    st = json.loads(pdctl("status", "--state-dir", up.state_dir, "--json", check=True).stdout)
    decode = next(i for i in st["instances"] if i["name"] == "decode-0")
    assert decode["kv_reads_timed_out"] >= 1 and decode["kv_recomputed"] >= 1


def check_lease_refused(up) -> None:
    prompt = fresh_prompt(random.Random(12), 150)
    before = metric(up, "pdctl_kv_reads_refused_lease")
    a = ask(up, "late-read-1", prompt)
    assert a.ok, a.error
    assert tokens(a) == reference(up, prompt)
    assert len(lines(up, "late-read-1", protocol.LEASE_REFUSED_MARK)) == 1
    assert metric(up, "pdctl_kv_reads_refused_lease") == before + 1
    # the prefill saw no read of blocks it had released (vLLM logs one when it happens)
    assert not protocol.LATE_READ.search(log(up, "prefill-0"))


def check_control(up) -> None:
    prompt = fresh_prompt(random.Random(13), 150)
    a = ask(up, "plain-read-1", prompt)
    assert a.ok, a.error
    assert tokens(a) == reference(up, prompt)
    mine = [ln for ln in log(up, "decode-0").splitlines() if "plain-read-1" in ln]
    assert any(protocol.READ_MS.search(ln) for ln in mine)  # received, with its read time
    assert not any(protocol.READ_TIMED_OUT_MARK in ln or protocol.LEASE_REFUSED_MARK in ln for ln in mine)
