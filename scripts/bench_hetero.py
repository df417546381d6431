#!/usr/bin/env python
"""Heterogeneous vs homogeneous P/D at the same load: TTFT and TPOT through the proxy, per case, at concurrency 1
(no queueing: what a request pays for the transfer and the conversion) and under load as an open loop (Poisson
arrivals at `--rate` req/s, the same arrival times for every case of a repetition: a closed loop would give a
slower case less load, and its waves made TTFT p50 swing 40 % between runs). Each case is brought up alone
(`pdctl up -d`, no aggregated reference beside it), warmed up, loaded, brought down; cases are interleaved over
`--reps` repetitions and each number is the median over them. Prints a table and writes JSON. The load is vLLM's
serving benchmark (pdctl.bench.load); a repetition's prompts come fresh from vLLM's `--dataset`, the same for
every case of it (each case is its own bring-up) and none twice within a bring-up.

Each hetero case is held against the homogeneous pair that shares the side a metric depends on: TTFT against
the homogeneous pair at the prefill's block size (the same prefill), TPOT against the one at the decode's block
size (the same decode: the CPU attention kernel's own speed differs by block size, as much in aggregated
serving). The other pair is shown too.

    .venv/bin/python scripts/bench_hetero.py [--reps 3] [--cases homog,homog64,d64,p64] [--rate 4] [--dataset random]
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
sys.path.insert(0, str(REPO))

from pdctl import api  # noqa: E402
from pdctl.bench import load  # noqa: E402
from pdctl.topology import resolved_model  # noqa: E402

CASES = {  # name: (topology, overrides, prefill block, decode block)
    "homog": ("cpu-homog.yaml", [], 32, 32),
    "homog64": ("cpu-demo.yaml", ["--set", "prefill.block_size=64"], 64, 64),
    "homog128": ("cpu-demo.yaml", ["--set", "prefill.block_size=128", "--set", "decode.block_size=128"], 128, 128),
    "d64": ("cpu-demo.yaml", [], 32, 64),
    "d128": ("cpu-demo.yaml", ["--set", "decode.block_size=128"], 32, 128),
    "p64": ("cpu-demo.yaml", ["--set", "prefill.block_size=64", "--set", "decode.block_size=32"], 64, 32),
}
METRICS = ("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50", "e2e_ms_p50", "req_per_s", "bunched")
PROMPT, OUTPUT, VOCAB = 256, 32, 1000


def pdctl(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "pdctl", *args], capture_output=True, text=True, cwd=REPO,
                       timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"pdctl {' '.join(args)} failed\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout


def workloads(loads: list[tuple[str, int, float | None]], seed: int, dataset: str, dataset_path: str | None,
              tokenizer: str) -> list[load.Workload]:
    """A warm-up's prompts, then each load's: fresh from seed, none in two of them."""
    seen: set = set()
    return [load.workload(n, PROMPT, VOCAB, seed + k, max_tokens=OUTPUT, tokenizer=tokenizer, dataset=dataset,
                          dataset_path=dataset_path, seen=seen) for k, n in enumerate([4] + [n for _, n, _ in loads])]


def run_case(case: str, loads: list[tuple[str, int, float | None]], works: list[load.Workload], state: Path,
             seed: int) -> dict[str, dict]:
    """loads: (label, requests, open-loop request rate, or None for concurrency 1); works: the warm-up's prompts,
    then each load's; arrivals drawn from seed."""
    config, extra, _, _ = CASES[case]
    pdctl("up", "-d", str(REPO / "configs" / config), *extra, "--state-dir", str(state))
    try:
        st = json.loads(pdctl("status", "--state-dir", str(state), "--json"))
        ports = {i["role"]: i["http_port"] for i in st["instances"]}
        proxy = f"http://127.0.0.1:{ports['proxy']}"
        decodes = [f"http://127.0.0.1:{i['http_port']}" for i in st["instances"] if i["role"] == "decode"]
        load.run_load("warm-up", proxy, "tiny", works[0], OUTPUT, 2)
        out = {}
        for (label, _, rate), work in zip(loads, works[1:], strict=True):
            out[label] = load.run_load("P/D", proxy, "tiny", work, OUTPUT, 1, decodes, rate, seed).to_dict()
        return out
    finally:
        pdctl("down", "--state-dir", str(state))


def burst(r: dict) -> bool:
    """A run whose streams arrived all at once (TPOT ~0, TTFT ~ the whole request: the tokens were held
    upstream of the client): its TTFT and TPOT measure nothing, so it is left out."""
    return r["tpot_ms_p50"] < 1.0 or 2 * r.get("bunched", 0) > r["requests"]


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for case, reps in runs.items():
        for conc in reps[0]:
            rs = [rep[conc] for rep in reps]
            clean = [r for r in rs if not burst(r)] or rs
            m = {k: statistics.median(r.get(k, 0) for r in clean) for k in METRICS}
            m["runs_used"] = len(clean)
            out.setdefault(conc, {})[case] = m
    return out


def homog_for(block: int, cases: list[str]) -> str | None:
    return next((c for c in cases if CASES[c][2] == CASES[c][3] == block), None)


def table(med: dict[str, dict[str, dict]], reps: int) -> None:
    for conc, by_case in med.items():
        print(f"\nP/D at {conc}, {PROMPT} prompt + {OUTPUT} output tokens, median of {reps} runs:")
        print(f"{'case':8} {'P->D':>7} {'TTFT ms':>8} {'TPOT ms':>8}   {'TTFT / same P':>20} "
              f"{'TPOT / same D':>20}   {'TTFT / same D':>20} {'TPOT / same P':>20}")
        cases = list(by_case)
        for c in cases:
            pb, db = CASES[c][2], CASES[c][3]
            m = by_case[c]
            cols = []
            for metric, block in (("ttft_ms_p50", pb), ("tpot_ms_p50", db), ("ttft_ms_p50", db),
                                  ("tpot_ms_p50", pb)):
                base = homog_for(block, cases)
                cols.append(f"{m[metric] / by_case[base][metric]:.3f}x ({base})" if base and base != c else "-")
            print(f"{c:8} {f'{pb}->{db}':>7} {m['ttft_ms_p50']:8.1f} {m['tpot_ms_p50']:8.2f}   {cols[0]:>20} "
                  f"{cols[1]:>20}   {cols[2]:>20} {cols[3]:>20}  ({m['runs_used']} runs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", default="homog,homog64,d64,p64")
    ap.add_argument("--rate", type=float, default=4.0, help="open-loop load, requests/s (0: none)")
    ap.add_argument("--requests", type=int, default=16, help="requests at concurrency 1")
    ap.add_argument("--rate-requests", type=int, default=96, help="requests of the open-loop load")
    ap.add_argument("--dataset", default="random", help="vLLM's benchmark dataset: random, prefix_repetition, "
                    "sharegpt:FILE or custom:FILE (a local file)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_hetero.json"))
    ap.add_argument("--table", help="print the table of an earlier run's JSON and stop")
    a = ap.parse_args()
    a.dataset, a.dataset_path = load.dataset_option(a.dataset)
    if a.table:
        doc = json.loads(Path(a.table).read_text())
        table(medians(doc["runs"]), doc["reps"])
        return
    try:
        load.check_dataset(a.dataset, a.dataset_path)
    except ValueError as e:
        ap.error(str(e))
    t = api.load(REPO / "configs" / CASES["homog"][0])  # every case serves the same tiny model
    tokenizer = resolved_model(t, t.decode[0], t.origin.base_dir)
    cases = a.cases.split(",")
    loads = [("concurrency 1", a.requests, None)]
    if a.rate:
        loads.append((f"{a.rate:g} req/s (Poisson)", a.rate_requests, a.rate))
    runs: dict[str, list[dict]] = {c: [] for c in cases}
    tmp = Path(tempfile.mkdtemp(prefix="pdhetero-"))
    fresh = int(time.time())
    for rep in range(a.reps):
        works = workloads(loads, fresh + 100 * rep, a.dataset, a.dataset_path, tokenizer)
        for c in cases:
            t0 = time.monotonic()
            runs[c].append(run_case(c, loads, works, tmp / f"{c}-{rep}", seed=1000 + rep))
            line = "  ".join(f"{k}: ttft {r['ttft_ms_p50']:6.1f} tpot {r['tpot_ms_p50']:5.2f} ms"
                             f"{' BURST' if burst(r) else ''}" for k, r in runs[c][-1].items())
            print(f"rep {rep} {c:8} {line}  ({time.monotonic() - t0:.0f} s)", flush=True)
    med = medians(runs)
    table(med, a.reps)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "reps": a.reps, "loads": loads,
                                       "median": med, "runs": runs}, indent=2))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
