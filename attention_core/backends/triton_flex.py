"""FlexAttention's forward in Triton: one program per (query tile, batch x head), visiting only the key tiles
its block mask lists.

A program reads its row of the :class:`~attention_core.flex_attention.BlockMask` (the counts and indices of
its full and its partial key tiles), then runs the online softmax of FlashAttention over the **full** tiles
without evaluating any predicate, and over the **partial** tiles with the predicate compiled in. Empty tiles
are never loaded: the loop bounds come from the block mask, so the work is proportional to the non-empty
tiles, as in the ``chunked`` backend.

A Python ``mask_mod`` cannot be compiled into a Triton kernel by this module (PyTorch's FlexAttention traces
it with ``torch.compile``); instead the library's own mods carry their kind and arguments
(``mod.flex_kind``), and the kernel has each of them as a compile-time ``MASK`` branch:

===================== ======================================================
MASK                   mod
===================== ======================================================
0 noop                 every pair (no block mask)
1 causal               ``causal``
2 window               ``sliding_window(w)`` (causal)
3 sinks_window         ``sinks_and_window(n, w)``
4 document             ``document(ids)`` with 1-D ids
5 prefix_lm            ``prefix_lm(n)``
6 bottom_right         ``causal_bottom_right(L, S)``
7 document_causal      ``and_masks(document(ids), causal)``
8 window_two_sided     ``sliding_window(w, causal=False)``
===================== ======================================================

and score mods ``SCORE``: 0 none, 1 ``alibi(slopes)``, 2 ``soft_cap(cap)``, 3 ``relative_position_bias``.
Any other mod raises a ``ValueError`` that names it (use ``backend="chunked"``, which runs every mod).

The backward (:mod:`attention_core.backends.triton_flex_bwd`) recomputes the probabilities from the saved
logsumexp, over the same non-empty tiles; both directions are ``torch.library`` operators with fake
implementations. Gradients of a tensor a score mod captures are not computed (``chunked`` does). Dtypes
float16 and bfloat16 (float32 accumulation) and float32 (IEEE dots); E = Ev <= 128. Kernel tiles are the block
mask's tiles (``BLOCK_SIZE``, powers of two >= 16; on a GPU at most :data:`GPU_TILES`, ``BLOCK_SIZE=(128, 32)`` for
16-bit inputs, ``(32, 32)`` for float32 with E <= 64). Under ``TRITON_INTERPRET=1`` (set before import) the
kernel runs on the CPU in NumPy: that is how the tests check it. What the forward and the backward cost on sm_80 /
sm_90 (registers, spills) is in ``benchmarks/results/triton_flex_resources.json``
(``benchmarks/triton_flex_resources.py``).

Layout: jit kernel -> launcher (recognise the mods, validate, allocate, grid) -> operators -> public. The
compiled mods (``_keep``, ``_score``), which the backward calls too, are in
:mod:`attention_core.backends.triton_flex_mods`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from attention_core.backends.triton_flex_bwd import flex_backward
from attention_core.backends.triton_flex_mods import MASK_KINDS, SCORE_KINDS, _keep, _score
from attention_core.block_mask import create_block_mask
from attention_core.mask_mods import check_captured, noop_mask

__all__ = ["GPU_TILES", "INTERPRET", "MASK_KINDS", "SCORE_KINDS", "compile_args", "triton_flex_attention"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------- kernels


@triton.jit
def _tile(acc, l_i, m_i, q, K, V, kv_base, t, offs_m, offs_d, h, DOC, SLOPES, TABLE, sm_scale, CAP,
          L, S, P0, P1, P2, E: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, SCORE: tl.constexpr,
          PARTIAL: tl.constexpr, IEEE: tl.constexpr):
    """One key tile ``t`` of the online softmax; the predicate only when PARTIAL."""
    offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
    in_k = (offs_n[:, None] < S) & (offs_d[None, :] < E)
    k = tl.load(K + kv_base + offs_n[:, None] * E + offs_d[None, :], mask=in_k, other=0.0)  # (BLOCK_N, BLOCK_D)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = _score(s * sm_scale, offs_m[:, None], offs_n[None, :], h, SLOPES, TABLE, CAP, P2, SCORE)
    valid = offs_n[None, :] < S  # a ragged last tile
    if PARTIAL:
        valid = valid & _keep(offs_m[:, None], offs_n[None, :], DOC, L, S, P0, P1, MASK)
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing yet: exp(-inf - 0) = 0
    p = tl.exp2((s - m_use[:, None]) * 1.4426950408889634)
    alpha = tl.exp2((m_i - m_use) * 1.4426950408889634)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + kv_base + offs_n[:, None] * E + offs_d[None, :], mask=in_k, other=0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _flex_fwd(Q, K, V, Out, LSE, KV_NUM, KV_IDX, FULL_NUM, FULL_IDX, DOC, SLOPES, TABLE,
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
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    row = ((b * BM_B) * HM + h * BM_H) * N_Q_TILES + pid_m  # this query tile's row of the block mask
    n_full = tl.load(FULL_NUM + row)
    for i in range(0, n_full):  # full tiles: no predicate
        t = tl.load(FULL_IDX + row * N_K_TILES + i)
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, K, V, kv_base, t, offs_m, offs_d, h, DOC, SLOPES, TABLE,
                              sm_scale, CAP, L, S, P0, P1, P2, E, BLOCK_N, MASK, SCORE, False, IEEE)
    n_part = tl.load(KV_NUM + row)
    for i in range(0, n_part):  # partial tiles: the compiled predicate
        t = tl.load(KV_IDX + row * N_K_TILES + i)
        acc, l_i, m_i = _tile(acc, l_i, m_i, q, K, V, kv_base, t, offs_m, offs_d, h, DOC, SLOPES, TABLE,
                              sm_scale, CAP, L, S, P0, P1, P2, E, BLOCK_N, MASK, SCORE, True, IEEE)
    alive = l_i > 0.0
    l_safe = tl.where(alive, l_i, 1.0)
    out = acc / l_safe[:, None]  # a row that read nothing: 0 / 1
    tl.store(Out + q_base + offs_m[:, None] * E + offs_d[None, :], out.to(Out.dtype.element_ty), mask=in_q)
    lse = tl.where(alive, m_i + tl.log(l_safe), float("inf"))
    tl.store(LSE + bh.to(tl.int64) * L + offs_m, lse, mask=offs_m < L)


# ---------------------------------------------------------------------------------------------- launcher


def _mask_kind(mod) -> tuple[int, int, int, torch.Tensor | None]:
    """(MASK, P0, P1, DOC) for a library mask_mod; ValueError for one the kernel does not compile in."""
    kind = getattr(mod, "flex_kind", None)
    name = getattr(mod, "__name__", repr(mod))
    if kind is not None and kind[0] == "and" and len(kind) == 3 and all(k is not None for k in kind[1:]):
        parts = {k[0]: k for k in kind[1:]}
        if set(parts) == {"document", "causal"} and parts["document"][1].dim() == 1:
            return MASK_KINDS["document_causal"], 0, 0, parts["document"][1]
    if kind is None or kind[0] in ("and", "or"):
        pass
    elif kind[0] == "noop":
        return MASK_KINDS["noop"], 0, 0, None
    elif kind[0] == "causal":
        return MASK_KINDS["causal"], 0, 0, None
    elif kind[0] == "sliding_window":
        return (MASK_KINDS["window"], 0, kind[1], None) if kind[2] else (
            MASK_KINDS["window_two_sided"], 0, kind[1] // 2, None)
    elif kind[0] == "sinks_and_window":
        return MASK_KINDS["sinks_window"], kind[1], kind[2], None
    elif kind[0] == "document" and kind[1].dim() == 1:
        return MASK_KINDS["document"], 0, 0, kind[1]
    elif kind[0] == "prefix_lm":
        return MASK_KINDS["prefix_lm"], kind[1], 0, None
    elif kind[0] == "causal_bottom_right":
        return MASK_KINDS["bottom_right"], kind[1], 0, None
    raise ValueError(f"the triton backend compiles in only the library's mods {sorted(MASK_KINDS)}, got "
                     f"mask_mod {name}: use backend='chunked', which runs any mask_mod")


def _score_kind(mod) -> tuple[int, float, int, torch.Tensor | None, torch.Tensor | None]:
    """(SCORE, CAP, P2, SLOPES, TABLE) for a library score_mod."""
    if mod is None:
        return 0, 1.0, 0, None, None
    kind = getattr(mod, "flex_kind", None)
    if kind is not None and kind[0] == "alibi":
        return 1, 1.0, 0, kind[1], None
    if kind is not None and kind[0] == "soft_cap":
        return 2, float(kind[1]), 0, None, None
    if kind is not None and kind[0] == "relative_position_bias":
        return 3, 1.0, kind[2], None, kind[1]
    raise ValueError(f"the triton backend compiles in only the score mods {[k for k in SCORE_KINDS if k]}, got "
                     f"{getattr(mod, '__name__', mod)}: use backend='chunked'")


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def compile_args(query, key, value, score_mod, block_mask, scale):
    """Validate and turn a call into (tensor arguments, scalar arguments, constexprs, grid) for ``_flex_fwd``."""
    B, H, L, E = query.shape
    S = key.shape[2]
    if value.shape[-1] != E or E > 128:
        raise ValueError(f"the triton backend needs Ev == E <= 128, got E={E}, Ev={value.shape[-1]}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the triton backend takes float16, bfloat16 or float32, got {query.dtype}")
    if block_mask is None:
        block_mask = create_block_mask(noop_mask, None, None, L, S, device=query.device,
                                       BLOCK_SIZE=GPU_TILES[query.dtype])
    Bq, Bk = block_mask.BLOCK_SIZE
    if not (_pow2(Bq) and _pow2(Bk)):
        raise ValueError(f"the triton backend needs BLOCK_SIZE of powers of two >= 16, got {(Bq, Bk)}")
    top_m, top_n = GPU_TILES[query.dtype]
    if not INTERPRET and query.dtype == torch.float32 and E > 64:
        raise ValueError(f"on a GPU the triton backend takes float32 only with E <= 64 (it spills registers on "
                         f"sm_90 beyond), got E={E}: use float16 or bfloat16")
    if not INTERPRET and (Bq > top_m or Bk > top_n):
        raise ValueError(f"on a GPU the triton backend takes {query.dtype} tiles up to {(top_m, top_n)} (larger "
                         f"ones spill registers), got BLOCK_SIZE {(Bq, Bk)}: create the block mask with "
                         f"BLOCK_SIZE={(top_m, top_n)}")
    MASK, P0, P1, DOC = _mask_kind(block_mask.mask_mod)
    SCORE, CAP, P2, SLOPES, TABLE = _score_kind(score_mod)
    dev = query.device
    Bm, Hm = block_mask.shape[:2]
    ints = [t.to(device=dev, dtype=torch.int32).contiguous() for t in (
        block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.full_kv_num_blocks, block_mask.full_kv_indices)]
    dummy = ints[0]
    DOC = dummy if DOC is None else DOC.to(device=dev, dtype=torch.int32).contiguous()
    if DOC is not dummy and DOC.numel() < max(L, S):
        raise ValueError(f"document ids cover {DOC.numel()} positions, fewer than L={L} or S={S}")
    SLOPES = dummy if SLOPES is None else SLOPES.detach().to(device=dev, dtype=torch.float32).contiguous()
    TABLE = dummy if TABLE is None else TABLE.detach().to(device=dev, dtype=torch.float32).contiguous()
    tensors = [query.contiguous(), key.contiguous(), value.contiguous(), *ints, DOC, SLOPES, TABLE]
    scalars = dict(sm_scale=float(scale), CAP=CAP, L=L, S=S, H=H, HM=Hm, N_Q_TILES=block_mask.kv_indices.shape[2],
                   N_K_TILES=block_mask.kv_indices.shape[3], P0=int(P0), P1=int(P1), P2=int(P2))
    constexprs = dict(BM_B=int(Bm > 1), BM_H=int(Hm > 1), MASK=MASK, SCORE=SCORE, E=E,
                      BLOCK_D=max(16, triton.next_power_of_2(E)), BLOCK_M=Bq, BLOCK_N=Bk,
                      IEEE=query.dtype == torch.float32)
    grid = (block_mask.kv_indices.shape[2], B * H)
    return tensors, scalars, constexprs, grid


#: Largest tiles (BLOCK_M, BLOCK_N) a GPU launch takes, per dtype: the ones the resource report compiled
#: without spills on sm_80 and sm_90 (the interpreter takes any tile).
#: (float32 on a GPU also needs E <= 64: at E = 128 every tile tried spilled on sm_90.)
GPU_TILES = {torch.float16: (128, 32), torch.bfloat16: (128, 32), torch.float32: (32, 32)}


def num_warps_for(dtype: torch.dtype, E: int, BLOCK_M: int, BLOCK_N: int) -> int:
    """Warps per program: 8 for 16-bit inputs (q and the accumulator split over more threads), 4 for float32."""
    return 4 if dtype == torch.float32 else 8


# ------------------------------------------------------------------- autograd: custom operators, as triton_flash's
# Forward and backward as torch.library operators with fake (shape-only) implementations and an autograd rule;
# the block mask travels as its four int32 tensors, the mods as their compile-time codes and scalars.


@torch.library.custom_op("attention_core::triton_flex_forward", mutates_args=())
def _forward_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_num: torch.Tensor,
                kv_idx: torch.Tensor, full_num: torch.Tensor, full_idx: torch.Tensor, doc: torch.Tensor,
                slopes: torch.Tensor, table: torch.Tensor, scale: float, cap: float, p0: int, p1: int, p2: int,
                mask: int, score: int, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, H, L, E), lse (B, H, L) float32)``; ``lse`` is ``+inf`` on a row that read no key."""
    B, H, L, E = query.shape
    Bm, Hm, nQ, nK = kv_idx.shape
    out = torch.empty_like(query)  # (B, H, L, E)
    lse = torch.empty((B, H, L), device=query.device, dtype=torch.float32)
    scalars = dict(sm_scale=scale, CAP=cap, L=L, S=key.shape[2], H=H, HM=Hm, N_Q_TILES=nQ, N_K_TILES=nK,
                   P0=p0, P1=p1, P2=p2)
    constexprs = dict(BM_B=int(Bm > 1), BM_H=int(Hm > 1), MASK=mask, SCORE=score, E=E,
                      BLOCK_D=max(16, triton.next_power_of_2(E)), BLOCK_M=block_m, BLOCK_N=block_n,
                      IEEE=query.dtype == torch.float32)
    warps = num_warps_for(query.dtype, E, block_m, block_n)
    _flex_fwd[(nQ, B * H)](query, key, value, out, lse, kv_num, kv_idx, full_num, full_idx, doc, slopes, table,
                           **scalars, **constexprs, num_warps=warps, num_stages=2)
    return out, lse


@_forward_op.register_fake
def _(query, key, value, kv_num, kv_idx, full_num, full_idx, doc, slopes, table, *params):
    return torch.empty_like(query), query.new_empty(query.shape[:3], dtype=torch.float32)


@torch.library.custom_op("attention_core::triton_flex_backward", mutates_args=())
def _backward_op(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor, kv_num: torch.Tensor, kv_idx: torch.Tensor,
                 full_num: torch.Tensor, full_idx: torch.Tensor, doc: torch.Tensor, slopes: torch.Tensor,
                 table: torch.Tensor, scale: float, cap: float, p0: int, p1: int, p2: int, mask: int, score: int,
                 block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``, recomputed tile by tile from ``lse`` (:mod:`attention_core.backends.triton_flex_bwd`)."""
    return flex_backward(grad_out, query, key, value, out, lse, kv_num, kv_idx, full_num, full_idx, doc, slopes,
                         table, scale, cap, p0, p1, p2, mask, score, block_m, block_n)


@_backward_op.register_fake
def _(grad_out, query, key, value, *rest):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, *ints, doc, slopes, table = inputs[:10]
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, *ints, doc, slopes, table)  # O(L) beside the inputs
    ctx.params = inputs[10:]


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, *rest = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, query, key, value, out, lse, *rest, *ctx.params)
    return (dq, dk, dv) + (None,) * 16


_forward_op.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------------ public


def triton_flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None) -> torch.Tensor:
    """Flex attention in Triton, forward and backward, over the block mask's non-empty tiles (see the module
    docstring and :mod:`attention_core.backends.triton_flex_bwd`).

    Args:
        query: (B, H, L, E) on a CUDA device (or the CPU under ``TRITON_INTERPRET=1``); key, value (B, H, S, E).
        score_mod: ``None`` or one of the library's score mods (alibi, soft_cap, relative_position_bias).
        block_mask: a BlockMask of one of the library's mask mods, tiles of powers of two; ``None``: all pairs.
        scale: score scale, default ``1 / sqrt(E)``.

    Returns:
        (B, H, L, E) in the query's dtype; rows that read nothing are zeros (and pass no gradient). Gradients
        flow to query, key and value; a tensor the score mod captures may not require one.
    """
    if query.device.type != "cuda" and not INTERPRET:
        raise ValueError(f"the triton backend needs a CUDA device (or TRITON_INTERPRET=1), got {query.device}")
    captured = [x for x in getattr(score_mod, "flex_kind", ())[1:] if isinstance(x, torch.Tensor)]
    if torch.is_grad_enabled() and any(x.requires_grad for x in captured):
        raise NotImplementedError(f"the triton flex kernel does not compute the gradient of the tensor that "
                                  f"score_mod {getattr(score_mod, '__name__', score_mod)} captures: use "
                                  f"backend='chunked', or detach it")
    B, H, L, _ = query.shape
    for mod in (score_mod, block_mask and block_mask.mask_mod):  # the kernel would read past a short tensor
        check_captured(mod, B, H, L, key.shape[2], query.device)
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    tensors, scalars, constexprs, grid = compile_args(query, key, value, score_mod, block_mask, scale)
    out, _ = _forward_op(*tensors, scalars["sm_scale"], scalars["CAP"], scalars["P0"], scalars["P1"],
                         scalars["P2"], constexprs["MASK"], constexprs["SCORE"], constexprs["BLOCK_M"],
                         constexprs["BLOCK_N"])
    return out
