"""Chapter 17's code exercise (``ch17.sink_attention``): attention with a learned sink logit per head.

The reader writes ``sink_attention(q, k, v, sinks, mask)``: q (H, L, E), k (H, S, E), v (H, S, Ev), sinks (H,)
and a bool mask (L, S) (True = attend), returning (H, L, Ev) in q's dtype, where each row's softmax denominator
also holds ``exp(sinks[h])`` (gpt-oss's learned sinks): ``out_i = sum_j exp(z_ij) v_j / (exp(s_h) + sum_j
exp(z_ij))`` with ``z_ij = q_i . k_j / sqrt(E)`` on the kept pairs. The reference is
:func:`attention_core.models.attention_variants.sink_attention`; the mistakes are the ones the chapter warns about
(no sink, the sink's logit scaled or shifted like a score, the sink added as a logit instead of ``exp``, exp
without the row's maximum, the scores shifted by their maximum but ``exp(sinks[h])`` left unshifted, a masked row
that should give zeros).
"""

from __future__ import annotations

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake
from attention_core.booktools.exercises_common import (
    ATTENTION_MODULES,
    NEG_INF,
    TORCH_ATTENTION,
    T,
    draw_values,
    rows_mask,
    strategies,
)

__all__ = ["build", "sink_mistake"]


def _reference(q, k, v, sinks, mask):
    from attention_core.models.attention_variants import sink_attention

    out, _ = sink_attention(q[None], k[None], v[None], sinks, mask)  # (1, H, L, Ev)
    return out[0]


def sink_mistake(q, k, v, sinks, mask, *, sink=True, scale_sink=False, linear_sink=False, stable=True,
                 sink_value=None, scale=None, shift_sink=False, unshifted_sink=False):
    """Attention with a sink column, one switch per known mistake (the defaults give the right answer)."""
    E = q.shape[-1]
    z = q @ k.transpose(-2, -1) * (E ** -0.5 if scale is None else scale)  # (H, L, S)
    z = z.masked_fill(~mask, NEG_INF)
    s = sinks.to(z.dtype).view(-1, 1, 1).expand(z.shape[0], z.shape[1], 1)  # (H,) -> (H, L, 1)
    if scale_sink:
        s = s * E ** -0.5  # the sink scaled like a score
    if not sink:
        w = torch.softmax(z, dim=-1).nan_to_num(0.0)
        return w @ v
    m = torch.maximum(z.amax(-1, keepdim=True), s) if stable else torch.zeros_like(s)  # (H, L, 1)
    if unshifted_sink:  # the scores' own maximum (0 on a fully masked row), and exp(s) not shifted by it
        m = z.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(z - m)
    if unshifted_sink:
        den = e.sum(-1, keepdim=True) + torch.exp(s)
    elif linear_sink:
        den = e.sum(-1, keepdim=True) + s  # s, not exp(s)
    else:
        den = e.sum(-1, keepdim=True) + torch.exp(s - m)
    out = (e @ v) / den
    if sink_value is not None:  # the sink's value taken as the mean value instead of zero
        out = out + torch.exp(s - m) / den * sink_value(v)
    return out


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def problems(draw):
        H, L, S = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 5))
        E, Ev = draw(st.integers(1, 4)), draw(st.integers(1, 3))
        dtype = draw(st.sampled_from([torch.float32, torch.float64]))
        big = draw(st.sampled_from([3.0, 3.0, 40.0]))  # 40: scores of hundreds, past exp's range
        q = draw_values(draw, (H, L, E), -big, big, dtype)
        k = draw_values(draw, (H, S, E), -big, big, dtype)
        v = draw_values(draw, (H, S, Ev), -3, 3, dtype)
        sinks = draw_values(draw, (H,), -4, 4, dtype)
        return q, k, v, sinks, rows_mask(draw, L, S)

    ones = torch.ones
    return FunctionSpec(
        "sink_attention", _reference, problems(), atol=1e-5, rtol=1e-5, max_examples=60,
        arg_names=("q", "k", "v", "sinks", "mask"),
        examples=(
            # the statement's: two equal scores and a sink of logit 0, so each of the three columns gets 1/3
            (T([[[0.0], [0.0]]]), T([[[0.0], [0.0]]]), T([[[3.0], [6.0]]]), T([0.0]),
             T([[True, False], [True, True]])),
            (T([[[1.0, 2.0]], [[-1.0, 0.5]]]), T([[[3.0, -1.0]], [[2.0, 2.0]]]), T([[[5.0]], [[-2.0]]]),
             T([1.5, -2.0]), ones(1, 1, dtype=torch.bool)),  # two heads, each its own sink
            (T([[[30.0, 30.0], [-30.0, 30.0]]]), T([[[30.0, 30.0], [20.0, -30.0], [0.0, 1.0]]]),
             T([[[1.0], [2.0], [3.0]]]), T([2.0]), ones(2, 3, dtype=torch.bool)),  # scores of 1000: exp overflows
            (T([[[1.0], [2.0]]], dtype=torch.float64), T([[[1.0], [-1.0]]], dtype=torch.float64),
             T([[[4.0], [8.0]]], dtype=torch.float64), T([0.5], dtype=torch.float64),
             T([[False, False], [True, False]])),  # a fully masked row: the sink takes all, the output is 0
            (T([[[0.0, 0.0]]]), T([[[0.0, 0.0], [0.0, 0.0]]]), T([[[2.0], [4.0]]]), T([3.0]),
             ones(1, 2, dtype=torch.bool)),  # E = 2 and a large sink: scaling or shifting it shows
        ),
        dtype=("q's dtype", lambda q, k, v, sinks, mask: q.dtype),
        unavailable=("attention_core.models.attention_variants.sink_attention",
                     "attention_core.scaled_dot_product_attention", "attention_core.attention_weights",
                     "attention_core.functional.scaled_dot_product_attention",
                     "attention_core.functional.attention_weights", "attention_core.functional.attention",
                     *TORCH_ATTENTION),
        forbidden_modules=ATTENTION_MODULES,
        task="to write attention with a sink logit yourself (scores, mask, the sink in the denominator)",
        mistakes=(
            Mistake("the sink joins the denominator: without exp(sinks[h]) each row's weights sum to 1.",
                    lambda q, k, v, s, m: sink_mistake(q, k, v, s, m, sink=False)),
            Mistake("the sink is a logit: add exp(sinks[h]) to the denominator, not sinks[h] itself.",
                    lambda q, k, v, s, m: sink_mistake(q, k, v, s, m, linear_sink=True)),
            Mistake("the sink logit is not a score: do not divide it by sqrt(E).",
                    lambda q, k, v, s, m: sink_mistake(q, k, v, s, m, scale_sink=True)),
            Mistake("exp of a large score overflows to inf: subtract each row's maximum (over the scores and the "
                    "sink) first.", lambda q, k, v, s, m: sink_mistake(q, k, v, s, m, stable=False)),
            Mistake("a shift must apply to every term: exp(z - m) for the scores, then exp(sinks[h] - m) for the sink "
                    "too, not exp(sinks[h]).",
                    lambda q, k, v, s, m: sink_mistake(q, k, v, s, m, unshifted_sink=True)),
            Mistake("the sink's value is zero: it takes weight from the keys and adds nothing to the output.",
                    lambda q, k, v, s, m: sink_mistake(q, k, v, s, m,
                                                       sink_value=lambda v_: v_.mean(-2, keepdim=True))),
            Mistake("scale the scores by 1/sqrt(E) before the softmax.",
                    lambda q, k, v, s, m: sink_mistake(q, k, v, s, m, scale=1.0)),
        ),
    )
