"""The accuracy gate's threshold logic, and the local gsm8k task against lm-eval's own gsm8k task."""

import os
import re
from pathlib import Path

import pytest
import yaml

from pdctl.gates import accuracy, gsm8k
from tests.conftest import SHARED

GSM8K = SHARED / "data" / "gsm8k"
EXPECTED = {"Qwen/Qwen3-0.6B": {"gsm8k": {"exact_match,strict-match": {"expected": 0.41, "rtol": 0.05}}}}


@pytest.mark.parametrize("value,status", [(0.41, "PASS"), (0.455, "PASS"), (0.365, "PASS"), (0.47, "FAIL"),
                                          (0.30, "FAIL")])
def test_threshold_pass_and_fail(value, status):
    v = accuracy.judge("Qwen/Qwen3-0.6B", "gsm8k", {"exact_match,strict-match": value}, {}, EXPECTED)
    assert [x.status for x in v] == [status]
    assert accuracy.gate_status(v) == status
    word = "within" if status == "PASS" else "outside"
    assert v[0].message == f"exact_match,strict-match {value:.4f} {word} 0.41 ± 0.05"


def test_unknown_model_is_ungated_never_pass():
    v = accuracy.judge("someone/else", "gsm8k", {"exact_match,strict-match": 0.9}, {}, EXPECTED)
    assert {x.status for x in v} == {"UNGATED"} and accuracy.gate_status(v) == "UNGATED"


def test_missing_metric_fails():
    """lm-eval's output lacks the metric expected.yaml names: FAIL, saying so (the twin below has it)."""
    v = accuracy.judge("Qwen/Qwen3-0.6B", "gsm8k", {"exact_match,flexible-extract": 0.41}, {}, EXPECTED)
    assert v[0].measured is None and accuracy.gate_status(v) == "FAIL"
    assert v[0].message == ("exact_match,strict-match: missing from lm-eval's output (it has: "
                            "exact_match,flexible-extract)")
    twin = accuracy.judge("Qwen/Qwen3-0.6B", "gsm8k", {"exact_match,strict-match": 0.41}, {}, EXPECTED)
    assert accuracy.gate_status(twin) == "PASS"


def test_shipped_expectations_include_vllms_gate():
    table = accuracy.load_expected(accuracy.DEFAULT_TABLE)
    qwen = accuracy.gate_spec(table, "Qwen/Qwen3-0.6B", "gsm8k")
    assert qwen.absolute == {"exact_match,strict-match": {"expected": 0.41, "rtol": 0.05}}
    assert qwen.kind == "absolute" and not accuracy.needs_reference(table, "Qwen/Qwen3-0.6B")


def test_the_tiny_random_model_has_only_a_relative_gate():
    """Its accuracy is 0 by construction: an absolute 0.0 ± 0.05 could not fail. It is judged against the
    aggregated reference instead: every sample alike, no accuracy delta."""
    table = accuracy.load_expected(accuracy.DEFAULT_TABLE)
    tiny = accuracy.gate_spec(table, "tiny", "gsm8k")
    assert tiny.absolute == {} and tiny.kind == "relative"
    assert tiny.relative == {"min_agreement": 1.0, "max_delta": 0.0,
                             "metrics": ["exact_match,strict-match", "exact_match,flexible-extract"]}
    assert accuracy.needs_reference(table, "tiny")
    assert accuracy.judge("tiny", "gsm8k", {"exact_match,strict-match": 0.0}, {}, table) == []


def test_the_old_layout_is_still_an_absolute_gate():
    spec = accuracy.gate_spec(EXPECTED, "Qwen/Qwen3-0.6B")
    assert spec.absolute == {"exact_match,strict-match": {"expected": 0.41, "rtol": 0.05}} and spec.relative is None


@pytest.mark.parametrize("table,message", [
    ({"m": {"gsm8k": {"relative": {"min_agreement": 2}}}}, "m.gsm8k.relative.min_agreement: a number from 0 to 1"),
    ({"m": {"gsm8k": {"relative": {"agreement": 1}}}}, "m.gsm8k.relative: keys are max_delta, metrics, min_agreement"),
    ({"m": {"gsm8k": {"absolute": {"acc,none": 0.4}}}}, "m.gsm8k: acc,none: expected {expected: NUMBER"),
    ({"m": {"gsm8k": {"relativ": {"max_delta": 0}}}}, "m.gsm8k: relativ: expected {expected: NUMBER"),
    ({"m": {"gsm8k": {}}}, "m.gsm8k: expected 'absolute:"),
])
def test_a_malformed_expected_table_is_refused_naming_the_entry(table, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        accuracy.validate_expected(table, "expected.yaml")


STRICT, FLEX = "exact_match,strict-match", "exact_match,flexible-extract"


def _relative(pd: dict, ref: dict, agreed: int = 20, samples: int = 20, metrics=(STRICT, FLEX)):
    return accuracy.judge_relative(pd, {}, ref, agreed, samples, 1.0, 0.0, list(metrics))


def test_relative_gate_passes_when_every_sample_agrees_and_no_metric_moves():
    status, message, verdicts = _relative({STRICT: 0.0, FLEX: 0.05}, {STRICT: 0.0, FLEX: 0.05})
    assert status == "PASS" and [v.status for v in verdicts] == ["PASS", "PASS"]
    assert message == ("relative gate: agreement 20/20 with the aggregated reference (min 100%), delta "
                       f"{STRICT} +0.0000, {FLEX} +0.0000 (max ± 0.0) -> PASS")
    assert {v.gate for v in verdicts} == {"relative"} and verdicts[1].expected == 0.05


def test_relative_gate_fails_on_one_disagreeing_sample():
    status, message, verdicts = _relative({STRICT: 0.0, FLEX: 0.05}, {STRICT: 0.0, FLEX: 0.05}, agreed=19)
    assert status == "FAIL" and all(v.passed for v in verdicts)  # the accuracy did not move: agreement did
    assert message.endswith("-> FAIL: agreement 19/20 below 100%")


def test_relative_gate_fails_on_an_accuracy_delta():
    status, message, verdicts = _relative({STRICT: 0.05, FLEX: 0.05}, {STRICT: 0.0, FLEX: 0.05})
    assert status == "FAIL" and [v.status for v in verdicts] == ["FAIL", "PASS"]
    assert verdicts[0].message == f"{STRICT} delta +0.0500 outside ± 0.0"
    assert message.endswith(f"-> FAIL: {STRICT} delta +0.0500 outside ± 0.0")


def test_relative_gate_fails_on_a_metric_missing_from_either_run():
    status, message, verdicts = _relative({STRICT: 0.0}, {STRICT: 0.0, FLEX: 0.0})
    assert status == "FAIL" and verdicts[1].message == f"{FLEX}: missing from the P/D run's lm-eval output"
    status, _, verdicts = _relative({STRICT: 0.0, FLEX: 0.0}, {STRICT: 0.0})
    assert status == "FAIL" and verdicts[1].message == f"{FLEX}: missing from the reference run's lm-eval output"


def test_relative_gate_fails_when_no_sample_was_compared():
    status, message, _ = _relative({STRICT: 0.0, FLEX: 0.0}, {STRICT: 0.0, FLEX: 0.0}, agreed=0, samples=0)
    assert status == "FAIL" and "no sample was compared" in message


def _fake_lm_eval(monkeypatch, pd: dict, ref: dict, pd_texts=None, fallbacks=(None, None), dirs=None):
    """run_gate with lm-eval replaced: P/D and reference runs answer the given metrics and sample texts (`dirs`
    collects the output directory each run was given)."""
    calls = []

    def run(base_url, model, out_dir, **kw):
        calls.append(base_url)
        if dirs is not None:
            dirs.append(out_dir)
        values, texts = (pd, pd_texts) if "proxy" in base_url else (ref, None)
        texts = texts or ["x"] * 4
        results = {"results": {"gsm8k": {**values, **{k.replace(",", "_stderr,"): 0.01 for k in values}}},
                   "pdctl_task": "gsm8k"}
        samples = [{"doc_id": i, "filter": "strict-match", "resps": [[t]]} for i, t in enumerate(texts)]
        return accuracy.EvalRun(results, samples, out_dir)

    counts = iter(fallbacks)
    monkeypatch.setattr(accuracy, "run_lm_eval", run)
    monkeypatch.setattr("pdctl.gates.parity.proxy_fallbacks", lambda url, headers=None: next(counts))
    return calls


def test_run_gate_says_a_relative_gate_was_applied(monkeypatch, tmp_path):
    table = accuracy.load_expected(accuracy.DEFAULT_TABLE)
    dirs: list = []
    _fake_lm_eval(monkeypatch, {STRICT: 0.0, FLEX: 0.0}, {STRICT: 0.0, FLEX: 0.0}, dirs=dirs)
    s = accuracy.run_gate("http://proxy", "http://ref", "tiny", tmp_path, table, tokenizer=None, limit=4,
                          num_fewshot=5, concurrency=1, data_dir=None)
    assert dirs == [tmp_path / "pd", tmp_path / "reference"]  # lm-eval's output of each side
    assert s["status"] == "PASS" and s["gate"] == "relative"
    assert s["gates"] == [f"relative gate: agreement 4/4 with the aggregated reference (min 100%), delta {STRICT} "
                          f"+0.0000, {FLEX} +0.0000 (max ± 0.0) -> PASS"]
    assert {v["metric"] for v in s["verdicts"]} == {STRICT, FLEX}  # one row per metric, judged against the reference
    assert s["reference"]["thresholds_from"] == "expected.yaml" and s["reference"]["agreed"] == 4


def test_run_gate_fails_the_relative_gate_on_one_diverged_sample(monkeypatch, tmp_path):
    table = accuracy.load_expected(accuracy.DEFAULT_TABLE)
    _fake_lm_eval(monkeypatch, {STRICT: 0.0, FLEX: 0.0}, {STRICT: 0.0, FLEX: 0.0}, pd_texts=["x", "x", "y", "x"])
    s = accuracy.run_gate("http://proxy", "http://ref", "tiny", tmp_path, table, tokenizer=None, limit=4,
                          num_fewshot=5, concurrency=1, data_dir=None)
    assert s["status"] == "FAIL" and s["reference"]["status"] == "FAIL"
    assert s["gates"][0].endswith("-> FAIL: agreement 3/4 below 100%")
    assert s["reference"]["diverged"] == [{"doc_id": 2, "first_diff_char": 0, "length": 1}]


def test_run_gate_refuses_a_relative_gate_without_a_reference(monkeypatch, tmp_path):
    table = accuracy.load_expected(accuracy.DEFAULT_TABLE)
    calls = _fake_lm_eval(monkeypatch, {STRICT: 0.0}, {})
    with pytest.raises(ValueError, match="model 'tiny' has a relative gsm8k gate in expected.yaml: it needs a "
                                         "reference"):
        accuracy.run_gate("http://proxy", None, "tiny", tmp_path, table, tokenizer=None, limit=4, num_fewshot=5,
                          concurrency=1, data_dir=None)
    assert calls == []  # refused before lm-eval ran


def test_run_gate_says_an_absolute_gate_was_applied(monkeypatch, tmp_path):
    table = accuracy.load_expected(accuracy.DEFAULT_TABLE)
    _fake_lm_eval(monkeypatch, {STRICT: 0.43, FLEX: 0.45}, {})
    s = accuracy.run_gate("http://proxy", None, "Qwen/Qwen3-0.6B", tmp_path, table, tokenizer=None, limit=4,
                          num_fewshot=5, concurrency=1, data_dir=None)
    assert s["status"] == "PASS" and s["gate"] == "absolute" and "reference" not in s
    assert s["gates"] == [f"absolute: {STRICT} 0.4300 vs 0.41 ± 0.05 -> PASS"]


def test_run_gate_fails_the_absolute_gate_on_a_metric_lm_eval_did_not_report(monkeypatch, tmp_path):
    table = accuracy.load_expected(accuracy.DEFAULT_TABLE)
    _fake_lm_eval(monkeypatch, {FLEX: 0.45}, {})
    s = accuracy.run_gate("http://proxy", None, "Qwen/Qwen3-0.6B", tmp_path, table, tokenizer=None, limit=4,
                          num_fewshot=5, concurrency=1, data_dir=None)
    assert s["status"] == "FAIL" and s["gates"] == [f"absolute: {STRICT} missing vs 0.41 ± 0.05 -> FAIL"]
    assert s["verdicts"][0]["message"] == f"{STRICT}: missing from lm-eval's output (it has: {FLEX})"


def test_run_gate_fails_when_the_proxy_fell_back_to_a_decode_alone(monkeypatch, tmp_path):
    table = accuracy.load_expected(accuracy.DEFAULT_TABLE)
    _fake_lm_eval(monkeypatch, {STRICT: 0.43}, {}, fallbacks=(5.0, 7.0))
    s = accuracy.run_gate("http://proxy", None, "Qwen/Qwen3-0.6B", tmp_path, table, tokenizer=None, limit=4,
                          num_fewshot=5, concurrency=1, data_dir=None)
    assert s["status"] == "FAIL" and s["fallbacks"] == 2
    assert s["gates"][-1].startswith("P/D: 2 requests were served by a decode alone (proxy fallback")
    _fake_lm_eval(monkeypatch, {STRICT: 0.43}, {}, fallbacks=(5.0, 5.0))
    twin = accuracy.run_gate("http://proxy", None, "Qwen/Qwen3-0.6B", tmp_path, table, tokenizer=None, limit=4,
                             num_fewshot=5, concurrency=1, data_dir=None)
    assert twin["status"] == "PASS" and "fallbacks" not in twin


def test_a_reference_for_a_model_expected_yaml_does_not_know_is_judged_but_never_a_pass(monkeypatch, tmp_path):
    _fake_lm_eval(monkeypatch, {STRICT: 0.2}, {STRICT: 0.2})
    s = accuracy.run_gate("http://proxy", "http://ref", "someone/else", tmp_path, {}, tokenizer=None, limit=4,
                          num_fewshot=5, concurrency=1, data_dir=None, min_agreement=0.5)
    assert s["status"] == "UNGATED" and s["reference"]["status"] == "PASS" and s["gate"] == "relative"
    assert s["reference"]["thresholds_from"] == "command line" and s["reference"]["min_agreement"] == 0.5


def test_agreement_per_document_over_filters():
    def s(doc, flt, text):
        return {"doc_id": doc, "filter": flt, "resps": [[text]]}

    a = [s(0, "strict", "x"), s(0, "flex", "x"), s(1, "strict", "y y"), s(1, "flex", "y y")]
    b = [s(0, "strict", "x"), s(0, "flex", "x"), s(1, "strict", "y y"), s(1, "flex", "y z")]
    rate, n, diverged = accuracy.agreement(a, b)
    assert (rate, n) == (0.5, 2)
    # Where the texts part tells KV damage (at once) from a late rounding flip.
    assert diverged == [{"doc_id": 1, "first_diff_char": 2, "length": 3}]
    assert accuracy.agreement(a, a) == (1.0, 2, [])


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """lm-eval's own gsm8k config, and the local task pdctl generates, loaded by lm-eval's TaskManager."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    from lm_eval.tasks import TaskManager

    d = tmp_path_factory.mktemp("tasks")
    (d / "gsm8k_local.yaml").write_text(gsm8k.local_task_yaml(GSM8K))
    # Without lm-eval's built-in tasks in the index (thousands of files, seconds to scan): the local task names
    # gsm8k.yaml by its path, so it loads the same without them.
    manager = TaskManager(include_path=str(d), include_defaults=False)
    local = manager.load_task_or_group(["gsm8k_local"])["gsm8k_local"]
    import lm_eval

    own = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks/gsm8k/gsm8k.yaml").read_text())
    return local, own


def test_local_task_is_lm_evals_gsm8k_on_local_rows(tasks):
    local, own = tasks
    cfg = local.config
    assert cfg.doc_to_text == own["doc_to_text"] and cfg.doc_to_target == own["doc_to_target"]
    assert cfg.num_fewshot == own["num_fewshot"] == 5 and cfg.fewshot_split == "train"
    assert [f["name"] for f in cfg.filter_list] == [f["name"] for f in own["filter_list"]]
    assert cfg.generation_kwargs["until"] == own["generation_kwargs"]["until"]
    rows = gsm8k.load_rows(GSM8K / "test.jsonl")
    docs = list(local.test_docs())
    assert len(docs) == len(rows) == 1319
    for row, doc in zip(rows[:25], docs[:25], strict=True):
        assert local.doc_to_text(doc) == gsm8k.doc_to_text(row)


def test_answer_extraction_matches_lm_evals_filters(tasks):
    local, own = tasks
    patterns = {f["name"]: f["filter"][0]["regex_pattern"] for f in own["filter_list"]}
    assert gsm8k.STRICT.pattern == patterns["strict-match"]
    assert gsm8k.FLEXIBLE.pattern == patterns["flexible-extract"]
    rows = gsm8k.load_rows(GSM8K / "test.jsonl")[:50]
    for row in rows:
        gold = row["answer"].split("#### ")[-1].strip()
        assert gsm8k.extract_strict(row["answer"]) == gold
        assert gsm8k.extract_flexible(row["answer"]).replace(",", "") .rstrip(".").lstrip("$") == gold.replace(",", "")
