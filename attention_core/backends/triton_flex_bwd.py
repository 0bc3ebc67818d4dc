"""FlexAttention's backward in Triton: the gradients of q, k and v over the block mask's non-empty tiles only.

The forward (:mod:`attention_core.backends.triton_flex`) saves each row's logsumexp ``lse``; the backward
recomputes the probabilities ``p = exp(score_mod(scale q k^T) - lse)`` tile by tile, as FlashAttention-2 does:

1. a preprocess: ``delta = rowsum(dO * O)`` per query row (the ``sum_j p_ij dp_ij`` of the softmax's backward);
2. ``dK, dV``: one program per key tile, which visits the query tiles that read it. The block mask lists, per
   query tile, its key tiles; this pass needs the **transposed** lists, per key tile its full and partial query
   tiles (:func:`transposed_tiles`, O(nQ nK) integers like the mask itself). It computes the tile transposed,
   ``s^T = k q^T``, so ``p^T`` and ``dS^T`` feed their dots without a transpose in registers (transposing ``p``
   instead spilled thousands of bytes on sm_80);
3. ``dQ``: one program per query tile, over the forward's own key tiles.

Full tiles skip the predicate, partial tiles evaluate it, as in the forward. The score mod's derivative is
compiled in: 1 for the additive biases (ALiBi, a relative-position table), ``1 - tanh^2`` for the soft cap. A
row that read no key has ``lse = +inf``, so its ``p`` is 0 and it passes no gradient. Gradients of the tensors a
score mod captures (slopes, a bias table) are not computed here (``backend="chunked"`` computes them).

Launches: :func:`launch_config`; on sm_80 and sm_90 neither loop spills at the forward's GPU tiles
(``benchmarks/results/triton_flex_resources.json``, rows ``bwd_dq`` and ``bwd_dkdv``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from attention_core.backends.triton_flex_mods import _keep, _score

__all__ = ["flex_backward", "launch_config", "transposed_tiles"]

PREPROCESS_BLOCK = 64


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _flex_bwd_preprocess(Out, DO, Delta, L, E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta (BLOCK_M,) = rowsum(dO * O) in float32."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    base = bh.to(tl.int64) * L * E
    inside = (offs_m[:, None] < L) & (offs_d[None, :] < E)
    o = tl.load(Out + base + offs_m[:, None] * E + offs_d[None, :], mask=inside, other=0.0).to(tl.float32)
    do = tl.load(DO + base + offs_m[:, None] * E + offs_d[None, :], mask=inside, other=0.0).to(tl.float32)
    tl.store(Delta + bh.to(tl.int64) * L + offs_m, tl.sum(o * do, 1), mask=offs_m < L)


@triton.jit
def _probs(q, k, lse, offs_m, offs_n, h, DOC, SLOPES, TABLE, sm_scale, CAP, L, S, P0, P1, P2,
           MASK: tl.constexpr, SCORE: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr):
    """Recomputed probabilities p (BLOCK_M, BLOCK_N) float32, and the modded scores s."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = _score(s * sm_scale, offs_m[:, None], offs_n[None, :], h, SLOPES, TABLE, CAP, P2, SCORE)
    valid = (offs_m[:, None] < L) & (offs_n[None, :] < S)
    if PARTIAL:
        valid = valid & _keep(offs_m[:, None], offs_n[None, :], DOC, L, S, P0, P1, MASK)
    p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)  # lse = +inf (a row that read nothing): p = 0
    return p, s


@triton.jit
def _ds(p, dp, delta, s, CAP, SCORE: tl.constexpr):
    """dS = p (dp - delta), times the score mod's derivative: 1 for the additive biases, 1 - tanh^2 for the cap."""
    ds = p * (dp - delta[:, None])
    if SCORE == 2:
        ds = ds * (1.0 - (s / CAP) * (s / CAP))  # d/dx cap tanh(x / cap), s = cap tanh(x / cap)
    return ds


@triton.jit
def _dq_tile(dq, q, do, lse, delta, K, V, kv_base, t, offs_m, offs_d, h, DOC, SLOPES, TABLE, sm_scale, CAP,
             L, S, P0, P1, P2, E: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, SCORE: tl.constexpr,
             PARTIAL: tl.constexpr, IEEE: tl.constexpr):
    """dq (BLOCK_M, BLOCK_D) += dS @ k over key tile ``t`` (scaled by sm_scale at the end)."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    in_k = (offs_n[:, None] < S) & (offs_d[None, :] < E)
    k = tl.load(K + kv_base + offs_n[:, None] * E + offs_d[None, :], mask=in_k, other=0.0)  # (BLOCK_N, BLOCK_D)
    v = tl.load(V + kv_base + offs_n[:, None] * E + offs_d[None, :], mask=in_k, other=0.0)
    p, s = _probs(q, k, lse, offs_m, offs_n, h, DOC, SLOPES, TABLE, sm_scale, CAP, L, S, P0, P1, P2,
                     MASK, SCORE, PARTIAL, IEEE)
    if IEEE:
        dp = tl.dot(do, tl.trans(v), input_precision="ieee")
    else:
        dp = tl.dot(do, tl.trans(v))
    ds = _ds(p, dp, delta, s, CAP, SCORE)
    if IEEE:
        dq += tl.dot(ds.to(k.dtype), k, input_precision="ieee")
    else:
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _flex_bwd_dq(Q, K, V, DO, DQ, LSE, Delta, KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, DOC, SLOPES, TABLE,
                 sm_scale, CAP, L, S, H, HM, N_Q_TILES, N_K_TILES, P0, P1, P2,
                 BM_B: tl.constexpr, BM_H: tl.constexpr, MASK: tl.constexpr, SCORE: tl.constexpr,
                 E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = bh.to(tl.int64) * L * E
    kv_base = bh.to(tl.int64) * S * E
    in_q = (offs_m[:, None] < L) & (offs_d[None, :] < E)
    q = tl.load(Q + q_base + offs_m[:, None] * E + offs_d[None, :], mask=in_q, other=0.0)  # (BLOCK_M, BLOCK_D)
    do = tl.load(DO + q_base + offs_m[:, None] * E + offs_d[None, :], mask=in_q, other=0.0)
    lse = tl.load(LSE + bh.to(tl.int64) * L + offs_m, mask=offs_m < L, other=float("inf"))
    delta = tl.load(Delta + bh.to(tl.int64) * L + offs_m, mask=offs_m < L, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row = ((b * BM_B) * HM + h * BM_H) * N_Q_TILES + pid_m  # the forward's row of the block mask
    n_full = tl.load(FULL_NUM + row)
    for i in range(0, n_full):
        t = tl.load(FULL_IDX + row * N_K_TILES + i)
        dq = _dq_tile(dq, q, do, lse, delta, K, V, kv_base, t, offs_m, offs_d, h, DOC, SLOPES, TABLE, sm_scale,
                      CAP, L, S, P0, P1, P2, E, BLOCK_N, MASK, SCORE, False, IEEE)
    n_part = tl.load(KV_NUM + row)
    for i in range(0, n_part):
        t = tl.load(KV_IDX + row * N_K_TILES + i)
        dq = _dq_tile(dq, q, do, lse, delta, K, V, kv_base, t, offs_m, offs_d, h, DOC, SLOPES, TABLE, sm_scale,
                      CAP, L, S, P0, P1, P2, E, BLOCK_N, MASK, SCORE, True, IEEE)
    dq = dq * sm_scale
    tl.store(DQ + q_base + offs_m[:, None] * E + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=in_q)


@triton.jit
def _probs_t(k, q, lse, offs_m, offs_n, h, DOC, SLOPES, TABLE, sm_scale, CAP, L, S, P0, P1, P2,
             MASK: tl.constexpr, SCORE: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr):
    """The transposed tile, as the dK/dV loop wants it: p^T (BLOCK_N, BLOCK_M) float32 and the modded s^T."""
    if IEEE:
        st = tl.dot(k, tl.trans(q), input_precision="ieee")
    else:
        st = tl.dot(k, tl.trans(q))
    st = _score(st * sm_scale, offs_m[None, :], offs_n[:, None], h, SLOPES, TABLE, CAP, P2, SCORE)
    valid = (offs_m[None, :] < L) & (offs_n[:, None] < S)
    if PARTIAL:
        valid = valid & _keep(offs_m[None, :], offs_n[:, None], DOC, L, S, P0, P1, MASK)
    pt = tl.where(valid, tl.exp(st - lse[None, :]), 0.0)  # lse = +inf (a row that read nothing): p = 0
    return pt, st


@triton.jit
def _dkdv_tile(dk, dv, k, v, Q, DO, LSE, Delta, q_base, lse_base, t, offs_n, offs_d, h, DOC, SLOPES, TABLE,
               sm_scale, CAP, L, S, P0, P1, P2, E: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
               SCORE: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr):
    """dv += p^T dO and dk += dS^T q over query tile ``t``, computed transposed (no transpose of p in registers)."""
    offs_m = t * BLOCK_M + tl.arange(0, BLOCK_M)
    in_q = (offs_m[:, None] < L) & (offs_d[None, :] < E)
    q = tl.load(Q + q_base + offs_m[:, None] * E + offs_d[None, :], mask=in_q, other=0.0)  # (BLOCK_M, BLOCK_D)
    do = tl.load(DO + q_base + offs_m[:, None] * E + offs_d[None, :], mask=in_q, other=0.0)
    lse = tl.load(LSE + lse_base + offs_m, mask=offs_m < L, other=float("inf"))
    delta = tl.load(Delta + lse_base + offs_m, mask=offs_m < L, other=0.0)
    pt, st = _probs_t(k, q, lse, offs_m, offs_n, h, DOC, SLOPES, TABLE, sm_scale, CAP, L, S, P0, P1, P2,
                      MASK, SCORE, PARTIAL, IEEE)  # (BLOCK_N, BLOCK_M)
    if IEEE:
        dv += tl.dot(pt.to(do.dtype), do, input_precision="ieee")
        dpt = tl.dot(v, tl.trans(do), input_precision="ieee")
    else:
        dv += tl.dot(pt.to(do.dtype), do)
        dpt = tl.dot(v, tl.trans(do))
    dst = pt * (dpt - delta[None, :])
    if SCORE == 2:
        dst = dst * (1.0 - (st / CAP) * (st / CAP))
    if IEEE:
        dk += tl.dot(dst.to(q.dtype), q, input_precision="ieee")
    else:
        dk += tl.dot(dst.to(q.dtype), q)
    return dk, dv


@triton.jit
def _flex_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, Delta, Q_NUM, Q_IDX, FULL_Q_NUM, FULL_Q_IDX, DOC, SLOPES, TABLE,
                   sm_scale, CAP, L, S, H, HM, N_Q_TILES, N_K_TILES, P0, P1, P2,
                   BM_B: tl.constexpr, BM_H: tl.constexpr, MASK: tl.constexpr, SCORE: tl.constexpr,
                   E: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = bh.to(tl.int64) * L * E
    kv_base = bh.to(tl.int64) * S * E
    lse_base = bh.to(tl.int64) * L
    in_k = (offs_n[:, None] < S) & (offs_d[None, :] < E)
    k = tl.load(K + kv_base + offs_n[:, None] * E + offs_d[None, :], mask=in_k, other=0.0)  # (BLOCK_N, BLOCK_D)
    v = tl.load(V + kv_base + offs_n[:, None] * E + offs_d[None, :], mask=in_k, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    col = ((b * BM_B) * HM + h * BM_H) * N_K_TILES + pid_n  # this key tile's row of the transposed mask
    n_full = tl.load(FULL_Q_NUM + col)
    for i in range(0, n_full):
        t = tl.load(FULL_Q_IDX + col * N_Q_TILES + i)
        dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, Delta, q_base, lse_base, t, offs_n, offs_d, h, DOC, SLOPES,
                            TABLE, sm_scale, CAP, L, S, P0, P1, P2, E, BLOCK_M, MASK, SCORE, False, IEEE)
    n_part = tl.load(Q_NUM + col)
    for i in range(0, n_part):
        t = tl.load(Q_IDX + col * N_Q_TILES + i)
        dk, dv = _dkdv_tile(dk, dv, k, v, Q, DO, LSE, Delta, q_base, lse_base, t, offs_n, offs_d, h, DOC, SLOPES,
                            TABLE, sm_scale, CAP, L, S, P0, P1, P2, E, BLOCK_M, MASK, SCORE, True, IEEE)
    dk = dk * sm_scale
    tl.store(DK + kv_base + offs_n[:, None] * E + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=in_k)
    tl.store(DV + kv_base + offs_n[:, None] * E + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=in_k)


# ---------------------------------------------------------------------------------------------- launcher


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., n) bool -> counts (...,) int32 and indices (..., n) int32, the True entries first, in order."""
    num = tiles.sum(-1, dtype=torch.int32)
    idx = torch.sort((~tiles).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num, idx


def _members(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Counts (Bm, Hm, nQ) and indices (Bm, Hm, nQ, nK) -> (Bm, Hm, nQ, nK) bool, the listed tiles."""
    cols = torch.arange(idx.shape[-1], device=idx.device)  # (nK,)
    listed = (cols < num[..., None]).to(torch.int32)  # the first num entries are tiles
    out = torch.zeros(idx.shape, dtype=torch.int32, device=idx.device)
    return out.scatter_add_(-1, idx.long(), listed) > 0


def transposed_tiles(kv_num, kv_idx, full_num, full_idx) -> tuple[torch.Tensor, ...]:
    """The block mask per key tile: (q_num (Bm, Hm, nK), q_idx (Bm, Hm, nK, nQ), full_q_num, full_q_idx), int32.

    Key tile ``j`` of query tile ``i`` is partial (full) exactly when query tile ``i`` of key tile ``j`` is.
    """
    partial = _members(kv_num, kv_idx).transpose(-1, -2)  # (Bm, Hm, nQ, nK) -> (Bm, Hm, nK, nQ)
    full = _members(full_num, full_idx).transpose(-1, -2)  # (Bm, Hm, nQ, nK) -> (Bm, Hm, nK, nQ)
    q_num, q_idx = _ordered(partial)
    full_q_num, full_q_idx = _ordered(full)
    return (q_num.contiguous(), q_idx.contiguous(), full_q_num.contiguous(), full_q_idx.contiguous())


def launch_config(dtype: torch.dtype, E: int) -> tuple[int, int]:
    """(num_warps, num_stages) of the backward's two loops, from the resource report: 8 warps (float32 at 4 spilled
    in dK/dV on sm_90); two stages only for 16-bit inputs with E <= 64 (two spilled in dQ on sm_80 at 16-bit
    E = 128 with the soft cap, and in float32 dK/dV on sm_80)."""
    return 8, (2 if dtype != torch.float32 and E <= 64 else 1)


def flex_backward(grad_out, query, key, value, out, lse, kv_num, kv_idx, full_num, full_idx, doc, slopes, table,
                  scale, cap, p0, p1, p2, mask, score, block_m, block_n):
    """(dq, dk, dv) of the flex forward from its saved ``out`` and ``lse`` (B, H, L) float32."""
    B, H, L, E = query.shape
    S = key.shape[2]
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    if L == 0 or S == 0 or B * H == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    grad_out = grad_out.contiguous()
    BLOCK_D = max(16, triton.next_power_of_2(E))
    delta = torch.empty((B, H, L), device=query.device, dtype=torch.float32)
    _flex_bwd_preprocess[(triton.cdiv(L, PREPROCESS_BLOCK), B * H)](
        out, grad_out, delta, L, E=E, BLOCK_D=BLOCK_D, BLOCK_M=PREPROCESS_BLOCK)
    Bm, Hm, nQ, nK = kv_idx.shape
    scalars = dict(sm_scale=scale, CAP=cap, L=L, S=S, H=H, HM=Hm, N_Q_TILES=nQ, N_K_TILES=nK, P0=p0, P1=p1, P2=p2)
    constexprs = dict(BM_B=int(Bm > 1), BM_H=int(Hm > 1), MASK=mask, SCORE=score, E=E, BLOCK_D=BLOCK_D,
                      BLOCK_M=block_m, BLOCK_N=block_n, IEEE=query.dtype == torch.float32)
    warps, stages = launch_config(query.dtype, E)
    _flex_bwd_dq[(nQ, B * H)](query, key, value, grad_out, dq, lse, delta, kv_num, kv_idx, full_num, full_idx,
                              doc, slopes, table, **scalars, **constexprs, num_warps=warps, num_stages=stages)
    q_tiles = transposed_tiles(kv_num, kv_idx, full_num, full_idx)
    _flex_bwd_dkdv[(nK, B * H)](query, key, value, grad_out, dk, dv, lse, delta, *q_tiles, doc, slopes, table,
                                **scalars, **constexprs, num_warps=warps, num_stages=stages)
    return dq, dk, dv
