"""The functional API: the worked example, weights, masked softmax, broadcasting, backend choice."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attention_core as ac
from attention_core import backends
from attention_core.backends import reference
from attention_core.functional import attention_with_weights

BACKENDS = ac.available_backends("cpu")


def test_worked_example_by_hand():
    """Q = K = V = [[2, 0, 0], [1, 1, 0]], d_k = 3: the numbers a reader can check on paper."""
    x = torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    scores = x @ x.T / math.sqrt(3)
    torch.testing.assert_close(scores, torch.tensor([[2.31, 1.15], [1.15, 1.15]]), rtol=1e-2, atol=0)
    weights = ac.attention_weights(x, x)
    torch.testing.assert_close(weights, torch.tensor([[0.76, 0.24], [0.5, 0.5]]), rtol=1e-2, atol=0)
    for backend in BACKENDS:
        out = ac.scaled_dot_product_attention(x, x, x, backend=backend)
        torch.testing.assert_close(out, torch.tensor([[1.76, 0.24, 0.0], [1.5, 0.5, 0.0]]), rtol=1e-2, atol=1e-6)


def test_attention_weights_are_softmax_of_scaled_scores():
    q, k = torch.randn(2, 3, 5, 8, dtype=torch.float64), torch.randn(2, 3, 7, 8, dtype=torch.float64)
    weights = ac.attention_weights(q, k)
    torch.testing.assert_close(weights, torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(8), dim=-1))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 5, dtype=torch.float64))
    torch.testing.assert_close(ac.attention_weights(q, k, scale=0.5), torch.softmax(q @ k.transpose(-2, -1) * 0.5, -1))


def test_attention_weights_masks_causal_and_gqa():
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    weights = ac.attention_weights(q, k, is_causal=True, enable_gqa=True)
    assert weights.shape == (2, 4, 5, 5)
    assert (weights.triu(1) == 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 5))
    # query heads 0, 1 share key head 0: the same as repeating it
    torch.testing.assert_close(weights[:, 1], ac.attention_weights(q[:, 1], k[:, 0], is_causal=True))
    mask = torch.rand(5, 5) > 0.5
    mask[2] = False
    w = ac.attention_weights(q, k, attn_mask=mask, enable_gqa=True)
    assert (w.masked_select(~mask) == 0).all() and (w[..., 2, :] == 0).all()


def test_weights_times_value_is_the_output():
    q, k, v = torch.randn(2, 3, 6, 4), torch.randn(2, 3, 9, 4), torch.randn(2, 3, 9, 5)
    mask = torch.rand(6, 9) > 0.3
    out, weights = attention_with_weights(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, weights @ v)
    torch.testing.assert_close(weights, ac.attention_weights(q, k, attn_mask=mask))


def test_masked_softmax_zero_rows_without_nan_and_finite_gradients():
    scores = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, True, True], [False] * 4, [True] * 4])
    w = ac.masked_softmax(scores, mask)
    assert not w.isnan().any()
    assert (w[1] == 0).all() and w[0, 1] == 0
    torch.testing.assert_close(w[[0, 2]].sum(-1), torch.ones(2, dtype=torch.float64))
    (w * torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    assert torch.isfinite(scores.grad).all() and (scores.grad[1] == 0).all() and scores.grad[0, 1] == 0
    assert torch.autograd.gradcheck(lambda s: ac.masked_softmax(s, mask), (scores.detach().requires_grad_(),))


def test_masked_softmax_float_mask_and_dim():
    scores = torch.randn(4, 3)
    additive = torch.zeros(4, 3)
    additive[1] = float("-inf")
    w = ac.masked_softmax(scores, additive, dim=0)
    torch.testing.assert_close(w, torch.softmax(scores + additive, dim=0))
    assert (w[1] == 0).all()
    allmasked = ac.masked_softmax(scores, torch.full((4, 3), float("-inf")))
    assert (allmasked == 0).all()
    torch.testing.assert_close(ac.masked_softmax(scores), torch.softmax(scores, -1))


def test_minus_infinity_is_exact_where_minus_1e9_is_not():
    """Why the library fills with -inf: -1e9 in float16 is -inf anyway, and in float32 a fully masked row
    becomes a uniform average instead of zeros."""
    scores = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.tensor([[False, False, False]])
    assert (ac.masked_softmax(scores, mask) == 0).all()
    torch.testing.assert_close(torch.softmax(scores.masked_fill(~mask, -1e9), -1), torch.full((1, 3), 1 / 3))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "q_shape,k_shape,v_shape",
    [
        ((5, 8), (6, 8), (6, 3)),  # no batch, no heads
        ((3, 5, 8), (3, 6, 8), (3, 6, 3)),  # heads only
        ((2, 2, 3, 5, 8), (2, 2, 3, 6, 8), (2, 2, 3, 6, 3)),  # two batch dims
        ((2, 3, 5, 8), (1, 3, 6, 8), (1, 3, 6, 3)),  # batch broadcasts, as torch.matmul does
        ((2, 3, 5, 8), (3, 6, 8), (3, 6, 3)),  # lower-rank key/value broadcast
        ((2, 3, 5, 8), (2, 1, 6, 8), (2, 1, 6, 3)),  # one key head broadcast to every query head
        ((1, 3, 5, 8), (2, 3, 6, 8), (2, 3, 6, 3)),  # the query broadcasts too
    ],
)
def test_leading_dims_broadcast_like_torch(backend, q_shape, k_shape, v_shape):
    q, k, v = torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape)
    mask = torch.rand(5, 6) > 0.3
    for kw in ({}, {"attn_mask": mask}, {"is_causal": True}):
        want = F.scaled_dot_product_attention(q, k, v, **kw)
        torch.testing.assert_close(ac.scaled_dot_product_attention(q, k, v, backend=backend, **kw), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("L,S,B", [(0, 4, 2), (3, 0, 2), (3, 4, 0)])
def test_empty_inputs(backend, L, S, B):
    q, k, v = torch.randn(B, 2, L, 4), torch.randn(B, 2, S, 4), torch.randn(B, 2, S, 3)
    out = ac.scaled_dot_product_attention(q, k, v, backend=backend)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


def test_numpy_backend_returns_input_dtype_and_device():
    q = torch.randn(1, 2, 3, 4, dtype=torch.float16)
    out = ac.scaled_dot_product_attention(q, q, q, backend="numpy")
    assert out.dtype == torch.float16 and out.device == q.device


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_dropout_scales_kept_weights(backend):
    torch.manual_seed(0)
    q, k, v = torch.zeros(1, 1, 200, 4), torch.zeros(1, 1, 50, 4), torch.ones(1, 1, 50, 1)  # weights 1/S
    out = ac.scaled_dot_product_attention(q, k, v, dropout_p=0.25, backend=backend)
    kept = out * 50 * 0.75  # the number of kept weights per row
    assert torch.allclose(kept, kept.round(), atol=1e-4)  # each kept weight is exactly (1/S) / (1 - p)
    assert abs(out.mean().item() - 1.0) < 0.05  # the expectation is unchanged
    assert not torch.equal(out, ac.scaled_dot_product_attention(q, k, v, dropout_p=0.25, backend=backend))
    torch.testing.assert_close(ac.scaled_dot_product_attention(q, k, v, backend=backend), torch.ones(1, 1, 200, 1))


def _spy(monkeypatch):
    """Record the name of every backend that runs."""
    ran = []
    original = backends.Backend.run

    def run(self, inputs):
        ran.append(self.name)
        return original(self, inputs)

    monkeypatch.setattr(backends.Backend, "run", run)
    return ran


def test_use_backend_nests_and_restores(monkeypatch):
    ran = _spy(monkeypatch)
    q = torch.randn(1, 1, 3, 4)
    sdpa = lambda **kw: ac.scaled_dot_product_attention(q, q, q, **kw)  # noqa: E731
    sdpa()
    with ac.use_backend("reference"):
        sdpa()
        with ac.use_backend("chunked"):
            sdpa()
            sdpa(backend="numpy")  # an explicit argument wins over the context
        sdpa()
        with ac.use_backend(None):  # back to the automatic choice inside
            sdpa()
    sdpa()
    assert ran == ["torch", "reference", "chunked", "numpy", "reference", "torch", "torch"]


def test_use_backend_restores_after_an_exception(monkeypatch):
    ran = _spy(monkeypatch)
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(RuntimeError):
        with ac.use_backend("numpy"):
            raise RuntimeError
    ac.scaled_dot_product_attention(q, q, q)
    assert ran == ["torch"]


def test_automatic_choice_on_cpu_is_torch():
    q = torch.randn(1, 1, 3, 4)
    inputs = backends.AttentionInputs(q, q, q, None, 0.0, False, 0.5, False)
    assert backends.choose_backend(inputs).name == "torch"


def test_registry_entries():
    for name in ("reference", "numpy", "torch", "chunked"):
        entry = ac.get_backend(name)
        assert entry.name == name and entry.is_available() == (True, "")
        assert callable(entry.load())
    with pytest.raises(ValueError, match="already registered"):
        backends.register_backend(ac.get_backend("torch"))


def test_reference_is_the_textbook_formula():
    q, k, v = (torch.randn(2, 3, 4, 5, dtype=torch.float64) for _ in range(3))
    want = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(5), dim=-1) @ v
    torch.testing.assert_close(reference.attention(q, k, v, None, 0.0, False, 5**-0.5, False), want)


def test_weights_entropy_bounds_and_formula() -> None:
    S = 7
    w = torch.softmax(torch.randn(3, 5, S, dtype=torch.float64), dim=-1)  # (3, 5, S), rows sum to 1
    h = ac.weights_entropy(w)
    assert h.shape == (3, 5)
    assert torch.allclose(h, -(w * w.log()).sum(-1))
    assert ((h > 0) & (h < math.log(S))).all()
    uniform = torch.full((2, S), 1.0 / S, dtype=torch.float64)
    assert torch.allclose(ac.weights_entropy(uniform), torch.full((2,), math.log(S), dtype=torch.float64))
    edge = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # one-hot, and a fully masked row
    assert torch.equal(ac.weights_entropy(edge), torch.zeros(2))  # 0 log 0 = 0: no NaN
    with pytest.raises(TypeError, match="weights must have a floating-point dtype"):
        ac.weights_entropy(torch.ones(2, 3, dtype=torch.long))
