"""Where the P/D proxy sends each request: pool pairs, health, load and prefix affinity.

Pure (no I/O, no asyncio) so every policy can be tested without servers. The proxy owns the `Instance` objects and
updates their `inflight` and `healthy` fields; the `Router` reads them on every pick. Everything that does not
change per request (pools, allowed pairs, hash rings) is computed once in `Router.__init__`, so a pick costs
O(candidates), plus O(log ring) for prefix affinity.
"""

from __future__ import annotations

import hashlib
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import count

POLICIES = ("least_outstanding", "round_robin", "prefix_affinity")


@dataclass(eq=False)
class Breaker:
    """Per-instance circuit breaker: `threshold` consecutive failures take the instance out of routing for
    `open_s`; then one trial request is let through (half-open): success closes it, failure opens it again.
    A flapping instance then costs one failed request per `open_s`, not one per request."""

    threshold: int = 3
    open_s: float = 10.0
    failures: int = 0
    opened_at: float | None = None
    trial: bool = False  # the half-open trial request is out ...
    trial_at: float = 0.0  # ... since then; a trial with no verdict after open_s is given up (a lease)
    trips: int = 0  # times it opened (metrics)

    def state(self, now: float) -> str:
        if self.opened_at is None:
            return "closed"
        return "open" if now - self.opened_at < self.open_s else "half_open"

    def allows(self, now: float) -> bool:
        st = self.state(now)
        return st == "closed" or (st == "half_open" and (not self.trial or now - self.trial_at > self.open_s))

    def picked(self, now: float) -> None:
        if self.state(now) == "half_open":
            self.trial, self.trial_at = True, now

    def release(self) -> None:
        """The request ended with no verdict on the instance (the client went away): another may try."""
        self.trial = False

    def success(self) -> None:
        self.failures, self.opened_at, self.trial = 0, None, False

    def failure(self, now: float) -> bool:
        """Count a failure; True when this one opened the breaker."""
        self.failures += 1
        half_open = self.opened_at is not None
        self.trial = False
        if half_open or self.failures >= self.threshold:
            self.opened_at = now
            self.trips += 1
            return True
        return False


@dataclass(eq=False)  # identity semantics: instances are hashable, two with equal fields stay distinct
class Instance:
    name: str  # e.g. "prefill-p32-0" (used in response headers and metrics)
    url: str  # base URL, no trailing slash
    role: str  # "prefill" | "decode"
    pool: str  # pool name, e.g. "p32"; single-pool topologies use "default"
    weight: float = 1.0  # per-pool weight for unequal hardware (>0)
    inflight: int = 0  # requests outstanding on it (the proxy increments/decrements)
    healthy: bool = True  # last health probe (or request) reached it
    refused: bool = False  # the last probe or request found nothing listening (not merely slow)
    # Held by the supervisor (protocol.HOLD_ROUTE): restarting, or its KV pairs not yet proven again. /health
    # answers before a restarted server's pairs are wired, so health alone cannot say it may serve.
    held: bool = False
    breaker: Breaker = field(default_factory=Breaker)

    def usable(self, now: float) -> bool:
        return self.healthy and not self.held and self.breaker.allows(now)


class NoRoute(Exception):
    """No instance may serve this request (bad pin); the message is meant for the client."""


def _h64(text: str) -> int:
    # A stable hash: Python's hash() is randomized per process, and ring positions must not move between restarts
    # (or between the replicas of a proxy). surrogatepass: JSON may carry lone surrogates.
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


@dataclass(eq=False)
class _Group:
    """One candidate set (e.g. "the decodes allowed for prefill pool p32") with its slice of the role's ring."""

    members: list[Instance]
    ring: list[int]  # sorted vnode positions
    owners: list[Instance]  # owners[i] holds ring[i]


class Router:
    """Picks a prefill, then a decode allowed for that prefill's pool, under one policy. Without prefill
    instances it routes aggregated serving: every request to one of the `decode` instances (each serves it
    whole), under the same policy."""

    def __init__(self, prefill: list[Instance], decode: list[Instance], policy: str = "least_outstanding",
                 exclude_pairs: Iterable[tuple[str, str]] = (), epsilon: float = 0.25, prefix_chars: int = 256,
                 vnodes: int = 64, clock: Callable[[], float] = time.monotonic):
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; one of: {', '.join(POLICIES)}")
        if not decode:
            raise ValueError("the router needs at least one decode instance (and prefills, unless aggregated)")
        if not prefill and exclude_pairs:
            raise ValueError("excluded pairs without prefill instances: aggregated serving has no pairs")
        names = [i.name for i in (*prefill, *decode)]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"instance names must be unique (they place instances on the hash ring): {dup}")
        for inst in (*prefill, *decode):
            if not inst.weight > 0:
                raise ValueError(f"{inst.name}: weight must be > 0, got {inst.weight}")
        if epsilon < 0 or vnodes < 1:
            raise ValueError(f"epsilon must be >= 0 and vnodes >= 1 (got {epsilon}, {vnodes})")
        self.policy = policy
        self.clock = clock
        self.epsilon = epsilon
        self.prefix_chars = prefix_chars
        self.instances = [*prefill, *decode]
        p_pools = _pools(prefill)
        d_pools = _pools(decode)

        excluded = set()
        for p, d in exclude_pairs:
            if p not in p_pools or d not in d_pools:
                raise ValueError(f"excluded pair {p}/{d} names an unknown pool; prefill pools: "
                                 f"{', '.join(p_pools)}; decode pools: {', '.join(d_pools)}")
            excluded.add((p, d))
        self.pairs = [(p, d) for p in p_pools for d in d_pools if (p, d) not in excluded]
        self._pair_set = set(self.pairs)
        self._excluded = excluded
        for pools, side, idx in ((p_pools, "prefill", 0), (d_pools, "decode", 1)):
            for name in pools if prefill else ():
                if not any(pair[idx] == name for pair in self.pairs):
                    raise ValueError(f"{side} pool {name} has no allowed partner pool: every pair with it is "
                                     "excluded")

        # One ring per role; each candidate set gets the subsequence of its members, so walking it is the same as
        # walking the whole ring and skipping non-members (hence the consistency property), but never O(ring).
        rings = {role: _ring(insts, vnodes) for role, insts in (("prefill", prefill), ("decode", decode))}

        def group(role: str, members: list[Instance]) -> _Group:
            ids = set(map(id, members))
            sub = [(pos, inst) for pos, inst in rings[role] if id(inst) in ids]
            return _Group(members, [pos for pos, _ in sub], [inst for _, inst in sub])

        paired_p = {p for p, _ in self.pairs}
        self._prefill_all = group("prefill", [i for i in prefill if i.pool in paired_p])
        self._prefill_pool = {p: group("prefill", m) for p, m in p_pools.items()}
        self._decode_for = {p: group("decode", [i for i in decode if (p, i.pool) in self._pair_set])
                            for p in p_pools}
        self._decode_pool = {d: group("decode", m) for d, m in d_pools.items()}
        self._decode_all = group("decode", [i for i in decode if i.pool in {d for _, d in self.pairs}]
                                 if prefill else decode)
        self.aggregated = not prefill
        self._rr = {"prefill": count(), "decode": count()}

    # -- public ----------------------------------------------------------------------------------------------

    def pick_prefill(self, key: str | None = None, pin: tuple[str, str] | None = None,
                     exclude: Iterable[Instance] = (), usable_only: bool = False) -> Instance | None:
        """A prefill for the request. `exclude`: instances already tried for it. With `usable_only`, None when
        no candidate is healthy with a closed (or trial-ready) breaker; otherwise every candidate is tried then."""
        if pin is not None:
            self._check_pair(*pin)
            return self._pick(self._prefill_pool[pin[0]], "prefill", key, exclude, usable_only)
        return self._pick(self._prefill_all, "prefill", key, exclude, usable_only)

    def pick_decode(self, prefill_pool: str | None, key: str | None = None, pin: tuple[str, str] | None = None,
                    exclude: Iterable[Instance] = ()) -> Instance:
        """A decode allowed for the prefill's pool; `prefill_pool` None (decode-only fallback): any paired decode,
        or the pinned pair's decode pool."""
        if pin is not None:
            if prefill_pool is not None:
                self._check_pair(prefill_pool, pin[1])
            return self._pick(self._decode_pool[pin[1]], "decode", key, exclude)
        if prefill_pool is None:
            return self._pick(self._decode_all, "decode", key, exclude)
        g = self._decode_for.get(prefill_pool)
        if g is None:
            raise NoRoute(f"no such prefill pool {prefill_pool}; pairs: {self._pairs_text()}")
        return self._pick(g, "decode", key, exclude)

    def parse_pin(self, header: str) -> tuple[str, str]:
        """A pin header "P/D" -> (P, D), checked against the allowed pairs."""
        parts = [s.strip() for s in header.split("/")]
        if len(parts) != 2 or not all(parts):
            raise NoRoute(f"malformed pool pin {header!r}: expected PREFILL_POOL/DECODE_POOL; "
                          f"pairs: {self._pairs_text()}")
        p, d = parts
        self._check_pair(p, d)
        return p, d

    # -- internals -------------------------------------------------------------------------------------------

    def _pairs_text(self) -> str:
        return ", ".join(f"{p}/{d}" for p, d in self.pairs)

    def _check_pair(self, p: str, d: str) -> None:
        if (p, d) in self._pair_set:
            return
        if (p, d) in self._excluded:
            raise NoRoute(f"pool pair {p}/{d} is excluded; pairs: {self._pairs_text()}")
        raise NoRoute(f"no such pool pair {p}/{d}; pairs: {self._pairs_text()}")

    def _pick(self, g: _Group, role: str, key: str | None, exclude: Iterable[Instance] = (),
              usable_only: bool = False) -> Instance | None:
        # Instances that failed their last probe, or whose breaker is open, get no traffic; with none usable,
        # every one is tried (the request then fails fast with the instance named, instead of waiting for a
        # probe), unless the caller has somewhere else to go (usable_only).
        now = self.clock()
        skip = set(map(id, exclude))
        members = [i for i in g.members if id(i) not in skip]
        cands = [i for i in members if i.usable(now)]
        if not cands and usable_only:
            # A missed probe on a busy host is no crash: still try what answers connections and whose breaker
            # allows it; only refused or tripped instances count as down.
            cands = [i for i in members if not i.refused and not i.held and i.breaker.allows(now)]
        if not cands:
            if usable_only or not members:
                return None
            cands = members
        inst = self._choose(g, cands, role, key)
        inst.breaker.picked(now)
        return inst

    def _choose(self, g: _Group, cands: list[Instance], role: str, key: str | None) -> Instance:
        if self.policy == "round_robin":
            return cands[next(self._rr[role]) % len(cands)]
        if self.policy == "prefix_affinity" and key is not None:
            inst = self._affine(g, cands, key)
            if inst is not None:
                return inst
        # Least outstanding, load measured per unit of weight; ties broken round-robin so equal loads still spread.
        start = next(self._rr[role])
        n = len(cands)
        return min((cands[(start + i) % n] for i in range(n)), key=lambda x: x.inflight / x.weight)

    def _affine(self, g: _Group, cands: list[Instance], key: str) -> Instance | None:
        """Consistent hashing with bounded loads: the first eligible owner clockwise from the key's position.

        An instance is skipped when inflight > (1 + epsilon) * its weighted share of the mean load + 1 (with equal
        weights: (1 + epsilon) * mean inflight + 1), so one hot prefix cannot pile onto one instance; its overflow
        goes to the next instance on the ring, which is deterministic and so still cache-friendly.
        """
        now = self.clock()
        all_down = not any(i.usable(now) for i in cands)  # then cands is every member: unhealthy ones are eligible
        share = (1 + self.epsilon) * sum(i.inflight for i in cands) / sum(i.weight for i in cands)
        ring, owners = g.ring, g.owners
        cand_ids = set(map(id, cands))
        n = len(ring)
        start = bisect_right(ring, _h64(key))
        seen: set[int] = set()
        for j in range(n):
            inst = owners[(start + j) % n]
            if id(inst) in seen:
                continue
            if id(inst) in cand_ids and (inst.usable(now) or all_down) and inst.inflight <= share * inst.weight + 1:
                return inst
            seen.add(id(inst))
            if len(seen) == len(g.members):
                break
        return None


def _pools(insts: list[Instance]) -> dict[str, list[Instance]]:
    pools: dict[str, list[Instance]] = {}
    for i in insts:
        pools.setdefault(i.pool, []).append(i)
    return pools


def _ring(insts: list[Instance], vnodes: int) -> list[tuple[int, Instance]]:
    # Positions depend only on the instance's name, never on the others: adding or removing one instance moves only
    # the keys it owns. Weight scales its share of the ring.
    ring = [(_h64(f"{i.name}#{v}"), i) for i in insts for v in range(max(1, round(vnodes * i.weight)))]
    ring.sort(key=lambda e: (e[0], e[1].name))
    return ring


def affinity_key(body: dict, prefix_chars: int = 256) -> str | None:
    """A hex key for a request's prompt prefix, so requests sharing it land where that prefix is already cached.

    The proxy has no tokenizer, so the key is the hash of the first `prefix_chars` characters of the prompt as text:
    a fixed size that depends on neither side's KV block size. Token-id prompts become "1,2,3," so a shared token
    prefix is a shared text prefix. Never raises on a malformed body (it is not validated yet): None instead.
    """
    text = _prompt_text(body, prefix_chars)
    if not text:
        return None
    return hashlib.blake2b(text[:prefix_chars].encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _prompt_text(body: object, limit: int) -> str | None:
    if not isinstance(body, dict):
        return None
    prompt = body.get("prompt")
    if prompt is not None:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: its first prompt
        if isinstance(prompt, str):
            return prompt[:limit]
        if isinstance(prompt, list):
            out, n = [], 0
            for t in prompt:
                if n >= limit:
                    break
                s = f"{t},"
                out.append(s)
                n += len(s)
            return "".join(out)
        return None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    out, n = [], 0
    for m in messages:
        if n >= limit:
            break
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
        elif not isinstance(content, str):
            content = ""
        s = f"{m.get('role', '')}\x00{content}\x01"
        out.append(s)
        n += len(s)
    return "".join(out)
