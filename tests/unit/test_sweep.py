"""Sweep orchestration: resumes after an interruption and writes JSON, Markdown and PNG reports."""

import json

import pytest

from pdctl.bench.sweep import Matrix, run_sweep


def _summary(case):
    return {"prefill_block": case.prefill_block_size, "decode_block": case.decode_block_size, "prefill_tp": 1,
            "decode_tp": 1, "status": "PASS", "parity": {"status": "PASS"},
            "accuracy": {"verdicts": [{"metric": "exact_match,strict-match", "measured": 0.0}],
                         "baseline": {"agreement": 1.0}},
            "perf": {"pd": {"ttft_ms_p50": 50.0, "tpot_ms_p50": 9.0}, "ratio": {"ttft_ms_p50": 1.2,
                                                                                  "tpot_ms_p50": 1.0}}}


def test_sweep_resumes_and_reports(tmp_path):
    m = Matrix.model_validate({"cases": [{"name": "a", "decode_block_size": 64},
                                         {"name": "b", "prefill_block_size": 64, "decode_block_size": 32}]})
    calls = []

    def interrupted(case, case_dir):
        calls.append(case.name)
        if case.name == "b":
            raise KeyboardInterrupt
        return _summary(case)

    with pytest.raises(KeyboardInterrupt):
        run_sweep(m, tmp_path, interrupted)
    assert calls == ["a"] * 1 + ["b"] and (tmp_path / "a" / "summary.json").is_file()

    calls.clear()
    rows = run_sweep(m, tmp_path, lambda case, d: (calls.append(case.name), _summary(case))[1])
    assert calls == ["b"]  # a was kept from the first run
    assert [r["case"] for r in rows] == ["a", "b"]
    assert json.loads((tmp_path / "sweep.json").read_text())[1]["decode_block"] == 32
    md = (tmp_path / "sweep.md").read_text()
    assert "| case |" in md and "| b | 64 | 32 |" in md
    for png in ("accuracy.png", "latency.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_matrix_rejects_unknown_keys():
    with pytest.raises(ValueError, match="extra"):
        Matrix.model_validate({"cases": [{"name": "a", "decode_blok_size": 64}]})
