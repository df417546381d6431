"""The engine contract: what runs a plan (the topology's `engine: {kind: local|ray|slurm}`).

The plan is the same on every engine; only where and how its processes run differs. `local` runs each process
in its own process group on this host; the cluster engines (Ray, Slurm) place the servers on nodes first, so
`launch` returns the plan with each instance's real node address filled in (`plan.with_hosts`). What an engine
needs to find its processes again (actor names, a job id) goes in the state (`LaunchState.engine`), so `status`,
`logs` and `down` work from any shell.

An engine subclasses `Engine` and implements every abstract method below; `RestartableEngine` adds starting and
stopping single instances, which the supervisor's restarts need. `pdctl.launch.engine_for` picks the engine
for a topology's `engine` section, `engine_of` the one a launched topology was started with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from pdctl.launch.logs import tail
from pdctl.launch.state import LaunchState
from pdctl.launch.waits import STOP_GRACE_S
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


class Engine(ABC):
    """Runs a whole plan: checks before starting, starts every process, says whether each still runs, stops
    them all. One instance serves one command (`up`, `status`, `down`, ...); all it keeps between commands is
    in the `LaunchState` it is given."""

    name: str = "abstract"  # the topology's engine.kind; recorded in the state (LaunchState.engine_kind)
    # Whether pdctl's supervisor can restart one instance (local: yes). Ray and Slurm start a plan as a whole;
    # there a dead instance is reported by `status` and stays down until `pdctl down && pdctl up`.
    restartable: bool = False

    @abstractmethod
    def preflight(self, plan: Plan) -> list[str]:
        """Problems that would make a launch fail, one line each, found before anything starts (ports taken,
        a cluster out of reach, a tool not on PATH); empty when the launch may go ahead. Starts nothing."""

    @abstractmethod
    def launch(self, plan: Plan, state: LaunchState, *, attached: bool) -> Plan:
        """Start every process of the plan, recording each in `state.processes` (and the engine's handle in
        `state.engine`) as it starts, so a failure part-way leaves what `stop` needs. Returns the plan as placed:
        the same plan, or for a cluster engine the plan with each instance's node address filled in. Does not
        wait for readiness (the runner probes). `attached`: the processes stop when this pdctl process dies."""

    @abstractmethod
    def liveness(self, state: LaunchState, name: str) -> Liveness:
        """Whether the named process still runs (with its exit code when known); False for a name the state
        does not record. Cheap: the supervisor asks every tick."""

    @abstractmethod
    def stop(self, state: LaunchState, grace_s: float = STOP_GRACE_S) -> StopReport:
        """Stop every recorded process and everything it started (SIGTERM, then SIGKILL after `grace_s`), and
        say which were stopped, already gone or killed. Idempotent: a second call, or one on a stale state,
        stops nothing and reports them gone."""

    def log_tail(self, state: LaunchState, name: str, n: int) -> list[str]:
        """The last n lines of a process's log; a cluster engine may fetch them from the node."""
        return tail(state.plan.get(name).log_path, n)


class RestartableEngine(Engine):
    """An engine that starts and stops single instances: what the supervisor's restarts need. `launch` starts
    each process of the plan in turn."""

    restartable = True

    @abstractmethod
    def start(self, plan: Plan, spec: ProcessSpec, state: LaunchState, *, attached: bool) -> None:
        """Start one process and record it in `state.processes` (replacing a previous record of that name)."""

    @abstractmethod
    def stop_one(self, state: LaunchState, name: str, grace_s: float = 10.0) -> StopReport:
        """Stop one process and everything it started (what a restart needs first); idempotent."""

    def launch(self, plan: Plan, state: LaunchState, *, attached: bool) -> Plan:
        for spec in plan.processes:
            self.start(plan, spec, state, attached=attached)
        return plan
