"""Chapter 15's code exercise (``ch15.residual``): speculative decoding's residual distribution
norm(max(0, p - q)).
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


def _residual_reference(p, q):
    from attention_core.serving.speculative import residual_distribution

    return residual_distribution(p, q)


def _residual(p, q, *, normalise=True, reverse=False, guard=True, per_row=True, op="sub"):
    r = (q - p if reverse else p - q).clamp_min(0) if op == "sub" else torch.maximum(p, q)
    if not normalise:
        return r
    mass = r.sum(-1, keepdim=True) if per_row else r.sum()
    out = r / mass
    if guard == "zeros":  # a row with nothing left comes back as zeros instead of p
        return torch.where(mass > 0, out, torch.zeros_like(p))
    return torch.where(mass > 0, out, p) if guard else out


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def pairs(draw):
        B, V = draw(st.integers(1, 3)), draw(st.integers(1, 6))
        dtype = draw(st.sampled_from([torch.float64, torch.float32]))  # the answer must come back in p's dtype
        p = draw_values(draw, (B, V), 0.01, 1.0, torch.float64)
        p = p / p.sum(-1, keepdim=True)
        kind = draw(st.sampled_from(["equal", "random"] + (["near"] if dtype == torch.float32 else [])))
        if kind == "random":
            q = draw_values(draw, (B, V), 0.01, 1.0, torch.float64)
        else:  # the draft agrees on the first row, exactly or nearly (a residual of small mass, not none)
            q = p.clone()
            if kind == "near" and V > 1:
                q[0] = q[0] * (1 + 1e-3 * draw_values(draw, (V,), -1.0, 1.0, torch.float64))
            if B > 1:
                q[1:] = draw_values(draw, (B - 1, V), 0.01, 1.0, torch.float64)
        q = q / q.sum(-1, keepdim=True)
        if kind == "equal":
            q[0] = p[0]  # exactly: renormalising could leave a residual of rounding noise
        return p.to(dtype), q.to(dtype)

    f64 = torch.float64
    return FunctionSpec(
        "residual", _residual_reference, pairs(), atol=1e-6, rtol=1e-5, max_examples=60, arg_names=("p", "q"),
        examples=(
            (T([0.4, 0.4, 0.2], dtype=f64), T([0.2, 0.3, 0.5], dtype=f64)),  # the statement's
            (T([[0.5, 0.5], [0.9, 0.1]], dtype=f64), T([[0.5, 0.5], [0.1, 0.9]], dtype=f64)),  # p == q in a row
            (T([1.0], dtype=f64), T([1.0], dtype=f64)),  # one token
            (T([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]], dtype=f64), T([[0.1, 0.2, 0.7], [0.3, 0.3, 0.4]], dtype=f64)),
            (T([[0.5002, 0.4998], [0.25, 0.75]]), T([[0.5, 0.5], [0.5, 0.5]])),  # float32; a residual of mass 2e-4
        ),
        dtype=("p's dtype", lambda p, q: p.dtype),
        unavailable=("attention_core.serving.speculative.residual_distribution",),
        forbidden_modules=("attention_core.serving",),
        task="to write the residual distribution yourself",
        mistakes=(
            Mistake("a distribution: divide max(0, p - q) by its sum so that it adds up to 1.",
                    lambda p, q: _residual(p, q, normalise=False)),
            Mistake("the residual is where the target wants more than the draft gave: max(0, p - q), not q - p.",
                    lambda p, q: _residual(p, q, reverse=True)),
            Mistake("where p == q the residual sums to 0: return p there, not 0 / 0.",
                    lambda p, q: _residual(p, q, guard=False)),
            Mistake("a row where p == q has nothing left: return p there (a rejection cannot happen in that row), "
                    "not zeros, which sum to 0.",
                    lambda p, q: _residual(p, q, guard="zeros")),
            Mistake("normalise each row (the last dim) on its own, not all rows together.",
                    lambda p, q: _residual(p, q, per_row=False)),
            Mistake("the residual is the part of p that q does not cover: p - q clipped at 0, not max(p, q).",
                    lambda p, q: _residual(p, q, op="max")),
        ),
    )
