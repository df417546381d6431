"""Benchmarks: P/D against the aggregated alternative on the same devices (load, goodput), and sweeps."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdctl import auth
from pdctl.api.common import Say, UserError, _quiet
from pdctl.api.deploy import _interruptible, _local_engine, _preflight
from pdctl.api.gates import expected_table, gsm8k_source
from pdctl.api.topology import _gate_note, _gated, as_overrides, load, origin, plan
from pdctl.bench.options import BenchOptions, phases
from pdctl.launch.errors import LaunchFailed
from pdctl.plan import Plan
from pdctl.topology import Override, Topology, TopologyError


@dataclass
class BenchResult:
    status: str  # PASS | FAIL
    summary: dict  # every phase's numbers (also summary.json under out_dir)
    out_dir: Path

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    def to_dict(self) -> dict:
        return self.summary


def _bench_data(o: BenchOptions, say: Say) -> BenchOptions:
    from pdctl.bench.load import check_dataset
    from pdctl.gates import gsm8k

    try:
        check_dataset(o.dataset, o.dataset_path)  # the load's prompts: before anything starts
    except ValueError as e:
        raise UserError(str(e)) from None
    if "eval" not in o.skip:
        return replace(o, data_dir=gsm8k_source(o.data_dir, say))
    if o.data_dir is not None:  # the parity gate's GSM8K prompts
        try:
            return replace(o, data_dir=gsm8k.check_dir(Path(o.data_dir)).data_dir)
        except gsm8k.DataError as e:
            raise UserError(str(e)) from None
    return o


def bench(target: Topology | str | Path, options: BenchOptions | None = None, *, results: str | Path | None = None,
          say: Say = _quiet, progress: Say = _quiet) -> BenchResult:
    """The whole job: up (beside an aggregated reference) -> parity -> accuracy -> load benchmark -> down.
    `say` and `progress` get each phase as it starts, with the seconds since the start."""
    o = options or BenchOptions()
    table = expected_table(o.expected)
    o = _bench_data(o, say)
    t = _gated(load(target, gated=True) if isinstance(target, (str, Path)) else target, say)
    out_dir = Path(results) if results else Path("results") / f"bench-{t.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return _bench(t, o, table, out_dir, say, progress)


def _bench(t: Topology, o: BenchOptions, table: dict, out_dir: Path, say: Say, progress: Say = _quiet) -> BenchResult:
    from pdctl.bench.load import WorkloadError
    from pdctl.bench.run import run_bench

    _local_engine(t)
    o = o.resolved()
    if o.breakdown:
        t = _traced(t, o)
    if o.goodput:
        _goodput_options(t, o, say)
    elif o.alone or o.duration_s is not None:
        raise UserError(f"{'--alone' if o.alone else '--duration'}: how --goodput runs P/D and its baseline; add "
                        "--goodput")
    p = plan(t, state_dir=o.state_dir, reference_port=t.reference.port)
    engine = _preflight(p, t)
    t0 = time.monotonic()

    def phase(text: str) -> None:
        say(f"[{time.monotonic() - t0:5.0f} s] {text}")
        progress(f"[{time.monotonic() - t0:5.0f} s] {text}")

    with _interruptible():
        try:
            if not o.goodput:
                s = run_bench(origin(t), p, p.get("reference"), engine, out_dir, o, table, phase)
            else:
                s = _bench_goodput(t, p, engine, out_dir, o, table, phase)
        except WorkloadError as e:  # the load's prompts, refused before anything started
            raise UserError(str(e)) from None
    return BenchResult(s["status"], s, out_dir)


def parse_rates(text: str | None) -> tuple[float, ...] | None:
    """--rates 2,4,8 -> (2.0, 4.0, 8.0); None -> None (the rate search)."""
    if text is None:
        return None
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"--rates {text}: expected offered request rates separated by commas, e.g. 2,4,8") from None
    if not all(0 < r < float("inf") for r in rates):
        raise UserError(f"--rates {text}: offered request rates must be positive numbers")
    return rates


def load_rates(text: str | None, goodput: bool) -> dict:
    """--rates as BenchOptions fields: with --goodput the offered rates to measure (None: the search); without it
    one rate, at which the load benchmark runs in open loop (Poisson arrivals) instead of --concurrency."""
    rates = parse_rates(text)
    if goodput or rates is None:
        return {"rates": rates, "request_rate": None}
    if len(rates) != 1:
        raise UserError(f"--rates {text}: without --goodput the load benchmark runs at one offered rate (open loop), "
                        "e.g. --rates 4; several are --goodput's")
    return {"rates": None, "request_rate": rates[0]}


def dataset_option(text: str) -> dict:
    """--dataset KIND or KIND:FILE as BenchOptions fields (checked before anything starts, by bench and sweep)."""
    from pdctl.bench.load import dataset_option as parse

    dataset, path = parse(text)
    return {"dataset": dataset, "dataset_path": path}


def parse_skip(text: str | None) -> frozenset[str]:
    """--skip check,eval -> {"check", "eval"}; None -> nothing skipped. UserError naming the option otherwise."""
    try:
        return phases(text or "")
    except ValueError as e:
        raise UserError(f"--skip {text}: {e}") from None


def _goodput_options(t: Topology, o: BenchOptions, say: Say) -> None:
    """What --goodput refuses before anything starts, and what it warns of."""
    from pdctl.bench import goodput

    try:
        goodput.parse_slo(o.slo)
    except goodput.SloError as e:
        raise UserError(str(e)) from None
    if o.breakdown or o.request_rate is not None:
        raise UserError("--goodput runs its own rates (--rates, or from this host's capacity): without --breakdown "
                        "or a request_rate")
    if o.rates is not None and (not o.rates or any(not r > 0 for r in o.rates)):
        raise UserError(f"rates {o.rates}: offered request rates must be positive")
    if o.duration_s is not None:
        if o.requests is not None:
            raise UserError(f"--requests {o.requests} and --duration {o.duration_s:g}: give one (the requests per "
                            "rate, or the seconds of arrivals per rate)")
        if not 0 < o.duration_s < float("inf") or o.repeat < 1:
            raise UserError(f"--repeat {o.repeat}, --duration {o.duration_s:g}: at least 1 repetition and a "
                            "positive number of seconds")
        return
    if o.repeat < 1 or o.requests < 1:
        raise UserError(f"--repeat {o.repeat}, --requests {o.requests}: at least 1 each")
    if o.requests < goodput.MIN_REQUESTS:
        say(f"warning: --requests {o.requests} per rate: fewer than {goodput.MIN_REQUESTS}, one request moves "
            f"the attainment by {100 / o.requests:.1f} %: too few to decide on")


def _bench_goodput(t: Topology, p: Plan, engine, out_dir: Path, o: BenchOptions, table: dict, phase: Say) -> dict:
    """The gates on the topology beside its reference (unless skipped), then goodput: the topology (without its
    reference) against its baseline on the same devices."""
    from pdctl.bench.goodput_run import run_goodput
    from pdctl.bench.run import overall_status, run_bench
    from pdctl.topology import summary as summary_line

    if {"check", "eval"} <= o.skip:
        out_dir.mkdir(parents=True, exist_ok=True)
        s: dict = {"name": t.name, "pools": summary_line(t)}
    else:
        gates = replace(o, skip=o.skip | {"perf"})
        s = run_bench(origin(t), p, p.get("reference"), engine, out_dir, gates, table, phase)
    base = plan(t, state_dir=p.state_dir, baseline=True)
    pd = p.with_processes([x for x in p.processes if x.role != "reference"])
    s["goodput"] = run_goodput(origin(t), pd, base, engine, out_dir, o, phase,
                               auth.headers(auth.api_key(t)) or None, beside=not o.alone)
    s["status"] = overall_status(s, o.allow_ungated)
    (out_dir / "summary.json").write_text(json.dumps(s, indent=2))
    return s


def _traced(t: Topology, o: BenchOptions) -> Topology:
    """The topology with connector.trace on (the decodes' timing lines), for a bench that follows its requests."""
    if "perf" in o.skip:
        raise UserError("--breakdown follows the load benchmark's requests: drop perf from --skip")
    if t.connector.kind != "pdctl":
        raise UserError(f"--breakdown: the decode's timing lines come from pdctl's connector; topology '{t.name}' "
                        f"uses connector.kind {t.connector.kind}")
    traced = t.model_copy(update={"connector": t.connector.model_copy(update={"trace": True})})
    traced._origin = t.origin
    return traced


@dataclass
class SweepResult:
    rows: list[dict]  # one summary per case (REFUSED / FAIL / PASS)
    out_dir: Path

    @property
    def passed(self) -> bool:
        return not any(r.get("status") == "FAIL" for r in self.rows)

    def table(self) -> list[dict]:
        """One flat row per case (blocks, TP, gates, p50 latencies) for a table."""
        from pdctl.bench.sweep import row

        return [row(r) for r in self.rows]

    @property
    def reports(self) -> list[Path]:
        return [self.out_dir / n for n in ("sweep.md", "sweep.json", "accuracy.png", "latency.png")]

    def to_dict(self) -> dict:
        return {"cases": self.rows, "results": str(self.out_dir)}


def _case_overrides(topology: str | Path, m, overrides) -> Callable[[Any], list[Override]]:
    """Each case's overrides under the command line's (`overrides`: --set and the role flags, in every case); a
    case that sets what the command line sets is an OverrideConflict before any case runs."""
    from pdctl.topology import OverrideConflict

    base = [replace(o, exclusive=True) for o in as_overrides(overrides)]
    for case in m.cases:
        try:
            load(topology, base + case.overrides())
        except OverrideConflict as e:
            e.problems = [replace(p, message=f"case {case.name!r}: {p.message}") for p in e.problems]
            raise
        except TopologyError:
            pass  # the case's own problem: its row says REFUSED
    return lambda case: base + case.overrides()


def sweep(topology: str | Path, matrix: str | Path, options: BenchOptions | None = None, *,
          results: str | Path | None = None, say: Say = _quiet, overrides=None) -> SweepResult:
    """`bench` for every case of a matrix (resumable: a case with a summary under `results` is kept); writes
    sweep.json, sweep.md and plots. A case the topology rules refuse is REFUSED, one that fails to start FAIL.
    `overrides` (as `load` takes them) change the topology under every case; one a case also sets is refused."""
    from pydantic import ValidationError

    from pdctl.bench import sweep as sweep_mod

    matrix = Path(matrix)
    try:
        m = sweep_mod.load_matrix(matrix)
    except (OSError, ValidationError, ValueError) as e:
        raise UserError(f"{matrix}: {e}") from None
    case_overrides = _case_overrides(topology, m, overrides)
    out_dir = Path(results) if results else Path("results") / f"sweep-{matrix.stem}"
    o = options or BenchOptions()
    if o.goodput:
        return _sweep_goodput(topology, m, o, out_dir, say, case_overrides, overrides)
    table = expected_table(o.expected)
    o = _bench_data(o, say)
    say(_gate_note() + " in every case")

    def run_case(case, case_dir: Path) -> dict:
        base = {k: case.value(path) for k, path in (("prefill_block", "prefill.block_size"), ("decode_block",
                "decode.block_size"), ("prefill_tp", "prefill.tp"), ("decode_tp", "decode.tp"))}
        try:
            t = load(topology, case_overrides(case), gated=True)
        except TopologyError as e:
            return {**base, "status": "REFUSED", "error": e.render()}
        try:
            return _bench(t, o, table, case_dir, lambda text: say(f"  {case.name}: {text}")).summary
        except (LaunchFailed, UserError, RuntimeError) as e:
            return {**base, "status": "FAIL", "error": str(e)}

    t0 = time.monotonic()
    rows = sweep_mod.run_sweep(m, out_dir, run_case,
                               lambda c, state: say(f"[{time.monotonic() - t0:5.0f} s] case {c.name}: {state}"))
    return SweepResult(rows, out_dir)


def devices_used(t: Topology) -> set[tuple[str, str, int | None]]:
    """(host, platform, device) of every P/D instance (device None: a pool that names none)."""
    from pdctl.topology import ROLES

    return {(g.host, g.platform, d) for role in ROLES for g in t.pools(role) for d in (g.devices or [None])}


@dataclass
class GoodputSweepResult:
    summary: dict  # every deployment's goodput runs, the recommendation, the SLO sensitivity (goodput/sweep.json)
    out_dir: Path
    refused: dict[str, str]  # case -> why it was not run (before anything started)

    @property
    def passed(self) -> bool:
        return not self.refused

    def to_dict(self) -> dict:
        return {**self.summary, "refused": self.refused}


def _sweep_goodput(topology: str | Path, m, o: BenchOptions, out_dir: Path, say: Say, case_overrides,
                   overrides) -> GoodputSweepResult:
    """Goodput of each layout of the matrix and of the baseline (the topology's devices aggregated), every one on
    the topology's devices, at the same offered rates; the layout with the highest goodput for the SLO, and the
    SLO tightness at which the answer changes (recomputed from the measured requests)."""
    from pdctl.bench import goodput
    from pdctl.bench.goodput_run import run_deployments
    from pdctl.bench.load import check_dataset

    o = replace(o, skip=o.skip | {"perf"}).resolved()
    try:
        check_dataset(o.dataset, o.dataset_path)
    except ValueError as e:
        raise UserError(str(e)) from None
    t = _gated(load(topology, overrides, gated=True), say)
    _goodput_options(t, o, say)
    _local_engine(t)
    want = devices_used(t)
    state = out_dir / "state"
    plans: dict[str, Plan] = {"baseline": plan(t, state_dir=state / "baseline", baseline=True)}
    refused: dict[str, str] = {}
    for case in m.cases:
        if case.name == "baseline":
            refused[case.name] = "the name 'baseline' is the aggregated deployment every sweep includes"
            continue
        try:
            tc = load(topology, case_overrides(case), gated=True)
        except TopologyError as e:
            refused[case.name] = e.render()
            continue
        if devices_used(tc) != want:
            refused[case.name] = (f"uses devices {sorted(devices_used(tc), key=str)}, the topology "
                                  f"{sorted(want, key=str)}: a layout of the same devices is compared")
            continue
        p = plan(tc, state_dir=state / case.name)
        plans[case.name] = p.with_processes([x for x in p.processes if x.role != "reference"])
    for name, why in refused.items():
        say(f"case {name}: REFUSED: {why}")
    if len(plans) < 2:
        raise UserError(f"sweep --goodput: no layout of the matrix can run ({', '.join(refused)} refused)")
    engine = _preflight(plans["baseline"], t)
    t0 = time.monotonic()

    def phase(text: str) -> None:
        say(f"[{time.monotonic() - t0:5.0f} s] {text}")

    with _interruptible():
        out = run_deployments(origin(t), plans, engine, out_dir, o, phase, auth.headers(auth.api_key(t)) or None)
    slo = goodput.Slo(out["slo"]["ttft_ms"], out["slo"]["tpot_ms"], out["slo"]["origin"])
    runs = {n: out[n]["runs"] for n in plans}
    out["recommendation"] = goodput.recommend(runs, slo)
    out["slo_sensitivity"] = goodput.slo_sensitivity(runs, slo)
    out["layouts"] = {n: _layout(p) for n, p in plans.items()}
    (out_dir / "goodput" / "sweep.json").write_text(json.dumps(out, indent=2))
    return GoodputSweepResult(out, out_dir, refused)


def _layout(p: Plan) -> str:
    """e.g. "prefill p32 1x block 32 on [0] -> decode d64 1x block 64 on [1]", or "aggregated: 2 servers on [0] [1]"."""
    t = p.topology

    def devs(g, i) -> str:
        return str(g.devices_of(i) or "-")

    if p.by_role("baseline"):
        on = [devs(g, i) for role in ("prefill", "decode") for g in t.pools(role) for i in range(g.count)]
        return f"aggregated: {len(on)} servers on " + " ".join(on)
    return " -> ".join(", ".join(f"{role} {g.name} {g.count}x block {g.block_size} on "
                                 + " ".join(devs(g, i) for i in range(g.count)) for g in t.pools(role))
                       for role in ("prefill", "decode"))
