"""The proxy's first_token: the prefill's token streamed first (pure rules and the stream edit), and the proxy doing it
against vLLM-shaped test backends over real loopback HTTP."""

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from aiohttp import web

from pdctl.proxy import first_token as ft
from pdctl.proxy.config import ProxyConfig
from pdctl.proxy.server import Proxy
from tests.conftest import sample, wait_for
from tests.unit.proxy.test_proxy import KVP, Loop, free_port, get, post

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
GREEDY = {"model": "m", "prompt": "hi", "max_tokens": 4, "temperature": 0, "stream": True}
TOKENS = ["He", "llo", " wor", "ld"]


def sse(objs) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


def cmpl_stream(tokens=TOKENS, usage=True) -> bytes:
    """What vLLM streams for a completion: one event per token, the last with its finish reason, then usage."""
    evs = [{"id": "cmpl-r", "object": "text_completion", "created": 7, "model": "m", "choices": [
        {"index": 0, "text": t, "logprobs": None, "finish_reason": "length" if i == len(tokens) - 1 else None,
         "stop_reason": None}]} for i, t in enumerate(tokens)]
    if usage:
        evs.append({"id": "cmpl-r", "object": "text_completion", "created": 7, "model": "m", "choices": [],
                    "usage": {"prompt_tokens": 1, "completion_tokens": len(tokens), "total_tokens": 5}})
    return sse(evs)


def chat_stream(tokens=TOKENS) -> bytes:
    head = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    evs = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]}]
    evs += [{**head, "choices": [{"index": 0, "delta": {"content": t}, "logprobs": None,
                                  "finish_reason": "length" if i == len(tokens) - 1 else None}]}
            for i, t in enumerate(tokens)]
    return sse(evs)


def texts(stream: bytes | str, chat: bool = False) -> list[str]:
    """Each event's text, in order (what a client shows)."""
    raw = stream.decode() if isinstance(stream, bytes) else stream
    out = []
    for ev in raw.split("\n\n"):
        if not ev.startswith("data: {"):
            continue
        obj = json.loads(ev[6:])
        for c in obj.get("choices") or []:
            out.append(c["delta"].get("content") or "" if chat else c["text"])
    return out


def answer(text="He", finish="length", chat=False) -> dict:
    choice = {"index": 0, "finish_reason": finish}
    choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    return {"id": "cmpl-r", "created": 7, "model": "m", "choices": [choice], "kv_transfer_params": KVP}


# -- which requests --------------------------------------------------------------------------------------------

def test_a_greedy_stream_of_one_choice_is_eligible():
    assert ft.ineligible(CMPL, GREEDY) is None
    assert ft.ineligible(CMPL, {**GREEDY, "prompt": [1, 2, 3], "stop": [], "logprobs": None}) is None
    assert ft.ineligible(CHAT, {"messages": [], "temperature": 0.0, "stream": True, "logprobs": False}) is None


@pytest.mark.parametrize("change, why", [
    ({"stream": False}, "not streaming"), ({"temperature": None}, "not greedy"), ({"temperature": 0.7}, "not greedy"),
    ({"temperature": True}, "not greedy"), ({"n": 2}, "n > 1"), ({"best_of": 3}, "best_of"),
    ({"logprobs": 1}, "logprobs"), ({"echo": True}, "echo"), ({"stop": ["\n"]}, "stop"), ({"stop": "x"}, "stop"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"return_token_ids": True}, "return_token_ids"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}}, "continuous_usage_stats"),
    ({"max_tokens": 1}, "max_tokens 1"), ({"prompt": ["a", "b"]}, "several prompts"),
])
def test_requests_whose_stream_the_prefills_token_would_change_are_not(change, why):
    body = {k: v for k, v in {**GREEDY, **change}.items() if v is not None}
    assert why in ft.ineligible(CMPL, body)


def test_the_prefills_token_is_taken_only_when_it_is_one_complete_token_of_a_longer_answer():
    assert ft.token_text(CMPL, answer()) == "He"
    assert ft.token_text(CHAT, answer(chat=True)) == "He"
    assert ft.token_text(CMPL, answer(finish="stop")) is None  # end of sequence: the answer is over
    assert ft.token_text(CMPL, answer(text="")) is None  # vLLM held back an incomplete character
    assert ft.token_text(CMPL, answer(text="a\ufffd")) is None
    two = answer()
    two["choices"].append(dict(two["choices"][0]))
    assert ft.token_text(CMPL, two) is None
    reasoning = answer(chat=True)
    reasoning["choices"][0]["message"]["reasoning_content"] = "hmm"
    assert ft.token_text(CHAT, reasoning) is None
    assert ft.token_text(CMPL, None) is None and ft.token_text(CMPL, {"choices": "x"}) is None


def test_the_first_events_are_vllms_shape_from_the_prefills_answer():
    (ev,) = [json.loads(e[6:]) for e in ft.events(CMPL, answer(), "He").decode().split("\n\n") if e]
    assert ev["id"] == "cmpl-r" and ev["object"] == "text_completion" and ev["choices"][0]["text"] == "He"
    assert ev["choices"][0]["finish_reason"] is None
    role, content = [json.loads(e[6:]) for e in ft.events(CHAT, answer(chat=True), "He").decode().split("\n\n") if e]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content["choices"][0]["delta"] == {"content": "He"} and content["object"] == "chat.completion.chunk"


# -- the decode's stream, edited -------------------------------------------------------------------------------

def edited(route: str, first: str, stream: bytes, size: int) -> bytes:
    skip = ft.Skip(route, first)
    return b"".join(skip.feed(stream[i:i + size]) for i in range(0, len(stream), size))


@pytest.mark.parametrize("size", [1, 7, 64, 10_000])
def test_the_client_sees_the_decodes_text_once_however_the_bytes_arrive(size):
    stream = cmpl_stream()
    out = edited(CMPL, "He", stream, size)
    assert texts(ft.events(CMPL, answer(), "He") + out) == TOKENS  # the same text, token 1 from the prefill
    assert out == stream[stream.index(b"data:", 1):]  # the rest byte for byte
    chat = edited(CHAT, "He", chat_stream(), size)
    client = ft.events(CHAT, answer(chat=True), "He") + chat
    assert texts(client, chat=True) == ["", *TOKENS]
    assert client.count(b'"role"') == 1  # the decode's role event went with its token


def test_a_first_event_holding_two_tokens_keeps_the_second():
    out = edited(CMPL, "He", cmpl_stream(["Hello", " wor", "ld"]), 10_000)
    assert texts(out) == ["llo", " wor", "ld"]


def test_a_held_back_character_arriving_over_two_events_is_matched_across_them():
    out = edited(CMPL, "né", cmpl_stream(["", "n", "é!", "x"]), 10_000)
    assert texts(out) == ["!", "x"]


def test_a_token_that_finishes_the_answer_keeps_its_finish_reason():
    out = edited(CMPL, "He", cmpl_stream(["He"], usage=False), 10_000)
    (ev,) = [json.loads(e[6:]) for e in out.decode().split("\n\n") if e.startswith("data: {")]
    assert ev["choices"][0] == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length",
                                "stop_reason": None}


def test_a_decode_whose_first_text_differs_is_a_mismatch():
    with pytest.raises(ft.Mismatch, match="differs from the prefill's token at character 1: 'Ho' vs 'He'"):
        edited(CMPL, "He", cmpl_stream(["Ho", "la"]), 10_000)
    assert texts(edited(CMPL, "Ho", cmpl_stream(["Ho", "la"]), 10_000)) == ["la"]  # negative control
    long = "x" * 60
    with pytest.raises(ft.Mismatch, match="at character 50: 'xxxxxxxxxxyy' vs 'xxxxxxxxxxxxxxxxxxxx'"):
        edited(CMPL, long, cmpl_stream([long[:50] + "yy"]), 10_000)


def test_an_error_event_before_any_text_passes_through():
    err = b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n'
    assert edited(CMPL, "He", err, 5) == err


# -- the proxy ---------------------------------------------------------------------------------------------------

class VllmLike:
    """A prefill and a decode shaped like vLLM's answers: the prefill's one token, the decode's stream."""

    def __init__(self, role: str):
        self.role = role
        self.first_delay_s = 0.0  # the decode before its first event (its KV read and first step)
        self.tokens = TOKENS
        self.fail = None  # decode: 500 | None
        self.requests: list[dict] = []
        self.streaming = 0  # decode: streams in progress

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(CMPL, self.answer)
        app.router.add_post(CHAT, self.answer)
        app.router.add_get("/health", self.health)
        return app

    async def health(self, _req: web.Request):
        return web.json_response({})

    async def answer(self, req: web.Request):
        body = await req.json()
        self.requests.append(body)
        chat = req.path == CHAT
        if self.role == "prefill":
            return web.json_response(answer(self.tokens[0], chat=chat))
        if self.fail:
            return web.json_response({"error": {"message": "boom"}}, status=self.fail)
        self.streaming += 1
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(req)
            await asyncio.sleep(self.first_delay_s)
            for ev in (chat_stream if chat else cmpl_stream)(self.tokens).split(b"\n\n"):
                if ev:
                    await resp.write(ev + b"\n\n")
            return resp
        finally:
            self.streaming -= 1


@pytest.fixture
def fleet():
    loop = Loop()
    pre, dec = VllmLike("prefill"), VllmLike("decode")
    p_url, d_url = loop.serve(pre.app()), loop.serve(dec.app())

    def proxy(**cfg):
        px = Proxy(ProxyConfig(prefill=[p_url], decode=[d_url], read_timeout_s=5.0, connect_timeout_s=1.0, **cfg))
        return px, loop.serve(px.app())

    yield type("Fleet", (), {"prefill": pre, "decode": dec, "proxy": proxy, "loop": loop, "p_url": p_url,
                             "d_url": d_url})
    loop.close()


def _last(px: Proxy) -> dict:
    assert wait_for(lambda: px.timings, 5)  # recorded as the handler ends, after the last byte
    return px.timings[-1]


@pytest.mark.parametrize("route", [CMPL, CHAT])
def test_the_client_has_the_prefills_token_before_the_decode_streams_and_the_same_text(fleet, route):
    fleet.decode.first_delay_s = 0.3
    px, url = fleet.proxy(first_token="on")
    body = {**GREEDY, "messages": [{"role": "user", "content": "hi"}]} if route == CHAT else GREEDY
    status, text, headers = post(url + route, body)
    assert status == 200 and headers["x-pdctl-first-token"] == "prefill"
    assert "".join(texts(text, chat=route == CHAT)) == "".join(TOKENS) and text.endswith("data: [DONE]\n\n")
    rec = _last(px)
    assert rec["first"] == "prefill" and rec["decode_first"] - rec["client_first"] > 0.25
    assert px.metrics.first_token == {("from_prefill",): 1}
    assert sample(get(url + "/metrics")[1], "pdctl_proxy_first_token_total", outcome="from_prefill") == 1


def test_off_by_default_the_decodes_stream_is_passed_as_it_is(fleet):
    fleet.decode.first_delay_s = 0.3
    px, url = fleet.proxy()
    status, text, headers = post(url + CMPL, GREEDY)
    assert status == 200 and "x-pdctl-first-token" not in headers and text.encode() == cmpl_stream()
    rec = _last(px)
    assert rec["first"] is None and rec["client_first"] >= rec["decode_first"]


def test_the_header_turns_it_on_or_off_per_request_and_an_unknown_value_is_refused(fleet):
    px, url = fleet.proxy(first_token="on")
    assert "x-pdctl-first-token" not in post(url + CMPL, GREEDY, {"x-pdctl-first-token": "off"})[2]
    px2, url2 = fleet.proxy()
    assert post(url2 + CMPL, GREEDY, {"x-pdctl-first-token": "on"})[2]["x-pdctl-first-token"] == "prefill"
    status, text, _ = post(url + CMPL, GREEDY, {"x-pdctl-first-token": "yes"})
    assert status == 400 and "x-pdctl-first-token: 'yes' is none of on, off, auto" in text
    assert len(fleet.prefill.requests) == 2  # the refused one went nowhere


def test_a_request_it_cannot_serve_that_way_is_served_as_it_is(fleet):
    px, url = fleet.proxy(first_token="on")
    status, text, headers = post(url + CMPL, {**GREEDY, "temperature": 0.8})
    assert status == 200 and "x-pdctl-first-token" not in headers and text.encode() == cmpl_stream()


def test_auto_streams_the_prefills_token_only_while_the_decode_has_other_requests(fleet):
    px, url = fleet.proxy(first_token="auto")
    assert "x-pdctl-first-token" not in post(url + CMPL, GREEDY)[2]  # idle decode: its own first token
    fleet.decode.first_delay_s = 1.0
    busy = ThreadPoolExecutor(1).submit(post, url + CMPL, GREEDY)  # one request keeps the decode busy
    assert wait_for(lambda: fleet.decode.streaming == 1, 5)
    fleet.decode.first_delay_s = 0.0
    status, text, headers = post(url + CMPL, GREEDY)
    assert status == 200 and headers["x-pdctl-first-token"] == "prefill" and "".join(texts(text)) == "".join(TOKENS)
    assert busy.result(10)[0] == 200


def test_a_decode_that_contradicts_the_prefills_token_ends_the_stream_with_an_error(fleet):
    px, url = fleet.proxy(first_token="on")
    fleet.decode.tokens = ["Ha", "llo"]  # the prefill still answers "He"
    fleet.prefill.tokens = TOKENS
    status, text, _ = post(url + CMPL, GREEDY)
    assert status == 200 and texts(text) == ["He"] and "first_token_mismatch" in text
    assert text.endswith("data: [DONE]\n\n") and px.metrics.first_token[("mismatch",)] == 1


def test_a_decode_that_fails_after_the_token_went_out_ends_the_stream_with_its_error(fleet):
    px, url = fleet.proxy(first_token="on")
    fleet.decode.fail = 500
    status, text, _ = post(url + CMPL, GREEDY)
    assert status == 200 and texts(text) == ["He"] and "decode_failed" in text and text.endswith("data: [DONE]\n\n")


def test_a_decode_nobody_listens_on_is_tried_again_on_another_and_the_token_sent_once(fleet):
    dead = f"http://127.0.0.1:{free_port()}"
    px = Proxy(ProxyConfig(prefill=[fleet.p_url], decode=[dead, fleet.d_url], read_timeout_s=5.0, connect_timeout_s=1.0,
                           first_token="on", policy="round_robin", health_interval_s=60))
    url = fleet.loop.serve(px.app())
    dead_inst = next(i for i in px.router.instances if i.url == dead)
    assert wait_for(lambda: dead_inst.refused, 5)  # the first probe found it down: make it look up again
    sent = 0
    while not px.metrics.upstream_errors[(dead,)] and sent < 8:  # round robin: soon one starts on the dead one
        dead_inst.healthy, dead_inst.refused = True, False
        status, text, _ = post(url + CMPL, GREEDY)
        sent += 1
        assert status == 200 and "".join(texts(text)) == "".join(TOKENS)  # the token once, then the rest
    assert px.metrics.upstream_errors[(dead,)] == 1 and px.metrics.first_token == {("from_prefill",): sent}



def test_a_proxy_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="first_token"):
        Proxy(ProxyConfig(prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:2"], first_token="always"))
