"""pdctl.kv.window: token-aligned pairing of sliding-window block-list tails, checked by simulating the reads.

The KV is modelled as token payloads: slot t of prefill block id holds token (absolute block * block size + t) + 1
(0 is a zeroed slot). Reads copy payloads as NIXL would (sub-blocks, decode-sized chunks of whole prefill blocks),
then the plan's zeroing applies; every slot of the decode's list must then hold its own token where the prefill
had it and zero everywhere else.
"""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pdctl.kv.index import merge_tail, pair_past_prefix_hit, split_plan, split_staging_needed, split_tail
from pdctl.kv.window import (
    WindowFill,
    window_covers,
    window_pairs,
    window_span,
    window_split_plan,
    window_staging_needed,
)

STALE = -1  # a decode slot's bytes from another request
PAST = -2  # a prefill slot past the prompt (whatever that block held)
STAGING = 10_000  # staging block ids start here (decode ids stay below)


def cdiv(a, b):
    return -(-a // b)


# -- the simulation -------------------------------------------------------------------------------------------


class Sim:
    """One request's sliding-window group on both sides, and the reads NIXL makes."""

    def __init__(self, s):
        self.s = s
        bp, bd = s["prefill_block"], s["decode_block"]
        self.pre = {b: [t + 1 if t < s["tokens"] else PAST for t in range((s["remote_first"] + i) * bp,
                                                                            (s["remote_first"] + i + 1) * bp)]
                    for i, b in enumerate(s["remote"])}
        self.dec = {b: [STALE] * bd for b in s["local"]}
        self.staged: dict[int, list[int]] = {}
        self.read: set[int] = set()  # prefill blocks read
        self.written: list[int] = []  # decode (or staging) block writes, by sub-block or chunk

    def merge_read(self, local_subs, remote_ids, ratio):
        """P <= D: NIXL reads prefill block remote_ids[i] whole into decode sub-block local_subs[i]."""
        bp = self.s["prefill_block"]
        assert len(local_subs) == len(remote_ids)
        assert len(set(local_subs)) == len(local_subs)  # no sub-block written twice
        for sub, rid in zip(local_subs, remote_ids, strict=True):
            block, j = divmod(sub, ratio)
            assert rid in self.pre, f"read prefill block {rid} outside its list"
            assert block in self.dec, f"wrote decode block {block} outside its list"
            self.read.add(rid)
            self.written.append(sub)
            self.dec[block][j * bp : (j + 1) * bp] = self.pre[rid]

    def split_read(self, chunks, ratio):
        """P >= D: whole prefill blocks as `ratio` decode-sized chunks (split_in_place needs them whole)."""
        bd = self.s["decode_block"]
        assert len(chunks) % ratio == 0
        for at in range(0, len(chunks), ratio):
            whole = chunks[at : at + ratio]
            rid = whole[0].src // ratio
            assert [c.src for c in whole] == [rid * ratio + c for c in range(ratio)], "a prefill block read in part"
            assert rid in self.pre, f"read prefill block {rid} outside its list"
            self.read.add(rid)
        dests = [c.dest for c in chunks]
        assert len(set(dests)) == len(dests)  # every chunk to its own block, each staging block used once
        for c in chunks:
            payload = self.pre[c.src // ratio][(c.src % ratio) * bd : (c.src % ratio + 1) * bd]
            if c.dest in self.dec:
                assert c.real
                self.dec[c.dest] = list(payload)
            else:
                assert not c.real and c.dest >= STAGING, f"wrote decode block {c.dest} outside its list"
                self.staged[c.dest] = list(payload)
            self.written.append(c.dest)

    def zero(self, fills):
        for f in fills:
            for a, b in f.zero:
                self.dec[f.id][a:b] = [0] * (b - a)

    def violations(self):
        """Slots breaking the contract: a needed token not the prefill's, a slot past the prompt or the prefill's
        list not zero, a slot before the needed ones neither its token nor zero."""
        s = self.s
        bd, tokens, need_from = s["decode_block"], s["tokens"], s["need_from"]
        held = window_span(s["remote_first"], len(s["remote"]), s["prefill_block"])
        bad = []
        for i, b in enumerate(s["local"]):
            for slot, got in enumerate(self.dec[b]):
                t = (s["local_first"] + i) * bd + slot
                if t >= tokens or t not in held:
                    ok = got == 0
                elif t >= need_from:
                    ok = got == t + 1
                else:
                    ok = got in (0, t + 1)
                if not ok:
                    bad.append((b, slot, t, got))
        return bad

    def exact(self):
        """What the window plans leave: every prompt token the prefill's list holds, zero elsewhere."""
        s = self.s
        bd, tokens = s["decode_block"], s["tokens"]
        held = window_span(s["remote_first"], len(s["remote"]), s["prefill_block"])
        return {b: [t + 1 if t < tokens and t in held else 0
                    for t in range((s["local_first"] + i) * bd, (s["local_first"] + i + 1) * bd)]
                for i, b in enumerate(s["local"])}


def covered(s):
    """The test's own coverage rule: both lists hold every token of [need_from, tokens)."""
    if s["need_from"] >= s["tokens"]:
        return True
    dec = window_span(s["local_first"], len(s["local"]), s["decode_block"])
    pre = window_span(s["remote_first"], len(s["remote"]), s["prefill_block"])
    return all(t in dec and t in pre for t in (s["need_from"], s["tokens"] - 1))


def args(s):
    return {k: s[k] for k in ("local_first", "remote_first", "prefill_block", "decode_block", "tokens",
                              "need_from")}


def run_merge(s):
    plan = window_pairs(s["local"], s["remote"], **args(s))
    if plan is None:
        return None, None
    sim = Sim(s)
    sim.merge_read(plan.local, plan.remote, plan.ratio)
    sim.zero(plan.fills)
    return plan, sim


def run_split(s):
    need = window_staging_needed(s["local"], s["remote"], **args(s))
    if need is None:
        assert window_split_plan(s["local"], s["remote"], **args(s)) is None
        return None, None, None
    staging = list(range(STAGING, STAGING + need))
    plan = window_split_plan(s["local"], s["remote"], staging=staging, **args(s))
    sim = Sim(s)
    sim.split_read(plan.chunks, plan.ratio)
    sim.zero(plan.fills)
    return plan, sim, staging


def assert_fills(s, fills):
    """The fills follow the decode's list, and say exactly which slots hold a token."""
    bd = s["decode_block"]
    exact = Sim(s).exact()
    assert [f.id for f in fills] == list(s["local"])
    assert [f.block for f in fills] == list(range(s["local_first"], s["local_first"] + len(s["local"])))
    for f in fills:
        start, stop = f.received
        assert [slot for slot, v in enumerate(exact[f.id]) if v] == list(range(start, stop))
        zeroed = sorted(slot for a, b in f.zero for slot in range(a, b))
        assert zeroed == [slot for slot in range(bd) if not start <= slot < stop]  # each slot once, all others
        assert f.whole == (start == stop) and all(a < b for a, b in f.zero)


# -- examples (docs/notes/hybrid-attention-research.md, Q3: N=300, window 64) --------------------------------

MERGE_EXAMPLE = dict(local=[10, 11], remote=[70, 71, 72], local_first=1, remote_first=7, prefill_block=32,
                     decode_block=128, tokens=300, need_from=236)  # P blocks 7-9: 224-319; D blocks 1-2: 128-383
SPLIT_EXAMPLE = dict(local=[10, 11, 12], remote=[70, 71], local_first=7, remote_first=1, prefill_block=128,
                     decode_block=32, tokens=300, need_from=236)  # P blocks 1-2: 128-383; D blocks 7-9: 224-319


def test_merge_example_pairs_by_tokens():
    plan, sim = run_merge(MERGE_EXAMPLE)
    # D sub-blocks 7, 8, 9 (tokens 224..319) are sub-block 3 of block 10 and sub-blocks 0, 1 of block 11.
    assert plan.local == (43, 44, 45) and plan.remote == (70, 71, 72)
    assert plan.fills == (WindowFill(10, 1, (96, 128), ((0, 96),)), WindowFill(11, 2, (0, 44), ((44, 128),)))
    assert sim.violations() == [] and sim.dec == sim.exact()


def test_split_example_reads_by_tokens():
    assert window_staging_needed(SPLIT_EXAMPLE["local"], SPLIT_EXAMPLE["remote"], **args(SPLIT_EXAMPLE)) == 5
    plan, sim, staging = run_split(SPLIT_EXAMPLE)
    # P block 1 = D blocks 4..7 (4..6 off the decode's list), P block 2 = D blocks 8..11 (10, 11 past the prompt).
    assert [c.block for c in plan.chunks] == list(range(4, 12))
    assert plan.remote_ids() == [280, 281, 282, 283, 284, 285, 286, 287]
    assert plan.local_ids() == [10_000, 10_001, 10_002, 10, 11, 12, 10_003, 10_004]
    assert plan.staging() == staging and plan.prefill_blocks() == 2
    assert [f.zero for f in plan.fills] == [(), (), ((12, 32),)]  # block 9 holds tokens 288..299
    assert sim.violations() == [] and sim.dec == sim.exact()


def test_equal_blocks_shifted_tails():
    # P == D, but the prefill's tail starts one block earlier and the decode's reaches past the prompt.
    s = dict(local=[5, 6, 7], remote=[50, 51, 52], local_first=3, remote_first=2, prefill_block=32, decode_block=32,
             tokens=150, need_from=100)
    merge, sim = run_merge(s)
    assert merge.local == (5, 6) and merge.remote == (51, 52)  # D block 3 <- P block 3, 4 <- 4; block 5 past N
    assert [f.zero for f in merge.fills] == [(), ((22, 32),), ((0, 32),)]
    assert sim.dec == sim.exact()
    split, sim, staging = run_split(s)
    assert staging == [] and split.remote_ids() == [51, 52] and split.local_ids() == [5, 6]
    assert split.fills == merge.fills and sim.dec == sim.exact()


def test_refusals():
    # The decode's tail starts past the first needed token; the prefill's ends before the prompt does.
    assert window_pairs(**{**MERGE_EXAMPLE, "local": [11], "local_first": 2}) is None
    assert window_pairs(**{**MERGE_EXAMPLE, "remote": [70, 71], "remote_first": 7}) is None
    assert window_pairs(**{**MERGE_EXAMPLE, "need_from": 223}) is None  # the prefill's list starts at 224
    assert window_pairs(**{**MERGE_EXAMPLE, "need_from": 224}) is not None
    split = {**SPLIT_EXAMPLE, "remote": [71], "remote_first": 2}  # the prefill holds 256..383 only
    assert window_staging_needed(**split) is None and window_split_plan(**split) is None
    with pytest.raises(ValueError, match="needs 0 staging blocks, got 1"):
        window_split_plan(**split, staging=[STAGING])


def test_arguments_checked():
    with pytest.raises(ValueError, match="needs 5 staging blocks, got 0"):
        window_split_plan(**SPLIT_EXAMPLE)
    with pytest.raises(ValueError, match="not a multiple"):
        window_pairs(**{**MERGE_EXAMPLE, "prefill_block": 128, "decode_block": 32})
    with pytest.raises(ValueError, match="not a multiple"):
        window_staging_needed(**{**SPLIT_EXAMPLE, "prefill_block": 32, "decode_block": 128})
    with pytest.raises(ValueError, match="no such block list"):
        window_span(-1, 2, 32)
    assert window_covers(range(0), 10, 10) and not window_covers(range(32, 64), 31, 40)


# -- the negative control: start-aligned pairing (vLLM's and pdctl.kv.index's) on shifted tails -----------------


def start_aligned_merge(s):
    """P < D as vLLM reads it: the decode's sub-blocks from its list's start, clipped to the prefill's count
    (pair_past_prefix_hit with no prefix hit leaves it), the prefill's list end-trimmed to as many; then the
    covered sub-blocks merged and the rest zeroed (merge_tail)."""
    r = s["decode_block"] // s["prefill_block"]
    subs = [x * r + j for x in s["local"] for j in range(r)][: len(s["remote"])]
    (subs,), (remote,) = pair_past_prefix_hit([subs], [list(s["remote"])], (), r)
    remote = remote[len(remote) - len(subs) :]
    sim = Sim(s)
    sim.merge_read(subs, remote, r)
    written, zero_from = merge_tail(len(subs), r, s["decode_block"])
    sim.zero([WindowFill(b, 0, (0, 0), ((zero_from, s["decode_block"]),) if i == written - 1 and zero_from
                         else () if i < written else ((0, s["decode_block"]),)) for i, b in enumerate(s["local"])])
    return sim, s["remote_first"] + len(s["remote"]) - len(subs) - s["local_first"] * r  # its shift, sub-blocks


def start_aligned_split(s):
    """P > D as pdctl.kv.index.split_plan reads it: the decode's list taken as request blocks 0, 1, ...; the
    prompt's tail zeroed by split_tail at those (wrong) blocks."""
    r = s["prefill_block"] // s["decode_block"]
    shape = dict(ratio=r, block_size=s["decode_block"], tokens=s["tokens"])
    need = split_staging_needed([s["local"]], [s["remote"]], **shape)
    plan = split_plan([s["local"]], [s["remote"]], staging=list(range(STAGING, STAGING + need)), **shape)
    sim = Sim(s)
    chunks = plan.groups[0]
    sim.split_read(chunks, r)
    tail = split_tail([c.block for c in chunks], s["decode_block"], s["tokens"])
    if tail is not None and chunks[tail[0]].real:
        sim.dec[chunks[tail[0]].dest][tail[1] :] = [0] * (s["decode_block"] - tail[1])
    return sim, s["remote_first"] * r - s["local_first"]  # its shift, decode blocks


def test_start_aligned_pairing_fails_the_examples():
    sim, shift = start_aligned_merge(MERGE_EXAMPLE)
    # vLLM pairs D tokens 128..223 with P tokens 224..319 and zeroes D 224..383 (the needed 236..299 with them).
    assert shift == 3 and sim.dec[10] == list(range(225, 301)) + [PAST] * 20 + [0] * 32 and sim.dec[11] == [0] * 128
    # Block 1: 128..223 not the prefill's to give, 236..255 zeroed; block 2: 256..299 zeroed.
    assert len(sim.violations()) == 96 + 20 + 44
    sim, shift = start_aligned_split(SPLIT_EXAMPLE)
    # split_plan reads P tokens 128..223 into D blocks 7..9 (tokens 224..319) and zeroes nothing.
    assert shift == -3 and sim.dec[10] == list(range(129, 161)) and sim.violations()


# -- properties -----------------------------------------------------------------------------------------------

SIZES = (16, 32, 64, 128)


@st.composite
def window_reads(draw, merge: bool):
    """A sliding-window group's two tails, around a needed range: each list starts at or before the first needed
    token's block (sometimes one block past it) and ends at the prompt's last block (sometimes one before, or
    past it: lookahead); distinct random block ids."""
    small, big = sorted((draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))))
    bp, bd = (small, big) if merge else (big, small)
    tokens = draw(st.integers(1, 2000))
    need_from = draw(st.integers(0, tokens - 1))

    def tail(block):
        back = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3, -1, 1 << 20]))  # -1: past need_from's block; 1 << 20: 0
        first = max(0, need_from // block - back)
        end = cdiv(tokens, block) + draw(st.sampled_from([0, 0, 0, 0, 1, 2, -1]))  # -1: before the prompt's end
        ids = draw(st.lists(st.integers(0, STAGING - 1), min_size=max(0, end - first),
                            max_size=max(0, end - first), unique=True))
        return first, ids

    lf, local = tail(bd)
    rf, remote = tail(bp)
    return dict(local=local, remote=remote, local_first=lf, remote_first=rf, prefill_block=bp, decode_block=bd,
                tokens=tokens, need_from=need_from)


@st.composite
def vllm_tails(draw, merge: bool):
    """The tails vLLM keeps (get_exchange_clipped_blocks): cdiv(window, B) + 1 blocks ending at the prompt's last
    block, on each side by its own block size; the decode needs the window's tokens."""
    small, big = sorted((draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))))
    bp, bd = (small, big) if merge else (big, small)
    tokens, window = draw(st.integers(1, 2000)), draw(st.integers(1, 1000))

    def tail(block):
        n = min(cdiv(window, block) + 1, cdiv(tokens, block))
        return cdiv(tokens, block) - n, draw(st.lists(st.integers(0, STAGING - 1), min_size=n, max_size=n,
                                                      unique=True))

    lf, local = tail(bd)
    rf, remote = tail(bp)
    return dict(local=local, remote=remote, local_first=lf, remote_first=rf, prefill_block=bp, decode_block=bd,
                tokens=tokens, need_from=max(0, tokens - window))


def check_merge(s):
    plan, sim = run_merge(s)
    assert (plan is None) == (not covered(s))
    if plan is None:
        return
    assert sim.violations() == [] and sim.dec == sim.exact()
    assert_fills(s, plan.fills)
    # Every prefill block of its list that holds a prompt token and has a decode sub-block is read, once.
    r = plan.ratio
    want = {b for i, b in enumerate(s["remote"]) if (s["remote_first"] + i) * s["prefill_block"] < s["tokens"]
            and s["local_first"] * r <= s["remote_first"] + i < (s["local_first"] + len(s["local"])) * r}
    assert sim.read == want and len(plan.remote) == len(want)


def check_split(s):
    plan, sim, staging = run_split(s)
    assert (plan is None) == (not covered(s))
    if plan is None:
        return
    assert sim.violations() == [] and sim.dec == sim.exact()
    assert_fills(s, plan.fills)
    r, lf, nl = plan.ratio, s["local_first"], len(s["local"])
    assert plan.staging() == staging and set(sim.staged) == set(staging)  # each given staging block used once
    assert plan.local_ids() == [c.dest for c in plan.chunks] and plan.remote_ids() == [c.src for c in plan.chunks]
    assert [c.block for c in plan.chunks] == list(range(plan.chunks[0].block, plan.chunks[0].block
                                                        + len(plan.chunks))) if plan.chunks else True
    for c in plan.chunks:  # chunk v % r of prefill absolute block v // r, into v's block when the decode holds it
        assert c.src == s["remote"][c.block // r - s["remote_first"]] * r + c.block % r
        assert c.real == (lf <= c.block < lf + nl) and (not c.real or c.dest == s["local"][c.block - lf])
    # Exactly the prefill blocks of its list holding a decode block of the decode's list with a prompt token.
    want = {s["remote"][v // r - s["remote_first"]] for v in range(lf, lf + nl)
            if v * s["decode_block"] < s["tokens"] and 0 <= v // r - s["remote_first"] < len(s["remote"])}
    assert sim.read == want and plan.prefill_blocks() == len(want)


@settings(max_examples=500, deadline=None)
@given(window_reads(merge=True))
def test_merge_puts_every_token_where_it_belongs(s):
    check_merge(s)


@settings(max_examples=500, deadline=None)
@given(window_reads(merge=False))
def test_split_puts_every_token_where_it_belongs(s):
    check_split(s)


@settings(max_examples=300, deadline=None)
@given(st.booleans().flatmap(vllm_tails))
def test_vllm_tails_are_never_refused(s):
    assert covered(s)  # the decode's and the prefill's tails both reach back to the window's start
    if s["prefill_block"] <= s["decode_block"]:
        check_merge(s)
    if s["prefill_block"] >= s["decode_block"]:
        check_split(s)


@settings(max_examples=300, deadline=None)
@given(st.booleans().flatmap(window_reads))
def test_start_aligned_pairing_of_shifted_tails_is_caught(s):
    """The simulation catches the pairing this module replaces: whenever the start-aligned pairing is shifted
    against the tokens, some slot of the decode's list breaks the contract."""
    assume(covered(s))
    if s["prefill_block"] <= s["decode_block"]:
        sim, shift = start_aligned_merge(s)
    else:
        sim, shift = start_aligned_split(s)
    assert (shift != 0) <= bool(sim.violations())
