"""What `pdctl bench` and `pdctl sweep` run: one object, built by keyword."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from pdctl.launch.waits import READY_TIMEOUT_S

# The load's shape when nothing says otherwise: the gates' latency comparison, and goodput's long prompts (what P/D
# users run: vLLM's random dataset, 2048 prompt tokens, 64 output tokens, at least 200 requests per rate).
LOAD_DEFAULTS = {"requests": 32, "prompt_len": 256, "max_tokens": 32}
GOODPUT_DEFAULTS = {"requests": 200, "prompt_len": 2048, "max_tokens": 64}
PHASES = ("check", "eval", "perf")  # what `skip` may name: the parity gate, the accuracy gate, the load benchmark


def phases(names: str | Iterable[str]) -> frozenset[str]:
    """Phases to skip, as "check,eval" or an iterable of names; ValueError naming one that is not of PHASES."""
    names = [n.strip() for n in names.split(",") if n.strip()] if isinstance(names, str) else list(names)
    if unknown := [n for n in names if n not in PHASES]:
        raise ValueError(f"unknown phase {', '.join(map(repr, unknown))} (choose from {', '.join(PHASES)})")
    return frozenset(names)


@dataclass
class BenchOptions:
    """What `bench` and `sweep` run: the gates, the workload, the waits. Built by keyword."""

    skip: frozenset[str] = frozenset()  # phases not run, of PHASES
    data_dir: Path | None = None  # GSM8K (the accuracy gate; the parity gate's 5-shot prompts too)
    limit: int | None = 20  # gsm8k rows
    num_fewshot: int = 5
    expected: Path | None = None  # the expected-accuracy table (None: pdctl's own, gates.accuracy.DEFAULT_TABLE)
    allow_ungated: bool = False  # a model the table does not know passes the accuracy gate (UNGATED)
    requests: int | None = None  # load benchmark: requests per side (goodput: per rate); None: the defaults above
    prompt_len: int | None = None
    max_tokens: int | None = None
    concurrency: int = 4
    request_rate: float | None = None  # open loop (Poisson arrivals) instead of `concurrency`
    breakdown: bool = False  # follow every P/D load request stage by stage (connector.trace on for the bring-up)
    dataset: str = "random"  # vLLM's benchmark dataset: random, prefix_repetition, sharegpt or custom
    dataset_path: Path | None = None  # sharegpt's JSON, custom's JSONL (a local file: nothing is downloaded)
    timeout_s: float = READY_TIMEOUT_S
    state_dir: Path | None = None  # where the brought-up topology keeps its state (default .pdctl/<name>)
    # Goodput (pdctl.bench.goodput): the P/D topology against the baseline (aggregated, same devices) under SLOs.
    goodput: bool = False
    slo: str = "auto"  # "ttft=MS,tpot=MS", or auto: measured on one unloaded baseline instance first
    rates: tuple[float, ...] | None = None  # offered req/s to run; None: from this host's measured capacity
    duration_s: float | None = None  # seconds of arrivals per rate (requests = rate x this), instead of `requests`
    repeat: int = 3  # interleaved repetitions (median)
    alone: bool = False  # each deployment up alone in turn (default: up at once where goodput_run allows it)

    def __post_init__(self) -> None:
        self.skip = phases(self.skip)

    def resolved(self) -> BenchOptions:
        """The options with the load's shape filled in from the defaults of its mode."""
        d = GOODPUT_DEFAULTS if self.goodput else LOAD_DEFAULTS
        if self.goodput and self.duration_s is not None:  # the requests per rate follow from each rate
            d = {k: v for k, v in d.items() if k != "requests"}
        return replace(self, **{k: v for k, v in d.items() if getattr(self, k) is None})
