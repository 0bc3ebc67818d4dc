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
    (with no mask, no is_causal and no gradient to compute, q, k, v are passed on as they are: see the end of
    clean_and_poison)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["Poison", "all_finite", "bad_rows", "check_on_host", "clean_and_poison", "empty_result", "nan_rows",
           "zero_nonfinite"]


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
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    bad_q = bad_rows(query)[..., None]  # (B, Hq, L, 1)
    bad_kv = bad_rows(key)  # (B, H, S): per key, and with value's as a second column
    bad_kv = torch.stack([bad_kv, bad_rows(value)], dim=-1) if value is not None else bad_kv[..., None]
    bad_kv = bad_kv.repeat_interleave(group, dim=1).to(torch.float32)  # (B, H, S, c) -> (B, Hq, S, c), 0 or 1
    # Which rows read a bad key or value row, without an (L, S) pass where the mask's shape allows it:
    if S == 0:
        reads_bad = bad_kv.new_zeros((B, Hq, 1, bad_kv.shape[-1])) > 0  # nothing is read
        alive = torch.zeros((), dtype=torch.bool, device=query.device)
    elif is_causal:  # upper-left: row i reads keys 0 .. min(i, S - 1): a prefix "any"
        prefix = bad_kv.cumsum(dim=2) > 0  # (B, Hq, S, c)
        rows = torch.arange(L, device=query.device).clamp(max=S - 1)
        reads_bad = prefix[:, :, rows]  # (B, Hq, L, c)
        alive = torch.ones((), dtype=torch.bool, device=query.device)
    elif attn_mask is None:  # every row reads every key
        reads_bad = bad_kv.amax(dim=2, keepdim=True) > 0  # (B, Hq, 1, c)
        alive = torch.ones((), dtype=torch.bool, device=query.device)
    else:  # rows x keys read, times bad keys: one matrix-vector product, (L, S) @ (S, c), in float32
        reads = attn_mask if attn_mask.dtype == torch.bool else attn_mask != -math.inf  # (Bm?, Hm?, Lm?, Sm?)
        reads = reads.to(torch.float32).expand(*reads.shape[:-1], S)  # one mask column broadcasts over S keys
        alive = reads.amax(-1, keepdim=True) > 0  # (Bm?, Hm?, Lm?, 1): the row reads at least one key
        reads_bad = _reads_bad(reads, bad_kv) > 0  # (B, Hq, Lm?, c)
    poison_w = bad_q | reads_bad[..., :1]  # (B, Hq, L, 1): a bad query, or it reads a bad key
    if float_mask and attn_mask.shape[-1]:
        poison_w = poison_w | ~(attn_mask.amax(-1, keepdim=True) < math.inf)  # NaN or +inf in the row's mask
    poison_w = poison_w & alive
    poison_out = poison_w | (reads_bad[..., -1:] & alive) if value is not None else poison_w
    if float_mask:
        attn_mask = attn_mask.masked_fill(~(attn_mask < math.inf), 0.0)  # the row is poisoned anyway

    def clean(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else zero_nonfinite(t)

    poison = Poison(weights=nan_rows(poison_w, query), out=nan_rows(poison_out, query))
    if attn_mask is None and not is_causal and S > 0 and not _may_differentiate(query, key, value):
        # Every row reads every key: a bad key or value row poisons its whole head and a bad query row only its
        # own row, so the raw inputs leak into no row the policy keeps; only gradients would carry them further.
        return query, key, value, None, poison
    return clean(query), clean(key), clean(value), attn_mask, poison


def _may_differentiate(*tensors: torch.Tensor | None) -> bool:
    """Could a backward pass run through these tensors? Decided from what is known while tracing (grad mode,
    ``requires_grad``, a ``torch.func`` wrapper), never from values."""
    if not torch.is_grad_enabled():
        return False
    if any(t is not None and t.requires_grad for t in tensors):
        return True
    if torch.compiler.is_compiling():
        return False  # the traced graph knows requires_grad; a torch.func transform is not looked into here
    return any(t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def _reads_bad(reads: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """``reads @ bad``: (Bm, Hm, Lm, S) 0/1 float (Bm, Hm in {1, B}, {1, Hq}) times (B, Hq, S, c) -> (B, Hq, Lm, c),
    the number of bad keys each row reads. A mask shared by the heads is multiplied once, the heads' (and the
    batch's) columns side by side, instead of being copied once per head by a broadcast ``matmul``."""
    Bm, Hm, Lm, S = reads.shape
    B, Hq, _, c = bad.shape
    if Hm != 1:
        return reads @ bad  # a mask per head: one product per head anyway
    if Bm == 1:
        cols = bad.permute(2, 0, 1, 3).reshape(S, B * Hq * c)  # (B, Hq, S, c) -> (S, B*Hq*c)
        out = reads[0, 0] @ cols  # (Lm, S) @ (S, B*Hq*c) -> (Lm, B*Hq*c)
        return out.view(Lm, B, Hq, c).permute(1, 2, 0, 3)  # -> (B, Hq, Lm, c)
    cols = bad.permute(0, 2, 1, 3).reshape(B, S, Hq * c)  # (B, Hq, S, c) -> (B, S, Hq*c)
    out = torch.bmm(reads[:, 0].expand(B, Lm, S), cols)  # (B, Lm, S) @ (B, S, Hq*c) -> (B, Lm, Hq*c)
    return out.view(B, Lm, Hq, c).permute(0, 2, 1, 3)  # -> (B, Hq, Lm, c)


def bad_rows(t: torch.Tensor) -> torch.Tensor:
    """(..., N, D) -> (..., N) bool: the rows holding a NaN or an inf.

    float32/float64: the row's largest entry is not below inf (``amax`` propagates NaN) or its smallest is not
    above -inf: two vectorised reductions, nothing allocated, no overflow. float16/bfloat16, whose reductions
    are slow on the CPU: ``t * 0`` is 0 where ``t`` is finite and NaN elsewhere, and a float32 sum is NaN when a
    term is. An empty row holds nothing bad."""
    if t.shape[-1] == 0:
        return torch.zeros(t.shape[:-1], dtype=torch.bool, device=t.device)
    if t.dtype in (torch.float16, torch.bfloat16):
        return (t * 0).sum(-1, dtype=torch.float32).isnan()
    return ~(t.amax(-1) < math.inf) | ~(t.amin(-1) > -math.inf)


def zero_nonfinite(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its NaN and infinities replaced by 0: a cleaned input, so that no masked product ``0 * NaN``
    reaches a row (the rows that did read a bad entry get their NaN back from :func:`nan_rows`)."""
    return t.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def nan_rows(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``rows``'s shape, in ``like``'s dtype and device: NaN where ``rows`` is True, 0 elsewhere. Added
    to a result, it makes exactly the poisoned rows NaN."""
    return torch.zeros(rows.shape, dtype=like.dtype, device=like.device).masked_fill(rows, math.nan)


def empty_result(shape: tuple[int, ...], *inputs: torch.Tensor) -> torch.Tensor:
    """A result with no elements, computed by no backend, but on autograd's graph (with zero gradients)."""
    out = inputs[0].new_zeros(shape)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        out = out + sum(t.sum() for t in inputs if t.requires_grad) * 0  # a 0-d term: the shape stays
    return out
