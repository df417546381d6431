"""pdctl.connector.fingerprints without an engine: the prefill scheduler completes a request's kv_transfer_params
whichever comes first (its step's worker metadata or request_finished), TP shares add up, and a decode worker's
check over real caches of another block size passes on the prefill's KV and names the first difference otherwise
(negative control)."""

import queue
from types import SimpleNamespace

import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

from pdctl import protocol
from pdctl.connector.fingerprints import (
    COMPUTE_ATTR,
    EXPECT_ATTR,
    FingerprintScheduler,
    FingerprintShares,
    FingerprintWorker,
)
from pdctl.connector.stats import PdctlKVConnectorStats
from pdctl.kv.fingerprint import Fingerprint
from pdctl.kv.forms import form_of

LAYERS, HEADS, DIM, TOKENS = 2, 2, 8, 72


def fp_of(value: int) -> Fingerprint:
    fp = Fingerprint.empty(5, LAYERS, HEADS)
    fp.chunks[:] = value
    return fp


def scheduler(on: bool = True):
    s = object.__new__(FingerprintScheduler)
    s._fingerprint_init(on)
    s.fingerprint_blocks = lambda req_id: ([3, 4, 5],)
    return s


def prefill_request(rid="r", computed=0):
    return SimpleNamespace(request_id=rid, kv_transfer_params={"do_remote_decode": True}, num_computed_tokens=computed,
                           num_prompt_tokens=TOKENS)


def test_the_workers_fingerprint_the_step_that_computes_the_rest_of_a_prompt():
    s, req = scheduler(), prefill_request(computed=0)
    s._fingerprint_seen(req)
    meta = SimpleNamespace(reqs_to_recv={})
    s._fingerprint_meta(meta, SimpleNamespace(num_scheduled_tokens={"r": 40}))  # a first chunk only
    assert getattr(meta, COMPUTE_ATTR) == {}
    req.num_computed_tokens = 40
    s._fingerprint_meta(meta, SimpleNamespace(num_scheduled_tokens={"r": 32}))
    assert getattr(meta, COMPUTE_ATTR) == {"r": (([3, 4, 5],), TOKENS)} and getattr(meta, EXPECT_ATTR) == {}
    off = scheduler(on=False)
    off._fingerprint_seen(req)
    off._fingerprint_meta(meta, SimpleNamespace(num_scheduled_tokens={"r": 32}))
    assert getattr(meta, COMPUTE_ATTR) == {}


def test_the_params_get_the_fingerprint_whichever_comes_first_and_tp_shares_add_up():
    shares = FingerprintShares({"a": fp_of(1)}).aggregate(FingerprintShares({"a": fp_of(2), "b": fp_of(5)}))
    # vLLM hands the step's output to the connector after request_finished ...
    s = scheduler()
    params = {"do_remote_prefill": True}
    s._fingerprint_finished(prefill_request("a"), params)
    assert protocol.FINGERPRINT_KEY not in params
    s._fingerprint_output(SimpleNamespace(kv_connector_worker_meta=shares))
    sent = protocol.decode_fingerprint(params[protocol.FINGERPRINT_KEY])
    assert (sent.chunks == 3).all() and sent.difference(fp_of(3)) is None
    # ... or the other way round
    later = {"do_remote_prefill": True}
    s._fingerprint_finished(prefill_request("b"), later)
    assert protocol.decode_fingerprint(later[protocol.FINGERPRINT_KEY]).difference(fp_of(5)) is None
    assert not s._fp_ready and not s._fp_params


def test_a_decode_passes_the_expected_fingerprint_with_the_read_only_when_it_checks():
    for on in (True, False):
        s = scheduler(on)
        s._fingerprint_seen(SimpleNamespace(request_id="d", kv_transfer_params={
            "do_remote_prefill": True, protocol.FINGERPRINT_KEY: {"v": 2}}))
        meta = SimpleNamespace(reqs_to_recv={"d": object()})
        s._fingerprint_meta(meta, SimpleNamespace(num_scheduled_tokens={}))
        assert getattr(meta, EXPECT_ATTR) == ({"d": {"v": 2}} if on else {})


# -- a worker over real caches ------------------------------------------------------------------------------


class Worker(FingerprintWorker):
    def __init__(self, block: int, kv: torch.Tensor, blocks: list[int], windows: bool = False):
        """Caches of `block` tokens holding `kv` [layers, heads, tokens, 2 * dim] in blocks `blocks`, in order."""
        self._fingerprint_init()
        n = max(blocks) + 2
        self.device_kv_caches = {f"layer.{i}": torch.zeros(n, HEADS, block, 2 * DIM, dtype=torch.bfloat16)
                                 for i in range(LAYERS)}
        for i, cache in enumerate(self.device_kv_caches.values()):
            for j, b in enumerate(blocks):
                part = kv[i, :, j * block:(j + 1) * block]
                cache[b, :, :part.shape[1]] = part
        full = FullAttentionSpec(block_size=block, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)
        groups = [SimpleNamespace(kv_cache_spec=full, layer_names=list(self.device_kv_caches))]
        if windows:  # a sliding-window group is not fingerprinted
            groups.append(SimpleNamespace(kv_cache_spec=SlidingWindowSpec(
                block_size=block, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16, sliding_window=32),
                layer_names=[]))
        self.kv_cache_config = SimpleNamespace(transfer_groups=groups)
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(get_total_num_kv_heads=lambda: HEADS))
        self.tp_rank, self.world_size, self._physical_blocks_per_logical_kv_block = 0, 1, 1
        self.xfer_stats, self._receiving, self._failure_policy = PdctlKVConnectorStats(), {}, "fail"
        self._is_hma_required, self._invalid_block_ids = False, queue.Queue()

    def _form(self, name):
        return form_of(self.device_kv_caches[name], "FLASH_ATTN")

    def _cache(self, name):
        return self.device_kv_caches[name]


def kv_values():
    return torch.randn(LAYERS, HEADS, TOKENS, 2 * DIM, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)


def expected(kv) -> dict:
    prefill = Worker(16, kv, [7, 2, 9, 4, 1])  # 72 tokens in 5 blocks of 16
    prefill._fp_todo = {"r": (([7, 2, 9, 4, 1],), TOKENS)}
    shares = prefill.build_connector_worker_meta()
    assert len(prefill.xfer_stats.data[protocol.FINGERPRINT_SECONDS]) == 1  # the prefill's time, too
    return protocol.encode_fingerprint(shares.shares["r"])


def check(decode: Worker, want: dict, blocks: list[int], hit: int = 0) -> str | None:
    decode._fp_expected["r"] = want
    meta = SimpleNamespace(local_physical_block_ids=[blocks], remote=SimpleNamespace(num_tokens=TOKENS))
    decode._fingerprint_read("r", meta, (hit,))
    return decode._fingerprint_check("r")


def test_a_decode_of_another_block_size_holding_the_prefills_kv_passes_and_a_flipped_bit_is_named():
    kv = kv_values()
    want = expected(kv)
    assert check(Worker(32, kv, [5, 0, 3]), want, [5, 0, 3]) is None
    assert check(Worker(32, kv, [5, 0, 3], windows=True), want, [5, 0, 3]) is None
    bad = kv.clone()
    bad[1, 1, 40, 3] += 1  # layer 1, token 40, head 1
    decode = Worker(32, bad, [5, 0, 3])
    assert check(decode, want, [5, 0, 3]) == "layer 1, tokens 32..47, KV head 1"
    assert decode.xfer_stats.data[protocol.FINGERPRINTS_CHECKED] == [1]
    (spent,) = decode.xfer_stats.data[protocol.FINGERPRINT_SECONDS]  # the check's time, counted once
    assert 0 < spent < 5
    decode._fingerprint_failed("r", "layer 1, tokens 32..47, KV head 1", [[5, 0, 3]])
    assert decode._invalid_block_ids.get_nowait() == {5, 0, 3}
    assert decode.xfer_stats.data[protocol.FINGERPRINT_MISMATCHES] == [1]


def test_a_decode_prefix_hit_is_not_compared_and_a_bad_fingerprint_fails_closed():
    kv = kv_values()
    want = expected(kv)
    stale = kv.clone()
    stale[:, :, :32] = 0  # the decode's own first block (a prefix hit): not what it received
    assert check(Worker(32, stale, [8, 5, 0]), want, [5, 0], hit=1) is None
    wrong_after_hit = stale.clone()
    wrong_after_hit[0, 0, 33] += 1
    assert check(Worker(32, wrong_after_hit, [8, 5, 0]), want, [5, 0], hit=1) == "layer ?, tokens 32..47, KV head 0"
    assert "kv_transfer_params['pdctl_kv_fingerprint']" in check(Worker(32, kv, [5, 0, 3]), {"v": 9}, [5, 0, 3])
