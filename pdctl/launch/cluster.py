"""What the cluster engines share: servers run on cluster nodes, the proxy (unless placed) runs here."""

from __future__ import annotations

from abc import abstractmethod

from pdctl.launch.engine import Engine, Liveness, StopReport
from pdctl.launch.local import LocalEngine
from pdctl.launch.state import LaunchState
from pdctl.topology import EngineSpec


def is_this_host(ip: str) -> bool:
    """Whether an address belongs to this machine (it can be bound here): cluster nodes on loopback addresses."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


class ClusterEngine(Engine):
    prefix = "cluster:"  # a record's `where` for processes the cluster runs

    def __init__(self, engine_spec: EngineSpec) -> None:
        self.engine_spec = engine_spec  # the topology's engine section
        self.local = LocalEngine()

    def on_cluster(self, state: LaunchState, name: str) -> bool:
        rec = state.processes.get(name)
        return rec is not None and rec.where.startswith(self.prefix)

    @abstractmethod
    def cluster_liveness(self, state: LaunchState, name: str) -> Liveness:
        """Whether a process the cluster runs is still there."""

    def liveness(self, state: LaunchState, name: str) -> Liveness:
        if name not in state.processes:
            return Liveness(False)
        if not self.on_cluster(state, name):
            return self.local.liveness(state, name)
        return self.cluster_liveness(state, name)

    def stop_here(self, state: LaunchState, grace_s: float, report: StopReport) -> StopReport:
        """Stop what runs on this host (the proxy), adding to the cluster's report."""
        here = LaunchState(state.plan, "local", state.detached,
                           {n: r for n, r in state.processes.items() if not self.on_cluster(state, n)})
        return report.add(self.local.stop(here, grace_s))
