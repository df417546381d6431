"""A decode whose cache is handed to the connector as separate K and V tensors per layer (vllm-gaudi's `hpu` form,
and its `hpu_host` host buffer), reading a prefill of another form: a joined cache (CUDA's LBHNC or LBNHC, a
CPU_ATTN page) or Gaudi's other buffer. A mixin of pdctl.connector.nixl.PdctlNixlWorker.

- Registration is vllm-gaudi's: its `hpu_nixl_connector` replaces vLLM's `register_kv_caches` at class level (K
  and V registered as two regions per layer, each region's page half the layer's). Without it vLLM cannot register
  a (K, V) layer at all, so the connector refuses at start; with it, the regions registered are checked against
  pdctl.kv's model of the cache (`reads.regions_of`) before any read, so a vllm-gaudi built for another vLLM is
  refused rather than misread.
- The read: a joined prefill's metadata is read as two halves per layer (`reads.as_halves`), so vLLM's descriptor
  lists pair a page's first half with K and its second with V, region by region as it always does; pdctl's pair
  rules (`reads.refusal`) stand in for vLLM's layout and block-length checks, which compare like with like.
- The receive runs where NIXL wrote: in the host buffer before vllm-gaudi copies it to the device, or on the device
  cache (pdctl.kv.receive regroups the halves, merges sub-blocks, repacks).

Not yet (refused at the handshake, naming the pair): a joined decode reading a Gaudi prefill, a Gaudi prefill
block bigger than the decode's, and a conversion at equal block sizes into a device cache (vLLM post-processes a
read only when the block sizes differ)."""

from __future__ import annotations

import dataclasses

import torch

from pdctl import protocol
from pdctl.connector import seam
from pdctl.kv import reads
from pdctl.kv.forms import FormError, KvPair, KvPairForm
from pdctl.kv.layouts import layout
from pdctl.kv.receive import receive_merged

GAUDI_REGISTRATION = "vllm_gaudi.distributed.kv_transfer.kv_connector.v1.hpu_nixl_connector"


def kv_pair(cache) -> KvPair | None:
    """A layer's cache as a (K, V) pair, or None for a joined one: vllm-gaudi hands a device cache as a tuple of K
    and V, and allocates its host buffer as one [2, B, N, H, D] view per layer."""
    if isinstance(cache, (tuple, list)):
        if len(cache) != 2:
            raise FormError(f"a layer handed as {len(cache)} tensors: pdctl.kv models one joined tensor or a (K, V) "
                            "pair")
        return KvPair(*cache)
    if isinstance(cache, torch.Tensor) and cache.dim() == 5 and cache.shape[0] == 2:
        return KvPair(cache[0], cache[1])
    return None


class KvPairCaches:
    def _pair_forms(self) -> bool:
        """Whether this worker's cache is handed as (K, V) pairs (chosen when the caches were registered)."""
        return any(isinstance(f, KvPairForm) for f in self._forms.values())

    def _refuse_unregistrable_pairs(self) -> None:
        """Before vLLM registers: a (K, V) cache needs vllm-gaudi's registration, whose absence vLLM would report
        as an AttributeError deep in its loop."""
        if self._pair_forms() and not seam.registers_kv_pairs():
            raise FormError(
                f"{protocol.REFUSED_MARK} KV cache: a layer handed as separate K and V tensors (vllm-gaudi's "
                f"{next(iter(self._forms.values())).name} form) is registered as two NIXL regions by vllm-gaudi's "
                f"{GAUDI_REGISTRATION}, which did not load in this process; vLLM's own registration takes one tensor "
                "per layer")

    def _xfer_caches(self) -> dict:
        """The caches NIXL reads into: the host buffer where there is one, else the device cache."""
        return self.host_xfer_buffers if seam.uses_host_buffer(self) else self.device_kv_caches

    def _check_pair_registration(self) -> None:
        """After registration: each layer's K and V registered as two adjacent regions, each the K or V page of
        every block, as pdctl.kv models them; else refused, naming the first layer that differs."""
        if not self._pair_forms():
            return
        registered = seam.registered_regions(self)
        at = {r[0]: i for i, r in enumerate(registered)}
        for name, raw in self._xfer_caches().items():
            want = [(r.base, r.page_len, r.stride, r.blocks) for r in reads.regions_of(kv_pair(raw),
                                                                                       self._xfer_form(name))]
            i = at.get(want[0][0])
            got = registered[i:i + 2] if i is not None else []
            if got != want:
                raise FormError(
                    f"{protocol.REFUSED_MARK} KV cache: layer {name}'s K and V were registered as {got or 'nothing'}, "
                    f"pdctl.kv's model of its {self._xfer_form(name).name} form is {want} (K's then V's region): "
                    "vllm-gaudi's registration does not match this vLLM's worker")

    def _xfer_form(self, name: str):
        """The form of layer `name`'s cache where NIXL reads into it (the host buffer's, where there is one)."""
        if name not in self._xfer_forms:
            self._xfer_forms[name] = self._form_of(self._xfer_caches()[name])
        return self._xfer_forms[name]

    def _xfer_layers(self, names: list[str]) -> list:
        """One KV group's layers where NIXL wrote them, each with its form (pairs as pdctl.kv.forms.KvPair)."""
        out = []
        for name in names:
            raw = self._xfer_caches()[name]
            out.append((kv_pair(raw) or raw, self._xfer_form(name)))
        return out

    def _pair_read(self, meta, prefill: reads.Peer, decode: reads.Peer, refuse):
        """The prefill's metadata as this (K, V)-pair decode reads it, or refused: what is not served yet."""
        ratio = self.block_size // prefill.block_size if prefill.block_size <= self.block_size else 0
        if prefill.kv_pair and not decode.kv_pair:
            refuse("pdctl: a joined decode reading a (K, V)-pair prefill (Gaudi) is not served yet: its local regions "
                   "must be read as halves; pair Gaudi prefills with Gaudi decodes")
        if not ratio:
            refuse("pdctl: a (K, V)-pair decode (Gaudi) reading a prefill with a bigger block is not served yet")
        repacked = layout(prefill.packing) is not layout(decode.packing)
        if ratio == 1 and repacked and not seam.uses_host_buffer(self):
            refuse(f"pdctl: {prefill.packing} -> {decode.packing} at equal block sizes into a device cache is not "
                   "served yet (vLLM post-processes a read only across block sizes); stage through a host buffer "
                   "(connector.kv_buffer_device: cpu)")
        self._pair_reads.add(meta.engine_id)
        if not prefill.kv_pair:
            meta = reads.as_halves(meta)
        return dataclasses.replace(meta, kv_cache_layout=self.kv_cache_layout)

    def _validate_remote_agent_handshake(self, nixl_agent_meta, remote_tp_size: int, remote_dcp_size: int = 1):
        """vLLM's checks compare like with like (same layout, one region per layer, no host buffer across block
        sizes); a read with a (K, V)-pair side was accepted by pdctl's pair rules instead. What still must hold:
        region i of the prefill is region i of the decode, its page the decode's page / ratio."""
        if nixl_agent_meta.engine_id not in self._pair_reads:
            return super()._validate_remote_agent_handshake(nixl_agent_meta, remote_tp_size, remote_dcp_size)
        ratio = self.block_size // nixl_agent_meta.block_size
        local = seam.registered_regions(self)
        remote = nixl_agent_meta.block_lens
        if len(remote) != len(local) or any(r * ratio != loc[1] for r, loc in zip(remote, local, strict=True)):
            raise RuntimeError(
                f"{protocol.REFUSED_MARK} P/D pair: the prefill's {len(remote)} regions of pages {sorted(set(remote))} "
                f"bytes do not pair with this decode's {len(local)} regions of {sorted({r[1] for r in local})} bytes "
                f"at block ratio {ratio}")
        return None

    def _received_on_host(self) -> bool:
        """Whether reads are converted in the host buffer (a (K, V)-pair decode with one), not on the device."""
        return self._pair_forms() and seam.uses_host_buffer(self)

    def sync_recved_kv_to_device(self, req_id: str, meta):
        """A (K, V)-pair decode with a host buffer converts there, before vllm-gaudi copies the blocks to the device;
        vLLM's device post-process then has nothing left to do (pdctl.connector.nixl skips it)."""
        remote = meta.remote
        if self._received_on_host() and remote is not None and remote.engine_id in self._pair_reads:
            block = self._remote_block[remote.engine_id]
            ratio = self.block_size // block
            packed = self._received_packing.get(block)
            repacked = layout(packed) is not layout(self._xfer_form(next(iter(self._xfer_caches()))).name)
            for g, local in enumerate(meta.local_physical_block_ids):
                if local and (ratio > 1 or repacked):
                    covered = min(len(local) * ratio, len(remote.block_ids[g]))
                    receive_merged(self._xfer_layers(seam.group_layer_names(self, g)), list(local), ratio, covered,
                                   None, packed)
        return super().sync_recved_kv_to_device(req_id, meta)
