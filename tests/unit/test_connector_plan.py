"""The connector's P > D read planning, without servers: which prefill chunk lands in which decode block."""

from types import SimpleNamespace

import pytest
import torch

from pdctl.connector.nixl import PdctlNixlWorker, _as_decode_sized


def worker(block_size=32, staging=8, total_blocks=100):
    w = object.__new__(PdctlNixlWorker)  # no vLLM engine: only the planning state
    w.block_size, w._staging_blocks, w._staging_free = block_size, staging, None
    w.device_kv_caches = {"layer0": torch.zeros(total_blocks, 1, 1, 2)}
    w._cached_blocks, w._split_plans, w._failure_policy = (), {}, "recompute"
    return w


def meta(local, remote, tokens):
    return SimpleNamespace(local_physical_block_ids=[list(local)], remote=SimpleNamespace(
        num_tokens=tokens, block_ids=[list(remote)]))


def test_partial_last_prefill_block_reads_its_missing_chunk_into_staging():
    w, m = worker(), meta([10, 11, 12], [5, 6], tokens=70)  # P64 -> D32: 70 tokens = 3 decode blocks
    assert w._plan_split("r", m, 2)
    assert m.remote.block_ids == [[10, 11, 12, 13]]  # prefill blocks 5, 6 as decode-sized chunks
    assert m.local_physical_block_ids == [[10, 11, 12, 92]]  # chunk 13 has no decode block: staging (92..99)
    (groups, tokens), = w._split_plans.values()
    assert tokens == 70 and [[real for _, _, real in g] for g in groups[0]] == [[True, True], [True, False]]
    w._release(groups)
    assert sorted(w._staging_free) == list(range(92, 100))


def test_decode_prefix_hit_inside_a_prefill_block():
    w = worker()
    w._cached_blocks = (1,)  # the decode holds decode block 0 (tokens 0-31) from its own prefix cache
    m = meta([11, 12], [5, 6], tokens=70)
    assert w._plan_split("r", m, 2)
    # Prefill block 5 is still read whole: its chunk 0 goes to staging (block 0 is cached and shared).
    assert m.remote.block_ids == [[10, 11, 12, 13]]
    assert m.local_physical_block_ids == [[92, 11, 12, 93]]


def test_aligned_prompt_needs_no_staging_and_release_is_safe():
    w, m = worker(), meta([10, 11], [5], tokens=64)
    assert w._plan_split("r", m, 2)
    assert m.local_physical_block_ids == [[10, 11]] and w._staging_free is None
    w._release(w._split_plans["r"][0])  # nothing was ever taken: a no-op, not an AttributeError


def test_staging_exhausted_falls_back_and_returns_what_it_took():
    w = worker(staging=1)
    first = meta([1, 2, 3], [5, 6], tokens=70)
    assert w._plan_split("a", first, 2) and w._staging_free == []
    assert not w._plan_split("b", meta([7, 8, 9], [7, 8], tokens=70), 2)
    assert w._staging_free == []  # b took nothing; a still holds the only slot


def test_decode_sized_view_of_the_prefill_metadata():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    fields = {f: None for f in NixlAgentMetadata.__dataclass_fields__}
    m = NixlAgentMetadata(**{**fields, "engine_id": "p", "agent_metadata": b"", "kv_caches_base_addr": [0],
                             "device_id": 0, "num_blocks": 10, "block_lens": [4096], "block_strides": [4096],
                             "kv_cache_layout": "LBHNC", "block_size": 64, "ssm_sizes": (0, 0),
                             "attn_backend_name": "CPU_ATTN", "physical_blocks_per_logical_kv_block": 1,
                             "region_num_blocks": [10], "dcp_size": 1, "pcp_size": 1, "region_members": [],
                             "packed_member_layouts": {}})
    v = _as_decode_sized(m, 2)
    assert (v.block_size, v.num_blocks, v.block_lens, v.block_strides, v.region_num_blocks) == (
        32, 20, [2048], [2048], [20])
    assert m.block_size == 64  # the original is untouched


@pytest.mark.parametrize("tokens,expected_last", [(64, 2), (65, 3), (1, 1)])
def test_only_blocks_with_tokens_receive(tokens, expected_last):
    w, m = worker(), meta([10, 11, 12, 13], [5, 6], tokens=tokens)
    assert w._plan_split("r", m, 2)
    (groups, _), = w._split_plans.values()
    real = [d for g in groups[0] for d, _, r in g if r]
    assert real == [10, 11, 12, 13][:expected_last]


# -- the CPU attention ISA in the handshake ------------------------------------------------------------------


def test_backend_tag_round_trip():
    from pdctl.connector.nixl import tag_backend, untag_backend

    assert untag_backend(tag_backend("CPU_ATTN", "amx")) == ("CPU_ATTN", "amx")
    assert untag_backend("CPU_ATTN") == ("CPU_ATTN", None)  # a stock prefill sends no ISA
    assert tag_backend("FLASH_ATTN", None) == "FLASH_ATTN"


def isa_worker(monkeypatch, block_size, host_isa):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    w = object.__new__(PdctlNixlWorker)
    w.block_size, w.world_size, w.kv_cache_layout, w.backend_name = block_size, 1, "HND", "CPU_ATTN"
    w._cpu_attn, w._received_isa, w._staging_blocks, w.enable_permute_local_kv = True, {}, 0, False
    w._physical_blocks_per_logical_kv_block, w._split_ratio, w._remote_block = 1, {}, {}
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
    assert w._received_isa == {2: "amx"}  # the merge reads the received sub-blocks as AMX-packed


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
    assert seen == ["CPU_ATTN"] and seen2 == ["CPU_ATTN"] and w2._received_isa == {2: "vec"}


def _spin_pair(tmp_path):
    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    ctx = zmq.Context()
    addr = f"ipc://{tmp_path}/n"
    writer = SpinCondition(is_reader=False, context=ctx, notify_address=addr)
    reader = SpinCondition(is_reader=True, context=ctx, notify_address=addr)
    return ctx, writer, reader


def _close(ctx, *conds):
    for c in conds:
        for sock in (c.local_notify_socket, c.read_cancel_socket, c.write_cancel_socket):
            if sock is not None:
                sock.close(0)
    ctx.term()


def test_executor_queue_readers_stop_spinning_on_cpu(tmp_path):
    from pdctl.connector.nixl import _calm_message_queues

    ctx, writer, reader = _spin_pair(tmp_path)
    try:
        assert reader.busy_loop_s == 1  # vLLM's default: a second of spinning after every message
        assert _calm_message_queues({}, on_cpu=False) == 0
        assert reader.busy_loop_s == 1 and "wait" not in vars(reader)  # off CPU vLLM's own setting stays
        assert _calm_message_queues({}, on_cpu=True) >= 1  # the writer is no reader: left alone
        assert reader.busy_loop_s == 0 and "wait" in vars(reader) and "wait" not in vars(writer)
        _calm_message_queues({"worker_spin_s": 0.25}, on_cpu=False)
        assert reader.busy_loop_s == 0.25
    finally:
        _close(ctx, writer, reader)


def test_bounded_wait_outlives_a_lost_notify(tmp_path):
    """A notify that never comes (vLLM's PUB/SUB drops some) costs a busy reader ~1/8 of the time since its
    last read, where vLLM's own wait sleeps the whole timeout; a notify that comes still wakes it at once."""
    import time

    from pdctl.connector.nixl import _bounded_wait

    ctx, writer, reader = _spin_pair(tmp_path)
    reader.busy_loop_s = 0
    try:
        time.sleep(0.05)  # let the SUB connect
        reader.last_read = time.monotonic() - 0.010  # a decode step ago
        t0 = time.monotonic()
        _bounded_wait(reader, timeout_ms=300)
        bounded = time.monotonic() - t0
        reader.last_read = time.monotonic() - 0.010
        t0 = time.monotonic()
        type(reader).wait(reader, timeout_ms=300)  # vLLM's: waits for the notify that never comes
        stock = time.monotonic() - t0
        assert bounded < 0.05 and stock >= 0.29, (bounded, stock)
        # Idle for long: the poll grows up to the caller's timeout, and a notify cuts it short.
        reader.last_read = time.monotonic() - 100
        writer.notify()
        t0 = time.monotonic()
        _bounded_wait(reader, timeout_ms=2000)
        assert time.monotonic() - t0 < 0.5
        t0 = time.monotonic()
        _bounded_wait(reader, timeout_ms=200)  # the notify was consumed: nothing left to wake it
        assert time.monotonic() - t0 >= 0.19
    finally:
        _close(ctx, writer, reader)
