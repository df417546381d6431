"""A backend runs a plan: start every process, say whether each still runs, stop them all.

The plan is the same for every backend; only where and how its processes run differs. `local` runs them as
process groups on this host; cluster backends (Ray, Slurm) implement the same four methods.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pdctl.launch.state import LaunchState
from pdctl.plan import Plan, ProcessSpec


@dataclass
class Liveness:
    alive: bool
    exit_code: int | None = None  # when known


@dataclass
class StopReport:
    stopped: list[str]  # process names that were running and were stopped
    already_gone: list[str]  # recorded but no longer running (stale state)
    killed: list[str]  # needed SIGKILL after the grace period


class Backend(ABC):
    name: str = "abstract"

    @abstractmethod
    def preflight(self, plan: Plan) -> list[str]:
        """Problems that would make a launch fail, found before anything starts (ports taken, ...)."""

    @abstractmethod
    def start(self, plan: Plan, spec: ProcessSpec, state: LaunchState, *, attached: bool) -> None:
        """Start one process and record it in `state`."""

    @abstractmethod
    def liveness(self, state: LaunchState, name: str) -> Liveness:
        """Whether the named process still runs."""

    @abstractmethod
    def stop(self, state: LaunchState, grace_s: float = 15.0) -> StopReport:
        """Stop every recorded process and everything it started; idempotent."""
