"""pdctl.kv.lease (when a read may start, when it is given up) and the decode worker's use of it: reads past the
timeout fail through vLLM's failure path, blocks held while NIXL cannot cancel; a read whose lease is not known
alive is never posted. A fake clock drives every decision."""

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdctl import protocol
from pdctl.connector.stats import COUNTERS, PdctlKVConnectorStats
from pdctl.kv.lease import (
    HOP_MARGIN_S,
    KV_LEASE_S,
    check_settings,
    expired_reads,
    read_allowed,
    reads_of_gone_peers,
)
from pdctl.protocol import ConnectorSettings


def test_a_read_may_start_only_while_it_ends_inside_the_lease():
    # seen at 100; lease 30; timeout 5; hop 1: the last moment a read may start is 124
    assert read_allowed(100.0, 100.0, 30, 5)
    assert read_allowed(100.0, 124.0, 30, 5)
    assert not read_allowed(100.0, 124.01, 30, 5)
    assert not read_allowed(100.0, 100.0, 5, 5)  # a timeout as long as the lease never fits


@given(st.floats(0, 1e6), st.floats(0, 100), st.floats(1, 600), st.floats(0.01, 60))
def test_an_allowed_read_ends_before_the_earliest_expiry(seen, waited, lease_s, timeout_s):
    # The lease began at the earliest HOP_MARGIN_S before the decode saw the request; an allowed read, started
    # now and given up at its timeout at the latest, ends before that lease can run out.
    now = seen + waited
    if read_allowed(seen, now, lease_s, timeout_s):
        assert now + timeout_s <= (seen - HOP_MARGIN_S) + lease_s + 1e-6


def test_expired_reads_are_those_past_the_timeout():
    posted = {"a": 0.0, "b": 3.0, "c": 9.9}
    assert expired_reads(posted, 10.0, 5.0) == ["a", "b"]
    assert expired_reads(posted, 5.0, 5.0) == []  # exactly at the timeout: not yet
    assert expired_reads({}, 1e9, 5.0) == []


def test_reads_of_a_gone_peer_past_the_check_delay_are_named_and_each_peer_asked_once():
    posted = {"a": 0.0, "b": 0.2, "c": 9.8, "d": 0.0}
    peer_of = {"a": ("h", 1), "b": ("h", 1), "c": ("h", 1), "d": ("h", 2)}
    asked: list = []
    gone = {("h", 1): True, ("h", 2): False}
    got = reads_of_gone_peers(posted, peer_of, lambda p: asked.append(p) or gone[p], now=10.0, after_s=0.5)
    assert got == ["a", "b"]  # c is fresh (0.2 s): not asked about yet; d's prefill is there
    assert sorted(asked) == [("h", 1), ("h", 2)]
    assert reads_of_gone_peers(posted, {}, lambda p: True, now=10.0) == []  # a read of no known peer: kept


def test_settings_that_cannot_work_are_said():
    assert check_settings(KV_LEASE_S, ConnectorSettings.kv_read_timeout_s) is None
    assert "above 0" in check_settings(30, 0)
    why = check_settings(30, 20)
    assert "at most 14 s" in why and "lengthen the lease" in why
    assert check_settings(120, 20) is None


# -- the decode worker ---------------------------------------------------------------------------------------


class FakeNixl:
    def __init__(self, stuck: set[int] = frozenset()):
        self.released: list[int] = []
        self.stuck = stuck  # handles NIXL cannot cancel

    def release_xfer_handle(self, h):
        if h in self.stuck:
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")
        self.released.append(h)


@pytest.fixture
def worker(monkeypatch):
    from pdctl.connector import nixl

    clock = [100.0]
    monkeypatch.setattr(nixl.time, "monotonic", lambda: clock[0])
    w = object.__new__(nixl.PdctlNixlWorker)  # vLLM's __init__ needs a whole engine
    w._fingerprint_init()
    w._posted_at, w._gave_up, w._seen_at, w._receiving = {}, set(), {}, {}
    w._read_timeout_s, w._lease_s, w._failure_policy = 5.0, 30.0, "recompute"
    w.xfer_stats = PdctlKVConnectorStats()
    w._recving_transfers, w._recv_failures, w._recving_metadata = {}, set(), {}
    w._failed_remote_engines, w._remote_agents = set(), {"P": {0: "agent"}}
    w.nixl_wrapper = FakeNixl()
    w._peers = type("Peers", (), {"gone": staticmethod(lambda peer: False)})()
    w.tp_rank, w.engine_id = 0, "D"
    return w, clock


def test_a_read_past_the_timeout_is_failed_through_vllms_path(worker, caplog):
    w, clock = worker
    w._recving_transfers["r1"], w._posted_at["r1"] = [7, 8], 100.0
    w._receiving["r1"] = ("P", "127.0.0.1", 5600, 2, 33)
    clock[0] = 104.9
    w._give_up_late_reads()
    assert w._recving_transfers == {"r1": [7, 8]} and not w._recv_failures
    clock[0] = 105.1
    with caplog.at_level("WARNING", logger="vllm.pdctl.connector"):
        w._give_up_late_reads()
    assert w.nixl_wrapper.released == [7, 8]
    assert "r1" not in w._recving_transfers and "r1" in w._recv_failures  # vLLM reports it failed next poll
    assert w.xfer_stats.data[protocol.READS_TIMED_OUT] == [1]
    assert protocol.READ_TIMED_OUT_MARK in caplog.text and "127.0.0.1:5600" in caplog.text
    w._give_up_late_reads()  # once
    assert w.xfer_stats.data[protocol.READS_TIMED_OUT] == [1]


def test_a_gone_prefills_reads_are_given_up_at_once_and_the_others_kept(worker, caplog):
    w, clock = worker
    w._peers = type("Peers", (), {"gone": staticmethod(lambda peer: peer == ("127.0.0.1", 5600))})()
    for r, port, h in (("r1", 5600, 7), ("r2", 5601, 9)):
        w._recving_transfers[r], w._posted_at[r] = [h], 100.0
        w._receiving[r] = ("P" + r, "127.0.0.1", port, 1, 16)
    clock[0] = 100.4  # not checked yet: a healthy read takes milliseconds
    w._give_up_late_reads()
    assert not w._recv_failures
    clock[0] = 100.8
    with caplog.at_level("WARNING", logger="vllm.pdctl.connector"):
        w._give_up_late_reads()
    assert w._recv_failures == {"r1"} and w.nixl_wrapper.released == [7] and w._recving_transfers == {"r2": [9]}
    assert protocol.PEER_GONE_MARK in caplog.text and "r1" in caplog.text
    assert w.xfer_stats.data[protocol.READS_PEER_GONE] == [1] and not w.xfer_stats.data.get(protocol.READS_TIMED_OUT)
    clock[0] = 106.0  # r2's own timeout still applies, once
    w._give_up_late_reads()
    w._give_up_late_reads()
    assert w._recv_failures == {"r1", "r2"} and w.xfer_stats.data[protocol.READS_TIMED_OUT] == [1]
    assert w.xfer_stats.data[protocol.READS_PEER_GONE] == [1]


def test_a_read_nixl_cannot_cancel_keeps_its_blocks_until_it_ends(worker):
    w, clock = worker
    w.nixl_wrapper = FakeNixl(stuck={8})
    w._recving_transfers["r1"], w._posted_at["r1"] = [7, 8], 100.0
    clock[0] = 200.0
    w._give_up_late_reads()
    # the handle NIXL kept stays vLLM's to poll: the request is not reported (its blocks stay held) until it ends
    assert w._recving_transfers == {"r1": [8]} and "r1" in w._recv_failures


def _meta(blocks=((1, 2),)):
    remote = SimpleNamespace(engine_id="P", host="127.0.0.1", port=5600, num_tokens=33, block_ids=[[3, 4]])
    return SimpleNamespace(remote=remote, local_physical_block_ids=[list(b) for b in blocks],
                           local_block_ids=[list(b) for b in blocks], local_num_computed_blocks=())


def test_a_read_whose_lease_is_not_known_alive_is_never_posted(worker, monkeypatch, caplog):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    w, clock = worker
    w._split_ratio, w._trace = {}, False
    w._windows = {}
    posted: list[str] = []
    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req",
                        lambda self, r, m: posted.append(r) or self._recving_transfers.setdefault(r, [1]))
    w._seen_at["old"], w._seen_at["new"] = 70.0, 99.0
    with caplog.at_level("WARNING", logger="vllm.pdctl.connector"):
        assert w._read_blocks_for_req("old", _meta()) is None  # seen 30 s ago: the lease may be gone
        w._read_blocks_for_req("new", _meta())
    assert posted == ["new"] and w._posted_at == {"new": 100.0}
    assert "old" in w._recv_failures and w.xfer_stats.data[protocol.READS_REFUSED_LEASE] == [1]
    assert protocol.LEASE_REFUSED_MARK in caplog.text
    w._read_blocks_for_req("old", _meta())  # never posted afterwards either
    assert posted == ["new"]


def test_before_the_handshake_the_lease_is_not_decided_yet(worker, monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker

    w, clock = worker
    w._split_ratio, w._trace, w._windows = {}, False, {}
    w._remote_agents = {}  # handshake under way: vLLM queues the read and calls again once it is done
    calls: list[str] = []
    monkeypatch.setattr(NixlPullConnectorWorker, "_read_blocks_for_req", lambda self, r, m: calls.append(r))
    w._seen_at["old"] = 0.0
    w._read_blocks_for_req("old", _meta())
    assert calls == ["old"] and not w._recv_failures


def test_the_counters_travel_with_vllms_stats():
    a, b = PdctlKVConnectorStats(), PdctlKVConnectorStats()
    assert a.is_empty()
    b.record(protocol.READS_TIMED_OUT)
    b.record(protocol.RECOMPUTED)
    b.record(protocol.FINGERPRINT_SECONDS, 0.25)
    assert not b.is_empty()
    a.record(protocol.FINGERPRINT_SECONDS, 0.5)
    a.aggregate(PdctlKVConnectorStats(data=dict(b.data)))
    reduced = a.reduce()
    assert reduced["pdctl_kv_reads_timed_out"] == 1 and reduced["pdctl_kv_recomputed_requests"] == 1
    assert reduced["pdctl_kv_fingerprint_seconds"] == 0.75  # an amount counter adds its amounts
    assert reduced["pdctl_kv_reads_refused_lease"] == 0
    assert set(COUNTERS) <= set(a.clone_and_reset().data)
