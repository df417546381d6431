"""pdctl.kv.fingerprint: a function of the logical KV only (any split of tokens, heads or layers adds up to the
same partial sums), exact, and changed by each corruption the issue names (negative controls)."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl import protocol
from pdctl.kv.fingerprint import CHUNK, MASK, Difference, Fingerprint, head_partials

H, T, D = 4, 70, 8


def partials(k, v, **where):
    """One layer's sums per chunk, over its heads."""
    return [x & MASK for x in head_partials(k, v, **where).sum(dim=1).tolist()]


def kv(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, H, T, D, generator=g).to(dtype) if dtype != torch.uint8 else
            torch.randint(0, 256, (2, H, T, D), generator=g, dtype=torch.uint8))


def whole(k, v, layer=0):
    return partials(k, v, layer=layer, first_token=0)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, T // CHUNK), st.integers(1, H - 1), st.sampled_from([torch.bfloat16, torch.float16, torch.uint8]))
def test_any_split_of_tokens_and_heads_adds_up_to_the_whole(cut_chunk, cut_head, dtype):
    (k, v), n = kv(dtype), -(-T // CHUNK)
    t0 = cut_chunk * CHUNK
    parts = [partials(k[:cut_head, :t0], v[:cut_head, :t0], layer=0, first_token=0, chunks=n),
             partials(k[:cut_head, t0:], v[:cut_head, t0:], layer=0, first_token=t0, chunks=n),
             partials(k[cut_head:], v[cut_head:], layer=0, first_token=0, first_head=cut_head, chunks=n)]
    total = [sum(column) & MASK for column in zip(*parts, strict=True)]
    assert total == whole(k, v) and len(total) == n


def test_it_is_the_same_on_every_run_and_every_chunk_is_used():
    k, v = kv()
    a = whole(k, v)
    assert a == whole(k.clone(), v.clone()) and len(a) == -(-T // CHUNK) and all(a)
    assert partials(k, v, layer=0, first_token=0, chunks=2) == a[:2]
    with pytest.raises(ValueError, match="does not start a fingerprint chunk"):
        partials(k, v, layer=0, first_token=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_each_corruption_changes_the_chunk_it_is_in(dtype):
    k, v = kv(dtype)

    def changed(k2, v2, layer=0):
        at = fingerprint_of(k, v).difference(fingerprint_of(k2, v2, layers=(layer,)))
        return None if at is None else at.chunk

    flipped = k.clone()
    flipped.view(torch.uint8).view(-1)[flipped.element_size() * (2 * T * D + 40 * D + 3)] ^= 0x10  # head 2, token 40
    assert changed(flipped, v) == 40 // CHUNK
    swapped = k.clone()
    swapped[:, [17, 50]] = swapped[:, [50, 17]]
    assert changed(swapped, v) == 17 // CHUNK
    assert changed(v, k) == 0  # K and V interchanged
    wrong_block = k.clone()
    wrong_block[:, 32:48] = k[:, 48:64]  # a block read from the next block's address
    assert changed(wrong_block, v) == 2
    stale_tail = v.clone()
    stale_tail[:, 69] = stale_tail[:, 68]  # the prompt's last slot not written
    assert changed(k, stale_tail) == 69 // CHUNK
    zeroed = k.clone()
    zeroed[1, 5] = 0
    assert changed(zeroed, v) == 0
    heads = k.clone()
    heads[[0, 3]] = heads[[3, 0]]  # a head slice from the wrong rank
    assert changed(heads, v) == 0
    assert changed(k, v, layer=1) == 0  # another layer's KV
    assert changed(k, v) is None


def fingerprint_of(k, v, layers=(0,), heads=range(H), first_token=0, chunks=None):
    fp = Fingerprint.empty(chunks or -(-T // CHUNK), max(layers) + 1, H)
    for layer in layers:
        fp.add_layer(layer, heads.start, head_partials(k[heads.start:heads.stop, first_token:],
                                                       v[heads.start:heads.stop, first_token:], layer=layer,
                                                       first_token=first_token, first_head=heads.start,
                                                       chunks=chunks or -(-T // CHUNK)))
    return fp


def test_a_fingerprint_names_the_first_differing_layer_chunk_and_head_and_checks_a_ranks_heads_alone():
    k, v = kv()
    want = fingerprint_of(k, v, layers=(0, 1, 2))
    assert want.difference(fingerprint_of(k, v, layers=(0, 1, 2))) is None
    # two TP ranks' shares add up to the whole
    assert want.difference(fingerprint_of(k, v, (0, 1, 2), range(0, 2)) + fingerprint_of(k, v, (0, 1, 2),
                                                                                          range(2, 4))) is None
    bad = k.clone()
    bad[3, 37] += 1  # head 3, token 37, in every layer's share below; layer 1 alone differs in `mixed`
    mixed = fingerprint_of(k, v, (0, 2)) + fingerprint_of(bad, v, (1,))
    assert want.difference(mixed) == Difference(37 // CHUNK, 3, 1)
    assert want.difference(mixed).describe(T) == "layer 1, tokens 32..47, KV head 3"
    # a rank holding heads 0-1 sees nothing wrong; the rank holding 2-3 finds it
    assert want.difference(fingerprint_of(k, v, (0, 2)) + fingerprint_of(bad, v, (1,), range(0, 2)),
                           heads=range(0, 2)) is None
    assert want.difference(fingerprint_of(bad, v, (0, 1, 2), range(2, 4)), heads=range(2, 4)).head == 3
    # a decode holding the first 32 tokens itself: compared from chunk 2, the layer unknown
    got = fingerprint_of(bad, v, (0, 1, 2), first_token=32)
    assert want.difference(got, from_chunk=2) == Difference(2, 3, None)
    assert want.difference(fingerprint_of(k, v, (0, 1, 2), first_token=48), from_chunk=3) is None
    short = fingerprint_of(k, v, (0, 1, 2), chunks=2)  # sums missing past chunk 2 count as 0
    assert want.difference(short).chunk == 2


def test_the_wire_form_round_trips_every_bit_and_names_what_is_wrong():
    k, v = kv()
    fp = fingerprint_of(k, v, layers=(0, 1))
    fp.chunks[0, 0] = (1 << 64) - 1  # a word a double would round
    back = protocol.decode_fingerprint(json.loads(json.dumps(protocol.encode_fingerprint(fp))))
    assert np.array_equal(back.chunks, fp.chunks) and np.array_equal(back.layers, fp.layers)
    good = protocol.encode_fingerprint(fp)
    for broken, what in [({**good, "v": 1}, "expected"), ({**good, "heads": 0}, "'heads'"),
                         ({**good, "chunks": good["chunks"][:-1]}, "'chunks'"), ({**good, "layers": None}, "'layers'"),
                         ("x", "expected")]:
        with pytest.raises(protocol.FingerprintError, match=what) as e:
            protocol.decode_fingerprint(broken)
        assert protocol.FINGERPRINT_KEY in str(e.value)
