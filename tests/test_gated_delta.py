"""The gated delta rule (Gated DeltaNet, Yang, Kautz & Hatamizadeh, ICLR 2025): the recurrent reference, the
chunkwise form, and the token-mixer layer with its decode step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_core import linear_attention as la
from attention_core.models.gated_delta import GatedDeltaNet, GatedDeltaNetState

SMALL = settings(max_examples=30, deadline=None, derandomize=True)


def _inputs(seed: int, B: int = 2, H: int = 3, L: int = 13, E: int = 5, Ev: int = 4, dtype=torch.float32,
            alpha_low: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, d, generator=g, dtype=dtype) for d in (E, E, Ev))
    alpha = alpha_low + (1 - alpha_low) * torch.rand(B, H, L, generator=g, dtype=dtype)  # in (alpha_low, 1]
    beta = torch.rand(B, H, L, generator=g, dtype=dtype)
    return q, k, v, alpha, beta


def _eq10_loop(q, k, v, alpha, beta, S=None):
    """Eq. (10) written out with matrices, one token at a time, independently of the library:
    ``S_t = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T``, ``o_t = S_t q_t`` (keys as given)."""
    *lead, L, E = k.shape
    Ev = v.shape[-1]
    S = torch.zeros(*lead, Ev, E, dtype=k.dtype) if S is None else S
    eye = torch.eye(E, dtype=k.dtype)
    outs = []
    for t in range(L):
        kt = k[..., t, :, None]  # (..., E, 1)
        a, b = alpha[..., t, None, None], beta[..., t, None, None]
        transition = a * (eye - b * (kt @ kt.transpose(-2, -1)))  # (..., E, E)
        S = S @ transition + b * (v[..., t, :, None] @ kt.transpose(-2, -1))  # (..., Ev, E)
        outs.append((S @ q[..., t, :, None])[..., 0])
    return torch.stack(outs, dim=-2), S


# ---------------------------------------------------------------------------------------------- hand cases


def test_three_tokens_by_hand():
    """E = 2, Ev = 1. Token 1: k = (1, 0), v = 2, beta = 1/2: S = (1, 0), q = (1, 1) reads 1.
    Token 2: alpha = 1/2, k = (0.6, 0.8), v = 1, beta = 1: alpha S = (0.5, 0), it reads 0.3 at k, the error
    0.7 is written along k: S = (0.92, 0.56); q = (1, 0) reads 0.92.
    Token 3: alpha = 1, k = (0, 1), v = 3, beta = 1/2: S reads 0.56, half of the error 2.44 is written:
    S = (0.92, 1.78); q = (1, 1) reads 2.70."""
    q = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    k = torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    v = torch.tensor([[2.0], [1.0], [3.0]])
    alpha = torch.tensor([0.5, 0.5, 1.0])
    beta = torch.tensor([0.5, 1.0, 0.5])
    want = torch.tensor([[1.0], [0.92], [2.70]])
    for form in (la.gated_delta_rule_recurrent, la.gated_delta_rule_chunked):
        out, state = form(q, k, v, alpha, beta)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(state.S, torch.tensor([[0.92, 1.78]]))
    for C in (1, 2, 3):
        out, _ = la.gated_delta_rule_chunked(q, k, v, alpha, beta, chunk_size=C)
        torch.testing.assert_close(out, want)


def test_the_gate_decays_the_old_memory_and_not_the_new_write():
    """One key written at strength 1, then a token with beta = 0 and alpha = 1/4: the memory is a quarter of
    what it was (alpha multiplies S_{t-1}, never the new write beta v k^T)."""
    q = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    v = torch.tensor([[4.0], [5.0]])
    out, _ = la.gated_delta_rule_recurrent(q, k, v, torch.tensor([1.0, 0.25]), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(out, torch.tensor([[4.0], [1.0]]))
    out, _ = la.gated_delta_rule_recurrent(q, k, v, torch.tensor([0.25, 1.0]), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(out, torch.tensor([[4.0], [4.0]]))  # a decay on the first token meets S_0 = 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_both_forms_equal_eq10_written_out_in_float64(seed):
    q, k, v, alpha, beta = _inputs(seed, dtype=torch.float64)
    k = F.normalize(k, dim=-1)
    want, S = _eq10_loop(q, k, v, alpha, beta)
    out, state = la.gated_delta_rule_recurrent(q, k, v, alpha, beta)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(state.S, S, rtol=1e-12, atol=1e-12)
    out, state = la.gated_delta_rule_chunked(q, k, v, alpha, beta, chunk_size=4)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state.S, S, rtol=1e-10, atol=1e-10)


def test_keys_are_l2_normalized_unless_told_not_to():
    q, k, v, alpha, beta = _inputs(3, dtype=torch.float64)
    k = 0.5 * k  # norms away from 1, below sqrt(2) mostly; the loop takes them as given
    want, _ = _eq10_loop(q, k, v, alpha, beta)
    for form in (la.gated_delta_rule_recurrent, la.gated_delta_rule_chunked):
        torch.testing.assert_close(form(q, k, v, alpha, beta, normalize_keys=False)[0], want)
        torch.testing.assert_close(form(q, k, v, alpha, beta)[0], _eq10_loop(q, F.normalize(k, dim=-1), v, alpha,
                                                                             beta)[0])


# -------------------------------------------------------------------------------- recurrent == chunked


@SMALL
@given(L=st.integers(1, 20), C=st.integers(1, 9), seed=st.integers(0, 2**16), alpha_low=st.sampled_from([0.05, 0.9]))
def test_chunked_equals_recurrent_fp32(L, C, seed, alpha_low):
    q, k, v, alpha, beta = _inputs(seed, B=1, H=2, L=L, alpha_low=alpha_low)
    rec, s_rec = la.gated_delta_rule_recurrent(q, k, v, alpha, beta)
    chk, s_chk = la.gated_delta_rule_chunked(q, k, v, alpha, beta, chunk_size=C)
    assert chk.shape == rec.shape == (1, 2, L, 4) and chk.dtype == torch.float32
    torch.testing.assert_close(chk, rec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_chk.S, s_rec.S, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("C", [1, 2, 3, 5, 7, 13, 64])
@pytest.mark.parametrize("seed", [0, 1])
def test_chunked_equals_recurrent_over_chunk_sizes_that_do_and_do_not_divide_L(C, seed):
    q, k, v, alpha, beta = _inputs(seed, L=13)
    rec, s_rec = la.gated_delta_rule_recurrent(q, k, v, alpha, beta)
    chk, s_chk = la.gated_delta_rule_chunked(q, k, v, alpha, beta, chunk_size=C)
    torch.testing.assert_close(chk, rec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_chk.S, s_rec.S, rtol=1e-5, atol=1e-5)


def test_the_gradients_of_both_forms_agree():
    inputs = [t.double().requires_grad_() for t in _inputs(4, L=9)]
    grads = []
    for form, kw in ((la.gated_delta_rule_recurrent, {}), (la.gated_delta_rule_chunked, {"chunk_size": 4})):
        out, state = form(*inputs, **kw)
        grads.append(torch.autograd.grad((out ** 2).sum() + state.S.sum(), inputs))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("form", ["recurrent", "chunked"])
def test_a_state_continues_the_sequence(form):
    fn = {"recurrent": la.gated_delta_rule_recurrent,
          "chunked": lambda *a, **kw: la.gated_delta_rule_chunked(*a, chunk_size=3, **kw)}[form]
    q, k, v, alpha, beta = _inputs(5, L=11)
    full, final = fn(q, k, v, alpha, beta)
    parts, state = [], None
    for a, b in ((0, 4), (4, 5), (5, 11)):
        out, state = fn(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], alpha[..., a:b], beta[..., a:b], state=state)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, dim=-2), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.S, final.S, rtol=1e-5, atol=1e-5)
    assert state.nbytes() == 2 * 3 * 4 * 5 * 4  # B H Ev E floats, whatever L


def test_one_number_stands_for_every_token_and_head():
    q, k, v, alpha, beta = _inputs(10, L=7)
    for form in (la.gated_delta_rule_recurrent, la.gated_delta_rule_chunked):
        torch.testing.assert_close(form(q, k, v, 0.75, beta)[0], form(q, k, v, torch.full_like(alpha, 0.75), beta)[0])
        torch.testing.assert_close(form(q, k, v, alpha, 1)[0], form(q, k, v, alpha, torch.ones_like(beta))[0])


@pytest.mark.parametrize("C", [1, 4, 13])
def test_alpha_one_is_the_delta_rule(C):
    q, k, v, _, beta = _inputs(6)
    ones = torch.ones_like(beta)
    want, S = la.delta_rule(q, F.normalize(k, dim=-1), v, beta)
    for out, state in (la.gated_delta_rule_recurrent(q, k, v, ones, beta),
                       la.gated_delta_rule_chunked(q, k, v, ones, beta, chunk_size=C)):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state.S, S, rtol=1e-5, atol=1e-5)


def test_beta_zero_only_decays_and_small_alpha_forgets():
    q, k, v, alpha, beta = _inputs(7, L=6)
    S0 = la.GatedDeltaState(torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(1)))
    _, state = la.gated_delta_rule_chunked(q, k, v, alpha, torch.zeros_like(beta), state=S0, chunk_size=4)
    torch.testing.assert_close(state.S, S0.S * alpha.prod(-1)[..., None, None])
    tiny = torch.full_like(alpha, 1e-6)  # at token 5 the memory of tokens 0..4 is scaled by 1e-6: gone
    out, _ = la.gated_delta_rule_chunked(q, k, v, tiny, beta, state=S0, chunk_size=4)
    alone, _ = la.gated_delta_rule_recurrent(q[..., 5:, :], k[..., 5:, :], v[..., 5:, :], tiny[..., 5:], beta[..., 5:])
    torch.testing.assert_close(out[..., 5:, :], alone, rtol=0, atol=1e-5)


def test_leading_dims_and_empty_sequences():
    q, k, v, alpha, beta = _inputs(8, B=1, H=1, L=5)
    out, state = la.gated_delta_rule_chunked(q[0, 0], k[0, 0], v[0, 0], alpha[0, 0], beta[0, 0], chunk_size=2)
    torch.testing.assert_close(out, la.gated_delta_rule_recurrent(q, k, v, alpha, beta)[0][0, 0])
    for form in (la.gated_delta_rule_recurrent, la.gated_delta_rule_chunked):
        out, state = form(q[..., :0, :], k[..., :0, :], v[..., :0, :], alpha[..., :0], beta[..., :0])
        assert out.shape == (1, 1, 0, 4) and bool((state.S == 0).all())


# ------------------------------------------------------------------------------------------------- errors


def _call(form, **change):
    q, k, v, alpha, beta = _inputs(9, B=1, H=2, L=4)
    args = {"query": q, "key": k, "value": v, "alpha": alpha, "beta": beta, **change}
    return form(**args)


BAD = [
    ({"alpha": torch.rand(1, 2, 5)}, ValueError, r"alpha must have shape \(\.\.\., L\) = \(1, 2, 4\)"),
    ({"beta": torch.rand(1, 2, 4, 1)}, ValueError, r"beta must have shape"),
    ({"alpha": torch.zeros(1, 2, 4)}, ValueError, r"alpha must be in \(0, 1\]"),
    ({"alpha": torch.full((1, 2, 4), 1.5)}, ValueError, r"alpha must be in \(0, 1\].*1\.5"),
    ({"alpha": torch.full((1, 2, 4), float("nan"))}, ValueError, r"alpha must be in"),
    ({"beta": torch.full((1, 2, 4), -0.1)}, ValueError, r"beta must be in \[0, 1\]"),
    ({"beta": torch.full((1, 2, 4), 1.2)}, ValueError, r"beta must be in \[0, 1\]"),
    ({"alpha": torch.ones(1, 2, 4, dtype=torch.int64)}, TypeError, r"alpha must have a floating-point dtype"),
    ({"beta": [0.5] * 4}, TypeError, r"beta must be a tensor \(\.\.\., L\) or a float in \[0, 1\], got list"),
    ({"alpha": True}, TypeError, r"alpha must be a tensor"),
    ({"alpha": 0.0}, ValueError, r"alpha must be in \(0, 1\]"),
    ({"beta": float("nan")}, ValueError, r"beta must be in \[0, 1\]"),
    ({"query": torch.randn(1, 2, 3, 5)}, ValueError, r"L == S"),
    ({"query": torch.randn(1, 2, 4, 6)}, ValueError, r"query and key must share the last dim E"),
    ({"value": torch.randn(1, 2, 4, 4, dtype=torch.float64)}, TypeError, r"dtype"),
    ({"key": torch.full((1, 2, 4, 5), float("inf"))}, ValueError, r"must be finite"),
    ({"state": torch.zeros(1, 2, 4, 5)}, TypeError, r"state must be a GatedDeltaState"),
    ({"state": la.GatedDeltaState(torch.zeros(1, 2, 5, 4))}, ValueError, r"state.S must have shape \(\.\.\., Ev, E\)"),
    ({"normalize_keys": 1}, TypeError, r"normalize_keys must be a bool"),
]


@pytest.mark.parametrize("form", [la.gated_delta_rule_recurrent, la.gated_delta_rule_chunked])
@pytest.mark.parametrize("change, error, message", BAD)
def test_bad_arguments_are_refused_with_a_message_that_names_them(form, change, error, message):
    with pytest.raises(error, match=message):
        _call(form, **change)


@pytest.mark.parametrize("chunk_size, error", [(0, ValueError), (True, TypeError), (2.0, TypeError)])
def test_bad_chunk_sizes(chunk_size, error):
    with pytest.raises(error, match="chunk_size"):
        _call(la.gated_delta_rule_chunked, chunk_size=chunk_size)


def test_a_refused_call_leaves_the_state_alone():
    state = la.GatedDeltaState(torch.ones(1, 2, 4, 5))
    with pytest.raises(ValueError):
        _call(la.gated_delta_rule_chunked, state=state, beta=torch.full((1, 2, 4), 2.0))
    assert bool((state.S == 1).all())


# -------------------------------------------------------------------------------------------------- layer


def _layer(seed: int = 0, **kw) -> GatedDeltaNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GatedDeltaNet(16, 2, chunk_size=4, **kw)


@pytest.mark.parametrize("conv_size", [0, 1, 4])
def test_decoding_step_by_step_equals_the_full_forward(conv_size):
    m = _layer(conv_size=conv_size)
    x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(0))
    y, final = m(x)
    state, ys = None, []
    for t in range(11):
        yt, state = m.step(x[:, t], state)
        ys.append(yt)
    torch.testing.assert_close(torch.stack(ys, dim=1), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.S, final.S, rtol=1e-5, atol=1e-5)
    y1, s1 = m(x[:, :6])  # a prefill, then the rest in one call
    y2, _ = m(x[:, 6:], s1)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y, rtol=1e-5, atol=1e-5)
    assert state.nbytes() == final.nbytes() == 4 * (2 * 2 * 8 * 8 + (2 * (max(conv_size, 1) - 1) * 48))


def _layer_by_hand(m: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """Section 3.4's block written out with torch's own modules: Conv1d padded by K - 1 and cut (causal), SiLU,
    per-head L2 norm of q and k, Mamba2's decay, sigmoid beta, eq. (10) as a matrix loop, RMSNorm x SiLU gate."""
    B, L, _ = x.shape
    H, E, Ev, K = m.num_heads, m.head_dim, m.value_dim, m.conv_size
    proj = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1).transpose(1, 2)  # (B, C, L)
    conv = torch.nn.Conv1d(proj.shape[1], proj.shape[1], K, groups=proj.shape[1], padding=K - 1, bias=False)
    conv.weight = m.conv_weight
    mixed = F.silu(conv(proj)[..., :L]).transpose(1, 2)  # (B, L, C)
    q, k, v = mixed.split([H * E, H * E, H * Ev], dim=-1)
    heads = lambda t, d: t.reshape(B, L, H, d).permute(0, 2, 1, 3)  # noqa: E731
    q, k, v = F.normalize(heads(q, E), dim=-1), F.normalize(heads(k, E), dim=-1), heads(v, Ev)
    alpha = torch.exp(-m.A_log.exp() * F.softplus(m.a_proj(x) + m.dt_bias)).permute(0, 2, 1)  # (B, H, L)
    beta = torch.sigmoid(m.b_proj(x)).permute(0, 2, 1)
    o, _ = _eq10_loop(q, k, v, alpha, beta)  # (B, H, L, Ev)
    o = o.permute(0, 2, 1, 3)  # (B, L, H, Ev)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.o_norm.eps) * m.o_norm.weight
    return m.o_proj((o * F.silu(m.g_proj(x)).reshape(B, L, H, Ev)).reshape(B, L, H * Ev))


def test_the_layer_is_the_papers_block_written_out():
    m = _layer()
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(m(x)[0], _layer_by_hand(m, x), rtol=1e-5, atol=1e-5)


def test_the_layers_chunk_size_changes_nothing_but_the_work():
    x = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(4))
    want = _layer()(x)[0]
    for C in (1, 3, 11, 64):
        m = _layer()
        m.chunk_size = C
        torch.testing.assert_close(m(x)[0], want, rtol=1e-5, atol=1e-5)


def test_the_layer_is_causal_and_its_gates_are_in_range():
    m = _layer()
    x = torch.randn(1, 9, 16, generator=torch.Generator().manual_seed(1))
    x2 = x.clone()
    x2[:, 6:] += 1.0
    torch.testing.assert_close(m(x)[0][:, :6], m(x2)[0][:, :6])
    assert not torch.allclose(m(x)[0][:, 6:], m(x2)[0][:, 6:])
    log_alpha, beta = m.gates(x)
    assert log_alpha.shape == beta.shape == (1, 2, 9)
    assert bool((log_alpha <= 0).all()) and bool(((beta > 0) & (beta < 1)).all())


def test_the_layer_trains_every_parameter():
    m = _layer()
    y, _ = m(torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2)))
    y.square().mean().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in m.parameters())


def test_the_layer_refuses_bad_inputs():
    m = _layer()
    with pytest.raises(ValueError, match=r"x must be \(B, L, D\) with D = embed_dim = 16"):
        m(torch.randn(1, 3, 8))
    with pytest.raises(TypeError, match="dtype"):
        m(torch.randn(1, 3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="state must be a GatedDeltaNetState"):
        m(torch.randn(1, 3, 16), state=torch.zeros(1))
    _, state = m(torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match=r"state.S must have shape \(1, 2, 8, 8\)"):
        m(torch.randn(1, 3, 16), state=state)
    with pytest.raises(ValueError, match=r"x must be one token per row, \(B, D\)"):
        m.step(torch.randn(2, 1, 16), state)
    with pytest.raises(ValueError, match="divisible"):
        GatedDeltaNet(10, 3)
    with pytest.raises(ValueError, match="conv_size"):
        GatedDeltaNet(16, 2, conv_size=-1)
    assert isinstance(state, GatedDeltaNetState)


@pytest.mark.parametrize("form", [la.gated_delta_rule_recurrent, la.gated_delta_rule_chunked])
def test_inputs_too_large_for_memory_are_refused_before_any_work(form):
    from attention_core._checks import TooLargeError

    x = torch.zeros(1, 1, 1, 8).expand(1, 1, 2**40, 8)  # 32 TiB as read, 32 bytes stored
    g = torch.ones(1, 1, 1).expand(1, 1, 2**40)
    with pytest.raises(TooLargeError, match="GiB"):
        form(x, x, x, g, g)
