"""The accuracy gate: lm-eval's gsm8k through the P/D proxy, judged against an expected-accuracy table (pdctl's own,
DEFAULT_TABLE, shipped in the package; or a user's file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pdctl.gates.gsm8k import OFFLINE_ENV, local_task_yaml

# pdctl's own table: inside the package, so a gate finds it from any working directory and in an installed wheel.
DEFAULT_TABLE = Path(__file__).with_name("expected.yaml")


def table_name(path: str | Path | None) -> str:
    """How messages name the table a gate judged by (None: pdctl's own)."""
    return str(path) if path is not None else "pdctl's expected-accuracy table"


@dataclass
class Verdict:
    metric: str
    measured: float | None
    stderr: float | None
    expected: float | None  # absolute: expected.yaml's value; relative: the aggregated reference's
    rtol: float | None  # absolute: rtol; relative: max_delta
    status: str  # PASS | FAIL | UNGATED
    message: str = ""
    gate: str = "absolute"  # absolute | relative | none

    @property
    def passed(self) -> bool:
        return self.status == "PASS"


DEFAULT_MIN_AGREEMENT = 1.0
DEFAULT_MAX_DELTA = 0.0
_RELATIVE_KEYS = {"min_agreement", "max_delta", "metrics"}


@dataclass
class GateSpec:
    """One model's gate for one task in expected.yaml.

    absolute: metric -> {expected, rtol}: |measured - expected| <= rtol, a real model's known accuracy.
    relative: {min_agreement, max_delta, metrics}: against an aggregated reference run on the same rows,
    per-sample agreement >= min_agreement and |P/D - reference| <= max_delta per metric. The gate of
    a model whose accuracy says nothing (the random tiny model solves no problem: 0.0 ± 0.05 cannot fail).
    """

    absolute: dict[str, dict]
    relative: dict | None = None

    @property
    def kind(self) -> str:
        return "+".join(k for k in ("absolute", "relative") if getattr(self, k)) or "none"


def gate_spec(expected: dict, model: str, task: str = "gsm8k") -> GateSpec | None:
    """The gate expected.yaml holds for a model and task; None when it holds none."""
    table = (expected.get(model) or {}).get(task)
    if not table:
        return None
    # Metrics set directly under the task (no `absolute:` key) are absolute ones too.
    absolute = {**(table.get("absolute") or {}),
                **{k: v for k, v in table.items() if k not in ("absolute", "relative")}}
    relative = table.get("relative")
    return GateSpec(absolute, None if relative is None else {
        "min_agreement": float(relative.get("min_agreement", DEFAULT_MIN_AGREEMENT)),
        "max_delta": float(relative.get("max_delta", DEFAULT_MAX_DELTA)),
        "metrics": list(relative.get("metrics") or [])})


def needs_reference(expected: dict, model: str, task: str = "gsm8k") -> bool:
    """A relative gate is judged against an aggregated reference: without one it would not be applied."""
    spec = gate_spec(expected, model, task)
    return bool(spec and spec.relative is not None)


def validate_expected(table: dict, where: str = "expected.yaml") -> dict:
    """Every entry well-formed (model -> task -> absolute metrics and/or relative), or ValueError naming it."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a mapping of model -> task -> gate")
    for model, tasks in table.items():
        if not isinstance(tasks, dict):
            raise ValueError(f"{where}: {model}: expected a mapping of task -> gate")
        for task, gate in tasks.items():
            at = f"{where}: {model}.{task}"
            if not isinstance(gate, dict) or not gate:
                raise ValueError(f"{at}: expected 'absolute: {{METRIC: {{expected, rtol}}}}' and/or "
                                 "'relative: {min_agreement, max_delta}'")
            rel = gate.get("relative")
            if rel is not None:
                if not isinstance(rel, dict) or set(rel) - _RELATIVE_KEYS:
                    raise ValueError(f"{at}.relative: keys are {', '.join(sorted(_RELATIVE_KEYS))}")
                for k in ("min_agreement", "max_delta"):
                    if k in rel and not (isinstance(rel[k], (int, float)) and 0 <= rel[k] <= 1):
                        raise ValueError(f"{at}.relative.{k}: a number from 0 to 1, got {rel[k]!r}")
                if not isinstance(rel.get("metrics", []), list):
                    raise ValueError(f"{at}.relative.metrics: a list of lm-eval metric names")
            absolute = {**(gate.get("absolute") or {}),
                        **{k: v for k, v in gate.items() if k not in ("absolute", "relative")}}
            for metric, spec in absolute.items():
                if not (isinstance(spec, dict) and isinstance(spec.get("expected"), (int, float))
                        and isinstance(spec.get("rtol", 0.05), (int, float))):
                    raise ValueError(f"{at}: {metric}: expected {{expected: NUMBER, rtol: NUMBER}}")
    return table


def load_expected(path: Path) -> dict:
    from pdctl import yamlsrc

    try:
        data = yamlsrc.load_file(path, "the expected-accuracy file")
    except yamlsrc.YamlSourceError as e:
        raise ValueError(f"{path}{f':{e.line}' if e.line else ''}: {e.message}") from None
    return validate_expected(data or {}, str(path))


def judge(model: str, task: str, measured: dict[str, float], stderr: dict[str, float], expected: dict
          ) -> list[Verdict]:
    """One verdict per absolute metric of expected.yaml; a model without a gate there yields UNGATED rows, never
    a PASS (a model with only a relative gate yields none: run_gate judges it against the reference)."""
    spec = gate_spec(expected, model, task)
    if spec is None:
        return [Verdict(m, v, stderr.get(m), None, None, "UNGATED",
                        f"no gate for model '{model}' task {task} in expected.yaml", "none")
                for m, v in sorted(measured.items())]
    out = []
    for metric, s in spec.absolute.items():
        value = measured.get(metric)
        exp, rtol = float(s["expected"]), float(s.get("rtol", 0.05))
        if value is None:
            have = ", ".join(sorted(measured)) or "none"
            out.append(Verdict(metric, None, None, exp, rtol, "FAIL",
                               f"{metric}: missing from lm-eval's output (it has: {have})"))
            continue
        ok = abs(value - exp) <= rtol
        out.append(Verdict(metric, value, stderr.get(metric), exp, rtol, "PASS" if ok else "FAIL",
                           f"{metric} {value:.4f} {'within' if ok else 'outside'} {exp} ± {rtol}"))
    return out


def judge_relative(values: dict[str, float], stderr: dict[str, float], ref_values: dict[str, float],
                   agreed: int, samples: int, min_agreement: float, max_delta: float,
                   metrics: list[str] | None = None) -> tuple[str, str, list[Verdict]]:
    """The relative gate: (status, message, one verdict per metric). Per-sample agreement with the aggregated
    reference >= min_agreement, and |P/D - reference| <= max_delta for every metric (those named, else every
    metric either run reports; one missing from either run fails)."""
    names = list(metrics or sorted(set(values) | set(ref_values)))
    verdicts = []
    for m in names:
        pd, ref = values.get(m), ref_values.get(m)
        if pd is None or ref is None:
            side = "the P/D run" if pd is None else "the reference run"
            verdicts.append(Verdict(m, pd, stderr.get(m), ref, max_delta, "FAIL",
                                    f"{m}: missing from {side}'s lm-eval output", "relative"))
            continue
        d = pd - ref
        ok = abs(d) <= max_delta + 1e-12
        verdicts.append(Verdict(m, pd, stderr.get(m), ref, max_delta, "PASS" if ok else "FAIL",
                                f"{m} delta {d:+.4f} {'within' if ok else 'outside'} ± {max_delta}", "relative"))
    rate = agreed / samples if samples else 0.0
    problems = [v.message for v in verdicts if not v.passed]
    if not samples:
        problems.insert(0, "no sample was compared (the runs share no document)")
    elif rate < min_agreement:
        problems.insert(0, f"agreement {agreed}/{samples} below {min_agreement:.0%}")
    if not names:
        problems.append("no metric to compare")
    deltas = ", ".join(f"{v.metric} {v.measured - v.expected:+.4f}" for v in verdicts
                       if v.measured is not None and v.expected is not None) or "-"
    status = "FAIL" if problems else "PASS"
    message = (f"relative gate: agreement {agreed}/{samples} with the aggregated reference (min "
               f"{min_agreement:.0%}), delta {deltas} (max ± {max_delta}) -> {status}"
               + (": " + "; ".join(problems) if problems else ""))
    return status, message, verdicts


def absolute_line(verdicts: list[Verdict]) -> str:
    """'absolute: exact_match,strict-match 0.4300 vs 0.41 ± 0.05, ... -> PASS'"""
    rows = [v for v in verdicts if v.gate == "absolute"]
    parts = [f"{v.metric} {'missing' if v.measured is None else format(v.measured, '.4f')} vs {v.expected} ± "
             f"{v.rtol}" for v in rows]
    return f"absolute: {', '.join(parts)} -> {gate_status(rows)}"


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
                num_fewshot: int, concurrency: int, data_dir: Path | None, timeout_s: float = 3600,
                api_key: str | None = None) -> EvalRun:
    """lm-eval's gsm8k with the local-completions model against an OpenAI-compatible URL (the P/D proxy).
    `api_key` reaches lm-eval as OPENAI_API_KEY (its local-completions model sends it as a Bearer token): not in
    model_args, which lm-eval writes into its results and log."""
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
    env = {**os.environ, OFFLINE_ENV: "1" if data_dir else os.environ.get(OFFLINE_ENV, "0"),
           "TOKENIZERS_PARALLELISM": "false", **({"OPENAI_API_KEY": api_key} if api_key else {})}
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


def run_gate(proxy_url: str, reference_url: str | None, model: str, out_dir: Path, expected: dict, *,
             tokenizer: str | None, limit: int | None, num_fewshot: int, concurrency: int, data_dir: Path | None,
             min_agreement: float | None = None, tolerance: float | None = None, api_key: str | None = None) -> dict:
    """lm-eval through P/D (and the reference), judged: the summary that `pdctl eval` and `pdctl bench` report.

    The gates are expected.yaml's for the model: absolute (accuracy within rtol of a known value) and/or relative
    (per-sample agreement and accuracy delta against the reference, an aggregated server). A reference adds the
    relative gate for any model; min_agreement / tolerance (the command line) override expected.yaml's values,
    else 1.0 / 0.0. A relative gate without a reference is an error (raised before lm-eval runs). The proxy's
    fallback counter must not grow over the P/D run: a request served by a decode alone is not P/D. `api_key`
    goes with every call (auth.api_key_env).
    """
    spec = gate_spec(expected, model, "gsm8k")
    if spec and spec.relative is not None and not reference_url:
        raise ValueError(f"model '{model}' has a relative gsm8k gate in expected.yaml: it needs a reference (an "
                         "aggregated server of the same model to compare with)")
    from pdctl import auth
    from pdctl.gates.parity import PROXY_FALLBACKS, proxy_fallbacks

    key = auth.headers(api_key)
    fallbacks_before = proxy_fallbacks(proxy_url, key)
    pd = run_lm_eval(proxy_url, model, out_dir / "pd", tokenizer=tokenizer, limit=limit, num_fewshot=num_fewshot,
                     concurrency=concurrency, data_dir=data_dir, api_key=api_key)
    fallbacks_after = proxy_fallbacks(proxy_url, key)
    task = pd.results["pdctl_task"]
    values, errs = pd.metrics(task)
    verdicts = judge(model, "gsm8k", values, errs, expected)
    gates: list[str] = []
    if spec and spec.absolute:
        gates.append(absolute_line(verdicts))
    summary: dict = {"model": model, "task": task, "limit": limit, "num_fewshot": num_fewshot,
                     "gate": spec.kind if spec else "none", "gates": gates, "verdicts": [], "status": ""}
    statuses = [gate_status(verdicts)] if verdicts else []
    if reference_url:
        rel = dict(spec.relative) if spec and spec.relative is not None else {
            "min_agreement": DEFAULT_MIN_AGREEMENT, "max_delta": DEFAULT_MAX_DELTA, "metrics": []}
        source = "expected.yaml" if spec and spec.relative is not None else "defaults"
        if min_agreement is not None:
            rel["min_agreement"], source = float(min_agreement), "command line"
        if tolerance is not None:
            rel["max_delta"], source = float(tolerance), "command line"
        ref = run_lm_eval(reference_url, model, out_dir / "reference", tokenizer=tokenizer, limit=limit,
                          num_fewshot=num_fewshot, concurrency=concurrency, data_dir=data_dir, api_key=api_key)
        ref_values, _ = ref.metrics(task)
        rate, n, diverged = agreement(pd.samples, ref.samples)
        agreed = round(rate * n)
        status, message, rel_verdicts = judge_relative(values, errs, ref_values, agreed, n, rel["min_agreement"],
                                                       rel["max_delta"], rel["metrics"])
        if spec is None:  # a reference with a model expected.yaml does not know: the per-metric rows are these
            verdicts = []
        verdicts += rel_verdicts
        gates.append(message)
        summary["reference"] = {"values": ref_values,
                                "delta": {v.metric: v.measured - v.expected for v in rel_verdicts
                                          if v.measured is not None and v.expected is not None},
                                "agreement": rate, "agreed": agreed, "samples": n, "concurrency": concurrency,
                                "min_agreement": rel["min_agreement"], "max_delta": rel["max_delta"],
                                "thresholds_from": source, "diverged": diverged, "status": status,
                                "message": message}
        statuses.append(status)
        if not (spec and spec.relative is not None):
            summary["gate"] = "+".join(k for k in ("absolute" if spec and spec.absolute else "", "relative") if k)
    if fallbacks_before is not None and fallbacks_after is not None and fallbacks_after > fallbacks_before:
        n_fb = fallbacks_after - fallbacks_before
        gates.append(f"P/D: {n_fb:.0f} requests were served by a decode alone (proxy fallback, "
                     f"{PROXY_FALLBACKS}): not P/D -> FAIL")
        summary["fallbacks"] = n_fb
        statuses.append("FAIL")
    summary["verdicts"] = [v.__dict__ for v in verdicts]
    if "FAIL" in statuses:
        summary["status"] = "FAIL"
    elif spec is None:
        summary["status"] = "UNGATED"  # a model expected.yaml does not know is never a PASS
    else:
        summary["status"] = "PASS"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
