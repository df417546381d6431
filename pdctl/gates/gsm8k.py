"""GSM8K from local files, in lm-eval's own gsm8k format (lm_eval/tasks/gsm8k/gsm8k.yaml, version 3.0)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

# lm-eval's gsm8k: doc_to_text "Question: {{question}}\nAnswer:", target " {{answer}}", examples joined by "\n\n".
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")


def load_rows(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def doc_to_text(row: dict) -> str:
    return f"Question: {row['question']}\nAnswer:"


def fewshot_prompt(row: dict, train: list[dict], shots: int = 5, seed: int = 1234) -> str:
    examples = random.Random(seed).sample(train, shots)
    parts = [f"{doc_to_text(e)} {e['answer']}" for e in examples]
    return "\n\n".join([*parts, doc_to_text(row)])


def extract_strict(text: str) -> str | None:
    m = STRICT.search(text)
    return m.group(1) if m else None


def extract_flexible(text: str) -> str | None:
    found = FLEXIBLE.findall(text)
    if not found:
        return None
    last = found[-1]
    return next(g for g in last if g)


def local_task_yaml(data_dir: Path, task_name: str = "gsm8k_local") -> str:
    """An lm-eval task that *is* lm-eval's gsm8k, with the dataset read from data_dir's jsonl files."""
    import lm_eval

    base = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    data_dir = Path(data_dir).resolve()
    return (f"include: {base}\n"
            f"task: {task_name}\n"
            "tag: []\n"
            "dataset_path: json\n"
            "dataset_name: null\n"
            "dataset_kwargs:\n"
            "  data_files:\n"
            f"    train: {data_dir / 'train.jsonl'}\n"
            f"    test: {data_dir / 'test.jsonl'}\n")
