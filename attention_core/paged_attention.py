"""Attention that reads its keys and values through a block table (PagedAttention, Kwon et al., 2023).

A paged KV cache stores every sequence's keys and values in fixed-size blocks of one shared pool:
``key_cache`` (N_blocks, H, block_size, E) and ``value_cache`` (N_blocks, H, block_size, Ev). Sequence ``b``
owns the blocks ``block_table[b, 0], block_table[b, 1], ...`` in order: its token ``t`` lives in block
``block_table[b, t // block_size]`` at slot ``t % block_size``. Blocks need not be contiguous, and two sequences
may list the same block (a shared prompt prefix).

:func:`paged_attention` computes, for each sequence, causal attention of its ``L`` newest tokens (the queries)
over its ``seq_lens[b]`` cached tokens, exactly what :func:`attention_core.scaled_dot_product_attention` gives
over a contiguous cache. Two paths in torch:

- ``"gather"``: copy each sequence's blocks into a contiguous (H, S, E) tensor, then plain attention (the
  reference; it materialises the cache once more);
- ``"chunked"``: walk the block table one block column at a time with an online softmax (the way the kernel
  reads: one block of keys at a time, never a contiguous copy);

and ``"triton"`` (``attention_core.backends.triton_paged``), a kernel that follows the block table itself.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from attention_core._checks import (
    check_fits,
    check_floating,
    check_int,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_tensor,
    fmt_shape,
    short_repr,
)
from attention_core._nonfinite import all_finite, bad_rows, check_on_host, zero_nonfinite
from attention_core.backends.inputs import compute_dtype
from attention_core.functional import scaled_dot_product_attention

__all__ = ["gather_paged_kv", "paged_attention", "PAGED_PATHS"]

#: The ways :func:`paged_attention` can read the block table.
PAGED_PATHS = ("gather", "chunked", "triton")
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor, scale: object, path: object) -> float:
    """Every refusal of :func:`paged_attention`, before any work; returns the scale."""
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_table", block_table), ("seq_lens", seq_lens)):
        check_tensor(t, name)
    if not isinstance(path, str) or path not in PAGED_PATHS:
        raise ValueError(f"path must be one of {PAGED_PATHS}, got {short_repr(path)}")
    check_floating(query, "query")
    check_same_dtype(query=query, key_cache=key_cache, value_cache=value_cache)  # a cache is never cast silently
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be an int32 or int64 tensor, got {t.dtype}")
    check_same_device(query=query, key_cache=key_cache, value_cache=value_cache, block_table=block_table,
                      seq_lens=seq_lens)
    if query.device.type == "meta":
        raise ValueError("query, the caches, block_table and seq_lens are on the meta device: paged attention "
                         "reads the block table's values, which a meta tensor does not have")
    if query.dim() != 4:
        raise ValueError(f"query must be (B, Hq, L, E), got shape {fmt_shape(query.shape)}")
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(f"key_cache and value_cache must be (N_blocks, H, block_size, E), got shapes "
                         f"{fmt_shape(key_cache.shape)} and {fmt_shape(value_cache.shape)}")
    if key_cache.shape[:3] != value_cache.shape[:3]:
        raise ValueError(f"key_cache {fmt_shape(key_cache.shape)} and value_cache {fmt_shape(value_cache.shape)} "
                         "must agree in (N_blocks, H, block_size)")
    B, Hq, L, E = query.shape
    N, H, bs, _ = key_cache.shape
    if E < 1:
        raise ValueError(f"query and key_cache must have at least one feature (E >= 1), got query "
                         f"{fmt_shape(query.shape)}")
    if key_cache.shape[3] != E:
        raise ValueError(f"query has E = {E} but key_cache has E = {key_cache.shape[3]}")
    if H < 1 or bs < 1:
        raise ValueError(f"key_cache must have H >= 1 heads and block_size >= 1 slots, got shape "
                         f"{fmt_shape(key_cache.shape)}")
    if Hq % H:
        raise ValueError(f"query has Hq = {Hq} heads, not a multiple of the cache's H = {H} key/value heads")
    if block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be (B={B}, max_blocks), got shape {fmt_shape(block_table.shape)}")
    if seq_lens.shape != (B,):
        raise ValueError(f"seq_lens must be (B={B},), got shape {fmt_shape(seq_lens.shape)}")
    width = block_table.shape[1]
    if B and (int(seq_lens.min()) < L or int(seq_lens.max()) > width * bs):
        raise ValueError(f"seq_lens must lie in [L={L}, max_blocks * block_size = {width} * {bs} = {width * bs}], "
                         f"got {short_repr(seq_lens.tolist(), 120)}")
    S_max = int(seq_lens.max()) if B else 0
    # what every path reads: each sequence's keys and values, B x (H, S_max, E + Ev) padded (the chunked path
    # walks every block column for every sequence), and the gather path's (Hq, L, S) scores of one sequence
    per = max(query.element_size(), 4)
    check_fits((B * H * S_max * (E + value_cache.shape[3]) + Hq * L * S_max * 2) * per,
               f"paged attention over seq_lens up to {S_max} (B = {B}, H = {H}, E = {E}, Ev = "
               f"{value_cache.shape[3]})", query.device)
    n_cols = -(-S_max // bs)
    if B and n_cols:
        cols = block_table[:, :n_cols]  # (B, n_cols): the columns some sequence reads
        used = torch.arange(n_cols, device=block_table.device)[None, :] * bs < seq_lens[:, None]  # (B, n_cols)
        ids = cols[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= N):
            raise ValueError(f"block_table lists blocks outside [0, N_blocks = {N}) in the entries the sequences "
                             f"use (their first ceil(seq_lens / block_size) columns): min {int(ids.min())}, "
                             f"max {int(ids.max())}")
    value = check_scale(scale, "scale", positive=False)
    return 1.0 / math.sqrt(E) if value is None else value


def gather_paged_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's cached tensor made contiguous: (N_blocks, H, bs, E) -> (H, seq_len, E).

    ``block_table_row`` is an int32 or int64 vector of block ids in ``[0, N_blocks)``; ``seq_len`` is an int in
    ``[0, len(block_table_row) * bs]`` (the slots the row's blocks hold). Anything else raises ``TypeError`` or
    ``ValueError`` naming the argument.
    """
    check_tensor(cache, "cache")
    check_tensor(block_table_row, "block_table_row")
    if cache.dim() != 4:
        raise ValueError(f"cache must be (N_blocks, H, block_size, E), got shape {fmt_shape(cache.shape)}")
    if block_table_row.dtype not in _INDEX_DTYPES:
        raise TypeError(f"block_table_row must be an int32 or int64 tensor, got {block_table_row.dtype}")
    if block_table_row.dim() != 1:
        raise ValueError(f"block_table_row must be one sequence's row (max_blocks,), got shape "
                         f"{fmt_shape(block_table_row.shape)}")
    N, _, bs, _ = cache.shape
    if bs < 1:
        raise ValueError(f"cache must have block_size >= 1 slots, got shape {fmt_shape(cache.shape)}")
    width = block_table_row.shape[0]
    seq_len = check_int(seq_len, "seq_len", low=0, high=width * bs)
    check_fits(2 * -(-seq_len // bs) * math.prod(cache.shape[1:]) * cache.element_size(),  # the blocks, then (H, S, E)
               f"gather_paged_kv's copy of seq_len = {seq_len} slots of cache {fmt_shape(cache.shape)}", cache.device)
    used = block_table_row[: -(-seq_len // bs)]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= N):
        raise ValueError(f"block_table_row lists blocks outside [0, N_blocks = {N}) in the entries seq_len = "
                         f"{seq_len} uses: min {int(used.min())}, max {int(used.max())}")
    return _gather_kv(cache, block_table_row, seq_len)


def _gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """:func:`gather_paged_kv` on input :func:`paged_attention` has already checked."""
    bs = cache.shape[2]
    n = -(-seq_len // bs)
    blocks = cache[block_table_row[:n].long()]  # (n, H, bs, E)
    return blocks.transpose(0, 1).flatten(1, 2)[:, :seq_len]  # (n, H, bs, E) -> (H, n * bs, E) -> (H, S, E)


def _gather(query, key_cache, value_cache, block_table, seq_lens, scale):
    B, Hq, L, E = query.shape
    out = query.new_empty(B, Hq, L, value_cache.shape[3])
    for b in range(B):
        S = int(seq_lens[b])
        k = _gather_kv(key_cache, block_table[b], S)[None]  # (1, H, S, E)
        v = _gather_kv(value_cache, block_table[b], S)[None]
        # the L queries are the last L tokens: query i sits at position S - L + i and sees keys 0 .. S - L + i
        mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril(S - L)  # (L, S)
        out[b] = scaled_dot_product_attention(query[b : b + 1], k, v, mask, scale=scale,
                                              enable_gqa=Hq != k.shape[1])[0]
    return out


def _chunked(query, key_cache, value_cache, block_table, seq_lens, scale):
    """Online softmax over one block column at a time. The non-finite policy of the core: a query row that reads
    a NaN or inf (in its query, or a key or value row it sees) gives a NaN row; nothing else does. Slots a row
    does not see (a later token of its own sequence, a stale slot past ``seq_lens``, the block a padding entry of
    the table points at) are zeroed before any product, so ``0 * inf`` never reaches a row."""
    B, Hq, L, E = query.shape
    N, H, bs, Ev = value_cache.shape
    group = Hq // H
    ct = compute_dtype(query.dtype)
    host = check_on_host(query, key_cache, value_cache)  # eager CPU: a finiteness test costs no sync
    q = query.to(ct).reshape(B, H, group, L, E)  # (B, Hq, L, E) -> (B, H, G, L, E)
    bad = bad_rows(q)  # (B, H, G, L): rows whose query holds a NaN or inf
    q = zero_nonfinite(q) * scale
    m = q.new_full((B, H, group, L), -math.inf)
    denom = q.new_zeros(B, H, group, L)
    acc = q.new_zeros(B, H, group, L, Ev)
    lens = seq_lens.long()
    qpos = lens[:, None] - L + torch.arange(L, device=query.device)[None, :]  # (B, L)
    n_cols = -(-int(lens.max()) // bs)
    for j in range(n_cols):
        ids = block_table[:, j].long().clamp(0, N - 1)  # entries past a sequence's blocks may hold anything
        kpos = j * bs + torch.arange(bs, device=query.device)  # (bs,)
        live = kpos[None, :] < lens[:, None]  # (B, bs): slots that hold one of the sequence's tokens
        ok = kpos[None, None, :] <= qpos[:, :, None]  # (B, L, bs): what each query sees (implies live)
        k = key_cache[ids].to(ct).masked_fill(~live[:, None, :, None], 0.0)  # (B, H, bs, E), stale slots zeroed
        v = value_cache[ids].to(ct).masked_fill(~live[:, None, :, None], 0.0)  # (B, H, bs, Ev)
        if not (host and bool(all_finite(k, v, None, None))):
            bad_slot = bad_rows(k) | bad_rows(v)  # (B, H, bs)
            bad = bad | (ok[:, None, None] & bad_slot[:, :, None, None, :]).any(-1)  # (B, H, G, L, bs) -> (B, H, G, L)
            k, v = zero_nonfinite(k), zero_nonfinite(v)
        s = torch.einsum("bhgle,bhse->bhgls", q, k)  # (B, H, G, L, bs)
        s = s.masked_fill(~ok[:, None, None], -math.inf)
        m_new = torch.maximum(m, s.amax(-1))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # no row seen a key yet
        p = torch.exp(s - safe[..., None])  # (B, H, G, L, bs)
        corr = torch.exp(m - safe)
        denom = denom * corr + p.sum(-1)
        acc = acc * corr[..., None] + torch.einsum("bhgls,bhse->bhgle", p, v)
        m = m_new
    out = acc / denom.clamp_min(torch.finfo(acc.dtype).tiny)[..., None]
    out = out.masked_fill(bad[..., None], math.nan)
    return out.reshape(B, Hq, L, Ev).to(query.dtype)  # (B, H, G, L, Ev) -> (B, Hq, L, Ev)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: Optional[float] = None,
                    *, path: str = "chunked") -> torch.Tensor:
    """Causal attention of each sequence's newest ``L`` tokens over its paged cache.

    Args:
        query: (B, Hq, L, E) the queries of the last ``L`` tokens of every sequence (decode: L = 1), floating.
        key_cache: (N_blocks, H, block_size, E) the shared pool of key blocks, query's dtype and device; Hq a
            multiple of H (GQA).
        value_cache: (N_blocks, H, block_size, Ev) the pool of value blocks.
        block_table: (B, max_blocks) int32/int64: sequence b's blocks in order; entries past its length are
            ignored (they may hold anything).
        seq_lens: (B,) int32/int64: tokens cached per sequence (including the L new ones), L <= seq_lens[b].
        scale: score scale, a finite float; default 1/sqrt(E).
        path: ``"gather"``, ``"chunked"`` or ``"triton"`` (see the module docstring).

    Returns:
        The output, shaped (B, Hq, L, Ev) in query's dtype (float64 computed in float64, the others in float32),
        equal (to float rounding) to causal SDPA over each sequence's contiguous cache with the queries aligned
        to its end, on every path. The non-finite policy is the core's: a query row that reads a NaN or inf (in
        its query or in a key or value it sees) is NaN; slots it does not see, including stale slots past
        ``seq_lens`` and the blocks that padding entries of the table point at, never reach it.

    Raises:
        TypeError: an argument of the wrong type (the message names it).
        ValueError: a bad value or shape (the message names the argument); a ``ValueError`` (of the library's
            ``TooLargeError`` kind) when the sequences cannot be read in this device's memory.
    """
    scale = _check(query, key_cache, value_cache, block_table, seq_lens, scale, path)
    return _paged_attention(query, key_cache, value_cache, block_table, seq_lens, scale, path)


def _paged_attention(query, key_cache, value_cache, block_table, seq_lens, scale: float, path: str) -> torch.Tensor:
    """:func:`paged_attention` on arguments already checked (the paged engine checks its batch once per call)."""
    B, Hq, L, _ = query.shape
    if B == 0 or Hq == 0 or L == 0:
        return query.new_zeros(B, Hq, L, value_cache.shape[3])
    if path == "gather":
        return _gather(query, key_cache, value_cache, block_table, seq_lens, scale)
    if path == "chunked":
        return _chunked(query, key_cache, value_cache, block_table, seq_lens, scale)
    from attention_core.backends.fused_checks import triton_available, triton_runs_on

    ok, why = triton_available()
    if not ok or not triton_runs_on(query.device.type):
        raise ValueError(f"path='triton' cannot run here on {query.device} tensors: "
                         f"{why or 'Triton runs CUDA tensors (or CPU ones under TRITON_INTERPRET=1)'}")
    from attention_core.backends.triton_paged import triton_paged_attention

    return triton_paged_attention(query, key_cache, value_cache, block_table, seq_lens, scale)
