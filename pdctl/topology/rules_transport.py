"""Rules of the UCX settings each pool's servers get (pdctl.topology.transport): a pool's own `env` may change
them, but not into settings NIXL cannot transfer with."""

from __future__ import annotations

from pdctl.topology.problems import Problem, pool_loc
from pdctl.topology.schema import ROLES, Topology
from pdctl.topology.transport import MM_ERROR_ENV, TLS_ENV, pool_ucx, ucx_problem


def _transport_problems(t: Topology) -> list[Problem]:
    out: list[Problem] = []
    crosses = t.engine.kind != "local"  # cluster engines place instances on several hosts
    for role in ROLES:
        for g in t.pools(role):
            found = ucx_problem(pool_ucx(t, g), crosses)
            if found:
                key = TLS_ENV if TLS_ENV in g.env else MM_ERROR_ENV
                out.append(Problem((*pool_loc(t, role, g), "env", key), *found))
    return out
