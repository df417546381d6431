#!/usr/bin/env python
"""Time to ready and engine memory on each engine: the CPU demo pair (prefill block 32 -> decode block 64) brought up
with `pdctl up -d` on the local engine, on a two-node Ray cluster and on a two-node Slurm cluster (both on
loopback addresses on this machine, as in the e2e tests). Prints a table and writes JSON.

Engine memory is the PSS of the engine's own processes (Ray: GCS, raylets, agents, the instance actors; Slurm:
munged, slurmctld, slurmd, slurmstepd) while the topology is up, so the vLLM servers are not counted.

    .venv/bin/python scripts/bench_engines.py [--engines local,ray,slurm] [--out results/bench_engines.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.e2e.clusters import RayCluster, SlurmCluster  # noqa: E402

CONFIGS = {"local": "cpu-demo.yaml", "ray": "cpu-ray.yaml", "slurm": "cpu-slurm.yaml"}


def pss_kib(pids: list[int]) -> int:
    total = 0
    for pid in set(pids):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def pids_by_exe(suffix: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.readlink(d / "exe").endswith(suffix):
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def pdctl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdctl", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=600)


def bring_up(engine: str, state: Path, env: dict, extra: list[str]) -> dict:
    t0 = time.perf_counter()
    r = pdctl("up", "-d", str(REPO / "configs" / CONFIGS[engine]), "--state-dir", str(state), *extra, env=env)
    ready = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{engine}: pdctl up failed\n{r.stdout}\n{r.stderr}")
    return {"engine": engine, "time_to_ready_s": round(ready, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="local,ray,slurm")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_engines.json"))
    a = ap.parse_args()
    rows = []
    for engine in a.engines.split(","):
        tmp = Path(tempfile.mkdtemp(prefix=f"pdbench-{engine}-"))
        env = dict(os.environ)
        print(f"{engine}: bringing up {CONFIGS[engine]} ...", flush=True)
        if engine == "local":
            row = bring_up(engine, tmp / "state", env, [])
            row["engine_pss_mib"] = 0.0
            pdctl("down", "--state-dir", str(tmp / "state"), env=env)
        elif engine == "ray":
            with RayCluster(tmp) as c:
                idle = pss_kib(c.pids())
                row = bring_up(engine, tmp / "state", env, ["--set", f"engine.address={c.address}"])
                row["engine_idle_pss_mib"] = round(idle / 1024, 1)
                row["engine_pss_mib"] = round(pss_kib(c.pids()) / 1024, 1)
                pdctl("down", "--state-dir", str(tmp / "state"), env=env)
        else:
            with SlurmCluster(tmp) as c:
                env["SLURM_CONF"] = str(c.conf)

                def daemons():
                    return ([p.pid for p in c.daemons.values()] + pids_by_exe("/slurmstepd")
                            + pids_by_exe("/munged"))

                idle = pss_kib(daemons())
                row = bring_up(engine, tmp / "state", env, [])
                row["engine_idle_pss_mib"] = round(idle / 1024, 1)
                row["engine_pss_mib"] = round(pss_kib(daemons()) / 1024, 1)
                pdctl("down", "--state-dir", str(tmp / "state"), env=env)
        rows.append(row)
        print(f"  {row}", flush=True)
    local = next((r["time_to_ready_s"] for r in rows if r["engine"] == "local"), None)
    print(f"\n{'engine':8} {'ready s':>8} {'vs local':>9} {'engine idle MiB':>16} {'engine up MiB':>14}")
    for r in rows:
        ratio = f"{r['time_to_ready_s'] / local:.2f}x" if local else "-"
        print(f"{r['engine']:8} {r['time_to_ready_s']:8.1f} {ratio:>9} {r.get('engine_idle_pss_mib', 0):16.1f} "
              f"{r['engine_pss_mib']:14.1f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=2))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
