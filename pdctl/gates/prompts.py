"""The parity gate's prompts: lengths around each block boundary (and a hybrid model's window), prompts sharing a
prefix (the decode serves their head from its own cache), and GSM8K few-shot prompts; fresh for every run."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

from pdctl.gates.parity import Prompt, boundary_lengths, random_prompts, shared_prefix_prompts


def gsm8k_prompts(data_dir: Path, n: int, shots: int = 5, seed: int = 1234) -> list[Prompt]:
    """n test questions as lm-eval's gsm8k prompts ("Question: ...\\nAnswer:"), few-shot from the train split."""
    from pdctl.gates.gsm8k import fewshot_prompt, load_rows

    train, test = load_rows(data_dir / "train.jsonl"), load_rows(data_dir / "test.jsonl")
    rng = random.Random(seed)
    picks = rng.sample(range(len(test)), min(n, len(test)))
    return [Prompt(text=fewshot_prompt(test[i], train, shots), label=f"gsm8k-{i}") for i in picks]


def default_prompts(block_sizes: list[int], vocab: int, max_prompt: int, data_dir: Path | None = None,
                    seed: int | None = None, window: int | None = None) -> list[Prompt]:
    lengths = boundary_lengths(block_sizes, max_prompt, window)
    prompts = random_prompts(lengths, vocab, seed)
    # Shared prefixes: the decode serves the head of these from its own prefix cache (sent after their base).
    base = prompts[lengths.index(max(n for n in lengths if n <= 130))] if lengths else None
    if base:
        prompts += shared_prefix_prompts(base, [1, 37, 70, 100], vocab, seed or 7)
    if data_dir:
        prompts += with_nonce(gsm8k_prompts(data_dir, 4), seed)
    return prompts


def prompts_for(block_sizes: list[int], vocab: int, max_prompt: int, data_dir: Path | None = None,
                seed: int | None = None, lengths: list[int] | None = None, window: int | None = None) -> list[Prompt]:
    """The check's prompts for one pair of block sizes: the defaults (with a hybrid model's sliding `window`, also
    around it), or only random prompts of `lengths`."""
    if lengths:
        return random_prompts(lengths, vocab, seed)
    return default_prompts(block_sizes, vocab, min(max_prompt, 1024), data_dir, seed, window)


def with_nonce(prompts: list[Prompt], seed: int | None = None) -> list[Prompt]:
    """Text prompts get a fresh first line so no prefix cache can answer them (random ones are fresh already)."""
    rng = random.Random(seed)
    return [replace(p, text=f"({rng.randrange(10**9)})\n{p.text}") if p.text else p for p in prompts]
