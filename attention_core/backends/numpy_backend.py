"""The NumPy backend: a float64 oracle, independent of torch's kernels.

Every input is copied to a float64 NumPy array on the CPU, attention is computed there, and the result comes
back as a tensor in the query's dtype and device. Nothing in it shares code with the torch backends, which
is what makes it a useful oracle for them (tests compare every backend against it on upcast inputs). It has
no autograd and no dropout: the registry refuses such calls with a clear message.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["attention", "attention_np"]


def attention_np(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    attn_mask: np.ndarray | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> np.ndarray:
    """Float64 attention on arrays (..., L, E), (..., S, E), (..., S, Ev) -> (..., L, Ev).

    Leading dims broadcast like NumPy's matmul (repeat key/value heads before calling for GQA). ``attn_mask``
    is bool (True = takes part) or float (added), broadcastable to (..., L, S). Fully masked rows give 0.
    """
    L, S = query.shape[-2], key.shape[-2]
    scale = 1.0 / np.sqrt(query.shape[-1]) if scale is None else scale
    scores = np.matmul(query, np.swapaxes(key, -1, -2)) * scale  # (..., L, E) @ (..., E, S) -> (..., L, S)
    keep = np.ones(scores.shape, dtype=bool)
    if is_causal:
        keep &= np.tril(np.ones((L, S), dtype=bool))  # upper-left aligned: query i sees key j iff j <= i
    if attn_mask is not None and attn_mask.dtype == np.bool_:
        keep &= attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask
        keep &= attn_mask != -np.inf  # an additive -inf removes the key
    scores = np.where(keep, scores, -np.inf)
    alive = keep.any(axis=-1, keepdims=True)  # (..., L, 1): does the row attend to anything?
    row_max = np.where(alive, scores.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    expd = np.where(keep, np.exp(scores - row_max), 0.0)
    denom = expd.sum(axis=-1, keepdims=True)
    weights = np.where(alive, expd / np.where(alive, denom, 1.0), 0.0)
    return np.matmul(weights, value)  # (..., L, S) @ (..., S, Ev) -> (..., L, Ev)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bool:
        return t.detach().cpu().numpy()
    return t.detach().to(device="cpu", dtype=torch.float64).numpy()


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """Backend entry point on canonical inputs; returns (B, Hq, L, Ev) in the query's dtype and device."""
    if dropout_p > 0:
        raise ValueError(f"the numpy backend has no dropout, got dropout_p={dropout_p}")
    q, k, v = _to_numpy(query), _to_numpy(key), _to_numpy(value)
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3]
        k = np.repeat(k, group, axis=-3)  # (B, H, S, E) -> (B, Hq, S, E); kv head h -> q heads h*G..h*G+G-1
        v = np.repeat(v, group, axis=-3)  # (B, H, S, Ev) -> (B, Hq, S, Ev)
    mask = None if attn_mask is None else _to_numpy(attn_mask)
    out = attention_np(q, k, v, mask, is_causal, scale)
    return torch.from_numpy(out).to(device=query.device, dtype=query.dtype)
