"""The code exercise of chapter 18 (attention in low precision): FP8 quantisation with one scale per block.

The reader writes ``fake_quantize_blocks(x, block)``: round ``x`` (L, E) to ``torch.float8_e4m3fn`` with one
scale ``amax / 448`` per block of ``block`` consecutive rows (the last block may be shorter; a block of zeros
gets the scale 1) and return the dequantised values in ``x``'s dtype. The reference is
:func:`attention_core.low_precision.fake_quantize`; the mistakes below are the ones the chapter warns about.
"""

from __future__ import annotations

from typing import Any

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake

__all__ = ["ch18_spec", "fake_quantize_blocks_mistake"]

_E4M3 = torch.float8_e4m3fn


def fake_quantize_blocks_mistake(x: torch.Tensor, block: int, *, fmax: float = 448.0, guard: bool = True,
                                 per_tensor: bool = False, dtype: torch.dtype = _E4M3, along: int = -2,
                                 skip_cast: bool = False, signed_amax: bool = False) -> torch.Tensor:
    """A quantiser with one switch per known mistake (the defaults give the right answer)."""
    xc = x.double() if x.dtype == torch.float64 else x.float()
    if along == -1:
        xc = xc.transpose(-1, -2)  # blocks of columns instead of rows
    L = xc.shape[-2]
    out = torch.empty_like(xc)
    whole = xc.abs().amax() if xc.numel() else xc.new_zeros(())
    for r0 in range(0, L, block):
        part = xc[..., r0:r0 + block, :]
        amax = whole if per_tensor else (part.abs().amax() if part.numel() else part.new_zeros(()))
        if signed_amax and part.numel():
            amax = part.amax()  # the largest x, not the largest |x|
        scale = amax / fmax
        if guard and amax == 0:
            scale = torch.ones_like(scale)
        codes = part / scale
        codes = codes if skip_cast else codes.to(dtype).to(xc.dtype)
        out[..., r0:r0 + block, :] = codes * scale
    if along == -1:
        out = out.transpose(-1, -2)
    return out.to(x.dtype)


def _reference(x: torch.Tensor, block: int) -> torch.Tensor:
    from attention_core.low_precision import fake_quantize

    return fake_quantize(x, "e4m3", block_size=block)


def ch18_spec() -> FunctionSpec:
    """The :class:`FunctionSpec` of ``ch18.fake_quantize_blocks``."""
    from hypothesis import strategies as st

    @st.composite
    def problems(draw: Any) -> tuple:
        L = draw(st.integers(1, 9))
        E = draw(st.integers(1, 4))
        block = draw(st.integers(1, 4))
        dtype = draw(st.sampled_from([torch.float32, torch.float64]))
        mag = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
        vals = draw(st.lists(st.floats(-1.0, 1.0, allow_nan=False, width=32), min_size=L * E, max_size=L * E))
        x = torch.tensor(vals, dtype=torch.float64).view(L, E) * mag
        if draw(st.booleans()):  # an outlier in one row
            x[draw(st.integers(0, L - 1)), 0] = mag * draw(st.sampled_from([50.0, -200.0]))
        if draw(st.booleans()):  # a block of zeros
            x[: min(block, L)] = 0
        return x.to(dtype), block

    T = torch.tensor
    return FunctionSpec(
        "fake_quantize_blocks", _reference, problems(), atol=0.0, rtol=1e-6, max_examples=80,
        arg_names=("x", "block"),
        examples=(
            (T([[448.0, 1.0], [0.5, 0.0], [7.0, -3.3]]), 2),  # the statement's: block 0 exact, block 1 rounds
            (T([[0.0, 0.0], [0.0, 0.0], [1.0, 2.0]], dtype=torch.float64), 2),  # a block of zeros
            (T([[1.0, 2.0], [300.0, 0.01], [0.3, 0.7]]), 1),  # an outlier row: per-row scales
            (T([[1e-3, 2e-3, 3e-3], [5000.0, 1.0, -1.0]]), 1),  # tiny values need their own scale
            (T([[0.1, 0.2], [0.3, 0.4], [1000.0, 1.0]], dtype=torch.float64), 2),  # ragged last block, an outlier
            (T([[-500.0, 1.0], [2.0, -0.5]]), 2),  # the block's largest |x| is negative
        ),
        dtype=("x's dtype", lambda x, block: x.dtype),
        unavailable=("attention_core.low_precision.fake_quantize", "attention_core.low_precision.quantize_fp8"),
        unavailable_globals=("fake_quantize_blocks_solution",),  # the page's folded worked solution
        task="to write the block quantisation yourself",
        mistakes=(
            Mistake("the scale maps amax onto e4m3's largest value: scale = amax / 448, not amax.",
                    lambda x, b: fake_quantize_blocks_mistake(x, b, fmax=1.0)),
            Mistake("a block of zeros has amax 0: give it the scale 1, or 0 / 0 makes NaN.",
                    lambda x, b: fake_quantize_blocks_mistake(x, b, guard=False)),
            Mistake("one scale per block of rows, not one for the whole tensor.",
                    lambda x, b: fake_quantize_blocks_mistake(x, b, per_tensor=True)),
            Mistake("one scale per block of `block` rows, not one per row: take amax over the whole block.",
                    lambda x, b: fake_quantize_blocks_mistake(x, 1)),
            Mistake("round to torch.float8_e4m3fn (3 mantissa bits), not float8_e5m2.",
                    lambda x, b: fake_quantize_blocks_mistake(x, b, dtype=torch.float8_e5m2)),
            Mistake("blocks are consecutive rows (dim -2, the sequence), not columns.",
                    lambda x, b: fake_quantize_blocks_mistake(x, b, along=-1)),
            Mistake("take the block's largest |x| (amax of x.abs()), not its largest x: a negative outlier sets "
                    "the scale too.", lambda x, b: fake_quantize_blocks_mistake(x, b, signed_amax=True)),
            Mistake("cast the scaled values to float8_e4m3fn and back: without the cast nothing is rounded.",
                    lambda x, b: fake_quantize_blocks_mistake(x, b, skip_cast=True)),
        ),
    )
