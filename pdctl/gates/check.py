"""`pdctl check`: choose prompts, bring up what is needed, run the parity gate, write reports."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from xml.sax.saxutils import escape

from pdctl.gates.parity import Prompt, boundary_lengths, random_prompts, shared_prefix_prompts


def gsm8k_prompts(data_dir: Path, n: int, shots: int = 5, seed: int = 1234) -> list[Prompt]:
    """n test questions as lm-eval's gsm8k prompts ("Question: ...\\nAnswer:"), few-shot from the train split."""
    from pdctl.gates.gsm8k import fewshot_prompt, load_rows

    train, test = load_rows(data_dir / "train.jsonl"), load_rows(data_dir / "test.jsonl")
    rng = random.Random(seed)
    picks = rng.sample(range(len(test)), min(n, len(test)))
    return [Prompt(text=fewshot_prompt(test[i], train, shots), label=f"gsm8k-{i}") for i in picks]


def default_prompts(block_sizes: list[int], vocab: int, max_prompt: int, gsm8k_dir: Path | None = None,
                    seed: int | None = None, window: int | None = None) -> list[Prompt]:
    lengths = boundary_lengths(block_sizes, max_prompt, window)
    prompts = random_prompts(lengths, vocab, seed)
    # Shared prefixes: the decode serves the head of these from its own prefix cache (sent after their base).
    base = prompts[lengths.index(max(n for n in lengths if n <= 130))] if lengths else None
    if base:
        prompts += shared_prefix_prompts(base, [1, 37, 70, 100], vocab, seed or 7)
    if gsm8k_dir:
        prompts += with_nonce(gsm8k_prompts(gsm8k_dir, 4), seed)
    return prompts


def prompts_for(block_sizes: list[int], vocab: int, max_prompt: int, gsm8k_dir: Path | None = None,
                seed: int | None = None, lengths: list[int] | None = None, window: int | None = None) -> list[Prompt]:
    """The check's prompts for one pair of block sizes: the defaults (with a hybrid model's sliding `window`, also
    around it), or only random prompts of `lengths`."""
    if lengths:
        return random_prompts(lengths, vocab, seed)
    return default_prompts(block_sizes, vocab, min(max_prompt, 1024), gsm8k_dir, seed, window)


def with_nonce(prompts: list[Prompt], seed: int | None = None) -> list[Prompt]:
    """Text prompts get a fresh first line so no prefix cache can answer them (random ones are fresh already)."""
    rng = random.Random(seed)
    return [replace(p, text=f"({rng.randrange(10**9)})\n{p.text}") if p.text else p for p in prompts]


def junit_xml(report, name: str = "pdctl.check") -> str:
    """A ParityReport, or a fleet's report (one proof case per pool pair)."""
    cases = []
    if hasattr(report, "pairs"):
        return _junit_fleet(report, name)
    for r in report.results:
        body = "" if r.passed else (f'<failure message="first divergent token {r.first_divergence}">'
                                    f"{escape(r.error or '')}\nP/D: {escape(str(r.pd))}\n"
                                    f"reference: {escape(str(r.reference))}</failure>")
        cases.append(f'  <testcase classname="{name}" name="{escape(r.label)}">{body}</testcase>')
    proof_ok = bool(report.proof and report.proof.ok)
    proof = escape(json.dumps(report.to_dict()["proof"]))
    why = escape(report.proof.message if report.proof else "no transfer proof", {'"': "&quot;"})
    failure = "" if proof_ok else f'<failure message="{why}">{proof}</failure>'
    cases.append(f'  <testcase classname="{name}" name="kv-transfer-proof">{failure}</testcase>')
    failures = sum(not r.passed for r in report.results) + (not proof_ok)
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="{name}" tests="{len(cases)}" '
            f'failures="{failures}">\n' + "\n".join(cases) + "\n</testsuite>\n")


def _junit_fleet(report, name: str) -> str:
    cases = []
    for pair in report.all():
        pid = f"{pair.prefill_pool}/{pair.decode_pool}"
        for r in pair.report.results:
            body = "" if r.passed else (f'<failure message="first divergent token {r.first_divergence}">'
                                        f"{escape(r.error or '')}</failure>")
            cases.append(f'  <testcase classname="{name}.{escape(pid)}" name="{escape(r.label)}">{body}</testcase>')
        ok = pair.report.proof is not None and pair.report.proof.ok and not pair.problems
        detail = escape(json.dumps(pair.to_dict()))
        proof = pair.report.proof
        why = escape(pair.problems[0] if proof and proof.ok and pair.problems else
                     proof.message if proof else "no transfer proof", {'"': "&quot;"})
        failure = "" if ok else f'<failure message="{why}">{detail}</failure>'
        cases.append(f'  <testcase classname="{name}.{escape(pid)}" name="kv-transfer-proof">{failure}</testcase>')
    failures = sum("<failure" in c for c in cases)
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<testsuite name="{name}" tests="{len(cases)}" '
            f'failures="{failures}">\n' + "\n".join(cases) + "\n</testsuite>\n")
