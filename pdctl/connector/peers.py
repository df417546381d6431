"""Whether a prefill is still there, asked off the decode engine's step: its NIXL side channel (the address its
KV parameters name) refusing connections means the server is gone. A dead prefill's reads in progress are then
given up at once instead of at connector.kv_read_timeout_s; reads from the other prefills are not touched.

A refused connection is the only verdict taken: a timeout (a host that is down or a network that drops packets)
says nothing, and those reads end at their timeout.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

CONNECT_TIMEOUT_S = 1.0
RECHECK_S = 0.5  # a peer is connected to at most this often


def refused(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> bool:
    """True when nothing listens at host:port (the connection was refused)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class PeerWatch:
    """Verdicts on peers, each found by a short-lived thread so the caller never waits on a connect: `gone(peer)`
    answers with the latest verdict (False until one exists) and starts a new check when that one is stale."""

    def __init__(self, probe: Callable[[str, int], bool] = refused, recheck_s: float = RECHECK_S,
                 clock: Callable[[], float] = time.monotonic):
        self._probe, self._recheck_s, self._clock = probe, recheck_s, clock
        self._lock = threading.Lock()
        self._verdict: dict[tuple[str, int], tuple[float, bool]] = {}  # peer -> (when checked, gone)
        self._checking: set[tuple[str, int]] = set()

    def gone(self, peer: tuple[str, int]) -> bool:
        with self._lock:
            at, verdict = self._verdict.get(peer, (None, False))
            stale = at is None or self._clock() - at >= self._recheck_s
            if stale and peer not in self._checking:
                self._checking.add(peer)
                threading.Thread(target=self._check, args=(peer,), daemon=True, name="pdctl-peer-check").start()
            return verdict

    def _check(self, peer: tuple[str, int]) -> None:
        try:
            verdict = self._probe(*peer)
        except Exception:  # noqa: BLE001 (a check that fails says nothing about the peer)
            verdict = False
        with self._lock:
            self._verdict[peer] = (self._clock(), verdict)
            self._checking.discard(peer)
