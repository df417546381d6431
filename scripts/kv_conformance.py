#!/usr/bin/env python3
"""KV conformance: a prefill's KV moved into a decode's cache between two real NIXL agents, through pdctl's own
connector code, checked token by token against the prompt's KV in token order.

    python scripts/kv_conformance.py --prefill FORM:BLOCK --decode FORM:BLOCK [--tokens N] [--prefix-hit BLOCKS]
        [--dtype bf16|fp16|fp8] [--window W] [--tp P:D] [--corrupt] [--json] [--device cpu|cuda]
    python scripts/kv_conformance.py --list
    python scripts/kv_conformance.py [--json]        # the whole matrix (its JSON also in results/)

FORM: vLLM's KVCacheLayout names LBHNC, LBNHC, BLHNC, BLNHC (a GPU backend's joined cache), cpu_vec, cpu_amx
(CPU_ATTN's cache packed for that ISA; an AMX host packs bf16 blocks of 32k tokens for amx, every other block for
vec), hpu (vllm-gaudi's device cache: per layer separate K and V tensors of token-major slots with a padding block
at the end, two regions per layer), or a host buffer as a device's connector allocates it with
`kv_buffer_device: cpu`: host:LBHNC, host:LBNHC (vLLM's, one allocation per layer in the device's layout),
host:hpu (vllm-gaudi's: K and V head-major, two regions per layer). --prefix-hit: decode blocks the decode already
holds; --window W: a sliding-window group of W tokens.

Two processes, each a NIXL agent (UCX on loopback: posix, cma, self; ../shared/ENVIRONMENT.md): the prefill process
lays its caches out byte for byte as its form says (one buffer per rank, every layer's view of it, vLLM's layout),
writes the prompt's KV through vLLM's logical view (CPU_ATTN: packed by pdctl.kv.layouts, checked against vLLM's
kernels by scripts/verify_cpu_layouts.py), registers the buffers with NIXL as vLLM does (one region per
allocation) and sends the handshake metadata the connector advertises (vLLM's NixlAgentMetadata, msgpack; the
CPU attention ISA tagged onto the backend name: pdctl.protocol.tag_backend). The decode process runs the
connector's own code on it: the pair check (pdctl.kv.reads.refusal), the decode-sized view of a bigger prefill
block and its chunk addresses (reads.as_decode_sized, reads.split_addresses), the read planning (reads.merge_mapping,
reads.window_tails, pdctl.kv.window.window_pairs, reads.plan_split with a staging pool of the minimum size the
connector accepts), every descriptor's address (reads.descriptors), real NIXL READs, then the receive processing
(pdctl.kv.receive.receive_merged / receive_split, on caches whose forms pdctl.kv.forms.form_of chose from their
strides). What vLLM itself does between those (its descriptor formulas, the end-trim of the remote list) is done
as vLLM 0.32 does it, said where.

Each case prints `exact`, `refused: <reason>` (the connector, or vLLM's handshake before it, refuses the pair) or
`wrong: <first slot>`; the exit status is 1 when a case is wrong. --corrupt flips one byte of a received token after
the receive processing: the case must then be `wrong`.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import pickle
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the GPU machine runs the working tree as it is, pdctl not installed
    sys.path.insert(0, str(ROOT))

# UCX between two processes on one host (../shared/ENVIRONMENT.md): without these a READ waits for the target's
# worker to be progressed. Set before NIXL loads, in both processes.
UCX_LOOPBACK = {"UCX_TLS": "posix,cma,self", "UCX_MM_ERROR_HANDLING": "y", "UCX_RESOLVE_REMOTE_EP_ID": "n"}

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pdctl import protocol  # noqa: E402
from pdctl.kv import fingerprint, reads  # noqa: E402
from pdctl.kv.forms import CacheForm, form_of, joined_caches, kv_pair_form, kv_pairs  # noqa: E402
from pdctl.kv.index import StagingPool  # noqa: E402
from pdctl.kv.receive import receive_merged, receive_split  # noqa: E402
from pdctl.kv.window import window_pairs  # noqa: E402

JOINED = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")
CPU_FORMS = {"cpu_vec": "vec", "cpu_amx": "amx"}
# vllm-gaudi's forms -> pdctl.kv's (K, V)-pair form; host buffers of joined caches -> the device layout they keep.
KV_PAIRS = {"hpu": "hpu", "host:hpu": "hpu_host"}
HOST_JOINED = {"host:LBHNC": "LBHNC", "host:LBNHC": "LBNHC"}
FORMS = (*JOINED, *CPU_FORMS, *KV_PAIRS, *HOST_JOINED)
# vLLM allocates a BL* cache's host buffer per layer in logical [B, H, N, 2D] order (LBHNC) yet advertises the
# device's layout name: a BLNHC decode would read its HND pages as NHD. Refused, as pdctl's validate refuses it.
HOST_REFUSED = {"host:BLHNC", "host:BLNHC"}
# name -> (the cache tensor's dtype as vLLM allocates it, the dtype the values are made in)
DTYPES = {"bf16": (torch.bfloat16, torch.bfloat16), "fp16": (torch.float16, torch.float16),
          "fp8": (torch.uint8, torch.float8_e4m3fn)}
LAYERS, HEADS, HEAD_DIM = 2, 4, 32  # head_dim 32: the smallest amx packs
JOINED_BACKEND = "FLASH_ATTN"
GAUDI_BACKEND, GAUDI_LAYOUT = "CUSTOM", "LBNHC"  # vllm-gaudi's backend name; its examples set VLLM_KV_CACHE_LAYOUT=NHD
NULL_BLOCK = 0  # vLLM's null block: a sliding-window entry the window has left
READ_WAIT_S = 20.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Side:
    form: str
    block: int
    tp: int = 1

    def __str__(self) -> str:
        return f"{self.form}:{self.block}"


@dataclass(frozen=True)
class Case:
    prefill: Side
    decode: Side
    dtype: str = "bf16"
    tokens: int = 100
    prefix_hit: int = 0  # decode blocks
    window: int | None = None
    corrupt: bool = False
    seed: int = 0

    def describe(self) -> str:
        extra = (f" hit {self.prefix_hit}" if self.prefix_hit else "") + (
            f" window {self.window}" if self.window else "")
        return (f"{self.prefill} -> {self.decode} {self.dtype} tp {self.prefill.tp}:{self.decode.tp} "
                f"tokens {self.tokens}{extra}")


# -- what each side is --------------------------------------------------------------------------------------------


def isa_at(form: str, dtype: str, block: int) -> str | None:
    """The CPU attention ISA a host of `form` packs blocks of `block` tokens for (vLLM's _get_attn_isa: amx for
    bf16 blocks of 32k on an AMX host, vec otherwise); None for a joined cache."""
    if form not in CPU_FORMS:
        return None
    return "amx" if form == "cpu_amx" and dtype == "bf16" and block % 32 == 0 else "vec"


def form_problem(side: Side, dtype: str) -> str | None:
    """Why `side` is not a form a host can have, or None."""
    if side.form in HOST_REFUSED:
        return (f"vLLM allocates a {side.form[5:]} cache's host buffer head-major per layer (LBHNC) but advertises "
                f"{side.form[5:]}: set kv_layout LBHNC or LBNHC with kv_buffer_device: cpu")
    if side.form not in FORMS:
        return f"unknown form {side.form} (known: {', '.join(FORMS)})"
    if side.form in CPU_FORMS and dtype == "fp8":
        return "pdctl.kv models CPU_ATTN's bf16 and fp16 pages, not its fp8 cache"
    if side.form == "cpu_amx" and isa_at(side.form, dtype, side.block) != "amx":
        return f"CPU_ATTN packs {dtype} blocks of {side.block} tokens for vec, not amx (amx: bf16, blocks of 32k)"
    if HEADS % side.tp:
        return f"TP {side.tp} does not divide {HEADS} KV heads"
    return None


def peer(side: Side, dtype: str) -> reads.Peer:
    if side.form in KV_PAIRS:
        return reads.Peer(GAUDI_BACKEND, GAUDI_LAYOUT, side.block, side.tp, KV_PAIRS[side.form])
    cpu = side.form in CPU_FORMS
    return reads.Peer("CPU_ATTN" if cpu else JOINED_BACKEND, "LBHNC" if cpu else HOST_JOINED.get(side.form, side.form),
                      side.block, side.tp, isa_at(side.form, dtype, side.block))


def registered_form(platform: str, layout: str, buffer_device: str, cpu_isa: str = "vec") -> str:
    """The form NIXL moves for a server, in this harness's names: its platform, its cache layout (vLLM's name, e.g.
    LBHNC) and where its KV is registered (`cpu` on an accelerator: the host buffer its connector allocates).
    `cpu_isa`: the attention ISA a CPU host packs for."""
    host = "host:" if buffer_device == "cpu" and platform != "cpu" else ""
    if platform == "hpu":
        return f"{host}hpu"
    if platform == "cpu":
        return f"cpu_{cpu_isa}"
    return f"{host}{layout}"


def rank_caches(side: Side, dtype: str, blocks: int, device: str) -> list[tuple[torch.Tensor, CacheForm]]:
    """One TP rank's caches as vLLM hands them to the connector (every layer a view of one buffer) with the forms
    pdctl.kv.forms chooses from their strides."""
    cache_dtype = DTYPES[dtype][0]
    heads = HEADS // side.tp
    if side.form in KV_PAIRS:
        pairs = kv_pairs(KV_PAIRS[side.form], blocks, heads, side.block, HEAD_DIM, LAYERS, cache_dtype, device)
        return [(c, kv_pair_form(c)) for c in pairs]
    if side.form in HOST_JOINED:  # one allocation per layer
        return [(c, form_of(c, JOINED_BACKEND)) for _ in range(LAYERS) for c in joined_caches(
            HOST_JOINED[side.form], blocks, heads, side.block, HEAD_DIM, 1, cache_dtype, device)]
    cpu = side.form in CPU_FORMS
    caches = joined_caches("LBHNC" if cpu else side.form, blocks, heads, side.block, HEAD_DIM, LAYERS, cache_dtype,
                           device)
    if cpu:
        return [(c, form_of(c, "CPU_ATTN", lambda n: isa_at(side.form, dtype, n))) for c in caches]
    return [(c, form_of(c, JOINED_BACKEND)) for c in caches]


def plain(cache, form: CacheForm) -> bool:
    """A joined cache, whose logical view is the tensor itself (not packed per ISA, not a (K, V) pair)."""
    return len(form.tensors(cache)) == 1 and form.isa_of is None


def read_tokens(cache: torch.Tensor, form: CacheForm, ids: list[int]) -> torch.Tensor:
    """Blocks `ids` as [len(ids), H, N, 2D] in token order: vLLM's logical view (CPU_ATTN: unpacked per ISA)."""
    idx = torch.tensor(ids, dtype=torch.long, device=cache.device)
    if plain(cache, form):
        return cache.index_select(0, idx)
    side = form.side()
    k, v = side.layout.unpack(form.pages(cache, idx), side.shape)
    return torch.cat([k, v], dim=-1)


def write_tokens(cache: torch.Tensor, form: CacheForm, ids: list[int], values: torch.Tensor) -> None:
    """The inverse of read_tokens."""
    idx = torch.tensor(ids, dtype=torch.long, device=cache.device)
    if plain(cache, form):
        cache.index_copy_(0, idx, values)
        return
    side = form.side()
    d = values.shape[-1] // 2
    form.put_pages(cache, idx, side.layout.pack(values[..., :d], values[..., d:], side.shape))


def truth(case: Case, device: str) -> torch.Tensor:
    """The prompt's KV in token order: [L, T, H, 2D] values of the case's dtype (fp8: as bytes)."""
    gen = torch.Generator().manual_seed(case.seed)
    cache_dtype, make = DTYPES[case.dtype]
    vals = torch.randn((LAYERS, case.tokens, HEADS, 2 * HEAD_DIM), generator=gen).to(make)
    return (vals.view(torch.uint8) if cache_dtype == torch.uint8 else vals).to(device)


def stale(caches: list[tuple[torch.Tensor, CacheForm]], seed: int) -> None:
    """Random bytes everywhere: what other requests left in the cache."""
    gen = torch.Generator().manual_seed(seed)
    for cache, form in caches:
        for t in storages(cache, form):
            raw = torch.randint(0, 256, tuple(t.shape), dtype=torch.uint8, generator=gen)
            t.copy_(raw.view(t.dtype) if t.dtype == torch.uint8 else (raw.float() / 64 - 2).to(t.dtype))


def pads(cache, form: CacheForm) -> list[torch.Tensor]:
    """vllm-gaudi's padding block past each of K's and V's blocks (`hpu`; none in other forms)."""
    if form.name != "hpu":
        return []
    return [flat[t.numel():] for t, flat in zip(form.tensors(cache), storages(cache, form), strict=True)]


def storages(cache, form: CacheForm) -> list[torch.Tensor]:
    """Every element of the allocations a layer's cache is a view of, as flat tensors of its dtype (vllm-gaudi's
    padding block included)."""
    out = []
    for t in form.tensors(cache):
        flat = torch.empty(0, dtype=t.dtype, device=t.device)
        flat.set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes() // t.element_size(),))
        out.append(flat)
    return out


def first_held(case: Case) -> int:
    """The first token the prefill still holds: 0, or a sliding window's first held block's first token."""
    if not case.window:
        return 0
    pb = prefill_blocks(case)
    return next(a for a, i in zip(pb.listed, pb.ids, strict=True) if i != NULL_BLOCK) * case.prefill.block


def held_fingerprint(case: Case, caches, rank: int, side: Side, blocks, start: int = 0) -> fingerprint.Fingerprint:
    """pdctl.kv.fingerprint's sums of one rank's share of the prompt's KV from token `start`, read through each
    layer's logical view of `blocks` (absolute block, cache block id) where they lie."""
    n, heads = side.block, HEADS // side.tp
    count = cdiv(case.tokens, fingerprint.CHUNK)
    out = fingerprint.Fingerprint.empty(count, len(caches), HEADS)
    held = [(a, i) for a, i in blocks if (a + 1) * n > start and a * n < case.tokens]
    if not held:
        return out
    if [a for a, _ in held] != list(range(held[0][0], held[0][0] + len(held))):
        raise ValueError(f"blocks {[a for a, _ in held]} are not one run of the prompt")
    for layer, (cache, form) in enumerate(caches):
        out.add_layer(layer, rank * heads, fingerprint.blocks_partials(
            cache, form, [i for _, i in held], first_block=held[0][0], start=max(start, held[0][0] * n),
            end=case.tokens, layer=layer, first_head=rank * heads, chunks=count))
    return out


# -- the blocks a request holds on each side ----------------------------------------------------------------------


@dataclass
class Blocks:
    """Which absolute blocks of the request each side lists, and the block ids they are at."""

    listed: list[int]  # absolute block numbers, in order
    ids: list[int]  # their cache block ids (NULL_BLOCK: vLLM's null block, a window entry already left)
    total: int  # blocks in the cache
    staging: int = 0  # the cache's last blocks, withheld as the staging area


def listed_blocks(case: Case, block: int) -> list[int]:
    """The request's blocks a side lists: all of them, or a sliding-window group's tail as vLLM cuts it."""
    count = cdiv(case.tokens, block)
    return list(range(max(0, count - cdiv(case.window, block) - 1), count)) if case.window else list(range(count))


def prefill_blocks(case: Case) -> Blocks:
    n = case.prefill.block
    listed = listed_blocks(case, n)
    total = len(listed) + 5
    order = torch.randperm(total - 1, generator=torch.Generator().manual_seed(case.seed + 1)).tolist()
    need_from = max(0, case.tokens - case.window + 1) if case.window else 0
    # blocks the window has left are vLLM's null block
    ids = [NULL_BLOCK if (a + 1) * n <= need_from else 1 + order[i] for i, a in enumerate(listed)]
    return Blocks(listed, ids, total)


def decode_blocks(case: Case, staging: int) -> Blocks:
    listed = listed_blocks(case, case.decode.block)
    total = len(listed) + staging + 5
    order = torch.randperm(total - staging, generator=torch.Generator().manual_seed(case.seed + 2)).tolist()
    return Blocks(listed, order[:len(listed)], total, staging)


# -- the prefill process ------------------------------------------------------------------------------------------


@dataclass
class AgentMetadata:
    """vLLM 0.32's NixlAgentMetadata (kv_connector/v1/nixl/metadata.py), field for field: what the connector
    advertises, msgpack-encoded by msgspec as vLLM's handshake encodes it (a unit test holds the two equal; the
    harness does not import vLLM, which the GPU machine lacks and which costs seconds per process)."""

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int]
    kv_cache_layout: str
    block_size: int
    ssm_sizes: tuple[int, int]
    attn_backend_name: str
    physical_blocks_per_logical_kv_block: int
    region_num_blocks: list[int] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1
    ple_block_len: int | None = None
    region_members: list[list[str]] = field(default_factory=list)
    packed_member_layouts: dict[str, tuple[int, int]] = field(default_factory=dict)


def encode(meta: AgentMetadata) -> bytes:
    """As vLLM's handshake encodes it (msgspec msgpack); pickle where msgspec is not installed (the GPU machine)."""
    try:
        import msgspec
    except ImportError:
        return pickle.dumps(meta)
    return msgspec.msgpack.encode(meta)


def decode_meta(raw: bytes) -> AgentMetadata:
    try:
        import msgspec
    except ImportError:
        return pickle.loads(raw)  # noqa: S301 - our own prefill process's bytes
    return msgspec.msgpack.decode(raw, type=AgentMetadata)


def advertise(agent, name: str, caches: list[tuple[torch.Tensor, CacheForm]], side: Side, dtype: str
              ) -> AgentMetadata:
    """The handshake metadata pdctl's connector advertises for one rank's caches (the CPU ISA tagged onto the
    backend name)."""
    regions = [r for c, f in caches for r in reads.regions_of(c, f)]
    p = peer(side, dtype)
    return AgentMetadata(
        engine_id=name, agent_metadata=agent.get_agent_metadata(), kv_caches_base_addr=[r.base for r in regions],
        device_id=0, num_blocks=regions[0].blocks, block_lens=[r.page_len for r in regions],
        block_strides=[r.stride for r in regions], kv_cache_layout=p.layout, block_size=side.block,
        ssm_sizes=(0, 0), attn_backend_name=protocol.tag_backend(p.backend, p.isa),
        physical_blocks_per_logical_kv_block=1, region_num_blocks=[r.blocks for r in regions])


def register(agent, caches: list[tuple[torch.Tensor, CacheForm]], mem: str):
    """Register every allocation the caches are views of, once (vLLM's register_kv_caches: one region per
    storage)."""
    seen = {}
    for cache, form in caches:
        for t in form.tensors(cache):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    dev = torch.cuda.current_device() if mem == "VRAM" else 0
    descs = agent.get_reg_descs([(addr, size, dev, "") for addr, size in seen.items()], mem)
    agent.register_memory(descs)
    return descs


def new_agent(role: str):
    """A NIXL agent with UCX (its INFO lines, which NIXL prints on stdout, kept off it)."""
    from nixl._api import nixl_agent, nixl_agent_config
    logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_agent(f"pdctl-conformance-{role}-{os.getpid()}", nixl_agent_config(backends=["UCX"]))


def prefill_serve(conn, device: str) -> None:
    """The prefill process: per case, lay the caches out, write the prompt's KV, register, advertise; release on
    the next message."""
    if device == "cpu":
        os.environ.update(UCX_LOOPBACK)
    torch.set_num_threads(1)
    agent = new_agent("prefill")
    mem = "VRAM" if device == "cuda" else "DRAM"
    held: list = []
    while True:
        msg = conn.recv()
        for descs in held:
            agent.deregister_memory(descs)
        held = []
        if msg is None:
            break
        case: Case = msg
        blocks = prefill_blocks(case)
        kv = truth(case, device)
        n = case.prefill.block
        metas, ranks = [], []
        for rank in range(case.prefill.tp):
            caches = rank_caches(case.prefill, case.dtype, blocks.total, device)
            stale(caches, case.seed + 10 + rank)
            heads = slice(rank * HEADS // case.prefill.tp, (rank + 1) * HEADS // case.prefill.tp)
            held_blocks = [(a, i) for a, i in zip(blocks.listed, blocks.ids, strict=True) if i != NULL_BLOCK]
            for layer, (cache, form) in enumerate(caches):
                ids = [i for _, i in held_blocks]
                vals = read_tokens(cache, form, ids)
                for row, (a, _) in enumerate(held_blocks):
                    lo, hi = a * n, min(case.tokens, (a + 1) * n)
                    vals[row, :, :hi - lo] = kv[layer, lo:hi, heads].transpose(0, 1)
                write_tokens(cache, form, ids, vals)
            held.append(register(agent, caches, mem))
            ranks.append(caches)
            metas.append(encode(advertise(agent, f"prefill-rank{rank}", caches, case.prefill, case.dtype)))
        if device == "cuda":
            torch.cuda.synchronize()
        fp = fingerprint.Fingerprint.empty(cdiv(case.tokens, fingerprint.CHUNK), len(ranks[0]), HEADS)
        for rank, caches in enumerate(ranks):  # the prompt's KV fingerprint, over every rank's held blocks
            fp = fp + (held_fingerprint(case, caches, rank, case.prefill, [
                (a, i) for a, i in zip(blocks.listed, blocks.ids, strict=True) if i != NULL_BLOCK]))
        # sent as a prefill's kv_transfer_params carry it (pdctl.protocol)
        conn.send((metas, blocks.ids, agent.get_agent_metadata(), {protocol.FINGERPRINT_KEY:
                                                                   protocol.encode_fingerprint(fp)}))
    conn.close()


# -- the decode process -------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    result: str  # exact, refused: ..., wrong: ...
    seconds: float = 0.0
    read_s: float = 0.0
    receive_s: float = 0.0
    bytes: int = 0
    fingerprint: str = ""  # equal, or where the decode's differs from the prefill's (empty: refused)


def sources(p: int, d: int, rank: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
    """Decode rank `rank`'s reads under TP p:d: (prefill rank, the part of each local unit, the part of each remote
    unit), as vLLM's TP mapping reads head slices."""
    if p == d:
        return [(rank, (0, 1), (0, 1))]
    if p < d:
        k = d // p
        return [(rank // k, (0, 1), (rank % k, k))]
    k = p // d
    return [(rank * k + i, (i, k), (0, 1)) for i in range(k)]


class Decode:
    def __init__(self, device: str):
        self.device = device
        self.mem = "VRAM" if device == "cuda" else "DRAM"
        self.agent = new_agent("decode")

    def run(self, case: Case, metas: list[bytes], prefill_ids: list[int], agent_meta: bytes,
            prefill_fp: list[int]) -> Outcome:
        remote = [decode_meta(m) for m in metas]
        backend, remote_isa = protocol.untag_backend(remote[0].attn_backend_name)
        pre = reads.Peer(backend, remote[0].kv_cache_layout, remote[0].block_size, case.prefill.tp, remote_isa)
        dec = peer(case.decode, case.dtype)
        why = reads.refusal(pre, dec, isa_at(case.decode.form, case.dtype, pre.block_size))
        if why:
            return Outcome(f"refused: {why}")
        np_, nd = case.prefill.block, case.decode.block
        split = np_ > nd
        ratio = np_ // nd if split else nd // np_
        staging = 2 * (ratio - 1) if split else 0  # the least the connector accepts at the handshake
        blocks = decode_blocks(case, staging)
        ranks = []
        for rank in range(case.decode.tp):
            caches = rank_caches(case.decode, case.dtype, blocks.total, self.device)
            stale(caches, case.seed + 20 + rank)
            ranks.append(caches)
        kv = truth(case, self.device)
        hit = case.prefix_hit
        for rank, caches in enumerate(ranks):  # the decode's prefix hit: it computed those blocks itself
            heads = slice(rank * HEADS // case.decode.tp, (rank + 1) * HEADS // case.decode.tp)
            for layer, (cache, form) in enumerate(caches):
                ids = blocks.ids[:hit]
                if ids:
                    vals = read_tokens(cache, form, ids)
                    for row, a in enumerate(blocks.listed[:hit]):
                        lo, hi = a * nd, min(case.tokens, (a + 1) * nd)
                        vals[row, :, :hi - lo] = kv[layer, lo:hi, heads].transpose(0, 1)
                    write_tokens(cache, form, ids, vals)
        before = [[([t.clone() for t in f.tensors(c)], [p.clone() for p in pads(c, f)]) for c, f in caches]
                  for caches in ranks]
        plan = self.plan(case, blocks, prefill_ids, ratio, split)
        if isinstance(plan, str):
            return Outcome(plan)
        name = self.agent.add_remote_agent(agent_meta)
        regs = [register(self.agent, caches, self.mem) for caches in ranks]
        t0 = time.perf_counter()
        pair = pre.kv_pair or dec.kv_pair  # the joined side's pages are read as two halves
        try:
            moved = 0
            for rank, caches in enumerate(ranks):
                for src, local_part, remote_part in sources(case.prefill.tp, case.decode.tp, rank):
                    moved += self.read(name, caches, remote[src], plan, ratio, split, local_part, remote_part,
                                       halve=(pair and not dec.kv_pair, pair and not pre.kv_pair))
            read_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            for caches in ranks:
                self.receive(case, caches, plan, ratio, split, pre.packing)
            if self.device == "cuda":
                torch.cuda.synchronize()
            receive_s = time.perf_counter() - t1
        finally:
            self.agent.remove_remote_agent(name)
            for descs in regs:
                self.agent.deregister_memory(descs)
        if case.corrupt:
            self.corrupt(case, ranks, blocks)
        wrong = self.verify(case, ranks, before, blocks, kv, plan)
        fp = self.fingerprint_check(case, ranks, blocks, prefill_fp)
        if wrong is None and fp != "equal":
            wrong = f"wrong: the fingerprint {fp}"
        return Outcome(wrong or "exact", read_s=read_s, receive_s=receive_s, bytes=moved, fingerprint=fp)

    @staticmethod
    def fingerprint_check(case: Case, ranks, blocks: Blocks, prefill_fp: fingerprint.Fingerprint) -> str:
        """Each decode rank's fingerprint of what it received (after conversion) against the prefill's, over that
        rank's KV heads, as pdctl's connector checks it: chunk by chunk from the first token it received, past its
        prefix hit, past a sliding window's head on either side (what the prefill no longer held, and what the
        decode's window tail does not list)."""
        start = max(case.prefix_hit * case.decode.block, first_held(case), blocks.listed[0] * case.decode.block)
        heads = HEADS // case.decode.tp
        for rank, caches in enumerate(ranks):
            got = held_fingerprint(case, caches, rank, case.decode, zip(blocks.listed, blocks.ids, strict=True), start)
            at = prefill_fp.difference(got, from_chunk=start // fingerprint.CHUNK,
                                       heads=range(rank * heads, (rank + 1) * heads))
            if at is not None:
                return f"differs at {at.describe(case.tokens)} (rank {rank})"
        return "equal"

    def plan(self, case: Case, blocks: Blocks, prefill_ids: list[int], ratio: int, split: bool):
        """The read planning the connector runs (pdctl.kv.reads), on one KV group."""
        local = blocks.ids[case.prefix_hit:]
        if split:
            tails = {}
            if case.window:
                tails[0] = reads.window_tails(blocks.ids, prefill_ids, tokens=case.tokens, window=case.window,
                                              prefill_block=case.prefill.block, decode_block=case.decode.block)
            pool = StagingPool.last_blocks(blocks.total, blocks.staging)
            try:
                read = reads.plan_split([blocks.ids if case.window else local], [prefill_ids], ratio=ratio,
                                        block_size=case.decode.block, tokens=case.tokens, cached=[case.prefix_hit],
                                        tails=tails, take=pool.take)
            except reads.WindowNotHeld:
                return "refused: pdctl: the sliding-window tails do not hold the window"
            except reads.StagingFull as e:
                return f"wrong: the staging area ({blocks.staging} blocks, the least accepted) cannot hold {e} chunks"
            chunks = read.plan.groups[0]
            pairs = [(c.dest, c.src) for c in chunks]
            return {"pairs": pairs, "chunks": chunks, "fills": read.fills.get(0), "ids": None}
        if case.window and ratio > 1:
            tails = reads.window_tails(blocks.ids, prefill_ids, tokens=case.tokens, window=case.window,
                                       prefill_block=case.prefill.block, decode_block=case.decode.block)
            merge = window_pairs(**tails) if tails else None
            if merge is None:
                return "refused: pdctl: the sliding-window tails do not hold the window"
            return {"pairs": list(zip(merge.local, merge.remote, strict=True)), "fills": merge.fills,
                    "ids": blocks.ids}
        mapped, remote = reads.merge_mapping([local], [prefill_ids], ratio, [case.prefix_hit])
        subs = mapped[0] if mapped else []
        trimmed = reads.end_trimmed([subs], remote)[0]  # vLLM's _apply_prefix_caching
        return {"pairs": list(zip(subs, trimmed, strict=True)), "fills": None, "ids": local}

    def read(self, name: str, caches, meta, plan: dict, ratio: int, split: bool, local_part, remote_part,
             halve: tuple[bool, bool] = (False, False)) -> int:
        """Post one READ of every layer's planned units from one prefill rank, wait for it; the bytes moved.
        `halve` (local, remote): that side's joined pages read as two regions, against the other side's (K, V)
        pair (reads.halves, reads.as_halves)."""
        halve_local, halve_remote = halve
        local_rows, remote_rows = [], []
        if halve_remote:
            meta = reads.as_halves(meta)
        local_regions = [r for c, f in caches for r in (reads.halves(reads.regions_of(c, f)) if halve_local else
                                                         reads.regions_of(c, f))]
        if split:
            # vLLM's _build_fa_remote on the decode-sized metadata, then the connector's addresses for its chunks.
            sized = reads.as_decode_sized(meta, ratio)
            remote_descs = np.concatenate([
                np.stack([base + np.arange(n, dtype=np.uint64) * stride, np.full(n, length, dtype=np.uint64)], 1)
                for base, length, stride, n in zip(sized.kv_caches_base_addr, sized.block_lens, sized.block_strides,
                                                   sized.region_num_blocks, strict=True)])
            remote_descs[:, 0] = reads.split_addresses(sized, ratio, remote_descs)
            per_remote = sized.region_num_blocks[0]
            local_descs = np.concatenate([reads.descriptors(r, 1, local_part) for r in local_regions])
            per_local = local_regions[0].blocks
        else:
            regions = [reads.Region(*r) for r in zip(meta.kv_caches_base_addr, meta.block_lens, meta.block_strides,
                                                     meta.region_num_blocks, strict=True)]
            remote_descs = np.concatenate([reads.descriptors(r, 1, remote_part) for r in regions])
            per_remote = meta.region_num_blocks[0]
            local_descs = np.concatenate([reads.descriptors(r, ratio, local_part) for r in local_regions])
            per_local = local_regions[0].blocks * ratio
        if not plan["pairs"]:
            return 0
        for region in range(len(local_regions)):
            for loc, rem in plan["pairs"]:
                local_rows.append(region * per_local + loc)
                remote_rows.append(region * per_remote + rem)
        if not np.array_equal(local_descs[local_rows, 1], remote_descs[remote_rows, 1]):
            raise ValueError("local and remote read units differ in length")
        dev = torch.cuda.current_device() if self.device == "cuda" else 0
        with_dev = lambda d: np.concatenate([d, np.full((len(d), 1), dev, dtype=np.uint64)], 1)  # noqa: E731
        lh = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.agent.get_xfer_descs(with_dev(local_descs), self.mem))
        rh = self.agent.prep_xfer_dlist(name, self.agent.get_xfer_descs(with_dev(remote_descs), self.mem))
        try:
            handle = self.agent.make_prepped_xfer("READ", lh, local_rows, rh, remote_rows, b"conformance")
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + READ_WAIT_S
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                state = self.agent.check_xfer_state(handle)
            self.agent.release_xfer_handle(handle)
            if state != "DONE":
                raise RuntimeError(f"READ {state if state == 'ERR' else 'unfinished'}")
        finally:
            self.agent.release_dlist_handle(lh)
            self.agent.release_dlist_handle(rh)
        return int(local_descs[local_rows, 1].sum())

    @staticmethod
    def receive(case: Case, caches, plan: dict, ratio: int, split: bool, packed: str) -> None:
        """The connector's receive processing on one rank's caches (one KV group); `packed`: the prefill's page
        packing (reads.Peer.packing)."""
        if split:
            receive_split(caches, plan["chunks"], ratio, case.tokens, plan["fills"], packed)
        elif plan["ids"]:
            receive_merged(caches, list(plan["ids"]), ratio, len(plan["pairs"]), plan["fills"], packed)

    @staticmethod
    def corrupt(case: Case, ranks, blocks: Blocks) -> None:
        """Flip one byte of the last received token (the negative control)."""
        t = case.tokens - 1
        a = t // case.decode.block
        cache, form = ranks[0][0]
        row = read_tokens(cache, form, [blocks.ids[blocks.listed.index(a)]])
        raw = row.view(torch.uint8)
        raw[0, 0, t % case.decode.block, 0] ^= 0x5A
        write_tokens(cache, form, [blocks.ids[blocks.listed.index(a)]], row)

    def verify(self, case: Case, ranks, before, blocks: Blocks, kv: torch.Tensor, plan: dict) -> str | None:
        """Token by token against the prompt's KV: every slot of the request's blocks holds its token, or zero where
        nothing was sent (the last page read whole keeps the prefill's bytes past the prompt when prefill block <=
        decode block, as vLLM's own read leaves them: free, the decode writes those slots before it reads them);
        every other block of the cache (staging excepted) is as it was."""
        nd, t_all = case.decode.block, case.tokens
        lo = 0
        if case.window:  # the first token the prefill still held
            pb = prefill_blocks(case)
            lo = next(a for a, i in zip(pb.listed, pb.ids, strict=True) if i != NULL_BLOCK) * case.prefill.block
        merge_end = cdiv(t_all, case.prefill.block) * case.prefill.block if case.prefill.block <= nd and \
            not case.window else t_all
        held = set(blocks.ids) | set(range(blocks.total - blocks.staging, blocks.total))
        others = [b for b in range(blocks.total) if b not in held]
        for rank, caches in enumerate(ranks):
            heads = slice(rank * HEADS // case.decode.tp, (rank + 1) * HEADS // case.decode.tp)
            for layer, (cache, form) in enumerate(caches):
                got = read_tokens(cache, form, blocks.ids)
                for row, a in enumerate(blocks.listed):
                    for s in range(nd):
                        t = a * nd + s
                        if row < case.prefix_hit or lo <= t < t_all:
                            if t >= t_all:
                                continue  # a prefix-hit block's own slots past the prompt: the decode's business
                            want = kv[layer, t, heads]
                        elif t_all <= t < merge_end:
                            continue
                        else:
                            want = torch.zeros_like(kv[layer, 0, heads])
                        if not torch.equal(_bits(got[row, :, s]), _bits(want)):
                            return f"wrong: rank {rank} layer {layer} block {blocks.ids[row]} slot {s} (token {t})"
                views, pads_before = before[rank][layer]
                if others and any(not torch.equal(_bits(t[others]), _bits(b[others]))
                                  for t, b in zip(form.tensors(cache), views, strict=True)):
                    return f"wrong: rank {rank} layer {layer}: a block outside the request changed"
                if any(not torch.equal(_bits(p), _bits(b)) for p, b in zip(pads(cache, form), pads_before,
                                                                            strict=True)):
                    return f"wrong: rank {rank} layer {layer}: the padding block changed"
        return None


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


# -- cases --------------------------------------------------------------------------------------------------------


def case_for(pf: str, df: str, direction: str, ratio: int, dtype: str, kind: str, tp: tuple[int, int]) -> Case:
    """One matrix cell: forms, direction (equal, merge: prefill block < decode block, split: >), the case kind
    (full blocks, a partial tail, a decode prefix hit with a partial tail, a sliding-window group)."""
    small = 32 if "cpu_amx" in (pf, df) else 16
    big = small * ratio
    pb, db = {"equal": (small, small), "merge": (small, big), "split": (big, small)}[direction]
    return sized_case(pf, pb, df, db, dtype, kind, tp)


def sized_case(pf: str, pb: int, df: str, db: int, dtype: str, kind: str, tp: tuple[int, int]) -> Case:
    """One cell at given block sizes: `case_for`'s case kinds."""
    small, big = min(pb, db), max(pb, db)
    ratio, direction = big // small, "split" if pb > db else "merge"
    tail = 3 * big + big // 2 + small // 2 + 1
    tokens, hit, window = {"full": (3 * big, 0, None), "tail": (tail, 0, None),
                           "prefix": (tail, (ratio + 1) if direction == "split" else 1, None),
                           "window": (6 * big + small // 2 + 1, 0, 2 * big + small)}[kind]
    return Case(Side(pf, pb, tp[0]), Side(df, db, tp[1]), dtype, tokens, hit, window)


SAME = [(f, f) for f in (*JOINED, *CPU_FORMS, *HOST_JOINED)]
MIXED = [("LBNHC", "LBHNC"), ("LBHNC", "BLHNC"), ("cpu_vec", "cpu_amx"), ("cpu_amx", "cpu_vec"),
         ("LBHNC", "cpu_vec"), ("cpu_vec", "LBHNC")]
TPS = [(1, 1), (1, 2), (2, 1)]
# Gaudi's cache (block 128, its only kernel block size) with CUDA's (block 16), CPU's (32) and itself, device caches
# and host buffers; each pair at the other side's own block size and at 128.
GAUDI_BLOCK = 128
GAUDI = [("LBHNC", "hpu"), ("LBNHC", "hpu"), ("hpu", "LBHNC"), ("hpu", "LBNHC"), ("cpu_vec", "hpu"),
         ("cpu_amx", "hpu"), ("hpu", "cpu_vec"), ("hpu", "cpu_amx"), ("hpu", "hpu"), ("hpu", "host:hpu"),
         ("host:hpu", "hpu"), ("host:LBHNC", "host:hpu"), ("host:hpu", "host:LBHNC"), ("host:LBNHC", "host:hpu"),
         ("host:hpu", "host:LBNHC"), ("cpu_vec", "host:hpu"), ("LBNHC", "host:hpu")]


def own_block(form: str) -> int:
    return GAUDI_BLOCK if form in KV_PAIRS else 32 if form in CPU_FORMS else 16


def gaudi_cases() -> list[Case]:
    cases = []
    for pf, df in GAUDI:
        cpu = {pf, df} & set(CPU_FORMS)
        sizes = {(own_block(pf), own_block(df)), (GAUDI_BLOCK, GAUDI_BLOCK)}
        for pb, db in sorted(sizes):
            for dtype in ["bf16"] if cpu else ["bf16", "fp8"]:
                for kind in ("full", "tail", "prefix", *(("window",) if pb != db else ())):
                    for tp in TPS:
                        cases.append(sized_case(pf, pb, df, db, dtype, kind, tp))
    return cases


def matrix() -> list[Case]:
    """Forms (each with itself, and mixed pairs) x directions x ratios 2/4/8 x dtype x case kind x TP; Gaudi's
    pairs (`GAUDI`) at their own block sizes."""
    cases = []
    for pf, df in SAME + MIXED:
        cpu = {pf, df} & set(CPU_FORMS)
        if "cpu_amx" in (pf, df) or (pf, df) in MIXED:
            dtypes = ["bf16"]
        else:
            dtypes = ["bf16", "fp16"] if cpu else list(DTYPES)
        for direction, ratios in (("equal", (1,)), ("merge", (2, 4, 8)), ("split", (2, 4, 8))):
            for ratio in ratios:
                for dtype in dtypes:
                    for kind in ("full", "tail", "prefix", *(("window",) if direction != "equal" else ())):
                        for tp in TPS:
                            cases.append(case_for(pf, df, direction, ratio, dtype, kind, tp))
    return cases + gaudi_cases()


def fast_cases() -> list[Case]:
    """A few cells of every path, for the unit tier (seconds)."""
    return [case_for("BLHNC", "BLHNC", "split", 2, "bf16", "prefix", (1, 1)),
            case_for("LBNHC", "LBNHC", "merge", 4, "fp8", "window", (1, 1)),
            case_for("LBHNC", "LBHNC", "merge", 2, "fp16", "tail", (1, 2)),
            case_for("cpu_vec", "cpu_amx", "merge", 2, "bf16", "prefix", (1, 1)),
            case_for("cpu_amx", "cpu_amx", "split", 2, "bf16", "window", (1, 1)),
            case_for("LBNHC", "LBHNC", "merge", 2, "bf16", "full", (1, 1)),
            sized_case("LBNHC", 16, "hpu", GAUDI_BLOCK, "fp8", "prefix", (1, 1)),
            sized_case("host:hpu", GAUDI_BLOCK, "host:LBHNC", 16, "bf16", "window", (1, 1))]


def case_problem(case: Case) -> str | None:
    """What makes a case given by flags one the harness cannot run, naming the flag; None when it can."""
    if min(case.prefill.tp, case.decode.tp) < 1:
        return f"--tp {case.prefill.tp}:{case.decode.tp}: each side needs at least one rank"
    if case.tokens < 1:
        return f"--tokens {case.tokens}: a prompt has at least one token"
    if not 0 <= case.prefix_hit < cdiv(case.tokens, case.decode.block):
        return (f"--prefix-hit {case.prefix_hit}: the decode holds 0 to {cdiv(case.tokens, case.decode.block) - 1} "
                "of the prompt's blocks (the last one always arrives)")
    if case.window is not None and (case.window < 1 or case.prefix_hit):
        return f"--window {case.window}: a window of at least one token, without --prefix-hit"
    if case.window and case.prefill.block == case.decode.block:
        return "--window: at equal block sizes vLLM pairs the window's tails itself; pdctl plans only other sizes"
    return None


def parse_side(text: str, flag: str, tp: int) -> Side:
    form, _, block = text.rpartition(":")
    if not form or not block.isdigit() or int(block) < 1:
        raise SystemExit(f"kv_conformance: {flag} {text}: expected FORM:BLOCK (FORM: {', '.join(FORMS)})")
    return Side(form, int(block), tp)


# -- running ------------------------------------------------------------------------------------------------------


class Pair:
    """The two processes: the prefill in a child, the decode here."""

    def __init__(self, device: str):
        if device == "cpu":
            os.environ.update(UCX_LOOPBACK)
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_serve, args=(child, device), daemon=True)
        self.proc.start()
        self.decode = Decode(device)

    def run(self, case: Case) -> Outcome:
        t0 = time.perf_counter()
        for side in (case.prefill, case.decode):
            problem = form_problem(side, case.dtype)
            if problem:
                return Outcome(f"refused: {problem}", time.perf_counter() - t0)
        self.conn.send(case)
        metas, prefill_ids, agent_meta, params = self.conn.recv()
        prefill_fp = protocol.decode_fingerprint(params[protocol.FINGERPRINT_KEY])
        try:
            out = self.decode.run(case, metas, prefill_ids, agent_meta, prefill_fp)
        except Exception as e:  # noqa: BLE001 - one case's failure is reported; the next one still runs
            out = Outcome(f"wrong: {type(e).__name__}: {e}")
        out.seconds = time.perf_counter() - t0
        return out

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(timeout=20)
        if self.proc.is_alive():
            self.proc.kill()


def run_cases(cases: list[Case], device: str, progress=None) -> list[tuple[Case, Outcome]]:
    pair = Pair(device)
    out = []
    try:
        for i, case in enumerate(cases):
            out.append((case, pair.run(case)))
            if progress:
                progress(i + 1, len(cases), *out[-1])
    finally:
        pair.close()
    return out


def summary(results: list[tuple[Case, Outcome]], seconds: float) -> dict:
    kinds = {"exact": 0, "refused": 0, "wrong": 0}
    reasons: dict[str, int] = {}
    fingerprints = {"equal": 0, "differs": 0}
    for _, o in results:
        kind = o.result.split(":")[0]
        kinds[kind] += 1
        if o.fingerprint:
            fingerprints["equal" if o.fingerprint == "equal" else "differs"] += 1
        if kind == "refused":
            reasons[o.result[len("refused: "):]] = reasons.get(o.result[len("refused: "):], 0) + 1
    return {"cells": len(results), **kinds, "fingerprints": fingerprints, "refusals": reasons,
            "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog="examples:\n  " +
                                 "\n  ".join(["python scripts/kv_conformance.py --prefill BLHNC:32 --decode BLHNC:16 "
                                              "--prefix-hit 3", "python scripts/kv_conformance.py --prefill "
                                              "cpu_vec:16 --decode cpu_amx:64 --corrupt",
                                              "python scripts/kv_conformance.py --prefill LBNHC:16 --decode hpu:128 "
                                              "--prefix-hit 1 --dtype fp8",
                                              "python scripts/kv_conformance.py --json > matrix.json"]))
    ap.add_argument("--prefill", metavar="FORM:BLOCK", help=f"FORM: {', '.join(FORMS)}")
    ap.add_argument("--decode", metavar="FORM:BLOCK", help="as --prefill")
    ap.add_argument("--tokens", type=int, default=None, help="prompt tokens (default: 3.5 of the larger block + 1)")
    ap.add_argument("--prefix-hit", type=int, default=0, metavar="BLOCKS", help="decode blocks the decode holds")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--window", type=int, default=None, metavar="W", help="a sliding-window group of W tokens")
    ap.add_argument("--tp", default="1:1", metavar="P:D")
    ap.add_argument("--corrupt", action="store_true", help="flip one received byte: the case must be wrong")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--list", action="store_true", help="list the matrix's cells and exit")
    ap.add_argument("--fast", action="store_true", help="a few cells of every path (the unit tier's)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("kv_conformance: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    try:
        p_tp, d_tp = (int(x) for x in args.tp.split(":"))
    except ValueError:
        print(f"kv_conformance: --tp {args.tp}: expected P:D, e.g. 1:2", file=sys.stderr)
        return 2
    if (args.prefill is None) != (args.decode is None):
        print("kv_conformance: give both --prefill and --decode, or neither (the whole matrix)", file=sys.stderr)
        return 2
    if args.prefill:
        pre, dec = parse_side(args.prefill, "--prefill", p_tp), parse_side(args.decode, "--decode", d_tp)
        big = max(pre.block, dec.block)
        tokens = args.tokens if args.tokens is not None else 3 * big + big // 2 + 1
        cases = [Case(pre, dec, args.dtype, tokens, args.prefix_hit, args.window)]
        problem = case_problem(cases[0])
        if problem:
            print(f"kv_conformance: {problem}", file=sys.stderr)
            return 2
    else:
        cases = fast_cases() if args.fast else matrix()
    whole = not args.prefill and not args.fast and not args.corrupt
    cases = [replace(c, corrupt=args.corrupt) for c in cases]
    if args.list:
        for c in cases:
            print(c.describe())
        print(f"{len(cases)} cells")
        return 0
    started = time.perf_counter()

    def progress(i, n, case, out):
        if not args.json:
            caught = f" (fingerprint {out.fingerprint})" if out.result.startswith("wrong: rank") else ""
            print(f"{case.describe():70s} {out.result}{caught}", flush=True)
        elif i % 100 == 0:
            print(f"kv_conformance: {i}/{n}", file=sys.stderr, flush=True)

    results = run_cases(cases, args.device, progress)
    report = summary(results, time.perf_counter() - started)
    doc = json.dumps({"summary": report, "device": args.device, "cases": [
        {**asdict(c), "result": o.result, "seconds": round(o.seconds, 4), "read_s": round(o.read_s, 5),
         "receive_s": round(o.receive_s, 5), "bytes": o.bytes, "fingerprint": o.fingerprint} for c, o in results]},
        indent=1)
    if whole:  # the whole matrix: its JSON is kept beside the table
        out = ROOT / "results" / f"kv_conformance-{args.device}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(doc)
    if args.json:
        print(doc)
    else:
        fp = report["fingerprints"]
        print(f"{report['cells']} cells: {report['exact']} exact, {report['refused']} refused, {report['wrong']} "
              f"wrong; fingerprints {fp['equal']} equal, {fp['differs']} differ ({report['seconds']} s)")
    return 1 if report["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
