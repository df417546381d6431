"""pdctl's Python API: everything the command line does, callable from a CI job or a notebook.

    import pdctl

    t = pdctl.load("configs/cpu-demo.yaml", {"decode.block_size": 128})
    with pdctl.up(t) as d:                      # in-process: everything stops when the block ends
        print(d.proxy_url, [i.name for i in d.instances])
    report = pdctl.check(t)                     # brings P/D up beside an aggregated reference, then down
    assert report.passed, report.to_dict()

Functions return typed results (`Plan`, `Deployment`, `ParityReport`/`FleetReport`, `EvalResult`, `BenchResult`,
`SweepResult`); bad input raises `UserError` or `TopologyError` (both carry a message for a person, never a
traceback's worth). Long waits report through two optional callbacks: `say(line)` for lines worth keeping
(what a gate runs with, warnings) and `progress(text)` for a status that replaces the last one.

Imports here are light (pydantic, yaml): what needs vLLM, lm-eval or the launch machinery is imported where used.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pdctl import auth
from pdctl.bench.options import BenchOptions
from pdctl.launch.errors import LaunchFailed
from pdctl.plan import Plan, ProcessSpec, build_plan, reference_spec
from pdctl.topology import Loaded, Override, Topology, TopologyError, load_topology

Say = Callable[[str], None]
DASHBOARD = "configs/grafana/pdctl-fleet.json"  # over its Prometheus (docs/operations.md: Monitoring)


def _quiet(_: str) -> None:
    pass


class UserError(Exception):
    """Bad input from the user: one message, never a traceback."""


# ----------------------------------------------------------------------------------------------------------------
# Topology and plan


def as_overrides(overrides: Iterable[Override | str] | Mapping[str, Any] | None) -> list[Override]:
    """Overrides as the API takes them: Override objects, "dotted.path=value" strings (as --set) or a mapping
    {"decode.block_size": 128} (values as Python objects)."""
    if not overrides:
        return []
    if isinstance(overrides, Mapping):
        out = []
        for key, value in overrides.items():
            probe = Override.parse_set(f"{key}=0")  # the path as --set reads it (pool names, list indices)
            out.append(Override(probe.path, value, f"{key}={value!r}"))
        return out
    return [o if isinstance(o, Override) else Override.parse_set(str(o)) for o in overrides]


def load(path: str | Path, overrides: Iterable[Override | str] | Mapping[str, Any] | None = None, *,
         gated: bool = False) -> Topology:
    """A topology file, validated against every rule (TopologyError with file:line otherwise).

    `gated=True` loads it as a gate runs it: proxy.on_prefill_down=reject and connector.kv_load_failure_policy=
    fail unless the overrides set them (a fallback must never count as P/D). `topology.origin` keeps where it was
    loaded from; `warnings(topology)` and `gate_notes(topology)` say what to tell the user."""
    from pdctl.gates import gated as gated_mod

    ovr = as_overrides(overrides)
    applied: list[str] = []
    kept: list[str] = []
    if gated:
        ovr, applied, kept = gated_mod.gated(ovr)
    loaded = load_topology(path, ovr)
    if gated:
        loaded.gate = (applied, kept)
    return loaded.topology


def origin(t: Topology) -> Loaded:
    if t.origin is None:
        raise UserError(f"topology '{t.name}' was not loaded from a file (use pdctl.load)")
    return t.origin


def warnings(t: Topology) -> list[str]:
    """The loader's warnings, each with its file:line."""
    o = t.origin
    return [o.source.describe(w) for w in o.warnings] if o else []


def gate_notes(t: Topology) -> list[str]:
    """What a gated load runs with, and a warning for a setting the user kept that lets a fallback pass."""
    from pdctl.gates import gated as gated_mod

    g = getattr(t.origin, "gate", None)
    return [line for line in gated_mod.gated_lines(*g) if line] if g else []


def _gated(t: Topology, say: Say) -> Topology:
    """A topology as a gate must run it. Loaded with gated=True: as is (the user's explicit choice kept, with its
    warning); else the gate's settings replace the topology's own."""
    from pdctl.gates import gated as gated_mod

    if getattr(t.origin, "gate", None) is not None:
        for line in gate_notes(t):
            say(line)
        return t
    updates: dict[str, dict] = {}
    for (section, name), value in gated_mod.GATE_SETTINGS:
        updates.setdefault(section, {})[name] = value
    gt = t.model_copy(update={s: getattr(t, s).model_copy(update=u) for s, u in updates.items()})
    gt._origin = replace(t.origin, topology=gt) if t.origin else None
    say(_gate_note())
    return gt


def _gate_note() -> str:
    """What every gated run is brought up with."""
    from pdctl.gates import gated as gated_mod

    return gated_mod.gated_lines([f"{'.'.join(path)}={v}" for path, v in gated_mod.GATE_SETTINGS], [])[0]


def default_state_dir(t: Topology) -> Path:
    return (Path(".pdctl") / t.name).absolute()


def plan(t: Topology, *, state_dir: str | Path | None = None, reference_port: int | None = None,
         python: str | None = None, baseline: bool = False) -> Plan:
    """The exact processes `up` starts (pure: same topology, same plan); with `reference_port`, plus an
    aggregated reference server (the first decode pool's settings, no connector) for the gates. `baseline`:
    instead, the aggregated deployment `bench --goodput` compares the topology with (plan.baseline_plan)."""
    o = origin(t)
    sd = Path(state_dir).absolute() if state_dir else default_state_dir(t)
    if baseline:
        from pdctl.plan import baseline_plan

        return baseline_plan(t, base_dir=o.base_dir, state_dir=sd / "baseline", python=python or sys.executable)
    p = build_plan(t, base_dir=o.base_dir, state_dir=sd, python=python or sys.executable)
    if reference_port:
        ref = reference_spec(t, base_dir=o.base_dir, state_dir=sd, port=reference_port, python=python or sys.executable)
        p = p.with_processes([*p.processes, ref])
    return p


def slurm_batch(p: Plan) -> str | None:
    """The batch script `up` submits for the Slurm engine (None for the others)."""
    if p.topology.engine.kind != "slurm":
        return None
    from pdctl.launch.slurm_engine import render_batch

    return render_batch(p, p.topology.engine)


def render_k8s(t: Topology, out_dir: str | Path, *, image: str | None = None, namespace: str = "default",
               validate: bool = True) -> list[Path]:
    """Kubernetes manifests for the topology, written to out_dir (checked offline with kubernetes-validate
    --strict unless validate=False); the paths written."""
    import yaml

    from pdctl.launch import k8s

    if t.proxy.early_decode:
        raise UserError("proxy.early_decode: its hand-over is a host-local socket, and Kubernetes puts the proxy "
                        "and each decode in pods of their own; remove it to render for Kubernetes")
    from pdctl.topology import ROLES, pool_field

    niced = [pool_field(t, r, g, "nice") for r in ROLES for g in t.pools(r) if g.nice]
    if niced:
        raise UserError(f"{niced[0]}: Kubernetes runs each instance in a pod of its own, whose processes a niceness "
                        "does not rank against other pods' (each pod's CPU share comes from its cgroup); remove it "
                        "(and give the pods CPU requests instead) to render for Kubernetes")
    o = origin(t)
    p = build_plan(t, base_dir=o.base_dir, state_dir=Path("/var/lib/pdctl") / t.name, python="python3")
    manifests = k8s.render(t, p, image=image or k8s.DEFAULT_IMAGE, namespace=namespace)
    if validate:
        import kubernetes_validate

        problems = []
        for fname, m in manifests.items():
            try:
                kubernetes_validate.validate(m, kubernetes_validate.latest_version(), strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{fname}: {e.message}")
        if problems:
            raise UserError("rendered manifests failed validation (a pdctl bug):\n  " + "\n  ".join(problems))

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data):  # shared label dicts would become &id001 anchors: legal, hard to read
            return True

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, m in manifests.items():
        (out / fname).write_text(yaml.dump(m, Dumper=_NoAliases, sort_keys=False))
        written.append(out / fname)
    return written


def tiny_model(out_dir: str | Path, *, seed: int = 0, force: bool = False, say: Say = _quiet,
               window: int | None = None) -> str | None:
    """Build the tiny random-weight Llama for tests and demos (`window`: the hybrid one, sliding-window and full
    attention layers in turn); its fingerprint, or None when out_dir holds this model already (kept unless
    force)."""
    from pdctl import tinymodel

    out = Path(out_dir)
    marker = out / "pdctl-tiny.json"
    try:
        made = json.loads(marker.read_text()) if marker.is_file() else {}
        kept = not force and made.get("seed") == seed and made.get("sliding_window") == window
    except (ValueError, OSError, AttributeError):
        kept = False  # a marker that is not ours: rebuild
    if kept:
        return None
    say(f"building tiny model in {out} ...")
    tinymodel.build_tiny_model(out, seed=seed, window=window)
    return tinymodel.fingerprint(out)


# ----------------------------------------------------------------------------------------------------------------
# Deployments


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

    def __init__(self, state, backend, *, attached: bool, notes: list[str] | None = None):
        self.state, self.backend, self.attached = state, backend, attached
        self.notes = notes or []  # what `up` has to say (supervisor pid, engine caveats)

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

        return StatusReport(self.name, str(self.state_dir), self.state.backend, supervisor.alive(self.state_dir),
                            run_mod.status(self.state, self.backend), self.prometheus_url, dict(self.state.probes))

    def select(self, which: str | None = None) -> list[ProcessSpec]:
        """Processes named by instance, ROLE, ROLE/POOL, ROLE/INDEX or ROLE/POOL/INDEX (all without `which`)."""
        from pdctl.plan import select

        specs = select(self.plan, which)
        if not specs:
            raise UserError(f"no instance matches '{which}'; have {', '.join(s.name for s in self.plan.processes)}")
        return specs

    def logs(self, which: str | None = None, lines: int = 40) -> dict[str, list[str]]:
        """The last `lines` lines of each selected process's log."""
        return {s.name: self.backend.log_tail(self.state, s.name, lines) for s in self.select(which)}

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
            settled = supervisor.supervise_attached(self.state, self.backend, stop, say=say)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        return "settled" if settled else ("interrupted" if signal.SIGINT in got else "stopped")

    def down(self, grace_s: float = 15.0) -> DownReport:
        return down(state_dir=self.state_dir, grace_s=grace_s)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc) -> None:
        if self.attached:
            from pdctl.launch import run as run_mod

            run_mod.down(self.state, self.backend)


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
    """The plan's backend, once everything that can be known before launch was checked."""
    from pdctl.launch import run as run_mod
    from pdctl.launch.backends import backend_for

    backend = backend_for(p.topology.engine)
    problems = run_mod.preflight(origin(t), p, backend)
    if problems:
        raise UserError("pre-flight failed, nothing was started:\n  " + "\n  ".join(problems))
    return backend


def up(target: Topology | Plan, *, detach: bool = False, timeout_s: float = 300.0,
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

    backend = _preflight(p, t)
    notes: list[str] = []
    state = None
    try:
        with _interruptible():
            # Interrupted while starting, run.up stops what it started; once it returned, the except below does.
            state = run_mod.up(p, backend, attached=not detach, timeout_s=timeout_s, on_progress=on_progress)
            if detach and backend.restartable:
                try:
                    pid = supervisor.start_detached(state)
                except RuntimeError as e:
                    notes.append(f"warning: {e}; instances will not be restarted")
                else:
                    notes.append(f"supervisor pid {pid} (log {Path(p.state_dir) / 'logs' / 'supervisor.log'})")
            elif detach:
                notes.append(f"note: the {backend.name} engine starts a plan as a whole; pdctl does not restart "
                             "its single instances (status shows them down; pdctl down && pdctl up)")
            d = Deployment(state, backend, attached=not detach, notes=notes)
            if d.prometheus_url:
                notes.append(f"monitoring: Prometheus {d.prometheus_url} (Grafana dashboard: {DASHBOARD})")
    except BaseException:
        if state is not None:  # up, then stopped before the caller got its handle: nothing is left behind
            supervisor.stop(Path(p.state_dir))
            run_mod.down(state, backend)
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
    from pdctl.launch import state as state_mod
    from pdctl.launch.backends import backend_of

    d = state_dir_of(name, state_dir)
    st = state_mod.load(d)
    if st is None:
        raise UserError(f"nothing is up in {d}")
    return Deployment(st, backend_of(st), attached=False)


def down(name: str | None = None, *, state_dir: str | Path | None = None, grace_s: float = 15.0) -> DownReport:
    """Stop a launched topology: its supervisor first (nothing may restart behind down's back), then every
    process. Idempotent: nothing to stop is reported, not raised."""
    from pdctl.launch import run as run_mod
    from pdctl.launch import state as state_mod
    from pdctl.launch import supervisor
    from pdctl.launch.backends import backend_of

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
        r = run_mod.down(st, backend_of(st), grace_s)
    return DownReport(st.plan.name, mode, r.stopped, r.killed, r.already_gone)


@contextlib.contextmanager
def _brought_up(p: Plan, t: Topology, timeout_s: float, progress: Callable[[str], None], label: str):
    """A plan with its reference, up in the foreground for one gate, always taken down (also on SIGINT/SIGTERM
    while the gate runs)."""
    from pdctl.launch import run as run_mod

    backend = _preflight(p, t)
    progress(label)
    with _interruptible():
        state = run_mod.up(p, backend, attached=True, timeout_s=timeout_s)
        try:
            yield Deployment(state, backend, attached=True)
        finally:
            run_mod.down(state, backend)


def _local_engine(t: Topology) -> None:
    if t.engine.kind != "local":
        raise UserError(f"this brings a topology up on this host with a reference beside it; for the "
                        f"{t.engine.kind} engine run `pdctl up -d` and then point the gate at the running system "
                        "(pdctl check --proxy URL --reference URL, pdctl eval --url URL)")


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


# ----------------------------------------------------------------------------------------------------------------
# Parity gate


@dataclass
class CheckOptions:
    max_tokens: int = 16
    concurrency: int = 1
    vocab: int = 1000  # random prompt ids are drawn below this (a loaded model's own vocabulary wins)
    gsm8k_dir: Path | None = None  # adds 5-shot GSM8K prompts
    seed: int | None = None  # fresh prompts every run by default
    lengths: list[int] | None = None  # only random prompts of these token lengths
    mixed_prompts: int = 16  # fleets: prompts pinned over every pair at once after the per-pair phases
    mixed_concurrency: int = 12
    reference_first: bool = False  # the reference alone first, its answers recorded, then P/D
    reference_port: int = 8300
    timeout_s: float = 300.0
    junit: Path | None = None  # write a JUnit XML report here
    state_dir: Path | None = None  # where the brought-up topology keeps its state (default .pdctl/<name>)
    stream: bool = False  # streamed requests, compared as the text a client reads (proxy.first_token's path)


def check(target: Topology | Deployment | str | Path | None = None, *, proxy: str | None = None,
          reference: str | None = None, decodes: list[str] | None = None, model: str | None = None,
          options: CheckOptions | None = None, say: Say = _quiet, progress: Say = _quiet):
    """Parity gate: P/D output equals an aggregated reference token for token, and the KV travelled.

    target: a Topology (or its file; brought up beside an aggregated reference, checked, taken down); a running
    Deployment (with `reference` URL, or its own reference); or None with `proxy` and `reference` URLs. A fleet is
    checked per pool pair. Returns a ParityReport or FleetReport (`.passed`, `.to_dict()`)."""
    from pdctl.gates import check as check_mod
    from pdctl.gates import fleet, gsm8k, parity

    o = options or CheckOptions()
    if o.gsm8k_dir is not None:
        try:
            gsm8k.check_dir(Path(o.gsm8k_dir), "--gsm8k-dir ")
        except gsm8k.DataError as e:
            raise UserError(str(e)) from None

    window: list[int | None] = [None]  # a hybrid model's sliding window, once the topology is known

    def prompts(blocks: list[int], vocab: int, max_prompt: int, seed: int | None) -> list:
        return check_mod.prompts_for(blocks, vocab, max_prompt, o.gsm8k_dir, seed, o.lengths, window[0])

    def pair_prompts(vocab: int, max_prompt: int):  # a fleet's: pair k draws from its own seed (fleet.pair_seed)
        return lambda pb, db, k: prompts([pb, db], vocab, max_prompt, fleet.pair_seed(o.seed, k))

    for flag, url in (("--proxy", proxy), ("--reference", reference), *(("--decode", u) for u in decodes or ())):
        _check_url(flag, url)
    if isinstance(target, (str, Path)):
        target = load(target, gated=True)
    if isinstance(target, Deployment) and (o.reference_first or o.state_dir):
        raise UserError("--reference-first and --state-dir are for a topology pdctl brings up, not a running one")
    if isinstance(target, Deployment) and proxy is None:
        d = target
        ref = reference or d.reference_url
        if not ref:
            raise UserError("a running topology is checked against a running reference: give --reference URL of an "
                            "aggregated server")
        say(_running_warning(d))
        t = d.topology
        window[0] = _sliding_window(d)
        key = _api_key(t)
        vocab = (t.origin.model_info.vocab_size if t.origin else None) or o.vocab
        max_prompt = (t.model.max_model_len or 2048) - o.max_tokens - 1
        report = _check_fleet(d.plan, d.proxy_url, ref, model or t.model.name,
                              pair_prompts(vocab, max_prompt), replace(o, vocab=vocab), progress,
                              key)
        return _reported(report, o)
    if not isinstance(target, Topology):
        if target is not None and not isinstance(target, Deployment):
            raise UserError(f"check: cannot check a {type(target).__name__}; give a Topology, a Deployment or URLs")
        if not (proxy and reference):
            raise UserError("give a TOPOLOGY, --state-dir of a running one with --reference, or both --proxy and "
                            "--reference for running systems")
        say(_running_warning(target))
        urls = decodes or [i["url"] for i in _ready_instances(proxy) if i.get("role") == "decode"]
        if not urls:
            raise UserError("no decode URL to prove the transfer with: pass --decode URL")
        name = model or _served_model(reference)
        progress(f"sending prompts through P/D {proxy} and the reference {reference}")
        report = parity.run_parity(proxy, reference, urls, name, prompts([], o.vocab, 1024, o.seed), o.max_tokens,
                                   o.concurrency, stream=o.stream)
        return _reported(report, o)

    t = _gated(target, say)
    _local_engine(t)
    key = _api_key(t)  # before anything starts
    vocab = origin(t).model_info.vocab_size or o.vocab
    window[0] = origin(t).model_info.sliding_window
    max_prompt = (t.model.max_model_len or 2048) - o.max_tokens - 1
    p = plan(t, state_dir=o.state_dir, reference_port=o.reference_port)
    ref = p.get("reference")
    if len(t.prefill) > 1 or len(t.decode) > 1 or t.proxy.kind == "vllm-router":
        if o.reference_first:
            raise UserError("--reference-first is for one prefill and one decode pool behind pdctl's proxy; a "
                            "fleet's check pins fresh prompts to every pair while it runs (vllm-router's check "
                            "sends every pair's prompts at once)")
        with _brought_up(p, t, o.timeout_s, progress, f"bringing up {p.name} and an aggregated reference") as d:
            report = _check_fleet(d.plan, d.proxy_url, ref.http_url, t.model.name,
                                  pair_prompts(vocab, max_prompt), replace(o, vocab=vocab),
                                  progress, key)
        return _reported(report, o)
    ps = prompts([t.prefill[0].block_size, t.decode[0].block_size], vocab, max_prompt, o.seed)
    answers: str | list = ref.http_url
    if o.reference_first:
        _preflight(p, t)  # the whole plan, before the reference alone starts
        alone, p = p.with_processes([ref]), p.with_processes([s for s in p.processes if s is not ref])
        with _brought_up(alone, t, o.timeout_s, progress, "bringing up the aggregated reference alone"):
            progress(f"recording the reference's answers to {len(ps)} prompts")
            answers = parity.reference_answers(ref.http_url, t.model.name, ps, o.max_tokens, o.concurrency, key,
                                               o.stream)
    beside = "" if o.reference_first else " and an aggregated reference"
    with _brought_up(p, t, o.timeout_s, progress, f"bringing up {p.name}{beside}") as d:
        progress(f"sending {len(ps)} prompts through P/D{'' if o.reference_first else ' and the reference'}")
        report = parity.run_parity(d.proxy_url, answers, [s.http_url for s in d.plan.by_role("decode")],
                                   t.model.name, ps, o.max_tokens, o.concurrency, api_key=key, stream=o.stream)
    return _reported(report, o)


def _sliding_window(d: Deployment) -> int | None:
    """A running topology's model window (a hybrid model's), from the config.json its servers were given."""
    from pdctl.topology import ModelSpec, read_model_info

    if d.topology.origin is not None:
        return d.topology.origin.model_info.sliding_window
    for spec in d.plan.processes:
        if "--model" in spec.argv[:-1]:
            model = spec.argv[spec.argv.index("--model") + 1]
            return read_model_info(ModelSpec(path=model), Path("/")).sliding_window
    return None


def _ready_instances(proxy_url: str) -> list[dict]:
    from pdctl.launch import probe

    try:
        body = json.loads(probe.http_get(proxy_url.rstrip("/") + "/ready")[1] or "{}")
    except ValueError:
        return []
    got = body.get("instances") if isinstance(body, dict) else None
    if isinstance(got, dict):  # a proxy before pdctl 16: {"ROLE URL": healthy}
        return [{"role": k.split(" ", 1)[0], "url": k.split(" ", 1)[1], "healthy": v}
                for k, v in got.items() if " " in k]
    return [i for i in got if isinstance(i, dict) and "url" in i] if isinstance(got, list) else []


def _check_fleet(p: Plan, proxy_url: str, reference: str, model: str, prompts_for, o: CheckOptions, progress: Say,
                 api_key: str | None = None):
    from pdctl.gates import fleet

    if p.topology.proxy.kind == "vllm-router":
        progress("checking every pool pair's prompts through vllm-router (it cannot pin a pair: the transfer is "
                 "proven per decode instance)")
        return fleet.check_unpinned(p, proxy_url, reference, model, prompts_for, o.max_tokens, o.concurrency,
                                    progress=lambda text: progress(f"checking {text}"), stream=o.stream)
    progress("checking every pool pair")
    return fleet.check_fleet(p, proxy_url, reference, model, prompts_for, o.max_tokens, o.concurrency,
                             o.mixed_prompts, o.mixed_concurrency, o.vocab, o.seed,
                             progress=lambda text: progress(f"checking {text}"), api_key=api_key, stream=o.stream)


def _reported(report, o: CheckOptions):
    if o.junit:
        from pdctl.gates.check import junit_xml

        junit = Path(o.junit)
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.write_text(junit_xml(report))
    return report


# ----------------------------------------------------------------------------------------------------------------
# Accuracy gate


@dataclass
class EvalOptions:
    limit: int | None = None  # the first N test rows
    num_fewshot: int = 5
    concurrency: int = 1  # per-sample agreement with a baseline is exact only at 1
    data_dir: Path | None = None  # GSM8K jsonl here; else $GSM8K_DIR, a cached copy, the hub
    expected: Path | None = None  # the expected-accuracy table (None: pdctl's own, gates.accuracy.DEFAULT_TABLE)
    allow_ungated: bool = False  # a model the table does not know passes (UNGATED) instead of failing
    tokenizer: str | None = None
    min_agreement: float | None = None
    tolerance: float | None = None
    reference_port: int = 8300
    timeout_s: float = 300.0
    results: Path | None = None
    state_dir: Path | None = None  # where the brought-up topology keeps its state (default .pdctl/<name>)


@dataclass
class EvalResult:
    status: str  # PASS | FAIL | UNGATED
    model: str
    summary: dict  # what lm-eval measured and how each gate judged it (written as summary.json)
    out_dir: Path
    allow_ungated: bool = False

    @property
    def passed(self) -> bool:
        """PASS; UNGATED (no gate for the model) only when allowed: a gate that judged nothing is not a pass."""
        return self.status == "PASS" or (self.status == "UNGATED" and self.allow_ungated)

    def to_dict(self) -> dict:
        return self.summary


def expected_table(path: str | Path | None) -> dict:
    """The expected-accuracy table at `path` (None: pdctl's own); a path that is not a file is refused."""
    from pdctl.gates import accuracy

    path = Path(path) if path is not None else accuracy.DEFAULT_TABLE
    if not path.is_file():
        raise UserError(f"--expected: {path} is not a file (the expected-accuracy table; leave it out for pdctl's "
                        f"own, {accuracy.DEFAULT_TABLE})")
    try:
        return accuracy.load_expected(path)
    except (ValueError, OSError) as e:
        raise UserError(str(e)) from None


def gsm8k_source(data_dir: Path | None, say: Say = _quiet) -> Path | None:
    """Where GSM8K comes from, settled before anything starts (a bring-up of minutes must not end in lm-eval's
    ConnectionError); sets the environment lm-eval reads."""
    from pdctl.gates import gsm8k

    try:
        source = gsm8k.data_source(Path(data_dir) if data_dir else None)
    except gsm8k.DataError as e:
        raise UserError(str(e)) from None
    os.environ.update(source.env)
    say(f"GSM8K: {source.detail}")
    return source.data_dir


def evaluate(target: Topology | Deployment | str | Path | None = None, *, url: str | None = None,
             baseline: str | None = None, model: str | None = None, options: EvalOptions | None = None,
             say: Say = _quiet, progress: Say = _quiet) -> EvalResult:
    """Accuracy gate: lm-eval's gsm8k through the P/D proxy, judged by expected.yaml (absolute and/or relative to
    an aggregated reference). target: a Topology (or its file; brought up, with a reference when the gate needs
    one or baseline='auto'), a running Deployment, or None with `url` of a running proxy."""
    from pdctl.gates import accuracy

    o = options or EvalOptions()
    table = expected_table(o.expected)
    _check_url("--url", url)
    if baseline != "auto":
        _check_url("--baseline", baseline)
    if isinstance(target, (str, Path)):
        target = load(target, gated=True)
    if target is not None and not isinstance(target, (Topology, Deployment)):
        raise UserError(f"evaluate: cannot evaluate a {type(target).__name__}; give a Topology, a Deployment or a URL")
    if target is None and not url:
        raise UserError("give a TOPOLOGY, or --url of a running P/D proxy")
    if not isinstance(target, Topology) and baseline == "auto":
        raise UserError("--baseline auto needs a TOPOLOGY; with --url give the reference's URL")
    data_dir = gsm8k_source(o.data_dir, say)
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def run(proxy_url: str, ref_url: str | None, name: str, tok: str | None, out_dir: Path,
            key: str | None) -> EvalResult:
        progress(f"lm-eval gsm8k via P/D {proxy_url}" + (f" and the reference {ref_url}" if ref_url else "")
                 + f" (limit {o.limit})")
        s = accuracy.run_gate(proxy_url, ref_url, name, out_dir, table, tokenizer=tok, limit=o.limit,
                              num_fewshot=o.num_fewshot, concurrency=o.concurrency, data_dir=data_dir,
                              min_agreement=o.min_agreement, tolerance=o.tolerance, api_key=key)
        return EvalResult(s["status"], name, s, out_dir, o.allow_ungated)

    if not isinstance(target, Topology):
        d = target if isinstance(target, Deployment) else None
        key = _api_key(d.topology if d else None)
        proxy_url = url or d.proxy_url
        baseline = baseline or (d.reference_url if d else None)
        name = model or (d.topology.model.name if d else _served_model(proxy_url, key))
        if accuracy.needs_baseline(table, name) and not baseline:
            raise UserError(f"model '{name}' has a relative gsm8k gate in {accuracy.table_name(o.expected)} "
                            "(per-sample agreement and accuracy delta against an aggregated reference): give "
                            "--baseline URL of an aggregated server of the same model, or a TOPOLOGY (pdctl then "
                            "starts one)")
        say(_running_warning(d, "eval"))
        local = d is not None and d.backend.name == "local"  # a cluster node's model path means nothing here
        return run(proxy_url, baseline, name, o.tokenizer or (_served_path(d) if local else None),
                   o.results or Path("results") / f"eval-{stamp}", key)

    t = _gated(target, say)
    _local_engine(t)
    key = _api_key(t)  # before anything starts
    if accuracy.needs_baseline(table, t.model.name) and not baseline:
        baseline = "auto"  # the gate cannot be judged without it, and the topology says how to start one
        say(f"model '{t.model.name}' has a relative gsm8k gate in {accuracy.table_name(o.expected)}: starting "
            "an aggregated reference beside the topology to compare with (as --baseline auto)")
    p = plan(t, state_dir=o.state_dir, reference_port=o.reference_port if baseline == "auto" else None)
    tok = o.tokenizer or _model_path(t)
    out_dir = o.results or Path("results") / f"eval-{t.name}-{stamp}"
    label = f"bringing up {p.name}{' and an aggregated reference' if baseline == 'auto' else ''}"
    with _brought_up(p, t, o.timeout_s, progress, label) as d:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "topology.json").write_text(json.dumps(p.to_dict()["topology"], indent=2))
        return run(d.proxy_url, d.reference_url if baseline == "auto" else baseline, t.model.name, tok, out_dir, key)


def _served_path(d: Deployment) -> str:
    """The model path a deployment's decodes were started with (their tokenizer too)."""
    argv = d.plan.by_role("decode")[0].argv
    return argv[argv.index("--model") + 1]


def _model_path(t: Topology) -> str:
    from pdctl.topology import resolved_model

    return resolved_model(t, t.decode[0], origin(t).base_dir)


# ----------------------------------------------------------------------------------------------------------------
# Bench and sweep


@dataclass
class BenchResult:
    status: str  # PASS | FAIL
    summary: dict  # every phase's numbers (also summary.json under out_dir)
    out_dir: Path

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    def to_dict(self) -> dict:
        return self.summary


def _bench_data(o: BenchOptions, say: Say) -> BenchOptions:
    from pdctl.bench.load import check_dataset
    from pdctl.gates import gsm8k

    try:
        check_dataset(o.dataset, o.dataset_path)  # the load's prompts: before anything starts
    except ValueError as e:
        raise UserError(str(e)) from None
    if not o.skip_eval:
        return replace(o, data_dir=gsm8k_source(o.data_dir, say))
    if o.data_dir is not None:  # the parity gate's GSM8K prompts
        try:
            return replace(o, data_dir=gsm8k.check_dir(Path(o.data_dir)).data_dir)
        except gsm8k.DataError as e:
            raise UserError(str(e)) from None
    return o


def bench(target: Topology | str | Path, options: BenchOptions | None = None, *, results: str | Path | None = None,
          say: Say = _quiet, progress: Say = _quiet) -> BenchResult:
    """The whole job: up (beside an aggregated reference) -> parity -> accuracy -> load benchmark -> down.
    `say` and `progress` get each phase as it starts, with the seconds since the start."""
    o = options or BenchOptions()
    table = expected_table(o.expected)
    o = _bench_data(o, say)
    t = _gated(load(target, gated=True) if isinstance(target, (str, Path)) else target, say)
    out_dir = Path(results) if results else Path("results") / f"bench-{t.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return _bench(t, o, table, out_dir, say, progress)


def _bench(t: Topology, o: BenchOptions, table: dict, out_dir: Path, say: Say, progress: Say = _quiet) -> BenchResult:
    from pdctl.bench.load import WorkloadError
    from pdctl.bench.run import run_bench

    _local_engine(t)
    o = o.resolved()
    if o.breakdown:
        t = _traced(t, o)
    if o.goodput:
        _goodput_options(t, o, say)
    p = plan(t, state_dir=o.state_dir, reference_port=o.reference_port)
    backend = _preflight(p, t)
    t0 = time.monotonic()

    def phase(text: str) -> None:
        say(f"[{time.monotonic() - t0:5.0f} s] {text}")
        progress(f"[{time.monotonic() - t0:5.0f} s] {text}")

    with _interruptible():
        try:
            if not o.goodput:
                s = run_bench(origin(t), p, p.get("reference"), backend, out_dir, o, table, phase)
            else:
                s = _bench_goodput(t, p, backend, out_dir, o, table, phase)
        except WorkloadError as e:  # the load's prompts, refused before anything started
            raise UserError(str(e)) from None
    return BenchResult(s["status"], s, out_dir)


def parse_rates(text: str | None) -> tuple[float, ...] | None:
    """--rates 2,4,8 -> (2.0, 4.0, 8.0); None -> None (the rate search)."""
    if text is None:
        return None
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"--rates {text}: expected offered request rates separated by commas, e.g. 2,4,8") from None
    if not all(0 < r < float("inf") for r in rates):
        raise UserError(f"--rates {text}: offered request rates must be positive numbers")
    return rates


def _goodput_options(t: Topology, o: BenchOptions, say: Say) -> None:
    """What --goodput refuses before anything starts, and what it warns of."""
    from pdctl.bench import goodput

    try:
        goodput.parse_slo(o.slo)
    except goodput.SloError as e:
        raise UserError(str(e)) from None
    if o.breakdown or o.request_rate is not None:
        raise UserError("--goodput runs its own rates (--rates, or a search): drop --request-rate and --breakdown")
    if o.rates is not None and (not o.rates or any(not r > 0 for r in o.rates)):
        raise UserError(f"rates {o.rates}: offered request rates must be positive")
    if o.repeat < 1 or o.requests < 1:
        raise UserError(f"--repeat {o.repeat}, --requests {o.requests}: at least 1 each")
    if o.requests < goodput.MIN_REQUESTS:
        say(f"warning: --requests {o.requests} per rate: fewer than {goodput.MIN_REQUESTS}, one request moves "
            f"the attainment by {100 / o.requests:.1f} %: too few to decide on")


def _bench_goodput(t: Topology, p: Plan, backend, out_dir: Path, o: BenchOptions, table: dict, phase: Say) -> dict:
    """The gates on the topology beside its reference (unless skipped), then goodput: the topology alone against
    its baseline on the same devices."""
    from pdctl.bench.goodput_run import run_goodput
    from pdctl.bench.run import overall_status, run_bench
    from pdctl.topology import summary as summary_line

    if o.skip_check and o.skip_eval:
        out_dir.mkdir(parents=True, exist_ok=True)
        s: dict = {"name": t.name, "pools": summary_line(t)}
    else:
        s = run_bench(origin(t), p, p.get("reference"), backend, out_dir, replace(o, skip_perf=True), table, phase)
    base = plan(t, state_dir=p.state_dir, baseline=True)
    pd = p.with_processes([x for x in p.processes if x.role != "reference"])
    s["goodput"] = run_goodput(origin(t), pd, base, backend, out_dir, o, phase,
                               auth.headers(auth.api_key(t)) or None)
    s["status"] = overall_status(s, o.allow_ungated)
    (out_dir / "summary.json").write_text(json.dumps(s, indent=2))
    return s


def _traced(t: Topology, o: BenchOptions) -> Topology:
    """The topology with connector.trace on (the decodes' timing lines), for a bench that follows its requests."""
    if o.skip_perf:
        raise UserError("--breakdown follows the load benchmark's requests: drop --skip-perf")
    if t.connector.kind != "pdctl":
        raise UserError(f"--breakdown: the decode's timing lines come from pdctl's connector; topology '{t.name}' "
                        f"uses connector.kind {t.connector.kind}")
    traced = t.model_copy(update={"connector": t.connector.model_copy(update={"trace": True})})
    traced._origin = t.origin
    return traced


@dataclass
class SweepResult:
    rows: list[dict]  # one summary per case (REFUSED / FAIL / PASS)
    out_dir: Path

    @property
    def passed(self) -> bool:
        return not any(r.get("status") == "FAIL" for r in self.rows)

    def table(self) -> list[dict]:
        """One flat row per case (blocks, TP, gates, p50 latencies) for a table."""
        from pdctl.bench.sweep import row

        return [row(r) for r in self.rows]

    @property
    def reports(self) -> list[Path]:
        return [self.out_dir / n for n in ("sweep.md", "sweep.json", "accuracy.png", "latency.png")]


def sweep(topology: str | Path, matrix: str | Path, options: BenchOptions | None = None, *,
          results: str | Path | None = None, say: Say = _quiet) -> SweepResult:
    """`bench` for every case of a matrix (resumable: a case with a summary under `results` is kept); writes
    sweep.json, sweep.md and plots. A case the topology rules refuse is REFUSED, one that fails to start FAIL."""
    from pydantic import ValidationError

    from pdctl.bench import sweep as sweep_mod

    matrix = Path(matrix)
    try:
        m = sweep_mod.load_matrix(matrix)
    except (OSError, ValidationError, ValueError) as e:
        raise UserError(f"{matrix}: {e}") from None
    out_dir = Path(results) if results else Path("results") / f"sweep-{matrix.stem}"
    o = options or BenchOptions()
    table = expected_table(o.expected)
    o = _bench_data(o, say)
    say(_gate_note() + " in every case")

    def run_case(case, case_dir: Path) -> dict:
        base = {"prefill_block": case.prefill_block_size, "decode_block": case.decode_block_size,
                "prefill_tp": case.prefill_tp, "decode_tp": case.decode_tp}
        try:
            t = load(topology, case.overrides(), gated=True)
        except TopologyError as e:
            return {**base, "status": "REFUSED", "error": e.render()}
        try:
            return _bench(t, o, table, case_dir, lambda text: say(f"  {case.name}: {text}")).summary
        except (LaunchFailed, UserError, RuntimeError) as e:
            return {**base, "status": "FAIL", "error": str(e)}

    t0 = time.monotonic()
    rows = sweep_mod.run_sweep(m, out_dir, run_case,
                               lambda c, state: say(f"[{time.monotonic() - t0:5.0f} s] case {c.name}: {state}"))
    return SweepResult(rows, out_dir)


# ----------------------------------------------------------------------------------------------------------------
# The proxy


def proxy_weights(flags: list[str]) -> dict[str, float]:
    """`--weight ROLE/POOL=W` flags as ProxyConfig.weights."""
    weights: dict[str, float] = {}
    for w in flags:
        key, sep, val = w.partition("=")
        try:
            weights[key] = float(val)
        except ValueError:
            sep = ""
        if not sep or key.count("/") != 1:
            raise UserError(f"--weight {w}: expected ROLE/POOL=W, e.g. --weight decode/d64=2")
    return weights


def proxy_pairs(flags: list[str]) -> list[tuple[str, str]]:
    """`--exclude-pair PREFILL_POOL/DECODE_POOL` flags as ProxyConfig.exclude_pairs."""
    pairs = []
    for x in flags:
        p, sep, d = x.partition("/")
        if not sep or not p or not d:
            raise UserError(f"--exclude-pair {x}: expected PREFILL_POOL/DECODE_POOL, e.g. --exclude-pair p128/d32")
        pairs.append((p, d))
    return pairs


def serve_proxy(prefill: list[str], decode: list[str], *, host: str = "127.0.0.1", port: int = 8000,
                **settings) -> None:
    """Run the P/D proxy in this process until interrupted; every routing rule is checked before the port opens.
    settings: ProxyConfig's fields (policy, on_prefill_down, timeouts, weights, exclude_pairs, ...), and
    api_key_env: the name of the environment variable holding the key clients must send (never the key itself:
    a flag's value is in the process's command line)."""
    from pdctl.proxy import first_token
    from pdctl.proxy.server import Proxy, ProxyConfig, serve

    name = settings.pop("api_key_env", None)
    if name:
        try:
            settings["api_key"] = auth.read(name, what=f"{auth.PROXY_FLAG} {name}")
        except auth.MissingKey as e:
            raise UserError(str(e)) from None

    flags = {"connect_timeout_s": "--connect-timeout", "first_byte_timeout_s": "--first-byte-timeout",
             "read_timeout_s": "--read-timeout", "breaker_open_s": "--breaker-open",
             "breaker_failures": "--breaker-failures"}
    for key, flag in flags.items():
        value = settings.get(key)
        if value is not None and not value > 0:
            raise UserError(f"{flag} {value:g}: must be > 0")
    mode = settings.get("first_token", "off")
    if mode not in first_token.MODES:
        raise UserError(f"--first-token {mode}: expected one of {', '.join(first_token.MODES)}")
    cfg = ProxyConfig(prefill, decode, **settings)
    try:
        Proxy(cfg)
    except ValueError as e:
        raise UserError(f"proxy: {e}") from None
    serve(cfg, host, port)
