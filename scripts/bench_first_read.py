"""First KV reads of fresh pairs: repeated bring-ups of a fleet, each instance pair's first read timed from the
decode's `connector.trace` lines, per placement and per UCX setting.

For every bring-up (`pdctl up`'s own warm-up: one probe per prefill instance x decode instance pair, straight to
the two instances, then one request through the proxy; attached, then down), per probe the decode's connector logs
when its scheduler saw the request (`sched_seen`), when the worker issued the read (`read_issued`, after the NIXL
handshake) and when the worker saw it done (`read_done`), and when the scheduler learned the KV was ready
(`sched_kv_ready`). Reported per variant:
  first read      sched_seen -> sched_kv_ready of each pair's probe (handshake + read + wake-up)
  read            read_issued -> read_done (posting and the NIXL READ)
  failed          bring-ups whose `pdctl up` failed (a pair refused: its probe's read failed, timed out, or took
                  over 2 s), with the reason
  handshakes      remote engines the decodes registered (vLLM's "Transfer plan:" line; one per prefill instance
                  each, more is a re-handshake)
  up              `pdctl up`'s time to ready, warm-up included

Variants (interleaved: each repeat runs every variant once, in turn):
  placement  split: the topology's own (prefills on core 0, decodes on core 1); shared: prefill pool i and decode
             pool i on core i (p32 with d64 on core 0, p128 with d32 on core 1: the placement that stalled first
             reads for 12-120 s); stacked: every pool on one core (four engines on one core)
  ucx        pdctl: the plan's transport settings; defaults: every UCX_* variable taken out of the servers'
             environment (UCX's own choice)
With `--connector nixl` (vLLM's stock connector; no trace lines) the first read is the probe's decode leg.

Usage: python scripts/bench_first_read.py [configs/cpu-fleet.yaml] [--repeat 20] [--placement split,shared]
                                          [--ucx pdctl,defaults] [--connector pdctl|nixl] [--set PATH=VALUE ...]
                                          [--out results/bench_first_read.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from pdctl.launch import run as run_mod
from pdctl.launch.errors import LaunchFailed
from pdctl.launch.local import LocalEngine
from pdctl.plan import Plan, build_plan
from pdctl.protocol import TRACE_LINE
from pdctl.topology import Override, load_topology

TRACE = TRACE_LINE
PROBE = re.compile(r"pdctl-probe-(prefill-\S+?-\d+)-(decode-\S+?-\d+)")
HANDSHAKE = "Transfer plan: "  # vLLM logs it once per remote engine registered after a NIXL handshake


def shared_cores(path: str) -> list[Override]:
    """Prefill pool i and decode pool i on core i (p32 with d64 on core 0, p128 with d32 on core 1 in cpu-fleet):
    the placement that stalled first reads with UCX's defaults, one prefill and one decode per core."""
    t = load_topology(path).topology
    cores = sorted({c for role in ("prefill", "decode") for pool in t.pools(role) for c in (pool.devices or [0])})
    out = []
    for i, (p, d) in enumerate(zip(t.pools("prefill"), t.pools("decode"), strict=False)):
        core = cores[i % len(cores)]
        out += [Override.parse_set(f"prefill.{p.name}.devices=[{core}]"),
                Override.parse_set(f"decode.{d.name}.devices=[{core}]")]
    return out


def stacked_cores(path: str) -> list[Override]:
    """Every pool on one core (the last of the topology's): four engines on one core, an oversubscription."""
    t = load_topology(path).topology
    core = max(c for role in ("prefill", "decode") for pool in t.pools(role) for c in (pool.devices or [0]))
    return [Override.parse_set(f"{role}.{pool.name}.devices=[{core}]") for role in ("prefill", "decode")
            for pool in t.pools(role)]


def without_ucx(plan: Plan) -> Plan:
    return plan.with_processes([replace(s, env={k: v for k, v in s.env.items() if not k.startswith("UCX_")})
                                for s in plan.processes])


def first_reads(plan: Plan) -> dict:
    """Per instance pair: its probe's times (s) from the decodes' logs."""
    stages: dict[str, dict[str, float]] = {}
    handshakes = 0
    for s in plan.processes:
        if s.role != "decode":
            continue
        text = Path(s.log_path).read_text(errors="replace")
        handshakes += text.count(HANDSHAKE)
        for stage, rid, at in TRACE.findall(text):
            m = PROBE.search(rid)
            if m:
                stages.setdefault(f"{m.group(1)}->{m.group(2)}", {}).setdefault(stage, float(at))
    pairs = {pair: {
        "first_read_s": st["sched_kv_ready"] - st["sched_seen"] if {"sched_kv_ready", "sched_seen"} <= st.keys()
        else None,
        "read_s": st["read_done"] - st["read_issued"] if {"read_done", "read_issued"} <= st.keys() else None,
    } for pair, st in sorted(stages.items())}
    return {"pairs": pairs, "handshake_lines": handshakes}


def bring_up(plan: Plan, timeout_s: float) -> dict:
    engine = LocalEngine()
    deadline = time.monotonic() + 30  # the last bring-up's servers may still be letting their ports go
    while (problems := engine.preflight(plan)) and time.monotonic() < deadline:
        time.sleep(1)
    if problems:
        raise SystemExit("; ".join(problems))
    for s in plan.processes:  # each bring-up's logs alone
        Path(s.log_path).unlink(missing_ok=True)
    t0 = time.perf_counter()
    state, error = None, None
    try:
        state = run_mod.up(plan, engine, attached=True, timeout_s=timeout_s)
    except LaunchFailed as e:
        error = str(e)
    took = time.perf_counter() - t0
    probes = dict(state.probes) if state is not None else {}
    if state is not None:
        run_mod.down(state, engine)
    out = {"up_s": took, "error": error, "probes": probes, **first_reads(plan)}
    if not out["pairs"]:  # vLLM's stock connector logs no trace lines: the probe's decode leg
        out["pairs"] = {k.replace(" -> ", "->"): {"first_read_s": v, "read_s": None} for k, v in probes.items()}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology", nargs="?", default="configs/cpu-fleet.yaml")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--placement", default="split,shared")
    ap.add_argument("--ucx", default="pdctl,defaults")
    ap.add_argument("--connector", default="pdctl", choices=["pdctl", "nixl"])
    ap.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                    help="a topology override for every variant (as pdctl's --set), e.g. "
                    "'connector.extra_config={\"num_threads\": 0}'")
    ap.add_argument("--timeout", type=float, default=600, help="pdctl up's time to ready, per bring-up")
    ap.add_argument("--out", default="results/bench_first_read.json")
    a = ap.parse_args()
    variants: dict[str, Plan] = {}
    for placement in a.placement.split(","):
        sets = [Override.parse_set(f"connector.kind={a.connector}")]
        sets += [Override.parse_set("connector.trace=true")] if a.connector == "pdctl" else []
        sets += [Override.parse_set(x) for x in a.set]
        sets += {"shared": shared_cores, "stacked": stacked_cores}.get(placement, lambda _: [])(a.topology)
        loaded = load_topology(a.topology, sets)
        plan = build_plan(loaded.topology, base_dir=loaded.base_dir,
                          state_dir=Path(f"/tmp/pdctl-bench-first-read/{placement}"), python=sys.executable)
        for ucx in a.ucx.split(","):
            stock = ", stock connector" if a.connector == "nixl" else ""
            variants[f"{placement} cores, UCX {ucx}{stock}"] = plan if ucx == "pdctl" else without_ucx(plan)
    runs: dict[str, list[dict]] = {k: [] for k in variants}
    for i in range(a.repeat):
        for label, plan in variants.items():
            r = bring_up(plan, a.timeout)
            runs[label].append(r)
            worst = max((p["first_read_s"] or 0.0 for p in r["pairs"].values()), default=0.0)
            print(f"[{i + 1}/{a.repeat}] {label:32} up {r['up_s']:6.1f} s  worst first read {worst:7.3f} s  "
                  f"{len(r['pairs'])} pairs  {r['error'] or ''}", flush=True)
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # after every bring-up: a stop keeps them
            Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=2))
    summary = {}
    print(f"\n{'variant':32} {'bring-ups':>9} {'failed':>6} {'pairs':>5} {'first read p50':>14} {'max':>8} "
          f"{'read max':>8} {'>1 s':>5} {'up p50':>7}")
    for label, rs in runs.items():
        firsts = [p["first_read_s"] for r in rs for p in r["pairs"].values() if p["first_read_s"] is not None]
        reads = [p["read_s"] for r in rs for p in r["pairs"].values() if p["read_s"] is not None]
        summary[label] = row = {
            "bring_ups": len(rs), "failed": sum(1 for r in rs if r["error"]),
            "pairs_measured": len(firsts),
            "first_read_p50_s": statistics.median(firsts) if firsts else None,
            "first_read_max_s": max(firsts, default=None),
            "read_max_s": max(reads, default=None),
            "first_reads_over_1s": sum(1 for x in firsts if x > 1.0),
            "handshake_lines": sum(r["handshake_lines"] for r in rs),
            "errors": [r["error"] for r in rs if r["error"]],
            "up_p50_s": statistics.median(r["up_s"] for r in rs),
        }
        fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
        print(f"{label:32} {row['bring_ups']:>9} {row['failed']:>6} {row['pairs_measured']:>5} "
              f"{fmt(row['first_read_p50_s']):>14} {fmt(row['first_read_max_s']):>8} {fmt(row['read_max_s']):>8} "
              f"{row['first_reads_over_1s']:>5} {row['up_p50_s']:>7.1f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "summary": summary, "runs": runs},
                                      indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
