"""`pdctl bench --goodput`: the P/D topology and its baseline (the aggregated alternative on the same devices,
pdctl.plan.baseline_plan) in turn, each brought up alone, sent the same prompts with the same seeded Poisson
arrivals at each offered rate through vLLM's serving benchmark; the share of requests within the SLOs per rate,
and the highest rate sustained. Repeated, interleaved (baseline first, so `--slo auto` is fixed before any P/D
number exists; then the order flips every repetition), medians reported."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from pdctl.bench import goodput, host, load
from pdctl.bench.options import BenchOptions
from pdctl.launch import run as run_mod
from pdctl.launch.engine import Engine
from pdctl.launch.errors import LaunchFailed
from pdctl.plan import Plan
from pdctl.topology import Loaded, resolved_model

UNLOADED_REQUESTS = 20  # --slo auto: one baseline instance at concurrency 1


def run_goodput(loaded: Loaded, pd_plan: Plan, base_plan: Plan, engine: Engine, out_dir: Path, o: BenchOptions,
                phase: Callable[[str], None], headers: dict[str, str] | None = None) -> dict:
    """o: resolved (requests per rate, prompt and output lengths). pd_plan without its reference: nothing but
    the deployment under test runs on the devices."""
    out = run_deployments(loaded, {"baseline": base_plan, "pd": pd_plan}, engine, out_dir, o, phase, headers)
    b, p = out["baseline"]["sustained_req_s"], out["pd"]["sustained_req_s"]
    out["ratio_pd_over_baseline"] = p / b if b else None
    out["crossover"] = goodput.crossover({float(x): a for x, a in out["pd"]["attainment_median"].items()},
                                         {float(x): a for x, a in out["baseline"]["attainment_median"].items()})
    out["status"] = "PASS"  # a measurement: the ratio is the finding, whichever way it goes
    out["plots"] = [str(x) for x in plots(out, out_dir / "goodput")]
    (out_dir / "goodput" / "summary.json").write_text(json.dumps(out, indent=2))
    return out


def run_deployments(loaded: Loaded, deployments: dict[str, Plan], engine: Engine, out_dir: Path,
                    o: BenchOptions, phase: Callable[[str], None], headers: dict[str, str] | None = None,
                    on_up: Callable[[str, int, Plan], None] | None = None, until_miss: bool = False,
                    rates_for: dict[str, tuple[float, ...]] | None = None) -> dict:
    """Each deployment brought up alone in turn and sent the same prompts with the same seeded arrivals per
    (repetition, rate); the first must be "baseline" (`--slo auto` is measured on its first instance before any
    other number exists); the order rotates every repetition. Per deployment: the runs (attainment, statistics
    and every request's TTFT/TPOT per rate), the median sustained rate and the medians per rate.
    on_up(name, repetition, plan) runs once a deployment is up, before its load; until_miss stops a deployment's
    explicit rates at its first miss (nothing above it counts towards the sustained rate); rates_for gives a
    deployment its own explicit rates (one known to sustain the lowest of o.rates need not be sent it)."""
    names = list(deployments)
    assert names[0] == "baseline", names
    t = loaded.topology
    model = t.model.name
    slo = goodput.parse_slo(o.slo)
    tok = load.load_tokenizer(resolved_model(t, t.decode[0], loaded.base_dir))
    vocab = loaded.model_info.vocab_size or 1000
    seed = int(time.time())
    works: dict[tuple, tuple[load.Workload, int]] = {}

    def prompts(key: tuple, n: int) -> tuple[load.Workload, int]:
        # One workload and arrival seed per (repetition, offered rate): every deployment sent a rate gets the
        # same prompts and arrivals there; each bring-up starts with empty prefix caches, and a rate's prompts
        # are new to the servers that get them.
        if key not in works:
            works[key] = (load.workload(n, o.prompt_len, vocab, seed + len(works), max_tokens=o.max_tokens,
                                        tokenizer=tok, dataset=o.dataset, dataset_path=o.dataset_path),
                          seed + 1000 + len(works))
        return works[key]

    (out_dir / "goodput").mkdir(parents=True, exist_ok=True)
    legs: dict[str, list[dict]] = {n: [] for n in names}
    unloaded: dict | None = None
    for rep in range(o.repeat):
        k0 = rep % len(names)
        for name in names[k0:] + names[:k0]:
            plan = deployments[name]
            phase(f"goodput {rep + 1}/{o.repeat}: {name} up ({len(plan.processes) - 1} servers)")
            try:
                state = run_mod.up(plan, engine, attached=True, timeout_s=o.timeout_s)
            except LaunchFailed as e:
                if slo is None:  # the baseline, whose first instance fixes the SLO: nothing to compare with
                    raise
                # One layout that does not come up (a pair that does not wire) is that layout's result.
                phase(f"  {name} did not come up: {e}")
                legs[name].append({"points": {}, "stats": {}, "sustained": None, "requests": {},
                                   "failed": str(e)})
                continue
            url = plan.by_role("proxy")[0].http_url
            try:
                if slo is None:  # the first leg is the baseline's
                    one = plan.by_role("baseline")[0]
                    before = host.cpu_times()
                    r = load.run_load("unloaded", one.http_url, model, prompts(("unloaded",), UNLOADED_REQUESTS)[0],
                                      o.max_tokens, 1, seed=seed, headers=headers)
                    steal = host.steal_share(before, host.cpu_times())
                    times = goodput.request_times(r.vllm)
                    slo = goodput.auto_slo([x.ttft_ms for x in times if x.ttft_ms is not None],
                                           [x.tpot_ms for x in times if x.tpot_ms is not None])
                    unloaded = r.to_dict() | {"cpu_steal": steal}
                    phase(f"SLO: {slo}{_steal_said(steal)}")
                if on_up is not None:
                    on_up(name, rep, plan)
                points: dict[float, float] = {}
                stats: dict[str, dict] = {}
                per_request: dict[str, list] = {}
                k = 0
                own = (rates_for or {}).get(name, o.rates)
                rate = own[0] if own else goodput.next_rate(points, goodput.START_RATE, goodput.MAX_RATE)
                while rate is not None:
                    w, arrivals = prompts((rep, rate), o.requests)
                    before = host.cpu_times()
                    r = load.run_load(name, url, model, w, o.max_tokens, 1, request_rate=rate, seed=arrivals,
                                      headers=headers)
                    steal = host.steal_share(before, host.cpu_times())
                    times = goodput.request_times(r.vllm)
                    points[rate] = goodput.attainment(times, slo)
                    stats[f"{rate:g}"] = goodput.point_stats(times, slo, r.duration_s) | {"cpu_steal": steal}
                    per_request[f"{rate:g}"] = [[x.ttft_ms, x.tpot_ms] for x in times]
                    (out_dir / "goodput" / f"{name}-{rep}-{rate:g}.vllm.json").write_text(r.vllm_json())
                    phase(f"  {name} at {rate:g} req/s: {points[rate]:.0%} of {o.requests} within the SLO "
                          f"(TTFT p50 {r.ttft_ms_p50:.0f} ms, TPOT p50 {r.tpot_ms_p50:.1f} ms){_steal_said(steal)}")
                    k += 1
                    if until_miss and points[rate] < goodput.ATTAINMENT:
                        break
                    rate = (own[k] if k < len(own) else None) if own else \
                        goodput.next_rate(points, goodput.START_RATE, goodput.MAX_RATE)
            finally:
                run_mod.down(state, engine)
            legs[name].append({"points": {f"{r:g}": a for r, a in points.items()}, "stats": stats,
                               "sustained": goodput.sustained(points), "requests": per_request})
    assert slo is not None
    out: dict = {"slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "origin": slo.origin},
                 "unloaded": unloaded, "requests_per_rate": o.requests, "repeat": o.repeat,
                 "dataset": o.dataset, "prompt_len": o.prompt_len, "max_tokens": o.max_tokens, "seed": seed,
                 "attainment_target": goodput.ATTAINMENT, "deployments": names}
    for name, runs in legs.items():
        sustained = [r["sustained"] or 0.0 for r in runs]
        rates = sorted({float(x) for r in runs for x in r["points"]})
        out[name] = {"runs": runs, "sustained_req_s": statistics.median(sustained),
                     "attainment_median": {f"{x:g}": statistics.median(r["points"][f"{x:g}"] for r in runs
                                                                        if f"{x:g}" in r["points"]) for x in rates},
                     "stats_median": {f"{x:g}": _medians([r["stats"][f"{x:g}"] for r in runs
                                                          if f"{x:g}" in r["stats"]]) for x in rates}}
    return out


def _steal_said(steal: float | None) -> str:
    return f"; this host's CPU stolen by other guests {steal:.0%}" if host.worth_saying(steal) else ""


def _medians(points: list[dict]) -> dict:
    """Per key, the median over the repetitions of one rate (keys a repetition lacks, or has None for, skipped)."""
    keys = dict.fromkeys(k for p in points for k in p)
    return {k: statistics.median(vals) if (vals := [p[k] for p in points if p.get(k) is not None]) else None
            for k in keys}


SIDES = (("pd", "P/D"), ("baseline", "aggregated, same devices"))


def plots(g: dict, out_dir: Path) -> list[Path]:
    """attainment.png, ttft_p99.png, tpot_p99.png: each against the offered rate, both deployments, with the
    target (90 %) or the SLO drawn in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for key, label, line, fname in (("attainment", "requests within the SLOs (%)", 100 * goodput.ATTAINMENT,
                                     "attainment.png"),
                                    ("ttft_ms_p99", "TTFT p99 (ms)", g["slo"]["ttft_ms"], "ttft_p99.png"),
                                    ("tpot_ms_p99", "TPOT p99 (ms)", g["slo"]["tpot_ms"], "tpot_p99.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for side, name in SIDES:
            st = g[side]["stats_median"]
            xs = sorted(float(x) for x in st if st[x].get(key) is not None)
            ys = [st[f"{x:g}"][key] * (100 if key == "attainment" else 1) for x in xs]
            ax.plot(xs, ys, marker="o", label=name)
        ax.axhline(line, color="grey", linestyle="--", linewidth=1,
                   label="target 90 %" if key == "attainment" else "SLO")
        ax.set_xlabel("offered requests/s (Poisson)")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs offered rate, median of {g['repeat']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        made.append(out_dir / fname)
    return made
