"""What `pdctl bench` and `pdctl sweep` run: one object, built by keyword."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class BenchOptions:
    """What `bench` and `sweep` run: the gates, the workload, the waits. Built by keyword."""

    skip_check: bool = False
    skip_eval: bool = False
    skip_perf: bool = False
    data_dir: Path | None = None  # GSM8K (the accuracy gate; the parity gate's 5-shot prompts too)
    limit: int | None = 20  # gsm8k rows
    num_fewshot: int = 5
    expected: Path | None = None  # the expected-accuracy table (None: pdctl's own, gates.accuracy.DEFAULT_TABLE)
    allow_ungated: bool = False  # a model the table does not know passes the accuracy gate (UNGATED)
    requests: int = 32  # load benchmark: requests per side
    prompt_len: int = 256
    max_tokens: int = 32
    concurrency: int = 4
    request_rate: float | None = None  # open loop (Poisson arrivals) instead of `concurrency`
    breakdown: bool = False  # follow every P/D load request stage by stage (connector.trace on for the bring-up)
    dataset: str = "random"  # vLLM's benchmark dataset: random, prefix_repetition, sharegpt or custom
    dataset_path: Path | None = None  # sharegpt's JSON, custom's JSONL (a local file: nothing is downloaded)
    eval_concurrency: int = 1  # per-sample agreement with the reference is exact only when batches match
    reference_port: int = 8300
    timeout_s: float = 300.0
    state_dir: Path | None = None  # where the brought-up topology keeps its state (default .pdctl/<name>)
