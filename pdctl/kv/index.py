"""Which block goes where: the connector's index decisions, as pure functions of explicit arguments.

No torch, no vLLM: block ids in, block ids out. The connector (pdctl.connector.nixl) only adapts vLLM's calls to
these and moves the bytes; the property tests (tests/unit/kv/test_index.py) pin every rule here.

- prefill block > decode block: `split_plan` reads every prefill block a request touches whole, as `ratio`
  decode-sized chunks, each chunk either landing in one of the request's decode blocks or in a staging block
  (`split_staging_needed` of them, taken from a `StagingPool`); after the read, `split_tail` says which chunk holds
  the prompt's last token and where in it the zeroing starts;
- prefill block < decode block: `pair_past_prefix_hit` corrects vLLM's sub-block pairing when the decode already
  holds prefix-cached blocks, and `merge_tail` says how many decode blocks received data and where the last one's
  uncovered tail starts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# -- prefill block > decode block ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitChunk:
    """One decode-sized chunk of a prefill block, as NIXL reads it."""

    src: int  # the chunk on the prefill: prefill block id * ratio + chunk index (the decode-sized remote id)
    dest: int  # the decode cache block it is read into
    block: int  # which of the request's decode blocks its tokens are (tokens block * block_size ...)
    real: bool  # dest is that decode block; False: dest is a staging block, dropped after the split


@dataclass(frozen=True)
class SplitPlan:
    """A request's P > D read: per KV group, whole prefill blocks as `ratio` chunks each, in token order."""

    ratio: int  # prefill block / decode block
    block_size: int  # decode block size (tokens)
    tokens: int | None  # the prompt's tokens (None: unknown, nothing is zeroed)
    groups: tuple[tuple[SplitChunk, ...], ...]

    def local_ids(self) -> list[list[int]]:
        """Per group, the decode blocks the chunks are read into (vLLM's local_physical_block_ids)."""
        return [[c.dest for c in chunks] for chunks in self.groups]

    def remote_ids(self) -> list[list[int]]:
        """Per group, the decode-sized prefill chunks read (vLLM's remote block_ids)."""
        return [[c.src for c in chunks] for chunks in self.groups]

    def staging(self) -> list[int]:
        """The staging blocks the plan holds, in chunk order (what to release once the read is done)."""
        return [c.dest for chunks in self.groups for c in chunks if not c.real]

    def prefill_blocks(self, group: int) -> int:
        """How many whole prefill blocks the group reads."""
        return len(self.groups[group]) // self.ratio


def _received_span(n_local: int, n_remote: int, ratio: int, block_size: int, tokens: int | None,
                   cached: int) -> range:
    """The request's decode blocks that receive data: past the decode's own prefix hit (`cached` blocks), as many
    as it allocated (`n_local`), and no further than the prefill's blocks and the prompt's tokens reach."""
    n_decode = n_remote * ratio
    if tokens is not None:
        n_decode = min(n_decode, -(-tokens // block_size))
    first, last = cached, min(cached + n_local, n_decode)
    return range(first, last) if n_local and first < last else range(0)


def _prefill_blocks(span: range, ratio: int) -> range:
    """The prefill blocks (request-relative) that hold the span's decode blocks."""
    return range(span.start // ratio, (span.stop - 1) // ratio + 1) if span else range(0)


def _cached(cached: Sequence[int], group: int) -> int:
    return cached[group] if group < len(cached) else 0


def split_staging_needed(local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], *, ratio: int,
                         block_size: int, tokens: int | None, cached: Sequence[int] = ()) -> int:
    """How many staging blocks `split_plan` needs: the chunks of the prefill blocks read that no decode block of
    the request takes (a partial first prefill block after a prefix hit, a partial last one)."""
    need = 0
    for g, loc in enumerate(local):
        span = _received_span(len(loc), len(remote[g]), ratio, block_size, tokens, _cached(cached, g))
        need += len(_prefill_blocks(span, ratio)) * ratio - len(span)
    return need


def split_plan(local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], *, ratio: int, block_size: int,
               tokens: int | None, cached: Sequence[int] = (), staging: Sequence[int] = ()) -> SplitPlan:
    """Read a request's prefill blocks whole, as decode-sized chunks.

    local: per KV group, the decode blocks vLLM allocated for the request past its prefix hit (`cached[g]` decode
    blocks, which the decode already holds); remote: per group, the prefill's blocks for the request; ratio: prefill
    block / decode block; tokens: the prompt's tokens (None: every remote block counts); staging: exactly
    `split_staging_needed(...)` free staging block ids, used in order.
    """
    need = split_staging_needed(local, remote, ratio=ratio, block_size=block_size, tokens=tokens, cached=cached)
    if len(staging) != need:
        raise ValueError(f"split plan needs {need} staging blocks, got {len(staging)}")
    spare = iter(staging)
    groups = []
    for g, loc in enumerate(local):
        hit = _cached(cached, g)
        span = _received_span(len(loc), len(remote[g]), ratio, block_size, tokens, hit)
        chunks = []
        for b in _prefill_blocks(span, ratio):
            for c in range(ratio):
                v = b * ratio + c
                real = v in span
                chunks.append(SplitChunk(src=remote[g][b] * ratio + c, dest=loc[v - hit] if real else next(spare),
                                         block=v, real=real))
        groups.append(tuple(chunks))
    return SplitPlan(ratio, block_size, tokens, tuple(groups))


def split_tail(blocks: Sequence[int], block_size: int, tokens: int | None) -> tuple[int, int] | None:
    """After a split: (index into `blocks`, first token to zero) for the chunk holding the prompt's last token when
    its decode block reaches past the prompt; None when nothing is to be zeroed.

    blocks: the request-relative decode block of each chunk of one group, in plan order (`SplitChunk.block`).
    Slots past the prompt's last token are zero, as vLLM leaves uncovered ones.
    """
    if tokens is None or not blocks or (blocks[-1] + 1) * block_size <= tokens:
        return None
    for i in range(len(blocks) - 1, -1, -1):
        if blocks[i] * block_size < tokens:
            return i, tokens - blocks[i] * block_size
    return None  # no chunk holds a token (a plan never has such a group)


class StagingPool:
    """Staging blocks (decode cache blocks withheld from vLLM's allocator) for P > D reads: first free, first taken.

    Never hands out an id that is out, and takes back only ids that are out.
    """

    def __init__(self, ids: Iterable[int]):
        self._free = list(ids)
        self._out: set[int] = set()
        if len(set(self._free)) != len(self._free):
            raise ValueError("staging block ids repeat")
        self.capacity = len(self._free)

    @classmethod
    def last_blocks(cls, total_blocks: int, staging_blocks: int) -> StagingPool:
        """The last `staging_blocks` of a cache of `total_blocks` (where the decode's scheduler reserved them)."""
        return cls(range(total_blocks - staging_blocks, total_blocks))

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """n free ids (the longest free first), or None (and nothing taken) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot take {n} staging blocks")
        if len(self._free) < n:
            return None
        taken, self._free = self._free[:n], self._free[n:]
        self._out.update(taken)
        return taken

    def release(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        if len(set(ids)) != len(ids) or not self._out.issuperset(ids):
            raise ValueError(f"releasing staging blocks that are not out: {sorted(set(ids) - self._out)}")
        self._out.difference_update(ids)
        self._free.extend(ids)


# -- prefill block < decode block ----------------------------------------------------------------------------


def pair_past_prefix_hit(local: list[list[int]], remote: list[list[int]], cached: Sequence[int],
                         sub_per_block: int) -> tuple[list[list[int]], list[list[int]]]:
    """Correct vLLM's sub-block pairing (its `_map_block_ids_for_block_size_ratio` output) for a decode prefix hit.

    local: per group, the decode's sub-blocks (`sub_per_block` per decode block, past its `cached[g]` prefix-hit
    blocks); remote: per group, all the prefill's blocks. Local sub-block j is token range (cached + j) * remote
    block, so it pairs with remote block cached * sub_per_block + j and only len(remote) - cached * sub_per_block
    of them exist; vLLM clips at len(remote), then end-trims the remote list to the local count, which pairs every
    sub-block with the wrong remote block. An empty local list (vLLM's full prefix hit) stays as it is; remote is
    returned unchanged.
    """
    if not local or not any(cached):
        return local, remote
    out = []
    for g, group in enumerate(local):
        skip = _cached(cached, g) * sub_per_block
        out.append(group[: max(0, len(remote[g]) - skip)] if group else group)
    return (out if any(out) else []), remote


def merge_tail(covered_sub_blocks: int, ratio: int, block_size: int) -> tuple[int, int | None]:
    """After a P < D read of `covered_sub_blocks` sub-blocks (`ratio` per decode block of `block_size` tokens):
    (decode blocks that received data, first token slot of the last one to zero, or None when it is full)."""
    covered_blocks, sub_in_last = divmod(covered_sub_blocks, ratio)
    written = covered_blocks + (1 if sub_in_last else 0)
    return written, (sub_in_last * (block_size // ratio) if sub_in_last else None)
