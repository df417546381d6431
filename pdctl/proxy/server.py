"""pdctl's P/D proxy: OpenAI-compatible front for prefill and decode instances.

Each request: prefill with max_tokens 1 and `do_remote_decode`, then the client's request plus the prefill's
kv_transfer_params to a decode, whose answer (SSE or JSON) is passed through as it arrives.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from pdctl.proxy.metrics import Metrics
from pdctl.proxy.routing import ROUTE_HEADER, Instance, NoRoute, Router, affinity_key
from pdctl.proxy.upstream import ConnectFailed, Upstream, UpstreamError
from pdctl.topology import DEFAULT_POOL, instance_name

log = logging.getLogger("pdctl.proxy")

PASS_HEADERS = ("Authorization",)
REMOTE_DECODE_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                        "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass
class ProxyConfig:
    prefill: list[str]  # [POOL=]URL per instance; a bare URL is in pool "default"
    decode: list[str]
    policy: str = "least_outstanding"
    strict: bool = False
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0
    health_interval_s: float = 2.0  # how often every instance's /health is probed for routing
    weights: dict[str, float] = field(default_factory=dict)  # "ROLE/POOL" -> weight
    exclude_pairs: list[tuple[str, str]] = field(default_factory=list)
    affinity_epsilon: float = 0.25
    affinity_prefix_chars: int = 256
    access_log: bool = True


def parse_upstream(text: str) -> tuple[str, str]:
    """'p32=http://h:8100' -> ('p32', 'http://h:8100'); a bare URL is in the default pool."""
    pool, sep, url = text.partition("=")
    if not sep or "://" in pool:
        return DEFAULT_POOL, text.rstrip("/")
    return pool, url.rstrip("/")


def instances(role: str, upstreams: list[str], weights: dict[str, float]) -> list[Instance]:
    """The role's instances named as the plan names them (prefill-p32-0: index within its pool)."""
    out: list[Instance] = []
    seen: dict[str, int] = {}
    for text in upstreams:
        pool, url = parse_upstream(text)
        k = seen[pool] = seen.get(pool, -1) + 1
        out.append(Instance(instance_name(role, pool, k), url, role, pool, weights.get(f"{role}/{pool}", 1.0)))
    return out


def usable_kv_params(params: object) -> bool:
    return isinstance(params, dict) and bool(params.get("remote_block_ids")) and bool(
        params.get("remote_engine_id"))


def error_body(message: str, kind: str = "proxy_error", code: int = 502) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


class Proxy:
    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.router = Router(instances("prefill", cfg.prefill, cfg.weights), instances("decode", cfg.decode,
                             cfg.weights), cfg.policy, cfg.exclude_pairs, cfg.affinity_epsilon,
                             cfg.affinity_prefix_chars)
        self.metrics = Metrics()
        self._upstreams: dict[str, Upstream] = {}

    def upstream(self, inst: Instance) -> Upstream:
        up = self._upstreams.get(inst.url)
        if up is None:
            up = self._upstreams[inst.url] = Upstream(inst.url, self.cfg.connect_timeout_s, self.cfg.read_timeout_s)
        return up

    # -- app wiring ------------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_route)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _probe_forever(self) -> None:
        while True:
            insts = self.router.instances
            oks = await asyncio.gather(*(self._instance_ok(i) for i in insts))
            for inst, ok in zip(insts, oks, strict=True):
                if inst.healthy != ok:
                    log.warning("%s %s is %s", inst.name, inst.url, "back: routing to it again" if ok else
                                "down: no longer routing to it")
                inst.healthy = ok
            await asyncio.sleep(self.cfg.health_interval_s)

    async def _open(self, _app: web.Application) -> None:
        self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    async def _close(self, _app: web.Application) -> None:
        self._prober.cancel()
        for up in self._upstreams.values():
            up.close()

    # -- simple routes ---------------------------------------------------------------------------------------

    async def health(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _instance_ok(self, inst: Instance) -> bool:
        try:
            async with asyncio.timeout(2):
                async with await self.upstream(inst).request("GET", "/health") as r:
                    await r.read()
                    return r.status == 200
        except (TimeoutError, UpstreamError):
            return False

    async def ready(self, _req: web.Request) -> web.Response:
        insts = self.router.instances
        oks = await asyncio.gather(*(self._instance_ok(i) for i in insts))
        for inst, ok in zip(insts, oks, strict=True):
            inst.healthy = ok
        up = {i.pool for i, ok in zip(insts, oks, strict=True) if ok and i.role == "prefill"}, {
            i.pool for i, ok in zip(insts, oks, strict=True) if ok and i.role == "decode"}
        # Ready when some allowed pair has a healthy instance on both sides.
        pairs = {f"{p}/{d}": p in up[0] and d in up[1] for p, d in self.router.pairs}
        ready = any(pairs.values())
        return web.json_response({"ready": ready, "instances": {f"{i.role} {i.url}": ok for i, ok in
                                                                zip(insts, oks, strict=True)},
                                  "names": {i.name: ok for i, ok in zip(insts, oks, strict=True)},
                                  "pairs": pairs}, status=200 if ready else 503)

    async def models(self, req: web.Request) -> web.Response:
        decodes = [i for i in self.router.instances if i.role == "decode"]
        inst = next((i for i in decodes if i.healthy), decodes[0])
        try:
            async with await self.upstream(inst).request("GET", "/v1/models", headers=self._headers(req, "")) as r:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
        except UpstreamError as e:
            return web.json_response(error_body(f"decode {inst.url} unreachable: {e}", code=503), status=503)

    async def metrics_route(self, _req: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(self.router.instances), content_type="text/plain")

    # -- P/D -------------------------------------------------------------------------------------------------

    async def completions(self, req: web.Request) -> web.StreamResponse:
        return await self._pd(req, "/v1/completions")

    async def chat_completions(self, req: web.Request) -> web.StreamResponse:
        return await self._pd(req, "/v1/chat/completions")

    def _headers(self, req: web.Request, request_id: str) -> dict[str, str]:
        h = {k: req.headers[k] for k in PASS_HEADERS if k in req.headers}
        if request_id:
            h["X-Request-Id"] = request_id
        return h

    async def _pd(self, req: web.Request, route: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        status = 500
        chosen: list[Instance] = []  # the prefill, then the decode, as they are picked
        request_id = req.headers.get("X-Request-Id") or f"pdctl-{uuid.uuid4().hex}"
        try:
            resp = await self._pd_inner(req, route, t0, chosen, request_id)
            status = resp.status
            if not resp.prepared:  # a streamed answer carried these from its first byte
                resp.headers.update(self._route_headers(chosen))
            return resp
        finally:
            seconds = time.perf_counter() - t0
            self.metrics.request_done(route, status, seconds)
            p, d = (chosen + [None, None])[:2]
            if d is not None:
                self.metrics.pair_done(p.pool, d.pool, status)
            if self.cfg.access_log:
                log.info("%s %s %d %.1f ms prefill=%s decode=%s", request_id, route,
                         status, 1e3 * seconds, p.name if p else "-", d.name if d else "-")

    @staticmethod
    def _route_headers(chosen: list[Instance]) -> dict[str, str]:
        return dict(zip(("x-pdctl-prefill", "x-pdctl-decode"), (i.name for i in chosen), strict=False))

    async def _pd_inner(self, req: web.Request, route: str, t0: float, chosen: list[Instance],
                        request_id: str) -> web.StreamResponse:
        try:
            body = await req.json()
            assert isinstance(body, dict)
        except (ValueError, AssertionError):
            return web.json_response(error_body("request body must be a JSON object", "invalid_request", 400),
                                     status=400)
        headers = self._headers(req, request_id)
        router = self.router
        try:
            pin = router.parse_pin(req.headers[ROUTE_HEADER]) if ROUTE_HEADER in req.headers else None
        except NoRoute as e:
            return web.json_response(error_body(f"{ROUTE_HEADER}: {e}", "invalid_request", 400), status=400)
        key = affinity_key(body, router.prefix_chars) if router.policy == "prefix_affinity" else None

        pre_body = dict(body)
        pre_body["max_tokens"] = 1
        if "max_completion_tokens" in pre_body:
            pre_body["max_completion_tokens"] = 1
        pre_body["stream"] = False
        for k in ("stream_options", "min_tokens"):
            pre_body.pop(k, None)
        pre_body["kv_transfer_params"] = dict(REMOTE_DECODE_PARAMS)

        p = router.pick_prefill(key, pin)
        chosen.append(p)
        p.inflight += 1
        try:
            async with await self.upstream(p).request("POST", route, json.dumps(pre_body).encode(), headers) as r:
                raw = await r.read()
                if r.status >= 400:
                    # Client errors (e.g. prompt too long) go back as they are; the decode never sees them.
                    if r.status >= 500:
                        self.metrics.upstream_error(p.url)
                    return web.Response(status=r.status, body=raw, content_type="application/json")
                pre = json.loads(raw)
        except UpstreamError as e:
            self.metrics.upstream_error(p.url)
            if isinstance(e, ConnectFailed):
                p.healthy = False  # nothing listens there: route around it until a probe finds it back
            return web.json_response(error_body(f"prefill {p.url} unavailable: {e!s}", "upstream_unavailable",
                                                503), status=503)
        except ValueError:
            self.metrics.upstream_error(p.url)
            return web.json_response(error_body(f"prefill {p.url} returned no JSON"), status=502)
        finally:
            p.inflight -= 1
        self.metrics.prefill_done(time.perf_counter() - t0)

        kvp = pre.get("kv_transfer_params")
        if not usable_kv_params(kvp):
            self.metrics.kv_transfer_missing += 1
            log.warning("prefill %s returned no usable kv_transfer_params (request %s): the decode would "
                        "recompute the prompt", p.url, request_id)
            if self.cfg.strict:
                return web.json_response(error_body(
                    f"prefill {p.url} returned no usable kv_transfer_params; refusing to let the decode "
                    "recompute the prompt (strict mode)", "kv_transfer_missing"), status=502)
        dec_body = dict(body)
        dec_body["kv_transfer_params"] = kvp

        d = router.pick_decode(p.pool, key, pin)
        chosen.append(d)
        d.inflight += 1
        try:
            return await self._decode(req, d, route, dec_body, headers, t0, self._route_headers(chosen))
        finally:
            d.inflight -= 1

    async def _decode(self, req: web.Request, d: Instance, route: str, body: dict, headers: dict[str, str],
                      t0: float, route_headers: dict[str, str]) -> web.StreamResponse:
        try:
            upstream = await self.upstream(d).request("POST", route, json.dumps(body).encode(), headers)
        except UpstreamError as e:
            self.metrics.upstream_error(d.url)
            if isinstance(e, ConnectFailed):
                d.healthy = False
            return web.json_response(error_body(f"decode {d.url} unavailable: {e!s}", "upstream_unavailable",
                                                503), status=503)
        async with upstream:
            ctype = upstream.headers.get("content-type", "application/json")
            if not body.get("stream") or upstream.status >= 400:
                try:
                    raw = await upstream.read()
                except UpstreamError as e:
                    self.metrics.upstream_error(d.url)
                    return web.json_response(error_body(f"decode {d.url} failed: {e!s}"), status=502)
                self.metrics.first_decode_byte(time.perf_counter() - t0)
                if upstream.status >= 500:
                    self.metrics.upstream_error(d.url)
                return web.Response(status=upstream.status, body=raw, content_type=ctype.split(";")[0])
            out = web.StreamResponse(status=200, headers={"Content-Type": ctype, "Cache-Control": "no-cache",
                                                          "X-Request-Id": headers["X-Request-Id"], **route_headers})
            await out.prepare(req)
            first = True
            try:
                async for chunk in upstream.chunks():
                    if first:
                        self.metrics.first_decode_byte(time.perf_counter() - t0)
                        first = False
                    await out.write(chunk)
            except UpstreamError as e:
                # The client must see the stream end with an error, never a hang.
                self.metrics.upstream_error(d.url)
                err = json.dumps(error_body(f"decode {d.url} failed mid-stream: {e!s}"))
                await out.write(f"data: {err}\n\ndata: [DONE]\n\n".encode())
            await out.write_eof()
            return out


def serve(cfg: ProxyConfig, host: str, port: int) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = Proxy(cfg)
    log.info("pdctl proxy on %s:%d: %s; pairs %s; policy %s%s", host, port,
             ", ".join(f"{i.name} {i.url}" for i in proxy.router.instances),
             ", ".join(f"{p}/{d}" for p, d in proxy.router.pairs), cfg.policy, ", strict" if cfg.strict else "")
    web.run_app(proxy.app(), host=host, port=port, print=None, access_log=None, handler_cancellation=True)
