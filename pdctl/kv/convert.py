"""Block-size, layout and head-slice conversion of one request's KV blocks, in both directions.

Everything goes through the canonical per-request sequence K[H, T, D], V[H, T, D]: a prefill's blocks are
unpacked and concatenated along tokens, then cut into the decode's block size and packed in the decode's layout.
Slots past the prompt's last token are zero, so stale bytes never reach attention.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pdctl.kv.layouts import BlockShape, Layout


@dataclass(frozen=True)
class Side:
    """One side of a transfer: its layout and block shape (heads = heads on that rank)."""

    layout: Layout
    shape: BlockShape

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.shape.block_size)


def to_sequence(raw: torch.Tensor, side: Side) -> tuple[torch.Tensor, torch.Tensor]:
    """raw [B, E] -> K, V [H, B*N, D]."""
    k, v = side.layout.unpack(raw, side.shape)
    h, d = side.shape.heads, side.shape.head_dim
    return k.transpose(0, 1).reshape(h, -1, d), v.transpose(0, 1).reshape(h, -1, d)


def from_sequence(k: torch.Tensor, v: torch.Tensor, side: Side, num_blocks: int) -> torch.Tensor:
    """K, V [H, T, D] -> raw [num_blocks, E]; tokens past T are zero."""
    h, t, d = k.shape
    n = side.shape.block_size
    slots = num_blocks * n
    if t < slots:
        pad = torch.zeros(h, slots - t, d, dtype=k.dtype, device=k.device)
        k, v = torch.cat([k, pad], dim=1), torch.cat([v, pad], dim=1)
    elif t > slots:
        k, v = k[:, :slots], v[:, :slots]
    kb = k.reshape(h, num_blocks, n, d).transpose(0, 1)
    vb = v.reshape(h, num_blocks, n, d).transpose(0, 1)
    return side.layout.pack(kb, vb, side.shape)


def convert(raw_src: torch.Tensor, src: Side, dst: Side, num_tokens: int, head_offset: int = 0) -> torch.Tensor:
    """A request's prefill blocks -> its decode blocks (any block sizes, layouts; decode heads a slice).

    raw_src: [blocks_for(num_tokens) on src, E_src]; returns [blocks_for(num_tokens) on dst, E_dst].
    head_offset: first prefill head this decode rank holds (decode TP > prefill TP).
    """
    if dst.shape.head_dim != src.shape.head_dim:
        raise ValueError(f"head dims differ: prefill {src.shape.head_dim}, decode {dst.shape.head_dim}")
    if head_offset + dst.shape.heads > src.shape.heads:
        raise ValueError(f"decode heads {head_offset}..{head_offset + dst.shape.heads} outside the prefill's "
                         f"{src.shape.heads}")
    src.layout.check(src.shape)
    dst.layout.check(dst.shape)
    k, v = to_sequence(raw_src, src)
    k = k[head_offset : head_offset + dst.shape.heads, :num_tokens]
    v = v[head_offset : head_offset + dst.shape.heads, :num_tokens]
    return from_sequence(k, v, dst, dst.blocks_for(num_tokens))


def _regroup(src: torch.Tensor, src_side: Side, dst_side: Side, ratio: int, merge: bool) -> torch.Tensor:
    """Concatenate (merge) or cut (split) blocks along tokens: one strided copy per layout token view."""
    if src_side.layout is not dst_side.layout:
        raise ValueError("regroup keeps the layout; use convert() to change it")
    lay = src_side.layout
    unit = lay.token_unit()
    small = src_side if merge else dst_side
    if small.shape.block_size % unit:
        raise ValueError(f"{lay.name} regroups in units of {unit} tokens; block {small.shape.block_size} is not one")
    n_big = src.shape[0] // ratio if merge else src.shape[0]
    out = torch.empty((n_big if merge else n_big * ratio, dst_side.shape.elems), dtype=src.dtype, device=src.device)
    big, little = (out, src) if merge else (src, out)
    big_side = dst_side if merge else src_side
    u = small.shape.block_size  # the largest unit: whole small blocks, so chunks are as long as they can be
    for bv, lv in zip(lay.token_views(big, big_side.shape, u), lay.token_views(little, small.shape, u), strict=True):
        # little: [n_big*ratio, *outer, u, c] -> [n_big, ratio, *outer, u, c] -> [n_big, *outer, ratio, u, c]
        lv = lv.unflatten(0, (n_big, ratio)).movedim(1, -3)
        bv = bv.unflatten(-2, (ratio, lv.shape[-2]))
        (bv.copy_(lv) if merge else lv.copy_(bv))
    return out


def merge_in_place(cache_blocks: torch.Tensor, ratio: int, received: Side, local: Side) -> torch.Tensor:
    """P < D: each local block holds `ratio` received blocks' raw bytes back to back; return it in local layout.

    cache_blocks: [B, E_local] (E_local == ratio * E_received).
    """
    if received.layout is local.layout:
        return _regroup(cache_blocks.reshape(-1, received.shape.elems), received, local, ratio, merge=True)
    b = cache_blocks.shape[0]
    k, v = received.layout.unpack(cache_blocks.reshape(b * ratio, -1), received.shape)
    h, n, d = received.shape.heads, received.shape.block_size, received.shape.head_dim
    k = k.reshape(b, ratio, h, n, d).transpose(1, 2).reshape(b, h, ratio * n, d)
    v = v.reshape(b, ratio, h, n, d).transpose(1, 2).reshape(b, h, ratio * n, d)
    return local.layout.pack(k, v, local.shape)


def split_in_place(remote_blocks: torch.Tensor, ratio: int, received: Side, local: Side) -> torch.Tensor:
    """P > D: whole received blocks [B, E_received] -> [B * ratio, E_local] decode blocks in local layout.

    The inverse pairing of merge_in_place: decode block c of received block b holds its tokens c*N..(c+1)*N.
    """
    b = remote_blocks.shape[0]
    if received.layout is local.layout:
        return _regroup(remote_blocks.reshape(b, -1), received, local, ratio, merge=False)
    k, v = received.layout.unpack(remote_blocks.reshape(b, -1), received.shape)
    h, n, d = local.shape.heads, local.shape.block_size, local.shape.head_dim
    k = k.reshape(b, h, ratio, n, d).transpose(1, 2).reshape(b * ratio, h, n, d)
    v = v.reshape(b, h, ratio, n, d).transpose(1, 2).reshape(b * ratio, h, n, d)
    return local.layout.pack(k, v, local.shape)


@functools.lru_cache(maxsize=1024)
def zero_mask(side: Side, first: int) -> torch.Tensor:
    """True at the elements zero_tokens_from(block, side, first) zeroes: computed once per (side, first), a tail
    is then zeroed by one masked_fill_ instead of an unpack, clone and pack per layer."""
    return zero_tokens_from(torch.ones(1, side.shape.elems, dtype=torch.int16), side, first).reshape(-1) == 0


@functools.lru_cache(maxsize=1024)
def slots_mask(side: Side, start: int, stop: int) -> torch.Tensor:
    """True at the elements of token slots [start, stop) of a block (a sliding-window block's head that the
    prefill no longer held, or its tail past the prompt)."""
    return zero_mask(side, start) & ~zero_mask(side, stop)


def zero_tokens_from(raw: torch.Tensor, side: Side, first: int) -> torch.Tensor:
    """Blocks [B, E] with every token slot >= first (within each block) zeroed, in the block's own layout."""
    k, v = side.layout.unpack(raw, side.shape)
    k, v = k.clone(), v.clone()
    k[:, :, first:] = 0
    v[:, :, first:] = 0
    return side.layout.pack(k, v, side.shape)


# ----------------------------------------------------------------------------------------------------------------
# Transfer plans: the same conversion as byte ranges, so NIXL can place bytes directly (no post-process pass).


@dataclass(frozen=True)
class Range:
    src_block: int  # index among the request's prefill blocks
    src_offset: int  # bytes into that block
    dst_block: int  # index among the request's decode blocks
    dst_offset: int
    length: int


def transfer_plan(src: Side, dst: Side, num_tokens: int, elem_size: int, head_offset: int = 0) -> list[Range]:
    """Byte ranges that realise convert() by copying, adjacent ranges coalesced. Uncovered slots are not in it."""
    n_src = src.blocks_for(num_tokens)
    e_src, e_dst = src.shape.elems, dst.shape.elems
    # Convert element *addresses* instead of values: each decode element learns which prefill element it is.
    addr = torch.arange(n_src * e_src, dtype=torch.float64).reshape(n_src, e_src) + 1  # 0 marks padding
    moved = convert(addr, src, dst, num_tokens, head_offset).to(torch.int64).reshape(-1) - 1
    dst_idx = torch.nonzero(moved >= 0).reshape(-1)
    src_idx = moved[dst_idx]
    if dst_idx.numel() == 0:
        return []
    # A run continues while both sides advance by one element and neither crosses a block boundary.
    brk = torch.ones_like(dst_idx, dtype=torch.bool)
    brk[1:] = ((dst_idx[1:] - dst_idx[:-1]) != 1) | ((src_idx[1:] - src_idx[:-1]) != 1) | (
        dst_idx[1:] % e_dst == 0) | (src_idx[1:] % e_src == 0)
    starts = torch.nonzero(brk).reshape(-1)
    ends = torch.cat([starts[1:], torch.tensor([dst_idx.numel()])])
    out = []
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        d0, s0 = int(dst_idx[s]), int(src_idx[s])
        out.append(Range(s0 // e_src, (s0 % e_src) * elem_size, d0 // e_dst, (d0 % e_dst) * elem_size,
                         (e - s) * elem_size))
    return out
