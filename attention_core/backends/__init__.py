"""Attention backends: one signature, several implementations, one registry.

Every backend module exposes two functions beside each other::

    supports(inputs: AttentionInputs) -> str | None        # None: it can compute these inputs; else why not
    run(inputs: AttentionInputs) -> (out, weights | None)  # out (B, Hq, L, Ev); weights (B, Hq, L, S) if asked

and receives *canonical* inputs (:class:`~attention_core.backends.inputs.AttentionInputs`), validated once by
:func:`attention_core.scaled_dot_product_attention`, never again:

- ``query`` (B, Hq, L, E), ``key`` (B, H, S, E), ``value`` (B, H, S, Ev), one floating dtype, one device;
  ``Hq % H == 0``, and ``H == Hq`` unless ``enable_gqa``;
- ``attn_mask`` is ``None`` or 4-D and broadcasts to (B, Hq, L, S); bool (True = takes part) or float in the
  compute dtype (float32 for float16/bfloat16 queries, else the query's dtype), added to the scores in that
  precision, as torch's SDPA does; never given together with ``is_causal``;
- ``scale`` is a finite float, zero and negative included as in torch (the default ``1/sqrt(E)`` is already filled in);
- ``need_weights``: the caller wants the softmax weights too; only ``reference`` holds them.

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
where they cannot run, or with inputs they cannot take, raises a ``ValueError`` that says why. Their
``supports`` live beside them in :mod:`attention_core.backends.fused_checks`, which imports only torch, so that
asking never imports Triton or compiles anything; their ``run`` is reached through a two-line function below
that imports the kernel module on first use.

The registry is open: :func:`register_backend` adds an entry (a ``run`` function, or, the older form, the
import path of a module whose ``attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
enable_gqa)`` returns the output).

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
from typing import Callable, Union

import torch

from attention_core._checks import parse_device
from attention_core.backends import chunked, numpy_backend, reference, torch_backend
from attention_core.backends import fused_checks as _fused
from attention_core.backends.inputs import AttentionInputs, BackendResult

#: A backend's implementation: ``run(inputs) -> (out, weights | None)``
RunFn = Callable[[AttentionInputs], BackendResult]

__all__ = [
    "AUTO_ORDER",
    "AttentionInputs",
    "Backend",
    "BackendResult",
    "available_backends",
    "choose_backend",
    "get_backend",
    "register_backend",
    "resolve_backend",
    "use_backend",
]


@dataclass(frozen=True)
class Backend:
    """One registry entry.

    Attributes:
        name: the name users pass as ``backend=``.
        description: one line for listings and error messages.
        implementation: the backend's ``run(inputs) -> (out, weights | None)``; or (the older form) the import
            path of a module whose ``function`` has the SDPA argument order and returns the output only.
        is_available: ``() -> (ok, reason)``: can this machine run it at all?
        supports: ``(AttentionInputs) -> reason or None``: can it handle these inputs?
        function: with a module path as ``implementation``, the function's name in it.
        runs_on: ``(device_type) -> bool``: does it take tensors on this kind of device ("cpu", "cuda")?
            Every device by default.
        auto_ok: ``(AttentionInputs) -> bool``: may :func:`choose_backend` pick it for these inputs (a backend
            can run somewhere without being a good choice there, e.g. ``triton`` before sm_80)? Yes by default.
        score_bytes: for a backend that holds the whole (B, Hq, L, S) score matrix, the bytes per score it
            computes in, given the query's dtype (the registry refuses, before allocating, a call whose scores
            and weights cannot fit); ``None`` for backends that never hold it.
    """

    name: str
    description: str
    implementation: Union[RunFn, str]
    is_available: Callable[[], tuple[bool, str]]
    supports: Callable[[AttentionInputs], str | None]
    function: str = "attention"
    runs_on: Callable[[str], bool] = lambda device_type: True
    auto_ok: Callable[[AttentionInputs], bool] = lambda inputs: True
    score_bytes: Callable[[torch.dtype], int] | None = None

    def load(self) -> RunFn:
        """The ``run`` function (for the older form, the module is imported once and its function wrapped)."""
        if callable(self.implementation):
            return self.implementation
        fn = _LOADED.get((self.implementation, self.function))
        if fn is None:
            legacy = getattr(importlib.import_module(self.implementation), self.function)

            def fn(inputs: AttentionInputs) -> BackendResult:
                return legacy(*inputs.args()), None

            _LOADED[(self.implementation, self.function)] = fn
        return fn

    def run(self, inputs: AttentionInputs) -> BackendResult:
        """Run the implementation on canonical inputs: ``(out (B, Hq, L, Ev), weights (B, Hq, L, S) or None)``."""
        return self.load()(inputs)


_REGISTRY: dict[str, Backend] = {}
_LOADED: dict[tuple[str, str], RunFn] = {}  # older entries: (module, function) -> its run wrapper
_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("attention_backend", default=None)


class _Traced:
    """What ``torch.compile`` reads for the :func:`use_backend` default: Dynamo cannot trace ``ContextVar.get``,
    but it reads (and guards on) a plain attribute, so a compiled call recompiles when the default changes. It
    mirrors the innermost :func:`use_backend` block entered in any thread (eager calls read the ContextVar)."""

    name: str | None = None


_TRACED = _Traced()

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
    kind = None
    if device is not None:
        kind = parse_device(device, "device").type
    return [name for name, b in _REGISTRY.items() if b.is_available()[0] and (kind is None or b.runs_on(kind))]


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Make ``name`` the default backend inside a ``with`` block (``None``: back to the automatic choice).

    Nests and restores on exit (it is a :mod:`contextvars` variable, so threads and async tasks each see their
    own). A ``backend=`` argument to a call still wins.

    Example:
        >>> import torch
        >>> import attention_core as ac
        >>> q = k = v = torch.ones(1, 1, 2, 4)
        >>> with ac.use_backend("reference"):
        ...     out = ac.scaled_dot_product_attention(q, k, v)
        >>> out.shape
        torch.Size([1, 1, 2, 4])
    """
    if name is not None:
        _check_available(get_backend(name))
    token = _CURRENT.set(name)
    outer, _TRACED.name = _TRACED.name, name
    try:
        yield
    finally:
        _CURRENT.reset(token)
        _TRACED.name = outer


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

    ``inputs`` is an :class:`AttentionInputs` (``TypeError`` otherwise).
    """
    _check_inputs(inputs)
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
    _check_inputs(inputs)
    if name is None:
        name = _TRACED.name if torch.compiler.is_compiling() else _CURRENT.get()
    if name is None:
        return choose_backend(inputs)
    backend = get_backend(name)
    _check_available(backend)
    reason = backend.supports(inputs)
    if reason is not None:
        able = [n for n in available_backends() if _REGISTRY[n].supports(inputs) is None]
        raise ValueError(f"backend {name!r} cannot handle these inputs: {reason}; backends that can: {able}")
    return backend


def _check_inputs(inputs: object) -> None:
    if not isinstance(inputs, AttentionInputs):
        raise TypeError(f"inputs must be an AttentionInputs (the canonical 4-D call), got {type(inputs).__name__}")


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


def _compute_bytes(dtype: torch.dtype) -> int:
    """Bytes per score in the compute dtype: float32 for float16/bfloat16 inputs, else the input's."""
    return 4 if dtype in (torch.float16, torch.bfloat16) else torch.empty((), dtype=dtype).element_size()


def _run_triton(inputs: AttentionInputs) -> BackendResult:
    from attention_core.backends import triton_flash  # imports Triton: only when the backend first runs

    return triton_flash.run(inputs)


def _run_cuda(inputs: AttentionInputs) -> BackendResult:
    from attention_core.backends import cuda_flash  # compiles the extension at its first call

    return cuda_flash.run(inputs)


register_backend(Backend(
    "reference", "eager torch math: scores, masked softmax, weights @ value (any device; returns weights)",
    reference.run, _always, reference.supports, score_bytes=_compute_bytes,
))
register_backend(Backend(
    "numpy", "float64 NumPy oracle (copies to the CPU; no autograd, no dropout)",
    numpy_backend.run, _always, numpy_backend.supports, score_bytes=lambda dtype: 8,
))
register_backend(Backend(
    "torch", "torch.nn.functional.scaled_dot_product_attention (fused ATen kernels)",
    torch_backend.run, _always, torch_backend.supports,
))
register_backend(Backend(
    "chunked", "online softmax over key/value tiles in plain torch, recomputing backward (no dropout)",
    chunked.run, _always, chunked.supports,
))
register_backend(Backend(
    "triton", "FlashAttention-2 forward and backward in Triton (CUDA; the CPU under TRITON_INTERPRET=1)",
    _run_triton, _fused.triton_available, _fused.triton_supports,
    runs_on=_fused.triton_runs_on, auto_ok=_fused.triton_worth_choosing,
))
register_backend(Backend(
    "cuda", "hand-written CUDA C++ flash forward, fp32 rows or tensor cores (WMMA), via load_inline",
    _run_cuda, _fused.cuda_available, _fused.cuda_supports,
    runs_on=lambda device_type: device_type == "cuda",
))
