"""A request's KV fingerprint: what a prefill computed and what a decode holds, compared without moving the KV again.

The fingerprint of a stretch of KV is a sum, modulo 2**64, of one term per element: the element's bits times odd
weights of its logical coordinates (layer, token, KV head, K or V, dimension), each a fixed integer hash of them.
So it depends only on what is where logically, never on the cache's layout, block size or TP split; it is exact
(integer arithmetic on the bits, no rounding); and a sum does not depend on the order of its terms, so each side
adds its terms however its cache holds them, and TP ranks' shares (each over its own heads, named by their global
index) add up to the whole.

A request's fingerprint is a list of partial sums, one per `CHUNK` tokens of the prompt (the last one shorter), so
a decode that holds a prefix itself compares only the chunks it received: every block size pdctl serves is a
multiple of CHUNK, so a prefix hit ends on a chunk boundary.

What changes it: any changed bit of any element (a flipped byte); an element at another token, head, layer or
dimension (two tokens swapped, a block read from the wrong address, a head slice from the wrong rank); K and V
interchanged; a slot of the prompt left stale or zeroed. Slots past the prompt are not attended to and are not in
it. It is linear in the bits: two changes cancel only if their differences times their random weights sum to 0
mod 2**64, which no systematic misread does but with probability about 2**-64.

Pure torch on the tensors' own device: no vLLM, no NIXL.
"""

from __future__ import annotations

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


def _weights(layer: int, kv: int, first_head: int, heads: int, dim: int, device: torch.device) -> torch.Tensor:
    """An odd int64 per (head, dimension) of one layer's K or V: [heads, 1, dim]."""
    h = (first_head + torch.arange(heads, dtype=torch.int64, device=device)).view(heads, 1, 1)
    d = torch.arange(dim, dtype=torch.int64, device=device).view(1, 1, dim)
    return _mix(layer * _LAYER + kv * _KV + h * _HEAD + d * _DIM) | 1


def partials(k: torch.Tensor, v: torch.Tensor, *, layer: int, first_token: int, first_head: int = 0,
             chunks: int | None = None) -> list[int]:
    """One layer's partial sums, one per CHUNK tokens from token 0: `k`, `v` [heads, tokens, head_dim] in token
    order are tokens first_token.. of KV heads first_head.. (global indices). first_token must start a chunk;
    `chunks`: how many partial sums to return (default: those the tokens reach), the ones without tokens 0.

    An element's term is bits * w(layer, K or V, head, dim) * w(token): its bits as a signed integer times odd
    weights of its coordinates, so the sum factors into a weighted sum over heads and dims per token (one pass over
    the elements, the integer promotion fused into the multiply), then one weight per token. Any change of an
    element's bits changes its term (an odd weight times a nonzero difference below 2**32 is not 0 mod 2**64)."""
    if first_token % CHUNK:
        raise ValueError(f"token {first_token} does not start a fingerprint chunk of {CHUNK}")
    h, t, d = k.shape
    if v.shape != k.shape:
        raise ValueError(f"K {tuple(k.shape)} and V {tuple(v.shape)} differ in shape")
    dev = k.device
    per_token = torch.zeros(t, dtype=torch.int64, device=dev)
    # In slices of tokens: the int64 products of a slice stay small (a whole layer's would be allocated and paged
    # in afresh on every call, which measured up to 10x slower on CPU).
    step = max(CHUNK, SLICE_ELEMS // max(1, h * d) // CHUNK * CHUNK)
    for kv, values in enumerate((k, v)):
        bits, weights = _bits(values), _weights(layer, kv, first_head, h, d, dev)
        for s in range(0, t, step):
            per_token[s:s + step] += (bits[:, s:s + step] * weights).sum(dim=(0, 2))
    tokens = first_token + torch.arange(t, device=dev, dtype=torch.int64)
    per_token *= _mix(tokens * _TOKEN + _M1) | 1
    first = first_token // CHUNK
    count = chunks if chunks is not None else first + -(-t // CHUNK)
    out = torch.zeros(count, dtype=torch.int64, device=dev)
    index = tokens // CHUNK
    keep = index < count
    out.index_add_(0, index[keep], per_token[keep])
    return [x & MASK for x in out.tolist()]


def add(a: list[int], b: list[int]) -> list[int]:
    """Two shares' partial sums (layers, TP ranks, K and V) as one."""
    n = max(len(a), len(b))
    a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
    return [(x + y) & MASK for x, y in zip(a, b, strict=True)]


def first_difference(want: list[int], got: list[int], from_chunk: int = 0) -> int | None:
    """The first chunk at or past `from_chunk` whose partial sums differ (a missing one counts as 0), or None."""
    n = max(len(want), len(got))
    for i in range(from_chunk, n):
        if (want[i] if i < len(want) else 0) != (got[i] if i < len(got) else 0):
            return i
    return None
