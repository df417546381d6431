"""Time-to-ready of `pdctl up` (1 prefill + 1 decode + proxy, warm-up included) versus the slower of the two
instances started alone, as a ratio (target <= 1.15).

Usage: python scripts/bench_startup.py [configs/cpu-homog.yaml] [--repeat 2] [--out results/bench_startup.json]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pdctl.launch import run as run_mod
from pdctl.launch.local import LocalBackend
from pdctl.plan import Plan, build_plan
from pdctl.topology import load_topology


def time_to_ready(plan: Plan) -> float:
    backend = LocalBackend()
    problems = backend.preflight(plan)
    if problems:
        raise SystemExit("; ".join(problems))
    t0 = time.perf_counter()
    state = run_mod.up(plan, backend, attached=True, timeout_s=400)
    took = time.perf_counter() - t0
    run_mod.down(state, backend)
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology", nargs="?", default="configs/cpu-homog.yaml")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default="results/bench_startup.json")
    a = ap.parse_args()
    loaded = load_topology(a.topology)
    full = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/tmp/pdctl-bench-startup"),
                      python=sys.executable)
    alone = {role: full.with_processes([full.get(f"{role}-0")]) for role in ("prefill", "decode")}
    rows: dict[str, list[float]] = {"prefill alone": [], "decode alone": [], "pdctl up (P+D+proxy+warm-up)": []}
    for _ in range(a.repeat):
        rows["prefill alone"].append(time_to_ready(alone["prefill"]))
        rows["decode alone"].append(time_to_ready(alone["decode"]))
        rows["pdctl up (P+D+proxy+warm-up)"].append(time_to_ready(full))
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratio = med["pdctl up (P+D+proxy+warm-up)"] / max(med["prefill alone"], med["decode alone"])
    print(f"{'what':32} {'median s':>9}  runs")
    for k, v in rows.items():
        print(f"{k:32} {med[k]:>9.1f}  {', '.join(f'{x:.1f}' for x in v)}")
    print(f"ratio pdctl up / slower instance alone: {ratio:.2f} (target <= 1.15)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "runs": rows, "median_s": med,
                                       "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
