"""Benchmark pdctl's P/D proxy against instant backends: added latency and max P/D requests/s.

The proxy runs alone on core 0; the instant prefill/decode backends and the load generator share core 1, so the
numbers are the proxy's. Each P/D request is two upstream calls. "direct" is the client making both calls itself,
so "added" is what the proxy costs. A FastAPI + httpx proxy (the stack of vLLM's toy P/D proxy) is measured the
same way, as the baseline the HTTP stack was chosen against.

Max requests/s is measured with wrk (C; Debian package `wrk`) on the load core, so the load generator is not the
bottleneck; latencies at concurrency 1 with a Python client that can time the client-side P-then-D baseline,
interleaving direct and proxied requests in one run so both are timed under the same conditions.

Usage: python scripts/bench_proxy.py [--duration 5] [--out results/bench_proxy.json]
"""

import argparse
import asyncio
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

KVP = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
       "remote_port": 1}
CHUNKS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ backends


def serve_backends(p_port: int, d_port: int) -> None:
    import uvloop
    from aiohttp import web

    pre_body = json.dumps({"choices": [{"text": "x"}], "kv_transfer_params": KVP}).encode()
    dec_body = json.dumps({"choices": [{"text": "hello world"}]}).encode()
    chunk = b'data: {"choices":[{"text":"t"}]}\n\n'

    async def prefill(req):
        await req.read()
        return web.Response(body=pre_body, content_type="application/json")

    async def decode(req):
        body = await req.json()
        if not body.get("stream"):
            return web.Response(body=dec_body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        for _ in range(CHUNKS):
            await resp.write(chunk)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(_req):
        return web.Response(text="ok")

    async def main():
        for port, handler in ((p_port, prefill), (d_port, decode)):
            app = web.Application()
            app.router.add_post("/v1/completions", handler)
            app.router.add_get("/health", health)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        await asyncio.Event().wait()

    uvloop.run(main())


def serve_fastapi_proxy(port: int, p_url: str, d_url: str) -> None:
    """A minimal FastAPI + httpx P/D proxy in the style of vLLM's toy proxy (the baseline)."""
    import httpx
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    # As vLLM's toy proxy sets it: no cap on connections *and on kept-alive ones*. httpx keeps 20 alive by
    # default; past 20 in flight every request opened and closed a connection (36 req/s with errors at c=64).
    client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None,
                                                                 max_keepalive_connections=None))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        pre = dict(body, max_tokens=1, stream=False)
        r = await client.post(p_url + "/v1/completions", json=pre)
        body["kv_transfer_params"] = r.json().get("kv_transfer_params")
        if body.get("stream"):
            async def gen():
                async with client.stream("POST", d_url + "/v1/completions", json=body) as s:
                    async for c in s.aiter_bytes():
                        yield c
            return StreamingResponse(gen(), media_type="text/event-stream")
        r = await client.post(d_url + "/v1/completions", json=body)
        return JSONResponse(r.json())

    @app.get("/health")
    async def health():
        return {"ok": True}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop", access_log=False)


# ------------------------------------------------------------------------------------------------ load


def _quantiles(lat: list[float]) -> dict:
    lat = sorted(lat)
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [float("nan")] * 99
    return {"p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3}


async def load(modes: list[str], urls: dict, concurrency: int, stream: bool, duration: float) -> dict[str, dict]:
    """Closed-loop load; each worker takes the modes in turn, so with several modes (concurrency 1: direct and
    proxy) both are timed interleaved, under the same conditions, and their difference is the proxy's cost."""
    import aiohttp

    body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": stream}
    lat: dict[str, list[float]] = {m: [] for m in modes}
    errors = dict.fromkeys(modes, 0)
    end = time.perf_counter() + duration
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def call(url: str, b: dict) -> bool:
            async with s.post(url + "/v1/completions", json=b) as r:
                await r.read()
                return r.status == 200

        async def one(mode: str) -> None:
            t0 = time.perf_counter()
            if mode == "direct":
                ok = await call(urls["prefill"], dict(body, max_tokens=1, stream=False))
                ok = ok and await call(urls["decode"], dict(body, kv_transfer_params=KVP))
            else:
                ok = await call(urls[mode], body)
            if ok:
                lat[mode].append(time.perf_counter() - t0)
            else:
                errors[mode] += 1

        async def worker():
            i = 0
            while time.perf_counter() < end:
                mode = modes[i % len(modes)]
                i += 1
                try:
                    await one(mode)
                except Exception:  # noqa: BLE001 - counted
                    errors[mode] += 1

        for m in modes:  # warm connections
            for _ in range(min(concurrency, 4)):
                await one(m)
        for v in lat.values():
            v.clear()
        gc.disable()  # the client's own collector pauses are not the proxy's latency
        t0 = time.perf_counter()
        try:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        finally:
            gc.enable()
        wall = time.perf_counter() - t0
    return {m: {"requests": len(lat[m]), "errors": errors[m], "rps": len(lat[m]) / wall, **_quantiles(lat[m])}
            for m in modes}


WRK_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '%s'
"""


def wrk(url: str, concurrency: int, stream: bool, duration: float, core: int) -> dict:
    """Closed-loop load with wrk: requests/s, p50/p99 latency, errors."""
    import re
    import shutil
    import tempfile

    if not shutil.which("wrk"):
        return {"wrk_rps": None}
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 8, "stream": stream})
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_LUA % body)
    out = subprocess.run(["taskset", "-c", str(core), "wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(duration))}s",
                          "--latency", "-s", f.name, url + "/v1/completions"], capture_output=True, text=True).stdout
    os.unlink(f.name)

    def ms(label: str) -> float | None:
        m = re.search(rf"^\s+{label}\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        if not m:
            return None
        return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(bad.group(1)) if bad else 0) + (sum(map(int, sock.groups())) if sock else 0)
    return {"wrk_rps": float(rps.group(1)) if rps else None, "wrk_p50_ms": ms("50%"), "wrk_p99_ms": ms("99%"),
            "wrk_errors": errors}


def pinned(core: int):
    return lambda: os.sched_setaffinity(0, {core})


def wait_port(port: int, timeout: float = 30) -> None:
    end = time.time() + timeout
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} never opened")


def summary(rows: list[dict]) -> list[dict]:
    """Per proxy, stream and concurrency: the median wrk req/s over repeats, and the median of each repeat's
    ratio to pdctl's proxy of this checkout (measured in the same repeat)."""
    import statistics

    ours = "pdctl (aiohttp+httptools)"
    out = []
    for key in sorted({(r["proxy"], r["stream"], r["concurrency"]) for r in rows if r.get("wrk_rps")}):
        mine = [r for r in rows if (r["proxy"], r["stream"], r["concurrency"]) == key]
        ratios = []
        for r in mine:
            base = next((b for b in rows if (b["proxy"], b["stream"], b["concurrency"], b["repeat"]) ==
                         (ours, r["stream"], r["concurrency"], r["repeat"]) and b.get("wrk_rps")), None)
            if base and key[0] != ours:
                ratios.append(r["wrk_rps"] / base["wrk_rps"])
        out.append({"proxy": key[0], "stream": key[1], "concurrency": key[2],
                    "wrk_rps": statistics.median(r["wrk_rps"] for r in mine),
                    **({"ratio_to_pdctl": statistics.median(ratios), "ratio_spread": [min(ratios), max(ratios)]}
                       if ratios else {})})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--out", default="results/bench_proxy.json")
    ap.add_argument("--pdctl-at", action="append", default=[], metavar="DIR",
                    help="also measure the pdctl proxy of another checkout (e.g. a git worktree of an older commit)")
    ap.add_argument("--repeat", type=int, default=1, help="measure everything N times, interleaved; medians")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false",
                    help="leave the FastAPI + httpx proxy out (at c=64 it leaves the backends slow for whatever is "
                    "measured right after it: an A/B of two pdctl proxies is cleaner without it)")
    ap.add_argument("--serve-backends", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-fastapi", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_backends:
        serve_backends(*a.serve_backends)
        return 0
    if a.serve_fastapi:
        serve_fastapi_proxy(int(a.serve_fastapi[0]), a.serve_fastapi[1], a.serve_fastapi[2])
        return 0

    cores = sorted(os.sched_getaffinity(0))
    proxy_core, load_core = cores[0], cores[-1]
    p_port, d_port, px_port, fa_port = free_port(), free_port(), free_port(), free_port()
    urls = {"prefill": f"http://127.0.0.1:{p_port}", "decode": f"http://127.0.0.1:{d_port}"}
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-backends", str(p_port), str(d_port)],
                              preexec_fn=pinned(load_core), start_new_session=True)]
    proxies = {
        "pdctl (aiohttp+httptools)": (px_port, [sys.executable, "-m", "pdctl", "proxy", "--port", str(px_port),
                                                "--prefill", urls["prefill"], "--decode", urls["decode"]]),
        "fastapi+httpx": (fa_port, [sys.executable, __file__, "--serve-fastapi", str(fa_port), urls["prefill"],
                                    urls["decode"]]),
    }
    if not a.baseline:
        del proxies["fastapi+httpx"]
    envs = {}
    for other in a.pdctl_at:
        port = free_port()
        name = f"pdctl at {other}"
        proxies[name] = (port, [sys.executable, "-m", "pdctl", "proxy", "--port", str(port), "--prefill",
                                urls["prefill"], "--decode", urls["decode"]])
        envs[name] = {**os.environ, "PYTHONPATH": str(Path(other).resolve())}
    for name, (_port, argv) in proxies.items():
        procs.append(subprocess.Popen(argv, preexec_fn=pinned(proxy_core), start_new_session=True, env=envs.get(name),
                                      cwd=envs.get(name, {}).get("PYTHONPATH"),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    os.sched_setaffinity(0, {load_core})
    rows = []
    try:
        for port in (p_port, d_port, *(port for port, _ in proxies.values())):
            wait_port(port)
        proxy_urls = {name: f"http://127.0.0.1:{port}" for name, (port, _) in proxies.items()}
        all_urls = {**urls, **proxy_urls}
        for rep, stream in ((rep, stream) for rep in range(a.repeat) for stream in (False, True)):
            if rep % 2:  # interleaved: every other repeat measures the proxies in the opposite order
                proxy_urls = dict(reversed(proxy_urls.items()))
            for c in a.concurrency:
                # Latency (concurrency 1): each proxy interleaved with its own direct baseline in one run.
                # Throughput: one thing at a time.
                pairs = {name: asyncio.run(load(["direct", name] if c == 1 else [name], all_urls, c, stream,
                                                a.duration)) for name in proxy_urls}
                direct = (next(iter(pairs.values()))["direct"] if c == 1 else
                          asyncio.run(load(["direct"], all_urls, c, stream, a.duration))["direct"])
                rows.append({"proxy": "direct (client calls P then D)", "stream": stream, "concurrency": c,
                             "repeat": rep, **direct, "added_p50_ms": 0.0, "added_p99_ms": 0.0})
                for name, purl in proxy_urls.items():
                    r, base = pairs[name][name], pairs[name].get("direct", direct)
                    rows.append({"proxy": name, "stream": stream, "concurrency": c, "repeat": rep, **r,
                                 "added_p50_ms": r["p50_ms"] - base["p50_ms"],
                                 "added_p99_ms": r["p99_ms"] - base["p99_ms"],
                                 **wrk(purl, c, stream, a.duration, load_core)})
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(10)
    print(f"{'proxy':32} {'stream':6} {'conc':>4} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'+p50':>6} {'+p99':>6} "
          f"{'err':>3} | {'wrk req/s':>9} {'p50':>7} {'p99':>7} {'err':>3}")
    for r in rows:
        w = r.get("wrk_rps")
        wrk_cols = (f"{w:>9.0f} {r['wrk_p50_ms'] or 0:>7.2f} {r['wrk_p99_ms'] or 0:>7.2f} {r['wrk_errors']:>3}"
                    if w else f"{'-':>9}")
        print(f"{r['proxy']:32} {str(r['stream']):6} {r['concurrency']:>4} {r['rps']:>7.0f} {r['p50_ms']:>7.2f} "
              f"{r['p99_ms']:>7.2f} {r['added_p50_ms']:>6.2f} {r['added_p99_ms']:>6.2f} {r['errors']:>3} | {wrk_cols}")
    medians = summary(rows)
    if a.repeat > 1:
        print(f"\nmedian over {a.repeat} repeats of wrk req/s (and per-repeat ratio to pdctl's proxy here):")
        for m in medians:
            print(f"  {m['proxy']:40} stream={str(m['stream']):5} c={m['concurrency']:<3} {m['wrk_rps']:>8.0f}"
                  + (f"  x{m['ratio_to_pdctl']:.3f} ({m['ratio_spread'][0]:.3f}-{m['ratio_spread'][1]:.3f})"
                     if m.get("ratio_to_pdctl") else ""))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "proxy_core": proxy_core,
                                       "load_core": load_core, "rows": rows, "medians": medians}, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
