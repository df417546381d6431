"""pdctl's command line: parse, call the library, render. No logic of its own."""


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
    summary = (f"{t.name}: prefill {t.prefill.count}x {t.prefill.platform} block {t.prefill.block_size} "
               f"TP {t.prefill.tp} {t.prefill.kv_layout} -> decode {t.decode.count}x {t.decode.platform} "
               f"block {t.decode.block_size} TP {t.decode.tp} {t.decode.kv_layout}, connector {t.connector.kind}")
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
    """
    loaded = _load(topology, overrides)
    p = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=_state_dir(loaded, state_dir),
                   python=sys.executable)
    if json_:
        print(p.to_json())
        return
    _render_plan(p)


def _render_plan(p: Plan) -> None:
    table = Table(title=f"plan: {p.name}  (state {p.state_dir})", show_lines=False)
    for col in ("process", "platform", "block", "TP", "layout", "HTTP", "side channel", "readiness"):
        table.add_column(col)
    for s in p.processes:
        table.add_row(s.name, s.platform, str(s.block_size or "-"), str(s.tp or "-"), s.kv_layout or "-",
                      f"{s.host}:{s.ports['http']}", str(s.ports.get("side_channel", "-")), s.readiness_url)
    out.print(table)
    for s in p.processes:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in s.env.items())
        out.print(f"\n[bold]{s.name}[/bold]  log: {s.log_path}", highlight=False)
        out.print(f"{env} {shlex.join(s.argv)}", highlight=False, markup=False, soft_wrap=True)


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


def main() -> None:
    try:
        app(standalone_mode=True)
    except topo_mod.TopologyError as e:
        err.print(e.render(), markup=False, highlight=False)
        sys.exit(1)
    except UserError as e:
        err.print(f"error: {e}", markup=False, highlight=False)
        sys.exit(1)
