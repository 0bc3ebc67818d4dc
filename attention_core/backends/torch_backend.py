"""The torch backend: ``torch.nn.functional.scaled_dot_product_attention``.

PyTorch picks a fused kernel (flash, memory-efficient, cuDNN, or its math fallback) by device and inputs.
On the CPU, torch 2.13 already returns zeros for a fully masked query row, for bool and float masks, in every
dtype, with and without dropout, and its gradients there are finite (checked in ``tests/``). The fused CUDA
kernels have differed across versions (NaN rows), so on other devices this backend zeroes rows whose mask
removes every key: one reduction over the mask, O(L * S) booleans against the O(L * S * E) of attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attention_core.backends.inputs import AttentionInputs, BackendResult, no_weights

__all__ = ["run", "supports"]


def run(inputs: AttentionInputs) -> BackendResult:
    """Registry entry point: ``(out, None)``; canonical inputs (B, Hq, L, E), (B, H, S, E), (B, H, S, Ev)."""
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = inputs.args()
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )
    if attn_mask is None or query.device.type == "cpu":
        return out, None
    keep = attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")
    alive = keep.any(dim=-1, keepdim=True)  # (B?, H?, L?, S) -> (B?, H?, L?, 1)
    return out.masked_fill(~alive, 0.0), None


def supports(inputs: AttentionInputs) -> str | None:
    """Every input but a request for the weights (the fused kernels never form them)."""
    return no_weights(inputs)
