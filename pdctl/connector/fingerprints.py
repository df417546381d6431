"""Every transfer's KV checked (connector setting `kv_fingerprint`): the prefill computes the request's prompt KV
fingerprint (pdctl.kv.fingerprint) where the KV lies, in the step that computes it, and sends it with the request's
kv_transfer_params (pdctl.protocol.FINGERPRINT_KEY); each decode TP rank computes the same over the KV it received,
after conversion, for the heads it holds, and a mismatch fails the request's load through vLLM's failure path
(kv_load_failure_policy: recompute computes the prompt itself, fail ends the request with an error): never an
answer computed on KV other than the prefill's.

The prefill's fingerprint travels worker -> scheduler in vLLM's worker metadata (`FingerprintShares`, every TP
rank's share added), in the step whose output also finishes the request: vLLM hands that output's connector part
to the scheduler after it called request_finished, but before the request's kv_transfer_params leave the engine,
so the scheduler completes those parameters then (pdctl.connector.seam, "source" entry).

Covered: the full-attention groups' KV past the decode's own prefix hit (its prefix was computed by itself, on
its own device, never transferred). Sliding-window groups hold a window's tail, Mamba groups a state: not in the
fingerprint. Mixins of pdctl.connector.nixl's worker and of pdctl.connector.scheduler's scheduler.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from pdctl import protocol
from pdctl.connector import seam
from pdctl.connector.common import log
from pdctl.kv.fingerprint import CHUNK, Fingerprint, blocks_partials

COMPUTE_ATTR = "pdctl_fingerprint_compute"  # prefill metadata: req -> (block ids per group, prompt tokens computed)
EXPECT_ATTR = "pdctl_fingerprint_expect"  # decode metadata: req -> the prefill's fingerprint, as it was sent


class FingerprintShares(KVConnectorWorkerMetadata):
    """Worker -> scheduler: each request's fingerprint share this step (vLLM adds up the TP ranks' with
    `aggregate`)."""

    def __init__(self, shares: dict[str, Fingerprint]):
        self.shares = shares

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        for req_id, fp in getattr(other, "shares", {}).items():
            self.shares[req_id] = self.shares[req_id] + fp if req_id in self.shares else fp
        return self


class FingerprintScheduler:
    """The scheduler's part: which requests a prefill's workers fingerprint this step, and completing their
    kv_transfer_params; on a decode, handing each read's expected fingerprint to the workers."""

    def _fingerprint_init(self, on: bool) -> None:
        self._fp_on = on
        self.fingerprint_blocks = None  # the cache manager's get_block_ids (NixlConnector.bind_kv_cache_manager)
        self._fp_prompts: dict[str, Any] = {}  # prefill: req -> the request, until it finishes
        self._fp_ready: dict[str, Fingerprint] = {}  # prefill: computed before request_finished was called
        self._fp_params: dict[str, dict] = {}  # prefill: kv_transfer_params returned before the fingerprint came
        self._fp_expected: dict[str, Any] = {}  # decode: req -> the prefill's fingerprint, until its read is sent

    def _fingerprint_seen(self, request) -> None:
        params = request.kv_transfer_params or {}
        if self._fp_on and params.get("do_remote_decode"):
            self._fp_prompts[request.request_id] = request
        if self._fp_on and params.get("do_remote_prefill") and protocol.FINGERPRINT_KEY in params:
            self._fp_expected[request.request_id] = params[protocol.FINGERPRINT_KEY]

    def _fingerprint_meta(self, meta, scheduler_output) -> None:
        todo = {}
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._fp_prompts.get(req_id)
            if request is None or self.fingerprint_blocks is None:
                continue
            end = request.num_computed_tokens + n
            if end >= request.num_prompt_tokens:  # this step computes the rest of the prompt
                todo[req_id] = (self.fingerprint_blocks(req_id), request.num_prompt_tokens)
                del self._fp_prompts[req_id]
        setattr(meta, COMPUTE_ATTR, todo)
        setattr(meta, EXPECT_ATTR, {r: self._fp_expected.pop(r) for r in seam.reads_in(meta)
                                    if r in self._fp_expected})

    def _fingerprint_finished(self, request, params: dict | None) -> None:
        req_id = request.request_id
        self._fp_prompts.pop(req_id, None)
        self._fp_expected.pop(req_id, None)
        fp = self._fp_ready.pop(req_id, None)
        if params is not None and params.get("do_remote_prefill"):
            if fp is not None:
                params[protocol.FINGERPRINT_KEY] = protocol.encode_fingerprint(fp)
            elif self._fp_on:
                self._fp_params[req_id] = params

    def _fingerprint_output(self, connector_output) -> None:
        shares = getattr(connector_output.kv_connector_worker_meta, "shares", None) or {}
        for req_id, fp in shares.items():
            params = self._fp_params.pop(req_id, None)
            if params is not None:
                params[protocol.FINGERPRINT_KEY] = protocol.encode_fingerprint(fp)
            else:
                self._fp_ready[req_id] = fp
        # Parameters still waiting: their request's step computed no fingerprint (none will come).
        self._fp_params.clear()


class FingerprintWorker:
    """The worker's part: compute a prompt's share (prefill), check what arrived (decode)."""

    def _fingerprint_init(self) -> None:
        self._fp_todo: dict[str, tuple] = {}  # prefill: req -> (block ids per group, tokens), for this step
        self._fp_expected: dict[str, Any] = {}  # decode: req -> the prefill's fingerprint (wire form)
        self._fp_reads: dict[str, tuple] = {}  # decode: req -> (blocks per group, prefix hit per group, tokens)
        self._fp_layout: tuple | None = None

    def _fingerprint_metadata(self, metadata) -> None:
        self._fp_todo.update(getattr(metadata, COMPUTE_ATTR, None) or {})
        self._fp_expected.update(getattr(metadata, EXPECT_ATTR, None) or {})

    def _fingerprint_read(self, req_id: str, meta, prefix_hit: tuple[int, ...]) -> None:
        """Where the request's KV lands (before a P > D plan rewrites the read lists)."""
        if req_id in self._fp_expected and req_id not in self._fp_reads:
            self._fp_reads[req_id] = ([list(g) for g in meta.local_physical_block_ids or ()], prefix_hit,
                                      meta.remote.num_tokens)

    def _fingerprint_groups(self) -> tuple[list[tuple[int, list[str]]], dict[str, int], int, range, bool]:
        """(the fingerprinted groups and their layers, each layer's number, the model's KV heads, this rank's
        heads, whether this rank's share counts on a prefill: one of the ranks holding a replicated head)."""
        if self._fp_layout is None:
            groups = [(g, seam.group_layer_names(self, g)) for g in range(seam.group_count(self))
                      if seam.group_full_attention(self, g)]
            number = {name: i for i, name in enumerate(sorted(self.device_kv_caches))}
            total = seam.total_kv_heads(self)
            local = self._form(groups[0][1][0]).heads if groups else total
            replicas = max(1, self.world_size // total)
            first = self.tp_rank // replicas if replicas > 1 else self.tp_rank * local
            self._fp_layout = (groups, number, total, range(first, first + local), self.tp_rank % replicas == 0)
        return self._fp_layout

    def _share(self, block_ids, hit_blocks, start: int, end: int, physical: bool) -> Fingerprint:
        """This rank's fingerprint of tokens start..end-1: each fingerprinted group's blocks `block_ids[g]`, the
        first of them the request's block hit_blocks[g] (logical blocks, or physical when `physical`)."""
        groups, number, total, heads, _ = self._fingerprint_groups()
        chunks = -(-end // CHUNK)
        fp = Fingerprint.empty(chunks, len(number), total)
        per = seam.kernel_blocks_per_block(self)
        for g, names in groups:
            ids = list(block_ids[g])
            first = hit_blocks[g] if hit_blocks else 0
            if not physical:
                ids = [b * per + j for b in ids for j in range(per)]
            for name in names:
                form = self._form(name)
                fp.add_layer(number[name], heads.start, blocks_partials(
                    self._cache(name), form, ids, first_block=first * per, start=start, end=end,
                    layer=number[name], first_head=heads.start, chunks=chunks))
        return fp

    def build_connector_worker_meta(self):
        """Prefill: the shares of the prompts this step computed (after the forward pass wrote their KV)."""
        todo, self._fp_todo = self._fp_todo, {}
        if not todo:
            return None
        t0 = time.perf_counter()
        counts = self._fingerprint_groups()[4]
        shares = {}
        for req_id, (block_ids, tokens) in todo.items():
            fp = self._share(block_ids, (), 0, tokens, physical=False)
            shares[req_id] = fp if counts else Fingerprint.empty(len(fp.chunks), len(fp.layers), fp.heads)
        self.xfer_stats.record(protocol.FINGERPRINT_SECONDS, time.perf_counter() - t0)
        return FingerprintShares(shares)

    def _fingerprint_check(self, req_id: str) -> str | None:
        """Decode, once the request's KV arrived and was converted: None when it is the prefill's (or there was
        nothing to check), else where it first differs."""
        expected = self._fp_expected.pop(req_id, None)
        read = self._fp_reads.pop(req_id, None)
        if expected is None or read is None:
            return None
        block_ids, prefix_hit, tokens = read
        groups, _, _, heads, _ = self._fingerprint_groups()
        if not groups or not any(block_ids[g] for g, _ in groups):
            return None
        start = max((prefix_hit[g] if prefix_hit else 0) * seam.group_block_size(self, g) for g, _ in groups)
        start = -(-start // CHUNK) * CHUNK
        try:
            want = protocol.decode_fingerprint(expected)
        except protocol.FingerprintError as e:
            return str(e)
        self.xfer_stats.record(protocol.FINGERPRINTS_CHECKED)
        if start >= tokens:
            return None
        t0 = time.perf_counter()
        got = self._share(block_ids, prefix_hit, start, tokens, physical=True)
        at = want.difference(got, from_chunk=start // CHUNK, heads=heads)
        self.xfer_stats.record(protocol.FINGERPRINT_SECONDS, time.perf_counter() - t0)
        return None if at is None else at.describe(tokens)

    def _fingerprint_failed(self, req_id: str, why: str, block_ids) -> None:
        engine, host, port = (self._receiving.get(req_id) or ("?", "?", "?"))[:3]
        log.warning(protocol.FINGERPRINT_MISMATCH_FORMAT, req_id, engine, host, port, self.tp_rank, why,
                    self._failure_policy)
        self.xfer_stats.record(protocol.FINGERPRINT_MISMATCHES)
        seam.report_invalid_blocks(self, {b for g in block_ids for b in g})
