"""KV cache block layouts as pure tensor math.

A layout says where token n's K[d] and V[d] of head h live inside one block's memory. Every layout is modelled
by two inverse functions between a block's raw memory and canonical token-major K and V:

    unpack(raw[B, E]) -> K[B, H, N, D], V[B, H, N, D]      (E = H * N * 2 * D elements per block and layer)
    pack(K, V) -> raw[B, E]

Block-size conversion (both directions), head slicing for TP and transfer plans are all built from these two, so a
new layout is correct everywhere once its unpack/pack are (the property tests check the round trip).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockShape:
    heads: int  # KV heads on this rank
    block_size: int  # tokens per block (N)
    head_dim: int  # D

    @property
    def elems(self) -> int:
        return self.heads * self.block_size * 2 * self.head_dim


class Layout:
    """Base: subclasses implement unpack/pack for raw blocks of shape [B, E]."""

    name = "abstract"
    # A block's tokens are its outermost axis: blocks cut or joined along tokens are the same bytes (a merge or
    # split within the layout moves nothing).
    token_major = False
    # How many registered regions a page spans: 1 (one tensor per layer), or 2 for a cache handed as separate K
    # and V tensors, whose page is the K page then the V page (each in its own region, equal in size).
    regions = 1

    def unpack(self, raw: torch.Tensor, s: BlockShape) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def pack(self, k: torch.Tensor, v: torch.Tensor, s: BlockShape) -> torch.Tensor:
        raise NotImplementedError

    def check(self, s: BlockShape) -> None:
        """Raise ValueError when this layout cannot hold blocks of shape s."""

    def token_views(self, raw: torch.Tensor, s: BlockShape, unit: int) -> list[torch.Tensor]:
        """Views (no copies) of raw [B, E] that together cover it, each [B, *outer, N // unit, chunk]: groups of
        `unit` consecutive tokens whose bytes are one contiguous chunk. Concatenating blocks along tokens is then
        one strided copy per view (merge/split without a canonical round trip)."""
        raise NotImplementedError

    def token_unit(self) -> int:
        """The smallest `unit` token_views accepts (units must be multiples of it)."""
        return 1


class HND(Layout):
    """vLLM's LBHNC on CUDA/XPU: per block [H, N, 2D], a token's K then V in the last dim."""

    name = "HND"

    def unpack(self, raw, s):
        x = raw.reshape(-1, s.heads, s.block_size, 2 * s.head_dim)
        return x[..., : s.head_dim], x[..., s.head_dim :]

    def pack(self, k, v, s):
        return torch.cat([k, v], dim=-1).reshape(k.shape[0], -1)

    def token_views(self, raw, s, unit):
        return [raw.reshape(-1, s.heads, s.block_size // unit, unit * 2 * s.head_dim)]


class NHD(Layout):
    """vLLM's LBNHC: per block [N, H, 2D], token-major: a token range is one byte range."""

    name = "NHD"
    token_major = True

    def unpack(self, raw, s):
        x = raw.reshape(-1, s.block_size, s.heads, 2 * s.head_dim).transpose(1, 2)
        return x[..., : s.head_dim], x[..., s.head_dim :]

    def pack(self, k, v, s):
        return torch.cat([k, v], dim=-1).transpose(1, 2).reshape(k.shape[0], -1)

    def token_views(self, raw, s, unit):
        return [raw.reshape(-1, s.block_size // unit, unit * s.heads * 2 * s.head_dim)]


class CpuVec(Layout):
    """CPU_ATTN with the vec/vec16 ISA: per (block, head) K transposed [D][N], then V [N][D]."""

    name = "cpu_vec"

    def unpack(self, raw, s):
        x = raw.reshape(-1, s.heads, 2, s.block_size * s.head_dim)
        k = x[:, :, 0].reshape(-1, s.heads, s.head_dim, s.block_size).transpose(-1, -2)
        v = x[:, :, 1].reshape(-1, s.heads, s.block_size, s.head_dim)
        return k, v

    def pack(self, k, v, s):
        b = k.shape[0]
        kt = k.transpose(-1, -2).reshape(b, s.heads, 1, -1)
        return torch.cat([kt, v.reshape(b, s.heads, 1, -1)], dim=2).reshape(b, -1)

    def token_views(self, raw, s, unit):
        n, d = s.block_size, s.head_dim
        x = raw.reshape(-1, s.heads, 2, n * d)
        return [x[:, :, 0].unflatten(-1, (d, n // unit, unit)),  # K^T: per dim, tokens contiguous
                x[:, :, 1].unflatten(-1, (n // unit, unit * d))]  # V: per token, dims contiguous


class CpuAmx(Layout):
    """CPU_ATTN with the AMX ISA: K [N/16][D/2][16 tokens][2 dims], V [D/16][N/2][16 dims][2 tokens]."""

    name = "cpu_amx"

    def check(self, s):
        if s.block_size % 32 or s.head_dim % 32:
            raise ValueError(f"cpu_amx needs block size and head dim multiples of 32 (got {s.block_size}, "
                             f"{s.head_dim})")

    def unpack(self, raw, s):
        n, d, h = s.block_size, s.head_dim, s.heads
        x = raw.reshape(-1, h, 2, n * d)
        k = x[:, :, 0].reshape(-1, h, n // 16, d // 2, 16, 2).permute(0, 1, 2, 4, 3, 5).reshape(-1, h, n, d)
        v = x[:, :, 1].reshape(-1, h, d // 16, n // 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(-1, h, n, d)
        return k, v

    def pack(self, k, v, s):
        n, d, h = s.block_size, s.head_dim, s.heads
        b = k.shape[0]
        kr = k.reshape(b, h, n // 16, 16, d // 2, 2).permute(0, 1, 2, 4, 3, 5).reshape(b, h, 1, -1)
        vr = v.reshape(b, h, n // 2, 2, d // 16, 16).permute(0, 1, 4, 2, 5, 3).reshape(b, h, 1, -1)
        return torch.cat([kr, vr], dim=2).reshape(b, -1)

    def token_unit(self):
        return 16

    def token_views(self, raw, s, unit):
        n, d = s.block_size, s.head_dim
        x = raw.reshape(-1, s.heads, 2, n * d)
        # K: 16-token groups outermost. V: token pairs inside each 16-dim group (unit/2 pairs of 32 elements).
        return [x[:, :, 0].unflatten(-1, (n // unit, unit * d)),
                x[:, :, 1].unflatten(-1, (d // 16, n // unit, unit * 16))]


class KvSplit(Layout):
    """A cache handed as separate K and V tensors (Gaudi): a page is K's page then V's page, each in its own region.
    `heads_outer`: each of them [H, N, D] (the host buffer vllm-gaudi allocates), else [N, H, D] (its device cache,
    token-major)."""

    regions = 2

    def __init__(self, name: str, heads_outer: bool):
        self.name = name
        self.heads_outer = heads_outer

    def _dims(self, s: BlockShape) -> tuple[int, int]:
        return (s.heads, s.block_size) if self.heads_outer else (s.block_size, s.heads)

    def unpack(self, raw, s):
        x = raw.reshape(-1, 2, *self._dims(s), s.head_dim)
        if not self.heads_outer:
            x = x.transpose(2, 3)
        return x[:, 0], x[:, 1]

    def pack(self, k, v, s):
        x = torch.stack([k, v], dim=1)
        return (x if self.heads_outer else x.transpose(2, 3)).reshape(k.shape[0], -1)

    def token_views(self, raw, s, unit):
        if self.heads_outer:
            return [raw.reshape(-1, 2, s.heads, s.block_size // unit, unit * s.head_dim)]
        return [raw.reshape(-1, 2, s.block_size // unit, unit * s.heads * s.head_dim)]


# vllm-gaudi's two forms: its device cache (token-major K and V) and its host buffer (head-major K and V).
HPU, HPU_HOST = KvSplit("hpu", heads_outer=False), KvSplit("hpu_host", heads_outer=True)
LAYOUTS: dict[str, Layout] = {lay.name: lay for lay in (HND(), NHD(), CpuVec(), CpuAmx(), HPU, HPU_HOST)}
# The CPU attention ISAs that share a layout.
ISA_LAYOUT = {"vec": "cpu_vec", "vec16": "cpu_vec", "amx": "cpu_amx"}


# vLLM 0.32's KVCacheLayout names (vllm/v1/kv_cache_layout.py) -> the layout of one (layer, block) page. vLLM sees a
# cache group as logical [L, B, H, N, C] (C: one token's K then V for one head) and each name orders those axes in
# memory. pdctl.kv models a page as one contiguous run of bytes, which holds when H, N and C are the innermost axes:
# the block-compact layouts. LHBNC and BHLNC put the layer or block axis between heads, so a page is scattered.
VLLM_LAYOUTS = {"LBHNC": "HND", "BLHNC": "HND", "LBNHC": "NHD", "BLNHC": "NHD", "HND": "HND", "NHD": "NHD"}


def vllm_layout(name: str) -> Layout:
    """The layout of one (layer, block) page of a vLLM KV cache laid out as `name` (a KVCacheLayout name, or the
    legacy HND/NHD aliases of LBHNC/LBNHC)."""
    if name in ("LHBNC", "BHLNC"):
        raise ValueError(f"vLLM KV cache layout {name} does not keep a (layer, block) page contiguous; pdctl.kv "
                         f"models {', '.join(sorted(VLLM_LAYOUTS))}")
    if name not in VLLM_LAYOUTS:
        raise ValueError(f"unknown vLLM KV cache layout '{name}' (known: {', '.join(sorted(VLLM_LAYOUTS))})")
    return LAYOUTS[VLLM_LAYOUTS[name]]


def layout(name: str) -> Layout:
    name = ISA_LAYOUT.get(name, name)
    if name not in LAYOUTS:
        raise ValueError(f"unknown KV layout '{name}' (known: {', '.join(LAYOUTS)}; CPU ISAs: "
                         f"{', '.join(ISA_LAYOUT)}; neon is not modelled)")
    return LAYOUTS[name]
