"""Rules of the engine that runs the plan (local, Ray, Slurm): the Ray address, each engine's placement keys, one
Slurm partition, and what only the local engine does."""

from __future__ import annotations

import os

from pdctl.topology.problems import Loc, Problem, pool_loc
from pdctl.topology.schema import RAY_PLACEMENT, ROLES, SLURM_PLACEMENT, Placement, Topology


def _engine_problems(t: Topology) -> list[Problem]:
    e = t.engine
    out: list[Problem] = []
    if e.kind == "ray" and not e.address and not os.environ.get("RAY_ADDRESS"):
        out.append(Problem(("engine", "address"), "the ray engine needs the cluster's address",
                           "set engine.address: HOST:PORT (the head's GCS port; on the command line --set "
                           "engine.address=HOST:PORT), or export RAY_ADDRESS"))
    if e.kind != "ray" and e.address:
        out.append(Problem(("engine", "address"), f"has no meaning for the {e.kind} engine",
                           "remove it, or use engine.kind: ray", severity="warning"))
    own = {"ray": RAY_PLACEMENT, "slurm": SLURM_PLACEMENT, "local": ()}[e.kind]
    placements: list[tuple[Loc, Placement]] = [(("engine", "placement", r), pl) for r, pl in e.placement.items()]
    placements += [((*pool_loc(t, r, g), "placement"), g.placement) for r in ROLES for g in t.pools(r)
                   if g.placement]
    for loc, pl in placements:
        for key in RAY_PLACEMENT + SLURM_PLACEMENT:
            if getattr(pl, key) and key not in own:
                out.append(Problem((*loc, key),
                                   f"'{key}' is no placement of the {e.kind} engine",
                                   f"{e.kind} placement keys: {', '.join(own)}" if own else
                                   "the local engine runs everything on this host; use engine.kind: ray or slurm"))
    parts = {loc: pl.partition for loc, pl in placements if pl.partition and loc[-1] != "proxy"}
    if len(set(parts.values())) > 1:
        loc = list(parts)[-1]
        out.append(Problem((*loc, "partition"),
                           f"the placements name different partitions ({', '.join(sorted(set(parts.values())))}); "
                           "the slurm engine runs the topology as one job, in one partition",
                           "name one partition (nodelist picks the nodes within it)"))
    if e.kind == "slurm" and e.placement.get("proxy"):
        out.append(Problem(("engine", "placement", "proxy"),
                           "the slurm engine runs the proxy where `pdctl up` runs",
                           "remove engine.placement.proxy"))
    if e.kind != "local" and t.monitoring.enabled:
        out.append(Problem(("monitoring", "enabled"), f"pdctl runs Prometheus with the local engine only, not the "
                           f"{e.kind} engine", "remove monitoring (or run your own Prometheus against the instances' "
                           "and the proxy's /metrics), or use engine.kind: local"))
    if e.kind != "local":
        for role in ROLES:
            for g in t.pools(role):
                if g.host not in ("127.0.0.1", "0.0.0.0"):
                    out.append(Problem((*pool_loc(t, role, g), "host"),
                                       f"on the {e.kind} engine an instance listens on its node's address; "
                                       f"host {g.host} is ignored", "remove it", severity="warning"))
    return out
