"""`pdctl bench --goodput`: the P/D topology and its baseline (the aggregated alternative on the same devices,
pdctl.plan.baseline_plan) sent the same prompts with the same seeded Poisson arrivals at each offered rate through
vLLM's serving benchmark; the share of requests within the SLOs per rate, and the highest rate sustained. Repeated,
interleaved (baseline first, so `--slo auto` is fixed before any P/D number exists; then the order flips every
repetition), medians reported. On this host's CPUs both are up at once and take turns rate by rate, once each idle
process is measured using at most IDLE_CORES_MAX cores (a slow minute of a shared host then falls on both sides of
a rate); otherwise each is brought up alone in turn. Every point also records where this host's cores went: busy
cores, each role's servers and proxy, pdctl's own load generator, and the busiest idle process beside it."""

from __future__ import annotations

import json
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from pdctl.bench import goodput, host, load
from pdctl.bench.options import BenchOptions
from pdctl.launch import run as run_mod
from pdctl.launch.engine import Engine
from pdctl.launch.errors import LaunchFailed
from pdctl.launch.state import LaunchState
from pdctl.plan import Plan
from pdctl.topology import Loaded, resolved_model

UNLOADED_REQUESTS = 20  # --slo auto: one baseline instance at concurrency 1
MEASURED = "MEASURED"  # goodput's status: what it found, never PASS or FAIL
MIN_POINT_REQUESTS = 10  # --duration: the fewest requests a rate is sent (attainment in steps of at most 10 %)
IDLE_CORES_MAX = 0.05  # the most one idle server may use while the deployment beside it is measured
IDLE_SETTLE_S, IDLE_WINDOW_S = 2.0, 5.0  # after the last bring-up: wait, then read each process group's CPU time


def run_goodput(loaded: Loaded, pd_plan: Plan, base_plan: Plan, engine: Engine, out_dir: Path, o: BenchOptions,
                phase: Callable[[str], None], headers: dict[str, str] | None = None, beside: bool = False) -> dict:
    """o: resolved (requests per rate, prompt and output lengths). pd_plan without its reference: nothing but
    the two deployments run on the devices. beside: up at once (run_deployments)."""
    out = run_deployments(loaded, {"baseline": base_plan, "pd": pd_plan}, engine, out_dir, o, phase, headers,
                          beside=beside)
    b, p = out["baseline"]["sustained_req_s"], out["pd"]["sustained_req_s"]
    out["ratio_pd_over_baseline"] = p / b if b else None
    out["crossover"] = goodput.crossover({float(x): a for x, a in out["pd"]["attainment_median"].items()},
                                         {float(x): a for x, a in out["baseline"]["attainment_median"].items()})
    tried = [float(x) for side in ("pd", "baseline") for x in out[side]["attainment_median"]]
    out["answer"] = goodput.answer(tried, p, b)
    out["status"] = MEASURED  # a measurement, not a gate: the sustained rates are the finding, whichever way
    out["plots"] = [str(x) for x in plots(out, out_dir / "goodput")]
    (out_dir / "goodput" / "summary.json").write_text(json.dumps(out, indent=2))
    return out


def run_deployments(loaded: Loaded, deployments: dict[str, Plan], engine: Engine, out_dir: Path,
                    o: BenchOptions, phase: Callable[[str], None], headers: dict[str, str] | None = None,
                    on_up: Callable[[str, int, Plan], None] | None = None, until_miss: bool = False,
                    rates_for: dict[str, tuple[float, ...]] | None = None, beside: bool = False) -> dict:
    """Every deployment sent the same prompts with the same seeded arrivals per (repetition, rate); the first
    must be "baseline" (`--slo auto` is measured on its first instance before any other number exists); the
    order rotates every repetition. Per deployment: the runs (attainment, statistics and every request's
    TTFT/TPOT per rate), the median sustained rate and the medians per rate.

    beside: all deployments up at once in each repetition and their points interleaved rate by rate, so a slow
    minute of the host falls on every side of a rate alike, provided each idle server (and proxy) is measured at
    most IDLE_CORES_MAX cores (stated in the result: out["beside"]); otherwise, and without beside, each is brought
    up alone in turn and runs all its rates. Up at once needs this host's engine, CPU pools (accelerators would
    share device memory) and ports that differ (plan.baseline_plan moves its own).
    on_up(name, repetition, plan) runs once a deployment is up, before its load; until_miss stops a deployment's
    rates at its first miss (nothing above it counts towards the sustained rate); rates_for gives a deployment its
    own rates (one known to sustain the lowest of o.rates need not be sent it). Without o.rates the rates come from
    this host's capacity, read off the first unloaded measurement (chosen_rates), the same for every deployment,
    each stopping at its first miss."""
    names = list(deployments)
    assert names[0] == "baseline", names
    t = loaded.topology
    model = t.model.name
    slo = goodput.parse_slo(o.slo)
    tok = load.load_tokenizer(resolved_model(t, t.decode[0], loaded.base_dir))
    vocab = loaded.model_info.vocab_size or 1000
    seed = int(time.time())
    works: dict[tuple, tuple[load.Workload, int]] = {}
    unloaded: dict | None = None
    speeds: list[dict] = []  # the unloaded baseline instance at the start of each repetition
    rates, chosen = o.rates, None  # chosen: how rates were derived when o.rates gave none
    until_miss = until_miss or o.rates is None

    def prompts(key: tuple, n: int) -> tuple[load.Workload, int]:
        # One workload and arrival seed per (repetition, offered rate): every deployment sent a rate gets the
        # same prompts and arrivals there; each bring-up starts with empty prefix caches, and a rate's prompts
        # are new to the servers that get them.
        if key not in works:
            works[key] = (load.workload(n, o.prompt_len, vocab, seed + len(works), max_tokens=o.max_tokens,
                                        tokenizer=tok, dataset=o.dataset, dataset_path=o.dataset_path),
                          seed + 1000 + len(works))
        return works[key]

    def bring_up(name: str, rep: int) -> LaunchState | str:
        """The deployment's launch state, or why it did not come up (that layout's result)."""
        plan = deployments[name]
        phase(f"goodput {rep + 1}/{o.repeat}: {name} up ({len(plan.processes) - 1} servers)")
        try:
            return run_mod.up(plan, engine, attached=True, timeout_s=o.timeout_s)
        except LaunchFailed as e:
            if slo is None or rates is None:  # the baseline, whose first instance fixes the SLO and the rates
                raise
            phase(f"  {name} did not come up: {e}")
            return str(e)

    def failed(name: str, why: str) -> None:
        legs[name].append({"points": {}, "stats": {}, "sustained": None, "requests": {}, "failed": why})

    def ready(name: str, rep: int, st: LaunchState) -> _Leg:
        """The baseline's unloaded measurement (every repetition: the SLO from the first, before any other number;
        then whether this host's speed moved), on_up, then the deployment's rates."""
        nonlocal slo, unloaded, rates, chosen
        plan = deployments[name]
        if name == names[0]:
            # Fresh servers every repetition and the same prompts: the same work, so its time is the host's speed.
            one = plan.by_role("baseline")[0]
            before = host.cpu_times()
            r = load.run_load("unloaded", one.http_url, model, prompts(("unloaded",), UNLOADED_REQUESTS)[0],
                              o.max_tokens, 1, seed=seed, headers=headers)
            steal = host.steal_share(before, host.cpu_times())
            speeds.append({"repetition": rep, "ttft_ms_p50": r.ttft_ms_p50, "tpot_ms_p50": r.tpot_ms_p50,
                           "cpu_steal": steal})
            if slo is None:
                times = goodput.request_times(r.vllm)
                slo = goodput.auto_slo([x.ttft_ms for x in times if x.ttft_ms is not None],
                                       [x.tpot_ms for x in times if x.tpot_ms is not None])
                unloaded = r.to_dict() | {"cpu_steal": steal}
                phase(f"SLO: {slo}{_steal_said(steal)}")
            elif len(speeds) > 1:
                phase(f"  unloaded baseline instance: TTFT p50 {r.ttft_ms_p50:.1f} ms, "
                      f"{r.ttft_ms_p50 / speeds[0]['ttft_ms_p50']:.2f}x repetition 1's{_steal_said(steal)}")
            if rates is None:
                chosen = chosen_rates(r.ttft_ms_p50, r.tpot_ms_p50, o.max_tokens, deployments, one)
                rates = tuple(chosen["rates"])
                phase(f"rates from this host's capacity: {', '.join(f'{x:g}' for x in rates)} req/s "
                      f"({chosen['said']}); each side stops at its first miss")
        if on_up is not None:
            on_up(name, rep, plan)
        assert rates is not None
        own = (rates_for or {}).get(name, rates)
        return _Leg(name, plan.by_role("proxy")[0].http_url, own, until_miss, _groups(st),
                    down=goodput.steps_down(own[0]) if chosen is not None else ())

    def point(leg: _Leg, rep: int, beside_it: dict[str, int] | None = None) -> None:
        """One rate on one deployment; beside_it: the process groups of the deployments up and idle meanwhile."""
        assert slo is not None
        rate = leg.rate
        assert rate is not None
        n = point_requests(o, rate)
        w, arrivals = prompts((rep, rate), n)
        before = _cpu_reading(leg.groups, beside_it or {})
        r = load.run_load(leg.name, leg.url, model, w, o.max_tokens, 1, request_rate=rate, seed=arrivals,
                          headers=headers)
        cpu = _cpu_used(before, _cpu_reading(leg.groups, beside_it or {}))
        times = goodput.request_times(r.vllm)
        leg.record(rate, goodput.attainment(times, slo),
                   goodput.point_stats(times, slo, r.duration_s) | cpu,
                   [[x.ttft_ms, x.tpot_ms] for x in times])
        (out_dir / "goodput" / f"{leg.name}-{rep}-{rate:g}.vllm.json").write_text(r.vllm_json())
        phase(f"  {leg.name} at {rate:g} req/s: {leg.points[rate]:.0%} of {n} within the SLO "
              f"(TTFT p50 {r.ttft_ms_p50:.0f} ms, TPOT p50 {r.tpot_ms_p50:.1f} ms{_busy_said(cpu)})"
              f"{_steal_said(cpu['cpu_steal'])}")

    (out_dir / "goodput").mkdir(parents=True, exist_ok=True)
    legs: dict[str, list[dict]] = {n: [] for n in names}
    why_apart = None if beside else "not asked"
    if why_apart is None:
        why_apart = beside_refusal(list(deployments.values()), engine.name)
    idle_seen: list[dict[str, float]] = []
    at_once = 0  # repetitions run with every deployment up
    for rep in range(o.repeat):
        k0 = rep % len(names)
        order = names[k0:] + names[:k0]
        if why_apart is None:  # all up, idle CPU measured, then rate by rate
            states: dict[str, LaunchState] = {}
            try:
                for name in order:
                    st = bring_up(name, rep)
                    if isinstance(st, str):  # memory for all at once, say: each alone shows whether it comes up
                        why_apart = f"{name} did not come up beside the others"
                        break
                    states[name] = st
                if why_apart is None:
                    idle = _idle_cores(states)
                    idle_seen.append(idle)
                    worst = max(idle.values(), default=None)
                    if worst is None or worst > IDLE_CORES_MAX:
                        why_apart = ("idle CPU unreadable" if worst is None else
                                     f"an idle process used {worst:.3f} cores (> {IDLE_CORES_MAX})")
                if why_apart is not None:
                    phase(f"  up at once refused: {why_apart}; each deployment alone from here")
                else:
                    phase(f"  all up at once; idle, the busiest process used {worst:.3f} cores "
                          f"(<= {IDLE_CORES_MAX})")
                    running = [ready(n, rep, states[n]) for n in order]
                    everyone = {n: _groups(st) for n, st in states.items()}
                    for leg in _turns(running):
                        point(leg, rep, {f"{n}/{p}": g for n, gs in everyone.items() if n != leg.name
                                         for p, (_, g) in gs.items()})
                    for leg in running:
                        legs[leg.name].append(leg.result())
                    at_once += 1
                    continue
            finally:
                for st in states.values():
                    run_mod.down(st, engine)
        for name in order:  # each alone
            st = bring_up(name, rep)
            if isinstance(st, str):
                failed(name, st)
                continue
            try:
                leg = ready(name, rep, st)
                while leg.rate is not None:
                    point(leg, rep)
            finally:
                run_mod.down(st, engine)
            legs[name].append(leg.result())
    assert slo is not None
    out: dict = {"slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "origin": slo.origin},
                 "unloaded": unloaded, "requests_per_rate": o.requests, "duration_s": o.duration_s,
                 "rates": {"tried": list(rates or ()), "from": "--rates" if chosen is None else "capacity",
                           **({"capacity": chosen} if chosen else {})}, "repeat": o.repeat,
                 "dataset": o.dataset, "prompt_len": o.prompt_len, "max_tokens": o.max_tokens, "seed": seed,
                 "attainment_target": goodput.ATTAINMENT, "deployments": names, "host_cpus": host.cpu_count(),
                 "bound_cores": {name: _bound_cores(plan) for name, plan in deployments.items()},
                 "beside": {"repetitions_up_at_once": at_once, "why_not": why_apart, "idle_cores": idle_seen,
                            "idle_cores_max": IDLE_CORES_MAX},
                 "host_speed": {"unloaded": speeds, "ttft_spread": goodput.spread([x["ttft_ms_p50"] for x in speeds])}}
    for name, runs in legs.items():
        sustained = [r["sustained"] or 0.0 for r in runs]
        rates = sorted({float(x) for r in runs for x in r["points"]})
        out[name] = {"runs": runs, "sustained_req_s": statistics.median(sustained),
                     "attainment_median": {f"{x:g}": statistics.median(r["points"][f"{x:g}"] for r in runs
                                                                        if f"{x:g}" in r["points"]) for x in rates},
                     "stats_median": {f"{x:g}": _medians([r["stats"][f"{x:g}"] for r in runs
                                                          if f"{x:g}" in r["stats"]]) for x in rates}}
    return out


def point_requests(o: BenchOptions, rate: float) -> int:
    """Requests sent at one rate: --requests, or --duration seconds of arrivals (at least MIN_POINT_REQUESTS)."""
    if o.duration_s is None:
        assert o.requests is not None
        return o.requests
    return max(MIN_POINT_REQUESTS, round(rate * o.duration_s))


def server_units(plan: Plan, one) -> dict[str, float]:
    """Per server role, how many of the measured instance `one` the deployment has: its servers' bound cores over
    the instance's (TP where a server is unbound: an accelerator's devices)."""
    def size(p) -> int:
        return p.bound_cores or p.tp or 1

    out: dict[str, float] = {}
    for p in plan.processes:
        if p.model is not None:  # a server (the proxy and monitoring have no model)
            out[p.role] = out.get(p.role, 0.0) + size(p) / size(one)
    return out


def chosen_rates(ttft_ms_p50: float, tpot_ms_p50: float | None, max_tokens: int, deployments: dict[str, Plan],
                 one) -> dict:
    """The rates every deployment is sent when none were given: around each one's saturation estimate from the
    unloaded instance's prefill and decode times and the cores each deployment has (goodput.rates_from_capacity)."""
    cap = goodput.Capacity.measured(ttft_ms_p50, tpot_ms_p50, max_tokens)
    est = {name: round(cap.saturation(server_units(p, one)), 3) for name, p in deployments.items()}
    said = (f"prefill {cap.prefill_s * 1e3:.0f} ms and decode {cap.decode_s * 1e3:.0f} ms per request unloaded; "
            "saturation at batch 1 about " + ", ".join(f"{n} {e:g}" for n, e in est.items()) + " req/s")
    return {"rates": list(goodput.rates_from_capacity(est.values())), "prefill_s": cap.prefill_s,
            "decode_s": cap.decode_s, "saturation_req_s": est, "said": said}


class _Leg:
    """One deployment's rates in one repetition, in order (stopping at its first miss when until_miss); `down`:
    rates below them, highest first, tried until one passes when the first rate misses."""

    def __init__(self, name: str, url: str, rates: tuple[float, ...], until_miss: bool,
                 groups: dict[str, tuple[str, int]] | None = None, down: tuple[float, ...] = ()):
        self.name, self.url, self.rates, self.until_miss = name, url, rates, until_miss
        self.down, self.descending = down, False
        self.groups = groups or {}  # process name -> (role, process group): whose CPU a point reads
        self.points: dict[float, float] = {}
        self.stats: dict[str, dict] = {}
        self.requests: dict[str, list] = {}
        self.rate: float | None = rates[0] if rates else None

    def record(self, rate: float, attainment: float, stats: dict, requests: list) -> None:
        self.points[rate] = attainment
        self.stats[f"{rate:g}"] = stats
        self.requests[f"{rate:g}"] = requests
        k = len(self.points)
        missed = attainment < goodput.ATTAINMENT
        if missed and k == 1 and self.down:
            self.descending = True
        if self.descending:  # below the first rate: down until one passes
            below = [r for r in self.down if r not in self.points]
            self.rate = below[0] if missed and below else None
        elif self.until_miss and missed:
            self.rate = None
        else:
            self.rate = self.rates[k] if k < len(self.rates) else None

    def result(self) -> dict:
        return {"points": {f"{r:g}": a for r, a in self.points.items()}, "stats": self.stats,
                "sustained": goodput.sustained(self.points), "requests": self.requests}


def _turns(legs: list[_Leg]) -> Iterator[_Leg]:
    """Rounds of one point per deployment that still has a rate to run, until none has; who goes first rotates
    from one round to the next."""
    turn = 0
    while active := [leg for leg in legs if leg.rate is not None]:
        k = turn % len(active)
        yield from active[k:] + active[:k]
        turn += 1


def beside_refusal(plans: list[Plan], engine_name: str) -> str | None:
    """Why these deployments cannot be up at once on this host (None: they can): another engine's processes are
    not this host's to measure, accelerator pools would share device memory, and no two may share a port."""
    if engine_name != "local":
        return f"the {engine_name} engine's processes are not measured here"
    accel = sorted({s.platform for p in plans for s in p.processes if s.platform not in (None, "cpu")})
    if accel:
        return f"{', '.join(accel)} servers would share device memory"
    seen: dict[tuple[str, int], tuple[int, str]] = {}
    for k, p in enumerate(plans):
        for s in p.processes:
            for port in s.ports.values():
                key = (s.host, port)
                if key in seen and seen[key][0] != k:
                    return f"{seen[key][1]} and {s.name} ({p.name}) both listen on {s.host}:{port}"
                seen[key] = (k, f"{s.name} ({p.name})")
    return None


def _busy_said(cpu: dict) -> str:
    busy, cpus = cpu.get("cores_busy"), host.cpu_count()
    return "" if busy is None or not cpus else f", {busy:.2f} of {cpus} cores busy"


def _bound_cores(plan: Plan) -> dict[str, int]:
    """Per server role, the CPU cores its servers' workers are bound to; a role with an unbound server is left
    out (it may use any core)."""
    out: dict[str, int] = {}
    unbound: set[str] = set()
    for p in plan.processes:
        if p.model is None:  # the proxy, monitoring: not servers
            continue
        n = p.bound_cores
        if n is None:
            unbound.add(p.role)
        out[p.role] = out.get(p.role, 0) + (n or 0)
    return {role: n for role, n in out.items() if role not in unbound}


def _groups(st: LaunchState) -> dict[str, tuple[str, int]]:
    """Each process of a launched deployment that runs on this host: its role (prefill, decode, baseline, proxy)
    and process group (a cluster node's process group id means nothing in this host's /proc)."""
    roles = {p.name: p.role for p in st.plan.processes}
    return {name: (roles.get(name, name), rec.pgid) for name, rec in st.processes.items() if rec.where == "local"}


def _cpu_reading(groups: dict[str, tuple[str, int]], idle: dict[str, int]) -> dict:
    """CPU seconds so far: the host's ticks, each process group of the deployment under load and of those idle
    beside it, and pdctl's own process (the load generator's client)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    used = host.groups_cpu_seconds([g for _, g in groups.values()] + list(idle.values()))
    return {"at": time.monotonic(), "host": host.cpu_times(), "own": own.ru_utime + own.ru_stime,
            "groups": {name: (role, used[g]) for name, (role, g) in groups.items()},
            "idle": {name: used[g] for name, g in idle.items()}}


def _cpu_used(before: dict, after: dict) -> dict:
    """A point's CPU between two readings, as stats keys: steal, busy cores, cores per role (summed over its
    processes; a group /proc could not read both times is left out), pdctl's own, and the busiest idle process."""
    span = after["at"] - before["at"]
    out: dict[str, float | None] = {"cpu_steal": host.steal_share(before["host"], after["host"]),
                                    "cores_busy": host.busy_cores(before["host"], after["host"])}
    if span <= 0:
        return out
    for name, (role, used) in after["groups"].items():
        was = before["groups"].get(name, (role, None))[1]
        if used is not None and was is not None:
            out[f"cores_{role}"] = (out.get(f"cores_{role}") or 0.0) + max(0.0, used - was) / span
    out["cores_pdctl"] = max(0.0, after["own"] - before["own"]) / span
    idle = [(used - before["idle"][n]) / span for n, used in after["idle"].items()
            if used is not None and before["idle"].get(n) is not None]
    if idle:
        out["cores_idle_max"] = max(idle)
    return out


def _idle_cores(states: dict[str, LaunchState]) -> dict[str, float]:
    """Cores each process (server or proxy, by deployment/process) used over IDLE_WINDOW_S with no load, after
    IDLE_SETTLE_S; a process group /proc cannot read is left out."""
    groups = {f"{name}/{p}": rec.pgid for name, st in states.items() for p, rec in st.processes.items()}
    time.sleep(IDLE_SETTLE_S)
    was = host.groups_cpu_seconds(groups.values())
    before = {k: was[g] for k, g in groups.items()}
    t0 = time.monotonic()
    time.sleep(IDLE_WINDOW_S)
    now = host.groups_cpu_seconds(groups.values())
    after = {k: now[g] for k, g in groups.items()}
    dt = time.monotonic() - t0
    return {k: round((after[k] - b) / dt, 4) for k, b in before.items() if b is not None and after[k] is not None}


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
