"""The connector's adaptation to vLLM, without servers: the prefill's metadata as decode-sized chunks and the CPU
attention ISA in the handshake. Which block goes where is pdctl.kv.index's (tests/unit/kv/test_index.py)."""

import pytest

from pdctl.connector.nixl import PdctlNixlWorker
from pdctl.kv.reads import as_decode_sized


def agent_meta(**given):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    fields = {f: None for f in NixlAgentMetadata.__dataclass_fields__}
    return NixlAgentMetadata(**{**fields, "engine_id": "p", "agent_metadata": b"", "kv_caches_base_addr": [0],
                                "device_id": 0, "num_blocks": 10, "block_lens": [4096], "block_strides": [4096],
                                "kv_cache_layout": "LBHNC", "block_size": 64, "ssm_sizes": (0, 0),
                                "attn_backend_name": "CPU_ATTN", "physical_blocks_per_logical_kv_block": 1,
                                "region_num_blocks": [10], "dcp_size": 1, "pcp_size": 1, "region_members": [],
                                "packed_member_layouts": {}, **given})


def test_decode_sized_view_of_the_prefill_metadata():
    m = agent_meta(block_strides=[8192])
    v = as_decode_sized(m, 2)
    # The stride stays page to page (a BL* stride spans every layer): the chunks' addresses are pdctl.kv.reads'.
    assert (v.block_size, v.num_blocks, v.block_lens, v.block_strides, v.region_num_blocks) == (
        32, 20, [2048], [8192], [20])
    assert m.block_size == 64  # the original is untouched


@pytest.mark.parametrize("form", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_a_bigger_prefill_block_is_read_chunk_by_chunk_from_each_page(form):
    """P > D: the remote descriptors the connector builds (vLLM's _build_fa_remote on the decode-sized handshake
    metadata, as the handshake makes it) address chunk c of prefill block b at page b + c * chunk, in every joined
    form. In the block-outermost ones a page's next chunk is not the stride / ratio away."""
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from pdctl.kv.forms import form_of, joined_cache

    ratio, layers = 2, 3
    caches = [joined_cache(form, blocks=5, heads=2, block_size=8, head_dim=4, layers=layers, layer=i)
              for i in range(layers)]
    forms = [form_of(c, "FLASH_ATTN") for c in caches]
    page = forms[0].page_elems * caches[0].element_size()
    meta = as_decode_sized(agent_meta(kv_caches_base_addr=[c.data_ptr() for c in caches], num_blocks=5,
                                      block_lens=[page] * layers, block_strides=[c.stride(0) * 4 for c in caches],
                                      region_num_blocks=[5] * layers, block_size=8, kv_cache_layout=form), ratio)
    w = object.__new__(PdctlNixlWorker)
    w.transfer_topo, w._group_spec_types, w._transfer_layer_region_indices = object(), [FullAttentionSpec], []
    w.block_len_per_layer, w._region_is_mla, w._split_ratio = meta.block_lens, [], {"p": ratio}
    w._halved_engines = set()
    plan = SimpleNamespace(source_ranks_per_group=((0,),), rank_offset_factor=0)
    descs = w._build_fa_remote(plan, meta, 1)
    want = [forms[i].region(caches[i], b)[0] + c * page // ratio
            for i in range(layers) for b in range(5) for c in range(ratio)]
    assert descs[:, 0].tolist() == want
    assert set(descs[:, 1].tolist()) == {page // ratio}


# -- the CPU attention ISA in the handshake ------------------------------------------------------------------


def test_backend_tag_round_trip():
    from pdctl.protocol import tag_backend, untag_backend

    assert untag_backend(tag_backend("CPU_ATTN", "amx")) == ("CPU_ATTN", "amx")
    assert untag_backend("CPU_ATTN") == ("CPU_ATTN", None)  # a stock prefill sends no ISA
    assert tag_backend("FLASH_ATTN", None) == "FLASH_ATTN"


def isa_worker(monkeypatch, block_size, host_isa):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    w = object.__new__(PdctlNixlWorker)
    w.block_size, w.world_size, w.kv_cache_layout, w.backend_name = block_size, 1, "HND", "CPU_ATTN"
    w._cpu_attn, w._received_packing, w._staging_blocks, w.enable_permute_local_kv = True, {}, 0, False
    w._physical_blocks_per_logical_kv_block, w._split_ratio, w._remote_block = 1, {}, {}
    w._windows = {}  # not a hybrid model
    w._forms, w._pair_reads, w._halved_engines = {}, set(), set()
    monkeypatch.setattr(PdctlNixlWorker, "_isa", lambda self, n: host_isa)
    seen = []
    monkeypatch.setattr(NixlPullConnectorWorker, "add_remote_agent",
                        lambda self, meta, *a, **k: seen.append(meta.attn_backend_name) or "ok")
    return w, seen


def remote_meta(block_size, backend):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    return NixlAgentMetadata(engine_id="p", agent_metadata=b"", kv_caches_base_addr=[0], device_id=0,
                             num_blocks=10, block_lens=[4096], block_strides=[4096], kv_cache_layout="HND",
                             block_size=block_size, ssm_sizes=(0, 0), attn_backend_name=backend,
                             physical_blocks_per_logical_kv_block=1)


def test_amx_prefill_into_vec_decode_is_merged_from_its_own_layout(monkeypatch):
    w, seen = isa_worker(monkeypatch, 64, "vec")
    assert w.add_remote_agent(remote_meta(32, "CPU_ATTN+pdctl-isa=amx")) == "ok"
    assert seen == ["CPU_ATTN"]  # vLLM's own code sees the plain backend name
    assert w._received_packing == {32: "amx"}  # the merge reads the received sub-blocks as AMX-packed


def test_a_bigger_prefill_block_of_another_isa_is_split_from_its_own_layout(monkeypatch):
    w, seen = isa_worker(monkeypatch, 32, "vec")
    w._staging_blocks = 2
    assert w.add_remote_agent(remote_meta(64, "CPU_ATTN+pdctl-isa=amx")) == "ok"
    assert w._received_packing == {64: "amx"} and w._split_ratio == {"p": 2}  # the split reads it as AMX-packed


def test_a_joined_prefills_packing_is_noted_for_its_merge(monkeypatch):
    w, seen = isa_worker(monkeypatch, 64, None)
    w.backend_name, w._cpu_attn = "FLASH_ATTN", False
    assert w.add_remote_agent(remote_meta(32, "FLASH_ATTN")) == "ok"
    assert w._received_packing == {32: "HND"}  # as vLLM's metadata says it: what the merge reads it as


def test_other_isa_at_equal_block_size_is_refused_naming_both(monkeypatch):
    w, seen = isa_worker(monkeypatch, 32, "vec")
    with pytest.raises(RuntimeError, match=r"ISA amx\).*\(ISA vec\).*ISA amx stores KV differently"):
        w.add_remote_agent(remote_meta(32, "CPU_ATTN+pdctl-isa=amx"))
    assert seen == []


def test_same_layout_isas_and_untagged_prefills_pass(monkeypatch):
    w, seen = isa_worker(monkeypatch, 32, "vec")
    w.add_remote_agent(remote_meta(32, "CPU_ATTN+pdctl-isa=vec16"))  # vec16 and vec share one layout
    w2, seen2 = isa_worker(monkeypatch, 64, "vec")
    w2.add_remote_agent(remote_meta(32, "CPU_ATTN"))  # stock prefill: this host's ISA is assumed
    assert seen == ["CPU_ATTN"] and seen2 == ["CPU_ATTN"] and w2._received_packing == {32: "vec"}



# -- hybrid models: sliding-window tails -------------------------------------------------------------------


def window_worker(block_size, windows):
    from types import SimpleNamespace

    w = object.__new__(PdctlNixlWorker)
    w.block_size, w._windows = block_size, windows
    w._fingerprint_init()
    w.kv_cache_config = SimpleNamespace(transfer_groups=[SimpleNamespace(kv_cache_spec=None)] * 2)
    return w


def window_meta(tokens, remote, local):
    from types import SimpleNamespace

    return SimpleNamespace(remote=SimpleNamespace(num_tokens=tokens, block_ids=remote, engine_id="p"),
                           local_physical_block_ids=local)


def test_window_tails_skip_the_prefills_null_entries_and_start_at_the_window():
    from pdctl.kv.window import window_pairs

    # 479 tokens, window 96: the decode's first query (token 479) needs keys 384..478. The prefill (block 32)
    # sent the last cdiv(96, 32) + 1 = 4 blocks, #11-14, #11 already vLLM's null block (id 0); the decode
    # (block 64) holds #6-7.
    w = window_worker(64, {0: 96})
    tails = w._window_tails(window_meta(479, [[0, 21, 22, 23], [1, 2]], [[50, 51], [60]]), 0, 96, 32)
    assert tails == dict(local=[50, 51], remote=[21, 22, 23], local_first=6, remote_first=12, prefill_block=32,
                         decode_block=64, tokens=479, need_from=384)
    plan = window_pairs(**tails)
    # decode #6 = tokens 384..447 = prefill #12, #13; decode #7 = #14 (tokens 448..479) and nothing past 479
    assert (plan.local, plan.remote) == ((100, 101, 102), (21, 22, 23))
    assert [f.zero for f in plan.fills] == [(), ((31, 64),)]


def test_window_tails_that_are_not_tails_are_refused():
    w = window_worker(64, {0: 96})
    assert w._window_tails(window_meta(100, [[1, 2, 3, 4, 5]], [[7]]), 0, 96, 32) is None  # 5 blocks > cdiv
    assert w._window_tails(window_meta(None, [[1]], [[7]]), 0, 96, 32) is None  # no prompt length


def test_prefill_backoff_only_for_sliding_window_groups(monkeypatch):
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import NixlBaseConnectorScheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from pdctl.connector.scheduler import PdctlNixlScheduler

    monkeypatch.setattr(NixlBaseConnectorScheduler, "_prefill_backoff", lambda self: 0)
    s = object.__new__(PdctlNixlScheduler)
    full = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=None)
    sliding = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=None, sliding_window=96)
    s.kv_cache_config = SimpleNamespace(transfer_groups=[SimpleNamespace(kv_cache_spec=full)])
    assert s._prefill_backoff() == 0
    s.kv_cache_config.transfer_groups.append(SimpleNamespace(kv_cache_spec=sliding))
    assert s._prefill_backoff() == 1


def test_a_full_prefix_hit_plans_no_window_read(monkeypatch):
    """A decode that holds the whole prompt gets empty block lists: nothing to pair (vLLM only notifies)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    from pdctl.connector import seam

    w = window_worker(64, {0: 96})
    w._read_delay_s, w._split_ratio, w._split_plans, w._receiving, w._trace = 0, {}, {}, {}, False
    w._window_now = {}
    w._gave_up, w._seen_at, w._posted_at, w._recving_transfers = set(), {}, {}, {}
    monkeypatch.setattr(seam, "has_remote_agent", lambda self, engine: True)
    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req", lambda self, req, meta: "read")
    meta = window_meta(479, [[0, 21, 22, 23], [1, 2]], ())
    meta.local_num_computed_blocks, meta.local_block_ids = (), ()
    meta.remote.host, meta.remote.port = "h", 1
    assert w._read_blocks_for_req("r", meta) == "read" and w._window_now == {}
