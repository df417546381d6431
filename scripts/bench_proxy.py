"""Benchmark pdctl's P/D proxy against instant backends: added latency and max P/D requests/s.

The proxy runs alone on core 0; the instant prefill/decode backends and the load generator share core 1, so the
numbers are the proxy's. Each P/D request is two upstream calls. "direct" is the client making both calls itself,
so "added" is what the proxy costs. Measured the same way, interleaved: a FastAPI + httpx proxy built as vLLM's
toy P/D proxy is (the baseline the HTTP stack was chosen against; warmed past its httpx pool's start-up transient
first, see serve_fastapi_proxy), and vllm-router (the vLLM project's Rust P/D router, when installed).

Max requests/s is measured with wrk (C; Debian package `wrk`) on the load core, so the load generator is not the
bottleneck; latencies at concurrency 1 with a Python client that can time the client-side P-then-D baseline,
interleaving direct and proxied requests in one run so both are timed under the same conditions.

Usage: python scripts/bench_proxy.py [--duration 5] [--out results/bench_proxy.json]
"""

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

KVP = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1], "remote_host": "h",
       "remote_port": 1}
CHUNKS = 8
BASELINE = "fastapi+httpx"
ROUTER = "vllm-router"
# The baseline's warm-up (serve_fastapi_proxy): 2 s rounds of load until each of its httpx pools holds at most
# concurrency/4 connections, for at most this long. Its pools shed a burst's connections only once they have idled
# for httpx's keepalive_expiry (5 s); that took 6-12 s at c=64 on a busy 2-core host. Below SETTLE_MIN_CONCURRENCY
# a pool never holds enough connections for its bookkeeping to matter.
BASELINE_WARMUP_S = 30.0
SETTLE_MIN_CONCURRENCY = 32


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

    # A proxy whose client hung up (wrk, at the end of a run) may drop a request half sent, or half answered.
    gone = ConnectionResetError

    async def prefill(req):
        try:
            await req.read()
        except gone:
            return web.Response(status=499)
        return web.Response(body=pre_body, content_type="application/json")

    async def decode(req):
        try:
            body = await req.json()
        except gone:
            return web.Response(status=499)
        if not body.get("stream"):
            return web.Response(body=dec_body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await resp.prepare(req)
            for _ in range(CHUNKS):
                await resp.write(chunk)
            await resp.write(b"data: [DONE]\n\n")
        except gone:
            pass
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


def serve_fastapi_proxy(port: int, p_urls: list[str], d_urls: list[str]) -> None:
    """The baseline: a FastAPI + httpx P/D proxy built the way vLLM's toy proxy is (tests/v1/kv_connector/
    nixl_integration/toy_proxy_server.py). One httpx.AsyncClient per instance (base_url, no connection cap, every
    connection kept alive), opened in the app's lifespan; instances taken round robin; the prefill asked for one
    token, not streamed, marked do_remote_decode, its body read and the response closed before the decode goes out
    with the prefill's kv_transfer_params; the decode's answer always streamed back through a StreamingResponse.

    Its httpx (0.28, httpcore 1.0.9) pool has a start-up transient under load: a burst of c requests opens c
    connections per instance, and every pool pass (several per upstream request) then costs O(idle x all
    connections) (the keep-alive check counts the whole list for each idle connection, and polls each idle
    socket). Requests soon crowd onto a few connections; the rest idle out after keepalive_expiry (5 s) and the
    pool settles at ~10 (5x less proxy CPU per request at c=64). vLLM's toy proxy does the same (~50 -> ~220 req/s
    over four 3 s wrk runs at c=64 on a busy 2-core host). main() measures it settled (--warmup)."""
    import itertools
    import uuid
    from contextlib import asynccontextmanager

    import httpx
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import StreamingResponse

    def client(url: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url + "/v1", timeout=None,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.prefill = [client(u) for u in p_urls]
        app.state.decode = [client(u) for u in d_urls]
        app.state.next_prefill = itertools.cycle(app.state.prefill)
        app.state.next_decode = itertools.cycle(app.state.decode)
        yield
        for c in app.state.prefill + app.state.decode:
            await c.aclose()

    app = FastAPI(lifespan=lifespan)

    async def pd(path: str, request: Request):
        body = await request.json()
        headers = {"X-Request-Id": str(uuid.uuid4())}
        pre = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens", "min_completion_tokens")}
        if "max_completion_tokens" in pre:
            pre["max_completion_tokens"] = 1
        pre.update(stream=False, max_tokens=1,
                   kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                       "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                       "remote_port": None})
        r = await next(request.app.state.next_prefill).post(path, json=pre, headers=headers)
        r.raise_for_status()
        await r.aread()
        kv = r.json().get("kv_transfer_params")
        await r.aclose()
        if kv:
            body["kv_transfer_params"] = kv
        decode = next(request.app.state.next_decode)

        async def relay():
            async with decode.stream("POST", path, json=body, headers=headers) as s:
                s.raise_for_status()
                async for chunk in s.aiter_bytes():
                    yield chunk

        return StreamingResponse(relay(), media_type="text/event-stream" if body.get("stream")
                                 else "application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await pd("/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await pd("/chat/completions", request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/pool")
    async def pool():
        """Connections in each instance's httpx pool (main() waits for them to settle)."""
        return {role: [len(c._transport._pool.connections) for c in getattr(app.state, role)]
                for role in ("prefill", "decode")}

    # uvicorn as the toy runs it (uvloop and httptools when installed, as here), less the per-request access log.
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


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


def cpu_s(pid: int) -> float:
    """CPU time a process (all its threads) has used: user + system."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, concurrency: int, stream: bool, duration: float, core: int, pid: int | None = None) -> dict:
    """Closed-loop load with wrk: requests/s, p50/p99 latency, errors; with the proxy's pid, the CPU time it spent
    per request (which, unlike requests/s, holds on a host whose cores other work shares)."""
    import re
    import shutil
    import tempfile

    if not shutil.which("wrk"):
        return {"wrk_rps": None}
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 8, "stream": stream})
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_LUA % body)
    cpu0 = cpu_s(pid) if pid else 0.0
    out = subprocess.run(["taskset", "-c", str(core), "wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(duration))}s",
                          "--latency", "-s", f.name, url + "/v1/completions"], capture_output=True, text=True).stdout
    cpu = cpu_s(pid) - cpu0 if pid else None
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
    done = re.search(r"^\s*(\d+) requests in", out, re.M)
    return {"wrk_rps": float(rps.group(1)) if rps else None, "wrk_p50_ms": ms("50%"), "wrk_p99_ms": ms("99%"),
            "wrk_errors": errors, "wrk_requests": int(done.group(1)) if done else None,
            "wrk_proxy_cpu_ms_per_req": cpu * 1e3 / int(done.group(1)) if cpu is not None and done
            and int(done.group(1)) else None}


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
        cpu = [r["wrk_proxy_cpu_ms_per_req"] for r in mine if r.get("wrk_proxy_cpu_ms_per_req") is not None]
        out.append({"proxy": key[0], "stream": key[1], "concurrency": key[2],
                    "wrk_rps": statistics.median(r["wrk_rps"] for r in mine),
                    "proxy_cpu_ms_per_req": statistics.median(cpu) if cpu else None,
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
    ap.add_argument("--no-router", dest="router", action="store_false",
                    help="leave vllm-router (the vLLM project's Rust P/D router) out")
    ap.add_argument("--warmup", type=float, default=BASELINE_WARMUP_S, metavar="S",
                    help="before each measurement of the FastAPI + httpx baseline at concurrency >= "
                    f"{SETTLE_MIN_CONCURRENCY}, load it (wrk, 2 s rounds, that concurrency) until its httpx pools "
                    "have shed the connections the burst opened, for at most S seconds: its steady state, past "
                    "the pool's start-up transient (serve_fastapi_proxy); 0: measure it cold (default %(default)s)")
    ap.add_argument("--serve-backends", nargs=2, type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-fastapi", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_backends:
        serve_backends(*a.serve_backends)
        return 0
    if a.serve_fastapi:
        serve_fastapi_proxy(int(a.serve_fastapi[0]), a.serve_fastapi[1].split(","), a.serve_fastapi[2].split(","))
        return 0

    cores = sorted(os.sched_getaffinity(0))
    proxy_core, load_core = cores[0], cores[-1]
    p_port, d_port, px_port, fa_port, vr_port, vr_metrics_port = (free_port() for _ in range(6))
    urls = {"prefill": f"http://127.0.0.1:{p_port}", "decode": f"http://127.0.0.1:{d_port}"}
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-backends", str(p_port), str(d_port)],
                              preexec_fn=pinned(load_core), start_new_session=True)]
    proxies = {
        "pdctl (aiohttp+httptools)": (px_port, [sys.executable, "-m", "pdctl", "proxy", "--port", str(px_port),
                                                "--prefill", urls["prefill"], "--decode", urls["decode"]]),
        BASELINE: (fa_port, [sys.executable, __file__, "--serve-fastapi", str(fa_port), urls["prefill"],
                             urls["decode"]]),
        # vLLM P/D mode: the prefill gets max_tokens 1, stream false and kv_transfer_params {do_remote_decode: true}
        # on /v1/completions, the decode the prefill's kv_transfer_params, as the instant backends answer. It
        # waits for the backends' /health before it listens.
        ROUTER: (vr_port, [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation",
                           "--kv-connector", "nixl", "--prefill", urls["prefill"], "--decode", urls["decode"],
                           "--host", "127.0.0.1", "--port", str(vr_port), "--policy", "round_robin",
                           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(vr_metrics_port),
                           "--worker-startup-check-interval", "1"]),
    }
    if not a.baseline:
        del proxies[BASELINE]
    if a.router and importlib.util.find_spec("vllm_router") is None:
        print("vllm-router is not installed (pip install vllm-router): left out", file=sys.stderr)
        a.router = False
    if not a.router:
        del proxies[ROUTER]
    envs, cwds = {ROUTER: {**os.environ, "NO_COLOR": "1"}}, {}
    for other in a.pdctl_at:
        port = free_port()
        name = f"pdctl at {other}"
        proxies[name] = (port, [sys.executable, "-m", "pdctl", "proxy", "--port", str(port), "--prefill",
                                urls["prefill"], "--decode", urls["decode"]])
        envs[name] = {**os.environ, "PYTHONPATH": str(Path(other).resolve())}
        cwds[name] = envs[name]["PYTHONPATH"]
    pids = {}
    for name, (_port, argv) in proxies.items():
        procs.append(subprocess.Popen(argv, preexec_fn=pinned(proxy_core), start_new_session=True, env=envs.get(name),
                                      cwd=cwds.get(name),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        pids[name] = procs[-1].pid
    os.sched_setaffinity(0, {load_core})
    rows = []
    try:
        for port in (p_port, d_port, *(port for port, _ in proxies.values())):
            wait_port(port)
        proxy_urls = {name: f"http://127.0.0.1:{port}" for name, (port, _) in proxies.items()}
        all_urls = {**urls, **proxy_urls}

        def warm(name: str, c: int, stream: bool) -> dict:
            """The baseline's warm-up (--warmup): what it took, for the row."""
            if name != BASELINE or c < SETTLE_MIN_CONCURRENCY or a.warmup <= 0 or not shutil.which("wrk"):
                return {}
            url, rounds, end = proxy_urls[name], [], time.monotonic() + a.warmup
            while True:
                rounds.append(round(wrk(url, c, stream, 2, load_core)["wrk_rps"] or 0))
                try:
                    with urllib.request.urlopen(url + "/pool", timeout=30) as r:
                        biggest = max(sum(json.load(r).values(), []))
                except OSError:  # an httpx without those internals: warm for the whole --warmup
                    biggest = None
                settled = biggest is not None and biggest <= c // 4
                if settled or time.monotonic() >= end:
                    return {"warmup_rounds_rps": rounds, "warmup_pool": biggest, "warmup_settled": settled}

        for rep, stream in ((rep, stream) for rep in range(a.repeat) for stream in (False, True)):
            if rep % 2:  # interleaved: every other repeat measures the proxies in the opposite order
                proxy_urls = dict(reversed(proxy_urls.items()))
            for c in a.concurrency:
                # Latency (concurrency 1): each proxy interleaved with its own direct baseline in one run.
                # Throughput: one thing at a time.
                pairs, warmups = {}, {}
                for name in proxy_urls:
                    warmups[name] = warm(name, c, stream)
                    pairs[name] = asyncio.run(load(["direct", name] if c == 1 else [name], all_urls, c, stream,
                                                   a.duration))
                direct = (next(iter(pairs.values()))["direct"] if c == 1 else
                          asyncio.run(load(["direct"], all_urls, c, stream, a.duration))["direct"])
                rows.append({"proxy": "direct (client calls P then D)", "stream": stream, "concurrency": c,
                             "repeat": rep, **direct, "added_p50_ms": 0.0, "added_p99_ms": 0.0})
                for name, purl in proxy_urls.items():
                    r, base = pairs[name][name], pairs[name].get("direct", direct)
                    wrk_warmup = {f"wrk_{k}": v for k, v in warm(name, c, stream).items()}
                    rows.append({"proxy": name, "stream": stream, "concurrency": c, "repeat": rep, **r,
                                 "added_p50_ms": r["p50_ms"] - base["p50_ms"],
                                 "added_p99_ms": r["p99_ms"] - base["p99_ms"], **warmups[name],
                                 **wrk(purl, c, stream, a.duration, load_core, pids[name]), **wrk_warmup})
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
    print(f"{'proxy':32} {'stream':6} {'conc':>4} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'+p50':>6} {'+p99':>6} "
          f"{'err':>3} | {'wrk req/s':>9} {'p50':>7} {'p99':>7} {'err':>3} {'cpu ms/req':>10}")
    for r in rows:
        w = r.get("wrk_rps")
        cpu = r.get("wrk_proxy_cpu_ms_per_req")
        wrk_cols = (f"{w:>9.0f} {r['wrk_p50_ms'] or 0:>7.2f} {r['wrk_p99_ms'] or 0:>7.2f} {r['wrk_errors']:>3} "
                    f"{cpu if cpu is not None else float('nan'):>10.3f}" if w else f"{'-':>9}")
        print(f"{r['proxy']:32} {str(r['stream']):6} {r['concurrency']:>4} {r['rps']:>7.0f} {r['p50_ms']:>7.2f} "
              f"{r['p99_ms']:>7.2f} {r['added_p50_ms']:>6.2f} {r['added_p99_ms']:>6.2f} {r['errors']:>3} | {wrk_cols}")
    for r in rows:
        for k in ("", "wrk_"):
            if r.get(f"{k}warmup_rounds_rps"):
                print(f"  {r['proxy']} stream={r['stream']} c={r['concurrency']}: before the {k[:-1] or 'python'} "
                      f"measurement, warm-up rounds of 2 s at {r[f'{k}warmup_rounds_rps']} req/s; largest pool then "
                      f"{r[f'{k}warmup_pool']} connections" + ("" if r[f"{k}warmup_settled"] else " (not settled)"))
    medians = summary(rows)
    if a.repeat > 1:
        print(f"\nmedian over {a.repeat} repeats of wrk req/s, proxy CPU per request (and per-repeat ratio of req/s "
              "to pdctl's proxy here):")
        for m in medians:
            print(f"  {m['proxy']:40} stream={str(m['stream']):5} c={m['concurrency']:<3} {m['wrk_rps']:>8.0f}"
                  + (f" {m['proxy_cpu_ms_per_req']:7.3f} ms CPU/req" if m["proxy_cpu_ms_per_req"] is not None else "")
                  + (f"  x{m['ratio_to_pdctl']:.3f} ({m['ratio_spread'][0]:.3f}-{m['ratio_spread'][1]:.3f})"
                     if m.get("ratio_to_pdctl") else ""))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": " ".join(sys.argv), "proxy_core": proxy_core,
                                       "load_core": load_core, "rows": rows, "medians": medians}, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
