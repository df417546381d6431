"""Sweep orchestration: resumes after an interruption and writes JSON, Markdown and PNG reports."""

import json

import pytest

from pdctl.bench.sweep import Matrix, run_sweep


def _summary(case):
    return {"prefill_block": case.value("prefill.block_size"), "decode_block": case.value("decode.block_size"),
            "prefill_tp": 1, "decode_tp": 1, "status": "PASS", "parity": {"status": "PASS"},
            "accuracy": {"verdicts": [{"metric": "exact_match,strict-match", "measured": 0.0}],
                         "reference": {"agreement": 1.0}},
            "perf": {"pd": {"ttft_ms_p50": 50.0, "tpot_ms_p50": 9.0}, "ratio": {"ttft_ms_p50": 1.2,
                                                                                  "tpot_ms_p50": 1.0}}}


def test_sweep_resumes_and_reports(tmp_path):
    m = Matrix.model_validate({"cases": [{"name": "a", "set": {"decode.block_size": 64}},
                                         {"name": "b", "set": ["prefill.block_size=64", "decode.block_size=32"]}]})
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


def test_a_case_with_a_removed_key_says_which_set_replaces_it_and_where(tmp_path):
    from pdctl.bench.sweep import load_matrix

    path = tmp_path / "m.yaml"
    path.write_text("cases:\n  - {name: a, set: {decode.block_size: 64}}\n  - name: b\n    prefill_block_size: 64\n"
                    "    decode_tp: 2\n")
    with pytest.raises(ValueError) as e:
        load_matrix(path)
    assert str(e.value) == ("line 4: case 'b': prefill_block_size, decode_tp: removed: use set: "
                            "{prefill.block_size: 64, decode.tp: 2}")
    path.write_text("cases:\n  - {name: a, set: {decode.block_size: 64}}\n  - {name: b, set: [prefill.tp=2]}\n")
    a, b = load_matrix(path).cases
    assert [o.flag for o in a.overrides() + b.overrides()] == ["--set decode.block_size=64", "--set prefill.tp=2"]
    assert (a.value("decode.block_size"), b.value("prefill.tp"), b.value("decode.tp")) == (64, 2, None)
