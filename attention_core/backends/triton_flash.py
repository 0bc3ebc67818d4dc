"""FlashAttention-2 in Triton: a fused forward and backward that never stores the (L, S) score matrix.

One program owns a tile of ``BLOCK_M`` queries and walks over the keys ``BLOCK_N`` at a time, keeping a
running max ``m``, a running sum ``l`` and an unnormalised output ``acc`` (the online softmax). Everything is
done in base 2: ``exp(x) = exp2(x * log2(e))``, so the kernel calls ``exp2``, the cheap instruction, and the
factor ``scale * log2(e)`` is folded into the running max: one fused multiply-add per score,
``exp2(s * qk_scale - m)``, instead of a multiply and then a subtract. The forward saves the log-sum-exp of
each row (natural log, float32, (B, Hq, L)); the backward recomputes the probabilities from it instead of
storing them, after a small preprocess kernel computes ``delta = rowsum(dO * O)``.

Masking is by position only: ``is_causal`` (upper-left aligned, as in torch SDPA) and a sliding window of
:func:`attention_core.masks.sliding_window_mask`'s meaning. A (query, key) pair is visible when
``i - left <= j <= i + right``; the launcher turns ``(is_causal, window)`` into ``(left, right)`` and then
into a compile-time ``MODE``, so that the common cases compile to few loops (fewer loops, fewer registers):

========== ======================================================== =================================
MODE       forward / dQ (rows: queries, columns: keys)               dK/dV (rows: keys, columns: queries)
========== ======================================================== =================================
full       one unmasked loop (+ a masked last tile if S % BLOCK_N)   one loop
causal     unmasked tiles left of the diagonal, then masked ones     masked diagonal, then unmasked
window     masked, unmasked, masked (:func:`_tile_ranges`)           the same, roles swapped
========== ======================================================== =================================

``EVEN_M`` / ``EVEN_N`` (L, S multiples of the block) and ``BLOCK_D == E`` remove the bounds checks from
every load and store at compile time. Row offsets are 64-bit (a program's first row times the row stride can
pass 2^31); offsets inside a tile stay 32-bit.

Layout (as the Triton tutorial): jit kernels -> autotuning (the candidates are in
:mod:`attention_core.backends.triton_configs`) -> launchers (allocate, grid) -> autograd, as custom operators
with fake implementations (so that ``torch.compile(fullgraph=True)`` traces through them) -> the public
:func:`flash_attention` (which validates), plus the registry's :func:`run` (inputs already validated).

Dtypes: float16 and bfloat16 (float32 accumulation, tensor cores), and float32 (dots in IEEE fp32, not TF32,
on the ordinary FMA units, with its own smaller tiles) so that the CPU interpreter can check the kernels. Head
dims up to 128, zero-padded to a power of two >= 16. GQA: query head ``h`` reads key/value head
``h // (Hq // H)``; the dK/dV kernel sums over the query heads of a group (see :data:`GQA_SPLIT`).

What the kernels cost on a GPU (registers, spills, shared memory, tensor-core instructions per config) is
measured on the CPU by :mod:`attention_core.backends.triton_inspect` (``benchmarks/triton_resources.py``).
On sm_75 (Turing: Colab's T4) Triton compiles ``tl.dot`` without tensor cores: the kernels run, slowly.
On sm_90 (Hopper), once switched on (``AC_TRITON_TMA=1``; off by default until it has run on a GPU), the forward
of the inputs :func:`attention_core.backends.triton_flash_tma.use_tma` covers runs that module's kernel instead,
which moves tiles with tensor descriptors (TMA); the backward is this one.

``TRITON_INTERPRET=1`` must be set before this module is imported (``@triton.jit`` reads it when the kernels
are defined). Without a GPU driver only one autotune config can run, so the interpreter gets one fixed block
shape: 32 x 32, or ``AC_TRITON_INTERPRET_BLOCKS=MxN`` (e.g. ``128x64``), or :func:`interpreter_blocks`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Optional, Tuple

import torch
import triton
import triton.language as tl

from attention_core._checks import check_positive_int, check_scale
from attention_core.backends.fused_checks import (
    check_fused_inputs,
    triton_grid_reason,
    triton_tensor_core_warning,
)
from attention_core.backends.inputs import AttentionInputs, BackendResult, scale_or_default
from attention_core.backends.triton_configs import (  # noqa: F401  (re-exported: tests, triton_inspect)
    CANDIDATES,
    PREPROCESS_BLOCK,
    RAGGED_SPILLS,
    TUNE_KEY,
    autotune_configs,
    check_block,
    favoured_config,
    interpreter_shape,
    kind,
    make_config,
    prune_for,
    shape_of,
)
from attention_core.backends.triton_modes import CAUSAL, FULL, WINDOW, mask_mode  # noqa: F401  (MODE codes)

__all__ = [
    "GQA_SPLIT",
    "INTERPRET",
    "run",
    "autotune_configs",
    "favoured_config",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
    "interpreter_blocks",
    "kernel_constexprs",
    "mask_mode",
    "window_bounds",
]

#: Read once, as ``@triton.jit`` does: the kernels below are interpreted (NumPy, CPU) when this is True.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: How many programs share the query heads of one GQA group in the dK/dV kernel. ``None``: automatic, more
#: than one only when ``cdiv(S, 64) * B * H`` programs would leave the GPU's SMs idle (e.g. MQA, B = 1); each
#: program then writes a float32 partial sum, added up afterwards (``split`` extra (B, H, S, E) buffers).
#: An int forces it (it must divide ``Hq // H``); the tests use that under the interpreter.
GQA_SPLIT: Optional[int] = None

LOG2E = 1.4426950408889634  # 1 / ln(2)
LN2 = 0.6931471805599453



# --------------------------------------------------------------------------------------------- jit kernels


@triton.jit
def _load(ptrs, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a 2-D tile, checking row (axis 0) and column (axis 1) bounds only where asked (zeros outside)."""
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _store(ptrs, x, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Store a 2-D tile, checking bounds only where asked."""
    if CHECK_ROWS:
        if CHECK_COLS:
            tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))
        else:
            tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        if CHECK_COLS:
            tl.store(ptrs, x, mask=cols[None, :] < n_cols)
        else:
            tl.store(ptrs, x)


@triton.jit
def _load_rows(ptrs, rows, n_rows, CHECK: tl.constexpr):
    """Load a 1-D vector (one float per row), checking the bound only where asked."""
    if CHECK:
        x = tl.load(ptrs, mask=rows < n_rows, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _tile_ranges(r0, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, n_cols, left, right):
    """Split the columns seen by rows ``[r0, r0 + BLOCK_R)`` into three runs of whole ``BLOCK_C`` tiles.

    Row ``r`` sees columns ``c`` with ``r - left <= c <= r + right`` and ``c < n_cols``. Returns
    ``lo <= a <= b <= hi``: tiles in ``[lo, a)`` and ``[b, hi)`` need the mask, tiles in ``[a, b)`` are
    visible to every row of the block (no mask), and no column outside ``[lo, hi)`` is visible to any row.
    All arguments are non-negative, so ``//`` never rounds a negative number (Triton truncates, NumPy
    floors). The window mode's split (see :func:`_col_ranges`).
    """
    first = tl.maximum(r0 - left, 0)  # the first column any row sees
    end = tl.minimum(r0 + BLOCK_R + right, n_cols)  # one past the last one
    lo = first // BLOCK_C * BLOCK_C
    hi = tl.where(end > first, (end + BLOCK_C - 1) // BLOCK_C * BLOCK_C, lo)  # no tile if no row sees any
    inner_lo = tl.maximum(r0 + BLOCK_R - 1 - left, lo)  # every row sees columns in [inner_lo, inner_hi)
    inner_hi = tl.minimum(r0 + right + 1, n_cols)
    a = lo + (inner_lo - lo + BLOCK_C - 1) // BLOCK_C * BLOCK_C
    b = a + tl.maximum(inner_hi - a, 0) // BLOCK_C * BLOCK_C
    a = tl.minimum(a, hi)
    b = tl.minimum(tl.maximum(b, a), hi)
    return lo, a, b, hi


@triton.jit
def _col_ranges(r0, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, n_cols, left, right, MODE: tl.constexpr,
                ROWS_ARE_QUERIES: tl.constexpr):
    """The column tiles rows ``[r0, r0 + BLOCK_R)`` visit: masked ``[lo, a)``, unmasked ``[a, b)``, masked ``[b, hi)``.

    Each run is walked ``BLOCK_C`` at a time from its start. Rows are queries (forward, dQ; columns are keys)
    or keys (dK/dV; columns are queries, and the window's ``left``/``right`` swap). Every visible column is
    in exactly one visited tile, every column of an unmasked tile is visible to every row, and no visited
    tile is hidden from all rows (tests/_triton_interp_cases.py checks this for every block size).

    Closed forms for the full and causal modes leave some runs empty, so those loops are not compiled:
    forward/dQ visit no ``[lo, a)`` (and no ``[b, hi)`` in the full mode when ``n_cols % BLOCK_C == 0``);
    dK/dV visit no ``[lo, a)`` in the full mode and no ``[b, hi)`` outside the window mode. A column past
    ``n_cols`` may sit in an unmasked dK/dV tile: it is a query that loads as zeros and adds nothing.
    """
    if MODE == 2:
        if ROWS_ARE_QUERIES:
            lo, a, b, hi = _tile_ranges(r0, BLOCK_R, BLOCK_C, n_cols, left, right)
        else:  # key j is seen by query i when j - right <= i <= j + left
            lo, a, b, hi = _tile_ranges(r0, BLOCK_R, BLOCK_C, n_cols, right, left)
    elif MODE == 1:
        if ROWS_ARE_QUERIES:  # keys left of the first query: seen by every row; then the diagonal
            lo = 0
            a = 0
            b = tl.minimum(r0, n_cols) // BLOCK_C * BLOCK_C
            hi = tl.minimum(r0 + BLOCK_R, n_cols)
        else:  # queries i >= j: the tiles on the diagonal (masked), then every later one
            lo = tl.where(r0 < n_cols, r0 // BLOCK_C * BLOCK_C, n_cols)  # keys past the last query: none
            a = tl.minimum((r0 + BLOCK_R + BLOCK_C - 1) // BLOCK_C * BLOCK_C, n_cols)
            b = n_cols
            hi = n_cols
    else:
        lo = 0
        a = 0
        if ROWS_ARE_QUERIES:  # whole key tiles unmasked, the partial last one masked
            b = n_cols // BLOCK_C * BLOCK_C
        else:
            b = n_cols
        hi = n_cols
    return lo, a, b, hi


@triton.jit
def _visible(offs_q, offs_k, n_keys, left, right, MODE: tl.constexpr, CHECK_KEYS: tl.constexpr):
    """(len(offs_q), len(offs_k)) bool: query ``i`` sees key ``j`` (and ``j < n_keys`` if ``CHECK_KEYS``)."""
    if MODE == 2:
        keep = ((offs_k[None, :] >= offs_q[:, None] - left) & (offs_k[None, :] <= offs_q[:, None] + right)
                & (offs_k[None, :] < n_keys))
    elif MODE == 1:
        keep = offs_k[None, :] <= offs_q[:, None]
        if CHECK_KEYS:
            keep = keep & (offs_k[None, :] < n_keys)
    else:
        keep = (offs_k[None, :] < n_keys) & (offs_q[:, None] >= 0)
    return keep


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                    offs_m, start, end, S, left, right, qk_scale,
                    E: tl.constexpr, Ev: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MODE: tl.constexpr, EVEN_N: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Online softmax over the key tiles ``[start, end)``; updates acc (BLOCK_M, BLOCK_DV), l_i and m_i.

    ``MASKED``: the tiles straddle a mask edge (diagonal, window edge, or the end of the keys).
    """
    CHECK_KEYS: tl.constexpr = MASKED and not EVEN_N
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT_offs = tl.arange(0, BLOCK_N)[None, :] * stride_kn + tl.arange(0, BLOCK_D)[:, None] * stride_kd
        kT = _load(K + tl.cast(start_n, tl.int64) * stride_kn + kT_offs, tl.arange(0, BLOCK_D), E, offs_n, S,
                   BLOCK_D != E, CHECK_KEYS)  # (BLOCK_D, BLOCK_N)
        qk = tl.dot(q, kT, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N), unscaled scores
        if MASKED:
            qk = tl.where(_visible(offs_m, offs_n, S, left, right, MODE, CHECK_KEYS), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # the running max, in scaled base-2 units
        if MASKED and MODE == 2:  # a row that has seen no key yet (only a window can do that): no NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])  # one FMA per score: the scale is folded in here
        alpha = tl.math.exp2(m_i - m_use)  # rescales what was accumulated under the old max
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v_offs = tl.arange(0, BLOCK_N)[:, None] * stride_vn + tl.arange(0, BLOCK_DV)[None, :] * stride_vd
        v = _load(V + tl.cast(start_n, tl.int64) * stride_vn + v_offs, offs_n, S, tl.arange(0, BLOCK_DV), Ev,
                  CHECK_KEYS, BLOCK_DV != Ev)  # (BLOCK_N, BLOCK_DV)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, Out, LSE, sm_scale,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              Hq, GROUP, L, S, left, right, L_BUCKET, S_BUCKET,
              E: tl.constexpr, Ev: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              MODE: tl.constexpr, PRECISION: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(L, BLOCK_M), B * Hq): one program per (query tile, batch, query head).

    ``L_BUCKET`` and ``S_BUCKET`` are unused here: they are the autotune key (L and S rounded up to a power
    of two), so that a new length reuses the config found for its bucket.
    """
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // Hq).to(tl.int64)
    off_h = (off_bh % Hq).to(tl.int64)
    off_hkv = off_h // GROUP  # GQA: the key/value head this query head reads
    Q += off_b * stride_qb + off_h * stride_qh + start_m.to(tl.int64) * stride_qm
    K += off_b * stride_kb + off_hkv * stride_kh
    V += off_b * stride_vb + off_hkv * stride_vh
    Out += off_b * stride_ob + off_h * stride_oh + start_m.to(tl.int64) * stride_om

    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load(Q + rows[:, None] * stride_qm + offs_d[None, :] * stride_qd, offs_m, L, offs_d, E,
              not EVEN_M, BLOCK_D != E)  # (BLOCK_M, BLOCK_D), stays on chip

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # scores in base 2: exp(x) = exp2(x * log2(e))

    lo, a, b, hi = _col_ranges(start_m, BLOCK_M, BLOCK_N, S, left, right, MODE, True)
    if MODE == 2:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                        offs_m, lo, a, S, left, right, qk_scale,
                                        E, Ev, BLOCK_D, BLOCK_DV, BLOCK_N, True, MODE, EVEN_N, PRECISION)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                    offs_m, a, b, S, left, right, qk_scale,
                                    E, Ev, BLOCK_D, BLOCK_DV, BLOCK_N, False, MODE, EVEN_N, PRECISION)
    if MODE != 0 or not EVEN_N:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                        offs_m, b, hi, S, left, right, qk_scale,
                                        E, Ev, BLOCK_D, BLOCK_DV, BLOCK_N, True, MODE, EVEN_N, PRECISION)

    if MODE == 2:  # only a window can leave a row with no key: output 0, lse -inf
        alive = l_i > 0.0
        out = acc / tl.where(alive, l_i, 1.0)[:, None]
        lse = m_i + tl.math.log2(tl.where(alive, l_i, 1.0))  # base 2: log2(sum 2^s) = m + log2(l)
        lse = tl.where(alive, lse * 0.6931471805599453, float("-inf"))  # natural log
    else:
        out = acc / l_i[:, None]
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    _store(Out + rows[:, None] * stride_om + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty),
           offs_m, L, offs_dv, Ev, not EVEN_M, BLOCK_DV != Ev)
    if EVEN_M:
        tl.store(LSE + off_bh.to(tl.int64) * L + offs_m, lse)
    else:
        tl.store(LSE + off_bh.to(tl.int64) * L + offs_m, lse, mask=offs_m < L)


@triton.jit
def _attn_bwd_preprocess(Out, DO, Delta,
                         stride_ob, stride_oh, stride_om, stride_od,
                         stride_dob, stride_doh, stride_dom, stride_dod,
                         Hq, L, Ev: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O), (B * Hq, L): the term the softmax backward subtracts from dP."""
    start_m = tl.program_id(0) * BLOCK_M
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    off_bh = tl.program_id(1)
    off_b = (off_bh // Hq).to(tl.int64)
    off_h = (off_bh % Hq).to(tl.int64)
    offs_dv = tl.arange(0, BLOCK_DV)
    ok = (offs_m[:, None] < L) & (offs_dv[None, :] < Ev)
    row0 = start_m.to(tl.int64)
    o = tl.load(Out + off_b * stride_ob + off_h * stride_oh + row0 * stride_om + rows[:, None] * stride_om
                + offs_dv[None, :] * stride_od, mask=ok, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + row0 * stride_dom + rows[:, None] * stride_dom
                 + offs_dv[None, :] * stride_dod, mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + off_bh.to(tl.int64) * L + offs_m, delta, mask=offs_m < L)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, Delta, stride_qm, stride_qd, stride_dom, stride_dod,
                         offs_n, start, end, L, left, right, qk_scale,
                         E: tl.constexpr, Ev: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                         BLOCK_M: tl.constexpr, MASKED: tl.constexpr, MODE: tl.constexpr, EVEN_M: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Accumulate dK, dV of one key tile over the query tiles ``[start, end)`` (transposed: keys are rows).

    A query past ``L`` loads as zeros (q, dO, lse and delta), which adds exactly zero to dK and dV, so only
    the mask of visible pairs is needed, never one for the end of the queries.
    """
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row0 = tl.cast(start_m, tl.int64)
        qT_offs = tl.arange(0, BLOCK_M)[None, :] * stride_qm + tl.arange(0, BLOCK_D)[:, None] * stride_qd
        do_offs = tl.arange(0, BLOCK_M)[:, None] * stride_dom + tl.arange(0, BLOCK_DV)[None, :] * stride_dod
        qT = _load(Q + row0 * stride_qm + qT_offs, tl.arange(0, BLOCK_D), E, offs_m, L,
                   BLOCK_D != E, not EVEN_M)  # (BLOCK_D, BLOCK_M)
        lse = _load_rows(LSE + offs_m, offs_m, L, not EVEN_M) * 1.4426950408889634  # base 2
        if MODE == 2:
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a row that sees nothing: p = 0
        sT = tl.dot(k, qT, input_precision=PRECISION)  # (BLOCK_N, BLOCK_M), unscaled
        pT = tl.math.exp2(sT * qk_scale - lse[None, :])  # the forward's probabilities, recomputed
        if MASKED:  # (BLOCK_N, BLOCK_M): key j (row) seen by query i (column)
            if MODE == 2:
                keep = (offs_n[:, None] >= offs_m[None, :] - left) & (offs_n[:, None] <= offs_m[None, :] + right)
            else:
                keep = offs_n[:, None] <= offs_m[None, :]
            pT = tl.where(keep, pT, 0.0)
        do = _load(DO + row0 * stride_dom + do_offs, offs_m, L, tl.arange(0, BLOCK_DV), Ev,
                   not EVEN_M, BLOCK_DV != Ev)  # (BLOCK_M, BLOCK_DV)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)  # dV += P^T dO
        delta = _load_rows(Delta + offs_m, offs_m, L, not EVEN_M)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M) = (dO V^T)^T
        dsT = pT * (dpT - delta[None, :])  # softmax backward: dS = P * (dP - rowsum(dO * O))
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PRECISION)  # dK += dS^T Q
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, DK, DV, LSE, Delta, sm_scale,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   stride_dks, stride_dvs,
                   Hq, H, GROUP, GROUP_PER, L, S, left, right, L_BUCKET, S_BUCKET,
                   E: tl.constexpr, Ev: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                   MODE: tl.constexpr, PRECISION: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(S, BLOCK_N), B * H, split): one program per (key tile, batch, key/value head, part of group).

    With GQA a program walks over ``GROUP_PER`` of the ``GROUP`` query heads that share its key/value head,
    so their sum happens in registers: no atomics, and the result is deterministic. With ``split > 1``
    (``GROUP_PER = GROUP // split``) program ``s`` writes its partial sum at ``DK + s * stride_dks`` (a
    float32 buffer the launcher adds up); with ``split == 1`` the strides are 0 and it writes dK itself.
    """
    start_n = tl.program_id(0) * BLOCK_N
    off_bh = tl.program_id(1)
    off_split = tl.program_id(2)
    off_b = (off_bh // H).to(tl.int64)
    off_hkv = (off_bh % H).to(tl.int64)
    rows = tl.arange(0, BLOCK_N)
    offs_n = start_n + rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row0 = start_n.to(tl.int64)
    k = _load(K + off_b * stride_kb + off_hkv * stride_kh + row0 * stride_kn + rows[:, None] * stride_kn
              + offs_d[None, :] * stride_kd, offs_n, S, offs_d, E, not EVEN_N, BLOCK_D != E)
    v = _load(V + off_b * stride_vb + off_hkv * stride_vh + row0 * stride_vn + rows[:, None] * stride_vn
              + offs_dv[None, :] * stride_vd, offs_n, S, offs_dv, Ev, not EVEN_N, BLOCK_DV != Ev)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634

    lo, a, b, hi = _col_ranges(start_n, BLOCK_N, BLOCK_M, L, left, right, MODE, False)
    g0 = off_split * GROUP_PER
    for g in range(g0, g0 + GROUP_PER):
        off_h = off_hkv * GROUP + g
        Qh = Q + off_b * stride_qb + off_h * stride_qh
        DOh = DO + off_b * stride_dob + off_h * stride_doh
        LSEh = LSE + (off_b * Hq + off_h) * L
        Dh = Delta + (off_b * Hq + off_h) * L
        if MODE != 0:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, Dh, stride_qm, stride_qd, stride_dom,
                                          stride_dod, offs_n, lo, a, L, left, right, qk_scale, E, Ev, BLOCK_D,
                                          BLOCK_DV, BLOCK_M, True, MODE, EVEN_M, PRECISION)
        dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, Dh, stride_qm, stride_qd, stride_dom,
                                      stride_dod, offs_n, a, b, L, left, right, qk_scale, E, Ev, BLOCK_D,
                                      BLOCK_DV, BLOCK_M, False, MODE, EVEN_M, PRECISION)
        if MODE == 2:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LSEh, Dh, stride_qm, stride_qd, stride_dom,
                                          stride_dod, offs_n, b, hi, L, left, right, qk_scale, E, Ev, BLOCK_D,
                                          BLOCK_DV, BLOCK_M, True, MODE, EVEN_M, PRECISION)
    dk *= sm_scale  # dS is w.r.t. the scaled scores; d(scores)/dK = scale * Q
    DK += off_split.to(tl.int64) * stride_dks + off_b * stride_dkb + off_hkv * stride_dkh + row0 * stride_dkn
    DV += off_split.to(tl.int64) * stride_dvs + off_b * stride_dvb + off_hkv * stride_dvh + row0 * stride_dvn
    _store(DK + rows[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
           offs_n, S, offs_d, E, not EVEN_N, BLOCK_D != E)
    _store(DV + rows[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
           offs_n, S, offs_dv, Ev, not EVEN_N, BLOCK_DV != Ev)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, start, end, S, left, right, qk_scale,
                       E: tl.constexpr, Ev: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                       BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MODE: tl.constexpr, EVEN_N: tl.constexpr,
                       PRECISION: tl.constexpr):
    """Accumulate dQ of one query tile over the key tiles ``[start, end)``."""
    CHECK_KEYS: tl.constexpr = MASKED and not EVEN_N
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col0 = tl.cast(start_n, tl.int64)
        kT_offs = tl.arange(0, BLOCK_N)[None, :] * stride_kn + tl.arange(0, BLOCK_D)[:, None] * stride_kd
        vT_offs = tl.arange(0, BLOCK_N)[None, :] * stride_vn + tl.arange(0, BLOCK_DV)[:, None] * stride_vd
        kT = _load(K + col0 * stride_kn + kT_offs, tl.arange(0, BLOCK_D), E, offs_n, S,
                   BLOCK_D != E, CHECK_KEYS)  # (BLOCK_D, BLOCK_N)
        vT = _load(V + col0 * stride_vn + vT_offs, tl.arange(0, BLOCK_DV), Ev, offs_n, S,
                   BLOCK_DV != Ev, CHECK_KEYS)  # (BLOCK_DV, BLOCK_N)
        qk = tl.dot(q, kT, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N), unscaled
        p = tl.math.exp2(qk * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m, offs_n, S, left, right, MODE, CHECK_KEYS), p, 0.0)
        dp = tl.dot(do, vT, input_precision=PRECISION)  # (BLOCK_M, BLOCK_N) = dO V^T
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)  # dQ += dS K
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, DQ, LSE, Delta, sm_scale,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 Hq, GROUP, L, S, left, right, L_BUCKET, S_BUCKET,
                 E: tl.constexpr, Ev: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 MODE: tl.constexpr, PRECISION: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (cdiv(L, BLOCK_M), B * Hq): dQ of one query tile, walking over the key tiles it sees."""
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = (off_bh // Hq).to(tl.int64)
    off_h = (off_bh % Hq).to(tl.int64)
    off_hkv = off_h // GROUP
    row0 = start_m.to(tl.int64)
    K += off_b * stride_kb + off_hkv * stride_kh
    V += off_b * stride_vb + off_hkv * stride_vh
    rows = tl.arange(0, BLOCK_M)
    offs_m = start_m + rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load(Q + off_b * stride_qb + off_h * stride_qh + row0 * stride_qm + rows[:, None] * stride_qm
              + offs_d[None, :] * stride_qd, offs_m, L, offs_d, E, not EVEN_M, BLOCK_D != E)
    do = _load(DO + off_b * stride_dob + off_h * stride_doh + row0 * stride_dom + rows[:, None] * stride_dom
               + offs_dv[None, :] * stride_dod, offs_m, L, offs_dv, Ev, not EVEN_M, BLOCK_DV != Ev)
    lse = _load_rows(LSE + off_bh.to(tl.int64) * L + offs_m, offs_m, L, not EVEN_M) * 1.4426950408889634
    if MODE == 2:
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a row that sees nothing: p = 0
    delta = _load_rows(Delta + off_bh.to(tl.int64) * L + offs_m, offs_m, L, not EVEN_M)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634

    lo, a, b, hi = _col_ranges(start_m, BLOCK_M, BLOCK_N, S, left, right, MODE, True)
    if MODE == 2:
        dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                offs_m, lo, a, S, left, right, qk_scale,
                                E, Ev, BLOCK_D, BLOCK_DV, BLOCK_N, True, MODE, EVEN_N, PRECISION)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                            offs_m, a, b, S, left, right, qk_scale,
                            E, Ev, BLOCK_D, BLOCK_DV, BLOCK_N, False, MODE, EVEN_N, PRECISION)
    if MODE != 0 or not EVEN_N:
        dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                offs_m, b, hi, S, left, right, qk_scale,
                                E, Ev, BLOCK_D, BLOCK_DV, BLOCK_N, True, MODE, EVEN_N, PRECISION)
    dq *= sm_scale  # d(scores)/dQ = scale * K
    _store(DQ + off_b * stride_dqb + off_h * stride_dqh + row0 * stride_dqm + rows[:, None] * stride_dqm
           + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty), offs_m, L, offs_d, E,
           not EVEN_M, BLOCK_D != E)


# ------------------------------------------------------------------------------------------------- configs

_EVEN = {"EVEN_M": lambda a: a["L"] % a["BLOCK_M"] == 0, "EVEN_N": lambda a: a["S"] % a["BLOCK_N"] == 0}


def _tuned(kernel: str, fn):
    """``fn`` with the ``EVEN_*`` heuristics and an autotuner over every candidate of ``kernel``."""
    if INTERPRET:  # no driver to time candidates with: one fixed shape (see interpreter_blocks)
        configs, prune = [make_config(interpreter_shape())], None
    else:
        shapes = dict.fromkeys(s for (k, _, _), lst in CANDIDATES.items() if k == kernel for s in lst)
        configs, prune = [make_config(s) for s in shapes], {"early_config_prune": prune_for(kernel)}
    return triton.autotune(configs=configs, key=TUNE_KEY, prune_configs_by=prune)(triton.heuristics(_EVEN)(fn))


_attn_fwd_tuned = _tuned("fwd", _attn_fwd)
_attn_bwd_dq_tuned = _tuned("dq", _attn_bwd_dq)
_attn_bwd_dkdv_tuned = _tuned("dkdv", _attn_bwd_dkdv)
_TUNED = (_attn_fwd_tuned, _attn_bwd_dq_tuned, _attn_bwd_dkdv_tuned)


@contextlib.contextmanager
def interpreter_blocks(block_m: int, block_n: int) -> Iterator[None]:
    """Run every kernel with one block shape inside a ``with`` block (no autotuning), then restore.

    Under ``TRITON_INTERPRET=1`` this is how the tests check the kernels at the tile shapes a GPU uses
    (128 x 64, 64 x 64, 16 x 128, ...); on a GPU it pins a shape. For dK/dV, ``block_n`` is the key tile.

    Example:
        >>> with interpreter_blocks(128, 64):
        ...     out = flash_attention(q, k, v, is_causal=True)  # doctest: +SKIP
    """
    check_block(block_m, "block_m")
    check_block(block_n, "block_n")
    saved = [t.configs for t in _TUNED]
    for t in _TUNED:
        t.configs = [make_config((block_m, block_n, 4, 1 if INTERPRET else 2))]
    try:
        yield
    finally:
        for t, configs in zip(_TUNED, saved):
            t.configs = configs


# ----------------------------------------------------------------------------------------------- launchers

def _alloc(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised output buffer (NaN-filled in torch's deterministic mode, which the tests turn on)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _block_dim(n: int) -> int:
    """A head dim rounded up to a power of two >= 16 (for ``tl.arange``, ``tl.dot``); the rest is masked."""
    return max(16, triton.next_power_of_2(n))


def _precision(dtype: object) -> str:
    """fp32 dots in IEEE fp32 (a GPU would otherwise use TF32, about 3 significant digits)."""
    return "ieee" if kind(dtype) == "fp32" else "tf32"


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


def _mode_constexprs(L: int, S: int, E: int, Ev: int, left: int, right: int, dtype: object) -> Dict[str, object]:
    return dict(E=E, Ev=Ev, BLOCK_D=_block_dim(E), BLOCK_DV=_block_dim(Ev), MODE=mask_mode(L, S, left, right),
                PRECISION=_precision(dtype))


def kernel_constexprs(kernel: str, *, L: int, S: int, E: int, Ev: int, left: int, right: int, dtype: object,
                      BLOCK_M: int, BLOCK_N: int) -> Dict[str, object]:
    """The compile-time arguments a launch of ``kernel`` passes for these sizes (for triton_inspect)."""
    if kernel == "preprocess":
        return dict(Ev=Ev, BLOCK_DV=_block_dim(Ev), BLOCK_M=PREPROCESS_BLOCK)
    values = _mode_constexprs(L, S, E, Ev, left, right, dtype)
    values.update(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, L=L, S=S)
    values.update({name: rule(values) for name, rule in _EVEN.items()})
    return {k: v for k, v in values.items() if k not in ("L", "S")}


def _buckets(L: int, S: int) -> Tuple[int, int]:
    """The autotune key's ``(L_BUCKET, S_BUCKET)``: powers of two, negative at a ragged launch (TUNE_KEY)."""
    from attention_core.backends.triton_configs import is_ragged  # (imported here: the kernels' lines stay put)

    sign = -1 if is_ragged(L, S) else 1
    return sign * triton.next_power_of_2(L), sign * triton.next_power_of_2(S)


#: A row stride past this makes ``BLOCK * stride`` (an offset inside one tile, 32-bit) risk passing 2^31.
_MAX_ROW_STRIDE = 2**31 // 256


def _small_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a contiguous copy when its position stride is too large for 32-bit tile offsets."""
    return t.contiguous() if t.stride(2) > _MAX_ROW_STRIDE or t.stride(3) > _MAX_ROW_STRIDE else t


def _check_grid(B: int, Hq: int, H: int) -> None:
    reason = triton_grid_reason(B, Hq, H)
    if reason is not None:
        raise ValueError(reason)


def _gqa_split(B: int, H: int, S: int, group: int, device: torch.device) -> int:
    """How many programs share one GQA group in the dK/dV kernel (see :data:`GQA_SPLIT`)."""
    if GQA_SPLIT is not None:
        if isinstance(GQA_SPLIT, bool) or not isinstance(GQA_SPLIT, int) or GQA_SPLIT < 1 or group % GQA_SPLIT:
            raise ValueError(f"GQA_SPLIT must be a positive divisor of Hq // H = {group}, got {GQA_SPLIT!r}")
        return GQA_SPLIT
    if group == 1 or device.type != "cuda":
        return 1
    want = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    programs = triton.cdiv(S, 64) * B * H
    split = 1
    while programs * split < want and split < group:
        split = next(d for d in range(split + 1, group + 1) if group % d == 0)
    return split


def flash_attention_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, left: int, right: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on checked inputs; returns ``out`` (B, Hq, L, Ev) and ``lse`` (B, Hq, L).

    On an sm_90 GPU, inputs that :func:`attention_core.backends.triton_flash_tma.use_tma` accepts run the
    tensor-descriptor (TMA) kernel of that module instead (same outputs) once it is switched on (off by
    default); everything else runs ``_attn_fwd``.

    ``lse`` is the natural-log log-sum-exp of each row's visible scaled scores, float32; ``-inf`` (and an
    output row of zeros) where a row sees no key.
    """
    B, Hq, L, E = query.shape
    H, S, Ev = key.shape[1], key.shape[2], value.shape[3]
    _check_grid(B, Hq, H)
    from attention_core.backends import triton_flash_tma  # (imported here: it imports this module)

    if triton_flash_tma.use_tma(query, key, value, left, right):  # sm_90, covered shapes: TMA loads/stores
        return triton_flash_tma.flash_attention_forward_tma(query, key, value, scale,
                                                            mask_mode(L, S, left, right) == CAUSAL)
    out = _alloc((B, Hq, L, Ev), query.dtype, query.device)
    lse = _alloc((B, Hq, L), torch.float32, query.device)
    if out.numel() == 0 or S == 0:  # nothing to launch; no keys at all means every row is fully masked
        return out.zero_(), lse.fill_(float("-inf"))
    query, key, value = (_small_strides(t) for t in (query, key, value))

    def grid(meta: dict) -> Tuple[int, int]:
        return triton.cdiv(L, meta["BLOCK_M"]), B * Hq

    with _on_device(query):
        _attn_fwd_tuned[grid](
            query, key, value, out, lse, scale,
            *query.stride(), *key.stride(), *value.stride(), *out.stride(),
            Hq, Hq // H, L, S, left, right, *_buckets(L, S),
            **_mode_constexprs(L, S, E, Ev, left, right, query.dtype),
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
    _check_grid(B, Hq, H)
    dq = _alloc(tuple(query.shape), query.dtype, query.device)
    dk = _alloc(tuple(key.shape), key.dtype, key.device)
    dv = _alloc(tuple(value.shape), value.dtype, value.device)
    if L == 0 or S == 0 or B * Hq == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    query, key, value, out, grad_out = (_small_strides(t) for t in (query, key, value, out, grad_out))
    delta = _alloc((B, Hq, L), torch.float32, query.device)
    common = _mode_constexprs(L, S, E, Ev, left, right, query.dtype)
    group = Hq // H
    split = _gqa_split(B, H, S, group, query.device)
    if split == 1:  # each program writes dK, dV itself
        dk_buf, dv_buf, split_strides = dk, dv, (0, 0)
    else:  # float32 partial sums over parts of the group, added up below
        dk_buf = _alloc((split, B, H, S, E), torch.float32, query.device)
        dv_buf = _alloc((split, B, H, S, Ev), torch.float32, query.device)
        split_strides = (dk_buf.stride(0), dv_buf.stride(0))

    def grid_q(meta: dict) -> Tuple[int, int]:
        return triton.cdiv(L, meta["BLOCK_M"]), B * Hq

    def grid_kv(meta: dict) -> Tuple[int, int, int]:
        return triton.cdiv(S, meta["BLOCK_N"]), B * H, split

    with _on_device(query):
        _attn_bwd_preprocess[(triton.cdiv(L, PREPROCESS_BLOCK), B * Hq)](
            out, grad_out, delta, *out.stride(), *grad_out.stride(), Hq, L,
            Ev=Ev, BLOCK_DV=_block_dim(Ev), BLOCK_M=PREPROCESS_BLOCK,
        )
        _attn_bwd_dkdv_tuned[grid_kv](
            query, key, value, grad_out, dk_buf, dv_buf, lse, delta, scale,
            *query.stride(), *key.stride(), *value.stride(), *grad_out.stride(),
            *dk_buf.stride()[-4:], *dv_buf.stride()[-4:], *split_strides,
            Hq, H, group, group // split, L, S, left, right, *_buckets(L, S), **common,
        )
        _attn_bwd_dq_tuned[grid_q](
            query, key, value, grad_out, dq, lse, delta, scale,
            *query.stride(), *key.stride(), *value.stride(), *grad_out.stride(), *dq.stride(),
            Hq, group, L, S, left, right, *_buckets(L, S), **common,
        )
    if split > 1:
        dk.copy_(dk_buf.sum(0))  # (split, B, H, S, E) -> (B, H, S, E)
        dv.copy_(dv_buf.sum(0))  # (split, B, H, S, Ev) -> (B, H, S, Ev)
    return dq, dk, dv


def _check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool,
                  window: Optional[int]) -> None:
    """Validate the public function's arguments (the registry path arrives already validated)."""
    check_fused_inputs(query, key, value, is_causal)
    if window is not None:
        check_positive_int(window, "window")
    _check_grid(query.shape[0], query.shape[1], key.shape[1])
    if INTERPRET and query.device.type != "cpu":
        raise ValueError(f"under TRITON_INTERPRET=1 the kernels run on CPU tensors, got {query.device}")
    if not INTERPRET and query.device.type != "cuda":
        raise ValueError(
            f"the Triton kernels run on CUDA tensors, got {query.device}; set TRITON_INTERPRET=1 before "
            "importing attention_core.backends.triton_flash to run them (slowly) on the CPU"
        )
    if INTERPRET and query.dtype == torch.bfloat16:
        raise TypeError("the Triton interpreter computes bfloat16 dots wrongly; use float16 or float32 there")


# ------------------------------------------------------------------- autograd: a custom operator, as flash-attn's
# The forward and backward launchers registered as operators with fake (shape-only) implementations and an
# autograd rule: eager calls run the kernels; torch.compile(fullgraph=True) sees one opaque call per direction and
# traces it on fake tensors, instead of breaking the graph at a Python autograd.Function that launches Triton.


@torch.library.custom_op("attention_core::triton_flash_forward", mutates_args=())
def _forward_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, left: int,
                right: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Hq, L, Ev), lse (B, Hq, L) float32)``: :func:`flash_attention_forward` as an operator."""
    return flash_attention_forward(query, key, value, scale, left, right)


@_forward_op.register_fake
def _(query, key, value, scale, left, right):
    B, Hq, L, _ = query.shape
    return query.new_empty((B, Hq, L, value.shape[-1])), query.new_empty((B, Hq, L), dtype=torch.float32)


@torch.library.custom_op("attention_core::triton_flash_backward", mutates_args=())
def _backward_op(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, scale: float, left: int,
                 right: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``: :func:`flash_attention_backward` as an operator (recomputes from ``lse``)."""
    return flash_attention_backward(grad_out, query, key, value, out, lse, scale, left, right)


@_backward_op.register_fake
def _(grad_out, query, key, value, out, lse, scale, left, right):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, scale, left, right = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse)  # O(L) extra beside the inputs and the output
    ctx.bounds = (scale, left, right)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, query, key, value, out, lse, *ctx.bounds)
    return dq, dk, dv, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


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

    Raises:
        ValueError: ``B * Hq`` (or ``B * H``) past 65,535, CUDA's limit on grid axis 1 (split the batch).

    Warns:
        UserWarning: once per process on a GPU older than sm_80, where Triton uses no tensor cores.

    Limits: with grouped-query attention the dK/dV kernel sums a group's query heads inside one program; when
    that leaves SMs idle (few key/value heads, short S) it splits the group over up to ``Hq // H`` programs
    that write float32 partial sums (``GQA_SPLIT``), which costs ``split`` extra (B, H, S, E) buffers.
    """
    _check_inputs(query, key, value, is_causal, window)
    triton_tensor_core_warning(query.device)
    scale = check_scale(scale)
    scale = scale_or_default(scale, query.shape[-1])
    left, right = window_bounds(query.shape[2], key.shape[2], is_causal, window)
    return _forward_op(query, key, value, scale, left, right)[0]


def run(inputs: AttentionInputs) -> BackendResult:
    """Registry entry point on canonical inputs already validated by :func:`attention_core.scaled_dot_product_attention`
    and :func:`~attention_core.backends.fused_checks.triton_supports` (no second validation here); no window."""
    triton_tensor_core_warning(inputs.query.device)
    query, key = inputs.query, inputs.key
    left, right = window_bounds(query.shape[2], key.shape[2], inputs.is_causal, None)
    return _forward_op(query, key, inputs.value, inputs.scale, left, right)[0], None
