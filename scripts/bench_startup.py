"""Start-up of pdctl's servers: time-to-ready of `pdctl up` (1 prefill + 1 decode + proxy, warm-up included)
versus the slower of the two instances started alone (target <= 1.15), where each server's start goes (phases
read from its log), and an interleaved A/B of vLLM's executor for CPU servers at TP 1.

Phases, from the log lines of one server (1 s resolution, the logs' own):
  api imports     guard's spawn -> the API server's first line (Python importing vLLM in the API server)
  engine spawn    -> the engine core's first line (a spawned process importing vLLM again)
  model load      -> "Loading weights took" (device init, thread binding, weights)
  kv + nixl       -> "init engine ... took" (profile, KV cache allocation, connector and NIXL agent)
  api ready       -> "Starting vLLM server on" (the API server's routes, tokenizer, chat template)
With vLLM's multiprocess executor (pdctl's plan) a worker process (a third import of vLLM) starts between engine
spawn and model load. --executor-ab alternates it with vLLM's uni executor (the worker inside the engine core:
ready ~28 % sooner here, but measured 2-3.5x worse TTFT at concurrency 4 by scripts/bench_executor.py, so not
pdctl's choice).

Usage: python scripts/bench_startup.py [configs/cpu-homog.yaml] [--repeat 2] [--executor-ab]
                                       [--out results/bench_startup.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from pdctl.launch import run as run_mod
from pdctl.launch.local import LocalEngine
from pdctl.plan import Plan, ProcessSpec, build_plan
from pdctl.topology import load_topology

PHASES = [  # (name, the log line that ends it)
    ("api imports", re.compile(r"^\(APIServer pid=")),
    ("engine spawn", re.compile(r"^\(EngineCore pid=")),
    ("model load", re.compile(r"Loading weights took")),
    ("kv + nixl", re.compile(r"init engine \(profile, create kv cache, warmup model\) took")),
    ("api ready", re.compile(r"Starting vLLM server on")),
]
STAMP = re.compile(r" (\d\d-\d\d \d\d:\d\d:\d\d) ")
START = re.compile(r"^--- pdctl: starting \S+ at (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def phases(log_text: str) -> dict[str, float]:
    """Seconds per start-up phase of the last start in one server's log (empty when a marker is missing)."""
    lines = log_text.splitlines()
    starts = [i for i, ln in enumerate(lines) if START.match(ln)]
    if not starts:
        return {}
    lines = lines[starts[-1]:]
    t0 = datetime.strptime(START.match(lines[0]).group(1), "%Y-%m-%d %H:%M:%S")
    out, prev, i = {}, t0, 1
    for name, marker in PHASES:
        while i < len(lines) and not (marker.search(lines[i]) and STAMP.search(lines[i])):
            i += 1
        if i == len(lines):
            return {}
        at = datetime.strptime(f"{t0.year}-{STAMP.search(lines[i]).group(1)}", "%Y-%m-%d %H:%M:%S")
        out[name], prev = (at - prev).total_seconds(), at
    out["total"] = (prev - t0).total_seconds()
    return out


# vLLM-CPU accepts the uni executor only with V1 multiprocessing off (vllm/platforms/cpu.py); TP 1 only.
UNI_EXECUTOR_ARGS = ("--distributed-executor-backend", "uni")
UNI_EXECUTOR_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def with_uni(spec: ProcessSpec) -> ProcessSpec:
    """The same server with vLLM's uni executor (its worker inside the engine-core process)."""
    from dataclasses import replace

    return replace(spec, argv=[*spec.argv, *UNI_EXECUTOR_ARGS], env={**spec.env, **UNI_EXECUTOR_ENV})


def time_to_ready(plan: Plan) -> tuple[float, dict[str, dict[str, float]]]:
    engine = LocalEngine()
    problems = engine.preflight(plan)
    if problems:
        raise SystemExit("; ".join(problems))
    for s in plan.processes:  # each run's logs alone
        Path(s.log_path).unlink(missing_ok=True)
    t0 = time.perf_counter()
    state = run_mod.up(plan, engine, attached=True, timeout_s=400)
    took = time.perf_counter() - t0
    run_mod.down(state, engine)
    found = {s.name: phases(Path(s.log_path).read_text(errors="replace")) for s in plan.processes
             if s.role in ("prefill", "decode")}
    return took, found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology", nargs="?", default="configs/cpu-homog.yaml")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--executor-ab", action="store_true",
                    help="alternate pdctl's plan (vLLM's multiprocess executor) with the uni executor")
    ap.add_argument("--out", default="results/bench_startup.json")
    a = ap.parse_args()
    loaded = load_topology(a.topology)
    full = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/tmp/pdctl-bench-startup"),
                      python=sys.executable)
    variants = {"pdctl": full}
    if a.executor_ab:
        variants["uni executor"] = full.with_processes(
            [with_uni(s) if s.role in ("prefill", "decode") and s.tp == 1 else s for s in full.processes])
    rows: dict[str, list[float]] = {}
    breakdown: dict[str, list[dict[str, float]]] = {}
    for _ in range(a.repeat):
        for label, plan in variants.items():  # interleaved: each repeat runs every variant once
            for role in ("prefill", "decode"):
                took, _ = time_to_ready(plan.with_processes([plan.get(f"{role}-0")]))
                rows.setdefault(f"{label}: {role} alone", []).append(took)
            took, found = time_to_ready(plan)
            rows.setdefault(f"{label}: pdctl up (P+D+proxy+warm-up)", []).append(took)
            for name, ph in found.items():
                if ph:
                    breakdown.setdefault(f"{label}: {name} in up", []).append(ph)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{'what':50} {'median s':>9}  runs")
    for k, v in rows.items():
        print(f"{k:50} {med[k]:>9.1f}  {', '.join(f'{x:.1f}' for x in v)}")
    ratios = {}
    for label in variants:
        alone = max(med[f"{label}: prefill alone"], med[f"{label}: decode alone"])
        ratios[label] = med[f"{label}: pdctl up (P+D+proxy+warm-up)"] / alone
        print(f"{label}: ratio pdctl up / slower instance alone: {ratios[label]:.2f} (target <= 1.15)")
    names = [n for n, _ in PHASES] + ["total"]
    print(f"\nwhere a server's start goes (median s over repeats, both servers starting together)\n"
          f"{'server':42}" + "".join(f"{n:>14}" for n in names))
    med_phases = {}
    for k, runs in breakdown.items():
        med_phases[k] = {n: statistics.median(r[n] for r in runs) for n in names}
        print(f"{k:42}" + "".join(f"{med_phases[k][n]:>14.0f}" for n in names))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "runs": rows, "median_s": med,
                                       "ratio": ratios, "phases": breakdown, "median_phases": med_phases}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
