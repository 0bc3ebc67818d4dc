"""Chapter 8's code exercise (``ch08.causal_attention``): chapter 5's causal attention on (B, H, L, E).

The reference and the known mistakes are chapter 5's (:mod:`~attention_core.booktools.exercises_self_attention`).
"""

from __future__ import annotations

import torch

from attention_core.booktools.code_checks import FunctionSpec
from attention_core.booktools.exercises_common import (
    ATTENTION_MODULES,
    TORCH_ATEN_SDPA,
    T,
    draw_values,
    strategies,
)
from attention_core.booktools.exercises_self_attention import (
    CAUSAL_MISTAKES,
    CAUSAL_UNAVAILABLE,
    large_scores,
    sdpa_causal,
)

__all__ = ["TORCH_ATEN_SDPA", "build"]

def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def qkv(draw):
        B, H, L, E = (draw(st.integers(1, 3)) for _ in range(4))
        return tuple(draw_values(draw, (B, H, L, E), -3, 3) for _ in range(3))

    return FunctionSpec(
        "causal_attention", sdpa_causal, qkv(), atol=1e-5, rtol=1e-5, max_examples=50,
        arg_names=("q", "k", "v"),
        examples=(
            (torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1), T([2.0, 4.0]).view(1, 1, 2, 1)),  # the statement's
            (T([1.0, 2.0]).view(1, 1, 1, 2), T([3.0, -1.0]).view(1, 1, 1, 2), T([5.0, 6.0]).view(1, 1, 1, 2)),
            (large_scores(2, 1, 3, 4), large_scores(2, 1, 3, 4), large_scores(2, 1, 3, 4) / 10),  # large scores
        ),
        unavailable=CAUSAL_UNAVAILABLE, forbidden_modules=ATTENTION_MODULES,
        task="to write the scores, the causal mask and the softmax yourself",
        mistakes=CAUSAL_MISTAKES,
    )
