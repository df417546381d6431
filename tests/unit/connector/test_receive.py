"""The connector's own receive path (PdctlNixlWorker's post-process, split and window mixins) on small CPU caches
laid out as vLLM lays each form, without servers: every token read back by the per-token reference of
tests/unit/kv/test_receive.py; and every index and mask made on the cache's device."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from pdctl.connector import seam
from pdctl.connector.nixl import NixlPullConnectorWorker, PdctlNixlWorker
from pdctl.kv.forms import FormError, joined_cache
from pdctl.kv.index import merge_tail, split_plan, split_staging_needed
from pdctl.kv.receive import merge_received, merge_window, split_received, zero_fills
from pdctl.kv.window import WindowFill
from tests.unit.kv.test_receive import (
    check_tokens,
    check_zero,
    garbage,
    make_cache,
    prefill,
    raw_page,
    read_token,
)

LAYERS = ("layer.0", "layer.1")


def worker(monkeypatch, form: str, blocks: int, block: int, layers=LAYERS, dtype=torch.bfloat16):
    """A PdctlNixlWorker as far as its receive path reads it: one cache per layer in `form`."""
    w = object.__new__(PdctlNixlWorker)
    cpu = form.startswith("cpu:")
    w.block_size, w.backend_name, w._cpu_attn, w._forms, w._received_packing = block, "CPU_ATTN" if cpu else \
        "FLASH_ATTN", cpu, {}, {}
    w.enable_permute_local_kv, w._window_fills = False, {}
    w.kv_cache_layout = "LBHNC" if cpu else form  # the name vLLM gives the layout (pdctl reads the strides)
    if form.startswith("cpu:"):
        w.device_kv_caches = {n: make_cache(form, blocks, block, dtype) for n in layers}
        monkeypatch.setattr(seam, "attn_isa", lambda dtype, n, head, cache_dtype: form.split(":")[1])
        w.vllm_config = type("C", (), {"cache_config": type("CC", (), {"cache_dtype": "auto"})()})()
    else:  # one buffer of every layer, each layer's cache a strided view of it, as vLLM allocates
        w.device_kv_caches = {n: joined_cache(form, blocks, 2, block, 4, layers=len(layers), layer=i, dtype=dtype)
                              for i, n in enumerate(layers)}
    monkeypatch.setattr(seam, "group_layer_names", lambda self, g: list(layers))
    return w


@pytest.mark.parametrize("form", ["LBHNC", "LBNHC", "BLHNC", "BLNHC", "cpu:vec"])
def test_the_connectors_split_gives_every_token_back_in_every_form(monkeypatch, form):
    """The probe that found LBNHC (4 of 32 slots wrong) and BLNHC (26 of 32) misread at ead200e: 2 layers, 2 heads,
    decode block 4, prefill block 8, 13 tokens (a partial last block); now every token of both layers is right and
    the slots past the prompt are zero."""
    tokens, ratio, block = 13, 2, 4 if not form.startswith("cpu:") else 32
    tokens = tokens if block == 4 else 13 * 8
    w = worker(monkeypatch, form, 16, block)
    n_d = -(-tokens // block)
    ids, spare = list(range(3, 3 + n_d)), [0, 1]
    shape = dict(ratio=ratio, block_size=block, tokens=tokens)
    need = split_staging_needed([ids], [[0, 1, 2, 3, 4, 5, 6][: -(-tokens // (block * ratio))]], **shape)
    srcs = {}
    for name in LAYERS:
        garbage(w.device_kv_caches[name], 5)
        srcs[name] = prefill(form, block * ratio, tokens, torch.bfloat16, seed=len(srcs))
    plan = split_plan([ids], [list(range(srcs[LAYERS[0]][0].shape[0]))], staging=spare[:need], **shape)
    e_d = raw_page(w.device_kv_caches[LAYERS[0]], 0).numel()
    for name in LAYERS:
        for c in plan.groups[0]:
            b, part = divmod(c.src, ratio)
            raw_page(w.device_kv_caches[name], c.dest).copy_(raw_page(srcs[name][0], b)[part * e_d:(part + 1) * e_d])
    w._split_received(plan, {})
    for name in LAYERS:
        _, k, v = srcs[name]
        check_tokens(w.device_kv_caches[name], form, ids, block, k, v, tokens)
        check_zero(w.device_kv_caches[name], form, ids[-1], tokens % block, block)


@pytest.mark.parametrize("prefill_form, decode_form", [("cpu:amx", "cpu:vec"), ("cpu:vec", "cpu:amx")])
def test_the_connectors_split_reads_a_prefill_of_another_cpu_isa_in_its_packing(monkeypatch, prefill_form,
                                                                                  decode_form):
    """P64 -> D32 between CPU hosts of different attention ISAs: the split reads each prefill block in the packing
    the prefill advertised (the handshake notes it by prefill block size); read in the decode's own packing it
    would be wrong (the negative control)."""
    import tests.unit.kv.test_receive as helpers

    monkeypatch.setattr(helpers, "head_dim", lambda form: 32)  # one model on both hosts (amx needs D % 32 == 0)
    ratio, block, tokens = 2, 32, 64 * 2 + 7
    ids = [4, 1, 6, 2, 5]
    src, k, v = prefill(prefill_form, block * ratio, tokens, torch.bfloat16, seed=3)
    plan = split_plan([ids], [list(range(src.shape[0]))], ratio=ratio, block_size=block, tokens=tokens, staging=[7])

    def received(isa: dict) -> PdctlNixlWorker:
        w = worker(monkeypatch, decode_form, 8, block, layers=LAYERS[:1])
        w._received_packing = isa
        cache = w.device_kv_caches[LAYERS[0]]
        garbage(cache, 4)
        e_d = raw_page(cache, 0).numel()
        for c in plan.groups[0]:
            b, part = divmod(c.src, ratio)
            raw_page(cache, c.dest).copy_(raw_page(src, b)[part * e_d:(part + 1) * e_d])
        w._split_received(plan, {})
        return w

    w = received({block * ratio: prefill_form.split(":")[1]})
    check_tokens(w.device_kv_caches[LAYERS[0]], decode_form, ids, block, k, v, tokens)
    check_zero(w.device_kv_caches[LAYERS[0]], decode_form, ids[-1], tokens % block, block)
    misread = received({})
    with pytest.raises(AssertionError):
        check_tokens(misread.device_kv_caches[LAYERS[0]], decode_form, ids, block, k, v, tokens)


@pytest.mark.parametrize("form", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_the_connectors_window_zeroing_works_on_every_form(monkeypatch, form):
    """A sliding-window group's fills after a split: at ead200e `cache[id].view(-1)` raised on LBNHC and BLNHC."""
    w = worker(monkeypatch, form, 6, 4)
    plan = split_plan([[2, 3]], [[0]], ratio=2, block_size=4, tokens=8)
    for name in LAYERS:
        garbage(w.device_kv_caches[name], 1)
    fills = (WindowFill(2, 0, (2, 4), ((0, 2),)), WindowFill(3, 1, (0, 4), ()))
    w._split_received(plan, {0: fills})
    for name in LAYERS:
        check_zero(w.device_kv_caches[name], form, 2, 0, 2)
        assert read_token(w.device_kv_caches[name], form, 2, 2)[0].all()  # slot 2 received: kept


@pytest.mark.parametrize("form", ["cpu:vec", "cpu:amx"])
def test_the_connectors_post_process_merges_cpu_blocks(monkeypatch, form):
    """P < D on CPU_ATTN through post_process_device_kv_on_receive: sub-blocks merged in the ISA's packing, the
    uncovered tail and the blocks past the prompt zeroed."""
    p_block, ratio = 32, 2
    block, tokens = p_block * ratio, 32 * 2 + 5  # 3 sub-blocks: the second decode block half covered
    w = worker(monkeypatch, form, 8, block)
    ids = [5, 2, 7]
    for name in LAYERS:
        cache = w.device_kv_caches[name]
        garbage(cache, 2)
        src, k, v = prefill(form, p_block, tokens, torch.bfloat16, seed=9)
        e_p = raw_page(src, 0).numel()
        for i in range(src.shape[0]):
            j, part = divmod(i, ratio)
            raw_page(cache, ids[j])[part * e_p:(part + 1) * e_p] = raw_page(src, i)
    covered = -(-tokens // p_block)
    w.post_process_device_kv_on_receive(ratio, [(0, ids, covered)])
    written, zero_from = merge_tail(covered, ratio, block)
    for name in LAYERS:
        check_tokens(w.device_kv_caches[name], form, ids, block, k, v, tokens)
        check_zero(w.device_kv_caches[name], form, ids[written - 1], zero_from, block)
        assert not raw_page(w.device_kv_caches[name], ids[2]).any()


@pytest.mark.parametrize("form, name", [("LHBNC", "LHBNC"), ("BHLNC", "BHLNC")])
def test_a_form_the_connector_cannot_convert_is_refused_naming_it(monkeypatch, form, name):
    """At ead200e these were read as HND, silently."""
    w = worker(monkeypatch, form, 4, 4)
    with pytest.raises(FormError, match=f"KV cache form {name}"):
        w._form(LAYERS[0])


# -- the device: every index and mask on the cache's ---------------------------------------------------------------


class MixedDevices(TorchFunctionMode):
    """Records every torch call that mixes a tensor on `device` with a tensor elsewhere (an index or mask made on
    the CPU for a cache on another device). Meta tensors run the conversions without data."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.mixed = device, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kinds = {t.device.type for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)}
        if self.device in kinds and len(kinds) > 1:
            self.mixed.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def meta_cache(form: str, blocks: int, block: int) -> torch.Tensor:
    if form.startswith("cpu:"):
        return torch.zeros(blocks, 2, block, 64, dtype=torch.bfloat16, device="meta")
    return joined_cache(form, blocks, 2, block, 4, layers=2, layer=1, dtype=torch.bfloat16, device="meta")


@pytest.mark.parametrize("form", ["LBHNC", "LBNHC", "BLNHC", "cpu:vec", "cpu:amx"])
def test_every_index_and_mask_is_made_on_the_caches_device(form):
    from pdctl.kv.forms import form_of

    block = 64 if form.startswith("cpu:") else 4
    cache = meta_cache(form, 12, block)
    f = form_of(cache, "CPU_ATTN" if form.startswith("cpu:") else "FLASH_ATTN",
                (lambda n: form.split(":")[1]) if form.startswith("cpu:") else None)
    with MixedDevices("meta") as seen:
        merge_received([(cache, f)], [1, 2, 3], 2, 2, block // 2)
        split_received([(cache, f)], [4, 5, 6, 7], 2, (2, 1))
        merge_window([(cache, f)], [8, 9], 2, (WindowFill(8, 0, (1, block), ((0, 1),)), WindowFill(9, 1, (0, 0),
                                                                                                ((0, block),))))
        zero_fills([(cache, f)], (WindowFill(10, 0, (1, block), ((0, 1),)),))
    assert seen.mixed == []


def test_negative_control_a_cpu_index_on_another_device_is_seen():
    cache = meta_cache("LBHNC", 4, 4)
    with MixedDevices("meta") as seen:
        cache.index_select(0, torch.tensor([1]))  # ead200e's connector: torch.tensor(ids) on the CPU
        cache[0].reshape(-1).masked_fill_(torch.zeros(64, dtype=torch.bool), 0)
    assert seen.mixed == ["index_select", "masked_fill_"]


@pytest.mark.parametrize("form", ["LBHNC", "BLNHC"])
def test_the_connectors_split_makes_its_indices_and_masks_on_the_caches_device(monkeypatch, form):
    """At ead200e the split made its index tensors and tail mask on the CPU whatever the cache's device: a CUDA or
    HPU cache would raise (meta stands in for one here)."""
    w = worker(monkeypatch, form, 8, 4)
    w.device_kv_caches = {n: meta_cache(form, 8, 4) for n in LAYERS}
    plan = split_plan([[2, 3]], [[0, 1]], ratio=2, block_size=4, tokens=13, staging=[])
    with MixedDevices("meta") as seen:
        w._split_received(plan, {})
    assert seen.mixed == []


def test_a_layer_handed_as_k_and_v_tensors_is_refused_at_registration_naming_its_form(monkeypatch):
    """vllm-gaudi hands each layer as (K, V): the connector refuses it before vLLM registers anything, with the
    words pdctl up reports as the root cause, instead of vLLM's assertion on the tuple's shape."""
    from pdctl import protocol
    from pdctl.kv.forms import kv_pairs

    w = worker(monkeypatch, "LBHNC", 4, 16)
    monkeypatch.setattr(NixlPullConnectorWorker, "register_kv_caches",
                        lambda self, caches: pytest.fail("vLLM's registration reached"))
    pair = tuple(kv_pairs("hpu", 4, 2, 16, 4)[0])
    with pytest.raises(FormError) as e:
        w.register_kv_caches({"layer.0": pair})
    assert str(e.value).startswith(protocol.REFUSED_MARK) and "vllm-gaudi's hpu form" in str(e.value)
    assert protocol.CONNECTOR_FAILURE.search(str(e.value))
    with pytest.raises(FormError, match="a layer handed as 3 tensors"):
        w.register_kv_caches({"layer.0": (*pair, pair[0])})
