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


def options_from(cls, values: dict, **extra):
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


def load_topology(path: Path, overrides: list, gated: bool = False):
    t = api.load(path, overrides, gated=gated)
    for w in api.warnings(t):
        err.print(w, markup=False, highlight=False, style="yellow")
    return t
