"""Hybrid models (sliding-window + full-attention KV groups under vLLM's hybrid KV cache manager): each side keeps
only the window's tail of a sliding-window group, cut by its own block size; those blocks are paired by absolute
token position (pdctl.kv.window) in both directions, and what the prefill no longer holds is zeroed. A mixin of
pdctl.connector.nixl.PdctlNixlWorker."""

from __future__ import annotations

from typing import Any

from pdctl.connector import seam
from pdctl.connector.common import log
from pdctl.kv import reads
from pdctl.kv.window import window_pairs


class SlidingWindowReads:
    def _window_groups(self) -> dict[int, int]:
        """KV transfer group -> sliding window (tokens), for the groups that are sliding-window ones."""
        if self._windows is None:
            groups = range(seam.group_count(self))
            self._windows = {g: w for g in groups if (w := seam.group_window(self, g))}
        return self._windows

    def _window_tails(self, meta, group: int, window: int, prefill_block: int) -> dict[str, Any] | None:
        """Where the two tails of a sliding-window group lie (pdctl.kv.reads.window_tails)."""
        return reads.window_tails(meta.local_physical_block_ids[group], meta.remote.block_ids[group],
                                  tokens=meta.remote.num_tokens, window=window, prefill_block=prefill_block,
                                  decode_block=self.block_size)

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
