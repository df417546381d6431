"""Commands that run and watch a topology: up, down, status, logs, and the proxy by hand."""

from typing import Annotated

import typer

from pdctl import api, render
from pdctl import topology as topo_mod
from pdctl.api import UserError
from pdctl.cli.common import (
    JsonOpt,
    NameArg,
    OutputOpt,
    StateDirOpt,
    TopologyArg,
    app,
    err,
    load_topology,
    out,
    say,
    topology_command,
)


@app.command()
@topology_command
def up(
    topology: TopologyArg,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="return once ready; `pdctl down` stops it")] = False,
    timeout: Annotated[float, typer.Option(help="seconds for every instance to be ready")] = api.READY_TIMEOUT_S,
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

      pdctl up -d configs/cpu-demo.yaml --decode-block-size 128 --state-dir /tmp/demo128
    """
    t = load_topology(topology, [*overrides, topo_mod.MONITORING_ON] if monitoring else overrides)
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
         grace: Annotated[float, typer.Option(help="seconds between SIGTERM and SIGKILL")] = api.STOP_GRACE_S) -> None:
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


PROXY = api.proxy_options()  # field -> (flag, help, default shown): the proxy model's own


def proxy_opt(field: str, more: str = ""):
    """The `pdctl proxy` option of a field of the proxy's model: its flag, description and default."""
    flag, text, shown = PROXY[field]
    return typer.Option(flag, help=(text + more).replace("[", "\\["), show_default=shown or False)


@app.command()
def proxy(
    decode: Annotated[list[str] | None, proxy_opt("decode", more=" (repeatable)")] = None,
    prefill: Annotated[list[str] | None, proxy_opt("prefill", more=" (repeatable)")] = None,
    spec: Annotated[str | None, typer.Option(help="the whole configuration as JSON (pdctl up's), not flags")] = None,
    host: Annotated[str | None, proxy_opt("host")] = None, port: Annotated[int | None, proxy_opt("port")] = None,
    policy: Annotated[str | None, proxy_opt("policy")] = None,
    weights: Annotated[list[str] | None, proxy_opt("weights", more=", as ROLE/POOL=W (repeatable)")] = None,
    exclude_pairs: Annotated[list[str] | None, proxy_opt("exclude_pairs", more=", as P/D")] = None,
    affinity_epsilon: Annotated[float | None, proxy_opt("affinity_epsilon")] = None,
    affinity_prefix_chars: Annotated[int | None, proxy_opt("affinity_prefix_chars")] = None,
    on_prefill_down: Annotated[str | None, proxy_opt("on_prefill_down")] = None,
    connect_timeout_s: Annotated[float | None, proxy_opt("connect_timeout_s", more=", s")] = None,
    first_byte_timeout_s: Annotated[float | None, proxy_opt("first_byte_timeout_s", more=", s")] = None,
    read_timeout_s: Annotated[float | None, proxy_opt("read_timeout_s", more=", s")] = None,
    breaker_failures: Annotated[int | None, proxy_opt("breaker_failures")] = None,
    breaker_open_s: Annotated[float | None, proxy_opt("breaker_open_s", more=", s")] = None,
    health_interval_s: Annotated[float | None, proxy_opt("health_interval_s", more=", s")] = None,
    access_log: Annotated[bool | None, proxy_opt("access_log")] = None,
    api_key_env: Annotated[str | None, typer.Option(help="require the key this environment variable holds "
                                                    "(Bearer, on /v1/*) and send it to the instances")] = None,
    first_token: Annotated[str | None, proxy_opt("first_token")] = None,
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
    settings = {k: v for k, v in locals().items() if k in PROXY and k not in ("prefill", "decode")}
    settings["weights"] = api.proxy_weights(weights) if weights else None
    settings["exclude_pairs"] = api.proxy_pairs(exclude_pairs) if exclude_pairs else None
    api.serve_proxy(prefill, decode, spec=spec, **settings)
