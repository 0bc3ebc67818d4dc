"""Validation helpers shared by the public functions.

Every check raises ``TypeError`` (wrong kind of object) or ``ValueError`` (right kind, wrong shape or value)
with a message that names the argument, says what was seen and what was expected. The public functions call
these *before* any arithmetic, so a bad input never surfaces as a cryptic broadcast error from deep inside.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

Shape = Sequence[int]


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


def check_same_dtype(**tensors: torch.Tensor) -> None:
    """Raise ``TypeError`` unless every tensor has the dtype of the first one."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            seen = ", ".join(f"{n}.dtype={x.dtype}" for n, x in items)
            raise TypeError(f"{name} must have the dtype of {first_name} ({first.dtype}); got {seen}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless every tensor lives on the device of the first one."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            seen = ", ".join(f"{n} on {x.device}" for n, x in items)
            raise ValueError(f"{name} must be on the device of {first_name} ({first.device}); got {seen}")


def check_dropout(p: object, name: str = "dropout_p") -> float:
    """Return ``p`` as a float in ``[0, 1)``; raise otherwise (``p = 1`` would divide by zero)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{name} must be a float in [0, 1), got {type(p).__name__} {p!r}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {p!r}")
    return float(p)


def check_scale(scale: object, name: str = "scale") -> float | None:
    """Return ``scale`` as a float (or ``None``); raise unless it is a positive, finite number."""
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a positive float or None, got {type(scale).__name__} {scale!r}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be a positive, finite float or None, got {scale!r}")
    return float(scale)


def check_bool_flag(x: object, name: str) -> bool:
    """Raise ``TypeError`` unless ``x`` is a Python bool."""
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")
    return x


def check_positive_int(x: object, name: str, allow_zero: bool = False) -> int:
    """Return ``x`` if it is an int > 0 (or >= 0 with ``allow_zero``); raise otherwise."""
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")
    if x < 0 or (x == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {bound}, got {x}")
    return x


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
