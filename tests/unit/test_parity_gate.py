"""The parity gate's pure parts: prompt ordering, recorded reference answers, the warm-up's error line."""

from pdctl.gates.parity import Prompt, _in_cache_order, first_divergence
from pdctl.launch import run as run_mod
from pdctl.launch.run import _connector_error


def test_shared_prefix_prompts_come_in_a_second_wave():
    prompts = [Prompt(ids=[1], label="random-1"), Prompt(ids=[1, 2], label="prefix1+1"),
               Prompt(ids=[3], label="random-3"), Prompt(text="q", label="gsm8k-0")]
    assert _in_cache_order(prompts) == ([0, 2, 3], [1])


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # a shorter answer diverges where it ends


def test_warm_up_error_is_the_error_line_not_the_connectors_info(tmp_path):
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


def test_only_a_handshake_timeout_is_worth_another_warm_up(tmp_path):
    from pdctl.launch.run import _handshake_timed_out

    log = tmp_path / "decode.log"
    log.write_text("ERROR NIXL transfer failure: handshake_failed | Context: {}\nERROR zmq.error.Again: Resource "
                   "temporarily unavailable\n")
    assert _handshake_timed_out(str(log))
    log.write_text("ERROR NIXL transfer failure: handshake_setup_failed\n"
                   "ERROR RuntimeError: pdctl connector: unsupported P/D pair (...)\n")
    assert not _handshake_timed_out(str(log))


def test_a_stalled_warm_up_is_tried_again_per_pair_with_the_pair_pinned(tmp_path):
    """A fleet's first read from a new prefill was seen to stall; the warm-up tries again, and pins each pair."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from pdctl.plan import Plan, ProcessSpec

    seen: list[tuple[str, str]] = []

    class H(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.headers.get("x-pdctl-route"), self.headers["X-Request-Id"]))
            if len(seen) == 1:
                threading.Event().wait(1.0)  # longer than the warm-up waits: a stall
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"ok": True}).encode())

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    spec = lambda name, role, pool: ProcessSpec(name, role, 0, [], {}, "127.0.0.1",  # noqa: E731
                                                {"http": port if role == "proxy" else 1}, str(tmp_path / name),
                                                "", block_size=32, pool=pool)
    topo = {"model": {"path": "m"}, "proxy": {"exclude_pairs": [["p2", "d"]]},
            "prefill": [{"name": "p1"}, {"name": "p2"}], "decode": [{"name": "d"}, {"name": "e"}]}
    plan = Plan("t", str(tmp_path), [spec("prefill-p1-0", "prefill", "p1"), spec("prefill-p2-0", "prefill", "p2"),
                                     spec("decode-d-0", "decode", "d"), spec("decode-e-0", "decode", "e"),
                                     spec("proxy", "proxy", None)], topo)
    try:
        run_mod.warm_up(plan, timeout_s=0.3)
    finally:
        server.shutdown()
    assert [r for r, _ in seen] == ["p1/d", "p1/d", "p1/e", "p2/e"]  # the stalled one again; p2/d is excluded
    assert seen[1][1].endswith("-2")
