"""pdctl's NIXL connector, loaded by vLLM from `kv_connector_module_path: pdctl.connector.nixl`.

A thin adapter over vLLM's NixlConnector (pull mode); every layout decision is pdctl.kv's:
- NIXL progress without a busy-spinning thread: the agent's progress thread sleeps `progress_delay_us` between
  passes (nixl's Python wrapper hard-codes 0, i.e. a spinning core per server even when idle);
- prefill block < decode block on CPU_ATTN: received sub-blocks are merged with the real per-ISA layout
  (vLLM's generic merge assumes token rows and corrupts CPU KV silently), and the uncovered tail is zeroed in
  the same layout (vLLM's zeroing wipes V);
- prefill block > decode block (vLLM refuses it with an AssertionError at request time): the prefill is presented
  to vLLM's read machinery as decode-sized byte chunks; every prefill block a request touches is read whole, the
  chunks that no block of the request holds (a partial first or last prefill block) going to a staging area the
  decode's scheduler reserved at start (withheld from the allocator, never borrowed from it); on completion each
  prefill block is reassembled and split into decode blocks in the real layout (pdctl.kv.split_in_place);
- vLLM's sub-block pairing when the decode already holds prefix-cached blocks (P < D) is corrected;
- hybrid models (sliding-window + full-attention KV groups under vLLM's hybrid KV cache manager): each side keeps
  only the window's tail of a sliding-window group, cut by its own block size; those blocks are paired by absolute
  token position (pdctl.kv.window) in both directions, what the prefill no longer holds is zeroed, and the
  prefill stops one token short (vLLM's `_prefill_backoff`) so both sides keep the window of the token the
  decode computes (vLLM keeps the next token's window: one key short, silently, for some prompt lengths);
- each side's exact CPU cache layout travels in the handshake (the CPU attention ISA, appended to the backend name
  vLLM already sends): a prefill on another ISA is converted from (P < D) or refused, never misread;
- pairs it cannot serve fail at handshake with one message naming both sides;
- early decode (proxy.early_decode): a decode request may arrive before its prefill answered; its blocks are
  given and it waits, parked, until the proxy hands over the prefill's KV parameters (pdctl.proxy.handover).

The class keeps the name NixlConnector because several vLLM config checks test that name. Importing this module
has no side effects: vLLM imports it in the API server, the engine core and every worker. Every private vLLM/NIXL
name it relies on is listed and reached through pdctl.connector.seam (checked by scripts/check_vllm_compat.py).
Calming vLLM's executor queues on CPU is not the connector's: pdctl.vllm_plugin does it for every server pdctl
starts on CPU, aggregated ones included.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.logger import init_logger

from pdctl import protocol
from pdctl.connector import peers, seam
from pdctl.connector.stats import PdctlKVConnectorStats, PdctlPromMetrics
from pdctl.kv import lease
from pdctl.kv.convert import Side, merge_in_place, slots_mask, split_in_place, zero_mask
from pdctl.kv.index import (
    SplitPlan,
    StagingPool,
    merge_tail,
    pair_past_prefix_hit,
    split_plan,
    split_staging_needed,
    split_tail,
)
from pdctl.kv.layouts import BlockShape, layout
from pdctl.kv.window import WindowFill, WindowMerge, window_pairs, window_split_plan, window_staging_needed
from pdctl.proxy import handover

__all__ = ["NixlConnector"]

ISA_TAG = "+pdctl-isa="
IDLE_WAIT_S = 0.01  # early decode: the longest an engine with only parked requests waits for a hand-over
ARRIVED_ATTR = "pdctl_seen_at"  # on the connector metadata: req -> when the decode's scheduler saw its KV params


def tag_backend(name: str, isa: str | None) -> str:
    """The attention backend name with this side's CPU attention ISA appended (vLLM's handshake has no field)."""
    return f"{name}{ISA_TAG}{isa}" if isa else name


def untag_backend(name: str) -> tuple[str, str | None]:
    base, sep, isa = name.partition(ISA_TAG)
    return base, (isa or None) if sep else None

log = init_logger("vllm.pdctl.connector")  # under "vllm" so it lands in the server log


def _settings(vllm_config) -> dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.get_from_extra_config("pdctl", {}) or {})


def trace(stage: str, req_id: str, at: float | None = None) -> None:
    """One timing line (wall clock `at`, default now: the proxy and every engine process on a host share it),
    read by pdctl.bench.breakdown. Only when the connector's `trace` setting is on."""
    log.info("%s", protocol.trace_line(stage, req_id, time.time() if at is None else at))


class PdctlNixlWorker(NixlPullConnectorWorker):
    def __init__(self, vllm_config, engine_id: str, kv_cache_config):
        s = _settings(vllm_config)
        self.pdctl_settings = s
        affinity = os.sched_getaffinity(0)
        with seam.nixl_agent_settings(bool(s.get("progress_thread", True)), int(s.get("progress_delay_us", 1000))):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        # The base worker pins this thread to the last core of each NUMA node; on a small host that puts every
        # instance's model thread on one core. Keep the binding vLLM's OMP setup chose.
        if not s.get("pin_transfer_thread", False):
            os.sched_setaffinity(0, affinity)
        self._cpu_attn = self.backend_name == "CPU_ATTN"
        if os.environ.get("PDCTL_QUEUE_SPIN_S") and not seam.spin_wait_patched():
            log.warning("pdctl connector: PDCTL_QUEUE_SPIN_S is set but vLLM's executor queues were not calmed: "
                        "pdctl's vLLM plugin did not load (pdctl not installed in this Python, or VLLM_PLUGINS "
                        "does not name pdctl_calm_queues); the queue readers spin")
        self._trace = bool(s.get("trace", False))
        # A read issued in this step is polled again (bounded) before the step's answer leaves: vLLM would see
        # it done only at the next step's poll, and schedule its first token a step after that.
        self._read_wait_s = float(s.get("read_wait_s", 0.002))
        self._fresh_reads: list[str] = []  # requests whose read this step issued
        self._staging_blocks = int(s.get("staging_blocks", 0))
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
        self._received_isa: dict[int, str] = {}  # block-size ratio -> the CPU attention ISA those prefills use
        self._remote_block: dict[str, int] = {}  # remote engine -> its block size (as it said at handshake)
        self._receiving: dict[str, tuple] = {}  # req -> (engine, host, port, decode blocks read, prompt tokens)
        self._received_tokens: dict[str, int] = {}  # remote engine -> prompt tokens received so far
        self._failure_policy = vllm_config.kv_transfer_config.kv_load_failure_policy
        # Every read bounded, and started only while the prefill's hold on its blocks is known alive (pdctl.kv.lease).
        self._lease_s = float(vllm_config.kv_transfer_config.get_from_extra_config("kv_lease_duration",
                                                                                     lease.KV_LEASE_S))
        self._read_timeout_s = float(s.get("kv_read_timeout_s", lease.READ_TIMEOUT_S))
        self._seen_at: dict[str, float] = {}  # req -> when the scheduler saw its KV parameters (monotonic)
        self._posted_at: dict[str, float] = {}  # req -> when its read was posted (monotonic), until it ends
        self._gave_up: set[str] = set()  # reads given up (timed out or refused), until vLLM reports them
        self._peers = peers.PeerWatch()  # whether a prefill whose read is in progress is still there
        self.xfer_stats = PdctlKVConnectorStats()
        log.info("pdctl connector: backend %s, block %d, progress thread %s (delay %s us)", self.backend_name,
                 self.block_size, s.get("progress_thread", True), s.get("progress_delay_us", 1000))

    # -- handshake -------------------------------------------------------------------------------------------

    def _isa(self, block_size: int) -> str | None:
        """The CPU attention ISA this host uses for blocks of block_size tokens (None off CPU_ATTN)."""
        if not self._cpu_attn or not self.device_kv_caches:
            return None
        cache = next(iter(self.device_kv_caches.values()))
        return seam.attn_isa(cache.dtype, block_size, cache.shape[-1] // 2, self.vllm_config.cache_config.cache_dtype)

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        isa = self._advertised_isa()
        # Advertise the exact cache layout: an AMX prefill and a vec decode would otherwise misread each other.
        if isa and seam.rewrite_handshake_metadata(
                self, lambda meta: dataclasses.replace(meta, attn_backend_name=tag_backend(meta.attn_backend_name,
                                                                                           isa))):
            log.info("pdctl connector: advertising CPU attention ISA %s (block %d)", isa, self.block_size)

    def _advertised_isa(self) -> str | None:
        """The CPU attention ISA this worker tells its peers it packs KV for (this host's own)."""
        return self._isa(self.block_size)

    def _describe_local(self) -> str:
        isa = self._isa(self.block_size)
        return (f"decode: block {self.block_size}, TP {self.world_size}, layout {self.kv_cache_layout}, "
                f"backend {self.backend_name}" + (f" (ISA {isa})" if isa else ""))

    def add_remote_agent(self, nixl_agent_meta, remote_tp_rank: int = 0, remote_tp_size: int = 1,
                         remote_dcp_size: int = 1) -> str:
        backend, remote_isa = untag_backend(nixl_agent_meta.attn_backend_name)
        nixl_agent_meta = dataclasses.replace(nixl_agent_meta, attn_backend_name=backend)
        remote = (f"prefill: block {nixl_agent_meta.block_size}, TP {remote_tp_size}, layout "
                  f"{nixl_agent_meta.kv_cache_layout}, backend {backend}" + (f" (ISA {remote_isa})" if remote_isa
                                                                            else ""))

        def refuse(why: str):
            raise RuntimeError(f"{protocol.REFUSED_MARK} P/D pair ({remote}; {self._describe_local()}): {why}")

        self._remote_block[nixl_agent_meta.engine_id] = nixl_agent_meta.block_size
        if self._window_groups() and nixl_agent_meta.block_size != self.block_size:
            uneven = sorted({seam.group_block_size(self, g) for g in range(seam.group_count(self))})
            if len(uneven) > 1:
                refuse(f"hybrid model whose KV cache groups have different block sizes {uneven} on the decode")
            if seam.kernel_blocks_per_block(self) != 1:
                refuse("hybrid model with kernel blocks smaller than logical blocks")
        if self._cpu_attn and backend != self.backend_name:
            refuse("CPU_ATTN decode receiving from another attention backend")
        if self._cpu_attn:
            self._check_isa(nixl_agent_meta.block_size, remote_isa, refuse)
        if nixl_agent_meta.block_size > self.block_size:
            ratio, rest = divmod(nixl_agent_meta.block_size, self.block_size)
            if rest:
                refuse("the prefill block is not a multiple of the decode block")
            if remote_tp_size != self.world_size:
                refuse("prefill block > decode block needs equal TP on both sides")
            if seam.permutes_local_kv(self) or nixl_agent_meta.kv_cache_layout != self.kv_cache_layout:
                refuse("prefill block > decode block needs the same KV layout on both sides")
            if self._staging_blocks < 2 * (ratio - 1):
                refuse(f"the decode reserved {self._staging_blocks} staging blocks, it needs at least "
                       f"{2 * (ratio - 1)} (connector extra config pdctl.staging_blocks; pdctl's plan sets it)")
            if seam.kernel_blocks_per_block(self) != 1:
                refuse("prefill block > decode block with kernel blocks smaller than logical blocks")
            self._split_ratio[nixl_agent_meta.engine_id] = ratio
            nixl_agent_meta = _as_decode_sized(nixl_agent_meta, ratio)
            log.info("pdctl connector: prefill block %d > decode block %d: reading %d chunks per prefill block, "
                     "split after receive (staging %d blocks)", ratio * self.block_size, self.block_size, ratio,
                     self._staging_blocks)
        return super().add_remote_agent(nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size)

    def _check_isa(self, remote_block: int, remote_isa: str | None, refuse) -> None:
        """Which layout the prefill's blocks arrive in, by block-size ratio; refuse what cannot be converted."""
        assumed = self._isa(remote_block)  # what this host would use for the prefill's block size
        if remote_isa is None:
            log.warning("pdctl connector: the prefill did not say its CPU attention ISA (not pdctl's connector?); "
                        "assuming %s", assumed)
            remote_isa = assumed
        same = layout(remote_isa) is layout(assumed) if assumed else True
        ratio = self.block_size // remote_block if remote_block <= self.block_size else 0
        if not same and ratio <= 1:
            refuse(f"the prefill's CPU attention ISA {remote_isa} stores KV differently from this decode's "
                   f"{assumed}; pdctl converts between them only when the prefill block is smaller than the "
                   "decode block (merge after receive)")
        known = self._received_isa.setdefault(ratio, remote_isa)
        if layout(known) is not layout(remote_isa):
            refuse(f"another prefill with the same block size uses ISA {known}; one ISA per block-size ratio")
        if ratio > 1:
            log.info("pdctl connector: prefill block %d < decode block %d: NIXL reads %d sub-blocks per decode block "
                     "in place (transfer plan), then one merge pass %s -> %s (post-receive transform)", remote_block,
                     self.block_size, ratio, remote_isa, self._isa(self.block_size))

    # -- pairing ---------------------------------------------------------------------------------------------

    def start_load_kv(self, metadata):
        self._seen_at.update(getattr(metadata, ARRIVED_ATTR, None) or {})
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
            self.xfer_stats.record("pdctl_reads_refused_lease")
            self._gave_up.add(req_id)
            seam.fail_recv(self, req_id)
            return None
        # The decode's own prefix-cache hit (blocks already computed) for this request, per group: vLLM's
        # sub-block pairing does not know it and shifts every pair when it is non-zero.
        prefix_hit = tuple(meta.local_num_computed_blocks or ())
        remote = meta.remote
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
            if self._read_wait_s:
                self._fresh_reads.append(req_id)

    # -- sliding-window groups (hybrid models) ----------------------------------------------------------------

    def _window_groups(self) -> dict[int, int]:
        """KV transfer group -> sliding window (tokens), for the groups that are sliding-window ones."""
        if self._windows is None:
            groups = range(seam.group_count(self))
            self._windows = {g: w for g in groups if (w := seam.group_window(self, g))}
        return self._windows

    def _window_tails(self, meta, group: int, window: int, prefill_block: int) -> dict[str, Any] | None:
        """Where the two tails of a sliding-window group lie, as pdctl.kv.window's arguments; None when the
        lists are not the tails vLLM cuts (then the load fails and vLLM recomputes, never a silent misread).

        Both sides hold the request's first `tokens` tokens (the prefill stopped one short: `_prefill_backoff`),
        so the decode's first query is token `tokens` and needs keys from tokens - window + 1. Each list ends
        with the block holding the last token; the prefill's first entries are vLLM's null block where the
        window had already left them."""
        tokens = meta.remote.num_tokens
        remote = list(meta.remote.block_ids[group])
        local = list(meta.local_physical_block_ids[group])
        if tokens is None:
            return None
        remote_first = -(-tokens // prefill_block) - len(remote)
        local_first = -(-tokens // self.block_size) - len(local)
        if remote_first < 0 or local_first < 0:
            return None
        held = max(remote_first, max(0, tokens - window + 1) // prefill_block)  # past the null entries
        return dict(local=local, remote=remote[held - remote_first:], local_first=local_first, remote_first=held,
                    prefill_block=prefill_block, decode_block=self.block_size, tokens=tokens,
                    need_from=max(0, tokens - window + 1, local_first * self.block_size))

    def _plan_window_merge(self, req_id: str, meta) -> bool:
        """P <= D: pair each sliding-window group's sub-blocks by absolute tokens (vLLM pairs the tails from
        their starts); False: a needed token is on neither list."""
        prefill_block = self._remote_block.get(meta.remote.engine_id, self.block_size)
        if prefill_block == self.block_size:
            return True  # equal tails end at the same block: vLLM's end-trim pairs them right
        for g, window in self._window_groups().items():
            tails = self._window_tails(meta, g, window, prefill_block)
            plan = window_pairs(**tails) if tails else None
            if plan is None:
                self._window_now = {}
                log.warning("pdctl connector: request %s: the sliding-window tails of group %d do not hold the "
                            "window (%s); its KV load fails", req_id, g, tails and {
                                k: v for k, v in tails.items() if k not in ("local", "remote")})
                return False
            self._window_now[g] = plan
            if tails["local"]:
                key = (g, tails["local"][0])
                self._window_fills[key] = plan.fills
                self._window_keys.setdefault(req_id, []).append(key)
        self._log_window_read(meta, {g: len(p.remote) for g, p in self._window_now.items()}, prefill_block)
        return True

    def _log_window_read(self, meta, window_reads: dict[int, int], prefill_block: int) -> None:
        """Once per prefill engine: what each KV group of a hybrid model reads (prefill blocks, bytes)."""
        engine = meta.remote.engine_id
        if engine in self._window_logged:
            return
        self._window_logged.add(engine)
        parts = []
        for g in range(len(meta.local_physical_block_ids)):
            names = seam.group_layer_names(self, g)
            cache = self.device_kv_caches[names[0]]
            block_bytes = cache[0].numel() * cache.element_size() * prefill_block // self.block_size * len(names)
            n = window_reads.get(g, len(meta.remote.block_ids[g]))
            kind = f"sliding window {self._window_groups()[g]}" if g in self._window_groups() else "full attention"
            parts.append(f"group {g} ({kind}, {len(names)} layers): {n} prefill blocks, {n * block_bytes} bytes")
        log.info("pdctl connector: hybrid model, prefill engine %s (block %d -> decode block %d), first request "
                 "of %s tokens: %s", engine, prefill_block, self.block_size, meta.remote.num_tokens, "; ".join(parts))

    def _give_up_late_reads(self) -> None:
        """Reads in progress past connector.kv_read_timeout_s, or from a prefill that is gone, fail through vLLM's
        failure path: each NIXL handle is released (NIXL cancels it) or, where NIXL cannot, kept and polled until
        it ends, so the request's blocks go back to the allocator (or are recomputed into) only once no transfer
        can still write them."""
        now = time.monotonic()
        posted = {r: t for r, t in self._posted_at.items() if r not in self._gave_up}
        for req_id in lease.expired_reads(posted, now, self._read_timeout_s):
            engine, host, port = (self._receiving.get(req_id) or ("?", "?", "?"))[:3]
            log.warning(protocol.READ_TIMED_OUT_FORMAT, req_id, engine, host, port, now - posted.pop(req_id),
                        self._read_timeout_s, self._failure_policy)
            self._give_up(req_id, "pdctl_reads_timed_out")
        peer_of = {r: (got[1], int(got[2])) for r, got in self._receiving.items() if r in posted}
        for req_id in lease.reads_of_gone_peers(posted, peer_of, self._peers.gone, now):
            engine, host, port = self._receiving[req_id][:3]
            log.warning(protocol.PEER_GONE_FORMAT, req_id, engine, host, port, now - posted[req_id],
                        self._failure_policy)
            self._give_up(req_id, "pdctl_reads_peer_gone")

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

    # -- prefill block > decode block ------------------------------------------------------------------------

    def _staging_pool(self) -> StagingPool:
        if self._staging is None:  # the cache is registered by the first read
            total = next(iter(self.device_kv_caches.values())).shape[0]
            self._staging = StagingPool.last_blocks(total, self._staging_blocks)
        return self._staging

    def _plan_split(self, req_id: str, meta, ratio: int, prefix_hit: tuple[int, ...]) -> bool:
        """Rewrite the request's read lists to whole prefill blocks as decode-sized chunks (pdctl.kv.index);
        False: the staging area cannot hold the chunks no decode block takes."""
        windows = self._window_groups() if any(meta.local_physical_block_ids or ()) else {}
        # Full-attention groups: pdctl.kv.index, from the start; sliding-window groups: pdctl.kv.window, by tokens.
        local = [[] if g in windows else list(ids) for g, ids in enumerate(meta.local_physical_block_ids)]
        remote = [list(g) for g in meta.remote.block_ids]
        shape = dict(ratio=ratio, block_size=self.block_size, tokens=meta.remote.num_tokens, cached=prefix_hit)
        full_need = split_staging_needed(local, remote, **shape)
        tails = {g: self._window_tails(meta, g, w, ratio * self.block_size) for g, w in windows.items()}
        window_need = {g: window_staging_needed(**t) if t else None for g, t in tails.items()}
        if None in window_need.values():
            log.warning("pdctl connector: request %s: the sliding-window tails do not hold the window; its KV "
                        "load fails", req_id)
            return False
        need = full_need + sum(window_need.values())
        staging = self._staging_pool().take(need) if need else []
        if staging is None:
            log.warning("pdctl connector: staging area full (%d blocks): request %s's KV load fails "
                        "(kv_load_failure_policy %s: %s)", self._staging_blocks, req_id,
                        self._failure_policy, "the decode computes the prompt itself"
                        if self._failure_policy == "recompute" else "the request ends with an error")
            return False
        taken = full_need
        plan = split_plan(local, remote, staging=staging[:taken], **shape)
        if windows:
            groups, fills = list(plan.groups), {}
            for g, t in tails.items():
                window = window_split_plan(**t, staging=staging[taken:taken + window_need[g]])
                taken += window_need[g]
                groups[g], fills[g] = window.chunks, window.fills
            plan = dataclasses.replace(plan, groups=tuple(groups))
            self._split_fills[req_id] = fills
            self._log_window_read(meta, {g: len(groups[g]) // ratio for g in tails}, ratio * self.block_size)
        meta.local_physical_block_ids = plan.local_ids()
        meta.remote.block_ids = plan.remote_ids()
        if any(plan.groups):  # a read of nothing is never reported done: a kept plan would outlive its request
            self._split_plans[req_id] = plan
        return True

    def _release(self, plan: SplitPlan) -> None:
        staging = plan.staging()
        if staging:
            self._staging_pool().release(staging)

    def get_transfer_results(self):
        if self._fresh_reads:
            seam.await_reads(self, self._fresh_reads, self._read_wait_s)
            self._fresh_reads.clear()
        self._give_up_late_reads()
        polled = time.time() if self._trace else 0.0
        results = super().get_transfer_results()  # polls the reads, then converts P < D blocks
        failed = set(results.failed_recving or ())
        done = list(dict.fromkeys([*(results.finished_recving or ()), *failed]))  # vLLM lists a failure in both
        now = time.monotonic()
        for req_id in done:
            posted = self._posted_at.pop(req_id, None)
            self._log_received(req_id, req_id not in failed, None if posted is None else now - posted)
            self._seen_at.pop(req_id, None)
            self._gave_up.discard(req_id)
            if req_id in failed and self._failure_policy == "recompute":
                self.xfer_stats.record("pdctl_recomputed")
            for key in self._window_keys.pop(req_id, ()):  # normally used up by the post-process already
                self._window_fills.pop(key, None)
            fills = self._split_fills.pop(req_id, {})
            plan = self._split_plans.pop(req_id, None)
            if plan is None:
                continue
            if req_id not in failed:
                self._split_received(plan, fills)
            self._release(plan)
        if self._trace:
            for req_id in done:
                trace("read_done", req_id, polled)
                trace("converted", req_id)
        return results

    def _split_received(self, plan: SplitPlan, window_fills: dict[int, tuple[WindowFill, ...]]) -> None:
        """Reassemble each prefill block read and split it into decode blocks in the real layout; keep the
        request's decode blocks (not the staging chunks) and zero the slots past the prompt (sliding-window
        groups: every slot of their blocks that received nothing)."""
        n = self.block_size
        for g, chunks in enumerate(plan.groups):
            if not chunks:
                continue
            names = seam.group_layer_names(self, g)
            ids = torch.tensor([c.dest for c in chunks], dtype=torch.long)
            real = torch.tensor([c.real for c in chunks], dtype=torch.bool)
            fills = window_fills.get(g)
            tail = None if fills is not None else split_tail([c.block for c in chunks], n, plan.tokens)
            for name in names:
                cache = self.device_kv_caches[name]
                local = self._side(cache, n)
                received = self._side(cache, n * plan.ratio)
                whole = cache.index_select(0, ids).reshape(plan.prefill_blocks(g), -1)
                blocks = split_in_place(whole, plan.ratio, received, local)
                if tail is not None:
                    at, first = tail
                    blocks[at].masked_fill_(zero_mask(local, first), 0)
                keep = real.nonzero().reshape(-1)
                cache.index_copy_(0, ids[keep], blocks[keep].reshape(-1, *cache.shape[1:]))
                if fills:
                    self._zero_fills(cache, local, fills)

    def _map_block_ids_for_block_size_ratio(self, local_block_ids, remote_block_ids, block_size_ratio: int):
        local, remote = super()._map_block_ids_for_block_size_ratio(local_block_ids, remote_block_ids,
                                                                    block_size_ratio)
        local, remote = pair_past_prefix_hit(local, remote, getattr(self, "_prefix_hit", ()),
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

    def _side(self, cache: torch.Tensor, block_size: int, isa: str | None = None) -> Side:
        """This cache's layout for blocks of block_size tokens (for CPU_ATTN the ISA depends on the block size;
        received blocks use the ISA the prefill advertised at handshake)."""
        _, heads, _, two_d = cache.shape
        if self._cpu_attn:
            name = isa or seam.attn_isa(cache.dtype, block_size, two_d // 2, self.vllm_config.cache_config.cache_dtype)
        else:
            name = "NHD" if self.kv_cache_layout in ("NHD", "LBNHC") else "HND"
        return Side(layout(name), BlockShape(heads, block_size, two_d // 2))

    def post_process_device_kv_on_receive(self, block_size_ratio: int, block_ids_list, convert: bool = True):
        if not self._cpu_attn or seam.permutes_local_kv(self):
            # vLLM's own conversion; a sliding-window group's received sub-blocks are not a prefix of its list
            # (vLLM would zero in-window tokens): it converts every block and zeroes nothing there (the slots
            # left stale are outside the window or past the prompt: never read before they are written).
            items = [(g, ids, len(ids) * block_size_ratio) if self._window_fills.pop((g, ids[0]), None) is not None
                     else (g, ids, covered) for g, ids, covered in block_ids_list if ids] + [
                         x for x in block_ids_list if not x[1]]
            return super().post_process_device_kv_on_receive(block_size_ratio, items, convert)
        # CPU_ATTN: merge sub-blocks and zero the uncovered tail in the ISA's real layout.
        for group, block_ids, covered_sub_blocks in block_ids_list:
            names = seam.group_layer_names(self, group)
            fills = self._window_fills.pop((group, block_ids[0]), None) if block_ids else None
            if fills is not None:
                self._merge_window(names, block_ids, block_size_ratio, fills, convert)
                continue
            written, zero_from = merge_tail(covered_sub_blocks, block_size_ratio, self.block_size)
            idx = torch.tensor(block_ids[:written], dtype=torch.long)
            stale = torch.tensor(block_ids[written:], dtype=torch.long)
            for name in names:
                cache = self.device_kv_caches[name]
                local = self._side(cache, self.block_size)
                merge = convert and block_size_ratio > 1
                if written and (merge or zero_from is not None):
                    blocks = cache.index_select(0, idx).reshape(written, -1)
                    if merge:
                        received = self._side(cache, self.block_size // block_size_ratio,
                                               self._received_isa.get(block_size_ratio))
                        blocks = merge_in_place(blocks, block_size_ratio, received, local)
                    if zero_from is not None:
                        blocks[-1].masked_fill_(zero_mask(local, zero_from), 0)
                    cache.index_copy_(0, idx, blocks.reshape(-1, *cache.shape[1:]))
                if stale.numel():
                    cache.index_fill_(0, stale, 0)

    def _merge_window(self, names: list[str], block_ids, ratio: int, fills: tuple[WindowFill, ...],
                      convert: bool) -> None:
        """A sliding-window group's decode blocks after a P < D read paired by tokens: merge every block's
        sub-blocks, then zero what the prefill did not send (the window's head, the slots past the prompt)."""
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        for name in names:
            cache = self.device_kv_caches[name]
            local = self._side(cache, self.block_size)
            blocks = cache.index_select(0, idx).reshape(len(block_ids), -1)
            if convert and ratio > 1:
                received = self._side(cache, self.block_size // ratio, self._received_isa.get(ratio))
                blocks = merge_in_place(blocks, ratio, received, local)
            for row, fill in zip(blocks, fills, strict=True):
                _zero_slots(row, local, fill)
            cache.index_copy_(0, idx, blocks.reshape(-1, *cache.shape[1:]))

    def _zero_fills(self, cache: torch.Tensor, local: Side, fills: tuple[WindowFill, ...]) -> None:
        """Zero the slots of a sliding-window group's decode blocks that received nothing (after a split)."""
        for fill in fills:
            if fill.zero:
                _zero_slots(cache[fill.id].view(-1), local, fill)


def _zero_slots(block: torch.Tensor, local: Side, fill: WindowFill) -> None:
    """Zero, in place, the token slots of one decode block (flat, in the local layout) that `fill` says received
    nothing."""
    for start, stop in fill.zero:
        block.masked_fill_(slots_mask(local, start, stop), 0)


def _as_decode_sized(meta, ratio: int):
    """The prefill's handshake metadata as if its blocks were `ratio` times smaller (contiguous byte chunks)."""
    return dataclasses.replace(
        meta, block_size=meta.block_size // ratio, num_blocks=meta.num_blocks * ratio,
        block_lens=[n // ratio for n in meta.block_lens], block_strides=[n // ratio for n in meta.block_strides],
        region_num_blocks=[n * ratio for n in meta.region_num_blocks] if meta.region_num_blocks else
        meta.region_num_blocks)


class PdctlNixlScheduler(NixlPullConnectorScheduler):
    def __init__(self, vllm_config, engine_id: str, kv_cache_config):
        staging = int(_settings(vllm_config).get("staging_blocks", 0))
        if staging and vllm_config.kv_transfer_config.kv_role in ("kv_consumer", "kv_both"):
            # Reserve the staging area: the scheduler's block pool is built from this config right after the
            # connector, so the allocator never hands out the last `staging` blocks; the worker reads into them.
            if kv_cache_config.num_blocks <= 4 * staging:
                raise ValueError(f"pdctl connector: {kv_cache_config.num_blocks} KV blocks cannot spare "
                                 f"{staging} staging blocks; give the decode more KV cache memory")
            kv_cache_config.num_blocks -= staging
            log.info("pdctl connector: %d KV blocks reserved as staging for prefill block > decode block",
                     staging)
        self._trace = bool(_settings(vllm_config).get("trace", False))
        self._traced: set[str] = set()  # remote-KV requests seen, until their KV is ready
        self._seen_at: dict[str, float] = {}  # req -> when its KV parameters were seen here, until sent to workers
        self._kv_ready: set[str] = set()  # ... then until the step that computes their first token
        super().__init__(vllm_config, engine_id, kv_cache_config)
        # Early decode: hand-over token -> (request, blocks, external tokens) of a request waiting for its
        # prefill's KV parameters; they arrive on the listener's thread and are taken in build_connector_meta.
        self._parked: dict[str, tuple[Any, Any, int]] = {}
        self._reading: set[str] = set()  # requests whose KV read vLLM has, until it is done (or they end)
        self._handover: handover.Listener | None = None
        role = vllm_config.kv_transfer_config.kv_role
        # A prefill hands its KV parameters over to the decode itself, when the proxy's request says where.
        self._hands_over = bool(_settings(vllm_config).get("handover")) and role in ("kv_producer", "kv_both")
        if _settings(vllm_config).get("handover") and role in ("kv_consumer", "kv_both"):
            self._handover = handover.Listener(handover.name(self.side_channel_host, self.side_channel_port))
            log.info("pdctl connector: early decode: KV parameters handed over on @%s", self._handover.sock_name)

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
        if params.get("do_remote_prefill") and params.get("remote_engine_id"):
            self._seen_at.setdefault(request.request_id, time.monotonic())  # the prefill's lease began before
        if self._trace and request.request_id not in self._traced and params.get("do_remote_prefill"):
            self._traced.add(request.request_id)
            trace("sched_seen", request.request_id)
        if params.get(handover.TOKEN_KEY) and params.get("do_remote_prefill") and self._handover is None:
            # No hand-over here (the proxy sends early requests only to decodes started with it): compute it.
            log.warning("pdctl connector: request %s awaits a hand-over this decode does not listen for "
                        "(proxy.early_decode): computing its prompt", request.request_id)
            params["do_remote_prefill"] = False
            return 0, False
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self._trace and num_external_tokens and request.request_id in self._traced:
            trace("sched_alloc", request.request_id)
        params = request.kv_transfer_params or {}
        token = params.get(handover.TOKEN_KEY)
        if token and params.get("do_remote_prefill") and self._handover is not None:
            self._parked[token] = (request, blocks, num_external_tokens)  # until its KV parameters arrive
            return None
        if self._handover is not None and num_external_tokens and params.get("do_remote_prefill"):
            self._reading.add(request.request_id)
        return super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _claim_handovers(self) -> None:
        """Parked requests whose KV parameters arrived go on as if they had come with them."""
        for token in list(self._parked):
            try:
                at, params = self._handover.take_timed(token)
            except KeyError:
                continue
            request, blocks, num_external_tokens = self._parked.pop(token)
            if self._trace:
                trace("handover_in", request.request_id, at)
            if params is None:  # no KV will come: the proxy drops this request (vLLM aborts it)
                request.kv_transfer_params["do_remote_prefill"] = False
                continue
            request.kv_transfer_params = {**params, "do_remote_prefill": True}
            self._seen_at[request.request_id] = time.monotonic()
            if self._trace:
                trace("sched_handover", request.request_id)
            if num_external_tokens:
                self._reading.add(request.request_id)
            super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _idle_until_handover(self, scheduler_output) -> bool:
        """A step with nothing to compute, no read under way and requests parked: vLLM's engine would step again
        at once, empty, for as long as their prefills compute (~100 ms; on a CPU host that busy loop slows the
        prefills). Wait for a hand-over instead, bounded so a new request is still seen soon; whether one came."""
        if scheduler_output.total_num_scheduled_tokens or self._reading or seam.reads_to_issue(self):
            return False
        return self._handover.wait(IDLE_WAIT_S, self._parked)

    def request_finished(self, request, block_ids):
        self._traced.discard(request.request_id)  # aborted before its KV or first token: followed no further
        self._seen_at.pop(request.request_id, None)
        self._kv_ready.discard(request.request_id)
        params = request.kv_transfer_params or {}
        token = params.get(handover.TOKEN_KEY)
        if token and params.get("do_remote_prefill"):
            # Ended while parked (or before it was given blocks): nothing to read, no prefill to notify.
            self._parked.pop(token, None)
            if self._handover is not None:
                self._handover.discard(token)  # a hand-over that came meanwhile is nobody's now
            params["do_remote_prefill"] = False
            return False, None
        self._reading.discard(request.request_id)
        delay, out = super().request_finished(request, block_ids)
        target = handover.direct_target(params) if self._hands_over and out else None
        if target is not None:
            why = handover.send(*target, out)
            if why is None:
                out = {**out, handover.HANDED_KEY: True}
            else:  # the proxy hands them over when it has the answer
                log.warning("pdctl connector: request %s: %s", request.request_id, why)
        return delay, out

    def update_connector_output(self, connector_output) -> None:
        if self._reading:
            self._reading.difference_update(connector_output.finished_recving or ())
        if self._trace:
            for req_id in connector_output.finished_recving or ():
                if req_id in self._traced:
                    self._traced.discard(req_id)
                    self._kv_ready.add(req_id)
                    trace("sched_kv_ready", req_id)
        super().update_connector_output(connector_output)

    def build_connector_meta(self, scheduler_output):
        if self._parked and (self._handover.has(self._parked) or self._idle_until_handover(scheduler_output)):
            self._claim_handovers()
        if self._trace and self._kv_ready:  # the step that computes the first token of a request whose KV arrived
            for req_id in self._kv_ready & scheduler_output.num_scheduled_tokens.keys():
                self._kv_ready.discard(req_id)
                trace("sched_first", req_id)
        meta = super().build_connector_meta(scheduler_output)
        # The workers decide whether a read may start (the lease) from when this scheduler saw the request: one
        # host, one monotonic clock.
        setattr(meta, ARRIVED_ATTR, {r: self._seen_at.pop(r) for r in seam.reads_in(meta) if r in self._seen_at})
        return meta


class NixlConnector(NixlPullConnector):
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


# Extensions: modules named by PDCTL_CONNECTOR_EXTENSIONS (comma-separated), imported once this module is loaded,
# in every vLLM process that loads the connector; each may wrap the classes above (the e2e fault drills hold a
# read and claim a foreign ISA this way: tests/e2e/connector_hooks.py). The same trust as PYTHONPATH's.
EXTENSIONS_ENV = "PDCTL_CONNECTOR_EXTENSIONS"
for _module in filter(None, (m.strip() for m in os.environ.get(EXTENSIONS_ENV, "").split(","))):
    importlib.import_module(_module)
