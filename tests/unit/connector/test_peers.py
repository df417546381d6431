"""pdctl.connector.peers: a prefill is judged gone only when its side channel refuses connections, and the
decode's step never waits on the check."""

import socket
import threading
import time

from pdctl.connector.peers import PeerWatch, refused
from tests.conftest import wait_for


def test_refused_only_where_nothing_listens(monkeypatch):
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert refused("127.0.0.1", port) is False
    assert refused("127.0.0.1", port) is True  # closed now: nothing listens
    # a host that does not answer in time (down, or packets dropped) is no verdict
    import pdctl.connector.peers as peers

    def silent(*_a, **_k):
        raise TimeoutError("timed out")

    monkeypatch.setattr(peers.socket, "create_connection", silent)
    assert refused("127.0.0.1", port) is False


def test_gone_answers_at_once_and_rechecks_a_stale_verdict():
    clock = [0.0]
    release = threading.Event()
    calls: list = []

    def probe(host, port):
        calls.append((host, port))
        release.wait(5)
        return port == 1

    w = PeerWatch(probe, recheck_s=0.5, clock=lambda: clock[0])
    t0 = time.perf_counter()
    assert w.gone(("h", 1)) is False  # no verdict yet; the check runs on its own thread
    assert w.gone(("h", 1)) is False and time.perf_counter() - t0 < 0.5
    release.set()
    assert wait_for(lambda: w.gone(("h", 1)), 5, 0.01)
    assert calls == [("h", 1)]  # one check at a time per peer, none again while the verdict is fresh
    clock[0] = 1.0
    w.gone(("h", 1))
    assert wait_for(lambda: len(calls) == 2, 5, 0.01)
    assert wait_for(lambda: w.gone(("h", 2)) is False and len(calls) == 3, 5, 0.01)


def test_a_probe_that_raises_is_no_verdict():
    def probe(host, port):
        raise RuntimeError("boom")

    w = PeerWatch(probe)
    w.gone(("h", 1))
    time.sleep(0.1)
    assert w.gone(("h", 1)) is False
