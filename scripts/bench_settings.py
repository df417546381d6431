"""Is a setting worth its place? Each candidate setting against the topology's defaults, for goodput, in one
interleaved run (the decision rule of the goodput issue: a setting becomes a default when it raises median goodput
by at least 5 % over the repetitions without making TTFT or TPOT at concurrency 1 more than 5 % worse; otherwise
it leaves the topology schema).

Deployments: the baseline (aggregated on the same devices: `--slo auto` is measured on it first), the topology as
it is ("defaults"), and the topology with each `--setting` applied alone; all up at once in each repetition (each
on its own ports; idle CPU measured and stated; `--alone`: each brought up alone in turn), the order rotating,
taking turns rate by rate, the same prompts and seeded Poisson arrivals at each of `--rates`
(pdctl.bench.goodput_run.run_deployments; a deployment's rates stop at its first miss). Once up, before any
load, --c1-requests prompts one at a time give each TTFT and TPOT at concurrency 1. `--baseline-setting`
candidates are aggregated deployments judged against the baseline: the baseline gets the same engine-settings
search as P/D.

Usage: python scripts/bench_settings.py [configs/cpu-demo.yaml] --setting proxy.first_token=auto
           --baseline-setting "prefill.extra_args=[--max-num-batched-tokens,'512']" --rates 3,4,5,6
           [--repeat 3] [--requests 200] [--c1-requests 20] [--alone] [--out results/bench_settings.json]
Each --setting is a `--set` override (dotted.path=value); several in one, separated by ';', are one candidate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdctl import api  # noqa: E402
from pdctl.bench import goodput, load  # noqa: E402
from pdctl.bench.goodput_run import run_deployments  # noqa: E402
from pdctl.bench.options import BenchOptions  # noqa: E402
from pdctl.launch.local import LocalEngine  # noqa: E402
from pdctl.topology import resolved_model  # noqa: E402

GAIN = 1.05  # goodput at least this many times the defaults'
LATENCY_SLACK = 1.05  # TTFT and TPOT at concurrency 1 at most this many times the defaults'


def concurrency_one(loaded, o: BenchOptions, n: int, out: dict[str, list[dict]]):
    """on_up for run_deployments: TTFT and TPOT p50 at one request at a time on each deployment as soon as it is
    up, before its load (the same prompts for every deployment within a repetition)."""
    t = loaded.topology
    tok = load.load_tokenizer(resolved_model(t, t.decode[0], loaded.base_dir))
    works: dict[int, load.Workload] = {}

    def measure(name: str, rep: int, plan) -> None:
        if rep not in works:
            works[rep] = load.workload(n, o.prompt_len, loaded.model_info.vocab_size or 1000, 7000 + rep,
                                       max_tokens=o.max_tokens, tokenizer=tok)
        r = load.run_load(name, plan.by_role("proxy")[0].http_url, t.model.name, works[rep], o.max_tokens, 1,
                          seed=rep)
        out.setdefault(name, []).append({"ttft_ms_p50": r.ttft_ms_p50, "tpot_ms_p50": r.tpot_ms_p50})
        print(f"concurrency 1, {rep + 1}/{o.repeat} {name}: TTFT p50 {r.ttft_ms_p50:.1f} ms, TPOT p50 "
              f"{r.tpot_ms_p50:.2f} ms", flush=True)
    return measure


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology", nargs="?", default="configs/cpu-demo.yaml")
    ap.add_argument("--setting", action="append", default=[], help="dotted.path=value[;dotted.path=value]: "
                    "a candidate for the P/D topology, judged against its defaults")
    ap.add_argument("--baseline-setting", action="append", default=[], help="the same for the baseline (each "
                    "pool's settings reach the aggregated server on its devices), judged against the baseline")
    ap.add_argument("--rates", required=True, help="offered req/s, e.g. 2,3,4,5,6")
    ap.add_argument("--pd-rates", help="the P/D deployments' own rates (default --rates), e.g. from the lowest "
                    "a P/D deployment is known to sustain; the baselines get --rates")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--requests", type=int, default=goodput.MIN_REQUESTS)
    ap.add_argument("--c1-requests", type=int, default=20)
    ap.add_argument("--slo", default="auto")
    ap.add_argument("--alone", action="store_true", help="each deployment brought up alone in turn (default: all "
                    "up at once, taking turns rate by rate, where their idle CPU allows)")
    ap.add_argument("--out", default="results/bench_settings.json")
    a = ap.parse_args()
    o = BenchOptions(goodput=True, rates=api.parse_rates(a.rates), repeat=a.repeat, requests=a.requests,
                     slo=a.slo).resolved()
    work = Path("/tmp/pdctl-bench-settings")
    base_t = api.load(a.topology, gated=True)  # a fallback to decode-only fails instead of passing as P/D

    moved = itertools.count(1)

    def on_own_ports(t):
        # Up at once, each deployment needs its own ports: every candidate's topology moved by another 2000 from
        # the defaults' (a baseline plan adds its own 1000).
        return t.ports_moved(2000 * next(moved))

    plans = {"baseline": api.plan(base_t, state_dir=work / "baseline", baseline=True)}
    plans["defaults"] = api.plan(base_t, state_dir=work / "defaults")
    for setting in a.setting:
        t = api.load(a.topology, [s.strip() for s in setting.split(";")], gated=True)
        plans[setting] = api.plan(on_own_ports(t), state_dir=work / f"s{len(plans)}")
    for setting in a.baseline_setting:
        t = api.load(a.topology, [s.strip() for s in setting.split(";")], gated=True)
        plans[f"baseline: {setting}"] = api.plan(on_own_ports(t), state_dir=work / f"s{len(plans)}",
                                                 baseline=True)
    t0 = time.monotonic()
    c1: dict[str, list[dict]] = {}
    g = run_deployments(api.origin(base_t), plans, LocalEngine(), Path("results") / "bench_settings", o,
                        lambda text: print(f"[{time.monotonic() - t0:5.0f} s] {text}", flush=True),
                        on_up=concurrency_one(api.origin(base_t), o, a.c1_requests, c1), until_miss=True,
                        rates_for={name: api.parse_rates(a.pd_rates) for name in plans
                                   if a.pd_rates and not name.startswith("baseline")}, beside=not a.alone)
    rows = []
    for name in plans:
        runs = c1.get(name) or [{"ttft_ms_p50": float("nan"), "tpot_ms_p50": float("nan")}]  # never came up
        med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_ms_p50", "tpot_ms_p50")}
        rows.append({"deployment": name, "sustained_req_s": g[name]["sustained_req_s"], **med})
    by_name = {r["deployment"]: r for r in rows}
    for r in rows:
        d = by_name["baseline" if r["deployment"].startswith("baseline") else "defaults"]
        r["goodput_x"] = r["sustained_req_s"] / d["sustained_req_s"] if d["sustained_req_s"] else None
        r["ttft_c1_x"], r["tpot_c1_x"] = r["ttft_ms_p50"] / d["ttft_ms_p50"], r["tpot_ms_p50"] / d["tpot_ms_p50"]
        better = (r["goodput_x"] or 0) >= GAIN and r["ttft_c1_x"] <= LATENCY_SLACK and r["tpot_c1_x"] <= LATENCY_SLACK
        r["verdict"] = ("reference" if r["deployment"] in ("baseline", "defaults") else
                        ("tunes the baseline" if better else "no better than the baseline")
                        if r["deployment"].startswith("baseline") else
                        "make it the default" if better else "take it out of the schema")
    print(f"\nSLO: {g['slo']['origin']}; rates {a.rates}; {a.requests} requests per rate; median of {a.repeat}")
    speed = g["host_speed"]
    if (speed["ttft_spread"] or 0) >= goodput.SPEED_NOTE:
        print("this host's speed moved: the unloaded baseline's TTFT p50 per repetition was "
              + ", ".join(f"{x['ttft_ms_p50']:.1f}" for x in speed["unloaded"])
              + f" ms ({speed['ttft_spread']:.2f}x apart): read each repetition on its own")
    print(f"{'deployment':44}{'req/s':>7}{'x dflt':>8}{'TTFT c1':>9}{'x':>6}{'TPOT c1':>9}{'x':>6}  verdict")
    for r in rows:
        gx = "-" if r["goodput_x"] is None else f"{r['goodput_x']:.2f}"
        print(f"{r['deployment'][:44]:44}{r['sustained_req_s']:>7g}{gx:>8}{r['ttft_ms_p50']:>9.1f}"
              f"{r['ttft_c1_x']:>6.2f}{r['tpot_ms_p50']:>9.2f}{r['tpot_c1_x']:>6.2f}  {r['verdict']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows, "goodput": g,
                                       "concurrency_one": c1}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
