"""pdctl.bench.breakdown: the connector's timing lines parsed, joined with the proxy's records, summarized."""

from __future__ import annotations

import math

import pytest

from pdctl.bench import breakdown as b


def _proxy(rid: str, t0: float, **over) -> dict:
    rec = {"id": rid, "status": 200, "prefill": "prefill-0", "decode": "decode-0", "fallback": None, "recv": t0,
           "prefill_sent": t0 + 0.001, "prefill_done": t0 + 0.011, "decode_sent": t0 + 0.012,
           "decode_first": t0 + 0.030, "client_first": t0 + 0.0302, "end": t0 + 0.1}
    return rec | over


def _lines(vid: str, t0: float) -> list[str]:
    at = {"sched_seen": 0.014, "sched_alloc": 0.0145, "read_issued": 0.016, "read_posted": 0.0165,
          "read_done": 0.019, "converted": 0.0192,
          "sched_kv_ready": 0.021, "sched_first": 0.022}
    return [f"(EngineCore pid=1) INFO 12-02 10:00:00 [nixl.py:80] pdctl trace {k} {vid} {t0 + v:.6f}"
            for k, v in at.items()]


def test_lines_parsed_first_stamp_wins_and_other_lines_ignored():
    lines = ["INFO some other line", *_lines("cmpl-r1-0-ab12", 100.0),
             "pdctl trace read_done cmpl-r1-0-ab12 999.000000"]
    st = b.connector_stamps(lines)
    assert set(st) == {"cmpl-r1-0-ab12"}
    assert st["cmpl-r1-0-ab12"]["read_done"] == pytest.approx(100.019)


def test_join_matches_by_the_proxy_id_inside_vllms_id_and_stages_add_up():
    stamps = b.connector_stamps(_lines("cmpl-pdctl-1-0-ab12", 100.0) + _lines("cmpl-pdctl-10-0-cd34", 200.0))
    tl = b.join([_proxy("pdctl-1", 100.0), _proxy("pdctl-10", 200.0)], stamps)
    assert len(tl) == 2
    assert sorted(t["recv"] for t in tl) == [100.0, 200.0]
    one = next(t for t in tl if t["recv"] == 100.0)
    assert one["read_issued"] == pytest.approx(100.016)  # pdctl-1 did not take pdctl-10's stamps
    stats = {s.name: s for s in b.summarize(tl)}
    assert stats["read post"].p50_ms == pytest.approx(0.5) and stats["KV read"].p50_ms == pytest.approx(2.5)
    assert stats["prefill"].p50_ms == pytest.approx(10.0)
    total = sum(stats[s.name].p50_ms for s in b.STAGES)
    assert total == pytest.approx(stats["TTFT (proxy)"].p50_ms)  # consecutive stages: no gap, no overlap


def test_join_leaves_out_fallbacks_errors_missing_and_ambiguous_stamps():
    stamps = b.connector_stamps(_lines("cmpl-a-0-x", 1.0) + _lines("cmpl-b-0-x", 2.0)
                                + _lines("cmpl-d-0-x", 4.0) + _lines("cmpl-d-1-y", 4.0)
                                + [ln for ln in _lines("cmpl-e-0-x", 5.0) if "read_done" not in ln])
    recs = [_proxy("a", 1.0, fallback="prefill_down"), _proxy("b", 2.0, status=502), _proxy("c", 3.0),
            _proxy("d", 4.0), _proxy("e", 5.0)]
    assert b.join(recs, stamps) == []  # negative control: nothing that lacks a stamp or a clean answer counts


def test_summary_of_nothing_is_empty_and_the_table_says_why():
    assert b.summarize([]) == []
    assert "connector.trace" in b.table([], "P32->D64")


def test_table_and_plot(tmp_path):
    tl = b.join([_proxy(f"r{i}", 100.0 + i) for i in range(5)],
                b.connector_stamps(sum((_lines(f"cmpl-r{i}-0-z", 100.0 + i) for i in range(5)), [])))
    stats = b.summarize(tl)
    text = b.table(stats, "pair")
    assert text.splitlines()[0] == "pair" and "KV read" in text and "#" in text
    assert all(len(ln) <= 80 for ln in text.splitlines())
    assert not math.isnan(stats[-1].p99_ms)
    first = b.summarize(b.first_token([_proxy("f", 1.0, first="prefill", client_first=1.0112)]), b.FIRST_STAGES)
    b.plot({"P32->D64 c=1": stats, "P64->D32 c=1": stats, "P32->D64 c=1 first token": first}, tmp_path / "w.png",
           {"P32->D64 c=1": 20.0})
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"


def test_probe_http_get_keeps_the_query_string():
    """bench --breakdown asks the proxy for /debug/timings?since=T through probe.http_get (once dropped the
    query, so every request the proxy ever saw was followed)."""
    import http.server
    import threading

    from pdctl.launch import probe

    seen = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            seen.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"[]")

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        assert probe.http_get(f"http://127.0.0.1:{srv.server_port}/debug/timings?since=12.5") == (200, "[]")
        assert probe.http_get(f"http://127.0.0.1:{srv.server_port}/health") == (200, "[]")
    finally:
        srv.shutdown()
    assert seen == ["/debug/timings?since=12.5", "/health"]


def test_table_bars_fit_when_the_stage_p50s_add_up_to_more_than_the_total():
    stats = [b.StageStat(s.name, s.what, 1.0, 2.0, 1.0) for s in (*b.STAGES, b.TOTAL)]
    lines = b.table(stats).splitlines()
    bars = [ln[36:] for ln in lines[1:-1]]
    assert all(len(ln) <= 80 for ln in lines) and all(bar.count("#") <= 3 for bar in bars), lines



def test_a_request_whose_first_token_was_the_prefills_is_followed_by_its_own_stages():
    # proxy.first_token: the client had token 1 right after the prefill answered, before the decode's first event.
    stamps = b.connector_stamps(_lines("cmpl-f-0-x", 1.0) + _lines("cmpl-o-0-x", 2.0))
    first = _proxy("f", 1.0, first="prefill", client_first=1.0112)
    ordinary = _proxy("o", 2.0)
    assert [t["recv"] for t in b.join([first, ordinary], stamps)] == [2.0]  # not through the decode's stages
    (t,) = b.first_token([first, ordinary])  # negative control: the ordinary one is not here
    stats = b.summarize([t], b.FIRST_STAGES)
    assert [s.name for s in stats] == ["proxy in", "prefill", "token out", "TTFT (proxy)"]
    assert stats[-1].p50_ms == pytest.approx(11.2) and stats[2].p50_ms == pytest.approx(0.2)
    assert sum(s.p50_ms for s in stats[:-1]) == pytest.approx(stats[-1].p50_ms)
