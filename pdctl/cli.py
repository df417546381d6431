"""pdctl's command line: parse, call one function of the Python API (pdctl.api), render (pdctl.render)."""

import functools
import inspect
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from pdctl import api, render
from pdctl import topology as topo_mod
from pdctl.api import UserError

app = typer.Typer(
    name="pdctl",
    help="Orchestrate vLLM prefill/decode disaggregation across heterogeneous hardware.\n\n"
    "Prefill and decode may differ in KV block size (either direction), TP and cache layout.\n\n"
    "Quick tour:\n\n"
    "  pdctl model tiny .pdctl/models/tiny\n\n"
    "  pdctl validate configs/cpu-demo.yaml\n\n"
    "  pdctl plan configs/cpu-demo.yaml --set decode.block_size=128 --json",
    no_args_is_help=True, rich_markup_mode="rich", pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
model_app = typer.Typer(help="Build models for tests and demos.", no_args_is_help=True)
app.add_typer(model_app, name="model")
render_app = typer.Typer(help="Render a topology for systems pdctl does not run itself.", no_args_is_help=True)
app.add_typer(render_app, name="render")

out = render.stdout_console()
err = Console(stderr=True, soft_wrap=True)


def say(line: str | None) -> None:
    """A line for the user on stderr (warnings in yellow)."""
    if line:
        err.print(line, style="yellow" if line.startswith("warning") else None, markup=False, highlight=False)


# ----------------------------------------------------------------------------------------------------------------
# Shared options


def _options(cls, values: dict, **extra):
    """Options (a dataclass) from a command's parameters of the same names, plus `extra`."""
    names = set(cls.__dataclass_fields__) - set(extra)
    return cls(**{k: v for k, v in values.items() if k in names}, **extra)


SetOpt = Annotated[list[str], typer.Option("--set", help="override any field: dotted.path=value (repeatable), e.g. "
                                           "--set decode.block_size=128")]


def topology_command(fn):
    """Give a command --set; it receives the overrides as `overrides: list[Override]`."""
    sig = inspect.signature(fn)
    set_ = inspect.Parameter("set_", inspect.Parameter.KEYWORD_ONLY, default=[], annotation=SetOpt)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        kwargs["overrides"] = [topo_mod.Override.parse_set(s) for s in kwargs.pop("set_")]
        return fn(*args, **kwargs)

    params = [p for p in sig.parameters.values() if p.name != "overrides"]
    wrapper.__signature__ = sig.replace(parameters=[*params, set_])
    wrapper.__annotations__ = {**{p.name: p.annotation for p in [*params, set_]}, "return": None}
    return wrapper


TopologyArg = Annotated[Path, typer.Argument(help="topology YAML", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
OutputOpt = Annotated[render.Output, typer.Option("--output", "-o", help="default: the columns that matter, fitting 80 "
                      "columns; wide: every column; json or yaml (--json = -o json)")]
StateDirOpt = Annotated[Path | None, typer.Option("--state-dir", help="default: .pdctl/<name>")]
NameArg = Annotated[str | None, typer.Argument(help="topology name (default: the only one that is up)")]
TimeoutOpt = Annotated[float, typer.Option(help="seconds to wait for readiness")]
ExpectedOpt = Annotated[Path | None, typer.Option(help="expected-accuracy table (default: pdctl's own)")]
AllowUngatedOpt = Annotated[bool, typer.Option(help="a model the table does not know passes (UNGATED), not fails")]
DataDirOpt = Annotated[Path | None, typer.Option(help="GSM8K train.jsonl/test.jsonl here instead of the hub")]
SkipOpt = Annotated[str | None, typer.Option(help="phases not to run, comma-separated: check (parity gate), eval "
                                             "(accuracy gate), perf (load benchmark)")]
DatasetOpt = Annotated[str, typer.Option(help="load benchmark: vLLM's random, prefix_repetition, sharegpt:FILE (a "
                                          "ShareGPT JSON) or custom:FILE (JSONL, a prompt per line)")]


def _load(path: Path, overrides: list, gated: bool = False):
    t = api.load(path, overrides, gated=gated)
    for w in api.warnings(t):
        err.print(w, markup=False, highlight=False, style="yellow")
    return t


# ----------------------------------------------------------------------------------------------------------------
# Topology


@app.command()
@topology_command
def validate(topology: TopologyArg, json_: JsonOpt = False, overrides: list = ()) -> None:
    """Check a topology against every compatibility rule, before anything starts.

    Exit 0 when valid, 1 with every problem (file:line, field, how to fix) otherwise.

    Examples:

      pdctl validate configs/cpu-demo.yaml

      pdctl validate configs/cpu-demo.yaml --set prefill.block_size=64 --set decode.block_size=32

      pdctl validate configs/cpu-demo.yaml --set connector.kind=nixl --json
    """
    try:
        t = _load(topology, overrides)
    except topo_mod.TopologyError as e:
        if not json_:
            raise
        out.print_json(json.dumps({"ok": False, "file": str(topology), "problems": [
            {"path": ".".join(map(str, p.path)), "where": e.source.describe(p).split(": ", 1)[0],
             "message": p.message, "hint": p.hint} for p in e.problems]}))
        raise typer.Exit(1) from None
    summary = topo_mod.summary(t)
    if json_:
        out.print_json(json.dumps({"ok": True, "file": str(topology), "summary": summary}))
    else:
        out.print(f"[green]valid[/green] {summary}", highlight=False, soft_wrap=True)

BaselineOpt = Annotated[bool, typer.Option(help="bench --goodput's aggregated baseline on the same devices")]
SloOpt = Annotated[str, typer.Option(help="--goodput: ttft=MS,tpot=MS, or auto")]
RatesOpt = Annotated[str | None, typer.Option(help="offered req/s: --goodput's rates, e.g. 2,4,8 [bench: a search]; "
                                               "else one rate: the load in open loop (Poisson), not --concurrency")]
RepeatOpt = Annotated[int, typer.Option(help="--goodput: interleaved repetitions (median)")]

@app.command()
@topology_command
def plan(topology: TopologyArg, json_: JsonOpt = False, output: OutputOpt = render.Output.default,
         state_dir: StateDirOpt = None, baseline: BaselineOpt = False, overrides: list = ()) -> None:
    """Show the exact processes `pdctl up` would start: argv, env, ports, log, readiness URL.

    Examples:

      pdctl plan configs/cpu-demo.yaml

      pdctl plan configs/qwen3-0.6b-cuda.yaml --set decode.tp=2 --json

      pdctl plan configs/cpu-slurm.yaml --set engine.kind=slurm -o wide
    """
    p = api.plan(_load(topology, overrides), state_dir=state_dir, baseline=baseline)
    render.plan(out, p, render.Output.json if json_ else output, api.slurm_batch(p))


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
    written = api.render_k8s(_load(topology, overrides), out_dir, image=image or None, namespace=namespace,
                             validate=validate_)
    checked = " (validated with kubernetes-validate --strict)" if validate_ else ""
    out.print(f"wrote {len(written)} manifests to {out_dir}{checked}", highlight=False)


@model_app.command("tiny")
def model_tiny(
    out_dir: Annotated[Path, typer.Argument(help="directory to write the model to")],
    seed: Annotated[int, typer.Option(help="same seed, same weights and tokenizer")] = 0,
    force: Annotated[bool, typer.Option(help="rebuild even if DIR already holds this seed's model")] = False,
    hybrid: Annotated[bool, typer.Option(help="4 layers: sliding-window and full attention in turn")] = False,
    window: Annotated[int, typer.Option(min=1, help="with --hybrid: the sliding window, in tokens")] = 96,
) -> None:
    """Build a tiny random-weight Llama (2 layers, 2 KV heads, ~2k BPE vocab) offline, in seconds.

    Examples:

      pdctl model tiny .pdctl/models/tiny

      pdctl model tiny .pdctl/models/tiny-hybrid --hybrid --window 96
    """
    fingerprint = api.tiny_model(out_dir, seed=seed, force=force, say=say, window=window if hybrid else None)
    out.print(f"built {out_dir} (seed {seed}, fingerprint {fingerprint})" if fingerprint else
              f"tiny model already at {out_dir} (seed {seed}); --force rebuilds", highlight=False)


# ----------------------------------------------------------------------------------------------------------------
# Launch and supervise


@app.command()
@topology_command
def up(
    topology: TopologyArg,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="return once ready; `pdctl down` stops it")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for every instance to be ready")] = 300.0,
    state_dir: StateDirOpt = None,
    monitoring: Annotated[bool, typer.Option(
        help="also run Prometheus (monitoring.enabled; docs/operations.md)")] = False,
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

      pdctl up -d configs/cpu-demo.yaml --set decode.block_size=128 --state-dir /tmp/demo128
    """
    t = _load(topology, [*overrides, topo_mod.MONITORING_ON] if monitoring else overrides)
    d = None
    try:
        with render.live_progress(err) as on_progress:
            d = api.up(t, detach=detach, timeout_s=timeout, state_dir=state_dir, on_progress=on_progress)
        with d:  # in the foreground, whatever ends this block early (Ctrl-C before supervision) stops everything
            where = "" if d.engine.name == "local" else f"  engine {d.engine.name}"
            out.print(f"[green]ready[/green]: {d.name}  proxy {d.proxy_url}  state {d.state_dir}{where}",
                      highlight=False)
            for note in d.notes:
                (out.print if note.startswith(("supervisor", "monitoring")) else say)(note)
            if detach:
                return
            out.print("attached: supervising (restarts failed instances); Ctrl-C stops everything", highlight=False)
            how = d.supervise(say=lambda msg: err.print(msg, markup=False, highlight=False))
    except KeyboardInterrupt:
        err.print("interrupted: " + ("the topology stays up (pdctl down stops it)" if d and not d.attached else
                                     "every process was stopped"))
        raise typer.Exit(130) from None
    if how == "settled":
        err.print("[red]every instance is down and none will be restarted[/red]", highlight=False)
    err.print("stopped every process", highlight=False)
    raise typer.Exit({"settled": 1, "interrupted": 130}.get(how, 0))


@app.command()
def down(name: NameArg = None, state_dir: StateDirOpt = None,
         grace: Annotated[float, typer.Option(help="seconds between SIGTERM and SIGKILL")] = 15.0) -> None:
    """Stop every process of a launched topology (SIGTERM to each process group, SIGKILL after --grace).

    Idempotent: a topology that is not up, or whose processes are already gone, is reported, not an error.

    Examples:

      pdctl down cpu-demo

      pdctl down --state-dir /tmp/demo128
    """
    render.down(out, api.down(name, state_dir=state_dir, grace_s=grace))


@app.command()
def status(name: NameArg = None, state_dir: StateDirOpt = None, json_: JsonOpt = False,
           output: OutputOpt = render.Output.default, watch: Annotated[bool, typer.Option(
               "--watch", "-w", help="redraw every --interval seconds; Ctrl-C to leave")] = False,
           interval: Annotated[float, typer.Option(min=0.2, help="seconds between --watch redraws")] = 2.0) -> None:
    """One row per instance: name, pool, host:port, block size, TP, health, restarts, KV usage (-o wide adds
    where, pid, side channel, uptime, requests running/waiting); then the supervisor, and for each instance that
    ended once, how (signal or exit code) and its log's root-cause line.

    Examples:

      pdctl status

      pdctl status cpu-demo -o wide --watch
    """
    d, output = api.attach(name, state_dir=state_dir), render.Output.json if json_ else output
    if watch and output in (render.Output.json, render.Output.yaml):
        raise UserError(f"--watch redraws the table: it does not go with -o {output.value} (or --json)")
    if watch:
        return render.watch(out, lambda: render.status_view(out, d.status(), output), interval)
    render.status(out, d.status(), output)


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
    d = api.attach(name, state_dir=state_dir)
    tails = d.logs(which, lines)
    for n, text in tails.items():
        if len(tails) > 1:
            out.print(f"==> {n} ({d.plan.get(n).log_path}) <==", highlight=False)
        print("\n".join(text))
    if follow:
        try:
            for n, line in d.follow(which):
                print(f"{n}| {line}" if len(tails) > 1 else line, end="", flush=True)
        except KeyboardInterrupt:
            pass


@app.command()
def proxy(
    decode: Annotated[list[str] | None, typer.Option("--decode", help="decode [POOL=]URL (repeatable)")] = None,
    prefill: Annotated[list[str] | None, typer.Option("--prefill", help="prefill [POOL=]URL (repeatable; none: "
                                                      "aggregated, each request to one --decode)")] = None,
    spec: Annotated[str | None, typer.Option(help="the whole configuration as JSON (what pdctl up writes); "
                                             "instead of every other flag")] = None,
    host: Annotated[str | None, typer.Option(help="listen address [127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="listen port [8000]")] = None,
    policy: Annotated[str | None, typer.Option(help="least_outstanding|round_robin|prefix_affinity")] = None,
    weight: Annotated[list[str] | None, typer.Option("--weight", help="ROLE/POOL=W: a pool's share of traffic "
                                              "(repeatable)")] = None,
    exclude_pair: Annotated[list[str] | None, typer.Option("--exclude-pair", help="PREFILL_POOL/DECODE_POOL never "
                                                    "routed (repeatable)")] = None,
    affinity_epsilon: Annotated[float | None, typer.Option(help="prefix_affinity: skip an instance above (1 + "
                                                           "eps) x the mean outstanding + 1 [0.25]")] = None,
    affinity_prefix_chars: Annotated[int | None, typer.Option(help="prefix_affinity: prompt characters hashed "
                                                              "[256]")] = None,
    on_prefill_down: Annotated[str | None, typer.Option(help="no prefill answers with usable KV: fallback (a "
                                                        "decode computes the prompt, counted) | reject")] = None,
    connect_timeout: Annotated[float | None, typer.Option(help="upstream connect timeout, s [10]")] = None,
    first_byte_timeout: Annotated[float | None, typer.Option(help="request sent -> first byte, s [600]")] = None,
    read_timeout: Annotated[float | None, typer.Option(help="upstream read timeout between bytes, s [600]")] = None,
    breaker_failures: Annotated[int | None, typer.Option(help="consecutive failures that open an instance's "
                                                         "circuit breaker [3]")] = None,
    breaker_open: Annotated[float | None, typer.Option(help="seconds a tripped instance stays out [10]")] = None,
    access_log: Annotated[bool | None, typer.Option(help="one log line per request [on]")] = None,
    api_key_env: Annotated[str | None, typer.Option(help="require the key this environment variable holds "
                                                    "(Bearer, on /v1/*) and send it to the instances")] = None,
    handover: Annotated[list[str] | None, typer.Option("--handover", help="early decode: each decode's hand-over "
                                                       "socket, one per --decode in its order")] = None,
    first_token: Annotated[str | None, typer.Option(help="off | on | auto: stream the prefill's token first "
                                                    "(greedy streams; auto: while the decode is busy)")] = None,
) -> None:
    """Run the P/D proxy standalone (pdctl up starts it from the topology, with --spec).

    Each request goes to a prefill, then to a decode of a pool allowed for that prefill's pool. The header
    `x-pdctl-route: PREFILL_POOL/DECODE_POOL` pins the pair; the response says which instances served it
    (`x-pdctl-prefill`, `x-pdctl-decode`). Without --prefill, aggregated serving over the --decode servers.

    Examples:

      pdctl proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

      pdctl proxy --prefill http://p0:8100 --prefill http://p1:8100 --decode http://d0:8200 --policy round_robin

      pdctl proxy --prefill p32=http://h:8100 --prefill p128=http://h:8101 --decode d64=http://h:8200 \\
        --decode d32=http://h:8201 --exclude-pair p128/d32 --weight decode/d64=2 --policy prefix_affinity
    """
    api.serve_proxy(prefill, decode, spec=spec, host=host, port=port, policy=policy,
                    on_prefill_down=on_prefill_down, connect_timeout_s=connect_timeout,
                    read_timeout_s=read_timeout, first_byte_timeout_s=first_byte_timeout,
                    breaker_failures=breaker_failures, breaker_open_s=breaker_open,
                    weights=api.proxy_weights(weight) if weight else None,
                    exclude_pairs=api.proxy_pairs(exclude_pair) if exclude_pair else None,
                    affinity_epsilon=affinity_epsilon, handovers=handover, affinity_prefix_chars=affinity_prefix_chars,
                    access_log=access_log, api_key_env=api_key_env, first_token=first_token)


# ----------------------------------------------------------------------------------------------------------------
# Gates


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
    data_dir: Annotated[Path | None, typer.Option(help="dir with GSM8K test/train.jsonl: adds 5-shot prompts")] = None,
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
    stream: Annotated[bool, typer.Option(help="stream every request and compare the text a client reads "
                                         "(proxy.first_token's path)")] = False,
    timeout: TimeoutOpt = 300.0,
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
    both sides, prompts sharing a prefix with earlier ones, and GSM8K 5-shot prompts with --data-dir. The
    decode's /metrics must show the prompts arrived by KV transfer. Exit 1 on any mismatch or missing transfer.

    Examples:

      pdctl check configs/cpu-demo.yaml

      pdctl check configs/cpu-demo.yaml --set decode.block_size=128 --junit results/parity.xml

      pdctl check configs/cpu-demo.yaml --set decode.tp=2 --set "decode.devices=[0,1]" --reference-first

      pdctl check configs/cpu-demo.yaml --set proxy.first_token=on --stream   # the prefill's token first

      pdctl check --proxy http://127.0.0.1:8000 --reference http://127.0.0.1:8300 --model tiny --json

      pdctl check configs/cpu-fleet.yaml --json     # a fleet: every prefill pool x decode pool pair, pinned

      pdctl check --state-dir .pdctl/cpu-fleet --reference http://127.0.0.1:8300   # a fleet that is up
    """
    try:
        only = [int(n) for n in lengths.split(",")] if lengths else None
    except ValueError:
        raise UserError(f"--lengths {lengths}: expected token counts separated by commas, e.g. 65,129,300") from None
    opts = _options(api.CheckOptions, locals(), timeout_s=timeout, lengths=only)
    if topology is not None:
        target = _load(topology, overrides, gated=True)
    else:  # a topology that is up (`pdctl up -d`), or running servers
        target = api.attach(state_dir=state_dir) if state_dir is not None else None
        opts.state_dir = None
    with err.status("checking ...") as st:
        report = api.check(target, proxy=proxy_url, reference=reference_url, decodes=decode_url, model=model,
                           options=opts, say=say, progress=lambda text: st.update(f"{text} ..."))
    if json_:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render.check(out, report)
    raise typer.Exit(0 if report.passed else 1)


@app.command("eval")
@topology_command
def eval_(
    topology: Annotated[Path | None, typer.Argument(help="topology to bring up (or --proxy)")] = None,
    proxy: Annotated[str | None, typer.Option(help="running P/D proxy URL instead of a topology")] = None,
    reference: Annotated[str | None, typer.Option(help="aggregated reference URL to compare with; 'auto' "
                                                  "starts one beside the topology")] = None,
    limit: Annotated[int | None, typer.Option(help="evaluate the first N test rows")] = None,
    num_fewshot: Annotated[int, typer.Option(help="few-shot examples per prompt")] = 5,
    concurrency: Annotated[int, typer.Option(help="requests in flight; above 1, batches differ between the P/D "
                                             "and reference runs and so does float rounding: per-sample "
                                             "agreement is exact only at 1")] = 1,
    data_dir: DataDirOpt = None,
    expected: ExpectedOpt = None, allow_ungated: AllowUngatedOpt = False,
    model: Annotated[str | None, typer.Option(help="served model name (with --proxy)")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="tokenizer path or id (default: the model's path)")] = None,
    min_agreement: Annotated[float | None, typer.Option(help="with a reference: minimum per-sample agreement "
                                                        "(default: expected.yaml's relative gate, else 1.0)")]
    = None,
    tolerance: Annotated[float | None, typer.Option(help="with a reference: maximum |accuracy difference| "
                                                    "(default: expected.yaml's relative gate, else 0.0)")] = None,
    results: Annotated[Path | None, typer.Option(help="results directory")] = None,
    timeout: TimeoutOpt = 300.0,
    state_dir: StateDirOpt = None,
    json_: JsonOpt = False,
    overrides: list = (),
) -> None:
    """Accuracy gate: lm-eval's gsm8k through the P/D proxy, against an expected-accuracy table (pdctl's own).

    Runs lm-eval's `local-completions` model (tokenized requests off) with gsm8k's strict-match and
    flexible-extract filters. With --data-dir, the dataset is read from local jsonl files (same prompts, few-shot
    source and answer extraction: the task is lm-eval's own gsm8k config); else $GSM8K_DIR, else a cached copy of
    openai/gsm8k, else the hub; with none of them it stops before anything starts.

    The gate is expected.yaml's for the model: absolute (accuracy within rtol of a known value) and/or relative
    (per-sample agreement and accuracy delta against an aggregated reference, for a model whose accuracy says
    nothing, like the random tiny one). --reference URL|auto evaluates an aggregated reference too (any model:
    agreement >= --min-agreement, |delta| <= --tolerance). A model with a relative gate needs a reference: with a
    TOPOLOGY pdctl starts one beside it (as --reference auto); with --proxy, give --reference URL. The topology runs
    with proxy.on_prefill_down=reject and connector.kv_load_failure_policy=fail (unless set on the command line):
    a fallback never counts as P/D. Exit 1 on FAIL, and on UNGATED (a model the table lacks) unless --allow-ungated.

    Examples:

      pdctl eval configs/cpu-demo.yaml --data-dir ../shared/data/gsm8k --limit 20 --reference auto

      pdctl eval --proxy http://127.0.0.1:8000 --model Qwen/Qwen3-0.6B --tokenizer Qwen/Qwen3-0.6B
    """
    opts = _options(api.EvalOptions, locals(), timeout_s=timeout)
    if topology is not None:
        target = _load(topology, overrides, gated=True)
    else:
        target = api.attach(state_dir=state_dir) if state_dir is not None else None
    with err.status("evaluating ...") as st:
        r = api.evaluate(target, proxy=proxy, reference=reference, model=model, options=opts, say=say,
                         progress=lambda text: st.update(f"{text} ..."))
    if json_:
        print(json.dumps(r.summary, indent=2))
    else:
        render.accuracy(out, err, r.summary, expected)
        out.print(f"{r.status}  (results: {r.out_dir})", highlight=False)
    raise typer.Exit(0 if r.passed else 1)


@app.command()
@topology_command
def bench(
    topology: TopologyArg,
    skip: SkipOpt = None,
    results: Annotated[Path | None, typer.Option(help="results directory")] = None,
    data_dir: DataDirOpt = None,
    limit: Annotated[int | None, typer.Option(help="gsm8k rows to evaluate")] = 20,
    expected: ExpectedOpt = None, allow_ungated: AllowUngatedOpt = False,
    requests: Annotated[int | None, typer.Option(help="load: requests per side [32; --goodput: per rate, 200]")] = None,
    prompt_len: Annotated[int | None, typer.Option(help="load: prompt tokens [256; --goodput: 2048]")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="load: output tokens [32; --goodput: 64]")] = None,
    concurrency: Annotated[int, typer.Option(help="load benchmark: requests in flight")] = 4,
    dataset: DatasetOpt = "random",
    breakdown: Annotated[bool, typer.Option(help="follow each P/D request stage by stage (connector.trace)")] = False,
    goodput: Annotated[bool, typer.Option(help="goodput under SLOs, P/D vs aggregated on the same devices")] = False,
    slo: SloOpt = "auto", rates: RatesOpt = None, repeat: RepeatOpt = 3,
    timeout: TimeoutOpt = 300.0, state_dir: StateDirOpt = None, json_: JsonOpt = False,
    overrides: list = (),
) -> None:
    """The whole job in one command: up -> parity check -> accuracy gate -> load benchmark -> down.

    Brings the topology up beside an aggregated reference, runs `pdctl check`'s parity gate, `pdctl eval`'s
    accuracy gate (P/D and reference, per-sample agreement), then the same prompts (--dataset) through vLLM's
    serving benchmark against both (TTFT, TPOT, ITL, end-to-end p50/p99, throughput, NIXL transfer time and bytes),
    with P/D / aggregated ratios. Exit 1 if a gate failed; every artefact (resolved topology too) lands in --results.
    --goodput instead measures the highest request rate at which 90 % of requests meet both SLOs, for the topology
    and for aggregated servers on the same devices (docs/benchmarks.md).

    The accuracy gate is expected.yaml's for the model. GSM8K: --data-dir, else $GSM8K_DIR, else a cached
    openai/gsm8k, else the hub (none: it stops before anything starts). The topology runs with
    proxy.on_prefill_down=reject and connector.kv_load_failure_policy=fail (unless set): a fallback is not P/D.

    Examples:

      pdctl bench configs/cpu-demo.yaml --set decode.block_size=128 --data-dir ../shared/data/gsm8k

      pdctl bench configs/qwen3-0.6b-cuda-d64.yaml --set decode.block_size=64 --limit 256

      pdctl bench configs/cpu-demo.yaml --skip check,eval --breakdown   # where P/D's TTFT goes

      pdctl bench configs/cpu-demo.yaml --skip check,eval --goodput --slo auto   # does P/D pay here?
    """
    opts = _options(api.BenchOptions, locals(), timeout_s=timeout, skip=api.parse_skip(skip),
                    **api.load_rates(rates, goodput), **api.dataset_option(dataset))
    t = _load(topology, overrides, gated=True)
    with err.status("bench ...") as st:
        r = api.bench(t, opts, results=results, say=say, progress=lambda text: st.update(f"{text} ..."))
    if json_:
        print(json.dumps(r.summary, indent=2))
    else:
        render.bench(out, err, r.summary, expected, r.out_dir)
    raise typer.Exit(0 if r.passed else 1)


@app.command()
def sweep(
    topology: TopologyArg,
    matrix: Annotated[Path, typer.Option(help="YAML with `cases:`, each a name and the fields it `set:`s")],
    results: Annotated[Path | None, typer.Option(help="results directory (reuse it to resume)")] = None,
    data_dir: DataDirOpt = None,
    limit: Annotated[int | None, typer.Option(help="gsm8k rows to evaluate per case")] = 20,
    expected: ExpectedOpt = None,
    requests: Annotated[int | None, typer.Option(help="load: requests per side [32; --goodput: per rate, 200]")] = None,
    concurrency: Annotated[int, typer.Option(help="load benchmark: requests in flight")] = 4,
    dataset: DatasetOpt = "random",
    skip: SkipOpt = None, timeout: TimeoutOpt = 300.0,
    goodput: Annotated[bool, typer.Option(help="cases are layouts of the same devices: goodput per layout")] = False,
    slo: SloOpt = "auto", rates: RatesOpt = None, repeat: RepeatOpt = 3, json_: JsonOpt = False,
) -> None:
    """`pdctl bench` for every case of a matrix: one table, sweep.json, sweep.md and PNG plots.

    Resumable: a case whose summary.json exists under --results is kept, so rerunning an interrupted sweep with
    the same --results continues where it stopped. A case the topology rules refuse is reported as REFUSED.

    --goodput: the layout of the topology's devices (each case one) with the highest goodput for the SLO, against
    the baseline, and the SLO at which the answer changes (docs/benchmarks.md).

    Examples:

      pdctl sweep configs/cpu-demo.yaml --matrix configs/cpu-matrix.yaml --data-dir ../shared/data/gsm8k

      pdctl sweep configs/qwen3-0.6b-cuda-d64.yaml --matrix configs/upstream-matrix.yaml --results results/pr26759

      pdctl sweep configs/cpu-fleet.yaml --matrix configs/cpu-fleet-layout-matrix.yaml --goodput --rates 1,2,3,4,6
    """
    opts = _options(api.BenchOptions, locals(), timeout_s=timeout, skip=api.parse_skip(skip),
                    **api.load_rates(rates, goodput), **api.dataset_option(dataset))
    r = api.sweep(topology, matrix, opts, results=results, say=say)
    print(json.dumps(r.to_dict(), indent=2)) if json_ else render.sweep(out, r, matrix)
    raise typer.Exit(0 if r.passed else 1)


# ----------------------------------------------------------------------------------------------------------------


def main() -> None:
    try:
        api.refuse_renamed(sys.argv[1:])
        app(standalone_mode=True)
    except topo_mod.TopologyError as e:
        err.print(e.render(), markup=False, highlight=False)
        sys.exit(1)
    except api.LaunchFailed as e:
        render.launch_failed(err, e)
        sys.exit(1)
    except UserError as e:
        err.print(f"error: {e}", markup=False, highlight=False)
        sys.exit(1)
