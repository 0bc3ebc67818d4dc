"""The NumPy backend: a float64 oracle, independent of torch's kernels.

Every input is copied to a float64 NumPy array on the CPU, attention is computed there, and the result comes
back as a tensor in the query's dtype and device. Nothing in it shares code with the torch backends, which
is what makes it a useful oracle for them (tests compare every backend against it on upcast inputs). It has
no autograd and no dropout: the registry refuses such calls with a clear message.
"""

from __future__ import annotations

import numpy as np
import torch

from attention_core.backends.inputs import AttentionInputs, BackendResult, no_weights, scale_or_default

__all__ = ["attention_np", "run", "supports"]


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
    scale = scale_or_default(scale, query.shape[-1])
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


def supports(inputs: AttentionInputs) -> str | None:
    """No meta tensors, no autograd, no dropout, no weights: it is a float64 oracle on values."""
    if inputs.query.device.type == "meta":
        return "it computes on the tensors' values, and meta tensors have none"
    if inputs.requires_grad:
        return "it has no autograd (an input requires grad); use 'reference' or 'torch' for gradients"
    if inputs.dropout_p > 0:
        return f"it has no dropout (dropout_p={inputs.dropout_p}); it is a deterministic oracle"
    return no_weights(inputs)


def run(inputs: AttentionInputs) -> BackendResult:
    """Registry entry point: ``(out, None)``, out (B, Hq, L, Ev) in the query's dtype and device."""
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = inputs.args()
    if dropout_p > 0:
        raise ValueError(f"the numpy backend has no dropout, got dropout_p={dropout_p}")
    q, k, v = _to_numpy(query), _to_numpy(key), _to_numpy(value)
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3]
        k = np.repeat(k, group, axis=-3)  # (B, H, S, E) -> (B, Hq, S, E); kv head h -> q heads h*G..h*G+G-1
        v = np.repeat(v, group, axis=-3)  # (B, H, S, Ev) -> (B, Hq, S, Ev)
    mask = None if attn_mask is None else _to_numpy(attn_mask)
    out = attention_np(q, k, v, mask, is_causal, scale)
    return torch.from_numpy(out).to(device=query.device, dtype=query.dtype), None
