"""This host's CPU during a measurement. Steal: the share of CPU time the hypervisor gave to other guests while a
point ran. On a shared VM it moves a deployment's speed from one minute to the next (a 2-core cloud VM measured
0-43 % in 5 s windows while its unloaded TTFT moved 1.7x), so every goodput point records it beside its numbers:
a slow point with high steal says the host was slow, not the deployment. Busy cores, and the CPU each process group
used (a role's servers under load, an idle deployment's beside it): on a CPU host the cores are the accelerator,
and where they went says why a deployment stopped meeting its SLO. Linux only (/proc); None elsewhere."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")
STEAL_NOTE = 0.05  # a report mentions steal once some point lost at least this share of the CPU to other guests


@dataclass(frozen=True)
class CpuTimes:
    steal: int  # clock ticks, all CPUs
    total: int
    idle: int  # idle + iowait
    cpus: int  # the cpuN lines: how many CPUs the ticks are summed over


def parse_stat(text: str) -> CpuTimes | None:
    """The aggregate `cpu` line of /proc/stat: user nice system idle iowait irq softirq steal (guest time is
    already inside user, so it is not added again)."""
    lines = text.split("\n")
    first = lines[0].split()
    if len(first) < 9 or first[0] != "cpu":
        return None
    try:
        ticks = [int(x) for x in first[1:9]]
    except ValueError:
        return None
    cpus = sum(1 for line in lines[1:] if line.startswith("cpu") and line[3:4].isdigit())
    return CpuTimes(steal=ticks[7], total=sum(ticks), idle=ticks[3] + ticks[4], cpus=cpus)


def cpu_times(stat: Path = PROC_STAT) -> CpuTimes | None:
    try:
        return parse_stat(stat.read_text())
    except OSError:
        return None


def worth_saying(steal: float | None) -> bool:
    return steal is not None and steal >= STEAL_NOTE


def steal_share(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """The share of all CPU time between two readings that went to other guests."""
    if before is None or after is None or after.total <= before.total:
        return None
    return max(0, after.steal - before.steal) / (after.total - before.total)


def cpu_count(stat: Path = PROC_STAT) -> int | None:
    """The CPUs /proc/stat sums its ticks over (busy_cores' scale)."""
    try:
        t = parse_stat(stat.read_text())
    except OSError:
        return None
    return t.cpus if t else None


def busy_cores(before: CpuTimes | None, after: CpuTimes | None) -> float | None:
    """How many of this host's CPUs were busy on average between two readings (time stolen by other guests is
    not this guest's work and is left out)."""
    if before is None or after is None or after.total <= before.total or not after.cpus:
        return None
    span = after.total - before.total
    busy = span - (after.idle - before.idle) - max(0, after.steal - before.steal)
    return max(0.0, busy / span * after.cpus)


def group_cpu_seconds(pgid: int, proc: Path = Path("/proc")) -> float | None:
    """CPU time (user + system, every thread) used so far by the live processes of one process group; None when
    /proc cannot be read."""
    return groups_cpu_seconds([pgid], proc)[pgid]


def groups_cpu_seconds(pgids: Iterable[int], proc: Path = Path("/proc")) -> dict[int, float | None]:
    """group_cpu_seconds for several process groups from one pass over /proc (a point reads every group of every
    deployment up, twice): None for a group with no live process, or when /proc cannot be read."""
    ticks: dict[int, int | None] = dict.fromkeys(pgids)
    try:
        entries = [d for d in proc.iterdir() if d.name.isdigit()]
    except OSError:
        return dict.fromkeys(ticks)
    for d in entries:
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        group = int(fields[2])
        if group in ticks:
            ticks[group] = (ticks[group] or 0) + int(fields[11]) + int(fields[12])
    hz = os.sysconf("SC_CLK_TCK")
    return {g: None if t is None else t / hz for g, t in ticks.items()}
