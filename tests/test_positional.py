"""Positional information: sinusoidal values, learned tables, RoPE's relative property, clear errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attention_core as ac
from attention_core.positional import (
    LearnedPositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    apply_rotary,
    rotary_angles,
    rotate_half,
    sinusoidal_encoding,
)

# ------------------------------------------------------------------------------------------- sinusoidal


def test_sinusoidal_position_zero_is_zero_one_pattern() -> None:
    table = sinusoidal_encoding(3, 8)
    assert table.shape == (3, 8) and table.dtype == torch.float32
    torch.testing.assert_close(table[0], torch.tensor([0.0, 1.0] * 4))


def test_sinusoidal_matches_the_paper_formula() -> None:
    D, base = 6, 10000.0
    table = sinusoidal_encoding(50, D, base, dtype=torch.float64)
    for pos in (1, 7, 49):
        for i in range(D // 2):
            angle = pos / base ** (2 * i / D)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-12)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-12)
    assert table[1, 0].item() == pytest.approx(math.sin(1.0))  # the fastest pair turns one radian per step


def test_sinusoidal_module_adds_the_table_with_offset() -> None:
    pe = SinusoidalPositionalEncoding(8, max_len=10)
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(pe(x), x + sinusoidal_encoding(4, 8))
    torch.testing.assert_close(pe(x, offset=3), x + sinusoidal_encoding(7, 8)[3:])
    assert not list(pe.parameters()), "the sinusoidal table is fixed, not trained"


def test_sinusoidal_too_long_sequence_names_lengths() -> None:
    pe = SinusoidalPositionalEncoding(8, max_len=5)
    with pytest.raises(ValueError, match=r"x has sequence length L = 6 .*max_len = 5"):
        pe(torch.zeros(1, 6, 8))
    with pytest.raises(ValueError, match=r"positions 3 \.\. 5.*max_len = 5"):
        pe(torch.zeros(1, 3, 8), offset=3)


PE8 = SinusoidalPositionalEncoding(8)


@pytest.mark.parametrize(
    "call, exc, pattern",
    [
        (lambda: sinusoidal_encoding(4, 7), ValueError, r"d_model must be even.*got 7"),
        (lambda: sinusoidal_encoding(4, 8, base=1.0), ValueError, r"base must be .*> 1, got 1.0"),
        (lambda: sinusoidal_encoding(-1, 8), ValueError, r"num_positions must be .*, got -1$"),
        (lambda: sinusoidal_encoding(4, 8, dtype=torch.int64), TypeError, r"dtype must be a floating"),
        (lambda: PE8(torch.zeros(4, 8)), ValueError, r"x must be \(B, L, D\).*\(4, 8\)"),
        (lambda: PE8(torch.zeros(1, 4, 6)), ValueError, r"D = d_model = 8.*\(1, 4, 6\)"),
        (lambda: PE8([[0.0]]), TypeError, r"x must be a torch.Tensor, got list"),
        (lambda: PE8(torch.zeros(1, 2, 8), offset=-1), ValueError, r"offset must be"),
    ],
)
def test_sinusoidal_bad_inputs(call, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern):
        call()


# ---------------------------------------------------------------------------------------------- learned


def test_learned_embedding_adds_trainable_rows_and_gets_gradients() -> None:
    torch.manual_seed(0)
    emb = LearnedPositionalEmbedding(6, 4)
    x = torch.randn(3, 5, 4)
    out = emb(x)
    torch.testing.assert_close(out, x + emb.weight[:5])
    out.sum().backward()
    assert torch.equal(emb.weight.grad[:5], torch.full((5, 4), 3.0))  # each used row summed over the batch
    assert torch.equal(emb.weight.grad[5], torch.zeros(4))  # position 5 was not used


def test_learned_embedding_refuses_positions_it_has_no_row_for() -> None:
    emb = LearnedPositionalEmbedding(6, 4)
    with pytest.raises(ValueError, match=r"L = 7 .*learned table holds max_len = 6"):
        emb(torch.zeros(1, 7, 4))
    with pytest.raises(ValueError, match=r"x must be \(B, L, D\) with D = d_model = 4, got shape \(1, 7\)"):
        emb(torch.zeros(1, 7))
    with pytest.raises(TypeError, match=r"x must have a floating-point dtype, got torch.int64"):
        emb(torch.zeros(1, 2, 4, dtype=torch.long))


# ----------------------------------------------------------------------------------------------- rotary


def _pairs_norm(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:
        return x.unflatten(-1, (-1, 2)).norm(dim=-1)
    a, b = x.chunk(2, -1)
    return torch.sqrt(a**2 + b**2)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_keeps_the_norm_of_every_pair_and_position_zero_is_identity(interleaved: bool) -> None:
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64)
    y = apply_rotary(x, interleaved=interleaved)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(_pairs_norm(y, interleaved), _pairs_norm(x, interleaved))
    torch.testing.assert_close(y[..., 0, :], x[..., 0, :])


@settings(max_examples=25, deadline=None)
@given(
    m=st.integers(0, 60),
    n=st.integers(0, 60),
    shift=st.integers(0, 60),
    half=st.integers(1, 8),
    interleaved=st.booleans(),
)
def test_rope_score_depends_only_on_the_offset(
    m: int, n: int, shift: int, half: int, interleaved: bool
) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n)
    q, k = torch.randn(2, 2 * half, generator=g, dtype=torch.float64)

    def score(i: int, j: int) -> float:
        qi = apply_rotary(q[None], torch.tensor([i]), interleaved=interleaved)[0]
        kj = apply_rotary(k[None], torch.tensor([j]), interleaved=interleaved)[0]
        return float(qi @ kj)

    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-9)


def test_rope_equals_a_rotation_matrix_per_pair() -> None:
    E, pos, base = 4, 3, 10000.0
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    y = apply_rotary(x, torch.tensor([pos]), base, interleaved=True)[0]
    expected = []
    for i in range(E // 2):
        t = pos * base ** (-2 * i / E)
        a, b = x[0, 2 * i].item(), x[0, 2 * i + 1].item()
        expected += [a * math.cos(t) - b * math.sin(t), a * math.sin(t) + b * math.cos(t)]
    torch.testing.assert_close(y, torch.tensor(expected, dtype=torch.float64))


def test_rotate_half_and_angles() -> None:
    assert rotate_half(torch.tensor([1.0, 2.0, 3.0, 4.0])).tolist() == [-3.0, -4.0, 1.0, 2.0]
    cos, sin = rotary_angles(torch.arange(3), 4)
    assert cos.shape == sin.shape == (3, 2)
    assert sin[1, 0].item() == pytest.approx(math.sin(1.0))


def test_rotary_module_matches_function_and_handles_offsets() -> None:
    rope = RotaryEmbedding(8, max_len=16)
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    rq, rk = rope(q, k)
    torch.testing.assert_close(rq, apply_rotary(q))
    torch.testing.assert_close(rk, apply_rotary(k))
    rq, rk = rope(q, k, offset=3, key_offset=1)
    torch.testing.assert_close(rq, apply_rotary(q, torch.arange(3, 8)))
    torch.testing.assert_close(rk, apply_rotary(k, torch.arange(1, 6)))


def test_rotary_attention_gradients_flow() -> None:
    rope = RotaryEmbedding(4, max_len=8)
    q = torch.randn(1, 2, 5, 4, requires_grad=True)
    k = torch.randn(1, 2, 5, 4, requires_grad=True)
    v = torch.randn(1, 2, 5, 4)
    out = ac.scaled_dot_product_attention(*rope(q, k), v, is_causal=True)
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0


ROPE4 = RotaryEmbedding(4)


@pytest.mark.parametrize(
    "call, exc, pattern",
    [
        (lambda: apply_rotary(torch.zeros(2, 5)), ValueError, r"x must have an even last dim E .*\(2, 5\)"),
        (lambda: RotaryEmbedding(7), ValueError, r"head_dim must be even.*got 7"),
        (lambda: apply_rotary(torch.zeros(4)), ValueError, r"x must have at least 2 dims .*\(4,\)"),
        (lambda: apply_rotary(torch.zeros(3, 4).long()), TypeError, r"x must have a floating-point"),
        (lambda: apply_rotary(torch.zeros(3, 4), torch.arange(2)), ValueError, r"positions must be \(L,\)"),
        (lambda: apply_rotary("q"), TypeError, r"x must be a torch.Tensor, got str"),
        (lambda: RotaryEmbedding(4, max_len=4).rotate(torch.zeros(5, 4)), ValueError, r"L = 5 .*= 4"),
        (lambda: ROPE4(torch.zeros(2, 6), torch.zeros(2, 4)), ValueError, r"query must have last dim"),
        (lambda: ROPE4(torch.zeros(2, 4), torch.zeros(2, 3)), ValueError, r"key must have an even"),
        (lambda: RotaryEmbedding(4, interleaved=1), TypeError, r"interleaved must be a bool"),
        (lambda: rotary_angles(torch.zeros(2, 2), 4), ValueError, r"positions must be 1-D"),
    ],
)
def test_rotary_bad_inputs(call, exc, pattern) -> None:
    with pytest.raises(exc, match=pattern):
        call()
