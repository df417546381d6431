"""The contracts between pdctl's processes: each writer's format is read back by its one parser."""

from pdctl import protocol


def test_a_trace_line_is_read_back_by_its_parser():
    line = "(EngineCore pid=1) INFO 12-05 [nixl.py:90] " + protocol.trace_line("read_done", "cmpl-pdctl-x-0", 1.5)
    assert protocol.TRACE_LINE.search(line).groups() == ("read_done", "cmpl-pdctl-x-0", "1.500000")


def test_the_received_line_is_read_back_only_for_a_read_that_succeeded():
    args = ("engine-a", "127.0.0.1", 5600, 64, 32, 4, 130, 130, "0.4")
    ok = protocol.RECEIVED_FORMAT % ("received", "req-1", *args)
    assert protocol.RECEIVED_LINE.search(ok).groups() == ("req-1", "127.0.0.1", "5600")
    assert protocol.READ_MS.search("INFO " + ok).groups() == ("req-1", "0.4")
    failed = protocol.RECEIVED_FORMAT % ("FAILED", "req-1", *args)
    assert protocol.RECEIVED_LINE.search(failed) is None and protocol.READ_MS.search(failed) is None
    # a full prefix hit reads nothing: no read time to report
    assert protocol.READ_MS.search(protocol.RECEIVED_FORMAT % ("received", "req-1", *args[:-1], "-")) is None


def test_a_timed_out_and_a_refused_read_are_found_by_their_marks():
    timed_out = protocol.READ_TIMED_OUT_FORMAT % ("req-1", "E", "h", 1, 5.2, 5.0, "recompute")
    refused = protocol.LEASE_REFUSED_FORMAT % ("req-1", "E", "h", 1, 29.0, 30, 5.0, "fail")
    assert protocol.READ_TIMED_OUT_MARK in timed_out and protocol.LEASE_REFUSED_MARK not in timed_out
    assert protocol.LEASE_REFUSED_MARK in refused and protocol.READ_TIMED_OUT_MARK not in refused


def test_the_prefills_request_asks_for_a_remote_decode_and_names_no_remote():
    p = protocol.REMOTE_DECODE_PARAMS
    assert p["do_remote_decode"] is True and p["do_remote_prefill"] is False
    assert all(p[k] is None for k in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"))


def test_every_header_is_pdctls_and_distinct():
    headers = [v for k, v in vars(protocol).items() if k.endswith("_HEADER")]
    assert len(headers) == len(set(headers)) == 6 and all(h.startswith("x-pdctl-") for h in headers)
