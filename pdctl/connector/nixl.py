"""pdctl's NIXL connector, loaded by vLLM from `kv_connector_module_path: pdctl.connector.nixl`.

A thin adapter over vLLM's NixlConnector (pull mode); every layout decision is pdctl.kv's:
- NIXL progress without a busy-spinning thread: the agent's progress thread sleeps `progress_delay_us` between
  passes (nixl's Python wrapper hard-codes 0, i.e. a spinning core per server even when idle);
- prefill block < decode block on CPU_ATTN: received sub-blocks are merged with the real per-ISA layout
  (vLLM's generic merge assumes token rows and corrupts CPU KV silently), and the uncovered tail is zeroed in
  the same layout (vLLM's zeroing wipes V);
- pairs it cannot serve (prefill block > decode block, for now) fail at handshake with one message naming both
  sides, instead of vLLM's AssertionError at request time.

The class keeps the name NixlConnector because several vLLM config checks test that name. Importing this module
has no side effects: vLLM imports it in the API server, the engine core and every worker.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector, NixlPullConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
from vllm.logger import init_logger

from pdctl.kv.convert import Side, merge_in_place, zero_tokens_from
from pdctl.kv.layouts import BlockShape, layout

__all__ = ["NixlConnector"]

log = init_logger("vllm.pdctl.connector")  # under "vllm" so it lands in the server log


def _settings(vllm_config) -> dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.get_from_extra_config("pdctl", {}) or {})


@contextlib.contextmanager
def _throttled_agent(progress_thread: bool, delay_us: int):
    """Make the base worker build its NIXL agent with our progress-thread settings."""
    real_cls = _base_worker.NixlWrapper

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

    _base_worker.NixlWrapper = factory
    try:
        yield
    finally:
        _base_worker.NixlWrapper = real_cls


class PdctlNixlWorker(NixlPullConnectorWorker):
    def __init__(self, vllm_config, engine_id: str, kv_cache_config):
        s = _settings(vllm_config)
        self.pdctl_settings = s
        affinity = os.sched_getaffinity(0)
        with _throttled_agent(bool(s.get("progress_thread", True)), int(s.get("progress_delay_us", 1000))):
            super().__init__(vllm_config, engine_id, kv_cache_config)
        # The base worker pins this thread to the last core of each NUMA node; on a small host that puts every
        # instance's model thread on one core. Keep the binding vLLM's OMP setup chose.
        if not s.get("pin_transfer_thread", False):
            os.sched_setaffinity(0, affinity)
        self._cpu_attn = self.backend_name == "CPU_ATTN"
        log.info("pdctl connector: backend %s, block %d, progress thread %s (delay %s us)", self.backend_name,
                 self.block_size, s.get("progress_thread", True), s.get("progress_delay_us", 1000))

    # -- handshake -------------------------------------------------------------------------------------------

    def _describe_local(self) -> str:
        return (f"decode: block {self.block_size}, TP {self.world_size}, layout {self.kv_cache_layout}, "
                f"backend {self.backend_name}")

    def add_remote_agent(self, nixl_agent_meta, remote_tp_rank: int = 0, remote_tp_size: int = 1,
                         remote_dcp_size: int = 1) -> str:
        remote = (f"prefill: block {nixl_agent_meta.block_size}, TP {remote_tp_size}, layout "
                  f"{nixl_agent_meta.kv_cache_layout}, backend {nixl_agent_meta.attn_backend_name}")
        if nixl_agent_meta.block_size > self.block_size:
            raise RuntimeError(f"pdctl connector: unsupported P/D pair ({remote}; {self._describe_local()}): "
                               "prefill block > decode block is not implemented in this connector yet")
        if self._cpu_attn and nixl_agent_meta.attn_backend_name != self.backend_name:
            raise RuntimeError(f"pdctl connector: unsupported P/D pair ({remote}; {self._describe_local()}): "
                               "CPU_ATTN decode receiving from another attention backend")
        return super().add_remote_agent(nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size)

    # -- pairing ---------------------------------------------------------------------------------------------

    def _read_blocks_for_req(self, req_id: str, meta):
        # The decode's own prefix-cache hit (blocks already computed) for this request, per group: vLLM's
        # sub-block pairing below does not know it and shifts every pair when it is non-zero.
        self._cached_blocks = tuple(meta.local_num_computed_blocks or ())
        try:
            return super()._read_blocks_for_req(req_id, meta)
        finally:
            self._cached_blocks = ()

    def _map_block_ids_for_block_size_ratio(self, local_block_ids, remote_block_ids, block_size_ratio: int):
        local, remote = super()._map_block_ids_for_block_size_ratio(local_block_ids, remote_block_ids,
                                                                    block_size_ratio)
        cached = getattr(self, "_cached_blocks", ())
        if not local or not any(cached):
            return local, remote
        # Local sub-block j is token range (cached + j) * remote_block: it pairs with remote block cached*ratio + j,
        # so only len(remote) - cached*ratio of them exist; vLLM clips at len(remote), then end-trims the remote
        # list to the local count, which pairs every sub-block with the wrong remote block.
        out = []
        for g, group in enumerate(local):
            skip = (cached[g] if g < len(cached) else 0) * block_size_ratio * self._physical_blocks_per_logical_kv_block
            out.append(group[: max(0, len(remote[g]) - skip)] if group else group)
        return (out if any(out) else []), remote

    # -- receive ---------------------------------------------------------------------------------------------

    def _cpu_side(self, cache: torch.Tensor, block_size: int) -> Side:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        _, heads, _, two_d = cache.shape
        isa = _get_attn_isa(cache.dtype, block_size, two_d // 2, self.vllm_config.cache_config.cache_dtype)
        return Side(layout(isa), BlockShape(heads, block_size, two_d // 2))

    def post_process_device_kv_on_receive(self, block_size_ratio: int, block_ids_list, convert: bool = True):
        if not self._cpu_attn or self.enable_permute_local_kv:
            return super().post_process_device_kv_on_receive(block_size_ratio, block_ids_list, convert)
        # CPU_ATTN: merge sub-blocks and zero the uncovered tail in the ISA's real layout.
        for group, block_ids, covered_sub_blocks in block_ids_list:
            names = self.kv_cache_config.transfer_groups[group].layer_names
            covered_blocks, sub_in_last = divmod(covered_sub_blocks, block_size_ratio)
            written = covered_blocks + (1 if sub_in_last else 0)
            idx = torch.tensor(block_ids[:written], dtype=torch.long)
            stale = torch.tensor(block_ids[written:], dtype=torch.long)
            for name in names:
                cache = self.device_kv_caches[name]
                local = self._cpu_side(cache, self.block_size)
                if written:
                    blocks = cache.index_select(0, idx).reshape(written, -1)
                    if convert and block_size_ratio > 1:
                        received = self._cpu_side(cache, self.block_size // block_size_ratio)
                        blocks = merge_in_place(blocks, block_size_ratio, received, local)
                    if sub_in_last:
                        first = sub_in_last * (self.block_size // block_size_ratio)
                        blocks[-1:] = zero_tokens_from(blocks[-1:], local, first)
                    cache.index_copy_(0, idx, blocks.reshape(-1, *cache.shape[1:]))
                if stale.numel():
                    cache.index_fill_(0, stale, 0)


class NixlConnector(NixlPullConnector):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config):
        # NixlPullConnector.__init__ would build the stock worker (and its spinning NIXL agent): skip to the base.
        NixlBaseConnector.__init__(self, vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(vllm_config, self.engine_id, kv_cache_config)
            self.connector_worker = None
        elif role == KVConnectorRole.WORKER:
            self.connector_scheduler = None
            self.connector_worker = PdctlNixlWorker(vllm_config, self.engine_id, kv_cache_config)
