"""attention_core.low_precision against hand-computed cases and float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attention_core as ac
from attention_core import low_precision as lp

F64 = torch.float64


def _qkv(seed: int, shape=(1, 2, 96, 32), dtype=F64, outliers: bool = False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(3):
        x = torch.randn(shape, generator=g, dtype=F64)
        if outliers:
            x = x + 10 * torch.randn(shape, generator=g, dtype=F64) * (torch.rand(shape, generator=g, dtype=F64) < 0.01)
        out.append(x.to(dtype))
    return out


# ------------------------------------------------------------------------------------------ quantisation


def test_exactly_representable_values_come_back_exactly():
    # e4m3: amax 448 gives scale 1, and these all have a 3-bit mantissa; e5m2: 57344 and 2-bit mantissas
    x = torch.tensor([[448.0, -1.5, 0.25], [0.0, 1.125, -240.0]], dtype=F64)
    q = lp.quantize_fp8(x, "e4m3")
    assert q.scale.item() == 1.0 and q.codes.dtype == torch.float8_e4m3fn
    assert torch.equal(q.dequantize(F64), x) and torch.equal(lp.fake_quantize(x), x)
    y = torch.tensor([[57344.0, -1.5, 0.25, 3.0]], dtype=torch.float32)
    assert torch.equal(lp.fake_quantize(y, "e5m2"), y)
    # a power-of-two scale keeps them exact: the same values / 4, and per block with each block's amax
    assert torch.equal(lp.fake_quantize(x / 4), x / 4)
    xb = torch.cat([x, x / 8], dim=0)  # blocks of 2 rows: scales 1 and 1/8
    q = lp.quantize_fp8(xb, block_size=2)
    assert q.scale.tolist() == [1.0, 1 / 8] and torch.equal(q.dequantize(F64), xb)


def test_a_value_between_two_codes_rounds_to_the_nearest():
    x = torch.tensor([448.0, 1.0 + 1 / 16 + 1 / 64, 1.0 + 1 / 32], dtype=F64)  # e4m3 steps by 1/8 at 1
    assert lp.fake_quantize(x).tolist() == [448.0, 1.125, 1.0]


def test_all_zero_blocks_get_scale_one_and_zeros_not_nan():
    x = torch.zeros(5, 4, dtype=F64)
    x[0, 0] = 3.0  # block 0 holds a value; blocks 1 (rows 2-3) and 2 (row 4, short) are all zero
    q = lp.quantize_fp8(x, block_size=2)
    assert q.scale.tolist() == [3.0 / 448, 1.0, 1.0]
    assert torch.equal(q.dequantize(F64), x)
    assert lp.quantize_fp8(torch.zeros(3, 2)).scale.item() == 1.0
    assert torch.equal(lp.fake_quantize(torch.zeros(3, 2)), torch.zeros(3, 2))


def test_per_block_scales_follow_each_block_and_float64_stays_float64():
    x = torch.tensor([[1.0, 2.0], [0.5, 0.0], [100.0, 3.0]], dtype=F64)
    q = lp.quantize_fp8(x, block_size=2)
    assert q.scale.dtype == F64 and q.scale.tolist() == [2.0 / 448, 100.0 / 448]
    assert q.row_scale().shape == (3, 1) and lp.fake_quantize(x, block_size=2).dtype == F64
    per_tensor = lp.quantize_fp8(x)
    assert per_tensor.scale.item() == 100.0 / 448


@pytest.mark.parametrize("call, exc, words", [
    (lambda: lp.quantize_fp8([1.0]), TypeError, "x must be a torch.Tensor"),
    (lambda: lp.quantize_fp8(torch.ones(2, 2), "e3m4"), ValueError, "fmt must be one of"),
    (lambda: lp.quantize_fp8(torch.ones(2, 2), block_size=0), ValueError, "block_size"),
    (lambda: lp.quantize_fp8(torch.ones(3), block_size=2), ValueError, "at least 2-D"),
    (lambda: lp.quantize_fp8(torch.tensor([1.0, float("nan")])), ValueError, "finite"),
    (lambda: lp.quantize_fp8(torch.ones(2, dtype=torch.int64)), TypeError, "int64"),
])
def test_quantize_refuses_bad_input(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


# ---------------------------------------------------------------------------------------------- rotation


def test_hadamard_is_sylvesters_matrix_and_orthogonal():
    H2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=F64)
    H8 = torch.kron(torch.kron(H2, H2), H2) / math.sqrt(8)
    assert torch.allclose(lp.hadamard_transform(torch.eye(8, dtype=F64)), H8, atol=1e-15, rtol=0)
    signs = lp.random_signs(16, torch.Generator().manual_seed(3), F64)
    M = lp.hadamard_transform(torch.eye(16, dtype=F64), signs)  # rows of I times diag(s) H / 4 = the matrix M
    assert torch.allclose(M @ M.T, torch.eye(16, dtype=F64), atol=1e-15, rtol=0)
    assert lp.hadamard_transform(torch.ones(4, dtype=F64)).tolist() == [2.0, 0.0, 0.0, 0.0]


def test_rotation_leaves_q_k_transpose_unchanged_in_float64():
    q, k, _ = _qkv(0, (3, 50, 64), outliers=True)
    signs = lp.random_signs(64, torch.Generator().manual_seed(1), F64)
    qr, kr = lp.hadamard_transform(q, signs), lp.hadamard_transform(k, signs)
    assert qr.dtype == F64
    assert torch.allclose(qr @ kr.transpose(-1, -2), q @ k.transpose(-1, -2), atol=1e-12, rtol=0)
    # ...and it spreads an outlier: the largest entry shrinks, the norm stays
    x = torch.zeros(1, 64, dtype=F64)
    x[0, 5] = 8.0
    y = lp.hadamard_transform(x, signs)
    assert torch.allclose(y.abs(), torch.full_like(y, 1.0)) and torch.isclose(y.norm(), x.norm())


def test_signs_come_from_the_generator_not_the_global_rng():
    state = torch.get_rng_state()
    a = lp.random_signs(32, torch.Generator().manual_seed(7))
    b = lp.random_signs(32, torch.Generator().manual_seed(7))
    assert torch.equal(a, b) and set(a.tolist()) <= {-1.0, 1.0} and torch.equal(torch.get_rng_state(), state)
    with pytest.raises(TypeError, match="generator"):
        lp.random_signs(4, 7)
    with pytest.raises(ValueError, match="power of two"):
        lp.hadamard_transform(torch.ones(6))


# ------------------------------------------------------------------------------------------------- exp2


def test_polynomial_exp2_error_bound_and_special_values():
    x = torch.linspace(-60, 60, 240_001, dtype=F64)
    rel = ((lp.exp2_poly(x) - torch.exp2(x)) / torch.exp2(x)).abs().max().item()
    assert 8.0e-5 < rel < 8.6e-5  # the cubic's minimax error on [0, 1), the same for every integer part
    x32 = x.float()
    exact = torch.exp2(x32.double())
    rel32 = ((lp.exp2_poly(x32).double() - exact) / exact).abs().max().item()
    assert rel32 < 8.6e-5 + 3e-7  # plus float32's rounding
    ints = torch.arange(-20, 21, dtype=F64)
    assert torch.equal(lp.exp2_poly(ints), torch.exp2(ints))  # p(0) = 1: exact at integers
    out = lp.exp2_poly(torch.tensor([float("-inf"), float("inf"), float("nan"), -200.0, 200.0]))
    assert out[0] == 0 and out[1] == float("inf") and out[2].isnan() and out[3] == 0 and out[4] == float("inf")
    assert lp.exp2_poly(torch.tensor([0.5], dtype=F64)).dtype == F64


def test_fit_reproduces_the_shipped_coefficients_and_equioscillates():
    c = lp.fit_exp2_minimax(3)
    assert np.allclose(c, lp.EXP2_COEFFS, atol=1e-9, rtol=0) and c[0] == 1.0
    f = np.linspace(0, 1, 100_001)
    err = np.polynomial.polynomial.polyval(f, c) / np.exp2(f) - 1
    top = np.abs(err).max()
    # four alternating extrema of one size: the interior ones and f = 1
    peaks = [np.abs(err[(f > a) & (f <= b)]).max() for a, b in ((0, 0.3), (0.3, 0.7), (0.7, 0.97), (0.97, 1.0))]
    assert max(peaks) - min(peaks) < 1e-3 * top
    assert np.abs(np.polynomial.polynomial.polyval(f, lp.fit_exp2_minimax(2)) / np.exp2(f) - 1).max() > 10 * top


# --------------------------------------------------------------------------------------------- attention


def test_fp32_recipe_matches_float64_and_the_chunked_backend():
    q, k, v = _qkv(1)
    ref = ac.scaled_dot_product_attention(q, k, v, backend="numpy")
    res = lp.simulate_attention(q, k, v, block_k=32)
    assert res.out.dtype == F64 and lp.rmse(res.out, ref) < 1e-7
    q32, k32, v32 = (t.float() for t in (q, k, v))
    chunked = ac.scaled_dot_product_attention(q32, k32, v32, backend="chunked")
    assert torch.allclose(lp.simulate_attention(q32, k32, v32, block_k=32).out, chunked, atol=5e-6, rtol=0)
    causal = lp.simulate_attention(q, k, v, is_causal=True, block_k=16).out
    assert lp.rmse(causal, ac.scaled_dot_product_attention(q, k, v, is_causal=True, backend="numpy")) < 1e-7


def test_fp64_recipe_is_float64_exact_enough():
    q, k, v = _qkv(2)
    ref = ac.scaled_dot_product_attention(q, k, v, backend="numpy")
    assert lp.rmse(lp.simulate_attention(q, k, v, lp.Recipe("fp64"), block_k=16).out, ref) < 1e-15


def test_threshold_zero_is_the_ordinary_online_softmax_bit_for_bit():
    for seed in range(3):
        q, k, v = _qkv(seed, dtype=torch.float32)
        a = lp.simulate_attention(q, k, v, block_k=16, rescale_threshold=0.0)
        b = lp.simulate_attention(q, k, v, block_k=16)
        assert torch.equal(a.out, b.out) and a.rescales == b.rescales and a.skipped == 0


def test_threshold_skips_rescales_and_keeps_the_output():
    q, k, v = _qkv(3)
    ref = ac.scaled_dot_product_attention(q, k, v, backend="numpy")
    plain = lp.simulate_attention(q, k, v, block_k=16)
    lazy = lp.simulate_attention(q, k, v, block_k=16, rescale_threshold=8.0)
    assert lazy.rescales < plain.rescales and lazy.skipped > 0
    assert lp.rmse(lazy.out, ref) < 1e-7  # the final normalisation is exact
    # a hand case: one query, tiles of 1 key, scores (base 2) 0, 1, 10: tau = 2 skips the 1, not the 10
    qh = torch.tensor([[1.0]], dtype=F64)
    kh = torch.tensor([[0.0], [1.0], [10.0]], dtype=F64) / lp._LOG2E
    vh = torch.tensor([[1.0], [2.0], [3.0]], dtype=F64)
    r = lp.simulate_attention(qh, kh, vh, lp.Recipe("fp64"), scale=1.0, block_k=1, rescale_threshold=2.0)
    assert (r.rescales, r.skipped) == (1, 1)
    assert (1 / lp._LOG2E) * lp._LOG2E == 1.0  # so scale = 1 / log2(e) gives base-2 scores q.k exactly
    edge = lp.simulate_attention(qh, torch.tensor([[0.0], [2.0]], dtype=F64), vh[:2], lp.Recipe("fp64"),
                                 scale=1 / lp._LOG2E, block_k=1, rescale_threshold=2.0)
    assert (edge.rescales, edge.skipped) == (0, 1)  # growth exactly tau is skipped, as FA4's `>= -threshold`
    w = torch.tensor([1.0, 2.0, 1024.0], dtype=F64)
    assert torch.allclose(r.out, (w @ vh / w.sum())[None], atol=1e-14, rtol=0)


def test_fp16_raw_scores_overflow_and_fp32_ones_do_not():
    q = torch.full((1, 4, 64), 32.0)  # q.k = 64 * 32^2 = 65536 > 65504, float16's largest
    k, v = q.clone(), torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(0))
    bad = lp.simulate_attention(q, k, v, lp.Recipe("fp32", scores=torch.float16)).out
    good = lp.simulate_attention(q, k, v, lp.Recipe("fp32")).out
    assert bad.isnan().all() and torch.allclose(good, v.mean(-2, keepdim=True).expand_as(good), atol=1e-6)
    q31 = torch.full((1, 4, 64), 31.0)
    assert lp.simulate_attention(q31, q31, v, lp.Recipe("fp32", scores=torch.float16)).out.isfinite().all()


def test_fp8_recipes_order_with_outliers():
    q, k, v = _qkv(4, (1, 2, 256, 64), outliers=True)
    ref = ac.scaled_dot_product_attention(q, k, v, backend="numpy")
    err = {n: lp.rmse(lp.simulate_attention(q, k, v, r, generator=torch.Generator().manual_seed(0)).out, ref)
           for n, r in lp.RECIPES.items()}
    assert err["fp32"] < err["fp16"] < err["bf16"] < err["fp8 per block + hadamard"]
    assert err["fp8 per tensor + hadamard"] < err["fp8 per tensor"]
    assert err["fp8 per block + hadamard"] < err["fp8 per block"]


def test_hadamard_recipe_needs_a_generator_and_a_power_of_two():
    q, k, v = _qkv(0, (1, 8, 6))
    with pytest.raises(TypeError, match="generator"):
        lp.simulate_attention(q, k, v, lp.RECIPES["fp8 per tensor + hadamard"])
    with pytest.raises(ValueError, match="power of two"):
        lp.simulate_attention(q, k, v, lp.RECIPES["fp8 per tensor + hadamard"], generator=torch.Generator())


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(query=torch.ones(2, 3), key=torch.ones(2, 4), value=torch.ones(2, 3)), ValueError, "same E"),
    (dict(query=torch.ones(2, 3), key=torch.ones(2, 3), value=torch.ones(3, 3)), ValueError, "leading dims"),
    (dict(query=torch.ones(3), key=torch.ones(2, 3), value=torch.ones(2, 3)), ValueError, "at least 2 dims"),
    (dict(query=torch.ones(2, 3), key=torch.ones(2, 3), value=torch.ones(2, 3), rescale_threshold=-1.0),
     ValueError, "rescale_threshold"),
    (dict(query=torch.ones(2, 3), key=torch.ones(2, 3), value=torch.ones(2, 3), recipe="fp8"), TypeError, "Recipe"),
    (dict(query=torch.ones(2, 3), key=torch.ones(2, 3), value=torch.ones(2, 3), block_k=0), ValueError, "block_k"),
    (dict(query=torch.ones(2, 3), key=torch.ones(2, 3, dtype=torch.float64), value=torch.ones(2, 3)), TypeError,
     r"one dtype, got torch.float32, torch.float64 and torch.float32"),
    (dict(query=torch.ones(2, 3), key=torch.ones(2, 3), value=torch.ones(2, 3, dtype=torch.float16)), TypeError,
     "one dtype, got torch.float32, torch.float32 and torch.float16"),
    (dict(query=torch.ones(2, 3), key=torch.ones(2, 3, device="meta"), value=torch.ones(2, 3)), ValueError,
     "one device, got cpu, meta and cpu"),
])
def test_simulate_refuses_bad_input(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        lp.simulate_attention(**kwargs)


def test_recipe_refuses_unknown_formats():
    with pytest.raises(ValueError, match="inputs"):
        lp.Recipe("fp4")
    with pytest.raises(ValueError, match="stats"):
        lp.Recipe("fp32", stats=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="a and b"):
        lp.rmse(torch.ones(2), torch.ones(3))


def test_rounded_stats_rounds_only_the_statistic_it_names() -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 512, 32, generator=g, dtype=torch.float64) for _ in range(3))
    ref = ac.scaled_dot_product_attention(q, k, v, backend="numpy")
    err = {w: lp.rmse(lp.simulate_attention(q, k, v, lp.Recipe("fp32", stats=torch.bfloat16, rounded_stats=w),
                                            block_k=32).out, ref) for w in ("both", "max", "sum")}
    fp32 = lp.rmse(lp.simulate_attention(q, k, v, lp.Recipe("fp32"), block_k=32).out, ref)
    assert err["max"] < 2 * fp32 < err["sum"] / 100  # a rounded max is a shared shift; the sum loses digits
    assert 0.5 < err["sum"] / err["both"] < 2
    big = torch.full((1, 4, 16), 200.0, dtype=torch.float64)  # max score 200^2 * 16 / 4 * log2(e) > 65504
    finite = {w: bool(lp.simulate_attention(big, big, big, lp.Recipe(
        "fp32", stats=torch.float16, rounded_stats=w)).out.isfinite().all()) for w in ("both", "max", "sum")}
    assert finite == {"both": False, "max": False, "sum": True}  # only a max stored in fp16 overflows here
    with pytest.raises(ValueError, match="rounded_stats"):
        lp.Recipe("fp32", stats=torch.bfloat16, rounded_stats="min")


def test_the_output_keeps_the_callers_dtype_with_the_rotation() -> None:
    q, k, v = (t.half() for t in _qkv(5, (1, 64, 32)))
    for name in ("fp32", "fp8 per tensor + hadamard", "fp8 per block + hadamard"):
        out = lp.simulate_attention(q, k, v, lp.RECIPES[name], generator=torch.Generator().manual_seed(0)).out
        assert out.dtype == torch.float16, name


def test_simulate_makes_its_masks_on_the_inputs_device(monkeypatch) -> None:
    """Every ``torch.arange`` the simulation makes is on the inputs' device (a GPU tensor meets no CPU mask)."""
    import sys

    real, devices = torch.arange, []

    def spy(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") == lp.__name__:
            devices.append(kwargs.get("device"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "arange", spy)
    q, k, v = _qkv(6, (1, 2, 24, 8))
    lp.simulate_attention(q, k, v, is_causal=True, block_k=8)
    assert len(devices) == 1 + 3 and all(d is not None and torch.device(d) == q.device for d in devices)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_simulate_runs_on_a_gpu_as_on_the_cpu() -> None:
    q, k, v = _qkv(7, (1, 2, 96, 64), outliers=True)
    for name, recipe in lp.RECIPES.items():
        ref = lp.simulate_attention(q, k, v, recipe, is_causal=True, block_k=32,
                                    generator=torch.Generator().manual_seed(1))
        got = lp.simulate_attention(q.cuda(), k.cuda(), v.cuda(), recipe, is_causal=True, block_k=32,
                                    generator=torch.Generator().manual_seed(1))
        assert got.out.device.type == "cuda" and torch.allclose(got.out.cpu(), ref.out, atol=1e-5), name
