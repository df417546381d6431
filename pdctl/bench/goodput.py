"""Goodput: the highest request rate a deployment sustains while at least 90 % of its requests meet both a TTFT
and a TPOT SLO (DistServe's definition; vLLM's serving benchmark counts the same per request). Pure: SLOs, per
request verdicts, attainment, and the rate search's decisions; the runs themselves live in pdctl.bench.

Two deployments are compared on the same devices: the P/D topology and the **baseline**, an aggregated deployment
of the same devices (not the gates' single-server reference)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ATTAINMENT = 0.90  # of the requests sent at a rate, the share that must meet both SLOs
AUTO_TTFT_X = 5.0  # --slo auto: the unloaded baseline instance's TTFT p50 times this
AUTO_TPOT_X = 3.0  # ... and its TPOT p50 times this
SPEED_NOTE = 1.2  # a report says the host's speed moved once the unloaded baseline's TTFT p50 spread this much
MIN_REQUESTS = 200  # per rate: below it one request moves the attainment by more than 0.5 %
# The rates tried when none are given, from the unloaded baseline instance (rates_from_capacity): a geometric grid
# from GRID_LOW x the lowest deployment's saturation estimate to GRID_HIGH x the highest's. Measured on 2-core hosts
# (docs/benchmarks.md): each side sustained 0.4-0.85x its estimate, so the grid starts where most should pass (one
# that misses is tried STEPS_DOWN below it) and ends where both should miss; a side stops at its first miss, so
# the top is rarely sent.
GRID_LOW = 0.45
GRID_HIGH = 1.5
GRID_STEP = 1.25  # between neighbouring rates: the answer's resolution
STEPS_DOWN = 2  # a side that misses even the grid's lowest rate is tried this many GRID_STEP^1.5 steps below it


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float
    origin: str  # how it was set: the flag, or the unloaded measurement it came from

    def __str__(self) -> str:
        return f"TTFT <= {self.ttft_ms:g} ms, TPOT <= {self.tpot_ms:g} ms ({self.origin})"


class SloError(ValueError):
    """A --slo value that is not one; the message names the flag and says what is expected."""


def parse_slo(text: str) -> Slo | None:
    """`--slo ttft=MS,tpot=MS` -> Slo; `--slo auto` -> None (measured first: auto_slo)."""
    if text.strip() == "auto":
        return None
    got: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("ttft", "tpot") or key in got:
            raise SloError(f"--slo {text!r}: expected ttft=MS,tpot=MS (both, once each) or auto")
        try:
            got[key] = float(value)
        except ValueError:
            raise SloError(f"--slo {text!r}: {key}={value!r} is not a number of milliseconds") from None
        if not math.isfinite(got[key]) or got[key] <= 0:
            raise SloError(f"--slo {text!r}: {key} must be a positive number of milliseconds")
    if set(got) != {"ttft", "tpot"}:
        raise SloError(f"--slo {text!r}: expected ttft=MS,tpot=MS (both, once each) or auto")
    return Slo(got["ttft"], got["tpot"], f"--slo {text}")


def auto_slo(ttft_ms: Sequence[float], tpot_ms: Sequence[float]) -> Slo:
    """--slo auto: 5x the TTFT p50 and 3x the TPOT p50 of one unloaded baseline instance (concurrency 1) on the
    workload, fixed before any P/D number exists."""
    if not ttft_ms or not tpot_ms:
        raise SloError("--slo auto: the unloaded baseline run completed no request to measure the SLO from")
    t, p = statistics.median(ttft_ms), statistics.median(tpot_ms)
    return Slo(round(AUTO_TTFT_X * t, 1), round(AUTO_TPOT_X * p, 2),
               f"auto: {AUTO_TTFT_X:g} x TTFT p50 {t:.1f} ms, {AUTO_TPOT_X:g} x TPOT p50 {p:.2f} ms unloaded")


@dataclass(frozen=True)
class RequestTimes:
    """One request as the client saw it; ttft_ms None: it failed (a failed request misses every SLO)."""

    ttft_ms: float | None
    tpot_ms: float | None  # None with a TTFT: one output token, no TPOT to miss (as vLLM counts it)


def request_times(vllm_result: dict) -> list[RequestTimes]:
    """Every sent request of one vLLM benchmark() result, failed ones included."""
    out = []
    for i, (n, err) in enumerate(zip(vllm_result["output_lens"], vllm_result["errors"], strict=True)):
        if not n or err:
            out.append(RequestTimes(None, None))
            continue
        ttft, latency = vllm_result["ttfts"][i], vllm_result["latencies"][i]
        out.append(RequestTimes(ttft * 1e3, (latency - ttft) * 1e3 / (n - 1) if n > 1 else None))
    return out


def meets(r: RequestTimes, slo: Slo) -> bool:
    return r.ttft_ms is not None and r.ttft_ms <= slo.ttft_ms and (r.tpot_ms is None or r.tpot_ms <= slo.tpot_ms)


def attainment(requests: Iterable[RequestTimes], slo: Slo) -> float:
    """The share of the sent requests that met both SLOs (0 when none was sent)."""
    rs = list(requests)
    return sum(meets(r, slo) for r in rs) / len(rs) if rs else 0.0


def sustained(points: dict[float, float]) -> float | None:
    """The highest offered rate whose attainment, and that of every lower rate tried, is at least ATTAINMENT
    ("up to the first miss": a noisy pass above a miss does not count). None: the lowest rate tried missed."""
    best = None
    for rate in sorted(points):
        if points[rate] < ATTAINMENT:
            break
        best = rate
    return best


@dataclass(frozen=True)
class Capacity:
    """One request's work as the unloaded baseline instance did it alone (concurrency 1): its prefill (TTFT p50)
    and its decode at batch 1 (max_tokens - 1 steps of TPOT p50), in seconds of that instance."""

    prefill_s: float
    decode_s: float

    @classmethod
    def measured(cls, ttft_ms_p50: float, tpot_ms_p50: float | None, max_tokens: int) -> Capacity:
        return cls(ttft_ms_p50 / 1e3, (tpot_ms_p50 or 0.0) * max(0, max_tokens - 1) / 1e3)

    def saturation(self, units: dict[str, float]) -> float:
        """The offered req/s at which a deployment's busiest role runs out at batch 1. units: per server role, how
        many of the measured instance it has (its cores over the instance's); "baseline" servers do both halves,
        "prefill" and "decode" one each. Batching makes decode cheaper under load: an estimate to place the rates
        around, never a result."""
        if "baseline" in units:
            return units["baseline"] / (self.prefill_s + self.decode_s)
        limits = [units.get("prefill", 0.0) / self.prefill_s]
        if self.decode_s > 0:
            limits.append(units.get("decode", 0.0) / self.decode_s)
        return min(limits)


def _two_digits(x: float) -> float:
    """x rounded to two significant digits (rates a person can read and pass back with --rates)."""
    return float(f"{x:.2g}")


def rates_from_capacity(estimates: Iterable[float]) -> tuple[float, ...]:
    """The offered rates to try, given each deployment's saturation estimate (req/s): from GRID_LOW x the lowest
    to GRID_HIGH x the highest, GRID_STEP apart, every deployment the same rates."""
    est = [e for e in estimates if e > 0 and math.isfinite(e)]
    if not est:
        raise ValueError("no deployment has a capacity to derive rates from")
    lo, hi = GRID_LOW * min(est), GRID_HIGH * max(est)
    n = math.ceil(math.log(hi / lo) / math.log(GRID_STEP))
    return tuple(dict.fromkeys(_two_digits(lo * GRID_STEP ** k) for k in range(n + 1)))


def _steps(x: float, steps: Iterable[int]) -> tuple[float, ...]:
    """x moved by each of `steps` half-again GRID_STEPs (GRID_STEP ** 1.5, about 1.4x), two significant digits."""
    return tuple(_two_digits(x * GRID_STEP ** (1.5 * k)) for k in steps)


def rates_below(lowest: float) -> tuple[float, ...]:
    """Rates to try next when nothing met the target at `lowest`: four steps up from a quarter of it."""
    return _steps(lowest / 4, range(4))


def steps_down(lowest: float) -> tuple[float, ...]:
    """Rates below the grid, highest first, for a side that missed its lowest rate (a slow minute, a tight SLO):
    its bracket's lower end is then found too."""
    return _steps(lowest, range(-1, -STEPS_DOWN - 1, -1))


def rates_above(highest: float) -> tuple[float, ...]:
    """Rates to try next when both sides met the target at `highest`: four steps up to about three times it."""
    return _steps(highest, range(1, 5))


def answer(tried: Iterable[float], pd: float | None, baseline: float | None) -> dict:
    """What the run measured, from the rates tried and each side's sustained rate (None or 0: not even the lowest
    tried): `kind` "compared" (each side's sustained rate), "below" (neither met the target even at the lowest rate
    tried: no answer; `next` the rates to try) or "above" (both sustained the highest rate tried: the limit not
    found; `next` too)."""
    rates = sorted(set(tried))
    sp, sb = pd or None, baseline or None
    out = {"pd": sp, "baseline": sb, "lowest": rates[0] if rates else None,
           "highest": rates[-1] if rates else None, "next": ()}
    if sp is None and sb is None:
        return {**out, "kind": "below", "next": rates_below(rates[0]) if rates else ()}
    if sp == sb == rates[-1]:
        return {**out, "kind": "above", "next": rates_above(rates[-1])}
    return {**out, "kind": "compared"}


def _rates_text(rates: Iterable[float]) -> str:
    return ",".join(f"{r:g}" for r in rates)


def answer_line(a: dict) -> str:
    """The measurement in one sentence: each side's sustained rate, or that the rates tried gave no answer and
    which to try next. Never a comparison of two sides that both missed everything."""
    target = f"at >= {ATTAINMENT:.0%} within the SLO"
    if a["kind"] == "below":
        if a["lowest"] is None:
            return "no answer: no rate was run"
        return (f"no answer: neither P/D nor the aggregated deployment kept {ATTAINMENT:.0%} of requests within "
                f"the SLO even at the lowest rate tried, {a['lowest']:g} req/s; try --rates {_rates_text(a['next'])}")
    if a["kind"] == "above":
        return (f"no answer: P/D and the aggregated deployment both sustained every rate tried, up to "
                f"{a['highest']:g} req/s ({target}); try --rates {_rates_text(a['next'])}")

    def side(x: float | None) -> str:
        return f"< {a['lowest']:g}" if x is None else f"{x:g}"

    return f"P/D sustains {side(a['pd'])} req/s, aggregated {side(a['baseline'])} ({target})"


# -- the report ----------------------------------------------------------------------------------------------------

QUANTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default, as vLLM's benchmark reports them); None
    for no values."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def point_stats(requests: Sequence[RequestTimes], slo: Slo, duration_s: float) -> dict:
    """One rate on one deployment: attainment, goodput (requests within the SLO per second of the run), served
    throughput (completed requests per second), and TTFT/TPOT percentiles of the completed requests."""
    done = [r for r in requests if r.ttft_ms is not None]
    ttft = [r.ttft_ms for r in done]
    tpot = [r.tpot_ms for r in done if r.tpot_ms is not None]
    out = {"requests": len(requests), "attainment": attainment(requests, slo),
           "goodput_req_s": sum(meets(r, slo) for r in requests) / duration_s if duration_s > 0 else 0.0,
           "served_req_s": len(done) / duration_s if duration_s > 0 else 0.0}
    out.update({f"ttft_ms_p{q}": percentile(ttft, q) for q in QUANTILES})
    out.update({f"tpot_ms_p{q}": percentile(tpot, q) for q in QUANTILES})
    return out


def _most(g: dict, sides: tuple[str, ...], key: str, *more: float | None) -> float | None:
    """The highest value of one statistic over every point these deployments ran (and `more`), None if unknown."""
    seen = [st.get(key) for side in sides for run in g[side].get("runs", ()) for st in run.get("stats", {}).values()]
    known = [x for x in (*seen, *more) if x is not None]
    return max(known) if known else None


def max_steal(g: dict, sides: tuple[str, ...]) -> float | None:
    """The highest CPU steal any point of these deployments (or the unloaded SLO measurement) ran under."""
    return _most(g, sides, "cpu_steal", (g.get("unloaded") or {}).get("cpu_steal"))


def max_idle_beside(g: dict, sides: tuple[str, ...]) -> float | None:
    """The most CPU any idle process used while a deployment beside it ran a point (both up at once)."""
    return _most(g, sides, "cores_idle_max")


NOT_SERVERS = ("busy", "proxy", "pdctl", "idle_max")  # a point's cores_<name> keys that are not a server role


def server_cores(point: dict) -> dict[str, float]:
    """A point's cores per server role (prefill, decode, baseline), from its cores_<role> keys."""
    return {k[len("cores_"):]: v for k, v in point.items()
            if k.startswith("cores_") and k[len("cores_"):] not in NOT_SERVERS and v is not None}


def beyond_bound_cores(g: dict, sides: tuple[str, ...]) -> list[tuple[str, str, float, float, int]]:
    """Per deployment and server role: the lowest offered rate at which its servers used more cores (median of the
    repetitions) than their workers are bound to: (side, role, rate, cores used, cores bound). Their unbound
    processes (API servers, engine cores) then take time from the cores of other roles' servers."""
    found = []
    for side in sides:
        bound = (g.get("bound_cores") or {}).get(side, {})
        by_rate = sorted(g[side].get("stats_median", {}).items(), key=lambda kv: float(kv[0]))
        for role, n in bound.items():
            for rate, st in by_rate:
                used = server_cores(st).get(role)
                if used is not None and used > n:
                    found.append((side, role, float(rate), used, n))
                    break
    return found


def spread(values: Sequence[float | None]) -> float | None:
    """The largest over the smallest of the known values (1.0: all alike); None with fewer than two."""
    known = [v for v in values if v is not None and v > 0]
    return max(known) / min(known) if len(known) > 1 else None


def crossover(pd: dict[float, float], baseline: dict[float, float]) -> dict:
    """Where P/D starts to pay, from the attainment per offered rate of each side (rates tried on both only).
    `winner`: the side that sustains the higher rate (goodput's verdict; "tie" when equal). `from_req_s`: among
    the rates where either side still meets the target (above them both fail, and who fails less says nothing),
    the lowest from which P/D's attainment is at least the baseline's at every higher one, when the baseline did
    better just below it; None when one side leads throughout. Both None when the sides share no rate or neither
    sustained any (nothing to compare)."""
    common = sorted(set(pd) & set(baseline))
    if not common:
        return {"from_req_s": None, "winner": None}
    sp = sustained({r: pd[r] for r in common}) or 0.0
    sb = sustained({r: baseline[r] for r in common}) or 0.0
    winner = "pd" if sp > sb else "baseline" if sb > sp else "tie" if sp else None  # None: neither sustained any
    live = [r for r in common if max(pd[r], baseline[r]) >= ATTAINMENT]
    start = None
    for r in reversed(live):
        if pd[r] < baseline[r]:
            break
        start = r
    if not live or start == live[0]:
        start = None  # P/D never behind where it matters (or behind at the top of it): no crossing to name
    return {"from_req_s": start, "winner": winner}


# -- the recommended layout ------------------------------------------------------------------------------------------

# SLO tightness factors the recommendation is recomputed at (both SLOs scaled together), from the requests measured.
SLO_FACTORS = (0.25, 0.33, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0)


def sustained_median(runs: Sequence[dict], slo: Slo) -> float:
    """The median over repetitions of the sustained rate under `slo`, recomputed from each run's per-request
    TTFT/TPOT per rate (`run["requests"][rate] = [[ttft_ms, tpot_ms], ...]`); 0 for a run that sustained none."""
    out = []
    for run in runs:
        points = {float(rate): attainment([RequestTimes(*x) for x in reqs], slo)
                  for rate, reqs in run["requests"].items()}
        out.append(sustained(points) or 0.0)
    return statistics.median(out) if out else 0.0


def recommend(deployments: dict[str, Sequence[dict]], slo: Slo) -> dict:
    """The deployment with the highest median sustained rate under `slo`; a tie goes to the one listed first (the
    baseline comes first: with nothing to gain, the simpler deployment)."""
    rates = {name: sustained_median(runs, slo) for name, runs in deployments.items()}
    best = max(rates, key=lambda n: (rates[n], -list(rates).index(n)))
    return {"best": best, "sustained_req_s": rates}


def slo_sensitivity(deployments: dict[str, Sequence[dict]], slo: Slo,
                    factors: Sequence[float] = SLO_FACTORS) -> dict:
    """The recommendation at each SLO tightness (both SLOs times a factor), and the factors at which the answer
    changes from the one below it."""
    rows = []
    for f in factors:
        scaled = Slo(round(slo.ttft_ms * f, 1), round(slo.tpot_ms * f, 2), f"{f:g} x {slo.origin}")
        r = recommend(deployments, scaled)
        rows.append({"factor": f, "ttft_ms": scaled.ttft_ms, "tpot_ms": scaled.tpot_ms, **r})
    changes = [b["factor"] for a, b in zip(rows, rows[1:], strict=False) if a["best"] != b["best"]]
    return {"rows": rows, "changes_at": changes}
