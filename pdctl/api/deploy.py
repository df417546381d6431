"""Deployments: bring a topology up (in-process or detached under a supervisor), attach to one, its status,
logs and supervision, take it down."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pdctl import auth
from pdctl.api.common import DASHBOARD, Say, UserError, _quiet
from pdctl.api.topology import origin, plan
from pdctl.launch.waits import READY_TIMEOUT_S, STOP_GRACE_S
from pdctl.plan import Plan, ProcessSpec
from pdctl.topology import Topology


@dataclass
class DownReport:
    name: str
    supervisor: str | None  # the supervisor's mode when one was stopped
    stopped: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)  # needed SIGKILL after the grace period
    already_gone: list[str] = field(default_factory=list)
    nothing: str | None = None  # why there was nothing to stop
    by_foreground_up: bool = False  # a foreground `pdctl up` stopped everything itself


@dataclass
class StatusReport:
    name: str
    state_dir: str
    engine: str
    supervisor: dict | None
    instances: list  # launch.run.InstanceStatus
    prometheus: str | None = None  # its URL when the topology runs with monitoring
    probes: dict[str, float] = field(default_factory=dict)  # "prefill -> decode": its warm-up probe's read (s)

    @property
    def ready(self) -> bool:
        return all(r.healthy for r in self.instances)

    def to_dict(self) -> dict:
        return {"name": self.name, "state_dir": self.state_dir, "engine": self.engine, "supervisor": self.supervisor,
                "ready": self.ready, "instances": [asdict(r) for r in self.instances], "prometheus": self.prometheus,
                "probes": self.probes}


class Deployment:
    """A running topology. From `up(detach=False)`: owned by this process, stopped when its `with` block ends.
    From `up(detach=True)` or `attach(name)`: backed by the state dir (and a supervisor), outlives the caller;
    `down()` stops it."""

    def __init__(self, state, engine, *, attached: bool, notes: list[str] | None = None):
        self.state, self.engine, self.attached = state, engine, attached
        self.notes = notes or []  # what `up` has to say (supervisor pid, engine caveats)

    @property
    def backend(self):
        """Renamed to `engine` (the engine that runs the plan); removed in 0.3."""
        warnings.warn("Deployment.backend is renamed to Deployment.engine", DeprecationWarning, stacklevel=2)
        return self.engine

    @property
    def plan(self) -> Plan:
        return self.state.plan  # as placed: cluster engines fill in node addresses

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def topology(self) -> Topology:
        return self.plan.topology

    @property
    def state_dir(self) -> Path:
        return Path(self.plan.state_dir)

    @property
    def proxy_url(self) -> str:
        return self.plan.get("proxy").http_url

    @property
    def instances(self) -> list[ProcessSpec]:
        """The prefill and decode servers, in plan order."""
        return [s for s in self.plan.processes if s.role in ("prefill", "decode")]

    @property
    def prometheus_url(self) -> str | None:
        """The topology's Prometheus (monitoring.enabled), else None."""
        from pdctl.monitoring import prometheus_url

        return prometheus_url(self.plan)

    @property
    def reference_url(self) -> str | None:
        ref = [s for s in self.plan.processes if s.role == "reference"]
        return ref[0].http_url if ref else None

    def status(self) -> StatusReport:
        from pdctl.launch import run as run_mod
        from pdctl.launch import supervisor

        return StatusReport(self.name, str(self.state_dir), self.state.engine_kind, supervisor.alive(self.state_dir),
                            run_mod.status(self.state, self.engine), self.prometheus_url, dict(self.state.probes))

    def select(self, which: str | None = None) -> list[ProcessSpec]:
        """Processes named by instance, ROLE, ROLE/POOL, ROLE/INDEX or ROLE/POOL/INDEX (all without `which`)."""
        from pdctl.plan import select

        specs = select(self.plan, which)
        if not specs:
            raise UserError(f"no instance matches '{which}'; have {', '.join(s.name for s in self.plan.processes)}")
        return specs

    def logs(self, which: str | None = None, lines: int = 40) -> dict[str, list[str]]:
        """The last `lines` lines of each selected process's log."""
        return {s.name: self.engine.log_tail(self.state, s.name, lines) for s in self.select(which)}

    def follow(self, which: str | None = None, poll_s: float = 0.3) -> Iterator[tuple[str, str]]:
        """(process, line) for every new log line, until the caller stops iterating (logs on this host only)."""
        specs = self.select(which)
        missing = [s.log_path for s in specs if not Path(s.log_path).is_file()]
        if missing:
            raise UserError(f"following logs works for files on this host; not here: {', '.join(missing)}")
        with contextlib.ExitStack() as stack:
            files = {s.name: stack.enter_context(open(s.log_path, errors="replace")) for s in specs}
            for f in files.values():
                f.seek(0, 2)
            while True:
                for n, f in files.items():
                    for line in f.readlines():
                        yield n, line
                time.sleep(poll_s)

    def supervise(self, say: Say = _quiet) -> str:
        """Supervise in the foreground until SIGINT/SIGTERM or nothing is left, then take everything down:
        'interrupted' (SIGINT), 'stopped' (SIGTERM, e.g. `pdctl down` from another shell) or 'settled' (every
        instance gave up)."""
        from pdctl.launch import supervisor

        if threading.current_thread() is not threading.main_thread():
            raise UserError("supervise() runs in the main thread (it handles SIGINT and SIGTERM); elsewhere, use "
                            "up(detach=True), whose supervisor is its own process")
        stop = threading.Event()
        got: list[int] = []
        old = {s: signal.signal(s, lambda signum, _f: (got.append(signum), stop.set()))
               for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            settled = supervisor.supervise_attached(self.state, self.engine, stop, say=say)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return "settled" if settled else ("interrupted" if signal.SIGINT in got else "stopped")

    def down(self, grace_s: float = STOP_GRACE_S) -> DownReport:
        return down(state_dir=self.state_dir, grace_s=grace_s)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc) -> None:
        if self.attached:
            from pdctl.launch import run as run_mod

            run_mod.down(self.state, self.engine)


@contextlib.contextmanager
def _interruptible():
    """SIGINT and SIGTERM raise KeyboardInterrupt (main thread only), so whatever was started in the block is
    stopped on the way out, however pdctl was told to stop (a shell that ignores SIGINT, `kill`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(_signum, _frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _preflight(p: Plan, t: Topology):
    """The plan's engine, once everything that can be known before launch was checked."""
    from pdctl.launch import engine_for
    from pdctl.launch import run as run_mod

    engine = engine_for(p.topology.engine)
    problems = run_mod.preflight(origin(t), p, engine)
    if problems:
        raise UserError("pre-flight failed, nothing was started:\n  " + "\n  ".join(problems))
    return engine


def up(target: Topology | Plan, *, detach: bool = False, timeout_s: float = READY_TIMEOUT_S,
       state_dir: str | Path | None = None, reference_port: int | None = None,
       on_progress: Callable[[list], None] = lambda _rows: None) -> Deployment:
    """Start every process of the topology (or of a plan made by `pdctl.plan`), wait until all are ready and a
    P/D request has gone through every pool pair; raises LaunchFailed (every process stopped) or UserError.

    detach=False: use it as a context manager; everything stops when the block ends. detach=True: the servers and
    a supervisor (local engine) outlive this process; `pdctl.attach(name)` finds them again."""
    from pdctl.launch import run as run_mod

    if isinstance(target, Plan):
        if state_dir is not None or reference_port is not None:
            raise UserError("up(plan): the plan says where its state lives and whether it has a reference; give "
                            "state_dir and reference_port to pdctl.plan")
        p, t = target, target.topology
        if t.origin is None:
            raise UserError("up(plan): the plan's topology must come from pdctl.load")
    else:
        t = target
        p = plan(t, state_dir=state_dir, reference_port=reference_port)
    from pdctl.launch import supervisor

    engine = _preflight(p, t)
    notes: list[str] = []
    state = None
    try:
        with _interruptible():
            # Interrupted while starting, run.up stops what it started; once it returned, the except below does.
            state = run_mod.up(p, engine, attached=not detach, timeout_s=timeout_s, on_progress=on_progress)
            if detach and engine.restartable:
                try:
                    pid = supervisor.start_detached(state)
                except RuntimeError as e:
                    notes.append(f"warning: {e}; instances will not be restarted")
                else:
                    notes.append(f"supervisor pid {pid} (log {Path(p.state_dir) / 'logs' / 'supervisor.log'})")
            elif detach:
                notes.append(f"note: the {engine.name} engine starts a plan as a whole; pdctl does not restart "
                             "its single instances (status shows them down; pdctl down && pdctl up)")
            d = Deployment(state, engine, attached=not detach, notes=notes)
            if d.prometheus_url:
                notes.append(f"monitoring: Prometheus {d.prometheus_url} (Grafana dashboard: {DASHBOARD})")
    except BaseException:
        if state is not None:  # up, then stopped before the caller got its handle: nothing is left behind
            supervisor.stop(Path(p.state_dir))
            run_mod.down(state, engine)
        raise
    return d


def state_dir_of(name: str | None = None, state_dir: str | Path | None = None) -> Path:
    from pdctl.launch import state as state_mod

    try:
        return state_mod.resolve_state_dir(name, Path(state_dir) if state_dir else None)
    except LookupError as e:
        raise UserError(str(e)) from None


def attach(name: str | None = None, *, state_dir: str | Path | None = None) -> Deployment:
    """A handle to a topology that is up (by name, state dir, or the only one there is)."""
    from pdctl.launch import engine_of
    from pdctl.launch import state as state_mod

    d = state_dir_of(name, state_dir)
    st = state_mod.load(d)
    if st is None:
        raise UserError(f"nothing is up in {d}")
    return Deployment(st, engine_of(st), attached=False)


def down(name: str | None = None, *, state_dir: str | Path | None = None, grace_s: float = STOP_GRACE_S) -> DownReport:
    """Stop a launched topology: its supervisor first (nothing may restart behind down's back), then every
    process. Idempotent: nothing to stop is reported, not raised."""
    from pdctl.launch import engine_of, supervisor
    from pdctl.launch import run as run_mod
    from pdctl.launch import state as state_mod

    try:
        d = state_dir_of(name, state_dir)
    except UserError as e:
        return DownReport(name or "-", None, nothing=str(e))
    mode = supervisor.stop(d)
    with state_mod.locked(d):  # a supervisor started late waits, then finds no state and exits
        st = state_mod.load(d)  # again: the supervisor wrote it last, or a foreground up removed it
        if st is None:
            return DownReport(name or d.name, mode, nothing=None if mode == "foreground" else f"no state in {d}",
                              by_foreground_up=mode == "foreground")
        r = run_mod.down(st, engine_of(st), grace_s)
    return DownReport(st.plan.name, mode, r.stopped, r.killed, r.already_gone)


@contextlib.contextmanager
def _brought_up(p: Plan, t: Topology, timeout_s: float, progress: Callable[[str], None], label: str):
    """A plan with its reference, up in the foreground for one gate, always taken down (also on SIGINT/SIGTERM
    while the gate runs)."""
    from pdctl.launch import run as run_mod

    engine = _preflight(p, t)
    progress(label)
    with _interruptible():
        state = run_mod.up(p, engine, attached=True, timeout_s=timeout_s)
        try:
            yield Deployment(state, engine, attached=True)
        finally:
            run_mod.down(state, engine)


def _local_engine(t: Topology) -> None:
    if t.engine.kind != "local":
        raise UserError(f"this brings a topology up on this host with a reference beside it; for the "
                        f"{t.engine.kind} engine run `pdctl up -d` and then point the gate at the running system "
                        "(pdctl check --proxy URL --reference URL, pdctl eval --proxy URL)")


def _running_warning(d: Deployment | None, gate: str = "check") -> str:
    from pdctl.gates import gated as gated_mod

    if d is None:
        still = ("the proxy's fallback counter still fails the gate" if gate == "eval" else
                 "the transfer proof and the proxy's fallback counter still fail a request answered without its KV")
        return ("note: a running system's proxy.on_prefill_down and connector.kv_load_failure_policy are its own "
                f"(give --state-dir to have them checked); {still}")
    return gated_mod.running_warning(d.topology) or ""


def _check_url(flag: str, url: str | None) -> None:
    """A URL the user gave: http(s), a host, a numeric port if any; else an error naming the flag."""
    import urllib.parse

    if url is None:
        return
    try:
        u = urllib.parse.urlsplit(url)
        ok = u.scheme in ("http", "https") and bool(u.hostname)
        u.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        ok = False
    if not ok:
        raise UserError(f"{flag} {url}: expected an http URL, e.g. http://127.0.0.1:8000")


def _api_key(t: Topology | None) -> str | None:
    """The key pdctl sends to a topology's servers and proxy (auth.api_key_env), None without auth; a UserError
    naming the field and the variable when this environment lacks it."""
    try:
        return auth.api_key(t)
    except auth.MissingKey as e:
        raise UserError(str(e)) from None


def _served_model(url: str, api_key: str | None = None) -> str:
    from pdctl.launch import probe

    status, body = probe.http_get(url.rstrip("/") + "/v1/models", headers=auth.headers(api_key))
    try:
        return json.loads(body)["data"][0]["id"]
    except (ValueError, TypeError, KeyError, IndexError):
        raise UserError(f"{url}/v1/models answered {status}: cannot tell the served model (give the model "
                        "name)") from None
