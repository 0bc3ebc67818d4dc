"""Hand-written CUDA C++ flash attention (forward), compiled at first use with ``load_inline``.

The kernels are in ``csrc/flash_kernels.cuh`` (device code only), launched by ``csrc/flash_launch.cu`` (plain
CUDA, raw pointers), with the torch glue in ``csrc/flash_binding.cpp``; :mod:`attention_core.backends.cuda_kernels`
reads them. This module compiles them once per process with ``torch.utils.cpp_extension.load_inline`` (torch
caches the build on disk across processes) and launches them. Nothing is compiled at import, or on a machine
without a CUDA device: :func:`attention_core.backends.fused_checks.cuda_available` says why not.

Without a GPU, :func:`run_on_cpu` executes the same device code on the CPU, one ``std::thread`` per CUDA thread
(:mod:`attention_core.backends.cuda_on_cpu`): slow, but it checks what the kernels compute, and under
ThreadSanitizer that their barriers are where they must be.

Two levels, the same function:

===== ====================== ==================== ===========================================================
level kernel                 dtypes               what it shows
===== ====================== ==================== ===========================================================
1     ``flash_fwd_rowwise``  fp32, fp16, bf16     one thread per query row (two at D = 128), K/V tiles in
                                                  shared memory, online softmax; fp32 math on the CUDA cores
2     ``flash_fwd_wmma``     fp16 (sm_75+),       S = Q K^T and O += P V on the tensor cores (WMMA 16x16x16,
                             bf16 (sm_80+)        fp32 accumulation); softmax per 16-row strip per warp
===== ====================== ==================== ===========================================================

``level=None`` takes level 2 for fp16/bf16 and level 1 for fp32. bf16 on a GPU older than sm_80 (Colab's T4 is
sm_75) has no bf16 WMMA: it falls back to level 1 with a warning, never an error. One build serves every GPU:
the bf16 level-2 kernel is compiled only for sm_80 and newer (``__CUDA_ARCH__``), so an arch list that includes
sm_75 compiles.

Forward only in CUDA. Autograd works: the backward recomputes attention with the eager reference backend
(``attention_core.backends.reference``) and differentiates that, which costs O(L * S) memory in the backward;
use the ``triton`` backend for a fused backward. Masks: ``is_causal`` (upper-left aligned) only.
Head dims: E == Ev <= 128.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Optional

import torch

from attention_core._checks import check_scale
from attention_core.backends import reference
from attention_core.backends.cuda_kernels import BINDING_SOURCE, KERNEL_SOURCE
from attention_core.backends.cuda_on_cpu import run_on_cpu
from attention_core.backends.fused_checks import check_fused_inputs, cuda_available
from attention_core.backends.inputs import AttentionInputs, BackendResult, scale_or_default

__all__ = ["BINDING_SOURCE", "KERNEL_SOURCE", "run", "flash_attention", "flash_attention_forward",
           "load_extension", "run_on_cpu"]

_DTYPE_LEVEL = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 2}


# ----------------------------------------------------------------------------------- build (the "kernels")


def _bf16_wmma_on(device: torch.device) -> bool:
    """True when ``device`` is sm_80+, where bf16 WMMA fragments exist (the launcher asks the same)."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


@functools.cache
def load_extension() -> Any:
    """Compile (first call, about a minute) or load (cached) the extension that holds ``flash_forward``.

    Raises:
        RuntimeError: no CUDA device or toolchain (with the reason), or the compilation failed.
    """
    ok, reason = cuda_available()
    if not ok:
        raise RuntimeError(f"the CUDA backend cannot run on this machine: {reason}")
    from torch.utils.cpp_extension import load_inline

    flags = ["-O3", "-lineinfo"]
    try:
        return load_inline(
            name="attention_core_flash",
            cpp_sources=[BINDING_SOURCE],
            cuda_sources=[KERNEL_SOURCE],
            functions=["flash_forward"],
            extra_cuda_cflags=flags,
            verbose=False,
        )
    except Exception as err:  # a compiler error: say what to do instead of a bare traceback
        raise RuntimeError(
            f"compiling the CUDA extension failed ({type(err).__name__}: {err}); the 'triton' and 'torch' "
            "backends need no compilation"
        ) from err


# ----------------------------------------------------------------------------------------------- launcher


def _choose_level(dtype: torch.dtype, device: torch.device, level: Optional[int]) -> int:
    """The kernel level for ``dtype`` on ``device`` (see the module table); warns when it falls back."""
    if level not in (None, 1, 2):
        raise ValueError(f"level must be None, 1 or 2, got {level!r}")
    if level == 2 and dtype == torch.float32:
        raise ValueError("level 2 (tensor cores) takes float16 or bfloat16 inputs, got float32; use level=1")
    level = _DTYPE_LEVEL[dtype] if level is None else level
    if level == 2 and dtype == torch.bfloat16 and not _bf16_wmma_on(device):
        major, minor = torch.cuda.get_device_capability(device)
        warnings.warn(
            f"bfloat16 tensor-core (WMMA) fragments need sm_80 or newer and this GPU is sm_{major}{minor}: "
            "running the level-1 kernel (fp32 math) instead; pass float16 for the tensor cores",
            RuntimeWarning, stacklevel=3,
        )
        level = 1
    return level


def flash_attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, is_causal: bool, level: int
) -> torch.Tensor:
    """Launch one kernel level on checked inputs; returns (B, Hq, L, E) in the query's dtype."""
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    out = torch.empty_like(query)
    if out.numel() == 0:
        return out
    if key.shape[2] == 0:  # no keys: every row is fully masked
        return out.zero_()
    ext = load_extension()
    with torch.cuda.device(query.device):
        stream = torch.cuda.current_stream(query.device).cuda_stream
        ext.flash_forward(query, key, value, out, is_causal, float(scale), level, stream)
    return out


# ---------------------------------------------------------------- autograd: a custom operator with a fake kernel
# As the Triton kernels: torch.compile(fullgraph=True) traces one opaque call on fake tensors.


@torch.library.custom_op("attention_core::cuda_flash_forward", mutates_args=())
def _forward_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, is_causal: bool,
                level: int) -> torch.Tensor:
    """(B, Hq, L, E): :func:`flash_attention_forward` as an operator."""
    return flash_attention_forward(query, key, value, scale, is_causal, level)


@_forward_op.register_fake
def _(query, key, value, scale, is_causal, level):
    return torch.empty_like(query)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, scale, is_causal, _ = inputs
    ctx.save_for_backward(query, key, value)
    ctx.args = (scale, is_causal)


def _backward(ctx, grad_out):
    """Recompute with the eager reference (O(L * S) memory, no extra kernels) and differentiate that."""
    scale, is_causal = ctx.args
    inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
    q, k, v = inputs
    with torch.enable_grad():
        out = reference.attention(q, k, v, None, 0.0, is_causal, scale, q.shape[1] != k.shape[1])
    dq, dk, dv = torch.autograd.grad(out, inputs, grad_out)
    return dq, dk, dv, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------ public function


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    level: Optional[int] = None,
) -> torch.Tensor:
    """Attention ``softmax(query @ key^T * scale) @ value`` by the hand-written CUDA kernels.

    Args:
        query: (B, Hq, L, E), float32, float16 or bfloat16, on a CUDA device.
        key: (B, H, S, E) with ``Hq % H == 0`` (grouped-query attention when ``H < Hq``).
        value: (B, H, S, E): the same head dim as query, at most 128.
        is_causal: query ``i`` sees keys ``j <= i`` (upper-left aligned, as torch SDPA).
        scale: multiplies the scores; ``1 / sqrt(E)`` by default.
        level: 1 (CUDA cores, any dtype) or 2 (tensor cores, fp16/bf16); ``None`` picks by dtype.

    Returns:
        (B, Hq, L, E) in the query's dtype. Differentiable (the backward recomputes with the reference).
    """
    check_fused_inputs(query, key, value, is_causal)
    ok, reason = cuda_available()
    if not ok:
        raise RuntimeError(f"the CUDA backend cannot run on this machine: {reason}")
    if query.device.type != "cuda":
        raise ValueError(f"query, key and value must be CUDA tensors, got {query.device}")
    if value.shape[-1] != query.shape[-1]:
        raise ValueError(f"value's head dim must equal query's (E={query.shape[-1]}): got value of shape "
                         f"{tuple(value.shape)} (the CUDA kernels take E == Ev)")
    scale = check_scale(scale)
    scale = scale_or_default(scale, query.shape[-1])
    chosen = _choose_level(query.dtype, query.device, level)
    return _forward_op(query, key, value, scale, is_causal, chosen)


def run(inputs: AttentionInputs) -> BackendResult:
    """Registry entry point on canonical inputs already validated by :func:`attention_core.scaled_dot_product_attention`
    and :func:`~attention_core.backends.fused_checks.cuda_supports` (no second validation here)."""
    chosen = _choose_level(inputs.query.dtype, inputs.query.device, None)
    return _forward_op(inputs.query, inputs.key, inputs.value, inputs.scale, inputs.is_causal, chosen), None
