"""Linear attention (parallel, recurrent, chunked), the delta rule, and Performer's random features."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_core import linear_attention as la

SMALL = settings(max_examples=40, deadline=None, derandomize=True)

shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 12), st.integers(1, 6), st.integers(1, 5))


def _qkv(seed: int, B: int, H: int, L: int, E: int, Ev: int, S: int | None = None):
    g = torch.Generator().manual_seed(seed)
    S = L if S is None else S
    return (torch.randn(B, H, L, E, generator=g), torch.randn(B, H, S, E, generator=g),
            torch.randn(B, H, S, Ev, generator=g))


@SMALL
@given(shape=shapes, extra=st.integers(0, 4), causal=st.booleans(), fmap=st.sampled_from(["elu", "relu"]),
       seed=st.integers(0, 2**16))
def test_parallel_equals_recurrent_fp32(shape, extra, causal, fmap, seed):
    B, H, L, E, Ev = shape
    q, k, v = _qkv(seed, B, H, L, E, Ev, S=L + extra)
    par = la.linear_attention(q, k, v, is_causal=causal, feature_map=fmap)
    rec, state = la.linear_attention_recurrent(q, k, v, is_causal=causal, feature_map=fmap)
    assert par.dtype == rec.dtype == torch.float32 and par.shape == (B, H, L, Ev)
    assert (par - rec).abs().max().item() <= 1e-5
    assert state.S.shape == (B, H, E, Ev) and state.z.shape == (B, H, E)


@SMALL
@given(shape=shapes, chunk=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_chunked_equals_parallel_causal(shape, chunk, seed):
    B, H, L, E, Ev = shape
    q, k, v = _qkv(seed, B, H, L, E, Ev)
    par = la.linear_attention(q, k, v, is_causal=True)
    assert (la.linear_attention_chunked(q, k, v, chunk_size=chunk) - par).abs().max().item() <= 1e-5


def test_linear_attention_is_a_kernel_smoother():
    """With the feature map's kernel, each output row is a weighted average of the values (weights sum to 1)."""
    q, k, v = _qkv(0, 1, 1, 5, 3, 2)
    w = la.elu_feature_map(q) @ la.elu_feature_map(k).transpose(-2, -1)  # (1, 1, 5, 5)
    w = w / w.sum(-1, keepdim=True)
    torch.testing.assert_close(la.linear_attention(q, k, v, eps=0.0), w @ v)


def test_recurrent_state_continues_token_by_token():
    q, k, v = _qkv(1, 1, 2, 6, 4, 3)
    full, final = la.linear_attention_recurrent(q, k, v)
    state, outs = None, []
    for t in range(6):
        o, state = la.linear_attention_recurrent(q[..., t:t + 1, :], k[..., t:t + 1, :], v[..., t:t + 1, :],
                                                 state=state)
        outs.append(o)
    torch.testing.assert_close(torch.cat(outs, dim=-2), full)
    assert state.nbytes() == final.nbytes() == (2 * 4 * 3 + 2 * 4) * 4  # fixed size: H (E Ev + E) floats


def test_delta_rule_stores_orthonormal_keys_exactly_and_beats_the_plain_memory():
    d, N = 16, 16
    keys = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0][:N]  # orthonormal rows
    vals = torch.randn(N, 4, dtype=torch.float64)
    _, S = la.delta_rule(keys, keys, vals)
    torch.testing.assert_close(keys @ S.T, vals)
    g = torch.Generator().manual_seed(0)
    keys = torch.nn.functional.normalize(torch.randn(48, d, generator=g, dtype=torch.float64), dim=-1)
    vals = torch.nn.functional.normalize(torch.randn(48, d, generator=g, dtype=torch.float64), dim=-1)
    plain = la.linear_attention(keys, keys, vals, feature_map="identity", normalize=False)
    _, S = la.delta_rule(keys, keys, vals)
    err_plain = ((plain - vals) ** 2).sum(-1).mean()
    err_delta = ((keys @ S.T - vals) ** 2).sum(-1).mean()
    assert err_delta < 0.5 * err_plain
    # the plain memory's error is (N - 1) / d on average for random unit keys; within 30% at N = 48, d = 16
    assert abs(err_plain.item() / (47 / 16) - 1) < 0.3


def test_delta_rule_outputs_read_the_state_after_each_write():
    q, k, v = (x[0, 0] for x in _qkv(2, 1, 1, 5, 3, 2))
    out, _ = la.delta_rule(q, k, v, beta=torch.full((5,), 0.5))
    S = torch.zeros(2, 3)
    for t in range(5):
        S = S + 0.5 * (v[t] - S @ k[t]).unsqueeze(-1) * k[t]
        torch.testing.assert_close(out[t], S @ q[t])


@pytest.mark.parametrize("kind", la.KINDS)
@pytest.mark.parametrize("scale", [0.3, 0.8])
def test_random_features_unbiased_within_the_closed_form_variance(kind, scale):
    """n independent m-feature estimates: their mean lies within 5 standard errors (sqrt(var / n), var from
    Lemma 2) of exp(x . y), and their sample variance within 15% of the closed form (fixed seed)."""
    g = torch.Generator().manual_seed(7)
    d, m, n = 4, 8, 20000
    x = torch.randn(d, generator=g, dtype=torch.float64) * scale
    y = torch.randn(d, generator=g, dtype=torch.float64) * scale
    omega = torch.randn(n, m, d, generator=g, dtype=torch.float64)
    est = torch.stack([la.performer_kernel_estimate(x, y, omega[i], kind) for i in range(n)])
    true = la.softmax_kernel(x, y).item()
    var = la.performer_variance(x, y, m, kind).item()
    assert abs(est.mean().item() - true) <= 5 * math.sqrt(var / n)
    assert abs(est.var().item() / var - 1) < 0.15


def test_lemma2_where_each_estimator_fails():
    x = torch.full((4,), 0.8, dtype=torch.float64)
    small, large = -x, x  # exp(x . y) = e^-2.56 vs e^2.56
    rel = {(kind, name): la.performer_variance(x, y, 16, kind).sqrt() / la.softmax_kernel(x, y)
           for kind in la.KINDS for name, y in (("small", small), ("large", large))}
    assert rel["positive", "small"] == 0 and rel["trig", "large"] == 0
    assert rel["trig", "small"] > 10 and rel["positive", "large"] > 10


def test_positive_features_are_positive_and_trig_ones_are_twice_as_many():
    om = la.draw_omega(5, 3, generator=torch.Generator().manual_seed(0))
    x = torch.randn(7, 3, dtype=torch.float64) * 3
    assert (la.performer_features(x, om, "positive") > 0).all()
    assert la.performer_features(x, om, "trig").shape == (7, 10)


@pytest.mark.parametrize("call, exc, words", [
    (lambda q, k, v: la.linear_attention(q.numpy(), k, v), TypeError, "query"),
    (lambda q, k, v: la.linear_attention(q, k[..., :2], v), ValueError, "last dim E"),
    (lambda q, k, v: la.linear_attention(q, k, v[..., :3, :]), ValueError, "value"),
    (lambda q, k, v: la.linear_attention(q, k, v, is_causal=1), TypeError, "is_causal"),
    (lambda q, k, v: la.linear_attention(q, k, v, feature_map="tanh"), ValueError, "feature_map"),
    (lambda q, k, v: la.linear_attention(q, k, v, eps=-1.0), ValueError, "eps"),
    (lambda q, k, v: la.linear_attention(q.double(), k, v), TypeError, "dtype"),
    (lambda q, k, v: la.linear_attention(q, k[..., :3, :], v[..., :3, :], is_causal=True), ValueError, "L <= S"),
    (lambda q, k, v: la.linear_attention_chunked(q, k, v, chunk_size=0), ValueError, "chunk_size"),
    (lambda q, k, v: la.linear_attention_chunked(q, k, v, chunk_size=2.0), TypeError, "chunk_size"),
    (lambda q, k, v: la.delta_rule(q, k, v, beta=3.0), ValueError, "beta"),
    (lambda q, k, v: la.delta_rule(q, k, v, beta=torch.ones(3)), ValueError, "beta"),
    (lambda q, k, v: la.delta_rule(q, k, v, state=torch.zeros(2)), ValueError, "state"),
    (lambda q, k, v: la.linear_attention_recurrent(q, k, v, state=(1, 2)), TypeError, "state"),
    (lambda q, k, v: la.draw_omega(0, 3), ValueError, "num_features"),
    (lambda q, k, v: la.performer_features(q, torch.zeros(3, 5)), ValueError, "omega"),
    (lambda q, k, v: la.performer_features(q, torch.zeros(3, 4), kind="cos"), ValueError, "kind"),
    (lambda q, k, v: la.performer_variance(q, k, 2.5), TypeError, "num_features"),
])
def test_errors_name_the_argument(call, exc, words):
    q, k, v = _qkv(0, 1, 2, 5, 4, 3)
    with pytest.raises(exc, match=words):
        call(q, k, v)


def test_state_and_beta_on_another_device_or_dtype_are_refused_by_name():
    """A state or beta tensor on another device is a ValueError, another dtype a TypeError, as everywhere else."""
    from attention_core.linear_attention import delta_rule

    q = k = v = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="state"):
        delta_rule(q, k, v, state=torch.zeros(1, 2, 4, 4, device="meta"))
    with pytest.raises(TypeError, match="state"):
        delta_rule(q, k, v, state=torch.zeros(1, 2, 4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="beta"):
        delta_rule(q, k, v, beta=torch.full((1, 2, 3), 0.5, device="meta"))
