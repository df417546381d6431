"""pdctl.proxy.routing: pool pairs, health, load, weights, pins and prefix affinity (pure, no servers)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pdctl.proxy.routing import POLICIES, Instance, NoRoute, Router, affinity_key


def inst(role: str, pool: str, i: int, weight: float = 1.0) -> Instance:
    return Instance(f"{role}-{pool}-{i}", f"http://{role}-{pool}-{i}:8000", role, pool, weight)


def fleet(p_pools: dict[str, int], d_pools: dict[str, int]) -> tuple[list[Instance], list[Instance]]:
    pre = [inst("prefill", p, i) for p, n in p_pools.items() for i in range(n)]
    dec = [inst("decode", d, i) for d, n in d_pools.items() for i in range(n)]
    return pre, dec


def by_name(insts: list[Instance]) -> dict[str, Instance]:
    return {i.name: i for i in insts}


# -- construction ----------------------------------------------------------------------------------------------


def test_pairs_follow_pool_order_minus_excluded():
    pre, dec = fleet({"p32": 1, "p16": 1}, {"d64": 1, "d16": 1})
    r = Router(pre, dec, exclude_pairs=[("p16", "d64")])
    assert r.pairs == [("p32", "d64"), ("p32", "d16"), ("p16", "d16")]
    assert r.instances == pre + dec
    assert POLICIES == ("least_outstanding", "round_robin", "prefix_affinity")


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "random"}, "unknown routing policy 'random'"),
    ({"exclude_pairs": [("p9", "d64")]}, "excluded pair p9/d64 names an unknown pool"),
    ({"exclude_pairs": [("p32", "d9")]}, "excluded pair p32/d9 names an unknown pool"),
    ({"exclude_pairs": [("p16", "d64"), ("p16", "d16")]}, "prefill pool p16 has no allowed partner"),
    ({"exclude_pairs": [("p32", "d16"), ("p16", "d16")]}, "decode pool d16 has no allowed partner"),
])
def test_constructor_errors(kwargs, match):
    pre, dec = fleet({"p32": 1, "p16": 1}, {"d64": 1, "d16": 1})
    with pytest.raises(ValueError, match=match):
        Router(pre, dec, **kwargs)


def test_constructor_needs_decodes_and_positive_weights():
    pre, dec = fleet({"default": 1}, {"default": 1})
    assert Router([], dec).aggregated and not Router(pre, dec).aggregated  # no prefills: aggregated serving
    with pytest.raises(ValueError, match="at least one decode instance"):
        Router(pre, [])
    with pytest.raises(ValueError, match="aggregated serving has no pairs"):
        Router([], dec, exclude_pairs=[("default", "default")])
    dec[0].weight = 0
    with pytest.raises(ValueError, match="decode-default-0: weight must be > 0"):
        Router(pre, dec)
    dec[0].weight = 1
    dup = Instance("decode-default-0", "http://other:1", "decode", "default")
    with pytest.raises(ValueError, match="unique"):
        Router(pre, [*dec, dup])


# -- least outstanding -----------------------------------------------------------------------------------------


def test_least_outstanding_picks_emptiest_across_pools():
    pre, dec = fleet({"p32": 2, "p16": 2}, {"d64": 1})
    r = Router(pre, dec)
    for i, n in zip(pre, (3, 2, 5, 1), strict=True):
        i.inflight = n
    assert r.pick_prefill().name == "prefill-p16-1"
    pre[3].inflight = 9
    assert r.pick_prefill().name == "prefill-p32-1"


def test_least_outstanding_respects_weight():
    pre = [inst("prefill", "big", 0, weight=2.0), inst("prefill", "small", 0)]
    dec = [inst("decode", "d", 0)]
    r = Router(pre, dec)
    got = Counter()
    for _ in range(300):  # inflight accumulates: nothing finishes
        p = r.pick_prefill()
        p.inflight += 1
        got[p.name] += 1
    assert got == {"prefill-big-0": 200, "prefill-small-0": 100}


def test_least_outstanding_skips_unhealthy_and_falls_back_to_all():
    pre, dec = fleet({"p": 3}, {"d": 1})
    r = Router(pre, dec)
    pre[0].healthy = False  # the emptiest, but down
    pre[1].inflight, pre[2].inflight = 4, 7
    assert {r.pick_prefill().name for _ in range(10)} == {"prefill-p-1"}
    for i in pre:
        i.healthy = False
    assert r.pick_prefill() is pre[0]  # none healthy: all are candidates again


def test_least_outstanding_ties_spread():
    pre, dec = fleet({"p32": 2, "p16": 2}, {"d": 1})
    r = Router(pre, dec)
    got = Counter(r.pick_prefill().name for _ in range(40))
    assert got == {i.name: 10 for i in pre}


# -- round robin -----------------------------------------------------------------------------------------------


def test_round_robin_cycles_and_ignores_load():
    pre, dec = fleet({"p": 3}, {"d": 2})
    r = Router(pre, dec, policy="round_robin")
    pre[0].inflight = 50
    seq = [r.pick_prefill().name for _ in range(6)]
    assert seq == ["prefill-p-0", "prefill-p-1", "prefill-p-2"] * 2
    dec[1].healthy = False
    assert {r.pick_decode("p").name for _ in range(5)} == {"decode-d-0"}


# -- pairs and pins --------------------------------------------------------------------------------------------


def test_pick_decode_never_returns_excluded_pool():
    pre, dec = fleet({"p32": 2, "p16": 2}, {"d64": 2, "d16": 2})
    for policy in POLICIES:
        r = Router(pre, dec, policy=policy, exclude_pairs=[("p16", "d64")])
        pools = Counter(r.pick_decode("p16", key=str(k)).pool for k in range(200))
        assert pools == {"d16": 200}, policy
        assert set(Counter(r.pick_decode("p32", key=str(k)).pool for k in range(200))) == {"d64", "d16"}, policy


def test_pick_decode_unknown_prefill_pool():
    pre, dec = fleet({"p32": 1}, {"d64": 1})
    with pytest.raises(NoRoute, match="no such prefill pool p9"):
        Router(pre, dec).pick_decode("p9")


def test_pin_restricts_both_picks():
    pre, dec = fleet({"p32": 2, "p16": 2}, {"d64": 2, "d16": 2})
    for policy in POLICIES:
        r = Router(pre, dec, policy=policy)
        pin = r.parse_pin("p16/d64")
        assert pin == ("p16", "d64")
        for k in range(50):
            p = r.pick_prefill(key=str(k), pin=pin)
            assert p.pool == "p16"
            assert r.pick_decode(p.pool, key=str(k), pin=pin).pool == "d64"


def test_pin_restricts_even_when_pool_is_busier():
    pre, dec = fleet({"p32": 1, "p16": 1}, {"d64": 1, "d16": 1})
    r = Router(pre, dec)
    pre[1].inflight = dec[0].inflight = 10
    assert r.pick_prefill(pin=("p16", "d64")).pool == "p16"
    assert r.pick_decode("p16", pin=("p16", "d64")).pool == "d64"
    assert r.pick_prefill().pool == "p32"  # unpinned: the idle one


@pytest.mark.parametrize("header, match", [
    ("x", "malformed pool pin 'x'"),
    ("p32/", "malformed pool pin"),
    ("a/b/c", "malformed pool pin"),
    ("p9/d64", r"no such pool pair p9/d64; pairs: p32/d64, p16/d16"),
    ("p32/d9", "no such pool pair p32/d9"),
    ("p16/d64", "pool pair p16/d64 is excluded; pairs: p32/d64, p16/d16"),
])
def test_parse_pin_errors(header, match):
    pre, dec = fleet({"p32": 1, "p16": 1}, {"d64": 1, "d16": 1})
    r = Router(pre, dec, exclude_pairs=[("p16", "d64"), ("p32", "d16")])
    with pytest.raises(NoRoute, match=match):
        r.parse_pin(header)


def test_parse_pin_strips_spaces_and_pick_rejects_excluded_pin():
    pre, dec = fleet({"p32": 1, "p16": 1}, {"d64": 1, "d16": 1})
    r = Router(pre, dec, exclude_pairs=[("p16", "d64")])
    assert r.parse_pin(" p32 / d16 ") == ("p32", "d16")
    with pytest.raises(NoRoute, match="excluded"):
        r.pick_prefill(pin=("p16", "d64"))
    with pytest.raises(NoRoute, match="excluded"):
        r.pick_decode("p16", pin=("p16", "d64"))


# -- prefix affinity -------------------------------------------------------------------------------------------


def affine(p_pools=None, d_pools=None, **kw) -> tuple[Router, list[Instance], list[Instance]]:
    pre, dec = fleet(p_pools or {"p": 4}, d_pools or {"d": 4})
    return Router(pre, dec, policy="prefix_affinity", **kw), pre, dec


def test_affinity_same_key_same_instances():
    r, _, _ = affine()
    first = {k: (r.pick_prefill(f"k{k}"), r.pick_decode("p", f"k{k}")) for k in range(100)}
    for _ in range(5):
        for k, (p, d) in first.items():
            assert r.pick_prefill(f"k{k}") is p
            assert r.pick_decode("p", f"k{k}") is d


def test_affinity_is_stable_across_routers():
    # Positions come from a stable hash, not Python's per-process hash(): a fresh router (or a restarted proxy)
    # sends every key to the same instance names.
    r1, _, _ = affine()
    r2, _, _ = affine()
    assert [r1.pick_prefill(f"k{k}").name for k in range(100)] == [r2.pick_prefill(f"k{k}").name for k in range(100)]


def test_affinity_is_stable_across_processes():
    # Python's hash() differs per process (PYTHONHASHSEED): two proxies, or one restarted, must still agree.
    code = ("from tests.unit.proxy.test_routing import affine; r = affine()[0]; "
            "print([r.pick_prefill(f'k{k}').name for k in range(50)], affine()[0].pick_decode('p', 'x').name)")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[3],
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert len(outs) == 1


def test_affinity_spreads_keys():
    r, pre, dec = affine()
    got_p = Counter(r.pick_prefill(f"key-{k}").name for k in range(200))
    got_d = Counter(r.pick_decode("p", f"key-{k}").name for k in range(200))
    assert set(got_p) == {i.name for i in pre} and min(got_p.values()) >= 20, got_p
    assert set(got_d) == {i.name for i in dec} and min(got_d.values()) >= 20, got_d


def test_affinity_weight_scales_share_of_keys():
    pre = [inst("prefill", "p", 0, weight=3.0), inst("prefill", "p", 1)]
    r = Router(pre, [inst("decode", "d", 0)], policy="prefix_affinity")
    got = Counter(r.pick_prefill(f"k{k}").name for k in range(1000))
    assert got["prefill-p-0"] > 2 * got["prefill-p-1"], got


def test_affinity_unhealthy_preferred_moves_and_comes_back():
    r, pre, _ = affine()
    without = Router(pre[1:], affine()[2], policy="prefix_affinity")
    keys = [f"k{k}" for k in range(300) if r.pick_prefill(f"k{k}") is pre[0]]
    assert len(keys) > 20
    pre[0].healthy = False
    for k in keys:
        moved = r.pick_prefill(k)
        assert moved is not pre[0]
        assert moved.name == without.pick_prefill(k).name  # the next on the ring, not any instance
    pre[0].healthy = True
    assert all(r.pick_prefill(k) is pre[0] for k in keys)


def test_affinity_bounded_load_skips_overloaded_to_next_on_ring():
    r, pre, _ = affine()
    without = Router(pre[1:], affine()[2], policy="prefix_affinity")
    keys = [f"k{k}" for k in range(300) if r.pick_prefill(f"k{k}") is pre[0]]
    pre[0].inflight = 5  # mean 1.25: limit 1.25 * 1.25 + 1 = 2.56
    for k in keys:
        moved = r.pick_prefill(k)
        assert moved is not pre[0]
        assert moved.name == without.pick_prefill(k).name
    pre[0].inflight = 2  # mean 0.5: limit 1.625, still over
    assert all(r.pick_prefill(k) is not pre[0] for k in keys)
    pre[0].inflight = 1  # within (1 + epsilon) * mean + 1: keeps its keys
    assert all(r.pick_prefill(k) is pre[0] for k in keys)


def test_affinity_bounded_load_epsilon():
    r, pre, _ = affine(epsilon=10.0)
    key = next(f"k{k}" for k in range(100) if r.pick_prefill(f"k{k}") is pre[0])
    pre[0].inflight = 5  # limit 11 * 1.25 + 1: a loose bound keeps affinity
    assert r.pick_prefill(key) is pre[0]


def test_affinity_none_key_is_least_outstanding():
    r, pre, dec = affine()
    for i, n in zip(pre, (4, 1, 3, 2), strict=True):
        i.inflight = n
    dec[2].inflight = -1  # whatever the ring says, the emptiest
    assert r.pick_prefill(None) is pre[1]
    assert r.pick_decode("p", None) is dec[2]


def test_affinity_respects_pairs():
    r, pre, dec = affine({"p32": 2, "p16": 2}, {"d64": 2, "d16": 2}, exclude_pairs=[("p16", "d64")])
    assert {r.pick_decode("p16", f"k{k}").pool for k in range(200)} == {"d16"}


def test_affinity_removing_an_instance_moves_only_its_keys():
    keys = [f"prompt-{k}" for k in range(1000)]
    pre, dec = fleet({"p": 1}, {"d": 5})
    full = Router(pre, dec, policy="prefix_affinity")
    less = Router(pre, [d for d in dec if d.name != "decode-d-2"], policy="prefix_affinity")
    before = {k: full.pick_decode("p", k).name for k in keys}
    after = {k: less.pick_decode("p", k).name for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "decode-d-2" for k in moved)
    assert all(after[k] != "decode-d-2" for k in keys)
    # and each of the remaining instances takes some of the orphaned keys (not all to one neighbor)
    assert len({after[k] for k in moved}) > 1


def test_affinity_adding_an_instance_takes_keys_only_for_itself():
    keys = [f"prompt-{k}" for k in range(1000)]
    pre, dec = fleet({"p": 4}, {"d": 1})
    small = Router(pre, dec, policy="prefix_affinity")
    extra = inst("prefill", "p", 4)
    big = Router([*pre, extra], dec, policy="prefix_affinity")
    moved = [k for k in keys if small.pick_prefill(k) is not big.pick_prefill(k)]
    assert 100 < len(moved) < 350  # about a fifth
    assert all(big.pick_prefill(k) is extra for k in moved)


# -- affinity_key ----------------------------------------------------------------------------------------------


def test_affinity_key_prompt_forms():
    k = affinity_key({"prompt": "hello world"})
    assert isinstance(k, str) and int(k, 16) >= 0
    assert affinity_key({"prompt": ["hello world", "other"]}) == k
    assert affinity_key({"prompt": [1, 2, 3]}) == affinity_key({"prompt": "1,2,3,"})
    assert affinity_key({"prompt": [[1, 2, 3], [4]]}) == affinity_key({"prompt": [1, 2, 3]})
    chat = affinity_key({"messages": [{"role": "user", "content": "hello world"}]})
    assert chat not in (None, k)
    parts = affinity_key({"messages": [{"role": "user", "content": [{"type": "text", "text": "hello "},
                                                                    {"type": "text", "text": "world"}]}]})
    assert parts == chat
    assert affinity_key({"messages": [{"role": "system", "content": "hello world"}]}) != chat


def test_affinity_key_prefixes():
    base = "You are a helpful assistant. " * 20  # > 256 characters
    assert len(base) > 256
    assert affinity_key({"prompt": base + "question A"}) == affinity_key({"prompt": base + "question B"})
    assert affinity_key({"prompt": "x" + base}) != affinity_key({"prompt": "y" + base})
    assert affinity_key({"prompt": "ab"}) != affinity_key({"prompt": "ac"})
    assert affinity_key({"prompt": base[:100] + "A"}, prefix_chars=100) == affinity_key(
        {"prompt": base[:100] + "B"}, prefix_chars=100)
    assert affinity_key({"prompt": base[:99] + "A"}, prefix_chars=100) != affinity_key(
        {"prompt": base[:99] + "B"}, prefix_chars=100)
    toks = list(range(1000, 1100))  # "1000," is 5 chars: 256 chars = the first 51.2 tokens
    assert affinity_key({"prompt": toks}) == affinity_key({"prompt": toks[:52] + [7, 7, 7]})
    assert affinity_key({"prompt": toks}) != affinity_key({"prompt": toks[:40] + [7, 7, 7]})
    sysmsg = {"role": "system", "content": base}
    assert affinity_key({"messages": [sysmsg, {"role": "user", "content": "A"}]}) == affinity_key(
        {"messages": [sysmsg, {"role": "user", "content": "B"}]})
    short = {"role": "system", "content": "be brief"}
    assert affinity_key({"messages": [short, {"role": "user", "content": "A"}]}) != affinity_key(
        {"messages": [short, {"role": "user", "content": "B"}]})


def test_affinity_key_distinct_keys():
    keys = {affinity_key({"prompt": f"prompt number {i}"}) for i in range(1000)}
    assert len(keys) == 1000


@pytest.mark.parametrize("body", [
    {}, {"model": "m"}, {"prompt": ""}, {"prompt": []}, {"prompt": None}, {"prompt": 5}, {"messages": "hi"},
    {"messages": []},
])
def test_affinity_key_none_without_prompt(body):
    assert affinity_key(body) is None


def test_affinity_key_tolerates_odd_json():
    assert affinity_key({"prompt": "\ud800 lone surrogate"}) is not None
    assert affinity_key({"messages": [{"role": "assistant", "content": None}, "junk", {"content": 3}]}) is not None


# -- circuit breaker and fault-aware picks ------------------------------------------------------------------------

def test_breaker_opens_after_threshold_half_opens_and_closes():
    from pdctl.proxy.routing import Breaker

    b = Breaker(threshold=3, open_s=10)
    assert not b.failure(0) and not b.failure(1) and b.state(1) == "closed"
    assert b.failure(2) and b.state(2) == "open" and not b.allows(11.9)
    assert b.state(12.5) == "half_open" and b.allows(12.5)
    b.picked(12.5)
    assert not b.allows(12.6)  # one trial at a time
    assert b.failure(13) and b.state(13) == "open" and b.trips == 2  # a failed trial opens it again at once
    b.picked(30)
    b.success()
    assert b.state(30) == "closed" and b.failures == 0


def test_pick_skips_open_breakers_and_excluded_and_may_return_none():
    clock = [100.0]
    pre, dec = [Instance(f"prefill-{i}", f"http://p{i}", "prefill", "default") for i in range(2)], \
        [Instance("decode-0", "http://d", "decode", "default")]
    r = Router(pre, dec, clock=lambda: clock[0])
    pre[0].breaker.threshold = 1
    pre[0].breaker.failure(clock[0])
    assert all(r.pick_prefill() is pre[1] for _ in range(5))
    assert r.pick_prefill(exclude=[pre[1]], usable_only=True) is None
    assert r.pick_prefill(exclude=[pre[1]]) is pre[0]  # nowhere else to go: tried anyway
    pre[1].healthy = False  # a missed probe only: still tried when nothing healthy is left
    assert r.pick_prefill(usable_only=True) is pre[1]
    pre[1].refused = True  # nothing listens there: down
    assert r.pick_prefill(usable_only=True) is None
    clock[0] += 11  # half-open: the trial goes to pre[0]
    assert r.pick_prefill(usable_only=True) is pre[0] and r.pick_prefill(usable_only=True) is None
    clock[0] += 11  # a trial with no verdict (its client went away) is given up after open_s
    assert r.pick_prefill(usable_only=True) is pre[0]
    pre[0].breaker.release()
    assert r.pick_prefill(usable_only=True) is pre[0]


def test_decode_only_fallback_picks_any_paired_decode_or_the_pinned_pool():
    pre = [Instance("prefill-p-0", "http://p", "prefill", "p")]
    dec = [Instance("decode-a-0", "http://a", "decode", "a"), Instance("decode-b-0", "http://b", "decode", "b")]
    r = Router(pre, dec)
    assert {r.pick_decode(None).name for _ in range(4)} == {"decode-a-0", "decode-b-0"}
    assert {r.pick_decode(None, pin=("p", "b")).name for _ in range(4)} == {"decode-b-0"}


def test_aggregated_routing_spreads_requests_over_every_instance_under_the_policy():
    _, dec = fleet({}, {"a": 2, "b": 1})
    r = Router([], dec, "round_robin")
    picks = [r.pick_decode(None).name for _ in range(6)]
    assert sorted(set(picks)) == sorted(i.name for i in dec) and picks[:3] != picks[:1] * 3
    assert r.pairs == [] and r.pick_prefill() is None
