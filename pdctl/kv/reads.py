"""How a decode reads a prefill's KV: what each side registers, which blocks pair with which, and the byte address
of every read. The connector's mixins (pdctl.connector) and the conformance harness (scripts/kv_conformance.py)
both plan their reads here, so what the harness proves over real NIXL transfers is what the connector does.

- `Region`, `region_of`, `regions_of`: one layer's registered cache as the handshake advertises it (base address,
  page bytes, bytes from one block's page to the next, blocks): one region, or two for a (K, V) pair (Gaudi);
- `descriptors`: the (address, length) of every read unit of a region: whole pages, or each page cut into `chunks`
  equal byte runs (a decode page receiving `chunks` smaller prefill pages; a prefill page read as decode-sized
  chunks), optionally one TP rank's part of each. Chunk c of block b lies at base + b * stride + c * page / chunks:
  in the block-outermost forms (BL*) the stride spans every layer's page, so a chunk is never base + j * stride /
  chunks (vLLM's address for its own decode-sized view of a bigger prefill block);
- `merge_mapping`: prefill block < decode block: vLLM's pairing of decode sub-blocks with prefill blocks, corrected
  past the decode's own prefix hit (pdctl.kv.index.pair_past_prefix_hit);
- `window_tails`: a sliding-window group's two tails as pdctl.kv.window takes them (both directions);
- `plan_split`: prefill block > decode block: every prefill block a request touches read whole as decode-sized
  chunks, staging for the chunks no decode block takes, window tails by token (pdctl.kv.index, pdctl.kv.window);
- `halves`, `as_halves`: a read with a (K, V)-pair side sees every layer as two regions: K and V, or the two halves
  of a joined page, so region i pairs with region i as vLLM's descriptors do (receive processing regroups them);
- `refusal`: whether a prefill/decode pair is read at all: pdctl's rules, and vLLM 0.32's handshake rules a pair
  meets before pdctl's code runs, each with its reason.

Pure: block ids, addresses and sizes in, plans out; no vLLM, no NIXL.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdctl.kv.index import SplitPlan, pair_past_prefix_hit, split_plan, split_staging_needed
from pdctl.kv.layouts import VLLM_LAYOUTS, layout
from pdctl.kv.window import WindowFill, window_split_plan, window_staging_needed


@dataclass(frozen=True)
class Region:
    """One registered KV region (a layer's cache) as the handshake advertises it."""

    base: int  # byte address of block 0's page
    page_len: int  # bytes of one (layer, block) page
    stride: int  # bytes from one block's page to the next (page_len for LB*, every layer's page for BL*)
    blocks: int

    def __post_init__(self):
        if self.stride < self.page_len:
            raise ValueError(f"a region's pages overlap: stride {self.stride} < page {self.page_len}")


def regions_of(cache, form) -> list[Region]:
    """Every region one layer's cache registers (pdctl.kv.forms.CacheForm.tensors): one, or K's then V's for a
    (K, V) pair, each holding its share of every page."""
    tensors = form.tensors(cache)
    size = tensors[0].element_size()
    page = form.page_elems * size // len(tensors)
    return [Region(t.data_ptr(), page, t.stride(0) * size, form.num_blocks(cache)) for t in tensors]


def region_of(cache, form) -> Region:
    """The region of one registered cache tensor of form `form` (a joined or CPU_ATTN cache)."""
    (region,) = regions_of(cache, form)
    return region


def halves(regions: Sequence[Region]) -> list[Region]:
    """A layer's regions as a read with a (K, V)-pair side sees them: two per layer, K's and V's for a pair, the two
    halves of every page for a joined cache. Both sides then have as many regions of equal page sizes, and vLLM's
    descriptors pair region i with region i as they always do: a joined page's first half with K, its second with
    V. Receive processing regroups what lands where (pdctl.kv.receive)."""
    if len(regions) == 2:
        return list(regions)
    (r,) = regions
    if r.page_len % 2:
        raise ValueError(f"a page of {r.page_len} bytes has no two equal halves")
    half = r.page_len // 2
    return [Region(r.base, half, r.stride, r.blocks), Region(r.base + half, half, r.stride, r.blocks)]


PER_REGION = ("region_group_ids", "region_names", "region_mem_types")  # vLLM's other lists of one entry per region


def as_halves(meta):
    """The handshake metadata of a one-region-per-layer side (vLLM's NixlAgentMetadata, or any dataclass with its
    fields) as `halves` sees it: each region followed by its second half."""
    counts = meta.region_num_blocks or [meta.num_blocks] * len(meta.kv_caches_base_addr)
    split = [halves([Region(b, n, s, c)]) for b, n, s, c in zip(meta.kv_caches_base_addr, meta.block_lens,
                                                                 meta.block_strides, counts, strict=True)]
    regions = [r for pair in split for r in pair]
    # The other per-region lists (vLLM's region_group_ids, region_names, region_mem_types): each half is its
    # region's, as a (K, V) side's K and V regions are their layer's.
    twice = {f.name: [x for x in getattr(meta, f.name) for _ in range(2)] for f in dataclasses.fields(meta)
             if f.name in PER_REGION and getattr(meta, f.name)}
    return dataclasses.replace(meta, kv_caches_base_addr=[r.base for r in regions],
                               block_lens=[r.page_len for r in regions], block_strides=[r.stride for r in regions],
                               region_num_blocks=[r.blocks for r in regions], **twice)


def descriptors(region: Region, chunks: int = 1, part: tuple[int, int] = (0, 1)) -> np.ndarray:
    """[blocks * chunks, 2] uint64 (address, length), row b * chunks + c: chunk c of block b's page cut into
    `chunks` equal byte runs. part (i, n): only the i-th of n equal parts of each chunk (a TP rank's heads of a
    head-major page)."""
    index, parts = part
    if region.page_len % (chunks * parts):
        raise ValueError(f"a page of {region.page_len} bytes does not cut into {chunks} x {parts} equal parts")
    length = region.page_len // chunks // parts
    rows = np.arange(region.blocks * chunks, dtype=np.uint64)
    out = np.empty((rows.size, 2), dtype=np.uint64)
    out[:, 0] = (region.base + (rows // chunks) * region.stride + (rows % chunks) * (length * parts)
                 + index * length)
    out[:, 1] = length
    return out


# -- prefill block < decode block ----------------------------------------------------------------------------


def merge_mapping(local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], ratio: int,
                  cached: Sequence[int] = (), sub_per_block: int | None = None
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """P < D: per group, the decode sub-blocks (block * ratio + j) paired 1:1 with the prefill's blocks.

    vLLM expands each decode block into `ratio` sub-blocks and clips to the remote count (its
    `_map_block_ids_for_block_size_ratio`); past a decode prefix hit of `cached[g]` blocks that pairs every sub-block
    with the wrong prefill block, which pair_past_prefix_hit corrects. vLLM then trims the remote list from its start
    to the local count (`end_trimmed`). An empty local list is vLLM's full prefix hit."""
    mapped = [[b * ratio + j for b in (local[g] if local else ()) for j in range(ratio)][:len(group)]
              for g, group in enumerate(remote)]
    remote = [list(group) for group in remote]
    if not any(mapped):
        return [], remote
    return pair_past_prefix_hit(mapped, remote, cached, sub_per_block or ratio)


def end_trimmed(local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]]) -> list[list[int]]:
    """vLLM's pairing of a shorter local list with the remote one (its `_apply_prefix_caching`): the remote list's
    last len(local) entries."""
    return [list(r[len(r) - len(loc):]) if loc else [] for loc, r in zip(local, remote, strict=True)]


# -- sliding-window groups -----------------------------------------------------------------------------------


def window_tails(local: Sequence[int], remote: Sequence[int], *, tokens: int | None, window: int,
                 prefill_block: int, decode_block: int) -> dict[str, Any] | None:
    """Where the two tails of a sliding-window group lie, as pdctl.kv.window's arguments; None when the lists are
    not the tails vLLM cuts (the load then fails and vLLM recomputes, never a silent misread).

    Both sides hold the request's first `tokens` tokens (the prefill stopped one short: the scheduler's backoff),
    so the decode's first query is token `tokens` and needs keys from tokens - window + 1. Each list ends with the
    block holding the last token; the prefill's first entries are vLLM's null block where the window had already
    left them."""
    if tokens is None:
        return None
    remote_first = -(-tokens // prefill_block) - len(remote)
    local_first = -(-tokens // decode_block) - len(local)
    if remote_first < 0 or local_first < 0:
        return None
    held = max(remote_first, max(0, tokens - window + 1) // prefill_block)  # past the null entries
    return dict(local=list(local), remote=list(remote[held - remote_first:]), local_first=local_first,
                remote_first=held, prefill_block=prefill_block, decode_block=decode_block, tokens=tokens,
                need_from=max(0, tokens - window + 1, local_first * decode_block))


# -- prefill block > decode block ----------------------------------------------------------------------------


class WindowNotHeld(Exception):
    """A sliding-window group's tails do not hold the window: the read cannot be planned."""


class StagingFull(Exception):
    """The staging area cannot hold the chunks no decode block takes."""


@dataclass(frozen=True)
class SplitRead:
    """A request's P > D read: the plan, and per sliding-window group the slots that receive nothing."""

    plan: SplitPlan
    fills: dict[int, tuple[WindowFill, ...]] = field(default_factory=dict)


def plan_split(local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], *, ratio: int, block_size: int,
               tokens: int | None, cached: Sequence[int], tails: dict[int, dict[str, Any] | None],
               take: Callable[[int], list[int] | None]) -> SplitRead:
    """Rewrite a request's reads to whole prefill blocks as decode-sized chunks.

    local/remote: per group, the decode's blocks past its prefix hit (`cached`) and the prefill's blocks; tails:
    per sliding-window group, `window_tails` (None: not held); take(n): n staging block ids, or None when fewer
    are free. Full-attention groups are planned from the start (pdctl.kv.index), sliding-window ones by tokens
    (pdctl.kv.window). WindowNotHeld, StagingFull: nothing is taken."""
    full_local = [[] if g in tails else list(ids) for g, ids in enumerate(local)]
    shape = dict(ratio=ratio, block_size=block_size, tokens=tokens, cached=cached)
    full_need = split_staging_needed(full_local, remote, **shape)
    window_need = {g: window_staging_needed(**t) if t else None for g, t in tails.items()}
    if None in window_need.values():
        raise WindowNotHeld(sorted(g for g, n in window_need.items() if n is None))
    need = full_need + sum(window_need.values())
    staging = take(need) if need else []
    if staging is None:
        raise StagingFull(need)
    plan = split_plan(full_local, remote, staging=staging[:full_need], **shape)
    if not tails:
        return SplitRead(plan)
    groups, fills, taken = list(plan.groups), {}, full_need
    for g, t in tails.items():
        window = window_split_plan(**t, staging=staging[taken:taken + window_need[g]])
        taken += window_need[g]
        groups[g], fills[g] = window.chunks, window.fills
    return SplitRead(SplitPlan(plan.ratio, plan.block_size, plan.tokens, tuple(groups)), fills)


def as_decode_sized(meta, ratio: int):
    """P > D: the prefill's handshake metadata (vLLM's NixlAgentMetadata, or any dataclass with its fields) as if its
    blocks were `ratio` times smaller, so vLLM's read machinery moves decode-sized chunks. The strides stay the
    prefill's (page to page): the chunks' addresses are `split_addresses`'."""
    return dataclasses.replace(
        meta, block_size=meta.block_size // ratio, num_blocks=meta.num_blocks * ratio,
        block_lens=[n // ratio for n in meta.block_lens],
        region_num_blocks=[n * ratio for n in meta.region_num_blocks] if meta.region_num_blocks else
        meta.region_num_blocks)


def split_addresses(meta, ratio: int, descs: np.ndarray) -> np.ndarray:
    """The address of every decode-sized chunk of a decode-sized prefill's regions (`as_decode_sized`), in vLLM's
    descriptor order (region-major, then block, then chunk), each at the offset vLLM chose within its chunk (a TP
    rank's part)."""
    counts = meta.region_num_blocks or [meta.num_blocks] * len(meta.kv_caches_base_addr)
    out, row = [], 0
    for base, chunk_len, stride, n in zip(meta.kv_caches_base_addr, meta.block_lens, meta.block_strides, counts,
                                          strict=True):
        region = Region(base, chunk_len * ratio, stride, n // ratio)
        offset = int(descs[row, 0]) - base  # vLLM's rank offset within the chunk
        out.append(descriptors(region, ratio)[:, 0] + np.uint64(offset))
        row += n
    if row != len(descs):
        raise ValueError(f"{len(descs)} remote descriptors for {row} prefill chunks")
    return np.concatenate(out)


# -- which pairs are read ------------------------------------------------------------------------------------

HEADS_OUTSIDE = ("LBHNC", "BLHNC", "HND")  # vLLM's layouts whose page holds each head's tokens together


@dataclass(frozen=True)
class Peer:
    """One side of a P/D pair as the handshake describes it."""

    backend: str  # the attention backend (CPU_ATTN, FLASH_ATTN, ...)
    layout: str  # vLLM's kv_cache_layout name
    block_size: int
    tp: int
    isa: str | None = None  # the packing vLLM's metadata cannot say: CPU_ATTN's ISA, or a (K, V) pair's form

    @property
    def packing(self) -> str:
        """The pdctl.kv.layouts name a page of this side is packed in."""
        return self.isa or VLLM_LAYOUTS[self.layout]

    @property
    def kv_pair(self) -> bool:
        """A cache handed as (K, V) pairs (Gaudi), whose layer registers two regions."""
        return layout(self.packing).regions == 2


def refusal(prefill: Peer, decode: Peer, decode_isa_at: str | None = None) -> str | None:
    """Why the pair is not read (the handshake fails with this reason), or None. `decode_isa_at`: the ISA the decode's
    host uses for the prefill's block size (CPU_ATTN: a prefill packed otherwise is converted only by a merge).

    A pair with a (K, V)-pair side (Gaudi) is pdctl's alone: vLLM's backend and layout checks cannot hold across
    devices, and its pages are converted from and to every form pdctl models, whole pages only (equal TP)."""
    if prefill.kv_pair or decode.kv_pair:
        if prefill.tp != decode.tp:
            return (f"pdctl: TP {prefill.tp} -> {decode.tp} reads head slices, which a (K, V)-pair cache (Gaudi) "
                    "does not keep together: use equal TP")
        if max(prefill.block_size, decode.block_size) % min(prefill.block_size, decode.block_size):
            return "pdctl: one block size must divide the other"
        return None
    if prefill.backend != decode.backend:
        return (f"vLLM: the attention backends differ ({prefill.backend} -> {decode.backend}); NIXL's compatibility "
                "hash covers the backend, and CPU_ATTN pages are packed per ISA")
    if prefill.layout != decode.layout:
        return (f"vLLM: the KV cache layouts differ ({prefill.layout} -> {decode.layout}); its handshake needs the "
                "same kv_cache_layout on both sides: set the same kv_layout on both pools")
    if prefill.tp != decode.tp and decode.layout not in HEADS_OUTSIDE:
        return (f"vLLM: TP {prefill.tp} -> {decode.tp} reads a head slice of each page, which {decode.layout} does "
                "not hold together (heads inside tokens); use a head-outer layout (LBHNC)")
    if prefill.block_size > decode.block_size:
        if prefill.block_size % decode.block_size:
            return "pdctl: the prefill block is not a multiple of the decode block"
        if prefill.tp != decode.tp:
            return "pdctl: prefill block > decode block needs equal TP on both sides"
    elif decode.block_size % prefill.block_size:
        return "vLLM: the decode block is not a multiple of the prefill block"
    if prefill.tp > decode.tp and prefill.block_size < decode.block_size:
        return (f"vLLM: a prefill with more TP ranks ({prefill.tp} -> {decode.tp}) must use the decode's block size "
                f"({prefill.block_size} -> {decode.block_size})")
    if prefill.isa and decode_isa_at and prefill.block_size == decode.block_size and \
            layout(prefill.isa) is not layout(decode_isa_at):
        return (f"pdctl: the prefill's CPU attention ISA {prefill.isa} stores KV differently from this decode's "
                f"{decode_isa_at}; pdctl converts between them only when the block sizes differ (a merge or a "
                "split after receive)")
    return None
