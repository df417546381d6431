"""Test hooks inside real vLLM servers: a pool given PDCTL_TEST_* variables (conftest.hooks_env) and brought up
through tests/e2e/hooked_pdctl.py loads this module as its connector (vLLM's `kv_connector_module_path`; the class
is pdctl's own NixlConnector, re-exported below, with the hooks these variables ask for wrapped around it). Each
server reads the variables once.

PDCTL_TEST_READ_DELAY_S / PDCTL_TEST_READ_DELAY_MATCH: hold each read of a request whose id holds MATCH that long
after the decode got it (a fault drill kills the prefill in that gap, deterministically).
PDCTL_TEST_READ_STALL_S / PDCTL_TEST_READ_STALL_MATCH: report each posted read of a request whose id holds MATCH as
still in progress for that long (NIXL's own state is not touched: cancelling it then succeeds), as a read whose
target never progresses looks to the decode.
PDCTL_TEST_ADVERTISE_ISA: claim this CPU attention ISA at the handshake ("other": the one this host's is not; the
mismatch must be refused).
PDCTL_TEST_CORRUPT_MATCH: a broken conversion: after a received block of a request whose id holds MATCH is merged
(prefill block < decode block) or split (prefill block > decode block), flip one bit of its first layer's page, as a
conversion writing one wrong byte would (connector.kv_fingerprint must fail that load)."""

from __future__ import annotations

import os
import time

from pdctl.connector import nixl

DELAY_S = float(os.environ.get("PDCTL_TEST_READ_DELAY_S", "0"))
DELAY_MATCH = os.environ.get("PDCTL_TEST_READ_DELAY_MATCH", "")
ADVERTISE_ISA = os.environ.get("PDCTL_TEST_ADVERTISE_ISA")
STALL_S = float(os.environ.get("PDCTL_TEST_READ_STALL_S", "0"))
STALL_MATCH = os.environ.get("PDCTL_TEST_READ_STALL_MATCH", "")
CORRUPT_MATCH = os.environ.get("PDCTL_TEST_CORRUPT_MATCH", "")

if DELAY_S:
    _read = nixl.PdctlNixlWorker._read_blocks_for_req

    def _delayed_read(self, req_id: str, meta):
        if DELAY_MATCH in req_id:
            nixl.log.warning("test hook: holding the read of request %s for %g s", req_id, DELAY_S)
            time.sleep(DELAY_S)
        return _read(self, req_id, meta)

    nixl.PdctlNixlWorker._read_blocks_for_req = _delayed_read

if STALL_S:
    _posting = nixl.PdctlNixlWorker._read_blocks_for_req

    def _stalled_read(self, req_id: str, meta):
        out = _posting(self, req_id, meta)
        if STALL_MATCH in req_id:
            wrapper = self.nixl_wrapper
            if not hasattr(wrapper, "stalled_until"):
                wrapper.stalled_until = {}
                real_state = wrapper.check_xfer_state

                def check_xfer_state(handle):
                    if time.monotonic() < wrapper.stalled_until.get(handle, 0.0):
                        return "PROC"
                    return real_state(handle)

                wrapper.check_xfer_state = check_xfer_state
            for handle in self._recving_transfers.get(req_id, ()):
                wrapper.stalled_until[handle] = time.monotonic() + STALL_S
            nixl.log.warning("test hook: reporting the read of request %s in progress for %g s", req_id, STALL_S)
        return out

    nixl.PdctlNixlWorker._read_blocks_for_req = _stalled_read

if ADVERTISE_ISA:
    _advertised = nixl.PdctlNixlWorker._advertised_isa

    def _claimed_isa(self):
        real = _advertised(self)  # only where the host advertises one at all
        if ADVERTISE_ISA == "other":  # whichever this host's is not: amx on an AVX-512 host, vec on an AMX one
            return real and ("vec" if real == "amx" else "amx")
        return real and ADVERTISE_ISA

    nixl.PdctlNixlWorker._advertised_isa = _claimed_isa

if CORRUPT_MATCH:
    import torch

    from pdctl.connector import split

    _targets: set[int] = set()  # the first decode block of each matching request's read, until converted
    _reading = nixl.PdctlNixlWorker._read_blocks_for_req

    def _marked_read(self, req_id: str, meta):
        if CORRUPT_MATCH in req_id and meta.local_physical_block_ids and meta.local_physical_block_ids[0]:
            _targets.add(meta.local_physical_block_ids[0][0])
        return _reading(self, req_id, meta)

    def _break(layers, blocks) -> None:
        for block in [b for b in blocks if b in _targets]:
            _targets.discard(block)
            cache, _ = layers[0]
            cache[block].view(torch.uint8).view(-1)[1] ^= 0x04
            nixl.log.warning("test hook: one bit of block %d flipped after its conversion", block)

    _merge, _split = nixl.receive_merged, split.receive_split

    def _broken_merge(layers, block_ids, *args, **kwargs):
        _merge(layers, block_ids, *args, **kwargs)
        _break(layers, block_ids)

    def _broken_split(layers, chunks, *args, **kwargs):
        _split(layers, chunks, *args, **kwargs)
        _break(layers, [c.dest for c in chunks])

    nixl.PdctlNixlWorker._read_blocks_for_req = _marked_read
    nixl.receive_merged, split.receive_split = _broken_merge, _broken_split

# What vLLM loads from this module (kv_connector: NixlConnector): pdctl's connector, with the hooks above in place.
NixlConnector = nixl.NixlConnector
