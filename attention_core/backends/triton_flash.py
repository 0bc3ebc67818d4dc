"""FlashAttention-2 in Triton: a fused forward and backward that never stores the (L, S) score matrix.

One program owns a tile of ``BLOCK_M`` queries and walks over the keys ``BLOCK_N`` at a time, keeping a
running max ``m``, a running sum ``l`` and an unnormalised output ``acc`` (the online softmax). Everything is
done in base 2: the scores are pre-multiplied by ``scale * log2(e)`` so the kernel calls ``exp2``, the cheap
instruction, and ``exp(x) = exp2(x * log2(e))`` keeps the math unchanged. The forward saves the
log-sum-exp of each row (natural log, float32, (B, Hq, L)); the backward recomputes the probabilities from it
instead of storing them, after a small preprocess kernel computes ``delta = rowsum(dO * O)``.

Masking is by position only: ``is_causal`` (upper-left aligned, as in torch SDPA) and a sliding window of
:func:`attention_core.masks.sliding_window_mask`'s meaning. A (query, key) pair is visible when
``i - left <= j <= i + right``; the launcher turns ``(is_causal, window)`` into ``(left, right)``. Each
program splits its key range into tiles that need the mask (at the edges) and tiles that do not (the bulk),
so the bulk pays nothing for masking and fully hidden tiles are never visited.

Layout (as the Triton tutorial): jit kernels -> launchers (validate, allocate, grid) -> autograd Function ->
public :func:`flash_attention`, plus the registry adapter :func:`attention`.

Dtypes: float16 and bfloat16 (float32 accumulation), and float32 (dots in IEEE fp32, not TF32) so that
the CPU interpreter can check the kernels. Head dims up to 128, zero-padded to a power of two >= 16. GQA:
query head ``h`` reads key/value head ``h // (Hq // H)``.

``TRITON_INTERPRET=1`` must be set before this module is imported (``@triton.jit`` reads it when the kernels
are defined). Without a GPU driver only one autotune config can run, so the interpreter gets one fixed config.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from attention_core._checks import check_positive_int, check_scale
from attention_core.backends.fused_checks import check_fused_inputs

__all__ = ["INTERPRET", "attention", "flash_attention", "flash_attention_backward", "flash_attention_forward"]

#: Read once, as ``@triton.jit`` does: the kernels below are interpreted (NumPy, CPU) when this is True.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: Tests set this to True: every buffer a kernel writes is then filled with NaN first, so an element the
#: kernel forgot to write cannot pass as a plausible value.
POISON_OUTPUTS = False

LOG2E = 1.4426950408889634  # 1 / ln(2)
LN2 = 0.6931471805599453


# --------------------------------------------------------------------------------------------- jit kernels


def _configs(kernel: str) -> List[triton.Config]:
    """Autotune candidates (BLOCK_M queries x BLOCK_N keys per tile) for one kernel.

    Under the interpreter there is no driver to time candidates with, so there is exactly one (32 x 32: the
    smallest tile that keeps the NumPy emulation from drowning in per-program overhead).
    """
    if INTERPRET:
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    if kernel == "dkdv":  # keys are the rows of this kernel: a tall key tile, short query tiles
        shapes = [(32, 64, 4, 3), (32, 128, 8, 3), (64, 64, 4, 2), (64, 128, 8, 2), (16, 128, 4, 3)]
    else:  # fwd and dq: a tall query tile, short key tiles
        shapes = [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 8, 3), (128, 64, 4, 2),
                  (128, 128, 8, 2)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
            for bm, bn, w, st in shapes]


#: A new best config is searched for each distinct value of these arguments.
_TUNE_KEY = ["L", "S", "E", "Ev", "left", "right", "PRECISION"]



@triton.jit
def _tile_ranges(r0, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, n_cols, left, right):
    """Split the columns seen by rows ``[r0, r0 + BLOCK_R)`` into three runs of whole ``BLOCK_C`` tiles.

    Row ``r`` sees columns ``c`` with ``r - left <= c <= r + right`` and ``c < n_cols``. Returns
    ``lo <= a <= b <= hi``: tiles in ``[lo, a)`` and ``[b, hi)`` need the mask, tiles in ``[a, b)`` are
    visible to every row of the block (no mask). All arguments are non-negative, so ``//`` never rounds
    a negative number (Triton truncates, NumPy floors).
    """
    lo = tl.maximum(r0 - left, 0)
    lo = (lo // BLOCK_C) * BLOCK_C
    hi = tl.minimum(r0 + BLOCK_R + right, n_cols)  # one past the last column any row sees
    hi = (tl.maximum(hi, 0) + BLOCK_C - 1) // BLOCK_C * BLOCK_C
    inner_lo = tl.maximum(r0 + BLOCK_R - 1 - left, lo)  # every row sees columns in [inner_lo, inner_hi)
    inner_hi = tl.minimum(r0 + right + 1, n_cols)
    a = lo + (inner_lo - lo + BLOCK_C - 1) // BLOCK_C * BLOCK_C
    a = tl.minimum(a, hi)
    b = a + tl.maximum(inner_hi - a, 0) // BLOCK_C * BLOCK_C
    return lo, a, b, hi


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                    offs_m, offs_d, offs_dv, start, end, S, left, right, qk_scale,
                    E: tl.constexpr, Ev: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Online softmax over the key tiles ``[start, end)``; updates acc (BLOCK_M, BLOCK_DV), l_i and m_i."""
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < S
        kT = tl.load(K + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=key_ok[None, :] & (offs_d[:, None] < E), other=0.0)  # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, kT, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), base-2 logits
        if MASKED:
            keep = (key_ok[None, :] & (offs_n[None, :] >= offs_m[:, None] - left)
                    & (offs_n[None, :] <= offs_m[:, None] + right))
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: no NaN
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=key_ok[:, None] & (offs_dv[None, :] < Ev), other=0.0)  # (BLOCK_N, BLOCK_DV)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(configs=_configs("fwd"), key=_TUNE_KEY)
@triton.jit
def _attn_fwd(Q, K, V, Out, LSE, sm_scale,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              Hq, GROUP, L, S, left, right,
              E: tl.constexpr, Ev: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(L, BLOCK_M), B * Hq): one program per (query tile, batch, query head)."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // Hq).to(tl.int64)
    off_h = off_bh % Hq
    off_hkv = (off_h // GROUP).to(tl.int64)  # GQA: the key/value head this query head reads
    Q += off_b * stride_qb + off_h.to(tl.int64) * stride_qh
    K += off_b * stride_kb + off_hkv * stride_kh
    V += off_b * stride_vb + off_hkv * stride_vh
    Out += off_b * stride_ob + off_h.to(tl.int64) * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < L
    q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < E), other=0.0)  # (BLOCK_M, BLOCK_D), stays on chip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # scores in base 2: exp(x) = exp2(x * log2(e))

    lo, a, b, hi = _tile_ranges(start_m, BLOCK_M, BLOCK_N, S, left, right)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                    offs_m, offs_d, offs_dv, lo, a, S, left, right, qk_scale,
                                    E, Ev, BLOCK_N, True, PRECISION)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                    offs_m, offs_d, offs_dv, a, b, S, left, right, qk_scale,
                                    E, Ev, BLOCK_N, False, PRECISION)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                    offs_m, offs_d, offs_dv, b, hi, S, left, right, qk_scale,
                                    E, Ev, BLOCK_N, True, PRECISION)

    alive = l_i > 0.0  # False for a row whose keys are all hidden: its output is 0 and its lse -inf
    out = acc / tl.where(alive, l_i, 1.0)[:, None]
    lse = m_i + tl.math.log2(tl.where(alive, l_i, 1.0))  # base 2: log2(sum 2^s) = m + log2(l)
    lse = tl.where(alive, lse * 0.6931471805599453, float("-inf"))  # natural log, -inf for an empty row
    tl.store(Out + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < Ev))
    tl.store(LSE + off_bh.to(tl.int64) * L + offs_m, lse, mask=row_ok)


@triton.jit
def _attn_bwd_preprocess(Out, DO, Delta,
                         stride_ob, stride_oh, stride_om, stride_od,
                         stride_dob, stride_doh, stride_dom, stride_dod,
                         Hq, L, Ev: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O), (B * Hq, L): the term the softmax backward subtracts from dP."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    off_bh = tl.program_id(1)
    off_b = (off_bh // Hq).to(tl.int64)
    off_h = (off_bh % Hq).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    ok = (offs_m[:, None] < L) & (offs_dv[None, :] < Ev)
    o = tl.load(Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om
                + offs_dv[None, :] * stride_od, mask=ok, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_dv[None, :] * stride_dod, mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + off_bh.to(tl.int64) * L + offs_m, delta, mask=offs_m < L)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, Delta,
                         stride_qm, stride_qd, stride_dom, stride_dod,
                         offs_n, offs_d, offs_dv, start, end, L, left, right, qk_scale,
                         E: tl.constexpr, Ev: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Accumulate dK, dV of one key tile over the query tiles ``[start, end)`` (transposed: keys are rows)."""
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < L
        qT = tl.load(Q + offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qd,
                     mask=row_ok[None, :] & (offs_d[:, None] < E), other=0.0)  # (BLOCK_D, BLOCK_M)
        lse = tl.load(LSE + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634  # base 2
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a row that sees nothing: p = 0
        sT = tl.dot(k, qT, input_precision=PRECISION) * qk_scale  # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(sT - lse[None, :])  # the forward's probabilities, recomputed
        if MASKED:
            keep = (row_ok[None, :] & (offs_n[:, None] >= offs_m[None, :] - left)
                    & (offs_n[:, None] <= offs_m[None, :] + right))
            pT = tl.where(keep, pT, 0.0)
        do = tl.load(DO + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                     mask=row_ok[:, None] & (offs_dv[None, :] < Ev), other=0.0)  # (BLOCK_M, BLOCK_DV)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)  # dV += P^T dO
        delta = tl.load(Delta + offs_m, mask=row_ok, other=0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M) = (dO V^T)^T
        dsT = pT * (dpT - delta[None, :])  # softmax backward: dS = P * (dP - rowsum(dO * O))
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PRECISION)  # dK += dS^T Q
    return dk, dv


@triton.autotune(configs=_configs("dkdv"), key=_TUNE_KEY)
@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, Delta, sm_scale,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   Hq, H, GROUP, L, S, left, right,
                   E: tl.constexpr, Ev: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(S, BLOCK_N), B * H): one program per (key tile, batch, key/value head).

    With GQA the program loops over the ``GROUP`` query heads that share its key/value head, so the sum over
    the group happens in registers: no atomics, and the result is deterministic.
    """
    start_n = tl.program_id(0) * BLOCK_N
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_hkv = (off_bh % H).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = offs_n < S
    k = tl.load(K + off_b * stride_kb + off_hkv * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, mask=key_ok[:, None] & (offs_d[None, :] < E), other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hkv * stride_vh + offs_n[:, None] * stride_vn
                + offs_dv[None, :] * stride_vd, mask=key_ok[:, None] & (offs_dv[None, :] < Ev), other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634

    # Query i sees key j when j - right <= i <= j + left: the same split with left and right swapped.
    lo, a, b, hi = _tile_ranges(start_n, BLOCK_N, BLOCK_M, L, right, left)
    for g in range(GROUP):
        off_h = off_hkv * GROUP + g
        Qh = Q + off_b * stride_qb + off_h * stride_qh
        DOh = DO + off_b * stride_dob + off_h * stride_doh
        row0 = (off_b * Hq + off_h) * L
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSE + row0, Delta + row0,
                                      stride_qm, stride_qd, stride_dom, stride_dod,
                                      offs_n, offs_d, offs_dv, lo, a, L, left, right, qk_scale,
                                      E, Ev, BLOCK_M, True, PRECISION)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSE + row0, Delta + row0,
                                      stride_qm, stride_qd, stride_dom, stride_dod,
                                      offs_n, offs_d, offs_dv, a, b, L, left, right, qk_scale,
                                      E, Ev, BLOCK_M, False, PRECISION)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSE + row0, Delta + row0,
                                      stride_qm, stride_qd, stride_dom, stride_dod,
                                      offs_n, offs_d, offs_dv, b, hi, L, left, right, qk_scale,
                                      E, Ev, BLOCK_M, True, PRECISION)
    dk *= sm_scale  # dS is w.r.t. the scaled scores; d(scores)/dK = scale * Q
    tl.store(DK + off_b * stride_dkb + off_hkv * stride_dkh + offs_n[:, None] * stride_dkn
             + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
             mask=key_ok[:, None] & (offs_d[None, :] < E))
    tl.store(DV + off_b * stride_dvb + off_hkv * stride_dvh + offs_n[:, None] * stride_dvn
             + offs_dv[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=key_ok[:, None] & (offs_dv[None, :] < Ev))


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, offs_d, offs_dv, start, end, S, left, right, qk_scale,
                       E: tl.constexpr, Ev: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                       PRECISION: tl.constexpr):
    """Accumulate dQ of one query tile over the key tiles ``[start, end)``."""
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        key_ok = offs_n < S
        kT = tl.load(K + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=key_ok[None, :] & (offs_d[:, None] < E), other=0.0)  # (BLOCK_D, BLOCK_N)
        vT = tl.load(V + offs_n[None, :] * stride_vn + offs_dv[:, None] * stride_vd,
                     mask=key_ok[None, :] & (offs_dv[:, None] < Ev), other=0.0)  # (BLOCK_DV, BLOCK_N)
        s = tl.dot(q, kT, input_precision=PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            keep = (key_ok[None, :] & (offs_n[None, :] >= offs_m[:, None] - left)
                    & (offs_n[None, :] <= offs_m[:, None] + right))
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, vT, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) = dO V^T
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)  # dQ += dS K
    return dq


@triton.autotune(configs=_configs("dq"), key=_TUNE_KEY)
@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, LSE, Delta, sm_scale,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 Hq, GROUP, L, S, left, right,
                 E: tl.constexpr, Ev: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(L, BLOCK_M), B * Hq): dQ of one query tile, walking over the key tiles it sees."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // Hq).to(tl.int64)
    off_h = (off_bh % Hq).to(tl.int64)
    off_hkv = off_h // GROUP
    K += off_b * stride_kb + off_hkv * stride_kh
    V += off_b * stride_vb + off_hkv * stride_vh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < L
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & (offs_d[None, :] < E), other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_dv[None, :] * stride_dod, mask=row_ok[:, None] & (offs_dv[None, :] < Ev), other=0.0)
    lse = tl.load(LSE + off_bh.to(tl.int64) * L + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a row that sees nothing: p = 0
    delta = tl.load(Delta + off_bh.to(tl.int64) * L + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634

    lo, a, b, hi = _tile_ranges(start_m, BLOCK_M, BLOCK_N, S, left, right)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                            offs_m, offs_d, offs_dv, lo, a, S, left, right, qk_scale,
                            E, Ev, BLOCK_N, True, PRECISION)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                            offs_m, offs_d, offs_dv, a, b, S, left, right, qk_scale,
                            E, Ev, BLOCK_N, False, PRECISION)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                            offs_m, offs_d, offs_dv, b, hi, S, left, right, qk_scale,
                            E, Ev, BLOCK_N, True, PRECISION)
    dq *= sm_scale  # d(scores)/dQ = scale * K
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm
             + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < E))


# ----------------------------------------------------------------------------------------------- launchers

def _alloc(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer; NaN-filled when :data:`POISON_OUTPUTS` is on (tests), else uninitialised."""
    t = torch.empty(shape, dtype=dtype, device=device)
    return t.fill_(float("nan")) if POISON_OUTPUTS else t


def _block_dim(n: int) -> int:
    """A head dim rounded up to a power of two >= 16 (for ``tl.arange``, ``tl.dot``); the rest is masked."""
    return max(16, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    """fp32 dots in IEEE fp32 (a GPU would otherwise use TF32, about 3 significant digits)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _on_device(t: torch.Tensor):
    """Launch on ``t``'s GPU (Triton launches on the current device), or do nothing on the CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def window_bounds(L: int, S: int, is_causal: bool, window: Optional[int]) -> Tuple[int, int]:
    """``(left, right)``: query ``i`` sees key ``j`` when ``i - left <= j <= i + right``.

    ``window`` has the meaning of :func:`attention_core.masks.sliding_window_mask`: with ``is_causal`` the
    ``window`` most recent keys (``left = window - 1, right = 0``), without it ``window // 2`` on each side.
    No window: ``L + S`` on an open side, farther than any pair of positions.
    """
    unbounded = L + S
    if window is None:
        return unbounded, (0 if is_causal else unbounded)
    if is_causal:
        return window - 1, 0
    return window // 2, window // 2


def flash_attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, left: int, right: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on checked inputs; returns ``out`` (B, Hq, L, Ev) and ``lse`` (B, Hq, L).

    ``lse`` is the natural-log log-sum-exp of each row's visible scaled scores, float32; ``-inf`` (and an
    output row of zeros) where a row sees no key.
    """
    B, Hq, L, E = query.shape
    H, S, Ev = key.shape[1], key.shape[2], value.shape[3]
    out = _alloc((B, Hq, L, Ev), query.dtype, query.device)
    lse = _alloc((B, Hq, L), torch.float32, query.device)
    if out.numel() == 0 or S == 0:  # nothing to launch; no keys at all means every row is fully masked
        return out.zero_(), lse.fill_(float("-inf"))

    def grid(meta: dict) -> Tuple[int, int]:
        return triton.cdiv(L, meta["BLOCK_M"]), B * Hq

    with _on_device(query):
        _attn_fwd[grid](
            query, key, value, out, lse, scale,
            *query.stride(), *key.stride(), *value.stride(), *out.stride(),
            Hq, Hq // H, L, S, left, right,
            E=E, Ev=Ev, BLOCK_D=_block_dim(E), BLOCK_DV=_block_dim(Ev), PRECISION=_precision(query.dtype),
        )
    return out, lse


def flash_attention_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    left: int,
    right: int,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the three backward kernels (delta, dK/dV, dQ); returns ``(dq, dk, dv)``, the inputs' shapes."""
    B, Hq, L, E = query.shape
    H, S, Ev = key.shape[1], key.shape[2], value.shape[3]
    dq = _alloc(tuple(query.shape), query.dtype, query.device)
    dk = _alloc(tuple(key.shape), key.dtype, key.device)
    dv = _alloc(tuple(value.shape), value.dtype, value.device)
    if L == 0 or S == 0 or B * Hq == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = _alloc((B, Hq, L), torch.float32, query.device)
    common = dict(E=E, Ev=Ev, BLOCK_D=_block_dim(E), BLOCK_DV=_block_dim(Ev),
                  PRECISION=_precision(query.dtype))
    pre_block = 32 if INTERPRET else 64

    def grid_q(meta: dict) -> Tuple[int, int]:
        return triton.cdiv(L, meta["BLOCK_M"]), B * Hq

    def grid_kv(meta: dict) -> Tuple[int, int]:
        return triton.cdiv(S, meta["BLOCK_N"]), B * H

    with _on_device(query):
        _attn_bwd_preprocess[(triton.cdiv(L, pre_block), B * Hq)](
            out, grad_out, delta, *out.stride(), *grad_out.stride(), Hq, L,
            Ev=Ev, BLOCK_DV=_block_dim(Ev), BLOCK_M=pre_block,
        )
        _attn_bwd_dkdv[grid_kv](
            query, key, value, grad_out, dk, dv, lse, delta, scale,
            *query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
            Hq, H, Hq // H, L, S, left, right, **common,
        )
        _attn_bwd_dq[grid_q](
            query, key, value, grad_out, dq, lse, delta, scale,
            *query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *dq.stride(),
            Hq, Hq // H, L, S, left, right, **common,
        )
    return dq, dk, dv


def _check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
                  window: Optional[int]) -> None:
    """Validate the public function's arguments (the registry path arrives already validated)."""
    check_fused_inputs(query, key, value, is_causal)
    if window is not None:
        check_positive_int(window, "window")
    if INTERPRET and query.device.type != "cpu":
        raise ValueError(f"under TRITON_INTERPRET=1 the kernels run on CPU tensors, got {query.device}")
    if not INTERPRET and query.device.type != "cuda":
        raise ValueError(
            f"the Triton kernels run on CUDA tensors, got {query.device}; set TRITON_INTERPRET=1 before "
            "importing attention_core.backends.triton_flash to run them (slowly) on the CPU"
        )
    if INTERPRET and query.dtype == torch.bfloat16:
        raise TypeError("the Triton interpreter computes bfloat16 dots wrongly; use float16 or float32 there")


# ---------------------------------------------------------------------------------------- autograd Function


class _FlashAttention(torch.autograd.Function):
    """Forward saves (q, k, v, out, lse), O(L) extra; backward recomputes the probabilities from lse."""

    @staticmethod
    def forward(ctx, query, key, value, scale, left, right):  # type: ignore[override]
        out, lse = flash_attention_forward(query, key, value, scale, left, right)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.bounds = (scale, left, right)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(grad_out, query, key, value, out, lse, *ctx.bounds)
        return dq, dk, dv, None, None, None


# ------------------------------------------------------------------------------------------ public function


def flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Fused attention ``softmax(query @ key^T * scale) @ value``, optionally causal and/or windowed.

    Args:
        query: (B, Hq, L, E), float16, bfloat16 or float32, on a CUDA device (the CPU under
            ``TRITON_INTERPRET=1``).
        key: (B, H, S, E) with ``Hq % H == 0`` (grouped-query attention when ``H < Hq``).
        value: (B, H, S, Ev). ``E`` and ``Ev`` at most 128.
        is_causal: query ``i`` sees keys ``j <= i`` (upper-left aligned, as torch SDPA).
        scale: multiplies the scores; ``1 / sqrt(E)`` by default.
        window: ``None`` or a window size >= 1, as :func:`attention_core.masks.sliding_window_mask` with
            ``causal=is_causal``: the ``window`` most recent keys if causal, else ``window // 2`` on each
            side.

    Returns:
        (B, Hq, L, Ev) in the query's dtype; rows that see no key are zeros. Differentiable in q, k, v.
    """
    _check_inputs(query, key, value, is_causal, window)
    scale = check_scale(scale)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    left, right = window_bounds(query.shape[2], key.shape[2], is_causal, window)
    return _FlashAttention.apply(query, key, value, scale, left, right)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """Registry entry point on canonical inputs (see :mod:`attention_core.backends`); no window here."""
    if attn_mask is not None or dropout_p > 0:  # fused_checks.triton_supports refuses these first
        raise ValueError("the triton backend takes no attn_mask and no dropout")
    return flash_attention(query, key, value, is_causal=is_causal, scale=scale)
