"""The one argument every backend receives: the validated, canonical inputs of one attention call."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = ["AttentionInputs", "BackendResult", "compute_dtype", "no_weights", "scale_or_default"]

#: What every backend's ``run`` returns: the output (B, Hq, L, Ev) and the weights (B, Hq, L, S) when
#: ``need_weights`` was asked (only backends that hold the weights can), else ``None``.
BackendResult = Tuple[torch.Tensor, Optional[torch.Tensor]]


@dataclass(frozen=True)
class AttentionInputs:
    """The canonical, validated arguments of one attention call (shapes in :mod:`attention_core.backends`).

    ``need_weights``: the caller wants the softmax weights back too (before dropout).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Optional[torch.Tensor]
    dropout_p: float
    is_causal: bool
    scale: float
    enable_gqa: bool
    need_weights: bool = False

    @property
    def requires_grad(self) -> bool:
        """True when autograd will need gradients through this call."""
        tensors = (self.query, self.key, self.value, self.attn_mask)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)

    def args(self) -> tuple:
        """The SDPA-ordered positional arguments ``(query, key, value, attn_mask, dropout_p, is_causal, scale,
        enable_gqa)``."""
        return (self.query, self.key, self.value, self.attn_mask, self.dropout_p, self.is_causal, self.scale,
                self.enable_gqa)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores are computed and masks are added in: float32 for float16/bfloat16, else ``dtype``.

    Every backend, and the paged and flex paths, use it, as torch's SDPA does on the CPU: a float32 mask entry of
    7e4 next to float16 inputs stays 7e4 (cast to float16 first it would become inf, and the row NaN), a
    bfloat16 query keeps a float32 mask's digits, and a tiled kernel's running sums keep theirs."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def no_weights(inputs: AttentionInputs) -> Optional[str]:
    """The reason a backend that never holds the weights gives when they are asked for, else ``None``."""
    if inputs.need_weights:
        return "it returns no weights (need_weights=True); use 'reference'"
    return None


def scale_or_default(scale: Optional[float], head_dim: int) -> float:
    """``scale``, or when it is ``None`` the default of scaled dot-product attention, ``1 / sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim) if scale is None else scale
