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

from attention_core.functional import scaled_dot_product_attention

__all__ = ["gather_paged_kv", "paged_attention", "PAGED_PATHS"]

#: The ways :func:`paged_attention` can read the block table.
PAGED_PATHS = ("gather", "chunked", "triton")


def _check(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
           seq_lens: torch.Tensor) -> None:
    for name, t in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_table", block_table), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if query.dim() != 4:
        raise ValueError(f"query must be (B, Hq, L, E), got shape {tuple(query.shape)}")
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError(f"key_cache and value_cache must be (N_blocks, H, block_size, E), got shapes "
                         f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.shape[:3] != value_cache.shape[:3]:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must "
                         "agree in (N_blocks, H, block_size)")
    B, Hq, L, E = query.shape
    H = key_cache.shape[1]
    if key_cache.shape[3] != E:
        raise ValueError(f"query has E = {E} but key_cache has E = {key_cache.shape[3]}")
    if Hq % H:
        raise ValueError(f"query has Hq = {Hq} heads, not a multiple of the cache's H = {H} key/value heads")
    if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be a (B={B}, max_blocks) integer tensor, got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if seq_lens.shape != (B,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_lens must be a (B={B},) integer tensor, got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    bs = key_cache.shape[2]
    if B and (int(seq_lens.min()) < L or int(seq_lens.max()) > block_table.shape[1] * bs):
        raise ValueError(f"seq_lens must lie in [L={L}, max_blocks * block_size = {block_table.shape[1] * bs}], "
                         f"got {seq_lens.tolist()}")
    if block_table.numel():
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * bs < seq_lens[:, None]
        ids = block_table[used]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= key_cache.shape[0]):
            raise ValueError(f"block_table lists blocks outside [0, {key_cache.shape[0]}) for used slots")


def gather_paged_kv(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's cached tensor made contiguous: (N_blocks, H, bs, E) -> (H, seq_len, E)."""
    bs = cache.shape[2]
    n = -(-seq_len // bs)
    blocks = cache[block_table_row[:n].long()]  # (n, H, bs, E)
    return blocks.transpose(0, 1).flatten(1, 2)[:, :seq_len]  # (n, H, bs, E) -> (H, n * bs, E) -> (H, S, E)


def _gather(query, key_cache, value_cache, block_table, seq_lens, scale):
    B, Hq, L, E = query.shape
    out = query.new_empty(B, Hq, L, value_cache.shape[3])
    for b in range(B):
        S = int(seq_lens[b])
        k = gather_paged_kv(key_cache, block_table[b], S)[None]  # (1, H, S, E)
        v = gather_paged_kv(value_cache, block_table[b], S)[None]
        # the L queries are the last L tokens: query i sits at position S - L + i and sees keys 0 .. S - L + i
        mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril(S - L)  # (L, S)
        out[b] = scaled_dot_product_attention(query[b : b + 1], k, v, mask, scale=scale,
                                              enable_gqa=Hq != k.shape[1])[0]
    return out


def _chunked(query, key_cache, value_cache, block_table, seq_lens, scale):
    B, Hq, L, E = query.shape
    _, H, bs, Ev = value_cache.shape
    group = Hq // H
    q = query.float().view(B, H, group, L, E) * scale  # (B, Hq, L, E) -> (B, H, G, L, E)
    m = q.new_full((B, H, group, L), -math.inf)
    denom = q.new_zeros(B, H, group, L)
    acc = q.new_zeros(B, H, group, L, Ev)
    qpos = (seq_lens[:, None] - L + torch.arange(L, device=query.device)[None, :])  # (B, L)
    n_cols = -(-int(seq_lens.max()) // bs) if B else 0
    for j in range(n_cols):
        ids = block_table[:, j].long().clamp(0, key_cache.shape[0] - 1)  # unused entries may hold anything
        k = key_cache[ids].float()  # (B, H, bs, E)
        v = value_cache[ids].float()  # (B, H, bs, Ev)
        kpos = j * bs + torch.arange(bs, device=query.device)  # (bs,)
        ok = (kpos[None, None, :] <= qpos[:, :, None]) & (kpos[None, None, :] < seq_lens[:, None, None])  # (B, L, bs)
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
    return out.view(B, Hq, L, Ev).to(query.dtype)  # (B, H, G, L, Ev) -> (B, Hq, L, Ev)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor, scale: Optional[float] = None,
                    *, path: str = "chunked") -> torch.Tensor:
    """Causal attention of each sequence's newest ``L`` tokens over its paged cache.

    Args:
        query: (B, Hq, L, E) the queries of the last ``L`` tokens of every sequence (decode: L = 1).
        key_cache: (N_blocks, H, block_size, E) the shared pool of key blocks; Hq a multiple of H (GQA).
        value_cache: (N_blocks, H, block_size, Ev) the pool of value blocks.
        block_table: (B, max_blocks) int: sequence b's blocks in order; entries past its length are ignored.
        seq_lens: (B,) int: tokens cached per sequence (including the L new ones), L <= seq_lens[b].
        scale: score scale, default 1/sqrt(E).
        path: ``"gather"``, ``"chunked"`` or ``"triton"`` (see the module docstring).

    Returns:
        The output, shaped (B, Hq, L, Ev), equal (to float rounding) to causal SDPA over each sequence's
        contiguous cache with the queries aligned to its end.
    """
    _check(query, key_cache, value_cache, block_table, seq_lens)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    if path == "gather":
        return _gather(query, key_cache, value_cache, block_table, seq_lens, scale)
    if path == "chunked":
        return _chunked(query, key_cache, value_cache, block_table, seq_lens, scale)
    if path == "triton":
        from attention_core.backends.triton_paged import triton_paged_attention

        return triton_paged_attention(query, key_cache, value_cache, block_table, seq_lens, scale)
    raise ValueError(f"path must be one of {PAGED_PATHS}, got {path!r}")
