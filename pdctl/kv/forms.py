"""The cache forms a connector is handed: how one registered KV cache tensor holds its blocks.

vLLM hands the connector one tensor per layer, logically `[B, H, N, 2D]` (block, KV head, token slot, a token's K
then V for one head), whatever order its memory is in: the layout is in the strides. A block's **page** is what NIXL
registers and moves for it: the bytes of one (layer, block), in memory order. The forms:

- joined caches, named by vLLM's KVCacheLayout as the memory order of (layer, block, head, token, channel):
  LBHNC and BLHNC (a page is `[H, N, 2D]`, pdctl.kv.layouts.HND), LBNHC and BLNHC (`[N, H, 2D]`, NHD). LB* keeps a
  layer's blocks back to back, BL* interleaves the layers block by block; a page is contiguous in all four.
  vLLM 0.34's LHBNC and BHLNC put the head or layer axis between a block's heads: a page is not one run of bytes,
  and they are refused by name;
- CPU_ATTN's packings: logically LBHNC, but each (block, head) holds its K region then its V region in the order of
  the attention ISA vLLM chose for the block size (vec, vec16: K transposed; amx: 16-token tiles). The ISA depends
  on the block size, so the form asks `isa_of(block_size)` (received blocks may be another size than the cache's);
- separate K and V tensors (Gaudi, `KvPairForm`): vllm-gaudi hands a layer as a (K, V) pair, each
  `[B, N, H, D]` (its flat `(blocks * N, H, D)` slots viewed per block, the padding block left out) and registers
  each as its own region. Its device cache is token-major (`hpu`: a page is `[N, H, D]` in each), its host buffer
  head-major (`hpu_host`: `[H, N, D]` in each). pdctl.kv sees the page as the K page then the V page.

The form is chosen once, from the tensor's shape, strides and the attention backend (`form_of`), never from a
layout name. Pure torch: no vLLM, no NIXL.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pdctl.kv.convert import Side
from pdctl.kv.layouts import BlockShape, layout

CPU_BACKEND = "CPU_ATTN"


class FormError(ValueError):
    """A cache form the connector cannot convert: the message names the form and the reason."""


@dataclass(frozen=True)
class CacheForm:
    """One registered cache tensor's form. `page_dims`: the logical axes (1 = H, 2 = N, 3 = C) in memory order
    within a page; `isa_of`: CPU_ATTN's ISA for a block size (None for joined caches, whose layout does not depend
    on it)."""

    name: str
    heads: int
    block_size: int
    head_dim: int
    page_dims: tuple[int, int, int]
    isa_of: Callable[[int], str] | None = field(default=None, compare=False)

    @property
    def page_elems(self) -> int:
        return self.heads * self.block_size * 2 * self.head_dim

    def side(self, block_size: int | None = None, packed: str | None = None) -> Side:
        """How a page of `block_size` tokens (default: the cache's own) is laid out: its Side for pdctl.kv.convert.
        `packed`: how received pages were packed when not as this cache packs them (the ISA a CPU_ATTN prefill
        advertised; HND or NHD for a prefill of another joined form)."""
        n = block_size or self.block_size
        if packed is not None:
            name = packed
        elif self.isa_of is not None:
            name = self.isa_of(n)
        else:
            name = "HND" if self.page_dims == (1, 2, 3) else "NHD"
        return Side(layout(name), BlockShape(self.heads, n, self.head_dim))

    def tensors(self, cache) -> tuple[torch.Tensor, ...]:
        """The tensors one layer's cache is, each its own registered region: the cache itself (a K/V pair: K, V)."""
        return (cache,)

    def num_blocks(self, cache) -> int:
        return self.tensors(cache)[0].shape[0]

    def pages(self, cache, ids: torch.Tensor) -> torch.Tensor:
        """Blocks `ids` (an index tensor on the cache's device) as [len(ids), page_elems]: each row a copy of one
        page in memory order, the bytes NIXL moved (a K/V pair: the K page, then the V page)."""
        rows = [t.index_select(0, ids).permute(0, *self.page_dims).reshape(ids.numel(), -1)
                for t in self.tensors(cache)]
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim=1)

    def put_pages(self, cache, ids: torch.Tensor, pages: torch.Tensor) -> None:
        """Write rows of memory-order pages back into blocks `ids`."""
        tensors = self.tensors(cache)
        dims = [tensors[0].shape[d] for d in self.page_dims]
        back = [0] * 4
        for pos, d in enumerate((0, *self.page_dims)):
            back[d] = pos
        for t, part in zip(tensors, pages.reshape(ids.numel(), len(tensors), -1).unbind(1), strict=True):
            t.index_copy_(0, ids, part.reshape(ids.numel(), *dims).permute(*back))

    def page(self, cache: torch.Tensor, block: int) -> torch.Tensor:
        """Block `block`'s page as a flat view (writes reach the cache) in memory order."""
        return cache[block].permute(*(d - 1 for d in self.page_dims)).view(-1)

    def zero_blocks(self, cache, ids: torch.Tensor) -> None:
        """Zero blocks `ids` whole."""
        for t in self.tensors(cache):
            t.index_fill_(0, ids, 0)

    def region(self, cache: torch.Tensor, block: int) -> tuple[int, int]:
        """Block `block`'s page as NIXL registers and reads it: (byte address, byte length)."""
        size = cache.element_size()
        return cache.data_ptr() + block * cache.stride(0) * size, self.page_elems * size


@dataclass(frozen=True)
class KvPair:
    """One layer's cache handed as separate K and V tensors, each [B, N, H, D] (a view of vllm-gaudi's slots)."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def __iter__(self):
        return iter((self.k, self.v))


@dataclass(frozen=True)
class KvPairForm(CacheForm):
    """A layer's (K, V) pair (`KvPair`): its page is the K page then the V page, each of `half` elements in memory
    order (`page_dims` of the K tensor's [B, N, H, D] axes: (1, 2, 3) token-major, (2, 1, 3) head-major)."""

    def side(self, block_size: int | None = None, packed: str | None = None) -> Side:
        n = block_size or self.block_size
        return Side(layout(packed or self.name), BlockShape(self.heads, n, self.head_dim))

    @property
    def half(self) -> int:
        """Elements of each of a page's two parts (its K page, its V page)."""
        return self.page_elems // 2

    def tensors(self, cache: KvPair) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        return (cache.k, cache.v)

    def page(self, cache: KvPair, block: int) -> torch.Tensor:  # type: ignore[override]
        raise FormError("a K/V pair's page spans two tensors: no single view of it (use pages/put_pages)")

    def region(self, cache: KvPair, block: int) -> tuple[int, int]:  # type: ignore[override]
        raise FormError("a K/V pair registers two regions per layer (pdctl.kv.reads.regions_of)")


def kv_pair_form(cache: KvPair) -> KvPairForm:
    """The form of a layer handed as a (K, V) pair of [B, N, H, D] tensors. FormError when K and V differ in shape,
    dtype or strides, or when a block's page in either is not one contiguous run of bytes."""
    k, v = cache
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype or k.stride() != v.stride():
        raise FormError(f"a K/V pair of shapes {tuple(k.shape)} / {tuple(v.shape)}, strides {k.stride()} / "
                        f"{v.stride()}: pdctl.kv models K and V as [B, N, H, D] tensors laid out alike")
    _, n, h, d = k.shape
    order = tuple(dim for dim in _memory_order(k) if dim)
    sizes = {1: n, 2: h, 3: d}
    inner = 1
    for dim in reversed(order):
        if sizes[dim] > 1 and k.stride(dim) != inner:
            order = ()
            break
        inner *= sizes[dim]
    if order == (1, 2, 3):
        name = "hpu"
    elif order == (2, 1, 3):
        name = "hpu_host"
    else:
        raise FormError(f"a K/V pair with strides {k.stride()} for shape {tuple(k.shape)}: a block's K page is not "
                        "one contiguous run of bytes in token-major [N, H, D] or head-major [H, N, D] order")
    return KvPairForm(name, h, n, d, order)  # type: ignore[arg-type]


def _memory_order(cache: torch.Tensor) -> tuple[int, ...]:
    """The logical axes of `cache` from the outermost in memory to the innermost."""
    return tuple(sorted(range(cache.dim()), key=lambda d: (-cache.stride(d), -d)))


def _joined_name(cache: torch.Tensor, page_dims: tuple[int, ...]) -> str | None:
    """vLLM's name for a joined cache whose page is contiguous in `page_dims` order, or None when it is not."""
    _, h, n, c = cache.shape
    sizes = {1: h, 2: n, 3: c}
    inner = 1
    for d in reversed(page_dims):  # innermost first: each axis' stride is the product of those inside it
        if sizes[d] > 1 and cache.stride(d) != inner:
            return None
        inner *= sizes[d]
    if cache.shape[0] > 1 and cache.stride(0) % inner:
        return None
    mid = "HN" if page_dims == (1, 2, 3) else "NH"
    return ("LB" if cache.shape[0] == 1 or cache.stride(0) == inner else "BL") + mid + "C"


def _refused_name(cache: torch.Tensor) -> str:
    """The name a cache whose page is not contiguous is refused under (vLLM 0.34's forms, else its strides)."""
    order = _memory_order(cache)
    if order.index(1) < order.index(0):
        return "LHBNC"  # heads outside blocks: a block's heads lie a whole head's blocks apart
    if order[:2] == (0, 1):
        return "BHLNC"  # each head of a block holds the block's every layer: one layer's page is scattered
    return f"strides {tuple(cache.stride())} for shape {tuple(cache.shape)}"


def form_of(cache: torch.Tensor, backend: str, isa_of: Callable[[int], str] | None = None) -> CacheForm:
    """The form of one registered cache tensor (logical [B, H, N, 2D]) of attention backend `backend`. CPU_ATTN
    needs `isa_of` (the ISA vLLM uses for a block size). FormError for a form the connector cannot convert."""
    if cache.dim() != 4:
        raise FormError(f"a {backend} cache of shape {tuple(cache.shape)}: pdctl.kv models one joined [B, H, N, 2D] "
                        "tensor per layer, or a (K, V) pair (kv_pair_form)")
    _, h, n, c = cache.shape
    if c % 2:
        raise FormError(f"a {backend} cache of shape {tuple(cache.shape)}: the last axis is not a token's K and V")
    order = tuple(d for d in _memory_order(cache) if d)
    page_dims = order if order in ((1, 2, 3), (2, 1, 3)) else None
    name = _joined_name(cache, page_dims) if page_dims else None
    if name is None:
        name = _refused_name(cache)
        raise FormError(f"KV cache form {name}: a (layer, block) page is not one contiguous run of bytes, so NIXL "
                        "cannot move a block as one region; pdctl's connector converts LBHNC, LBNHC, BLHNC, BLNHC "
                        "and CPU_ATTN")
    if backend == CPU_BACKEND:
        if page_dims != (1, 2, 3):
            raise FormError(f"KV cache form CPU_ATTN with a {name} cache: CPU_ATTN packs each (block, head) "
                            "contiguously (LBHNC); this cache is not laid out so")
        if isa_of is None:
            raise FormError("KV cache form CPU_ATTN: the ISA per block size (isa_of) is needed to read its packing")
        return CacheForm(f"CPU_ATTN:{isa_of(n)}", h, n, c // 2, page_dims, isa_of)
    return CacheForm(name, h, n, c // 2, page_dims)  # type: ignore[arg-type]


def joined_caches(form: str, blocks: int, heads: int, block_size: int, head_dim: int, layers: int = 1,
                  dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Every layer's cache tensor laid out as vLLM lays `form` (a KVCacheLayout name), each logically [B, H, N, 2D]:
    strided views of one zeroed buffer of every layer. For tests and checks; pdctl never allocates caches."""
    axes = {"L": layers, "B": blocks, "H": heads, "N": block_size, "C": 2 * head_dim}
    if sorted(form) != sorted("LBHNC"):
        raise FormError(f"unknown KV cache form {form!r}")
    buf = torch.zeros(*(axes[a] for a in form), dtype=dtype, device=device)
    rest = [a for a in form if a != "L"]
    return [buf.select(form.index("L"), layer).permute(*(rest.index(a) for a in "BHNC")) for layer in range(layers)]


def joined_cache(form: str, blocks: int, heads: int, block_size: int, head_dim: int, layers: int = 1,
                 layer: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
                 ) -> torch.Tensor:
    """Layer `layer`'s cache of `joined_caches`."""
    return joined_caches(form, blocks, heads, block_size, head_dim, layers, dtype, device)[layer]


def kv_pairs(form: str, blocks: int, heads: int, block_size: int, head_dim: int, layers: int = 1,
             dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> list[KvPair]:
    """Every layer's (K, V) pair as vllm-gaudi lays `form` out: `hpu`, its device cache (each of K and V its own
    flat `(blocks + 1) * block_size` slots of [H, D], viewed per block without the padding block at the end), or
    `hpu_host`, its host buffer (per layer one [2, B, H, N, D] allocation viewed as [2, B, N, H, D]). Zeroed; for
    tests and checks."""
    pairs = []
    for _ in range(layers):
        if form == "hpu":
            k, v = (torch.zeros((blocks + 1) * block_size, heads, head_dim, dtype=dtype, device=device)
                    .view(-1, block_size, heads, head_dim)[:blocks] for _ in range(2))
        elif form == "hpu_host":
            buf = torch.zeros(2, blocks, heads, block_size, head_dim, dtype=dtype, device=device)
            k, v = buf.permute(0, 1, 3, 2, 4).unbind(0)
        else:
            raise FormError(f"unknown K/V pair form {form!r} (hpu, hpu_host)")
        pairs.append(KvPair(k, v))
    return pairs


def block_ids(values: Sequence[int], cache: torch.Tensor | KvPair) -> torch.Tensor:
    """Block ids as an index tensor on the cache's device."""
    return torch.tensor(list(values), dtype=torch.long, device=cache.device)
