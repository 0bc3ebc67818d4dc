"""Attention backends: one signature, several implementations, one registry.

Every backend module exposes one function with the SDPA signature::

    attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> Tensor

and receives *canonical* inputs, already validated by :func:`attention_core.scaled_dot_product_attention`:

- ``query`` (B, Hq, L, E), ``key`` (B, H, S, E), ``value`` (B, H, S, Ev), one floating dtype, one device;
  ``Hq % H == 0``, and ``H == Hq`` unless ``enable_gqa``;
- ``attn_mask`` is ``None`` or 4-D and broadcasts to (B, Hq, L, S); bool (True = takes part) or float in the
  compute dtype (float32 for float16/bfloat16 queries, else the query's dtype), added to the scores in that
  precision, as torch's SDPA does; never given together with ``is_causal``;
- ``scale`` is a finite float, zero and negative included as in torch (the default ``1/sqrt(E)`` is already filled in).

A fully masked query row gives zeros in every backend.

=========== ============================================ ======== ======= ======= ==============================
name        what                                         autograd dropout weights runs on
=========== ============================================ ======== ======= ======= ==============================
reference   eager torch math, any device                 yes      yes     yes     any device
numpy       float64 NumPy oracle (copies to the CPU)     no       no      no      any device (computes on CPU)
torch       ``torch.nn.functional.scaled_dot_product_…`` yes      yes     no      any device
chunked     online softmax over tiles, custom backward   yes      no      no      any device
triton      FlashAttention-2 forward + backward kernels  yes      no      no      CUDA sm_75+ (bf16: sm_80+;
                                                                                  tensor cores: sm_80+);
                                                                                  CPU under ``TRITON_INTERPRET=1``
cuda        hand-written CUDA C++ forward (two levels)   yes (a)  no      no      CUDA sm_75+ with nvcc + ninja
=========== ============================================ ======== ======= ======= ==============================

(a) Its backward recomputes attention with the eager ``reference`` backend (O(L * S) memory).

``triton`` and ``cuda`` take no ``attn_mask`` (``is_causal`` only) and head dims up to 128; asking for them
where they cannot run, or with inputs they cannot take, raises a ``ValueError`` that says why (answered by
:mod:`attention_core.backends.fused_checks` without importing Triton or compiling anything).

The registry is open: :func:`register_backend` adds an entry. An entry names its implementation by module
path, so a backend's module, and whatever heavy thing it imports (Triton, the CUDA compiler), is loaded only
on first use.

Which backend runs a call: the ``backend=`` argument if given, else the innermost :func:`use_backend`, else
the automatic choice of :func:`choose_backend`.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "AUTO_ORDER",
    "AttentionInputs",
    "Backend",
    "available_backends",
    "choose_backend",
    "get_backend",
    "register_backend",
    "resolve_backend",
    "use_backend",
]


@dataclass(frozen=True)
class AttentionInputs:
    """The canonical, validated arguments of one attention call (shapes in the module docstring)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    dropout_p: float
    is_causal: bool
    scale: float
    enable_gqa: bool

    @property
    def requires_grad(self) -> bool:
        """True when autograd will need gradients through this call."""
        tensors = (self.query, self.key, self.value, self.attn_mask)
        return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


@dataclass(frozen=True)
class Backend:
    """One registry entry.

    Attributes:
        name: the name users pass as ``backend=``.
        description: one line for listings and error messages.
        module: import path of the module holding the implementation (imported on first use).
        is_available: ``() -> (ok, reason)``: can this machine run it at all?
        supports: ``(AttentionInputs) -> reason or None``: can it handle these inputs?
        function: name of the implementation function inside ``module``.
        runs_on: ``(device_type) -> bool``: does it take tensors on this kind of device ("cpu", "cuda")?
            Every device by default.
        auto_ok: ``(AttentionInputs) -> bool``: may :func:`choose_backend` pick it for these inputs (a backend
            can run somewhere without being a good choice there, e.g. ``triton`` before sm_80)? Yes by default.
    """

    name: str
    description: str
    module: str
    is_available: Callable[[], tuple[bool, str]]
    supports: Callable[[AttentionInputs], str | None]
    function: str = "attention"
    runs_on: Callable[[str], bool] = lambda device_type: True
    auto_ok: Callable[[AttentionInputs], bool] = lambda inputs: True

    def load(self) -> Callable[..., torch.Tensor]:
        """Import the implementation (once) and return its function; later calls read a dict, which
        ``torch.compile`` traces (it will not trace ``importlib``)."""
        fn = _LOADED.get((self.module, self.function))
        if fn is None:
            fn = getattr(importlib.import_module(self.module), self.function)
            _LOADED[(self.module, self.function)] = fn
        return fn

    def run(self, inputs: AttentionInputs) -> torch.Tensor:
        """Run the implementation on canonical inputs; returns (B, Hq, L, Ev)."""
        fn = self.load()
        return fn(
            inputs.query, inputs.key, inputs.value, inputs.attn_mask,
            inputs.dropout_p, inputs.is_causal, inputs.scale, inputs.enable_gqa,
        )


_REGISTRY: dict[str, Backend] = {}
_LOADED: dict[tuple[str, str], Callable[..., torch.Tensor]] = {}  # (module, function) -> the function
_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("attention_backend", default=None)

#: The automatic choice tries these in order and takes the first that is available and supports the inputs.
AUTO_ORDER: tuple[str, ...] = ("torch", "reference")

#: Names the contract reserves for backends that are not registered (none left; kept for future entries).
_PLANNED: dict[str, str] = {}


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Add ``backend`` to the registry and return it; ``replace=True`` overrides an entry of the same name."""
    if not isinstance(backend, Backend):
        raise TypeError(f"backend must be a Backend, got {type(backend).__name__}")
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered; pass replace=True to override it")
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    """The registry entry called ``name``; ``ValueError`` listing the known names if there is none."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str (one of {sorted(_REGISTRY)}), got {type(name).__name__}")
    if name not in _REGISTRY:
        why = f": {_PLANNED[name]}" if name in _PLANNED else ""
        raise ValueError(f"unknown backend {name!r}{why}; known backends: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Names of the registered backends this machine can run, in registration order.

    Args:
        device: if given, only the backends that also take tensors on this kind of device, e.g.
            ``available_backends("cpu")`` leaves out ``triton`` and ``cuda`` on a GPU machine (they take CUDA
            tensors), and keeps ``triton`` on a CPU under ``TRITON_INTERPRET=1``.
    """
    kind = None if device is None else torch.device(device).type
    return [name for name, b in _REGISTRY.items() if b.is_available()[0] and (kind is None or b.runs_on(kind))]


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Make ``name`` the default backend inside a ``with`` block (``None``: back to the automatic choice).

    Nests and restores on exit (it is a :mod:`contextvars` variable, so threads and async tasks each see their
    own). A ``backend=`` argument to a call still wins.

    Example:
        >>> with use_backend("reference"):
        ...     out = scaled_dot_product_attention(q, k, v)  # doctest: +SKIP
    """
    if name is not None:
        _check_available(get_backend(name))
    token = _CURRENT.set(name)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def choose_backend(inputs: AttentionInputs) -> Backend:
    """The automatic choice: the first name in :data:`AUTO_ORDER` that can run here and handle ``inputs``.

    ======== ================ =============================================================
    device   chosen           why
    ======== ================ =============================================================
    CPU      ``torch``        fused CPU kernel in ATen; handles masks, GQA, dropout, grads;
                              measured faster than ``chunked`` on CPU (benchmarks/)
    CUDA     ``torch``        its flash / cuDNN / memory-efficient kernels. ``triton`` and
                              ``cuda`` run only when asked for by name: they have not yet
                              been timed against it on a GPU (benchmarks/NOTES.md). Even
                              if listed, ``triton`` is never chosen before sm_80 (a T4):
                              Triton uses no tensor cores there (its ``auto_ok``)
    other    ``torch``        ``reference`` if some future entry ahead of it declines
    ======== ================ =============================================================
    """
    for name in AUTO_ORDER:
        backend = _REGISTRY.get(name)
        if (backend is not None and backend.is_available()[0] and backend.supports(inputs) is None
                and backend.auto_ok(inputs)):
            return backend
    raise RuntimeError(f"no backend in {AUTO_ORDER} can run these inputs")  # unreachable: reference runs all


def resolve_backend(name: str | None, inputs: AttentionInputs) -> Backend:
    """The backend that runs a call: ``name``, else the :func:`use_backend` default, else automatic.

    Raises:
        ValueError: unknown name; a backend that cannot run on this machine; or one that cannot handle these
            inputs (the message gives the reason and the alternatives).
    """
    name = name if name is not None else _CURRENT.get()
    if name is None:
        return choose_backend(inputs)
    backend = get_backend(name)
    _check_available(backend)
    reason = backend.supports(inputs)
    if reason is not None:
        able = [n for n in available_backends() if _REGISTRY[n].supports(inputs) is None]
        raise ValueError(f"backend {name!r} cannot handle these inputs: {reason}; backends that can: {able}")
    return backend


def _check_available(backend: Backend) -> None:
    ok, reason = backend.is_available()
    if not ok:
        raise ValueError(
            f"backend {backend.name!r} cannot run on this machine: {reason}; "
            f"available here: {available_backends()}"
        )


# ----------------------------------------------------------------------------------------------- entries


def _always() -> tuple[bool, str]:
    return True, ""


def _numpy_available() -> tuple[bool, str]:
    if importlib.util.find_spec("numpy") is None:
        return False, "numpy is not installed"
    return True, ""


def _supports_all(inputs: AttentionInputs) -> str | None:
    return None


def _numpy_supports(inputs: AttentionInputs) -> str | None:
    if inputs.query.device.type == "meta":
        return "it computes on the tensors' values, and meta tensors have none"
    if inputs.requires_grad:
        return "it has no autograd (an input requires grad); use 'reference' or 'torch' for gradients"
    if inputs.dropout_p > 0:
        return f"it has no dropout (dropout_p={inputs.dropout_p}); it is a deterministic oracle"
    return None


def _chunked_supports(inputs: AttentionInputs) -> str | None:
    if inputs.dropout_p > 0:
        return f"it has no dropout (dropout_p={inputs.dropout_p})"
    mask = inputs.attn_mask
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        return "its backward does not compute a gradient for a float attn_mask (attn_mask.requires_grad)"
    return None


register_backend(Backend(
    "reference", "eager torch math: scores, masked softmax, weights @ value (any device; returns weights)",
    "attention_core.backends.reference", _always, _supports_all,
))
register_backend(Backend(
    "numpy", "float64 NumPy oracle (copies to the CPU; no autograd, no dropout)",
    "attention_core.backends.numpy_backend", _numpy_available, _numpy_supports,
))
register_backend(Backend(
    "torch", "torch.nn.functional.scaled_dot_product_attention (fused ATen kernels)",
    "attention_core.backends.torch_backend", _always, _supports_all,
))
register_backend(Backend(
    "chunked", "online softmax over key/value tiles in plain torch, recomputing backward (no dropout)",
    "attention_core.backends.chunked", _always, _chunked_supports,
))
# The fused kernels' checks live in a module that imports only torch: asking never imports Triton or compiles.
from attention_core.backends import fused_checks  # noqa: E402

register_backend(Backend(
    "triton", "FlashAttention-2 forward and backward in Triton (CUDA; the CPU under TRITON_INTERPRET=1)",
    "attention_core.backends.triton_flash", fused_checks.triton_available, fused_checks.triton_supports,
    runs_on=fused_checks.triton_runs_on, auto_ok=fused_checks.triton_worth_choosing,
))
register_backend(Backend(
    "cuda", "hand-written CUDA C++ flash forward, fp32 rows or tensor cores (WMMA), via load_inline",
    "attention_core.backends.cuda_flash", fused_checks.cuda_available, fused_checks.cuda_supports,
    runs_on=lambda device_type: device_type == "cuda",
))
# The backends written in plain torch import nothing heavy: load them now, so that a first call made under
# torch.compile finds them without an import.
for _name in ("reference", "torch", "chunked"):
    _REGISTRY[_name].load()
