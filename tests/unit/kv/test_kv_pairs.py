"""pdctl.kv's (K, V)-pair form (vllm-gaudi's cache: separate K and V tensors per layer, two regions), its regions and
read pieces, and its receive processing without NIXL: a unit's bytes placed where reads.in_pieces says, as NIXL would
place them, then converted, are the prompt's KV in the decode's form."""

import numpy as np
import pytest
import torch

from pdctl.kv.forms import FormError, KvPair, block_ids, form_of, joined_caches, kv_pair_form, kv_pairs
from pdctl.kv.reads import Peer, descriptors, in_pieces, refusal, regions_of
from pdctl.kv.receive import receive_merged, receive_split

H, D = 2, 4


def logical(cache, form, ids):
    """Blocks `ids` as K, V [len, H, N, D] through the form's pages."""
    side = form.side()
    return side.layout.unpack(form.pages(cache, block_ids(ids, cache)), side.shape)


@pytest.mark.parametrize("name", ["hpu", "hpu_host"])
def test_the_form_is_read_from_the_strides_and_its_pages_round_trip(name):
    pair = kv_pairs(name, blocks=5, heads=H, block_size=8, head_dim=D)[0]
    form = kv_pair_form(pair)
    assert form.name == name and form.half * 2 == form.page_elems
    k, v = torch.randn(5, H, 8, D), torch.randn(5, H, 8, D)
    pair.k.copy_(k.transpose(1, 2))
    pair.v.copy_(v.transpose(1, 2))
    got_k, got_v = logical(pair, form, [4, 0])
    assert torch.equal(got_k, k[[4, 0]]) and torch.equal(got_v, v[[4, 0]])
    form.zero_blocks(pair, block_ids([4], pair))
    assert not pair.k[4].any() and not pair.v[4].any() and pair.k[3].any()


def test_gaudis_padding_block_is_outside_the_view_and_its_regions():
    pair = kv_pairs("hpu", blocks=3, heads=H, block_size=8, head_dim=D)[0]
    storage = pair.k.untyped_storage().nbytes()
    assert storage == 4 * 8 * H * D * 4  # one more block than the view holds
    k_region, v_region = regions_of(pair, kv_pair_form(pair))
    assert k_region.base == pair.k.data_ptr() and v_region.base == pair.v.data_ptr()
    assert k_region.blocks == 3 and k_region.page_len == k_region.stride == 8 * H * D * 4


def test_forms_it_cannot_read_are_refused_by_name():
    k = torch.zeros(3, 8, H, D)
    with pytest.raises(FormError, match="laid out alike"):
        kv_pair_form(KvPair(k, torch.zeros(3, 8, H, 2 * D)))
    odd = torch.zeros(3, D, 8, H).permute(0, 2, 3, 1)  # D outermost in a page
    with pytest.raises(FormError, match="not one contiguous run"):
        kv_pair_form(KvPair(odd, odd.clone()))


def test_a_pair_unit_pairs_with_a_joined_page_k_half_first():
    joined = descriptors(regions_of(*joined_form("LBHNC", 8))[0], 1)
    pair = kv_pairs("hpu", blocks=4, heads=H, block_size=8, head_dim=D)[0]
    k_rows, v_rows = (descriptors(r, 1) for r in regions_of(pair, kv_pair_form(pair)))
    j, p = in_pieces([joined], 2), in_pieces([k_rows, v_rows], 2)
    assert j.shape == p.shape == (4, 2, 2)
    assert (j[:, 1, 0] - j[:, 0, 0] == j[:, 0, 1]).all()  # the page's two halves, in order
    assert (p[:, 0] == k_rows).all() and (p[:, 1] == v_rows).all()
    with pytest.raises(ValueError, match="do not share"):
        in_pieces([k_rows, v_rows], 3)


def joined_form(name, block, blocks=4):
    cache = joined_caches(name, blocks, H, block, D)[0]
    return cache, form_of(cache, "FLASH_ATTN")


def place(dst: np.ndarray, src: np.ndarray) -> None:
    """What a NIXL READ does: each src (address, length) run copied to its dst run."""
    import ctypes

    for (da, n), (sa, m) in zip(dst.tolist(), src.tolist(), strict=True):
        assert n == m
        ctypes.memmove(da, sa, n)


@pytest.mark.parametrize("prefill", ["LBHNC", "LBNHC"])
def test_joined_pages_merged_into_a_pair_are_the_prompts_kv(prefill):
    # CUDA block 4 -> Gaudi block 8 (ratio 2): prefill blocks [2, 0, 3] hold tokens 0..11; decode blocks [1, 2].
    src, sform = joined_form(prefill, 4)
    k, v = torch.randn(H, 12, D), torch.randn(H, 12, D)
    for i, b in enumerate([2, 0, 3]):
        src[b] = torch.cat([k[:, 4 * i:4 * i + 4], v[:, 4 * i:4 * i + 4]], dim=-1)
    pair = kv_pairs("hpu", blocks=3, heads=H, block_size=8, head_dim=D)[0]
    for t in pair:
        t.fill_(7)
    dform = kv_pair_form(pair)
    remote = in_pieces([descriptors(regions_of(src, sform)[0], 1)], 2)
    local = in_pieces([descriptors(r, 2) for r in regions_of(pair, dform)], 2)
    for sub, rem in zip([2, 3, 4], [2, 0, 3], strict=True):  # decode block b's sub-block j is b * 2 + j
        place(local[sub], remote[rem])
    receive_merged([(pair, dform)], [1, 2], 2, 3, packed="HND" if prefill == "LBHNC" else "NHD")
    got_k, got_v = logical(pair, dform, [1, 2])
    want_k = torch.cat([k, torch.zeros(H, 4, D)], dim=1).reshape(H, 2, 8, D).transpose(0, 1)
    want_v = torch.cat([v, torch.zeros(H, 4, D)], dim=1).reshape(H, 2, 8, D).transpose(0, 1)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_a_pair_split_into_joined_pages_is_the_prompts_kv():
    # Gaudi host buffer block 8 -> CUDA LBNHC block 4 (ratio 2): one prefill block, 6 tokens.
    from pdctl.kv.index import SplitChunk

    pair = kv_pairs("hpu_host", blocks=2, heads=H, block_size=8, head_dim=D)[0]
    k, v = torch.randn(H, 6, D), torch.randn(H, 6, D)
    pair.k[1, :6] = k.transpose(0, 1)
    pair.v[1, :6] = v.transpose(0, 1)
    sform = kv_pair_form(pair)
    dst, dform = joined_form("LBNHC", 4)
    remote = in_pieces([descriptors(r, 2) for r in regions_of(pair, sform)], 2)  # chunk c of block b: b * 2 + c
    local = in_pieces([descriptors(regions_of(dst, dform)[0], 1)], 2)
    place(local[3], remote[2])
    place(local[0], remote[3])
    chunks = [SplitChunk(src=2, dest=3, block=0, real=True), SplitChunk(src=3, dest=0, block=1, real=True)]
    receive_split([(dst, dform)], chunks, 2, 6, packed="hpu_host")
    assert torch.equal(dst[3], torch.cat([k[:, :4], v[:, :4]], dim=-1))
    assert torch.equal(dst[0][:, :2], torch.cat([k[:, 4:], v[:, 4:]], dim=-1)) and not dst[0][:, 2:].any()


def test_pairs_with_a_kv_pair_side_are_pdctls_whole_pages_only():
    cuda, gaudi = Peer("FLASH_ATTN", "LBHNC", 16, 1), Peer("CUSTOM", "LBNHC", 128, 1, "hpu")
    assert gaudi.kv_pair and not cuda.kv_pair and cuda.packing == "HND" and gaudi.packing == "hpu"
    assert refusal(cuda, gaudi) is None and refusal(gaudi, cuda) is None  # backends and layouts differ: converted
    assert "equal TP" in refusal(Peer("FLASH_ATTN", "LBHNC", 16, 2), Peer("CUSTOM", "LBNHC", 128, 1, "hpu"))
    assert "divide" in refusal(Peer("FLASH_ATTN", "LBHNC", 48, 1), gaudi)
