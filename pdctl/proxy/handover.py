"""The early-decode hand-over (`proxy.early_decode`): the proxy sends a P/D request to its decode at the same
time as to its prefill, so the decode's own request path (its API server, engine input, scheduler, block
allocation: ~5 ms of TTFT on the CPU host, measured by the breakdown as "decode API" + "blocks") runs while the
prefill computes the prompt, instead of after it.

The decode request carries `kv_transfer_params: {"do_remote_prefill": true, "pdctl_await": TOKEN}`; the decode's
pdctl connector gives it its blocks and parks it (vLLM's WAITING_FOR_REMOTE_KVS) until the prefill's KV
parameters arrive here: one datagram from the proxy, `{"await": TOKEN, "params": {...}}`, or `"params": null`
when the prefill gave none (the proxy then drops the decode request and serves the request the ordinary way).
vLLM 0.32's own push mode (nixl/push_scheduler.py) overlaps the same way, but writes from the prefill and has no
block-size conversion.

The prefill hands them over itself when it can: the proxy's prefill request names the decode's socket and the
token (`kv_transfer_params.pdctl_handover_to: {"socket": NAME, "await": TOKEN}`), and the prefill's pdctl connector
sends the datagram from `request_finished`, in its engine core, the moment vLLM has the parameters (the prompt's
KV is computed), and marks its answer `pdctl_handed_over: true`. The decode's read then overlaps the prefill's own
output path (its API server, its JSON answer, the proxy: ~4 ms at one request at a time on the CPU host, where the
overlap measured neutral because both share its 2 cores; docs/notes/latency-attribution.md). The proxy hands the
parameters over only when the prefill did not (a prefill whose connector does not, a send that failed). A decode
that already claimed a token ignores a second hand-over for it. vLLM's pull protocol lets a decode read before the
prefill's worker has the request's send deadline (`nixl/pull_worker.py`, "P can now more easily lag behind D").

The channel is a Unix datagram socket in the abstract namespace, named after the decode's NIXL side-channel
address: host-local (the topology refuses early_decode for decodes on other hosts), no file to clean up, gone
with the process. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections import OrderedDict

log = logging.getLogger("vllm.pdctl.handover")

TOKEN_KEY = "pdctl_await"
TO_KEY = "pdctl_handover_to"  # a prefill request's: {"socket": NAME, "await": TOKEN}, where to hand its KV over
HANDED_KEY = "pdctl_handed_over"  # the prefill's answer: it handed its KV parameters over itself
PREFIX = "pdctl-handover-"
MAX_DATAGRAM = 1 << 20
KEEP_S = 600.0  # parameters nobody claimed (the decode request never arrived) are dropped after this long
CLAIMED_KEEP_S = 60.0  # a token taken (or its request gone) is remembered this long: a second hand-over is dropped


def name(side_channel_host: str, side_channel_port: int) -> str:
    """The decode's hand-over socket (abstract namespace: the leading NUL is added by `address`)."""
    return f"{PREFIX}{side_channel_host}:{side_channel_port}"


def direct_target(params: dict | None) -> tuple[str, str] | None:
    """Where a prefill request asks its prefill to hand the KV parameters over (socket, token), or None. Only a
    decode's hand-over socket: a request cannot make a prefill send to any other."""
    to = (params or {}).get(TO_KEY)
    if not isinstance(to, dict):
        return None
    sock, token = to.get("socket"), to.get("await")
    if isinstance(sock, str) and sock.startswith(PREFIX) and isinstance(token, str) and token:
        return sock, token
    return None


def address(sock_name: str) -> bytes:
    return b"\0" + sock_name.encode()


def send(sock_name: str, token: str, params: dict | None) -> str | None:
    """Hand the prefill's KV parameters (None: there are none) to the decode; None, or why it failed."""
    try:
        msg = json.dumps({"await": token, "params": params}, separators=(",", ":")).encode()
    except (TypeError, ValueError) as e:
        return f"KV parameters not JSON: {e}"
    if len(msg) > MAX_DATAGRAM:
        return f"{len(msg)} bytes of KV parameters exceed the hand-over's {MAX_DATAGRAM}"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            s.sendto(msg, address(sock_name))
    except OSError as e:  # nothing bound there (decode gone or restarted without it), or its queue is full
        return f"hand-over to {sock_name} failed: {e.strerror or e}"
    return None


class Listener:
    """The decode side: a thread receiving hand-overs; `take(token)` returns what arrived for a token (the
    parameters, or None for 'none will come'), or raises KeyError while nothing did."""

    def __init__(self, sock_name: str, clock=time.monotonic):
        self.sock_name = sock_name
        self._clock = clock
        self._lock = threading.Lock()
        self._arrived: dict[str, tuple[float, float, dict | None]] = {}  # token -> (clock, wall clock, params)
        # token -> clock, oldest first: taken (or its request gone), so a second hand-over for it is dropped
        self._claimed: OrderedDict[str, float] = OrderedDict()
        self._event = threading.Event()  # set on each arrival: wakes `wait`
        self._closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self._sock.bind(address(sock_name))
        self._thread = threading.Thread(target=self._run, name="pdctl-handover", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                raw = self._sock.recv(MAX_DATAGRAM)
            except OSError:
                return  # closed
            if self._closed:
                return
            self.deliver(raw)

    def deliver(self, raw: bytes) -> None:
        try:
            msg = json.loads(raw)
            token, params = msg["await"], msg["params"]
            if not isinstance(token, str) or not (params is None or isinstance(params, dict)):
                raise TypeError("await must be a string, params an object or null")
        except (ValueError, KeyError, TypeError) as e:
            log.warning("pdctl hand-over %s: ignored a malformed message (%s)", self.sock_name, e)
            return
        now = self._clock()
        with self._lock:
            if token in self._claimed:  # the prefill handed it over, then the proxy too (or the other way round)
                return
            self._arrived[token] = (now, time.time(), params)
            if len(self._arrived) > 1024:  # unclaimed ones: their decode request never came
                for t in [t for t, (at, _, _) in self._arrived.items() if now - at > KEEP_S]:
                    del self._arrived[t]
        self._event.set()

    def take(self, token: str) -> dict | None:
        return self.take_timed(token)[1]

    def take_timed(self, token: str) -> tuple[float, dict | None]:
        """What arrived for a token, with when it arrived (wall clock); KeyError while nothing did."""
        with self._lock:
            _, wall, params = self._arrived.pop(token)
            self._claim(token)
            return wall, params

    def _claim(self, token: str) -> None:
        """Remember a token as done (under the lock); forget the ones older than CLAIMED_KEEP_S, oldest first."""
        now = self._clock()
        self._claimed[token] = now
        self._claimed.move_to_end(token)
        while self._claimed and now - next(iter(self._claimed.values())) > CLAIMED_KEEP_S:
            self._claimed.popitem(last=False)

    def has(self, tokens) -> bool:
        """Whether something arrived for one of these tokens (others may wait for their request, or be stale)."""
        return any(t in self._arrived for t in tokens)

    def discard(self, token: str) -> None:
        """Its request is gone: what arrived, or arrives later, for the token is nobody's."""
        with self._lock:
            self._arrived.pop(token, None)
            self._claim(token)

    def wait(self, timeout_s: float, tokens) -> bool:
        """Until something arrives or the timeout passed; whether something is there for these tokens."""
        if not self.has(tokens):
            self._event.wait(timeout_s)
        self._event.clear()
        return self.has(tokens)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's recv
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=1)
