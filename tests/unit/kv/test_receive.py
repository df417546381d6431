"""Cache forms (pdctl.kv.forms) and the receive conversions (pdctl.kv.receive) against an independent per-token
reference: every token's K and V are written and read by (block, slot, head) at the byte offsets each form's
memory order puts them at (below), never through the code under test; NIXL's reads are simulated as raw byte copies
of those pages."""

import functools
import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.kv import forms
from pdctl.kv.forms import FormError, form_of, joined_cache
from pdctl.kv.index import merge_tail, split_plan, split_staging_needed
from pdctl.kv.receive import merge_received, split_received, zero_fills
from pdctl.kv.window import WindowFill

JOINED = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")
CPU = ("cpu:vec", "cpu:amx")
FORMS = JOINED + CPU
DTYPES = (torch.bfloat16, torch.float16, torch.uint8)  # uint8: fp8 caches are stored as bytes
HEADS = 2


def head_dim(form: str) -> int:
    return 32 if form == "cpu:amx" else 4


def smallest_block(form: str) -> int:
    return 32 if form == "cpu:amx" else 2


# -- the reference: where token n's K[d] / V[d] of head h lives in a page, written out per form -------------------


def offset(form: str, h, n, part, d, heads: int, block: int, dim: int):
    """Element offset within one page (memory order) of head h, slot n, K (part 0) or V (part 1), dim d (integers
    or broadcasting integer tensors)."""
    if form in ("LBHNC", "BLHNC"):  # [H, N, 2D]
        return (h * block + n) * 2 * dim + part * dim + d
    if form in ("LBNHC", "BLNHC"):  # [N, H, 2D]
        return (n * heads + h) * 2 * dim + part * dim + d
    base = h * 2 * block * dim + part * block * dim  # CPU_ATTN: per head its K region, then its V region
    if form == "cpu:vec":  # K transposed [D][N], V [N][D]
        return base + (1 - part) * (d * block + n) + part * (n * dim + d)
    k = (n // 16) * (dim // 2) * 32 + (d // 2) * 32 + (n % 16) * 2 + d % 2  # amx K: [N/16][D/2][16 tokens][2 dims]
    v = (d // 16) * (block // 2) * 32 + (n // 2) * 32 + (d % 16) * 2 + n % 2  # amx V: [D/16][N/2][16 dims][2 tokens]
    return base + (1 - part) * k + part * v


@functools.lru_cache(maxsize=64)
def offsets(form: str, heads: int, block: int, dim: int) -> torch.Tensor:
    """offset() for every (slot, head, part, dim) of a page: [N, H, 2, D]."""
    n, h, part, d = torch.meshgrid(torch.arange(block), torch.arange(heads), torch.arange(2), torch.arange(dim),
                                   indexing="ij")
    return offset(form, h, n, part, d, heads, block, dim)


def raw_page(cache: torch.Tensor, block: int) -> torch.Tensor:
    """Block `block`'s page as NIXL sees it: the bytes from its start, read off the storage by its stride."""
    elems = math.prod(cache.shape[1:])
    return torch.as_strided(cache, (elems,), (1,), cache.storage_offset() + block * cache.stride(0))


def make_cache(form: str, blocks: int, block: int, dtype=torch.bfloat16, layers: int = 2) -> torch.Tensor:
    if form in JOINED:
        return joined_cache(form, blocks, HEADS, block, head_dim(form), layers=layers, layer=1, dtype=dtype)
    return torch.zeros(blocks, HEADS, block, 2 * head_dim(form), dtype=dtype)


def isa_of(form: str):
    return (lambda n: form.split(":")[1]) if form in CPU else None


def cache_form(form: str, cache: torch.Tensor):
    return form_of(cache, "CPU_ATTN" if form in CPU else "FLASH_ATTN", isa_of(form))


def _slots(cache, form):
    _, heads, block, two_d = cache.shape
    return offsets(form, heads, block, two_d // 2)


def write_token(cache, form, block_id, slot, k, v):
    raw_page(cache, block_id)[_slots(cache, form)[slot]] = torch.stack([k, v], dim=1)


def read_token(cache, form, block_id, slot):
    kv = raw_page(cache, block_id)[_slots(cache, form)[slot]]  # [H, 2, D]
    return kv[:, 0], kv[:, 1]


def token_values(tokens: int, dim: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, 120, (tokens, HEADS, dim), generator=g).to(dtype)  # never 0: zeroing shows
    v = torch.randint(1, 120, (tokens, HEADS, dim), generator=g).to(dtype)
    return k, v


def garbage(cache, seed: int) -> None:
    """Stale bytes everywhere: what a slot still holds from an earlier request."""
    g = torch.Generator().manual_seed(seed)
    for b in range(cache.shape[0]):
        page = raw_page(cache, b)
        page.copy_(torch.randint(121, 127, page.shape, generator=g).to(cache.dtype))


def prefill(form, block, tokens, dtype, seed):
    """A prefill cache holding `tokens` tokens in blocks 0..; its slots past the prompt stale."""
    n_blocks = -(-tokens // block)
    cache = make_cache(form, n_blocks, block, dtype)
    garbage(cache, seed + 1)
    k, v = token_values(tokens, head_dim(form), dtype, seed)
    for t in range(tokens):
        write_token(cache, form, t // block, t % block, k[t], v[t])
    return cache, k, v


# -- the forms ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", JOINED)
def test_each_joined_form_is_told_by_its_strides_and_its_pages_are_the_bytes_nixl_moves(name):
    cache = make_cache(name, 5, 4, torch.float16, layers=3)
    f = cache_form(name, cache)
    assert f.name == name and f.num_blocks(cache) == 5 and (f.heads, f.block_size, f.head_dim) == (2, 4, 4)
    garbage(cache, 0)
    ids = forms.block_ids([3, 1], cache)
    assert torch.equal(f.pages(cache, ids), torch.stack([raw_page(cache, 3), raw_page(cache, 1)]))
    addr, length = f.region(cache, 3)
    assert addr == raw_page(cache, 3).data_ptr() and length == f.page_elems * 2 == 2 * 4 * 8 * 2
    f.page(cache, 2).fill_(0)  # a view: the write reaches the cache
    assert not raw_page(cache, 2).any() and raw_page(cache, 1).all()
    f.put_pages(cache, ids, torch.zeros(2, f.page_elems, dtype=cache.dtype))
    assert not raw_page(cache, 3).any() and raw_page(cache, 4).all()


@pytest.mark.parametrize("name, says", [("LHBNC", "KV cache form LHBNC"), ("BHLNC", "KV cache form BHLNC")])
def test_vllm_034s_scattered_forms_are_refused_by_name(name, says):
    with pytest.raises(FormError, match=says) as e:
        form_of(joined_cache(name, 4, 2, 4, 4, layers=2), "FLASH_ATTN")
    assert "not one contiguous run" in str(e.value)


def test_cpu_attn_needs_its_isa_and_an_lbhnc_cache():
    cache = make_cache("cpu:vec", 3, 32)
    assert form_of(cache, "CPU_ATTN", lambda n: "vec16" if n % 32 else "vec").side(16).layout.name == "cpu_vec"
    with pytest.raises(FormError, match="isa_of"):
        form_of(cache, "CPU_ATTN")
    with pytest.raises(FormError, match="CPU_ATTN with a LBNHC cache"):
        form_of(joined_cache("LBNHC", 3, 2, 32, 4), "CPU_ATTN", lambda n: "vec")
    with pytest.raises(FormError, match=r"or a \(K, V\) pair"):
        form_of(torch.zeros(2, 3, 32, 2, 4), "HPU_ATTN")  # K and V stacked: [2, B, N, H, D]


# -- the conversions, against the reference ----------------------------------------------------------------------


def check_tokens(cache, form, ids, block, k, v, tokens):
    for t in range(tokens):
        got_k, got_v = read_token(cache, form, ids[t // block], t % block)
        assert torch.equal(got_k, k[t]) and torch.equal(got_v, v[t]), f"token {t} (block {t // block})"


def check_zero(cache, form, block_id, first, block):
    for n in range(first, block):
        got_k, got_v = read_token(cache, form, block_id, n)
        assert not got_k.any() and not got_v.any(), f"slot {n} of block {block_id} not zeroed"


def run_merge(form, ratio, tokens, dtype, seed, stale=1):
    """P < D: each decode block gets `ratio` prefill pages back to back (vLLM's local descriptors), then the merge."""
    d_block = smallest_block(form) * ratio
    p_block = d_block // ratio
    src, k, v = prefill(form, p_block, tokens, dtype, seed)
    n_p, n_d = src.shape[0], -(-tokens // d_block)
    cache = make_cache(form, n_d + stale + 3, d_block, dtype)
    garbage(cache, seed + 2)
    ids = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(seed))[:n_d + stale].tolist()
    e_p = raw_page(src, 0).numel()
    for i in range(n_p):
        j, part = divmod(i, ratio)
        raw_page(cache, ids[j])[part * e_p:(part + 1) * e_p] = raw_page(src, i)
    written, zero_from = merge_tail(n_p, ratio, d_block)
    merge_received([(cache, cache_form(form, cache))], ids, ratio, written, zero_from)
    return cache, ids, d_block, k, v, zero_from, written


def run_split(form, ratio, tokens, dtype, seed, hit=0):
    """P > D: each prefill page read whole as `ratio` decode-sized chunks (pdctl.kv.index's plan, staging for the
    chunks no decode block takes, a prefix hit of `hit` decode blocks), then the split."""
    d_block = smallest_block(form)
    p_block = d_block * ratio
    src, k, v = prefill(form, p_block, tokens, dtype, seed)
    n_d = -(-tokens // d_block)
    cache = make_cache(form, 2 * n_d + 2 * ratio + 2, d_block, dtype)
    garbage(cache, seed + 2)
    order = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(seed)).tolist()
    ids, spare = order[:n_d], order[n_d:]
    for t in range(hit * d_block):  # the decode's own prefix hit: already there, never touched
        write_token(cache, form, ids[t // d_block], t % d_block, k[t], v[t])
    shape = dict(ratio=ratio, block_size=d_block, tokens=tokens, cached=[hit])
    local, remote = [ids[hit:]], [list(range(src.shape[0]))]
    need = split_staging_needed(local, remote, **shape)
    plan = split_plan(local, remote, staging=spare[:need], **shape)
    (chunks,) = plan.groups
    e_d = raw_page(cache, 0).numel()
    for c in chunks:
        b, part = divmod(c.src, ratio)
        raw_page(cache, c.dest).copy_(raw_page(src, b)[part * e_d:(part + 1) * e_d])
    tail = None
    if tokens % d_block:
        last = n_d - 1
        tail = next(i for i, c in enumerate(chunks) if c.block == last), tokens - last * d_block
    split_received([(cache, cache_form(form, cache))], [c.dest for c in chunks], ratio, tail)
    return cache, ids, d_block, k, v


def check_window(cache, form, local, local_first, block, need_from, tokens, k, v, fills):
    """A sliding-window group's decode tail: every token from need_from is back, every slot a fill names is zero."""
    for t in range(need_from, tokens):
        got_k, got_v = read_token(cache, form, local[t // block - local_first], t % block)
        assert torch.equal(got_k, k[t]) and torch.equal(got_v, v[t]), f"token {t}"
    for fill in fills:
        for start, stop in fill.zero:
            check_zero(cache, form, fill.id, start, stop)


@given(st.sampled_from(FORMS), st.sampled_from((2, 4, 8)), st.booleans(), st.sampled_from(DTYPES),
       st.integers(0, 2**16))
def test_a_merge_gives_every_token_back_and_zeroes_past_the_prefill(form, ratio, full, dtype, seed):
    d_block = smallest_block(form) * ratio
    tokens = 2 * d_block if full else d_block + 1 + seed % (d_block - 1)
    cache, ids, block, k, v, zero_from, written = run_merge(form, ratio, tokens, dtype, seed)
    check_tokens(cache, form, ids, block, k, v, tokens)
    if zero_from is not None:
        check_zero(cache, form, ids[written - 1], zero_from, block)
    assert not raw_page(cache, ids[written]).any()  # a block past the prompt: zeroed whole


@given(st.sampled_from(FORMS), st.sampled_from((2, 4, 8)), st.booleans(), st.integers(0, 2), st.sampled_from(DTYPES),
       st.integers(0, 2**16))
def test_a_split_gives_every_token_back_and_zeroes_past_the_prompt(form, ratio, full, hit, dtype, seed):
    d_block = smallest_block(form)
    p_block = d_block * ratio
    tokens = p_block + (0 if full else 1 + seed % (p_block - 1))
    hit = min(hit, tokens // d_block - 1)
    cache, ids, block, k, v = run_split(form, ratio, tokens, dtype, seed, hit)
    check_tokens(cache, form, ids, block, k, v, tokens)
    if tokens % block:
        check_zero(cache, form, ids[-1], tokens % block, block)


def test_negative_control_a_chunk_read_one_block_off_is_caught(monkeypatch):
    """The reference can fail: shift every split destination by one block and the tokens come back wrong."""
    import pdctl.kv.receive as receive

    real_split = receive.split_received

    def off_by_one(layers, dests, ratio, tail=None, fills=()):
        return real_split(layers, [(d + 1) % layers[0][0].shape[0] for d in dests], ratio, tail, fills)

    monkeypatch.setattr(sys.modules[__name__], "split_received", off_by_one)
    cache, ids, block, k, v = run_split("LBHNC", 2, 13, torch.bfloat16, 7)
    with pytest.raises(AssertionError, match="token"):
        check_tokens(cache, "LBHNC", ids, block, k, v, 13)


@pytest.mark.parametrize("form", FORMS)
def test_zero_fills_clear_exactly_the_slots_they_name(form):
    block = smallest_block(form) * 2
    cache = make_cache(form, 4, block)
    garbage(cache, 3)
    before = cache.clone()
    zero_fills([(cache, cache_form(form, cache))], [WindowFill(2, 0, (1, block), ((0, 1),)),
                                                WindowFill(0, 1, (0, 0), ((0, block),))])
    check_zero(cache, form, 2, 0, 1)
    check_zero(cache, form, 0, 0, block)
    for n in range(1, block):  # the rest of block 2 untouched
        assert all(torch.equal(a, b) for a, b in zip(read_token(cache, form, 2, n), read_token(before, form, 2, n),
                                                     strict=True))
    assert torch.equal(raw_page(cache, 1), raw_page(before, 1)) and torch.equal(raw_page(cache, 3),
                                                                                   raw_page(before, 3))


def window_request(form, p_block: int, d_block: int, dtype, seed: int, lead: int):
    """A prompt of `lead` to lead + 2 bigger blocks and a window of one to two of them, its KV in a prefill cache,
    and where each side's tail of the window starts: (tokens, need_from, src, k, v, local_first, remote_first,
    n_local)."""
    big = max(p_block, d_block)
    tokens = lead * big + 1 + seed % (2 * big - 1)
    window = big + 1 + (seed // 7) % big
    need_from = max(0, tokens - window + 1)
    src, k, v = prefill(form, p_block, tokens, dtype, seed)
    local_first, remote_first = need_from // d_block, need_from // p_block
    return tokens, need_from, src, k, v, local_first, remote_first, -(-tokens // d_block) - local_first


@settings(max_examples=50)  # the larger blocks (amx x8): a few ms per example
@given(st.sampled_from(FORMS), st.sampled_from((2, 4, 8)), st.sampled_from(DTYPES), st.integers(0, 2**16))
def test_a_sliding_window_merge_gives_the_window_back_and_zeroes_what_the_prefill_no_longer_held(form, ratio,
                                                                                                 dtype, seed):
    """P < D on a sliding-window group: each side holds only the window's tail (pdctl.kv.window pairs them by
    token); every token the decode needs comes back, every slot the prefill did not send is zero."""
    from pdctl.kv.receive import merge_window
    from pdctl.kv.window import window_pairs

    p_block = smallest_block(form)
    d_block = p_block * ratio
    tokens, need_from, src, k, v, local_first, remote_first, n_local = window_request(form, p_block, d_block, dtype,
                                                                                     seed, lead=3)
    cache = make_cache(form, n_local + 4, d_block, dtype)
    garbage(cache, seed + 3)
    local = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(seed))[:n_local].tolist()
    remote = list(range(remote_first, src.shape[0]))
    plan = window_pairs(local, remote, local_first=local_first, remote_first=remote_first, prefill_block=p_block,
                        decode_block=d_block, tokens=tokens, need_from=need_from)
    assert plan is not None
    e_p = raw_page(src, 0).numel()
    for sub, rid in zip(plan.local, plan.remote, strict=True):
        raw_page(cache, sub // ratio)[(sub % ratio) * e_p:(sub % ratio + 1) * e_p] = raw_page(src, rid)
    merge_window([(cache, cache_form(form, cache))], local, ratio, plan.fills)
    check_window(cache, form, local, local_first, d_block, need_from, tokens, k, v, plan.fills)


@settings(max_examples=50)  # the larger blocks (amx x8): a few ms per example
@given(st.sampled_from(FORMS), st.sampled_from((2, 4, 8)), st.integers(1, 2), st.sampled_from(DTYPES),
       st.integers(0, 2**16))
def test_a_merge_past_a_decode_prefix_hit_gives_every_new_token_back(form, ratio, hit, dtype, seed):
    """P < D where the decode already holds `hit` blocks of the prompt: the sub-blocks past them paired as the
    connector pairs them (pdctl.kv.reads.merge_mapping, then vLLM's end-trim), then the merge."""
    from pdctl.kv.reads import end_trimmed, merge_mapping

    p_block = smallest_block(form)
    d_block = p_block * ratio
    tokens = (hit + 1) * d_block + 1 + seed % (2 * d_block - 1)
    src, k, v = prefill(form, p_block, tokens, dtype, seed)
    n_d = -(-tokens // d_block)
    cache = make_cache(form, n_d + 3, d_block, dtype)
    garbage(cache, seed + 4)
    ids = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(seed))[:n_d].tolist()
    for t in range(hit * d_block):  # the decode's own prefix hit
        write_token(cache, form, ids[t // d_block], t % d_block, k[t], v[t])
    new, remote = ids[hit:], list(range(src.shape[0]))
    fixed, _ = merge_mapping([new], [remote], ratio, [hit])
    subs = fixed[0]
    pairs = list(zip(subs, end_trimmed([subs], [remote])[0], strict=True))
    e_p = raw_page(src, 0).numel()
    for sub, rid in pairs:
        raw_page(cache, sub // ratio)[(sub % ratio) * e_p:(sub % ratio + 1) * e_p] = raw_page(src, rid)
    written, zero_from = merge_tail(len(pairs), ratio, d_block)
    merge_received([(cache, cache_form(form, cache))], new, ratio, written, zero_from)
    check_tokens(cache, form, ids, d_block, k, v, tokens)


@settings(max_examples=50)  # the larger blocks (amx x8): a few ms per example
@given(st.sampled_from(FORMS), st.sampled_from((2, 4, 8)), st.sampled_from(DTYPES), st.integers(0, 2**16))
def test_a_sliding_window_split_gives_the_window_back_and_zeroes_what_the_prefill_no_longer_held(form, ratio,
                                                                                                 dtype, seed):
    """P > D on a sliding-window group: whole prefill blocks of the window's tail read as decode-sized chunks
    (pdctl.kv.window.window_split_plan, staging for what the decode's tail does not hold), then the split."""
    from pdctl.kv.window import window_split_plan, window_staging_needed

    d_block = smallest_block(form)
    p_block = d_block * ratio
    tokens, need_from, src, k, v, local_first, remote_first, n_local = window_request(form, p_block, d_block, dtype,
                                                                                     seed, lead=2)
    cache = make_cache(form, n_local + 2 * ratio + 2, d_block, dtype)
    garbage(cache, seed + 5)
    order = torch.randperm(cache.shape[0], generator=torch.Generator().manual_seed(seed)).tolist()
    local, spare = order[:n_local], order[n_local:]
    tails = dict(local=local, remote=list(range(remote_first, src.shape[0])), local_first=local_first,
                 remote_first=remote_first, prefill_block=p_block, decode_block=d_block, tokens=tokens,
                 need_from=need_from)
    need = window_staging_needed(**tails)
    plan = window_split_plan(**tails, staging=spare[:need])
    assert plan is not None
    e_d = raw_page(cache, 0).numel()
    for c in plan.chunks:
        b, part = divmod(c.src, ratio)
        raw_page(cache, c.dest).copy_(raw_page(src, b)[part * e_d:(part + 1) * e_d])
    split_received([(cache, cache_form(form, cache))], [c.dest for c in plan.chunks],
                   ratio, fills=plan.fills)
    check_window(cache, form, local, local_first, d_block, need_from, tokens, k, v, plan.fills)
