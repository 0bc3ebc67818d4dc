"""The mods the Triton flex kernels compile in: the ``@triton.jit`` mask and score predicates that the forward
(:mod:`attention_core.backends.triton_flex`) and the backward (:mod:`attention_core.backends.triton_flex_bwd`)
both call, and the codes that select their branches.

A Python ``mask_mod`` cannot be compiled into a Triton kernel by this library; instead the library's own mods
carry their kind and arguments (``mod.flex_kind``), and :func:`_keep` has each of them as a compile-time
``MASK`` branch (the table is in :mod:`attention_core.backends.triton_flex`), :func:`_score` each score mod as a
``SCORE`` branch. Both kernels import this module and neither imports the other's kernels back.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["MASK_KINDS", "SCORE_KINDS"]

MASK_KINDS = {"noop": 0, "causal": 1, "window": 2, "sinks_window": 3, "document": 4, "prefix_lm": 5,
              "bottom_right": 6, "document_causal": 7, "window_two_sided": 8}
SCORE_KINDS = {None: 0, "alibi": 1, "soft_cap": 2, "relative_position_bias": 3}


@triton.jit
def _keep(q, kv, DOC, L, S, P0, P1, MASK: tl.constexpr):
    """The compiled mask_mod: q (BLOCK_M, 1) and kv (1, BLOCK_N) positions -> bool (BLOCK_M, BLOCK_N)."""
    if MASK == 1:
        keep = kv <= q
    elif MASK == 2:
        keep = (kv <= q) & (q - kv < P1)
    elif MASK == 3:
        keep = (kv <= q) & ((kv < P0) | (q - kv < P1))
    elif MASK == 4:
        keep = tl.load(DOC + tl.minimum(q, L - 1)) == tl.load(DOC + tl.minimum(kv, S - 1))
    elif MASK == 5:
        keep = (kv < P0) | (kv <= q)
    elif MASK == 6:
        keep = kv <= q + P0
    elif MASK == 7:
        same = tl.load(DOC + tl.minimum(q, L - 1)) == tl.load(DOC + tl.minimum(kv, S - 1))
        keep = same & (kv <= q)
    elif MASK == 8:
        keep = ((q - kv) <= P1) & ((kv - q) <= P1)
    else:
        keep = (q >= 0) & (kv >= 0)
    return keep


@triton.jit
def _score(s, q, kv, h, SLOPES, TABLE, CAP, P2, SCORE: tl.constexpr):
    """The compiled score_mod on natural-unit scores s (BLOCK_M, BLOCK_N), float32."""
    if SCORE == 1:
        s = s + tl.load(SLOPES + h).to(tl.float32) * (kv - q).to(tl.float32)
    elif SCORE == 2:
        s = CAP * (2.0 / (1.0 + tl.exp(-2.0 * (s / CAP))) - 1.0)  # cap * tanh(s / cap)
    elif SCORE == 3:
        d = tl.minimum(tl.maximum(kv - q, -P2), P2) + P2
        s = s + tl.load(TABLE + h * (2 * P2 + 1) + d).to(tl.float32)
    return s
