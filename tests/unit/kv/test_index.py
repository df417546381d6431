"""pdctl.kv.index: the connector's index decisions (P > D split plan, staging pool, P < D prefix-hit pairing, tail
positions), as examples and as properties over random requests."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.kv.index import (
    SplitChunk,
    StagingPool,
    merge_tail,
    pair_past_prefix_hit,
    split_plan,
    split_staging_needed,
    split_tail,
)


def plan(local, remote, tokens, *, pool, ratio=2, block_size=32, cached=()):
    """What the connector does for one request: count the staging, take it, plan (None: staging full)."""
    shape = dict(ratio=ratio, block_size=block_size, tokens=tokens, cached=cached)
    need = split_staging_needed([local], [remote], **shape)
    staging = pool.take(need) if need else []
    return None if staging is None else split_plan([local], [remote], staging=staging, **shape)


def reals(p):
    """Per prefill block read, which of its chunks land in one of the request's decode blocks."""
    chunks = p.groups[0]
    return [[c.real for c in chunks[i : i + p.ratio]] for i in range(0, len(chunks), p.ratio)]


# -- the connector's cases (P64 -> D32, staging: the last 8 of 100 blocks) ------------------------------------


def test_partial_last_prefill_block_reads_its_missing_chunk_into_staging():
    pool = StagingPool.last_blocks(100, 8)
    p = plan([10, 11, 12], [5, 6], 70, pool=pool)  # 70 tokens = 3 decode blocks
    assert p.remote_ids() == [[10, 11, 12, 13]]  # prefill blocks 5, 6 as decode-sized chunks
    assert p.local_ids() == [[10, 11, 12, 92]]  # chunk 13 has no decode block: staging (92..99)
    assert p.tokens == 70 and reals(p) == [[True, True], [True, False]]
    assert p.groups[0][-1] == SplitChunk(src=13, dest=92, block=3, real=False)
    pool.release(p.staging())
    assert pool.free == 8 and sorted(pool.take(8)) == list(range(92, 100))


def test_decode_prefix_hit_inside_a_prefill_block():
    # The decode holds decode block 0 (tokens 0-31) from its own prefix cache.
    p = plan([11, 12], [5, 6], 70, pool=StagingPool.last_blocks(100, 8), cached=(1,))
    # Prefill block 5 is still read whole: its chunk 0 goes to staging (block 0 is cached and shared).
    assert p.remote_ids() == [[10, 11, 12, 13]]
    assert p.local_ids() == [[92, 11, 12, 93]]


def test_aligned_prompt_needs_no_staging_and_release_is_safe():
    pool = StagingPool.last_blocks(100, 8)
    assert split_staging_needed([[10, 11]], [[5]], ratio=2, block_size=32, tokens=64) == 0
    p = plan([10, 11], [5], 64, pool=pool)
    assert p.local_ids() == [[10, 11]] and p.staging() == [] and pool.free == 8
    pool.release(p.staging())  # nothing was taken: a no-op
    assert pool.free == 8


def test_staging_exhausted_falls_back_and_returns_what_it_took():
    pool = StagingPool.last_blocks(100, 1)
    assert plan([1, 2, 3], [5, 6], 70, pool=pool) is not None and pool.free == 0
    assert plan([7, 8, 9], [7, 8], 70, pool=pool) is None
    assert pool.free == 0  # b took nothing; a still holds the only slot


@pytest.mark.parametrize("tokens,expected_last", [(64, 2), (65, 3), (1, 1)])
def test_only_blocks_with_tokens_receive(tokens, expected_last):
    p = plan([10, 11, 12, 13], [5, 6], tokens, pool=StagingPool.last_blocks(100, 8))
    assert [c.dest for c in p.groups[0] if c.real] == [10, 11, 12, 13][:expected_last]


def test_split_plan_wants_exactly_the_staging_it_needs():
    with pytest.raises(ValueError, match="needs 1 staging blocks, got 0"):
        split_plan([[10, 11, 12]], [[5, 6]], ratio=2, block_size=32, tokens=70)


def test_split_tail_examples():
    assert split_tail([0, 1, 2, 3], 32, 70) == (2, 6)  # block 2 holds tokens 64..69: zero from slot 6
    assert split_tail([0, 1], 32, 64) is None  # the prompt ends on a block boundary
    assert split_tail([0, 1, 2, 3], 32, None) is None
    assert split_tail([0, 1, 2, 3], 32, 64) == (1, 32)  # a staging chunk past the prompt: nothing to zero in 1


def test_merge_tail_examples():
    assert merge_tail(5, 2, 64) == (3, 32)  # 5 sub-blocks of 32: 3 decode blocks, the last holds tokens 0..31
    assert merge_tail(4, 2, 64) == (2, None)
    assert merge_tail(0, 4, 64) == (0, None)


def test_pairing_examples():
    # P16 -> D32 (2 sub-blocks per decode block), 1 decode block cached, 5 remote blocks (tokens 0..79).
    # vLLM expands the 2 uncached decode blocks [7, 8] to sub-blocks [14, 15, 16, 17], clips to 5 (no-op).
    local, remote = pair_past_prefix_hit([[14, 15, 16, 17]], [[40, 41, 42, 43, 44]], (1,), 2)
    assert local == [[14, 15, 16]] and remote == [[40, 41, 42, 43, 44]]  # end-trim pairs 14 with 42 (tokens 32..47)
    assert pair_past_prefix_hit([[14, 15]], [[40, 41]], (1,), 2) == ([], [[40, 41]])  # all of it cached
    assert pair_past_prefix_hit([[14, 15]], [[40, 41]], (0,), 2) == ([[14, 15]], [[40, 41]])  # no hit: vLLM's
    assert pair_past_prefix_hit([], [[40]], (3,), 2) == ([], [[40]])  # vLLM's full prefix hit stays


# -- properties -----------------------------------------------------------------------------------------------


@st.composite
def split_requests(draw):
    ratio = draw(st.sampled_from([2, 3, 4, 8]))
    block_size = draw(st.sampled_from([1, 16, 32]))
    n_groups = draw(st.integers(1, 3))
    local = [draw(st.lists(st.integers(0, 999), max_size=12, unique=True)) for _ in range(n_groups)]
    remote = [draw(st.lists(st.integers(0, 99), max_size=6, unique=True)) for _ in range(n_groups)]
    tokens = draw(st.none() | st.integers(0, 14 * block_size * ratio))
    cached = tuple(draw(st.lists(st.integers(0, 10), max_size=n_groups + 1)))
    return local, remote, dict(ratio=ratio, block_size=block_size, tokens=tokens, cached=cached)


@settings(max_examples=400, deadline=None)
@given(split_requests())
def test_split_plan_reads_every_received_token_once_in_whole_prefill_blocks(req):
    local, remote, shape = req
    ratio, n, tokens, cached = shape["ratio"], shape["block_size"], shape["tokens"], shape["cached"]
    need = split_staging_needed(local, remote, **shape)
    staging = list(range(10_000, 10_000 + need))
    p = split_plan(local, remote, staging=staging, **shape)
    assert sorted(p.staging()) == staging  # every staging block given is used, once
    assert len(p.local_ids()) == len(p.remote_ids()) == len(local)
    for g, chunks in enumerate(p.groups):
        hit = cached[g] if g < len(cached) else 0
        # The decode blocks that receive: past the hit, within the allocation, the prefill's blocks and the prompt.
        end = min(hit + len(local[g]), len(remote[g]) * ratio, -(-tokens // n) if tokens is not None else 1 << 30)
        want = list(range(hit, end)) if local[g] else []
        assert [c.block for c in chunks if c.real] == want  # each exactly once, in token order
        assert all(c.dest == local[g][c.block - hit] for c in chunks if c.real)
        if tokens is not None:
            assert all(c.block * n < tokens for c in chunks if c.real)
        # Whole prefill blocks, consecutive, each as its `ratio` chunks in order.
        assert len(chunks) % ratio == 0 and p.prefill_blocks(g) == len(chunks) // ratio
        blocks = [c.block for c in chunks]
        assert blocks == list(range(blocks[0], blocks[0] + len(blocks))) if blocks else True
        assert all(c.block % ratio == i % ratio and c.src == remote[g][c.block // ratio] * ratio + c.block % ratio
                   for i, c in enumerate(chunks))
        if want:  # only prefill blocks holding a received decode block are read
            assert blocks[0] // ratio == want[0] // ratio and blocks[-1] // ratio == want[-1] // ratio
        else:
            assert chunks == ()
        tail = split_tail(blocks, n, tokens)
        if tail is not None:
            at, first = tail
            assert 0 < first <= n and chunks[at].block * n + first == tokens
            assert all(c.block * n >= tokens for c in chunks[at + 1 :])  # later chunks hold no token
        elif blocks and tokens is not None:
            assert (blocks[-1] + 1) * n <= tokens  # the plan ends inside the prompt: nothing to zero


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 16), st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_staging_pool_never_hands_out_an_id_twice(capacity, ops):
    pool = StagingPool.last_blocks(100, capacity)
    out: list[list[int]] = []
    for take, n in ops:
        if take:
            free = pool.free
            got = pool.take(n)
            if got is None:
                assert n > free and pool.free == free  # nothing taken
            else:
                assert len(got) == n and pool.free == free - n
                out.append(got)
        elif out:
            pool.release(out.pop(n % len(out)))
        held = [i for ids in out for i in ids]
        assert len(held) == len(set(held)) and all(100 - capacity <= i < 100 for i in held)
        assert pool.free + len(held) == pool.capacity == capacity
    held = [ids for ids in out if ids]
    if held:
        with pytest.raises(ValueError, match="not out"):
            pool.release(held[0] + held[0][:1])  # one id twice
        pool.release(held[0])
        with pytest.raises(ValueError, match="not out"):
            pool.release(held[0])  # already back
    with pytest.raises(ValueError, match="repeat"):
        StagingPool([1, 1])


@st.composite
def p_smaller_reads(draw):
    """A P < D read of one prompt as vLLM maps it: per group the uncached decode blocks' sub-blocks, clipped to the
    remote list (every prefill block of the prompt)."""
    sub = draw(st.integers(1, 4))  # sub-blocks (prefill blocks) per decode block
    p_block = draw(st.sampled_from([1, 16]))
    tokens = draw(st.integers(1, 8 * sub * p_block))
    n_groups = draw(st.integers(1, 3))
    cached = tuple(draw(st.lists(st.integers(0, -(-tokens // (sub * p_block))), max_size=n_groups + 1)))
    local, remote = [], []
    for g in range(n_groups):
        hit = cached[g] if g < len(cached) else 0
        n_local = max(0, -(-tokens // (sub * p_block)) - hit)  # the decode allocates the rest of the prompt
        blocks = draw(st.lists(st.integers(0, 200), min_size=n_local, max_size=n_local, unique=True))
        rem = list(range(1000 * (g + 1), 1000 * (g + 1) + -(-tokens // p_block)))
        local.append([b * sub + c for b in blocks for c in range(sub)][: len(rem)])
        remote.append(rem)
    if not any(local):
        local = []  # vLLM: a full prefix hit is an empty list
    return local, remote, cached, sub


@settings(max_examples=400, deadline=None)
@given(p_smaller_reads())
def test_prefix_hit_pairing_pairs_each_sub_block_with_its_own_tokens(read):
    local, remote, cached, sub = read
    out, rem = pair_past_prefix_hit(local, remote, cached, sub)
    assert rem is remote
    assert pair_past_prefix_hit(out, rem, cached, sub) == (out, rem)  # idempotent
    if not any(cached) or not local:
        assert out is local
        return
    assert out == [] or len(out) == len(local)
    for g, group in enumerate(out):
        skip = (cached[g] if g < len(cached) else 0) * sub
        assert group == local[g][: len(group)] and len(group) <= max(0, len(remote[g]) - skip)
        # vLLM end-trims the remote list to the local count: sub-block j then reads remote block skip + j.
        trimmed = remote[g][len(remote[g]) - len(group) :]
        assert trimmed == remote[g][skip : skip + len(group)]
        if local[g]:
            assert len(group) == min(len(local[g]), max(0, len(remote[g]) - skip))


@given(st.integers(0, 200), st.sampled_from([1, 2, 4, 8]), st.sampled_from([16, 32, 64]))
def test_merge_tail_bounds(covered, ratio, block_size):
    written, zero_from = merge_tail(covered, ratio, block_size)
    assert (written - 1) * ratio < covered <= written * ratio or written == covered == 0
    if covered % ratio == 0:
        assert zero_from is None
    else:
        assert 0 < zero_from < block_size and zero_from == (covered - (written - 1) * ratio) * (block_size // ratio)
