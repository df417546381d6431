"""Server settings measured where users stand, two variants of one topology in one interleaved run.

--ab executor (default): vLLM's executor for CPU servers at TP 1: the uni executor (the worker inside the engine
core: one process and one import of vLLM fewer, ready sooner) against pdctl's plan, vLLM's default multiprocess
executor (a worker process behind shared-memory queues), the same topology otherwise. Per alternation, each variant
is brought up (time to ready, warm-up included), sent --requests prompts at concurrency 1 and then 4 through the P/D
proxy (vLLM's serving benchmark, streaming, fresh prompts), and taken down; the order of the variants flips every
alternation. Reported: medians and the median of the per-alternation ratios uni / mp (the issue's criterion: TTFT and
TPOT ratios within 0.95-1.05).

--ab ucx: pdctl's UCX settings for the servers' placement (pdctl.topology.transport) against UCX's defaults (every
UCX_* variable taken out), the same measurements plus the KV read time per request (the decodes' NIXL transfer
time over the requests).

Usage: python scripts/bench_executor.py [configs/cpu-demo.yaml] [--ab executor|ucx] [--repeat 5] [--requests 50]
                                        [--prompt-len 256] [--max-tokens 32] [--out results/bench_executor.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_first_read import without_ucx  # noqa: E402
from bench_startup import with_uni  # noqa: E402

from pdctl.bench.load import run_load, workload  # noqa: E402
from pdctl.launch import run as run_mod  # noqa: E402
from pdctl.launch.local import LocalEngine  # noqa: E402
from pdctl.plan import build_plan  # noqa: E402
from pdctl.topology import load_topology, resolved_model  # noqa: E402

METRICS = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology", nargs="?", default="configs/cpu-demo.yaml")
    ap.add_argument("--ab", choices=("executor", "ucx"), default="executor")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None, help="default results/bench_executor.json (--ab ucx: bench_ucx.json)")
    a = ap.parse_args()
    a.out = a.out or ("results/bench_executor.json" if a.ab == "executor" else "results/bench_ucx.json")
    loaded = load_topology(a.topology)
    t = loaded.topology
    mp = build_plan(t, base_dir=loaded.base_dir, state_dir=Path("/tmp/pdctl-bench-executor"), python=sys.executable)
    if a.ab == "executor":
        new = ("uni", mp.with_processes([with_uni(s) if s.role in ("prefill", "decode") and s.tp == 1 else s
                                         for s in mp.processes]))
        old = ("mp", mp)
    else:
        new, old = ("ucx-pdctl", mp), ("ucx-defaults", without_ucx(mp))
    variants = dict([new, old])
    tokenizer = resolved_model(t, t.decode[0], loaded.base_dir)
    proxy = mp.get("proxy").http_url
    decodes = [s.http_url for s in mp.by_role("decode")]
    seen: set = set()
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    engine = LocalEngine()
    for rep in range(a.repeat):
        order = list(variants) if rep % 2 == 0 else list(reversed(variants))
        for name in order:
            plan = variants[name]
            t0 = time.perf_counter()
            state = run_mod.up(plan, engine, attached=True, timeout_s=400)
            ready = time.perf_counter() - t0
            try:
                row = {"ready_s": ready}
                for conc in (1, 4):
                    w = workload(a.requests, a.prompt_len, seed=1000 * rep + conc, tokenizer=tokenizer,
                                 max_tokens=a.max_tokens, seen=seen)
                    r = run_load(name, proxy, t.model.name, w, a.max_tokens, conc, decode_urls=decodes, seed=rep)
                    row.update({f"c{conc}_{m}": getattr(r, m) for m in METRICS})
                    row[f"c{conc}_errors"], row[f"c{conc}_bunched"] = r.errors, r.bunched
                    if r.kv_xfer_s is not None and r.requests:
                        row[f"c{conc}_kv_read_ms"] = 1000 * r.kv_xfer_s / r.requests
            finally:
                run_mod.down(state, engine)
            runs[name].append(row)
            print(f"repeat {rep + 1}/{a.repeat} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()),
                  flush=True)
    n, o = new[0], old[0]
    keys = [k for k in runs[n][0] if all(k in r for rows in runs.values() for r in rows)]
    med = {name: {k: statistics.median(r[k] for r in rows) for k in keys} for name, rows in runs.items()}
    ratio = {k: statistics.median(u[k] / m[k] for u, m in zip(runs[n], runs[o], strict=True) if m[k])
             for k in keys if not k.endswith(("errors", "bunched"))}
    print(f"\n{'metric':22}{n:>14}{o:>14}{'ratio':>10}   ({n} / {o}, medians over {a.repeat} alternations)")
    for k in keys:
        print(f"{k:22}{med[n][k]:>14.2f}{med[o][k]:>14.2f}{ratio.get(k, float('nan')):>10.3f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs, "median": med,
                                       f"median_ratio_{n}_over_{o}": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
