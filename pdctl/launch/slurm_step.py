"""`python -m pdctl.launch.slurm_step [--nice N] -- ARGV...`: one Slurm job step's command, run on its node.

The batch script is rendered before Slurm picks nodes, so the server's listen address and NIXL side-channel
host are written as {node_addr}; here, on the node, that becomes the node's address from `scontrol show node`
(the NodeAddr the other side and the proxy reach it at), and the command replaces this process, at this
process's niceness plus N (a pool's `nice`; srun's own --nice is the job's queue priority, not this).
"""

from __future__ import annotations

import os
import subprocess
import sys

from pdctl.launch.guard import add_niceness

PLACEHOLDER = "{node_addr}"


def node_addr() -> str:
    name = os.environ.get("SLURMD_NODENAME", "")
    if name:
        r = subprocess.run(["scontrol", "show", "node", name, "--oneliner"], capture_output=True, text=True,
                           timeout=30)
        for field in r.stdout.split():
            if field.startswith("NodeAddr="):
                return field.split("=", 1)[1]
    return subprocess.run(["hostname", "-i"], capture_output=True, text=True, timeout=10).stdout.split()[0]


def main(argv: list[str]) -> int:
    nice = 0
    if argv[:1] == ["--nice"]:
        try:
            nice, argv = int(argv[1]), argv[2:]
        except (IndexError, ValueError):
            argv = []  # the usage below
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m pdctl.launch.slurm_step [--nice N] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    why = add_niceness(nice) if nice else None
    if why:
        print(f"--- pdctl: step not started: {why}", file=sys.stderr, flush=True)
        return 1
    addr = node_addr()
    for k, v in list(os.environ.items()):
        if PLACEHOLDER in v:
            os.environ[k] = v.replace(PLACEHOLDER, addr)
    argv = [a.replace(PLACEHOLDER, addr) for a in argv]
    print(f"--- pdctl: step on {os.environ.get('SLURMD_NODENAME', '?')} ({addr})", flush=True)
    if os.getpgrp() != os.getpid():
        os.setpgrp()  # one group for the server and all it starts
    pidfile = os.environ.pop("PDCTL_STEP_PIDFILE", "")
    if pidfile:
        os.makedirs(os.path.dirname(pidfile), exist_ok=True)
        with open(f"/proc/{os.getpid()}/stat") as f:
            ticks = f.read().rsplit(")", 1)[1].split()[19]
        with open(pidfile, "w") as f:
            f.write(f"{os.getpid()} {ticks}\n")
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
