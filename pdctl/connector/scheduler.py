"""The decode's (and prefill's) scheduler side of pdctl's connector: the staging area reserved for prefill block >
decode block, the sliding-window backoff, when each request's KV parameters were seen (the workers' lease
decisions), and the scheduler's timing lines."""

from __future__ import annotations

import time

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

from pdctl.connector import seam
from pdctl.connector.common import log, settings, trace
from pdctl.connector.fingerprints import FingerprintScheduler

ARRIVED_ATTR = "pdctl_seen_at"  # on the connector metadata: req -> when the decode's scheduler saw its KV params


class PdctlNixlScheduler(FingerprintScheduler, NixlPullConnectorScheduler):
    def __init__(self, vllm_config, engine_id: str, kv_cache_config):
        staging = settings(vllm_config).staging_blocks
        if staging and vllm_config.kv_transfer_config.kv_role in ("kv_consumer", "kv_both"):
            # Reserve the staging area: the scheduler's block pool is built from this config right after the
            # connector, so the allocator never hands out the last `staging` blocks; the worker reads into them.
            if kv_cache_config.num_blocks <= 4 * staging:
                raise ValueError(f"pdctl connector: {kv_cache_config.num_blocks} KV blocks cannot spare "
                                 f"{staging} staging blocks; give the decode more KV cache memory")
            kv_cache_config.num_blocks -= staging
            log.info("pdctl connector: %d KV blocks reserved as staging for prefill block > decode block",
                     staging)
        self._trace = settings(vllm_config).trace
        self._traced: set[str] = set()  # remote-KV requests seen, until their KV is ready
        self._seen_at: dict[str, float] = {}  # req -> when its KV parameters were seen here, until sent to workers
        self._kv_ready: set[str] = set()  # ... then until the step that computes their first token
        self._fingerprint_init(settings(vllm_config).kv_fingerprint)
        super().__init__(vllm_config, engine_id, kv_cache_config)

    def _prefill_backoff(self) -> int:
        # vLLM's decode recomputes the prompt's last token, whose window starts one key before the window both
        # sides keep (that of the token after it): with a sliding-window group the prefill stops one token
        # short, as vLLM already does for Mamba, so both lay the window out for the token the decode computes.
        # Both sides run this connector (the topology requires it), so the two agree.
        windows = any(seam.group_window(self, g) for g in range(seam.group_count(self)))
        return max(super()._prefill_backoff(), 1 if windows else 0)

    # Timing lines (connector setting `trace`): when the decode's scheduler first saw a remote-KV request,
    # gave it blocks (its read goes to the worker with this step), learnt that its KV had arrived, and scheduled
    # the step that computes its first token.

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = request.kv_transfer_params or {}
        self._fingerprint_seen(request)
        if params.get("do_remote_prefill") and params.get("remote_engine_id"):
            self._seen_at.setdefault(request.request_id, time.monotonic())  # the prefill's lease began before
        if self._trace and request.request_id not in self._traced and params.get("do_remote_prefill"):
            self._traced.add(request.request_id)
            trace("sched_seen", request.request_id)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self._trace and num_external_tokens and request.request_id in self._traced:
            trace("sched_alloc", request.request_id)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request, block_ids):
        self._traced.discard(request.request_id)  # aborted before its KV or first token: followed no further
        self._seen_at.pop(request.request_id, None)
        self._kv_ready.discard(request.request_id)
        delay, params = super().request_finished(request, block_ids)
        self._fingerprint_finished(request, params)
        return delay, params

    def update_connector_output(self, connector_output) -> None:
        if self._trace:
            for req_id in connector_output.finished_recving or ():
                if req_id in self._traced:
                    self._traced.discard(req_id)
                    self._kv_ready.add(req_id)
                    trace("sched_kv_ready", req_id)
        self._fingerprint_output(connector_output)
        super().update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output):
        if self._trace and self._kv_ready:  # the step that computes the first token of a request whose KV arrived
            for req_id in self._kv_ready & scheduler_output.num_scheduled_tokens.keys():
                self._kv_ready.discard(req_id)
                trace("sched_first", req_id)
        meta = super().build_connector_meta(scheduler_output)
        # The workers decide whether a read may start (the lease) from when this scheduler saw the request: one
        # host, one monotonic clock.
        setattr(meta, ARRIVED_ATTR, {r: self._seen_at.pop(r) for r in seam.reads_in(meta) if r in self._seen_at})
        self._fingerprint_meta(meta, scheduler_output)
        return meta
