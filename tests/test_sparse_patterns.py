"""Sparse attention patterns: mods equal dense masks equal the definitions; two-hop reach; tiles visited."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_core import sparse_patterns as sp

SMALL = settings(max_examples=40, deadline=None, derandomize=True)


def _by_loops(L, keep, causal):
    """The definition, one pair at a time."""
    return torch.tensor([[bool(keep(i, j)) and (j <= i or not causal) for j in range(L)] for i in range(L)])


@SMALL
@given(L=st.integers(1, 40), s=st.integers(1, 10), causal=st.booleans())
def test_strided_equals_definition(L, s, causal):
    want = _by_loops(L, lambda i, j: abs(i - j) < s or (i - j) % s == 0, causal)
    assert torch.equal(sp.strided_mask(L, s, causal=causal), want)
    assert torch.equal(sp.dense_from_mod(sp.strided_mod(s, causal=causal), L), want)


@SMALL
@given(L=st.integers(1, 40), c=st.integers(1, 10), t=st.integers(1, 10), causal=st.booleans())
def test_fixed_equals_definition(L, c, t, causal):
    t = min(t, c)
    want = _by_loops(L, lambda i, j: i // c == j // c or j % c >= c - t, causal)
    assert torch.equal(sp.fixed_mask(L, c, t, causal=causal), want)
    assert torch.equal(sp.dense_from_mod(sp.fixed_mod(c, t, causal=causal), L), want)


@SMALL
@given(L=st.integers(1, 40), w=st.integers(0, 6), g=st.lists(st.integers(0, 39), max_size=3), causal=st.booleans())
def test_longformer_equals_definition(L, w, g, causal):
    g = [x for x in g if x < L]
    want = _by_loops(L, lambda i, j: abs(i - j) <= w or i in g or j in g, causal)
    assert torch.equal(sp.longformer_mask(L, w, g, causal=causal), want)
    assert torch.equal(sp.dense_from_mod(sp.longformer_mod(w, g, causal=causal, max_len=L), L), want)


def test_bigbird_is_longformer_plus_r_random_keys_per_row():
    L, w, r = 40, 2, 3
    m = sp.bigbird_mask(L, w, (0,), r, generator=torch.Generator().manual_seed(0))
    base = sp.longformer_mask(L, w, (0,))
    assert (m >= base).all() and not (m & ~torch.ones(L, L, dtype=torch.bool).tril()).any()
    extra = (m & ~base).sum(1)
    assert (extra <= r).all() and extra.sum() > L  # random keys beyond the window in most rows
    again = sp.bigbird_mask(L, w, (0,), r, generator=torch.Generator().manual_seed(0))
    assert torch.equal(m, again)
    mod = sp.bigbird_mod(L, w, (0,), r, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sp.dense_from_mod(mod, L), m)


@pytest.mark.parametrize("L", [16, 64, 100, 256])
def test_strided_with_sqrt_stride_reaches_every_causal_pair_in_two_hops(L):
    s = math.isqrt(L)
    m = sp.strided_mask(L, s)
    assert sp.reaches_every_pair(m)
    assert m.sum(1).max() <= 2 * s  # about 2 sqrt(n) entries per row
    assert not sp.reaches_every_pair(sp.longformer_mask(L, s - 1, ()))  # the band alone does not


def test_two_hop_reach_is_the_boolean_matrix_product():
    m = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    assert sp.two_hop_reach(m).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert sp.reaches_every_pair(m) and not sp.reaches_every_pair(torch.eye(3, dtype=torch.bool))


def test_causal_longformer_with_a_leading_global_token_does_not_reach_far_pairs():
    L, w = 32, 2
    assert not sp.reaches_every_pair(sp.longformer_mask(L, w, (0,)))
    assert sp.reaches_every_pair(sp.longformer_mask(L, w, (0,), causal=False), causal=False)


def test_tiles_visited_counts_nonempty_tiles():
    assert sp.tiles_visited(torch.ones(64, 64, dtype=torch.bool).tril(), 16, 16) == 10
    assert sp.tiles_visited(torch.eye(10, dtype=torch.bool), 4, 4) == 3  # ragged edge tile counts
    m = torch.zeros(32, 32, dtype=torch.bool)
    m[31, 0] = True
    assert sp.tiles_visited(m, 16, 16) == 1
    m = torch.zeros(8, 12, dtype=torch.bool)
    m[3, 5] = m[6, 11] = True  # inside tiles, off their first row and column
    assert sp.tiles_visited(m, 4, 4) == 2 and sp.tiles_visited(m, 8, 12) == 1


@pytest.mark.parametrize("call, exc, words", [
    (lambda: sp.strided_mod(0), ValueError, "stride"),
    (lambda: sp.strided_mask(8, 2.0), TypeError, "stride"),
    (lambda: sp.fixed_mod(4, 5), ValueError, "summary"),
    (lambda: sp.longformer_mod(2, "0"), TypeError, "global_tokens"),
    (lambda: sp.longformer_mask(8, 2, (9,)), ValueError, "global_tokens"),
    (lambda: sp.strided_mod(2, causal=1), TypeError, "causal"),
    (lambda: sp.bigbird_mod(8, 2, (0,), -1), ValueError, "num_random"),
    (lambda: sp.two_hop_reach(torch.ones(3, 4, dtype=torch.bool)), ValueError, "square"),
    (lambda: sp.two_hop_reach(torch.ones(3, 3)), TypeError, "bool"),
    (lambda: sp.tiles_visited(torch.ones(3, 3, dtype=torch.bool), 0), ValueError, "block_q"),
    (lambda: sp.dense_from_mod(sp.strided_mod(2), 0), ValueError, "L"),
])
def test_errors_name_the_argument(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
