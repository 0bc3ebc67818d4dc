"""Chapter 5's code exercise (``ch05.causal_attention``): causal scaled dot-product attention on (L, E).

Its reference, known mistakes and large-score inputs are shared with chapter 8's batched version
(:mod:`~attention_core.booktools.exercises_transformer`).
"""

from __future__ import annotations

import math

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake
from attention_core.booktools.exercises_common import (
    ATTENTION_MODULES,
    NEG_INF,
    TORCH_ATTENTION,
    T,
    draw_values,
    strategies,
)

__all__ = ["CAUSAL_MISTAKES", "CAUSAL_UNAVAILABLE", "build", "large_scores", "sdpa_causal"]


def sdpa_causal(q, k, v):
    import attention_core as ac

    return ac.scaled_dot_product_attention(q, k, v, is_causal=True)


def _causal(q, k, v, *, scale=None, diagonal=0, late=False, upper=False, manual=False, fill=NEG_INF, dim=-1):
    T_, E = q.shape[-2], q.shape[-1]
    s = q @ k.transpose(-2, -1) * (E**-0.5 if scale is None else scale)  # (..., T, T)
    keep = torch.ones(T_, T_, dtype=torch.bool)
    keep = keep.triu() if upper else keep.tril(diagonal)
    if late:
        return (torch.softmax(s, dim=-1) * keep) @ v
    s = s.masked_fill(~keep, fill)
    if manual:  # exp without subtracting the row's maximum
        e = torch.exp(s)
        return (e / e.sum(-1, keepdim=True)) @ v
    return torch.softmax(s, dim=dim) @ v


CAUSAL_MISTAKES = (
    Mistake("mask before the softmax: zeroing future weights afterwards leaves rows that do not sum to 1.",
            lambda q, k, v: _causal(q, k, v, late=True)),
    Mistake("scale the scores by 1/sqrt(E) before the softmax.", lambda q, k, v: _causal(q, k, v, scale=1.0)),
    Mistake("a query sees itself: keep the diagonal (tril, not tril(-1)); otherwise the first row has no key.",
            lambda q, k, v: _causal(q, k, v, diagonal=-1)),
    Mistake("query i sees keys 0..i, the lower triangle, not the upper one.",
            lambda q, k, v: _causal(q, k, v, upper=True)),
    Mistake("exp of a large score overflows to inf: subtract each row's maximum first (torch.softmax does).",
            lambda q, k, v: _causal(q, k, v, manual=True)),
    Mistake("fill the future scores with -inf, not 0: exp(0) = 1, so a score of 0 still gives the future a weight.",
            lambda q, k, v: _causal(q, k, v, fill=0.0)),
    Mistake("take the softmax over the keys (the last dim, dim=-1), so that each query's row sums to 1; "
            "over the queries it mixes the rows instead.",
            lambda q, k, v: _causal(q, k, v, dim=-2)),
    Mistake("mask the future: without the causal mask every query also sees the keys after it.",
            lambda q, k, v: _causal(q, k, v, diagonal=1 << 20)),  # tril of a huge diagonal keeps every key
    Mistake("divide the scores by sqrt(E), not by E.", lambda q, k, v: _causal(q, k, v, scale=1.0 / q.shape[-1])),
)
CAUSAL_UNAVAILABLE = ("attention_core.scaled_dot_product_attention", "attention_core.attention_weights",
                       "attention_core.functional.scaled_dot_product_attention",
                       "attention_core.functional.attention_weights", *TORCH_ATTENTION)


def large_scores(*shape: int) -> torch.Tensor:
    """Integer entries up to 30: scores of 300 to 1150, beyond exp's float32 range, computed exactly."""
    return (torch.arange(math.prod(shape), dtype=torch.float32).view(shape) % 7 - 3) * 10


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def qkv_triples(draw):
        L, E = draw(st.integers(1, 5)), draw(st.integers(1, 4))
        return tuple(draw_values(draw, (L, E), -3, 3) for _ in range(3))  # q, k, v: (L, E) each

    return FunctionSpec(
        "causal_attention", sdpa_causal, qkv_triples(), atol=1e-5, rtol=1e-5, max_examples=50,
        arg_names=("q", "k", "v"),
        examples=(
            (T([[0.0], [0.0]]), T([[0.0], [0.0]]), T([[2.0], [4.0]])),  # the statement's example
            (T([[1.0, 2.0]]), T([[3.0, -1.0]]), T([[5.0, 6.0]])),  # length 1
            (large_scores(3, 4), large_scores(3, 4), large_scores(3, 4) / 10),  # large scores
        ),
        unavailable=CAUSAL_UNAVAILABLE, forbidden_modules=ATTENTION_MODULES,
        task="to write the scores, the causal mask and the softmax yourself",
        mistakes=CAUSAL_MISTAKES,
    )
