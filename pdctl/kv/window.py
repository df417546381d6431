"""Which block goes where for a sliding-window KV cache group: token-aligned pairing of two block-list tails.

Under vLLM's hybrid KV cache manager each side keeps only a TAIL of a sliding-window group's blocks, sized by its
own block size: the prefill's list for the group holds absolute prefill blocks [remote_first, remote_first +
len(remote)) and the decode's list absolute decode blocks [local_first, local_first + len(local)), where absolute
block k of size B holds tokens [k*B, (k+1)*B) of the request. The two tails start at different tokens whenever
the block sizes differ (and may when they are equal), so pairing them from their starts, as vLLM and
pdctl.kv.index do for full-attention groups, puts the wrong tokens in the decode's blocks
(docs/notes/hybrid-attention-research.md, Q3). Here every pair is chosen by absolute token range instead.

Pure functions of explicit arguments, no torch, no vLLM; the connector computes the firsts and `need_from` (the
first token the decode needs: the window's start, past anything the decode already holds).
tests/unit/kv/test_window.py pins every rule by simulating the reads on token payloads.

- prefill block < decode block (`window_pairs`): NIXL reads prefill blocks into decode sub-blocks (decode block id
  x has sub-blocks x*ratio + j), each sub-block taking the prefill block of the same absolute tokens;
- prefill block > decode block (`window_staging_needed`, `window_split_plan`): whole prefill blocks are read as
  decode-sized chunks (like pdctl.kv.index.split_plan), each landing in its decode block or in a staging block;
- equal block sizes work with either (ratio 1).

Both give, per decode block of the list, the token slots that received the prompt's tokens and the slot ranges to
zero after the read: the prompt's end (slots >= tokens) and whatever the prefill no longer holds. Sliding-window
blocks loaded from outside are not zeroed by vLLM, so a slot left alone would keep another request's KV. Both
refuse (None) when some needed token is on neither list: the caller fails the load and vLLM recomputes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdctl.kv.index import SplitChunk


def window_span(first: int, count: int, block_size: int) -> range:
    """The absolute tokens held by `count` blocks of `block_size` tokens starting at absolute block `first`."""
    if first < 0 or count < 0 or block_size <= 0:
        raise ValueError(f"no such block list: first {first}, count {count}, block size {block_size}")
    return range(first * block_size, (first + count) * block_size)


def window_covers(span: range, need_from: int, tokens: int) -> bool:
    """Whether `span` holds every token of [need_from, tokens) (nothing needed: True)."""
    return max(need_from, 0) >= tokens or (span.start <= max(need_from, 0) and tokens <= span.stop)


@dataclass(frozen=True)
class WindowFill:
    """What one decode block of the group's list holds after the read, in its own token slots [0, block size)."""

    id: int  # the decode block id
    block: int  # its absolute decode block index (tokens block * block size ...)
    received: tuple[int, int]  # slots [start, stop) holding the prompt's tokens from the prefill; (0, 0): none
    zero: tuple[tuple[int, int], ...]  # slot ranges [start, stop) to zero after the read: every other slot

    @property
    def whole(self) -> bool:
        """Nothing received: the whole block is zeroed (no merge or split to apply to it)."""
        return self.received[0] == self.received[1]


def _fills(local: Sequence[int], local_first: int, block_size: int, got: range) -> tuple[WindowFill, ...]:
    """Per decode block of the list: the slots inside `got` (the absolute tokens read, all below the prompt's
    end) are received, the rest zeroed. `got` is one interval, so a block receives one run of slots."""
    fills = []
    for i, block_id in enumerate(local):
        lo = (local_first + i) * block_size
        start, stop = max(lo, got.start), min(lo + block_size, got.stop)
        if start >= stop:
            fills.append(WindowFill(block_id, local_first + i, (0, 0), ((0, block_size),)))
            continue
        zero = tuple((a, b) for a, b in ((0, start - lo), (stop - lo, block_size)) if a < b)
        fills.append(WindowFill(block_id, local_first + i, (start - lo, stop - lo), zero))
    return tuple(fills)


def _read_tokens(remote_first: int, n_remote: int, prefill_block: int, tokens: int) -> range:
    """The prompt's tokens the prefill's list holds (what the decode can receive)."""
    span = window_span(remote_first, n_remote, prefill_block)
    return range(span.start, max(span.start, min(span.stop, tokens)))


def _covered(local: Sequence[int], remote: Sequence[int], *, local_first: int, remote_first: int,
             prefill_block: int, decode_block: int, tokens: int, need_from: int) -> bool:
    """Both lists hold every needed token."""
    return (window_covers(window_span(local_first, len(local), decode_block), need_from, tokens)
            and window_covers(window_span(remote_first, len(remote), prefill_block), need_from, tokens))


def _ratio(big: int, small: int, what: str) -> int:
    if small <= 0 or big % small:
        raise ValueError(f"{what}: block {big} is not a multiple of block {small}")
    return big // small


# -- prefill block <= decode block ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WindowMerge:
    """A P <= D read of one sliding-window group: NIXL reads remote[i] into decode sub-block local[i]."""

    ratio: int  # decode block / prefill block: sub-blocks per decode block
    local: tuple[int, ...]  # decode sub-block ids (decode block id * ratio + j), in token order
    remote: tuple[int, ...]  # the prefill block ids read into them, pairwise
    fills: tuple[WindowFill, ...]  # per decode block of the list, in list order: merge the received, zero the rest


def window_pairs(local: Sequence[int], remote: Sequence[int], *, local_first: int, remote_first: int,
                 prefill_block: int, decode_block: int, tokens: int, need_from: int) -> WindowMerge | None:
    """Pair a sliding-window group's decode sub-blocks with the prefill blocks of the same tokens (P <= D).

    local: the decode's block ids for the group, absolute blocks from `local_first`; remote: the prefill's, from
    `remote_first`; tokens: the prompt's; need_from: the first token the decode needs. Decode absolute sub-block
    s (= local_first * ratio + i) takes prefill absolute block s when the prefill's list holds it and it holds a
    prompt token. None when a token of [need_from, tokens) is on neither list.
    """
    ratio = _ratio(decode_block, prefill_block, "prefill block <= decode block")
    if not _covered(local, remote, local_first=local_first, remote_first=remote_first,
                    prefill_block=prefill_block, decode_block=decode_block, tokens=tokens, need_from=need_from):
        return None
    first_sub = local_first * ratio
    # The sub-blocks both lists hold below the prompt's end (an empty range when the tails do not meet).
    lo = max(first_sub, remote_first)
    hi = min(first_sub + len(local) * ratio, remote_first + len(remote), -(-tokens // prefill_block))
    subs = range(lo, max(lo, hi))
    pairs_local = tuple(local[(s - first_sub) // ratio] * ratio + (s - first_sub) % ratio for s in subs)
    pairs_remote = tuple(remote[s - remote_first] for s in subs)
    got = _read_tokens(remote_first, len(remote), prefill_block, tokens)
    return WindowMerge(ratio, pairs_local, pairs_remote, _fills(local, local_first, decode_block, got))


# -- prefill block >= decode block ---------------------------------------------------------------------------


@dataclass(frozen=True)
class WindowSplit:
    """A P >= D read of one sliding-window group: whole prefill blocks as `ratio` decode-sized chunks each.

    The chunks are pdctl.kv.index.SplitChunk with `block` the ABSOLUTE decode block; they can stand as one group
    of a SplitPlan (split_in_place them `ratio` at a time, keep the real ones), then zero as `fills` say.
    """

    ratio: int  # prefill block / decode block
    chunks: tuple[SplitChunk, ...]  # in token order, whole prefill blocks
    fills: tuple[WindowFill, ...]  # per decode block of the list, in list order: what it holds, what to zero

    def local_ids(self) -> list[int]:
        """The decode blocks (or staging blocks) the chunks are read into."""
        return [c.dest for c in self.chunks]

    def remote_ids(self) -> list[int]:
        """The decode-sized prefill chunks read (prefill block id * ratio + chunk)."""
        return [c.src for c in self.chunks]

    def staging(self) -> list[int]:
        """The staging blocks the plan holds (release once the read is done)."""
        return [c.dest for c in self.chunks if not c.real]

    def prefill_blocks(self) -> int:
        """How many whole prefill blocks are read."""
        return len(self.chunks) // self.ratio


def _split_read(n_local: int, n_remote: int, *, local_first: int, remote_first: int, ratio: int,
                decode_block: int, tokens: int) -> range:
    """The absolute prefill blocks read: those on the prefill's list that hold a decode block of the list with a
    prompt token (one interval: both lists and the prompt are intervals)."""
    last = min(local_first + n_local, -(-tokens // decode_block))  # past the decode's last block with a token
    if last <= local_first:
        return range(0)
    lo, hi = max(local_first // ratio, remote_first), min((last - 1) // ratio + 1, remote_first + n_remote)
    return range(lo, max(lo, hi))


def window_staging_needed(local: Sequence[int], remote: Sequence[int], *, local_first: int, remote_first: int,
                          prefill_block: int, decode_block: int, tokens: int, need_from: int) -> int | None:
    """How many staging blocks `window_split_plan` needs: the chunks of the prefill blocks read whose decode block
    is not on the decode's list (before its tail, or past its end). None: the load is refused (nothing to take)."""
    ratio = _ratio(prefill_block, decode_block, "prefill block >= decode block")
    if not _covered(local, remote, local_first=local_first, remote_first=remote_first,
                    prefill_block=prefill_block, decode_block=decode_block, tokens=tokens, need_from=need_from):
        return None
    read = _split_read(len(local), len(remote), local_first=local_first, remote_first=remote_first, ratio=ratio,
                       decode_block=decode_block, tokens=tokens)
    on_list = range(local_first, local_first + len(local))
    return sum(1 for u in read for v in range(u * ratio, (u + 1) * ratio) if v not in on_list)


def window_split_plan(local: Sequence[int], remote: Sequence[int], *, local_first: int, remote_first: int,
                      prefill_block: int, decode_block: int, tokens: int, need_from: int,
                      staging: Sequence[int] = ()) -> WindowSplit | None:
    """Read a sliding-window group's prefill blocks whole, as decode-sized chunks, by absolute tokens (P >= D).

    Arguments as `window_pairs`; staging: exactly `window_staging_needed(...)` free staging block ids, used in
    order. Decode absolute block v is chunk v % ratio of prefill absolute block v // ratio; it lands in v's block
    when the decode's list holds v, else in a staging block. None when a token of [need_from, tokens) is on
    neither list (then staging must be empty: `window_staging_needed` said None).
    """
    need = window_staging_needed(local, remote, local_first=local_first, remote_first=remote_first,
                                 prefill_block=prefill_block, decode_block=decode_block, tokens=tokens,
                                 need_from=need_from)
    if len(staging) != (need or 0):
        raise ValueError(f"window split plan needs {need or 0} staging blocks, got {len(staging)}")
    if need is None:
        return None
    ratio = prefill_block // decode_block
    read = _split_read(len(local), len(remote), local_first=local_first, remote_first=remote_first, ratio=ratio,
                       decode_block=decode_block, tokens=tokens)
    spare = iter(staging)
    chunks = []
    for u in read:
        for c in range(ratio):
            v = u * ratio + c
            real = local_first <= v < local_first + len(local)
            chunks.append(SplitChunk(src=remote[u - remote_first] * ratio + c,
                                     dest=local[v - local_first] if real else next(spare), block=v, real=real))
    got = _read_tokens(remote_first, len(remote), prefill_block, tokens)
    return WindowSplit(ratio, tuple(chunks), _fills(local, local_first, decode_block, got))
