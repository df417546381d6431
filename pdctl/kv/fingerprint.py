"""A request's KV fingerprint: what a prefill computed and what a decode holds, compared without moving the KV again.

The fingerprint of a stretch of KV is a sum, modulo 2**64, of one term per element. A term mixes the element's
logical coordinates (layer, token, KV head, K or V, dimension) with the bits of its value, through a fixed integer
hash. So it depends only on what is where logically, never on the cache's layout, block size or TP split; it is
exact (integer arithmetic on the bits, no rounding); and a sum does not depend on the order of its terms, so each
side adds its terms however its cache holds them, and TP ranks' shares (each over its own heads, named by their
global index) add up to the whole.

A request's fingerprint is a list of partial sums, one per `CHUNK` tokens of the prompt (the last one shorter), so
a decode that holds a prefix itself compares only the chunks it received: every block size pdctl serves is a
multiple of CHUNK, so a prefix hit ends on a chunk boundary.

What changes it: any changed bit of any element (a flipped byte); an element at another token, head, layer or
dimension (two tokens swapped, a block read from the wrong address, a head slice from the wrong rank); K and V
interchanged; a slot of the prompt left stale or zeroed. Slots past the prompt are not attended to and are not in
it. Two different KV stretches share a fingerprint with probability about 2**-64 per comparison.

Pure torch on the tensors' own device: no vLLM, no NIXL.
"""

from __future__ import annotations

import torch

CHUNK = 16  # tokens per partial sum
MASK = (1 << 64) - 1

# Odd 64-bit constants as signed int64 (torch's integer arithmetic wraps modulo 2**64).
_M1, _M2 = -7046029254386353131, -4658895280553007687  # 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB
_LAYER, _TOKEN, _HEAD, _KV, _DIM = (0x2545F4914F6CDD1D, 0x5851F42D4C957F2D, 0x14057B7EF767814F,
                                    0x1B873593CC9E2D51, 0x68E31DA4B5297CC1)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (arithmetic shifts: the same on every device, which is all that matters)."""
    x = (x ^ (x >> 31)) * _M1
    x = (x ^ (x >> 29)) * _M2
    return x ^ (x >> 32)


def _bits(values: torch.Tensor) -> torch.Tensor:
    """Each element's bits as a non-negative int64 (16-bit floats, 8-bit caches)."""
    if values.element_size() == 2:
        return values.view(torch.int16).to(torch.int64) & 0xFFFF
    if values.element_size() == 1:
        return values.view(torch.uint8).to(torch.int64)
    if values.element_size() == 4:
        return values.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    raise ValueError(f"a KV cache of {values.dtype}: pdctl fingerprints 1-, 2- and 4-byte elements")


def partials(k: torch.Tensor, v: torch.Tensor, *, layer: int, first_token: int, first_head: int = 0,
             chunks: int | None = None) -> list[int]:
    """One layer's partial sums, one per CHUNK tokens from token 0: `k`, `v` [heads, tokens, head_dim] in token
    order are tokens first_token.. of KV heads first_head.. (global indices). first_token must start a chunk;
    `chunks`: how many partial sums to return (default: those the tokens reach), the ones without tokens 0."""
    if first_token % CHUNK:
        raise ValueError(f"token {first_token} does not start a fingerprint chunk of {CHUNK}")
    h, t, d = k.shape
    if v.shape != k.shape:
        raise ValueError(f"K {tuple(k.shape)} and V {tuple(v.shape)} differ in shape")
    dev = k.device
    coord = (layer * _signed(_LAYER)
             + (first_token + torch.arange(t, device=dev, dtype=torch.int64)).view(1, t, 1) * _signed(_TOKEN)
             + (first_head + torch.arange(h, device=dev, dtype=torch.int64)).view(h, 1, 1) * _signed(_HEAD)
             + torch.arange(d, device=dev, dtype=torch.int64).view(1, 1, d) * _signed(_DIM))
    total = torch.zeros(t, dtype=torch.int64, device=dev)
    for kv, values in enumerate((k, v)):
        terms = _mix((coord + kv * _signed(_KV)) ^ (_bits(values) * _M3))
        total += terms.sum(dim=(0, 2))
    first = first_token // CHUNK
    count = chunks if chunks is not None else first + -(-t // CHUNK)
    out = torch.zeros(count, dtype=torch.int64, device=dev)
    index = first + torch.arange(t, device=dev) // CHUNK
    keep = index < count
    out.index_add_(0, index[keep], total[keep])
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
