"""The prefill's first token to the client (x-pdctl-first-token): pure rules and the stream edit.

A P/D prefill computes the prompt and samples one token (its answer's text); the decode then reads the KV and
samples that same token again before it streams anything. For a greedy streaming request the prefill's token is
the token (the decode's first token is the same argmax over the same prompt), so the proxy can write it to the
client the moment the prefill answers and drop it from the decode's stream: the decode's whole path (request,
KV read, one step) leaves the time to first token and moves between tokens 1 and 2.

Only where that is provably the same stream: streaming, greedy (temperature <= vLLM's 1e-5), one choice, no
logprobs, no echo, no stop strings (vLLM holds back text that may begin one), no tools, no per-chunk extras
(continuous usage, token ids); and the prefill's answer one finished-by-length choice whose text is complete
(vLLM's detokenizer leaves out an incomplete UTF-8 character). The decode's first content is then checked
against it: any difference ends the stream with an error (the client already has a token the decode did not
produce), counted as `mismatch`.
"""

from __future__ import annotations

import json

SAMPLING_EPS = 1e-5  # vLLM treats a temperature below this as greedy (vllm/sampling_params.py _SAMPLING_EPS)
MODES = ("off", "on", "auto")
# Request fields that change what a stream's chunks carry, or which tokens become text.
_CHANGES_CHUNKS = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "stop", "tools", "return_token_ids",
                   "return_prompt_text", "use_beam_search")


def ineligible(route: str, body: dict) -> str | None:
    """Why this request's first token cannot come from its prefill (None: it can)."""
    if body.get("stream") is not True:
        return "not streaming"
    t = body.get("temperature")
    if isinstance(t, bool) or not isinstance(t, int | float) or t > SAMPLING_EPS:
        return "not greedy (temperature 0 not given)"
    for k in ("n", "best_of"):
        if body.get(k) not in (None, 1):
            return f"{k} > 1"
    for k in _CHANGES_CHUNKS:
        if body.get(k) not in (None, False, [], ""):
            return k
    so = body.get("stream_options")
    if isinstance(so, dict) and so.get("continuous_usage_stats"):
        return "continuous_usage_stats"
    for k in ("max_tokens", "max_completion_tokens"):
        if body.get(k) == 1:
            return f"{k} 1 (the prefill's token is the whole answer)"
    if route.endswith("/completions") and not route.endswith("/chat/completions"):
        p = body.get("prompt")
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return "several prompts"
    return None


def token_text(route: str, answer: object) -> str | None:
    """The prefill's token as text, when its answer is one complete token of a longer answer."""
    if not isinstance(answer, dict):
        return None
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    c = choices[0]
    if c.get("finish_reason") != "length":  # an end of sequence or a stop token: the answer is over
        return None
    if _is_chat(route):
        m = c.get("message")
        if not isinstance(m, dict) or any(m.get(k) for k in ("reasoning", "reasoning_content", "tool_calls")):
            return None
        text = m.get("content")
    else:
        text = c.get("text")
    if not isinstance(text, str) or not text or text.endswith("\ufffd"):
        return None
    return text


def events(route: str, answer: dict, text: str) -> bytes:
    """The stream's first events as vLLM would write them, from the prefill's answer."""
    head = {"id": answer.get("id"), "created": answer.get("created"), "model": answer.get("model")}
    if _is_chat(route):
        role = answer["choices"][0]["message"].get("role") or "assistant"
        head["object"] = "chat.completion.chunk"
        out = [{**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": None}]}
               for d in ({"role": role, "content": ""}, {"content": text})]
    else:
        out = [{**head, "object": "text_completion", "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}]}]
    return b"".join(b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in out)


class Mismatch(Exception):
    """The decode's first text is not the prefill's token."""


class Skip:
    """Edits the decode's SSE stream: drops its role event (chat) and the prefill's token from its first text,
    then passes every byte through unchanged. `feed` returns what to forward; raises Mismatch."""

    def __init__(self, route: str, text: str):
        self.chat = _is_chat(route)
        self.left = text  # the prefill's text not yet seen in the decode's stream
        self.done = False
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        if self.done:
            return chunk
        self._buf += chunk
        out = []
        while not self.done:
            end = self._buf.find(b"\n\n")
            if end < 0:
                break
            event, self._buf = self._buf[:end + 2], self._buf[end + 2:]
            out.append(self._event(event))
        if self.done:
            out.append(self._buf)
            self._buf = b""
        return b"".join(out)

    def _event(self, event: bytes) -> bytes:
        data = event.strip()
        if not data.startswith(b"data:"):
            return event
        try:
            obj = json.loads(data[5:])
        except ValueError:  # [DONE], or not JSON: the rest is the decode's as it is
            self.done = True
            return event
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not choices or not isinstance(choices[0], dict):  # an error or a usage event: not ours to edit
            self.done = bool(isinstance(obj, dict) and obj.get("error"))
            return event
        c = choices[0]
        holder, key = (c.get("delta"), "content") if self.chat else (c, "text")
        if not isinstance(holder, dict):
            raise Mismatch(f"unexpected event {data[:200]!r}")
        if self.chat:
            holder.pop("role", None)
        got = holder.get(key) or ""
        if got.startswith(self.left):
            got, self.left = got[len(self.left):], ""
        elif self.left.startswith(got):
            got, self.left = "", self.left[len(got):]
        else:
            i = next(i for i, (x, y) in enumerate(zip(got + "\0", self.left + "\1", strict=False)) if x != y)
            raise Mismatch(f"the decode's first text differs from the prefill's token at character {i}: "
                           f"{got[max(0, i - 10):i + 20]!r} vs {self.left[max(0, i - 10):i + 20]!r}")
        self.done = not self.left
        holder[key] = got
        others = [v for k, v in (holder.items() if self.chat else ()) if k != key]
        if not got and c.get("finish_reason") is None and not obj.get("usage") and not any(others):
            return b""
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _is_chat(route: str) -> bool:
    return route.endswith("/chat/completions")
