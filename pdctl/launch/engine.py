"""A backend runs a plan: start every process, say whether each still runs, stop them all.

The plan is the same for every backend; only where and how its processes run differs. `local` runs them as
process groups on this host; cluster backends (Ray, Slurm) place them on nodes first, so `launch` returns the
plan with each instance's real node address filled in (`plan.with_hosts`). What a backend needs to find its
processes again (actor names, a job id) goes in the state, so `status`, `logs` and `down` work from any shell.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pdctl.launch.logs import tail
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

    def add(self, other: StopReport) -> StopReport:
        self.stopped += other.stopped
        self.already_gone += other.already_gone
        self.killed += other.killed
        return self


class Backend(ABC):
    """Runs a whole plan. Every backend implements all of this; restarting single instances is the
    RestartableBackend's extra (the supervisor restarts only there)."""

    name: str = "abstract"
    # Whether pdctl's supervisor can restart one instance (local: yes). Ray and Slurm start a plan as a whole;
    # there a dead instance is reported by `status` and stays down until `pdctl down && pdctl up`.
    restartable: bool = False

    @abstractmethod
    def preflight(self, plan: Plan) -> list[str]:
        """Problems that would make a launch fail, found before anything starts (ports taken, ...)."""

    @abstractmethod
    def launch(self, plan: Plan, state: LaunchState, *, attached: bool) -> Plan:
        """Start every process, recording each in `state`; the plan as placed (cluster backends fill in node
        addresses)."""

    @abstractmethod
    def liveness(self, state: LaunchState, name: str) -> Liveness:
        """Whether the named process still runs."""

    @abstractmethod
    def stop(self, state: LaunchState, grace_s: float = 15.0) -> StopReport:
        """Stop every recorded process and everything it started; idempotent."""

    def log_tail(self, state: LaunchState, name: str, n: int) -> list[str]:
        """The last n lines of a process's log (a cluster backend may fetch them from the node)."""
        return tail(state.plan.get(name).log_path, n)


class RestartableBackend(Backend):
    """A backend that starts and stops single instances: what the supervisor's restarts need."""

    restartable = True

    @abstractmethod
    def start(self, plan: Plan, spec: ProcessSpec, state: LaunchState, *, attached: bool) -> None:
        """Start one process and record it in `state`."""

    @abstractmethod
    def stop_one(self, state: LaunchState, name: str, grace_s: float = 10.0) -> StopReport:
        """Stop one process and everything it started (what a restart needs first)."""

    def launch(self, plan: Plan, state: LaunchState, *, attached: bool) -> Plan:
        for spec in plan.processes:
            self.start(plan, spec, state, attached=attached)
        return plan
