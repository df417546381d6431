"""Keeps a launched topology running: restarts an instance that exits or fails its health checks persistently.

One supervisor per topology. The foreground `pdctl up` runs it in-process; `pdctl up -d` starts it as a detached
process (`python -m pdctl.launch.supervisor STATE_DIR`, log in STATE_DIR/logs/supervisor.log). Either way its pid
is in STATE_DIR/supervisor.json, so `pdctl down` stops it before anything else and nothing is restarted behind
`down`'s back. After launch it is the only writer of state.json: each instance's restarts, phase, last exit and
last error line live there for `pdctl status`.

Policy (topology `supervision:` and each pool's `restart:`):
- an instance whose process is gone is restarted unless its pool says `never`, or `on-failure` and it exited
  with code 0;
- an instance that fails `health_failures` probes in a row, the first at least `health_window_s` ago, is
  stopped and restarted (a /health stalled behind a busy engine on a small host is not a crash);
- restarts back off exponentially (`backoff_s` doubling, at most `backoff_max_s`); after `max_restarts` within
  `window_s` the instance is left down (phase `failed`).
A restarted instance is `starting` until its /health answers; it gets `start_timeout_s` for that. A restarted
prefill or decode then has its pairs proven again (pdctl.launch.warmup.reprove) before it counts as serving, and
pdctl's proxy holds it (no requests) from the moment it is found gone until that proof passed: the proxy's own
/health probes would route to a server whose KV pairs are not wired yet.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdctl import auth
from pdctl.launch import engine_of, warmup
from pdctl.launch import probe as probe_mod
from pdctl.launch import state as state_mod
from pdctl.launch.engine import Engine, RestartableEngine
from pdctl.launch.errors import LaunchFailed
from pdctl.launch.local import start_ticks
from pdctl.launch.logs import exit_of, root_cause, this_run
from pdctl.launch.state import LaunchState
from pdctl.plan import ProcessSpec
from pdctl.protocol import HOLD_ROUTE
from pdctl.topology import ROLES, Topology

START_TIMEOUT_S = 600.0


class StateGone(Exception):
    """`pdctl down` removed the topology's state: nothing is left to supervise."""


@dataclass(frozen=True)
class Policy:
    """The topology's `supervision:` section (no defaults here: the topology model's are the only ones) and how
    long a restarted instance may take to answer /health."""

    health_failures: int
    health_window_s: float
    health_interval_s: float
    backoff_s: float
    backoff_max_s: float
    max_restarts: int
    window_s: float
    start_timeout_s: float = START_TIMEOUT_S

    @classmethod
    def of(cls, topology: Topology) -> Policy:
        return cls(**topology.supervision.model_dump())


def restart_policy(topology: Topology, spec: ProcessSpec) -> str:
    """The pool's `restart:` (the proxy, and anything outside a pool, is always restarted on failure)."""
    if spec.role in ROLES:
        for g in topology.pools(spec.role):
            if g.name == spec.pool:
                return g.restart
    return "on-failure"


@dataclass
class _Watch:
    phase: str = "running"
    started: float = 0.0  # clock() when the current run started
    next_probe: float = 0.0
    fails: int = 0
    fail_since: float | None = None
    warned: bool = False  # said once that a `restart: never` instance fails its health checks
    restart_at: float = 0.0
    restarts: deque = field(default_factory=deque)  # clock() of restarts within the window


class Supervisor:
    def __init__(self, state: LaunchState, engine: Engine, *, attached: bool,
                 clock: Callable[[], float] = time.monotonic,
                 healthy: Callable[[str], bool] = lambda url: probe_mod.healthy(url, timeout=2.0),
                 say: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
                 save: Callable[[LaunchState], None] = state_mod.save,
                 prove: Callable[[ProcessSpec], str | None] | None = None,
                 hold: Callable[[str, bool], str | None] | None = None):
        self.state, self.engine, self.attached = state, engine, attached
        self.clock, self.healthy, self.say, self.save = clock, healthy, say, save
        self.prove = prove or self._probe_pairs
        self.hold = hold or self._tell_proxy
        self.policy = Policy.of(state.plan.topology)
        now = clock()
        self.watches = {}
        for spec in state.plan.processes:
            rec = state.processes.get(spec.name)
            w = _Watch(phase=rec.phase if rec else "running", started=now)
            if w.phase in ("starting", "backoff"):  # a supervisor taking over mid-restart
                w.restart_at = now
            self.watches[spec.name] = w

    # -- one pass over every instance -----------------------------------------------------------------------

    def tick(self) -> None:
        """One pass over every instance. An error with one instance is said and skipped: the others stay
        supervised."""
        now = self.clock()
        for spec in self.state.plan.processes:
            try:
                self._check(spec, now)
            except StateGone:
                raise
            except Exception as e:  # noqa: BLE001 (a supervisor that dies leaves everything unsupervised)
                self.say(f"{spec.name}: supervisor error: {type(e).__name__}: {e}")

    def _check(self, spec: ProcessSpec, now: float) -> None:
        w = self.watches[spec.name]
        if w.phase in ("failed", "exited"):
            return
        if w.phase == "backoff":
            if now >= w.restart_at:
                self._restart(spec, w, now)
            return
        live = self.engine.liveness(self.state, spec.name)
        if not live.alive:
            self._ended(spec, w, now, live.exit_code, None)
            return
        if now < w.next_probe:
            return
        w.next_probe = now + self.policy.health_interval_s
        ok = self.healthy(spec.readiness_url)
        if not ok and exit_of(this_run(self.engine.log_tail(self.state, spec.name, 200))) is not None:
            # The server is gone; its guard is still stopping what it left (up to the guard's grace, longer on a
            # loaded host). That is an exit, not a run of failed health checks.
            self._ended(spec, w, now, None, None)
            return
        if w.phase == "starting":
            if ok:
                why = self.prove(spec)  # its pairs wired again before it counts as serving
                if why is not None:
                    self._stop(spec)
                    self._ended(spec, w, now, None, why)
                    return
                self._set(spec, w, "running")
                self._held(spec, False)
                self.say(f"{spec.name} is serving again (restart {self.state.processes[spec.name].restarts})")
            elif now - w.started > self.policy.start_timeout_s:
                self._stop(spec)
                self._ended(spec, w, now, None, f"not ready {self.policy.start_timeout_s:.0f} s after restart")
            return
        if ok:
            w.fails, w.fail_since = 0, None
            return
        w.fails += 1
        w.fail_since = now if w.fail_since is None else w.fail_since
        if w.fails >= self.policy.health_failures and now - w.fail_since >= self.policy.health_window_s:
            reason = f"failed {w.fails} health checks over {now - w.fail_since:.0f} s"
            if restart_policy(self.state.plan.topology, spec) == "never":
                if not w.warned:
                    self.say(f"{spec.name}: {reason}; restart: never, left as it is")
                    w.warned = True
                return
            self.say(f"{spec.name}: {reason}; stopping it")
            self._stop(spec)
            self._ended(spec, w, now, None, reason)

    def _probe_pairs(self, spec: ProcessSpec) -> str | None:
        """A restarted prefill or decode: each of its pairs with an instance that is up, probed as `up` does
        (pdctl.launch.warmup); why one failed, or None."""
        if spec.role not in ("prefill", "decode"):
            return None
        try:
            probes = warmup.reprove(self.state.plan, spec.name,
                                    partners=lambda name: self.watches.get(name, _Watch()).phase == "running")
        except LaunchFailed as e:
            return e.reason
        self.state.probes.update({p.label: p.seconds for p in probes})
        return None

    def _held(self, spec: ProcessSpec, held: bool) -> None:
        """Hold a prefill or decode at the proxy (no requests), or release it; said when the proxy cannot be told
        (it restarts too, or a vllm-router routes by its own health checks)."""
        if spec.role in ("prefill", "decode"):
            why = self.hold(spec.name, held)
            if why is not None:
                self.say(f"{spec.name}: the proxy was not told to {'hold' if held else 'release'} it: {why}")

    def _tell_proxy(self, name: str, held: bool) -> str | None:
        proxy = next((p for p in self.state.plan.processes if p.role == "proxy"), None)
        if proxy is None:
            return None
        if self.state.plan.topology.proxy.kind != "pdctl":
            return f"proxy.kind {self.state.plan.topology.proxy.kind} routes by its own health checks"
        key = auth.headers(auth.api_key(self.state.plan.topology))
        status, body = probe_mod.http_post_json(proxy.http_url + HOLD_ROUTE, {"instance": name, "held": held},
                                                timeout=2.0, headers=key)
        return None if status == 200 else f"HTTP {status or 'unreachable'} {body[:200]}".rstrip()

    def run(self, stop: threading.Event, interval_s: float = 0.5, until_settled: bool = False) -> None:
        """Pass after pass, each holding the state's lock, until `stop`, the state is gone (`down`), or (with
        `until_settled`) nothing is left to supervise."""
        state_dir = Path(self.state.plan.state_dir)
        while not stop.wait(interval_s):
            with state_mod.locked(state_dir):
                if not state_mod.state_path(state_dir).is_file():
                    raise StateGone(str(state_dir))
                self.tick()
            if until_settled and self.settled():
                self.say("nothing left to supervise: every instance gave up or exited cleanly")
                return

    def settled(self) -> bool:
        """Nothing left to supervise: every instance gave up or exited cleanly."""
        return all(w.phase in ("failed", "exited") for w in self.watches.values())

    # -- transitions ----------------------------------------------------------------------------------------

    def _set(self, spec: ProcessSpec, w: _Watch, phase: str) -> None:
        w.phase = phase
        rec = self.state.processes.get(spec.name)
        if rec is not None:
            rec.phase = phase
        self.save(self.state)

    def _stop(self, spec: ProcessSpec) -> None:
        # An engine that starts a plan as a whole stops it as a whole too: its instance is left as it is.
        if isinstance(self.engine, RestartableEngine):
            self.engine.stop_one(self.state, spec.name)

    def _ended(self, spec: ProcessSpec, w: _Watch, now: float, code: int | None, reason: str | None) -> None:
        """The instance is gone: record how and why, then restart it later, or leave it down."""
        if isinstance(self.engine, RestartableEngine):
            self._stop(spec)  # whatever the server left behind (an orphaned EngineCore holds its ports)
        lines = this_run(self.engine.log_tail(self.state, spec.name, 2000))
        how = exit_of(lines) or (f"exited with code {code}" if code is not None else "gone")
        rec = self.state.processes.get(spec.name)
        if rec is not None:
            rec.last_exit = f"{reason} ({how})" if reason else how
            rec.last_error = root_cause(lines)
        clean = reason is None and (code == 0 or how == "exited with code 0")
        policy = restart_policy(self.state.plan.topology, spec)
        cause = f": {rec.last_error}" if rec and rec.last_error else ""
        if not isinstance(self.engine, RestartableEngine):
            self.say(f"{spec.name} {rec.last_exit if rec else how}{cause}; the {self.engine.name} engine does "
                     "not restart single instances (pdctl down && pdctl up)")
            return self._set(spec, w, "failed")
        if policy == "never" or (policy == "on-failure" and clean):
            self.say(f"{spec.name} {rec.last_exit if rec else how}{cause}; restart: {policy}, left down")
            return self._set(spec, w, "exited" if clean else "failed")
        while w.restarts and now - w.restarts[0] > self.policy.window_s:
            w.restarts.popleft()
        if len(w.restarts) >= self.policy.max_restarts:
            self.say(f"{spec.name} {rec.last_exit if rec else how}{cause}; gave up after {len(w.restarts)} restarts "
                     f"within {self.policy.window_s:.0f} s (supervision.max_restarts)")
            return self._set(spec, w, "failed")
        delay = min(self.policy.backoff_max_s, self.policy.backoff_s * 2 ** len(w.restarts))
        w.restart_at = now + delay
        self._held(spec, True)  # from now until its pairs are proven again
        self.say(f"{spec.name} {rec.last_exit if rec else how}{cause}; restarting in {delay:.0f} s")
        self._set(spec, w, "backoff")

    def _restart(self, spec: ProcessSpec, w: _Watch, now: float) -> None:
        assert isinstance(self.engine, RestartableEngine)  # _ended leaves the others' instances down
        old = self.state.processes.get(spec.name)
        try:
            self.engine.start(self.state.plan, spec, self.state, attached=self.attached)
        except OSError as e:
            w.restarts.append(now)  # a start that fails counts: it must not loop at the first backoff forever
            self.say(f"{spec.name}: restart failed: {e}")
            return self._ended(spec, w, now, None, f"restart failed: {e}")
        rec = self.state.processes[spec.name]
        if old is not None:
            rec.restarts, rec.last_exit, rec.last_error = old.restarts, old.last_exit, old.last_error
        rec.restarts += 1
        rec.phase = "starting"
        self.save(self.state)  # at once: `down` must find the new process whatever happens next
        w.restarts.append(now)
        w.started, w.next_probe, w.fails, w.fail_since = now, now, 0, None
        self.say(f"{spec.name} restarted (pid {rec.pid}, restart {rec.restarts})")
        self._set(spec, w, "starting")


# ----------------------------------------------------------------------------------------------------------------
# The supervisor as a process of its own (pdctl up -d), and how `down` stops it.


def start_detached(state: LaunchState) -> int:
    """Start the detached supervisor for a launched topology; returns its pid once it has recorded itself."""
    import subprocess

    d = Path(state.plan.state_dir)
    log_path = d / "logs" / "supervisor.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pdctl.launch.supervisor", str(d)], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        rec = state_mod.load_supervisor(d)
        if rec and rec["pid"] == proc.pid:
            return proc.pid
        if proc.poll() is not None:
            raise RuntimeError(f"the supervisor exited at start (code {proc.returncode}); log: {log_path}")
        time.sleep(0.05)
    raise RuntimeError(f"the supervisor did not start within 20 s; log: {log_path}")


def supervise_attached(state: LaunchState, engine: Engine, stop: threading.Event,
                       say: Callable[[str], None]) -> bool:
    """The foreground `pdctl up`: supervise until `stop` is set, then take everything down. True when it ended
    because nothing was left to supervise (every instance gave up or exited cleanly)."""
    d = Path(state.plan.state_dir)
    sup = Supervisor(state, engine, attached=True, say=say)
    record_self(d, "foreground")
    try:
        while not stop.wait(0.5):
            with state_mod.locked(d):
                sup.tick()
            if sup.settled():
                return True
        return False
    finally:
        engine.stop(state)
        state_mod.remove(d)
        (d / state_mod.SUPERVISOR_FILE).unlink(missing_ok=True)


def record_self(state_dir: Path, mode: str) -> None:
    state_mod.save_supervisor(state_dir, os.getpid(), start_ticks(os.getpid()) or 0, mode)


def alive(state_dir: Path) -> dict | None:
    """The recorded supervisor, if that process still runs."""
    rec = state_mod.load_supervisor(state_dir)
    if rec is None or start_ticks(rec["pid"]) != rec.get("start_ticks"):
        return None
    return rec


def stop(state_dir: Path, timeout_s: float = 60.0) -> str | None:
    """Stop the topology's supervisor, if one runs; its mode ('detached' | 'foreground') when one was stopped.

    A foreground `pdctl up` stops its whole topology when told to; wait for that, so `down` finds what is left."""
    rec = state_mod.load_supervisor(state_dir)
    if rec is None:
        return None
    pid = rec["pid"]
    if pid == os.getpid() or start_ticks(pid) != rec.get("start_ticks"):
        (state_dir / state_mod.SUPERVISOR_FILE).unlink(missing_ok=True)  # stale record
        return None
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and start_ticks(pid) == rec.get("start_ticks"):
        time.sleep(0.1)
    if start_ticks(pid) == rec.get("start_ticks"):
        os.kill(pid, signal.SIGKILL)
    (state_dir / state_mod.SUPERVISOR_FILE).unlink(missing_ok=True)
    return str(rec.get("mode", "detached"))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m pdctl.launch.supervisor STATE_DIR", file=sys.stderr)
        return 2
    d = Path(argv[0])
    stop_event = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, lambda *_: stop_event.set())
    record_self(d, "detached")  # before reading the state: a `down` from now on stops this process first
    state = state_mod.load(d)
    if state is None:
        print(f"no launched topology in {d}", file=sys.stderr)
        state_mod.remove_supervisor(d, os.getpid())
        return 1

    def say(msg: str) -> None:
        print(f"{time.strftime('%F %T')} {msg}", flush=True)

    say(f"supervising {state.plan.name} ({len(state.plan.processes)} processes, pid {os.getpid()})")
    try:
        Supervisor(state, engine_of(state), attached=False, say=say).run(stop_event, until_settled=True)
    except StateGone:
        say("the topology was taken down")
    finally:
        state_mod.remove_supervisor(d, os.getpid())
    say("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
