"""The connector's handshake: each side's exact CPU cache layout (the attention ISA) travels with vLLM's own
handshake, and a pair the connector cannot serve fails there, with one message naming both sides. A mixin of
pdctl.connector.nixl.PdctlNixlWorker."""

from __future__ import annotations

import dataclasses

from pdctl import protocol
from pdctl.connector import seam
from pdctl.connector.common import log
from pdctl.kv import reads
from pdctl.kv.layouts import layout


def packing_note(tag: str | None) -> str:
    """What a side's packing tag says, for messages naming the pair."""
    if not tag:
        return ""
    return f" ({tag}: K and V tensors)" if layout(tag).regions == 2 else f" (ISA {tag})"


class Handshake:
    def _isa(self, block_size: int) -> str | None:
        """The CPU attention ISA this host uses for blocks of block_size tokens (None off CPU_ATTN)."""
        if not self._cpu_attn or not self.device_kv_caches:
            return None
        cache = next(iter(self.device_kv_caches.values()))
        return seam.attn_isa(cache.dtype, block_size, cache.shape[-1] // 2, self.vllm_config.cache_config.cache_dtype)

    def register_kv_caches(self, kv_caches):
        super().register_kv_caches(kv_caches)
        isa = self._advertised_isa()
        # Advertise the exact cache layout: an AMX prefill and a vec decode would otherwise misread each other, and
        # vLLM's metadata cannot say that a cache is a (K, V) pair.
        if isa and seam.rewrite_handshake_metadata(self, lambda meta: dataclasses.replace(
                meta, attn_backend_name=protocol.tag_backend(meta.attn_backend_name, isa))):
            log.info("pdctl connector: advertising KV packing %s (block %d)", isa, self.block_size)

    def _advertised_isa(self) -> str | None:
        """How this worker's registered pages are packed where vLLM's metadata cannot say it: the CPU attention ISA
        of this host, or a (K, V) pair's form (hpu, hpu_host: the buffer NIXL reads)."""
        if self._pair_forms():
            return self._xfer_form(next(iter(self._xfer_caches()))).name
        return self._isa(self.block_size)

    def _describe_local(self) -> str:
        isa = self._advertised_isa()
        return (f"decode: block {self.block_size}, TP {self.world_size}, layout {self.kv_cache_layout}, "
                f"backend {self.backend_name}{packing_note(isa)}")

    def add_remote_agent(self, nixl_agent_meta, remote_tp_rank: int = 0, remote_tp_size: int = 1,
                         remote_dcp_size: int = 1) -> str:
        backend, remote_isa = protocol.untag_backend(nixl_agent_meta.attn_backend_name)
        nixl_agent_meta = dataclasses.replace(nixl_agent_meta, attn_backend_name=backend)
        remote = (f"prefill: block {nixl_agent_meta.block_size}, TP {remote_tp_size}, layout "
                  f"{nixl_agent_meta.kv_cache_layout}, backend {backend}{packing_note(remote_isa)}")

        def refuse(why: str):
            raise RuntimeError(f"{protocol.REFUSED_MARK} P/D pair ({remote}; {self._describe_local()}): {why}")

        self._remote_block[nixl_agent_meta.engine_id] = nixl_agent_meta.block_size
        if self._window_groups() and nixl_agent_meta.block_size != self.block_size:
            uneven = sorted({seam.group_block_size(self, g) for g in range(seam.group_count(self))})
            if len(uneven) > 1:
                refuse(f"hybrid model whose KV cache groups have different block sizes {uneven} on the decode")
            if seam.kernel_blocks_per_block(self) != 1:
                refuse("hybrid model with kernel blocks smaller than logical blocks")
        if self._cpu_attn and backend == self.backend_name:
            remote_isa = self._remote_isa(nixl_agent_meta.block_size, remote_isa)
        prefill = reads.Peer(backend, nixl_agent_meta.kv_cache_layout, nixl_agent_meta.block_size, remote_tp_size,
                             remote_isa)
        decode = reads.Peer(self.backend_name, self.kv_cache_layout, self.block_size, self.world_size,
                            self._advertised_isa())
        why = reads.refusal(prefill, decode, self._isa(nixl_agent_meta.block_size))
        if why:
            refuse(why)
        self._note_packing(prefill, decode, refuse)
        if prefill.kv_pair or decode.kv_pair:  # pdctl.connector.kv_pairs
            nixl_agent_meta = self._pair_read(nixl_agent_meta, prefill, decode, refuse)
            return super().add_remote_agent(nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size)
        if nixl_agent_meta.block_size > self.block_size:
            nixl_agent_meta = self._split_read(nixl_agent_meta, refuse)
        return super().add_remote_agent(nixl_agent_meta, remote_tp_rank, remote_tp_size, remote_dcp_size)

    def _split_read(self, meta, refuse):
        """Prefill block > decode block: the prefill's metadata as decode-sized chunks (pdctl.connector.split)."""
        ratio = meta.block_size // self.block_size
        if self._staging_blocks < 2 * (ratio - 1):
            refuse(f"the decode reserved {self._staging_blocks} staging blocks, it needs at least "
                   f"{2 * (ratio - 1)} (connector extra config pdctl.staging_blocks; pdctl's plan sets it)")
        if seam.kernel_blocks_per_block(self) != 1:
            refuse("prefill block > decode block with kernel blocks smaller than logical blocks")
        self._split_ratio[meta.engine_id] = ratio
        log.info("pdctl connector: prefill block %d > decode block %d: reading %d chunks per prefill block, "
                 "split after receive (staging %d blocks)", ratio * self.block_size, self.block_size, ratio,
                 self._staging_blocks)
        return reads.as_decode_sized(meta, ratio)

    def _remote_isa(self, remote_block: int, remote_isa: str | None) -> str | None:
        """The ISA the prefill packs its pages for (what this host would use for its block size, when it did not
        say: a stock prefill)."""
        if remote_isa is None:
            remote_isa = self._isa(remote_block)
            log.warning("pdctl connector: the prefill did not say its CPU attention ISA (not pdctl's connector?); "
                        "assuming %s", remote_isa)
        return remote_isa

    def _note_packing(self, prefill: reads.Peer, decode: reads.Peer, refuse) -> None:
        """How the prefill's pages arrive packed (a CPU prefill's ISA, a joined cache's HND or NHD), by prefill block
        size: one packing per block size, because vLLM's receive post-process knows a read's block-size ratio, not
        its prefill. The merge and the split read them from that packing."""
        known = self._received_packing.setdefault(prefill.block_size, prefill.packing)
        if layout(known) is not layout(prefill.packing):
            refuse(f"another prefill with the same block size packs its KV as {known}; one packing per prefill "
                   "block size")
        if prefill.block_size < self.block_size:
            log.info("pdctl connector: prefill block %d < decode block %d: NIXL reads %d sub-blocks per decode block "
                     "in place (transfer plan), then one merge pass %s -> %s (post-receive transform)",
                     prefill.block_size, self.block_size, self.block_size // prefill.block_size, prefill.packing,
                     decode.packing)
