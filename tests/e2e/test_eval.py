"""`pdctl eval`: lm-eval's gsm8k over ../shared/data/gsm8k through the real P/D proxy, with a baseline.

The passing gate (limit 10, agreement 100 %) runs as the README's pytest-plugin example: tests/e2e/test_api.py."""

import json

from tests.conftest import CONFIGS, SHARED
from tests.e2e.conftest import pdctl


def test_eval_negative_control_stock_connector_p32_d64_fails_on_agreement(tmp_path):
    """vLLM's stock connector merges CPU KV blocks wrongly at P32 -> D64 (silently): the accuracy gate must see
    it. The tiny model scores 0 either way, so only the relative gate (agreement with the reference) can."""
    r = pdctl("eval", CONFIGS / "cpu-demo.yaml", "--set", "connector.kind=nixl", "--data-dir",
              SHARED / "data" / "gsm8k", "--limit", "2", "--baseline", "auto", "--results", tmp_path / "res",
              "--state-dir", tmp_path / "state", "--json", timeout=1500)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout)
    b = summary["baseline"]
    assert summary["status"] == "FAIL" and b["status"] == "FAIL" and b["agreement"] < 1.0, b
    assert summary["gate"] == "relative"
