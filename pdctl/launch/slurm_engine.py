"""Slurm engine: one batch job, one job step per vLLM instance, each on the nodes the topology's placement names.

Each step learns its node's address at run time (`pdctl.launch.slurm_step`), so the script can be rendered before
Slurm has placed anything (`pdctl plan --set engine.kind=slurm` shows it). `pdctl up` submits it, reads which node
each step landed on from `squeue`, fills those addresses into the plan, and starts the proxy here. `down` is
`scancel` of that one job (the cgroup process tracker takes every process of every step with it).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

from pdctl.launch.cluster import ClusterEngine, is_this_host
from pdctl.launch.engine import Liveness, StopReport
from pdctl.launch.errors import LaunchFailed
from pdctl.launch.state import LaunchState, ProcessRecord
from pdctl.launch.waits import STOP_GRACE_S
from pdctl.plan import Plan
from pdctl.topology import EngineSpec

NODE_ADDR = "{node_addr}"  # replaced on the node by pdctl.launch.slurm_step
JOB_PREFIX = "pdctl-"


def render_batch(plan: Plan, engine: EngineSpec, python: str = sys.executable) -> str:
    """The sbatch script for a plan's servers (pure); `engine` is normally `plan.topology.engine`."""
    servers = [s for s in plan.processes if s.role in ("prefill", "decode")]
    placed = plan.with_hosts({s.name: NODE_ADDR for s in servers})
    partitions = {plan.placement_of(s).partition for s in servers} - {None}
    nodes: list[str] = []
    for s in servers:
        for n in plan.placement_of(s).nodelist or []:
            if n not in nodes:
                nodes.append(n)
    every_role_listed = all(plan.placement_of(s).nodelist for s in servers)
    gres = {plan.placement_of(s).gres for s in servers} - {None}
    lines = ["#!/bin/bash",
             f"# pdctl: the {plan.name} topology's servers, one job step per instance (rendered by pdctl).",
             f"#SBATCH --job-name={JOB_PREFIX}{plan.name}",
             f"#SBATCH --ntasks={len(servers)}",
             f"#SBATCH --nodes={len(nodes) if every_role_listed else len(servers)}",
             f"#SBATCH --output={plan.state_dir}/logs/slurm-%j.out",
             f"#SBATCH --time={engine.time_limit}",
             "#SBATCH --no-kill"]  # a lost node ends its own steps, not the whole topology
    if partitions:
        lines.append(f"#SBATCH --partition={sorted(partitions)[0]}")
    if nodes:
        lines.append(f"#SBATCH --nodelist={','.join(nodes)}")
    if len(gres) == 1:
        lines.append(f"#SBATCH --gres={gres.pop()}")
    lines.append("")
    # A key (auth.api_key_env) by reference only: sbatch hands the job pdctl's environment, every step inherits
    # what the script exports (srun --export=ALL), and a shell builtin puts no value in any argv or in this file.
    secrets = dict(kv for s in servers for kv in s.secret_env.items())
    for target, source in secrets.items():
        lines.append(f'export {target}="${{{source}:?pdctl: {source} (auth.api_key_env) is not set}}"')
    if secrets:
        lines.append("")
    for s in placed.processes:
        if s.role not in ("prefill", "decode"):
            continue
        pl = plan.placement_of(s)
        srun = ["srun", "--nodes=1", "--ntasks=1", f"--job-name={s.name}", f"--output={s.log_path}",
                "--open-mode=append", "--export=ALL"]
        if pl.nodelist:
            srun.append(f"--nodelist={pl.nodelist[s.index % len(pl.nodelist)]}")
        if pl.gres:
            srun.append(f"--gres={pl.gres}")
        env = [f"{k}={v}" for k, v in s.env.items()] + [f"PDCTL_STEP_PIDFILE={step_pidfile(plan, s.name)}"]
        nice = ["--nice", str(s.nice)] if s.nice else []
        cmd = [*srun, "env", *env, python, "-m", "pdctl.launch.slurm_step", *nice, "--", *s.argv]
        lines.append(shlex.join(cmd) + " &")
    lines += ["wait", ""]
    return "\n".join(lines)


def step_pidfile(plan: Plan, name: str) -> str:
    """Where a step writes its process group (pid and start time): on a node that is this host, `down` can still
    stop it when Slurm has lost the node."""
    return f"{plan.state_dir}/steps/{name}.pid"


def _run(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def steps(job_id: str) -> dict[str, str]:
    """Running steps of a job: step name -> node name."""
    r = _run(["squeue", "--steps", "--jobs", job_id, "--noheader", "--format", "%j|%N"])
    out = {}
    for line in r.stdout.splitlines():
        name, _, node = line.strip().partition("|")
        if name and name != "batch":
            out[name] = node
    return out


def node_addr(node: str) -> str:
    r = _run(["scontrol", "show", "node", node, "--oneliner"])
    for field in r.stdout.split():
        if field.startswith("NodeAddr="):
            return field.split("=", 1)[1]
    return node


def node_states() -> dict[str, str]:
    """Node name -> Slurm state; a trailing '*' means the node does not respond."""
    r = _run(["sinfo", "--Node", "--noheader", "--format", "%N %T"])
    return dict(line.split(None, 1) for line in r.stdout.splitlines() if len(line.split()) == 2)


def responding(state: str | None) -> bool:
    return bool(state) and not state.endswith("*") and not state.startswith(("down", "drain", "fail"))


def job_state(job_id: str) -> tuple[str, str]:
    r = _run(["squeue", "--jobs", job_id, "--noheader", "--format", "%T|%r"])
    state, _, reason = r.stdout.strip().partition("|")
    return state, reason


def cluster_nodes() -> list[str]:
    r = _run(["sinfo", "--Node", "--noheader", "--format", "%N %P %T cpus=%c gres=%G"])
    return [line.strip() for line in r.stdout.splitlines() if line.strip()]


class SlurmEngine(ClusterEngine):
    name = "slurm"
    prefix = "slurm:"

    def __init__(self, engine_spec: EngineSpec) -> None:
        super().__init__(engine_spec)  # the proxy runs where pdctl runs
        self._steps: tuple[float, dict[str, str]] | None = None

    def preflight(self, plan: Plan) -> list[str]:
        problems = []
        for tool in ("sbatch", "squeue", "scancel", "scontrol"):
            if not any(os.access(os.path.join(d, tool), os.X_OK) for d in os.environ.get("PATH", "").split(":")):
                problems.append(f"'{tool}' is not on PATH: the slurm engine runs where Slurm's client tools are")
        if problems:
            return problems
        r = _run(["sinfo", "--noheader", "--format", "%P"])
        if r.returncode != 0:
            problems.append(f"cannot reach slurmctld: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        proxy = plan.with_processes(plan.by_role("proxy"))
        return problems + self.local.preflight(proxy)

    def launch(self, plan: Plan, state: LaunchState, *, attached: bool) -> Plan:
        script = render_batch(plan, self.engine_spec)
        os.makedirs(os.path.join(plan.state_dir, "logs"), exist_ok=True)
        path = os.path.join(plan.state_dir, "job.sbatch")
        with open(path, "w") as f:
            f.write(script)
        r = _run(["sbatch", "--parsable", path])
        if r.returncode != 0:
            raise LaunchFailed("job", f"sbatch refused the job: {r.stderr.strip() or r.stdout.strip()}", None)
        job_id = r.stdout.strip().split(";")[0]
        state.engine = {"job_id": job_id, "script": path, "slurm_conf": os.environ.get("SLURM_CONF")}
        servers = [s for s in plan.processes if s.role != "proxy"]
        for s in servers:  # recorded at once: a failed placement must still scancel the job
            state.processes[s.name] = ProcessRecord(s.name, 0, 0, 0, time.time(), where=f"slurm:{job_id}")
        timeout = self.engine_spec.placement_timeout_s
        deadline = time.monotonic() + timeout
        found: dict[str, str] = {}
        while True:
            found = steps(job_id)
            if all(s.name in found for s in servers):
                break
            st, reason = job_state(job_id)
            if not st:
                raise LaunchFailed("job", f"Slurm job {job_id} ended before every step started; see "
                                   f"{plan.state_dir}/logs/slurm-{job_id}.out", None)
            if time.monotonic() > deadline:
                missing = [s.name for s in servers if s.name not in found]
                raise LaunchFailed(missing[0], f"Slurm job {job_id} is {st} ({reason}); not placed within "
                                   f"{timeout:.0f} s: {', '.join(missing)}. The cluster's nodes:\n  "
                                   + "\n  ".join(cluster_nodes() or ["(none)"]), None)
            time.sleep(0.5)
        addrs = {node: node_addr(node) for node in set(found.values())}
        plan = plan.with_hosts({s.name: addrs[found[s.name]] for s in servers})
        state.plan = plan
        for s in servers:
            state.processes[s.name] = ProcessRecord(s.name, 0, 0, 0, time.time(), where=f"slurm:{found[s.name]}")
        for s in plan.by_role("proxy"):
            self.local.start(plan, s, state, attached=attached)
        return plan

    def _running_steps(self, job_id: str) -> tuple[dict[str, str], dict[str, str]]:
        # One squeue and one sinfo per second at most: readiness polls every instance four times a second.
        now = time.monotonic()
        if self._steps is None or now - self._steps[0] > 1.0:
            self._steps = (now, (steps(job_id), node_states()))
        return self._steps[1]

    def cluster_liveness(self, state: LaunchState, name: str) -> Liveness:
        # A step on a node Slurm has lost (its slurmd gone) counts as down, whatever squeue still lists.
        running, nodes = self._running_steps(state.engine.get("job_id", ""))
        return Liveness(name in running and responding(nodes.get(running[name])))

    def stop(self, state: LaunchState, grace_s: float = STOP_GRACE_S) -> StopReport:
        report = StopReport([], [], [])
        job_id = state.engine.get("job_id")
        names = [n for n, r in state.processes.items() if r.where.startswith("slurm:")]
        if job_id:
            running = steps(job_id)
            if job_state(job_id)[0]:
                # Slurm's own stop: SIGTERM to every step, SIGKILL after the cluster's KillWait.
                _run(["scancel", job_id])
                deadline = time.monotonic() + max(grace_s, 40.0)
                while time.monotonic() < deadline and job_state(job_id)[0]:
                    time.sleep(0.2)
            report.stopped += [n for n in names if n in running]
            report.already_gone += [n for n in names if n not in running]
        else:
            report.already_gone += names
        self._stop_orphans(state, grace_s, report)
        self._steps = None
        return self.stop_here(state, grace_s, report)

    def _stop_orphans(self, state: LaunchState, grace_s: float, report: StopReport) -> None:
        """Steps on a lost node survive scancel (no slurmd to signal them). When that node is this host, stop
        their process groups here, by pid and start time (nothing else's group can match both)."""
        left: dict[str, ProcessRecord] = {}
        for name, rec in state.processes.items():
            if not rec.where.startswith("slurm:"):
                continue
            try:
                pid, ticks = (int(x) for x in open(step_pidfile(state.plan, name)).read().split())
            except (OSError, ValueError):
                continue
            spec = next((p for p in state.plan.processes if p.name == name), None)
            if spec is not None and is_this_host(spec.host):
                left[name] = ProcessRecord(name, pid, pid, ticks, rec.started_at)
        if left:
            r = self.local.stop(LaunchState(state.plan, "local", state.detached, left), grace_s)
            for name in r.stopped:
                if name not in report.stopped:
                    report.stopped.append(name)
                if name in report.already_gone:
                    report.already_gone.remove(name)
