"""Helpers for the fault drills: kill an instance's server, wait for the supervisor, stream and load clients."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdctl.launch.local import live_processes
from tests.e2e.conftest import wait_for


def record(state_dir: Path, name: str) -> dict:
    return json.loads((state_dir / "state.json").read_text())["processes"][name]


def server_pid(state_dir: Path, name: str) -> int:
    """The vLLM API server of an instance: the child of its guard (the recorded process)."""
    guard = record(state_dir, name)["pid"]
    kids: list[int] = []
    assert wait_for(lambda: kids.extend(p for p, ppid, _ in live_processes() if ppid == guard) or kids, 10), guard
    return kids[0]


def kill_server(state_dir: Path, name: str) -> float:
    """SIGKILL an instance's server and every process under it (vLLM's engine core, which holds the KV cache and
    the NIXL agent), all at once, as a crash of the server would; the time of the kill. Its guard lives on and
    reports the exit, as it does for a real crash."""
    pid = server_pid(state_dir, name)
    procs = live_processes()
    tree, grew = {pid}, True
    while grew:
        below = {p for p, ppid, _ in procs if ppid in tree} - tree
        tree |= below
        grew = bool(below)
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return time.monotonic()


def wait_restarted(state_dir: Path, name: str, restarts: int, timeout: float = 240) -> bool:
    """Until the supervisor has restarted the instance `restarts` times and it serves again."""
    def done() -> bool:
        try:
            r = record(state_dir, name)
        except (OSError, ValueError, KeyError):
            return False
        return r.get("restarts", 0) >= restarts and r.get("phase") == "running"

    return wait_for(done, timeout, 1.0)


def fresh_prompt(rng: random.Random, n: int | None = None) -> list[int]:
    # Token ids: no tokenizer needed, and a fresh prompt per request so no prefix cache answers it.
    return [rng.randrange(5, 1500) for _ in range(n or rng.randrange(80, 200))]


@dataclass
class Answer:
    status: int
    text: str
    headers: dict
    started: float
    ended: float
    error: str | None = None  # an error event in the stream, a bad status, or a client-side failure

    @property
    def ok(self) -> bool:
        return self.error is None


def complete(url: str, body: dict, headers: dict | None = None, timeout: float = 300) -> Answer:
    """One request through HTTP/1.1; a streamed answer is read to its end. Never raises."""
    host, port = url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    try:
        c = http.client.HTTPConnection(host, int(port), timeout=timeout)
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                              **(headers or {})})
        r = c.getresponse()
        text = r.read().decode(errors="replace")
        c.close()
    except (OSError, http.client.HTTPException) as e:
        return Answer(0, "", {}, t0, time.monotonic(), f"client: {e!r}")
    a = Answer(r.status, text, {k.lower(): v for k, v in r.getheaders()}, t0, time.monotonic())
    if r.status != 200:
        a.error = f"HTTP {r.status}: {text[:300]}"
    elif body.get("stream"):
        events = [ln[6:] for ln in text.split("\n") if ln.startswith("data: ")]
        errs = [e for e in events if e.startswith("{") and "error" in json.loads(e)]
        if errs:
            a.error = f"error event: {errs[0][:300]}"
        elif not events or events[-1] != "[DONE]":
            a.error = "stream ended without [DONE]"
    return a


def stream_text(a: Answer) -> str:
    out = []
    for ln in a.text.split("\n"):
        if ln.startswith("data: {"):
            ev = json.loads(ln[6:])
            out += [c.get("text", "") for c in ev.get("choices", [])]
    return "".join(out)


@dataclass
class Load:
    """`clients` threads each sending fresh streamed requests one after another until stopped."""

    url: str
    clients: int = 8
    max_tokens: int = 16
    seed: int = 0
    answers: list[Answer] = field(default_factory=list)

    def __enter__(self) -> Load:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def _run(self, k: int) -> None:
        rng = random.Random(self.seed * 1000 + k)
        while not self._stop.is_set():
            a = complete(self.url, {"model": "tiny", "prompt": fresh_prompt(rng), "max_tokens": self.max_tokens,
                                    "temperature": 0, "stream": True, "ignore_eos": True})
            with self._lock:
                self.answers.append(a)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(600)

    def errors(self) -> list[Answer]:
        with self._lock:
            return [a for a in self.answers if not a.ok]
