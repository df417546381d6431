"""Catch a KV read stall in the act, for docs/notes/ucx-transports.md.

Run beside scripts/bench_first_read.py (or any `pdctl up` with connector.trace on). When a decode's read is issued
and not done for 2 s, it records for that decode's worker: its main thread's /proc/PID/task/PID/{syscall,stack,stat}
three times 0.3 s apart, 3 s of `strace -p`, two `py-spy dump --native` (pip install py-spy), every vLLM worker
thread's kernel stack, the native stacks of every thread of every server's engine and worker processes, prefills
included (`gdb -batch thread apply all bt`: the UCX progress and async threads py-spy does not show), and the logs
(at the catch and 35 s later). Linux, as root or with ptrace rights.

  python scripts/catch_stall.py /tmp/pdctl-bench-first-read /tmp/stalls &
  python scripts/bench_first_read.py --placement shared --ucx pdctl --repeat 10
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import time

PY_SPY = os.path.join(os.path.dirname(sys.executable), "py-spy")
TRACE = re.compile(r"pdctl trace (\w+) (\S+) (\d+\.\d+)")
WORKER = re.compile(r"\(Worker pid=(\d+)\) .*pdctl trace read_issued (\S+)")
ANY_ENGINE = re.compile(r"\((?:Worker|EngineCore) pid=(\d+)\)")
WORKER_PID = re.compile(r"\(Worker pid=(\d+)\)")
PREFILL_OF = re.compile(r"probe-(prefill-\S+?-\d+)-decode-")  # the probe's request id names its pair
ENGINE_PIDS: list[str] = []  # every server's engine and worker processes, from the logs of the bring-up caught


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        return f"({e})"


def thread_sample(pid: str) -> str:
    task = f"/proc/{pid}/task/{pid}"
    return (f"syscall: {read(task + '/syscall')}stat: {read(task + '/stat').split()[2:3]}\n"
            f"wchan: {read(task + '/wchan')}\nstack:\n{read(task + '/stack')}")


def gdb_all_threads(pids: list[str]) -> list[str]:
    """Native stacks of every thread of these processes, taken at once (gdb, raised above the spinning threads:
    on a loaded core an attach took 51 s). The main thread first and deep; the others shallow."""
    # Symbols of the libraries that matter only (libc, UCX, NIXL, ZMQ, Python): loading torch's took 5-50 s.
    libs = [a for lib in ("libc.", "libucp", "libuct", "libucs", "plugin_UCX", "libnixl", "libzmq", "libpython")
            for a in ("-ex", f"sharedlibrary {lib}")]
    procs = {p: subprocess.Popen(["nice", "-n", "-10", "timeout", "90", "gdb", "-p", p, "-batch", "-iex",
                                  "set auto-solib-add off", *libs, "-ex", "thread apply 1 bt 40", "-ex",
                                  "thread apply all bt 16"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for p in pids}
    out = []
    for p, proc in procs.items():
        stdout = proc.communicate()[0]
        out.append(f"--- gdb {p} (main thread, then all threads) at {time.time():.3f}\n" + "\n".join(
            ln for ln in stdout.splitlines() if ln.startswith(("Thread ", "#")))[:80000])
    return out


def kernel_view(pids: list[str]) -> str:
    """Every thread as the kernel sees it: state, the system call it is in (number and arguments), where it
    sleeps, the cores it may run on, its whole kernel stack."""
    rows = []
    for p in pids:
        for t in sorted(glob.glob(f"/proc/{p}/task/*"), key=lambda x: int(os.path.basename(x))):
            cpus = next((ln.split(":", 1)[1].strip() for ln in read(t + "/status").splitlines()
                         if ln.startswith("Cpus_allowed_list")), "?")
            stack = " < ".join(x.split()[-1] for x in read(t + "/stack").strip().splitlines())
            rows.append(f"{p}/{os.path.basename(t)} {read(t + '/comm').strip()} "
                        f"{read(t + '/stat').rsplit(')', 1)[-1].split()[:1]} cpus={cpus} "
                        f"syscall={read(t + '/syscall').strip()} wchan={read(t + '/wchan').strip()} {stack}")
    return "--- kernel view of every thread (pid/tid comm state cpus syscall wchan stack)\n" + "\n".join(rows)


def spinning_threads(pids: list[str], over_s: float = 0.5) -> str:
    """Which threads burn CPU (user+system ticks over `over_s`): no ptrace, so nothing is stopped."""
    def ticks() -> dict[str, tuple[str, int]]:
        out = {}
        for p in pids:
            for t in glob.glob(f"/proc/{p}/task/*"):
                f = read(t + "/stat").rsplit(")", 1)[-1].split()
                if len(f) > 12:
                    out[f"{p}/{os.path.basename(t)}"] = (read(t + "/comm").strip(), int(f[11]) + int(f[12]))
        return out
    a = ticks()
    time.sleep(over_s)
    b = ticks()
    rows = sorted(((b[k][1] - a[k][1], k, b[k][0]) for k in b if k in a), reverse=True)
    return f"--- threads burning CPU over {over_s} s (ticks of 10 ms: pid/tid comm)\n" + "\n".join(
        f"{d:4d} {k} {c}" for d, k, c in rows if d > 0)


def evidence(pid: str | None, first: list[str]) -> list[str]:
    """`first`: the stalled pair's processes (its decode's and its prefill's worker), dumped before anything else:
    a stall may end within seconds, and gdb takes about 5 s per process."""
    out = []
    has_gdb = shutil.which("gdb") is not None
    live = [w for w in first if os.path.exists(f"/proc/{w}")]
    out.append(kernel_view(live))  # first: no ptrace, nothing stopped, the state the stall is in
    out.append(spinning_threads(live))
    if has_gdb:
        out += gdb_all_threads(live)
        out.append(spinning_threads(live))
        out += gdb_all_threads(live)  # again: what stays put is what the stall waits on
    if pid:
        for k in range(3):
            out.append(f"--- sample {k} at {time.time():.3f}\n{thread_sample(pid)}")
            time.sleep(0.3)
        r = subprocess.run(["timeout", "3", "strace", "-tt", "-T", "-p", pid], capture_output=True, text=True)
        out.append("--- strace (3 s, main thread)\n" + r.stderr[-8000:])
        r = subprocess.run([PY_SPY, "dump", "--native", "--pid", pid], capture_output=True, text=True, timeout=60)
        out.append(f"--- py-spy\n{(r.stdout or r.stderr)[:4000]}")
    workers = [w for w in sorted(set(ENGINE_PIDS)) if os.path.exists(f"/proc/{w}")]
    if has_gdb:  # every other engine and worker: the progress and async threads of the servers not in the pair
        out += gdb_all_threads([w for w in workers if w not in first])
    out.append(kernel_view(workers))
    return out


def main() -> int:
    root, out = sys.argv[1], sys.argv[2]
    seen: set[str] = set()
    while True:
        for log in glob.glob(f"{root}/**/decode*.log", recursive=True):
            text = read(log)
            stages: dict[str, dict[str, float]] = {}
            for stage, rid, at in TRACE.findall(text):
                stages.setdefault(rid, {})[stage] = float(at)
            worker = {rid: pid for pid, rid in WORKER.findall(text)}
            now = time.time()
            for rid, s in stages.items():
                if "read_issued" not in s or "read_done" in s or now - s["read_issued"] <= 2 or rid in seen:
                    continue
                seen.add(rid)
                ENGINE_PIDS[:] = [p for lg in glob.glob(os.path.dirname(log) + "/*.log")
                                  for p in ANY_ENGINE.findall(read(lg))]
                pair_prefill = PREFILL_OF.search(rid)
                prefill_log = os.path.join(os.path.dirname(log), f"{pair_prefill.group(1)}.log") if pair_prefill else ""
                prefill_workers = WORKER_PID.findall(read(prefill_log)) if prefill_log else []
                first = [p for p in (worker.get(rid), prefill_workers[-1] if prefill_workers else None) if p]
                d = os.path.join(out, f"{len(seen):02d}-{os.path.basename(log)}-{rid[-40:]}")
                os.makedirs(d, exist_ok=True)
                logs = glob.glob(os.path.dirname(log) + "/*.log")
                for lg in logs:  # first: a bench takes the next bring-up's logs in their place
                    shutil.copy(lg, os.path.join(d, "at-catch-" + os.path.basename(lg)))
                head = f"log {log}\nrid {rid}\nstages {s}\nnow {now}\nworker {worker.get(rid)}\n"
                with open(os.path.join(d, "evidence.txt"), "w") as f:
                    f.write("\n".join([head, *evidence(worker.get(rid), first)]))
                print("caught", d, flush=True)
                time.sleep(35)
                for lg in logs:
                    if os.path.exists(lg):
                        shutil.copy(lg, os.path.join(d, "later-" + os.path.basename(lg)))
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main())
