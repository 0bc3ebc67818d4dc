"""The non-finite policy of :func:`attention_core.scaled_dot_product_attention`, applied at the public edge.

The policy and the argument for it are in that function's docstring. In short: a NaN or inf in the inputs
makes NaN exactly the output rows that read it, in every backend. Each backend is left to compute on clean
inputs; this module finds the bad entries, zeroes them, and says which rows to turn into NaN afterwards::

    eager CPU tensors: all finite? (one sum per input)  --yes-->  nothing to do (the common case)
        | no, or a GPU, torch.compile or a torch.func transform (no branch on a tensor's value there)
        v
    bad rows of q (B, Hq, L), of k and v (B, H, S); pairs the mask or is_causal lets each row read
    poisoned rows = (bad query | reads a bad key, value or mask entry) & reads at least one key
    q, k, v with every non-finite entry set to 0; a float mask's NaN and +inf set to 0 (its -inf kept)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from attention_core.masks import causal_mask

__all__ = ["Poison", "all_finite", "check_on_host", "clean_and_poison", "empty_result"]


class Poison(NamedTuple):
    """What to add to the results: NaN in the rows the policy poisons, 0 elsewhere; (B, Hq, L, 1) each."""

    weights: torch.Tensor  # rows whose query, a key they read, or one of their float mask entries is bad
    out: torch.Tensor  # those, and the rows that read a bad value row


def all_finite(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None, attn_mask: torch.Tensor | None
) -> torch.Tensor:
    """A 0-d bool tensor: no NaN or inf anywhere, except a float mask's -inf (it removes a key).

    A sum is NaN or inf whenever one of its terms is, and it is one reduction with nothing allocated (an
    ``isfinite`` tensor costs several times more). A finite tensor whose sum overflows only sends the call
    down the slower path, which then finds nothing to do. Reading the answer as a Python bool is the caller's
    choice (see :func:`check_on_host`): it is free for CPU tensors, a synchronisation on a GPU, and a graph break
    under ``torch.compile`` or ``torch.func`` transforms.
    """
    sums = [t.sum(dtype=torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None)
            for t in (query, key, value) if t is not None and t.numel()]
    ok = torch.isfinite(torch.stack(sums)).all() if sums else torch.ones((), dtype=torch.bool)
    if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.numel():
        ok = ok & (attn_mask.amax() < math.inf)  # amax propagates NaN; NaN < inf and inf < inf are False
    return ok


def check_on_host(*tensors: torch.Tensor | None) -> bool:
    """May the policy look at :func:`all_finite`'s answer in Python (and skip the cleaning when it is true)?

    Only for eager CPU tensors: there the answer is already on the host (no synchronisation). On a GPU it would
    stall the host until the kernels finish, and under ``torch.compile`` or ``torch.func.vmap``/``grad`` a
    Python branch on a tensor's value cannot be traced: there the policy runs as tensor operations only
    (:func:`clean_and_poison` on every call, whose NaN rows add zero when nothing is wrong).
    """
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu" or torch._C._functorch.is_functorch_wrapped_tensor(t):
            return False
    return True


def clean_and_poison(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, Poison]:
    """Canonical inputs (see :mod:`attention_core.backends`) with their non-finite entries zeroed, and the
    :class:`Poison` to add to the results. The output must have at least one element (so ``H >= 1``)."""
    B, Hq, L, _ = query.shape
    H, S = key.shape[-3], key.shape[-2]
    group = Hq // H
    if is_causal:
        reads = causal_mask(L, S, device=query.device)  # (L, S): True = query i reads key j
    elif attn_mask is None:
        reads = torch.ones(1, S, dtype=torch.bool, device=query.device)  # (1, S): every key
    elif attn_mask.dtype == torch.bool:
        reads = attn_mask  # (B?, Hq?, L?, S?)
    else:
        reads = attn_mask != -math.inf
    reads = reads.expand(*reads.shape[:-1], S)  # a mask of one column broadcasts over S keys, even S = 0
    bad_q = ~torch.isfinite(query).all(-1, keepdim=True)  # (B, Hq, L, 1)
    bad_k = ~torch.isfinite(key).all(-1)  # (B, H, S)
    bad_pair = bad_k.repeat_interleave(group, dim=1)[:, :, None, :]  # (B, H, S) -> (B, Hq, 1, S)
    if attn_mask is not None and attn_mask.is_floating_point():
        bad_pair = bad_pair | ~(attn_mask < math.inf)  # NaN or +inf in the mask, (B?, Hq?, L?, S?)
    alive = reads.any(-1, keepdim=True)  # (..., L?, 1): the row reads at least one key
    poison_w = (bad_q | (bad_pair & reads).any(-1, keepdim=True)) & alive  # (B, Hq, L, 1)
    poison_out = poison_w
    if value is not None:
        bad_v = ~torch.isfinite(value).all(-1)  # (B, H, S)
        bad_v = bad_v.repeat_interleave(group, dim=1)[:, :, None, :]  # (B, H, S) -> (B, Hq, 1, S)
        poison_out = poison_w | ((bad_v & reads).any(-1, keepdim=True) & alive)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.masked_fill(~(attn_mask < math.inf), 0.0)  # the row is poisoned anyway

    def clean(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    def nan_rows(rows: torch.Tensor) -> torch.Tensor:
        return torch.zeros(rows.shape, dtype=query.dtype, device=query.device).masked_fill(rows, math.nan)

    poison = Poison(weights=nan_rows(poison_w), out=nan_rows(poison_out))
    return clean(query), clean(key), clean(value), attn_mask, poison


def empty_result(shape: tuple[int, ...], *inputs: torch.Tensor) -> torch.Tensor:
    """A result with no elements, computed by no backend, but on autograd's graph (with zero gradients)."""
    out = inputs[0].new_zeros(shape)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        out = out + sum(t.sum() for t in inputs if t.requires_grad) * 0  # a 0-d term: the shape stays
    return out
