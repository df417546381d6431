"""Property tests of pdctl.kv: after any conversion every token's K and V for every head equal the prefill's,
and uncovered tail slots are zero; transfer plans realise the same conversion byte for byte."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.kv.convert import (
    Range,
    Side,
    convert,
    merge_in_place,
    split_in_place,
    to_sequence,
    transfer_plan,
    zero_mask,
    zero_tokens_from,
)
from pdctl.kv.layouts import LAYOUTS, BlockShape, layout

LAYOUT_NAMES = sorted(LAYOUTS)


def execute_plan(plan: list[Range], raw_src: torch.Tensor, dst_shape: tuple[int, int]) -> torch.Tensor:
    """Copy a transfer plan's byte ranges into zeroed decode blocks of dst_shape=(blocks, elements): every byte
    in one indexed copy (a plan may have hundreds of thousands of ranges). Each range must lie inside its two
    blocks and no decode byte may be written twice."""
    src = raw_src.contiguous().view(torch.uint8).reshape(raw_src.shape[0], -1)
    esz = src.shape[1] // raw_src.shape[1]
    dst = torch.zeros(dst_shape[0], dst_shape[1] * esz, dtype=torch.uint8)
    if not plan:
        return dst.view(raw_src.dtype).reshape(dst_shape)
    sb, so, db, do, n = torch.from_numpy(np.array([(r.src_block, r.src_offset, r.dst_block, r.dst_offset, r.length)
                                                   for r in plan], dtype=np.int64)).T
    assert (n > 0).all() and (so >= 0).all() and (do >= 0).all()
    assert ((sb >= 0) & (sb < src.shape[0]) & (so + n <= src.shape[1])).all()
    assert ((db >= 0) & (db < dst.shape[0]) & (do + n <= dst.shape[1])).all()
    within = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
    to = torch.repeat_interleave(db * dst.shape[1] + do, n) + within
    assert torch.bincount(to).max() == 1
    dst.view(-1)[to] = src.reshape(-1)[torch.repeat_interleave(sb * src.shape[1] + so, n) + within]
    return dst.view(raw_src.dtype).reshape(dst_shape)


def _shape(name: str, heads: int, n: int, d: int) -> BlockShape:
    return BlockShape(heads, n, d)


@st.composite
def cases(draw, src_layout: str | None = None, dst_layout: str | None = None):
    src_l = src_layout or draw(st.sampled_from(LAYOUT_NAMES))
    dst_l = dst_layout or draw(st.sampled_from(LAYOUT_NAMES))
    base = draw(st.sampled_from([32, 64]))
    ratio = draw(st.sampled_from([1, 2, 4]))
    p_larger = draw(st.booleans())
    ns, nd = (base * ratio, base) if p_larger else (base, base * ratio)
    d = draw(st.sampled_from([32, 64]))
    tp_split = draw(st.sampled_from([1, 2]))  # decode TP / prefill TP
    heads_p = draw(st.sampled_from([2, 4]))
    rank = draw(st.integers(0, tp_split - 1))
    tokens = draw(st.integers(1, 3 * max(ns, nd) + 7))
    return src_l, dst_l, ns, nd, d, heads_p, tp_split, rank, tokens


def _sides(src_l, dst_l, ns, nd, d, heads_p, tp_split):
    return (Side(layout(src_l), BlockShape(heads_p, ns, d)),
            Side(layout(dst_l), BlockShape(heads_p // tp_split, nd, d)))


@settings(max_examples=150, deadline=None)
@given(cases())
def test_convert_preserves_every_token_and_zeroes_the_tail(case):
    src_l, dst_l, ns, nd, d, heads_p, tp_split, rank, tokens = case
    src, dst = _sides(src_l, dst_l, ns, nd, d, heads_p, tp_split)
    torch.manual_seed(tokens)
    raw = torch.randn(src.blocks_for(tokens), src.shape.elems, dtype=torch.float32)
    out = convert(raw, src, dst, tokens, head_offset=rank * dst.shape.heads)
    assert out.shape == (dst.blocks_for(tokens), dst.shape.elems)
    k_src, v_src = to_sequence(raw, src)
    k_dst, v_dst = to_sequence(out, dst)
    heads = slice(rank * dst.shape.heads, (rank + 1) * dst.shape.heads)
    assert torch.equal(k_dst[:, :tokens], k_src[heads, :tokens])
    assert torch.equal(v_dst[:, :tokens], v_src[heads, :tokens])
    assert not k_dst[:, tokens:].any() and not v_dst[:, tokens:].any()


@pytest.mark.parametrize("dst_layout", LAYOUT_NAMES)
@pytest.mark.parametrize("src_layout", LAYOUT_NAMES)
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_transfer_plan_equals_convert(src_layout, dst_layout, data):
    """4 examples for each pair of layouts (64 in all): one test per pair, as a plan with a head-major side has
    hundreds of thousands of ranges to build and replay."""
    case = data.draw(cases(src_layout, dst_layout))
    src_l, dst_l, ns, nd, d, heads_p, tp_split, rank, tokens = case
    src, dst = _sides(src_l, dst_l, ns, nd, d, heads_p, tp_split)
    raw = torch.randn(src.blocks_for(tokens), src.shape.elems).to(torch.bfloat16)
    want = convert(raw, src, dst, tokens, head_offset=rank * dst.shape.heads)
    plan = transfer_plan(src, dst, tokens, elem_size=2, head_offset=rank * dst.shape.heads)
    assert torch.equal(execute_plan(plan, raw, tuple(want.shape)), want)
    # Coalesced: no two ranges could have been one.
    for a, b in zip(plan, plan[1:], strict=False):
        assert not (a.src_block == b.src_block and a.dst_block == b.dst_block
                    and a.src_offset + a.length == b.src_offset and a.dst_offset + a.length == b.dst_offset)


def test_token_major_same_layout_plan_is_one_range_per_prefill_block():
    src = Side(layout("NHD"), BlockShape(2, 32, 64))
    dst = Side(layout("NHD"), BlockShape(2, 64, 64))
    plan = transfer_plan(src, dst, 128, 2)
    assert len(plan) == 4 and all(r.length == 32 * 2 * 2 * 64 * 2 for r in plan)
    # Head-major CPU layouts need per-head (and, for K^T, per-dimension) ranges: a post-receive pass is cheaper.
    vec = transfer_plan(Side(layout("cpu_vec"), src.shape), Side(layout("cpu_vec"), dst.shape), 128, 2)
    assert len(vec) > 10 * len(plan)


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_pack_unpack_round_trip(name):
    s = BlockShape(2, 64, 64)
    raw = torch.randn(3, s.elems)
    k, v = layout(name).unpack(raw, s)
    assert k.shape == (3, 2, 64, 64)
    assert torch.equal(layout(name).pack(k, v, s), raw)


@pytest.mark.parametrize("ratio", [2, 4])
@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_merge_in_place_matches_convert(name, ratio):
    recv = Side(layout(name), BlockShape(2, 32, 64))
    local = Side(layout(name), BlockShape(2, 32 * ratio, 64))
    tokens = 32 * ratio * 3
    raw = torch.randn(3 * ratio, recv.shape.elems)
    merged = merge_in_place(raw.reshape(3, -1), ratio, recv, local)
    assert torch.equal(merged, convert(raw, recv, local, tokens))


def test_cpu_vec_is_not_token_rows():
    """The upstream defect in one assert: vLLM's generic merge (token rows of 2D) is wrong for CPU vec."""
    recv = Side(layout("cpu_vec"), BlockShape(2, 32, 64))
    local = Side(layout("cpu_vec"), BlockShape(2, 64, 64))
    raw = torch.randn(2, recv.shape.elems)
    ours = merge_in_place(raw.reshape(1, -1), 2, recv, local)
    generic = raw.reshape(1, 2, 2, 32, 128).permute(0, 2, 1, 3, 4).reshape(1, -1)  # vLLM's view/permute/flatten
    assert not torch.equal(ours, generic)
    assert torch.equal(ours, convert(raw, recv, local, 64))


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_zero_tokens_from_zeroes_k_and_v_only_past_the_cut(name):
    side = Side(layout(name), BlockShape(2, 64, 64))
    raw = torch.randn(1, side.shape.elems)
    k, v = side.layout.unpack(zero_tokens_from(raw, side, 32), side.shape)
    k0, v0 = side.layout.unpack(raw, side.shape)
    assert torch.equal(k[:, :, :32], k0[:, :, :32]) and torch.equal(v[:, :, :32], v0[:, :, :32])
    assert not k[:, :, 32:].any() and not v[:, :, 32:].any()


def test_errors_are_clear():
    with pytest.raises(ValueError, match="unknown KV layout 'neon'"):
        layout("neon")
    with pytest.raises(ValueError, match="cpu_amx needs block size"):
        convert(torch.zeros(1, 2 * 16 * 2 * 64), Side(layout("cpu_amx"), BlockShape(2, 16, 64)),
                Side(layout("cpu_vec"), BlockShape(2, 32, 64)), 10)


@pytest.mark.parametrize("ratio", [2, 4])
@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_split_in_place_matches_convert(name, ratio):
    recv = Side(layout(name), BlockShape(2, 32 * ratio, 64))
    local = Side(layout(name), BlockShape(2, 32, 64))
    raw = torch.randn(3, recv.shape.elems)
    assert torch.equal(split_in_place(raw, ratio, recv, local), convert(raw, recv, local, 3 * 32 * ratio))
    # Read as `ratio` decode-sized byte chunks (what NIXL moves), the blocks reassemble exactly.
    chunks = raw.reshape(3 * ratio, -1)
    assert torch.equal(split_in_place(chunks.reshape(3, -1), ratio, recv, local), split_in_place(raw, ratio, recv,
                                                                                                  local))


@pytest.mark.parametrize("ratio", [2, 4])
def test_merge_across_cpu_isas_amx_prefill_into_vec_decode(ratio):
    """What the connector does when the handshake says the prefill packs KV for AMX and this decode uses vec."""
    recv = Side(layout("amx"), BlockShape(2, 32, 64))
    local = Side(layout("vec"), BlockShape(2, 32 * ratio, 64))
    raw = torch.randn(2 * ratio, recv.shape.elems)
    merged = merge_in_place(raw.reshape(2, -1), ratio, recv, local)
    k_in, v_in = layout("amx").unpack(raw, recv.shape)  # [blocks, heads, tokens, dim] per received block
    k_out, v_out = layout("vec").unpack(merged, local.shape)
    for t in range(2 * ratio * 32):
        b, j = divmod(t, 32)
        assert torch.equal(k_out[t // (32 * ratio), :, t % (32 * ratio)], k_in[b, :, j])
        assert torch.equal(v_out[t // (32 * ratio), :, t % (32 * ratio)], v_in[b, :, j])


@pytest.mark.parametrize("name", LAYOUT_NAMES)
def test_zero_mask_zeroes_what_zero_tokens_from_zeroes(name):
    """What the connector applies to a tail (a cached mask) against the oracle, at every cut."""
    side = Side(layout(name), BlockShape(2, 64, 64))
    raw = torch.randn(1, side.shape.elems).to(torch.bfloat16)
    for first in range(64):
        masked = raw.clone()
        masked[0].masked_fill_(zero_mask(side, first), 0)
        assert torch.equal(masked, zero_tokens_from(raw, side, first)), first
    assert not zero_mask(side, 64).any() and zero_mask(side, 0).all()
    # Negative control: the mask of another cut zeroes other slots.
    wrong = raw.clone()
    wrong[0].masked_fill_(zero_mask(side, 31), 0)
    assert not torch.equal(wrong, zero_tokens_from(raw, side, 32))
