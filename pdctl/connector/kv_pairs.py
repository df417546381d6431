"""Caches handed to the connector as separate K and V tensors per layer (vllm-gaudi's `hpu` form, and its
`hpu_host` host buffer), read across forms in both directions. A mixin of pdctl.connector.nixl.PdctlNixlWorker.

- Registration is vllm-gaudi's: its `hpu_nixl_connector` replaces vLLM's `register_kv_caches` at class level (K
  and V registered as two regions per layer, each region's page half the layer's). Without it vLLM cannot register
  a (K, V) layer at all, so the connector refuses at start; with it, the regions registered are checked against
  pdctl.kv's model of the cache (`reads.regions_of`) before any read, so a vllm-gaudi built for another vLLM is
  refused rather than misread.
- Every read with a (K, V)-pair side pairs region i with region i, as vLLM's descriptor lists always do: a joined
  side's pages are read as two halves (pdctl.kv.reads.halves). pdctl's pair rules (`reads.refusal`) stand in for
  vLLM's layout and block-length checks, which compare like with like.
- A Gaudi decode reading a joined prefill: the prefill's metadata as halves (`reads.as_halves`); the receive where
  NIXL wrote, in the host buffer before vllm-gaudi copies it to the device, or on the device cache.
- A joined decode reading a Gaudi prefill (a bigger block): the decode's own pages as halves through a local
  descriptor list of their own, the prefill's blocks as decode-sized chunks split after receive.

Not yet (refused at the handshake, naming the pair): a joined decode reading a Gaudi prefill at an equal or bigger
block or with sliding-window groups, a prefill block bigger than a Gaudi decode's, and a repacking at equal block
sizes into a device cache (vLLM post-processes a read only when the block sizes differ)."""

from __future__ import annotations

import dataclasses

import numpy as np
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


def every_other(meta, first: int):
    """Handshake metadata of every other region from `first` (a (K, V)-pair side's K regions, or its V regions)."""
    per_region = ("kv_caches_base_addr", "block_lens", "block_strides", "region_num_blocks", *reads.PER_REGION)
    return dataclasses.replace(meta, **{f: getattr(meta, f)[first::2] for f in per_region if getattr(meta, f)})


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
        caches = self._xfer_caches()
        return [(kv_pair(caches[name]) or caches[name], self._xfer_form(name)) for name in names]

    def _pair_read(self, meta, prefill: reads.Peer, decode: reads.Peer, refuse):
        """The prefill's metadata as this decode reads it when either side is a (K, V) pair, or refused: what is not
        served yet."""
        if prefill.kv_pair and not decode.kv_pair:
            return self._halved_read(meta, prefill, refuse)
        ratio = self.block_size // prefill.block_size if prefill.block_size <= self.block_size else 0
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

    # -- a joined decode reading a (K, V)-pair prefill -----------------------------------------------------------

    def _halved_read(self, meta, prefill: reads.Peer, refuse):
        """A joined decode reading a Gaudi prefill: its own pages read as two halves each (K's, V's), against the
        prefill's K and V regions, through a local descriptor list of its own (`_halved_handle`); the prefill's
        bigger blocks as decode-sized chunks, split after receive from the prefill's packing (pdctl.connector.split).
        vLLM's shared per-region state is never swapped: its handshake runs in a thread beside the engine's reads."""
        if prefill.block_size <= self.block_size:
            refuse(f"pdctl: a joined decode reads a (K, V)-pair prefill (Gaudi) only with a smaller block (the split "
                   f"regroups its pages); got {prefill.block_size} -> {self.block_size}")
        if self._window_groups():
            refuse("pdctl: a hybrid model's sliding-window groups from a (K, V)-pair prefill are not served yet")
        if not seam.desc_ids_by_region_groups():
            refuse("pdctl: a joined decode reads a (K, V)-pair prefill (Gaudi) through vLLM 0.32's descriptor ids; "
                   "this vLLM counts them otherwise (not adapted yet): pair Gaudi prefills with Gaudi decodes")
        meta = self._split_read(meta, refuse)
        self._halved_handle(self.block_size)
        self._pair_reads.add(meta.engine_id)
        self._halved_engines.add(meta.engine_id)
        return dataclasses.replace(meta, kv_cache_layout=self.kv_cache_layout)

    def _halved_regions(self) -> list[reads.Region]:
        """This decode's registered regions, each as its two halves (pdctl.kv.reads.halves)."""
        return [h for r in seam.registered_regions(self) for h in reads.halves([reads.Region(*r)])]

    def _halved_handle(self, block_size: int):
        """The local descriptor list of this decode's halved regions for reads of `block_size` tokens (made once)."""
        with self._halved_lock:
            if block_size not in self._halved_handles:
                ratio = self.block_size // block_size
                rows = np.concatenate([reads.descriptors(r, ratio) for r in self._halved_regions()])
                self._halved_handles[block_size] = seam.local_descriptor_list(self, rows)
            return self._halved_handles[block_size]

    def _build_fa_remote(self, plan, nixl_agent_meta, block_size_ratio: int):
        """A (K, V)-pair prefill read by a joined decode: vLLM's descriptors for its K regions and for its V regions
        (each list as long as the decode's regions, which vLLM pairs them with for the length), interleaved back to
        the prefill's region order, each as long as the prefill's (decode-sized) page."""
        if nixl_agent_meta.engine_id not in self._halved_engines:
            return super()._build_fa_remote(plan, nixl_agent_meta, block_size_ratio)
        counts = nixl_agent_meta.region_num_blocks or \
            [nixl_agent_meta.num_blocks] * len(nixl_agent_meta.kv_caches_base_addr)
        halves = [super(KvPairCaches, self)._build_fa_remote(plan, every_other(nixl_agent_meta, h), block_size_ratio)
                  for h in (0, 1)]
        rows = [np.split(h, np.cumsum(counts[i::2])[:-1]) for i, h in enumerate(halves)]
        descs = np.concatenate([part for pair in zip(*rows, strict=True) for part in pair])
        descs[:, 1] = np.repeat(np.asarray(nixl_agent_meta.block_lens, dtype=descs.dtype), counts)
        return descs

    def _read_blocks(self, read_spec, dst_engine_id, request_id, remote_request_id, local_xfer_side_handle,
                     local_dram_handle, remote_xfer_side_handle, expected_consumers, awaiting_kvs):
        """A read from a (K, V)-pair prefill into a joined decode goes into the halved local list, its descriptor
        ids counted over the halved regions (`_compute_desc_ids`); on the engine's thread only."""
        halved = dst_engine_id in self._halved_engines
        if halved:
            local_xfer_side_handle = self._halved_handle(self.block_size)
        self._halved_now = halved
        try:
            return super()._read_blocks(
                read_spec=read_spec, dst_engine_id=dst_engine_id, request_id=request_id,
                remote_request_id=remote_request_id, local_xfer_side_handle=local_xfer_side_handle,
                local_dram_handle=local_dram_handle, remote_xfer_side_handle=remote_xfer_side_handle,
                expected_consumers=expected_consumers, awaiting_kvs=awaiting_kvs)
        finally:
            self._halved_now = False

    def _compute_desc_ids(self, block_ids, dst_num_blocks, block_size_ratio, physical_blocks_per_logical,
                          **given):
        if getattr(self, "_halved_now", False) and block_size_ratio is not None:  # the local side of a halved read
            # vLLM 0.32's keywords (the handshake refuses a halved read where vLLM takes others).
            regions = len(seam.registered_regions(self))
            counts = given.get("region_num_blocks") or [dst_num_blocks] * regions
            groups = given.get("region_group_ids") or seam.region_groups(self) or [0] * regions
            given.update(region_num_blocks=[n for n in counts for _ in (0, 1)],
                         region_group_ids=[g for g in groups for _ in (0, 1)])
        return super()._compute_desc_ids(block_ids=block_ids, dst_num_blocks=dst_num_blocks,
                                         block_size_ratio=block_size_ratio,
                                         physical_blocks_per_logical=physical_blocks_per_logical, **given)

    def _validate_remote_agent_handshake(self, nixl_agent_meta, remote_tp_size: int, remote_dcp_size: int = 1):
        """vLLM's checks compare like with like (same layout, one region per layer, no host buffer across block
        sizes); a read with a (K, V)-pair side was accepted by pdctl's pair rules instead. What still must hold:
        region i of the prefill is region i of the decode, its page the decode's page / ratio."""
        if nixl_agent_meta.engine_id not in self._pair_reads:
            return super()._validate_remote_agent_handshake(nixl_agent_meta, remote_tp_size, remote_dcp_size)
        ratio = self.block_size // nixl_agent_meta.block_size
        local = ([r.page_len for r in self._halved_regions()] if nixl_agent_meta.engine_id in self._halved_engines
                 else [r[1] for r in seam.registered_regions(self)])
        remote = nixl_agent_meta.block_lens
        if len(remote) != len(local) or any(r * ratio != n for r, n in zip(remote, local, strict=True)):
            raise RuntimeError(
                f"{protocol.REFUSED_MARK} P/D pair: the prefill's {len(remote)} regions of pages {sorted(set(remote))} "
                f"bytes do not pair with this decode's {len(local)} regions of {sorted(set(local))} bytes at block "
                f"ratio {ratio}")
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
