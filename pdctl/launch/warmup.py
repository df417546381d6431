"""Every pair wired before traffic: `up`'s warm-up proves each prefill instance x decode instance pair with one
bounded probe transfer, then one request through the proxy, before the topology is called ready.

A probe is vLLM's P/D protocol sent straight to the two instances (what a proxy does): the prefill computes a
prompt of a few blocks and holds its KV, the decode reads it. An answer is not proof (under
kv_load_failure_policy: recompute a decode whose read failed computes the prompt itself and answers 200): the
decode's log must say the KV arrived (pdctl's connector logs each read, with its time) and nothing failed. A pair
whose read fails, times out (connector.kv_read_timeout_s), or takes longer than PROBE_READ_LIMIT_S makes `up`
fail, naming the pair and the cause. Nothing is tried twice: a pair that needs a second try is not wired.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pdctl import auth
from pdctl.launch import probe
from pdctl.launch.errors import LaunchFailed
from pdctl.launch.logs import tail
from pdctl.plan import Plan, ProcessSpec
from pdctl.protocol import (
    LEASE_REFUSED_MARK,
    READ_MS,
    READ_TIMED_OUT_MARK,
    REFUSED_MARK,
    REJECT_HEADER,
    REMOTE_DECODE_PARAMS,
    TRANSFER_FAILED_MARK,
)

# A probe reads a few blocks; on one host that takes milliseconds, across hosts well under a second. A first read
# slower than this is a pair UCX has not wired (the first-read stalls of 30-120 s this bound exists to catch).
PROBE_READ_LIMIT_S = 2.0
# Marks of a read that did not deliver, in the decode's log (pdctl's and vLLM's).
TROUBLE_MARKS = (REFUSED_MARK, READ_TIMED_OUT_MARK, LEASE_REFUSED_MARK, TRANSFER_FAILED_MARK)


@dataclass(frozen=True)
class PairProbe:
    prefill: str  # instance names
    decode: str
    decode_s: float  # the decode's leg: handshake (on a fresh pair), read, one step
    read_s: float | None  # the NIXL read alone, from the decode's log (pdctl's connector; None for vLLM's stock)

    @property
    def seconds(self) -> float:
        """What the pair's probe is known by: its read, else (vLLM's stock connector logs none) its decode leg."""
        return self.read_s if self.read_s is not None else self.decode_s

    @property
    def label(self) -> str:
        return f"{self.prefill} -> {self.decode}"


def pool_pairs(plan: Plan) -> list[tuple[str, str]]:
    """The (prefill pool, decode pool) pairs the proxy may route, from the plan's topology."""
    return [(p.name, d.name) for p, d in plan.topology.pairs()]


def instance_pairs(plan: Plan) -> list[tuple[ProcessSpec, ProcessSpec]]:
    """Every (prefill instance, decode instance) the proxy may route a request over, in plan order."""
    prefills, decodes = plan.by_role("prefill"), plan.by_role("decode")
    pools = set(pool_pairs(plan))
    return [(p, d) for p in prefills for d in decodes if not pools or (p.pool, d.pool) in pools]


def warm_up(plan: Plan, timeout_s: float = 120.0, *, sleep: Callable[[float], None] | None = None
            ) -> list[PairProbe]:
    """Probe every instance pair, then send one request through the proxy; the probes, in pair order.
    `timeout_s` bounds each HTTP call (a cold engine's first prompt compiles); the read itself is bounded by the
    decode's connector. `sleep` makes the readiness poll's pauses (time.sleep unless given): tests pass a fake."""
    sleep = sleep or time.sleep
    proxy = next((p for p in plan.processes if p.role == "proxy"), None)
    if proxy is None or not plan.by_role("decode"):  # no P/D pair (goodput's aggregated baseline): nothing to prove
        return []
    router = plan.topology.proxy.kind == "vllm-router"
    key = auth.headers(auth.api_key(plan.topology))
    pdctl_connector = plan.topology.connector.kind == "pdctl"
    n = _probe_tokens(plan)
    model = plan.topology.model.name
    probes = [_probe(prefill, decode, _probe_body(model, n, k), key, timeout_s, pdctl_connector)
              for k, (prefill, decode) in enumerate(instance_pairs(plan))]
    # The proxy must know every instance is up (its probe runs every 2 s): /ready probes them now.
    deadline = time.monotonic() + 60
    ready = proxy.http_url + ("/readiness" if router else "/ready")
    while probe.http_get(ready, timeout=5.0, headers=key)[0] != 200 and time.monotonic() < deadline:
        sleep(0.5)
    body = {"model": model, "max_tokens": 2, "temperature": 0, "prompt": [7 + i % 40 for i in range(n)]}
    headers = dict(key) if router else {REJECT_HEADER: "reject", **key}  # pdctl's proxy: P/D, or fail
    decodes = plan.by_role("decode")
    offsets = {d.log_path: _size(d.log_path) for d in decodes}
    try:
        _post(proxy.http_url, body, headers, timeout_s, "pdctl-warm-up-proxy")
    except (urllib.error.URLError, OSError) as e:
        raise LaunchFailed(proxy.name, f"warm-up request through the proxy failed: {_http_detail(e)}",
                           proxy.log_path) from None
    trouble = _trouble(offsets)
    if trouble:
        raise LaunchFailed(decodes[0].name, f"warm-up request through the proxy: {trouble}", decodes[0].log_path)
    return probes


def reprove(plan: Plan, instance: str, partners: Callable[[str], bool] = lambda name: True,
            timeout_s: float = 60.0) -> list[PairProbe]:
    """The pairs of a restarted instance, probed again before it serves (the supervisor's): only with partners
    that are up (`partners(name)`). Raises LaunchFailed naming the first pair that fails."""
    key = auth.headers(auth.api_key(plan.topology))
    n, model = _probe_tokens(plan), plan.topology.model.name
    # A decode that served an earlier probe's prompt has it cached: never the warm-up's (k < 1000 there)
    salt = 1000 + int(time.time() * 1000) % 90_000
    return [_probe(p, d, _probe_body(model, n, salt + k), key, timeout_s, plan.topology.connector.kind == "pdctl")
            for k, (p, d) in enumerate(instance_pairs(plan))
            if instance in (p.name, d.name) and partners(d.name if p.name == instance else p.name)]


def _probe_tokens(plan: Plan) -> int:
    blocks = [p.block_size for p in plan.processes if p.block_size]
    return 2 * max(blocks, default=16) + 1  # crosses a block boundary on both sides: a few blocks


def _probe_body(model: str, n: int, k: int) -> dict:
    # Each pair its own prompt: a decode's prefix cache must not answer another pair's probe.
    return {"model": model, "max_tokens": 2, "temperature": 0,
            "prompt": [5 + (i * (k % 97 + 1) + k) % 1000 for i in range(n)]}


def _probe(prefill: ProcessSpec, decode: ProcessSpec, body: dict, key: dict[str, str], timeout_s: float,
           pdctl_connector: bool) -> PairProbe:
    rid = f"pdctl-probe-{prefill.name}-{decode.name}"
    pair = f"pair {prefill.name} -> {decode.name}"
    offset = _size(decode.log_path)
    try:
        pre = _post(prefill.http_url, {**body, "max_tokens": 1, "stream": False,
                                       "kv_transfer_params": dict(REMOTE_DECODE_PARAMS)}, key, timeout_s, rid)
    except (urllib.error.URLError, OSError) as e:
        raise LaunchFailed(prefill.name, f"warm-up probe of {pair}: the prefill failed: {_http_detail(e)}",
                           prefill.log_path) from None
    params = pre.get("kv_transfer_params")
    if not params:
        raise LaunchFailed(prefill.name, f"warm-up probe of {pair}: the prefill answered without "
                           "kv_transfer_params (is its connector NIXL?)", prefill.log_path)
    t0 = time.monotonic()
    try:
        _post(decode.http_url, {**body, "kv_transfer_params": params}, key, timeout_s, rid)
    except (urllib.error.URLError, OSError) as e:
        cause = _connector_error(decode.log_path) or _http_detail(e)
        raise LaunchFailed(decode.name, f"warm-up probe of {pair} failed: {cause}", decode.log_path) from None
    decode_s = time.monotonic() - t0
    new = _read_from(decode.log_path, offset)
    trouble = _trouble_in(new)
    if trouble:
        raise LaunchFailed(decode.name, f"warm-up probe of {pair}: {trouble}", decode.log_path)
    read_s = None
    if pdctl_connector:
        read_ms = next((float(m.group(2)) for m in map(READ_MS.search, new.splitlines()) if m and rid in m.group(1)),
                       None)
        if read_ms is None:
            raise LaunchFailed(decode.name, f"warm-up probe of {pair}: the decode answered but its log shows no KV "
                               "received for the probe (it computed the prompt itself)", decode.log_path)
        read_s = read_ms / 1e3
        if read_s > PROBE_READ_LIMIT_S:
            raise LaunchFailed(decode.name, f"warm-up probe of {pair}: its first KV read took {read_s:.1f} s "
                               f"(limit {PROBE_READ_LIMIT_S:g} s; a wired pair reads a few blocks in milliseconds): "
                               "UCX has not wired this pair; see docs/notes/ucx-transports.md", decode.log_path)
    return PairProbe(prefill.name, decode.name, decode_s, read_s)


def _post(url: str, body: dict, headers: dict[str, str], timeout_s: float, rid: str) -> dict:
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **headers, "X-Request-Id": rid})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def _http_detail(e: BaseException) -> str:
    return e.read().decode(errors="replace")[:500] if isinstance(e, urllib.error.HTTPError) else str(e)


def _size(path: str) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def _read_from(path: str, start: int) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(start)
            return f.read()
    except OSError:
        return ""


def _trouble_in(text: str) -> str | None:
    """The first line (from its mark on) saying a read did not deliver: pdctl's refusal of the pair, a timed-out
    or refused read, a failed NIXL transfer."""
    for line in text.splitlines():
        for mark in TROUBLE_MARKS:
            if mark in line:
                return line[line.index(mark):][:300]
    return None


def _trouble(offsets: dict[str, int]) -> str | None:
    return next(filter(None, (_trouble_in(_read_from(p, s)) for p, s in offsets.items())), None)


def _connector_error(log_path: str) -> str | None:
    """The connector's own one-line reason from a server log (pdctl's refusal, NIXL's failure, vLLM's assertion);
    the connector's info lines also say "pdctl connector: ", so only error lines count."""
    found = None
    for line in tail(log_path, 400):
        for marker in (REFUSED_MARK, f"{TRANSFER_FAILED_MARK}: ", "AssertionError: ", "RuntimeError: "):
            if marker in line:
                found = line[line.index(marker):].removeprefix("RuntimeError: ")
                break
    return found
