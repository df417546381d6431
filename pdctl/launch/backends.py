"""Which backend runs a plan: the topology's `engine` section, or a launched topology's recorded backend."""

from __future__ import annotations

from pdctl.launch.backend import Backend
from pdctl.launch.local import LocalBackend
from pdctl.launch.slurm_engine import SlurmBackend
from pdctl.launch.state import LaunchState
from pdctl.topology import EngineSpec


def backend_for(engine: EngineSpec | None) -> Backend:
    """The backend for a topology's `engine` section (`plan.topology.engine`); None is the local one."""
    kind = engine.kind if engine is not None else "local"
    if kind == "ray":
        # Imported here, not above: `import ray` takes seconds, and only the ray engine needs it.
        from pdctl.launch.ray_engine import RayBackend

        return RayBackend(engine)
    if kind == "slurm":
        return SlurmBackend(engine)
    return LocalBackend()


def backend_of(state: LaunchState) -> Backend:
    """The backend a launched topology was started with (its state says which)."""
    return backend_for(state.plan.topology.engine.model_copy(update={"kind": state.backend}))
