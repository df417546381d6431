"""The parity gate: P/D output must equal an aggregated reference, token for token, and the KV must have travelled.

Prompts are token-id lists of chosen lengths (around every block boundary of both sides), drawn fresh per run so
neither side's prefix cache can answer them, unless a test asks for shared prefixes on purpose.
"""

from __future__ import annotations

import json
import math
import random
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from pdctl import auth, protocol
from pdctl.launch import probe
from pdctl.protocol import (
    DECODE_SERVED_HEADER,
    FIRST_HEADER,
    FIRST_TOKEN_MISMATCH,
    PREFILL_SERVED_HEADER,
    ROUTE_HEADER,
    ProxyMetric,
    VllmMetric,
)

DEFAULT_LENGTHS = (1, 31, 32, 33, 63, 64, 65, 127, 128, 129, 300, 700)


def boundary_lengths(block_sizes: list[int], max_len: int = 1024, window: int | None = None) -> list[int]:
    """Lengths straddling each block boundary of both sides (n-1, n, n+1 for n = k*block), plus a few long ones.

    window: a hybrid model's sliding window: prompts around it, several times longer than it, and those whose
    window starts a block after the prompt's last token's does (n - window + 1 a multiple of a block: where
    vLLM's stock connector leaves the decode's recomputed last token one key short)."""
    out = set(DEFAULT_LENGTHS)
    for b in block_sizes:
        for k in (1, 2, 4):
            out.update({k * b - 1, k * b, k * b + 1})
    if window:
        out.update({window - 1, window, window + 1, 3 * window, 5 * window + 7})
        for b in block_sizes:
            out.update(window - 1 + k * b for k in (1, 2, 5))
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
             headers: dict[str, str] | None = None, seen: dict[str, str] | None = None,
             stream: bool = False, pieces: bool = False) -> dict:
    """One greedy completion; `headers` go with the request, the answer's headers land in `seen`. `stream`:
    streamed, asking pdctl's proxy for the prefill's token first (its most involved path: the prefill's token,
    then the decode's stream without it; other servers ignore the header), and answered as the text a client reads
    (its events' text joined). `pieces` (the reference's stream): each event's token ids too, kept as the
    choice's "pieces" [[text, ids], ...]; never asked of P/D: token ids change what a stream's events carry, and
    the proxy streams such a request the ordinary way."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    if pieces or not stream:
        body["return_token_ids"] = True
    sent = {"Content-Type": "application/json", **({FIRST_HEADER: "on"} if stream else {}), **(headers or {})}
    req = urllib.request.Request(base_url.rstrip("/") + "/v1/completions", json.dumps(body).encode(), sent)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        if seen is not None:
            seen.update({k.lower(): v for k, v in r.headers.items()})
        return _streamed(r) if stream else json.loads(r.read())


class StreamError(RuntimeError):
    """A stream that ended with an error event: the error's type, and the text the client had read before it."""

    def __init__(self, error: dict, text: str):
        super().__init__(f"the stream ended with an error: {json.dumps(error)[:300]}")
        self.kind = error.get("type") if isinstance(error, dict) else None
        self.text = text


def _streamed(r) -> dict:
    """A completion stream read whole, as one answer: the events' text joined (and, where the events carry token
    ids, each event's text with its ids: "pieces"), the usage event's counts."""
    text, pieces, usage, rid = [], [], None, None
    for line in r:
        line = line.strip()
        if not line.startswith(b"data: {"):
            continue
        ev = json.loads(line[6:])
        if ev.get("error"):
            raise StreamError(ev["error"], "".join(text))
        rid = rid or ev.get("id")
        usage = ev.get("usage") or usage
        for c in ev.get("choices") or []:
            text.append(c.get("text") or "")
            if c.get("token_ids") is not None:
                pieces.append([text[-1], list(c["token_ids"])])
    if usage is None:
        raise RuntimeError("the stream ended without its usage event")
    return {"id": rid, "choices": [{"text": "".join(text)} | ({"pieces": pieces} if pieces else {})],
            "usage": usage}


def _token_ids(resp: dict) -> list[int] | str:
    choice = resp["choices"][0]
    return choice.get("token_ids") or choice["text"]


TOP_LOGPROBS = 20
TIE_TOKENS = 5  # the reference's top tokens whose logprobs P/D must match for a tie
# How far apart the reference may hold two tokens for a batch to break their tie: 8 prompts in flight on the tiny
# random model (docs/gates.md), P/D against the reference, the chosen token's logprob: bf16 differed by up to 0.106
# nats (one bf16 step there is 0.0625) and flipped 6 of 320 prompts at a tie of 0 or one step; float32 by up to
# 1.5e-5, no flip in 320 (none in 6,975 of the gate's prompts either). A bound of about twice the noise measured.
TIE_NATS = {"float32": 1e-3, "half": 0.25}


def tie_nats(dtype: str | None) -> float:
    """The tie bound for a model served in `dtype` (the topology's model.dtype; None where unknown). "auto"
    and bf16/fp16 get the half-precision bound."""
    return TIE_NATS["float32" if dtype == "float32" else "half"]


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
    served_id: str | None = None  # the answer's id (vllm-router's names the instances it chose)
    divergence: Divergence | None = None  # a divergent answer's diagnosis (diagnose)
    # The proxy ended the stream because the decode's first token was not the prefill's, which the client already
    # had (x-pdctl-first-token; pd is then that token's text): diagnosed at token 0 like any divergence.
    first_token_mismatch: bool = False

    def to_dict(self) -> dict:
        d = self.divergence
        if d is None:
            return asdict(self)
        finite = {"spread": None} if d.spread is not None and math.isinf(d.spread) else {}  # JSON has no inf
        return asdict(self) | {"divergence": asdict(d) | finite | {"tie": d.tie, "summary": d.summary}}

    @property
    def failure(self) -> str:
        """Why this prompt failed, in one line ("" when it passed)."""
        if self.passed:
            return ""
        return self.outcome

    @property
    def outcome(self) -> str:
        """What happened at the first divergent token, in one line ("" when there was none)."""
        if self.first_divergence is None:
            return ""
        if self.first_token_mismatch:
            return ("first token: the decode's is not the prefill's, which the client already had (the proxy "
                    f"ended the stream: {FIRST_TOKEN_MISMATCH})" + (f": {self.divergence.summary}"
                                                                    if self.divergence else ""))
        unit = "character" if isinstance(self.pd, str) else "token"  # streamed answers are compared as text
        at = f" (token {self.divergence.token})" if unit == "character" and self.divergence else ""
        return (f"first divergent {unit} {self.first_divergence}{at}" + (f" ({self.error})" if self.error else "")
                + (f": {self.divergence.summary}" if self.divergence else ""))


@dataclass
class Divergence:
    """What tells a near tie from wrong KV at the first divergent token: both sides' logprobs there, each asked
    with the prompt and the tokens both agreed on as its prompt (P/D through the same pair).

    Rounding makes P/D and an aggregated server differ a little, in ways that depend on the batch (what else is
    in flight) and, on some CPUs, on the block size (vLLM-CPU's AMX attention sums per block): a tie then breaks
    either way, and again the same way when asked again. Wrong KV moves the whole distribution: P/D picks a
    token the reference ranks far down or not at all, and its logprobs for the reference's top tokens are off by
    far more than rounding."""

    reference_token: int
    pd_token: int
    tie_nats: float = TIE_NATS["half"]  # the bound a tie is judged by (tie_nats)
    rank: int | None = None  # of P/D's token among the reference's TOP_LOGPROBS (1: its own choice); None: absent
    gap: float | None = None  # the reference's logprob of its token minus of P/D's (None: absent from the top)
    spread: float | None = None  # the most P/D's logprob differs from the reference's over the reference's top
    # TIE_TOKENS (inf: one of them absent from P/D's top; None: not asked)
    token: int | None = None  # the divergent token's index in the answer (streamed: found from the character)

    @property
    def tie(self) -> bool:
        """A near tie rounding broke, not the KV: the reference holds P/D's token within tie_nats of its own
        (at any rank: several tokens may lie within one bf16 step, and asked with the agreed tokens as prompt the
        reference may order them either way) and P/D's logprobs there are the reference's, within tie_nats, for
        each of the reference's top TIE_TOKENS."""
        return (self.rank is not None and self.gap is not None and abs(self.gap) <= self.tie_nats
                and self.spread is not None and self.spread <= self.tie_nats)

    @property
    def summary(self) -> str:
        where = (f"P/D's token not in the reference's top {TOP_LOGPROBS}" if self.rank is None else
                 f"P/D's token is the reference's choice {self.rank}, {self.gap:.3g} nats below its own")
        if self.spread is not None:
            where += (f"; a token of the reference's top {TIE_TOKENS} is not in P/D's top {TOP_LOGPROBS}"
                      if math.isinf(self.spread) else
                      f"; P/D's logprobs there within {self.spread:.3g} nats of the reference's (top {TIE_TOKENS})")
        return ("a near tie: " if self.tie else "") + where


@dataclass
class TransferProof:
    """What the decodes' own /metrics (and the proxy's) say about the prompts of one gate run.

    The bound: every prompt token but the last of every answered request arrives by KV transfer, except what
    the decode's own prefix cache held already:

        external_kv_tokens >= sum(prompt_len - 1) - cache_hit_tokens

    How vLLM counts (0.32, vllm/v1/core/sched/scheduler.py and v1/metrics/stats.py): when a request with
    `do_remote_prefill` is scheduled, the decode's local prefix-cache hit (whole blocks, at most prompt_len - 1
    tokens) is `local_cache_hit` and the NIXL connector claims the rest of the prompt,
    `prompt_len - local_hit` (`_get_remote_prefill_token_count`), as `external_kv_transfer`; after the load the
    scheduler recomputes the last token, so the decode computes at most that one token itself. The bound leaves
    exactly that token per request and no more. It is the tightest one that holds across vLLM versions and
    connectors: one that counts the last token as computed (`_prefill_backoff` = 1, e.g. Mamba) still meets
    it, and a bound of all tokens (what 0.32 reports for an attention model) would fail there. Models with a
    multi-token backoff (multi-module MTP) cannot meet it; pdctl serves none.

    vLLM counts the external tokens when it schedules the load, so a load that failed and was recomputed
    (`kv_load_failure_policy: recompute`) still counts as transferred: failed NIXL transfers fail the proof,
    and the gates run with `kv_load_failure_policy: fail`. A request the proxy served from a decode alone
    (`on_prefill_down: fallback`) fails it too, through the proxy's decode-only fallback counter.
    """

    external_kv_tokens: float
    local_compute_tokens: float
    bytes_transferred: float
    prompt_tokens: int  # tokens of the fresh prompts (no shared head with an earlier one)
    shared_prompt_tokens: int = 0  # tokens of the prompts sent after one sharing their head
    requests: int = 0  # answered requests: one token each may be computed by the decode
    cache_hit_tokens: float = 0.0  # prompt tokens the decode served from its own prefix cache
    failed_transfers: float = 0.0  # vLLM's nixl_num_failed_transfers over the run
    fallbacks: float | None = None  # requests the proxy sent to a decode alone (None: not a pdctl proxy)
    missing: list[str] = field(default_factory=list)  # metrics the proof needs and did not find
    # pdctl's connector with connector.kv_fingerprint: received KV checked against the prefill's fingerprint, and
    # found not to be it (per decode TP rank)
    fingerprints_checked: float = 0.0
    fingerprint_mismatches: float = 0.0

    @property
    def required(self) -> float:
        """The fewest prompt tokens that must have arrived by transfer."""
        return self.prompt_tokens + self.shared_prompt_tokens - self.requests - self.cache_hit_tokens

    @property
    def ok(self) -> bool:
        return (not self.missing and self.external_kv_tokens >= self.required and self.bytes_transferred > 0
                and self.failed_transfers == 0 and not self.fallbacks and not self.fingerprint_mismatches)

    @property
    def message(self) -> str:
        """Why the proof fails (the first reason), or what it shows."""
        tokens = self.prompt_tokens + self.shared_prompt_tokens
        bound = (f"at least {self.required:.0f} required: all but the last token of {self.requests} prompts "
                 f"({tokens} - {self.requests})" + (f", minus {self.cache_hit_tokens:.0f} served by the decode's "
                                                    "own prefix cache" if self.cache_hit_tokens else ""))
        if self.missing:
            return "cannot prove the transfer: " + "; ".join(self.missing)
        if self.fallbacks:
            return (f"{self.fallbacks:.0f} requests were served by a decode alone (proxy fallback, "
                    f"{PROXY_FALLBACKS}): not P/D")
        if self.fingerprint_mismatches:
            return (f"{self.fingerprint_mismatches:.0f} received KV not the prefill's (KV fingerprint mismatches, "
                    f"{FINGERPRINT_MISMATCHES}): those loads failed")
        if self.failed_transfers:
            return (f"{self.failed_transfers:.0f} NIXL transfers failed ({VllmMetric.NIXL_FAILED}): their "
                    "prompts were recomputed or failed, not transferred")
        if self.external_kv_tokens < self.required:
            return (f"KV did not travel: {self.external_kv_tokens:.0f} prompt tokens arrived by transfer, {bound}; "
                    f"{self.local_compute_tokens:.0f} computed locally")
        if self.bytes_transferred <= 0:
            return f"KV did not travel: the decodes' NIXL bytes did not grow ({VllmMetric.NIXL_BYTES})"
        checked = (f"; KV fingerprints checked {self.fingerprints_checked:.0f}, all equal"
                   if self.fingerprints_checked else "")
        return (f"KV travelled: {self.external_kv_tokens:.0f} prompt tokens by transfer, {bound}; "
                f"{self.local_compute_tokens:.0f} computed locally, NIXL bytes {self.bytes_transferred:.0f}{checked}")


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
                "proof": asdict(self.proof) | {"ok": self.proof.ok, "required": self.proof.required,
                                               "message": self.proof.message} if self.proof else None,
                "results": [r.to_dict() for r in self.results]}


def first_divergence(a: list | str, b: list | str) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


BY_SOURCE = f"{VllmMetric.PROMPT_BY_SOURCE}_total"
NIXL_BYTES = f"{VllmMetric.NIXL_BYTES}_sum"
NIXL_FAILED = f"{VllmMetric.NIXL_FAILED}_total"
PROXY_FALLBACKS = f"{ProxyMetric.FALLBACKS}_total"
FINGERPRINTS_CHECKED = f"{protocol.FINGERPRINTS_CHECKED}_total"
FINGERPRINT_MISMATCHES = f"{protocol.FINGERPRINT_MISMATCHES}_total"


def decode_counters(decode_urls: list[str], missing: list[str] | None = None,
                    headers: dict[str, str] | None = None) -> dict[str, float]:
    """Prompt tokens by source, NIXL bytes and failed transfers, summed over the decode instances (vLLM's own
    /metrics). What a proof needs and a decode does not expose is named in `missing` (when given)."""
    total = {"external": 0.0, "local": 0.0, "cache_hit": 0.0, "bytes": 0.0, "failed": 0.0, "checked": 0.0,
             "mismatched": 0.0}
    for url in decode_urls:
        m = probe.metrics(url, headers=headers)
        if m is None:
            if missing is not None:
                missing.append(f"decode {url}: /metrics did not answer")
            continue
        if missing is not None:
            if not any(k.startswith(BY_SOURCE + "{") for k in m):
                missing.append(f"decode {url}: /metrics has no {BY_SOURCE} (prompt tokens by source)")
            if NIXL_BYTES not in m:
                missing.append(f"decode {url}: /metrics has no {NIXL_BYTES} (is its KV connector NIXL?)")
        total["external"] += _by_source(m, "external_kv_transfer")
        total["local"] += _by_source(m, "local_compute")
        total["cache_hit"] += _by_source(m, "local_cache_hit")
        total["bytes"] += m.get(NIXL_BYTES, 0.0)
        total["failed"] += m.get(NIXL_FAILED, 0.0)
        total["checked"] += m.get(FINGERPRINTS_CHECKED, 0.0)
        total["mismatched"] += m.get(FINGERPRINT_MISMATCHES, 0.0)
    return total


def proxy_fallbacks(proxy_url: str, headers: dict[str, str] | None = None) -> float | None:
    """Requests pdctl's proxy sent to a decode alone so far; None when the proxy does not count them."""
    m = probe.metrics(proxy_url, headers=headers)
    return None if m is None or PROXY_FALLBACKS not in m else m[PROXY_FALLBACKS]


def _by_source(m: dict[str, float], source: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(BY_SOURCE + "{") and f'source="{source}"' in k)


def _in_cache_order(prompts: list[Prompt]) -> tuple[list[int], list[int]]:
    """Prompt indices in two waves: fresh ones, then those sharing a head with an earlier prompt ("prefix..."),
    so the decode really holds that head in its prefix cache when they arrive."""
    fresh, shared = [], []
    for i, p in enumerate(prompts):
        (shared if p.label.startswith("prefix") else fresh).append(i)
    return fresh, shared


def reference_answers(url: str, model: str, prompts: list[Prompt], max_tokens: int = 16,
                      concurrency: int = 1, api_key: str | None = None, stream: bool = False) -> list:
    """The reference's token ids (streamed: text) per prompt, recorded ahead (`pdctl check --reference-first`:
    on a host too small to run the reference beside the P/D topology)."""
    out: list = [None] * len(prompts)
    key = auth.headers(api_key)
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        for wave in _in_cache_order(prompts):
            for i, ids in zip(wave, pool.map(lambda i: _token_ids(complete(
                    url, model, prompts[i].body, max_tokens, headers=key, stream=stream)), wave), strict=True):
                out[i] = ids
    return out


def run_parity(proxy_url: str, reference: str | list, decode_urls: list[str], model: str, prompts: list[Prompt],
               max_tokens: int = 16, concurrency: int = 1, route: str | list[str | None] | None = None,
               api_key: str | None = None, stream: bool = False, tie: float = TIE_NATS["half"]) -> ParityReport:
    """Send every prompt through the P/D proxy and to the reference (a URL, or its answers recorded ahead);
    compare token ids (`stream`: both streamed, the text a client reads); prove the transfer. Shared-prefix
    prompts run after the others (_in_cache_order).
    `route` pins every prompt (or each, by position) to a pool pair "PREFILL_POOL/DECODE_POOL". `api_key` goes
    with every call (auth.api_key_env). A prompt that differs is diagnosed (Divergence) and passes only as a near
    tie within `tie` nats (tie_nats).
    """
    key = auth.headers(api_key)
    before = decode_counters(decode_urls, headers=key)
    fallbacks_before = proxy_fallbacks(proxy_url, key)
    routes = route if isinstance(route, list) else [route] * len(prompts)
    pieces: dict[int, list] = {}  # streamed: the reference's answer per prompt as [[text, token ids], ...]

    def reference_answer(i: int) -> list[int] | str:
        if isinstance(reference, list):
            return reference[i]
        answer = complete(reference, model, prompts[i].body, max_tokens, headers=key, stream=stream, pieces=stream)
        pieces[i] = answer["choices"][0].get("pieces")
        return _token_ids(answer)

    def one(i: int) -> PromptResult:
        p = prompts[i]
        rid = f"pdctl-check-{uuid.uuid4().hex[:16]}"
        headers = {"X-Request-Id": rid, **({ROUTE_HEADER: routes[i]} if routes[i] else {}), **key}
        seen: dict[str, str] = {}
        try:
            resp = complete(proxy_url, model, p.body, max_tokens, headers=headers, seen=seen, stream=stream)
        except StreamError as e:
            if e.kind != FIRST_TOKEN_MISMATCH:
                return PromptResult(p.label, len(p.ids or []), False, 0, [], [], f"P/D request failed: {e}", rid)
            return PromptResult(p.label, len(p.ids or []), False, 0, e.text, reference_answer(i),
                                f"P/D request failed: {e}", rid, seen.get(PREFILL_SERVED_HEADER),
                                seen.get(DECODE_SERVED_HEADER), first_token_mismatch=True)
        except Exception as e:  # noqa: BLE001 - any failure is a failed prompt, reported with its cause
            detail = e.read().decode(errors="replace")[:300] if isinstance(e, urllib.error.HTTPError) else ""
            return PromptResult(p.label, len(p.ids or []), False, 0, [], [], f"P/D request failed: {e} {detail}",
                                rid)
        pd, ref = _token_ids(resp), reference_answer(i)
        div = first_divergence(pd, ref)
        return PromptResult(p.label, resp["usage"]["prompt_tokens"], div is None, div, pd, ref, None, rid,
                            seen.get(PREFILL_SERVED_HEADER), seen.get(DECODE_SERVED_HEADER), resp.get("id"))

    waves = _in_cache_order(prompts)
    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        results = [r for wave in waves for r in pool.map(one, wave)]
    missing: list[str] = []
    after = decode_counters(decode_urls, missing, key)
    fallbacks_after = proxy_fallbacks(proxy_url, key)
    if isinstance(reference, str):  # after the counters: the proof is of the prompts, not of their diagnosis
        order = [i for wave in waves for i in wave]
        for r, i in zip(results, order, strict=True):
            if not r.passed and (r.error is None or r.first_token_mismatch):
                r.divergence = diagnose(r, prompts[i], proxy_url, reference, model,
                                        {**({ROUTE_HEADER: routes[i]} if routes[i] else {}), **key}, tie,
                                        pieces.get(i))
                r.passed = bool(r.divergence and r.divergence.tie)
    return ParityReport(results, transfer_proof(results, before, after, missing, fallbacks_before, fallbacks_after))


def diagnose(r: PromptResult, prompt: Prompt, proxy_url: str, reference: str, model: str,
             headers: dict[str, str], tie: float = TIE_NATS["half"], pieces: list | None = None) -> Divergence | None:
    """A divergent answer's Divergence: the reference's and P/D's (same pair) top logprobs at the first divergent
    token, each asked with the prompt and the tokens both agreed on. Streamed answers are text: the divergent
    token is found through the reference's stream `pieces` (each event's text and token ids), and P/D's token
    there by its text (stream_token). None where the tokens cannot be told (an answer cut short, a divergence
    inside one character several tokens make) or the logprobs cannot be had: the failure then stands as it is."""
    k = r.first_divergence
    if k is None:
        return None
    key = {x: v for x, v in headers.items() if x != ROUTE_HEADER}
    try:
        if r.first_token_mismatch:  # P/D's token: the prefill's, which the client read; the reference's: its top
            agreed, ref_token, start = [], None, 0
        elif isinstance(r.pd, str):
            at = stream_position(pieces or [], k)
            if at is None or not isinstance(r.reference, str):
                return None
            agreed, ref_token, start = at
        elif isinstance(r.reference, list) and k < min(len(r.pd), len(r.reference)):
            agreed, ref_token, start = r.reference[:k], r.reference[k], None
        else:
            return None
        ids = prompt.ids if prompt.ids is not None else _tokenize(reference, model, prompt.text or "", key)
        ref = _top_logprobs(reference, model, ids + agreed, key)
        pd = _top_logprobs(proxy_url, model, ids + agreed,
                           {**headers, "X-Request-Id": f"pdctl-check-logprobs-{uuid.uuid4().hex[:16]}"})
        if ref_token is None:
            ref_token = max(ref, key=lambda t: ref[t])
        pd_token = r.pd[k] if start is None else stream_token(
            r.pd[start:], agreed, ref, pd, lambda t: _detokenize(reference, model, t, key),
            exclude=None if r.first_token_mismatch else ref_token)
        if pd_token is None:
            return None
        d = Divergence(ref_token, pd_token, tie, token=len(agreed))
        ranked = sorted(ref, key=lambda t: -ref[t])
        if d.pd_token in ref:
            d.rank = ranked.index(d.pd_token) + 1
            d.gap = ref.get(d.reference_token, ref[ranked[0]]) - ref[d.pd_token]
        d.spread = max(abs(pd[t] - ref[t]) if t in pd else math.inf for t in ranked[:TIE_TOKENS])
        return d
    except Exception:  # noqa: BLE001 - a diagnosis that cannot be made leaves the failure as it is
        return None


def stream_position(pieces: list, k: int) -> tuple[list[int], int, int] | None:
    """Where the streamed reference's text, given as its events' [text, token ids], holds character k: the
    tokens before the token that wrote it, that token, and the character its text starts at. None where k is
    past the text or its event's text came from several tokens (one character of several bytes, held back until
    whole: which of them the other side left cannot be told from text)."""
    pos, agreed, held = 0, [], []
    for text, ids in pieces:
        if not text:  # an incomplete character: vLLM sends its tokens with no text, the text comes with the next
            held += ids
            continue
        ids = held + list(ids)
        held = []
        if k < pos + len(text):
            return (agreed, ids[0], pos) if len(ids) == 1 else None
        agreed, pos = agreed + ids, pos + len(text)
    return None


def stream_token(rest: str, agreed: list[int], ref: dict[int, float], pd: dict[int, float], detokenize,
                 exclude: int | None = None) -> int | None:
    """P/D's token where its streamed text `rest` leaves the reference's token (`exclude`: the reference's,
    which it is not): among both sides' top tokens there, those whose text, written after the agreed tokens,
    starts `rest`; P/D's likeliest of them (its own choice, as it was greedy). None where none does: P/D's token
    ranked by neither side (not a tie), or a token of part of a character, which has no text of its own."""
    base = detokenize(agreed)
    fits = []
    for t in sorted((set(ref) | set(pd)) - {exclude}):
        whole = detokenize(agreed + [t])
        text = whole[len(base):] if whole.startswith(base) else ""
        if text and "\ufffd" not in text and rest.startswith(text):
            fits.append(t)
    return max(fits, key=lambda t: (pd.get(t, -math.inf), -t)) if fits else None


def _top_logprobs(base_url: str, model: str, ids: list[int], headers: dict[str, str]) -> dict[int, float]:
    """The next token's TOP_LOGPROBS logprobs after `ids`, by token id."""
    out = _post(base_url, "/v1/completions", {
        "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": TOP_LOGPROBS,
        "return_tokens_as_token_ids": True}, headers)["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(t.split(":", 1)[1]): lp for t, lp in out.items()}


def _post(base_url: str, path: str, body: dict, headers: dict[str, str]) -> dict:
    status, text = probe.http_post_json(base_url.rstrip("/") + path, body, 120, headers)
    if status != 200:
        raise RuntimeError(f"{path}: HTTP {status or 'no answer'}")
    return json.loads(text)


def _detokenize(base_url: str, model: str, ids: list[int], headers: dict[str, str]) -> str:
    """The text of token ids as the reference writes them (vLLM's /detokenize)."""
    return _post(base_url, "/detokenize", {"model": model, "tokens": ids}, headers)["prompt"] if ids else ""


def _tokenize(base_url: str, model: str, text: str, headers: dict[str, str]) -> list[int]:
    """The prompt's token ids as the reference's /v1/completions sees them (vLLM's /tokenize, special tokens
    added the same way)."""
    return _post(base_url, "/tokenize", {"model": model, "prompt": text}, headers)["tokens"]


def transfer_proof(results: list[PromptResult], before: dict[str, float], after: dict[str, float],
                   missing: list[str] = (), fallbacks_before: float | None = None,
                   fallbacks_after: float | None = None) -> TransferProof:
    """The proof over the answered requests (a failed one fails the report by itself): the decodes' counters
    before and after, and the proxy's fallback counter (when it has one)."""
    answered = [r for r in results if r.error is None]
    fresh = sum(r.prompt_tokens for r in answered if not r.label.startswith("prefix"))
    shared = sum(r.prompt_tokens for r in answered if r.label.startswith("prefix"))
    fallbacks = (None if fallbacks_before is None or fallbacks_after is None
                 else fallbacks_after - fallbacks_before)
    return TransferProof(after["external"] - before["external"], after["local"] - before["local"],
                         after["bytes"] - before["bytes"], fresh, shared, len(answered),
                         after["cache_hit"] - before["cache_hit"], after["failed"] - before["failed"], fallbacks,
                         list(missing), after["checked"] - before["checked"],
                         after["mismatched"] - before["mismatched"])
