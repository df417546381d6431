"""The decode's conversions of received KV, in the cache's own form and on the cache's own device.

What NIXL wrote is a page's bytes in memory order (pdctl.kv.forms); these functions read those pages, convert them
with pdctl.kv.convert and write them back:
- `merge_received`: prefill block < decode block, each decode block holding `ratio` received pages back to back;
  the last block's slots past the prompt and the blocks past it zeroed;
- `split_received`: prefill block > decode block, each prefill page read whole as `ratio` decode-sized chunks
  (some into a staging area) and split into decode blocks; the slots past the prompt zeroed;
- `merge_window`, `zero_fills`: a sliding-window group's blocks, paired by tokens (pdctl.kv.window), with the slots
  the prefill no longer held zeroed;
- `receive_merged`, `receive_split`: one KV group's whole receive processing after a read, as the connector runs
  it (and the conformance harness, through the same functions).

Every index tensor and mask is made on the cache's device (masks cached per device and dtype): a CUDA or HPU cache
is never indexed with a CPU tensor. No vLLM, no NIXL: the connector's mixins call these.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from pdctl.kv.convert import Side, merge_in_place, slots_mask, split_in_place, zero_mask
from pdctl.kv.forms import CacheForm, block_ids
from pdctl.kv.index import SplitChunk, merge_tail, split_tail
from pdctl.kv.window import WindowFill


@functools.lru_cache(maxsize=1024)
def _mask_on(side: Side, start: int, stop: int | None, device: torch.device) -> torch.Tensor:
    """The elements of token slots [start, stop) (stop None: to the block's end) of a page, on `device`."""
    mask = zero_mask(side, start) if stop is None else slots_mask(side, start, stop)
    return mask.to(device)


# One KV group's layers as the connector holds them: each layer's cache with its form (the same shape, dtype and
# device across a group): indices are made once per group, each layer converted in turn.
Layers = Sequence[tuple[torch.Tensor, CacheForm]]


def _zero_slots(page: torch.Tensor, side: Side, slots: Sequence[tuple[int, int | None]]) -> None:
    """Zero token slots [start, stop) (stop None: to the block's end) of one page, in place."""
    for start, stop in slots:
        page.masked_fill_(_mask_on(side, start, stop, page.device), 0)


def _zero_block_slots(cache, form: CacheForm, block: int, side: Side,
                      slots: Sequence[tuple[int, int | None]]) -> None:
    """`_zero_slots` on block `block` of a cache: through a view of its page, or for a (K, V) pair, whose page
    spans two tensors, through a copy written back."""
    if side.layout.regions == 1:
        _zero_slots(form.page(cache, block), side, slots)
        return
    ids = block_ids([block], cache)
    page = form.pages(cache, ids)
    _zero_slots(page[0], side, slots)
    form.put_pages(cache, ids, page)


def _received_order(rows: torch.Tensor, ratio: int, regions: int, merged: bool) -> torch.Tensor:
    """Rows of `ratio` received units as the pages they were. A read with a (K, V)-pair side sees each page as two
    regions (K and V, or a joined page's two halves: pdctl.kv.reads.halves), each read chunk by chunk, so a merged
    row [K1..Kr, V1..Vr] is regrouped to [K1 V1 .. Kr Vr] (r received pages back to back), and split rows
    [K1 V1 .. Kr Vr] to the prefill's page [K1..Kr V1..Vr]. One region per page: already in order."""
    if regions == 1 or ratio == 1:
        return rows
    b = rows.shape[0]
    shape = (b, regions, ratio, -1) if merged else (b, ratio, regions, -1)
    return rows.reshape(shape).transpose(1, 2).reshape(b, -1)


def _moves_bytes(received: Side, local: Side) -> bool:
    """Whether regrouping received pages along tokens changes bytes: not for token-major pages packed as this cache
    packs them (back to back they are the bigger page; cut, the smaller ones)."""
    return not (received.layout is local.layout and local.layout.token_major)


def _regions(received: Side, local: Side) -> int:
    """The regions per page a read between these sides used: two when either is a (K, V) pair."""
    return max(received.layout.regions, local.layout.regions)


def merge_received(layers: Layers, ids: Sequence[int], ratio: int, written: int, zero_from: int | None,
                   packed: str | None = None, merge: bool = True) -> None:
    """P < D: the decode blocks `ids[:written]` each hold `ratio` received pages back to back (merged into the
    cache's layout when `merge`); slots >= zero_from of the last written block, and the blocks ids[written:],
    are zeroed. `packed`: how the prefill packed its pages, when not as this cache does."""
    if not layers:
        return
    idx = block_ids(ids[:written], layers[0][0])
    stale = block_ids(ids[written:], layers[0][0])
    for cache, form in layers:
        local, received = form.side(), form.side(form.block_size // ratio, packed)
        if written and merge and _moves_bytes(received, local):
            rows = _received_order(form.pages(cache, idx), ratio, _regions(received, local), merged=True)
            blocks = merge_in_place(rows, ratio, received, local)
            if zero_from is not None:
                _zero_slots(blocks[-1], local, [(zero_from, None)])
            form.put_pages(cache, idx, blocks)
        elif written and zero_from is not None:
            _zero_block_slots(cache, form, ids[written - 1], local, [(zero_from, None)])
        if stale.numel():
            form.zero_blocks(cache, stale)


def split_received(layers: Layers, dests: Sequence[int], ratio: int, tail: tuple[int, int] | None = None,
                   fills: Sequence[WindowFill] = (), packed: str | None = None) -> None:
    """P > D: `dests` are the decode-sized chunks each prefill page was read into, `ratio` per prefill block in
    order (staging chunks among them); each page is split into `ratio` decode blocks in the cache's layout, written
    back over the chunks it was read into (a staging chunk's block is scratch: it takes its row too, which saves a
    gather of the rest). tail (row, first): slots >= first of that row are past the prompt; `fills`: a
    sliding-window group's slots that received nothing. `packed`: how the prefill packed its pages, when not as
    this cache does (pdctl.kv.forms.CacheForm.side)."""
    if not layers:
        return
    ids = block_ids(dests, layers[0][0])
    for cache, form in layers:
        local = form.side()
        received = form.side(form.block_size * ratio, packed)
        if not _moves_bytes(received, local):
            if tail is not None:
                _zero_block_slots(cache, form, dests[tail[0]], local, [(tail[1], None)])
            continue
        rows = _received_order(form.pages(cache, ids).reshape(len(dests) // ratio, -1), ratio,
                               _regions(received, local), merged=False)
        blocks = split_in_place(rows, ratio, received, local)
        if tail is not None:
            at, first = tail
            _zero_slots(blocks[at], local, [(first, None)])
        form.put_pages(cache, ids, blocks)
    zero_fills(layers, fills)


def merge_window(layers: Layers, ids: Sequence[int], ratio: int, fills: Sequence[WindowFill],
                 packed: str | None = None, merge: bool = True) -> None:
    """A sliding-window group's decode blocks after a P < D read paired by tokens: every block's sub-blocks merged,
    then what the prefill did not send (the window's head, the slots past the prompt) zeroed."""
    if not layers:
        return
    idx = block_ids(ids, layers[0][0])
    for cache, form in layers:
        local = form.side()
        received = form.side(form.block_size // ratio, packed)
        if not (merge and ratio > 1 and _moves_bytes(received, local)):
            zero_fills([(cache, form)], fills)
            continue
        rows = _received_order(form.pages(cache, idx), ratio, _regions(received, local), merged=True)
        blocks = merge_in_place(rows, ratio, received, local)
        for row, fill in zip(blocks, fills, strict=True):
            _zero_slots(row, local, fill.zero)
        form.put_pages(cache, idx, blocks)


def zero_fills(layers: Layers, fills: Sequence[WindowFill]) -> None:
    """Zero, in place, the slots of a sliding-window group's decode blocks that received nothing."""
    for cache, form in layers:
        local = form.side()
        for fill in fills:
            if fill.zero:
                _zero_block_slots(cache, form, fill.id, local, fill.zero)


def receive_merged(layers: Layers, ids: Sequence[int], ratio: int, covered_sub_blocks: int,
                   fills: Sequence[WindowFill] | None = None, packed: str | None = None, convert: bool = True) -> None:
    """P <= D, after the read of `covered_sub_blocks` prefill pages into the decode blocks `ids` (`ratio` per
    block): merged in the cache's form (`convert`), the uncovered tail zeroed; `fills`: a sliding-window group's
    blocks paired by tokens (pdctl.kv.window), whose slots the prefill no longer held are zeroed instead."""
    if not layers:
        return
    if fills is not None:
        merge_window(layers, ids, ratio, fills, packed, merge=convert)
        return
    form = layers[0][1]
    written, zero_from = merge_tail(covered_sub_blocks, ratio, form.block_size)
    repacked = form.side(form.block_size // ratio, packed).layout is not form.side().layout  # at ratio 1 too
    merge_received(layers, ids, ratio, written, zero_from, packed, merge=convert and (ratio > 1 or repacked))


def receive_split(layers: Layers, chunks: Sequence[SplitChunk], ratio: int, tokens: int | None,
                  fills: Sequence[WindowFill] | None = None, packed: str | None = None) -> None:
    """P > D, after the read of one group's chunks (pdctl.kv.index.SplitPlan): each prefill page split into decode
    blocks, the slots past the prompt zeroed (`fills`: a sliding-window group's slots that received nothing)."""
    if not layers or not chunks:
        return
    tail = None if fills is not None else split_tail([c.block for c in chunks], layers[0][1].block_size, tokens)
    split_received(layers, [c.dest for c in chunks], ratio, tail, fills or (), packed)
