"""Prefill block > decode block (vLLM refuses it with an AssertionError at request time): the prefill is presented
to vLLM's read machinery as decode-sized byte chunks; every prefill block a request touches is read whole, the
chunks that no block of the request holds going to a staging area the decode's scheduler reserved at start; on
completion each prefill block is reassembled and split into decode blocks in the real layout
(pdctl.kv.split_in_place). A mixin of pdctl.connector.nixl.PdctlNixlWorker."""

from __future__ import annotations

import dataclasses

from pdctl.connector import seam
from pdctl.connector.common import log
from pdctl.kv.index import SplitPlan, StagingPool, split_plan, split_staging_needed, split_tail
from pdctl.kv.receive import split_received
from pdctl.kv.window import WindowFill, window_split_plan, window_staging_needed


class PrefillBlockSplit:
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

    def _split_received(self, plan: SplitPlan, window_fills: dict[int, tuple[WindowFill, ...]]) -> None:
        """Reassemble each prefill block read and split it into decode blocks in the real layout; keep the
        request's decode blocks (not the staging chunks) and zero the slots past the prompt (sliding-window
        groups: every slot of their blocks that received nothing)."""
        for g, chunks in enumerate(plan.groups):
            if not chunks:
                continue
            fills = window_fills.get(g)
            tail = None if fills is not None else split_tail([c.block for c in chunks], self.block_size, plan.tokens)
            dests, real = [c.dest for c in chunks], [c.real for c in chunks]
            split_received(self._layers(seam.group_layer_names(self, g)), dests, real, plan.ratio, tail, fills or ())



def as_decode_sized(meta, ratio: int):
    """The prefill's handshake metadata as if its blocks were `ratio` times smaller (contiguous byte chunks)."""
    return dataclasses.replace(
        meta, block_size=meta.block_size // ratio, num_blocks=meta.num_blocks * ratio,
        block_lens=[n // ratio for n in meta.block_lens], block_strides=[n // ratio for n in meta.block_strides],
        region_num_blocks=[n * ratio for n in meta.region_num_blocks] if meta.region_num_blocks else
        meta.region_num_blocks)
