"""pdctl.kv's (K, V)-pair form (vllm-gaudi's cache: separate K and V tensors per layer, two regions), its regions and
halves, and its receive processing without NIXL: bytes placed region by region as NIXL would place them (reads.halves:
a joined page's two halves pair with K and V), then converted, are the prompt's KV in the decode's form."""

import numpy as np
import pytest
import torch

from pdctl.kv.forms import FormError, KvPair, block_ids, form_of, joined_caches, kv_pair_form, kv_pairs
from pdctl.kv.reads import Peer, Region, as_halves, descriptors, halves, refusal, regions_of
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


def test_a_joined_page_is_read_as_two_halves_against_k_and_v():
    cache, form = joined_form("LBHNC", 8)
    (whole,) = regions_of(cache, form)
    first, second = halves([whole])
    assert (first.base, second.base - first.base, first.page_len, first.stride) == (
        whole.base, whole.page_len // 2, whole.page_len // 2, whole.stride)
    pair = kv_pairs("hpu", blocks=4, heads=H, block_size=8, head_dim=D)[0]
    k_region, v_region = regions_of(pair, kv_pair_form(pair))
    assert halves([k_region, v_region]) == [k_region, v_region]
    assert first.page_len == k_region.page_len  # region i pairs with region i, unit for unit
    with pytest.raises(ValueError, match="no two equal halves"):
        halves([Region(0, 9, 9, 1)])


def test_advertised_metadata_as_halves_lists_each_layers_two_halves():
    from dataclasses import dataclass

    @dataclass
    class Meta:
        kv_caches_base_addr: list
        block_lens: list
        block_strides: list
        num_blocks: int
        region_num_blocks: list | None = None

    m = as_halves(Meta([1000, 5000], [64, 64], [128, 128], 3))
    assert (m.kv_caches_base_addr, m.block_lens, m.block_strides, m.region_num_blocks) == (
        [1000, 1032, 5000, 5032], [32] * 4, [128] * 4, [3] * 4)


def joined_form(name, block, blocks=4):
    cache = joined_caches(name, blocks, H, block, D)[0]
    return cache, form_of(cache, "FLASH_ATTN")


def place(dst: np.ndarray, src: np.ndarray) -> None:
    """What a NIXL READ does: each src (address, length) run copied to its dst run."""
    import ctypes

    for (da, n), (sa, m) in zip(np.atleast_2d(dst).tolist(), np.atleast_2d(src).tolist(), strict=True):
        assert n == m
        ctypes.memmove(da, sa, n)


def read_units(local_regions, local_chunks, remote_regions, remote_chunks, pairs):
    """A READ of units `pairs` (local unit, remote unit), region i to region i, as vLLM's descriptors pair them."""
    for lr, rr in zip(local_regions, remote_regions, strict=True):
        local, remote = descriptors(lr, local_chunks), descriptors(rr, remote_chunks)
        for loc, rem in pairs:
            place(local[loc], remote[rem])


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
    # decode block b's sub-block j is b * 2 + j
    read_units(regions_of(pair, dform), 2, halves(regions_of(src, sform)), 1, [(2, 2), (3, 0), (4, 3)])
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
    # chunk c of prefill block b is b * 2 + c
    read_units(halves(regions_of(dst, dform)), 1, regions_of(pair, sform), 2, [(3, 2), (0, 3)])
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
