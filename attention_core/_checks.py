"""Validation helpers shared by the public functions.

Every check raises ``TypeError`` (wrong kind of object) or ``ValueError`` (right kind, wrong shape or value)
with a message that names the argument, says what was seen and what was expected. The public functions call
these *before* any arithmetic, so a bad input never surfaces as a cryptic broadcast error from deep inside.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence

import torch

Shape = Sequence[int]

#: The largest size a tensor dimension can have (torch stores sizes as int64).
MAX_SIZE = 2**63 - 1


def short_repr(x: object, limit: int = 60) -> str:
    """``repr(x)``, cut to ``limit`` characters (a 400-digit int or a big tensor must not flood a message)."""
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_real(x: object) -> bool:
    """A real number: int, float or a NumPy scalar, but not a bool (``True`` is an int to Python)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def fmt_shape(shape: Shape) -> str:
    """``(2, 3)`` for a shape; ``(5,)`` for one dimension, ``()`` for a scalar."""
    dims = tuple(int(d) for d in shape)
    return str(dims)


def check_tensor(x: object, name: str) -> torch.Tensor:
    """Return ``x`` if it is a tensor, else raise ``TypeError`` naming ``name``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def check_floating(x: torch.Tensor, name: str) -> None:
    """Raise ``TypeError`` unless ``x`` has a floating-point dtype."""
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")


def check_min_rank(x: torch.Tensor, name: str, min_rank: int, layout: str) -> None:
    """Raise ``ValueError`` unless ``x.dim() >= min_rank``; ``layout`` describes the expected shape."""
    if x.dim() < min_rank:
        raise ValueError(
            f"{name} must have at least {min_rank} dims {layout}, got shape {fmt_shape(x.shape)} "
            f"({x.dim()} dims)"
        )


def check_rank(x: torch.Tensor, name: str, ranks: Sequence[int], layout: str) -> None:
    """Raise ``ValueError`` unless ``x.dim()`` is in ``ranks``; ``layout`` describes the expected shape."""
    if x.dim() not in ranks:
        raise ValueError(
            f"{name} must be {layout}, got shape {fmt_shape(x.shape)} ({x.dim()} dims)"
        )


def _check_same(attr: str, error: type, tensors: dict, what: str, seen_as: str) -> None:
    """Raise ``error`` unless every tensor's ``attr`` equals the first one's; ``what`` names the property in the
    message ("have the dtype of", "be on the device of") and ``seen_as`` formats one tensor ("{n}.dtype={v}")."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if getattr(t, attr) != getattr(first, attr):
            seen = ", ".join(seen_as.format(n=n, v=getattr(x, attr)) for n, x in items)
            raise error(f"{name} must {what} {first_name} ({getattr(first, attr)}); got {seen}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    """Raise ``TypeError`` unless every tensor has the dtype of the first one."""
    _check_same("dtype", TypeError, tensors, "have the dtype of", "{n}.dtype={v}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every tensor lives on the device of the first one."""
    _check_same("device", ValueError, tensors, "be on the device of", "{n} on {v}")


def check_dropout(p: object, name: str = "dropout_p", *, allow_one: bool = False) -> float:
    """Return ``p`` as a float in ``[0, 1)`` (``[0, 1]`` with ``allow_one``: every weight dropped, as torch's
    SDPA and ``F.dropout`` allow, which give zeros); raise otherwise."""
    interval = "[0, 1]" if allow_one else "[0, 1)"
    if not _is_real(p):
        raise TypeError(f"{name} must be a float in {interval}, got {type(p).__name__} {short_repr(p)}")
    if not (0.0 <= p < 1.0 or (allow_one and p == 1.0)):
        raise ValueError(f"{name} must be in {interval}, got {short_repr(p)}")
    return float(p)


def real_to_float(x: object) -> float:
    """``float(x)`` for a real number, with an int beyond float's range read as ``inf`` (then refused by the
    finiteness checks with a message that names the argument, rather than an ``OverflowError``)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf


def check_positive_float(x: object, name: str, *, allow_zero: bool = False) -> float:
    """Return ``x`` as a float; raise unless it is a finite number > 0 (>= 0 with ``allow_zero``)."""
    bound = ">= 0" if allow_zero else "> 0"
    if not _is_real(x):
        raise TypeError(f"{name} must be a finite float {bound}, got {type(x).__name__} {short_repr(x)}")
    value = real_to_float(x)
    if not (math.isfinite(value) and (value > 0 or (allow_zero and value == 0))):
        raise ValueError(f"{name} must be a finite float {bound}, got {short_repr(x)}")
    return value


def check_scale(scale: object, name: str = "scale", *, positive: bool = True) -> float | None:
    """Return ``scale`` as a float (or ``None``); raise unless it is a finite number, > 0 if ``positive``
    (SDPA itself takes any finite scale, as torch's does: 0 gives uniform weights, a negative one reverses
    the ranking)."""
    kind = "a positive" if positive else "a finite"
    if scale is None:
        return None
    if not _is_real(scale):
        raise TypeError(f"{name} must be {kind} float or None, got {type(scale).__name__} {short_repr(scale)}")
    value = real_to_float(scale)
    if not (math.isfinite(value) and (value > 0 or not positive)):
        raise ValueError(f"{name} must be {kind}{', finite' if positive else ''} float or None, "
                         f"got {short_repr(scale)}")
    return value


def check_instance(x: object, kinds: type | tuple, name: str, what: str) -> object:
    """Return ``x`` if it is an instance of ``kinds``, else raise ``TypeError``: ``"{name} must be {what}, got
    {type}"``. For helpers that take an object a checked call made (a model, a batch, a trace)."""
    if not isinstance(x, kinds):
        raise TypeError(f"{name} must be {what}, got {type(x).__name__} {short_repr(x)}")
    return x


def check_bool_flag(x: object, name: str) -> bool:
    """Raise ``TypeError`` unless ``x`` is a Python bool."""
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")
    return x


def check_positive_int(x: object, name: str, allow_zero: bool = False) -> int:
    """Return ``x`` if it is an int >= 1 (>= 0 with ``allow_zero``) that fits a tensor size; raise otherwise.

    :func:`check_int` with ``low=1`` (``low=0``) and the largest tensor size as its upper bound, in its one form:
    ``"{name} must be an int >= 1, got ..."``.
    """
    x = check_int(x, name, low=0 if allow_zero else 1)
    if x > MAX_SIZE:
        check_int(x, name, low=0 if allow_zero else 1, high=MAX_SIZE, note="(2**63 - 1, the largest tensor size)")
    return x


def _range_text(low: object, high: object, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high}"
    return ""


def check_int(x: object, name: str, *, low: int | None = None, high: int | None = None,
              high_open: bool = False, note: str = "") -> int:
    """Return ``x`` if it is an int (a bool is not) in ``[low, high]`` (``[low, high)`` with ``high_open``).

    Raises ``TypeError`` for another type and ``ValueError`` for a value out of range, both in one form:
    ``"{name} must be an int >= 1 {note}, got ..."`` (the range as the bounds give it; ``note`` says what the
    number is, e.g. ``"(the half-width D)"``), with the type seen in the ``TypeError``.
    """
    want = " ".join(w for w in ("an int", _range_text(low, high, False, high_open), note) if w)
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be {want}, got {type(x).__name__} {short_repr(x)}")
    if (low is not None and x < low) or (high is not None and (x >= high if high_open else x > high)):
        raise ValueError(f"{name} must be {want}, got {short_repr(x)}")
    return x


def check_real(x: object, name: str, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False) -> float:
    """Return ``x`` as a float if it is a finite real number (a bool is not) in the given range.

    ``low_open`` / ``high_open`` exclude the bound. Raises ``TypeError`` for another type and ``ValueError`` for a
    NaN, an infinity or a value out of range, both in one form: ``"{name} must be a finite float > 1, got ..."``.
    """
    kind = "a float" if low is not None and high is not None else "a finite float"  # both bounds: finite said
    want = " ".join(w for w in (kind, _range_text(low, high, low_open, high_open)) if w)
    if not _is_real(x):
        raise TypeError(f"{name} must be {want}, got {type(x).__name__} {short_repr(x)}")
    value = real_to_float(x)
    bad = not math.isfinite(value)
    bad = bad or (low is not None and (value <= low if low_open else value < low))
    bad = bad or (high is not None and (value >= high if high_open else value > high))
    if bad:
        raise ValueError(f"{name} must be {want}, got {short_repr(x)}")
    return value


def check_floating_dtype(dtype: object, name: str = "dtype") -> torch.dtype:
    """Return ``dtype`` if it is a floating ``torch.dtype``; raise ``TypeError`` otherwise."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"{name} must be a floating torch.dtype (torch.float16, torch.bfloat16, torch.float32 or "
            f"torch.float64), got {short_repr(dtype)}"
        )
    return dtype


def parse_device(device: object, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device``, whether or not this machine has one (for functions that only ask about
    a kind of device). ``TypeError`` unless it is a ``torch.device`` or a str, ``ValueError`` for a str that
    names no device kind torch knows (``"tpu"``)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda', got "
                        f"{type(device).__name__} {short_repr(device)}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda', got "
                         f"{short_repr(device)} ({reason})") from None


def check_device(device: object, name: str = "device") -> torch.device | None:
    """Return ``device`` as a ``torch.device`` (``None`` stays ``None``); raise unless this machine has it.

    ``TypeError`` for something that is not a device at all, ``ValueError`` for a device this machine cannot
    allocate on (``"cuda"`` without a GPU, ``"mps"`` off a Mac, an unknown name).
    """
    if device is None:
        return None
    if not isinstance(device, (str, int, torch.device)) or isinstance(device, bool):
        raise TypeError(f"{name} must be a torch.device, a str such as 'cpu', an accelerator index or None, got "
                        f"{type(device).__name__} {short_repr(device)}")
    try:
        dev = torch.device(device)
        if dev.type not in ("cpu", "meta"):
            torch.empty(0, device=dev)  # the only reliable "can I allocate there?" across accelerator kinds
    except (RuntimeError, AssertionError, NotImplementedError, OverflowError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"{name} {short_repr(device)} cannot be used on this machine: {reason}") from None
    return dev


def check_module_input(x: torch.Tensor, name: str, weight: torch.Tensor) -> None:
    """Raise unless ``x`` has the dtype (``TypeError``) and device (``ValueError``) of a module's ``weight``.

    A module never casts its input: a float64 tensor into a float32 module would silently lose digits, and a
    float16 one would be silently promoted. Convert one or the other (``x.float()``, ``module.double()``).
    """
    check_floating(x, name)
    if x.dtype != weight.dtype:
        raise TypeError(
            f"{name} has dtype {x.dtype} but the module's parameters are {weight.dtype}; convert one of them "
            f"(e.g. {name}.to({weight.dtype}) or module.to({x.dtype}))"
        )
    if x.device != weight.device:
        raise ValueError(
            f"{name} is on {x.device} but the module's parameters are on {weight.device}; move one of them"
        )


def broadcast_or_none(*shapes: Shape) -> torch.Size | None:
    """The broadcast of ``shapes``, or ``None`` when they do not broadcast."""
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return None


def check_mask_broadcasts(mask: torch.Tensor, name: str, target: Shape, target_desc: str) -> None:
    """Raise ``ValueError`` unless ``mask`` broadcasts to ``target`` without growing it.

    Args:
        mask: the mask tensor.
        name: argument name used in the message.
        target: the shape the mask must broadcast to, e.g. ``(B, Hq, L, S)``.
        target_desc: how the target is spelled in the message, e.g. ``"(..., Hq, L, S)"``.
    """
    target = tuple(int(d) for d in target)
    if mask.dim() > len(target) or broadcast_or_none(mask.shape, target) != torch.Size(target):
        raise ValueError(
            f"{name} of shape {fmt_shape(mask.shape)} does not broadcast to the scores' shape "
            f"{target_desc} = {fmt_shape(target)}"
        )


class TooLargeError(ValueError, MemoryError):
    """A size that cannot fit, found before allocating anything: both a ``ValueError`` (a bad argument) and a
    ``MemoryError`` (what allocating would have raised, after a long wait or the system's OOM killer)."""


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


_CPU_BYTES = _physical_memory()  # read once, at import: torch.compile does not trace os.sysconf


def _device_bytes(device: torch.device) -> int | None:
    """Memory of ``device`` in bytes (physical memory for the CPU), or ``None`` when unknown."""
    if device.type == "cpu":
        return _CPU_BYTES
    if device.type == "cuda" and not torch.compiler.is_compiling():
        return torch.cuda.get_device_properties(device).total_memory
    return None


def check_fits(nbytes: int, what: str, device: torch.device | str) -> None:
    """Raise :class:`TooLargeError` naming ``what`` and its size when ``nbytes`` exceed the device's memory
    (or what a tensor can index), instead of letting the allocation fail or swap."""
    device = torch.device(device)
    total = _device_bytes(device)
    if nbytes > 2**63 - 1 or (total is not None and nbytes > total):
        limit = "what a tensor can hold" if total is None else f"{total / 2**30:.1f} GiB of memory on {device}"
        raise TooLargeError(f"{what} would take {nbytes / 2**30:,.1f} GiB, more than {limit}")


def check_tensors_fit(who: str, **tensors: torch.Tensor | None) -> None:
    """Raise :class:`TooLargeError` for a tensor whose elements, as the computation reads them, would not fit in
    its device's memory: a stride-0 view (``torch.zeros(1, 8).expand(2**40, 8)``) costs nothing to make but
    stands for terabytes that every reduction and copy walks element by element (hours, before any answer)."""
    for name, t in tensors.items():
        if t is not None:
            check_fits(t.numel() * t.element_size(),
                       f"{who}'s {name} of shape {fmt_shape(t.shape)} ({t.numel():,} elements, as read)", t.device)
