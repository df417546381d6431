"""The connector with a (K, V)-pair decode (vllm-gaudi's hpu cache, and its hpu_host buffer) reading a joined CUDA
prefill, without servers: the prefill's handshake metadata through the connector's add_remote_agent, vLLM's own
descriptor builders (_build_fa_local, _build_fa_remote) on what it hands them, each planned read unit copied byte
for byte as NIXL's READ would, then the connector's receive (the device post-process, or the host buffer before
vLLM's copy to the device). Every token of the prompt is read back from the decode's K and V tensors."""

import ctypes
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pdctl import protocol
from pdctl.connector import seam
from pdctl.connector.nixl import NixlPullConnectorWorker, PdctlNixlWorker
from pdctl.kv import reads
from pdctl.kv.forms import FormError, KvPair, joined_caches, kv_pair_form, kv_pairs

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import kv_conformance as kc  # noqa: E402

HEADS, HEAD_DIM, LAYERS = 2, 4, 2
NAMES = [f"layer.{i}" for i in range(LAYERS)]


def agent_meta(**given):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    fields = {f: None for f in NixlAgentMetadata.__dataclass_fields__}
    return NixlAgentMetadata(**{**fields, "engine_id": "p", "agent_metadata": b"", "device_id": 0, "ssm_sizes": (0, 0),
                                "physical_blocks_per_logical_kv_block": 1, "dcp_size": 1, "pcp_size": 1,
                                "region_members": [], "packed_member_layouts": {}, **given})


def hold(caches, form, kv: torch.Tensor, ids: list[int]) -> None:
    """Every layer's cache holds the prompt's KV `kv` [L, T, H, 2D] in blocks `ids`, in order."""
    block, tokens = form.block_size, kv.shape[1]
    for layer, cache in enumerate(caches):
        vals = kc.read_tokens(cache, form, ids)
        for row in range(len(ids)):
            lo, hi = row * block, min(tokens, (row + 1) * block)
            vals[row, :, :hi - lo] = kv[layer, lo:hi].transpose(0, 1)
        kc.write_tokens(cache, form, ids, vals)


def prefill_side(form: str, block: int, blocks: int, kv: torch.Tensor, ids: list[int]):
    """A joined prefill's caches holding the prompt's KV `kv` [L, T, H, 2D] in blocks `ids`, and the handshake
    metadata it advertises (vLLM's, one region per layer)."""
    caches = joined_caches(form, blocks, HEADS, block, HEAD_DIM, layers=LAYERS)
    form_ = kc.form_of(caches[0], "FLASH_ATTN")
    hold(caches, form_, kv, ids)
    regions = [reads.region_of(c, form_) for c in caches]
    meta = agent_meta(kv_caches_base_addr=[r.base for r in regions], num_blocks=blocks,
                      block_lens=[r.page_len for r in regions], block_strides=[r.stride for r in regions],
                      region_num_blocks=[r.blocks for r in regions], kv_cache_layout=form, block_size=block,
                      attn_backend_name="FLASH_ATTN", region_names=list(NAMES))
    return caches, meta


def gaudi_registration(w, buffers: dict) -> None:
    """What vllm-gaudi's register_kv_caches leaves on the worker: per layer K's region, then V's."""
    pairs = [kc_pair(buffers[name]) for name in NAMES]
    regions = [r for p in pairs for r in reads.regions_of(p, kv_pair_form(p))]
    w.kv_caches_base_addr = {w.engine_id: {0: [r.base for r in regions]}}
    w.block_len_per_layer = [r.page_len for r in regions]
    w.block_stride_per_layer = [r.stride for r in regions]
    w.region_num_blocks = [r.blocks for r in regions]


def kc_pair(raw) -> KvPair:
    return KvPair(*raw) if isinstance(raw, tuple) else KvPair(raw[0], raw[1])


def decode_worker(monkeypatch, block: int, blocks: int, host_buffer: bool):
    """A PdctlNixlWorker on a Gaudi decode, as far as the read and receive paths reach it."""
    w = object.__new__(PdctlNixlWorker)
    w.engine_id, w.tp_rank, w.world_size, w.block_size = "d", 0, 1, block
    w.backend_name, w._cpu_attn, w.kv_cache_layout = "HPU_ATTN", False, "LBNHC"
    w._received_packing, w._remote_block, w._split_ratio, w._windows, w._window_fills = {}, {}, {}, {}, {}
    w._staging_blocks, w._physical_blocks_per_logical_kv_block = 0, 1
    w._xfer_forms, w._pair_reads, w._prefix_hit, w._window_now = {}, set(), (), {}
    w._halved_engines = set()
    w.device_kv_caches = {n: tuple(p) for n, p in zip(NAMES, kv_pairs("hpu", blocks, HEADS, block, HEAD_DIM,
                                                                      layers=LAYERS), strict=True)}
    w.use_host_buffer = host_buffer
    w.host_xfer_buffers = {}
    if host_buffer:  # vllm-gaudi's: per layer one [2, B, H, N, D] allocation viewed as [2, B, N, H, D]
        w.host_xfer_buffers = {n: torch.zeros(2, blocks, HEADS, block, HEAD_DIM).permute(0, 1, 3, 2, 4)
                               for n in NAMES}
    w._forms = {n: w._form_of(c) for n, c in w.device_kv_caches.items()}
    w.transfer_topo, w.device_id, w._transfer_layer_region_indices, w._region_is_mla = object(), 0, [], []
    w._group_spec_types = []
    gaudi_registration(w, w._xfer_caches())
    monkeypatch.setattr(seam, "group_layer_names", lambda self, g: list(NAMES))
    monkeypatch.setattr(seam, "registers_kv_pairs", lambda: True)
    return w


def read_like_nixl(w, meta, local_ids: list[int], remote_ids: list[int]) -> int:
    """vLLM's read of one request: its descriptors from its own builders on what the connector handed it, the
    pairing by the connector's _map_block_ids_for_block_size_ratio, rows region-major; each unit copied."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    ratio = w.block_size // meta.block_size
    w._group_spec_types = [FullAttentionSpec]
    local = w._build_fa_local(w.kv_caches_base_addr["d"][0], ratio)
    plan = SimpleNamespace(source_ranks_per_group=((0,),), rank_offset_factor=0)
    remote = w._build_fa_remote(plan, meta, ratio)
    mapped, rem = w._map_block_ids_for_block_size_ratio([local_ids], [remote_ids], ratio)
    rem = reads.end_trimmed(mapped, rem)
    per_local, per_remote = len(local) // len(meta.block_lens), meta.num_blocks
    moved = 0
    for region in range(len(meta.block_lens)):
        for sub, blk in zip(mapped[0], rem[0], strict=True):
            (la, ll, _), (ra, rl, _) = local[region * per_local + sub], remote[region * per_remote + blk]
            assert ll == rl, "local and remote read units differ in length"
            ctypes.memmove(int(la), int(ra), int(ll))
            moved += int(ll)
    return moved


def decoded(w, ids: list[int]) -> torch.Tensor:
    """The decode's device cache for blocks `ids` as [L, T, H, 2D], token by token."""
    out = []
    for name in NAMES:
        pair = KvPair(*w.device_kv_caches[name])
        vals = kc.read_tokens(pair, w._forms[name], ids)  # [B, H, N, 2D]
        out.append(vals.permute(0, 2, 1, 3).reshape(-1, HEADS, 2 * HEAD_DIM))
    return torch.stack(out)


def handshake(monkeypatch, w, meta):
    """The connector's add_remote_agent; vLLM's part of it (NIXL, TP mapping) replaced by its validation, which
    the connector overrides for pairs with a (K, V) side."""
    handed = []

    def vllm_part(self, m, rank=0, tp=1, dcp=1):
        self._validate_remote_agent_handshake(m, tp, dcp)
        handed.append(m)
        return "agent"

    monkeypatch.setattr(NixlPullConnectorWorker, "add_remote_agent", vllm_part)
    assert w.add_remote_agent(meta) == "agent"
    return handed[0]


@pytest.mark.parametrize("host_buffer", [False, True], ids=["device", "host-buffer"])
@pytest.mark.parametrize("form", ["LBHNC", "LBNHC"])
def test_a_gaudi_decode_reads_a_cuda_prefill_through_the_connector(monkeypatch, form, host_buffer):
    """CUDA block 16 -> Gaudi block 128 (the recipe's pair), a partial last block: every prompt token lands in the
    decode's K and V tensors, the uncovered tail is zero."""
    pb, db, tokens = 16, 128, 150
    gen = torch.Generator().manual_seed(7)
    kv = torch.randn(LAYERS, tokens, HEADS, 2 * HEAD_DIM, generator=gen)
    p_ids = [9, 3, 5, 0, 11, 2, 8, 4, 1, 7][: -(-tokens // pb)]
    _, meta = prefill_side(form, pb, 12, kv, p_ids)
    w = decode_worker(monkeypatch, db, 4, host_buffer)
    w._check_pair_registration()
    handed = handshake(monkeypatch, w, meta)
    assert len(handed.block_lens) == 2 * LAYERS and handed.region_names == [n for n in NAMES for _ in (0, 1)]
    d_ids = [2, 0]
    moved = read_like_nixl(w, handed, d_ids, p_ids)
    assert moved == 2 * LAYERS * len(p_ids) * pb * HEADS * HEAD_DIM * 4
    if host_buffer:
        copied = []

        def copy_blocks(src, dst, src_ids, dst_ids, direction):  # vllm-gaudi's h2d copy: block by block
            for name in NAMES:
                k, v = dst[name]
                for s, d in zip(src_ids, dst_ids, strict=True):
                    k[d].copy_(src[name][0][s])
                    v[d].copy_(src[name][1][s])
            copied.append(list(dst_ids))

        w.copy_blocks = copy_blocks
        req = SimpleNamespace(local_physical_block_ids=[d_ids], remote=SimpleNamespace(engine_id="p",
                                                                                      block_ids=[p_ids]))
        w.sync_recved_kv_to_device("r", req)
        assert copied == [d_ids]
    w.post_process_device_kv_on_receive(db // pb, [(0, d_ids, len(p_ids))])  # vLLM calls it after the copy
    got = decoded(w, d_ids)
    assert torch.equal(got[:, :tokens], kv)
    assert not got[:, pb * len(p_ids):].any()  # past the last prefill block read: zeroed


def test_without_the_conversion_the_read_is_wrong(monkeypatch):
    """The negative control: the same read with the connector's receive skipped leaves K and V misplaced."""
    pb, db, tokens = 16, 128, 40
    kv = torch.randn(LAYERS, tokens, HEADS, 2 * HEAD_DIM, generator=torch.Generator().manual_seed(3))
    p_ids = [4, 1, 6]
    _, meta = prefill_side("LBHNC", pb, 8, kv, p_ids)
    w = decode_worker(monkeypatch, db, 2, False)
    read_like_nixl(w, handshake(monkeypatch, w, meta), [1], p_ids)
    assert not torch.equal(decoded(w, [1])[:, :tokens], kv)


def test_the_handshake_advertises_the_pair_form_and_names_it_in_refusals(monkeypatch):
    w = decode_worker(monkeypatch, 128, 2, True)
    assert w._advertised_isa() == "hpu_host"
    w.use_host_buffer, w.host_xfer_buffers, w._xfer_forms = False, {}, {}
    assert w._advertised_isa() == "hpu"
    # A joined prefill with a bigger block, and one at equal blocks into the device cache: not served yet.
    _, big = prefill_side("LBHNC", 256, 2, torch.zeros(LAYERS, 1, HEADS, 2 * HEAD_DIM), [0])
    with pytest.raises(RuntimeError, match=r"\(hpu: K and V tensors\).*bigger block is not served yet"):
        handshake(monkeypatch, w, big)
    _, equal = prefill_side("LBNHC", 128, 2, torch.zeros(LAYERS, 1, HEADS, 2 * HEAD_DIM), [0])
    with pytest.raises(RuntimeError, match="NHD -> hpu at equal block sizes into a device cache"):
        handshake(monkeypatch, w, equal)


def test_a_joined_decode_reads_a_gaudi_prefill_only_with_a_smaller_block_and_its_staging(monkeypatch):
    from tests.unit.connector.test_plan import isa_worker, remote_meta

    w, _ = isa_worker(monkeypatch, 128, None)
    w.backend_name, w._cpu_attn, w.kv_cache_layout = "FLASH_ATTN", False, "LBHNC"
    with pytest.raises(RuntimeError, match=r"\(hpu: K and V tensors\).*only with a smaller block .* 128 -> 128"):
        w.add_remote_agent(remote_meta(128, protocol.tag_backend("HPU_ATTN", "hpu")))
    w, _ = isa_worker(monkeypatch, 16, None)
    w.backend_name, w._cpu_attn, w.kv_cache_layout = "FLASH_ATTN", False, "LBHNC"
    with pytest.raises(RuntimeError, match="reserved 0 staging blocks, it needs at least 14"):
        w.add_remote_agent(remote_meta(128, protocol.tag_backend("HPU_ATTN", "hpu")))


def test_a_pair_cache_needs_vllm_gaudis_registration_and_it_is_checked(monkeypatch):
    w = decode_worker(monkeypatch, 128, 2, False)
    monkeypatch.setattr(seam, "registers_kv_pairs", lambda: False)
    with pytest.raises(FormError, match="unsupported KV cache: .*vllm-gaudi's .*hpu_nixl_connector, which did "
                                        "not load"):
        w._refuse_unregistrable_pairs()
    w._check_pair_registration()  # K then V per layer, as modelled
    w.block_len_per_layer = [2 * n for n in w.block_len_per_layer]  # one region per layer, as vLLM's own would
    with pytest.raises(FormError, match="layer.0's K and V were registered as .*does not match"):
        w._check_pair_registration()


def test_the_gaudi_decode_fingerprints_its_k_and_v_tensors_as_the_prefill_did(monkeypatch):
    """The fingerprint check on a Gaudi decode reads its (K, V) pairs: after the read, its share over the received
    blocks equals the joined prefill's; a flipped value in V is found (negative control)."""
    from pdctl.kv.fingerprint import Fingerprint, blocks_partials

    pb, db, tokens = 16, 128, 150
    kv = torch.randn(LAYERS, tokens, HEADS, 2 * HEAD_DIM, generator=torch.Generator().manual_seed(11))
    p_ids = [9, 3, 5, 0, 11, 2, 8, 4, 1, 7]
    caches, meta = prefill_side("LBNHC", pb, 12, kv, p_ids)
    form = kc.form_of(caches[0], "FLASH_ATTN")
    chunks = -(-tokens // 16)
    sent = Fingerprint.empty(chunks, LAYERS, HEADS)
    for layer, cache in enumerate(caches):
        sent.add_layer(layer, 0, blocks_partials(cache, form, p_ids, first_block=0, start=0, end=tokens, layer=layer,
                                                 first_head=0, chunks=chunks))
    w = decode_worker(monkeypatch, db, 4, False)
    read_like_nixl(w, handshake(monkeypatch, w, meta), [2, 0], p_ids)
    w.post_process_device_kv_on_receive(db // pb, [(0, [2, 0], len(p_ids))])
    w._fingerprint_init()
    monkeypatch.setattr(seam, "group_count", lambda self: 1)
    monkeypatch.setattr(seam, "group_full_attention", lambda self, g: True)
    monkeypatch.setattr(seam, "total_kv_heads", lambda self: HEADS)
    monkeypatch.setattr(seam, "kernel_blocks_per_block", lambda self: 1)
    got = w._share(([2, 0],), (0,), 0, tokens, physical=True)
    assert sent.difference(got) is None
    w.device_kv_caches["layer.1"][1][0, 5, 1, 2] += 1  # V of layer 1, block 2, token 5, head 1
    at = sent.difference(w._share(([2, 0],), (0,), 0, tokens, physical=True))
    assert at is not None and at.layer == 1


# -- a joined decode reading a Gaudi prefill ---------------------------------------------------------------------


class Wrapper:
    """NIXL's agent as vLLM's read path calls it: prepared lists kept, a prepared READ copied byte for byte."""

    def __init__(self):
        self.lists, self.copied = {}, 0

    def get_xfer_descs(self, descs, mem_type):
        return descs

    def prep_xfer_dlist(self, agent, descs):
        self.lists[len(self.lists)] = descs
        return len(self.lists) - 1

    def make_prepped_xfer(self, op, local, local_ids, remote, remote_ids, notif_msg=b""):
        assert op == "READ" and len(local_ids) == len(remote_ids)
        for lid, rid in zip(local_ids, remote_ids, strict=True):
            (la, ll, *_), (ra, rl, *_) = self.lists[local][lid], self.lists[remote][rid]
            assert ll == rl, "local and remote read units differ in length"
            ctypes.memmove(int(la), int(ra), int(ll))
            self.copied += int(ll)
        return "xfer"

    def transfer(self, handle):
        return "PROC"


def joined_decode(monkeypatch, form: str, block: int, blocks: int, staging: int):
    """A PdctlNixlWorker on a CUDA decode whose regions vLLM registered (one per layer)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    w = object.__new__(PdctlNixlWorker)
    w.engine_id, w.tp_rank, w.world_size, w.block_size = "d", 0, 1, block
    w.backend_name, w._cpu_attn, w.kv_cache_layout = "FLASH_ATTN", False, form
    w._received_packing, w._remote_block, w._split_ratio, w._windows, w._window_fills = {}, {}, {}, {}, {}
    w._staging_blocks, w._physical_blocks_per_logical_kv_block, w._staging = staging, 1, None
    w._xfer_forms, w._pair_reads, w._prefix_hit, w._window_now = {}, set(), (), {}
    w._halved_engines, w._halved_handles, w._halved_now = set(), {}, False
    w._halved_lock = threading.Lock()
    w._split_plans, w._split_fills, w._window_logged = {}, {}, set()
    caches = joined_caches(form, blocks, HEADS, block, HEAD_DIM, layers=LAYERS)
    w.device_kv_caches = dict(zip(NAMES, caches, strict=True))
    w.use_host_buffer, w.host_xfer_buffers = False, {}
    w._forms = {n: w._form_of(c) for n, c in w.device_kv_caches.items()}
    regions = [reads.region_of(c, w._forms[n]) for n, c in w.device_kv_caches.items()]
    w.kv_caches_base_addr = {"d": {0: [r.base for r in regions]}}
    w.block_len_per_layer = [r.page_len for r in regions]
    w.block_stride_per_layer = [r.stride for r in regions]
    w.region_num_blocks = [r.blocks for r in regions]
    w.region_group_ids, w.num_regions, w._uses_region_group_mapping = [0] * LAYERS, LAYERS, False
    w.dst_num_blocks, w.dst_region_num_blocks = {"d": blocks}, {"d": list(w.region_num_blocks)}
    w._transfer_layer_group_ids, w._transfer_layer_region_indices, w._region_is_mla = [], [], []
    w._has_mamba, w.dcp_size, w.device_id, w.region_mem_types = False, 1, 0, ["DRAM"] * LAYERS
    w._group_spec_types, w.kv_cache_config = [FullAttentionSpec], SimpleNamespace(transfer_groups=[None])
    w.nixl_wrapper, w._mixed_mem_types, w._recving_transfers = Wrapper(), False, {}
    w.transfer_topo = None  # set by handshake_and_read once the remote is known
    monkeypatch.setattr(seam, "group_layer_names", lambda self, g: list(NAMES))
    monkeypatch.setattr(seam, "group_count", lambda self: 1)
    monkeypatch.setattr(seam, "group_window", lambda self, g: None)
    return w


def gaudi_prefill(form: str, block: int, blocks: int, kv: torch.Tensor, ids: list[int]):
    """A Gaudi prefill's (K, V) pairs holding the prompt's KV in blocks `ids`, and the metadata it advertises: two
    regions per layer, its packing on the backend name (as pdctl's connector advertises it)."""
    pairs = kv_pairs(form, blocks, HEADS, block, HEAD_DIM, layers=LAYERS)
    pform = kv_pair_form(pairs[0])
    hold(pairs, pform, kv, ids)
    regions = [r for p in pairs for r in reads.regions_of(p, pform)]
    return pairs, agent_meta(kv_caches_base_addr=[r.base for r in regions], num_blocks=blocks,
                             block_lens=[r.page_len for r in regions], block_strides=[r.stride for r in regions],
                             region_num_blocks=[r.blocks for r in regions], kv_cache_layout="LBNHC", block_size=block,
                             attn_backend_name=protocol.tag_backend("HPU_ATTN", pform.name))


def handshake_and_read(monkeypatch, w, meta, d_ids, p_ids, tokens):
    """The connector's add_remote_agent (vLLM's part: its validation and remote descriptors, prepared), then one
    request's read through the connector's split planning and vLLM's own _read_blocks."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import ReadSpec

    plan = SimpleNamespace(source_ranks_per_group=((0,),), rank_offset_factor=0)
    remote = {}
    info = SimpleNamespace(remote_physical_blocks_per_logical=1, remote_dcp_size=1)
    w.transfer_topo = SimpleNamespace(get_engine_info=lambda e: info, block_size_ratio=lambda b: w.block_size // b)

    def vllm_part(self, m, rank=0, tp=1, dcp=1):
        self._validate_remote_agent_handshake(m, tp, dcp)
        remote["handle"] = self.nixl_wrapper.prep_xfer_dlist("p", self._build_fa_remote(plan, m, 1))
        remote["meta"] = m
        return "agent"

    monkeypatch.setattr(NixlPullConnectorWorker, "add_remote_agent", vllm_part)
    w.add_remote_agent(meta)
    m = remote["meta"]
    info.remote_block_size = m.block_size
    w.dst_num_blocks["p"], w.dst_region_num_blocks["p"] = m.num_blocks, m.region_num_blocks
    w.dst_region_group_ids, w.dst_uses_region_group_mapping = {"p": [0] * len(m.block_lens)}, {"p": False}
    req = SimpleNamespace(local_physical_block_ids=[list(d_ids)],
                          remote=SimpleNamespace(block_ids=[list(p_ids)], num_tokens=tokens, engine_id="p"))
    assert w._plan_split("r", req, meta.block_size // w.block_size, (0,))
    w._recving_transfers["r"] = []
    assert w._read_blocks(read_spec=ReadSpec(0, req.local_physical_block_ids, req.remote.block_ids),
                          dst_engine_id="p", request_id="r", remote_request_id="r",
                          local_xfer_side_handle=w.src_xfer_handles_by_block_size[w.block_size],
                          local_dram_handle=None, remote_xfer_side_handle=remote["handle"], expected_consumers=1,
                          awaiting_kvs=True)
    return w._split_plans.pop("r")


def joined_tokens(w, ids: list[int]) -> torch.Tensor:
    out = []
    for name in NAMES:
        vals = kc.read_tokens(w.device_kv_caches[name], w._forms[name], ids)  # [B, H, N, 2D]
        out.append(vals.permute(0, 2, 1, 3).reshape(-1, HEADS, 2 * HEAD_DIM))
    return torch.stack(out)


@pytest.mark.parametrize("pform", ["hpu", "hpu_host"])
@pytest.mark.parametrize("dform", ["LBHNC", "LBNHC"])
def test_a_cuda_decode_reads_a_gaudi_prefill_through_the_connector(monkeypatch, dform, pform):
    """Gaudi block 128 -> CUDA block 16 (the fleet's other direction), a partial last block: the decode's pages read
    as halves against the prefill's K and V regions through its own local list, split after receive; every token
    right, the slots past the prompt zero."""
    pb, db, tokens = 128, 16, 300
    kv = torch.randn(LAYERS, tokens, HEADS, 2 * HEAD_DIM, generator=torch.Generator().manual_seed(5))
    p_ids = [2, 0, 3]
    _, meta = gaudi_prefill(pform, pb, 4, kv, p_ids)
    w = joined_decode(monkeypatch, dform, db, 40, staging=14)
    w.src_xfer_handles_by_block_size = {db: "the whole-page list"}  # vLLM's own: never used for this prefill
    d_ids = list(range(3, 3 + -(-tokens // db)))
    plan = handshake_and_read(monkeypatch, w, meta, d_ids, p_ids, tokens)
    assert w._received_packing == {pb: pform} and w._split_ratio == {"p": pb // db}
    w._split_received(plan, {})
    got = joined_tokens(w, d_ids)
    assert torch.equal(got[:, :tokens], kv)
    assert not got[:, tokens:].any()
    # Negative control: the same read without the split after receive leaves the tokens misplaced.
    w2 = joined_decode(monkeypatch, dform, db, 40, staging=14)
    w2.src_xfer_handles_by_block_size = {db: "the whole-page list"}
    handshake_and_read(monkeypatch, w2, meta, d_ids, p_ids, tokens)
    assert not torch.equal(joined_tokens(w2, d_ids)[:, :tokens], kv)


def test_the_halved_read_is_refused_where_vllm_counts_descriptor_ids_otherwise(monkeypatch):
    """vLLM 0.34's _compute_desc_ids takes (regions, keys) pairs instead of 0.32's region groups: there the joined
    decode refuses a Gaudi prefill at the handshake instead of reading into the wrong descriptors."""
    assert seam.desc_ids_by_region_groups()  # the installed vLLM (0.32)
    _, meta = gaudi_prefill("hpu", 128, 2, torch.zeros(LAYERS, 1, HEADS, 2 * HEAD_DIM), [0])
    w = joined_decode(monkeypatch, "LBHNC", 16, 20, staging=14)
    monkeypatch.setattr(seam, "desc_ids_by_region_groups", lambda: False)
    with pytest.raises(RuntimeError, match="through vLLM 0.32's descriptor ids; this vLLM counts them otherwise"):
        handshake_and_read(monkeypatch, w, meta, [0], [0], 1)
