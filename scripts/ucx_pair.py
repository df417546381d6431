"""Two bare NIXL agents on one core, no vLLM: does a READ complete while its target makes no NIXL call?

The target registers 1 MiB and sleeps; the initiator adds it, posts a READ with a notification and polls it.
Run under the environment to test (UCX_* variables, PROG=0|1 for NIXL's progress thread, NTHR for NIXL's extra
UCX workers, DELAY_US for its progress thread's pause between passes as pdctl's connector sets it); UCX_PROTO_INFO=y
prints the lanes UCX chose.

Usage: python scripts/ucx_pair.py [--seconds 5]     (starts both agents on core 0 and prints the outcome)
Measured (docs/notes/ucx-transports.md): with UCX's defaults and the target's progress thread off the READ stays
in progress for the whole run although its bytes arrived; with pdctl's one-host settings it is DONE in < 1 ms.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def agent(role: str, d: Path, seconds: float) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    from pdctl.connector import seam

    conf = nixl_agent_config(enable_prog_thread=os.environ.get("PROG", "1") == "1",
                             num_threads=int(os.environ.get("NTHR", "0")))
    # DELAY_US: the progress thread's pause between passes, as pdctl's connector sets it (0: NIXL's spinning)
    with seam.nixl_agent_settings(os.environ.get("PROG", "1") == "1", int(os.environ.get("DELAY_US", "0"))):
        a = nixl_agent(role, conf)
    t = torch.full((1 << 20,), 7 if role == "target" else 0, dtype=torch.uint8)
    a.register_memory(a.get_reg_descs(t))
    if role == "target":
        (d / "meta").write_bytes(a.get_agent_metadata())
        (d / "descs").write_bytes(a.get_serialized_descs(a.get_xfer_descs(t)))
        (d / "ready").touch()
        time.sleep(seconds + 1)
        print(f"target: notifications {a.get_new_notifs()}", flush=True)
        return
    while not (d / "ready").exists():
        time.sleep(0.05)
    name = a.add_remote_agent((d / "meta").read_bytes())
    handle = a.initialize_xfer("READ", a.get_xfer_descs(t), a.deserialize_descs((d / "descs").read_bytes()), name,
                               b"done")
    t0 = time.perf_counter()
    a.transfer(handle)
    posted = time.perf_counter() - t0
    state = a.check_xfer_state(handle)
    while state not in ("DONE", "ERR") and time.perf_counter() - t0 < seconds:
        time.sleep(0.001)
        state = a.check_xfer_state(handle)
    print(f"initiator: READ {state} after {time.perf_counter() - t0:.3f} s (posting took {posted:.3f} s), bytes "
          f"arrived: {bool((t == 7).all())}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--role", choices=("target", "initiator"), help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        agent(a.role, Path(a.dir), a.seconds)
        return 0
    with tempfile.TemporaryDirectory() as d:
        cmd = ["taskset", "-c", "0", sys.executable, __file__, "--dir", d, "--seconds", str(a.seconds), "--role"]
        target = subprocess.Popen([*cmd, "target"])
        code = subprocess.call([*cmd, "initiator"])
        target.wait()
    return code


if __name__ == "__main__":
    sys.exit(main())
