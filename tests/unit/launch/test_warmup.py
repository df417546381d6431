"""`up`'s warm-up: every prefill instance x decode instance pair probed once, straight to the two instances, and
proven from the decode's log (the KV received, in time, nothing failed); a pair that is not wired fails `up` naming
it, and nothing is tried twice. Stub servers stand in for vLLM (each writes its decode's log as pdctl's connector
would) and the proxy."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pdctl import protocol
from pdctl.launch.errors import LaunchFailed
from pdctl.launch.warmup import PROBE_READ_LIMIT_S, _connector_error, instance_pairs, warm_up
from pdctl.plan import Plan, ProcessSpec
from pdctl.topology import Topology


def received(rid: str, read_ms: float) -> str:
    return "INFO " + protocol.RECEIVED_FORMAT % ("received", f"cmpl-{rid}-0-abc", "E", "127.0.0.1", 5600, 32, 64, 1,
                                                 65, 65, f"{read_ms:.1f}") + "\n"


class Fleet:
    """One stub HTTP server per instance; `decode_log(decode, rid)` says what a decode logs for a request."""

    def __init__(self, tmp: Path):
        self.tmp, self.posts, self.servers, self.prompts = tmp, [], [], []
        self.decode_log = lambda decode, rid: received(rid, 3.0)
        self.stall: set[str] = set()  # decodes that never answer

    def serve(self, name: str, role: str) -> int:
        fleet = self

        class H(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.end_headers()

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                rid = self.headers["X-Request-Id"]
                fleet.posts.append((name, rid))
                fleet.prompts.append((name, tuple(body["prompt"])))
                if name in fleet.stall:
                    threading.Event().wait(2)
                    return
                answer = {"choices": [{"text": "x"}]}
                if role == "prefill":
                    answer["kv_transfer_params"] = {"remote_engine_id": name, "do_remote_prefill": True}
                elif role == "decode" and body.get("kv_transfer_params"):
                    with open(fleet.tmp / name, "a") as f:
                        f.write(fleet.decode_log(name, rid))
                out = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.servers.append(server)
        return server.server_address[1]

    def plan(self, connector: str = "pdctl") -> Plan:
        topo = Topology.model_validate({
            "name": "t", "model": {"path": "m"}, "connector": {"kind": connector},
            "proxy": {"exclude_pairs": [["p2", "d"]]},
            "prefill": [{"name": "p1", "count": 2}, {"name": "p2"}], "decode": [{"name": "d"}, {"name": "e"}]})
        specs = []
        for name, role, pool in [("prefill-p1-0", "prefill", "p1"), ("prefill-p1-1", "prefill", "p1"),
                                 ("prefill-p2-0", "prefill", "p2"), ("decode-d-0", "decode", "d"),
                                 ("decode-e-0", "decode", "e"), ("proxy", "proxy", None)]:
            specs.append(ProcessSpec(name, role, 0, [], {}, "127.0.0.1", {"http": self.serve(name, role)},
                                     str(self.tmp / name), "", block_size=32, pool=pool))
        return Plan("t", str(self.tmp), specs, topo)

    def close(self):
        for s in self.servers:
            s.shutdown()
            s.server_close()


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path)
    yield f
    f.close()


def test_every_instance_pair_is_probed_once_then_one_request_goes_through_the_proxy(fleet):
    plan = fleet.plan()
    assert [(p.name, d.name) for p, d in instance_pairs(plan)] == [
        ("prefill-p1-0", "decode-d-0"), ("prefill-p1-0", "decode-e-0"), ("prefill-p1-1", "decode-d-0"),
        ("prefill-p1-1", "decode-e-0"), ("prefill-p2-0", "decode-e-0")]  # p2 -> d is excluded
    probes = warm_up(plan, timeout_s=5, sleep=lambda s: None)
    assert [p.label for p in probes] == [f"{p} -> {d}" for p, d in (
        ("prefill-p1-0", "decode-d-0"), ("prefill-p1-0", "decode-e-0"), ("prefill-p1-1", "decode-d-0"),
        ("prefill-p1-1", "decode-e-0"), ("prefill-p2-0", "decode-e-0"))]
    assert all(p.read_s == 0.003 for p in probes)
    # each probe: its prefill, then its decode, with one request id; then the proxy, once
    assert fleet.posts[:2] == [("prefill-p1-0", "pdctl-probe-prefill-p1-0-decode-d-0")] + \
        [("decode-d-0", "pdctl-probe-prefill-p1-0-decode-d-0")]
    assert len(fleet.posts) == 2 * 5 + 1 and fleet.posts[-1] == ("proxy", "pdctl-warm-up-proxy")


@pytest.mark.parametrize("line, why", [
    (protocol.READ_TIMED_OUT_FORMAT % ("r", "E", "h", 1, 5.2, 5.0, "recompute"), protocol.READ_TIMED_OUT_MARK),
    ("ERROR NIXL transfer failure: transfer_failed | Context: {}", protocol.TRANSFER_FAILED_MARK),
    ("ERROR RuntimeError: pdctl connector: unsupported P/D pair (prefill: block 64 ...)", protocol.REFUSED_MARK),
])
def test_a_pair_whose_read_did_not_deliver_fails_up_naming_the_pair_and_the_cause(fleet, line, why):
    plan = fleet.plan()
    fleet.decode_log = lambda d, rid: (line + "\n" if "p1-1" in rid and d == "decode-e-0" else received(rid, 2.0))
    with pytest.raises(LaunchFailed) as e:
        warm_up(plan, timeout_s=5, sleep=lambda s: None)
    assert e.value.name == "decode-e-0"
    assert "pair prefill-p1-1 -> decode-e-0" in str(e.value) and why in str(e.value)
    assert sum(1 for n, r in fleet.posts if r.endswith("p1-1-decode-e-0") and n == "decode-e-0") == 1  # once


def test_a_first_read_over_the_limit_is_a_pair_not_wired(fleet):
    plan = fleet.plan()
    fleet.decode_log = lambda d, rid: received(rid, PROBE_READ_LIMIT_S * 1e3 + 1 if "p2" in rid else 1.0)
    with pytest.raises(LaunchFailed, match=r"pair prefill-p2-0 -> decode-e-0: its first KV read took 2\.0 s"):
        warm_up(plan, timeout_s=5, sleep=lambda s: None)
    fleet.decode_log = lambda d, rid: received(rid, PROBE_READ_LIMIT_S * 1e3)  # at the limit: wired
    assert len(warm_up(plan, timeout_s=5, sleep=lambda s: None)) == 5


def test_an_answer_without_the_kv_received_is_no_proof_with_pdctls_connector(fleet):
    fleet.decode_log = lambda d, rid: "INFO some other line\n"
    with pytest.raises(LaunchFailed, match="shows no KV received for the probe"):
        warm_up(fleet.plan(), timeout_s=5, sleep=lambda s: None)
    # vLLM's stock connector logs no such line: its probes are proven by the absence of failures
    probes = warm_up(fleet.plan(connector="nixl"), timeout_s=5, sleep=lambda s: None)
    assert len(probes) == 5 and all(p.read_s is None and p.decode_s > 0 for p in probes)


def test_a_decode_that_does_not_answer_fails_up_at_once_without_a_retry(fleet):
    plan = fleet.plan()
    fleet.stall.add("decode-d-0")
    with pytest.raises(LaunchFailed, match="pair prefill-p1-0 -> decode-d-0 failed: timed out"):
        warm_up(plan, timeout_s=0.5, sleep=lambda s: None)
    assert [n for n, _ in fleet.posts] == ["prefill-p1-0", "decode-d-0"]


def test_the_error_is_the_error_line_not_the_connectors_info(tmp_path):
    log = tmp_path / "decode.log"
    log.write_text(
        "INFO [nixl.py:1] pdctl connector: backend CPU_ATTN, block 64\n"
        "ERROR [base_worker.py:1318] NIXL transfer failure: handshake_setup_failed | Context: {...}\n"
        "INFO [nixl.py:2] pdctl connector: advertising CPU attention ISA vec (block 64)\n")
    assert _connector_error(str(log)).startswith("NIXL transfer failure: handshake_setup_failed")
    log.write_text("ERROR RuntimeError: pdctl connector: unsupported P/D pair (prefill: block 64 ...)\n"
                   "INFO pdctl connector: advertising CPU attention ISA vec (block 32)\n")
    assert _connector_error(str(log)) == "pdctl connector: unsupported P/D pair (prefill: block 64 ...)"
    log.write_text("INFO pdctl connector: advertising CPU attention ISA vec (block 32)\n")
    assert _connector_error(str(log)) is None


def test_a_restarted_instance_is_reproven_with_its_partners_that_are_up_on_a_fresh_prompt(fleet):
    from pdctl.launch.warmup import reprove

    plan = fleet.plan()
    warm_up(plan, timeout_s=5, sleep=lambda s: None)
    seen_by_decode = {p for n, p in fleet.prompts if n == "decode-d-0"}
    fleet.posts.clear()
    fleet.prompts.clear()
    probes = reprove(plan, "prefill-p1-0", partners=lambda name: name != "decode-e-0", timeout_s=5)
    assert [p.label for p in probes] == ["prefill-p1-0 -> decode-d-0"]  # decode-e-0 is down: not its pair now
    assert [n for n, _ in fleet.posts] == ["prefill-p1-0", "decode-d-0"]
    # a prompt decode-d-0 has not seen: its prefix cache would answer the warm-up's, and no KV would travel
    assert fleet.prompts[1][1] not in seen_by_decode
