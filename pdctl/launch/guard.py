"""`python -m pdctl.launch.guard [--watch PID --detach] -- ARGV...`: run ARGV so none of it outlives its owner.

A parent-death signal reaches only the direct child: a vLLM API server that gets it exits, but its EngineCore
and workers (its own children) live on, orphaned, holding the NIXL side-channel port. The guard
leads a process group holding the server and all it starts; when its owner dies or it is told to stop, it stops
the whole group: SIGTERM, then SIGKILL.

The owner is the guard's parent (pdctl in the foreground: parent-death signal), with --watch a process it
polls (a Ray actor), or nobody with --orphan (`pdctl up -d`: the servers outlive the command; `pdctl down` or
the supervisor stops them). When the server exits, the guard writes one line to its stderr (the instance's
log) saying how: `--- pdctl guard: server exited with code N` or `... killed by signal 9 (SIGKILL)`; the
supervisor and `pdctl status` read it.

A Ray worker SIGKILLs its direct children when it exits, which would take the guard and leave the group
orphaned: with --detach the guard forks away from its parent first, and prints its pid.

With --nice N the guard adds N to its niceness before it starts the server (a pool's `nice`): Linux keeps a
niceness per thread and every thread and process inherits its creator's, so the server and everything it starts
(vLLM's engine core, its workers and all their threads) run at it. Done here, at spawn, because renicing a live
server would have to chase threads it is still creating.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

from pdctl.launch.logs import EXIT_MARK

_PR_SET_PDEATHSIG = 1
GRACE_S = 10.0


def _group_has_others(pgid: int, me: int) -> bool:
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me:
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
    return False


def _start_ticks(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else fields[19]




def add_niceness(n: int) -> str | None:
    """Add n to this process's niceness (what it starts inherits it); None, or why the host refused."""
    try:
        os.nice(n)
    except OSError as e:  # lowering it needs CAP_SYS_NICE or RLIMIT_NICE; the local engine's preflight says so first
        return (f"cannot add {n} to the niceness ({e.strerror}); a negative nice needs CAP_SYS_NICE or a high "
                "enough RLIMIT_NICE")
    return None


def exit_line(code: int) -> str:
    """How the server ended, as Popen reports it (negative: killed by that signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        return f"{EXIT_MARK}killed by signal {-code} ({name})"
    return f"{EXIT_MARK}exited with code {code}"


def main(argv: list[str]) -> int:
    watch: int | None = None
    nice = 0
    detach = orphan = False
    while argv and argv[0] != "--":
        if argv[0] == "--watch" and len(argv) > 1:
            watch, argv = int(argv[1]), argv[2:]
        elif argv[0] == "--nice" and len(argv) > 1:
            nice, argv = int(argv[1]), argv[2:]
        elif argv[0] == "--detach":
            detach, argv = True, argv[1:]
        elif argv[0] == "--orphan":
            orphan, argv = True, argv[1:]
        else:
            break
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or (detach and watch is None):
        print("usage: python -m pdctl.launch.guard [--watch PID [--detach] | --orphan] [--nice N] -- COMMAND "
              "[ARGS...]", file=sys.stderr)
        return 2
    why = add_niceness(nice) if nice else None
    if why:
        print(f"{EXIT_MARK}not started: {why}", file=sys.stderr, flush=True)
        return 1
    watched = _start_ticks(watch) if watch is not None else None
    if detach:
        pid = os.fork()
        if pid:
            print(pid, flush=True)
            os._exit(0)
        os.dup2(2, 1)  # stdout was the pipe for the pid; the command's output goes where stderr goes
        os.setsid()
    elif os.getpgrp() != os.getpid():
        os.setpgrp()
    if watch is None and not orphan:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() == 1:  # the parent died before the signal was armed
            return 1
    child = subprocess.Popen(argv)
    stopping: list[int] = []

    def on_signal(signum, _frame):
        stopping.append(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    while child.poll() is None and not stopping:
        if watch is not None and _start_ticks(watch) != watched:
            stopping.append(signal.SIGTERM)  # the owner is gone (or its pid now names another process)
            break
        time.sleep(0.2)
    code = child.returncode
    if code is not None:
        try:
            print(exit_line(code), file=sys.stderr, flush=True)
        except OSError:  # a full disk must not keep the group from being stopped
            pass
    # The server is gone or must go: nothing it started may stay behind.
    me, pgid = os.getpid(), os.getpgrp()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and _group_has_others(pgid, me):
        child.poll()
        time.sleep(0.1)
    if _group_has_others(pgid, me):
        for d in os.listdir("/proc"):
            if d.isdigit() and int(d) != me:
                try:
                    if os.getpgid(int(d)) == pgid:
                        os.kill(int(d), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
    child.poll()
    if code is None:
        code = child.returncode if child.returncode is not None else 128 + stopping[0]
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
