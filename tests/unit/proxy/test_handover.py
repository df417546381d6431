"""Early decode's hand-over: the socket between proxy and decode, and the decode scheduler's parking of a request
until its prefill's KV parameters arrive (vLLM's own scheduler methods replaced by recorders)."""

import json
import time
import uuid
from types import SimpleNamespace

import pytest

from pdctl.proxy import handover
from tests.conftest import wait_for

KVP = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1", "remote_block_ids": [[1, 2]],
       "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": "cmpl-x-0"}


@pytest.fixture
def listener():
    lst = handover.Listener(f"pdctl-test-{uuid.uuid4().hex}")
    yield lst
    lst.close()


def test_the_decode_takes_what_the_proxy_handed_over(listener):
    with pytest.raises(KeyError):
        listener.take("t1")  # nothing yet
    assert handover.send(listener.sock_name, "t1", KVP) is None
    assert handover.send(listener.sock_name, "t2", None) is None  # "no KV will come"
    assert wait_for(lambda: len(listener._arrived) == 2, 5)
    assert listener.take("t1") == KVP and listener.take("t2") is None
    with pytest.raises(KeyError):
        listener.take("t1")  # taken once


def test_malformed_messages_are_ignored_and_a_missing_listener_is_said():
    lst = handover.Listener(f"pdctl-test-{uuid.uuid4().hex}")
    lst.deliver(b"not json")
    lst.deliver(b'{"await": 3, "params": {}}')
    lst.deliver(b'{"await": "t", "params": [1]}')
    assert not lst.has(["t"])
    lst.close()
    why = handover.send(lst.sock_name, "t", KVP)  # nobody listens any more
    assert why is not None and lst.sock_name in why


def test_the_socket_name_follows_the_side_channel():
    assert handover.name("127.0.0.1", 5700) == "pdctl-handover-127.0.0.1:5700"
    assert handover.address("x") == b"\0x"


@pytest.fixture
def scheduler(monkeypatch, listener):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    from pdctl.connector.scheduler import PdctlNixlScheduler

    calls: list[tuple] = []
    monkeypatch.setattr(NixlPullConnectorScheduler, "update_state_after_alloc",
                        lambda self, r, b, n: calls.append(("alloc", r.request_id, dict(r.kv_transfer_params), n)))
    monkeypatch.setattr(NixlPullConnectorScheduler, "build_connector_meta",
                        lambda self, out: calls.append(("meta",)) or SimpleNamespace(reqs_to_recv={}))
    monkeypatch.setattr(NixlPullConnectorScheduler, "update_connector_output", lambda self, out: None)
    monkeypatch.setattr(NixlPullConnectorScheduler, "request_finished",
                        lambda self, r, b: calls.append(("finished", r.request_id)) or (False, None))
    sched = object.__new__(PdctlNixlScheduler)  # vLLM's __init__ needs a whole engine config
    sched._trace, sched._traced, sched._kv_ready, sched._seen_at = False, set(), set(), {}
    sched._parked, sched._handover, sched._reading, sched._reqs_need_recv = {}, listener, set(), {}
    sched._hands_over = False  # a decode's scheduler; a prefill's hands its KV parameters over itself
    return sched, calls


IDLE = SimpleNamespace(num_scheduled_tokens={}, total_num_scheduled_tokens=0)


def request(rid: str, params: dict | None):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params)


def test_a_parked_request_goes_on_only_when_its_kv_parameters_arrive(scheduler, listener):
    sched, calls = scheduler
    early = request("r1", {"do_remote_prefill": True, handover.TOKEN_KEY: "t1"})
    sched.update_state_after_alloc(early, "blocks", 255)
    assert calls == [] and "t1" in sched._parked  # parked: vLLM's own path not told yet
    sched.build_connector_meta(IDLE)
    assert calls == [("meta",)]  # nothing handed over yet: still parked
    handover.send(listener.sock_name, "t1", KVP)
    assert wait_for(lambda: listener.has(sched._parked), 5)
    sched.build_connector_meta(IDLE)
    assert calls[1:] == [("alloc", "r1", KVP, 255), ("meta",)] and not sched._parked
    # Negative control: a request that came with its KV parameters takes vLLM's path at once.
    sched.update_state_after_alloc(request("r2", dict(KVP)), "blocks", 10)
    assert calls[-1] == ("alloc", "r2", KVP, 10)


def test_none_handed_over_or_ended_while_parked_reads_nothing_and_notifies_no_prefill(scheduler, listener):
    sched, calls = scheduler
    dropped = request("r1", {"do_remote_prefill": True, handover.TOKEN_KEY: "t1"})
    aborted = request("r2", {"do_remote_prefill": True, handover.TOKEN_KEY: "t2"})
    for r in (dropped, aborted):
        sched.update_state_after_alloc(r, "blocks", 100)
    handover.send(listener.sock_name, "t1", None)
    assert wait_for(lambda: listener.has(sched._parked), 5)
    sched.build_connector_meta(IDLE)
    assert dropped.kv_transfer_params["do_remote_prefill"] is False and list(sched._parked) == ["t2"]
    assert sched.request_finished(aborted, ([1],)) == (False, None) and not sched._parked
    assert ("finished", "r2") not in calls and not any(c[0] == "alloc" for c in calls)
    sched.request_finished(request("r3", dict(KVP)), ([1],))  # negative control: vLLM's path
    assert calls[-1] == ("finished", "r3")


def test_a_traced_request_that_ends_early_is_followed_no_further(scheduler):
    sched, _ = scheduler
    sched._trace = True
    seen, ready = request("r1", dict(KVP)), request("r2", dict(KVP))
    sched._traced |= {"r1", "r3"}
    sched._kv_ready.add("r2")
    for r in (seen, ready):  # aborted before their KV arrived / before their first token was scheduled
        sched.request_finished(r, ([1],))
    assert sched._traced == {"r3"} and not sched._kv_ready  # negative control: r3 did not end, still followed


def test_a_decode_without_the_hand_over_computes_an_early_request_itself(scheduler):
    sched, calls = scheduler
    sched._handover = None
    r = SimpleNamespace(request_id="r1", kv_transfer_params={"do_remote_prefill": True, handover.TOKEN_KEY: "t"},
                        prompt_token_ids=[1] * 300)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert r.kv_transfer_params["do_remote_prefill"] is False


def test_an_engine_with_only_parked_requests_waits_for_a_hand_over_instead_of_stepping_empty(scheduler, listener,
                                                                                            monkeypatch):
    sched, _ = scheduler
    waits: list[float] = []
    monkeypatch.setattr(listener, "wait", lambda timeout_s, tokens: waits.append(timeout_s) or listener.has(tokens))
    sched.build_connector_meta(IDLE)
    assert waits == []  # nothing parked: vLLM's loop as it is
    sched.update_state_after_alloc(request("r1", {"do_remote_prefill": True, handover.TOKEN_KEY: "t1"}), "b", 64)
    sched.build_connector_meta(IDLE)
    assert len(waits) == 1 and 0 < waits[0] <= 0.05
    # Negative controls: a step with tokens to compute, or a read under way, never waits.
    sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r9": 1}, total_num_scheduled_tokens=1))
    sched.update_state_after_alloc(request("r2", dict(KVP)), "b", 64)
    assert sched._reading == {"r2"}
    sched.build_connector_meta(IDLE)
    assert len(waits) == 1
    sched.update_connector_output(SimpleNamespace(finished_recving={"r2"}, failed_recving=None))
    sched.build_connector_meta(IDLE)
    assert len(waits) == 2 and not sched._reading


def test_the_wait_ends_when_a_hand_over_arrives(listener):
    import threading
    import time

    threading.Timer(0.05, handover.send, (listener.sock_name, "t", KVP)).start()
    t0 = time.monotonic()
    assert listener.wait(5.0, ["t"]) and time.monotonic() - t0 < 4.0
    assert listener.take("t") == KVP and not listener.wait(0.0, ["t"])  # nothing left: no wait, nothing there


def test_a_hand_over_for_a_request_that_ended_while_parked_is_dropped(scheduler, listener):
    sched, _ = scheduler
    r = request("r1", {"do_remote_prefill": True, handover.TOKEN_KEY: "t1"})
    sched.update_state_after_alloc(r, "b", 64)
    handover.send(listener.sock_name, "t1", KVP)
    assert wait_for(lambda: listener.has(["t1"]), 5)
    sched.request_finished(r, ([1],))  # aborted before the step that would have taken it
    assert not listener.has(["t1"]) and not sched._parked


def test_a_second_hand_over_for_a_claimed_token_is_dropped(listener):
    # The prefill handed the parameters over, then the proxy too (or the other way round): the decode took the
    # first, the second must not sit in the listener.
    handover.send(listener.sock_name, "t1", KVP)
    assert wait_for(lambda: listener.has(["t1"]), 5)
    at, params = listener.take_timed("t1")
    assert params == KVP and abs(at - time.time()) < 60
    listener.deliver(b'{"await": "t1", "params": {"remote_block_ids": [[9]]}}')
    listener.deliver(b'{"await": "t2", "params": null}')  # negative control: another token is kept
    assert listener._arrived.keys() == {"t2"}


def _prefill_finishing(monkeypatch, sched, out):
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

    monkeypatch.setattr(NixlPullConnectorScheduler, "request_finished", lambda self, r, b: (True, dict(out)))
    sched._handover, sched._hands_over = None, True
    return sched


def test_the_prefill_hands_its_kv_parameters_over_itself_when_asked(scheduler, listener, monkeypatch):
    sched = _prefill_finishing(monkeypatch, scheduler[0], KVP)
    to = {"socket": listener.sock_name.replace("pdctl-test-", handover.PREFIX), "await": "t1"}
    own = handover.Listener(to["socket"])  # a decode's socket (the name a prefill may send to)
    try:
        r = request("p1", {"do_remote_decode": True, handover.TO_KEY: to})
        delay, out = sched.request_finished(r, ([1, 2],))
        assert delay is True and out == {**KVP, handover.HANDED_KEY: True}
        assert wait_for(lambda: own.has(["t1"]), 5) and own.take("t1") == KVP
        # Negative controls: no target, a socket that is no decode's, a prefill started without hand-overs.
        assert sched.request_finished(request("p2", {"do_remote_decode": True}), ([1],)) == (True, KVP)
        bad = {"do_remote_decode": True, handover.TO_KEY: {"socket": listener.sock_name, "await": "t3"}}
        assert sched.request_finished(request("p3", bad), ([1],)) == (True, KVP)
        sched._hands_over = False
        assert sched.request_finished(request("p4", {"do_remote_decode": True, handover.TO_KEY: to}),
                                      ([1],)) == (True, KVP)
        assert not listener.has(["t3"]) and not own.wait(0.2, ["t1"])
    finally:
        own.close()


def test_a_hand_over_the_prefill_cannot_send_is_left_to_the_proxy(scheduler, monkeypatch):
    sched = _prefill_finishing(monkeypatch, scheduler[0], KVP)
    to = {"socket": f"{handover.PREFIX}nobody-{uuid.uuid4().hex}", "await": "t1"}
    _, out = sched.request_finished(request("p1", {"do_remote_decode": True, handover.TO_KEY: to}), ([1],))
    assert out == KVP and handover.HANDED_KEY not in out  # the proxy hands them over when it has the answer


def test_the_decode_traces_when_a_hand_over_arrived(scheduler, listener, caplog):
    import logging

    sched, _ = scheduler
    sched._trace = True
    sched.update_state_after_alloc(request("r1", {"do_remote_prefill": True, handover.TOKEN_KEY: "t1"}), "b", 64)
    before = time.time()
    handover.send(listener.sock_name, "t1", KVP)
    assert wait_for(lambda: listener.has(["t1"]), 5)
    with caplog.at_level(logging.INFO, logger="vllm.pdctl"):
        sched.build_connector_meta(IDLE)
    lines = [r.getMessage().split() for r in caplog.records if "pdctl trace" in r.getMessage()]
    stages = {ln[2]: float(ln[4]) for ln in lines if ln[3] == "r1"}
    assert set(stages) == {"handover_in", "sched_handover"} and before <= stages["handover_in"]
    assert stages["handover_in"] <= stages["sched_handover"]


def test_claimed_tokens_are_forgotten_oldest_first_after_a_while():
    now = [0.0]
    lst = handover.Listener(f"pdctl-test-{uuid.uuid4().hex}", clock=lambda: now[0])
    try:
        for i in range(3000):  # a busy decode: many tokens taken; the memory of them stays bounded by time
            lst.deliver(json.dumps({"await": f"t{i}", "params": None}).encode())
            lst.take(f"t{i}")
            now[0] += 0.1
        assert len(lst._claimed) <= handover.CLAIMED_KEEP_S / 0.1 + 1
        lst.deliver(b'{"await": "t2999", "params": null}')  # recent: still dropped as a duplicate
        assert not lst.has(["t2999"])
        lst.discard("gone")
        now[0] += handover.CLAIMED_KEEP_S + 1
        lst.discard("later")  # forgetting happens on discards too
        assert list(lst._claimed) == ["later"]
        lst.deliver(b'{"await": "gone", "params": null}')  # long forgotten: kept (then dropped after KEEP_S)
        assert lst.has(["gone"])
    finally:
        lst.close()
