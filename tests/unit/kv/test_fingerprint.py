"""pdctl.kv.fingerprint: a function of the logical KV only (any split of tokens, heads or layers adds up to the
same partial sums), exact, and changed by each corruption the issue names (negative controls)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdctl.kv.fingerprint import CHUNK, add, first_difference, partials

H, T, D = 4, 70, 8


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
    total = [0] * n
    for p in parts:
        total = add(total, p)
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
    want = whole(k, v)

    def changed(k2, v2, layer=0):
        return first_difference(want, whole(k2, v2, layer))

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


def test_a_shorter_list_counts_its_missing_chunks_as_zero():
    assert first_difference([1, 2, 0], [1, 2]) is None
    assert first_difference([1, 2, 3], [1, 2]) == 2 and first_difference([5, 2, 3], [1, 2], from_chunk=1) == 2
    assert add([1, (1 << 64) - 1], [2, 1]) == [3, 0]
