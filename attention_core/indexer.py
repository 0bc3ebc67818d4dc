"""Learned sparse attention: a cheap indexer scores every (query, key) pair, each query keeps its top-k keys.

DeepSeek Sparse Attention (DSA, DeepSeek-AI, "DeepSeek-V3.2-Exp: Boosting Long-Context Efficiency with DeepSeek
Sparse Attention", 2025, section 1 "Architecture") puts a *lightning indexer* in front of attention. Its index score
between query token ``t`` and an earlier token ``s`` is (eq. (1))::

    I_{t,s} = sum_{j=1}^{H_I} w_{t,j} ReLU(q^I_{t,j} . k^I_s)

with a few indexer heads ``j`` (queries ``q^I_{t,j}`` and weights ``w_{t,j}`` from token ``t``, one key ``k^I_s``
per token, shared by the heads). Each query keeps the keys of its ``k`` largest scores and attends to those only
(eq. (2)). The indexer learns from the main attention (section 2.1): the target ``p_{t,:}`` is the main
attention's weights summed over its heads and L1-normalized, and the loss is
``sum_t KL(p_{t,:} || softmax(I_{t,:}))`` over every earlier key during a dense warm-up (eq. (3)), then over the
selected set ``S_t`` only once attention is sparse (eq. (4)).

- :func:`indexer_scores`: eq. (1), (..., L, S) scores;
- :func:`causal_topk_mask`: the selection, a bool (..., L, S) mask in SDPA's convention (True = attend): among the
  keys ``s <= offset + t``, the ``k`` of largest score; a query with at most ``k`` candidates keeps them all. The
  candidates are the main attention's causal set: the query's own token is one, neither forced nor excluded (eq.
  (1) speaks of "a preceding token" and singles out no position; we read it as the causal mask, ``s <= t``);
- :func:`topk_within`: the same selection among any bool (..., L, S) set of allowed keys (the models' sliding
  windows and caches), ties to the most recent key;
- :func:`selection_mask_mod`: the same mask as a ``mask_mod`` for :func:`attention_core.flex_attention`;
- :func:`indexer_kl_loss`: eqs. (3) and (4), with the set of keys as a mask.

Native Sparse Attention (Yuan et al., 2025) selects blocks of keys by compressed-attention scores instead of single
keys by a separate indexer; this module does DSA's token-level selection only.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attention_core._checks import (
    check_device,
    check_fits,
    check_floating,
    check_int,
    check_positive_int,
    check_same_device,
    check_same_dtype,
    check_tensor,
    check_tensors_fit,
    fmt_shape,
    short_repr,
)
from attention_core.mask_mods import MaskMod

__all__ = ["causal_allowed", "causal_topk_mask", "indexer_kl_loss", "indexer_scores", "selection_mask_mod",
           "topk_within"]


def indexer_scores(query: torch.Tensor, key: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's scores, eq. (1): ``I[..., t, s] = sum_j weights[..., j, t] ReLU(query[..., j, t, :]
    . key[..., s, :])``. No scale is applied (the layer scales its queries and weights).

    Args:
        query: (..., H_I, L, d_I), the indexer queries of each indexer head.
        key: (..., S, d_I), one indexer key per token, shared by the indexer heads.
        weights: (..., H_I, L), the weight of each head for each query token.

    Returns:
        (..., L, S), the dtype of ``query``.
    """
    for name, t in (("query", query), ("key", key), ("weights", weights)):
        check_tensor(t, name)
        check_floating(t, name)
    check_same_dtype(query=query, key=key, weights=weights)
    check_same_device(query=query, key=key, weights=weights)
    if query.dim() < 3 or key.dim() != query.dim() - 1 or key.shape[:-2] != query.shape[:-3] \
            or key.shape[-1] != query.shape[-1]:
        raise ValueError(f"query must be (..., H_I, L, d_I) and key (..., S, d_I) with the same leading dims and "
                         f"d_I, got query {fmt_shape(query.shape)} and key {fmt_shape(key.shape)}")
    if weights.shape != query.shape[:-1]:
        raise ValueError(f"weights must be (..., H_I, L) = {fmt_shape(query.shape[:-1])}, got "
                         f"{fmt_shape(weights.shape)}")
    check_tensors_fit("indexer_scores", query=query, key=key, weights=weights)
    check_fits(math.prod(query.shape[:-1]) * key.shape[-2] * query.element_size(),
               f"indexer_scores' (..., H_I, L, S) = {fmt_shape((*query.shape[:-1], key.shape[-2]))} products",
               query.device)
    dots = F.relu(query @ key.unsqueeze(-3).transpose(-2, -1))  # (..., H_I, L, d_I) @ (..., 1, d_I, S)
    return (weights.unsqueeze(-1) * dots).sum(-3)  # (..., H_I, L, S) -> (..., L, S)


def causal_allowed(L: int, S: int, offset: int = 0, device: torch.device | str | None = None) -> torch.Tensor:
    """(L, S) bool: query ``t`` (at position ``offset + t``) may read key ``s`` when ``s <= offset + t``."""
    L, S = check_positive_int(L, "L", allow_zero=True), check_positive_int(S, "S", allow_zero=True)
    offset = check_int(offset, "offset", low=0)
    device = check_device(device)
    check_fits(L * S, f"causal_allowed's (L, S) = ({L}, {S}) bool mask", device or "cpu")
    t = torch.arange(L, device=device).unsqueeze(-1)  # (L, 1)
    return torch.arange(S, device=device) <= t + offset  # (L, S)


def _check_scores(scores: object, name: str = "scores") -> torch.Tensor:
    check_tensor(scores, name)
    check_floating(scores, name)
    if scores.dim() < 2:
        raise ValueError(f"{name} must be (..., L, S), got shape {fmt_shape(scores.shape)}")
    return scores


def causal_topk_mask(scores: torch.Tensor, k: int, *, offset: int = 0) -> torch.Tensor:
    """Each query's top-``k`` keys among the keys it may read: a bool (..., L, S) mask, True = attend.

    Query ``t`` sits at position ``offset + t`` and may read keys ``s <= offset + t`` (``offset = S - L`` when the
    queries are the last ``L`` of ``S`` tokens, as in decoding). Of those it keeps the ``min(k, offset + t + 1)``
    of largest score (ties to the most recent key, as :func:`topk_within`); a key after the query is never
    selected, whatever its score. Every query keeps at least one key (``k >= 1``).

    Args:
        scores: (..., L, S) floating, e.g. :func:`indexer_scores` (a NaN counts as the largest score, as in
            ``torch.sort``).
        k: keys per query, >= 1.
        offset: the position of query 0, >= 0, with ``offset + L <= S``.
    """
    _check_scores(scores)
    k = check_positive_int(k, "k")
    offset = check_int(offset, "offset", low=0)
    L, S = scores.shape[-2:]
    if offset + L > S:
        raise ValueError(f"offset + L must be <= S (the last query reads at most every key), got offset = {offset}, "
                         f"scores {fmt_shape(scores.shape)}")
    check_fits(scores.numel() * (2 * scores.element_size() + 10),  # masked scores, the sort, the selection
               f"causal_topk_mask's sort of scores {fmt_shape(scores.shape)}", scores.device)
    allowed = causal_allowed(L, S, offset, scores.device)  # (L, S)
    if S == 0 or L == 0:
        return allowed.expand(scores.shape).clone()
    return topk_within(scores, allowed.expand(scores.shape), k)


def topk_within(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Each query's ``k`` keys of largest score among its ``allowed`` ones (all of them when it has at most
    ``k``): scores (..., L, S), allowed (..., L, S) bool -> (..., L, S) bool (True = attend). The selection passes no
    gradient. Ties (frequent: a key whose ReLU terms are all 0 scores exactly 0) go to the most recent key, by a
    stable sort, so that a query selects the same keys whether it comes alone (decoding) or with others.

    Args:
        scores: (..., L, S) floating (a NaN counts as the largest score, as in ``torch.sort``).
        allowed: (..., L, S) bool, the same shape and device as ``scores``; True = the query may read the key.
        k: keys per query, >= 1.
    """
    _check_scores(scores)
    check_tensor(allowed, "allowed")
    if allowed.dtype != torch.bool:
        raise TypeError(f"allowed must be a bool tensor, got {allowed.dtype}")
    if allowed.shape != scores.shape:
        raise ValueError(f"allowed must have the shape of scores {fmt_shape(scores.shape)}, got "
                         f"{fmt_shape(allowed.shape)}")
    check_same_device(scores=scores, allowed=allowed)
    k = check_positive_int(k, "k")
    S = scores.shape[-1]
    if S == 0:
        return allowed.clone()
    masked = scores.detach().masked_fill(~allowed, float("-inf")).flip(-1)  # (..., L, S), the most recent key first
    order = masked.sort(dim=-1, descending=True, stable=True).indices[..., : min(k, S)]  # (..., L, min(k, S))
    idx = S - 1 - order  # back to key indices
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, idx, True)
    return keep & allowed  # a query with fewer than k candidates picked some -inf keys: dropped here


def selection_mask_mod(selected: torch.Tensor) -> MaskMod:
    """A ``mask_mod`` for :func:`attention_core.flex_attention.create_block_mask` that keeps the pairs of a
    selection: ``selected`` (L, S) or (B, L, S) bool (e.g. :func:`causal_topk_mask`), the same for every head."""
    check_tensor(selected, "selected")
    if selected.dtype != torch.bool or selected.dim() not in (2, 3):
        raise ValueError(f"selected must be a bool (L, S) or (B, L, S) tensor, got {selected.dtype} "
                         f"{fmt_shape(selected.shape)}")
    sel = selected

    if sel.dim() == 2:
        def mask_mod(b, h, q_idx, kv_idx):
            return sel[q_idx, kv_idx]
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return sel[b, q_idx, kv_idx]
    mask_mod.__name__ = mask_mod.__qualname__ = "selection"
    return mask_mod


REDUCTIONS = ("sum", "mean")


def indexer_kl_loss(scores: torch.Tensor, attn_weights: torch.Tensor, keys: torch.Tensor, *,
                    reduction: str = "sum") -> torch.Tensor:
    """The indexer's loss, DSA's eqs. (3)-(4): ``sum_t KL(p_t || softmax(I_t))`` over the keys in ``keys[t]``.

    The target ``p_t`` is the main attention's weights summed over its heads, restricted to ``keys[t]`` and
    L1-normalized there; it is a target (no gradient flows into ``attn_weights``). ``softmax(I_t)`` is taken over
    the same keys. A dense warm-up passes the causal mask as ``keys`` (eq. (3), every earlier key); sparse training
    passes the selection (eq. (4), ``S_t``). A row with no key in ``keys``, or no target mass on them, adds 0.

    Args:
        scores: (..., L, S) index scores (:func:`indexer_scores`).
        attn_weights: (..., H, L, S) the main attention's weights (rows of a softmax over its keys).
        keys: (..., L, S) bool (or broadcastable to it), the keys of each row the two distributions cover.
        reduction: ``"sum"`` over rows (and leading dims), the paper's ``sum_t``, or ``"mean"`` over rows.

    Returns:
        A 0-d tensor, >= 0, zero when ``softmax(I_t)`` equals ``p_t`` on every row.
    """
    _check_scores(scores)
    check_tensor(attn_weights, "attn_weights")
    check_floating(attn_weights, "attn_weights")
    check_tensor(keys, "keys")
    check_same_device(scores=scores, attn_weights=attn_weights, keys=keys)
    if attn_weights.dim() != scores.dim() + 1 or attn_weights.shape[:-3] + attn_weights.shape[-2:] != scores.shape:
        raise ValueError(f"attn_weights must be (..., H, L, S) with scores (..., L, S) = {fmt_shape(scores.shape)}, "
                         f"got {fmt_shape(attn_weights.shape)}")
    if keys.dtype != torch.bool or torch.broadcast_shapes(keys.shape, scores.shape) != scores.shape:
        raise ValueError(f"keys must be a bool mask broadcastable to {fmt_shape(scores.shape)}, got {keys.dtype} "
                         f"{fmt_shape(keys.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {short_repr(reduction)}")
    check_fits((attn_weights.numel() + 6 * scores.numel()) * scores.element_size(),  # read once, six temporaries
               f"indexer_kl_loss's attn_weights {fmt_shape(attn_weights.shape)} and scores "
               f"{fmt_shape(scores.shape)}", scores.device)
    p = attn_weights.detach().to(scores.dtype).sum(-3).masked_fill(~keys, 0.0)  # (..., L, S)
    mass = p.sum(-1, keepdim=True)  # (..., L, 1)
    p = p / torch.where(mass > 0, mass, 1.0)  # L1-normalized on the kept keys
    keys = keys.expand(scores.shape)
    masked = scores.masked_fill(~keys, float("-inf")).masked_fill(~keys.any(-1, keepdim=True), 0.0)  # no NaN rows
    log_q = torch.log_softmax(masked, dim=-1)  # (..., L, S), -inf off the keys
    log_q = torch.where(keys & (p > 0), log_q, 0.0)  # terms with p = 0 are 0 (0 log 0 = 0)
    log_p = torch.where(p > 0, p, 1.0).log()
    kl = (p * (log_p - log_q)).sum(-1)  # (..., L)
    return kl.sum() if reduction == "sum" else kl.mean()
