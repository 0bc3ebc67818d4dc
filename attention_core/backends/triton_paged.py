"""Paged attention in Triton: one program per (sequence, query head, query token) follows the block table.

The program loads its query row, then walks the sequence's blocks in order: it reads the block id from
``block_table[b, j]``, loads that block's ``block_size`` keys and values from the shared pool, and updates an
online softmax (running max ``m``, running sum ``l``, unnormalised output ``acc``), in base 2 as the flash kernel
does. Keys past the query's position (causal, the queries aligned to the end of the sequence) or past its length
are masked. Nothing contiguous is ever built: this is the read pattern of vLLM's PagedAttention kernel, written
for clarity (one query row per program, products as broadcasts and sums, no ``tl.dot``), not for speed.
It computes in float64 for float64 inputs (``CT``), in float32 otherwise.

Layout (as the Triton tutorial): jit kernel -> launcher (validate, allocate, grid) -> public function. It is an
inference kernel: no backward. ``TRITON_INTERPRET=1`` must be set before import to run it on a CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["triton_paged_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_fwd(Q, KC, VC, BT, SL, Out,
               stride_qb, stride_qh, stride_ql,
               stride_kn, stride_kh, stride_ks,
               stride_vn, stride_vh, stride_vs,
               stride_bt, stride_ob, stride_oh, stride_ol,
               L, E, EV, GROUP,
               BLOCK_SIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_EV: tl.constexpr, CT: tl.constexpr):
    b = tl.program_id(0)
    hq = tl.program_id(1)
    i = tl.program_id(2)
    h = hq // GROUP
    seq_len = tl.load(SL + b)
    qpos = seq_len - L + i  # the query's position in its sequence
    offs_e = tl.arange(0, BLOCK_E)
    offs_ev = tl.arange(0, BLOCK_EV)
    offs_s = tl.arange(0, BLOCK_SIZE)
    # the query arrives scaled by scale * log2(e) (in CT), so the scores are in base 2
    q = tl.load(Q + b.to(tl.int64) * stride_qb + hq * stride_qh + i * stride_ql + offs_e, mask=offs_e < E,
                other=0.0).to(CT)
    q_ok = tl.abs(q) < float("inf")  # False for NaN and +-inf
    n_bad = tl.sum(tl.where(q_ok, 0, 1), axis=0)  # non-finite entries this row reads (policy: NaN row)
    q = tl.where(q_ok, q, 0.0)
    m = tl.full([], -float("inf"), CT)
    l_sum = tl.zeros([], CT)
    acc = tl.zeros([BLOCK_EV], dtype=CT)
    n_blocks = (qpos + BLOCK_SIZE) // BLOCK_SIZE  # blocks holding positions 0 .. qpos
    for j in range(0, n_blocks):
        block = tl.load(BT + b.to(tl.int64) * stride_bt + j).to(tl.int64)
        kpos = j * BLOCK_SIZE + offs_s
        visible = kpos <= qpos  # slots past the query (later tokens, stale slots) are never loaded
        k = tl.load(KC + block * stride_kn + h * stride_kh + offs_s[:, None] * stride_ks + offs_e[None, :],
                    mask=visible[:, None] & (offs_e[None, :] < E), other=0.0).to(CT)  # (bs, E)
        v = tl.load(VC + block * stride_vn + h * stride_vh + offs_s[:, None] * stride_vs + offs_ev[None, :],
                    mask=visible[:, None] & (offs_ev[None, :] < EV), other=0.0).to(CT)  # (bs, Ev)
        k_ok = tl.abs(k) < float("inf")
        v_ok = tl.abs(v) < float("inf")
        n_bad += tl.sum(tl.sum(tl.where(k_ok, 0, 1), axis=1), axis=0)
        n_bad += tl.sum(tl.sum(tl.where(v_ok, 0, 1), axis=1), axis=0)
        k = tl.where(k_ok, k, 0.0)
        v = tl.where(v_ok, v, 0.0)
        s = tl.sum(k * q[None, :], axis=1)  # (bs,) in base 2
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp2(s - m_new)
        corr = tl.exp2(m - m_new)
        l_sum = l_sum * corr + tl.sum(p, axis=0)
        acc = acc * corr + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    out = acc / l_sum
    out = tl.where(n_bad > 0, float("nan"), out)
    tl.store(Out + b.to(tl.int64) * stride_ob + hq * stride_oh + i * stride_ol + offs_ev,
             out.to(Out.dtype.element_ty), mask=offs_ev < EV)


def triton_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The launcher of :func:`attention_core.paged_attention.paged_attention`'s ``"triton"`` path.

    Inputs as there (already validated); the block size must be a power of two. Returns (B, Hq, L, Ev) in
    query's dtype, computed in float64 for float64 inputs and in float32 otherwise, with the core's non-finite
    policy (a row that reads a NaN or inf is NaN; a slot it does not see is never loaded).
    """
    from attention_core._checks import check_fits
    from attention_core.backends.fused_checks import GRID_YZ_LIMIT

    B, Hq, L, E = query.shape
    _, H, bs, Ev = value_cache.shape
    if bs & (bs - 1):
        raise ValueError(f"the triton path needs a power-of-two block_size, got key_cache's block_size = {bs}")
    if Hq > GRID_YZ_LIMIT or L > GRID_YZ_LIMIT:
        raise ValueError(f"the triton path runs one program per (sequence, head, query): query's Hq = {Hq} and "
                         f"L = {L} must each be at most {GRID_YZ_LIMIT} (CUDA's grid limit); split the call")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if not t.is_contiguous():  # the kernel reads a dense pool: a strided (or stride-0) one is copied first
            check_fits(t.numel() * t.element_size(), f"a contiguous copy of {name} {tuple(t.shape)}", t.device)
    ct = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = (query.to(ct) * (scale * _LOG2E)).contiguous()  # (B, Hq, L, E): scaled once, in the compute dtype
    key_cache, value_cache = key_cache.contiguous(), value_cache.contiguous()
    block_table = block_table.contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = query.new_empty(B, Hq, L, Ev)
    if out.numel() == 0:
        return out
    grid = (B, Hq, L)
    _paged_fwd[grid](q, key_cache, value_cache, block_table, seq_lens, out,
                     q.stride(0), q.stride(1), q.stride(2),
                     key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
                     value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
                     block_table.stride(0), out.stride(0), out.stride(1), out.stride(2),
                     L, E, Ev, Hq // H,
                     BLOCK_SIZE=bs, BLOCK_E=max(triton.next_power_of_2(E), 16),
                     BLOCK_EV=max(triton.next_power_of_2(Ev), 16),
                     CT=tl.float64 if ct == torch.float64 else tl.float32)
    return out
