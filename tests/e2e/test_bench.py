"""`pdctl bench` end to end on P32 -> D128: parity, accuracy (with per-sample agreement) and the load ratios."""

import json

from tests.conftest import CONFIGS, SHARED
from tests.e2e.conftest import pdctl


def test_bench_p32_d128_end_to_end(tmp_path):
    r = pdctl("bench", CONFIGS / "cpu-demo.yaml", "--decode-block-size", "128", "--data-dir",
              SHARED / "data" / "gsm8k", "--limit", "10", "--requests", "12", "--results", tmp_path / "res",
              "--state-dir", tmp_path / "state", "--json", timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(r.stdout)
    assert (s["prefill_block"], s["decode_block"], s["status"]) == (32, 128, "PASS")
    assert s["parity"]["status"] == "PASS" and s["parity"]["kv_travelled"] and s["parity"]["pass_rate"] == 1.0
    assert s["accuracy"]["status"] == "PASS" and s["accuracy"]["baseline"]["agreement"] == 1.0
    perf = s["perf"]
    assert perf["pd"]["requests"] == perf["aggregated"]["requests"] == 12
    assert perf["pd"]["errors"] == perf["aggregated"]["errors"] == 0
    assert perf["pd"]["kv_bytes"] > 0 and perf["ratio"]["ttft_ms_p50"] > 0 and perf["ratio"]["tpot_ms_p50"] > 0
    res = tmp_path / "res"
    for f in ("summary.json", "topology.json", "parity.json", "eval/summary.json"):
        assert (res / f).is_file(), f
