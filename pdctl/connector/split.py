"""Prefill block > decode block (vLLM refuses it with an AssertionError at request time): the prefill is presented
to vLLM's read machinery as decode-sized byte chunks; every prefill block a request touches is read whole, the
chunks that no block of the request holds going to a staging area the decode's scheduler reserved at start; on
completion each prefill block is reassembled and split into decode blocks in the real layout
(pdctl.kv.split_in_place), from the prefill's packing where it differs (a CPU prefill of another attention ISA).
A mixin of pdctl.connector.nixl.PdctlNixlWorker."""

from __future__ import annotations

from pdctl.connector import seam
from pdctl.connector.common import log
from pdctl.kv import reads
from pdctl.kv.index import SplitPlan, StagingPool
from pdctl.kv.receive import receive_split
from pdctl.kv.window import WindowFill


class PrefillBlockSplit:
    def _staging_pool(self) -> StagingPool:
        if self._staging is None:  # the cache is registered by the first read
            name = next(iter(self.device_kv_caches))
            total = self._form(name).num_blocks(self._cache(name))
            self._staging = StagingPool.last_blocks(total, self._staging_blocks)
        return self._staging

    def _plan_split(self, req_id: str, meta, ratio: int, prefix_hit: tuple[int, ...]) -> bool:
        """Rewrite the request's read lists to whole prefill blocks as decode-sized chunks (pdctl.kv.reads);
        False: the sliding-window tails do not hold the window, or the staging area cannot hold the chunks no
        decode block takes."""
        windows = self._window_groups() if any(meta.local_physical_block_ids or ()) else {}
        tails = {g: self._window_tails(meta, g, w, ratio * self.block_size) for g, w in windows.items()}
        try:
            read = reads.plan_split(meta.local_physical_block_ids, meta.remote.block_ids, ratio=ratio,
                                    block_size=self.block_size, tokens=meta.remote.num_tokens, cached=prefix_hit,
                                    tails=tails, take=self._staging_pool().take)
        except reads.WindowNotHeld:
            log.warning("pdctl connector: request %s: the sliding-window tails do not hold the window; its KV "
                        "load fails", req_id)
            return False
        except reads.StagingFull:
            log.warning("pdctl connector: staging area full (%d blocks): request %s's KV load fails "
                        "(kv_load_failure_policy %s: %s)", self._staging_blocks, req_id,
                        self._failure_policy, "the decode computes the prompt itself"
                        if self._failure_policy == "recompute" else "the request ends with an error")
            return False
        plan = read.plan
        if windows:
            self._split_fills[req_id] = read.fills
            self._log_window_read(meta, {g: len(plan.groups[g]) // ratio for g in tails}, ratio * self.block_size)
        meta.local_physical_block_ids = plan.local_ids()
        meta.remote.block_ids = plan.remote_ids()
        if any(plan.groups):  # a read of nothing is never reported done: a kept plan would outlive its request
            self._split_plans[req_id] = plan
        return True

    def _release(self, plan: SplitPlan) -> None:
        staging = plan.staging()
        if staging:
            self._staging_pool().release(staging)

    def _split_received(self, plan: SplitPlan, window_fills: dict[int, tuple[WindowFill, ...]]) -> None:
        """Reassemble each prefill block read and split it into decode blocks in the real layout; keep the
        request's decode blocks (not the staging chunks) and zero the slots past the prompt (sliding-window
        groups: every slot of their blocks that received nothing)."""
        packed = self._received_packing.get(plan.ratio * self.block_size)  # the prefill's, as it advertised
        for g, chunks in enumerate(plan.groups):
            receive_split(self._layers(seam.group_layer_names(self, g)), chunks, plan.ratio, plan.tokens,
                          window_fills.get(g), packed)

    def _build_fa_remote(self, plan, nixl_agent_meta, block_size_ratio: int):
        """The remote descriptors; a prefill read as decode-sized chunks gets each chunk's address from
        pdctl.kv.reads (vLLM's is base + j * stride, right only where a layer's pages abut: LB*)."""
        descs = super()._build_fa_remote(plan, nixl_agent_meta, block_size_ratio)
        ratio = self._split_ratio.get(nixl_agent_meta.engine_id)
        if ratio:
            descs[:, 0] = reads.split_addresses(nixl_agent_meta, ratio, descs)
        return descs

