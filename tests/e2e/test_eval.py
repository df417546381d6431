"""`pdctl eval`: lm-eval's gsm8k over ../shared/data/gsm8k through the real P/D proxy, with a baseline."""

import json

from tests.conftest import CONFIGS, SHARED
from tests.e2e.conftest import pdctl


def test_eval_limit_20_through_pd_with_baseline(tmp_path):
    r = pdctl("eval", CONFIGS / "cpu-demo.yaml", "--data-dir", SHARED / "data" / "gsm8k", "--limit", "20",
              "--baseline", "auto", "--results", tmp_path / "res", "--state-dir", tmp_path / "state", "--json",
              timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout)
    assert summary["task"] == "gsm8k_local" and summary["limit"] == 20
    assert {v["metric"] for v in summary["verdicts"]} == {"exact_match,strict-match", "exact_match,flexible-extract"}
    assert summary["status"] == "PASS"
    b = summary["baseline"]
    assert b["samples"] == 20 and b["agreement"] == 1.0 and b["status"] == "PASS"
    res = tmp_path / "res"
    assert (res / "summary.json").is_file() and (res / "topology.json").is_file()
    assert list((res / "pd").rglob("samples_gsm8k_local_*.jsonl")) and list((res / "baseline").rglob("results_*.json"))
