"""Bahdanau's and Luong's attention layers: shapes, masks, local windows, gradients, errors."""

from __future__ import annotations

import pytest
import torch

from attention_core.masks import padding_mask
from attention_core.models.rnn_attention import (
    LUONG_MODES,
    LUONG_SCORES,
    AdditiveAttention,
    LuongAttention,
    gaussian_window,
    local_attention_weights,
)

B, S, DQ, DK = 3, 7, 6, 6
VALID = torch.tensor([7, 4, 1])


def _inputs(L: int | None = None, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn((B, DQ) if L is None else (B, L, DQ), generator=g)
    key = torch.randn(B, S, DK, generator=g)
    return query, key, padding_mask(VALID, S)


def _layers():
    torch.manual_seed(0)
    yield AdditiveAttention(DQ, DK, 5)
    for score in LUONG_SCORES:
        for mode in LUONG_MODES:
            yield LuongAttention(DQ, DK, score=score, mode=mode, window=2)


@pytest.mark.parametrize("layer", list(_layers()), ids=repr)
def test_shapes_and_padding_gets_zero_weight(layer) -> None:
    query, key, mask = _inputs()
    context, weights = layer(query, key, attn_mask=mask)
    assert context.shape == (B, DK) and weights.shape == (B, S)
    assert torch.all(weights[~mask] == 0)
    assert torch.isfinite(context).all() and torch.all(weights >= 0)
    q3, _, _ = _inputs(L=4)
    context, weights = layer(q3, key, attn_mask=mask)
    assert context.shape == (B, 4, DK) and weights.shape == (B, 4, S)
    assert torch.all(weights.masked_select(~mask[:, None, :]) == 0)
    assert torch.allclose(context, weights @ key, atol=1e-6)


@pytest.mark.parametrize("layer", [AdditiveAttention(DQ, DK, 5), LuongAttention(DQ, DK, "dot")], ids=repr)
def test_global_weights_sum_to_one_over_real_positions(layer) -> None:
    query, key, mask = _inputs()
    _, weights = layer(query, key, attn_mask=mask)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B))
    _, unmasked = layer(query, key)
    assert torch.all(unmasked > 0)


def test_additive_attention_matches_its_formula() -> None:
    torch.manual_seed(0)
    layer = AdditiveAttention(DQ, DK, 5)
    query, key, mask = _inputs()
    sc = layer.score
    e = sc.v(torch.tanh(sc.W_q(query)[:, None, :] + sc.W_k(key))).squeeze(-1)  # (B, S)
    e = e.masked_fill(~mask, float("-inf"))
    _, weights = layer(query, key, attn_mask=mask)
    torch.testing.assert_close(weights, torch.softmax(e, -1))


def test_luong_scores_match_their_formulas() -> None:
    torch.manual_seed(0)
    query, key, _ = _inputs()
    dot = LuongAttention(DQ, DK, "dot")
    torch.testing.assert_close(dot.scores(query[:, None], key)[:, 0], torch.einsum("bd,bsd->bs", query, key))
    general = LuongAttention(DQ, DK, "general")
    W = general.score.W.weight  # (Dq, Dk)
    torch.testing.assert_close(general.scores(query[:, None], key)[:, 0],
                               torch.einsum("bd,de,bse->bs", query, W, key))
    concat = LuongAttention(DQ, DK, "concat", hidden_dim=5)
    Wc, v = concat.score.W_c.weight, concat.score.v.weight[0]
    cat = torch.cat([query[:, None].expand(B, S, DQ), key], -1)  # (B, S, Dq + Dk)
    torch.testing.assert_close(concat.scores(query[:, None], key)[:, 0], torch.tanh(cat @ Wc.T) @ v)


@pytest.mark.parametrize("window", [0, 1, 2, 3])
def test_local_p_weights_vanish_outside_the_window(window: int) -> None:
    torch.manual_seed(1)
    layer = LuongAttention(DQ, DK, "general", mode="local-p", window=window)
    query, key, mask = _inputs(L=5)
    _, weights = layer(query, key, attn_mask=mask)
    p = layer.position(query, VALID)  # (B, L)
    assert torch.all(p >= 0) and torch.all(p <= (VALID - 1)[:, None])
    s = torch.arange(S)
    outside = (s - p[..., None]).abs() > window  # (B, L, S)
    assert torch.all(weights[outside] == 0)
    assert torch.all(weights.masked_select(~mask[:, None, :]) == 0)
    assert torch.all(weights.sum(-1) <= 1 + 1e-6)  # the Gaussian only shrinks the softmax weights


def test_local_p_is_softmax_in_window_times_gaussian() -> None:
    scores = torch.tensor([[[0.0, 1.0, 2.0, 3.0, 4.0]]])  # (1, 1, 5)
    center = torch.tensor([[2.5]])
    w = local_attention_weights(scores, center, window=1, gaussian=True)
    inside = torch.softmax(torch.tensor([2.0, 3.0]), -1)
    bump = torch.exp(-torch.tensor([0.5, 0.5]) ** 2 / (2 * 0.5**2))
    torch.testing.assert_close(w[0, 0], torch.tensor([0.0, 0.0, *(inside * bump).tolist(), 0.0]))
    torch.testing.assert_close(gaussian_window(torch.tensor([2.0]), 5, 0), torch.tensor([[0.0, 0, 1, 0, 0]]))


def test_local_m_centres_on_the_target_step_clipped() -> None:
    layer = LuongAttention(DQ, DK, "dot", mode="local-m", window=1)
    query, key, mask = _inputs()
    for step in (0, 3, 9):
        _, weights = layer(query, key, attn_mask=mask, step=step)
        for b, n in enumerate(VALID.tolist()):
            p = min(step, n - 1)
            nonzero = set(torch.nonzero(weights[b]).flatten().tolist())
            assert nonzero <= {p - 1, p, p + 1} and p in nonzero
        torch.testing.assert_close(weights.sum(-1), torch.ones(B))


@pytest.mark.parametrize("layer", list(_layers()), ids=repr)
def test_gradients_reach_every_parameter(layer) -> None:
    query, key, mask = _inputs(L=3)
    query.requires_grad_(True)
    key.requires_grad_(True)
    context, _ = layer(query, key, attn_mask=mask)
    (context * torch.linspace(-1, 1, DK)).sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert query.grad.abs().sum() > 0 and key.grad.abs().sum() > 0


def test_fully_masked_row_gives_zeros_not_nan() -> None:
    layer = AdditiveAttention(DQ, DK, 5)
    query, key, _ = _inputs()
    mask = torch.zeros(B, S, dtype=torch.bool)
    context, weights = layer(query, key, attn_mask=mask)
    assert torch.all(weights == 0) and torch.all(context == 0)


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"score='dot' needs query_dim == key_dim, got query_dim=4 and key_dim=6"):
        LuongAttention(4, 6, "dot")
    with pytest.raises(ValueError, match=r"score must be one of .*got 'cosine'"):
        LuongAttention(4, 6, "cosine")
    with pytest.raises(ValueError, match=r"mode must be one of .*got 'local'"):
        LuongAttention(4, 6, "general", mode="local")
    with pytest.raises(ValueError, match=r"^window must be .*, got -1$"):
        LuongAttention(4, 6, "general", mode="local-p", window=-1)
    with pytest.raises(TypeError, match=r"^window must be .*, got float 1.5$"):
        LuongAttention(4, 6, "general", mode="local-p", window=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^query_dim must be .*, got 0$"):
        AdditiveAttention(0, 6, 5)
    layer = AdditiveAttention(DQ, DK, 5)
    query, key, mask = _inputs()
    with pytest.raises(ValueError, match=r"query must be \(B, 6\) or \(B, L, 6\), got shape \(3, 5\)"):
        layer(query[:, :5], key)
    with pytest.raises(ValueError, match=r"key must be \(B=3, S, 6\), got shape \(3, 7, 4\)"):
        layer(query, key[..., :4])
    with pytest.raises(ValueError, match=r"attn_mask must be a bool \(B, S\) = \(3, 7\) padding mask"):
        layer(query, key, attn_mask=mask[:, :5])
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        layer([1.0], key)


@pytest.mark.parametrize("layer", list(_layers()), ids=repr)
def test_projected_keys_give_the_same_result(layer) -> None:
    query, key, mask = _inputs(L=3)
    expected = layer(query, key, attn_mask=mask)
    got = layer(query, key, attn_mask=mask, projected_key=layer.project_key(key))
    for a, b in zip(expected, got):
        torch.testing.assert_close(a, b)


def test_bad_projected_key_is_refused() -> None:
    layer = LuongAttention(DQ, DK, "concat", hidden_dim=5)
    query, key, mask = _inputs()
    with pytest.raises(ValueError, match=r"projected_key must be \(B, S, 5\) = \(3, 7, 5\), got shape \(3, 7, 6\)"):
        layer(query, key, attn_mask=mask, projected_key=key)
