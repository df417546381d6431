"""The load client against a tiny streaming server: what it measures, closed and open loop."""

import asyncio
import statistics
import threading
import time

import pytest
from aiohttp import web

from pdctl.bench import load

STEP_S = 0.01  # the fake decode's time per token


def serve(bunch: bool = False):
    """A /v1/completions that streams max_tokens SSE events STEP_S apart (or all at once) and a usage chunk;
    records when each request arrived."""
    arrived: list[float] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        arrived.append(time.perf_counter())
        body = await request.json()
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        n = body["max_tokens"]
        if bunch:
            await asyncio.sleep(STEP_S * n)
        for _ in range(n):
            if not bunch:
                await asyncio.sleep(STEP_S)
            await r.write(b'data: {"choices":[{"text":"x"}]}\n\n')
        await r.write(b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % n)
        return r

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)

    return f"http://127.0.0.1:{port}", arrived, stop


@pytest.fixture
def server():
    url, arrived, stop = serve()
    yield url, arrived
    stop()


def test_closed_loop_measures_tpot_and_ttft(server):
    url, _ = server
    r = load.run_load("t", url, "m", load.workload(6, 8, 100, 0), 10, 2)
    assert (r.requests, r.errors, r.bunched, r.request_rate) == (6, 0, 0, None)
    assert STEP_S * 0.9 < r.tpot_ms_p50 / 1e3 < STEP_S * 3  # one step per token, not zero, not stalled
    assert STEP_S * 0.9 < r.ttft_ms_p50 / 1e3 < STEP_S * 5
    assert r.out_tok_per_s > 0 and r.e2e_ms_p50 > 9 * r.tpot_ms_p50


def test_streams_that_arrive_all_at_once_are_flagged():
    url, _, stop = serve(bunch=True)
    try:
        r = load.run_load("t", url, "m", load.workload(3, 8, 100, 0), 10, 1)
    finally:
        stop()
    assert r.bunched == 3 and r.tpot_ms_p50 < 1.0  # what bench_hetero leaves out as a burst run


def test_arrivals_are_poisson_at_the_rate_and_repeat_with_the_seed():
    a = load.arrivals(4000, 20.0, seed=7)
    assert a[0] == 0 and a == sorted(a) and a == load.arrivals(4000, 20.0, seed=7)
    assert a != load.arrivals(4000, 20.0, seed=8)
    gaps = [y - x for x, y in zip(a, a[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.06)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 20, rel=0.1)  # exponential: sd == mean


def test_open_loop_sends_at_the_arrival_times_not_when_a_slot_frees(server):
    url, arrived = server
    r = load.run_load("t", url, "m", load.workload(8, 8, 100, 0), 20, 1, request_rate=40.0, seed=3)
    assert (r.requests, r.errors, r.request_rate) == (8, 0, 40.0)
    offsets = load.arrivals(8, 40.0, seed=3)
    sent = [t - arrived[0] for t in arrived]
    # Each request takes ~0.2 s, so a closed loop of 1 would space them >= 0.2 s; the open loop keeps the schedule.
    assert max(abs(s - o) for s, o in zip(sent, offsets, strict=True)) < 0.05, (sent, offsets)
