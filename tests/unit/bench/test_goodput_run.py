"""`pdctl bench --goodput`: what it refuses before anything starts, and its run's order and arithmetic over fake
servers (the load through vLLM's benchmark replaced; the e2e test runs it for real)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pdctl.bench import goodput as gp
from pdctl.bench import goodput_run
from pdctl.bench.options import BenchOptions
from pdctl.plan import baseline_plan, build_plan
from pdctl.topology import load_topology
from tests.conftest import CONFIGS


@pytest.mark.parametrize("args, says", [
    (["--slo", "ttft=500"], "--slo 'ttft=500': expected ttft=MS,tpot=MS"),
    (["--rates", "2,x"], "--rates 2,x: expected offered request rates"),
    (["--rates", "0,2"], "--rates 0,2: offered request rates must be positive"),
    (["--breakdown"], "--goodput runs its own rates"),
    (["--request-rate", "2"], "--request-rate: removed: use --rates R"),
    (["--repeat", "0"], "--repeat 0, --requests 200: at least 1 each"),
    (["--requests", "0"], "--repeat 3, --requests 0: at least 1 each"),
])
def test_bad_goodput_flags_are_refused_before_anything_starts(run_cli, args, says, monkeypatch):
    monkeypatch.setattr("pdctl.launch.run.up", lambda *a, **k: pytest.fail("started"))
    code, _, err = run_cli("bench", CONFIGS / "cpu-demo.yaml", "--skip", "check,eval", "--goodput", *args)
    assert code == 1 and says in err and "Traceback" not in err, err


@pytest.mark.parametrize("args, says", [
    (["--rates", "2,4"], "--rates 2,4: without --goodput the load benchmark runs at one offered rate"),
    (["--rates", "x"], "--rates x: expected offered request rates"),
    (["--alone"], "--alone: how --goodput runs P/D and its baseline; add --goodput"),
])
def test_rates_without_goodput_are_one_open_loop_rate(run_cli, args, says, monkeypatch):
    monkeypatch.setattr("pdctl.launch.run.up", lambda *a, **k: pytest.fail("started"))
    code, _, err = run_cli("bench", CONFIGS / "cpu-demo.yaml", "--skip", "check,eval", *args)
    assert code == 1 and says in err and "Traceback" not in err, err


def test_one_rate_is_the_load_benchmarks_open_loop_and_several_are_goodputs():
    from pdctl import api

    assert api.load_rates("4", goodput=False) == {"rates": None, "request_rate": 4.0}
    assert api.load_rates("2,4", goodput=True) == {"rates": (2.0, 4.0), "request_rate": None}
    assert api.load_rates("4", goodput=True) == {"rates": (4.0,), "request_rate": None}
    assert api.load_rates(None, goodput=False) == {"rates": None, "request_rate": None}


def test_the_loads_shape_defaults_to_long_prompts_for_goodput_and_short_for_the_gates():
    g = BenchOptions(goodput=True).resolved()
    assert (g.requests, g.prompt_len, g.max_tokens) == (200, 2048, 64)
    assert (BenchOptions().resolved().requests, BenchOptions(requests=7).resolved().requests) == (32, 7)


class FakeServers:
    """Deployments whose requests meet a TTFT SLO up to `capacity` req/s; records every leg and load."""

    def __init__(self, capacity: dict[str, float]):
        self.capacity, self.legs, self.loads, self.sizes = capacity, [], [], {}
        self.current = None

    def up(self, plan, engine, attached, timeout_s):
        from pdctl.launch.state import LaunchState

        self.current = "pd" if plan.by_role("decode") else "baseline"
        self.legs.append(self.current)
        return LaunchState(plan)  # no processes: no CPU to read

    def down(self, state, engine):
        self.current = None

    def run_load(self, target, url, model, w, max_tokens, concurrency, decode_urls=(), request_rate=None, seed=0,
                 headers=None):
        self.loads.append((self.current, target, request_rate, id(w), seed))
        n = self.sizes[request_rate] = len(w)
        ok = request_rate is None or request_rate <= self.capacity[self.current]
        ttft = 0.1 if ok else 5.0
        vllm = {"output_lens": [4] * n, "errors": [""] * n, "ttfts": [ttft] * n, "latencies": [ttft + 0.03] * n}
        return SimpleNamespace(vllm=vllm, ttft_ms_p50=ttft * 1e3, tpot_ms_p50=10.0, vllm_json=lambda: "{}",
                               duration_s=n / (request_rate or 1.0),
                               to_dict=lambda: {"ttft_ms_p50": ttft * 1e3})


def _run(tmp_path, monkeypatch, o, capacity):
    loaded = load_topology(CONFIGS / "cpu-demo.yaml")
    t = loaded.topology
    pd = build_plan(t, base_dir=loaded.base_dir, state_dir=tmp_path / "s", python="py")
    base = baseline_plan(t, base_dir=loaded.base_dir, state_dir=tmp_path / "b", python="py")
    fake = FakeServers(capacity)
    monkeypatch.setattr(goodput_run.run_mod, "up", fake.up)
    monkeypatch.setattr(goodput_run.run_mod, "down", fake.down)
    monkeypatch.setattr(goodput_run.load, "run_load", fake.run_load)
    monkeypatch.setattr(goodput_run.load, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(goodput_run.load, "workload", lambda n, *a, **k: list(range(n)))
    phases = []
    out = goodput_run.run_goodput(loaded, pd, base, None, tmp_path, o.resolved(), phases.append)
    return out, fake, phases


def test_auto_slo_comes_from_the_unloaded_baseline_first_then_legs_interleave(tmp_path, monkeypatch):
    o = BenchOptions(goodput=True, rates=(1.0, 2.0, 4.0), repeat=3, requests=10)
    out, fake, phases = _run(tmp_path, monkeypatch, o, {"pd": 3.0, "baseline": 1.5})
    assert fake.legs == ["baseline", "pd", "pd", "baseline", "baseline", "pd"]
    assert fake.loads[0][:3] == ("baseline", "unloaded", None)  # concurrency 1, before any P/D number
    assert out["slo"]["ttft_ms"] == pytest.approx(500) and out["slo"]["tpot_ms"] == pytest.approx(30)
    assert any(p.startswith("SLO: TTFT <= 500 ms") for p in phases)
    # The same prompts and arrivals for both at each (repetition, rate).
    by = {}
    for dep, target, rate, w, seed in fake.loads:
        if target != "unloaded":
            by.setdefault((rate, seed), set()).add((dep, w))
    assert all(len({w for _, w in v}) == 1 and {d for d, _ in v} == {"pd", "baseline"} for v in by.values())
    # The unloaded baseline instance again at the start of every repetition, on fresh servers with the same prompts:
    # the host's speed, repetition by repetition (the same here: no note).
    unloaded = [(dep, w) for dep, target, _, w, _ in fake.loads if target == "unloaded"]
    assert len(unloaded) == 3 and {dep for dep, _ in unloaded} == {"baseline"} and len({w for _, w in unloaded}) == 1
    assert [x["ttft_ms_p50"] for x in out["host_speed"]["unloaded"]] == [100.0] * 3
    assert out["host_speed"]["ttft_spread"] == 1.0
    assert out["pd"]["sustained_req_s"] == 2.0 and out["baseline"]["sustained_req_s"] == 1.0
    assert out["ratio_pd_over_baseline"] == 2.0 and out["pd"]["attainment_median"] == {"1": 1.0, "2": 1.0, "4": 0.0}
    assert (tmp_path / "goodput" / "summary.json").is_file()
    # per rate and side: goodput and latency percentiles; P/D leads from the lowest rate on (no crossing to name)
    st = out["pd"]["stats_median"]
    assert st["2"]["goodput_req_s"] == pytest.approx(2.0) and st["4"]["goodput_req_s"] == 0.0
    assert st["4"]["ttft_ms_p99"] == pytest.approx(5000) and st["2"]["served_req_s"] == pytest.approx(2.0)
    assert out["crossover"] == {"from_req_s": None, "winner": "pd"}  # P/D sustains 2 req/s, the baseline 1
    for name in ("attainment.png", "ttft_p99.png", "tpot_p99.png"):
        assert (tmp_path / "goodput" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_deployment_stops_at_its_first_miss_and_may_start_at_its_own_rate(tmp_path, monkeypatch):
    _, fake, _ = _run(tmp_path / "setup", monkeypatch, BenchOptions(goodput=True, rates=(1.0,), repeat=1,
                                                                  requests=10), {"pd": 3.0, "baseline": 1.5})
    loaded = load_topology(CONFIGS / "cpu-demo.yaml")
    t = loaded.topology
    plans = {"baseline": baseline_plan(t, base_dir=loaded.base_dir, state_dir=tmp_path / "b", python="py"),
             "pd": build_plan(t, base_dir=loaded.base_dir, state_dir=tmp_path / "s", python="py")}
    fake.loads.clear()
    ups = []
    o = BenchOptions(goodput=True, rates=(1.0, 2.0, 3.0, 4.0, 5.0), repeat=1, requests=10).resolved()
    out = goodput_run.run_deployments(loaded, plans, None, tmp_path, o, lambda _: None,
                                      on_up=lambda name, rep, plan: ups.append((name, rep, plan is plans[name])),
                                      until_miss=True, rates_for={"pd": (2.0, 3.0, 4.0, 5.0)})
    sent = {dep: [rate for d, target, rate, *_ in fake.loads if d == dep and target != "unloaded"]
            for dep in ("baseline", "pd")}
    assert sent == {"baseline": [1.0, 2.0], "pd": [2.0, 3.0, 4.0]}  # nothing after a miss; P/D from its own 2
    assert out["baseline"]["sustained_req_s"] == 1.0 and out["pd"]["sustained_req_s"] == 3.0
    assert ups == [("baseline", 0, True), ("pd", 0, True)]
    at2 = {(d, w, seed) for d, target, rate, w, seed in fake.loads if rate == 2.0}
    assert len({(w, seed) for _, w, seed in at2}) == 1  # the same prompts and arrivals at the same rate
    # Negative control: without until_miss every rate is sent.
    fake.loads.clear()
    goodput_run.run_deployments(loaded, plans, None, tmp_path, o, lambda _: None)
    assert [r for d, t_, r, *_ in fake.loads if d == "baseline" and t_ != "unloaded"] == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_without_rates_they_come_from_the_unloaded_baseline_and_each_side_stops_at_its_first_miss(tmp_path,
                                                                                                   monkeypatch):
    o = BenchOptions(goodput=True, repeat=1, requests=10)
    out, fake, phases = _run(tmp_path, monkeypatch, o, {"pd": 1.3, "baseline": 2.0})
    # the fake's unloaded instance: TTFT 100 ms, TPOT 10 ms; 64 output tokens; cpu-demo: a core per server
    cap = out["rates"]["capacity"]
    assert out["rates"]["from"] == "capacity" and cap["prefill_s"] == pytest.approx(0.1)
    assert cap["decode_s"] == pytest.approx(0.63)
    assert cap["saturation_req_s"] == {"baseline": pytest.approx(2 / 0.73, abs=1e-3),
                                       "pd": pytest.approx(1 / 0.63, abs=1e-3)}
    tried = out["rates"]["tried"]
    assert tried == list(gp.rates_from_capacity(cap["saturation_req_s"].values()))
    assert any(p.startswith("rates from this host's capacity: " + ", ".join(f"{x:g}" for x in tried)) for p in phases)
    sent = {dep: [r for d, t_, r, *_ in fake.loads if d == dep and t_ != "unloaded"] for dep in ("pd", "baseline")}
    for dep, capacity in (("pd", 1.3), ("baseline", 2.0)):
        passed = [r for r in tried if r <= capacity]
        assert sent[dep] == tried[:len(passed) + 1]  # up to and with its first miss, nothing above it
        assert out[dep]["sustained_req_s"] == passed[-1]
    assert out["answer"]["kind"] == "compared" and out["status"] == goodput_run.MEASURED
    # Negative control: an SLO nothing meets (TTFT 0.01 ms) sustains no rate on either side: no answer.
    o = BenchOptions(goodput=True, repeat=1, requests=10, slo="ttft=0.01,tpot=0.01")
    out, fake, _ = _run(tmp_path / "neg", monkeypatch, o, {"pd": 5.3, "baseline": 2.2})
    assert out["pd"]["sustained_req_s"] == out["baseline"]["sustained_req_s"] == 0.0
    assert out["ratio_pd_over_baseline"] is None and out["slo"]["origin"].startswith("--slo")
    down = gp.steps_down(out["rates"]["tried"][0])
    assert out["answer"]["kind"] == "below" and out["answer"]["lowest"] == min(down)
    sent = [x[2] for x in fake.loads if x[1] != "unloaded"]  # the grid's lowest, then the steps down, each side
    assert sorted(sent) == sorted([out["rates"]["tried"][0], *down] * 2)


def test_a_side_that_misses_the_grids_lowest_rate_is_tried_below_it_until_one_passes(tmp_path, monkeypatch):
    """A slow minute, or a tight SLO: the grid's lowest rate is above what P/D sustains; the steps below find it."""
    o = BenchOptions(goodput=True, repeat=1, requests=10)
    out, fake, _ = _run(tmp_path, monkeypatch, o, {"pd": 0.4, "baseline": 2.0})
    lowest = out["rates"]["tried"][0]
    down = gp.steps_down(lowest)
    assert down[0] > 0.4 >= down[1]  # the fake P/D passes at the second step down
    sent = [r for d, t_, r, *_ in fake.loads if d == "pd" and t_ != "unloaded"]
    assert sent == [lowest, *down] and out["pd"]["sustained_req_s"] == down[1]
    assert out["answer"]["kind"] == "compared" and out["baseline"]["sustained_req_s"] >= lowest


def test_duration_sends_each_rate_its_seconds_of_arrivals(tmp_path, monkeypatch):
    o = BenchOptions(goodput=True, repeat=1, rates=(0.5, 4.0), duration_s=20)
    assert o.resolved().requests is None
    out, fake, _ = _run(tmp_path, monkeypatch, o, {"pd": 5.0, "baseline": 5.0})
    assert {r: n for r, n in fake.sizes.items() if r is not None} == {0.5: 10, 4.0: 80}  # at least MIN_POINT_REQUESTS
    assert out["duration_s"] == 20 and out["rates"] == {"tried": [0.5, 4.0], "from": "--rates"}


@pytest.mark.parametrize("args, says", [
    (["--duration", "20", "--requests", "50"], "--requests 50 and --duration 20: give one"),
    (["--duration", "0"], "--duration 0: at least 1 repetition and a positive number of seconds"),
])
def test_duration_is_refused_with_requests_and_when_not_positive(run_cli, args, says, monkeypatch):
    monkeypatch.setattr("pdctl.launch.run.up", lambda *a, **k: pytest.fail("started"))
    code, _, err = run_cli("bench", CONFIGS / "cpu-demo.yaml", "--skip", "check,eval", "--goodput", *args)
    assert code == 1 and says in err and "Traceback" not in err, err
    code, _, err = run_cli("bench", CONFIGS / "cpu-demo.yaml", "--skip", "check,eval", "--duration", "20")
    assert code == 1 and "--duration: how --goodput runs P/D and its baseline; add --goodput" in err, err


def test_each_point_records_this_hosts_cpu_steal_and_the_report_says_when_neighbours_were_busy(tmp_path, monkeypatch):
    from rich.console import Console

    from pdctl import render
    from pdctl.bench import host

    def readings(steal_per_run):
        # two readings per run (before, after), 1000 ticks apart; the steal in between as given
        ticks = host.CpuTimes(0, 0, 0, 2)
        for s in steal_per_run:
            yield ticks
            ticks = host.CpuTimes(ticks.steal + int(1000 * s), ticks.total + 1000, ticks.idle, 2)
            yield ticks

    def report(steal_per_run):
        it = readings(steal_per_run)
        monkeypatch.setattr(goodput_run.host, "cpu_times", lambda: next(it))
        o = BenchOptions(goodput=True, rates=(1.0, 2.0), repeat=1, requests=10)
        out, _, phases = _run(tmp_path, monkeypatch, o, {"pd": 3.0, "baseline": 1.5})
        c = Console(record=True, width=120)
        render.goodput(c, out)
        return out, phases, " ".join(c.export_text().split())

    # runs in order: unloaded (SLO), baseline at 1 and 2, P/D at 1 and 2
    out, phases, text = report([0.0, 0.02, 0.01, 0.30, 0.0])
    assert out["unloaded"]["cpu_steal"] == 0.0
    assert out["baseline"]["runs"][0]["stats"]["2"]["cpu_steal"] == 0.01
    assert out["pd"]["runs"][0]["stats"]["1"]["cpu_steal"] == 0.30
    assert any(p.startswith("  pd at 1 req/s") and "stolen by other guests 30%" in p for p in phases)
    assert "lost up to 30% of its CPU time to other guests" in text and "30%" in text
    # Negative control: neighbours that took under 5 % are not worth a warning.
    _, phases, text = report([0.0, 0.02, 0.01, 0.04, 0.0])
    assert "other guests" not in text and not any("stolen" in p for p in phases)


def test_a_host_whose_speed_moved_between_repetitions_is_said_to_have(tmp_path, monkeypatch):
    """The same unloaded work at the start of each repetition took 1.6x as long in the second: the report says the
    repetitions are not comparable, even at 0 % steal (a shared host's CPU can slow without steal)."""
    from rich.console import Console

    from pdctl import render

    slow = iter([1.0, 1.6, 1.2])
    steady = FakeServers.run_load

    def run_load(self, target, url, model, w, *a, **k):
        r = steady(self, target, url, model, w, *a, **k)
        if target == "unloaded":
            x = next(slow)
            r.ttft_ms_p50 *= x
            r.vllm["ttfts"] = [t * x for t in r.vllm["ttfts"]]
        return r

    monkeypatch.setattr(FakeServers, "run_load", run_load)
    o = BenchOptions(goodput=True, rates=(1.0,), repeat=3, requests=10)
    out, _, phases = _run(tmp_path, monkeypatch, o, {"pd": 3.0, "baseline": 1.5})
    assert [x["ttft_ms_p50"] for x in out["host_speed"]["unloaded"]] == pytest.approx([100.0, 160.0, 120.0])
    assert out["host_speed"]["ttft_spread"] == pytest.approx(1.6)
    assert out["slo"]["ttft_ms"] == pytest.approx(500)  # from the first: fixed before any P/D number
    assert any("unloaded baseline instance: TTFT p50 160.0 ms, 1.60x repetition 1's" in p for p in phases)
    c = Console(record=True, width=200)
    render.goodput(c, out)
    text = " ".join(c.export_text().split())
    assert "this host's speed moved during the run" in text and "100.0, 160.0, 120.0 ms" in text
    assert "(1.60x apart; the SLO came from the first)" in text
    # Negative control: within 20 % is a steady host, and nothing is said.
    out["host_speed"] = {"unloaded": out["host_speed"]["unloaded"][:1], "ttft_spread": 1.15}
    c = Console(record=True, width=200)
    render.goodput(c, out)
    assert "speed moved" not in c.export_text()


def test_the_goodput_table_shows_each_rate_and_what_each_side_sustained():
    from rich.console import Console

    from pdctl import render

    g = {"slo": {"ttft_ms": 500.0, "tpot_ms": 9.6, "origin": "auto: 5 x TTFT p50 100.0 ms"}, "repeat": 3,
         "requests_per_rate": 200, "dataset": "random", "prompt_len": 2048, "max_tokens": 64, "status": "MEASURED",
         "pd": {"attainment_median": {"2": 1.0, "4": 0.95, "8": 0.29}, "sustained_req_s": 4.0},
         "baseline": {"attainment_median": {"2": 0.96, "4": 0.75}, "sustained_req_s": 2.0},
         "ratio_pd_over_baseline": 2.0}
    c = Console(record=True, width=160)
    render.bench(c, c, {"goodput": g, "pools": "P32 -> D64", "status": "PASS"}, None, Path("r"))
    text = " ".join(c.export_text().split())  # a table's title wraps at the table's width
    assert "TTFT <= 500 ms, TPOT <= 9.6 ms" in text and "29%" in text and "75%" in text
    assert "goodput measured P/D sustains 4 req/s, aggregated 2 (at >= 90% within the SLO); P/D 2.00x" in text
    assert "goodput pass" not in text.lower() and "goodput fail" not in text.lower()  # a measurement, not a gate
    assert "latency per offered rate" not in text  # no per-rate statistics: no latency table
    # A side that missed even the lowest rate tried sustains less than it, not "0 req/s".
    g["pd"] = {"attainment_median": {"2": 0.5, "4": 0.3}, "sustained_req_s": 0.0}
    c = Console(record=True, width=160)
    render.bench(c, c, {"goodput": g, "pools": "P32 -> D64", "status": "PASS"}, None, Path("r"))
    text = " ".join(c.export_text().split())
    assert "P/D sustains < 2 req/s, aggregated 2 (at >= 90% within the SLO)" in text and "< 2 req/s 2 req/s" in text
    # Neither side within the target at any rate: no answer, never a comparison of two misses.
    g["baseline"] = {"attainment_median": {"2": 0.0, "4": 0.02}, "sustained_req_s": 0.0}
    g["ratio_pd_over_baseline"] = None
    c = Console(record=True, width=160)
    render.bench(c, c, {"goodput": g, "pools": "P32 -> D64", "status": "PASS"}, None, Path("r"))
    text = " ".join(c.export_text().split())
    assert "no answer: neither P/D nor the aggregated deployment kept 90% of requests within the SLO even at the " \
           "lowest rate tried, 2 req/s; try --rates 0.5,0.7,0.98,1.4" in text
    assert "P/D sustains" not in text


def test_the_goodput_report_shows_latency_percentiles_goodput_and_where_pd_pays():
    from rich.console import Console

    from pdctl import render

    def st(ttft, tpot, good):
        return {"goodput_req_s": good, **{f"ttft_ms_p{q}": ttft * k for q, k in ((50, 1), (90, 2), (99, 3))},
                **{f"tpot_ms_p{q}": tpot * k for q, k in ((50, 1), (90, 2), (99, 3))}}

    g = {"slo": {"ttft_ms": 500.0, "tpot_ms": 9.6, "origin": "auto: 5 x TTFT p50 100.0 ms"}, "repeat": 3,
         "requests_per_rate": 200, "dataset": "random", "prompt_len": 2048, "max_tokens": 64, "status": "PASS",
         "pd": {"attainment_median": {"2": 0.9, "4": 0.95}, "sustained_req_s": 4.0,
                "stats_median": {"2": st(150, 3.5, 1.8), "4": st(220, 4.1, 3.8)}},
         "baseline": {"attainment_median": {"2": 0.96, "4": 0.75}, "sustained_req_s": 2.0,
                      "stats_median": {"2": st(130, 3.8, 1.92), "4": st(160, 7.3, 3.0)}},
         "ratio_pd_over_baseline": 2.0, "crossover": {"from_req_s": 4.0, "winner": "pd"}, "plots": ["g/a.png"]}
    c = Console(record=True, width=80)
    render.goodput(c, g)
    text = c.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    flat = " ".join(text.split())
    assert "P/D pays from 4 req/s offered" in flat and "plots: g/a.png" in flat
    assert "4 P/D 220 440 660 4.1 8.2 12.3" in flat and "4 agg 160 320 480 7.3 14.6 21.9" in flat
    assert "3.80" in flat and "1.92" in flat  # goodput per side
    assert "CPU per offered rate" not in flat  # no CPU read (another engine's processes): no table of zeros
    c = Console(record=True, width=100)
    render.goodput(c, {**g, "crossover": {"from_req_s": None, "winner": "baseline"}})
    assert "P/D does not pay here" in " ".join(c.export_text().split())


def test_plan_baseline_shows_the_aggregated_deployment_bench_goodput_compares_with(run_cli):
    code, out, err = run_cli("plan", CONFIGS / "cpu-demo.yaml", "--baseline", "--json")
    assert code == 0, err
    names = [p["name"] for p in json.loads(out)["processes"]]
    assert names == ["baseline-prefill-0", "baseline-decode-0", "baseline-proxy"]


# -- pdctl sweep --goodput: the recommended layout ---------------------------------------------------------------


LAYOUTS = """cases:
  - name: p32-d64
  - name: p64-d64
    set: {prefill.block_size: 64}
  - name: elsewhere
    set: {decode.devices: [2]}
"""


def _sweep(tmp_path, monkeypatch, capacity: dict[str, float], fail: tuple = (), **opts):
    from pdctl import api
    from pdctl.api import benchmarks

    matrix = tmp_path / "layouts.yaml"
    matrix.write_text(LAYOUTS)
    fake = FakeServers({})
    legs: list[str] = []

    def up(plan, engine, attached, timeout_s):
        fake.current = Path(plan.state_dir).name  # state/<deployment>
        legs.append(fake.current)
        if fake.current in fail:
            from pdctl.launch.errors import LaunchFailed

            raise LaunchFailed("decode-0", "warm-up probe of pair prefill-0 -> decode-0: read timed out", None)
        fake.capacity[fake.current] = capacity[fake.current]
        from pdctl.launch.state import LaunchState

        return LaunchState(plan)

    monkeypatch.setattr(goodput_run.run_mod, "up", up)
    monkeypatch.setattr(goodput_run.run_mod, "down", fake.down)
    monkeypatch.setattr(goodput_run.load, "run_load", fake.run_load)
    monkeypatch.setattr(goodput_run.load, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(goodput_run.load, "workload", lambda n, *a, **k: list(range(n)))
    monkeypatch.setattr(benchmarks, "_preflight", lambda p, t: None)
    o = BenchOptions(goodput=True, **{"rates": (1.0, 2.0, 3.0, 4.0), "repeat": 2, "requests": 10, **opts})
    said: list[str] = []
    g = api.sweep(CONFIGS / "cpu-demo.yaml", matrix, o, results=tmp_path / "r", say=said.append)
    return g, legs, said


def test_sweep_goodput_recommends_the_layout_with_the_highest_goodput_and_where_the_answer_changes(
        tmp_path, monkeypatch):
    g, legs, said = _sweep(tmp_path, monkeypatch, {"baseline": 1.5, "p32-d64": 3.0, "p64-d64": 2.0})
    # every deployment every repetition, the baseline first (auto SLO), the order rotating
    assert legs == ["baseline", "p32-d64", "p64-d64", "p32-d64", "p64-d64", "baseline"]
    rec = g.summary["recommendation"]
    assert rec["best"] == "p32-d64" and rec["sustained_req_s"] == {"baseline": 1.0, "p32-d64": 3.0, "p64-d64": 2.0}
    # a layout on other devices is refused before anything starts, said and reported
    assert list(g.refused) == ["elsewhere"] and "same devices" in g.refused["elsewhere"] and not g.passed
    assert any("case elsewhere: REFUSED" in s for s in said)
    # auto SLO: TTFT 500 ms, TPOT 30 ms; the fake's TPOT is 10 ms: at 0.33x (TPOT 9.9 ms) nothing meets it, so
    # nothing gains over the baseline; from 0.5x the fast layout leads
    sens = g.summary["slo_sensitivity"]
    best = {r["factor"]: r["best"] for r in sens["rows"]}
    assert best[0.33] == "baseline" and best[0.5] == best[1.0] == best[4.0] == "p32-d64"
    assert sens["changes_at"] == [0.5]
    assert "aggregated: 2 servers on [0] [1]" == g.summary["layouts"]["baseline"]
    assert g.summary["layouts"]["p64-d64"] == "prefill default 1x block 64 on [0] -> decode default 1x block 64 on [1]"
    saved = json.loads((tmp_path / "r" / "goodput" / "sweep.json").read_text())
    assert saved["recommendation"] == rec


def test_sweep_goodput_recommends_the_baseline_when_it_serves_most(tmp_path, monkeypatch):
    """The negative control: a baseline that should win is recommended."""
    g, _, _ = _sweep(tmp_path, monkeypatch, {"baseline": 4.0, "p32-d64": 3.0, "p64-d64": 2.0})
    assert g.summary["recommendation"]["best"] == "baseline"
    assert g.summary["slo_sensitivity"]["changes_at"] == []


def test_sweep_goodput_without_rates_sends_every_layout_the_rates_from_this_hosts_capacity(tmp_path, monkeypatch):
    g, _, said = _sweep(tmp_path, monkeypatch, {"baseline": 2.0, "p32-d64": 1.3, "p64-d64": 1.0}, rates=None,
                        repeat=1)
    tried = g.summary["rates"]["tried"]
    est = g.summary["rates"]["capacity"]["saturation_req_s"]
    assert set(est) == {"baseline", "p32-d64", "p64-d64"} and tried == list(goodput_rates(est.values()))
    assert any(s.startswith("[") and "rates from this host's capacity" in s for s in said)
    assert g.summary["recommendation"]["best"] == "baseline"


def goodput_rates(estimates):
    return gp.rates_from_capacity(estimates)


def test_sweep_goodput_renders_the_recommendation(tmp_path, monkeypatch, run_cli):
    from pdctl import api

    seen: list = []
    with monkeypatch.context() as m:
        m.setattr(api, "sweep", lambda t, mx, o, **k: seen.append(o) or (_ for _ in ()).throw(api.UserError("stop")))
        run_cli("sweep", CONFIGS / "cpu-demo.yaml", "--matrix", CONFIGS / "cpu-matrix.yaml", "--goodput", "--rates",
                "1")
    assert seen[0].resolved().requests == 200  # goodput's own default, not the load benchmark's 32
    from rich.console import Console

    from pdctl import render

    g, _, _ = _sweep(tmp_path, monkeypatch, {"baseline": 1.5, "p32-d64": 3.0, "p64-d64": 2.0})
    c = Console(record=True, width=100)
    render.goodput_sweep(c, g.summary, g.refused)
    text = " ".join(c.export_text().split())
    assert "p32-d64 (recommended)" in text and "the answer changes at 0.5x the SLO" in text
    assert "elsewhere REFUSED" in text and "more than the" not in text  # no cores read: nothing said of them
    # a layout's role over its bound cores is named with the layout
    assert g.summary["bound_cores"]["p64-d64"] == {"prefill": 1, "decode": 1}
    g.summary["p64-d64"]["stats_median"]["2"]["cores_decode"] = 1.2
    c = Console(record=True, width=200)
    render.goodput_sweep(c, g.summary, g.refused)
    assert "layout p64-d64: decode servers used 1.20 cores at 2 req/s, more than the 1" in c.export_text()


def test_a_layout_that_does_not_come_up_is_its_result_and_the_sweep_goes_on(tmp_path, monkeypatch):
    g, legs, said = _sweep(tmp_path, monkeypatch, {"baseline": 1.5, "p32-d64": 3.0, "p64-d64": 2.0}, fail=("p32-d64",))
    assert legs.count("p64-d64") == 2 and legs.count("p32-d64") == 2  # tried every repetition, the others ran
    assert all("read timed out" in r["failed"] for r in g.summary["p32-d64"]["runs"])
    assert g.summary["recommendation"]["best"] == "p64-d64"
    assert g.summary["recommendation"]["sustained_req_s"]["p32-d64"] == 0.0
    assert any("p32-d64 did not come up" in s for s in said)


class SideBySide:
    """Deployments up at once: every up, down and load in one timeline; a load meets the SLO up to its
    deployment's capacity (by the name it is sent under)."""

    def __init__(self, capacity: dict[str, float], idle: float):
        self.capacity, self.idle, self.timeline = capacity, idle, []

    def up(self, plan, engine, attached, timeout_s):
        from pdctl.launch.state import LaunchState, ProcessRecord

        name = "pd" if plan.by_role("decode") else "baseline"
        self.timeline.append(("up", name))
        return LaunchState(plan, processes={s.name: ProcessRecord(s.name, 1, 1, 0, 0.0) for s in plan.processes})

    def down(self, state, engine):
        self.timeline.append(("down", "pd" if state.plan.by_role("decode") else "baseline"))

    def idle_cores(self, states):
        return {f"{n}/{p}": self.idle for n, st in states.items() for p in st.processes}

    def run_load(self, target, url, model, w, max_tokens, concurrency, request_rate=None, seed=0, headers=None):
        self.timeline.append(("load", target, request_rate, id(w), seed))
        ok = request_rate is None or request_rate <= self.capacity[target]
        ttft, n = (0.1 if ok else 5.0), len(w)
        vllm = {"output_lens": [4] * n, "errors": [""] * n, "ttfts": [ttft] * n, "latencies": [ttft + 0.03] * n}
        return SimpleNamespace(vllm=vllm, ttft_ms_p50=ttft * 1e3, tpot_ms_p50=10.0, vllm_json=lambda: "{}",
                               duration_s=n / (request_rate or 1.0), to_dict=lambda: {"ttft_ms_p50": ttft * 1e3})


def _side_by_side(tmp_path, monkeypatch, idle, beside=True, engine="local", fake_servers=SideBySide,
                  rates=(1.0, 2.0, 4.0), repeat=2):
    loaded = load_topology(CONFIGS / "cpu-demo.yaml")
    t = loaded.topology
    pd = build_plan(t, base_dir=loaded.base_dir, state_dir=tmp_path / "s", python="py")
    base = baseline_plan(t, base_dir=loaded.base_dir, state_dir=tmp_path / "b", python="py")
    fake = fake_servers({"pd": 3.0, "baseline": 1.5}, idle)
    for name, fn in (("up", fake.up), ("down", fake.down)):
        monkeypatch.setattr(goodput_run.run_mod, name, fn)
    monkeypatch.setattr(goodput_run, "_idle_cores", fake.idle_cores)
    monkeypatch.setattr(goodput_run.load, "run_load", fake.run_load)
    monkeypatch.setattr(goodput_run.load, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(goodput_run.load, "workload", lambda n, *a, **k: list(range(n)))
    phases = []
    o = BenchOptions(goodput=True, rates=rates, repeat=repeat, requests=10).resolved()
    out = goodput_run.run_goodput(loaded, pd, base, SimpleNamespace(name=engine), tmp_path, o, phases.append,
                                  beside=beside)
    return out, [e[:3] for e in fake.timeline], phases


def test_up_at_once_both_sides_take_turns_rate_by_rate_once_their_idle_cpu_is_measured(tmp_path, monkeypatch):
    from rich.console import Console

    from pdctl import render

    out, timeline, phases = _side_by_side(tmp_path, monkeypatch, idle=0.02)
    rep0 = timeline[:[i for i, e in enumerate(timeline) if e[0] == "up"][2]]
    assert rep0[:3] == [("up", "baseline"), ("up", "pd"), ("load", "unloaded", None)]  # the SLO before any P/D load
    assert rep0[-2:] == [("down", "baseline"), ("down", "pd")]
    loads = [(target, rate) for _, target, rate in rep0[3:-2]]
    # rate by rate, the side that goes first alternating: a slow minute falls on both sides of a rate
    assert loads == [("baseline", 1.0), ("pd", 1.0), ("pd", 2.0), ("baseline", 2.0), ("baseline", 4.0),
                     ("pd", 4.0)]
    assert [e for e in timeline if e[0] == "up"] == [("up", "baseline"), ("up", "pd"), ("up", "pd"),
                                                    ("up", "baseline")]  # the order flips every repetition
    # the same results as each alone: the same prompts, the same arithmetic
    assert out["pd"]["sustained_req_s"] == 2.0 and out["baseline"]["sustained_req_s"] == 1.0
    assert out["beside"]["repetitions_up_at_once"] == 2 and out["beside"]["why_not"] is None
    assert all(v == 0.02 for rep in out["beside"]["idle_cores"] for v in rep.values())
    assert any("all up at once; idle, the busiest process used 0.020 cores" in p for p in phases)
    c = Console(record=True, width=200)
    render.goodput(c, out)
    assert "both up at once, taking turns rate by rate; idle, the busiest process used 0.020 cores" in \
        c.export_text()


@pytest.mark.parametrize("idle, beside, engine, why", [
    (0.08, True, "local", "an idle process used 0.080 cores (> 0.05)"),  # an idle side that spins is not idle
    (0.02, True, "ray", "the ray engine's processes are not measured here"),
    (0.02, False, "local", "not asked"),
])
def test_each_deployment_comes_up_alone_when_up_at_once_is_refused(tmp_path, monkeypatch, idle, beside, engine, why):
    from rich.console import Console

    from pdctl import render

    out, timeline, phases = _side_by_side(tmp_path, monkeypatch, idle, beside, engine)
    ups = [i for i, e in enumerate(timeline) if e[0] == "up"]
    assert len(ups) == (6 if why.startswith("an idle") else 4)  # refused once both were up: down, then alone
    up_now = set()
    for e in timeline[ups[-4]:]:  # the two repetitions' four bring-ups: one deployment up at a time
        if e[0] == "up":
            assert not up_now
            up_now.add(e[1])
        elif e[0] == "down":
            up_now.remove(e[1])
        else:
            assert e[1] in up_now | {"unloaded"}
    assert out["beside"]["why_not"] == why and out["beside"]["repetitions_up_at_once"] == 0
    assert out["pd"]["sustained_req_s"] == 2.0 and out["baseline"]["sustained_req_s"] == 1.0
    c = Console(record=True, width=200)
    render.goodput(c, out)
    said = "each brought up alone in turn: " + why
    assert (said in c.export_text()) == (why != "not asked")


def test_deployments_may_be_up_at_once_only_on_this_hosts_cpus_and_their_own_ports(tmp_path):
    loaded = load_topology(CONFIGS / "cpu-demo.yaml")
    t = loaded.topology
    pd = build_plan(t, base_dir=loaded.base_dir, state_dir=tmp_path / "s", python="py")
    base = baseline_plan(t, base_dir=loaded.base_dir, state_dir=tmp_path / "b", python="py")
    assert goodput_run.beside_refusal([base, pd], "local") is None  # the baseline sits on its own ports
    # Negative controls: the same ports twice, another engine, accelerators sharing device memory.
    assert goodput_run.beside_refusal([pd, pd], "local") == \
        "prefill-0 (cpu-demo) and prefill-0 (cpu-demo) both listen on 127.0.0.1:8100"
    assert goodput_run.beside_refusal([base, pd], "slurm") == "the slurm engine's processes are not measured here"
    gpu = load_topology(CONFIGS / "cuda-to-gaudi.yaml")
    g = gpu.topology
    plans = [baseline_plan(g, base_dir=gpu.base_dir, state_dir=tmp_path / "gb", python="py"),
             build_plan(g, base_dir=gpu.base_dir, state_dir=tmp_path / "gs", python="py")]
    assert goodput_run.beside_refusal(plans, "local") == "cuda, hpu servers would share device memory"


# -- where the cores went at each point ---------------------------------------------------------------------------


def _reading(at, busy_ticks, groups, idle, own):
    from pdctl.bench import host

    # 2 CPUs, 1000 ticks (both together) per second of wall time; busy_ticks of them not idle
    return {"at": at, "host": host.CpuTimes(steal=0, total=1000 * at, idle=1000 * at - busy_ticks, cpus=2),
            "own": own, "groups": groups, "idle": idle}


def test_a_points_cores_are_each_roles_processes_summed_over_the_wall_time_between_two_readings():
    before = _reading(10, 0, {"prefill-0": ("prefill", 5.0), "decode-0": ("decode", 7.0), "proxy": ("proxy", 1.0)},
                      {"baseline/baseline-prefill-0": 3.0, "baseline/baseline-proxy": 0.5}, own=2.0)
    after = _reading(20, 8000, {"prefill-0": ("prefill", 9.0), "decode-0": ("decode", 16.0),
                                 "proxy": ("proxy", 1.5)},
                     {"baseline/baseline-prefill-0": 3.2, "baseline/baseline-proxy": 0.6}, own=3.0)
    cpu = goodput_run._cpu_used(before, after)
    assert cpu == pytest.approx({"cpu_steal": 0.0, "cores_busy": 1.6, "cores_prefill": 0.4, "cores_decode": 0.9,
                                 "cores_proxy": 0.05, "cores_pdctl": 0.1, "cores_idle_max": 0.02})
    # two servers of one role add up (the baseline's two aggregated servers)
    before["groups"] = {"a": ("baseline", 1.0), "b": ("baseline", 2.0)}
    after["groups"] = {"a": ("baseline", 4.0), "b": ("baseline", 7.0)}
    assert goodput_run._cpu_used(before, after)["cores_baseline"] == pytest.approx(0.8)
    # Negative controls: a group /proc could not read (another engine's, or exited) is left out, not zero; with
    # nothing beside it there is no idle figure.
    after["groups"] = {"a": ("baseline", None), "b": ("baseline", 7.0)}
    after["idle"] = {}
    cpu = goodput_run._cpu_used(before, after)
    assert cpu["cores_baseline"] == pytest.approx(0.5) and "cores_idle_max" not in cpu


def test_only_this_hosts_processes_are_read_for_cpu():
    from pdctl.launch.state import LaunchState, ProcessRecord

    loaded = load_topology(CONFIGS / "cpu-demo.yaml")
    plan = build_plan(loaded.topology, base_dir=loaded.base_dir, state_dir=Path("/tmp/x"), python="py")
    st = LaunchState(plan, processes={"prefill-0": ProcessRecord("prefill-0", 11, 11, 0, 0.0),
                                      "decode-0": ProcessRecord("decode-0", 12, 12, 0, 0.0, where="slurm:node2"),
                                      "proxy": ProcessRecord("proxy", 13, 13, 0, 0.0)})
    assert goodput_run._groups(st) == {"prefill-0": ("prefill", 11), "proxy": ("proxy", 13)}


def test_each_point_says_where_the_cores_went_and_how_little_the_idle_side_used_meanwhile(tmp_path, monkeypatch):
    """Up at once: the side under load's servers by role, its proxy, pdctl's own process and the busiest idle
    process beside it, per point, in the summary, the report and the progress lines."""
    from rich.console import Console

    from pdctl import render
    from pdctl.bench import host

    clock = iter(range(0, 10**6, 10))  # every reading 10 s after the one before
    seconds: dict[int, float] = {}  # CPU seconds so far per process group, advanced by each load below

    def group_cpu(pgid):
        return seconds.setdefault(pgid, 0.0)

    fake_time = SimpleNamespace(monotonic=lambda: next(clock), time=lambda: 0.0, sleep=lambda s: None)
    monkeypatch.setattr(goodput_run, "time", fake_time)
    monkeypatch.setattr(goodput_run.host, "groups_cpu_seconds", lambda pgids: {g: group_cpu(g) for g in pgids})
    ticks = iter(range(0, 10**9, 2000))  # 10 s on 2 CPUs between readings, 40 % of it idle: 1.2 cores busy
    monkeypatch.setattr(goodput_run.host, "cpu_times", lambda: host.CpuTimes(0, k := next(ticks), k * 2 // 5, 2))
    monkeypatch.setattr(goodput_run.host, "cpu_count", lambda: 2)
    pgids = {}

    class Counted(SideBySide):
        def up(self, plan, engine, attached, timeout_s):
            st = super().up(plan, engine, attached, timeout_s)
            for name, rec in st.processes.items():
                rec.pgid = pgids.setdefault((self.timeline[-1][1], name), 1000 + len(pgids))
            return st

        def run_load(self, target, url, model, w, max_tokens, concurrency, request_rate=None, seed=0, headers=None):
            # between two readings (10 s): the side under load's servers use 0.5 cores each and its proxy 0.05,
            # every process of the idle side 0.001
            for (side, name), g in pgids.items():
                busy = side == target and request_rate is not None
                per = (0.05 if "proxy" in name else 0.5) if busy else 0.001
                seconds[g] = seconds.get(g, 0.0) + 10 * per
            return super().run_load(target, url, model, w, max_tokens, concurrency, request_rate, seed, headers)

    out, _, phases = _side_by_side(tmp_path, monkeypatch, 0.02, fake_servers=Counted, rates=(1.0, 2.0), repeat=1)
    pd_at_1, base_at_1 = out["pd"]["runs"][0]["stats"]["1"], out["baseline"]["runs"][0]["stats"]["1"]
    assert pd_at_1["cores_prefill"] == pytest.approx(0.5) and pd_at_1["cores_decode"] == pytest.approx(0.5)
    assert pd_at_1["cores_proxy"] == pytest.approx(0.05) and "cores_baseline" not in pd_at_1
    assert base_at_1["cores_baseline"] == pytest.approx(1.0)  # its two aggregated servers
    assert pd_at_1["cores_idle_max"] == pytest.approx(0.001) == base_at_1["cores_idle_max"]
    assert out["host_cpus"] == 2 and out["pd"]["stats_median"]["2"]["cores_decode"] == pytest.approx(0.5)
    c = Console(record=True, width=120)
    render.goodput(c, out)
    text = " ".join(c.export_text().split())
    assert "CPU per offered rate (cores of 2" in text and "1.20" in text
    assert any(p.startswith("  pd at 1 req/s") and "1.20 of 2 cores busy" in p for p in phases)
    assert "prefill 0.50 + decode 0.50" in text and "baseline 1.00" in text
    assert "while the other ran its load, at most 0.001" in text
    # 0.5 cores per role within 1 bound core each: nothing said; a role over its bound cores is named at the lowest
    # rate where it was.
    assert out["bound_cores"] == {"baseline": {"baseline": 2}, "pd": {"prefill": 1, "decode": 1}}
    assert "more than the" not in text
    for rate, used in (("1", 0.9), ("2", 1.3)):
        out["pd"]["stats_median"][rate]["cores_decode"] = used
    c = Console(record=True, width=200)
    render.goodput(c, out)
    assert "P/D's decode servers used 1.30 cores at 2 req/s, more than the 1 their workers are bound to: at least " \
        "0.30 of it" in " ".join(c.export_text().split())
    # Negative control: a point whose idle side got busy says so, not the measurement before the load.
    out["pd"]["runs"][0]["stats"]["2"]["cores_idle_max"] = 0.3
    c = Console(record=True, width=200)
    render.goodput(c, out)
    assert "while the other ran its load, at most 0.300" in " ".join(c.export_text().split())
