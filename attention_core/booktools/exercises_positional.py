"""Chapter 7's code exercise (``ch07.rope``): the rotary embedding of rows at given positions.
"""

from __future__ import annotations

import importlib.util

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake
from attention_core.booktools.exercises_common import (
    T,
    draw_values,
    strategies,
)

__all__ = ["build"]


def _rope_reference(x, positions):
    from attention_core.positional import apply_rotary

    return apply_rotary(x, positions)


def _rope(x, positions, *, interleaved=False, two=True, sign=1.0, shift=0, index=False, times_m=True):
    N, E = x.shape
    i = torch.arange(E // 2, dtype=torch.float64)
    theta = 10000.0 ** (-(2 * i if two else i) / E)  # (E/2,)
    m = (torch.arange(N) if index else positions + shift).to(torch.float64)[:, None]  # (N, 1)
    angle = (m * theta if times_m else theta.expand(N, -1))
    cos, sin = angle.cos().to(x.dtype), (sign * angle.sin()).to(x.dtype)
    if interleaved:
        a, b = x[:, 0::2], x[:, 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(1)
    a, b = x[:, : E // 2], x[:, E // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


#: Hugging Face's rotary helpers (``rotate_half``, ``apply_rotary_pos_emb`` in each model's module) rotate the pairs
#: once the angles are given: the whole package is unavailable while the reader's function runs, where installed.
HF_ROTARY = ("transformers",) if importlib.util.find_spec("transformers") is not None else ()
#: torch's own rotary operator (ONNX's RotaryEmbedding, ``torch.onnx.ops.rotary_embedding``) rotates the pairs too.
TORCH_ROTARY = ("torch.onnx.ops",) if importlib.util.find_spec("torch.onnx.ops") is not None else ()


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def rope_inputs(draw):
        N, E = draw(st.integers(1, 5)), 2 * draw(st.integers(1, 4))
        positions = T(draw(st.lists(st.integers(0, 100), min_size=N, max_size=N)))
        return draw_values(draw, (N, E), -5, 5, torch.float64), positions

    f64 = torch.float64
    return FunctionSpec(
        "rope", _rope_reference, rope_inputs(), atol=1e-4, rtol=1e-4, max_examples=50,
        arg_names=("x", "positions"),
        examples=(
            (T([[1.0, 0.0], [1.0, 0.0]], dtype=f64), T([0, 2])),  # the statement's example
            (T([[3.0, -4.0]], dtype=f64), T([0])),  # position 0: unchanged
            (T([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [-1.0, 0.5, 2.0, 0.0]], dtype=f64), T([7, 0, 3])),
        ),
        dtype=("x's dtype", lambda x, positions: x.dtype),
        unavailable=("attention_core.positional.apply_rotary", "attention_core.positional.RotaryEmbedding"),
        forbidden_modules=("attention_core.positional", "attention_core.models", *HF_ROTARY, *TORCH_ROTARY),
        task="to write the rotation of each pair yourself",
        mistakes=(
            Mistake("pair i is made of features i and i + E/2 here, not of neighbours 2i and 2i + 1.",
                    lambda x, p: _rope(x, p, interleaved=True)),
            Mistake("theta_i = 10000^(-2i/E): the exponent has a factor 2.", lambda x, p: _rope(x, p, two=False)),
            Mistake("(a, b) -> (a cos - b sin, a sin + b cos): the pair turns the other way.",
                    lambda x, p: _rope(x, p, sign=-1.0)),
            Mistake("turn each row by its position from positions, not by its row number.",
                    lambda x, p: _rope(x, p, index=True)),
            Mistake("positions are used as given (0-based): do not add 1.", lambda x, p: _rope(x, p, shift=1)),
            Mistake("the angle is m theta_i: multiply the frequency by the row's position.",
                    lambda x, p: _rope(x, p, times_m=False)),
        ),
    )
