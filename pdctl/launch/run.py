"""Running a plan: pre-flight, start everything at once, wait for readiness, supervise, tear down.

Rendering is the caller's: progress arrives through a callback, failures as LaunchFailed with the log tail.
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdctl import auth, monitoring
from pdctl.launch import probe, supervisor
from pdctl.launch import state as state_mod
from pdctl.launch.engine import Engine, StopReport
from pdctl.launch.errors import LOG_TAIL_LINES, LaunchFailed, PreflightFailed  # noqa: F401 (re-exported)
from pdctl.launch.state import LaunchState
from pdctl.launch.waits import STOP_GRACE_S
from pdctl.launch.warmup import warm_up
from pdctl.plan import Plan, ProcessSpec, monitoring_dir
from pdctl.protocol import (
    FINGERPRINT_MISMATCHES,
    READS_PEER_GONE,
    READS_REFUSED_LEASE,
    READS_TIMED_OUT,
    RECOMPUTED,
    VllmMetric,
)
from pdctl.topology import DEFAULT_POOL, Loaded, is_local_path, resolve_path


@dataclass
class Progress:
    name: str
    phase: str  # starting | loading | ready | exited
    elapsed_s: float


def preflight(loaded: Loaded, plan: Plan, engine: Engine) -> list[str]:
    problems: list[str] = []
    existing = state_mod.load(Path(plan.state_dir))
    if existing and any(engine.liveness(existing, n).alive for n in existing.processes):
        return [f"'{plan.name}' is already up (state {plan.state_dir}); `pdctl down {plan.name}` first"]
    sup = supervisor.alive(Path(plan.state_dir))
    if sup:  # it would restart its instances into the new launch's ports and overwrite its state
        return [f"'{plan.name}' still has a {sup['mode']} supervisor (pid {sup['pid']}, state {plan.state_dir}); "
                f"`pdctl down {plan.name}` first"]
    t = loaded.topology
    problems += auth.problems(plan.processes)  # a missing key refuses here, before anything starts
    for role in ("prefill", "decode"):
        for g in t.pools(role):
            raw = t.model_path(g)
            where = role if g.name == DEFAULT_POOL else f"{role} pool {g.name}"
            msg = (f"{where}: model path {resolve_path(raw, loaded.base_dir)} does not exist "
                   f"(for the tiny demo model: pdctl model tiny {raw})")
            if is_local_path(raw) and not resolve_path(raw, loaded.base_dir).is_dir() and msg not in problems:
                problems.append(msg)
    for module in ("vllm", "nixl"):
        if importlib.util.find_spec(module) is None:
            problems.append(f"Python package '{module}' is not importable; install pdctl[cpu] or pdctl[cuda]")
    for spec in plan.by_role("monitor"):
        if shutil.which(spec.argv[0]) is None:
            problems.append(f"monitoring: '{spec.argv[0]}' is not on PATH; install the Debian package prometheus "
                            "(bash scripts/install_tools.sh, or apt-get install --no-install-recommends prometheus)")
    if t.proxy.kind == "vllm-router" and importlib.util.find_spec("vllm_router") is None:
        problems.append("proxy.kind: vllm-router: Python package 'vllm_router' is not importable; install "
                        "pdctl[router] (pip install vllm-router)")
    return problems + engine.preflight(plan)


def _ready(spec: ProcessSpec, headers: dict[str, str]) -> tuple[bool, bool]:
    """(ready, something answers): /health is 200 and, for NIXL instances, the side channel accepts."""
    status, _ = probe.http_get(spec.readiness_url, timeout=1.0, headers=headers)
    side = spec.side_channel
    ok = status == 200 and (side is None or probe.port_open(*side))
    return ok, status != 0


def up(plan: Plan, engine: Engine, *, attached: bool, timeout_s: float,
       on_progress: Callable[[list[Progress]], None] = lambda _: None) -> LaunchState:
    """Start every process in parallel and wait until all are ready; on any failure stop them all and raise."""
    state = LaunchState(plan, engine_kind=engine.name, detached=not attached)
    state_mod.clear_logs(Path(plan.state_dir))
    write_monitoring(plan)
    try:
        state.plan = plan = engine.launch(plan, state, attached=attached)
        state_mod.save(state)
        wait_ready(plan, engine, state, timeout_s, on_progress)
        state.probes = {p.label: p.seconds for p in warm_up(plan)}
        state_mod.save(state)
    except BaseException as e:
        if isinstance(e, LaunchFailed) and not e.log_tail:
            # The log lives on a cluster node: ask the engine for it.
            name = e.name
            e.log_tail = _safe(lambda: engine.log_tail(state, name, LOG_TAIL_LINES), [])
        engine.stop(state)
        state_mod.remove(Path(plan.state_dir))
        raise
    return state


def write_monitoring(plan: Plan) -> None:
    """Prometheus' config and pdctl's rules into the state dir, before Prometheus starts (a plan with monitoring
    on). Its samples (monitoring/data) are kept from one `up` to the next, like any Prometheus' across restarts."""
    if not plan.by_role("monitor"):
        return
    d = monitoring_dir(plan.state_dir)
    for rel, text in monitoring.files(plan).items():
        path = d / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # a Prometheus reloading its config never reads half a file


def _safe(fn, default):
    try:
        return fn()
    except Exception:
        return default


def wait_ready(plan: Plan, engine: Engine, state: LaunchState, timeout_s: float,
               on_progress: Callable[[list[Progress]], None]) -> None:
    t0 = time.monotonic()
    ready: dict[str, float] = {}
    answering: set[str] = set()
    key = auth.open_route_headers(plan.topology)
    while True:
        for spec in plan.processes:
            if spec.name in ready:
                continue
            live = engine.liveness(state, spec.name)
            if not live.alive:
                code = f" with code {live.exit_code}" if live.exit_code is not None else ""
                raise LaunchFailed(spec.name, f"exited{code} before it was ready", spec.log_path)
            ok, answers = _ready(spec, key)
            if ok:
                ready[spec.name] = time.monotonic() - t0
            elif answers:
                answering.add(spec.name)
        now = time.monotonic() - t0
        on_progress([Progress(s.name, "ready" if s.name in ready else "loading" if s.name in answering
                              else "starting", ready.get(s.name, now)) for s in plan.processes])
        if len(ready) == len(plan.processes):
            return
        if now > timeout_s:
            late = next(s for s in plan.processes if s.name not in ready)
            raise LaunchFailed(late.name, f"not ready after {timeout_s:.0f} s", late.log_path)
        time.sleep(0.25)


def down(state: LaunchState, engine: Engine, grace_s: float = STOP_GRACE_S) -> StopReport:
    report = engine.stop(state, grace_s)
    state_mod.remove(Path(state.plan.state_dir))
    return report


def stop_supervisor(state_dir: Path) -> str | None:
    """Stop the topology's supervisor first, so nothing is restarted while it is taken down."""
    return supervisor.stop(state_dir)


@dataclass
class InstanceStatus:
    name: str
    role: str
    index: int
    pid: int | None
    http_port: int
    side_channel_port: int | None
    block_size: int | None
    tp: int | None
    running: bool
    healthy: bool
    uptime_s: float | None
    where: str = "local"
    host: str = "127.0.0.1"
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_usage: float | None = None
    pool: str | None = None
    restarts: int = 0
    phase: str = "running"
    last_exit: str | None = None
    last_error: str | None = None
    # a decode's KV reads given up (connector.kv_read_timeout_s), refused (lease not known alive), and requests it
    # computed itself after a failed KV load (policy recompute): pdctl's connector's counters in vLLM's /metrics
    kv_reads_timed_out: float | None = None
    kv_reads_refused: float | None = None
    kv_recomputed: float | None = None
    kv_reads_peer_gone: float | None = None  # given up because their prefill was gone
    kv_fingerprint_mismatches: float | None = None  # received KV that was not the prefill's (connector.kv_fingerprint)


def status(state: LaunchState, engine: Engine) -> list[InstanceStatus]:
    out = []
    key = auth.open_route_headers(state.plan.topology)
    for spec in state.plan.processes:
        rec = state.processes.get(spec.name)
        running = engine.liveness(state, spec.name).alive
        healthy = running and probe.healthy(spec.readiness_url, timeout=1.0, headers=key)
        # vLLM's series, from the servers (the proxy and Prometheus have none of them).
        server = spec.role in ("prefill", "decode", "reference", "baseline")
        m = probe.metrics(spec.http_url, timeout=1.0, headers=key) if healthy and server else None
        out.append(InstanceStatus(
            spec.name, spec.role, spec.index, rec.pid if rec else None, spec.ports["http"],
            spec.ports.get("side_channel"), spec.block_size, spec.tp, running, healthy,
            time.time() - rec.started_at if rec and running else None, rec.where if rec else "-", spec.host,
            (m or {}).get(VllmMetric.RUNNING), (m or {}).get(VllmMetric.WAITING), (m or {}).get(VllmMetric.KV_USAGE),
            spec.pool, rec.restarts if rec else 0,
            rec.phase if rec else "-", rec.last_exit if rec else None, rec.last_error if rec else None,
            *((m or {}).get(f"{c}_total") for c in (READS_TIMED_OUT, READS_REFUSED_LEASE, RECOMPUTED,
                                                    READS_PEER_GONE, FINGERPRINT_MISMATCHES)),
        ))
    return out
