"""Attention in low precision, simulated on any CPU: FP8 quantisation, the Hadamard rotation, FA4's tricks.

What a GPU kernel does in fp16, bf16 or FP8 is reproduced here with dtype casts, where the rounding happens:

- :func:`quantize_fp8` rounds a tensor to ``torch.float8_e4m3fn`` or ``float8_e5m2`` with a scale
  ``amax / fp8_max``, one per tensor or one per block of rows (a kernel's tile: ``block_q`` query rows,
  ``block_k`` key rows), as FlashAttention-3's FP8 forward does (Shah et al. 2024, section 3.3);
- :func:`hadamard_transform` and :func:`random_signs` give the rotation ``M = diag(signs) H / sqrt(n)``
  ("incoherent processing"): ``(Q M)(K M)^T = Q K^T`` because ``M`` is orthogonal, but the rotated rows
  spread an outlier over every coordinate before they are quantised;
- :func:`simulate_attention` runs the online softmax over key tiles with each quantity rounded to the
  precision a :class:`Recipe` names: inputs, scores, softmax statistics (running max and sum), and P
  (cast to the P @ V operand's precision); optionally with FlashAttention-4's rescale threshold (the output
  is rescaled only when a row's running max grows by more than ``tau``, in base-2 units) and a polynomial exp2;
- :func:`exp2_poly` computes ``2^x = 2^floor(x) * p(x - floor(x))`` with a polynomial evaluated by Horner's
  rule; :func:`fit_exp2_minimax` computes the coefficients (Remez exchange on the relative error).

The online softmax here is a short loop written for the rounding hooks; the chunked backend
(:mod:`attention_core.backends.chunked`) is the fast one and has none. In float32 the two agree to float32's
rounding (``tests/test_low_precision.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from attention_core._checks import check_bool_flag, check_int, check_real, check_tensor

__all__ = [
    "EXP2_COEFFS",
    "FORMATS",
    "FP8Tensor",
    "RECIPES",
    "Recipe",
    "SimulatedAttention",
    "exp2_poly",
    "fake_quantize",
    "fit_exp2_minimax",
    "hadamard_transform",
    "quantize_fp8",
    "random_signs",
    "rmse",
    "simulate_attention",
]

#: The two FP8 formats by name: e4m3 (4 exponent bits, 3 mantissa bits, max 448, no infinity) and e5m2
#: (5 exponent bits, 2 mantissa bits, max 57344).
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: Input formats :class:`Recipe` accepts, with the dtype each rounds to.
FORMATS = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, **FP8}
_LOG2E = 1.4426950408889634
_STATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------ quantisation


@dataclass(frozen=True)
class FP8Tensor:
    """A tensor stored in FP8 with its scales: ``value ~= codes * scale``.

    Attributes:
        codes: (..., L, E) in ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
        scale: () for a per-tensor scale, or (..., ceil(L / block_size)) for one scale per block of rows; in
            the dtype the input was computed in (float64 for float64 input, float32 otherwise).
        block_size: rows per block, ``None`` for a per-tensor scale.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    block_size: Optional[int]

    def row_scale(self) -> torch.Tensor:
        """The scale of every row: (..., L, 1) (per block) or () (per tensor)."""
        return _row_scale(self.scale, self.block_size, self.codes.shape[-2] if self.codes.dim() >= 2 else 1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``codes * scale`` in ``dtype``: (..., L, E)."""
        return self.codes.to(dtype) * self.row_scale().to(dtype)


def _row_scale(scale: torch.Tensor, block_size: Optional[int], L: int) -> torch.Tensor:
    if block_size is None:
        return scale
    return scale.repeat_interleave(block_size, dim=-1)[..., :L, None]  # (..., nb) -> (..., L, 1)


def _check_fmt(fmt: object, name: str, allowed: dict) -> torch.dtype:
    if not isinstance(fmt, str) or fmt not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {fmt!r}")
    return allowed[fmt]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def quantize_fp8(x: torch.Tensor, fmt: str = "e4m3", *, block_size: Optional[int] = None) -> FP8Tensor:
    """Round ``x`` to FP8 with a scale ``amax / fp8_max`` per tensor, or per block of ``block_size`` rows.

    The scale maps the largest magnitude of the tensor (or of the block) onto the format's largest finite
    value, so nothing overflows; a block of zeros gets the scale 1 (its codes are zeros, never 0 / 0). The
    division and the cast run in float64 for float64 input and float32 otherwise (torch casts float64 to FP8
    through float32).

    Args:
        x: (..., L, E) floating, finite; at least 1-D per tensor, at least 2-D per block (blocks run along
            dim -2, the sequence, as a kernel's tiles do; the last block may be shorter).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        block_size: rows per block, or ``None`` for one scale for the whole tensor.

    Returns:
        :class:`FP8Tensor` with codes of ``x``'s shape.
    """
    x = check_tensor(x, "x")
    dtype = _check_fmt(fmt, "fmt", FP8)
    if not x.is_floating_point() or x.dtype in FP8.values():
        raise TypeError(f"x must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if block_size is not None:
        check_int(block_size, "block_size", low=1)
        if x.dim() < 2:
            raise ValueError(f"x must be at least 2-D (..., L, E) to be quantised per block, got shape "
                             f"{tuple(x.shape)}")
    elif x.dim() < 1:
        raise ValueError("x must be at least 1-D, got a 0-d tensor")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("x must be finite: a NaN or an infinity has no FP8 scale")
    xc = x.to(_compute_dtype(x))
    fmax = torch.finfo(dtype).max
    if block_size is None:
        amax = xc.abs().amax() if xc.numel() else xc.new_zeros(())
        scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))  # ()
        return FP8Tensor((xc / scale).to(dtype), scale, None)
    L = xc.shape[-2]
    nb = -(-L // block_size)
    pad = nb * block_size - L
    rows = xc.abs().amax(dim=-1) if xc.shape[-1] else xc.new_zeros(xc.shape[:-1])  # (..., L)
    rows = torch.nn.functional.pad(rows, (0, pad))  # (..., L) -> (..., nb * block)
    amax = rows.reshape(*rows.shape[:-1], nb, block_size).amax(dim=-1)  # (..., nb * block) -> (..., nb)
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))  # (..., nb)
    return FP8Tensor((xc / _row_scale(scale, block_size, L)).to(dtype), scale, block_size)


def fake_quantize(x: torch.Tensor, fmt: str = "e4m3", *, block_size: Optional[int] = None) -> torch.Tensor:
    """``quantize_fp8(x, fmt, block_size=...)`` dequantised back to ``x``'s dtype: (..., L, E)."""
    return quantize_fp8(x, fmt, block_size=block_size).dequantize(_compute_dtype(x)).to(x.dtype)


# ---------------------------------------------------------------------------------------------- rotation


def random_signs(n: int, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``n`` random signs (+1 or -1) drawn from ``generator`` (never the global RNG): (n,) in ``dtype``."""
    check_int(n, "n", low=1)
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    return (torch.randint(0, 2, (n,), generator=generator) * 2 - 1).to(dtype)


def hadamard_transform(x: torch.Tensor, signs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fast Walsh-Hadamard transform of the last dim, orthonormal: ``x @ diag(signs) @ H / sqrt(n)``.

    ``H`` is Sylvester's Hadamard matrix (``H_1 = [1]``, ``H_2n = [[H, H], [H, -H]]``); ``n log2 n``
    additions instead of the ``n^2`` of a matrix product. ``M = diag(signs) H / sqrt(n)`` is orthogonal, so
    ``hadamard_transform(q, s) @ hadamard_transform(k, s).T == q @ k.T`` in exact arithmetic.

    Args:
        x: (..., n) floating, ``n`` a power of two.
        signs: (n,) of +1/-1 (:func:`random_signs`), or ``None`` for no signs.

    Returns:
        (..., n) in ``x``'s dtype.
    """
    x = check_tensor(x, "x")
    if not x.is_floating_point() or x.dim() < 1:
        raise TypeError(f"x must be a floating tensor of at least 1 dim, got {x.dtype}, shape {tuple(x.shape)}")
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"x's last dim must be a power of two, got {n}")
    if signs is not None:
        signs = check_tensor(signs, "signs")
        if signs.shape != (n,) or not bool((signs.abs() == 1).all()):
            raise ValueError(f"signs must be ({n},) of +1 and -1, got shape {tuple(signs.shape)}")
        x = x * signs.to(x.dtype)
    lead = x.shape[:-1]
    y = x.reshape(-1, n)  # (..., n) -> (N, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)  # (N, n) -> (N, pairs, 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)  # (N, pairs, 2, h)
        h *= 2
    return y.reshape(*lead, n) / math.sqrt(n)  # (N, ..., 2, h) -> (..., n)


# ------------------------------------------------------------------------------------------------- exp2


def fit_exp2_minimax(degree: int = 3, *, points: int = 20001, iterations: int = 30) -> tuple[float, ...]:
    """Coefficients ``(1, c1, ..., c_degree)`` of ``p(f) ~ 2^f`` on [0, 1] minimising the largest relative error.

    ``p(0) = 1`` exactly (so ``2^x`` is exact at integers up to the last coefficient's rounding), and the other
    coefficients come from the Remez exchange on the relative error ``p(f) / 2^f - 1``, in float64, on a grid of
    ``points`` values of ``f``: solve for the polynomial whose error alternates in sign with equal size at
    ``degree + 1`` reference points, move the points to the error's extrema, repeat.

    Returns:
        ``degree + 1`` Python floats, lowest power first.
    """
    check_int(degree, "degree", low=1, high=8)
    check_int(points, "points", low=100)
    check_int(iterations, "iterations", low=1)
    f = np.linspace(0.0, 1.0, points)[1:]  # f = 0 is exact by construction
    target = np.exp2(f)
    ref = np.linspace(0.0, 1.0, degree + 2)[1:]  # degree + 1 reference points in (0, 1]
    for _ in range(iterations):
        # sum_k c_k r^k + (-1)^i E 2^r = 2^r - 1 at each reference point r_i (unknowns c_1..c_degree, E)
        A = np.column_stack([ref**k for k in range(1, degree + 1)] + [(-1.0) ** np.arange(degree + 1) * np.exp2(ref)])
        sol = np.linalg.solve(A, np.exp2(ref) - 1.0)
        coeffs = np.concatenate([[1.0], sol[:degree]])
        err = np.polynomial.polynomial.polyval(f, coeffs) / target - 1.0
        # one extremum per run of equal sign; then keep degree + 1 alternating ones around the largest
        runs = np.flatnonzero(np.diff(np.sign(err)) != 0) + 1
        ext = [s[np.argmax(np.abs(err[s]))] for s in np.split(np.arange(f.size), runs)]
        while len(ext) > degree + 1:
            ext.pop(0 if abs(err[ext[0]]) < abs(err[ext[-1]]) else -1)
        if len(ext) < degree + 1:
            break
        ref = f[np.array(ext)]
    return tuple(float(c) for c in coeffs)


#: The degree-3 minimax coefficients (lowest power first) from ``fit_exp2_minimax(3)``, computed once and kept
#: here; ``tests/test_low_precision.py`` recomputes them. FlashAttention-4 also uses a cubic with ``p(0) = 1``.
EXP2_COEFFS = (1.0, 0.6951167864133925, 0.2276449911952409, 0.07706704200379574)


def exp2_poly(x: torch.Tensor, coeffs: tuple = EXP2_COEFFS) -> torch.Tensor:
    """``2^x`` by range reduction and a polynomial: ``2^floor(x) * p(x - floor(x))``, ``p`` by Horner's rule.

    The integer part goes into the exponent (``torch.ldexp``, exact); only the fraction ``f`` in [0, 1) needs
    the polynomial, so the relative error is the polynomial's on [0, 1) (plus the dtype's rounding), whatever
    ``x``'s size. ``-inf`` gives 0, ``+inf`` gives inf, NaN gives NaN; results below the dtype's range are 0.

    Args:
        x: floating tensor (float32 or float64; the arithmetic runs in its dtype).
        coeffs: polynomial coefficients, lowest power first.

    Returns:
        ``x``'s shape and dtype.
    """
    x = check_tensor(x, "x")
    if x.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"x must be float32 or float64, got {x.dtype}")
    if not isinstance(coeffs, (tuple, list)) or not coeffs:
        raise TypeError(f"coeffs must be a non-empty tuple of floats, got {type(coeffs).__name__}")
    coeffs = [check_real(c, f"coeffs[{i}]") for i, c in enumerate(coeffs)]
    lowest = -1100.0 if x.dtype == torch.float64 else -160.0  # below this 2^x is 0 in the dtype
    xc = x.clamp(min=lowest).nan_to_num(posinf=2000.0)  # keep floor() finite; NaN stays NaN
    n = torch.floor(xc)
    f = xc - n  # in [0, 1), exact
    p = torch.full_like(f, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * f + c  # Horner
    out = torch.ldexp(p, n.to(torch.int32) if x.dtype == torch.float32 else n.to(torch.int64))
    return torch.where((x == float("inf")) | torch.isnan(x), x, out)


# --------------------------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class Recipe:
    """Where a simulated kernel rounds, and to what.

    Attributes:
        inputs: Q, K, V format: ``"fp64"``, ``"fp32"``, ``"bf16"``, ``"fp16"``, ``"e4m3"`` or ``"e5m2"``.
            Products are accumulated in float32 (float64 for ``"fp64"``), as tensor cores accumulate.
        quantization: FP8 scales ``"tensor"`` (one per tensor) or ``"block"`` (one per tile of rows).
        hadamard: rotate Q and K by a random Hadamard matrix before rounding (V is not rotated).
        scores: dtype the raw scores ``Q K^T`` are rounded to before the softmax (fp16 overflows past 65504);
            ``None``: the accumulation dtype.
        stats: dtype of the running max and the running sum; ``None``: the accumulation dtype.
        rounded_stats: which statistics ``stats`` applies to: ``"both"``, ``"max"`` (the running sum stays in
            the accumulation dtype) or ``"sum"`` (the running max does), to measure each one's share.
        p: dtype P is cast to for P @ V (``None``: the inputs' dtype, e4m3 for FP8 as in FlashAttention-3).
        poly_exp2: compute exponentials with :func:`exp2_poly` instead of ``torch.exp2``.
    """

    inputs: str = "fp32"
    quantization: str = "tensor"
    hadamard: bool = False
    scores: Optional[torch.dtype] = None
    stats: Optional[torch.dtype] = None
    p: Optional[torch.dtype] = None
    poly_exp2: bool = False
    rounded_stats: str = "both"

    def __post_init__(self) -> None:
        _check_fmt(self.inputs, "inputs", FORMATS)
        _check_fmt(self.quantization, "quantization", {"tensor": None, "block": None})
        check_bool_flag(self.hadamard, "hadamard")
        check_bool_flag(self.poly_exp2, "poly_exp2")
        _check_fmt(self.rounded_stats, "rounded_stats", {"both": None, "max": None, "sum": None})
        for name in ("scores", "stats"):
            if getattr(self, name) is not None and getattr(self, name) not in _STATS:
                raise ValueError(f"{name} must be one of {_STATS}, got {getattr(self, name)!r}")
        if self.p is not None and self.p not in (*_STATS, *FP8.values()):
            raise ValueError(f"p must be None, a float dtype or an FP8 dtype, got {self.p!r}")

    @property
    def accumulate(self) -> torch.dtype:
        return torch.float64 if self.inputs == "fp64" else torch.float32


#: The recipes the chapter compares. "fp8 baseline" is our reading of FlashAttention-3's FP8 baseline, whose
#: section 4.3 gives per-tensor scales, float32 accumulation and softmax intermediates in fp16 without saying
#: which intermediates, so this recipe rounds the running max and the running sum to fp16.
RECIPES = {
    "fp32": Recipe("fp32"),
    "bf16": Recipe("bf16"),
    "fp16": Recipe("fp16"),
    "fp8 baseline": Recipe("e4m3", "tensor", False, stats=torch.float16),
    "fp8 per tensor": Recipe("e4m3", "tensor", False),
    "fp8 per tensor + hadamard": Recipe("e4m3", "tensor", True),
    "fp8 per block": Recipe("e4m3", "block", False),
    "fp8 per block + hadamard": Recipe("e4m3", "block", True),
}


@dataclass(frozen=True)
class SimulatedAttention:
    """What :func:`simulate_attention` returns.

    Attributes:
        out: (..., L, Ev) in the query's dtype.
        rescales: how many times a row's output was rescaled (tiles after the first whose max grew past ``tau``).
        skipped: how many times a row's max grew by at most ``tau`` and the rescale was skipped.
    """

    out: torch.Tensor
    rescales: int
    skipped: int


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if dtype == x.dtype else x.to(dtype).to(x.dtype)


def _prepare(x: torch.Tensor, recipe: Recipe, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rounded codes in the accumulation dtype and the row scales: ((..., N, D), (..., N, 1) or ())."""
    acc = recipe.accumulate
    if recipe.inputs in FP8:
        q = quantize_fp8(x, recipe.inputs, block_size=block if recipe.quantization == "block" else None)
        return q.codes.to(acc), q.row_scale().to(acc)
    return x.to(FORMATS[recipe.inputs]).to(acc), torch.ones((), dtype=acc, device=x.device)


def _check_qkv(query: object, key: object, value: object) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(t, name)
        if not t.is_floating_point() or t.dtype in FP8.values():
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{name} must be (..., N, D) with at least 2 dims, got shape {tuple(t.shape)}")
    if not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype} and {value.dtype}")
    if not query.device == key.device == value.device:
        raise ValueError(f"query, key and value must be on one device, got {query.device}, {key.device} and "
                         f"{value.device}")
    if query.shape[:-2] != key.shape[:-2] or key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"query (..., L, E), key (..., S, E) and value (..., S, Ev) must share their leading dims"
                         f" and S; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key must have the same E, got {query.shape[-1]} and {key.shape[-1]}")


def simulate_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    recipe: Recipe = RECIPES["fp32"],
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    block_q: int = 128,
    block_k: int = 128,
    rescale_threshold: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
) -> SimulatedAttention:
    """Softmax attention by the online softmax over key tiles, rounded where ``recipe`` says.

    Per key tile of ``block_k`` keys, in base-2 units (``s = scale * log2(e) * q.k``): ``m_new = max(m, rowmax(s))``,
    ``p = exp2(s - m_new)``, ``l = l * alpha + rowsum(p)``, ``o = o * alpha + cast(p) @ v`` with
    ``alpha = exp2(m - m_new)``; at the end ``out = o / l``. ``m`` and ``l`` are rounded to ``recipe.stats``
    after each update, the raw scores to ``recipe.scores``, and ``p`` to ``recipe.p`` before ``p @ v`` (the row
    sum uses the unrounded ``p``, as the kernels do). With ``rescale_threshold = tau`` the running max moves
    (and ``o`` and ``l`` are rescaled) only when a tile's max exceeds it by more than ``tau``; otherwise the
    stale max is kept and ``p`` may reach ``2^tau``. Numerator and denominator share the stale max, so the final
    ``o / l`` is unchanged in exact arithmetic. ``tau = 0`` is the ordinary online softmax, bit for bit.

    Args:
        query: (..., L, E); key: (..., S, E); value: (..., S, Ev); one dtype (float16/bfloat16/float32/float64)
            and one device for all three.
        recipe: a :class:`Recipe` (see :data:`RECIPES`).
        is_causal: hide key j from query i when j > i (upper-left aligned).
        scale: score scale, default ``1/sqrt(E)``.
        block_q, block_k: the tile; FP8 ``"block"`` scales are per ``block_q`` query rows and ``block_k`` keys.
        rescale_threshold: ``None`` (rescale whenever the max grows) or ``tau >= 0`` in base-2 units.
        generator: draws the Hadamard signs (required when ``recipe.hadamard``).

    Returns:
        :class:`SimulatedAttention` (output in the query's dtype, and the rescale counts).

    Raises:
        TypeError: if an input is not a float16/bfloat16/float32/float64 tensor, the three dtypes differ, or
            ``recipe`` is not a :class:`Recipe`.
        ValueError: if the shapes do not fit, the inputs are on different devices, or a tile or threshold is out
            of range.
    """
    _check_qkv(query, key, value)
    out_dtype, device = query.dtype, query.device
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a Recipe, got {type(recipe).__name__}")
    check_bool_flag(is_causal, "is_causal")
    check_int(block_q, "block_q", low=1)
    check_int(block_k, "block_k", low=1)
    E = query.shape[-1]
    scale = 1 / math.sqrt(E) if scale is None else check_real(scale, "scale", low=0.0, low_open=True)
    tau = None if rescale_threshold is None else check_real(rescale_threshold, "rescale_threshold", low=0.0)
    if recipe.hadamard:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator when recipe.hadamard, got {type(generator).__name__}")
        if E & (E - 1):
            raise ValueError(f"the Hadamard rotation needs E a power of two, got E = {E}")
        signs = random_signs(E, generator, torch.float64).to(query.device)  # drawn on the CPU generator
        query, key = (hadamard_transform(t.to(torch.promote_types(t.dtype, torch.float32)), signs)
                      for t in (query, key))
    q, sq = _prepare(query, recipe, block_q)  # (..., L, E), row scales
    k, sk = _prepare(key, recipe, block_k)  # (..., S, E)
    v, sv = _prepare(value, recipe, block_k)  # (..., S, Ev)
    p_dtype = recipe.p or (FORMATS[recipe.inputs] if recipe.inputs != "fp64" else torch.float64)
    exp2 = exp2_poly if recipe.poly_exp2 else torch.exp2
    stats = recipe.stats or recipe.accumulate
    max_dtype = stats if recipe.rounded_stats in ("both", "max") else recipe.accumulate
    sum_dtype = stats if recipe.rounded_stats in ("both", "sum") else recipe.accumulate
    L, S = q.shape[-2], k.shape[-2]
    m = q.new_full((*q.shape[:-1], 1), float("-inf"))  # (..., L, 1) running max, base-2 units
    denom = q.new_zeros((*q.shape[:-1], 1))  # (..., L, 1) running sum
    o = q.new_zeros((*q.shape[:-1], v.shape[-1]))  # (..., L, Ev)
    rescales = skipped = 0
    rows = torch.arange(L, device=device)[:, None]  # (L, 1)
    for s0 in range(0, S, block_k):
        s1 = min(s0 + block_k, S)
        sk_t = sk[..., s0:s1, :].transpose(-1, -2) if sk.dim() else sk  # (..., 1, bs) or ()
        raw = (q @ k[..., s0:s1, :].transpose(-1, -2)) * sq * sk_t  # (..., L, E) @ (..., E, bs) -> (..., L, bs)
        s = _round(raw, recipe.scores or raw.dtype) * (scale * _LOG2E)
        if is_causal:
            s = s.masked_fill(torch.arange(s0, s1, device=device)[None, :] > rows, float("-inf"))  # (L, bs) broadcast
        tile_max = s.amax(dim=-1, keepdim=True)  # (..., L, 1)
        grows = tile_max > m
        if tau is None:
            move = grows
        else:
            move = grows & ((tile_max - m > tau) | torch.isinf(m))
        first = torch.isinf(m)
        rescales += int((move & ~first).sum())
        skipped += int((grows & ~move & ~first).sum())
        m_new = _round(torch.where(move, tile_max, m), max_dtype)  # the max as the kernel stores it
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # a row with no key yet
        alpha = torch.where(move, exp2(m - m_safe), torch.ones_like(m))  # exp2(-inf) = 0 on the first tile
        p = exp2(s - m_safe)  # (..., L, bs)
        denom = _round(denom * alpha + p.sum(dim=-1, keepdim=True), sum_dtype)
        pv = (_round(p, p_dtype) @ v[..., s0:s1, :]) * (sv[..., s0:s0 + 1, :] if sv.dim() else sv)  # per-tile scale
        o = o * alpha + pv
        m = m_new
    out = o / torch.where(denom == 0, torch.ones_like(denom), denom)
    return SimulatedAttention(out.to(out_dtype), rescales, skipped)  # the caller's dtype, not the rotation's


def rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Root mean squared difference of two tensors of one shape, computed in float64: a Python float."""
    check_tensor(a, "a")
    check_tensor(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    return float((a.double() - b.double()).pow(2).mean().sqrt())
