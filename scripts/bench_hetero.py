#!/usr/bin/env python
"""Heterogeneous vs homogeneous P/D at the same load: TTFT and TPOT of P/D for each case, as the median over
repeated, interleaved `pdctl bench --skip-check --skip-eval` runs (one run's p50 moves by 10-30 % on 2 shared
cores; interleaving spreads drift over every case). Prints a table and writes JSON.

Each hetero case is held against the homogeneous pair that shares the side a metric depends on: TTFT against
the homogeneous pair at the prefill's block size (the same prefill), TPOT against the one at the decode's block
size (the same decode: the CPU attention kernel's own speed differs by block size, as much in aggregated
serving, so a P32 -> D32 TPOT says nothing about what heterogeneity costs a D64 decode).

    .venv/bin/python scripts/bench_hetero.py [--reps 3] [--requests 32] [--cases homog,homog64,d64,p64]
    .venv/bin/python scripts/bench_hetero.py --table results/bench_hetero.json   # the table again
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
CASES = {  # name: (topology, overrides, prefill block, decode block)
    "homog": ("cpu-homog.yaml", [], 32, 32),
    "homog64": ("cpu-demo.yaml", ["--prefill-block-size", "64"], 64, 64),
    "homog128": ("cpu-demo.yaml", ["--prefill-block-size", "128", "--decode-block-size", "128"], 128, 128),
    "d64": ("cpu-demo.yaml", [], 32, 64),
    "d128": ("cpu-demo.yaml", ["--decode-block-size", "128"], 32, 128),
    "p64": ("cpu-demo.yaml", ["--prefill-block-size", "64", "--decode-block-size", "32"], 64, 32),
}
METRICS = ("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50", "e2e_ms_p50", "req_per_s", "bunched")


def run_case(case: str, requests: int, out: Path) -> dict:
    config, extra, _, _ = CASES[case]
    r = subprocess.run([sys.executable, "-m", "pdctl", "bench", str(REPO / "configs" / config), *extra,
                        "--skip-check", "--skip-eval", "--requests", str(requests), "--results", str(out),
                        "--state-dir", str(out / "state"), "--json"],
                       capture_output=True, text=True, cwd=REPO, timeout=1200)
    if r.returncode != 0:
        raise SystemExit(f"{case}: pdctl bench failed\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)["perf"]


def burst(perf: dict) -> bool:
    """A run whose streams arrived all at once (TPOT ~0, TTFT ~ the whole request: the tokens were held
    upstream of the client, seen on 2 busy cores): its TTFT and TPOT measure nothing, so it is left out."""
    pd = perf["pd"]
    return pd["tpot_ms_p50"] < 1.0 or 2 * pd.get("bunched", 0) > pd["requests"]


def medians(runs: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for c, rs in runs.items():
        clean = [r for r in rs if not burst(r)] or rs
        out[c] = {m: statistics.median(r["pd"].get(m, 0) for r in clean) for m in METRICS}
        out[c]["runs_used"] = len(clean)
    return out


def homog_for(block: int, cases: list[str]) -> str | None:
    return next((c for c in cases if CASES[c][2] == CASES[c][3] == block), None)


def table(med: dict[str, dict], requests: int, reps: int) -> None:
    print(f"\nP/D at concurrency 4, {requests} requests x 256 prompt + 32 output tokens, median of {reps} runs "
          "less burst runs:")
    print(f"{'case':8} {'P->D':>8} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'TTFT / homog same P':>20} "
          f"{'TPOT / homog same D':>20}")
    cases = list(med)
    for c in cases:
        pb, db = CASES[c][2], CASES[c][3]
        m = med[c]
        cols = []
        for metric, block in (("ttft_ms_p50", pb), ("tpot_ms_p50", db)):
            base = homog_for(block, cases)
            cols.append(f"{m[metric] / med[base][metric]:.3f}x ({base})" if base and base != c else "-")
        print(f"{c:8} {f'{pb}->{db}':>8} {m['ttft_ms_p50']:12.1f} {m['tpot_ms_p50']:12.2f} {cols[0]:>20} "
              f"{cols[1]:>20}  ({m['runs_used']} runs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--cases", default="homog,homog64,d64,p64")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_hetero.json"))
    ap.add_argument("--table", help="print the table of an earlier run's JSON and stop")
    a = ap.parse_args()
    if a.table:
        doc = json.loads(Path(a.table).read_text())
        table(medians(doc["runs"]), doc.get("requests", a.requests), len(next(iter(doc["runs"].values()))))
        return
    cases = a.cases.split(",")
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    tmp = Path(tempfile.mkdtemp(prefix="pdhetero-"))
    for rep in range(a.reps):
        for c in cases:
            t0 = time.monotonic()
            perf = run_case(c, a.requests, tmp / f"{c}-{rep}")
            runs[c].append(perf)
            pd = perf["pd"]
            print(f"rep {rep} {c:8} P/D ttft p50 {pd['ttft_ms_p50']:7.1f} ms  tpot p50 {pd['tpot_ms_p50']:6.2f} ms"
                  f"  bunched streams {pd.get('bunched', 0)}{'  BURST' if burst(perf) else ''}  "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    med = medians(runs)
    table(med, a.requests, a.reps)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "requests": a.requests, "reps": a.reps,
                                       "median": med, "runs": runs}, indent=2))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
