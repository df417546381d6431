"""Problems: what is wrong with a topology, where (a path of keys, told as file:line, or as the command-line flag
that set it) and how to fix it; pydantic's validation errors translated into them.

Errors are collected (never raised one at a time) and raised together as one TopologyError.
"""

from __future__ import annotations

import difflib
import typing
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from pdctl import yamlsrc
from pdctl.topology.schema import DEFAULT_POOL, Pool, Role, Topology

Loc = tuple[str | int, ...]

# Keys removed in 0.2 (a setting stays in the schema only where it is the best measured configuration or has a
# user who would set it), refused with why and what to do instead until 0.3. "pool.KEY" is any role's pool.
REMOVED_KEYS: dict[str, str] = {
    "connector.worker_spin_s": "delete it: servers on CPU never spin their executor queues (a spin of 10 ms "
    "measured 0.75x the goodput, docs/benchmarks.md); off CPU vLLM's own queues run",
    "connector.read_wait_s": "delete it: a decode no longer waits in the step that issued a KV read (the wait "
    "measured no goodput gain: without it 5 req/s, median of 3, against 4; docs/benchmarks.md)",
    "reference.calm_queues": "delete it: the reference's executor queues are calmed like every server pdctl starts "
    "(a plain-vLLM reference is a benchmark script's: scripts/plain_reference.py)",
    "proxy.early_decode": "delete it: P/D requests go to their decode once the prefill answers (sending them "
    "early measured 0.8x the goodput, median of 3; docs/benchmarks.md)",
    "proxy.first_token": "delete it: for a whole deployment it measured no goodput gain at the SLO (it moves the "
    "decode's path from before token 1 to between tokens 1 and 2; docs/latency.md); a streaming client can still "
    "ask for the prefill's token first per request, header x-pdctl-first-token: on|auto",
}


def removed_key(loc: Loc) -> str | None:
    """What replaces a removed key at `loc` (None: the key was never in the schema)."""
    names = [str(x) for x in loc if not isinstance(x, int)]
    if names and names[0] in typing.get_args(Role):  # a role's pool, by index or by name
        names = ["pool", names[-1]]
    return REMOVED_KEYS.get(".".join(names))


@dataclass(frozen=True)
class Problem:
    path: Loc
    message: str
    hint: str | None = None
    related: tuple[Loc, ...] = ()
    severity: Literal["error", "warning"] = "error"


@dataclass
class Source:
    """Where the topology came from: the file, its key lines, and which paths the command line overrode."""

    filename: str
    located: yamlsrc.Located | None = None
    overridden: dict[Loc, str] = field(default_factory=dict)

    def describe(self, problem: Problem) -> str:
        dotted = ".".join(str(p) for p in problem.path) or "(top level)"

        def flag_for(path: Loc) -> str | None:
            return next((f for loc, f in self.overridden.items() if path[: len(loc)] == loc), None)

        direct = flag_for(problem.path)
        if direct:
            where = f"command line ({direct})"
        else:
            line = self.located.line_of(problem.path) if self.located else None
            where = f"{self.filename}:{line}" if line else self.filename
        label = "warning: " if problem.severity == "warning" else ""
        text = f"{where}: {label}{dotted}: {problem.message}"
        if direct:
            text += " [this value came from the command line]"
        else:
            other = next((f for r in problem.related if (f := flag_for(r))), None)
            if other:
                text += f" [the other value came from the command line: {other}]"
        if problem.hint:
            text += f"\n    fix: {problem.hint}"
        return text


class TopologyError(Exception):
    def __init__(self, source: Source, problems: list[Problem]):
        self.source = source
        line = source.located.line_of if source.located else (lambda _: None)
        self.problems = sorted(problems, key=lambda p: (line(p.path) or 10**9))
        super().__init__(self.render())

    def render(self) -> str:
        n = len(self.problems)
        head = f"{self.source.filename}: {n} problem{'s' if n != 1 else ''}"
        return "\n".join([head, *("  " + self.source.describe(p) for p in self.problems)])


def pool_loc(t: Topology, role: Role, pool: Pool) -> Loc:
    """Where a pool's fields live: (role, index). A role written as one mapping is rewritten to (role,) when the
    problems are located (user_loc)."""
    return (role, next(i for i, g in enumerate(t.pools(role)) if g is pool))


def pool_field(t: Topology, role: Role, pool: Pool, name: str) -> str:
    """A pool's field as the user reads it: decode.extra_args, or decode pool d64's extra_args in a fleet."""
    single = len(t.pools(role)) == 1 and pool.name == DEFAULT_POOL
    return f"{role}.{name}" if single else f"{role} pool {pool.name}'s {name}"


def user_loc(problem: Problem, single: set[str]) -> Problem:
    """Problem paths as the user wrote the YAML: a role written as one mapping has no pool index."""

    def fix(loc: Loc) -> Loc:
        return (loc[0], *loc[2:]) if len(loc) > 1 and loc[0] in single and loc[1] == 0 else loc

    return replace(problem, path=fix(problem.path), related=tuple(fix(r) for r in problem.related))


# --------------------------------------------------------------------------------------------------------------
# Pydantic errors -> problems


def _submodel(cls: type[BaseModel], loc: Loc) -> type[BaseModel] | None:
    for part in loc:
        if isinstance(part, int):  # an item of a list of models (pools)
            continue
        if part not in cls.model_fields:
            return None
        ann = cls.model_fields[part].annotation
        nxt = next((a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)),
                   None)
        if nxt is None:
            return None
        cls = nxt
    return cls


def _clean_loc(raw: tuple, data: Any) -> Loc:
    """Pydantic's error location as the user's keys: its names for validators and literals
    ('function-before[...]', "literal['HND','NHD']") dropped, a user's key that merely looks like one kept."""
    out: list[str | int] = []
    node = data
    for part in raw:
        if isinstance(node, dict) and part in node:
            out.append(part)
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            out.append(part)
            node = node[part]
        elif isinstance(node, dict) and isinstance(part, int):
            out.append(part)  # a role written as one mapping is pool 0 (_as_pools); the mapping is that pool
        elif isinstance(part, str) and part.startswith(("function-", "literal[")):
            continue
        else:
            out.append(part)
            node = None
    return tuple(out)


def _from_validation_error(err: ValidationError, data: Any = None) -> list[Problem]:
    problems = []
    for e in err.errors(include_url=False):
        loc = _clean_loc(tuple(e["loc"]), data)
        kind = e["type"]
        if kind == "extra_forbidden" and removed_key(loc):
            problems.append(Problem(loc, f"'{loc[-1]}' was removed", removed_key(loc)))
        elif kind == "extra_forbidden":
            key = str(loc[-1])
            model = _submodel(Topology, loc[:-1])
            known = sorted(model.model_fields) if model else []
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else (f"known keys: {', '.join(known)}" if known else None)
            problems.append(Problem(loc, f"unknown key '{key}'", hint))
        elif kind == "missing":
            problems.append(Problem(loc, "required field is missing", f"add '{loc[-1]}:' here"))
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = e.get("input")
            if kind not in ("value_error",) and not isinstance(got, (dict, list)):
                msg += f" (got {yamlsrc.short(got)})"
            problems.append(Problem(loc, msg))
    return problems
