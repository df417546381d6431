"""The parity gate: P/D output must equal an aggregated reference, token for token, and the KV must have travelled.

Prompts are token-id lists of chosen lengths (around every block boundary of both sides), drawn fresh per run so
neither side's prefix cache can answer them, unless a test asks for shared prefixes on purpose.
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from pdctl.launch import probe
from pdctl.proxy.routing import ROUTE_HEADER

DEFAULT_LENGTHS = (1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 300, 700)


def boundary_lengths(block_sizes: list[int], max_len: int = 1024) -> list[int]:
    """Lengths straddling each block boundary of both sides (n-1, n, n+1 for n = k*block), plus a few long ones."""
    out = set(DEFAULT_LENGTHS)
    for b in block_sizes:
        for k in (1, 2, 4):
            out.update({k * b - 1, k * b, k * b + 1})
    return sorted(n for n in out if 0 < n <= max_len)


@dataclass
class Prompt:
    ids: list[int] | None = None
    text: str | None = None
    label: str = ""

    @property
    def body(self) -> list[int] | str:
        return self.ids if self.ids is not None else (self.text or "")


def random_prompts(lengths: list[int], vocab: int, seed: int | None = None, low: int = 3) -> list[Prompt]:
    """Fresh random-token prompts (ids >= low skip the tiny model's special tokens)."""
    rng = random.Random(seed if seed is not None else time.time_ns())
    return [Prompt(ids=[rng.randrange(low, vocab) for _ in range(n)], label=f"random-{n}") for n in lengths]


def shared_prefix_prompts(base: Prompt, extra: list[int], vocab: int, seed: int) -> list[Prompt]:
    """Prompts that start with `base` (so a decode that saw it serves part from its prefix cache)."""
    rng = random.Random(seed)
    assert base.ids is not None
    return [Prompt(ids=base.ids + [rng.randrange(3, vocab) for _ in range(n)], label=f"prefix{len(base.ids)}+{n}")
            for n in extra]


def complete(base_url: str, model: str, prompt: list[int] | str, max_tokens: int, timeout: float = 300,
             headers: dict[str, str] | None = None, seen: dict[str, str] | None = None) -> dict:
    """One greedy completion; `headers` go with the request, the answer's headers land in `seen`."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        if seen is not None:
            seen.update({k.lower(): v for k, v in r.headers.items()})
        return json.loads(r.read())


def _token_ids(resp: dict) -> list[int] | str:
    choice = resp["choices"][0]
    return choice.get("token_ids") or choice["text"]


@dataclass
class PromptResult:
    label: str
    prompt_tokens: int
    passed: bool
    first_divergence: int | None
    pd: list[int] | str
    reference: list[int] | str
    error: str | None = None
    request_id: str | None = None
    prefill: str | None = None  # the instances the proxy says served it (x-pdctl-prefill / x-pdctl-decode)
    decode: str | None = None


@dataclass
class TransferProof:
    external_kv_tokens: float
    local_compute_tokens: float
    bytes_transferred: float
    prompt_tokens: int

    @property
    def ok(self) -> bool:
        # The decode may compute the last prompt token itself; everything else must arrive by transfer.
        return self.external_kv_tokens >= 0.9 * self.prompt_tokens - 1 and self.bytes_transferred > 0


@dataclass
class ParityReport:
    results: list[PromptResult] = field(default_factory=list)
    proof: TransferProof | None = None

    @property
    def pass_rate(self) -> float:
        return sum(r.passed for r in self.results) / max(1, len(self.results))

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results) and bool(self.proof and self.proof.ok)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "pass_rate": self.pass_rate,
                "proof": asdict(self.proof) | {"ok": self.proof.ok} if self.proof else None,
                "results": [asdict(r) for r in self.results]}


def first_divergence(a: list | str, b: list | str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_counters(decode_urls: list[str]) -> dict[str, float]:
    """Prompt tokens by source and NIXL bytes, summed over the decode instances (vLLM's own /metrics)."""
    total = {"external": 0.0, "local": 0.0, "bytes": 0.0}
    for url in decode_urls:
        m = probe.metrics(url) or {}
        total["external"] += _by_source(m, "external_kv_transfer")
        total["local"] += _by_source(m, "local_compute")
        total["bytes"] += m.get("vllm:nixl_bytes_transferred_sum", 0.0)
    return total


def _by_source(m: dict[str, float], source: str) -> float:
    return sum(v for k, v in m.items()
               if k.startswith("vllm:prompt_tokens_by_source_total{") and f'source="{source}"' in k)


def _in_cache_order(prompts: list[Prompt]) -> tuple[list[int], list[int]]:
    """Prompt indices in two waves: fresh ones, then those sharing a head with an earlier prompt ("prefix..."),
    so the decode really holds that head in its prefix cache when they arrive."""
    fresh, shared = [], []
    for i, p in enumerate(prompts):
        (shared if p.label.startswith("prefix") else fresh).append(i)
    return fresh, shared


def reference_answers(url: str, model: str, prompts: list[Prompt], max_tokens: int = 16,
                      concurrency: int = 1) -> list:
    """The reference's token ids per prompt, recorded ahead (`pdctl check --reference-first`: on a host too
    small to run the reference beside the P/D topology)."""
    out: list = [None] * len(prompts)
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        for wave in _in_cache_order(prompts):
            for i, ids in zip(wave, pool.map(lambda i: _token_ids(complete(url, model, prompts[i].body, max_tokens)),
                                             wave), strict=True):
                out[i] = ids
    return out


def run_parity(proxy_url: str, reference: str | list, decode_urls: list[str], model: str, prompts: list[Prompt],
               max_tokens: int = 16, concurrency: int = 1, route: str | list[str | None] | None = None
               ) -> ParityReport:
    """Send every prompt through the P/D proxy and to the reference (a URL, or its answers recorded ahead);
    compare token ids; prove the transfer. Shared-prefix prompts run after the others (_in_cache_order).
    `route` pins every prompt (or each, by position) to a pool pair "PREFILL_POOL/DECODE_POOL".
    """
    before = decode_counters(decode_urls)
    routes = route if isinstance(route, list) else [route] * len(prompts)

    def one(i: int) -> PromptResult:
        p = prompts[i]
        rid = f"pdctl-check-{uuid.uuid4().hex[:16]}"
        headers = {"X-Request-Id": rid, **({ROUTE_HEADER: routes[i]} if routes[i] else {})}
        seen: dict[str, str] = {}
        try:
            resp = complete(proxy_url, model, p.body, max_tokens, headers=headers, seen=seen)
        except Exception as e:  # noqa: BLE001 - any failure is a failed prompt, reported with its cause
            detail = e.read().decode(errors="replace")[:300] if isinstance(e, urllib.error.HTTPError) else ""
            return PromptResult(p.label, len(p.ids or []), False, 0, [], [], f"P/D request failed: {e} {detail}",
                                rid)
        pd = _token_ids(resp)
        ref = reference[i] if isinstance(reference, list) else _token_ids(
            complete(reference, model, p.body, max_tokens))
        div = first_divergence(pd, ref)
        return PromptResult(p.label, resp["usage"]["prompt_tokens"], div is None, div, pd, ref, None, rid,
                            seen.get("x-pdctl-prefill"), seen.get("x-pdctl-decode"))

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        results = [r for wave in _in_cache_order(prompts) for r in pool.map(one, wave)]
    after = decode_counters(decode_urls)
    # Tokens the decode held in its own prefix cache were neither transferred nor computed: count only fresh ones.
    fresh = sum(r.prompt_tokens for r in results if not r.label.startswith("prefix"))
    proof = TransferProof(after["external"] - before["external"], after["local"] - before["local"],
                          after["bytes"] - before["bytes"], fresh)
    return ParityReport(results, proof)
