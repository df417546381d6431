#!/usr/bin/env python
"""Heterogeneous vs homogeneous P/D at the same load: TTFT and TPOT of P/D for each case, as the median over
repeated, interleaved `pdctl bench --skip-check --skip-eval` runs (one run's p50 moves by 10-30 % on 2 shared
cores; interleaving spreads drift over every case). Prints a table and writes JSON.

    .venv/bin/python scripts/bench_hetero.py [--reps 3] [--requests 32] [--cases homog,d64,d128,p64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CASES = {
    "homog": ("cpu-homog.yaml", []),  # P32 -> D32: the baseline
    "homog64": ("cpu-demo.yaml", ["--prefill-block-size", "64"]),  # P64 -> D64: d64's decode, homogeneous
    "d64": ("cpu-demo.yaml", []),  # P32 -> D64
    "d128": ("cpu-demo.yaml", ["--decode-block-size", "128"]),  # P32 -> D128
    "p64": ("cpu-demo.yaml", ["--prefill-block-size", "64", "--decode-block-size", "32"]),  # P64 -> D32
}
METRICS = ("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50", "e2e_ms_p50", "req_per_s", "bunched")


def run_case(case: str, requests: int, out: Path) -> dict:
    config, extra = CASES[case]
    r = subprocess.run([sys.executable, "-m", "pdctl", "bench", str(REPO / "configs" / config), *extra,
                        "--skip-check", "--skip-eval", "--requests", str(requests), "--results", str(out),
                        "--state-dir", str(out / "state"), "--json"],
                       capture_output=True, text=True, cwd=REPO, timeout=1200)
    if r.returncode != 0:
        raise SystemExit(f"{case}: pdctl bench failed\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)["perf"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--cases", default="homog,d64")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_hetero.json"))
    a = ap.parse_args()
    cases = a.cases.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    tmp = Path(tempfile.mkdtemp(prefix="pdhetero-"))
    for rep in range(a.reps):
        for c in cases:
            t0 = time.monotonic()
            perf = run_case(c, a.requests, tmp / f"{c}-{rep}")
            runs[c].append(perf)
            pd = perf["pd"]
            print(f"rep {rep} {c:6} P/D ttft p50 {pd['ttft_ms_p50']:7.1f} ms  tpot p50 {pd['tpot_ms_p50']:6.2f} ms"
                  f"  bunched streams {pd.get('bunched', 0)}  ({time.monotonic() - t0:.0f} s)", flush=True)
    med = {c: {m: statistics.median(r["pd"][m] for r in runs[c]) for m in METRICS} for c in cases}
    base = med.get("homog")
    print(f"\nP/D at concurrency 4, {a.requests} requests x 256 prompt + 32 output tokens, median of {a.reps}:")
    print(f"{'case':6} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'TTFT/homog':>11} {'TPOT/homog':>11}")
    for c in cases:
        m = med[c]
        rt = f"{m['ttft_ms_p50'] / base['ttft_ms_p50']:.3f}x" if base else "-"
        rp = f"{m['tpot_ms_p50'] / base['tpot_ms_p50']:.3f}x" if base else "-"
        print(f"{c:6} {m['ttft_ms_p50']:12.1f} {m['tpot_ms_p50']:12.2f} {rt:>11} {rp:>11}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "median": med, "runs": runs}, indent=2))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
