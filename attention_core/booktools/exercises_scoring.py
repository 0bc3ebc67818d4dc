"""Chapter 2's code exercise (``ch02.masked_softmax``): a softmax over the kept keys, zeros where none is kept.

Its inputs reach scores beyond ``exp``'s float32 range, a kept score below -1e9 and fully masked rows; its known
mistakes are the chapter's warnings (NaN rows, -1e9 filled or added for -inf, a guard that leaves a fully masked
row uniform, no max subtraction, zeroing after the softmax, the mask's sense). Mistakes that give the same weights
on every input the checker tries cannot be told apart by their output: each known mistake differs from every other
one on at least one edge case, so that a hint names only the mistake the submission made.
"""

from __future__ import annotations

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake
from attention_core.booktools.exercises_common import (
    ATTENTION_MODULES,
    NEG_INF,
    TORCH_ATTENTION,
    TORCH_MASKED_SOFTMAX,
    T,
    draw_values,
    library_reference,
    rows_mask,
    strategies,
)

__all__ = ["build"]


def _softmax_naive(scores, mask):
    return torch.softmax(scores.masked_fill(~mask, NEG_INF), dim=-1)


def _softmax_1e9(scores, mask):
    return torch.softmax(scores.masked_fill(~mask, -1e9), dim=-1)


def _softmax_add_1e9(scores, mask):  # -1e9 added as a float mask, not filled in
    return torch.softmax(scores + (~mask).to(scores.dtype) * -1e9, dim=-1)


def _softmax_1e9_zeroed(scores, mask):
    return torch.softmax(scores.masked_fill(~mask, -1e9), dim=-1) * mask


def _softmax_uniform_dead(scores, mask):  # -inf and a guard, but the guarded rows' weights left as they come
    dead = ~mask.any(dim=-1, keepdim=True)
    return torch.softmax(scores.masked_fill(~mask, NEG_INF).masked_fill(dead, 0.0), dim=-1)


def _softmax_no_max(scores, mask):
    e = torch.exp(scores) * mask
    s = e.sum(-1, keepdim=True)
    return torch.where(s > 0, e / s, torch.zeros_like(e))


def _softmax_not_renormalised(scores, mask):
    return torch.softmax(scores, dim=-1) * mask


def _softmax_inverted(scores, mask):
    return _softmax_guarded(scores, ~mask)


def _softmax_guarded(scores, mask):
    dead = ~mask.any(dim=-1, keepdim=True)
    w = torch.softmax(scores.masked_fill(~mask, NEG_INF).masked_fill(dead, 0.0), dim=-1)
    return w.masked_fill(dead, 0.0)


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def scores_and_masks(draw):
        L, S = draw(st.integers(1, 4)), draw(st.integers(1, 5))
        scale = draw(st.sampled_from([1.0, 1.0, 1.0, 40.0]))  # x 40: beyond exp's float32 range (~88)
        return draw_values(draw, (L, S), -5, 5) * scale, rows_mask(draw, L, S)

    return FunctionSpec(
        "masked_softmax", library_reference("attention_core.masked_softmax"), scores_and_masks(), atol=1e-6, rtol=1e-5,
        max_examples=50, arg_names=("scores", "mask"),
        examples=(
            (T([[0.0, 0.0, 5.0], [1.0, 2.0, 3.0]]), T([[True, True, False], [False, False, False]])),  # statement
            (T([[100.0, 99.0, -100.0]]), T([[True, True, True]])),  # exp(100) overflows float32
            (T([[-200.0, -199.0, 200.0]]), T([[True, True, False]])),  # the largest score is a masked one
            (T([[2.0]]), T([[False]])),  # length 1, masked
            (T([[2.0]]), T([[True]])),  # length 1, kept
            (T([[-3e9, 0.0, 1.0]]), T([[True, False, False]])),  # a kept score below -1e9: a finite wall leaks
            (T([[0.0, 300.0, 0.0]]), T([[False, False, False]])),  # all masked, far apart: an added -1e9 keeps them so
        ),
        unavailable=("attention_core.masked_softmax", "attention_core.functional.masked_softmax",
                     "attention_core.backends.reference.softmax_with_mask", *TORCH_ATTENTION,
                     *TORCH_MASKED_SOFTMAX),
        unavailable_globals=("guarded_softmax",),
        forbidden_modules=ATTENTION_MODULES,
        task="to write the masked softmax yourself (torch's masked softmax, or an attention function such as "
             "scaled_dot_product_attention, computes it whole)",
        mistakes=(
            Mistake("a row whose keys are all masked: softmax of all -inf is NaN, and that row must be zeros.",
                    _softmax_naive),
            Mistake("a finite fill (-1e9, -1e4) is not -inf: a fully masked row then gets equal weights instead "
                    "of zeros, and a kept score below the fill loses its weight to the masked keys.", _softmax_1e9),
            Mistake("-1e9 is a wall of finite height: a kept score below -1e9 loses its weight to the masked keys, "
                    "and zeroing them afterwards leaves a row that sums to 0 (fill with -inf instead, and guard the "
                    "fully masked rows).", _softmax_1e9_zeroed),
            Mistake("adding -1e9 is not masking: in a fully masked row -1e9 swallows the scores up to float32's "
                    "rounding (64 near 1e9), so the row gets weights set by that rounding (often equal ones) instead "
                    "of zeros.",
                    _softmax_add_1e9),
            Mistake("a fully masked row gets equal weights (1/S each): giving it harmless scores keeps the softmax "
                    "finite, but that row's weights must then be set to zero.", _softmax_uniform_dead),
            Mistake("exp of a large score overflows to inf: subtract each row's maximum first (as torch.softmax "
                    "does).", _softmax_no_max),
            Mistake("zeroing masked weights after the softmax leaves rows that no longer sum to 1.",
                    _softmax_not_renormalised),
            Mistake("mask is True where a (query, key) pair takes part, not where it is masked.", _softmax_inverted),
        ),
    )
