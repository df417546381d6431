"""pdctl's P/D proxy: OpenAI-compatible front for prefill and decode instances.

Each request: prefill with max_tokens 1 and `do_remote_decode`, then the client's request plus the prefill's
kv_transfer_params to a decode, whose answer (SSE or JSON) is passed through as it arrives.

Faults: a prefill that fails before answering is tried once more on another (a prefill is idempotent); when no
prefill answers with usable KV, `on_prefill_down` says fallback (the decode computes the prompt, counted) or
reject. A decode is tried again only when nothing listened (it never saw the KV parameters): once a decode has
them, the prefill may free its blocks as soon as they are read. Every instance has a circuit breaker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from aiohttp import web

from pdctl import auth
from pdctl.protocol import (
    DECODE_SERVED_HEADER,
    FALLBACK_HEADER,
    FIRST_HEADER,
    FIRST_TOKEN_MISMATCH,
    HOLD_ROUTE,
    PREFILL_SERVED_HEADER,
    REJECT_HEADER,
    REMOTE_DECODE_PARAMS,
    ROUTE_HEADER,
)
from pdctl.proxy import first_token
from pdctl.proxy.admin import AdminRoutes, error_body
from pdctl.proxy.config import ProxyConfig, names
from pdctl.proxy.keys import KeyGuard
from pdctl.proxy.metrics import Metrics
from pdctl.proxy.routing import Instance, NoRoute, Router, affinity_key
from pdctl.proxy.upstream import ConnectFailed, FirstByteTimeout, Upstream, UpstreamError

log = logging.getLogger("pdctl.proxy")

PASS_HEADERS = ("Authorization",)
TIMINGS_KEPT = 4096


def instances(role: str, upstreams: list[str], weights: dict[str, float]) -> list[Instance]:
    """The role's instances named as the plan names them (prefill-p32-0: index within its pool)."""
    return [Instance(name, url, role, pool, weights.get(f"{role}/{pool}", 1.0))
            for name, pool, url in names(role, upstreams)]


def usable_kv_params(params: object) -> bool:
    return isinstance(params, dict) and bool(params.get("remote_block_ids")) and bool(
        params.get("remote_engine_id"))


class Proxy(AdminRoutes):
    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg  # validated as a whole by its model (pdctl.proxy.config)
        decodes = instances("decode", cfg.decode, cfg.weights)
        self.router = Router(instances("prefill", cfg.prefill, cfg.weights), decodes, cfg.policy,
                             cfg.exclude_pairs, cfg.affinity_epsilon, cfg.affinity_prefix_chars)
        for inst in self.router.instances:
            inst.breaker.threshold, inst.breaker.open_s = cfg.breaker_failures, cfg.breaker_open_s
        self.metrics = Metrics(lambda: self.router.instances)
        key = cfg.api_key
        if key is not None and not auth.is_token(key):
            raise ValueError("api_key: use printable ASCII without spaces (it goes into an HTTP header)")
        self._keys = KeyGuard(key)
        self._upstreams: dict[str, Upstream] = {}
        # The last requests' timestamps (GET /debug/timings): a few clock reads per request, always on.
        self.timings: deque[dict] = deque(maxlen=TIMINGS_KEPT)

    def upstream(self, inst: Instance) -> Upstream:
        up = self._upstreams.get(inst.url)
        if up is None:
            up = self._upstreams[inst.url] = Upstream(inst.url, self.cfg.connect_timeout_s, self.cfg.read_timeout_s,
                                                      self.cfg.first_byte_timeout_s)
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
        app.router.add_get("/debug/timings", self.timings_route)
        app.router.add_post(HOLD_ROUTE, self.hold_route)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        self._prober = asyncio.get_running_loop().create_task(self._probe_forever())

    async def _close(self, _app: web.Application) -> None:
        self._prober.cancel()
        for up in self._upstreams.values():
            up.close()

    async def models(self, req: web.Request) -> web.Response:
        if (refused := self._refused(req)) is not None:
            return refused
        decodes = [i for i in self.router.instances if i.role == "decode"]
        inst = next((i for i in decodes if i.healthy), decodes[0])
        try:
            async with await self.upstream(inst).request("GET", "/v1/models", headers=self._headers(req, "")) as r:
                return web.Response(status=r.status, body=await r.read(), content_type="application/json")
        except UpstreamError as e:
            return web.json_response(error_body(f"decode {inst.url} unreachable: {e}", code=503), status=503)

    def _refused(self, req: web.Request) -> web.Response | None:
        refused = self._keys.refusal(req)
        if refused is not None:
            self.metrics.reject("unauthorized")
        return refused

    # -- P/D -------------------------------------------------------------------------------------------------

    # Every /v1 route checks the key (like vLLM's middleware, which guards /v1 and leaves /health and /metrics
    # open); a check in the handler, not a middleware, costs nothing when auth is off.
    async def completions(self, req: web.Request) -> web.StreamResponse:
        if (refused := self._refused(req)) is not None:
            return refused
        return await self._pd(req, "/v1/completions")

    async def chat_completions(self, req: web.Request) -> web.StreamResponse:
        if (refused := self._refused(req)) is not None:
            return refused
        return await self._pd(req, "/v1/chat/completions")

    def _headers(self, req: web.Request, request_id: str) -> dict[str, str]:
        if self._keys.upstream_header is not None:
            h = {"Authorization": self._keys.upstream_header}
        else:
            h = {k: req.headers[k] for k in PASS_HEADERS if k in req.headers}
        if request_id:
            h["X-Request-Id"] = request_id
        for k, v in h.items():  # HTTP/1.1 header values are latin-1; refuse what cannot be passed on
            try:
                v.encode("latin-1")
            except UnicodeEncodeError:
                raise web.HTTPBadRequest(text=json.dumps(error_body(f"header {k}: not latin-1 text", "invalid_request",
                                                                    400)), content_type="application/json") from None
        return h

    async def _pd(self, req: web.Request, route: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        status = 500
        rt = _Route(stamps={"recv": time.time()})
        request_id = req.headers.get("X-Request-Id") or f"pdctl-{uuid.uuid4().hex}"
        try:
            resp = await self._pd_inner(req, route, t0, rt, request_id)
            status = resp.status
            if not resp.prepared:  # a streamed answer carried these from its first byte
                resp.headers.update(rt.headers())
            return resp
        finally:
            seconds = time.perf_counter() - t0
            p, d = rt.prefill, rt.decode
            first = rt.stamps.get("client_first")
            self.metrics.request_done(route, status, seconds, p.pool if p else None, d.pool if d else None,
                                      first - rt.stamps["recv"] if first else None)
            self.timings.append({"id": request_id, "status": status, "prefill": p.name if p else None,
                                 "decode": d.name if d else None, "fallback": rt.fallback, "first": rt.first,
                                 **rt.stamps,
                                 "end": time.time()})
            if self.cfg.access_log:
                log.info("%s %s %d %.1f ms prefill=%s decode=%s%s%s", request_id, route, status,
                         1e3 * seconds, p.name if p else "-", d.name if d else "-",
                         f" fallback={rt.fallback}" if rt.fallback else "", f" first={rt.first}" if rt.first else "")

    def _failed(self, inst: Instance, e: Exception | None = None) -> None:
        """Count a failed call on an instance: its breaker, and (nothing listening) its health at once."""
        self.metrics.upstream_error(inst.url)
        if isinstance(e, ConnectFailed):
            inst.healthy = False  # nothing listens there: route around it until a probe finds it back
            inst.refused = True
        if inst.breaker.failure(self.router.clock()):
            log.warning("%s %s: %d consecutive failures, circuit open for %g s", inst.name, inst.url,
                        inst.breaker.failures, inst.breaker.open_s)

    async def _pd_inner(self, req: web.Request, route: str, t0: float, rt: _Route,
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

        if router.aggregated:  # every request served whole by one instance: no prefill leg, nothing to fall back
            return await self._decode_leg(req, route, body, headers, key, pin, rt, None, "off")
        rt.reject = self.cfg.on_prefill_down == "reject" or req.headers.get(REJECT_HEADER, "").lower() == "reject"
        first = req.headers.get(FIRST_HEADER, "").lower() or self.cfg.first_token
        if first not in first_token.MODES:
            return web.json_response(error_body(f"{FIRST_HEADER}: {first!r} is none of on, off, auto",
                                                "invalid_request", 400), status=400)
        if first != "off" and first_token.ineligible(route, body):
            first = "off"
        pre = await self._prefill(route, body, headers, key, pin, rt)
        if isinstance(pre, web.Response):
            return pre
        resp = await self._decode_leg(req, route, body, headers, key, pin, rt, pre, first, t0)
        if not resp.get(KV_LOAD_FAILED):
            return resp
        # The decode could not use the KV it was handed (a failed read, or KV that was not the prefill's: its
        # fingerprint check). Nothing reached the client and a prefill only computes KV: once more, on another
        # pair where there is one; else an error naming the pair and the request, never an answer.
        pairs = [f"{rt.prefill.name} -> {rt.decode.name}"]
        failed_p, failed_d = rt.prefill, rt.decode
        other_p = self.router.pick_prefill(key, pin, exclude=[failed_p], usable_only=True)
        other_d = self.router.pick_decode((other_p or failed_p).pool, key, pin, exclude=[failed_d])
        if other_p is not None or other_d is not None:
            self.metrics.retries += 1
            log.warning("request %s: the KV load failed on %s; trying another pair", request_id, pairs[0])
            pre = await self._prefill(route, body, headers, key, pin, rt, avoid=[failed_p] if other_p else [])
            if isinstance(pre, web.Response):
                return pre
            resp = await self._decode_leg(req, route, body, headers, key, pin, rt, pre, first, t0,
                                          avoid=[failed_d] if other_d else [])
            if not resp.get(KV_LOAD_FAILED):
                return resp
            pairs.append(f"{rt.prefill.name} -> {rt.decode.name}")
        return web.json_response(error_body(
            f"request {request_id}: the decode could not use the prefill's KV on pair {' and then '.join(pairs)} "
            f"(a failed KV read, or KV that was not the prefill's: the decode's log names which); last: "
            f"{resp[KV_LOAD_FAILED]}", "kv_load_failed", resp.status), status=resp.status)

    async def _decode_leg(self, req: web.Request, route: str, body: dict, headers: dict[str, str], key: str | None,
                          pin: tuple[str, str] | None, rt: _Route, pre: dict | None, first: str,
                          t0: float | None = None, avoid: list[Instance] | None = None) -> web.StreamResponse:
        """The decode leg: with the prefill's KV parameters, or without (decode-only, or aggregated serving), on
        one decode and once more on another when the first never saw the request."""
        router = self.router
        dec_body = dict(body)
        if pre is not None:
            dec_body["kv_transfer_params"] = pre
        else:
            dec_body.pop("kv_transfer_params", None)  # decode-only: the decode computes the prompt itself
        if t0 is not None:
            self.metrics.prefill_done(time.perf_counter() - t0, rt.prefill.pool if rt.prefill else None)

        tried: list[Instance] = []
        out, text = None, None
        while True:
            d = router.pick_decode(rt.prefill.pool if rt.prefill else None, key, pin, exclude=tried + (avoid or []))
            if d is None:
                last = tried[-1]
                err = error_body(f"decode {last.url} unavailable and no other decode may serve this request",
                                 "upstream_unavailable", 503)
                if out is not None:  # the client has the prefill's token: the stream ends with the error
                    return await _end_stream(out, json.dumps(err).encode())
                return web.json_response(err, status=503)
            rt.decode = d
            tried.append(d)
            if pre is not None and out is None and first != "off":
                out, text = await self._first_out(req, route, rt, headers, first, busy=d.inflight > 0)
            d.inflight += 1
            try:
                resp = await self._decode(req, d, route, dec_body, headers, rt.headers(),
                                          retry_ok=len(tried) == 1, stamps=rt.stamps, out=out, first=text)
            finally:
                d.inflight -= 1
            if resp is not None:
                return resp
            # Nothing listened there: the decode never saw the request (nor its KV parameters); one more.

    async def _prefill(self, route: str, body: dict, headers: dict[str, str], key: str | None,
                       pin: tuple[str, str] | None, rt: _Route,
                       avoid: list[Instance] | None = None) -> dict | None | web.Response:
        """The prefill leg: the request's KV parameters, None for decode-only fallback, or the answer to send
        back (a client error, or a refusal under on_prefill_down: reject). Tried once more on another prefill
        when the first fails before answering (it is idempotent: a prefill only computes and holds KV)."""
        pre_body = dict(body)
        pre_body["max_tokens"] = 1
        if "max_completion_tokens" in pre_body:
            pre_body["max_completion_tokens"] = 1
        pre_body["stream"] = False
        for k in ("stream_options", "min_tokens"):
            pre_body.pop(k, None)
        pre_body["kv_transfer_params"] = dict(REMOTE_DECODE_PARAMS)
        wire = json.dumps(pre_body).encode()
        tried: list[Instance] = []
        errors: list[str] = []
        for attempt in range(2):
            p = self.router.pick_prefill(key, pin, exclude=tried + (avoid or []), usable_only=True)
            if p is None:
                break
            if attempt:
                self.metrics.retries += 1
                log.warning("request %s: prefill %s failed (%s); trying %s", headers.get("X-Request-Id"),
                            tried[-1].name, errors[-1], p.name)
            tried.append(p)
            rt.prefill = p
            p.inflight += 1
            rt.stamps["prefill_sent"] = time.time()
            try:
                async with await self.upstream(p).request("POST", route, wire, headers) as r:
                    raw = await r.read()
                rt.stamps["prefill_done"] = time.time()
            except UpstreamError as e:
                self._failed(p, e)
                errors.append(f"{p.name}: {e}")
                continue
            except BaseException:  # cancelled (the client went away): no verdict on the instance
                p.breaker.release()
                raise
            finally:
                p.inflight -= 1
            if 400 <= r.status < 500:
                # Client errors (e.g. prompt too long) go back as they are; the decode never sees them.
                p.breaker.success()
                return web.Response(status=r.status, body=raw, content_type="application/json")
            if r.status >= 500:
                self._failed(p)
                errors.append(f"{p.name}: HTTP {r.status}: {raw[:200].decode(errors='replace')}")
                continue
            try:
                pre = json.loads(raw)
            except ValueError:
                pre = None
            if not isinstance(pre, dict):
                self._failed(p)
                errors.append(f"{p.name}: answered no JSON object")
                continue
            p.breaker.success()
            kvp = pre.get("kv_transfer_params")
            if usable_kv_params(kvp):
                rt.answer = pre
                return kvp
            self.metrics.kv_missing += 1
            return self._no_prefill("no_kv_params", f"prefill {p.name} ({p.url}) returned no usable "
                                    "kv_transfer_params", rt, "kv_transfer_missing", 502)
        rt.prefill = None
        if not tried:
            why = "no prefill instance is healthy" + (f" in pool {pin[0]}" if pin else "")
            return self._no_prefill("prefill_down", why, rt, "prefill_unavailable", 503)
        return self._no_prefill("prefill_failed", "; ".join(errors), rt, "prefill_unavailable", 503)

    def _no_prefill(self, reason: str, why: str, rt: _Route, kind: str, code: int) -> None | web.Response:
        """on_prefill_down: reject -> the error answer; fallback -> None (the decode computes the prompt)."""
        if rt.reject:
            self.metrics.reject(reason)
            return web.json_response(error_body(f"{why}; refusing to let a decode compute the prompt "
                                                "(proxy.on_prefill_down: reject)", kind, code), status=code)
        self.metrics.fallback(reason)
        rt.fallback = reason
        log.warning("decode-only fallback (%s): %s", reason, why)
        return None

    async def _first_out(self, req: web.Request, route: str, rt: _Route, headers: dict[str, str], mode: str,
                         busy: bool) -> tuple[web.StreamResponse | None, str | None]:
        """first_token: the client's stream opened with the prefill's token (first_token.events), and
        that token's text, which the decode's stream must then begin with; (None, None): the decode's stream
        as it is (mode auto and the decode idle, or the prefill's answer not one complete token)."""
        text = first_token.token_text(route, rt.answer) if mode == "on" or busy else None
        if text is None:
            return None, None
        out = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            "X-Request-Id": headers["X-Request-Id"], **rt.headers(), FIRST_HEADER: "prefill"})
        await out.prepare(req)
        await out.write(first_token.events(route, rt.answer, text))
        rt.stamps["client_first"] = time.time()
        rt.first = "prefill"
        self.metrics.first_token[("from_prefill",)] += 1
        return out, text

    async def _decode(self, req: web.Request, d: Instance, route: str, body: dict, headers: dict[str, str],
                      route_headers: dict[str, str], retry_ok: bool, stamps: dict[str, float],
                      out: web.StreamResponse | None = None,
                      first: str | None = None) -> web.StreamResponse | None:
        """The decode's answer passed through; None when nothing listened and another decode may be tried.
        `out`: the client's stream, already opened with
        the prefill's token `first` (first_token): the decode's stream follows without it, and a decode
        that fails ends that stream with the error."""
        try:
            resp = await self._decode_answer(req, d, route, body, headers, route_headers, retry_ok, stamps,
                                             out, first)
        except BaseException:  # cancelled (the client went away): no verdict on the instance
            d.breaker.release()
            raise
        if out is not None and resp is not None and resp is not out:
            return await _end_stream(out, resp.body)
        return resp

    async def _decode_answer(self, req: web.Request, d: Instance, route: str, body: dict, headers: dict[str, str],
                             route_headers: dict[str, str], retry_ok: bool, stamps: dict[str, float],
                             out: web.StreamResponse | None = None,
                             first: str | None = None) -> web.StreamResponse | None:
        try:
            stamps["decode_sent"] = time.time()
            upstream = await self.upstream(d).request("POST", route, json.dumps(body).encode(), headers)
        except UpstreamError as e:
            self._failed(d, e)
            if isinstance(e, ConnectFailed) and retry_ok:
                return None
            timeout = isinstance(e, FirstByteTimeout)
            return web.json_response(error_body(f"decode {d.name} ({d.url}) {'timed out' if timeout else 'unavailable'}"
                                                f": {e!s}", "upstream_timeout" if timeout else
                                                "upstream_unavailable", 504 if timeout else 503),
                                     status=504 if timeout else 503)
        async with upstream:
            ctype = upstream.headers.get("content-type", "application/json")
            if not body.get("stream") or upstream.status >= 400:
                try:
                    raw = await upstream.read()
                except UpstreamError as e:
                    self._failed(d, e)
                    return web.json_response(error_body(f"decode {d.name} ({d.url}) failed: {e!s}"), status=502)
                stamps["decode_first"] = time.time()
                if out is None:
                    stamps["client_first"] = stamps["decode_first"]
                if upstream.status >= 500 and body.get("kv_transfer_params"):
                    # Most likely its KV read failed (a prefill gone): not the decode's fault, so no breaker.
                    return self._kv_load_failed(d, upstream.status, raw)
                if upstream.status >= 500:
                    self._failed(d)
                else:
                    d.breaker.success()
                return web.Response(status=upstream.status, body=raw, content_type=ctype.split(";")[0])
            # vLLM sends a stream's headers at once: the first-byte timeout applies to the first event.
            chunks = upstream.chunks(first_timeout=self.cfg.first_byte_timeout_s)
            try:
                head = await anext(chunks, b"")
            except UpstreamError as e:
                self._failed(d, e)
                timeout = isinstance(e, FirstByteTimeout)
                return web.json_response(error_body(f"decode {d.name} ({d.url}) {'timed out' if timeout else 'failed'}"
                                                    f": {e!s}", "upstream_timeout" if timeout else "proxy_error",
                                                    504 if timeout else 502), status=504 if timeout else 502)
            stamps["decode_first"] = time.time()
            if out is None and body.get("kv_transfer_params") and head.startswith(b"data: {\"error\""):
                # vLLM opened the stream, then ended the request before its first token: nothing reached the
                # client yet, so it gets an error status, not a 200 stream of nothing.
                d.breaker.release()
                return self._kv_load_failed(d, 500, head.removeprefix(b"data: ").split(b"\n", 1)[0])
            skip = None
            if out is None:
                out = web.StreamResponse(status=200, headers={"Content-Type": ctype, "Cache-Control": "no-cache",
                                                              "X-Request-Id": headers["X-Request-Id"],
                                                              **route_headers})
                await out.prepare(req)
            else:
                skip = first_token.Skip(route, first)
            try:
                await out.write(head if skip is None else skip.feed(head))
                if skip is None:
                    stamps["client_first"] = time.time()
                async for chunk in chunks:
                    if skip is not None and not skip.done:
                        chunk = skip.feed(chunk)
                    await out.write(chunk)
                d.breaker.success()
            except UpstreamError as e:
                # The client must see the stream end with an error, never a hang.
                self._failed(d, e)
                err = json.dumps(error_body(f"decode {d.name} ({d.url}) failed mid-stream: {e!s}"))
                await out.write(f"data: {err}\n\ndata: [DONE]\n\n".encode())
            except first_token.Mismatch as e:
                # The client has a token this decode did not produce: what follows would not be one answer.
                self.metrics.first_token[("mismatch",)] += 1
                d.breaker.release()  # no verdict on the decode: greedy near-ties differ across block sizes
                log.warning("request %s: first token from the prefill, but %s: stream ended", headers["X-Request-Id"],
                            e)
                err = error_body(f"decode {d.name} ({d.url}): {e} (first_token: the stream so far is not "
                                 "what the decode generated; retry with the header x-pdctl-first-token: off)",
                                 FIRST_TOKEN_MISMATCH, 502)
                await out.write(b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n")
            await out.write_eof()
            return out

    def _kv_load_failed(self, d: Instance, status: int, raw: bytes) -> web.Response:
        """The answer of a decode that ended a request it was handed KV parameters for, marked KV_LOAD_FAILED
        (what it said), which the request may be retried on."""
        self.metrics.upstream_error(d.url)
        body = _decode_failed(d, status, raw)
        resp = web.json_response(body, status=status)
        resp[KV_LOAD_FAILED] = body["error"]["message"]
        return resp


async def _end_stream(out: web.StreamResponse, error: bytes) -> web.StreamResponse:
    """End a stream the client already reads (it has the prefill's token) with an error event."""
    await out.write(b"data: " + error.strip() + b"\n\ndata: [DONE]\n\n")
    await out.write_eof()
    return out


def _decode_failed(d: Instance, status: int, raw: bytes) -> dict:
    """vLLM answers a request it ended (a failed KV load under kv_load_failure_policy: fail included) with a
    bare "Internal server error"; say what that can mean for a P/D request."""
    try:
        said = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        said = raw[:200].decode(errors="replace")
    return error_body(f"decode {d.name} ({d.url}) ended the request with HTTP {status} ({said}) after it was "
                      "handed the prefill's KV parameters; when its KV read fails and connector."
                      "kv_load_failure_policy is 'fail', this is how vLLM reports it (the decode's log then says "
                      "'Failing ... request(s) due to KV load failure')", "decode_failed", status)


KV_LOAD_FAILED = "pdctl_kv_load_failed"  # on a decode's error answer: it could not use the prefill's KV


@dataclass
class _Route:
    """Who served one request: the prefill (None for decode-only fallback), the decode, why it fell back."""

    prefill: Instance | None = None
    decode: Instance | None = None
    fallback: str | None = None
    reject: bool = False  # no decode-only fallback for this request (on_prefill_down, or its header)
    first: str | None = None  # first_token: "prefill" when the client's first token came from it
    answer: dict | None = field(default=None, repr=False)  # the prefill's answer (its one token)
    stamps: dict[str, float] = field(default_factory=dict)  # wall-clock times of its stages (/debug/timings)

    def headers(self) -> dict[str, str]:
        h = {}
        if self.prefill is not None or self.fallback:
            h[PREFILL_SERVED_HEADER] = self.prefill.name if self.prefill is not None else "none"
        if self.decode is not None:
            h[DECODE_SERVED_HEADER] = self.decode.name
        if self.fallback:
            h[FALLBACK_HEADER] = f"decode-only ({self.fallback})"
        return h


def serve(cfg: ProxyConfig) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = Proxy(cfg)
    log.info("pdctl proxy on %s:%d: %s; pairs %s; policy %s%s", cfg.host, cfg.port,
             ", ".join(f"{i.name} {i.url}" for i in proxy.router.instances),
             ", ".join(f"{p}/{d}" for p, d in proxy.router.pairs), cfg.policy,
             f", on_prefill_down {cfg.on_prefill_down}" + (", API key required on /v1" if cfg.api_key else ""))
    web.run_app(proxy.app(), host=cfg.host, port=cfg.port, print=None, access_log=None, handler_cancellation=True)
