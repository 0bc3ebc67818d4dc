"""Chapter 13's code exercise (``ch13.rollout``): attention rollout through a stack of layers' maps.
"""

from __future__ import annotations

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake
from attention_core.booktools.exercises_common import (
    T,
    draw_values,
    strategies,
)

__all__ = ["build"]


def _rollout_reference(maps):
    from attention_core.explain.attribution import attention_rollout

    return attention_rollout([m[None] for m in maps])[0].to(maps.dtype)


def _rollout(maps, *, residual=True, half=True, reverse=False, last_only=False):
    eye = torch.eye(maps.shape[-1], dtype=maps.dtype)
    layers = [((m + eye) / 2 if half else m + eye) if residual else m for m in maps]
    if last_only:
        return layers[-1]
    out = layers[0]
    for a in layers[1:]:
        out = out @ a if reverse else a @ out
    return out


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def stacks(draw):
        n, L = draw(st.integers(1, 4)), draw(st.integers(1, 5))
        scores = draw_values(draw, (n, L, L), -4, 4, torch.float64)
        return (torch.softmax(scores, -1),)

    f64 = torch.float64
    return FunctionSpec(
        "rollout", _rollout_reference, stacks(), atol=1e-6, rtol=1e-6, max_examples=50, arg_names=("maps",),
        examples=(
            (T([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]], dtype=f64),),  # the chapter's two-layer toy
            (T([[[0.5, 0.5], [0.2, 0.8]]], dtype=f64),),  # one layer
            (T([[[1.0]], [[1.0]], [[1.0]]], dtype=f64),),  # one token
            (T([[[0.9, 0.1, 0.0], [0.0, 0.3, 0.7], [0.5, 0.0, 0.5]], [[0.2, 0.2, 0.6], [1.0, 0.0, 0.0],
                                                                        [0.0, 0.5, 0.5]]], dtype=f64),),
        ),
        unavailable=("attention_core.explain.attention_rollout", "attention_core.explain.attribution.attention_rollout",
                     "attention_core.explain.residual_attention",
                     "attention_core.explain.attribution.residual_attention"),
        forbidden_modules=("attention_core.explain",),
        task="to roll the layers out yourself",
        mistakes=(
            Mistake("each layer's map is (A + I) / 2: the residual connection keeps half of every token.",
                    lambda maps: _rollout(maps, residual=False)),
            Mistake("A + I must be halved so that each row still sums to 1.",
                    lambda maps: _rollout(maps, half=False)),
            Mistake("a later layer mixes the earlier mixtures: multiply it on the left, A'_2 @ A'_1.",
                    lambda maps: _rollout(maps, reverse=True)),
            Mistake("every layer takes part, not only the last.",
                    lambda maps: _rollout(maps, last_only=True)),
        ),
    )
