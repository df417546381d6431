"""The accuracy gate: lm-eval's gsm8k through the P/D proxy, judged against configs/expected.yaml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pdctl.gates.gsm8k import local_task_yaml


@dataclass
class Verdict:
    metric: str
    measured: float | None
    stderr: float | None
    expected: float | None
    rtol: float | None
    status: str  # PASS | FAIL | UNGATED

    @property
    def passed(self) -> bool:
        return self.status == "PASS"


def load_expected(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


def judge(model: str, task: str, measured: dict[str, float], stderr: dict[str, float], expected: dict
          ) -> list[Verdict]:
    """One verdict per expected metric; an unknown model or task yields UNGATED rows, never a PASS."""
    table = (expected.get(model) or {}).get(task)
    if not table:
        return [Verdict(m, v, stderr.get(m), None, None, "UNGATED") for m, v in sorted(measured.items())]
    out = []
    for metric, spec in table.items():
        value = measured.get(metric)
        exp, rtol = float(spec["expected"]), float(spec.get("rtol", 0.05))
        ok = value is not None and abs(value - exp) <= rtol
        out.append(Verdict(metric, value, stderr.get(metric), exp, rtol, "PASS" if ok else "FAIL"))
    return out


def gate_status(verdicts: list[Verdict]) -> str:
    if any(v.status == "FAIL" for v in verdicts):
        return "FAIL"
    if not verdicts or all(v.status == "UNGATED" for v in verdicts):
        return "UNGATED"
    return "PASS"


@dataclass
class EvalRun:
    results: dict
    samples: list[dict] = field(default_factory=list)
    out_dir: Path | None = None

    def metrics(self, task: str) -> tuple[dict[str, float], dict[str, float]]:
        r = self.results["results"][task]
        values = {k: float(v) for k, v in r.items() if "," in k and "_stderr" not in k and k != "alias"}
        errs = {k.replace("_stderr", ""): float(v) for k, v in r.items() if "_stderr," in k
                and isinstance(v, (int, float))}
        return values, errs


def run_lm_eval(base_url: str, model: str, out_dir: Path, *, tokenizer: str | None, limit: int | None,
                num_fewshot: int, concurrency: int, data_dir: Path | None, timeout_s: float = 3600) -> EvalRun:
    """lm-eval's gsm8k with the local-completions model against an OpenAI-compatible URL (the P/D proxy)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    task = "gsm8k"
    args = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--output_path", str(out_dir),
            "--log_samples", "--num_fewshot", str(num_fewshot), "--batch_size", "1"]
    if data_dir:
        task = "gsm8k_local"
        tasks_dir = out_dir / "tasks"
        tasks_dir.mkdir(exist_ok=True)
        (tasks_dir / "gsm8k_local.yaml").write_text(local_task_yaml(data_dir, task))
        args += ["--include_path", str(tasks_dir)]
    model_args = (f"model={model},base_url={base_url.rstrip('/')}/v1/completions,num_concurrent={concurrency},"
                  "max_retries=3,tokenized_requests=False")
    model_args += f",tokenizer_backend=huggingface,tokenizer={tokenizer}" if tokenizer else ",tokenizer_backend=None"
    args += ["--model_args", model_args, "--tasks", task]
    if limit:
        args += ["--limit", str(limit)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1" if data_dir else os.environ.get("HF_DATASETS_OFFLINE", "0"),
           "TOKENIZERS_PARALLELISM": "false"}
    with open(out_dir / "lm_eval.log", "w") as log:
        proc = subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
    if proc.returncode != 0:
        tail = (out_dir / "lm_eval.log").read_text().splitlines()[-25:]
        raise RuntimeError(f"lm-eval exited with {proc.returncode}; log {out_dir / 'lm_eval.log'}:\n" +
                           "\n".join(tail))
    results_file = max(out_dir.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    samples_file = max(out_dir.rglob(f"samples_{task}_*.jsonl"), key=lambda p: p.stat().st_mtime)
    samples = [json.loads(line) for line in samples_file.read_text().splitlines() if line.strip()]
    run = EvalRun(json.loads(results_file.read_text()), samples, out_dir)
    run.results["pdctl_task"] = task
    return run


def agreement(a: list[dict], b: list[dict]) -> tuple[float, int, list[dict]]:
    """Share of documents whose generated text is identical in both runs, how many were compared, and where each
    disagreeing document's texts first differ (KV damage shows from the first characters; a batch-dependent
    rounding flip between near-tied tokens shows late).

    lm-eval logs one sample per (document, filter); a document agrees when all its samples do.
    """
    def key(s):
        return s["doc_id"], s.get("filter")

    def text(s):
        return json.dumps(s.get("resps") or [[None]])

    def raw(s):
        return "".join(str(x) for r in s.get("resps") or [] for x in (r if isinstance(r, list) else [r]))

    bm = {key(s): text(s) for s in b}
    raw_b = {key(s): raw(s) for s in b}
    docs: dict = {}
    diverged: dict = {}
    for s in a:
        if key(s) not in bm:
            continue
        ta, tb = text(s), bm[key(s)]
        docs[s["doc_id"]] = docs.get(s["doc_id"], True) and ta == tb
        if ta != tb and s["doc_id"] not in diverged:
            ra, rb = raw(s), raw_b[key(s)]
            at = next((i for i, (x, y) in enumerate(zip(ra, rb, strict=False)) if x != y), min(len(ra), len(rb)))
            diverged[s["doc_id"]] = {"doc_id": s["doc_id"], "first_diff_char": at, "length": max(len(ra), len(rb))}
    if not docs:
        return 0.0, 0, []
    return sum(docs.values()) / len(docs), len(docs), sorted(diverged.values(), key=lambda d: d["doc_id"])


def run_gate(proxy_url: str, baseline_url: str | None, model: str, out_dir: Path, expected: dict, *,
             tokenizer: str | None, limit: int | None, num_fewshot: int, concurrency: int, data_dir: Path | None,
             min_agreement: float = 1.0, tolerance: float = 0.0) -> dict:
    """lm-eval through P/D (and the baseline), judged: the summary that `pdctl eval` and `pdctl bench` report."""
    pd = run_lm_eval(proxy_url, model, out_dir / "pd", tokenizer=tokenizer, limit=limit, num_fewshot=num_fewshot,
                     concurrency=concurrency, data_dir=data_dir)
    task = pd.results["pdctl_task"]
    values, errs = pd.metrics(task)
    verdicts = judge(model, "gsm8k", values, errs, expected)
    summary: dict = {"model": model, "task": task, "limit": limit, "num_fewshot": num_fewshot,
                     "verdicts": [v.__dict__ for v in verdicts], "status": gate_status(verdicts)}
    if baseline_url:
        ref = run_lm_eval(baseline_url, model, out_dir / "baseline", tokenizer=tokenizer, limit=limit,
                          num_fewshot=num_fewshot, concurrency=concurrency, data_dir=data_dir)
        ref_values, _ = ref.metrics(task)
        rate, n, diverged = agreement(pd.samples, ref.samples)
        deltas = {m: values.get(m, 0.0) - ref_values.get(m, 0.0) for m in values}
        ok = n > 0 and rate >= min_agreement and all(abs(d) <= tolerance for d in deltas.values())
        summary["baseline"] = {"values": ref_values, "delta": deltas, "agreement": rate, "samples": n,
                               "concurrency": concurrency, "diverged": diverged,
                               "status": "PASS" if ok else "FAIL"}
        if not ok:
            summary["status"] = "FAIL"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
