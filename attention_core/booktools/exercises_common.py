"""What every chapter's code-exercise module shares: input strategies, library references, shared names.

Each chapter's exercise lives in its own module (``exercises_<chapter>.py``: its reference, its inputs and its
known mistakes) and is registered in :mod:`~attention_core.booktools.chapter_exercises`. Every function here,
like every function of a chapter's module, is one of the checker's own helpers: unavailable while a reader's
function runs (see :func:`~attention_core.booktools.code_checks.unavailable`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

__all__ = ["ATTENTION_MODULES", "NEG_INF", "T", "TORCH_ATTENTION", "TORCH_MASKED_SOFTMAX", "draw_values",
           "library_reference", "rows_mask", "strategies"]

T = torch.tensor
NEG_INF = float("-inf")


#: Where the library computes attention whole (any backend, any wrapper): unavailable to every exercise that
#: asks for a softmax or an attention to be written by hand.
ATTENTION_MODULES = ("attention_core.functional", "attention_core.backends", "attention_core.multihead",
                     "attention_core.flex_attention", "attention_core.paged_attention", "attention_core.models",
                     "attention_core.low_precision", "attention_core.distributed",
                     # torch's eager FlexAttention in Python (its math_attention and sdpa_dense take a mask_mod),
                     # and the quantizable MultiheadAttention, which writes attention out in Python
                     "torch._higher_order_ops.flex_attention", "torch.ao.nn.quantizable.modules.activation")
#: torch's private attention operators (the ``aten::_scaled_dot_product_*`` family on ``torch.ops.aten``): each
#: returns the whole answer as its first output. The same C functions are bound in torch's own namespace too.
_PRIVATE_SDPA = ("_scaled_dot_product_attention_math", "_scaled_dot_product_attention_math_for_mps",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_fused_attention_overrideable", "_triton_scaled_dot_attention",
                 # the fused GPU kernels under SDPA (a Colab GPU runs them; causal is one of their arguments)
                 "_efficient_attention_forward", "_flash_attention_forward",
                 "_flash_attention_forward_no_dropout_inplace")
TORCH_ATEN_SDPA = tuple(f"torch.ops.aten.{name}" for name in _PRIVATE_SDPA if hasattr(torch.ops.aten, name))
#: torch's multi-head attention written whole: the fused operator behind ``nn.MultiheadAttention``'s fast path
#: (projections, heads, attention and output projection in one call), under both of its names.
TORCH_MHA_OPS = tuple(name for name in ("torch._native_multi_head_attention", "torch._triton_multi_head_attention",
                                        "torch.ops.aten._native_multi_head_attention",
                                        "torch.ops.aten._triton_multi_head_attention")
                      if hasattr(torch.ops.aten if "ops" in name else torch, name.rsplit(".", 1)[1]))
def _has(module: str, name: str) -> bool:
    """Whether ``module`` (imported here if it exists) has ``name``."""
    import importlib
    import importlib.util

    return importlib.util.find_spec(module) is not None and hasattr(importlib.import_module(module), name)


#: ONNX's Attention operator, public as ``torch.onnx.ops.attention`` (it takes its own path, not SDPA, when given a
#: float mask or a softmax precision), and the operator it calls.
TORCH_ONNX_ATTENTION = tuple(name for name, present in (
    ("torch.onnx.ops.attention", _has("torch.onnx.ops", "attention")),
    ("torch.ops.onnx.Attention", _has("torch.onnx.ops", "attention") and hasattr(torch.ops.onnx, "Attention")))
    if present)
#: torch's functions that compute attention whole, under the names a student finds (its bindings included; an
#: operator on ``torch.ops.aten`` is refused with every overload, ``.default`` too): off while any attention
#: exercise's function runs.
TORCH_ATTENTION = ("torch.nn.functional.scaled_dot_product_attention", "torch._C._nn.scaled_dot_product_attention",
                   "torch.ops.aten.scaled_dot_product_attention", "torch.nn.functional.multi_head_attention_forward",
                   "torch.nn.attention.flex_attention.flex_attention",
                   *TORCH_ONNX_ATTENTION,
                   *TORCH_ATEN_SDPA, *(f"torch.{name}" for name in _PRIVATE_SDPA if hasattr(torch, name)),
                   *TORCH_MHA_OPS)
#: torch's own masked softmax (public, in ``torch.masked``, and the private operator SDPA's fast path uses):
#: off where an exercise asks for the masked softmax itself (each gives NaN on a fully masked row, and one
#: ``nan_to_num`` away from the whole answer).
TORCH_MASKED_SOFTMAX = ("torch.masked.softmax", "torch.masked.log_softmax", "torch.masked.softmin",
                        "torch._masked_softmax", "torch.ops.aten._masked_softmax")


def strategies() -> Any:
    """``hypothesis.strategies``, imported when an exercise's inputs are built (the book extra installs it)."""
    from hypothesis import strategies as st

    return st


def draw_values(draw: Any, shape: tuple, lo: float, hi: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of ``shape`` with entries drawn in [lo, hi] (at float32's or float64's width)."""
    st = strategies()
    n = math.prod(shape)
    width = 32 if dtype == torch.float32 else 64
    return T(draw(st.lists(st.floats(lo, hi, width=width), min_size=n, max_size=n)), dtype=dtype).view(shape)


def rows_mask(draw: Any, L: int, S: int) -> torch.Tensor:
    """(L, S) bool: each row all kept, all masked, or random (so that both kinds of full row appear)."""
    st = strategies()
    rows = []
    for _ in range(L):
        kind = draw(st.sampled_from(["random", "random", "all", "none"]))
        rows.append([kind == "all"] * S if kind != "random" else draw(st.lists(st.booleans(), min_size=S, max_size=S)))
    return T(rows, dtype=torch.bool)


def library_reference(path: str) -> Callable[..., Any]:
    """A reference that looks the library function up when called (so a test can patch it)."""

    def call(*args: Any) -> Any:
        from attention_core.booktools.refusals import _resolve

        return _resolve(path)[2](*args)

    call.__name__ = path.rsplit(".", 1)[-1]
    return call
