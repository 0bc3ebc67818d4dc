"""The reference backend: attention written out in eager torch, step by step.

This is the textbook computation, the one the book derives and every other backend is checked against:

    scores  = query @ key^T * scale           (B, Hq, L, S)
    weights = masked_softmax(scores, mask)    (B, Hq, L, S), rows sum to 1 (or are all 0 if fully masked)
    out     = dropout(weights) @ value        (B, Hq, L, Ev)

It materialises the full (L, S) score matrix, so its memory grows as L * S; it is the only backend that can
hand the weights back (``need_weights=True`` in the modules, :func:`attention_core.attention_weights`).
Inputs are the canonical ones described in :mod:`attention_core.backends`; no validation happens here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention_core.backends.inputs import AttentionInputs, BackendResult
from attention_core.masks import causal_mask

__all__ = [
    "attention",
    "run",
    "supports",
    "attention_scores",
    "attention_weights",
    "attention_with_weights",
    "softmax_with_mask",
]


def softmax_with_mask(scores: torch.Tensor, mask: torch.Tensor | None = None, dim: int = -1) -> torch.Tensor:
    """Softmax of ``scores`` along ``dim`` where masked entries get weight 0; fully masked rows are all 0.

    A bool mask keeps the True entries (the others are filled with ``-inf``); a float mask is added. Why
    ``-inf`` and not a large negative number such as ``-1e9``: ``-1e9`` is not "minus infinity" for every
    dtype (it overflows to ``-inf`` in float16, and next to scores of size 1e9 it is no mask at all) and it
    turns a fully masked row into a *uniform* average over keys that were supposed to be invisible. With
    ``-inf`` a masked entry has exactly ``exp(-inf) = 0`` weight; the only price is a fully masked row, whose
    max is ``-inf`` and whose softmax would be ``0/0 = NaN``. The guard finds those rows, softmaxes a row of
    zeros instead (finite values and finite gradients) and zeroes the result.

    Args:
        scores: floating tensor of any shape.
        mask: ``None``, bool (True = keep) or float (added), broadcastable to ``scores``.
        dim: the dimension to normalise.

    Returns:
        Tensor of ``scores``' shape and dtype.
    """
    if scores.shape[dim] == 0:  # no keys at all: an empty softmax, nothing to guard
        return torch.softmax(scores, dim=dim)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    dead = scores.amax(dim=dim, keepdim=True) == float("-inf")  # rows with nothing to attend to
    weights = torch.softmax(scores.masked_fill(dead, 0.0), dim=dim)
    return weights.masked_fill(dead, 0.0)


def attention_scores(query: torch.Tensor, key: torch.Tensor, scale: float, enable_gqa: bool) -> torch.Tensor:
    """``query @ key^T * scale``, key heads repeated for GQA: (B, Hq, L, E), (B, H, S, E) -> (B, Hq, L, S)."""
    if enable_gqa:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)  # (B, H, S, E) -> (B, Hq, S, E)
    return query @ key.transpose(-2, -1) * scale  # (B, Hq, L, E) @ (B, Hq, E, S) -> (B, Hq, L, S)


def attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
    *,
    in_compute_dtype: bool = False,
) -> torch.Tensor:
    """Softmax weights (B, Hq, L, S): each row sums to 1, or is all 0 when its keys are all masked.

    They are computed in the compute dtype, float32 for float16/bfloat16 inputs (as torch's math path does on
    the CPU: half-precision scores lose about 2 digits), the input dtype otherwise; returned in the query's
    dtype, or in the compute dtype with ``in_compute_dtype`` (what :func:`attention_with_weights` multiplies the
    values by)."""
    compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    query_c, key = query.to(compute), key.to(compute)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.to(compute)
    L, S = query_c.shape[-2], key.shape[-2]
    if is_causal:
        attn_mask = causal_mask(L, S, device=query_c.device)  # (L, S), True on and below the diagonal
    weights = softmax_with_mask(attention_scores(query_c, key, scale, enable_gqa), attn_mask)
    return weights if in_compute_dtype else weights.to(query.dtype)


def attention_with_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output (B, Hq, L, Ev) and the weights (B, Hq, L, S) it used (before dropout)."""
    weights = attention_weights(query, key, attn_mask, is_causal, scale, enable_gqa, in_compute_dtype=True)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights  # kept weights scaled 1/(1-p)
    value_c = value.to(weights.dtype)
    if enable_gqa:
        group = query.shape[-3] // value.shape[-3]
        value_c = value_c.repeat_interleave(group, dim=-3)  # (B, H, S, Ev) -> (B, Hq, S, Ev)
    out = dropped @ value_c  # (B, Hq, L, S) @ (B, Hq, S, Ev) -> (B, Hq, L, Ev)
    return out.to(query.dtype), weights.to(query.dtype)


def attention(*args: object) -> torch.Tensor:
    """The output alone of :func:`attention_with_weights` (same arguments, SDPA order): (B, Hq, L, Ev)."""
    return attention_with_weights(*args)[0]


def supports(inputs: AttentionInputs) -> str | None:
    """Every input: the reference runs anything valid (the memory check is the registry's)."""
    return None


def run(inputs: AttentionInputs) -> BackendResult:
    """Registry entry point: ``(out, weights)`` when ``inputs.need_weights``, else ``(out, None)``."""
    out, weights = attention_with_weights(*inputs.args())
    return out, (weights if inputs.need_weights else None)
