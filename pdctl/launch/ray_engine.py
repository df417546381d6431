"""Ray engine: each instance is a detached named actor (namespace = topology name) that runs its vLLM server.

The actor starts the server in its own process group with a parent-death signal, so a killed actor or a lost
node takes its server with it; `down` asks each actor to stop its group and then kills the actor (never
`ray stop`, which kills every Ray process on the machine). Placement comes from the topology's
`engine.placement` (custom resources, node labels, or a node IP). The proxy runs where `pdctl up` runs unless
the topology places it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayError

from pdctl import auth
from pdctl.launch.cluster import ClusterEngine, is_this_host
from pdctl.launch.engine import Liveness, StopReport
from pdctl.launch.errors import LaunchFailed, PlacementFailed
from pdctl.launch.local import group_alive, guarded, start_ticks
from pdctl.launch.logs import tail
from pdctl.launch.state import LaunchState, ProcessRecord
from pdctl.launch.waits import STOP_GRACE_S
from pdctl.plan import Plan, ProcessSpec
from pdctl.topology import EngineSpec

CALL_TIMEOUT_S = 5.0  # an actor on a lost node never answers: liveness must not hang on it


@ray.remote(num_cpus=0, max_restarts=0)
class InstanceActor:
    """Owns one server process on its node."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pgid: int | None = None  # the guard's: it leads the server's process group
        self.log_path: str | None = None

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address()

    def start(self, argv: list[str], env: dict[str, str], log_path: str, nice: int = 0) -> dict:
        self.log_path = log_path
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        # Ray's own variables would tell a vLLM server it runs inside this Ray job,
        # and Ray's OMP_NUM_THREADS=1 would cap the server's CPU threads (its cores come from the plan).
        # Whether a server requires a key is the plan's to say (env), not the node's (as LocalEngine's).
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")
                and k not in ("OMP_NUM_THREADS", auth.VLLM_KEY_ENV)}
        with open(log_path, "ab") as log:
            log.write(f"--- pdctl: starting {self.name} on {self.node_ip()} at {time.strftime('%F %T')}\n".encode())
            log.flush()
            # The guard watches this actor and detaches from it: Ray SIGKILLs a worker's children when the worker
            # exits, which would orphan the server's EngineCore.
            launcher = subprocess.Popen(guarded(argv, watch=os.getpid(), nice=nice), env={**base, **env},
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                                        start_new_session=True)
            first = launcher.stdout.readline()
            launcher.wait()
        if not first.strip():  # the guard refused before it detached (e.g. a nice the node will not grant)
            return {"error": f"the guard did not start the server (exit {launcher.returncode}; its log "
                             f"{log_path} on {self.node_ip()} says why)", "log": tail(log_path, 5)}
        self.pgid = int(first)
        return {"pid": self.pgid, "start_ticks": start_ticks(self.pgid) or 0}

    def poll(self) -> tuple[bool, int | None]:
        return (self.pgid is not None and group_alive(self.pgid)), None

    def tail(self, n: int) -> list[str]:
        return tail(self.log_path, n) if self.log_path else []

    def stop(self, grace_s: float) -> str:
        if self.pgid is None or not group_alive(self.pgid):
            return "gone"
        os.killpg(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_alive(self.pgid):
            time.sleep(0.1)
        if group_alive(self.pgid):
            os.killpg(self.pgid, signal.SIGKILL)
            return "killed"
        return "stopped"


class RayEngine(ClusterEngine):
    name = "ray"
    prefix = "ray:"

    def __init__(self, engine_spec: EngineSpec) -> None:
        super().__init__(engine_spec)
        self._actors: dict[str, ray.actor.ActorHandle] = {}

    # -- connection

    def _connect(self, namespace: str) -> None:
        if ray.is_initialized():
            return
        address = self.engine_spec.address or os.environ.get("RAY_ADDRESS")
        ray.init(address=address, namespace=namespace, logging_level="ERROR", log_to_driver=False,
                 configure_logging=True)

    @staticmethod
    def _namespace(plan: Plan) -> str:
        return plan.topology.engine.namespace or plan.name

    def _on_ray(self, spec: ProcessSpec) -> bool:
        if spec.role != "proxy":
            return True
        pl = self.engine_spec.placement.get("proxy")
        return pl is not None and bool(pl.resources or pl.labels or pl.node not in (None, "local"))

    def _options(self, plan: Plan, spec: ProcessSpec) -> dict:
        pl = plan.placement_of(spec)
        opts: dict = {"name": spec.name, "lifetime": "detached", "num_cpus": 0}
        if pl.resources:
            # A sliver of the resource: it marks the node kind, it does not count instances.
            opts["resources"] = {k: min(float(v), 0.01) for k, v in pl.resources.items()}
        if pl.labels:
            opts["label_selector"] = dict(pl.labels)
        if pl.node and pl.node != "local":
            opts["resources"] = {**opts.get("resources", {}), f"node:{pl.node}": 0.001}
        return opts

    # -- Engine

    def preflight(self, plan: Plan) -> list[str]:
        try:
            self._connect(self._namespace(plan))
        except Exception as e:  # ray raises ConnectionError, RuntimeError, ValueError here
            return [f"cannot reach the Ray cluster at {self.engine_spec.address or '$RAY_ADDRESS'}: "
                    f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"]
        problems = []
        for spec in plan.processes:
            try:
                ray.get_actor(spec.name, namespace=self._namespace(plan))
                problems.append(f"{spec.name}: an actor of that name already lives in namespace "
                                f"'{self._namespace(plan)}'; `pdctl down {plan.name}` first")
            except ValueError:
                pass
        local = plan.with_processes([s for s in plan.processes if not self._on_ray(s)])
        return problems + self.local.preflight(local)

    def launch(self, plan: Plan, state: LaunchState, *, attached: bool) -> Plan:
        ns = self._namespace(plan)
        self._connect(ns)
        state.engine = {"namespace": ns, "address": self.engine_spec.address or os.environ.get("RAY_ADDRESS")}
        placed = [s for s in plan.processes if self._on_ray(s)]
        for spec in placed:
            opts = self._options(plan, spec)
            self._actors[spec.name] = InstanceActor.options(namespace=ns, **opts).remote(spec.name)
            # Recorded at once: a failed placement below must still find and kill the actors.
            state.processes[spec.name] = ProcessRecord(spec.name, 0, 0, 0, time.time(), where="ray:pending")
        timeout = self.engine_spec.placement_timeout_s
        refs = {n: a.node_ip.remote() for n, a in self._actors.items()}
        hosts: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        for name, ref in refs.items():
            try:
                hosts[name] = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except GetTimeoutError:
                raise PlacementFailed(name, plan.placement_of(plan.get(name)).model_dump(),
                                      timeout, _cluster_nodes()) from None
        plan = plan.with_hosts(hosts)
        state.plan = plan
        for spec in plan.processes:
            if spec.name in self._actors:
                # The key travels to the node as a task argument, not in the plan (which the state dir keeps).
                env = {**spec.env, **auth.spawn_env(spec)}
                got = ray.get(self._actors[spec.name].start.remote(spec.argv, env, spec.log_path, spec.nice),
                              timeout=60)
                if "error" in got:
                    raise LaunchFailed(spec.name, "\n  ".join([got["error"], *got["log"]]), None)
                state.processes[spec.name] = ProcessRecord(spec.name, got["pid"], got["pid"], got["start_ticks"],
                                                           time.time(), where=f"ray:{hosts[spec.name]}")
            else:
                self.local.start(plan, spec, state, attached=attached)
        return plan

    def _actor(self, state: LaunchState, name: str):
        if name not in self._actors:
            self._connect(state.engine.get("namespace") or self._namespace(state.plan))
            self._actors[name] = ray.get_actor(name, namespace=state.engine.get("namespace")
                                               or self._namespace(state.plan))
        return self._actors[name]

    def cluster_liveness(self, state: LaunchState, name: str) -> Liveness:
        try:
            alive, code = ray.get(self._actor(state, name).poll.remote(), timeout=CALL_TIMEOUT_S)
        except (RayError, ValueError):  # actor dead, node lost, or no such actor
            return Liveness(False)
        return Liveness(alive, code)

    def log_tail(self, state: LaunchState, name: str, n: int) -> list[str]:
        rec = state.processes.get(name)
        if rec is not None and rec.where.startswith("ray:"):
            try:
                return ray.get(self._actor(state, name).tail.remote(n), timeout=CALL_TIMEOUT_S)
            except (RayError, ValueError):
                pass  # the node is gone; its log may still be readable here
        return super().log_tail(state, name, n)

    def stop(self, state: LaunchState, grace_s: float = STOP_GRACE_S) -> StopReport:
        report = StopReport([], [], [])
        on_ray = {n: r for n, r in state.processes.items() if r.where.startswith("ray:")}
        if on_ray:
            try:
                self._connect(state.engine.get("namespace") or self._namespace(state.plan))
            except Exception:
                report.already_gone += list(on_ray)  # no cluster: nothing of ours can be running on it
                on_ray = {}
        pending = {}
        unreachable: list[str] = []
        for name in on_ray:
            try:
                actor = self._actor(state, name)
            except ValueError:
                unreachable.append(name)
                continue
            pending[name] = (actor, actor.stop.remote(grace_s))
        for name, (actor, ref) in pending.items():
            try:
                result = ray.get(ref, timeout=grace_s + 10)
            except RayError:
                unreachable.append(name)
                result = None
            if result == "gone":
                report.already_gone.append(name)
            elif result is not None:  # stopped, or killed after the grace period
                report.stopped.append(name)
                if result == "killed":
                    report.killed.append(name)
            try:
                ray.kill(actor, no_restart=True)
            except RayError:
                pass
        # A lost node's processes are out of reach, unless that node is this host (nodes on loopback
        # addresses): then its process groups are stopped here, by pid and start time like the local engine's.
        here = {n for n in unreachable if is_this_host(on_ray[n].where.removeprefix("ray:")) and on_ray[n].pid}
        report.already_gone += [n for n in unreachable if n not in here]
        if here:
            report.add(self.local.stop(LaunchState(state.plan, "local", state.detached,
                                                   {n: on_ray[n] for n in here}), grace_s))
        return self.stop_here(state, grace_s, report)


def _cluster_nodes() -> list[str]:
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = {k: v for k, v in n.get("Resources", {}).items() if not k.startswith("node:") and k != "memory"
               and k != "object_store_memory"}
        labels = {k: v for k, v in (n.get("Labels") or {}).items() if not k.startswith("ray.io/")}
        out.append(f"{n['NodeManagerAddress']}: resources {res}" + (f", labels {labels}" if labels else ""))
    return out
