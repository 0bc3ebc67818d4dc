"""Score functions against hand-written einsum versions of their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from attention_core import scoring


def pair(Dq=4, Dk=4, L=3, S=5, batch=(2,)):
    g = torch.Generator().manual_seed(0)
    return torch.randn(*batch, L, Dq, generator=g), torch.randn(*batch, S, Dk, generator=g)


def test_dot_and_scaled_dot():
    q, k = pair()
    want = torch.einsum("bld,bsd->bls", q, k)
    torch.testing.assert_close(scoring.dot_score(q, k), want)
    torch.testing.assert_close(scoring.scaled_dot_score(q, k), want / 2.0)  # sqrt(4) = 2
    torch.testing.assert_close(scoring.scaled_dot_score(q, k, scale=0.3), want * 0.3)


@pytest.mark.parametrize("d", [4, 64, 512])
def test_scaled_dot_keeps_unit_variance(d):
    g = torch.Generator().manual_seed(d)
    q, k = torch.randn(4000, 1, d, generator=g), torch.randn(4000, 1, d, generator=g)
    assert abs(scoring.dot_score(q, k).var().item() / d - 1) < 0.15  # Var(q . k) = d
    assert abs(scoring.scaled_dot_score(q, k).var().item() - 1) < 0.15  # and 1 after 1/sqrt(d)


def test_cosine():
    q, k = pair()
    want = torch.einsum("bld,bsd->bls", q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(scoring.cosine_score(q, k), want)
    torch.testing.assert_close(scoring.cosine_score(q, k, temperature=0.5), want * 2)
    assert scoring.cosine_score(q, q).diagonal(dim1=-2, dim2=-1).allclose(torch.ones(2, 3))
    assert torch.isfinite(scoring.cosine_score(torch.zeros(1, 2, 4), k)).all()  # zero vectors are guarded


def test_general_is_bilinear():
    q, k = pair(Dq=4, Dk=6)
    score = scoring.GeneralScore(4, 6)
    W = score.W.weight  # (Dq, Dk)
    torch.testing.assert_close(score(q, k), torch.einsum("bli,ij,bsj->bls", q, W, k))


def test_additive_is_bahdanau():
    q, k = pair(Dq=4, Dk=6)
    score = scoring.AdditiveScore(4, 6, hidden_dim=7)
    Wq, Wk, v = score.W_q.weight, score.W_k.weight, score.v.weight[0]  # (H, Dq), (H, Dk), (H,)
    hidden = torch.tanh(torch.einsum("hi,bli->blh", Wq, q)[:, :, None] + torch.einsum("hj,bsj->bsh", Wk, k)[:, None])
    torch.testing.assert_close(score(q, k), torch.einsum("blsh,h->bls", hidden, v))


def test_concat_is_luong_concat():
    q, k = pair(Dq=4, Dk=6, batch=())
    score = scoring.ConcatScore(4, 6, hidden_dim=7)
    Wc, v = score.W_c.weight, score.v.weight[0]  # (H, Dq + Dk), (H,)
    want = torch.empty(3, 5)
    for i in range(3):  # literally concatenate [q_i; k_j]
        for j in range(5):
            want[i, j] = v @ torch.tanh(Wc @ torch.cat([q[i], k[j]]))
    torch.testing.assert_close(score(q, k), want)


@pytest.mark.parametrize("name", sorted(scoring.SCORES))
def test_make_score_builds_every_score(name):
    module = scoring.make_score(name, query_dim=4, key_dim=4, hidden_dim=3)
    assert isinstance(module, torch.nn.Module)
    q, k = pair(batch=(2, 3))
    assert module(q, k).shape == (2, 3, 3, 5)


def test_gradients_flow_to_parameters():
    q, k = pair(Dq=4, Dk=6)
    for score in (scoring.GeneralScore(4, 6), scoring.AdditiveScore(4, 6, 5), scoring.ConcatScore(4, 6, 5)):
        score(q, k).sum().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in score.parameters())


def test_scores_feed_attention():
    q, k = pair()
    weights = torch.softmax(scoring.scaled_dot_score(q, k), dim=-1)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 3))
    assert math.isclose(scoring.ScaledDotScore()(q, k).sum().item(), scoring.scaled_dot_score(q, k).sum().item())


@pytest.mark.parametrize("name", sorted(scoring.SCORES))
def test_leading_dims_broadcast(name):
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 1, 3, 4, generator=g), torch.randn(1, 5, 6, 4, generator=g)
    module = scoring.make_score(name, query_dim=4, key_dim=4, hidden_dim=3)
    out = module(q, k)
    assert out.shape == (2, 5, 3, 6)
    torch.testing.assert_close(out[1, 2], module(q[1, 0], k[0, 2]))  # each pair scored on its own


def test_general_with_identity_is_dot():
    q, k = pair()
    score = scoring.GeneralScore(4, 4)
    with torch.no_grad():
        score.W.weight.copy_(torch.eye(4))
    torch.testing.assert_close(score(q, k), scoring.dot_score(q, k))


def test_concat_is_additive_with_split_weights():
    q, k = pair(Dq=4, Dk=6)
    concat, additive = scoring.ConcatScore(4, 6, 5), scoring.AdditiveScore(4, 6, 5)
    with torch.no_grad():  # W_c = [W_q  W_k], the same v
        additive.W_q.weight.copy_(concat.W_c.weight[:, :4])
        additive.W_k.weight.copy_(concat.W_c.weight[:, 4:])
        additive.v.weight.copy_(concat.v.weight)
    torch.testing.assert_close(concat(q, k), additive(q, k))


def test_parameter_counts():
    counts = {name: sum(p.numel() for p in scoring.make_score(name, 8, 6 if name in ("general", "additive", "concat")
                                                                  else 8, 16).parameters())
              for name in scoring.SCORES}
    assert counts == {"dot": 0, "scaled_dot": 0, "cosine": 0, "general": 8 * 6,
                      "additive": 16 * (8 + 6 + 1), "concat": 16 * (8 + 6 + 1)}


def test_cosine_ignores_norms_and_is_bounded():
    q, k = pair()
    torch.testing.assert_close(scoring.cosine_score(3 * q, 0.5 * k), scoring.cosine_score(q, k))
    scores = scoring.cosine_score(q, k, temperature=0.25)
    assert scores.abs().max() <= 4 + 1e-5
    assert not torch.allclose(scoring.dot_score(3 * q, k), scoring.dot_score(q, k))  # the dot product does not


@pytest.mark.parametrize("name", ["general", "additive", "concat"])
def test_gradcheck_learned_scores(name):
    module = scoring.make_score(name, query_dim=3, key_dim=2, hidden_dim=4).double()
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(4, 2, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(module, (q, k))


def test_mismatched_dtypes_name_the_arguments():
    with pytest.raises(TypeError, match=r"key must have the dtype of query \(torch.float32\)"):
        scoring.dot_score(torch.randn(3, 4), torch.randn(5, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match="query must have a floating-point dtype, got torch.int64"):
        scoring.scaled_dot_score(torch.ones(3, 4, dtype=torch.long), torch.randn(5, 4))
