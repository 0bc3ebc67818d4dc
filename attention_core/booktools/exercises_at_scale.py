"""Chapter 9's code exercise (``ch09.merge_partials``): merging two blocks' partial softmax results
(o, m, l), as FlashAttention's online softmax does; ``partial_softmax`` makes the blocks.
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

__all__ = ["build", "partial_softmax"]


def partial_softmax(scores: torch.Tensor, values: torch.Tensor) -> tuple:
    """One block of keys: scores (n,), values (n, Ev) -> o (Ev,), m (), l () (chapter 9's helper)."""
    m = scores.max()
    p = torch.exp(scores - m)  # (n,)
    return p @ values, m, p.sum()


def _whole_row(s1, v1, s2, v2):
    s, v = torch.cat([s1, s2]), torch.cat([v1, v2])  # (n1 + n2,), (n1 + n2, Ev)
    return torch.softmax(s, 0) @ v, s.max(), torch.exp(s - s.max()).sum()


def _merge_collect(out):
    o, m, total = out
    return o / total, m, total


def _merge(o1, m1, l1, o2, m2, l2, *, rescale=True, sign=1, l_too=True, pick=torch.maximum, unstable=False,
           normalise=False):
    m = pick(m1, m2)
    if unstable:
        a1, a2 = torch.exp(m1), torch.exp(m2)
        o, total = (a1 * o1 + a2 * o2) * torch.exp(-m), (a1 * l1 + a2 * l2) * torch.exp(-m)
        return o, m, total
    a1, a2 = (torch.exp(sign * (m1 - m)), torch.exp(sign * (m2 - m))) if rescale else (1.0, 1.0)
    o, total = a1 * o1 + a2 * o2, (a1 * l1 + a2 * l2) if l_too else l1 + l2
    return (o / total if normalise else o), m, total


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def two_blocks(draw):
        n1, n2, Ev = (draw(st.integers(1, 5)) for _ in range(3))
        scale = draw(st.sampled_from([1.0, 1.0, 1.0, 100.0]))  # x 100: exp(800) overflows float64
        f64 = torch.float64
        return (draw_values(draw, (n1,), -8, 8, f64) * scale, draw_values(draw, (n1, Ev), -8, 8, f64),
                draw_values(draw, (n2,), -8, 8, f64) * scale, draw_values(draw, (n2, Ev), -8, 8, f64))

    f64 = torch.float64
    return FunctionSpec(
        "merge_partials", _whole_row, two_blocks(), atol=1e-6, rtol=1e-5, max_examples=50,
        arg_names=("o1", "m1", "l1", "o2", "m2", "l2"),
        examples=(
            (T([0.0], dtype=f64), T([[4.0]], dtype=f64), T([2.0], dtype=f64), T([[2.0]], dtype=f64)),  # statement
            (T([800.0, 0.0], dtype=f64), T([[1.0], [2.0]], dtype=f64), T([-800.0], dtype=f64),
             T([[3.0]], dtype=f64)),  # exp(800) overflows
            (T([1.0], dtype=f64), T([[1.0, 2.0]], dtype=f64), T([3.0, 0.5], dtype=f64),
             T([[0.0, 1.0], [4.0, -1.0]], dtype=f64)),  # the second block holds the maximum
        ),
        prepare=lambda s1, v1, s2, v2: (*partial_softmax(s1, v1), *partial_softmax(s2, v2)),
        collect=_merge_collect, output_names=("o / l", "m", "l"),
        forbidden_modules=ATTENTION_MODULES,
        task="to write the merge of two partial results yourself",
        mistakes=(
            Mistake("the two sums are measured from different maxima: rescale each to the common maximum before "
                    "adding.", lambda *a: _merge(*a, rescale=False)),
            Mistake("rescale by exp(m1 - m), which is at most 1, not by exp(m - m1).", lambda *a: _merge(*a, sign=-1)),
            Mistake("rescale l1 and l2 as well as o1 and o2.", lambda *a: _merge(*a, l_too=False)),
            Mistake("the merged maximum m is the larger of m1 and m2.", lambda *a: _merge(*a, pick=torch.minimum)),
            Mistake("exp(m1) overflows for large scores: rescale with exp(m1 - m), which is at most 1.",
                    lambda *a: _merge(*a, unstable=True)),
            Mistake("return the unnormalised o (a sum, like l); the division by l comes at the end.",
                    lambda *a: _merge(*a, normalise=True)),
        ),
    )
