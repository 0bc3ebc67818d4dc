"""Checks the task models share at their public edge: config dicts, token ids and images.

Each raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (right kind, wrong shape, value or
device) naming the argument, what was seen and what was expected, before the model computes anything.
"""

from __future__ import annotations

from typing import Any, Collection, Dict, Mapping, Optional, Tuple

import torch

from attention_core._checks import check_module_input, check_tensor, fmt_shape, short_repr

__all__ = ["check_config", "check_images", "check_sequence_input", "check_state_tensors", "check_token_ids"]


def check_config(config: object, name: str, required: Collection[str], optional: Collection[str] = ()
                 ) -> Dict[str, Any]:
    """Return ``config`` as a dict; raise unless it is a mapping with every ``required`` key and no key outside
    ``required`` and ``optional``."""
    if not isinstance(config, Mapping):
        raise TypeError(f"{name} must be a dict of settings, got {type(config).__name__} {short_repr(config)}")
    missing = sorted(set(required) - set(config))
    if missing:
        raise ValueError(f"{name} lacks the keys {missing} (it has {sorted(config)}); expected "
                         f"{sorted(required)} and optionally {sorted(optional)}")
    unknown = sorted(set(config) - set(required) - set(optional), key=str)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; expected {sorted(required)} and optionally "
                         f"{sorted(optional)}")
    return dict(config)


def check_token_ids(tokens: object, name: str, vocab_size: int, device: Optional[torch.device] = None,
                    dtypes: Collection[torch.dtype] = (torch.int64,), rank: int = 2,
                    what: str = "the model") -> torch.Tensor:
    """Return ``tokens`` if it is a tensor of ids in ``[0, vocab_size)`` with ``rank`` dimensions ((B, L), or
    (L,) for ``rank=1``), a dtype of ``dtypes`` and on ``device`` (``what``'s); raise otherwise."""
    check_tensor(tokens, name)
    if tokens.dtype not in dtypes:
        raise TypeError(f"{name} must hold integer token ids ({', '.join(str(d) for d in dtypes)}), got dtype "
                        f"{tokens.dtype}")
    if tokens.dim() != rank:
        layout = {1: "(L,)", 2: "(B, L)"}.get(rank, f"{rank}-D")
        raise ValueError(f"{name} must be {layout} token ids, got shape {fmt_shape(tokens.shape)}")
    if device is not None and tokens.device != device:
        raise ValueError(f"{name} is on {tokens.device} but {what} is on {device}; move one of them")
    if tokens.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor: it has no ids to look up")
    if tokens.numel():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must be ids in [0, {vocab_size}) (vocab_size = {vocab_size}), got values "
                             f"from {lo} to {hi}")
    return tokens


def check_images(images: object, name: str, channels: int, size: tuple, weight: torch.Tensor) -> torch.Tensor:
    """Return ``images`` if it is a floating (B, channels, H, W) tensor with ``(H, W) == size``, of the dtype
    and on the device of the model's ``weight``; raise otherwise (a module never casts its input: a float64
    model takes float64 images and answers in float64)."""
    check_tensor(images, name)
    if not images.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype (pixel values), got {images.dtype}; convert it "
                        f"with {name}.to({weight.dtype})")
    if images.dim() != 4 or images.shape[1] != channels or tuple(images.shape[-2:]) != tuple(size):
        raise ValueError(f"{name} must be (B, {channels}, {size[0]}, {size[1]}), got shape {fmt_shape(images.shape)}")
    check_module_input(images, name, weight)
    return images


def check_sequence_input(x: object, name: str, weight: torch.Tensor) -> torch.Tensor:
    """Return ``x`` if it is a (B, L, D) tensor with D = ``weight.shape[1]`` (an input projection's weight), of
    that weight's dtype and device; raise otherwise."""
    check_tensor(x, name)
    check_module_input(x, name, weight)
    if x.dim() != 3 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{name} must be (B, L, D) with D = embed_dim = {weight.shape[1]}, got "
                         f"{fmt_shape(x.shape)}")
    return x


def check_state_tensors(state: object, name: str, kind: type, shapes: Mapping[str, Tuple[int, ...]],
                        weight: torch.Tensor) -> None:
    """Raise unless ``state`` is a ``kind`` whose tensor fields named in ``shapes`` have those shapes and
    ``weight``'s dtype and device (a layer's carried state or cache, for a batch the shapes already hold)."""
    if not isinstance(state, kind):
        article = "an" if kind.__name__[0] in "AEIOU" else "a"
        raise TypeError(f"{name} must be {article} {kind.__name__} or None, got {type(state).__name__}")
    for field, shape in shapes.items():
        t = getattr(state, field)
        check_tensor(t, f"{name}.{field}")
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}.{field} must have shape {tuple(shape)} for this layer and a batch of "
                             f"{shape[0]}, got {fmt_shape(t.shape)}")
        check_module_input(t, f"{name}.{field}", weight)
