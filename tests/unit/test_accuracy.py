"""The accuracy gate's threshold logic, and the local gsm8k task against lm-eval's own gsm8k task."""

import os
from pathlib import Path

import pytest
import yaml

from pdctl.gates import accuracy, gsm8k
from tests.conftest import CONFIGS, SHARED

GSM8K = SHARED / "data" / "gsm8k"
EXPECTED = {"Qwen/Qwen3-0.6B": {"gsm8k": {"exact_match,strict-match": {"expected": 0.41, "rtol": 0.05}}}}


@pytest.mark.parametrize("value,status", [(0.41, "PASS"), (0.455, "PASS"), (0.365, "PASS"), (0.47, "FAIL"),
                                          (0.30, "FAIL")])
def test_threshold_pass_and_fail(value, status):
    v = accuracy.judge("Qwen/Qwen3-0.6B", "gsm8k", {"exact_match,strict-match": value}, {}, EXPECTED)
    assert [x.status for x in v] == [status]
    assert accuracy.gate_status(v) == status


def test_unknown_model_is_ungated_never_pass():
    v = accuracy.judge("someone/else", "gsm8k", {"exact_match,strict-match": 0.9}, {}, EXPECTED)
    assert {x.status for x in v} == {"UNGATED"} and accuracy.gate_status(v) == "UNGATED"


def test_missing_metric_fails():
    v = accuracy.judge("Qwen/Qwen3-0.6B", "gsm8k", {"exact_match,flexible-extract": 0.41}, {}, EXPECTED)
    assert v[0].measured is None and accuracy.gate_status(v) == "FAIL"


def test_shipped_expectations_include_vllms_gate():
    table = accuracy.load_expected(CONFIGS / "expected.yaml")
    assert table["Qwen/Qwen3-0.6B"]["gsm8k"]["exact_match,strict-match"] == {"expected": 0.41, "rtol": 0.05}


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
    local = TaskManager(include_path=str(d)).load_task_or_group(["gsm8k_local"])["gsm8k_local"]
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
