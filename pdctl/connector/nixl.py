"""pdctl's NIXL connector, loaded by vLLM from `kv_connector_module_path: pdctl.connector.nixl`.

A thin adapter over vLLM's NixlConnector (pull mode); every layout decision is pdctl.kv's. The worker is built from
small parts, each a module of its own:
- handshake.py: each side's exact CPU cache layout (the attention ISA) travels in vLLM's handshake; a prefill on
  another ISA is converted from (P < D) or refused, never misread; a pair the connector cannot serve fails there,
  with one message naming both sides;
- split.py: prefill block > decode block (vLLM refuses it): the prefill presented as decode-sized byte chunks,
  partial blocks through a staging area the scheduler reserved, each prefill block reassembled and split in the
  real layout on completion;
- windows.py: hybrid models (sliding-window + full-attention KV groups): window tails paired by absolute token
  position in both directions, what the prefill no longer holds zeroed;
- kv_pairs.py: Gaudi's separate K and V tensors per layer, read from and into every joined form;
- scheduler.py: the scheduler side (staging reserve, the sliding-window backoff, when each request's KV
  parameters were seen);
- peers.py, stats.py, common.py: whether a prefill is still there, pdctl's counters, the logger and timing lines.
This module holds the worker's read path: prefill block < decode block (received sub-blocks merged in the
cache's own form, CPU_ATTN's per-ISA packing included, the uncovered tail zeroed in it: pdctl.kv.receive), vLLM's
sub-block pairing past the decode's own prefix hit corrected (pdctl.kv.reads), NIXL's progress thread throttled
(`progress_delay_us`; nixl's Python wrapper hard-codes a spinning one), and every read bounded (pdctl.kv.lease).

The class keeps the name NixlConnector because several vLLM config checks test that name. Importing this module
has no side effects: vLLM imports it in the API server, the engine core and every worker. Every private vLLM/NIXL
name it relies on is listed and reached through pdctl.connector.seam (checked by scripts/check_vllm_compat.py).
Calming vLLM's executor queues on CPU is not the connector's: pdctl.vllm_plugin does it for every server pdctl
starts on CPU, aggregated ones included.
"""

from __future__ import annotations

import os
import threading
import time

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

from pdctl import protocol
from pdctl.connector import peers, seam
from pdctl.connector.common import log, settings, trace
from pdctl.connector.fingerprints import FingerprintWorker
from pdctl.connector.handshake import Handshake
from pdctl.connector.kv_pairs import KvPairCaches, kv_pair
from pdctl.connector.scheduler import ARRIVED_ATTR, PdctlNixlScheduler
from pdctl.connector.split import PrefillBlockSplit
from pdctl.connector.stats import PdctlKVConnectorStats, PdctlPromMetrics
from pdctl.connector.windows import SlidingWindowReads
from pdctl.kv import lease, reads
from pdctl.kv.forms import CacheForm, FormError, form_of, kv_pair_form
from pdctl.kv.index import SplitPlan, StagingPool
from pdctl.kv.receive import receive_merged
from pdctl.kv.window import WindowFill, WindowMerge

__all__ = ["NixlConnector"]


class PdctlNixlWorker(Handshake, KvPairCaches, PrefillBlockSplit, SlidingWindowReads, FingerprintWorker,
                      NixlPullConnectorWorker):
    def __init__(self, vllm_config, engine_id: str, kv_cache_config):
        s = settings(vllm_config)
        self.pdctl_settings = s
        affinity = os.sched_getaffinity(0)
        with seam.nixl_agent_settings(s.progress_thread, s.progress_delay_us):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        # The base worker pins this thread to the last core of each NUMA node; on a small host that puts every
        # instance's model thread on one core. Keep the binding vLLM's OMP setup chose.
        os.sched_setaffinity(0, affinity)
        self._cpu_attn = self.backend_name == "CPU_ATTN"
        if os.environ.get(protocol.QUEUE_SPIN_ENV) and not seam.spin_wait_patched():
            log.warning("pdctl connector: %s is set but vLLM's executor queues were not calmed: "
                        "pdctl's vLLM plugin did not load (pdctl not installed in this Python, or VLLM_PLUGINS "
                        "does not name pdctl_calm_queues); the queue readers spin", protocol.QUEUE_SPIN_ENV)
        self._trace = s.trace
        self._staging_blocks = s.staging_blocks
        self._staging: StagingPool | None = None  # the last staging_blocks ids of the cache, once first needed
        self._split_ratio: dict[str, int] = {}  # remote engine -> prefill block / decode block (> 1)
        self._split_plans: dict[str, SplitPlan] = {}  # req -> its P > D read, from the read to its completion
        # The decode's prefix hit of the read in progress (set only around vLLM's _read_blocks_for_req, which
        # calls _map_block_ids_for_block_size_ratio without the request).
        self._prefix_hit: tuple[int, ...] = ()
        # Sliding-window groups (hybrid models): group -> window, once the caches are known.
        self._windows: dict[int, int] | None = None
        self._window_now: dict[int, WindowMerge] = {}  # P < D: the read in progress's pairs, per window group
        self._window_fills: dict[tuple[int, int], tuple[WindowFill, ...]] = {}  # (group, first block) -> fills
        self._window_keys: dict[str, list[tuple[int, int]]] = {}  # req -> its keys above, until it is done
        self._split_fills: dict[str, dict[int, tuple[WindowFill, ...]]] = {}  # P > D: req -> group -> fills
        self._window_logged: set[str] = set()  # remote engines whose per-group read was logged
        self._received_packing: dict[int, str] = {}  # prefill block size -> how those prefills pack their pages
        self._remote_block: dict[str, int] = {}  # remote engine -> its block size (as it said at handshake)
        self._receiving: dict[str, tuple] = {}  # req -> (engine, host, port, decode blocks read, prompt tokens)
        self._received_tokens: dict[str, int] = {}  # remote engine -> prompt tokens received so far
        self._failure_policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        # Every read bounded, and started only while the prefill's hold on its blocks is known alive (pdctl.kv.lease).
        self._lease_s = float(vllm_config.kv_transfer_config.get_from_extra_config("kv_lease_duration",
                                                                                     lease.KV_LEASE_S))
        self._read_timeout_s = s.kv_read_timeout_s
        self._seen_at: dict[str, float] = {}  # req -> when the scheduler saw its KV parameters (monotonic)
        self._posted_at: dict[str, float] = {}  # req -> when its read was posted (monotonic), until it ends
        self._gave_up: set[str] = set()  # reads given up (timed out or refused), until vLLM reports them
        self._peers = peers.PeerWatch()  # whether a prefill whose read is in progress is still there
        self._forms: dict[str, CacheForm] = {}  # layer -> its cache's form, chosen when the caches are registered
        self._xfer_forms: dict[str, CacheForm] = {}  # layer -> the form of the buffer NIXL reads into (host or device)
        self._pair_reads: set[str] = set()  # remote engines read with a (K, V)-pair side (pdctl.connector.kv_pairs)
        self._halved_engines: set[str] = set()  # ... of them, the (K, V)-pair prefills this joined decode reads
        self._halved_handles: dict[int, int] = {}  # read block size -> the local list of this decode's halved pages
        self._halved_lock = threading.Lock()  # handshakes run in a thread of their own
        self._halved_now = False  # set on the engine's thread around a read into the halved list
        self.xfer_stats = PdctlKVConnectorStats()
        self._fingerprint_init()
        log.info("pdctl connector: backend %s, block %d, progress thread %s (delay %s us)", self.backend_name,
                 self.block_size, s.progress_thread, s.progress_delay_us)

    # -- pairing ---------------------------------------------------------------------------------------------

    def start_load_kv(self, metadata):
        self._seen_at.update(getattr(metadata, ARRIVED_ATTR, None) or {})
        self._fingerprint_metadata(metadata)
        return super().start_load_kv(metadata)

    def _read_blocks_for_req(self, req_id: str, meta):
        if req_id in self._gave_up:  # a read given up (refused, timed out) is never posted again
            return None
        remote = meta.remote
        seen = self._seen_at.get(req_id)
        # Decided when the read would be posted now (after the handshake; vLLM calls again once it is done).
        now = time.monotonic()
        if remote and seen is not None and seam.has_remote_agent(self, remote.engine_id) and \
                any(meta.local_physical_block_ids or ()) and \
                not lease.read_allowed(seen, now, self._lease_s, self._read_timeout_s):
            log.warning(protocol.LEASE_REFUSED_FORMAT, req_id, remote.engine_id, remote.host, remote.port,
                        now - seen, self._lease_s, self._read_timeout_s, self._failure_policy)
            self.xfer_stats.record(protocol.READS_REFUSED_LEASE)
            self._gave_up.add(req_id)
            seam.fail_recv(self, req_id)
            return None
        # The decode's own prefix-cache hit (blocks already computed) for this request, per group: vLLM's
        # sub-block pairing does not know it and shifts every pair when it is non-zero.
        prefix_hit = tuple(meta.local_num_computed_blocks or ())
        remote = meta.remote
        if remote and seam.has_remote_agent(self, remote.engine_id):
            self._fingerprint_read(req_id, meta, prefix_hit)
        ratio = self._split_ratio.get(remote.engine_id, 0) if remote else 0
        # Split once, after the handshake (the plan is pdctl's until the read completes; vLLM re-calls this
        # method for requests that waited for their handshake).
        if ratio and seam.has_remote_agent(self, remote.engine_id) and req_id not in self._split_plans:
            if not self._plan_split(req_id, meta, ratio, prefix_hit):
                seam.fail_recv(self, req_id)
                return None
        reading = any(meta.local_physical_block_ids or ())  # empty: a full prefix hit, vLLM only notifies
        if ratio == 0 and reading and remote and seam.has_remote_agent(self, remote.engine_id) and \
                self._window_groups():
            if not self._plan_window_merge(req_id, meta):
                seam.fail_recv(self, req_id)
                return None
        if remote and seam.has_remote_agent(self, remote.engine_id):
            read = sum(len(g) for g in meta.local_block_ids)
            self._receiving[req_id] = (remote.engine_id, remote.host, remote.port, read, remote.num_tokens)
        self._prefix_hit = prefix_hit  # for _map_block_ids_for_block_size_ratio, which vLLM calls in here
        if self._trace and remote and seam.has_remote_agent(self, remote.engine_id):
            trace("read_issued", req_id)
        issued = time.monotonic()
        try:
            posted = super()._read_blocks_for_req(req_id, meta)
            if seam.reading(self, req_id):
                # From before the post: posting itself can block (NIXL's first notification to a prefill wires up
                # UCX's message lane inside it), and that wait is the read's too.
                self._posted_at.setdefault(req_id, issued)
            if self._trace and remote and seam.has_remote_agent(self, remote.engine_id):
                trace("read_posted", req_id)
            return posted
        finally:
            self._prefix_hit = ()
            self._window_now = {}

    def _give_up_late_reads(self) -> None:
        """Reads in progress past connector.kv_read_timeout_s, or from a prefill that is gone, fail through vLLM's
        failure path: each NIXL handle is released (NIXL cancels it) or, where NIXL cannot, kept and polled until
        it ends, so the request's blocks go back to the allocator (or are recomputed into) only once no transfer
        can still write them."""
        if not self._posted_at:  # every engine step comes here; most have no read in progress
            return
        now = time.monotonic()
        posted = {r: t for r, t in self._posted_at.items() if r not in self._gave_up}
        for req_id in lease.expired_reads(posted, now, self._read_timeout_s):
            engine, host, port = (self._receiving.get(req_id) or ("?", "?", "?"))[:3]
            log.warning(protocol.READ_TIMED_OUT_FORMAT, req_id, engine, host, port, now - posted.pop(req_id),
                        self._read_timeout_s, self._failure_policy)
            self._give_up(req_id, protocol.READS_TIMED_OUT)
        peer_of = {r: (got[1], int(got[2])) for r, got in self._receiving.items() if r in posted}
        for req_id in lease.reads_of_gone_peers(posted, peer_of, self._peers.gone, now):
            engine, host, port = self._receiving[req_id][:3]
            log.warning(protocol.PEER_GONE_FORMAT, req_id, engine, host, port, now - posted[req_id],
                        self._failure_policy)
            self._give_up(req_id, protocol.READS_PEER_GONE)

    def _give_up(self, req_id: str, counter: str) -> None:
        self._gave_up.add(req_id)
        self.xfer_stats.record(counter)
        kept = seam.abandon_reads(self, req_id)
        if kept:
            log.warning("pdctl connector: NIXL could not cancel %d read(s) of request %s: its blocks stay held "
                        "until they end", kept, req_id)

    def _log_received(self, req_id: str, ok: bool, read_s: float | None = None) -> None:
        """One line per request: which prefill engine its KV came from. vLLM's decode metrics count tokens by
        source but not by remote engine, and a decode in a fleet receives from several prefill pools at once;
        the parity gate reads these lines (keyed by the request id, which holds the proxy's X-Request-Id)."""
        got = self._receiving.pop(req_id, None)
        if got is None:
            return
        engine, host, port, blocks, tokens = got
        if ok:
            self._received_tokens[engine] = self._received_tokens.get(engine, 0) + (tokens or 0)
        log.info(protocol.RECEIVED_FORMAT, "received" if ok else "FAILED", req_id, engine, host, port,
                 self._remote_block.get(engine, "?"), self.block_size, blocks, tokens,
                 self._received_tokens.get(engine, 0), "-" if read_s is None else f"{read_s * 1e3:.1f}")

    def get_transfer_results(self):
        self._give_up_late_reads()
        polled = time.time() if self._trace else 0.0
        results = super().get_transfer_results()  # polls the reads, then converts P < D blocks
        failed = set(results.failed_recving or ())
        done = list(dict.fromkeys([*(results.finished_recving or ()), *failed]))  # vLLM lists a failure in both
        now = time.monotonic()
        read_s = {}
        for req_id in done:
            posted = self._posted_at.pop(req_id, None)
            read_s[req_id] = None if posted is None else now - posted
            self._seen_at.pop(req_id, None)
            self._gave_up.discard(req_id)
            for key in self._window_keys.pop(req_id, ()):  # normally used up by the post-process already
                self._window_fills.pop(key, None)
            fills = self._split_fills.pop(req_id, {})
            plan = self._split_plans.pop(req_id, None)
            if plan is None:
                continue
            if req_id not in failed:
                self._split_received(plan, fills)
            self._release(plan)
        for req_id in done:  # every conversion done: the KV the decode will attend to, checked
            reads = self._fp_reads.get(req_id)
            why = self._fingerprint_check(req_id) if req_id not in failed else None
            self._fp_expected.pop(req_id, None)
            self._fp_reads.pop(req_id, None)
            if why is not None:
                self._fingerprint_failed(req_id, why, reads[0])
                failed.add(req_id)
                results.failed_recving = {*(results.failed_recving or ()), req_id}
            if req_id in failed and self._failure_policy == "recompute":
                self.xfer_stats.record(protocol.RECOMPUTED)
            self._log_received(req_id, req_id not in failed, read_s[req_id])
        if self._trace:
            for req_id in done:
                trace("read_done", req_id, polled)
                trace("converted", req_id)
        return results

    def _map_block_ids_for_block_size_ratio(self, local_block_ids, remote_block_ids, block_size_ratio: int):
        # vLLM's sub-block pairing, corrected past the decode's prefix hit (pdctl.kv.reads).
        local, remote = reads.merge_mapping(local_block_ids, remote_block_ids, block_size_ratio,
                                            getattr(self, "_prefix_hit", ()),
                                            block_size_ratio * seam.kernel_blocks_per_block(self))
        if self._window_now:  # sliding-window groups: the pairs pdctl.kv.window chose by tokens
            local = [list(g) for g in local] if local else [[] for _ in remote]
            remote = [list(g) for g in remote]
            for g, plan in self._window_now.items():
                local[g], remote[g] = list(plan.local), list(plan.remote)
            if not any(local):
                local = []
        return local, remote

    # -- receive ---------------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        # Each cache's form, once, from its shape and strides (pdctl.kv.forms), before vLLM registers anything: one
        # the connector cannot convert stops the server here, naming the form, rather than misreading KV later.
        try:
            self._forms = {name: self._form_of(cache) for name, cache in kv_caches.items()}
        except FormError as e:
            raise FormError(f"{protocol.REFUSED_MARK} KV cache: {e}") from None
        self._refuse_unregistrable_pairs()
        super().register_kv_caches(kv_caches)
        self._check_pair_registration()
        log.info("pdctl connector: KV cache form %s", ", ".join(sorted({f.name for f in self._forms.values()})))

    def _form_of(self, cache: torch.Tensor) -> CacheForm:
        pair = kv_pair(cache)  # vllm-gaudi's separate K and V tensors
        if pair is not None:
            return kv_pair_form(pair)
        if not self._cpu_attn:
            return form_of(cache, self.backend_name)
        cache_dtype = self.vllm_config.cache_config.cache_dtype
        return form_of(cache, self.backend_name,
                       lambda n: seam.attn_isa(cache.dtype, n, cache.shape[-1] // 2, cache_dtype))

    def _form(self, name: str) -> CacheForm:
        """The form of layer `name`'s cache (chosen when the caches were registered)."""
        if name not in self._forms:
            self._forms[name] = self._form_of(self.device_kv_caches[name])
        return self._forms[name]

    def _cache(self, name: str):
        """Layer `name`'s device cache as pdctl.kv takes it (a (K, V) pair as pdctl.kv.forms.KvPair)."""
        raw = self.device_kv_caches[name]
        return kv_pair(raw) or raw

    def _layers(self, names: list[str]) -> list[tuple[torch.Tensor, CacheForm]]:
        """One KV group's layers as pdctl.kv.receive takes them: each cache with its form."""
        return [(self._cache(name), self._form(name)) for name in names]

    def post_process_device_kv_on_receive(self, block_size_ratio: int, block_ids_list, convert: bool = True):
        # Every form pdctl.kv models: merge sub-blocks and zero the uncovered tail in the cache's own form
        # (CPU_ATTN's per-ISA packing included; vLLM's generic merge corrupts CPU KV silently), on its device. Pairs
        # whose layouts differ are refused at the handshake (pdctl.kv.reads.refusal), so vLLM never permutes here.
        if self._received_on_host():  # converted in the host buffer before it was copied here (kv_pairs.py)
            return
        for group, block_ids, covered_sub_blocks in block_ids_list:
            fills = self._window_fills.pop((group, block_ids[0]), None) if block_ids else None
            receive_merged(self._layers(seam.group_layer_names(self, group)), list(block_ids), block_size_ratio,
                           covered_sub_blocks, fills, self._received_packing.get(self.block_size // block_size_ratio),
                           convert)


class NixlConnector(NixlPullConnector):
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.connector_scheduler is not None:
            self.connector_scheduler.fingerprint_blocks = kv_cache_manager.get_block_ids

    def build_connector_worker_meta(self):
        return self.connector_worker.build_connector_worker_meta() if self.connector_worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return PdctlKVConnectorStats(data=data) if data is not None else PdctlKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return PdctlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        # NixlPullConnector.__init__ would build the stock worker (and its spinning NIXL agent): skip to the base.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = PdctlNixlScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = PdctlNixlWorker(vllm_config, self.engine_id, kv_cache_config)
