"""Test hooks inside real vLLM servers, loaded by pdctl's connector through PDCTL_CONNECTOR_EXTENSIONS (never in
the product's path): `hooks_env(...)` gives a pool the variables, this module reads them in each server.

PDCTL_TEST_READ_DELAY_S / PDCTL_TEST_READ_DELAY_MATCH: hold each read of a request whose id holds MATCH that long
after the decode got it (a fault drill kills the prefill in that gap, deterministically).
PDCTL_TEST_ADVERTISE_ISA: claim another CPU attention ISA than this host's at the handshake (the mismatch must be
refused)."""

from __future__ import annotations

import os
import time

from pdctl.connector import nixl

DELAY_S = float(os.environ.get("PDCTL_TEST_READ_DELAY_S", "0"))
DELAY_MATCH = os.environ.get("PDCTL_TEST_READ_DELAY_MATCH", "")
ADVERTISE_ISA = os.environ.get("PDCTL_TEST_ADVERTISE_ISA")

if DELAY_S:
    _read = nixl.PdctlNixlWorker._read_blocks_for_req

    def _delayed_read(self, req_id: str, meta):
        if DELAY_MATCH in req_id:
            nixl.log.warning("test hook: holding the read of request %s for %g s", req_id, DELAY_S)
            time.sleep(DELAY_S)
        return _read(self, req_id, meta)

    nixl.PdctlNixlWorker._read_blocks_for_req = _delayed_read

if ADVERTISE_ISA:
    _advertised = nixl.PdctlNixlWorker._advertised_isa

    def _claimed_isa(self):
        return _advertised(self) and ADVERTISE_ISA  # only where the host advertises one at all

    nixl.PdctlNixlWorker._advertised_isa = _claimed_isa
