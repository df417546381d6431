"""Running a plan: the engines (engine.py: the contract; local.py, ray_engine.py, slurm_engine.py), the runner
(run.py: up, readiness, down), supervision, the state dir, and k8s rendering.

`engine_for` and `engine_of` pick an engine; they import it when called, so importing this package stays cheap
(`import ray` alone takes seconds, and only the ray engine needs it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdctl.launch.engine import Engine
    from pdctl.launch.state import LaunchState
    from pdctl.topology import EngineSpec


def engine_for(spec: EngineSpec | None) -> Engine:
    """The engine for a topology's `engine` section (`plan.topology.engine`); None is the local one."""
    kind = spec.kind if spec is not None else "local"
    if kind == "ray":
        from pdctl.launch.ray_engine import RayEngine

        return RayEngine(spec)
    if kind == "slurm":
        from pdctl.launch.slurm_engine import SlurmEngine

        return SlurmEngine(spec)
    from pdctl.launch.local import LocalEngine

    return LocalEngine()


def engine_of(state: LaunchState) -> Engine:
    """The engine a launched topology was started with (its state says which)."""
    return engine_for(state.plan.topology.engine.model_copy(update={"kind": state.engine_kind}))
