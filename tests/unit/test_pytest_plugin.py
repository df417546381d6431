"""pdctl's pytest plugin: what its fixture is given, and that its two gates fail (AssertionError naming why) when
the reports say so. The gates themselves are pdctl.check / pdctl.evaluate, replaced here by stand-ins; they are
run for real in tests/e2e/test_api.py (the README's example)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

import pdctl
from pdctl import pytest_plugin
from pdctl.gates.parity import ParityReport, PromptResult, TransferProof


def _config(topology=None, sets=()):
    opts = {"--pdctl-topology": topology, "--pdctl-set": list(sets)}
    return SimpleNamespace(getoption=lambda name: opts[name])


def test_the_fixture_takes_a_path_a_pair_a_mapping_or_the_command_line():
    assert pytest_plugin._target("configs/cpu-demo.yaml", _config()) == {"topology": "configs/cpu-demo.yaml"}
    assert pytest_plugin._target(("t.yaml", {"decode.block_size": 128}), _config()) == {
        "topology": "t.yaml", "overrides": {"decode.block_size": 128}}
    assert pytest_plugin._target({"topology": "t.yaml", "reference_port": 9300}, _config())["reference_port"] == 9300
    assert pytest_plugin._target(None, _config("t.yaml", ["decode.block_size=64"])) == {
        "topology": "t.yaml", "overrides": ["decode.block_size=64"]}
    with pytest.raises(pytest.UsageError, match="needs a topology"):
        pytest_plugin._target(None, _config())
    with pytest.raises(pytest.UsageError, match="give a topology path"):
        pytest_plugin._target(42, _config())


def _report(passed: bool, proof_ok: bool = True) -> ParityReport:
    r = PromptResult("random-65", 65, passed, None if passed else 1, [1, 2, 3], [1, 2, 3] if passed else [1, 9, 3])
    proof = TransferProof(external_kv_tokens=64 if proof_ok else 0, local_compute_tokens=1 if proof_ok else 65,
                          bytes_transferred=1e6 if proof_ok else 0, prompt_tokens=65, requests=1)
    return ParityReport([r], proof)


def test_assert_parity_passes_a_passing_report_and_fails_a_failing_one(monkeypatch):
    monkeypatch.setattr(pdctl, "check", lambda d, options: _report(True))
    assert pytest_plugin.assert_parity(object()).passed
    monkeypatch.setattr(pdctl, "check", lambda d, options: _report(False))
    with pytest.raises(AssertionError, match="random-65: first divergent token 1"):
        pytest_plugin.assert_parity(object())
    monkeypatch.setattr(pdctl, "check", lambda d, options: _report(True, proof_ok=False))
    with pytest.raises(AssertionError, match="KV did not travel: 0 prompt tokens arrived by transfer"):
        pytest_plugin.assert_parity(object())


def test_assert_parity_passes_check_options_through(monkeypatch):
    seen = {}
    monkeypatch.setattr(pdctl, "check", lambda d, options: seen.update(o=options) or _report(True))
    pytest_plugin.assert_parity(object(), max_tokens=4, seed=7)
    assert (seen["o"].max_tokens, seen["o"].seed) == (4, 7)


@pytest.mark.parametrize("status,allow,fails", [("PASS", False, False), ("FAIL", False, True),
                                                ("UNGATED", False, True), ("UNGATED", True, False)])
def test_assert_accuracy_fails_on_fail_and_on_an_ungated_model(monkeypatch, status, allow, fails):
    summary = {"gates": ["relative gate: agreement 9/10 -> FAIL"] if status == "FAIL" else [],
               "verdicts": [{"metric": "exact_match,strict-match", "status": status, "message": "m"}]}
    seen = {}

    def evaluate(d, options):
        seen["o"] = options
        return pdctl.EvalResult(status, "tiny", summary, Path("results/x"))

    monkeypatch.setattr(pdctl, "evaluate", evaluate)
    if fails:
        with pytest.raises(AssertionError, match=f"accuracy gate {status} for tiny"):
            pytest_plugin.assert_accuracy(object(), limit=10, data_dir="../shared/data/gsm8k", allow_ungated=allow)
    else:
        assert pytest_plugin.assert_accuracy(object(), limit=10, allow_ungated=allow).status == status
    assert seen["o"].limit == 10
