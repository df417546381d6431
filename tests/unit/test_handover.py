"""Early decode's hand-over: the socket between proxy and decode, and the decode scheduler's parking of a request
until its prefill's KV parameters arrive (vLLM's own scheduler methods replaced by recorders)."""

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

    from pdctl.connector.nixl import PdctlNixlScheduler

    calls: list[tuple] = []
    monkeypatch.setattr(NixlPullConnectorScheduler, "update_state_after_alloc",
                        lambda self, r, b, n: calls.append(("alloc", r.request_id, dict(r.kv_transfer_params), n)))
    monkeypatch.setattr(NixlPullConnectorScheduler, "build_connector_meta", lambda self, out: calls.append(("meta",)))
    monkeypatch.setattr(NixlPullConnectorScheduler, "update_connector_output", lambda self, out: None)
    monkeypatch.setattr(NixlPullConnectorScheduler, "request_finished",
                        lambda self, r, b: calls.append(("finished", r.request_id)) or (False, None))
    sched = object.__new__(PdctlNixlScheduler)  # vLLM's __init__ needs a whole engine config
    sched._trace, sched._traced, sched._kv_ready = False, set(), set()
    sched._parked, sched._handover, sched._reading, sched._reqs_need_recv = {}, listener, set(), {}
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
