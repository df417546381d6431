"""Local engine: each process in its own process group on this host, logs to the state dir."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdctl import auth, protocol
from pdctl.launch import probe
from pdctl.launch.engine import Liveness, RestartableEngine, StopReport
from pdctl.launch.state import LaunchState, ProcessRecord
from pdctl.launch.waits import STOP_GRACE_S
from pdctl.plan import Plan, ProcessSpec

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def guarded(argv: list[str], watch: int | None = None, orphan: bool = False, nice: int = 0) -> list[str]:
    """ARGV run under pdctl's guard: when its owner dies, or the server itself, the whole process group goes (a
    parent-death signal alone stops only the direct child, and vLLM's EngineCore outlives its API server that
    way). The owner is the parent, the process `watch` names (then the guard detaches and prints its pid), or
    nobody (`orphan`: detached topologies). The guard logs how the server ended, and adds `nice` to the
    niceness of everything it starts."""
    opts = ["--watch", str(watch), "--detach"] if watch is not None else ["--orphan"] if orphan else []
    if nice:
        opts += ["--nice", str(nice)]
    return [sys.executable, "-m", "pdctl.launch.guard", *opts, "--", *argv]


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when there is no such live process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def group_alive(pgid: int) -> bool:
    # Not killpg(pgid, 0): orphaned zombies (not reaped by a container's PID 1) would count as alive.
    return bool(group_members(pgid))


def live_processes() -> list[tuple[int, int, int]]:
    """(pid, parent pid, process group) of every process that has not exited (zombies excluded)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] not in ("Z", "X"):
                out.append((int(d.name), int(fields[1]), int(fields[2])))
    return out


def group_members(pgid: int) -> list[int]:
    return [pid for pid, _, group in live_processes() if group == pgid]


# pdctl's settings for vLLM (the queue plugin's) come from the plan only: one exported in pdctl's own shell must not
# reach a server the plan leaves plain (a benchmark's plain-vLLM reference, a GPU server). Nor may a
# VLLM_API_KEY exported there lock the servers of a topology without auth (pdctl would not send it).
PLAN_ONLY_ENV = (protocol.QUEUE_SPIN_ENV, auth.VLLM_KEY_ENV)


def _inherited() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PLAN_ONLY_ENV}


CAP_SYS_NICE = 23


def may_lower_niceness_to(target: int) -> bool:
    """Whether this process may set a niceness below its own to `target` (what the guard does for a negative
    nice): with CAP_SYS_NICE, or when RLIMIT_NICE allows it (the limit is 20 - the lowest niceness)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:") and int(line.split()[1], 16) >> CAP_SYS_NICE & 1:
                return True
    except (OSError, ValueError, IndexError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= target


def nice_problems(plan: Plan) -> list[str]:
    """The instances whose pool's negative nice this host will not grant pdctl (refused before anything starts)."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    out = []
    for spec in plan.processes:
        target = max(-20, own + spec.nice)
        if target < own and not may_lower_niceness_to(target):
            out.append(f"{spec.name}: nice {spec.nice} (pool {spec.pool}) would lower the niceness to {target}, "
                       f"which needs CAP_SYS_NICE or RLIMIT_NICE >= {20 - target} (ulimit -e; now "
                       f"{resource.getrlimit(resource.RLIMIT_NICE)[0]}); run pdctl with either, or use a nice >= 0")
    return out


class LocalEngine(RestartableEngine):
    name = "local"

    def __init__(self) -> None:
        self._children: dict[str, subprocess.Popen] = {}  # only for processes this pdctl started

    def preflight(self, plan: Plan) -> list[str]:
        problems = []
        for spec in plan.processes:
            for kind, port in spec.ports.items():
                if not probe.port_free(spec.host, port):
                    problems.append(f"{spec.name}: {kind} port {spec.host}:{port} is already in use on this host")
        return problems + nice_problems(plan)

    def start(self, plan: Plan, spec: ProcessSpec, state: LaunchState, *, attached: bool) -> None:
        Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as log:
            log.write(f"--- pdctl: starting {spec.name} at {time.strftime('%F %T')}\n".encode())
            log.flush()
            # Foreground: if pdctl itself is killed (even -9), everything it started stops instead of living on.
            # The key (auth.api_key_env) is read here, at spawn, into the child's environment only.
            # A process group of its own keeps a terminal's Ctrl-C for pdctl to handle in order; the session stays
            # pdctl's so every server shares one autogroup: across autogroups the scheduler splits a shared core by
            # group, and a spinning NIXL progress thread starves the other server's UCX write it waits for
            # (docs/notes/ucx-transports.md).
            proc = subprocess.Popen(
                guarded(spec.argv, orphan=not attached, nice=spec.nice),
                env={**_inherited(), **spec.env, **auth.spawn_env(spec)},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, process_group=0,
                preexec_fn=_die_with_parent if attached else None,
            )
        self._children[spec.name] = proc
        state.processes[spec.name] = ProcessRecord(spec.name, proc.pid, proc.pid, start_ticks(proc.pid) or 0,
                                                   time.time())

    def _is_ours(self, rec: ProcessRecord) -> bool:
        ticks = start_ticks(rec.pid)
        return ticks is not None and (rec.start_ticks == 0 or ticks == rec.start_ticks)

    def liveness(self, state: LaunchState, name: str) -> Liveness:
        child = self._children.get(name)
        if child is not None:
            code = child.poll()
            return Liveness(code is None, code)
        rec = state.processes.get(name)
        return Liveness(rec is not None and self._is_ours(rec))

    def stop(self, state: LaunchState, grace_s: float = STOP_GRACE_S, names: list[str] | None = None) -> StopReport:
        """Stop every recorded process (or the named ones) and all of their process groups."""
        report = StopReport([], [], [])
        groups: dict[str, int] = {}
        for name, rec in state.processes.items():
            if names is not None and name not in names:
                continue
            leader_ours = self._is_ours(rec)
            # A pid reused by an unrelated process that leads its own group must not be signalled.
            if not leader_ours and start_ticks(rec.pid) is not None and os.getpgid(rec.pid) == rec.pid:
                report.already_gone.append(name)
                continue
            if group_alive(rec.pgid):
                groups[name] = rec.pgid
                os.killpg(rec.pgid, signal.SIGTERM)
                report.stopped.append(name)
            else:
                report.already_gone.append(name)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(group_alive(g) for g in groups.values()):
            self._reap()
            time.sleep(0.1)
        for name, pgid in groups.items():
            if group_alive(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                    report.killed.append(name)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(group_alive(g) for g in groups.values()):
            self._reap()
            time.sleep(0.05)
        self._reap()
        return report

    def stop_one(self, state: LaunchState, name: str, grace_s: float = 10.0) -> StopReport:
        return self.stop(state, grace_s, [name])

    def _reap(self) -> None:
        for child in self._children.values():
            child.poll()
