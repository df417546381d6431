"""Loading a topology: the YAML read with its key lines, the overrides applied, the models validated, the model's
facts read and every rule checked.

Pure apart from `load_topology` (and `read_model_info`, which it calls), which read the YAML and the model's
config.json.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pdctl import yamlsrc
from pdctl.topology.facts import ModelInfo, read_model_info
from pdctl.topology.overrides import Override, apply_overrides
from pdctl.topology.problems import Problem, Source, TopologyError, _from_validation_error, user_loc
from pdctl.topology.rules import compatibility_problems
from pdctl.topology.schema import ROLES, Topology


@dataclass
class Loaded:
    topology: Topology
    source: Source
    base_dir: Path
    model_info: ModelInfo
    warnings: list[Problem] = field(default_factory=list)
    gate: tuple[list[str], list[str]] | None = None  # loaded for a gate: (settings applied, user's kept)


def validate_data(data: Any, source: Source, base_dir: Path) -> Loaded:
    if not isinstance(data, dict):
        raise TopologyError(source, [Problem((), "a topology is a mapping with name, model, prefill, decode")])
    single = {r for r in ROLES if isinstance(data.get(r), dict)}
    try:
        topo = Topology.model_validate(data)
    except ValidationError as e:
        raise TopologyError(source, [user_loc(p, single) for p in _from_validation_error(e, data)]) from None
    info = read_model_info(topo.model, base_dir)
    problems = [user_loc(p, single) for p in compatibility_problems(topo, info)]
    errors = [p for p in problems if p.severity == "error"]
    if errors:
        raise TopologyError(source, errors)
    loaded = Loaded(topo, source, base_dir, info, [p for p in problems if p.severity == "warning"])
    topo._origin = loaded
    return loaded


def load_topology(path: str | Path, overrides: list[Override] = ()) -> Loaded:
    path = Path(path)
    source = Source(str(path))
    try:
        source.located = yamlsrc.load(yamlsrc.read_file(path, "the topology"))
    except yamlsrc.YamlSourceError as e:
        source.filename = f"{path}:{e.line}" if e.line else str(path)
        raise TopologyError(source, [Problem((), e.message)]) from None
    data = source.located.data
    if overrides:
        if not isinstance(data, dict):
            data = {}
        data, resolved = apply_overrides(data, list(overrides))
        source.overridden = {o.path: o.flag for o in resolved}
    try:
        base_dir = path.resolve().parent
    except (OSError, RuntimeError):  # it was just read, so this is a race; relative to where it was named
        base_dir = path.absolute().parent
    return validate_data(data, source, base_dir)
