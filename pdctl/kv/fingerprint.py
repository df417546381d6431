"""A request's KV fingerprint: what a prefill computed and what a decode holds, compared without moving the KV again.

The fingerprint of a stretch of KV is a sum, modulo 2**64, of one term per element: the element's bits times odd
weights of its logical coordinates (layer, token, KV head, K or V, dimension), each a fixed integer hash of them.
So it depends only on what is where logically, never on the cache's layout, block size or TP split; it is exact
(integer arithmetic on the bits, no rounding); and a sum does not depend on the order of its terms, so each side
adds its terms however its cache holds them, and TP ranks' shares (each over its own heads, named by their global
index) add up to the whole.

A request's fingerprint (`Fingerprint`) holds partial sums per `CHUNK` tokens of the prompt (the last one shorter)
and per KV head, and per layer and KV head over the whole prompt. Per chunk, so a decode that holds a prefix itself
compares only the chunks it received (every block size pdctl serves is a multiple of CHUNK, so a prefix hit ends on
a chunk boundary); per head, so each decode TP rank checks the heads it holds, alone; per layer, so a mismatch names
the first layer that differs. Its size is 8 bytes per (chunk, head) and per (layer, head).

What changes it: any changed bit of any element (a flipped byte); an element at another token, head, layer or
dimension (two tokens swapped, a block read from the wrong address, a head slice from the wrong rank); K and V
interchanged; a slot of the prompt left stale or zeroed. Slots past the prompt are not attended to and are not in
it. It is linear in the bits: two changes cancel only if their differences times their random weights sum to 0
mod 2**64, which no systematic misread does but with probability about 2**-64.

Pure torch on the tensors' own device: no vLLM, no NIXL.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

CHUNK = 16  # tokens per partial sum
SLICE_ELEMS = 1 << 18  # elements per pass: 2 MiB of int64 products
MASK = (1 << 64) - 1

# Odd 64-bit constants, each within int64 (torch's integer arithmetic wraps modulo 2**64).
_M1, _M2 = -7046029254386353131, -4658895280553007687  # 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9
_LAYER, _TOKEN, _HEAD, _KV, _DIM = (0x2545F4914F6CDD1D, 0x5851F42D4C957F2D, 0x14057B7EF767814F,
                                    0x1B873593CC9E2D51, 0x68E31DA4B5297CC1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (arithmetic shifts: the same on every device, which is all that matters)."""
    x = (x ^ (x >> 31)) * _M1
    x = (x ^ (x >> 29)) * _M2
    return x ^ (x >> 32)


_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _bits(values: torch.Tensor) -> torch.Tensor:
    """Each element's bits as a signed integer of its width (bf16/fp16: int16; fp8 caches: int8), no copy."""
    if values.element_size() not in _SIGNED:
        raise ValueError(f"a KV cache of {values.dtype}: pdctl fingerprints 1-, 2- and 4-byte elements")
    return values.view(_SIGNED[values.element_size()])


@functools.lru_cache(maxsize=1024)
def _weights(layer: int, kv: int, first_head: int, heads: int, dim: int, device: torch.device) -> torch.Tensor:
    """An odd int64 per (head, dimension) of one layer's K or V: [heads, 1, dim] (kept: every request of a server
    asks for the same few; read only)."""
    h = (first_head + torch.arange(heads, dtype=torch.int64, device=device)).view(heads, 1, 1)
    d = torch.arange(dim, dtype=torch.int64, device=device).view(1, 1, dim)
    return _mix(layer * _LAYER + kv * _KV + h * _HEAD + d * _DIM) | 1


def _token_sums(values: torch.Tensor, weights: torch.Tensor, out: torch.Tensor) -> None:
    """Add each token's weighted sum over dims, per head, into out [B, H, N]: values [B, H, N, D] (any strides),
    weights [H, 1, D]. In slices of SLICE_ELEMS elements: the int64 products of a slice stay small (a whole layer's
    would be allocated and paged in afresh on every call, which measured up to 10x slower on CPU)."""
    b, h, n, d = values.shape
    bits = _bits(values)
    n_step = max(1, min(n, SLICE_ELEMS // max(1, h * d)))
    b_step = max(1, SLICE_ELEMS // max(1, h * n_step * d))
    for i in range(0, b, b_step):
        for j in range(0, n, n_step):
            out[i:i + b_step, :, j:j + n_step] += (bits[i:i + b_step, :, j:j + n_step] * weights).sum(dim=3)


def head_partials(k: torch.Tensor, v: torch.Tensor, *, layer: int, first_token: int, first_head: int = 0,
                  chunks: int | None = None, start: int = 0, end: int | None = None) -> torch.Tensor:
    """One layer's partial sums per CHUNK tokens from token 0 and per KV head: int64 [chunks, heads] (wrapping:
    the bits of the sums modulo 2**64). `k`, `v` hold tokens first_token.. of KV heads first_head.. (global
    indices): [heads, tokens, head_dim] in token order, or [blocks, heads, block_size, head_dim], consecutive
    blocks as a form's pages unpack (any strides: read where they lie, no copy). Only tokens start..end-1 count
    (default: all; a block's slots past the prompt are not). first_token must start a chunk; `chunks`: how many
    partial sums to return (default: those the tokens reach), the ones without tokens 0.

    An element's term is bits * w(layer, K or V, head, dim) * w(token): its bits as a signed integer times odd
    weights of its coordinates, so the sum factors into a weighted sum over dims per (head, token) (one pass over
    the elements, the integer promotion fused into the multiply), then one weight per token. Any change of an
    element's bits changes its term (an odd weight times a nonzero difference below 2**32 is not 0 mod 2**64)."""
    if first_token % CHUNK:
        raise ValueError(f"token {first_token} does not start a fingerprint chunk of {CHUNK}")
    if v.shape != k.shape:
        raise ValueError(f"K {tuple(k.shape)} and V {tuple(v.shape)} differ in shape")
    if k.dim() == 3:
        k, v = k.unsqueeze(0), v.unsqueeze(0)  # one block of every token
    b, h, n, d = k.shape
    dev = k.device
    sums = torch.zeros(b, h, n, dtype=torch.int64, device=dev)
    for kv, values in enumerate((k, v)):
        _token_sums(values, _weights(layer, kv, first_head, h, d, dev), sums)
    t = b * n
    per_token = sums.transpose(0, 1).reshape(h, t)  # [H, tokens]: a copy of one int64 per (token, head)
    tokens = first_token + torch.arange(t, device=dev, dtype=torch.int64)
    per_token *= _mix(tokens * _TOKEN + _M1) | 1
    # Tokens outside start..end-1 count nothing; then a sum per CHUNK tokens (the first token starts a chunk).
    if start > first_token:
        per_token[:, :start - first_token] = 0
    if end is not None and end < first_token + t:
        per_token[:, max(0, end - first_token):] = 0
    first = first_token // CHUNK
    whole = -(-t // CHUNK)
    count = chunks if chunks is not None else first + whole
    if whole * CHUNK != t:
        per_token = torch.nn.functional.pad(per_token, (0, whole * CHUNK - t))
    sums_per_chunk = per_token.view(h, whole, CHUNK).sum(dim=2).t()  # [chunks of these tokens, H]
    out = torch.zeros(count, h, dtype=torch.int64, device=dev)
    if first < count:
        out[first:first + whole] = sums_per_chunk[:count - first]
    return out


def block_kv(cache, form, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks `ids` of one layer's cache of form `form` (pdctl.kv.forms) as K and V [len(ids), heads, block, D]:
    the logical KV, however the form packs it (views of one copy of the pages, in memory order)."""
    idx = torch.tensor(list(ids), dtype=torch.long, device=form.tensors(cache)[0].device)
    side = form.side()
    return side.layout.unpack(form.pages(cache, idx), side.shape)


def blocks_partials(cache, form, ids: Sequence[int], *, first_block: int, start: int, end: int, layer: int,
                    first_head: int, chunks: int) -> torch.Tensor:
    """`head_partials` of tokens start..end-1 of one layer held in blocks `ids` (consecutive blocks of the prompt,
    the first its block `first_block`) of a cache of form `form`: [chunks, heads]. Read in the form's own order."""
    n = form.block_size
    if start >= end:
        return torch.zeros(chunks, form.heads, dtype=torch.int64)
    lo, hi = start // n - first_block, -(-end // n) - first_block
    if lo < 0 or hi > len(ids):
        raise ValueError(f"tokens {start}..{end - 1} are not in blocks {first_block}..{first_block + len(ids) - 1}")
    k, v = block_kv(cache, form, ids[lo:hi])
    return head_partials(k, v, layer=layer, first_token=(first_block + lo) * n, first_head=first_head,
                         chunks=chunks, start=start, end=end)


@dataclass(frozen=True)
class Difference:
    """Where two fingerprints first differ: a chunk of CHUNK tokens and a KV head (the first differing pair past
    the chunk the check starts at), and the first layer whose sums differ (None: not known, the decode held a
    prefix itself)."""

    chunk: int
    head: int
    layer: int | None

    def describe(self, tokens: int) -> str:
        last = min(tokens, (self.chunk + 1) * CHUNK) - 1
        layer = "?" if self.layer is None else self.layer
        return f"layer {layer}, tokens {self.chunk * CHUNK}..{last}, KV head {self.head}"


@dataclass
class Fingerprint:
    """A request's prompt KV fingerprint: partial sums per (chunk, KV head) and per (layer, KV head), uint64 (sums
    modulo 2**64). Per head, so a decode rank holding some heads (TP) checks its share alone; per layer, so a
    mismatch names its first layer. Shares (layers, TP ranks, token splits) add up to the whole."""

    chunks: np.ndarray  # [chunks, heads]
    layers: np.ndarray  # [layers, heads]

    @classmethod
    def empty(cls, chunks: int, layers: int, heads: int) -> Fingerprint:
        return cls(np.zeros((chunks, heads), np.uint64), np.zeros((layers, heads), np.uint64))

    @property
    def heads(self) -> int:
        return self.chunks.shape[1]

    def add_layer(self, layer: int, first_head: int, sums: torch.Tensor) -> None:
        """Add one layer's head_partials [chunks, heads] of heads first_head.. (in place)."""
        part = sums.cpu().numpy().view(np.uint64)
        h = part.shape[1]
        self.chunks[:part.shape[0], first_head:first_head + h] += part
        with np.errstate(over="ignore"):
            self.layers[layer, first_head:first_head + h] += part.sum(axis=0, dtype=np.uint64)

    def __add__(self, other: Fingerprint) -> Fingerprint:
        def grown(a: np.ndarray, rows: int) -> np.ndarray:
            return np.concatenate([a, np.zeros((rows - a.shape[0], a.shape[1]), np.uint64)])
        c, n = max(len(self.chunks), len(other.chunks)), max(len(self.layers), len(other.layers))
        return Fingerprint(grown(self.chunks, c) + grown(other.chunks, c),
                           grown(self.layers, n) + grown(other.layers, n))

    def difference(self, got: Fingerprint, *, from_chunk: int = 0, heads: range | None = None) -> Difference | None:
        """Where `got` (the decode's) first differs from this one (the prefill's), over chunks from `from_chunk`
        (past the decode's own prefix) and heads `heads` (a TP rank's; default all), or None. The layer is named
        when the decode's sums cover the whole prompt (from chunk 0)."""
        heads = heads if heads is not None else range(self.heads)
        if got.heads != self.heads:
            return Difference(from_chunk, heads.start, None)
        rows = max(len(self.chunks), len(got.chunks))
        want, have = (np.concatenate([a, np.zeros((rows - len(a), a.shape[1]), np.uint64)])[from_chunk:,
                                                                                            heads.start:heads.stop]
                      for a in (self.chunks, got.chunks))
        differ = np.argwhere(want != have)
        if not len(differ):
            return None
        chunk, head = (int(x) for x in differ[0])
        layer = None
        if from_chunk == 0 and self.layers.shape == got.layers.shape:
            bad = np.flatnonzero(self.layers[:, heads.start + head] != got.layers[:, heads.start + head])
            layer = int(bad[0]) if len(bad) else None
        return Difference(from_chunk + chunk, heads.start + head, layer)
