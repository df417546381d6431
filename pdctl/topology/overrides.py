"""Command-line changes to a topology (--set dotted.path=value, and the role flags that are each one --set: e.g.
--decode-block-size N), applied to the YAML's data before it is validated; a problem one causes names its flag."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, replace
from typing import Any

from pdctl import yamlsrc
from pdctl.topology.problems import Loc, Problem, Source, TopologyError
from pdctl.topology.schema import ROLES, Pool


@dataclass(frozen=True)
class Override:
    """One command-line change: `flag` is how the user wrote it, for error messages."""

    path: Loc
    value: Any
    flag: str
    # A role flag's override (--decode-block-size): a role of several pools has it set in every pool, not refused.
    every_pool: bool = False
    # Another override of the same place is a conflict, not a later word (a role flag; a sweep's --set under a case).
    exclusive: bool = False

    @classmethod
    def from_role_flag(cls, flag: str, value: Any) -> Override:
        """`--decode-block-size 64` as the override it is (`--set decode.block_size=64`), named by the flag."""
        return cls(ROLE_FLAGS[flag], value, f"{flag} {value}", every_pool=True, exclusive=True)

    @classmethod
    def parse_set(cls, text: str) -> Override:
        """`--set dotted.path=value`; a TopologyError naming the flag when it is not one."""
        flag = f"--set {text}"
        key, sep, raw = text.partition("=")
        if not sep or not key.strip():
            raise TopologyError(Source(flag), [Problem(
                (), f"--set {text!r}: expected dotted.path=value, e.g. --set decode.block_size=64")])
        value = _flag_value(raw, flag) if raw.strip() else ""
        # A list index is ASCII digits only ('²'.isdigit() is true, and int() refuses it), and not absurdly long.
        path = tuple(int(k) if re.fullmatch(r"[0-9]{1,9}", k) else k for k in key.strip().split("."))
        return cls(path, value, flag)


def _flag_value(raw: str, flag: str) -> Any:
    """A flag's value as YAML (64 -> int, [0,1] -> list); text that is not YAML stays text. A value that breaks
    the loader's limits (a deep or alias-expanding document) is a TopologyError naming the flag."""
    try:
        return yamlsrc.parse_value(raw)
    except yamlsrc.YamlLimitError as e:
        raise TopologyError(Source(flag), [Problem((), e.message)]) from None
    except yamlsrc.YamlSourceError:
        return raw


# The role flags: each is exactly `--set <role>.<field>=N` (the knobs of vLLM PR #26759's accuracy harness:
# PREFILL_BLOCK_SIZE, DECODE_BLOCK_SIZE, the prefill's and DECODER_TP_SIZE), on every command that takes a topology.
ROLE_FLAGS: dict[str, tuple[str, str]] = {
    "--prefill-block-size": ("prefill", "block_size"),
    "--decode-block-size": ("decode", "block_size"),
    "--prefill-tp": ("prefill", "tp"),
    "--decode-tp": ("decode", "tp"),
}


def _pool_override(data: dict, o: Override) -> list[Override]:
    """Overrides of a role written as a list of pools address a pool by name (--set decode.d64.block_size=128);
    a role-level path (--set decode.block_size=128) applies to a role with one pool and is refused with several.
    A role flag sets every pool of its role when they agree on the field, and is refused naming them when they
    differ (setting them all would erase the fleet's difference)."""
    role = o.path[0] if o.path else None
    pools = data.get(role) if role in ROLES else None
    if not isinstance(pools, list) or len(o.path) < 2 or isinstance(o.path[1], int):
        return [o]
    names = [p.get("name") for p in pools if isinstance(p, dict)]
    if o.path[1] in names:
        return [replace(o, path=(role, names.index(o.path[1]), *o.path[2:]))]
    if len(pools) == 1:
        return [replace(o, path=(role, 0, *o.path[1:]))]
    field_ = ".".join(map(str, o.path[1:]))
    if o.every_pool:
        now = {str(p.get("name")): p.get(field_) for p in pools if isinstance(p, dict)}
        if len(now) == len(pools) and len({repr(v) for v in now.values()}) == 1:
            return [replace(o, path=(role, i, *o.path[1:])) for i in range(len(pools))]
        said = ", ".join(f"{n}: {'unset' if v is None else v}" for n, v in now.items())
        raise TopologyError(Source(o.flag), [Problem(
            o.path, f"the topology's {len(pools)} {role} pools differ in {field_} ({said}); the flag would set "
            "every one", f"--set {role}.{names[0]}.{field_}={o.value} for one pool")])
    raise TopologyError(Source(o.flag), [Problem(
        o.path, f"the topology has {len(pools)} {role} pools ({', '.join(map(str, names))}); say which",
        f"--set {role}.{names[0]}.{field_}=..." if names and o.path[1] in Pool.model_fields else
        f"{role} pools: {', '.join(map(str, names))}" if names else f"add a {role} pool first")])


class OverrideConflict(TopologyError):
    """Two overrides of one place where one of them is exclusive: the command line says two things."""


def _refuse_conflicts(overrides: list[Override]) -> None:
    """A role flag and another override of the same field (a --set, or a pool's own path) say two things: refused
    naming both, whatever their values."""
    by_path: dict[Loc, Override] = {}
    for o in overrides:
        first = by_path.setdefault(o.path, o)
        if first.flag != o.flag and (first.exclusive or o.exclusive):
            raise OverrideConflict(Source(f"{first.flag} and {o.flag}"), [Problem(
                o.path, "both set it", "give one of them")])


def apply_overrides(data: dict, overrides: list[Override]) -> tuple[dict, list[Override]]:
    """The data with the overrides applied, and the overrides with pool names resolved to list indices."""
    data = copy.deepcopy(data)  # plain YAML data, bounded by yamlsrc (dates and bytes too, which JSON refuses)
    overrides = [r for o in overrides for r in _pool_override(data, o)]
    _refuse_conflicts(overrides)
    for o in overrides:
        node: Any = data
        for k in o.path[:-1]:
            if isinstance(node, list) and isinstance(k, int) and k < len(node):
                node = node[k]
            elif isinstance(node, dict):
                node = node.setdefault(k, {})
                if not isinstance(node, (dict, list)):
                    raise TopologyError(Source(o.flag), [Problem(o.path, f"'{k}' is not a section")])
            else:
                raise TopologyError(Source(o.flag), [Problem(o.path, "no such place in the topology")])
        if isinstance(node, list):
            if not (isinstance(o.path[-1], int) and o.path[-1] < len(node)):
                raise TopologyError(Source(o.flag), [Problem(o.path, "list index out of range")])
        node[o.path[-1]] = o.value
    return data, overrides


# The typed override flags removed in 0.2 (--set is their form): flag -> the --set that replaces it. The CLI
# refuses each with its replacement for one release.
REMOVED_OVERRIDE_FLAGS: dict[str, str] = {
    "--decode-layout": "decode.kv_layout=HND|NHD",
    "--prefill-count": "prefill.count=N",
    "--decode-count": "decode.count=N",
    "--engine": "engine.kind=local|ray|slurm",
    "--address": "engine.address=HOST:PORT",
}


# `pdctl up --monitoring`: monitoring.enabled set from the command line (a problem it causes names the flag).
MONITORING_ON = Override(("monitoring", "enabled"), True, "--monitoring")

