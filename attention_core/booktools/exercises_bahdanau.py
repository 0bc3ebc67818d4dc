"""Chapter 3's code exercise (``ch03.bahdanau_weights``): additive scores, the padding mask and the softmax
of one decoder step.
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


def _bahdanau_reference(s_prev, h, mask, W_a, U_a, v_a):
    from attention_core.models.rnn_attention import AdditiveAttention

    layer = AdditiveAttention(W_a.shape[1], U_a.shape[1], W_a.shape[0])
    with torch.no_grad():
        layer.score.W_q.weight.copy_(W_a)
        layer.score.W_k.weight.copy_(U_a)
        layer.score.v.weight.copy_(v_a[None])
        return layer(s_prev, h, attn_mask=mask)[1]


def _bahdanau_scores(s_prev, h, W_a, U_a, v_a, tanh=True):
    hidden = (s_prev @ W_a.T)[:, None, :] + h @ U_a.T  # (B, 1, d_a) + (B, S, d_a)
    return (torch.tanh(hidden) if tanh else hidden) @ v_a  # (B, S)


def _bahdanau_unmasked(s_prev, h, mask, W_a, U_a, v_a):
    return torch.softmax(_bahdanau_scores(s_prev, h, W_a, U_a, v_a), dim=-1)


def _bahdanau_no_tanh(s_prev, h, mask, W_a, U_a, v_a):
    return torch.softmax(_bahdanau_scores(s_prev, h, W_a, U_a, v_a, tanh=False).masked_fill(~mask, NEG_INF), -1)


def _bahdanau_mask_after(s_prev, h, mask, W_a, U_a, v_a):
    return torch.softmax(_bahdanau_scores(s_prev, h, W_a, U_a, v_a), dim=-1) * mask


def _bahdanau_untransposed(s_prev, h, mask, W_a, U_a, v_a):
    # ``s_prev @ W_a`` runs only when the state and the score's hidden layer have the same width
    hidden = torch.tanh((s_prev @ W_a)[:, None, :] + h @ U_a.T)
    return torch.softmax((hidden @ v_a).masked_fill(~mask, NEG_INF), dim=-1)


def _bahdanau_batch_axis(s_prev, h, mask, W_a, U_a, v_a):
    return torch.softmax(_bahdanau_scores(s_prev, h, W_a, U_a, v_a).masked_fill(~mask, NEG_INF), dim=0)


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def step_inputs(draw):
        B, S, Dq, Dk, A = (draw(st.integers(1, 4)) for _ in range(5))
        lens = T(draw(st.lists(st.integers(1, S), min_size=B, max_size=B)))  # real words per sentence
        return (draw_values(draw, (B, Dq), -3, 3), draw_values(draw, (B, S, Dk), -3, 3),
                torch.arange(S) < lens[:, None],  # (B, S): True on the real words
                draw_values(draw, (A, Dq), -3, 3), draw_values(draw, (A, Dk), -3, 3), draw_values(draw, (A,), -3, 3))

    one = torch.ones
    return FunctionSpec(
        "bahdanau_weights", _bahdanau_reference, step_inputs(), atol=1e-6, rtol=1e-5, max_examples=50,
        arg_names=("s_prev", "h", "mask", "W_a", "U_a", "v_a"),
        examples=(
            (T([[1.0]]), T([[[1.0], [-1.0], [5.0]]]), T([[True, True, False]]), T([[1.0]]), T([[1.0]]),
             T([0.0])),  # the statement's example: equal scores, padding at the end
            (one(2, 1), one(2, 1, 1), T([[True], [True]]), one(1, 1), one(1, 1), one(1)),  # one word
            (T([[0.5, -1.0]]), T([[[1.0], [2.0]]]), T([[True, False]]), T([[1.0, 2.0], [0.0, 1.0]]),
             T([[1.0], [-1.0]]), T([1.0, 2.0])),
            (T([[0.5, -1.0]]), T([[[1.0], [2.0]]]), T([[True, True]]), T([[1.0, 2.0], [0.0, 1.0]]),
             T([[1.0], [-1.0]]), T([1.0, 2.0])),  # a square W_a that is not symmetric: W_a s differs from s W_a
        ),
        unavailable=("attention_core.models.rnn_attention.AdditiveAttention", "attention_core.scoring.AdditiveScore",
                     "attention_core.models.rnn_attention.AdditiveScore"),
        forbidden_modules=(*ATTENTION_MODULES, "attention_core.scoring"),
        task="to write the additive score, the mask and the softmax yourself",
        mistakes=(
            Mistake("padded positions must get weight 0: mask the scores before the softmax.", _bahdanau_unmasked),
            Mistake("the score is v_a . tanh(W_a s + U_a h): the tanh is missing.", _bahdanau_no_tanh),
            Mistake("masking after the softmax leaves weights that no longer sum to 1 over the real words.",
                    _bahdanau_mask_after),
            Mistake("the softmax runs over the source positions (the last axis), not over the batch.",
                    _bahdanau_batch_axis),
            Mistake("W_a is laid out like an nn.Linear weight, (d_a, Dq): W_a s is s_prev @ W_a.T, not s_prev @ W_a.",
                    _bahdanau_untransposed),
        ),
    )
