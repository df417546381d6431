"""pdctl's command line: parse, call the library, render. No logic of its own."""


import contextlib
import functools
import inspect
import json
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from pdctl import topology as topo_mod
from pdctl.plan import Plan, build_plan

app = typer.Typer(
    name="pdctl",
    help="Orchestrate vLLM prefill/decode disaggregation across heterogeneous hardware.\n\n"
    "Prefill and decode may differ in KV block size (either direction), TP and cache layout.\n\n"
    "Quick tour:\n\n"
    "  pdctl model tiny .pdctl/models/tiny\n\n"
    "  pdctl validate configs/cpu-demo.yaml\n\n"
    "  pdctl plan configs/cpu-demo.yaml --decode-block-size 128 --json",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
model_app = typer.Typer(help="Build models for tests and demos.", no_args_is_help=True)
app.add_typer(model_app, name="model")
render_app = typer.Typer(help="Render a topology for systems pdctl does not run itself.", no_args_is_help=True)
app.add_typer(render_app, name="render")

out = Console()
err = Console(stderr=True, soft_wrap=True)


class UserError(Exception):
    """Bad input from the user: rendered as one message, exit 1, never a traceback."""


# ----------------------------------------------------------------------------------------------------------------
# Shared topology options


def _override_params() -> list[inspect.Parameter]:
    params = []
    for key, (flag, path) in topo_mod.OVERRIDE_FLAGS.items():
        help_ = f"override {'.'.join(map(str, path))}"
        params.append(inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[str | None, typer.Option(flag, help=help_)]))
    params.append(inspect.Parameter(
        "set_", inspect.Parameter.KEYWORD_ONLY, default=[],
        annotation=Annotated[list[str], typer.Option("--set", help="override any field: dotted.path=value "
                                                    "(repeatable), e.g. --set proxy.port=9000")]))
    return params


def topology_command(fn):
    """Give a command the override flags; it receives them as `overrides: list[Override]`."""
    sig = inspect.signature(fn)
    extra = _override_params()

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        flags = {k: kwargs.pop(k) for k in topo_mod.OVERRIDE_FLAGS}
        sets = kwargs.pop("set_")
        try:
            kwargs["overrides"] = topo_mod.overrides_from_flags(flags, sets)
        except ValueError as e:
            raise UserError(str(e)) from None
        return fn(*args, **kwargs)

    params = [p for p in sig.parameters.values() if p.name != "overrides"]
    wrapper.__signature__ = sig.replace(parameters=params + extra)
    wrapper.__annotations__ = {**{p.name: p.annotation for p in params + extra}, "return": None}
    return wrapper


TopologyArg = Annotated[Path, typer.Argument(help="topology YAML", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
StateDirOpt = Annotated[Path | None, typer.Option("--state-dir", help="default: .pdctl/<name>")]


def _load(path: Path, overrides: list) -> topo_mod.Loaded:
    loaded = topo_mod.load_topology(path, overrides)
    for w in loaded.warnings:
        err.print(loaded.source.describe(w), markup=False, highlight=False, style="yellow")
    return loaded


def _state_dir(loaded: topo_mod.Loaded, state_dir: Path | None) -> Path:
    return (state_dir or Path(".pdctl") / loaded.topology.name).absolute()


@contextlib.contextmanager
def _brought_up(p: Plan, backend, timeout: float, label: str):
    """Start a plan (foreground), yield its state, always tear it down; a failed start is rendered, exit 1."""
    from pdctl.launch import run as run_mod

    with err.status(label):
        try:
            launched = run_mod.up(p, backend, attached=True, timeout_s=timeout)
        except run_mod.LaunchFailed as e:
            _launch_failed(e)
            raise typer.Exit(1) from None
    try:
        yield launched
    finally:
        run_mod.down(launched, backend)


def _plan_with_reference(loaded: topo_mod.Loaded, state_dir: Path | None, reference_port: int | None):
    """The topology's plan, plus an aggregated reference instance when a port is given; pre-flight checked."""
    from pdctl.launch import run as run_mod
    from pdctl.launch.local import LocalBackend
    from pdctl.plan import Plan, reference_spec

    t = loaded.topology
    if t.engine.kind != "local":
        raise UserError(f"this command brings a topology up on this host with a reference beside it; for the "
                        f"{t.engine.kind} engine run `pdctl up -d` and then point it at the running system "
                        "(pdctl check --proxy URL --reference URL, pdctl eval --url URL)")
    sd = _state_dir(loaded, state_dir)
    p = build_plan(t, base_dir=loaded.base_dir, state_dir=sd, python=sys.executable)
    ref = None
    if reference_port:
        ref = reference_spec(t, base_dir=loaded.base_dir, state_dir=sd, port=reference_port, python=sys.executable)
        p = Plan(p.name, p.state_dir, [*p.processes, ref], p.topology)
    backend = LocalBackend()
    problems = run_mod.preflight(loaded, p, backend)
    if problems:
        raise UserError("pre-flight failed, nothing was started:\n  " + "\n  ".join(problems))
    return p, ref, backend


# ----------------------------------------------------------------------------------------------------------------
# Commands


@app.command()
@topology_command
def validate(topology: TopologyArg, json_: JsonOpt = False, overrides: list = ()) -> None:
    """Check a topology against every compatibility rule, before anything starts.

    Exit 0 when valid, 1 with every problem (file:line, field, how to fix) otherwise.

    Examples:

      pdctl validate configs/cpu-demo.yaml

      pdctl validate configs/cpu-demo.yaml --prefill-block-size 64 --decode-block-size 32

      pdctl validate configs/cpu-demo.yaml --set connector.kind=nixl --json
    """
    try:
        loaded = _load(topology, overrides)
    except topo_mod.TopologyError as e:
        if json_:
            out.print_json(json.dumps({"ok": False, "file": str(topology), "problems": [
                {"path": ".".join(map(str, p.path)), "where": e.source.describe(p).split(": ", 1)[0],
                 "message": p.message, "hint": p.hint} for p in e.problems]}))
            raise typer.Exit(1) from None
        raise
    t = loaded.topology
    summary = topo_mod.summary(t)
    if json_:
        out.print_json(json.dumps({"ok": True, "file": str(topology), "summary": summary}))
    else:
        out.print(f"[green]valid[/green] {summary}", highlight=False, soft_wrap=True)


@app.command()
@topology_command
def plan(topology: TopologyArg, json_: JsonOpt = False, state_dir: StateDirOpt = None,
         overrides: list = ()) -> None:
    """Show the exact processes `pdctl up` would start: argv, env, ports, log, readiness URL.

    Examples:

      pdctl plan configs/cpu-demo.yaml

      pdctl plan configs/qwen3-0.6b-cuda.yaml --decode-tp 2 --json

      pdctl plan configs/cpu-slurm.yaml --engine slurm
    """
    loaded = _load(topology, overrides)
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=_state_dir(loaded, state_dir),
                   python=sys.executable)
    batch = None
    if loaded.topology.engine.kind == "slurm":
        from pdctl.launch.slurm_engine import render_batch

        batch = render_batch(p, p.topology["engine"])
    if json_:
        print(json.dumps({**p.to_dict(), "batch_script": batch}, indent=2) if batch else p.to_json())
        return
    _render_plan(p)
    if batch:
        out.print("\n[bold]Slurm batch script[/bold] (pdctl up submits it; the proxy runs here):", highlight=False)
        out.print(batch, highlight=False, markup=False, soft_wrap=True)


def _render_plan(p: Plan) -> None:
    table = Table(title=f"plan: {p.name}  (state {p.state_dir})", show_lines=False)
    for col in ("process", "pool", "platform", "block", "TP", "layout", "HTTP", "side channel", "readiness"):
        table.add_column(col)
    for s in p.processes:  # in pool order: the plan lists each pool's instances together
        table.add_row(s.name, s.pool or "-", s.platform, str(s.block_size or "-"), str(s.tp or "-"), s.kv_layout or "-",
                      f"{s.host}:{s.ports['http']}", str(s.ports.get("side_channel", "-")), s.readiness_url)
    out.print(table)
    for s in p.processes:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in s.env.items())
        out.print(f"\n[bold]{s.name}[/bold]  log: {s.log_path}", highlight=False)
        out.print(f"{env} {shlex.join(s.argv)}", highlight=False, markup=False, soft_wrap=True)


@render_app.command("k8s")
@topology_command
def render_k8s(
    topology: TopologyArg,
    out_dir: Annotated[Path, typer.Option("-o", "--out", help="directory to write the manifests to")],
    image: Annotated[str, typer.Option(help="container image with vLLM, NIXL and pdctl installed")] = "",
    namespace: Annotated[str, typer.Option(help="Kubernetes namespace")] = "default",
    validate_: Annotated[bool, typer.Option("--validate/--no-validate", help="check every manifest offline with "
                                            "kubernetes-validate --strict")] = True,
    overrides: list = (),
) -> None:
    """Kubernetes manifests: a StatefulSet + headless Service per pool, the proxy, the topology as a ConfigMap.

    Accelerators are requested per platform (nvidia.com/gpu, habana.ai/gaudi, gpu.intel.com/i915) instead of
    device ids, and each pod's NIXL side-channel host is its pod IP. A local model path is mounted from the
    PersistentVolumeClaim 'pdctl-models' at /models. Validated offline; pdctl does not apply them.

    Examples:

      pdctl render k8s configs/cuda-to-gaudi.yaml -o k8s/ --image registry.example/pdctl-vllm:0.11

      pdctl render k8s configs/cpu-demo.yaml -o /tmp/k8s --namespace pd
    """
    import yaml

    from pdctl.launch import k8s

    loaded = _load(topology, overrides)
    t = loaded.topology
    p = build_plan(t, base_dir=loaded.base_dir, state_dir=Path("/var/lib/pdctl") / t.name, python="python3")
    manifests = k8s.render(t, p, image=image or k8s.DEFAULT_IMAGE, namespace=namespace)
    problems = []
    if validate_:
        import kubernetes_validate

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

    out_dir.mkdir(parents=True, exist_ok=True)
    for fname, m in manifests.items():
        (out_dir / fname).write_text(yaml.dump(m, Dumper=_NoAliases, sort_keys=False))
    checked = " (validated with kubernetes-validate --strict)" if validate_ else ""
    out.print(f"wrote {len(manifests)} manifests to {out_dir}{checked}", highlight=False)


@model_app.command("tiny")
def model_tiny(
    out_dir: Annotated[Path, typer.Argument(help="directory to write the model to")],
    seed: Annotated[int, typer.Option(help="same seed, same weights and tokenizer")] = 0,
    force: Annotated[bool, typer.Option(help="rebuild even if DIR already holds this seed's model")] = False,
) -> None:
    """Build a tiny random-weight Llama (2 layers, 2 KV heads, ~2k BPE vocab) offline, in seconds.

    Examples:

      pdctl model tiny .pdctl/models/tiny

      pdctl model tiny /tmp/tiny --seed 7
    """
    from pdctl import tinymodel

    marker = out_dir / "pdctl-tiny.json"
    if not force and marker.is_file() and json.loads(marker.read_text()).get("seed") == seed:
        out.print(f"tiny model already at {out_dir} (seed {seed}); --force rebuilds", highlight=False)
        return
    with err.status(f"building tiny model in {out_dir} ..."):
        tinymodel.build_tiny_model(out_dir, seed=seed)
    out.print(f"built {out_dir} (seed {seed}, fingerprint {tinymodel.fingerprint(out_dir)})", highlight=False)


# ----------------------------------------------------------------------------------------------------------------
# Launch and supervise


def _progress_table(rows: list) -> Table:
    table = Table(show_header=True, header_style="bold")
    for col in ("instance", "state", "elapsed"):
        table.add_column(col)
    colors = {"ready": "green", "loading": "yellow", "starting": "cyan"}
    for r in rows:
        table.add_row(r.name, f"[{colors.get(r.phase, 'red')}]{r.phase}[/]", f"{r.elapsed_s:5.1f} s")
    return table


def _launch_failed(e) -> None:
    """The root cause first (pdctl's own error line, else the first exception of the failing process), then
    where the whole log is; a few last lines only when no cause line was found."""
    err.print(f"[red]launch failed:[/red] {e.name}: {e.reason}", highlight=False)
    cause = e.cause
    if cause and cause not in e.reason:
        err.print(f"  cause: {cause}", markup=False, highlight=False)
    elif not cause and e.log_tail:
        last = e.log_tail[-8:]
        err.print(f"--- last {len(last)} lines of {e.log_path}:", highlight=False)
        err.print("\n".join(last), markup=False, highlight=False)
    err.print((f"log: {e.log_path}\n" if e.log_path else "") + "every process was stopped", highlight=False)


@app.command()
@topology_command
def up(
    topology: TopologyArg,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="return once ready; `pdctl down` stops it")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for every instance to be ready")] = 300.0,
    state_dir: StateDirOpt = None,
    overrides: list = (),
) -> None:
    """Start the topology's prefill and decode servers and the proxy, wait until all are ready.

    Every process runs in its own process group with its log in the state dir. If an instance exits or the
    timeout passes before everything is ready, everything is stopped and the root cause is shown. Once ready,
    a supervisor keeps the topology running: an instance that exits, or fails its health checks persistently,
    is restarted with backoff (each pool's `restart: on-failure|always|never`, the `supervision:` section).
    In the foreground (default) pdctl is the supervisor and Ctrl-C stops everything; with -d the command
    returns once ready and leaves a supervisor process behind (`pdctl down` stops it first).

    Examples:

      pdctl up configs/cpu-demo.yaml

      pdctl up -d configs/cpu-homog.yaml --timeout 180 && pdctl status cpu-homog

      pdctl up -d configs/cpu-demo.yaml --decode-block-size 128 --state-dir /tmp/demo128
    """
    import signal
    import threading

    from rich.live import Live

    from pdctl.launch import run as run_mod
    from pdctl.launch import supervisor
    from pdctl.launch.backend import backend_for

    loaded = _load(topology, overrides)
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=_state_dir(loaded, state_dir),
                   python=sys.executable)
    backend = backend_for(p.topology.get("engine"))
    problems = run_mod.preflight(loaded, p, backend)
    if problems:
        raise UserError("pre-flight failed, nothing was started:\n  " + "\n  ".join(problems))

    stop = threading.Event()
    got: list[int] = []

    def on_signal(signum, _frame):
        got.append(signum)
        stop.set()
        raise KeyboardInterrupt

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Live(_progress_table([]), console=err, refresh_per_second=4, transient=False) as live:
            launched = run_mod.up(p, backend, attached=not detach, timeout_s=timeout,
                                  on_progress=lambda rows: live.update(_progress_table(rows)))
    except run_mod.LaunchFailed as e:
        _launch_failed(e)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("interrupted: every process was stopped")
        raise typer.Exit(130) from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    p = launched.plan  # as placed: cluster engines fill in node addresses
    proxy = p.get("proxy")
    where = "" if backend.name == "local" else f"  engine {backend.name}"
    out.print(f"[green]ready[/green]: {p.name}  proxy {proxy.http_url}  state {p.state_dir}{where}", highlight=False)
    if detach:
        if backend.restartable:
            try:
                pid = supervisor.start_detached(launched)
            except RuntimeError as e:
                err.print(f"[yellow]warning:[/yellow] {e}; instances will not be restarted", highlight=False)
            else:
                out.print(f"supervisor pid {pid} (log {Path(p.state_dir) / 'logs' / 'supervisor.log'})",
                          highlight=False)
        else:
            err.print(f"note: the {backend.name} engine starts a plan as a whole; pdctl does not restart its "
                      "single instances (status shows them down; pdctl down && pdctl up)", highlight=False)
        return

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda signum, _f: (got.append(signum), stop.set()))
    out.print("attached: supervising (restarts instances that fail); Ctrl-C stops everything", highlight=False)
    settled = supervisor.supervise_attached(launched, backend, stop,
                                            say=lambda msg: err.print(msg, markup=False, highlight=False))
    if settled:
        err.print("[red]every instance is down and none will be restarted[/red]", highlight=False)
    err.print("stopped every process", highlight=False)
    raise typer.Exit(1 if settled else (130 if signal.SIGINT in got else 0))


NameArg = Annotated[str | None, typer.Argument(help="topology name (default: the only one that is up)")]


def _state_or_exit(name: str | None, state_dir: Path | None):
    from pdctl.launch import state as state_mod

    try:
        d = state_mod.resolve_state_dir(name, state_dir)
    except LookupError as e:
        raise UserError(str(e)) from None
    st = state_mod.load(d)
    return d, st


@app.command()
def down(name: NameArg = None, state_dir: StateDirOpt = None,
         grace: Annotated[float, typer.Option(help="seconds between SIGTERM and SIGKILL")] = 15.0) -> None:
    """Stop every process of a launched topology (SIGTERM to each process group, SIGKILL after --grace).

    Idempotent: a topology that is not up, or whose processes are already gone, is reported, not an error.

    Examples:

      pdctl down cpu-demo

      pdctl down --state-dir /tmp/demo128
    """
    from pdctl.launch import run as run_mod
    from pdctl.launch.backend import backend_of

    try:
        d, st = _state_or_exit(name, state_dir)
    except UserError as e:
        out.print(f"nothing to stop: {e}", highlight=False)
        return
    # The supervisor first: nothing may be restarted behind down's back. A foreground `pdctl up` stops its
    # whole topology when told to.
    from pdctl.launch import state as state_mod

    mode = run_mod.stop_supervisor(d)
    if mode:
        out.print(f"stopped the {mode} supervisor", highlight=False)
    with state_mod.locked(d):  # a supervisor started late waits, then finds no state and exits
        st = state_mod.load(d)  # again: the supervisor wrote it last, or a foreground up removed it
        if st is None and mode == "foreground":
            out.print("its `pdctl up` stopped every process", highlight=False)
            return
        if st is None:
            out.print(f"nothing to stop: no state in {d}", highlight=False)
            return
        report = run_mod.down(st, backend_of(st), grace)
    for n in report.stopped:
        out.print(f"stopped {n}" + (" (SIGKILL after the grace period)" if n in report.killed else ""))
    for n in report.already_gone:
        out.print(f"{n} was already gone (stale state)", highlight=False)
    out.print(f"{st.plan.name} is down", highlight=False)


def _fmt(v, spec: str = "", none: str = "-") -> str:
    return none if v is None else format(v, spec)


@app.command()
def status(name: NameArg = None, state_dir: StateDirOpt = None, json_: JsonOpt = False) -> None:
    """One row per instance: role, pid, ports, block size, TP, health, uptime, restarts, requests and KV usage;
    then the supervisor, and for each instance that ended once, how (signal or exit code) and its log's
    root-cause line.

    Examples:

      pdctl status

      pdctl status cpu-demo --json
    """
    import dataclasses

    from pdctl.launch import run as run_mod
    from pdctl.launch import supervisor
    from pdctl.launch.backend import backend_of

    d, st = _state_or_exit(name, state_dir)
    if st is None:
        raise UserError(f"nothing is up in {d}")
    rows = run_mod.status(st, backend_of(st))
    if json_:
        print(json.dumps({"name": st.plan.name, "state_dir": str(d), "engine": st.backend,
                          "supervisor": supervisor.alive(d),
                          "ready": all(r.healthy for r in rows),
                          "instances": [dataclasses.asdict(r) for r in rows]}, indent=2))
        return
    table = Table(title=f"{st.plan.name} ({d})")
    for col in ("instance", "where", "pid", "HTTP", "side ch.", "block", "TP", "health", "uptime", "restarts",
                "run", "wait", "KV"):
        table.add_column(col)
    for r in rows:
        health = "[green]ok[/]" if r.healthy else ("[yellow]running[/]" if r.running else "[red]down[/]")
        if r.phase in ("starting", "backoff", "failed", "exited") and not r.healthy:
            health += f" ({r.phase})"
        table.add_row(r.name, r.where, _fmt(r.pid), f"{r.host}:{r.http_port}", _fmt(r.side_channel_port),
                      _fmt(r.block_size),
                      _fmt(r.tp), health, _fmt(r.uptime_s, ".0f") + ("s" if r.uptime_s else ""), str(r.restarts),
                      _fmt(r.requests_running, ".0f"), _fmt(r.requests_waiting, ".0f"),
                      _fmt(r.kv_usage and 100 * r.kv_usage, ".1f") + ("%" if r.kv_usage is not None else ""))
    out.print(table)
    sup = supervisor.alive(d)
    out.print(f"supervisor: {sup['mode']} pid {sup['pid']}" if sup else
              "supervisor: none (nothing restarts failed instances)", highlight=False)
    for r in rows:
        if r.last_exit or r.last_error:
            out.print(f"{r.name}: last exit: {r.last_exit or '-'}" + (f"; last error: {r.last_error}"
                      if r.last_error else ""), markup=False, highlight=False)


@app.command()
def logs(
    name: Annotated[str, typer.Argument(help="topology name")],
    which: Annotated[str | None, typer.Argument(help="an instance (decode-d64-0), ROLE, ROLE/POOL, ROLE/INDEX or "
                                                "ROLE/POOL/INDEX, e.g. decode/0 or proxy")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing new lines")] = False,
    lines: Annotated[int, typer.Option("-n", help="lines from the end")] = 40,
    state_dir: StateDirOpt = None,
) -> None:
    """Show the logs of a topology's instances.

    Examples:

      pdctl logs cpu-demo decode/0 -n 100

      pdctl logs cpu-demo prefill -f

      pdctl logs cpu-fleet decode-d64-0 -n 20
    """
    import time as _time

    from pdctl.launch.backend import backend_of
    from pdctl.plan import select as plan_select

    d, st = _state_or_exit(name, state_dir)
    if st is None:
        raise UserError(f"nothing is up in {d}")
    backend = backend_of(st)
    specs = plan_select(st.plan, which)
    if not specs:
        raise UserError(f"no instance matches '{which}'; have {', '.join(s.name for s in st.plan.processes)}")
    for s in specs:
        if len(specs) > 1:
            out.print(f"==> {s.name} ({s.log_path}) <==", highlight=False)
        print("\n".join(backend.log_tail(st, s.name, lines)))
    if follow:
        missing = [s.log_path for s in specs if not Path(s.log_path).is_file()]
        if missing:
            raise UserError(f"-f follows log files on this host; not here: {', '.join(missing)}")
        files = {s.name: open(s.log_path, errors="replace") for s in specs}
        for f in files.values():
            f.seek(0, 2)
        try:
            while True:
                for n, f in files.items():
                    for line in f.readlines():
                        print(f"{n}| {line}" if len(files) > 1 else line, end="", flush=True)
                _time.sleep(0.3)
        except KeyboardInterrupt:
            pass


@app.command()
def proxy(
    prefill: Annotated[list[str], typer.Option("--prefill", help="prefill [POOL=]URL (repeatable)")],
    decode: Annotated[list[str], typer.Option("--decode", help="decode [POOL=]URL (repeatable)")],
    host: Annotated[str, typer.Option(help="listen address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="listen port")] = 8000,
    policy: Annotated[str, typer.Option(help="least_outstanding | round_robin | prefix_affinity")]
    = "least_outstanding",
    weight: Annotated[list[str] | None, typer.Option("--weight", help="ROLE/POOL=W: a pool's share of traffic "
                                              "(repeatable)")] = None,
    exclude_pair: Annotated[list[str] | None, typer.Option("--exclude-pair", help="PREFILL_POOL/DECODE_POOL never "
                                                    "routed (repeatable)")] = None,
    affinity_epsilon: Annotated[float, typer.Option(help="prefix_affinity: skip an instance above (1 + eps) x "
                                                    "the mean outstanding + 1")] = 0.25,
    affinity_prefix_chars: Annotated[int, typer.Option(help="prefix_affinity: prompt characters hashed")] = 256,
    on_prefill_down: Annotated[str, typer.Option(help="no prefill answers with usable KV: fallback (a decode "
                                                 "computes the prompt, counted) | reject (error at once)")]
    = "fallback",
    strict: Annotated[bool, typer.Option(help="deprecated: --on-prefill-down reject")] = False,
    connect_timeout: Annotated[float, typer.Option(help="upstream connect timeout, s")] = 10.0,
    first_byte_timeout: Annotated[float, typer.Option(help="request sent -> first byte of the answer, s")] = 600.0,
    read_timeout: Annotated[float, typer.Option(help="upstream read timeout between bytes, s")] = 600.0,
    breaker_failures: Annotated[int, typer.Option(help="consecutive failures that open an instance's circuit "
                                                  "breaker")] = 3,
    breaker_open: Annotated[float, typer.Option(help="seconds a tripped instance stays out before a trial")]
    = 10.0,
    access_log: Annotated[bool, typer.Option(help="one log line per request: id, status, ms, pair")] = True,
) -> None:
    """Run the P/D proxy standalone (pdctl up starts it from the topology).

    Each request goes to a prefill, then to a decode of a pool allowed for that prefill's pool. The header
    `x-pdctl-route: PREFILL_POOL/DECODE_POOL` pins the pair; the response says which instances served it
    (`x-pdctl-prefill`, `x-pdctl-decode`).

    Examples:

      pdctl proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

      pdctl proxy --prefill http://p0:8100 --prefill http://p1:8100 --decode http://d0:8200 --policy round_robin

      pdctl proxy --prefill p32=http://h:8100 --prefill p128=http://h:8101 --decode d64=http://h:8200 \\
        --decode d32=http://h:8201 --exclude-pair p128/d32 --weight decode/d64=2 --policy prefix_affinity
    """
    from pdctl.proxy.server import Proxy, ProxyConfig, serve

    weights: dict[str, float] = {}
    for w in weight or []:
        key, sep, val = w.partition("=")
        try:
            weights[key] = float(val)
        except ValueError:
            sep = ""
        if not sep or key.count("/") != 1:
            raise UserError(f"--weight {w}: expected ROLE/POOL=W, e.g. --weight decode/d64=2")
    pairs = []
    for x in exclude_pair or []:
        p, sep, d = x.partition("/")
        if not sep or not p or not d:
            raise UserError(f"--exclude-pair {x}: expected PREFILL_POOL/DECODE_POOL, e.g. --exclude-pair p128/d32")
        pairs.append((p, d))
    if strict:
        on_prefill_down = "reject"
    for flag, value in (("--connect-timeout", connect_timeout), ("--first-byte-timeout", first_byte_timeout),
                        ("--read-timeout", read_timeout), ("--breaker-open", breaker_open),
                        ("--breaker-failures", breaker_failures)):
        if not value > 0:
            raise UserError(f"{flag} {value:g}: must be > 0")
    cfg = ProxyConfig(prefill, decode, policy, on_prefill_down, connect_timeout, read_timeout, first_byte_timeout,
                      breaker_failures, breaker_open, weights=weights, exclude_pairs=pairs,
                      affinity_epsilon=affinity_epsilon, affinity_prefix_chars=affinity_prefix_chars,
                      access_log=access_log)
    try:
        Proxy(cfg)  # every routing rule checked before the port opens
    except ValueError as e:
        raise UserError(f"proxy: {e}") from None
    serve(cfg, host, port)


# ----------------------------------------------------------------------------------------------------------------
# Gates


def _reported(report, json_: bool, junit: Path | None) -> bool:
    """Write the JUnit file if asked; print JSON and say so (then there is nothing to render)."""
    from pdctl.gates.check import junit_xml

    if junit:
        junit.parent.mkdir(parents=True, exist_ok=True)
        junit.write_text(junit_xml(report))
    if json_:
        print(json.dumps(report.to_dict(), indent=2))
    return json_


def _render_parity(report, json_: bool, junit: Path | None) -> None:
    if _reported(report, json_, junit):
        return
    table = Table(title="parity: P/D vs aggregated reference (greedy, token ids)")
    for col in ("prompt", "tokens", "result", "first divergent token"):
        table.add_column(col)
    for r in report.results:
        table.add_row(r.label, str(r.prompt_tokens), "[green]pass[/]" if r.passed else "[red]FAIL[/]",
                      "-" if r.first_divergence is None else str(r.first_divergence) + (f" ({r.error})" if r.error
                                                                                         else ""))
    out.print(table)
    p = report.proof
    if p:
        verdict = "[green]KV travelled[/]" if p.ok else "[red]KV did NOT travel[/]"
        out.print(f"{verdict}: decode prompt tokens by transfer {p.external_kv_tokens:.0f}, computed locally "
                  f"{p.local_compute_tokens:.0f} (fresh prompt tokens {p.prompt_tokens}), NIXL bytes "
                  f"{p.bytes_transferred:.0f}", highlight=False)
    out.print(f"pass rate {100 * report.pass_rate:.1f}% -> " + ("[green]PASS[/]" if report.passed else "[red]FAIL[/]"))


def _render_fleet(report, json_: bool, junit: Path | None) -> None:
    if _reported(report, json_, junit):
        return
    table = Table(title="parity per pool pair: P/D vs aggregated reference (greedy, token ids)")
    for col in ("prefill", "decode", "prompts", "passed", "by transfer", "computed", "KV from", "result"):
        table.add_column(col)
    for pair in report.all():
        d = pair.to_dict()
        name = ("all pairs", "at once") if pair.prefill_pool == "*" else (pair.prefill_pool, pair.decode_pool)
        table.add_row(*name, str(d["prompts"]), str(d["passed"]), f"{d['tokens_by_transfer']:.0f}",
                      f"{d['tokens_computed']:.0f}", ", ".join(f"{k} x{v}" for k, v in d["kv_from"].items()) or "-",
                      "[green]pass[/]" if pair.passed else "[red]FAIL[/]")
    out.print(table)
    for pair in report.all():
        for r in pair.report.results:
            if not r.passed:
                out.print(f"[red]FAIL[/] {pair.prefill_pool}/{pair.decode_pool} {r.label}: first divergent token "
                          f"{r.first_divergence} {r.error or ''}", highlight=False)
        for problem in pair.problems:
            out.print(f"[red]FAIL[/] {pair.prefill_pool}/{pair.decode_pool} {problem}", highlight=False)
    if not report.logs_checked:
        out.print("the decodes' logs were not read (stock connector): where each KV came from is not proven",
                  highlight=False)
    out.print(f"pass rate {100 * report.pass_rate:.1f}% -> " + ("[green]PASS[/]" if report.passed else "[red]FAIL[/]"))


@app.command()
@topology_command
def check(
    topology: Annotated[Path | None, typer.Argument(help="topology to bring up (or --proxy and --reference)")] = None,
    proxy_url: Annotated[str | None, typer.Option("--proxy", help="running P/D proxy URL")] = None,
    reference_url: Annotated[str | None, typer.Option("--reference", help="running aggregated server URL")] = None,
    decode_url: Annotated[list[str] | None, typer.Option("--decode", help="decode URL for the transfer proof "
                                                         "(default: from the proxy's /ready)")] = None,
    model: Annotated[str | None, typer.Option(help="served model name (running systems)")] = None,
    vocab: Annotated[int, typer.Option(help="random prompt token ids are drawn below this")] = 1000,
    max_tokens: Annotated[int, typer.Option(help="tokens generated per prompt")] = 16,
    concurrency: Annotated[int, typer.Option(help="prompts in flight at once")] = 1,
    gsm8k_dir: Annotated[Path | None, typer.Option(help="dir with GSM8K test/train.jsonl: adds 5-shot prompts")] = None,
    reference_port: Annotated[int, typer.Option(help="port of the reference instance pdctl starts")] = 8300,
    reference_first: Annotated[bool, typer.Option(help="run the reference alone first and record its answers, "
                                                  "then bring up P/D: for hosts too small for both at once (e.g. "
                                                  "decode TP 2 on 2 cores)")] = False,
    mixed_prompts: Annotated[int, typer.Option(help="fleets: prompts pinned over every pair at once after the "
                                               "per-pair phases (0: none)")] = 16,
    mixed_concurrency: Annotated[int, typer.Option(help="fleets: prompts in flight in the mixed phase")] = 12,
    seed: Annotated[int | None, typer.Option(help="prompt seed (default: fresh every run)")] = None,
    lengths: Annotated[str | None, typer.Option(help="only random prompts of these token lengths, e.g. 65,129,300")]
    = None,
    json_: JsonOpt = False,
    junit: Annotated[Path | None, typer.Option(help="write a JUnit XML report here")] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for readiness")] = 300.0,
    state_dir: StateDirOpt = None,
    overrides: list = (),
) -> None:
    """Parity gate: P/D output must equal an aggregated reference token for token, and the KV must travel.

    With a TOPOLOGY, brings it up plus an aggregated reference (same model, mode, block size and TP as the
    decode, no connector), checks, and tears everything down. A fleet (several pools per role) is checked per
    prefill pool x decode pool pair: prompts pinned to the pair (x-pdctl-route) around both pools' block
    boundaries, each pair's KV proven from its decode pool's metrics and, with pdctl's connector, from the
    decodes' logs (which prefill each read came from); then prompts over every pair at once.

    Prompts: random tokens at every block boundary of
    both sides, prompts sharing a prefix with earlier ones, and GSM8K 5-shot prompts with --gsm8k-dir. The
    decode's /metrics must show the prompts arrived by KV transfer. Exit 1 on any mismatch or missing transfer.

    Examples:

      pdctl check configs/cpu-demo.yaml

      pdctl check configs/cpu-demo.yaml --decode-block-size 128 --junit results/parity.xml

      pdctl check configs/cpu-demo.yaml --decode-tp 2 --set "decode.devices=[0,1]" --reference-first

      pdctl check --proxy http://127.0.0.1:8000 --reference http://127.0.0.1:8300 --model tiny --json

      pdctl check configs/cpu-fleet.yaml --json     # a fleet: every prefill pool x decode pool pair, pinned

      pdctl check --state-dir .pdctl/cpu-fleet --reference http://127.0.0.1:8300   # a fleet that is up
    """
    from pdctl.gates import check as check_mod
    from pdctl.gates import gated as gated_mod
    from pdctl.gates import gsm8k, parity
    from pdctl.launch import probe

    try:
        only = [int(n) for n in lengths.split(",")] if lengths else None
    except ValueError:
        raise UserError(f"--lengths {lengths}: expected token counts separated by commas, e.g. 65,129,300") from None
    if gsm8k_dir is not None:
        try:
            gsm8k.check_dir(gsm8k_dir, "--gsm8k-dir ")
        except gsm8k.DataError as e:
            raise UserError(str(e)) from None

    def why_not(report) -> None:
        """After the table: why a transfer proof failed (the first reason, per pair for a fleet)."""
        if json_:
            return
        for pair in getattr(report, "all", lambda: [report])():
            rep = getattr(pair, "report", pair)
            name = f"{pair.prefill_pool}/{pair.decode_pool} " if hasattr(pair, "prefill_pool") else ""
            if rep.proof is not None and not rep.proof.ok:
                out.print(f"[red]FAIL[/] {name}{rep.proof.message}", highlight=False)

    if topology is None and state_dir is not None and not proxy_url:
        # A topology that is up (`pdctl up -d`): every pool pair, pinned, against a reference that runs too.
        from pdctl.gates import fleet

        if not reference_url:
            raise UserError("--state-dir checks a running topology: give --reference URL of an aggregated server")
        _, st = _state_or_exit(None, state_dir)
        if st is None:
            raise UserError(f"nothing is up in {state_dir}")
        warning = gated_mod.running_warning(st.plan.topology)
        if warning:
            err.print(warning, style="yellow", markup=False, highlight=False)
        served = st.plan.topology["model"].get("served_name") or st.plan.topology["model"]["path"]
        limit = (st.plan.topology["model"].get("max_model_len") or 2048) - max_tokens - 1

        def pair_prompts(pb: int, db: int) -> list:
            return check_mod.prompts_for([pb, db], vocab, limit, gsm8k_dir, seed, only)

        with err.status("checking every pool pair ...") as status:
            report = fleet.check_fleet(st.plan, st.plan.get("proxy").http_url, reference_url, model or served,
                                       pair_prompts, max_tokens, concurrency, mixed_prompts, mixed_concurrency,
                                       vocab, seed, progress=lambda text: status.update(f"checking {text} ..."))
        _render_fleet(report, json_, junit)
        why_not(report)
        raise typer.Exit(0 if report.passed else 1)
    if topology is None:
        if not (proxy_url and reference_url):
            raise UserError("give a TOPOLOGY, --state-dir of a running one with --reference, or both --proxy "
                            "and --reference for running systems")
        st = _state_or_exit(None, state_dir)[1] if state_dir is not None else None
        warning = (gated_mod.running_warning(st.plan.topology) if st is not None else
                   "note: a running system's proxy.on_prefill_down and connector.kv_load_failure_policy are its "
                   "own (give --state-dir to have them checked); the transfer proof and the proxy's fallback "
                   "counter still fail a request answered without its KV")
        if warning:
            err.print(warning, style="yellow", markup=False, highlight=False)
        decodes = decode_url or [u.split(" ", 1)[1] for u in json.loads(probe.http_get(
            proxy_url.rstrip("/") + "/ready")[1] or "{}").get("instances", {}) if u.startswith("decode ")]
        if not decodes:
            raise UserError("no decode URL to prove the transfer with: pass --decode URL")
        name = model or json.loads(probe.http_get(reference_url.rstrip("/") + "/v1/models")[1])["data"][0]["id"]
        prompts = check_mod.prompts_for([], vocab, 1024, gsm8k_dir, seed, only)
        report = parity.run_parity(proxy_url, reference_url, decodes, name, prompts, max_tokens, concurrency)
        _render_parity(report, json_, junit)
        why_not(report)
        raise typer.Exit(0 if report.passed else 1)


    overrides, applied, kept = gated_mod.gated(overrides)
    loaded = _load(topology, overrides)
    for line in gated_mod.gated_lines(applied, kept):
        if line:
            err.print(line, style="yellow" if line.startswith("warning") else None, markup=False, highlight=False)
    t = loaded.topology
    p, ref, backend = _plan_with_reference(loaded, state_dir, reference_port)
    vocab = loaded.model_info.vocab_size or vocab
    max_prompt = (t.model.max_model_len or 2048) - max_tokens - 1

    def prompts_for(blocks: list[int]) -> list:
        return check_mod.prompts_for(blocks, vocab, max_prompt, gsm8k_dir, seed, only)

    if len(t.prefill) > 1 or len(t.decode) > 1:
        if reference_first:
            raise UserError("--reference-first is for one prefill and one decode pool; a fleet's check pins "
                            "fresh prompts to every pair while it runs")
        from pdctl.gates import fleet

        with _brought_up(p, backend, timeout, f"bringing up {p.name} and an aggregated reference ..."), \
                err.status("checking every pool pair ...") as status:
            report = fleet.check_fleet(p, p.get("proxy").http_url, ref.http_url, t.model.name,
                                       lambda pb, db: prompts_for([pb, db]), max_tokens, concurrency,
                                       mixed_prompts, mixed_concurrency, vocab, seed,
                                       progress=lambda text: status.update(f"checking {text} ..."))
        _render_fleet(report, json_, junit)
        why_not(report)
        raise typer.Exit(0 if report.passed else 1)
    prompts = prompts_for([t.prefill[0].block_size, t.decode[0].block_size])
    reference: str | list = ref.http_url
    if reference_first:
        ref_alone = Plan(p.name, p.state_dir, [ref], p.topology)
        p = Plan(p.name, p.state_dir, [s for s in p.processes if s is not ref], p.topology)
        with _brought_up(ref_alone, backend, timeout, "bringing up the aggregated reference alone ..."), \
                err.status(f"recording the reference's answers to {len(prompts)} prompts ..."):
            reference = parity.reference_answers(ref.http_url, t.model.name, prompts, max_tokens, concurrency)
    beside = "" if reference_first else " and an aggregated reference"
    with _brought_up(p, backend, timeout, f"bringing up {p.name}{beside} ..."), \
            err.status(f"sending {len(prompts)} prompts through P/D{'' if reference_first else ' and the reference'}"):
        report = parity.run_parity(p.get("proxy").http_url, reference, [s.http_url for s in p.by_role("decode")],
                                   t.model.name, prompts, max_tokens, concurrency)
    _render_parity(report, json_, junit)
    why_not(report)
    raise typer.Exit(0 if report.passed else 1)


def _render_accuracy(summary: dict, expected_file: str) -> None:
    """The table vLLM PR #26759 reported its results in, plus the expected values and verdicts."""
    task, shots = summary["task"], summary["num_fewshot"]
    t = Table(title=f"{summary['model']}: {task} ({shots}-shot, limit {summary['limit']}) via P/D")
    for col in ("Task", "Filter", "n-shot", "Metric", "Value", "Stderr", "Gate", "Expected", "Status"):
        t.add_column(col)
    for v in summary["verdicts"]:
        metric, _, filt = v["metric"].partition(",")
        gate = v.get("gate", "absolute")
        if v["expected"] is None:
            want = "-"
        elif gate == "relative":  # the aggregated reference's value on the same rows
            want = f"reference {v['expected']:.4f} ± {v['rtol']}"
        else:
            want = f"{v['expected']} ± {v['rtol']}"
        t.add_row(task, filt, str(shots), metric, _fmt(v["measured"], ".4f"), _fmt(v["stderr"], ".4f"), gate, want,
                  v["status"])
    out.print(t)
    for line in summary.get("gates", []):  # which gate was applied, and how it came out
        out.print(line, highlight=False, markup=False, soft_wrap=True)
    for v in summary["verdicts"]:
        if v["status"] == "FAIL" and v.get("message"):
            out.print(f"FAIL {v['message']}", highlight=False, markup=False, soft_wrap=True)
    if "baseline" in summary:
        for d in summary["baseline"].get("diverged", [])[:10]:
            out.print(f"  doc {d['doc_id']}: texts differ from character {d['first_diff_char']} of {d['length']}",
                      highlight=False)
    if summary["status"] == "UNGATED":
        err.print(f"warning: no expected accuracy for model '{summary['model']}' in {expected_file}: not gated",
                  style="yellow")


@app.command("eval")
@topology_command
def eval_(
    topology: Annotated[Path | None, typer.Argument(help="topology to bring up (or --url)")] = None,
    url: Annotated[str | None, typer.Option(help="running P/D proxy URL instead of a topology")] = None,
    baseline: Annotated[str | None, typer.Option(help="aggregated reference URL to compare with; 'auto' "
                                                 "starts one beside the topology")] = None,
    limit: Annotated[int | None, typer.Option(help="evaluate the first N test rows")] = None,
    num_fewshot: Annotated[int, typer.Option(help="few-shot examples per prompt")] = 5,
    concurrency: Annotated[int, typer.Option(help="requests in flight; above 1, batches differ between the P/D "
                                             "and baseline runs and so does float rounding: per-sample "
                                             "agreement is exact only at 1")] = 1,
    data_dir: Annotated[Path | None, typer.Option(help="GSM8K train.jsonl/test.jsonl here instead of the hub")] = None,
    expected: Annotated[Path, typer.Option(help="expected accuracy table")] = Path("configs/expected.yaml"),
    model: Annotated[str | None, typer.Option(help="served model name (with --url)")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="tokenizer path or id (default: the model's path)")] = None,
    min_agreement: Annotated[float | None, typer.Option(help="with a baseline: minimum per-sample agreement "
                                                        "(default: expected.yaml's relative gate, else 1.0)")]
    = None,
    tolerance: Annotated[float | None, typer.Option(help="with a baseline: maximum |accuracy difference| "
                                                    "(default: expected.yaml's relative gate, else 0.0)")] = None,
    results: Annotated[Path | None, typer.Option(help="results directory")] = None,
    reference_port: Annotated[int, typer.Option(help="port of the reference pdctl starts for --baseline auto")]
    = 8300,
    timeout: Annotated[float, typer.Option(help="seconds to wait for readiness")] = 300.0,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
    overrides: list = (),
) -> None:
    """Accuracy gate: lm-eval's gsm8k through the P/D proxy, against configs/expected.yaml.

    Runs lm-eval's `local-completions` model (tokenized requests off) with gsm8k's strict-match and
    flexible-extract filters. With --data-dir, the dataset is read from local jsonl files (same prompts, few-shot
    source and answer extraction: the task is lm-eval's own gsm8k config); else $GSM8K_DIR, else a cached copy of
    openai/gsm8k, else the hub; with none of them it stops before anything starts.

    The gate is expected.yaml's for the model: absolute (accuracy within rtol of a known value) and/or relative
    (per-sample agreement and accuracy delta against an aggregated reference, for a model whose accuracy says
    nothing, like the random tiny one). --baseline URL|auto evaluates an aggregated reference too (any model:
    agreement >= --min-agreement, |delta| <= --tolerance). A model with a relative gate needs a baseline: with a
    TOPOLOGY pdctl starts one beside it (as --baseline auto); with --url, give --baseline URL. The topology runs
    with proxy.on_prefill_down=reject and connector.kv_load_failure_policy=fail (unless set on the command line):
    a fallback never counts as P/D. Exit 1 on FAIL; a model expected.yaml does not know is UNGATED, never PASS.

    Examples:

      pdctl eval configs/cpu-demo.yaml --data-dir ../shared/data/gsm8k --limit 20 --baseline auto

      pdctl eval --url http://127.0.0.1:8000 --model Qwen/Qwen3-0.6B --tokenizer Qwen/Qwen3-0.6B
    """
    import os
    import time as _time

    from pdctl.gates import accuracy, gsm8k
    from pdctl.gates import gated as gated_mod

    try:
        table = accuracy.load_expected(expected) if expected.is_file() else {}
    except (ValueError, OSError) as e:
        raise UserError(str(e)) from None
    if not expected.is_file():
        err.print(f"warning: {expected} not found: nothing is gated", style="yellow")
    if topology is None and not url:
        raise UserError("give a TOPOLOGY, or --url of a running P/D proxy")
    if topology is None and baseline == "auto":
        raise UserError("--baseline auto needs a TOPOLOGY; with --url give the reference's URL")
    try:  # before anything starts: a bring-up of minutes must not end in lm-eval's ConnectionError
        source = gsm8k.data_source(data_dir)
    except gsm8k.DataError as e:
        raise UserError(str(e)) from None
    data_dir = source.data_dir
    os.environ.update(source.env)
    err.print(f"GSM8K: {source.detail}", highlight=False, markup=False)
    stamp = _time.strftime("%Y%m%d-%H%M%S")

    def evaluate(proxy_url: str, ref_url: str | None, name: str, tok: str | None, out_dir: Path) -> int:
        with err.status(f"lm-eval gsm8k via P/D {proxy_url}" + (f" and the reference {ref_url}" if ref_url else "")
                        + f" (limit {limit}) ..."):
            summary = accuracy.run_gate(proxy_url, ref_url, name, out_dir, table, tokenizer=tok, limit=limit,
                                        num_fewshot=num_fewshot, concurrency=concurrency, data_dir=data_dir,
                                        min_agreement=min_agreement, tolerance=tolerance)
        if json_:
            print(json.dumps(summary, indent=2))
        else:
            _render_accuracy(summary, str(expected))
            out.print(f"{summary['status']}  (results: {out_dir})", highlight=False)
        return 1 if summary["status"] == "FAIL" else 0

    if topology is None:
        from pdctl.launch import probe

        name = model or json.loads(probe.http_get(url.rstrip("/") + "/v1/models")[1])["data"][0]["id"]
        if accuracy.needs_baseline(table, name) and not baseline:
            raise UserError(f"model '{name}' has a relative gsm8k gate in {expected} (per-sample agreement and "
                            "accuracy delta against an aggregated reference): give --baseline URL of an aggregated "
                            "server of the same model, or a TOPOLOGY (pdctl then starts one)")
        st = _state_or_exit(None, state_dir)[1] if state_dir is not None else None
        warning = (gated_mod.running_warning(st.plan.topology) if st is not None else
                   "note: a running system's proxy.on_prefill_down and connector.kv_load_failure_policy are its "
                   "own (give --state-dir to have them checked); the proxy's fallback counter still fails the gate")
        if warning:
            err.print(warning, style="yellow", markup=False, highlight=False)
        out_dir = results or Path("results") / f"eval-{stamp}"
        raise typer.Exit(evaluate(url, baseline, name, tokenizer, out_dir))

    overrides, applied, kept = gated_mod.gated(overrides)
    loaded = _load(topology, overrides)
    for line in gated_mod.gated_lines(applied, kept):
        if line:
            err.print(line, style="yellow" if line.startswith("warning") else None, markup=False, highlight=False)
    t = loaded.topology
    if accuracy.needs_baseline(table, t.model.name) and not baseline:
        # The gate cannot be judged without the reference, and the topology says how to start one.
        baseline = "auto"
        err.print(f"model '{t.model.name}' has a relative gsm8k gate in {expected}: starting an aggregated "
                  "reference beside the topology to compare with (as --baseline auto)", highlight=False, markup=False)
    p, ref, backend = _plan_with_reference(loaded, state_dir, reference_port if baseline == "auto" else None)
    tok = tokenizer or topo_mod.resolved_model(t, t.decode[0], loaded.base_dir)
    out_dir = results or Path("results") / f"eval-{t.name}-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "topology.json").write_text(json.dumps(p.topology, indent=2))
    with _brought_up(p, backend, timeout, f"bringing up {p.name}{' and an aggregated reference' if ref else ''} ..."):
        code = evaluate(p.get("proxy").http_url, ref.http_url if ref else baseline, t.model.name, tok, out_dir)
    raise typer.Exit(code)


@app.command()
@topology_command
def bench(
    topology: TopologyArg,
    skip_check: Annotated[bool, typer.Option(help="skip the parity gate")] = False,
    skip_eval: Annotated[bool, typer.Option(help="skip the accuracy gate")] = False,
    skip_perf: Annotated[bool, typer.Option(help="skip the load benchmark")] = False,
    results: Annotated[Path | None, typer.Option(help="results directory")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="GSM8K train.jsonl/test.jsonl here instead of the hub")] = None,
    limit: Annotated[int | None, typer.Option(help="gsm8k rows to evaluate")] = 20,
    expected: Annotated[Path, typer.Option(help="expected accuracy table")] = Path("configs/expected.yaml"),
    requests: Annotated[int, typer.Option(help="load benchmark: requests per side")] = 32,
    prompt_len: Annotated[int, typer.Option(help="load benchmark: prompt tokens")] = 256,
    max_tokens: Annotated[int, typer.Option(help="load benchmark: output tokens")] = 32,
    concurrency: Annotated[int, typer.Option(help="load benchmark: requests in flight")] = 4,
    request_rate: Annotated[float | None, typer.Option(help="load benchmark in open loop: Poisson arrivals at "
                                                       "this many requests/s (as vllm bench serve)")] = None,
    eval_concurrency: Annotated[int, typer.Option(help="accuracy gate: requests in flight (1 keeps per-sample "
                                                  "agreement exact)")] = 1,
    reference_port: Annotated[int, typer.Option(help="port of the aggregated reference")] = 8300,
    timeout: Annotated[float, typer.Option(help="seconds to wait for readiness")] = 300.0,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
    overrides: list = (),
) -> None:
    """The whole job in one command: up -> parity check -> accuracy gate -> load benchmark -> down.

    Brings the topology up beside an aggregated reference, runs `pdctl check`'s parity gate, `pdctl eval`'s
    accuracy gate (P/D and reference, per-sample agreement), then the same streaming load against both (TTFT,
    TPOT, ITL, end-to-end p50/p99, throughput, NIXL transfer time and bytes) and reports P/D / aggregated ratios.
    Exit 1 if a gate failed. Every artefact, with the resolved topology, lands under --results.

    The accuracy gate is expected.yaml's for the model (absolute and/or relative to the reference). GSM8K comes
    from --data-dir, else $GSM8K_DIR, else a cached openai/gsm8k, else the hub: with none, it stops before
    anything starts. The topology runs with proxy.on_prefill_down=reject and connector.kv_load_failure_policy=fail
    (unless set on the command line): a fallback never counts as P/D.

    Examples:

      pdctl bench configs/cpu-demo.yaml --decode-block-size 128 --data-dir ../shared/data/gsm8k

      pdctl bench configs/qwen3-0.6b-cuda-d64.yaml --decode-block-size 64 --limit 256
    """
    import os
    import time as _time

    from pdctl.bench.run import BenchOptions, run_bench
    from pdctl.gates import accuracy, gsm8k
    from pdctl.gates import gated as gated_mod
    from pdctl.launch import run as run_mod

    try:
        table = accuracy.load_expected(expected) if expected.is_file() else {}
    except (ValueError, OSError) as e:
        raise UserError(str(e)) from None
    try:  # before anything starts: a bring-up of minutes must not end in lm-eval's ConnectionError
        if not skip_eval:
            source = gsm8k.data_source(data_dir)
            data_dir = source.data_dir
            os.environ.update(source.env)
            err.print(f"GSM8K: {source.detail}", highlight=False, markup=False)
        elif data_dir is not None:  # the parity gate's GSM8K prompts
            data_dir = gsm8k.check_dir(data_dir).data_dir
    except gsm8k.DataError as e:
        raise UserError(str(e)) from None
    overrides, applied, kept = gated_mod.gated(overrides)
    loaded = _load(topology, overrides)
    for line in gated_mod.gated_lines(applied, kept):
        if line:
            err.print(line, style="yellow" if line.startswith("warning") else None, markup=False, highlight=False)
    t = loaded.topology
    p, ref, backend = _plan_with_reference(loaded, state_dir, reference_port)
    out_dir = results or Path("results") / f"bench-{t.name}-{_time.strftime('%Y%m%d-%H%M%S')}"
    opts = BenchOptions(skip_check, skip_eval, skip_perf, data_dir, limit, 5, table, requests, prompt_len,
                        max_tokens, concurrency, timeout, eval_concurrency, request_rate)
    t0 = _time.monotonic()
    with err.status("bench ...") as status:
        def phase(text: str) -> None:
            status.update(f"[{_time.monotonic() - t0:5.0f} s] {text} ...")
            err.print(f"[{_time.monotonic() - t0:5.0f} s] {text}", highlight=False)

        try:
            summary = run_bench(loaded, p, ref, backend, out_dir, opts, phase)
        except run_mod.LaunchFailed as e:
            _launch_failed(e)
            raise typer.Exit(1) from None
    if json_:
        print(json.dumps(summary, indent=2))
    else:
        _render_bench(summary, str(expected), out_dir)
    raise typer.Exit(1 if summary["status"] == "FAIL" else 0)


def _render_bench(s: dict, expected_file: str, out_dir: Path) -> None:
    if "accuracy" in s:
        _render_accuracy(s["accuracy"], expected_file)
    if "perf" in s:
        pd, agg, r = s["perf"]["pd"], s["perf"]["aggregated"], s["perf"]["ratio"]
        t = Table(title="load: P/D vs aggregated (ms; p50 / p99)")
        for col in ("", "TTFT", "TPOT", "ITL", "end-to-end", "req/s", "out tok/s", "errors"):
            t.add_column(col)
        rows = [("P/D", pd), ("aggregated", agg)] + [(f"pair {x['prefill_pool']} -> {x['decode_pool']}", x)
                                                       for x in s["perf"].get("pairs", [])]
        for name, x in rows:
            t.add_row(name, f"{x['ttft_ms_p50']:.1f} / {x['ttft_ms_p99']:.1f}",
                      f"{x['tpot_ms_p50']:.1f} / {x['tpot_ms_p99']:.1f}",
                      f"{x['itl_ms_p50']:.1f} / {x['itl_ms_p99']:.1f}",
                      f"{x['e2e_ms_p50']:.0f} / {x['e2e_ms_p99']:.0f}", f"{x['req_per_s']:.2f}",
                      f"{x['out_tok_per_s']:.1f}", str(x["errors"]))
        t.add_row("P/D / aggregated", f"{r['ttft_ms_p50']:.2f}x", f"{r['tpot_ms_p50']:.2f}x", f"{r['itl_ms_p50']:.2f}x",
                  f"{r['e2e_ms_p50']:.2f}x", f"{r['req_per_s']:.2f}x", f"{r['out_tok_per_s']:.2f}x", "")
        out.print(t)
        if pd.get("kv_bytes") is not None:
            out.print(f"KV transfer (decode metrics): {pd['kv_bytes'] / 2**20:.1f} MiB in "
                      f"{1e3 * (pd['kv_xfer_s'] or 0):.1f} ms of NIXL transfer time", highlight=False)
    summary = Table(title=f"bench {s['pools']}")
    for col in ("gate", "result", "detail"):
        summary.add_column(col)
    if "parity" in s:
        pz = s["parity"]
        summary.add_row("parity", pz["status"], f"{100 * pz['pass_rate']:.0f}% of {pz['prompts']} prompts, KV "
                        + ("travelled" if pz["kv_travelled"] else "did NOT travel"))
    if "accuracy" in s:
        a = s["accuracy"]
        measured = {v["metric"]: v["measured"] for v in a["verdicts"]}  # absolute and relative rows: one value
        detail = f"{a.get('gate', 'absolute')} gate: " + ", ".join(f"{m} {_fmt(x, '.3f')}" for m, x in
                                                                  measured.items())
        if "baseline" in a:
            b = a["baseline"]
            detail += f"; agreement {b.get('agreed', round(b['agreement'] * b['samples']))}/{b['samples']}"
        summary.add_row("accuracy", a["status"], detail)
    if "perf" in s:
        r = s["perf"]["ratio"]
        summary.add_row("load", s["perf"]["status"], f"TTFT {r['ttft_ms_p50']:.2f}x, TPOT {r['tpot_ms_p50']:.2f}x "
                        "of aggregated (p50)")
    summary.add_row("overall", s["status"], f"time to ready {s['time_to_ready_s']:.0f} s; results {out_dir}")
    out.print(summary)


@app.command()
def sweep(
    topology: TopologyArg,
    matrix: Annotated[Path, typer.Option(help="YAML with `cases:`, each a name plus bench overrides")],
    results: Annotated[Path | None, typer.Option(help="results directory (reuse it to resume)")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="GSM8K train.jsonl/test.jsonl here instead of the hub")] = None,
    limit: Annotated[int | None, typer.Option(help="gsm8k rows to evaluate per case")] = 20,
    expected: Annotated[Path, typer.Option(help="expected accuracy table")] = Path("configs/expected.yaml"),
    requests: Annotated[int, typer.Option(help="load benchmark: requests per side")] = 32,
    concurrency: Annotated[int, typer.Option(help="load benchmark: requests in flight")] = 4,
    request_rate: Annotated[float | None, typer.Option(help="load benchmark in open loop: Poisson arrivals at "
                                                       "this many requests/s (as vllm bench serve)")] = None,
    eval_concurrency: Annotated[int, typer.Option(help="accuracy gate: requests in flight (1 keeps per-sample "
                                                  "agreement exact)")] = 1,
    skip_check: Annotated[bool, typer.Option(help="skip the parity gate")] = False,
    skip_eval: Annotated[bool, typer.Option(help="skip the accuracy gate")] = False,
    skip_perf: Annotated[bool, typer.Option(help="skip the load benchmark")] = False,
    reference_port: Annotated[int, typer.Option(help="port of the aggregated reference")] = 8300,
    timeout: Annotated[float, typer.Option(help="seconds to wait for readiness")] = 300.0,
) -> None:
    """`pdctl bench` for every case of a matrix: one table, sweep.json, sweep.md and PNG plots.

    Resumable: a case whose summary.json exists under --results is kept, so rerunning an interrupted sweep with
    the same --results continues where it stopped. A case the topology rules refuse is reported as REFUSED.

    Examples:

      pdctl sweep configs/cpu-demo.yaml --matrix configs/cpu-matrix.yaml --data-dir ../shared/data/gsm8k

      pdctl sweep configs/qwen3-0.6b-cuda-d64.yaml --matrix configs/upstream-matrix.yaml --results results/pr26759
    """
    import time as _time

    from pydantic import ValidationError

    from pdctl.bench import sweep as sweep_mod
    from pdctl.bench.run import BenchOptions, run_bench
    from pdctl.gates import accuracy
    from pdctl.launch import run as run_mod

    try:
        m = sweep_mod.load_matrix(matrix)
    except (OSError, ValidationError, ValueError) as e:
        raise UserError(f"{matrix}: {e}") from None
    out_dir = results or Path("results") / f"sweep-{matrix.stem}"
    try:
        table = accuracy.load_expected(expected) if expected.is_file() else {}
    except ValueError as e:
        raise UserError(str(e)) from None

    def run_case(case, case_dir: Path) -> dict:
        base = {"prefill_block": case.prefill_block_size, "decode_block": case.decode_block_size,
                "prefill_tp": case.prefill_tp, "decode_tp": case.decode_tp}
        try:
            loaded = topo_mod.load_topology(topology, case.overrides())
        except topo_mod.TopologyError as e:
            return {**base, "status": "REFUSED", "error": e.render()}
        try:
            p, ref, backend = _plan_with_reference(loaded, None, reference_port)
            opts = BenchOptions(skip_check, skip_eval, skip_perf, data_dir, limit, 5, table, requests, 256, 32,
                                concurrency, timeout, eval_concurrency, request_rate)
            return run_bench(loaded, p, ref, backend, case_dir, opts,
                             lambda text: err.print(f"  {case.name}: {text}", highlight=False))
        except (run_mod.LaunchFailed, UserError, RuntimeError) as e:
            return {**base, "status": "FAIL", "error": str(e)}

    t0 = _time.monotonic()
    rows = sweep_mod.run_sweep(m, out_dir, run_case, lambda c, state: err.print(
        f"[{_time.monotonic() - t0:5.0f} s] case {c.name}: {state}", highlight=False))
    t = Table(title=f"sweep {matrix} ({out_dir})")
    shown = [sweep_mod.row(r) for r in rows]
    for col in (c for c in shown[0] if c != "error"):
        t.add_column(col)
    for r in shown:
        t.add_row(*("-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
                    for k, v in r.items() if k != "error"))
    out.print(t)
    out.print(f"reports: {out_dir / 'sweep.md'}, {out_dir / 'sweep.json'}, {out_dir / 'accuracy.png'}, "
              f"{out_dir / 'latency.png'}", highlight=False)
    raise typer.Exit(1 if any(r.get("status") == "FAIL" for r in rows) else 0)


# ----------------------------------------------------------------------------------------------------------------


def main() -> None:
    try:
        app(standalone_mode=True)
    except topo_mod.TopologyError as e:
        err.print(e.render(), markup=False, highlight=False)
        sys.exit(1)
    except UserError as e:
        err.print(f"error: {e}", markup=False, highlight=False)
        sys.exit(1)
