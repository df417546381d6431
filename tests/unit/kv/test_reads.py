"""pdctl.kv.reads: what each side registers and the address of every read, against the caches' own views; vLLM's
sub-block pairing reproduced (vLLM 0.32's own method, imported here, is the reference)."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
from vllm.v1.kv_cache_interface import FullAttentionSpec

from pdctl.kv.forms import form_of, joined_cache
from pdctl.kv.reads import Region, descriptors, end_trimmed, merge_mapping, region_of

FORMS = ["LBHNC", "LBNHC", "BLHNC", "BLNHC"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_every_chunk_is_where_the_cache_holds_that_part_of_the_page(form, chunks):
    for layer in range(3):
        cache = joined_cache(form, blocks=4, heads=2, block_size=8, head_dim=4, layers=3, layer=layer,
                             dtype=torch.bfloat16)
        f = form_of(cache, "FLASH_ATTN")
        region = region_of(cache, f)
        d = descriptors(region, chunks)
        assert d.shape == (4 * chunks, 2)
        for b in range(4):
            page = f.page(cache, b)  # a view: its data_ptr is where the page is
            step = page.numel() // chunks
            for c in range(chunks):
                assert d[b * chunks + c].tolist() == [page[c * step:].data_ptr(), step * 2]


def test_a_tp_part_is_the_ith_slice_of_each_chunk():
    r = Region(base=1000, page_len=64, stride=256, blocks=2)
    assert descriptors(r, 2, part=(1, 2)).tolist() == [[1016, 16], [1048, 16], [1272, 16], [1304, 16]]
    with pytest.raises(ValueError, match="does not cut"):
        descriptors(r, 3)
    with pytest.raises(ValueError, match="overlap"):
        Region(base=0, page_len=64, stride=32, blocks=1)


def vllm_mapping(local, remote, ratio):
    """vLLM 0.32's own _map_block_ids_for_block_size_ratio on attention groups."""
    w = SimpleNamespace(_group_spec_types=[FullAttentionSpec] * len(remote))
    w.get_mapped_blocks = lambda ids, r: NixlBaseConnectorWorker.get_mapped_blocks(w, ids, r)
    return NixlBaseConnectorWorker._map_block_ids_for_block_size_ratio(w, local, remote, ratio)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8), st.lists(st.tuples(st.integers(0, 6), st.integers(0, 30)), min_size=1, max_size=3))
def test_merge_mapping_is_vllms_without_a_prefix_hit(ratio, groups):
    local = [list(range(100 * g, 100 * g + n)) for g, (n, _) in enumerate(groups)]
    remote = [list(range(1000 * (g + 1), 1000 * (g + 1) + m)) for g, (_, m) in enumerate(groups)]
    assert merge_mapping(local, remote, ratio) == vllm_mapping(local, remote, ratio)


def test_merge_mapping_past_a_prefix_hit_pairs_by_tokens():
    # Decode block 4 x prefill block: the decode holds its first block (prefix hit), the prefill sent 10 blocks.
    local, remote = merge_mapping([[7, 8]], [list(range(10, 20))], 4, cached=[1])
    # Sub-blocks of blocks 7 and 8 (tokens 4..11 in prefill blocks) pair with prefill blocks 4..9 (the last 6).
    assert local == [[28, 29, 30, 31, 32, 33]]
    assert end_trimmed(local, remote) == [[14, 15, 16, 17, 18, 19]]
    assert merge_mapping([[]], [[1, 2]], 2) == ([], [[1, 2]])  # a full prefix hit: vLLM only notifies


def test_a_cpu_prefill_of_another_isa_is_converted_by_a_merge_or_a_split_and_refused_at_equal_blocks():
    from pdctl.kv.reads import Peer, refusal

    def cpu(block: int, isa: str) -> Peer:
        return Peer("CPU_ATTN", "HND", block, 1, isa)

    assert refusal(cpu(32, "amx"), cpu(64, "vec"), "vec") is None  # merged from amx's packing
    assert refusal(cpu(64, "amx"), cpu(32, "vec"), "vec") is None  # split from amx's packing
    assert refusal(cpu(64, "vec16"), cpu(64, "vec"), "vec") is None  # one layout
    why = refusal(cpu(64, "amx"), cpu(64, "vec"), "vec")  # no pass would convert it
    assert why and "ISA amx stores KV differently" in why and "block sizes differ" in why
