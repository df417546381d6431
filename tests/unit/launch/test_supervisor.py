"""The supervisor's policy, tick by tick with a fake clock and engine; then real processes: a killed one is
restarted, `down` stops the detached supervisor first, and the guard logs how a server ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from pdctl.launch import state as state_mod
from pdctl.launch import supervisor
from pdctl.launch.engine import Engine, Liveness, RestartableEngine, StopReport
from pdctl.launch.logs import EXIT_MARK, exit_of, root_cause
from pdctl.launch.state import LaunchState, ProcessRecord
from pdctl.plan import Plan, ProcessSpec
from pdctl.topology import Topology
from tests.conftest import wait_for


class FakeWholePlanEngine(Engine):
    """Starts a plan as a whole, like Ray and Slurm: no single-instance start or stop."""

    name = "fake"

    def __init__(self):
        self.alive: dict[str, bool] = {}
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.logs: dict[str, list[str]] = {}

    def preflight(self, plan):
        return []

    def launch(self, plan, state, *, attached):
        for s in plan.processes:
            self._start(s, state)
        return plan

    def _start(self, spec, state):
        self.alive[spec.name] = True
        self.started.append(spec.name)
        state.processes[spec.name] = ProcessRecord(spec.name, 1000 + len(self.started), 1000, 1, time.time())

    def liveness(self, state, name):
        return Liveness(self.alive.get(name, False), None if self.alive.get(name) else 137)

    def stop(self, state, grace_s=15.0):
        return StopReport([], [], [])

    def log_tail(self, state, name, n):
        return self.logs.get(name, [])


class FakeEngine(FakeWholePlanEngine, RestartableEngine):
    def start(self, plan, spec, state, *, attached):
        self._start(spec, state)

    def stop_one(self, state, name, grace_s=10.0):
        self.stopped.append(name)
        self.alive[name] = False
        return StopReport([name], [], [])


def spec(name: str, pool: str = "default", role: str = "prefill") -> ProcessSpec:
    return ProcessSpec(name, role, 0, ["true"], {}, "127.0.0.1", {"http": 1}, f"/tmp/{name}.log",
                       f"http://127.0.0.1:1/{name}/health", pool=pool)


def topology(restart: str = "on-failure", **supervision) -> Topology:
    return Topology.model_validate({"name": "t", "model": {"path": "m"}, "prefill": [{"name": "default",
                                    "restart": restart}], "decode": [{"name": "default"}], "supervision": supervision})


def make(restart: str = "on-failure", engine: type[FakeWholePlanEngine] = FakeEngine, **supervision):
    topo = topology(restart, **{"max_restarts": 3, **supervision})
    plan = Plan("t", "/tmp/t", [spec("prefill-0")], topo)
    st = LaunchState(plan)
    be = engine()
    be.launch(plan, st, attached=False)
    be.started.clear()
    clock = [0.0]
    health = {"ok": True}
    said: list[str] = []
    sup = supervisor.Supervisor(st, be, attached=False, clock=lambda: clock[0], healthy=lambda _u: health["ok"],
                                say=said.append, save=lambda _s: None)
    return sup, be, st, clock, health, said


def test_exit_is_restarted_with_exponential_backoff_then_given_up():
    sup, be, st, clock, _, said = make()
    be.logs["prefill-0"] = ["Traceback (most recent call last):", "ValueError: boom", f"{EXIT_MARK}killed by "
                            "signal 9 (SIGKILL)"]
    delays = []
    for _ in range(3):
        be.alive["prefill-0"] = False
        sup.tick()
        rec = st.processes["prefill-0"]
        assert rec.phase == "backoff" and rec.last_exit == "killed by signal 9 (SIGKILL)"
        assert rec.last_error == "ValueError: boom"
        delays.append(sup.watches["prefill-0"].restart_at - clock[0])
        clock[0] = sup.watches["prefill-0"].restart_at
        sup.tick()
        assert st.processes["prefill-0"].phase == "starting"
        clock[0] += 1
        sup.tick()  # /health answers: serving again
        assert st.processes["prefill-0"].phase == "running"
    assert delays == [2.0, 4.0, 8.0] and st.processes["prefill-0"].restarts == 3
    be.alive["prefill-0"] = False
    sup.tick()  # a fourth failure within the window: left down
    assert st.processes["prefill-0"].phase == "failed" and "gave up after 3 restarts" in said[-1]
    assert sup.settled()


def test_restarts_outside_the_window_do_not_count():
    sup, be, st, clock, _, _ = make(max_restarts=1, window_s=100.0)
    for _ in range(3):
        be.alive["prefill-0"] = False
        sup.tick()
        assert st.processes["prefill-0"].phase == "backoff"
        clock[0] = sup.watches["prefill-0"].restart_at
        sup.tick()
        clock[0] += 1
        sup.tick()
        assert st.processes["prefill-0"].phase == "running"
        clock[0] += 200  # past the window: this restart no longer counts against the next failure
    assert st.processes["prefill-0"].restarts == 3


@pytest.mark.parametrize("restart,code,phase", [("never", 137, "failed"), ("on-failure", 0, "exited"),
                                                ("always", 0, "backoff"), ("on-failure", 1, "backoff")])
def test_restart_policy_per_pool(restart, code, phase):
    sup, be, st, _, _, _ = make(restart)
    be.alive["prefill-0"] = False
    be.logs["prefill-0"] = [f"{EXIT_MARK}exited with code {code}"]
    sup.tick()
    assert st.processes["prefill-0"].phase == phase


def test_health_failures_restart_only_after_count_and_window():
    sup, be, st, clock, health, said = make()
    health["ok"] = False
    for t in (0, 5, 10, 15, 20, 25):  # 6 failures, but the first only 25 s ago: a busy engine, not a crash
        clock[0] = t
        sup.tick()
    assert st.processes["prefill-0"].phase == "running" and not be.stopped
    clock[0] = 30
    sup.tick()
    assert be.stopped == ["prefill-0", "prefill-0"] and st.processes["prefill-0"].phase == "backoff"
    assert "failed 7 health checks over 30 s" in st.processes["prefill-0"].last_exit


def test_one_good_probe_resets_the_health_count():
    sup, be, st, clock, health, _ = make()
    for t in range(0, 60, 5):
        clock[0] = t
        health["ok"] = t % 15 != 0  # fails now and then, never 3 times in a row
        sup.tick()
    assert st.processes["prefill-0"].phase == "running" and not be.stopped


def test_not_restartable_engine_reports_and_leaves_down():
    sup, be, st, _, _, said = make(engine=FakeWholePlanEngine)
    assert not be.restartable
    be.alive["prefill-0"] = False
    sup.tick()
    assert st.processes["prefill-0"].phase == "failed" and "does not restart" in said[-1] and not be.started


def test_root_cause_prefers_pdctl_lines_then_the_first_exception():
    vllm = ["(EngineCore_DP0 pid=7) ERROR 12-02 10:00:00 [core.py:1] EngineCore failed to start.",
            "(EngineCore_DP0 pid=7) Traceback (most recent call last):",
            '(EngineCore_DP0 pid=7)   File "x.py", line 1, in <module>',
            "(EngineCore_DP0 pid=7) ValueError: pdctl connector: 96 KV blocks cannot spare 32 staging blocks; give "
            "the decode more KV cache memory",
            "Traceback (most recent call last):",
            "RuntimeError: Engine core initialization failed. See root cause above."]
    assert root_cause(vllm) == ("ValueError: pdctl connector: 96 KV blocks cannot spare 32 staging blocks; give "
                                "the decode more KV cache memory")
    assert root_cause(["Traceback (most recent call last):", "  File 'a'", "OSError: [Errno 98] Address in use",
                       "During handling...", "RuntimeError: later"]) == "OSError: [Errno 98] Address in use"
    assert root_cause(["INFO all fine"]) is None
    assert exit_of(["x", f"{EXIT_MARK}exited with code 3", "y"]) == "exited with code 3"


# -- real processes -------------------------------------------------------------------------------------------




def test_detached_supervisor_restarts_a_killed_process_and_down_stops_it_first(tmp_path: Path, run_cli):
    """A real LocalEngine plan of one `sleep` behind a tiny HTTP health server: SIGKILL it, the detached
    supervisor restarts it (status shows the restart and how it ended); `down` stops the supervisor, then it."""
    from pdctl.launch.local import LocalEngine, group_alive

    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = [sys.executable, "-c", "import http.server, sys; http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), "
              "type('H', (http.server.BaseHTTPRequestHandler,), {'do_GET': lambda s: (s.send_response(200), "
              "s.end_headers()), 'log_message': lambda *a: None})).serve_forever()", str(port)]
    sp = ProcessSpec("prefill-0", "prefill", 0, server, {}, "127.0.0.1", {"http": port},
                     str(tmp_path / "logs" / "prefill-0.log"), f"http://127.0.0.1:{port}/health", pool="default")
    topo = topology("on-failure", backoff_s=0.5, health_interval_s=0.5)
    plan = Plan("sup-test", str(tmp_path), [sp], topo)
    engine = LocalEngine()
    st = LaunchState(plan)
    engine.launch(plan, st, attached=False)
    state_mod.save(st)
    pid = supervisor.start_detached(st)
    try:
        first = st.processes["prefill-0"]
        # A process group of its own in the starter's session: one scheduler autogroup for the deployment
        # (a session per server let a spinning NIXL thread starve another server on a shared core).
        assert os.getpgid(first.pid) == first.pid and os.getsid(first.pid) == os.getsid(0)
        assert wait_for(lambda: _http_ok(port), 15)
        os.kill(_child_of(first.pid), signal.SIGKILL)  # the server, under its guard
        assert wait_for(lambda: (r := state_mod.load(tmp_path).processes["prefill-0"]).restarts == 1
                     and r.phase == "running", 30), (tmp_path / "logs" / "supervisor.log").read_text()
        rec = state_mod.load(tmp_path).processes["prefill-0"]
        assert rec.pid != first.pid and rec.last_exit == "killed by signal 9 (SIGKILL)"
        assert os.getpgid(rec.pid) == rec.pid and os.getsid(rec.pid) == os.getsid(pid)  # the supervisor's session
        code, out, _ = run_cli("status", "--state-dir", str(tmp_path), "--json")
        row = json.loads(out)["instances"][0]
        assert code == 0 and row["restarts"] == 1 and row["healthy"] and json.loads(out)["supervisor"]["pid"] == pid
        code, out, _ = run_cli("down", "--state-dir", str(tmp_path))
        assert code == 0 and "stopped the detached supervisor" in out and "stopped prefill-0" in out
        assert wait_for(lambda: not group_alive(rec.pgid), 10)
        assert supervisor_gone(pid)
    finally:
        for p in (pid,):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        engine.stop(state_mod.load(tmp_path) or st, 2)


def supervisor_gone(pid: int) -> bool:
    from pdctl.launch.local import start_ticks

    return wait_for(lambda: start_ticks(pid) is None, 10)


def _http_ok(port: int) -> bool:
    from pdctl.launch.probe import healthy

    return healthy(f"http://127.0.0.1:{port}/health", timeout=0.5)


def _child_of(pid: int) -> int:
    from pdctl.launch.local import live_processes

    kids = []
    assert wait_for(lambda: kids.extend(p for p, ppid, _ in live_processes() if ppid == pid) or kids, 10)
    return kids[0]


def test_guard_logs_how_the_server_ended(tmp_path: Path):
    from pdctl.launch.local import guarded

    out = subprocess.run(guarded(["sh", "-c", "exit 4"], orphan=True), capture_output=True, text=True, timeout=30)
    assert out.returncode == 4 and f"{EXIT_MARK}exited with code 4" in out.stderr
    p = subprocess.Popen(guarded(["sleep", "300"], orphan=True), stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    child = _child_of(p.pid)
    os.kill(child, signal.SIGKILL)
    assert p.wait(15) == 137 and "killed by signal 9 (SIGKILL)" in p.stderr.read()


def test_launch_failed_shows_the_root_cause_first_not_the_traceback(tmp_path: Path, capsys):
    from pdctl import cli, render
    from pdctl.launch.errors import LaunchFailed

    log = tmp_path / "decode-0.log"
    noise = [f"(EngineCore_DP0 pid=7) INFO line {i}" for i in range(30)]
    log.write_text("\n".join([*noise, "(EngineCore_DP0 pid=7) Traceback (most recent call last):",
                              '(EngineCore_DP0 pid=7)   File "x.py", line 3, in f',
                              "(EngineCore_DP0 pid=7) ValueError: pdctl connector: 96 KV blocks cannot spare 32 "
                              "staging blocks; give the decode more KV cache memory",
                              *[f'  File "v{i}.py", line {i}' for i in range(20)],
                              "RuntimeError: Engine core initialization failed. See root cause above."]) + "\n")
    render.launch_failed(cli.err, LaunchFailed("decode-0", "exited with code 1 before it was ready", str(log)))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[0] == "launch failed: decode-0: exited with code 1 before it was ready"
    assert lines[1].strip() == ("cause: ValueError: pdctl connector: 96 KV blocks cannot spare 32 staging blocks; "
                                "give the decode more KV cache memory")
    assert f"log: {log}" in err and "File" not in err and len(lines) <= 4


def test_a_restart_that_cannot_start_counts_toward_the_limit():
    sup, be, st, clock, _, said = make(max_restarts=2)

    def broken(*_a, **_k):
        raise OSError("No space left on device")

    be.start = broken
    be.alive["prefill-0"] = False
    for _ in range(10):
        sup.tick()
        clock[0] = max(clock[0], sup.watches["prefill-0"].restart_at)
    assert st.processes["prefill-0"].phase == "failed" and "gave up after 2 restarts" in said[-1]


def test_restart_never_leaves_an_unhealthy_instance_running():
    sup, be, st, clock, health, said = make("never")
    health["ok"] = False
    for t in range(0, 100, 5):
        clock[0] = t
        sup.tick()
    assert not be.stopped and st.processes["prefill-0"].phase == "running"
    assert sum("restart: never, left as it is" in m for m in said) == 1


def test_an_error_with_one_instance_does_not_stop_the_supervisor():
    sup, be, st, clock, _, said = make()

    def boom(*_a):
        raise ProcessLookupError("gone")

    be.liveness = boom
    sup.tick()
    assert "supervisor error: ProcessLookupError" in said[-1]


def test_run_ends_when_down_removed_the_state(tmp_path: Path):
    import threading

    sup, be, st, clock, _, _ = make()
    st.plan = replace(st.plan, state_dir=str(tmp_path))
    with pytest.raises(supervisor.StateGone):
        sup.run(threading.Event(), interval_s=0.01)  # no state.json in tmp_path: taken down


def test_attached_supervision_takes_everything_down_when_told_or_when_settled(tmp_path: Path):
    import threading

    for restart, settles in (("on-failure", False), ("never", True)):
        sup, be, st, _, _, said = make(restart)
        st.plan = replace(st.plan, state_dir=str(tmp_path))
        state_mod.save(st)
        stopped: list = []
        be.stop = lambda state, grace_s=15.0, stopped=stopped: stopped.append(True)
        stop = threading.Event()
        if settles:
            be.alive["prefill-0"] = False  # restart: never -> failed -> nothing left to supervise
        else:
            threading.Timer(0.8, stop.set).start()
        assert supervisor.supervise_attached(st, be, stop, say=said.append) is settles
        assert stopped and not (tmp_path / "state.json").exists() and not (tmp_path / "supervisor.json").exists()


def test_a_server_gone_while_its_guard_still_cleans_up_is_an_exit_not_failed_health_checks():
    # CI saw "failed 5 health checks over 10 s (killed by signal 9 (SIGKILL))": the guard outlived the SIGKILLed
    # server by its grace while the engine core stopped, and the health count ran out first.
    sup, be, st, clock, health, _ = make()
    be.logs["prefill-0"] = [f"{EXIT_MARK}exited with code 1", "--- pdctl: starting prefill-0 at now", "INFO up"]
    health["ok"] = False
    sup.tick()  # negative control: the previous run's exit line is not this run's
    assert st.processes["prefill-0"].phase == "running" and not be.stopped
    be.logs["prefill-0"].append(f"{EXIT_MARK}killed by signal 9 (SIGKILL)")
    clock[0] = 5
    sup.tick()
    rec = st.processes["prefill-0"]
    assert rec.phase == "backoff" and rec.last_exit == "killed by signal 9 (SIGKILL)" and be.stopped == ["prefill-0"]


def test_a_restarted_instance_serves_only_once_its_pairs_are_proven_again():
    sup, be, st, clock, _, said = make()
    verdicts = ["warm-up probe of pair prefill-0 -> decode-0: its first KV read took 30.2 s", None]
    proved: list[str] = []
    sup.prove = lambda s: proved.append(s.name) or verdicts.pop(0)
    for _ in range(2):
        be.alive["prefill-0"] = False
        sup.tick()
        clock[0] = sup.watches["prefill-0"].restart_at
        sup.tick()
        assert st.processes["prefill-0"].phase == "starting"
        clock[0] += 1
        sup.tick()  # /health answers: its pairs are probed before it counts as serving
    # the first proof failed: stopped, recorded, restarted after the backoff; the second passed
    assert proved == ["prefill-0", "prefill-0"]
    assert "prefill-0" in be.stopped
    assert any("its first KV read took 30.2 s" in m and "restarting in" in m for m in said)
    assert st.processes["prefill-0"].phase == "running" and st.processes["prefill-0"].restarts == 2


def test_the_proxy_holds_a_restarted_instance_from_its_end_until_its_pairs_are_proven():
    sup, be, st, clock, _, said = make()
    told: list[tuple[str, bool, str]] = []
    sup.hold = lambda name, held: told.append((name, held, st.processes[name].phase)) or None
    verdicts = ["its first KV read took 30.2 s", None]
    sup.prove = lambda s: verdicts.pop(0)
    for _ in range(2):
        be.alive["prefill-0"] = False
        sup.tick()
        clock[0] = sup.watches["prefill-0"].restart_at
        sup.tick()
        clock[0] += 1
        sup.tick()
    # held when found gone (and again when its proof failed), released only once proven and serving
    assert told == [("prefill-0", True, "running"), ("prefill-0", True, "starting"), ("prefill-0", False, "running")]
    sup.hold = lambda name, held: "HTTP unreachable"
    be.alive["prefill-0"] = False
    sup.tick()
    assert "the proxy was not told to hold it: HTTP unreachable" in said[-2]
