"""`pdctl bench` end to end on P32 -> D128: parity, accuracy (with per-sample agreement), the load ratios, and the
load's requests followed stage by stage (--breakdown)."""

import json

from pdctl.bench import goodput, goodput_run
from tests.conftest import CONFIGS, SHARED
from tests.e2e.conftest import pdctl


def test_bench_p32_d128_end_to_end(tmp_path):
    r = pdctl("bench", CONFIGS / "cpu-demo.yaml", "--decode-block-size", "128", "--data-dir",
              SHARED / "data" / "gsm8k", "--limit", "10", "--requests", "12", "--results", tmp_path / "res",
              "--state-dir", tmp_path / "state", "--breakdown", "--json", timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert (s["prefill_block"], s["decode_block"], s["status"]) == (32, 128, "PASS")
    assert s["parity"]["status"] == "PASS" and s["parity"]["kv_travelled"] and s["parity"]["pass_rate"] == 1.0
    assert s["accuracy"]["status"] == "PASS" and s["accuracy"]["reference"]["agreement"] == 1.0
    perf = s["perf"]
    assert perf["pd"]["requests"] == perf["aggregated"]["requests"] == 12
    assert perf["pd"]["errors"] == perf["aggregated"]["errors"] == 0
    assert perf["pd"]["kv_bytes"] > 0 and perf["ratio"]["ttft_ms_p50"] > 0 and perf["ratio"]["tpot_ms_p50"] > 0
    # --breakdown: every P/D load request followed from the proxy through the decode's connector to its first token.
    bd = perf["breakdown"]
    assert bd["requests"] == bd["followed"] == 12 and not bd["unread_logs"], bd
    stages = {x["name"]: x for x in bd["stages"]}
    assert list(stages)[0] == "proxy in" and list(stages)[-1] == "TTFT (proxy)"
    assert all(x["p50_ms"] >= 0 for x in bd["stages"]) and stages["KV read"]["p50_ms"] > 0
    assert abs(sum(x["mean_ms"] for x in bd["stages"][:-1]) - stages["TTFT (proxy)"]["mean_ms"]) < 1e-6 * 1e3
    assert stages["TTFT (proxy)"]["p50_ms"] <= perf["pd"]["ttft_ms_p99"]  # the client's TTFT includes the proxy's
    res = tmp_path / "res"
    for f in ("summary.json", "topology.json", "parity.json", "eval/summary.json"):
        assert (res / f).is_file(), f


def test_goodput_pd_against_aggregated_servers_on_the_same_devices(tmp_path):
    """`pdctl bench --goodput` on real servers: the baseline (two aggregated servers on the P/D pair's two cores
    behind pdctl's proxy, on ports + 1000) and the P/D topology up at once once their idle CPU is measured, --slo
    auto measured on one unloaded baseline instance first, then both at the same offered rate with the same
    prompts. One rate, one repetition, few requests: the path, not a finding (docs/benchmarks.md has the measured
    one)."""
    r = pdctl("bench", CONFIGS / "cpu-demo.yaml", "--skip", "check,eval", "--goodput", "--rates", "3",
              "--requests", "24", "--repeat", "1", "--prompt-len", "512", "--max-tokens", "16",
              "--results", tmp_path / "res", "--state-dir", tmp_path / "state", "--json", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "too few to decide on" in r.stderr  # 24 < 200 requests per rate: said
    g = json.loads(r.stdout)["goodput"]
    assert g["slo"]["origin"].startswith("auto") and g["unloaded"]["requests"] == 20
    assert g["slo"]["ttft_ms"] == round(5 * g["unloaded"]["ttft_ms_p50"], 1)
    assert [x["ttft_ms_p50"] for x in g["host_speed"]["unloaded"]] == [g["unloaded"]["ttft_ms_p50"]]
    # Up at once only as the idle CPU of every server and proxy of both allows (0.002-0.026 cores measured on the
    # AMX host): the decision follows the measurement, and is said.
    (idle,) = g["beside"]["idle_cores"]
    assert len(idle) == 6 and all(v >= 0 for v in idle.values()), idle
    if max(idle.values()) <= goodput_run.IDLE_CORES_MAX:
        assert g["beside"]["repetitions_up_at_once"] == 1 and "all up at once; idle" in r.stderr, g["beside"]
    else:
        assert g["beside"]["why_not"].startswith("an idle process used") and "up at once refused" in r.stderr
    # Where the cores went, read from /proc for the real processes: each side's servers by role and its proxy did
    # the work; with both up, the other side's busiest process used less than the loaded side's servers.
    cores = {side: g[side]["runs"][0]["stats"]["3"] for side in ("pd", "baseline")}
    assert 0 < cores["pd"]["cores_busy"] <= g["host_cpus"], cores
    assert cores["pd"]["cores_prefill"] > 0 and cores["pd"]["cores_decode"] > 0 and cores["pd"]["cores_proxy"] > 0
    assert cores["baseline"]["cores_baseline"] > 0 and "cores_decode" not in cores["baseline"], cores
    if g["beside"]["repetitions_up_at_once"]:
        assert cores["pd"]["cores_idle_max"] < cores["pd"]["cores_prefill"] + cores["pd"]["cores_decode"]
    assert f" of {g['host_cpus']} cores busy" in r.stderr  # each point's progress line says it
    out = tmp_path / "res" / "goodput"
    for side in ("pd", "baseline"):
        assert set(g[side]["attainment_median"]) == {"3"}
        doc = json.loads((out / f"{side}-0-3.vllm.json").read_text())
        assert doc["completed"] == 24 and doc["failed"] == 0, side
        # Negative control on the same real requests: an SLO nothing meets is met by none of them.
        times = goodput.request_times(doc)
        assert goodput.attainment(times, goodput.Slo(0.01, 0.01, "impossible")) == 0.0
        assert goodput.attainment(times, goodput.parse_slo(f"ttft={g['slo']['ttft_ms']},tpot={g['slo']['tpot_ms']}")) \
            == g[side]["attainment_median"]["3"]
    # The baseline really served aggregated: its servers' logs show no KV transfer configuration.
    logs = (tmp_path / "state" / "baseline" / "logs")
    assert sorted(p.name for p in logs.glob("baseline-*.log")) == ["baseline-decode-0.log", "baseline-prefill-0.log",
                                                                    "baseline-proxy.log"]
    assert all("kv_transfer_config" not in p.read_text() or "kv_transfer_config': None" in p.read_text()
               for p in logs.glob("baseline-*-0.log"))
