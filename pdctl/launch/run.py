"""Running a plan: pre-flight, start everything at once, wait for readiness, supervise, tear down.

Rendering is the caller's: progress arrives through a callback, failures as LaunchFailed with the log tail.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdctl import auth, monitoring
from pdctl.launch import probe, supervisor
from pdctl.launch import state as state_mod
from pdctl.launch.backend import Backend, StopReport
from pdctl.launch.errors import LOG_TAIL_LINES, LaunchFailed, PreflightFailed  # noqa: F401 (re-exported)
from pdctl.launch.logs import tail
from pdctl.launch.state import LaunchState
from pdctl.plan import Plan, ProcessSpec, monitoring_dir
from pdctl.protocol import REFUSED_MARK, REJECT_HEADER, REMOTE_DECODE_PARAMS, ROUTE_HEADER, TRANSFER_FAILED_MARK
from pdctl.topology import DEFAULT_POOL, Loaded, is_local_path, resolve_path


@dataclass
class Progress:
    name: str
    phase: str  # starting | loading | ready | exited
    elapsed_s: float


def preflight(loaded: Loaded, plan: Plan, backend: Backend) -> list[str]:
    problems: list[str] = []
    existing = state_mod.load(Path(plan.state_dir))
    if existing and any(backend.liveness(existing, n).alive for n in existing.processes):
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
    return problems + backend.preflight(plan)


def _ready(spec: ProcessSpec, headers: dict[str, str]) -> tuple[bool, bool]:
    """(ready, something answers): /health is 200 and, for NIXL instances, the side channel accepts."""
    status, _ = probe.http_get(spec.readiness_url, timeout=1.0, headers=headers)
    side = spec.side_channel
    ok = status == 200 and (side is None or probe.port_open(*side))
    return ok, status != 0


def up(plan: Plan, backend: Backend, *, attached: bool, timeout_s: float,
       on_progress: Callable[[list[Progress]], None] = lambda _: None) -> LaunchState:
    """Start every process in parallel and wait until all are ready; on any failure stop them all and raise."""
    state = LaunchState(plan, backend=backend.name, detached=not attached)
    state_mod.clear_logs(Path(plan.state_dir))
    write_monitoring(plan)
    try:
        state.plan = plan = backend.launch(plan, state, attached=attached)
        state_mod.save(state)
        wait_ready(plan, backend, state, timeout_s, on_progress)
        warm_up(plan)
    except BaseException as e:
        if isinstance(e, LaunchFailed) and not e.log_tail:
            # The log lives on a cluster node: ask the backend for it.
            name = e.name
            e.log_tail = _safe(lambda: backend.log_tail(state, name, LOG_TAIL_LINES), [])
        backend.stop(state)
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


def wait_ready(plan: Plan, backend: Backend, state: LaunchState, timeout_s: float,
               on_progress: Callable[[list[Progress]], None]) -> None:
    t0 = time.monotonic()
    ready: dict[str, float] = {}
    answering: set[str] = set()
    key = auth.open_route_headers(plan.topology)
    while True:
        for spec in plan.processes:
            if spec.name in ready:
                continue
            live = backend.liveness(state, spec.name)
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


def pool_pairs(plan: Plan) -> list[tuple[str, str]]:
    """The (prefill pool, decode pool) pairs the proxy may route, from the plan's topology."""
    return [(p.name, d.name) for p, d in plan.topology.pairs()]


def warm_up(plan: Plan, attempts: int = 3, timeout_s: float = 120.0, *,
            sleep: Callable[[float], None] | None = None) -> None:
    """One P/D request per pool pair before `ready`: a pair the connector refuses fails here, at start, with its
    decode's log, instead of as an HTTP 500 on a user's first request. A NIXL handshake that timed out (vLLM
    waits 5 s for the prefill's side channel; the first request also compiles on a busy host) is tried again; a
    refusal is final. Through pdctl's proxy, pinned to each pair; vllm-router cannot pin a pair, so each pair
    gets one request in vLLM's P/D protocol straight to its first instances, then one goes through the router.
    `sleep` makes every pause (the readiness poll's, a retry's; time.sleep unless given): tests pass a fake one."""
    sleep = sleep or time.sleep
    proxy = next((p for p in plan.processes if p.role == "proxy"), None)
    if proxy is None or not plan.by_role("decode"):  # no P/D pair (goodput's aggregated baseline): nothing to prove
        return
    router = plan.topology.proxy.kind == "vllm-router"
    key = auth.headers(auth.api_key(plan.topology))
    # The proxy's routing must know every instance is up (its probe runs every 2 s): /ready probes them now.
    deadline = time.monotonic() + 60
    ready = proxy.http_url + ("/readiness" if router else "/ready")
    while probe.http_get(ready, timeout=5.0, headers=key)[0] != 200 and time.monotonic() < deadline:
        sleep(0.5)
    model = plan.topology.model.name
    blocks = [p.block_size for p in plan.processes if p.block_size]
    n = 2 * max(blocks, default=16) + 1  # crosses a block boundary on both sides
    pairs: list[tuple[str | None, str | None]] = list(pool_pairs(plan)) or [(None, None)]
    for k, (pool_p, pool_d) in enumerate(pairs + ([(None, None)] if router else [])):
        # Each pair its own prompt: a decode's prefix cache must not answer another pair's warm-up.
        body = {"model": model, "max_tokens": 2, "temperature": 0,
                "prompt": [5 + (i * (k + 1) + k) % 50 for i in range(n)]}
        decodes = [p for p in plan.processes if p.role == "decode" and pool_d in (None, p.pool)]
        rid = f"pdctl-warm-up-{pool_p}-{pool_d}"
        if router and pool_d is not None:
            prefill = next(p for p in plan.processes if p.role == "prefill" and p.pool == pool_p)
            decodes = decodes[:1]
            send = functools.partial(_direct_pd, prefill.http_url, decodes[0].http_url, body, key, timeout_s)
        else:
            headers = dict(key) if router else {REJECT_HEADER: "reject", **key}  # pdctl's proxy: P/D, or fail
            if pool_p is not None and not router:
                headers[ROUTE_HEADER] = f"{pool_p}/{pool_d}"
            send = functools.partial(_post, proxy.http_url, body, headers, timeout_s)
        label = f" (pool pair {pool_p} -> {pool_d})" if pool_p is not None and len(pool_pairs(plan)) > 1 else ""
        _warm_one(send, rid, decodes, label, attempts, sleep)


def _warm_one(send, rid: str, decodes: list[ProcessSpec], label: str, attempts: int,
              sleep: Callable[[float], None]) -> None:
    decode = decodes[0]
    for attempt in range(1, attempts + 1):
        offsets = {d.log_path: _size(d.log_path) for d in decodes}
        try:
            send(f"{rid}-{attempt}")
            # An answer is not proof: under kv_load_failure_policy: recompute a decode that refused the pair,
            # or whose read failed, computes the prompt itself and answers 200. Its log says which.
            refused, failed = _transfer_trouble(offsets)
            if refused or (failed and attempt == attempts):
                raise LaunchFailed(decode.name, f"warm-up P/D request failed{label}: {refused or failed}",
                                   decode.log_path)
            if failed:
                sleep(2)
                continue
            return
        except (urllib.error.URLError, OSError) as e:
            # A decode's first read from a prefill bound to the same CPU core stalls until that prefill steps
            # again (12-120 s; validate warns of the layout): worth another try, like a handshake that timed out.
            stalled = isinstance(e, TimeoutError) or isinstance(getattr(e, "reason", None), TimeoutError)
            if attempt < attempts and (stalled or _handshake_timed_out(decode.log_path)):
                sleep(2)
                continue
            detail = e.read().decode(errors="replace")[:500] if isinstance(e, urllib.error.HTTPError) else str(e)
            cause = _connector_error(decode.log_path)
            raise LaunchFailed(decode.name, f"warm-up P/D request failed{label}: {cause or detail}",
                               decode.log_path) from None


def _post(url: str, body: dict, headers: dict[str, str], timeout_s: float, rid: str) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **headers, "X-Request-Id": rid})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def _direct_pd(prefill_url: str, decode_url: str, body: dict, key: dict[str, str], timeout_s: float, rid: str
               ) -> dict:
    """vLLM's P/D protocol by hand (what a proxy does): the prefill computes the prompt and holds its KV, the
    decode reads it with the prefill's kv_transfer_params."""
    pre = _post(prefill_url, {**body, "max_tokens": 1, "stream": False,
                              "kv_transfer_params": dict(REMOTE_DECODE_PARAMS)}, key, timeout_s, rid)
    params = pre.get("kv_transfer_params")
    if not params:
        raise OSError(f"the prefill {prefill_url} answered without kv_transfer_params (is its connector NIXL?)")
    return _post(decode_url, {**body, "kv_transfer_params": params}, key, timeout_s, rid)


def _size(path: str) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def _transfer_trouble(offsets: dict[str, int]) -> tuple[str | None, str | None]:
    """(pdctl's refusal of the pair, a failed NIXL transfer) written to the decodes' logs since the offsets."""
    refused = failed = None
    for path, start in offsets.items():
        try:
            with open(path, errors="replace") as f:
                f.seek(start)
                new = f.read()
        except OSError:
            continue
        for line in new.splitlines():
            if REFUSED_MARK in line and refused is None:
                refused = line[line.index(REFUSED_MARK):]
            elif TRANSFER_FAILED_MARK in line and failed is None:
                failed = line[line.index(TRANSFER_FAILED_MARK):][:300]
    return refused, failed


def _handshake_timed_out(log_path: str) -> bool:
    """The decode's NIXL handshake got no answer in time (zmq's EAGAIN), and nothing refused the pair."""
    lines = tail(log_path, 400)
    return any("zmq.error.Again" in ln for ln in lines) and not any(REFUSED_MARK in ln
                                                                    for ln in lines)


def _connector_error(log_path: str) -> str | None:
    """The connector's own one-line reason from a server log (pdctl's refusal, NIXL's failure, vLLM's assertion);
    the connector's info lines also say "pdctl connector: ", so only error lines count."""
    found = None
    for line in tail(log_path, 400):
        for marker in (REFUSED_MARK, f"{TRANSFER_FAILED_MARK}: ", "AssertionError: ",
                       "RuntimeError: "):
            if marker in line:
                found = line[line.index(marker):].removeprefix("RuntimeError: ")
                break
    return found


def down(state: LaunchState, backend: Backend, grace_s: float = 15.0) -> StopReport:
    report = backend.stop(state, grace_s)
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


def status(state: LaunchState, backend: Backend) -> list[InstanceStatus]:
    out = []
    key = auth.open_route_headers(state.plan.topology)
    for spec in state.plan.processes:
        rec = state.processes.get(spec.name)
        running = backend.liveness(state, spec.name).alive
        healthy = running and probe.healthy(spec.readiness_url, timeout=1.0, headers=key)
        # vLLM's series, from the servers (the proxy and Prometheus have none of them).
        server = spec.role in ("prefill", "decode", "reference", "baseline")
        m = probe.metrics(spec.http_url, timeout=1.0, headers=key) if healthy and server else None
        out.append(InstanceStatus(
            spec.name, spec.role, spec.index, rec.pid if rec else None, spec.ports["http"],
            spec.ports.get("side_channel"), spec.block_size, spec.tp, running, healthy,
            time.time() - rec.started_at if rec and running else None, rec.where if rec else "-", spec.host,
            (m or {}).get("vllm:num_requests_running"), (m or {}).get("vllm:num_requests_waiting"),
            (m or {}).get("vllm:kv_cache_usage_perc"), spec.pool, rec.restarts if rec else 0,
            rec.phase if rec else "-", rec.last_exit if rec else None, rec.last_error if rec else None,
        ))
    return out
