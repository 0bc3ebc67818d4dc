"""Chapter 6's code exercise (``ch06.causal_multi_head``): projections, heads, causal attention and the
output projection, written by hand.
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

__all__ = ["build"]


def _mha_reference(x, w_q, w_k, w_v, w_o, num_heads):
    import attention_core as ac

    mha = ac.MultiHeadAttention(x.shape[-1], num_heads, bias=False, dtype=x.dtype)
    with torch.no_grad():
        for proj, w in [(mha.q_proj, w_q), (mha.k_proj, w_k), (mha.v_proj, w_v), (mha.out_proj, w_o)]:
            proj.weight.copy_(w.T)  # nn.Linear computes x @ weight.T
        return mha(x, attn_mask=ac.causal_mask(x.shape[1]))[0]


def _mha(x, w_q, w_k, w_v, w_o, H, *, mask=True, scale_d=False, split="ok", merge="ok", out=True, right=True,
         scale=None, zero_after=False):
    """The worked answer, or one known mistake: ``scale`` replaces 1/sqrt(E) (1.0: no scale); ``zero_after``
    applies no mask before the softmax and zeroes the later keys' weights after it (rows no longer sum to 1)."""
    B, L, D = x.shape
    E = D // H
    if not right:
        w_q, w_k, w_v, w_o = w_q.T, w_k.T, w_v.T, w_o.T

    def heads(t):
        if split == "view":  # (B, L, D) read as (B, H, L, E): mixes positions and heads
            return t.reshape(B, H, L, E)
        return t.view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)

    q, k, v = heads(x @ w_q), heads(x @ w_k), heads(x @ w_v)
    s = q @ k.transpose(-2, -1) * (1 / math.sqrt(D if scale_d else E) if scale is None else scale)  # (B, H, L, L)
    later = torch.ones(L, L, dtype=torch.bool).triu(1)  # key j after query i
    if mask and not zero_after:
        s = s.masked_fill(later, NEG_INF)
    w = torch.softmax(s, dim=-1)
    if zero_after:
        w = w.masked_fill(later, 0.0)
    o = w @ v  # (B, H, L, E)
    o = o.reshape(B, L, D) if merge == "reshape" else o.transpose(1, 2).reshape(B, L, D)  # -> (B, L, D)
    return o @ w_o if out else o


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def mha_inputs(draw):
        B, L, H, E = (draw(st.integers(1, n)) for n in (2, 5, 3, 3))
        D = H * E
        ts = [draw_values(draw, s, -1, 1, torch.float64) for s in [(B, L, D)] + [(D, D)] * 4]
        return (*ts, H)

    def ex(B, L, H, E):
        D = H * E
        g = torch.Generator().manual_seed(B * 1000 + L * 100 + H * 10 + E)
        return (*(torch.rand(s, generator=g, dtype=torch.float64) * 2 - 1 for s in [(B, L, D)] + [(D, D)] * 4), H)

    eye = torch.eye(2, dtype=torch.float64)
    return FunctionSpec(
        "causal_multi_head", _mha_reference, mha_inputs(), atol=1e-4, rtol=1e-4, max_examples=40,
        arg_names=("x", "w_q", "w_k", "w_v", "w_o", "num_heads"),
        examples=(
            (T([[[1.0, 2.0], [0.0, 0.0]]], dtype=torch.float64), eye, eye, eye, eye, 2),  # the statement's
            ex(1, 1, 1, 1), ex(2, 4, 2, 3), ex(1, 5, 3, 2), ex(2, 3, 3, 1),  # one token; heads of size 1
        ),
        dtype=("x's dtype", lambda x, *_: x.dtype),
        unavailable=("attention_core.MultiHeadAttention", "attention_core.multihead.MultiHeadAttention",
                     "torch.nn.MultiheadAttention", *TORCH_ATTENTION),
        forbidden_modules=ATTENTION_MODULES,
        task="to write the projections, the heads and the causal attention yourself",
        mistakes=(
            Mistake("query i of every head sees keys j <= i only: apply the causal mask.",
                    lambda *a: _mha(*a, mask=False)),
            Mistake("scale by 1/sqrt(E), the size of one head, not by 1/sqrt(D).", lambda *a: _mha(*a, scale_d=True)),
            Mistake("split the last axis into heads, (B, L, H, E), then transpose to (B, H, L, E).",
                    lambda *a: _mha(*a, split="view")),
            Mistake("transpose (B, H, L, E) back to (B, L, H, E) before reshaping to (B, L, D).",
                    lambda *a: _mha(*a, merge="reshape")),
            Mistake("after concatenating the heads, apply the output projection w_o.", lambda *a: _mha(*a, out=False)),
            Mistake("the weights act on the right: x @ w_q, not x @ w_q.T.", lambda *a: _mha(*a, right=False)),
            Mistake("scale the scores by 1/sqrt(E), E = D / num_heads the size of one head: without it, they grow "
                    "with E.", lambda *a: _mha(*a, scale=1.0)),
            Mistake("scale by 1/sqrt(E), the size of one head, not by 1/sqrt(num_heads).",
                    lambda *a: _mha(*a, scale=1 / math.sqrt(a[5]))),
            Mistake("mask before the softmax (later keys at -inf): weights zeroed after it no longer sum to 1.",
                    lambda *a: _mha(*a, zero_after=True)),
        ),
    )
