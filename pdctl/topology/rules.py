"""Every compatibility rule, checked before anything starts: one rules_* module per subject, run here in the
order their problems are reported."""

from __future__ import annotations

from pdctl.topology.facts import ModelInfo, model_attention
from pdctl.topology.problems import Loc, Problem
from pdctl.topology.rules_collisions import _collisions
from pdctl.topology.rules_connector import _connector_problems
from pdctl.topology.rules_engine import _engine_problems
from pdctl.topology.rules_exposure import _exposure_problems
from pdctl.topology.rules_hybrid import _attention_problems
from pdctl.topology.rules_pairs import _pair_problems, _pool_set_problems
from pdctl.topology.rules_pool import _pool_problems
from pdctl.topology.rules_proxy import _router_problems
from pdctl.topology.rules_transport import _transport_problems
from pdctl.topology.schema import ROLES, Topology


def compatibility_problems(t: Topology, info: ModelInfo = ModelInfo()) -> list[Problem]:
    out = _pool_set_problems(t) + _attention_problems(t, info)
    attention = model_attention(t, info)
    for p, d in t.pairs():
        out += _pair_problems(t, p, d, attention)
    for role in ROLES:
        for g in t.pools(role):
            out += _pool_problems(t, role, g, info)
    if "\0" in t.model.path:
        out.append(Problem(("model", "path"), "holds a NUL character, which no path can"))
    if t.model.max_model_len and info.max_position and t.model.max_model_len > info.max_position:
        out.append(Problem(("model", "max_model_len"),
                           f"{t.model.max_model_len} exceeds the model's max_position_embeddings "
                           f"{info.max_position}", f"use at most {info.max_position}"))
    out += _connector_problems(t)
    out += _transport_problems(t)
    out += _engine_problems(t)
    out += _router_problems(t)
    out += _exposure_problems(t)
    out += _collisions(t)
    # A rule that holds for a pool is met or broken once, whatever the pairs it is in.
    seen: set[tuple[Loc, str]] = set()
    return [p for p in out if not ((p.path, p.message) in seen or seen.add((p.path, p.message)))]
