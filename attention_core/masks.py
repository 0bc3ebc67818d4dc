"""Masks, and the conversions between the conventions people use for them.

The library speaks one convention, PyTorch SDPA's:

- a **bool** mask is True where a (query, key) pair *takes part*;
- a **float** ("additive") mask is added to the scores: 0 keeps a pair, ``-inf`` removes it.

Other vocabularies are converted here, at the edge: valid lengths (d2l's ``valid_lens``) with
:func:`padding_mask`, and ``torch.nn.MultiheadAttention``'s *opposite* bool convention (True = NOT allowed)
with :func:`to_torch_mha_mask` / :func:`from_torch_mha_mask`.

Every mask here is the dense form of a predicate of :mod:`attention_core.mask_mods` (the mask language that
:func:`attention_core.flex_attention.create_block_mask` turns into tiles): :func:`causal_mask` is ``causal``,
:func:`sliding_window_mask` is ``sliding_window``.

All positions are aligned upper-left: query ``i`` and key ``j`` count from 0 at the start of their sequences,
as in ``torch.tril(torch.ones(L, S))``, which is what SDPA's ``is_causal`` means.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

from attention_core import mask_mods
from attention_core._checks import (
    broadcast_or_none,
    check_bool_flag,
    check_device,
    check_fits,
    check_floating_dtype,
    check_positive_int,
    check_tensor,
    fmt_shape,
    short_repr,
)
from attention_core.mask_mods import dense_mask

__all__ = [
    "causal_mask",
    "combine_masks",
    "from_torch_mha_mask",
    "padding_mask",
    "sliding_window_mask",
    "to_additive_mask",
    "to_bool_mask",
    "to_torch_mha_mask",
]

Device = Union[torch.device, str, None]


def causal_mask(L: int, S: int | None = None, *, device: Device = None) -> torch.Tensor:
    """Bool (L, S) mask, True where key ``j <= i`` (query ``i`` sees itself and the past), upper-left aligned.

    Args:
        L: number of queries.
        S: number of keys; defaults to ``L``.
        device: where to allocate.

    Returns:
        Bool tensor (L, S); the same as SDPA's ``is_causal=True``.

    Example:
        >>> causal_mask(3).int()
        tensor([[1, 0, 0],
                [1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
    """
    L = check_positive_int(L, "L", allow_zero=True)
    S = L if S is None else check_positive_int(S, "S", allow_zero=True)
    device = check_device(device)
    _check_numel(L, S, "causal_mask's (L, S)")
    return dense_mask(mask_mods.causal, 1, 1, L, S, device)[0, 0]  # the causal mod on every pair


def sliding_window_mask(
    L: int, window: int, S: int | None = None, *, causal: bool = True, device: Device = None
) -> torch.Tensor:
    """Bool (L, S) local-attention mask (Longformer, Mistral), upper-left aligned like :func:`causal_mask`.

    - ``causal=True``: query ``i`` sees the ``window`` most recent keys, itself included:
      ``i - window < j <= i``.
    - ``causal=False``: query ``i`` sees ``window // 2`` keys on each side and itself:
      ``|i - j| <= window // 2``
      (Longformer's "w/2 on each side").

    Args:
        L: number of queries.
        window: window size, ``>= 1``.
        S: number of keys; defaults to ``L``.
        causal: one-sided (True) or two-sided (False) window.
        device: where to allocate.

    Returns:
        Bool tensor (L, S), True = attend.
    """
    L = check_positive_int(L, "L", allow_zero=True)
    window = check_positive_int(window, "window")
    S = L if S is None else check_positive_int(S, "S", allow_zero=True)
    check_bool_flag(causal, "causal")
    device = check_device(device)
    _check_numel(L, S, "sliding_window_mask's (L, S)")
    return dense_mask(mask_mods.sliding_window(window, causal), 1, 1, L, S, device)[0, 0]  # (L, S)


def padding_mask(
    valid_lens: Sequence[int] | torch.Tensor, max_len: int, *, device: Device = None
) -> torch.Tensor:
    """Bool (B, max_len) mask, True at the first ``valid_lens[b]`` positions of row ``b`` (the real tokens).

    To use it in attention, broadcast it to (B, H, L, S):

    - as a **key** mask (padding keys are never attended to): ``mask[:, None, None, :]`` -> (B, 1, 1, S);
    - as a **query** mask (padding queries attend to nothing, so their rows come out as zeros):
      ``mask[:, None, :, None]`` -> (B, 1, L, 1).

    Args:
        valid_lens: B lengths, each in ``[0, max_len]`` (a list or a 1-D integer tensor).
        max_len: the padded length.
        device: where to allocate (default: ``valid_lens``' device, or the CPU for a list).

    Returns:
        Bool tensor (B, max_len).
    """
    max_len = check_positive_int(max_len, "max_len", allow_zero=True)
    device = check_device(device)
    if isinstance(valid_lens, torch.Tensor):
        if (valid_lens.dim() != 1 or valid_lens.is_floating_point() or valid_lens.is_complex()
                or valid_lens.dtype == torch.bool):
            raise ValueError(
                f"valid_lens must be a 1-D integer tensor (B,), got shape {fmt_shape(valid_lens.shape)} "
                f"and dtype {valid_lens.dtype}"
            )
        lens = valid_lens.to(device=device) if device is not None else valid_lens
    elif isinstance(valid_lens, (list, tuple)) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in valid_lens
    ):
        if any(not 0 <= n <= max_len for n in valid_lens):
            raise ValueError(f"valid_lens must lie in [0, max_len={max_len}], got {short_repr(list(valid_lens))}")
        lens = torch.tensor(list(valid_lens), dtype=torch.long, device=device)
    else:
        raise TypeError(
            f"valid_lens must be a list of ints or a 1-D integer tensor, got {short_repr(valid_lens)}"
        )
    _check_numel(lens.shape[0], max_len, "padding_mask's (len(valid_lens), max_len)")
    # a meta tensor has no values to check: its (meta) result has the right shape all the same
    if lens.numel() and lens.device.type != "meta" and (int(lens.min()) < 0 or int(lens.max()) > max_len):
        raise ValueError(f"valid_lens must lie in [0, max_len={max_len}], got {short_repr(lens.tolist())}")
    positions = torch.arange(max_len, device=lens.device)  # (S,)
    return positions[None, :] < lens[:, None]  # (1, S) < (B, 1) -> (B, S)


def _check_numel(L: int, S: int, what: str) -> None:
    """Refuse, before allocating, an (L, S) bool mask that cannot fit in memory (or a tensor): ``TooLargeError``
    naming ``what``, the function and its two sizes, e.g. ``"causal_mask's (L, S)"``."""
    check_fits(L * S, f"{what} = ({L}, {S}) bool mask", "cpu")  # one byte per entry


def combine_masks(*masks: torch.Tensor | None) -> torch.Tensor | None:
    """Combine masks that must all hold: bool masks are AND-ed, float masks added (``None`` entries skipped).

    A mix of bool and float masks gives a float mask (the bool ones become 0 / -inf in the float dtype).
    The result has the broadcast shape of the inputs; ``None`` if every input is ``None``.
    """
    named = {f"masks[{i}]": check_tensor(m, f"masks[{i}]") for i, m in enumerate(masks) if m is not None}
    if not named:
        return None
    for name, m in named.items():
        if m.dtype != torch.bool and not m.is_floating_point():
            raise TypeError(f"{name} must be bool (True = attend) or floating (added), got dtype {m.dtype}")
    seen = ", ".join(f"{n} {fmt_shape(m.shape)} on {m.device}" for n, m in named.items())
    if broadcast_or_none(*(m.shape for m in named.values())) is None:
        raise ValueError(f"masks must broadcast to one shape, got {seen}")
    if len({m.device for m in named.values()}) > 1:
        raise ValueError(f"masks must be on one device, got {seen}")
    present = list(named.values())
    floats = [m for m in present if m.is_floating_point()]
    if not floats:
        out = present[0]
        for m in present[1:]:
            out = out & m
        return out
    dtype = floats[0].dtype
    out = None
    for m in present:
        term = m.to(dtype) if m.is_floating_point() else to_additive_mask(m, dtype=dtype)
        out = term if out is None else out + term
    return out


def to_additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bool (True = attend) to float: True -> 0, False -> ``-inf``; a float mask comes back cast to ``dtype``.

    Args:
        mask: bool or float tensor of any shape.
        dtype: floating dtype of the result.

    Returns:
        Float tensor of ``mask``'s shape.
    """
    check_tensor(mask, "mask")
    check_floating_dtype(dtype)
    if mask.dtype == torch.bool:
        zeros = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return zeros.masked_fill(~mask, float("-inf"))
    if mask.is_floating_point():
        return mask.to(dtype)
    raise TypeError(f"mask must be bool or floating, got dtype {mask.dtype}")


def to_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Float additive mask to bool (True = attend): ``-inf`` -> False, ``0`` -> True. Bool passes through.

    Only masks made of 0 and ``-inf`` are masks in the bool sense; a float mask with other values (say
    ``-1e9``, or a learned bias) is an additive *bias*, and converting it would silently change the result,
    so it raises ``ValueError``.
    """
    check_tensor(mask, "mask")
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        raise TypeError(f"mask must be bool or floating, got dtype {mask.dtype}")
    removed = mask == float("-inf")
    odd = ~removed & (mask != 0)
    if mask.device.type != "meta" and bool(odd.any()):  # a meta tensor has no values to check
        raise ValueError(
            f"mask must hold only 0 and -inf to become a bool mask, got e.g. {mask[odd][:3].tolist()} "
            "(an additive bias has no bool equivalent)"
        )
    return ~removed


def to_torch_mha_mask(mask: torch.Tensor) -> torch.Tensor:
    """SDPA convention -> ``torch.nn.MultiheadAttention``'s: bool masks inverted (True = NOT allowed there).

    Float masks mean the same in both conventions and are returned unchanged. Use it for ``attn_mask`` and
    ``key_padding_mask`` alike when calling ``torch.nn.MultiheadAttention``.
    """
    check_tensor(mask, "mask")
    if mask.dtype == torch.bool:
        return ~mask
    if mask.is_floating_point():
        return mask
    raise TypeError(f"mask must be bool or floating, got dtype {mask.dtype}")


def from_torch_mha_mask(mask: torch.Tensor) -> torch.Tensor:
    """``torch.nn.MultiheadAttention``'s convention -> SDPA's (the inverse of :func:`to_torch_mha_mask`).

    Inverting a bool mask is its own inverse, so this is the same conversion, named for the direction.
    """
    return to_torch_mha_mask(mask)
