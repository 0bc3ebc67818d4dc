"""Can the fused kernels run here, and can they handle these inputs? Answered without importing them.

The registry asks every entry ``is_available()`` and ``supports(inputs)`` on each automatic choice and on
:func:`attention_core.available_backends`. For the ``"triton"`` and ``"cuda"`` entries the answers live here,
in a module that imports only torch, so that asking never imports Triton, never compiles the CUDA extension,
and never reads ``TRITON_INTERPRET`` at the wrong moment. The kernels themselves are in
:mod:`attention_core.backends.triton_flash` and :mod:`attention_core.backends.cuda_flash`.

Each ``*_available`` returns ``(ok, reason)``; each ``*_supports`` returns ``None`` (yes) or the reason (no).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import TYPE_CHECKING, Optional, Tuple

import torch

from attention_core._checks import parse_device

if TYPE_CHECKING:  # the registry imports this module, so the type is only named, never imported, here
    from attention_core.backends.inputs import AttentionInputs

__all__ = [
    "MAX_HEAD_DIM",
    "cuda_available",
    "cuda_supports",
    "tensor_core_kernel",
    "triton_available",
    "triton_grid_reason",
    "triton_interpreting",
    "triton_runs_on",
    "triton_supports",
    "triton_tensor_core_warning",
    "triton_uses_tensor_cores",
    "triton_worth_choosing",
]

#: The largest head dim (E and Ev) the fused kernels take; smaller ones are zero-padded to a power of two.
MAX_HEAD_DIM = 128

_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def triton_interpreting() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton then runs kernels in NumPy on the CPU (slowly, for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _common_reasons(inputs: AttentionInputs, window_hint: bool = False) -> Optional[str]:
    """Why neither fused kernel can take these inputs (shared by both), or ``None``.

    ``window_hint``: the kernel has a sliding window of its own (Triton's ``flash_attention(..., window=)``).
    """
    if inputs.need_weights:
        return "it returns no weights (need_weights=True); use 'reference'"
    if inputs.attn_mask is not None:
        own = "; a sliding window through its own flash_attention(..., window=)" if window_hint else ""
        return f"it takes no attn_mask (only is_causal{own}); use 'torch' or 'chunked' for an arbitrary mask"
    if inputs.dropout_p > 0:
        return f"it has no dropout (dropout_p={inputs.dropout_p}); use 'torch' or 'reference'"
    if inputs.query.dtype not in _FLOATS:
        return f"it computes in float16, bfloat16 or float32, got {inputs.query.dtype}"
    E, Ev = inputs.query.shape[-1], inputs.value.shape[-1]
    if max(E, Ev) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} only, got E={E}, Ev={Ev}"
    return None


# ---------------------------------------------------------------------------------------------------- triton


def triton_available() -> Tuple[bool, str]:
    """Triton is installed, and there is a CUDA GPU it can compile for or ``TRITON_INTERPRET=1`` is set."""
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (it ships with Linux torch wheels: pip install triton)"
    if triton_interpreting():
        return True, ""
    if not torch.cuda.is_available():
        return False, "no CUDA device (set TRITON_INTERPRET=1 before first use to run it, slowly, on the CPU)"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (7, 5):
        return False, f"Triton needs compute capability 7.5 or newer, this GPU is sm_{major}{minor}"
    return True, ""


def triton_runs_on(device_type: str) -> bool:
    """CUDA tensors on a GPU; CPU tensors (only) under ``TRITON_INTERPRET=1``."""
    return device_type == ("cpu" if triton_interpreting() else "cuda")


#: CUDA's limit on grid axes 1 and 2; the Triton kernels put batch x heads on axis 1.
GRID_YZ_LIMIT = 65535


def triton_grid_reason(B: int, Hq: int, H: int) -> Optional[str]:
    """Why the Triton grids cannot hold ``B`` sequences of ``Hq`` query (``H`` key/value) heads, or ``None``.

    The forward and dQ kernels run ``B * Hq`` programs along grid axis 1, dK/dV ``B * H``; CUDA allows at
    most 65,535 there (axis 0, the tiles along the sequence, goes to 2^31 - 1).
    """
    if B * max(Hq, H) > GRID_YZ_LIMIT:
        most = max(1, GRID_YZ_LIMIT // max(Hq, H, 1))
        return (f"batch x query heads B * Hq = {B} * {Hq} = {B * max(Hq, H)} exceeds CUDA's grid limit of "
                f"{GRID_YZ_LIMIT} programs on axis 1; split the batch into calls of at most {most} sequences")
    return None


def triton_uses_tensor_cores(device: torch.device) -> bool:
    """True unless ``device`` is a GPU older than sm_80, where Triton lowers ``tl.dot`` to FMA instructions.

    Measured by compiling the kernels for sm_75 (benchmarks/results/triton_resources.md): 0 HMMA, against
    HMMA on sm_80 and HGMMA on sm_90. The CPU (interpreter) counts as True: there is nothing to warn about.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


_WARNED_NO_TENSOR_CORES = False


def triton_tensor_core_warning(device: torch.device) -> None:
    """Warn once per process that the Triton kernels use no tensor cores on this (pre-sm_80) GPU."""
    global _WARNED_NO_TENSOR_CORES
    if _WARNED_NO_TENSOR_CORES or triton_uses_tensor_cores(device):
        return
    _WARNED_NO_TENSOR_CORES = True
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    warnings.warn(
        f"backend 'triton' on sm_{major}{minor}: Triton compiles its dots without tensor cores before sm_80, "
        "so these kernels run on the ordinary FMA units, several times slower than torch's "
        "scaled_dot_product_attention here (backend='torch')",
        UserWarning,
        stacklevel=3,
    )


def triton_worth_choosing(inputs: AttentionInputs) -> bool:
    """May the automatic choice pick ``triton`` for these inputs? Never where it has no tensor cores."""
    return triton_uses_tensor_cores(inputs.query.device)


def tensor_core_kernel(device: torch.device | str) -> Optional[str]:
    """The book's own fused kernel that runs its products on ``device``'s tensor cores, or ``None`` (no GPU).

    ``"triton"`` from sm_80 (Triton lowers ``tl.dot`` to HMMA on Ampere, HGMMA on Hopper); ``"cuda"`` before
    sm_80, i.e. on Colab's T4 (sm_75): Triton emits no tensor-core instruction for sm_75 (0 HMMA and 0 HGMMA in
    every kernel the committed report ``triton_resources.json`` compiled for it), while the CUDA backend's
    level 2 drives them through WMMA (float16; bfloat16 WMMA needs sm_80). The automatic choice stays
    ``torch`` on every GPU: on a T4, PyTorch's SDPA runs its memory-efficient kernel, which has float16
    tensor-core builds for sm_75 (its FlashAttention-2 kernel needs sm_80).

    ``device`` is a ``torch.device`` or a device string (``TypeError`` otherwise; ``ValueError`` for a string
    that names no device, such as ``"tpu"``).
    """
    device = parse_device(device, "device")
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return "triton" if triton_uses_tensor_cores(device) else "cuda"


def triton_supports(inputs: AttentionInputs) -> Optional[str]:
    """``None`` if the Triton kernel can compute these inputs, else why not."""
    reason = _common_reasons(inputs, window_hint=True)
    if reason is not None:
        return reason
    B, Hq = inputs.query.shape[0], inputs.query.shape[1]
    reason = triton_grid_reason(B, Hq, inputs.key.shape[1])
    if reason is not None:
        return reason
    device, dtype = inputs.query.device, inputs.query.dtype
    if triton_interpreting():
        if device.type != "cpu":
            return f"under TRITON_INTERPRET=1 it runs on CPU tensors, got {device}"
        if dtype == torch.bfloat16:
            return "the Triton interpreter computes bfloat16 dots wrongly; use float16 or float32 there"
        return None
    if device.type != "cuda":
        return f"it runs on CUDA tensors, got {device} (TRITON_INTERPRET=1 runs it on the CPU)"
    if dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) < (8, 0):
        return "bfloat16 tensor-core dots need compute capability 8.0 (Ampere) or newer; use float16"
    return None


# ------------------------------------------------------------------------------------------------------ cuda


def cuda_available() -> Tuple[bool, str]:
    """A CUDA GPU (sm_75+), a CUDA build of torch, and the tools to compile the extension at first use."""
    if not torch.cuda.is_available():
        return False, "no CUDA device (the hand-written CUDA kernels run only on an NVIDIA GPU)"
    if torch.version.cuda is None:
        return False, "this torch build has no CUDA support"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (7, 5):
        return False, f"the CUDA kernels need compute capability 7.5 or newer, this GPU is sm_{major}{minor}"
    from torch.utils import cpp_extension  # only asked for on a CUDA machine

    if not cpp_extension.is_ninja_available():
        return False, "compiling the CUDA extension needs ninja (pip install ninja)"
    if cpp_extension.CUDA_HOME is None:
        return False, "no CUDA toolkit (nvcc) found to compile the extension; set CUDA_HOME"
    return True, ""


def cuda_supports(inputs: AttentionInputs) -> Optional[str]:
    """``None`` if the CUDA kernels can compute these inputs, else why not.

    bfloat16 on a GPU older than sm_80 is accepted: it runs on the level-1 (fp32 math) kernel with a warning,
    because bfloat16 tensor-core (WMMA) fragments need sm_80.
    """
    reason = _common_reasons(inputs)
    if reason is not None:
        return reason
    if inputs.query.device.type != "cuda":
        return f"it runs on CUDA tensors, got {inputs.query.device}"
    E, Ev = inputs.query.shape[-1], inputs.value.shape[-1]
    if E != Ev:
        return f"it needs value's head dim equal to query's, got E={E}, Ev={Ev}"
    return None


# ------------------------------------------------------------------------------------------- public inputs


def check_fused_inputs(query: object, key: object, value: object, is_causal: object) -> None:
    """Validate the arguments of the fused kernels' own public functions (the registry path is pre-checked).

    Expects query (B, Hq, L, E), key (B, H, S, E), value (B, H, S, Ev): one float dtype (fp16, bf16, fp32),
    one device, ``Hq % H == 0``, ``1 <= E, Ev <= 128``. Raises ``TypeError`` or ``ValueError`` naming the
    argument.
    """
    from attention_core._checks import check_bool_flag, check_tensor, fmt_shape

    named = {"query": check_tensor(query, "query"), "key": check_tensor(key, "key"),
             "value": check_tensor(value, "value")}
    check_bool_flag(is_causal, "is_causal")
    shapes = ", ".join(f"{n} {fmt_shape(t.shape)}" for n, t in named.items())
    for name, t in named.items():
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, E), got shape {fmt_shape(t.shape)}")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
    if len({t.dtype for t in named.values()}) > 1 or len({t.device for t in named.values()}) > 1:
        seen = ", ".join(f"{n} {t.dtype} on {t.device}" for n, t in named.items())
        raise TypeError(f"query, key and value must share one dtype and one device, got {seen}")
    B, Hq, L, E = named["query"].shape
    B_k, H, S, E_k = named["key"].shape
    if B_k != B or named["value"].shape[0] != B:
        raise ValueError(f"query, key and value must have the same batch size (dim 0): got {shapes}")
    if tuple(named["value"].shape[1:3]) != (H, S):
        raise ValueError(f"key and value must have the same heads and positions (dims 1, 2): got {shapes}")
    if E_k != E:
        raise ValueError(f"key's head dim must equal query's (E={E}): got {shapes}")
    if Hq % H != 0:
        raise ValueError(f"query heads (Hq={Hq}) must be a multiple of key/value heads (H={H}): got {shapes}")
    Ev = named["value"].shape[3]
    if not (1 <= E <= MAX_HEAD_DIM and 1 <= Ev <= MAX_HEAD_DIM):
        raise ValueError(f"head dims E and Ev must be in 1..{MAX_HEAD_DIM}: got {shapes}")
