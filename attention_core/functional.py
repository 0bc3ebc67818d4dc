"""Attention as functions: validate at the edge, then dispatch to a backend.

:func:`scaled_dot_product_attention` has the semantics of ``torch.nn.functional.scaled_dot_product_attention``
(torch 2.13), including its broadcasting of leading dims, plus two promises kept by every backend: a query row
whose keys are all masked gives zeros, never NaN; and a NaN or inf in the inputs gives NaN in exactly the
output rows that read it (the non-finite policy, argued in :func:`scaled_dot_product_attention`).

The layout of one call::

    query (..., Hq, L, E)   key (..., H, S, E)   value (..., H, S, Ev)   attn_mask -> (..., Hq, L, S)
        |  _prepare: check types, dtypes, devices, ranks, sizes, flags; broadcast the leading dims
        v
    canonical (B, Hq, L, E), (B, H, S, E), (B, H, S, Ev), mask 4-D      (see attention_core.backends)
        |  _nonfinite: eager CPU tensors: one sum per input, and only if it is not finite, zero the bad entries
        |              and note the rows they poison; on a GPU, under torch.compile or torch.func: that on every call
        |  resolve_backend: backend= > use_backend(...) > automatic
        v
    out (B, Hq, L, Ev), NaN put back in the poisoned rows  ->  (..., Hq, L, Ev)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from attention_core._checks import (
    broadcast_or_none,
    check_bool_flag,
    check_dropout,
    check_fits,
    check_floating,
    check_int,
    check_mask_broadcasts,
    check_min_rank,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_tensor,
    check_tensors_fit,
    fmt_shape,
    short_repr,
)
from attention_core._nonfinite import Poison, all_finite, check_on_host, clean_and_poison, empty_result
from attention_core.backends import AttentionInputs, resolve_backend
from attention_core.backends import reference as _reference
from attention_core.backends.inputs import compute_dtype, scale_or_default

__all__ = [
    "attention",
    "attention_weights",
    "attention_with_weights",
    "masked_softmax",
    "scaled_dot_product_attention",
    "weights_entropy",
]


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``softmax(query @ key^T * scale + mask) @ value``, computed by a chosen backend.

    Non-finite values, the same in every backend: a NaN or +-inf in ``query`` row ``i`` makes output row ``i`` NaN;
    one in ``key`` or ``value`` row ``j`` makes NaN every output row that reads key ``j``; a NaN or +inf in a float
    ``attn_mask`` at ``(i, j)`` makes row ``i`` NaN, ``-inf`` removes the pair; a row that reads no key is zeros.
    Why this policy, and what it costs: the API page, section "Bad input, and NaN or inf in the input".

    Args:
        query: (..., Hq, L, E), floating, E >= 1; any size may be 0 otherwise (the answer is then empty, or
            zeros when S = 0).
        key: (..., H, S, E), query's dtype and device.
        value: (..., H, S, Ev), query's dtype and device.
        attn_mask: ``None``; bool (True = the pair takes part); or float, added to the scores (bool, float32
            or the query's dtype). Must broadcast to (..., Hq, L, S). Not together with ``is_causal``.
        dropout_p: dropout probability on the weights, in [0, 1]; kept weights are scaled by 1/(1-p) (p = 1
            drops them all: zeros, as torch gives).
        is_causal: mask with ``tril(ones(L, S))`` (upper-left aligned: query i sees keys 0..i).
        scale: multiplies the scores, any finite float (0 gives uniform weights; negative reverses the
            ranking, as in torch); default ``1/sqrt(E)``.
        enable_gqa: grouped-query attention: key/value head h serves query heads h*G .. h*G+G-1, G = Hq/H.
            Without it, leading dims (heads included) broadcast as in ``torch.matmul``.
        backend: a name from :func:`attention_core.available_backends`; ``None`` uses the
            :func:`attention_core.use_backend` default, else the automatic choice.

    Returns:
        (..., Hq, L, Ev) in the query's dtype, where ``...`` is the broadcast of the inputs' leading dims.
        Rows whose keys are all masked are zeros.

    Raises:
        TypeError, ValueError: a bad argument (the message names it, what was seen and what was expected),
            or a backend that cannot run here or cannot handle these inputs.
    """
    out, _ = _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False, backend)
    return out


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    need_weights: bool = False,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`scaled_dot_product_attention` returning ``(out, weights or None)``: the one path the modules take.

    With ``need_weights=True`` the weights (..., Hq, L, S), before dropout, come back too; only the
    ``reference`` backend holds them, so ``backend=None`` means ``"reference"`` then (whatever
    :func:`~attention_core.use_backend` says), and any other name is a ``ValueError``.
    """
    if need_weights is True:
        if isinstance(backend, str) and backend != "reference":
            raise ValueError(f"need_weights=True runs the 'reference' backend, got backend={backend!r}")
        backend = "reference" if backend is None else backend
    return _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, need_weights, backend)


def _attend(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, need_weights,  # noqa: ANN001
            backend) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate once, choose the backend, run it, put the non-finite policy's NaN back: (out, weights | None)."""
    check_tensor(value, "value")
    p = _prepare(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__} {short_repr(backend)}")
    check_bool_flag(need_weights, "need_weights")
    L, S, Ev = p.query.shape[-2], p.key.shape[-2], p.value.shape[-1]
    out_shape, weights_shape = (*p.lead, L, Ev), (*p.lead, L, S)
    check_fits(math.prod(out_shape) * query.element_size(), f"the output {fmt_shape(out_shape)}",
               query.device)  # before any pass over the inputs (a stride-0 view can stand for terabytes)
    if math.prod(out_shape) == 0 and (not need_weights or math.prod(weights_shape) == 0):
        # nothing to compute (a 0-sized batch, head, L, or Ev without weights): no backend needed
        return (empty_result(out_shape, query, key, value),
                empty_result(weights_shape, query, key) if need_weights else None)
    p, poison = _nonfinite(p, is_causal, query, key, value)
    inputs = AttentionInputs(
        p.query, p.key, p.value, p.attn_mask, p.dropout_p, is_causal, p.scale, enable_gqa, need_weights
    )
    chosen = resolve_backend(backend, inputs)
    if chosen.score_bytes is not None:  # it builds the (B, Hq, L, S) scores: refuse what cannot fit, up front
        _check_scores_fit(p, chosen.score_bytes(p.query.dtype), f"the {chosen.name!r} backend")
    out, weights = chosen.run(inputs)  # (B, Hq, L, Ev), (B, Hq, L, S) or None
    if poison is not None:
        out = out + poison.out  # (B, Hq, L, Ev) + (B, Hq, L, 1): NaN in the poisoned rows, + 0 elsewhere
        weights = None if weights is None else weights + poison.weights
    out = out.reshape(out_shape)  # (B, Hq, L, Ev) -> (..., Hq, L, Ev)
    return out, None if weights is None else weights.reshape(weights_shape)  # (B, Hq, L, S) -> (..., Hq, L, S)


def attention_with_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`scaled_dot_product_attention` (always the reference backend), also returning the weights.

    Returns:
        ``(out, weights)``: (..., Hq, L, Ev) and the softmax weights (..., Hq, L, S) before dropout. Non-finite
        inputs follow the policy of :func:`scaled_dot_product_attention` (for the weights, a row is NaN when
        its query, a key it reads or its float mask entry is not finite).
    """
    return attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, need_weights=True,
                     backend="reference")


def attention_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The attention weights ``softmax(query @ key^T * scale + mask)``, validated like the full attention.

    Args:
        query: (..., Hq, L, E), floating.
        key: (..., H, S, E).
        attn_mask, is_causal, scale, enable_gqa: as in :func:`scaled_dot_product_attention`.

    Returns:
        (..., Hq, L, S) in the query's dtype; each row sums to 1, or is all 0 when its keys are all masked, or
        is NaN when it reads a non-finite value (the policy of :func:`scaled_dot_product_attention`).
    """
    p = _prepare(query, key, None, attn_mask, 0.0, is_causal, scale, enable_gqa)
    L, S = p.query.shape[-2], p.key.shape[-2]
    if math.prod(p.lead) * L * S == 0:
        return empty_result((*p.lead, L, S), query, key)
    _check_scores_fit(p, None, "attention_weights")
    p, poison = _nonfinite(p, is_causal, query, key, None)
    weights = _reference.attention_weights(p.query, p.key, p.attn_mask, is_causal, p.scale, enable_gqa)
    if poison is not None:
        weights = weights + poison.weights  # NaN in the poisoned rows
    return weights.reshape(*p.lead, L, S)  # (B, Hq, L, S) -> (..., Hq, L, S)


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None = None, dim: int = -1) -> torch.Tensor:
    """Softmax along ``dim`` that ignores masked entries; a fully masked row becomes zeros, never NaN.

    Masked entries are filled with ``-inf`` (so they get exactly 0 weight) and rows that end up all ``-inf``
    are guarded; see :func:`attention_core.backends.reference.softmax_with_mask` for why ``-inf`` beats
    ``-1e9``. Gradients stay finite everywhere (zero for masked entries and for fully masked rows).

    Non-finite scores follow the formula: an entry removed by the mask (False, or ``-inf`` in a float mask) or
    equal to ``-inf`` gets weight 0 and is never read, even if its score is NaN; a NaN or ``+inf`` that takes
    part makes its whole row NaN.

    Args:
        scores: floating tensor with at least one dim, e.g. (..., L, S).
        mask: ``None``; bool, True = keep; or float, added to ``scores`` in the compute precision (float32
            for float16/bfloat16 scores, whose result is cast back; else the scores' dtype). Must broadcast
            to ``scores.shape``.
        dim: the dimension that sums to 1.

    Returns:
        Tensor of ``scores``' shape and dtype.
    """
    check_tensor(scores, "scores")
    check_floating(scores, "scores")
    if scores.dim() == 0:
        raise ValueError("scores must have at least 1 dim (the one that sums to 1), got a 0-d tensor")
    check_tensors_fit("masked_softmax", scores=scores)  # the output has the scores' shape
    n = scores.dim()
    check_int(dim, "dim", low=-n, high=n, high_open=True)
    if mask is not None:
        _check_mask_kind(mask, "mask")
        check_same_device(scores=scores, mask=mask)
        check_mask_broadcasts(mask, "mask", scores.shape, "scores.shape")
        if mask.dtype != torch.bool:
            dtype = scores.dtype
            compute = compute_dtype(dtype)
            scores, mask = scores.to(compute), mask.to(compute)
            # a removed entry is never read: -inf wins over a NaN or +inf score (scores + mask alone gives NaN)
            scores = (scores + mask).masked_fill(mask == float("-inf"), float("-inf"))
            return _reference.softmax_with_mask(scores, None, dim).to(dtype)
    return _reference.softmax_with_mask(scores, mask, dim)


# ------------------------------------------------------------------------------------------- validation

def _check_scores_fit(p: _Prepared, bytes_per: int | None, who: str) -> None:
    """Refuse, before allocating, a call whose (B, Hq, L, S) scores cannot fit in the device's memory."""
    L, S = p.query.shape[-2], p.key.shape[-2]
    per = bytes_per or torch.empty((), dtype=compute_dtype(p.query.dtype)).element_size()
    n = math.prod(p.lead) * L * S
    check_fits(2 * n * per, f"{who}'s (B, Hq, L, S) = ({math.prod(p.lead[:-1])}, {p.lead[-1] if p.lead else 1}, "
               f"{L}, {S}) scores and weights", p.query.device if p.query.device.type != "meta" else "meta")



class _Prepared(NamedTuple):
    """Canonical 4-D inputs and the leading dims to restore on the way out."""

    query: torch.Tensor  # (B, Hq, L, E)
    key: torch.Tensor  # (B, H, S, E)
    value: torch.Tensor | None  # (B, H, S, Ev)
    attn_mask: torch.Tensor | None  # 4-D, broadcasts to (B, Hq, L, S); bool or the compute dtype
    dropout_p: float
    scale: float
    lead: tuple[int, ...]  # the broadcast leading dims "..., Hq" of the output


def _check_mask_kind(mask: object, name: str) -> torch.Tensor:
    check_tensor(mask, name)
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{name} must be bool (True = takes part) or floating (added), got dtype {mask.dtype}"
        )
    return mask


def _prepare(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> _Prepared:
    """Validate every argument of an attention call and bring the tensors to the canonical 4-D layout."""
    named = {"query": query, "key": key} if value is None else {"query": query, "key": key, "value": value}
    for name, t in named.items():
        check_tensor(t, name)
    check_tensors_fit("attention", **named)  # read element by element: refuse what cannot fit, before any work
    check_floating(query, "query")
    check_same_dtype(**named)
    check_same_device(**named)
    check_bool_flag(is_causal, "is_causal")
    check_bool_flag(enable_gqa, "enable_gqa")
    dropout_p = check_dropout(dropout_p, allow_one=True)  # torch's ranges: p = 1 drops every weight
    scale = check_scale(scale, positive=False)  # any finite scale, as torch takes
    min_rank, layout = (3, "(..., H, N, E) with enable_gqa=True") if enable_gqa else (2, "(..., N, E)")
    for name, t in named.items():
        check_min_rank(t, name, min_rank, layout)
    L, E = query.shape[-2:]
    S = key.shape[-2]
    if E == 0:
        raise ValueError(
            f"query and key must have at least one feature (E >= 1 in dim -1) to be compared: got query "
            f"{fmt_shape(query.shape)}, key {fmt_shape(key.shape)}"
        )
    if key.shape[-1] != E:
        raise ValueError(
            f"key's last dim must equal query's (E={E}): got query {fmt_shape(query.shape)}, "
            f"key {fmt_shape(key.shape)}"
        )
    if value is not None and value.shape[-2] != S:
        raise ValueError(
            f"value must have as many positions as key (S={S}) in dim -2: got key {fmt_shape(key.shape)}, "
            f"value {fmt_shape(value.shape)}"
        )
    lead = _broadcast_lead(named, enable_gqa)
    if attn_mask is not None:
        if is_causal:
            raise ValueError(
                "attn_mask and is_causal=True were both given; pass one (combine them into attn_mask)"
            )
        _check_mask_kind(attn_mask, "attn_mask")
        check_same_device(query=query, attn_mask=attn_mask)
        if attn_mask.is_floating_point() and attn_mask.dtype not in (torch.float32, query.dtype):
            raise TypeError(
                f"a float attn_mask must be float32 or the query's dtype ({query.dtype}), "
                f"got {attn_mask.dtype}"
            )
        check_min_rank(attn_mask, "attn_mask", 2, "(..., L, S)")
        check_mask_broadcasts(attn_mask, "attn_mask", (*lead, L, S), "(..., Hq, L, S)")
        check_tensors_fit("attention", attn_mask=attn_mask)
    v = None if value is None else _to_4d(value, lead, enable_gqa)
    return _Prepared(
        query=_to_4d(query, lead, enable_gqa),
        key=_to_4d(key, lead, enable_gqa),
        value=v,
        attn_mask=None if attn_mask is None else _mask_to_4d(attn_mask, lead, query.dtype),
        dropout_p=dropout_p,
        scale=scale_or_default(scale, E),
        lead=lead,
    )


def _broadcast_lead(named: dict, enable_gqa: bool) -> tuple[int, ...]:
    """The output's leading dims "..., Hq", with specific messages for the common head mistakes."""
    query, key = named["query"], named["key"]
    value = named.get("value", key)
    shapes = ", ".join(f"{n} {fmt_shape(t.shape)}" for n, t in named.items())
    if enable_gqa:
        Hq, H, Hv = query.shape[-3], key.shape[-3], value.shape[-3]
        if H != Hv:
            raise ValueError(f"key and value must have the same number of heads (dim -3): got {shapes}")
        if (H == 0 and Hq != 0) or (H != 0 and Hq % H != 0):
            raise ValueError(
                f"with enable_gqa=True the query heads (Hq={Hq}) must be a multiple of the key/value heads "
                f"(H={H}): got {shapes}"
            )
        batch = broadcast_or_none(query.shape[:-3], key.shape[:-3], value.shape[:-3])
        if batch is None:
            raise ValueError(
                f"the batch dims (before H, N, E) of query, key and value do not broadcast: {shapes}"
            )
        return (*batch, Hq)
    lead = broadcast_or_none(*(t.shape[:-2] for t in named.values()))
    if lead is not None:
        return tuple(lead)
    if all(t.dim() >= 3 for t in named.values()):
        Hq, H, Hv = query.shape[-3], key.shape[-3], value.shape[-3]
        if H != Hv and 1 not in (H, Hv):
            raise ValueError(f"key and value must have the same number of heads (dim -3): got {shapes}")
        if Hq != H and 1 not in (Hq, H):
            hint = "pass enable_gqa=True" if H and Hq % H == 0 else f"Hq must be a multiple of H={H} for GQA"
            raise ValueError(
                f"query has Hq={Hq} heads but key has H={H} (dim -3); for grouped-query attention {hint}: "
                f"got {shapes}"
            )
    raise ValueError(f"the leading dims (before N, E) of query, key and value do not broadcast: {shapes}")


def _to_4d(x: torch.Tensor, lead: tuple[int, ...], enable_gqa: bool) -> torch.Tensor:
    """(..., H, N, E) broadcast to ``lead`` (its own H kept with GQA) -> (B, H, N, E)."""
    head = x.shape[-3] if enable_gqa else (lead[-1] if lead else 1)
    batch = lead[:-1]
    x = x.expand(*batch, head, x.shape[-2], x.shape[-1])  # broadcast the leading dims: a view, no copy
    return x.reshape(math.prod(batch), head, x.shape[-2], x.shape[-1])  # (..., H, N, E) -> (B, H, N, E)


def _mask_to_4d(mask: torch.Tensor, lead: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A mask broadcastable to (*lead, L, S) -> 4-D, broadcastable to (B, Hq, L, S); L, S never expanded.
    A float mask comes back in the compute dtype of a query of ``dtype`` (see :func:`compute_dtype`)."""
    mask = mask if mask.dtype == torch.bool else mask.to(compute_dtype(dtype))  # added in the compute precision
    mask = mask.reshape((1,) * (len(lead) + 2 - mask.dim()) + tuple(mask.shape))  # left-pad with 1s
    if len(lead) < 2:
        return mask.reshape((1,) * (2 - len(lead)) + tuple(mask.shape))  # (h?, L, S) -> (1, h, L, S)
    batch, rest = mask.shape[:-3], tuple(mask.shape[-3:])
    if all(d == 1 for d in batch):
        return mask.reshape(1, *rest)  # (1, ..., 1, h, L, S) -> (1, h, L, S)
    mask = mask.expand(*lead[:-1], *rest)  # batch dims of the mask broadcast to the output's
    return mask.reshape(math.prod(lead[:-1]), *rest)  # (..., h, L, S) -> (B, h, L, S)


def _nonfinite(
    p: _Prepared, is_causal: bool, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None
) -> tuple[_Prepared, Poison | None]:
    """The non-finite policy (see :func:`scaled_dot_product_attention`) on canonical inputs: ``(p, None)``
    after one check when every input is finite, else the inputs with their bad entries zeroed and the NaN to
    add to the results. ``query``, ``key``, ``value`` are the user's tensors, checked before any broadcast;
    the mask is checked in its compute dtype."""
    if p.query.device.type == "meta":
        return p, None
    if check_on_host(query, key, value, p.attn_mask) and bool(all_finite(query, key, value, p.attn_mask)):
        return p, None  # the common case, decided on the host at no cost; elsewhere, tensor operations only
    q, k, v, mask, poison = clean_and_poison(p.query, p.key, p.value, p.attn_mask, is_causal)
    return p._replace(query=q, key=k, value=v, attn_mask=mask), poison


def weights_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of each row of attention weights: ``-sum_j w_j log w_j`` over the last dim, 0 log 0 = 0.

    0 when a row puts all its weight on one key, ``log n`` when it spreads evenly over ``n`` keys; a fully
    masked (all-zero) row gives 0. ``exp`` of it reads as the number of keys a query effectively looks at.

    Args:
        weights: (..., S) floating, each row a probability distribution (or all zeros).

    Returns:
        (...) in the weights' dtype.
    """
    check_tensor(weights, "weights")
    check_floating(weights, "weights")
    check_tensors_fit("weights_entropy", weights=weights)  # xlogy makes one tensor of the weights' shape
    return -torch.special.xlogy(weights, weights).sum(-1)  # xlogy(0, 0) = 0: empty keys add nothing
