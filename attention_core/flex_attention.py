"""FlexAttention on any machine: block masks that record which tiles are empty, full or partial, and attention
that never touches an empty tile (the ``chunked`` and ``triton`` backends; the ``reference`` oracle computes every
score).

The names and argument orders are PyTorch's (``torch.nn.attention.flex_attention``), so code written against
this module moves to a GPU unchanged::

    block_mask = create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128)
    out = flex_attention(query, key, value, score_mod=None, block_mask=block_mask, scale=None, enable_gqa=False)

The (L, S) grid of (query, key) pairs is cut into tiles of ``BLOCK_SIZE`` queries by ``BLOCK_SIZE`` keys. For
each tile, :func:`create_block_mask` evaluates the ``mask_mod`` once and records whether the tile is

- **empty** (no pair takes part): attention never reads its keys;
- **full** (every pair takes part): attention computes it without evaluating the predicate;
- **partial**: attention computes it and evaluates the predicate on it.

A :class:`BlockMask` stores, per (batch, head, query tile), the count and the indices of its partial tiles and
of its full tiles: O((L / Bq) (S / Bk)) integers, never an (L, S) tensor. A sliding window of 256 keys over
8,192 queries leaves 4 of 64 key tiles per query tile (with 128-tiles), so attention does about 1/16 of the
dense work. :class:`BlockMask` and :func:`create_block_mask` live in :mod:`attention_core.block_mask`, below
this module and the backends, and are re-exported here.

Backends (``backend=``): ``"reference"``, the dense oracle (every score computed, then masked; returns what
the formula says, with autograd through everything); ``"chunked"`` (the default), online softmax over the
non-empty tiles only, forward and backward, in :mod:`attention_core.backends.chunked_flex`; ``"triton"``, a
Triton kernel over the non-empty tiles (a GPU, or Triton's interpreter on a CPU).

Policy, as :func:`attention_core.scaled_dot_product_attention`: a query row that reads no key (every pair
masked, or every score set to ``-inf`` by the ``score_mod``) gives zeros, and no gradient.
"""

from __future__ import annotations

import math

import torch

from attention_core._checks import (
    check_bool_flag,
    check_fits,
    check_floating,
    check_rank,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_tensor,
    check_tensors_fit,
    fmt_shape,
    short_repr,
)
from attention_core._nonfinite import all_finite, bad_rows, empty_result, nan_rows, zero_nonfinite
from attention_core.backends.chunked_flex import chunked_flex_attention
from attention_core.block_mask import _SLAB, BLOCK_SIZE, EMPTY, FULL, PARTIAL, BlockMask, create_block_mask
from attention_core.mask_mods import (
    ScoreMod,
    call_mask_mod,
    check_captured,
    dense_mask,
    dense_scores,
    index_grids,
    noop_mask,
)

# The block-mask names live in attention_core.block_mask (below this module and the backends, so neither imports
# the other back); they are re-exported here, where PyTorch keeps them.
__all__ = ["BLOCK_SIZE", "EMPTY", "FULL", "PARTIAL", "BlockMask", "create_block_mask", "flex_attention"]

# ------------------------------------------------------------------------------------------- attention


def _check_inputs(query, key, value, block_mask, scale, enable_gqa) -> tuple[int, int, int, int]:
    named = {"query": query, "key": key, "value": value}
    for name, t in named.items():
        check_tensor(t, name)
        check_floating(t, name)
    for name, t in named.items():
        check_rank(t, name, (4,), "a 4-D tensor (B, H, L or S, E)")
    check_same_dtype(**named)
    check_same_device(**named)
    check_bool_flag(enable_gqa, "enable_gqa")
    B, Hq, L, E = query.shape
    Bk, H, S, Ek = key.shape
    if E == 0:  # as the core's scaled_dot_product_attention: nothing to compare a query with a key on
        raise ValueError(f"query and key must have at least one feature (E >= 1 in dim -1) to be compared: got "
                         f"query {fmt_shape(query.shape)}, key {fmt_shape(key.shape)}")
    if Bk != B or value.shape[0] != B or value.shape[1] != H or value.shape[2] != S or Ek != E:
        raise ValueError(f"shapes must be query (B, Hq, L, E), key (B, H, S, E), value (B, H, S, Ev); got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if Hq != H and not (enable_gqa and H > 0 and Hq % H == 0):
        raise ValueError(f"query has {Hq} heads and key/value {H}: equal, or enable_gqa=True with Hq % H == 0")
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a BlockMask (create_block_mask), got {type(block_mask).__name__}")
        Bm, Hm, Lm, Sm = block_mask.shape
        if (Lm, Sm) != (L, S) or Bm not in (1, B) or Hm not in (1, Hq):
            raise ValueError(f"block_mask of shape {block_mask.shape} does not fit query/key (B={B}, Hq={Hq}, "
                             f"L={L}, S={S}): it needs (1 or B, 1 or Hq, L, S)")
        check_same_device(query=query, block_mask=block_mask.kv_num_blocks)
    scale = check_scale(scale, positive=False)  # any finite number, as the core's SDPA takes
    # refuse what cannot fit before any work: the output, and each input as it is read (a stride-0 expand of a
    # tiny storage can stand for terabytes that every backend reads, element by element)
    check_tensors_fit("flex_attention", **named)
    out_shape = (B, Hq, L, value.shape[-1])
    check_fits(math.prod(out_shape) * query.element_size(), f"flex_attention's output of shape {fmt_shape(out_shape)}",
               query.device)
    return B, Hq, L, S


def _nonfinite(query, key, value, block_mask):
    """The non-finite policy of :func:`attention_core.scaled_dot_product_attention`, with the block mask's
    predicate saying which keys a row reads: a NaN or inf in query row ``i`` makes output row ``i`` NaN (if it
    reads any key); one in key or value row ``j`` makes NaN exactly the rows whose ``mask_mod`` keeps ``j``.
    Returns the inputs with their bad rows zeroed (so no backend computes ``0 * NaN`` for a masked pair, forward
    or backward) and the (B, H, L, 1) NaN-or-0 tensor to add to the output (``None`` when all is finite).

    Finding the bad keys is data-dependent (a ``nonzero``): under ``torch.compile`` and ``torch.func`` transforms
    the inputs are passed on as they are, and a masked pair's NaN may then reach its row."""
    if torch.compiler.is_compiling() or any(torch._C._functorch.is_functorch_wrapped_tensor(t)
                                             for t in (query, key, value)):
        return query, key, value, None  # which keys are bad is data-dependent: traced graphs compute as given
    if bool(all_finite(query, key, value, None)):  # free on the CPU, one synchronisation on a GPU
        return query, key, value, None
    B, H, L, _ = query.shape
    S = key.shape[2]
    mask_mod = noop_mask if block_mask is None else block_mask.mask_mod
    b, h, q, _ = index_grids(B, H, L, 0, query.device)  # (B, 1, 1, 1), (1, H, 1, 1), (1, 1, L, 1)
    bad_kv = bad_rows(key) | bad_rows(value)  # (B, H, S)
    bad_q = bad_rows(query)  # (B, H, L)
    rows = torch.zeros(B, H, L, dtype=torch.bool, device=query.device)
    step = max(1, _SLAB // max(1, B * H * L))  # key columns per evaluation of the predicate
    cols = bad_kv.flatten(0, 1).any(0).nonzero().flatten()  # the key positions bad somewhere
    for c0 in range(0, cols.numel(), step):
        c = cols[c0:c0 + step]
        keep = call_mask_mod(mask_mod, b, h, q, c.view(1, 1, 1, -1), (B, H, L, c.numel()))  # (B, H, L, c)
        rows |= (keep & bad_kv[:, :, None, c]).any(-1)  # reads a bad key or value
    bad = bad_q.nonzero()  # (n, 3): (b, h, i) of the bad query rows; each poisons its row if it reads some key
    kv = torch.arange(S, device=query.device).view(1, S)
    step = max(1, _SLAB // max(1, S))
    for n0 in range(0, bad.shape[0], step):
        bi, hi, qi = (x.view(-1, 1) for x in bad[n0:n0 + step].unbind(1))  # (n, 1) each
        alive = call_mask_mod(mask_mod, bi, hi, qi, kv, (bi.shape[0], S)).any(-1)  # (n,)
        rows[bi[:, 0], hi[:, 0], qi[:, 0]] |= alive
    return zero_nonfinite(query), zero_nonfinite(key), zero_nonfinite(value), nan_rows(rows[..., None], query)


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    backend: str = "chunked",
) -> torch.Tensor:
    """Attention with the scores edited by ``score_mod`` and the pairs chosen by ``block_mask``.

    ``softmax(score_mod(scale * q k^T) masked by block_mask.mask_mod) @ v``; tiles the block mask records as
    empty are never computed (``chunked`` and ``triton``; ``reference`` computes every score, then masks), full
    tiles skip the predicate.

    Args:
        query: (B, Hq, L, E) floating.
        key: (B, H, S, E), same dtype.
        value: (B, H, S, Ev), same dtype.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` or ``None``. Tensors it captures (a bias
            table, ALiBi slopes) receive gradients on ``chunked`` and ``reference`` (``triton`` raises if one
            requires a gradient).
        block_mask: from :func:`create_block_mask` with (L, S) = (query's L, key's S), or ``None`` (every pair).
        scale: score scale, default ``1 / sqrt(E)``.
        enable_gqa: let ``Hq`` be a multiple of ``H`` (each key/value head serves ``Hq / H`` query heads).
        backend: ``"chunked"`` (tiles, skipping empty ones), ``"reference"`` (dense, the oracle) or ``"triton"``
            (the library's mods compiled in, forward and backward; CUDA or ``TRITON_INTERPRET=1``).

    Returns:
        (B, Hq, L, Ev) in the query's dtype; a row that reads no key is zeros.
    """
    B, Hq, L, S = _check_inputs(query, key, value, block_mask, scale, enable_gqa)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(f"score_mod must be callable or None, got {type(score_mod).__name__}")
    if backend not in ("chunked", "reference", "triton"):
        raise ValueError(f"backend must be 'chunked', 'reference' or 'triton', got {short_repr(backend)}")
    for mod in (score_mod, block_mask and block_mask.mask_mod):  # a captured tensor too short for these inputs
        check_captured(mod, B, Hq, L, S, query.device)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    H = key.shape[1]
    if query.device.type == "meta":  # no values: the shape, dtype and device of the answer
        return query.new_empty(B, Hq, L, value.shape[-1])
    if B * Hq * L * value.shape[-1] == 0:  # nothing to compute (S = 0 is computed: rows that read nothing)
        return empty_result((B, Hq, L, value.shape[-1]), query, key, value)
    if Hq != H:  # GQA: each key/value head serves Hq / H query heads; autograd sums their gradients
        key = key.repeat_interleave(Hq // H, dim=1)  # (B, H, S, E) -> (B, Hq, S, E)
        value = value.repeat_interleave(Hq // H, dim=1)  # (B, H, S, Ev) -> (B, Hq, S, Ev)
    query, key, value, poison = _nonfinite(query, key, value, block_mask)
    if backend == "reference":
        out = _reference(query, key, value, score_mod, block_mask, scale)
    elif backend == "chunked":
        out = chunked_flex_attention(query, key, value, score_mod, block_mask, scale)
    else:  # Triton is optional: imported only when asked for
        from attention_core.backends.triton_flex import triton_flex_attention

        out = triton_flex_attention(query, key, value, score_mod, block_mask, scale)
    return out if poison is None else out + poison  # NaN in the rows that read a bad entry, + 0 elsewhere


def _reference(query, key, value, score_mod, block_mask, scale) -> torch.Tensor:
    """Dense: every score, the score_mod, the mask_mod, a softmax whose empty rows are zeros, in float32 or wider."""
    B, H, L, _ = query.shape
    S = key.shape[2]
    dt = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    scores = (query.to(dt) @ key.to(dt).transpose(-2, -1)) * scale  # (B, H, L, E) @ (B, H, E, S) -> (B, H, L, S)
    if S == 0:  # no key at all: every row reads nothing, (B, H, L, 0) @ (B, H, 0, Ev) is zeros
        return (scores @ value.to(dt)).to(query.dtype)
    if score_mod is not None:
        scores = dense_scores(score_mod, scores)
    mask_mod = noop_mask if block_mask is None else block_mask.mask_mod
    keep = dense_mask(mask_mod, B, H, L, S, query.device)
    scores = scores.masked_fill(~keep, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).detach()  # (B, H, L, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)  # an empty row: -inf - 0, exp 0
    p = (scores - row_max).exp()
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom == 0, 1.0, denom)  # empty rows: 0 / 1
    return (p @ value.to(dt)).to(query.dtype)  # (B, H, L, S) @ (B, H, S, Ev) -> (B, H, L, Ev)
