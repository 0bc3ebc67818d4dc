"""Mask builders and the conversions between conventions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attention_core as ac
from attention_core.masks import combine_masks, sliding_window_mask

SMALL = settings(max_examples=40, deadline=None, derandomize=True)


def test_causal_mask_is_lower_triangular_and_matches_is_causal():
    assert ac.causal_mask(3).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert ac.causal_mask(2, 4).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0]]  # upper-left aligned
    assert ac.causal_mask(3, 2).int().tolist() == [[1, 0], [1, 1], [1, 1]]
    q, k, v = torch.randn(1, 2, 5, 4), torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 3)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k, v, attn_mask=ac.causal_mask(5, 7)),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
    )


def test_padding_mask_marks_real_tokens():
    mask = ac.padding_mask([3, 0, 5], 5)
    assert mask.dtype == torch.bool
    assert mask.int().tolist() == [[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert torch.equal(ac.padding_mask(torch.tensor([3, 0, 5]), 5), mask)
    assert ac.padding_mask([], 4).shape == (0, 4)


def test_padding_mask_as_key_mask_ignores_padded_keys():
    B, H, L, S, E = 2, 3, 4, 6, 5
    q, k, v = torch.randn(B, H, L, E), torch.randn(B, H, S, E), torch.randn(B, H, S, E)
    lens = [4, 6]
    key_mask = ac.padding_mask(lens, S)[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
    out = ac.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
    for b, n in enumerate(lens):  # the same as attending to the unpadded keys only
        torch.testing.assert_close(out[b], F.scaled_dot_product_attention(q[b], k[b, :, :n], v[b, :, :n]))


def test_padding_mask_as_query_mask_zeroes_padded_rows():
    q = k = v = torch.randn(2, 1, 5, 4)
    query_mask = ac.padding_mask([2, 5], 5)[:, None, :, None]  # (B, L) -> (B, 1, L, 1)
    out = ac.scaled_dot_product_attention(q, k, v, attn_mask=query_mask)
    assert (out[0, :, 2:] == 0).all() and (out[1] != 0).any()


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_by_definition(causal):
    L, S, w = 7, 9, 3
    mask = sliding_window_mask(L, w, S, causal=causal)
    for i in range(L):
        for j in range(S):
            want = (i - w < j <= i) if causal else abs(i - j) <= w // 2
            assert mask[i, j].item() == want
    if causal:
        assert mask.sum(-1).max() == w  # never more than `window` keys
        assert torch.equal(sliding_window_mask(L, L + S, S), ac.causal_mask(L, S))  # a huge window is causal


@SMALL
@given(st.lists(st.lists(st.booleans(), min_size=3, max_size=3), min_size=1, max_size=4))
def test_bool_additive_round_trip(rows):
    mask = torch.tensor(rows)
    additive = ac.to_additive_mask(mask)
    assert additive.dtype == torch.float32
    assert torch.equal(additive == 0, mask) and torch.equal(additive == float("-inf"), ~mask)
    assert torch.equal(ac.to_bool_mask(additive), mask)
    assert ac.to_additive_mask(mask, dtype=torch.float16).dtype == torch.float16


def test_additive_and_bool_masks_give_the_same_attention():
    q, k, v = torch.randn(3, 2, 4, 8).unbind(0)
    mask = torch.rand(4, 4) > 0.5
    mask[:, 0] = True
    torch.testing.assert_close(
        ac.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        ac.scaled_dot_product_attention(q, k, v, attn_mask=ac.to_additive_mask(mask)),
    )


@SMALL
@given(st.lists(st.booleans(), min_size=1, max_size=8))
def test_torch_mha_convention_round_trip(values):
    mask = torch.tensor(values)
    mha = ac.to_torch_mha_mask(mask)
    assert torch.equal(mha, ~mask)  # True = NOT allowed in nn.MultiheadAttention
    assert torch.equal(ac.from_torch_mha_mask(mha), mask)


def test_float_masks_pass_through_mha_conversion_unchanged():
    bias = torch.tensor([[0.0, -1.5, float("-inf")]])
    assert ac.to_torch_mha_mask(bias) is bias
    assert ac.from_torch_mha_mask(bias) is bias


def test_torch_mha_mask_means_the_same_attention():
    m = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    allowed = ac.causal_mask(5)
    theirs, _ = m(x, x, x, attn_mask=ac.to_torch_mha_mask(allowed), need_weights=False)
    ours, _ = ac.MultiHeadAttention.from_torch(m)(x, attn_mask=allowed)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def test_combine_masks():
    a = torch.tensor([[True, False, True]])
    b = torch.tensor([[True], [False]])
    assert combine_masks(None, None) is None
    assert torch.equal(combine_masks(a, None, b), a & b)
    mixed = combine_masks(a, torch.tensor([[1.0, 2.0, 3.0]]))
    assert mixed.tolist() == [[1.0, float("-inf"), 3.0]]
