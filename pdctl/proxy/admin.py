"""The proxy's routes other than P/D itself: health and readiness, the supervisor's hold, metrics, timings; and
the health probes that keep each instance's `healthy` current. A mixin of pdctl.proxy.server.Proxy, whose state
(router, config, upstreams, metrics, timings) it reads."""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web

from pdctl.proxy.routing import Instance
from pdctl.proxy.upstream import ConnectFailed, UpstreamError

log = logging.getLogger("pdctl.proxy")


def error_body(message: str, kind: str = "proxy_error", code: int = 502) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


class AdminRoutes:
    """Everything but /v1: what operators, supervisors and Prometheus ask the proxy."""

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

    async def health(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _instance_ok(self, inst: Instance) -> bool:
        try:
            async with asyncio.timeout(2):
                async with await self.upstream(inst).request("GET", "/health") as r:
                    await r.read()
                    inst.refused = False
                    return r.status == 200
        except ConnectFailed:
            inst.refused = True
            return False
        except (TimeoutError, UpstreamError):
            return False

    async def ready(self, _req: web.Request) -> web.Response:
        insts = self.router.instances
        oks = await asyncio.gather(*(self._instance_ok(i) for i in insts))
        for inst, ok in zip(insts, oks, strict=True):
            inst.healthy = ok
        up = {i.pool for i, ok in zip(insts, oks, strict=True) if ok and not i.held and i.role == "prefill"}, {
            i.pool for i, ok in zip(insts, oks, strict=True) if ok and not i.held and i.role == "decode"}
        # Ready when some allowed pair has a healthy instance on both sides (aggregated: some instance).
        pairs = {f"{p}/{d}": p in up[0] and d in up[1] for p, d in self.router.pairs}
        ready = bool(up[1]) if self.router.aggregated else any(pairs.values())
        instances = [{"name": i.name, "role": i.role, "pool": i.pool, "url": i.url, "healthy": ok, "held": i.held}
                     for i, ok in zip(insts, oks, strict=True)]
        return web.json_response({"ready": ready, "instances": instances, "pairs": pairs},
                                 status=200 if ready else 503)

    async def metrics_route(self, _req: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def hold_route(self, req: web.Request) -> web.Response:
        """The supervisor holds an instance (no requests) while it restarts and its pairs are proven again, then
        releases it. Guarded by the API key like /v1: a client must not be able to take instances out."""
        if (refused := self._refused(req)) is not None:
            return refused
        try:
            body = await req.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        name, held = (body.get("instance"), body.get("held")) if isinstance(body, dict) else (None, None)
        if not isinstance(name, str) or not isinstance(held, bool):
            return web.json_response(error_body('expected {"instance": NAME, "held": true|false}',
                                                "invalid_request", 400), status=400)
        inst = next((i for i in self.router.instances if i.name == name), None)
        if inst is None:
            known = ", ".join(i.name for i in self.router.instances)
            return web.json_response(error_body(f"no instance {name!r}; instances: {known}", "invalid_request",
                                                404), status=404)
        if inst.held != held:
            log.warning("%s %s is %s", inst.name, inst.url, "held by the supervisor: no requests until it is "
                        "released" if held else "released by the supervisor: routing to it again")
        inst.held = held
        return web.json_response({"instance": name, "held": held})

    async def timings_route(self, req: web.Request) -> web.Response:
        """Per-request wall-clock stamps of the last requests (`?since=T`: only those received after T):
        recv, prefill_sent, prefill_done, decode_sent, decode_first (the decode's first token event),
        client_first (written to the client), end; with the request id and who served it."""
        try:
            since = float(req.query.get("since", "0"))
        except ValueError:
            return web.json_response(error_body("since: expected a number (seconds since the epoch)",
                                                "invalid_request", 400), status=400)
        return web.json_response([t for t in list(self.timings) if t["recv"] > since])
