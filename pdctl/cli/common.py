"""What every command shares: the typer apps, the consoles, the shared options and --set."""

import functools
import inspect
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from pdctl import api, render
from pdctl import topology as topo_mod

app = typer.Typer(
    name="pdctl",
    help="Orchestrate vLLM prefill/decode disaggregation across heterogeneous hardware.\n\n"
    "Prefill and decode may differ in KV block size (either direction), TP and cache layout.\n\n"
    "Quick tour:\n\n"
    "  pdctl model tiny .pdctl/models/tiny\n\n"
    "  pdctl validate configs/cpu-demo.yaml\n\n"
    "  pdctl plan configs/cpu-demo.yaml --decode-block-size 128 --json\n\n"
    "  pdctl bench configs/cpu-demo.yaml --decode-block-size 64 --data-dir ../shared/data/gsm8k",
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


def options_from(cls, values: dict, **extra):
    """Options (a dataclass) from a command's parameters of the same names, plus `extra`."""
    names = set(cls.__dataclass_fields__) - set(extra)
    return cls(**{k: v for k, v in values.items() if k in names}, **extra)


SetOpt = Annotated[list[str], typer.Option("--set", help="override any field: dotted.path=value (repeatable), e.g. "
                                           "--set decode.block_size=128", rich_help_panel="Topology")]

# The role flags (pdctl.topology.ROLE_FLAGS), each exactly its --set: parameter name -> (flag, help).
_ROLE_OPTS = {
    "prefill_block_size": ("--prefill-block-size", "= --set prefill.block_size=N: the prefill's KV block size"),
    "decode_block_size": ("--decode-block-size", "= --set decode.block_size=N: the decode's KV block size"),
    "prefill_tp": ("--prefill-tp", "= --set prefill.tp=N: tensor-parallel size of each prefill instance"),
    "decode_tp": ("--decode-tp", "= --set decode.tp=N: tensor-parallel size of each decode instance"),
}
assert {f for f, _ in _ROLE_OPTS.values()} == set(topo_mod.ROLE_FLAGS)


def topology_command(fn):
    """Give a command --set and the role flags; it receives them as `overrides: list[Override]` (the role flags
    first, in ROLE_FLAGS order, then the --sets in the order given)."""
    sig = inspect.signature(fn)
    extra = [inspect.Parameter("set_", inspect.Parameter.KEYWORD_ONLY, default=[], annotation=SetOpt)]
    extra += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        int | None, typer.Option(flag, help=text + " (every pool of the role)", metavar="N",
                                 rich_help_panel="Topology", show_default=False)])
        for name, (flag, text) in _ROLE_OPTS.items()]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        roles = [topo_mod.Override.from_role_flag(flag, kwargs.pop(name)) for name, (flag, _) in _ROLE_OPTS.items()
                 if kwargs.get(name) is not None]
        kwargs = {k: v for k, v in kwargs.items() if k not in _ROLE_OPTS}
        kwargs["overrides"] = roles + [topo_mod.Override.parse_set(s) for s in kwargs.pop("set_")]
        return fn(*args, **kwargs)

    params = [p for p in sig.parameters.values() if p.name != "overrides"]
    wrapper.__signature__ = sig.replace(parameters=[*params, *extra])
    wrapper.__annotations__ = {**{p.name: p.annotation for p in [*params, *extra]}, "return": None}
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


def load_topology(path: Path, overrides: list, gated: bool = False):
    t = api.load(path, overrides, gated=gated)
    for w in api.warnings(t):
        err.print(w, markup=False, highlight=False, style="yellow")
    return t


def gate_target(topology: Path | None, overrides: list, state_dir: Path | None):
    """What a gate runs against: the TOPOLOGY brought up (loaded as a gate runs it), else the topology up in
    --state-dir, else None (running servers by URL). Overrides change a topology to bring up, never a running one."""
    if topology is not None:
        return load_topology(topology, overrides, gated=True)
    if overrides:
        raise api.UserError(f"{overrides[0].flag}: changes a TOPOLOGY to bring up; a running system (--proxy, "
                            "--state-dir) is gated as it runs")
    return api.attach(state_dir=state_dir) if state_dir is not None else None
