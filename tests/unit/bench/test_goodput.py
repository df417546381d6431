"""Goodput's pure parts: SLOs, per-request verdicts, attainment, the rate search."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdctl.bench import goodput as g
from pdctl.bench.goodput import RequestTimes, Slo


def test_an_slo_flag_is_both_bounds_in_milliseconds_or_auto():
    s = g.parse_slo("ttft=500,tpot=10")
    assert (s.ttft_ms, s.tpot_ms) == (500.0, 10.0) and "--slo ttft=500,tpot=10" in str(s)
    assert g.parse_slo("TPOT=9.6, ttft=608") == Slo(608.0, 9.6, "--slo TPOT=9.6, ttft=608")
    assert g.parse_slo("auto") is None


@pytest.mark.parametrize("bad", ["ttft=500", "ttft=500,tpot=10,tpot=3", "ttft=fast,tpot=10", "ttft=-1,tpot=3",
                                 "e2el=5,tpot=1", "", "ttft=nan,tpot=1"])
def test_a_bad_slo_flag_is_refused_naming_it(bad):
    with pytest.raises(g.SloError, match="--slo"):
        g.parse_slo(bad)


def test_auto_is_five_times_the_unloaded_ttft_and_three_times_the_tpot():
    s = g.auto_slo([100.0, 120.0, 140.0], [3.0, 3.2, 9.0])
    assert (s.ttft_ms, s.tpot_ms) == (600.0, 9.6) and s.origin.startswith("auto")
    with pytest.raises(g.SloError):
        g.auto_slo([], [])


def test_a_failed_request_misses_and_one_token_has_no_tpot_to_miss():
    slo = Slo(500, 10, "t")
    assert not g.meets(RequestTimes(None, None), slo)
    assert g.meets(RequestTimes(499, None), slo) and g.meets(RequestTimes(500, 10), slo)
    assert not g.meets(RequestTimes(501, 1), slo) and not g.meets(RequestTimes(1, 10.5), slo)


def test_request_times_come_from_vllms_per_request_lists_failures_included():
    r = {"output_lens": [4, 0, 1, 4], "errors": ["", "boom", "", ""], "ttfts": [0.1, 0.0, 0.2, 0.05],
         "latencies": [0.13, 0.0, 0.2, 0.65]}
    got = g.request_times(r)
    assert got[1] == RequestTimes(None, None) and got[2] == RequestTimes(200.0, None)
    assert got[0].ttft_ms == pytest.approx(100) and got[0].tpot_ms == pytest.approx(10)
    # Only request 0 meets it: 1 failed, 2's TTFT is 200 ms, 3's TPOT 200 ms.
    assert g.attainment(got, Slo(150, 15, "t")) == 0.25 and g.attainment(got, Slo(250, 250, "t")) == 0.75
    assert g.attainment([], Slo(1, 1, "t")) == 0.0


def test_the_sustained_rate_is_up_to_the_first_miss():
    assert g.sustained({2: 1.0, 3: 0.95, 4: 0.89, 5: 0.97}) == 3  # the pass at 5 above a miss does not count
    assert g.sustained({2: 0.5}) is None and g.sustained({}) is None
    assert g.sustained({1: 0.9}) == 1  # exactly 90 % meets it


def test_the_search_doubles_to_the_first_miss_then_bisects_to_five_percent():
    capacity = 5.3  # a deployment that meets the SLO at or below 5.3 req/s
    points: dict[float, float] = {}
    tried = []
    while (r := g.next_rate(points, start=1.0, ceiling=64)) is not None:
        assert r not in points and len(tried) < 30
        tried.append(r)
        points[r] = 1.0 if r <= capacity else 0.5
    assert tried[:4] == [1.0, 2.0, 4.0, 8.0]
    ok = g.sustained(points)
    assert ok <= capacity and min(x for x in points if x > ok) / ok <= g.RESOLUTION and ok >= capacity / 1.05


def test_the_search_stops_at_the_ceiling_and_looks_below_a_failed_start():
    assert g.next_rate({8.0: 1.0}, start=1.0, ceiling=8.0) is None
    assert g.next_rate({1.0: 0.2}, start=1.0, ceiling=8.0) == 0.5
    assert g.next_rate({1.0: 0.2, 0.5: 0.2, 0.25: 0.1, 0.125: 0.0}, start=1.0, ceiling=8.0) is None


@given(st.floats(0.2, 50), st.floats(0.5, 4))
def test_the_search_always_ends_within_resolution_of_any_capacity(capacity, start):
    points: dict[float, float] = {}
    for _ in range(40):
        r = g.next_rate(points, start=start, ceiling=100)
        if r is None:
            break
        points[r] = 1.0 if r <= capacity else 0.0
    else:
        raise AssertionError(f"no end: {points}")
    ok = g.sustained(points)
    if ok is not None and ok < 100:
        assert min(x for x in points if x > ok) / ok <= g.RESOLUTION


def test_percentiles_interpolate_as_numpy_does():
    import numpy as np

    xs = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 50, 90, 99, 100):
        assert g.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert g.percentile([], 50) is None


def test_a_points_goodput_counts_only_requests_within_both_slos_per_second():
    slo = g.Slo(500, 10, "x")
    rs = [g.RequestTimes(100, 5), g.RequestTimes(600, 5), g.RequestTimes(100, 50),
          g.RequestTimes(None, None)]
    st = g.point_stats(rs, slo, duration_s=2.0)
    assert st["attainment"] == 0.25 and st["goodput_req_s"] == 0.5 and st["served_req_s"] == 1.5
    assert st["ttft_ms_p50"] == 100 and st["tpot_ms_p99"] == pytest.approx(49.1)
    # the report's attainment is the per-request data's, recomputed
    assert st["attainment"] == sum(g.meets(r, slo) for r in rs) / len(rs)


def test_the_crossover_is_where_pd_leads_from_on_and_none_when_one_side_leads_everywhere():
    # the baseline ahead at low load, P/D from 2 req/s on while either meets the target
    assert g.crossover({1: 0.9, 2: 0.95, 4: 0.92}, {1: 0.99, 2: 0.9, 4: 0.5}) == {"from_req_s": 2, "winner": "pd"}
    # P/D ahead everywhere: no crossing to name
    assert g.crossover({1: 1.0, 2: 0.9}, {1: 0.9, 2: 0.5}) == {"from_req_s": None, "winner": "pd"}
    # negative control: a baseline that should win is reported as winning
    assert g.crossover({1: 0.9, 2: 0.4}, {1: 0.99, 2: 0.9}) == {"from_req_s": None, "winner": "baseline"}
    # behind again at the top of where it matters: the lead lower down is no crossover
    assert g.crossover({1: 0.5, 2: 0.95, 4: 0.85}, {1: 0.95, 2: 0.9, 4: 0.91})["from_req_s"] is None
    assert g.crossover({1: 0.5}, {2: 0.5}) == {"from_req_s": None, "winner": None}


def test_where_both_miss_the_target_who_misses_less_decides_nothing():
    # 2026-12-05's cpu-demo run (medians of 3): P/D sustains 4 req/s, the baseline 3; at 8 req/s both are far
    # below 90 % and the baseline's 49 % against P/D's 28 % must not turn the verdict
    pd = {1: 1.0, 2: 0.98, 3: 0.98, 4: 0.96, 5: 0.82, 6: 0.81, 8: 0.28}
    base = {1: 1.0, 2: 0.96, 3: 0.92, 4: 0.85, 5: 0.75, 6: 0.78, 8: 0.49}
    assert g.crossover(pd, base) == {"from_req_s": None, "winner": "pd"}


def test_a_role_beyond_its_bound_cores_is_named_at_the_lowest_rate_where_it_was():
    def side(**per_rate):
        return {"stats_median": {rate.lstrip("r"): {f"cores_{k}": v for k, v in used.items()}
                                 for rate, used in per_rate.items()}}

    run = {"bound_cores": {"pd": {"prefill": 1, "decode": 1}, "baseline": {"baseline": 2}},
           "pd": side(r4={"prefill": 0.3, "decode": 0.8}, r10={"prefill": 0.6, "decode": 1.04},
                      r7={"prefill": 0.4, "decode": 1.01}),
           "baseline": side(r4={"baseline": 1.1}, r14={"baseline": 1.8})}
    assert g.beyond_bound_cores(run, ("pd", "baseline")) == [("pd", "decode", 7.0, 1.01, 1)]
    # Negative controls: within the bound everywhere, or a role with no bound (an unbound server may use any core).
    run["pd"] = side(r4={"prefill": 0.3, "decode": 1.0})
    assert g.beyond_bound_cores(run, ("pd", "baseline")) == []
    run["pd"] = side(r4={"prefill": 0.3, "decode": 1.5})
    run["bound_cores"]["pd"] = {"prefill": 1}
    assert g.beyond_bound_cores(run, ("pd", "baseline")) == []
