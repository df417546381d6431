"""GSM8K from local files, in lm-eval's own gsm8k format (lm_eval/tasks/gsm8k/gsm8k.yaml, version 3.0)."""

from __future__ import annotations

import json
import os
import random
import re
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
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


# ----------------------------------------------------------------------------------------------------------------
# Where the data comes from, decided before anything starts


OFFLINE_ENV = "HF_DATASETS_OFFLINE"  # the datasets library reads no hub: set where the data is local or cached
HUB_DATASET = "openai/gsm8k"  # lm-eval's gsm8k.yaml: dataset_path openai/gsm8k, dataset_name main
HUB_PROBE_TIMEOUT_S = 3.0
HOW_TO_POINT = ("point pdctl at local files: --data-dir DIR (or GSM8K_DIR=DIR) where DIR holds train.jsonl and "
                "test.jsonl in openai/grade-school-math's format, one {\"question\": ..., \"answer\": ...} per line")


class DataError(ValueError):
    """GSM8K is not where it was said to be, is malformed, or is nowhere: one message, before anything starts."""


@dataclass
class DataSource:
    kind: str  # dir | cache | hub
    data_dir: Path | None = None  # kind dir: the jsonl files' directory
    detail: str = ""  # what was found, for the command's output

    @property
    def env(self) -> dict[str, str]:
        """Environment lm-eval needs for this source: a cached copy must be read offline (no hub to ask)."""
        return {OFFLINE_ENV: "1"} if self.kind == "cache" else {}


def check_jsonl(path: Path) -> int:
    """The number of GSM8K rows in a jsonl file, or DataError naming the file (and line) that is wrong."""
    if not path.is_file():
        raise DataError(f"{path}: no such file (a GSM8K directory holds train.jsonl and test.jsonl)")
    rows = 0
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not JSON ({e.msg}, column {e.colno})") from None
                if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                        and isinstance(row.get("answer"), str)):
                    raise DataError(f"{path}:{n}: a GSM8K row is an object with string 'question' and 'answer'")
                rows += 1
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def check_dir(data_dir: Path, flag: str = "--data-dir ") -> DataSource:
    """A local GSM8K directory: both splits there and well-formed (lm-eval's few-shot examples come from train)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"{flag}{data_dir}: no such directory; {HOW_TO_POINT}")
    counts = {name: check_jsonl(data_dir / f"{name}.jsonl") for name in ("test", "train")}
    return DataSource("dir", data_dir, f"{data_dir} ({counts['test']} test rows, {counts['train']} train rows)")


def cache_dirs() -> list[Path]:
    """Where HF datasets and the hub keep a downloaded copy (as the libraries resolve their defaults)."""
    home = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "huggingface")
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE") or home / "datasets")
    hub_cache = Path(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or home / "hub")
    return [datasets_cache, hub_cache]


def cached_copy() -> Path | None:
    """A copy of openai/gsm8k (config main) that `datasets` can load offline, if one was downloaded here."""
    owner, name = HUB_DATASET.split("/")
    datasets_cache, hub_cache = cache_dirs()
    patterns = [(datasets_cache, f"{owner}___{name}/main/*/*/dataset_info.json"),  # datasets' prepared copy
                (datasets_cache, f"{name}/main/*/*/dataset_info.json"),
                (hub_cache, f"datasets--{owner}--{name}/snapshots/*/main/test-*")]  # the hub's files
    for root, pattern in patterns:
        found = next(iter(sorted(root.glob(pattern))), None) if root.is_dir() else None
        if found:
            return found
    return None


def hub_reachable(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether the dataset hub answers for openai/gsm8k within timeout_s, all told (name resolution included:
    the probe runs in a thread that is left behind when it does not answer in time). Offline settings are
    honoured without asking."""
    if os.environ.get(OFFLINE_ENV) == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    url = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/") + f"/api/datasets/{HUB_DATASET}"
    answer: list[bool] = []

    def probe() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout_s) as r:
                answer.append(200 <= r.status < 400)
        except (urllib.error.URLError, OSError, ValueError):
            answer.append(False)

    t = threading.Thread(target=probe, name="pdctl-hub-probe", daemon=True)
    t.start()
    t.join(timeout_s)
    return bool(answer and answer[0])


def data_source(data_dir: Path | None, *, probe=None) -> DataSource:
    """Where lm-eval's gsm8k will read from: --data-dir, else $GSM8K_DIR, else a cached copy, else the hub.
    DataError when the directory given is wrong, or when there is none of these. `probe`: the hub check
    (default hub_reachable, looked up at call time)."""
    if data_dir is not None:
        return check_dir(data_dir)
    env_dir = os.environ.get("GSM8K_DIR")
    if env_dir:
        try:
            return check_dir(Path(env_dir), "GSM8K_DIR=")
        except DataError as e:
            if str(e).startswith("GSM8K_DIR="):
                raise
            raise DataError(f"{e} (from GSM8K_DIR={env_dir})") from None
    cached = cached_copy()
    if cached:
        return DataSource("cache", None, f"the cached {HUB_DATASET} ({cached})")
    if (probe or hub_reachable)():
        return DataSource("hub", None, f"the hub's {HUB_DATASET}")
    looked = " and ".join(str(d) for d in cache_dirs())
    raise DataError(f"GSM8K is not available, so nothing was started: no --data-dir, GSM8K_DIR is not set, no "
                    f"cached {HUB_DATASET} (looked in {looked}) and the dataset hub did not answer within "
                    f"{HUB_PROBE_TIMEOUT_S:g} s; {HOW_TO_POINT}")
