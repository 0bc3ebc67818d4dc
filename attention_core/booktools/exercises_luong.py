"""Chapter 4's code exercise (``ch04.local_p_weights``): Luong's local-p window weights (a window of D around
p_t, a softmax inside it, a Gaussian of sigma D/2).
"""

from __future__ import annotations

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake
from attention_core.booktools.exercises_common import (
    ATTENTION_MODULES,
    NEG_INF,
    T,
    draw_values,
    strategies,
)

__all__ = ["build"]


def _local_reference(scores, center, D):
    from attention_core.models.rnn_attention import local_attention_weights

    return local_attention_weights(scores, center, D, gaussian=True)


def _local(scores, center, D, *, sigma=None, strict=False, window=True, renorm=False, rounded=False):
    p = center.round() if rounded else center
    dist = torch.arange(scores.shape[-1], dtype=scores.dtype) - p[..., None]  # (B, L, S)
    outside = (dist.abs() >= D) if strict else (dist.abs() > D)
    w = torch.softmax(scores.masked_fill(outside, NEG_INF) if window else scores, dim=-1)
    sigma = D / 2 if sigma is None else sigma
    w = w * torch.exp(-dist**2 / (2 * sigma**2))
    return w / w.sum(-1, keepdim=True) if renorm else w


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def window_inputs(draw):
        B, L, S, D = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 7)), draw(st.integers(1, 4))
        half = st.integers(0, 2 * (S - 1)).map(lambda i: i / 2)  # positions on a half grid: exact window edges
        anywhere = st.floats(0, S - 1, width=32)
        center = T(draw(st.lists(half | anywhere, min_size=B * L, max_size=B * L))).view(B, L)
        return draw_values(draw, (B, L, S), -4, 4), center, D

    return FunctionSpec(
        "local_p_weights", _local_reference, window_inputs(), atol=1e-6, rtol=1e-5, max_examples=50,
        arg_names=("scores", "center", "D"),
        examples=(
            (torch.zeros(1, 1, 5), T([[2.0]]), 2),  # the statement's example: uniform scores, centred window
            (torch.zeros(1, 1, 5), T([[2.0]]), 1),  # keys exactly D away
            (T([[[1.0, 2.0, 3.0, 4.0]]]), T([[1.5]]), 1),  # p between two words
            (T([[[0.5]]]), T([[0.0]]), 1),  # one source word
        ),
        unavailable=("attention_core.models.rnn_attention.local_attention_weights",
                     "attention_core.models.rnn_attention.LuongAttention",
                     "attention_core.models.rnn_attention.gaussian_window",
                     "attention_core.models.rnn_attention.masked_softmax"),
        forbidden_modules=ATTENTION_MODULES,
        task="to write the window, the softmax and the Gaussian yourself",
        mistakes=(
            Mistake("the Gaussian's sigma is D/2, not D.", lambda s, c, D: _local(s, c, D, sigma=D)),
            Mistake("a position exactly D away from p_t is inside the window (<=, not <).",
                    lambda s, c, D: _local(s, c, D, strict=True)),
            Mistake("positions farther than D from p_t get weight 0: mask them before the softmax.",
                    lambda s, c, D: _local(s, c, D, window=False)),
            Mistake("the Gaussian multiplies the softmax weights; the rows are not renormalised afterwards.",
                    lambda s, c, D: _local(s, c, D, renorm=True)),
            Mistake("p_t is a real number: measure distances from p_t itself, not from a rounded position.",
                    lambda s, c, D: _local(s, c, D, rounded=True)),
        ),
    )
