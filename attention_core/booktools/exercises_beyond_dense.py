"""Chapter 12's code exercise (``ch12.causal_linear_attention``): causal linear attention with the
feature map elu(x) + 1.
"""

from __future__ import annotations

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake
from attention_core.booktools.exercises_common import (
    ATTENTION_MODULES,
    T,
    draw_values,
    strategies,
)

__all__ = ["build"]


def _linear_reference(query, key, value):
    from attention_core.linear_attention import linear_attention

    return linear_attention(query, key, value, is_causal=True, eps=0.0)


def _linear(q, k, v, *, phi=None, causal_offset=0, normalize=True, causal=True):
    phi = phi or (lambda x: torch.nn.functional.elu(x) + 1)
    A = phi(q) @ phi(k).transpose(-2, -1)  # (..., L, L)
    if causal:
        A = A * torch.ones(A.shape[-2:], dtype=torch.bool).tril(causal_offset)
    return (A @ v) / A.sum(-1, keepdim=True) if normalize else A @ v


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def qkv(draw):
        batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
        L, E, Ev = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
        dtype = draw(st.sampled_from([torch.float32, torch.float64]))
        return tuple(draw_values(draw, (*batch, L, n), -4, 4, dtype) for n in (E, E, Ev))

    return FunctionSpec(
        "causal_linear_attention", _linear_reference, qkv(), atol=1e-5, rtol=1e-5, max_examples=50,
        arg_names=("query", "key", "value"),
        examples=(
            (T([[0.0], [0.0]]), T([[0.0], [0.0]]), T([[2.0], [4.0]])),  # the statement's example
            (T([[1.0, -2.0]]), T([[3.0, 0.5]]), T([[5.0, 6.0]])),  # one token
            (T([[-3.0], [2.0], [-1.0]]), T([[1.0], [-3.0], [2.0]]), T([[1.0], [2.0], [3.0]])),  # elu < 0 matters
            (torch.linspace(-4, 4, 24).view(2, 3, 4), torch.linspace(4, -4, 24).view(2, 3, 4),
             torch.arange(12.0).view(2, 3, 2)),  # a batch, large values
        ),
        unavailable=("attention_core.linear_attention.linear_attention",
                     "attention_core.linear_attention.linear_attention_recurrent",
                     "attention_core.linear_attention.linear_attention_chunked"),
        forbidden_modules=("attention_core.linear_attention", "attention_core.shakespeare", *ATTENTION_MODULES),
        task="to write causal linear attention yourself",
        mistakes=(
            Mistake("the feature map is elu(x) + 1: elu alone is negative for x < 0, and the normalizer can vanish.",
                    lambda q, k, v: _linear(q, k, v, phi=torch.nn.functional.elu)),
            Mistake("query i reads keys 0..i, itself included: the mask keeps the diagonal.",
                    lambda q, k, v: _linear(q, k, v, causal_offset=-1)),
            Mistake("causal: query i must not read the keys after it.",
                    lambda q, k, v: _linear(q, k, v, causal=False)),
            Mistake("divide by the normalizer phi(q_i) . sum_j phi(k_j), so the weights of a row sum to 1.",
                    lambda q, k, v: _linear(q, k, v, normalize=False)),
        ),
    )
