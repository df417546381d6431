"""The P/D proxy against small local test backends (real HTTP on loopback), including fault injection."""

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from pdctl.proxy.config import ProxyConfig
from pdctl.proxy.server import Proxy
from tests.conftest import sample, wait_for

KVP = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1", "remote_block_ids": [1, 2],
       "remote_host": "127.0.0.1", "remote_port": 5600}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Loop:
    """An event loop in a thread, for servers the test talks to over real sockets."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners = []

    def serve(self, app: web.Application) -> str:
        port = free_port()

        async def start():
            runner = web.AppRunner(app, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            self.runners.append(runner)

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        return f"http://127.0.0.1:{port}"

    def close(self):
        async def stop():
            for r in reversed(self.runners):
                await r.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Backend:
    """A fake vLLM instance whose behaviour each test sets."""

    def __init__(self, role: str):
        self.role = role
        self.requests: list[tuple[dict, dict]] = []
        self.mode = "ok"  # ok | error500 | error400 | no_kvp | slow | cut_stream | slow_stream | error_event
        self.delay_s = 0.0  # before answering
        self.arrived: list[float] = []
        self.answered: list[float] = []
        self.healthy = True
        self.cancelled = asyncio.Event()
        self.model_headers: list[dict] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, req):
        self.model_headers.append(req.headers.copy())
        return web.json_response({"data": [{"id": "m"}]})

    async def health(self, _req):
        return web.json_response({}, status=200 if self.healthy else 503)

    async def completions(self, req: web.Request):
        body = await req.json()
        self.arrived.append(time.monotonic())
        self.requests.append((body, req.headers.copy()))  # case-insensitive
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.answered.append(time.monotonic())
        if self.mode == "error500":
            return web.json_response({"error": "boom"}, status=500)
        if self.mode == "error400":
            return web.json_response({"error": {"message": "prompt too long"}}, status=400)
        if self.mode == "slow":
            await asyncio.sleep(30)
        if self.role == "prefill":
            return web.json_response({"choices": [{"text": "x"}],
                                      "kv_transfer_params": None if self.mode == "no_kvp" else KVP})
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "hello"}], "echo_kvp": body.get("kv_transfer_params")})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        if self.mode == "error_event":  # vLLM ending a request before its first token (a failed KV load)
            await resp.write(b'data: {"error": {"message": "Internal server error", "code": 500}}\n\n'
                             b"data: [DONE]\n\n")
            return resp
        try:
            for i in range(5):
                await resp.write(f"data: {json.dumps({'i': i})}\n\n".encode())
                if self.mode == "cut_stream" and i == 1:
                    req.transport.close()  # the decode dies mid-stream
                    return resp
                await asyncio.sleep(0.5 if self.mode == "slow_stream" else 0)
            await resp.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return resp


@pytest.fixture
def pd():
    loop = Loop()
    prefill, decode = Backend("prefill"), Backend("decode")
    p_url, d_url = loop.serve(prefill.app()), loop.serve(decode.app())

    def make(decodes=(), **cfg):
        proxy = Proxy(ProxyConfig(prefill=[p_url], decode=[*decodes, d_url], **cfg))
        return proxy, loop.serve(proxy.app())

    proxy, url = make(read_timeout_s=2.0, connect_timeout_s=1.0)
    yield type("PD", (), {"prefill": prefill, "decode": decode, "proxy": proxy, "url": url, "make": make,
                          "loop": loop, "p_url": p_url, "d_url": d_url})
    loop.close()


def post(url: str, body: dict, headers: dict | None = None, timeout: float = 10):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json",
                                                                   **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def get(url: str, headers: dict | None = None):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


BODY = {"model": "m", "prompt": "hi", "max_tokens": 20, "min_tokens": 3, "stream_options": {"include_usage": True}}


def test_protocol_prefill_then_decode(pd):
    status, text, _ = post(pd.url + "/v1/completions", BODY, {"Authorization": "Bearer k", "X-Request-Id": "rid-1"})
    assert status == 200 and json.loads(text)["echo_kvp"] == KVP
    (pre, pre_h), = pd.prefill.requests
    (dec, dec_h), = pd.decode.requests
    assert pre["max_tokens"] == 1 and pre["stream"] is False
    assert "min_tokens" not in pre and "stream_options" not in pre
    assert pre["kv_transfer_params"]["do_remote_decode"] is True
    assert dec["max_tokens"] == 20 and dec["min_tokens"] == 3 and dec["stream_options"] == BODY["stream_options"]
    assert pre_h["X-Request-Id"] == dec_h["X-Request-Id"] == "rid-1"
    assert pre_h["Authorization"] == dec_h["Authorization"] == "Bearer k"


def test_request_id_generated_and_chat_max_completion_tokens(pd):
    status, _, _ = post(pd.url + "/v1/chat/completions", {"model": "m", "messages": [], "max_completion_tokens": 9})
    assert status == 200
    (pre, pre_h), = pd.prefill.requests
    (dec, dec_h), = pd.decode.requests
    assert pre["max_completion_tokens"] == 1 and dec["max_completion_tokens"] == 9
    assert pre_h["X-Request-Id"].startswith("pdctl-") and pre_h["X-Request-Id"] == dec_h["X-Request-Id"]


def test_streaming_passes_sse_through(pd):
    status, text, headers = post(pd.url + "/v1/completions", {**BODY, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert [ln for ln in text.split("\n\n") if ln][-1] == "data: [DONE]" and text.count("data: {") == 5


def test_decode_dies_mid_stream_ends_with_error_event(pd):
    pd.decode.mode = "cut_stream"
    t0 = time.monotonic()
    status, text, _ = post(pd.url + "/v1/completions", {**BODY, "stream": True})
    assert status == 200 and time.monotonic() - t0 < 5
    assert '"i": 0' in text and "failed mid-stream" in text and text.rstrip().endswith("data: [DONE]")
    assert "pdctl_proxy_upstream_errors_total" in get(pd.url + "/metrics")[1]


def test_decode_500_is_passed_and_counted(pd):
    pd.decode.mode = "error500"
    status, text, _ = post(pd.url + "/v1/completions", BODY, {"X-Request-Id": "rid-9"})
    assert status == 500
    err = json.loads(text)["error"]
    assert err["type"] == "kv_load_failed" and "kv_load_failure_policy" in err["message"]
    assert "request rid-9" in err["message"] and "pair prefill-0 -> decode-0" in err["message"]  # no other pair
    metrics = get(pd.url + "/metrics")[1]
    assert sample(metrics, "pdctl_proxy_upstream_errors_total", instance=pd.d_url) == 1
    assert sample(metrics, "pdctl_proxy_requests_total", route="/v1/completions", status="500") == 1


def test_a_kv_load_the_decode_failed_is_retried_once_on_another_pair_never_answered_200(pd):
    second = Backend("decode")
    d2 = pd.loop.serve(second.app())
    pd.decode.mode = "error500"  # as vLLM answers a request whose KV load failed (policy fail)
    proxy = Proxy(ProxyConfig(prefill=[pd.p_url], decode=[pd.d_url, d2], policy="round_robin",
                              health_interval_s=60))
    url = pd.loop.serve(proxy.app())
    proxy.router._rr["decode"] = iter(range(0, 100, 2))  # the first pick is the failing one
    status, text, h = post(url + "/v1/completions", BODY)
    assert status == 200 and h["x-pdctl-decode"] == "decode-1" and json.loads(text)["echo_kvp"] == KVP
    assert len(pd.prefill.requests) == 2 and len(pd.decode.requests) == len(second.requests) == 1
    second.mode = "error500"  # both fail: an error naming both pairs and the request
    status, text, _ = post(url + "/v1/completions", BODY, {"X-Request-Id": "rid-2"})
    err = json.loads(text)["error"]
    assert status == 500 and err["type"] == "kv_load_failed" and "request rid-2" in err["message"]
    assert "prefill-0 -> decode-0 and then prefill-0 -> decode-1" in err["message"] or \
        "prefill-0 -> decode-1 and then prefill-0 -> decode-0" in err["message"]


def test_a_stream_the_decode_ends_before_its_first_token_is_an_error_status_not_200(pd):
    pd.decode.mode = "error_event"
    status, text, _ = post(pd.url + "/v1/completions", {**BODY, "stream": True})
    err = json.loads(text)["error"]
    assert status == 500 and err["type"] == "kv_load_failed" and "Internal server error" in err["message"]


def test_prefill_4xx_goes_back_to_the_client_and_skips_decode(pd):
    pd.prefill.mode = "error400"
    status, text, _ = post(pd.url + "/v1/completions", BODY)
    assert status == 400 and "prompt too long" in text and not pd.decode.requests


def test_prefill_unreachable_falls_back_to_decode_only_and_counts(pd):
    proxy = Proxy(ProxyConfig(prefill=[f"http://127.0.0.1:{free_port()}"], decode=[pd.d_url], connect_timeout_s=1))
    url = pd.loop.serve(proxy.app())
    status, text, h = post(url + "/v1/completions", BODY)
    assert status == 200 and h["x-pdctl-fallback"].startswith("decode-only") and h["x-pdctl-prefill"] == "none"
    (dec, _), = pd.decode.requests
    assert "kv_transfer_params" not in dec  # a plain request: the decode computes the prompt itself
    # Tried and refused (prefill_failed), or already known down from the first health probe (prefill_down).
    assert _counted(get(url + "/metrics")[1], "pdctl_decode_only_fallback_total") == 1
    assert post(url + "/v1/completions", BODY)[0] == 200
    metrics = get(url + "/metrics")[1]
    assert _counted(metrics, "pdctl_decode_only_fallback_total") == 2
    assert sample(metrics, "pdctl_decode_only_fallback_total", reason="prefill_down") >= 1  # known down by now


def _counted(metrics: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines() if ln.startswith(name + "{"))


def test_prefill_unreachable_is_503_at_once_when_rejecting(pd):
    proxy = Proxy(ProxyConfig(prefill=[f"http://127.0.0.1:{free_port()}"], decode=[pd.d_url], connect_timeout_s=1,
                              on_prefill_down="reject"))
    url = pd.loop.serve(proxy.app())
    t0 = time.monotonic()
    status, text, _ = post(url + "/v1/completions", BODY)
    assert status == 503 and json.loads(text)["error"]["type"] == "prefill_unavailable"
    assert "on_prefill_down: reject" in json.loads(text)["error"]["message"]
    assert time.monotonic() - t0 < 2 and not pd.decode.requests
    metrics = get(url + "/metrics")[1]
    assert _counted(metrics, "pdctl_proxy_rejected_total") == 1
    assert _counted(metrics, "pdctl_decode_only_fallback_total") == 0


def test_slow_prefill_times_out_at_the_first_byte_then_falls_back(pd):
    pd.prefill.mode = "slow"
    _, url = pd.make(first_byte_timeout_s=1.0, read_timeout_s=30.0)
    t0 = time.monotonic()
    status, text, h = post(url + "/v1/completions", BODY, timeout=20)
    assert time.monotonic() - t0 < 5  # first-byte timeout 1 s, not the 30 s between bytes
    assert status == 200 and "decode-only" in h["x-pdctl-fallback"]


def test_slow_prefill_rejected_names_the_timeout(pd):
    pd.prefill.mode = "slow"
    _, url = pd.make(first_byte_timeout_s=1.0, on_prefill_down="reject")
    status, text, _ = post(url + "/v1/completions", BODY, timeout=20)
    assert status == 503 and "first-byte timeout (1 s)" in json.loads(text)["error"]["message"]


def test_prefill_retried_once_on_another_prefill(pd):
    second = Backend("prefill")
    p2 = pd.loop.serve(second.app())
    for failure in ("error500", "refused"):
        first = f"http://127.0.0.1:{free_port()}" if failure == "refused" else pd.p_url
        pd.prefill.mode = failure if failure != "refused" else "ok"
        proxy = Proxy(ProxyConfig(prefill=[first, p2], decode=[pd.d_url], policy="round_robin", connect_timeout_s=1,
                                  health_interval_s=60))
        url = pd.loop.serve(proxy.app())
        time.sleep(0.3)
        proxy.router.instances[0].healthy = True  # as if the first probe found it: the request learns otherwise
        proxy.router._rr["prefill"] = iter(range(0, 100, 2))  # the first pick is the failing one
        n = len(second.requests)
        status, text, h = post(url + "/v1/completions", BODY)
        assert status == 200 and h["x-pdctl-prefill"] == "prefill-1" and "x-pdctl-fallback" not in h, failure
        assert len(second.requests) == n + 1 and json.loads(text)["echo_kvp"] == KVP
        assert sample(get(url + "/metrics")[1], "pdctl_proxy_prefill_retries_total") == 1


def test_prefill_client_error_is_not_retried(pd):
    second = Backend("prefill")
    p2 = pd.loop.serve(second.app())
    pd.prefill.mode = second.mode = "error400"
    proxy = Proxy(ProxyConfig(prefill=[pd.p_url, p2], decode=[pd.d_url]))
    url = pd.loop.serve(proxy.app())
    assert post(url + "/v1/completions", BODY)[0] == 400
    assert len(pd.prefill.requests) + len(second.requests) == 1 and not pd.decode.requests


def test_missing_kv_transfer_params_fallback_counts_and_warns(pd, caplog):
    pd.prefill.mode = "no_kvp"
    status, _, h = post(pd.url + "/v1/completions", BODY)
    assert status == 200 and h["x-pdctl-fallback"] == "decode-only (no_kv_params)"
    metrics = get(pd.url + "/metrics")[1]
    assert sample(metrics, "pdctl_proxy_kv_transfer_missing_total") == 1
    assert sample(metrics, "pdctl_decode_only_fallback_total", reason="no_kv_params") == 1
    assert any("no usable kv_transfer_params" in r.getMessage() and pd.p_url in r.getMessage()
               for r in caplog.records)


def test_missing_kv_transfer_params_rejected_is_502(pd):
    pd.prefill.mode = "no_kvp"
    _, url = pd.make(on_prefill_down="reject")
    status, text, _ = post(url + "/v1/completions", BODY)
    assert status == 502 and json.loads(text)["error"]["type"] == "kv_transfer_missing"
    assert not pd.decode.requests


def test_circuit_breaker_opens_then_lets_one_trial_through(pd):
    second = Backend("prefill")
    p2 = pd.loop.serve(second.app())
    pd.prefill.mode = "error500"
    proxy = Proxy(ProxyConfig(prefill=[pd.p_url, p2], decode=[pd.d_url], policy="round_robin", breaker_failures=2,
                              breaker_open_s=1.0, health_interval_s=60))
    # The breakers' clock stands still but for the test moving it: no wait, and the breaker stays open however
    # long the requests below take on a busy machine.
    now = [proxy.router.clock()]
    proxy.router.clock = lambda: now[0]
    url = pd.loop.serve(proxy.app())
    for _ in range(8):
        assert post(url + "/v1/completions", BODY)[0] == 200  # retried on the second prefill: no client error
    # Two failures opened it; afterwards nothing more is sent to it while it is open.
    assert len(pd.prefill.requests) == 2
    metrics = get(url + "/metrics")[1]
    who = {"role": "prefill", "pool": "default", "name": "prefill-0"}
    assert sample(metrics, "pdctl_proxy_breaker_open", **who) == 1
    assert sample(metrics, "pdctl_proxy_breaker_trips_total", **who) == 1
    now[0] += 1.2  # past breaker_open_s
    pd.prefill.mode = "ok"  # recovered: the half-open trial succeeds and closes the breaker
    for _ in range(4):
        assert post(url + "/v1/completions", BODY)[0] == 200
    assert len(pd.prefill.requests) >= 3
    assert sample(get(url + "/metrics")[1], "pdctl_proxy_breaker_open", **who) == 0


def test_decode_refusing_connections_is_retried_on_another_decode(pd):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy, url = pd.make(decodes=[dead], policy="round_robin", health_interval_s=60)
    proxy.router._rr["decode"] = iter(range(0, 100, 2))  # the dead one first
    status, text, h = post(url + "/v1/completions", BODY)
    assert status == 200 and h["x-pdctl-decode"] == "decode-1" and json.loads(text)["echo_kvp"] == KVP


def test_decode_first_byte_timeout_is_504_openai_error(pd):
    pd.decode.mode = "slow"
    _, url = pd.make(first_byte_timeout_s=1.0)
    status, text, _ = post(url + "/v1/completions", BODY, timeout=20)
    err = json.loads(text)["error"]
    assert status == 504 and err["type"] == "upstream_timeout" and err["code"] == 504 and "decode-0" in err["message"]


def test_stream_stalled_between_bytes_ends_with_error_event(pd):
    pd.decode.mode = "slow_stream"  # 0.5 s between events
    _, url = pd.make(read_timeout_s=0.2)
    t0 = time.monotonic()
    status, text, _ = post(url + "/v1/completions", {**BODY, "stream": True})
    assert status == 200 and time.monotonic() - t0 < 3
    assert "between bytes" in text and text.rstrip().endswith("data: [DONE]")


def test_client_disconnect_cancels_upstream(pd):
    pd.decode.mode = "slow_stream"
    sock = socket.create_connection(("127.0.0.1", int(pd.url.rsplit(":", 1)[1])))
    body = json.dumps({**BODY, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    sock.settimeout(5)
    got = b""
    while b"data:" not in got:
        got += sock.recv(4096)
    sock.close()
    fut = asyncio.run_coroutine_threadsafe(asyncio.wait_for(pd.decode.cancelled.wait(), 5), pd.loop.loop)
    fut.result(6)  # the decode's handler saw the cancellation


def test_ready_needs_a_prefill_and_a_decode(pd):
    assert get(pd.url + "/ready")[0] == 200 and get(pd.url + "/health")[0] == 200
    pd.decode.healthy = False
    status, text = get(pd.url + "/ready")
    got = json.loads(text)
    assert status == 503 and got["ready"] is False and got["pairs"] == {"default/default": False}
    # Each instance as structured JSON, not a "role url" key.
    assert got["instances"] == [
        {"name": "prefill-0", "role": "prefill", "pool": "default", "url": pd.p_url, "healthy": True, "held": False},
        {"name": "decode-0", "role": "decode", "pool": "default", "url": pd.d_url, "healthy": False, "held": False}]


def test_a_held_decode_gets_no_request_until_released_and_ready_says_so(pd):
    second = Backend("decode")
    proxy, url = pd.make(decodes=[pd.loop.serve(second.app())])
    status, text, _ = post(url + "/pdctl/hold", {"instance": "decode-0", "held": True})
    assert status == 200 and json.loads(text) == {"instance": "decode-0", "held": True}
    for _ in range(6):
        assert post(url + "/v1/completions", BODY)[0] == 200
    assert len(second.requests) == 0 and len(pd.decode.requests) == 6  # decode-0 is `second`, held
    got = json.loads(get(url + "/ready")[1])
    assert [i["held"] for i in got["instances"]] == [False, True, False]
    assert post(url + "/pdctl/hold", {"instance": "decode-0", "held": False})[0] == 200
    for _ in range(6):
        assert post(url + "/v1/completions", BODY)[0] == 200
    assert len(second.requests) > 0  # the negative control: released, it serves again


def test_a_held_only_prefill_is_not_used_while_the_decode_can_serve_alone(pd):
    assert post(pd.url + "/pdctl/hold", {"instance": "prefill-0", "held": True})[0] == 200
    status, _, h = post(pd.url + "/v1/completions", BODY)
    assert status == 200 and pd.prefill.requests == [] and h.get("x-pdctl-fallback")
    got = json.loads(get(pd.url + "/ready")[1])
    assert got["ready"] is False and got["pairs"] == {"default/default": False}


@pytest.mark.parametrize("body,code,said", [({"instance": "decode-9", "held": True}, 404, "no instance 'decode-9'"),
                                            ({"instance": "decode-0", "held": "yes"}, 400, "expected"),
                                            ([1], 400, "expected")])
def test_hold_refuses_what_it_cannot_do(pd, body, code, said):
    status, text, _ = post(pd.url + "/pdctl/hold", body)
    assert status == code and said in json.loads(text)["error"]["message"]


def test_hold_needs_the_api_key(pd):
    _, url = pd.make(api_key="s3cret-key")
    assert post(url + "/pdctl/hold", {"instance": "decode-0", "held": True})[0] == 401
    status, _, _ = post(url + "/pdctl/hold", {"instance": "decode-0", "held": True},
                        {"Authorization": "Bearer s3cret-key"})
    assert status == 200


def test_models_route(pd):
    assert json.loads(get(pd.url + "/v1/models")[1])["data"][0]["id"] == "m"


def test_bad_body_is_400(pd):
    req = urllib.request.Request(pd.url + "/v1/completions", b"not json", {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 400


def test_unhealthy_instances_get_no_traffic_and_come_back(pd):
    # Two decodes; one stops answering /health (a lost node): after a probe every request goes to the other.
    second = Backend("decode")
    d2 = pd.loop.serve(second.app())
    proxy, url = pd.make(decodes=[d2], health_interval_s=0.2)
    seen = next(i for i in proxy.router.instances if i.url == d2)  # the proxy's view of the second decode
    second.healthy = False
    assert wait_for(lambda: not seen.healthy, 5, interval=0.02)  # a probe saw it fail
    for _ in range(6):
        assert post(url + "/v1/completions", BODY)[0] == 200
    assert len(pd.decode.requests) == 6 and not second.requests
    second.healthy = True
    assert wait_for(lambda: seen.healthy, 5, interval=0.02)
    for _ in range(6):
        assert post(url + "/v1/completions", BODY)[0] == 200
    assert second.requests  # probed healthy again: back in the rotation


def test_connection_refused_marks_an_instance_down_at_once(pd):
    dead = f"http://127.0.0.1:{free_port()}"
    proxy, url = pd.make(decodes=[dead], health_interval_s=60)  # no probe in this test's lifetime after the first
    time.sleep(0.3)
    proxy.router.instances[1].healthy = True  # as if the first probe found it: the first request learns it is gone
    codes = [post(url + "/v1/completions", BODY)[0] for _ in range(4)]
    assert codes.count(503) <= 1 and codes[-3:] == [200, 200, 200]


def test_pools_pins_route_headers_and_pair_metrics(pd):
    """Two decode pools behind one endpoint: x-pdctl-route pins the pair, the answer names the instances, the
    proxy counts per pair, and a pin the topology excludes (or never had) is a 400 that reaches no server."""
    second = Backend("decode")
    d2 = pd.loop.serve(second.app())
    proxy, url = pd.make(decodes=[f"d32={d2}"], exclude_pairs=[])
    status, _, h = post(url + "/v1/completions", BODY, {"x-pdctl-route": "default/d32"})
    assert status == 200 and h["x-pdctl-prefill"] == "prefill-0" and h["x-pdctl-decode"] == "decode-d32-0"
    assert len(second.requests) == 1 and not pd.decode.requests
    status, _, h = post(url + "/v1/completions", BODY, {"x-pdctl-route": "default/default"})
    assert status == 200 and h["x-pdctl-decode"] == "decode-0" and len(pd.decode.requests) == 1
    for bad in ("default/d99", "nonsense", "p9/d32"):
        status, text, _ = post(url + "/v1/completions", BODY, {"x-pdctl-route": bad})
        assert status == 400 and "pairs: default/d32, default/default" in text, text
    assert len(pd.prefill.requests) == 2  # the bad pins reached nobody
    metrics = get(url + "/metrics")[1]
    assert sample(metrics, "pdctl_proxy_pair_requests_total", prefill_pool="default", decode_pool="d32",
                  status="200") == 1
    assert 'name="decode-d32-0"' in metrics
    excluded = Proxy(ProxyConfig(prefill=[pd.p_url, f"p2={pd.p_url}"], decode=[f"d32={d2}", pd.d_url],
                                 exclude_pairs=[("default", "d32")]))
    xurl = pd.loop.serve(excluded.app())
    status, text, _ = post(xurl + "/v1/completions", BODY, {"x-pdctl-route": "default/d32"})
    assert status == 400 and "excluded" in text
    answers = [post(xurl + "/v1/completions", BODY)[2] for _ in range(12)]
    seen = {(h["x-pdctl-prefill"], h["x-pdctl-decode"]) for h in answers}
    assert ("prefill-0", "decode-d32-0") not in seen and len(seen) >= 2, seen
    assert post(xurl + "/v1/completions", BODY, {"x-pdctl-route": "p2/d32"})[2]["x-pdctl-decode"] == "decode-d32-0"


def test_metrics_format_and_histograms(pd):
    post(pd.url + "/v1/completions", BODY)
    text = get(pd.url + "/metrics")[1]
    from pdctl.launch.probe import parse_metrics

    m = parse_metrics(text)
    assert m['pdctl_proxy_requests_total{route="/v1/completions",status="200"}'] == 1
    assert m["pdctl_proxy_request_duration_seconds_count"] == 1 and m["pdctl_proxy_prefill_seconds_count"] == 1
    assert sample(text, "pdctl_proxy_inflight", role="decode", pool="default", name="decode-0", instance=pd.d_url) == 0
    # Per pair: TTFT and the whole request as histograms; the prefill leg per prefill pool.
    assert sample(text, "pdctl_proxy_ttft_seconds_count", prefill_pool="default", decode_pool="default") == 1
    assert sample(text, "pdctl_proxy_request_duration_seconds_count", prefill_pool="default",
                  decode_pool="default", route="/v1/completions") == 1
    assert sample(text, "pdctl_proxy_prefill_seconds_count", prefill_pool="default") == 1
    assert sample(text, "pdctl_proxy_ttft_seconds_sum", prefill_pool="default", decode_pool="default") <= sample(
        text, "pdctl_proxy_request_duration_seconds_sum", prefill_pool="default", decode_pool="default",
        route="/v1/completions")


# -- the upstream client -------------------------------------------------------------------------------------


def test_upstream_connections_are_kept_alive(pd):
    peers = []
    orig = pd.prefill.completions

    async def record(req):
        peers.append(req.transport.get_extra_info("peername"))
        return await orig(req)

    pd.prefill.completions = record
    app = pd.prefill.app()
    p_url = pd.loop.serve(app)
    proxy = Proxy(ProxyConfig(prefill=[p_url], decode=[pd.d_url]))
    url = pd.loop.serve(proxy.app())
    for _ in range(5):
        assert post(url + "/v1/completions", BODY)[0] == 200
    assert len(peers) == 5 and len(set(peers)) == 1  # one connection, reused


OK_JSON = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: application/json\r\n\r\n{}"


async def _server_and_upstream(handle):
    """A raw asyncio server running `handle`, and pdctl's Upstream to it."""
    from pdctl.proxy.upstream import Upstream

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, Upstream(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", 1.0, 2.0)


def test_upstream_retries_a_keep_alive_connection_the_server_closed_unanswered():
    """A server may close an idle keep-alive connection just as a request is sent on it: the request was never
    seen, so it goes again on a new connection instead of failing."""

    answered = []

    async def main():
        async def handle(reader, writer):
            n = 0
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                n += 1
                if n == 2:  # the second request on a connection: close it unanswered
                    writer.close()
                    return
                answered.append(writer.get_extra_info("peername"))
                writer.write(OK_JSON)
                await writer.drain()

        server, up = await _server_and_upstream(handle)
        bodies = []
        for _ in range(2):
            async with await up.request("POST", "/v1/completions", b"{}") as r:
                bodies.append((r.status, await r.read()))
        up.close()
        server.close()
        return bodies

    assert asyncio.run(main()) == [(200, b"{}"), (200, b"{}")]
    assert len(answered) == 2 and answered[0] != answered[1]  # the second answer came on a new connection


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_upstream_does_not_write_on_a_pooled_connection_whose_server_died(loop_kind):
    """A server killed between two requests: its pooled connection's transport is closing (or closed before
    connection_lost ran). uvloop raised RuntimeError on write (the proxy answered 500, seen in a fault drill);
    the request must go on a new connection instead, and a closed fresh connection is a ConnectFailed."""
    from pdctl.proxy.upstream import ConnectFailed

    async def main():
        async def handle(reader, writer):
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                await reader.readexactly(int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
                writer.write(OK_JSON)
                await writer.drain()

        server, up = await _server_and_upstream(handle)
        got = []
        async with await up.request("POST", "/v1/completions", b"{}") as r:
            got.append((r.status, await r.read()))
        (pooled,) = up._idle
        pooled.transport.close()  # closing; connection_lost not yet delivered
        async with await up.request("POST", "/v1/completions", b"{}") as r:
            got.append((r.status, await r.read()))
        if loop_kind == "uvloop":
            # A fresh connection whose write fails (closed under us) is a ConnectFailed, not a RuntimeError.
            up.close()
            orig = up._connect

            class Dead:  # what uvloop's transport does once its handle is closed
                def write(self, _data):
                    raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

                def close(self):
                    pass

            async def closed_at_once():
                conn = await orig()
                conn.transport.close()
                conn.transport = Dead()
                return conn

            up._connect = closed_at_once
            with pytest.raises(ConnectFailed):
                await up.request("POST", "/v1/completions", b"{}")
        server.close()
        return got

    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        result = uvloop.run(main())
    else:
        result = asyncio.run(main())
    assert result == [(200, b"{}"), (200, b"{}")]


def test_upstream_read_timeout_and_refused_connection():
    from pdctl.proxy.upstream import ConnectFailed, ReadTimeout, Upstream

    async def main():
        async def silent(reader, writer):
            await asyncio.sleep(5)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ReadTimeout):
            await Upstream(f"http://127.0.0.1:{port}", 1.0, 0.3).request("POST", "/x", b"{}")
        assert time.monotonic() - t0 < 2
        server.close()
        with pytest.raises(ConnectFailed):
            await Upstream(f"http://127.0.0.1:{free_port()}", 1.0, 1.0).request("GET", "/health")

    asyncio.run(main())


def test_non_latin1_header_is_a_400_and_trips_nothing(pd):
    import http.client

    host, port = pd.url.removeprefix("http://").split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    body = json.dumps(BODY).encode()
    c.putrequest("POST", "/v1/completions")
    c.putheader("Content-Type", "application/json")
    c.putheader("Content-Length", str(len(body)))
    c.putheader("X-Request-Id", "caf\u00e9-\u65e5".encode())  # UTF-8 bytes: not latin-1 text
    c.endheaders(body)
    r = c.getresponse()
    assert r.status == 400 and "latin-1" in r.read().decode()
    assert not pd.prefill.requests and pd.proxy.router.instances[0].breaker.failures == 0


def test_stream_whose_first_event_never_comes_is_a_504(pd):
    pd.decode.mode = "slow"  # headers only after 30 s: as vLLM, which sends a stream's headers at once, then waits
    _, url = pd.make(first_byte_timeout_s=1.0, read_timeout_s=60.0)
    t0 = time.monotonic()
    status, text, _ = post(url + "/v1/completions", {**BODY, "stream": True}, timeout=20)
    assert status == 504 and time.monotonic() - t0 < 5 and json.loads(text)["error"]["type"] == "upstream_timeout"


def test_a_cancelled_half_open_trial_does_not_keep_the_instance_out(pd):
    import socket as sk

    pd.prefill.mode = "error500"
    proxy, url = pd.make(breaker_failures=1, breaker_open_s=0.3, health_interval_s=60)
    real = proxy.router.clock
    post(url + "/v1/completions", BODY)  # one failure: open
    proxy.router.clock = lambda: real() + 0.4  # the breakers' clock past breaker_open_s, instead of a wait
    pd.prefill.mode = "slow"
    port = int(url.rsplit(":", 1)[1])
    s = sk.create_connection(("127.0.0.1", port))
    body = json.dumps(BODY).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    assert wait_for(lambda: len(pd.prefill.requests) == 2, 5)  # the half-open trial is at the prefill
    s.close()  # the client goes away mid-trial
    pd.prefill.mode = "ok"
    assert wait_for(lambda: not proxy.router.instances[0].breaker.trial, 5)
    status, _, h = post(url + "/v1/completions", BODY)
    assert status == 200 and h["x-pdctl-prefill"] == "prefill-0"



def test_a_request_may_forbid_the_fallback_with_its_header(pd):
    proxy = Proxy(ProxyConfig(prefill=[f"http://127.0.0.1:{free_port()}"], decode=[pd.d_url], connect_timeout_s=1))
    url = pd.loop.serve(proxy.app())
    status, text, _ = post(url + "/v1/completions", BODY, {"x-pdctl-on-prefill-down": "reject"})
    assert status == 503 and json.loads(text)["error"]["type"] == "prefill_unavailable" and not pd.decode.requests
    assert post(url + "/v1/completions", BODY)[0] == 200  # others still fall back


def test_debug_timings_stamp_every_stage_in_order(pd):
    t0 = time.time()
    assert post(pd.url + "/v1/completions", {**BODY, "stream": True}, {"X-Request-Id": "rid-t1"})[0] == 200
    assert post(pd.url + "/v1/completions", BODY, {"X-Request-Id": "rid-t2"})[0] == 200
    status, text = get(pd.url + f"/debug/timings?since={t0}")
    recs = {r["id"]: r for r in json.loads(text)}
    assert status == 200 and set(recs) == {"rid-t1", "rid-t2"}
    order = ["recv", "prefill_sent", "prefill_done", "decode_sent", "decode_first", "client_first", "end"]
    for r in recs.values():
        assert [r[k] for k in order] == sorted(r[k] for k in order) and r["recv"] >= t0
        assert r["status"] == 200 and r["decode"] and r["prefill"]
    assert json.loads(get(pd.url + f"/debug/timings?since={time.time()}")[1]) == []
    assert get(pd.url + "/debug/timings?since=soon")[0] == 400


def test_histograms_count_each_observation_in_its_le_bucket():
    from pdctl.proxy.metrics import Metrics

    m = Metrics()
    for v in (0.005, 0.0051, 0.3, 100.0):  # on a bound, just past one, mid-range, past the last finite bound
        m.prefill_done(v, "p32")
    text = m.render().decode()

    def le(bound: str) -> float:
        return sample(text, "pdctl_proxy_prefill_seconds_bucket", prefill_pool="p32", le=bound)

    assert (le("0.005"), le("0.01"), le("0.25"), le("0.5"), le("60.0"), le("+Inf")) == (1, 2, 2, 3, 3, 4)
    assert sample(text, "pdctl_proxy_prefill_seconds_count", prefill_pool="p32") == 4
    assert sample(text, "pdctl_proxy_prefill_seconds_sum", prefill_pool="p32") == pytest.approx(100.3101)


# -- API keys ------------------------------------------------------------------------------------------------


def test_api_key_refuses_requests_without_it_in_openais_shape_and_sends_its_own_upstream(pd):
    _, url = pd.make(api_key="s3cret-key")
    for headers, said in (({}, "missing API key"), ({"Authorization": "Bearer wrong"}, "incorrect API key"),
                          ({"Authorization": "Basic s3cret-key"}, "incorrect API key"),
                          ({"Authorization": "Bearer s3cret-key2"}, "incorrect API key"),
                          ({"Authorization": "Bearer  s3cret-key"}, "incorrect API key")):
        for route in ("/v1/completions", "/v1/chat/completions"):
            status, text, h = post(url + route, BODY, headers)
            assert status == 401 and h["WWW-Authenticate"] == "Bearer", (headers, text)
            err = json.loads(text)["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            assert err["param"] is None and err["message"].startswith(said) and "s3cret" not in text
    assert pd.prefill.requests == [] and pd.decode.requests == []  # nothing refused reached an instance
    assert get(url + "/v1/models")[0] == 401 and pd.decode.model_headers == []
    # The client's key is checked, then replaced by the proxy's own (a lower-case scheme passes, as at vLLM).
    status, text, _ = post(url + "/v1/completions", BODY, {"authorization": "bearer s3cret-key"})
    assert status == 200, text
    assert [h["Authorization"] for _, h in pd.prefill.requests + pd.decode.requests] == ["Bearer s3cret-key"] * 2
    status, _ = get(url + "/v1/models", {"Authorization": "Bearer s3cret-key"})
    assert status == 200 and pd.decode.model_headers[-1]["Authorization"] == "Bearer s3cret-key"
    # /health, /ready and /metrics stay open (vLLM guards /v1 only); refusals are counted.
    assert get(url + "/health")[0] == 200 and get(url + "/ready")[0] == 200
    metrics = get(url + "/metrics")[1]
    assert sample(metrics, "pdctl_proxy_rejected_total", reason="unauthorized") == 11


def test_without_a_key_the_proxy_asks_for_none(pd):
    """The negative control: auth off, a request with no key is served and a client's header passes on."""
    assert post(pd.url + "/v1/completions", BODY)[0] == 200
    assert "Authorization" not in pd.decode.requests[-1][1]
    assert get(pd.url + "/v1/models")[0] == 200


def test_a_key_that_cannot_be_a_header_is_refused_at_start_and_never_shown():
    for bad in ("two words", "caf\u00e9", ""):  # an empty key would be auth silently off: refused too
        with pytest.raises(ValueError, match="printable ASCII"):
            Proxy(ProxyConfig(prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:2"], api_key=bad))
    assert "hunter2" not in repr(ProxyConfig(decode=["http://127.0.0.1:2"], api_key="hunter2"))


def test_the_decode_is_asked_after_the_prefill_answers(pd):
    pd.prefill.delay_s = 0.3
    assert post(pd.url + "/v1/completions", BODY)[0] == 200
    assert pd.decode.arrived[0] >= pd.prefill.answered[0]


def test_aggregated_mode_sends_each_request_whole_to_one_instance_and_counts_no_fallback(pd):
    """No --prefill (goodput's baseline): the request as the client sent it, to one of the servers, no
    kv_transfer_params, no decode-only fallback counted; ready once an instance is."""
    other = Backend("decode")
    proxy = Proxy(ProxyConfig(prefill=[], decode=[pd.d_url, pd.loop.serve(other.app())], policy="round_robin"))
    url = pd.loop.serve(proxy.app())
    for _ in range(4):
        status, text, headers = post(url + "/v1/completions", BODY)
        assert status == 200 and json.loads(text)["echo_kvp"] is None, text
        assert "x-pdctl-fallback" not in {k.lower() for k in headers}
    assert len(pd.decode.requests) == len(other.requests) == 2 and not pd.prefill.requests
    body, _ = other.requests[0]
    assert body == BODY  # untouched: max_tokens, min_tokens, stream_options as sent
    assert _counted(get(url + "/metrics")[1], "pdctl_decode_only_fallback_total") == 0
    assert get(url + "/ready")[0] == 200
    pd.decode.healthy = other.healthy = False
    assert get(url + "/ready")[0] == 503
    with pytest.raises(ValueError, match="aggregated serving"):
        Proxy(ProxyConfig(prefill=[], decode=[pd.d_url], first_token="on"))
