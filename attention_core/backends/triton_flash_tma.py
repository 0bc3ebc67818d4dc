"""FlashAttention-2's forward on Hopper (sm_90) with tensor descriptors: Q, K, V loaded and O stored by TMA.

The same algorithm as :mod:`attention_core.backends.triton_flash`'s ``_attn_fwd`` (one program per tile of
``BLOCK_M`` queries, online softmax over ``BLOCK_N`` keys at a time, in base 2 with the scale folded into
one fused multiply-add), with two differences in how tiles reach the chip, as Triton's fused-attention
tutorial does on Hopper:

* every tile is moved by a *tensor descriptor* (``desc.load([row, 0])``, ``desc.store``): Hopper's Tensor
  Memory Accelerator copies a whole (rows, E) box between global and shared memory from one instruction
  (``cp.async.bulk.tensor`` in the PTX, ``UTMALDG``/``UTMASTG`` in the SASS) instead of every thread
  computing and issuing its own addresses;
* the descriptors are made on the host (:class:`triton.tools.tensor_descriptor.TensorDescriptor`) over the
  tensors seen as 2-D ``(B * heads * N, E)`` matrices; an autotune ``pre_hook`` gives each its box shape
  for the config being tried. (In-kernel descriptors, ``tl.make_tensor_descriptor``, also need a scratch
  allocator, ``triton.set_allocator``; the tutorial makes them on Hopper only with warp specialisation.)

Warp specialisation (``tl.range(..., warp_specialize=True)``; ``WARP_SPECIALIZE`` here) is launched off: the
tutorial's own tests turn it on on Blackwell only, and Triton 3.9 compiling this kernel for sm_90 with it on
either leaves the loop as it was (8 warps: no ``ttg.warp_specialize`` region, the same registers and
instructions) or fails in its warp-specialisation pass (4 warps): the ``warp_specialize_probe`` of
``benchmarks/results/triton_tma_resources.json``.

Because a box never stops at a head's edge in that 2-D view, a tile must not straddle two heads: the kernel
covers lengths ``L`` and ``S`` that are multiples of 128 (every tile), float16/bfloat16, ``E == Ev`` in
{64, 128}, causal or not (no window), GQA, contiguous tensors. :func:`use_tma` is the one rule that sends a
call here, and only on an sm_90 device and once switched on (``ENABLED``, off by default until the kernel
has run on a GPU); everything else runs ``triton_flash``'s pointer kernel, and the
backward is always ``triton_flash``'s (it reads this kernel's ``lse``, natural log, float32, (B, Hq, L)).

What it compiles to on sm_90 (registers, spills, wgmma and TMA instruction counts) is recorded by
``benchmarks/triton_tma_resources.py``. Its speed has not been measured on a GPU.

``TRITON_INTERPRET=1`` (set before import) runs the kernel in NumPy on CPU tensors (the tests do), with one
block shape given to :func:`flash_attention_forward_tma`.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch
import triton
import triton.language as tl

from attention_core.backends.triton_modes import CAUSAL, FULL, mask_mode

try:  # Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the rule never routes here
    TensorDescriptor = None

__all__ = ["CANDIDATES", "ENABLED", "HEAD_DIMS", "ROW_MULTIPLE", "flash_attention_forward_tma",
           "device_capability", "use_tma"]

#: Read once, as ``@triton.jit`` does.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: Off unless ``AC_TRITON_TMA=1`` is in the environment when this module is imported, or set to True: the
#: kernel has been interpreted (float16) and compiled for sm_90 but has not yet run on a GPU. ``make gpu-check``
#: switches it on for its benchmark and its tests, and times the pointer kernel beside it.
ENABLED = os.environ.get("AC_TRITON_TMA", "0") == "1"

#: Head dims the kernel covers (E == Ev).
HEAD_DIMS = (64, 128)

#: L and S must be multiples of this (the largest tile), so that no TMA box straddles two heads.
ROW_MULTIPLE = 128

#: Autotune candidates ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` per head dim. From the tutorial's Hopper
#: space (BLOCK_M in {64, 128}, BLOCK_N in {32, 64, 128}, 2-4 stages; 8 warps only for a 128 x 128 tile),
#: those that compile for sm_90 without spilling and within 227 KiB of shared memory
#: (benchmarks/results/triton_tma_resources.json), plus (128, 64, 8, 3) at E = 128, where the tutorial's
#: 4-warp 128 x 64 tile spills (255 registers, ~90 bytes per thread) and the 8-warp one uses 164 registers.
#: Causal launches keep only BLOCK_M % BLOCK_N == 0 (the diagonal starts on a key tile).
CANDIDATES: Dict[int, List[Tuple[int, int, int, int]]] = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 32, 4, 3), (64, 64, 4, 3)],
    128: [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3)],
}


# --------------------------------------------------------------------------------------------- jit kernels


@triton.jit
def _tma_fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, kv_row0, offs_m, start, end, qk_scale,
                   BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """Online softmax over the keys ``[start, end)`` of one head (rows ``kv_row0 + j`` of the 2-D K and V).

    ``MASKED``: the tiles on the causal diagonal, where key ``j`` is hidden from query ``i < j``.
    """
    row = kv_row0 + start
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = desc_k.load([row, 0])  # (BLOCK_N, E), one TMA copy
        qk = tl.dot(q, k.T)  # (BLOCK_M, BLOCK_N), unscaled scores
        if MASKED:
            offs_n = start_n + tl.arange(0, BLOCK_N)
            qk = tl.where(offs_n[None, :] <= offs_m[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # finite: every row has seen a key by its diagonal
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = desc_v.load([row, 0])  # (BLOCK_N, E)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
        row += BLOCK_N
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_tma(desc_q, desc_k, desc_v, desc_o, LSE, sm_scale, Hq, GROUP, L, S, L_BUCKET, S_BUCKET,
                  E: tl.constexpr, IS_CAUSAL: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Grid (L // BLOCK_M, B * Hq): one program per (query tile, batch, query head).

    ``desc_q``/``desc_o``: (B * Hq * L, E); ``desc_k``/``desc_v``: (B * H * S, E), boxes (BLOCK_M, E) and
    (BLOCK_N, E). ``L_BUCKET``/``S_BUCKET`` are only the autotune key.
    """
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1)
    off_b = off_bh // Hq
    off_h = off_bh % Hq
    q_row = off_bh * L + start_m  # this tile's first row of the 2-D Q and O
    kv_row0 = (off_b * (Hq // GROUP) + off_h // GROUP) * S  # GQA: the key/value head this query head reads
    offs_m = start_m + tl.arange(0, BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, E], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # base 2: exp(x) = exp2(x * log2(e))
    q = desc_q.load([q_row, 0])  # (BLOCK_M, E), stays on chip

    if IS_CAUSAL:  # keys left of the tile's first query: seen by every row; then the diagonal tiles, masked
        diag = tl.minimum(start_m, S)
        end = tl.minimum(start_m + BLOCK_M, S)
    else:
        diag = S
        end = S
    acc, l_i, m_i = _tma_fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, kv_row0, offs_m, 0, diag, qk_scale,
                                   BLOCK_N, False, WARP_SPECIALIZE)
    if IS_CAUSAL:
        acc, l_i, m_i = _tma_fwd_inner(acc, l_i, m_i, q, desc_k, desc_v, kv_row0, offs_m, diag, end, qk_scale,
                                       BLOCK_N, True, WARP_SPECIALIZE)

    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453  # natural log, as triton_flash's backward reads it
    tl.store(LSE + off_bh.to(tl.int64) * L + offs_m, lse)
    desc_o.store([q_row, 0], (acc / l_i[:, None]).to(desc_o.dtype))


# ------------------------------------------------------------------------------------------------- configs


def _set_boxes(nargs: dict) -> None:
    """Autotune ``pre_hook``: the descriptors' box shapes for the config about to run."""
    bm, bn, E = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["E"]
    nargs["desc_q"].block_shape = [bm, E]
    nargs["desc_o"].block_shape = [bm, E]
    nargs["desc_k"].block_shape = [bn, E]
    nargs["desc_v"].block_shape = [bn, E]


def _prune(configs: List[triton.Config], named_args: dict, **kwargs: object) -> List[triton.Config]:
    """Keep this head dim's candidates; causal launches also need ``BLOCK_M % BLOCK_N == 0``."""
    wanted = CANDIDATES[int(kwargs["E"])]
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted
            and (not kwargs["IS_CAUSAL"] or c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_N"] == 0)]


def _config(shape: Tuple[int, int, int, int]) -> triton.Config:
    bm, bn, warps, stages = shape
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages, pre_hook=_set_boxes)


_attn_fwd_tma_tuned = triton.autotune(configs=[_config(s) for s in dict.fromkeys(sum(CANDIDATES.values(), []))],
                                      key=["L_BUCKET", "S_BUCKET", "E", "IS_CAUSAL"],
                                      prune_configs_by={"early_config_prune": _prune})(_attn_fwd_tma)


# ------------------------------------------------------------------------------------------ routing rule


def device_capability(t: torch.Tensor) -> Optional[Tuple[int, int]]:
    """``(major, minor)`` of ``t``'s CUDA device, ``None`` for any other device."""
    return tuple(torch.cuda.get_device_capability(t.device)) if t.device.type == "cuda" else None


def use_tma(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, left: int, right: int) -> bool:
    """True when the forward of these (already validated) inputs runs the TMA kernel.

    Only on an sm_90 device (capability (9, 0)), with Triton's tensor descriptors available, for float16 or
    bfloat16, ``E == Ev`` in {64, 128}, the full or causal mask (``left``/``right`` as
    ``triton_flash.window_bounds`` gives them: a window that hides a pair is
    not covered), ``L`` and ``S`` positive multiples of 128, contiguous 16-byte-aligned tensors, and fewer
    than 2^31 rows in each 2-D view, at least one (batch, head) pair, and only while ``ENABLED`` (off by
    default). Anything else keeps the pointer kernel. The inputs are not checked here: ``flash_attention`` and
    the ``triton`` backend check them before they ask.
    """
    B, Hq, L, E = query.shape
    H, S, Ev = key.shape[1], key.shape[2], value.shape[3]
    return (ENABLED and TensorDescriptor is not None and device_capability(query) == (9, 0)
            and query.dtype in (torch.float16, torch.bfloat16) and E == Ev and E in HEAD_DIMS
            and mask_mode(L, S, left, right) in (FULL, CAUSAL)
            and B * Hq > 0 and L > 0 and S > 0 and L % ROW_MULTIPLE == 0 and S % ROW_MULTIPLE == 0
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (query, key, value))
            and B * Hq * L < 2**31 and B * H * S < 2**31)


# ----------------------------------------------------------------------------------------------- launcher


def _descriptor(t: torch.Tensor, rows: int, box: Optional[int]) -> TensorDescriptor:
    """A descriptor of contiguous (..., N, E) ``t`` as a 2-D (rows, E) matrix, box (box, E) (or set later)."""
    E = t.shape[-1]
    flat = t.view(rows, E)  # (B, heads, N, E) -> (B * heads * N, E)
    return TensorDescriptor(flat, shape=[rows, E], strides=[E, 1], block_shape=[box or 16, E])


def flash_attention_forward_tma(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                                is_causal: bool, *, block: Optional[Tuple[int, ...]] = None
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Launch the TMA forward; returns ``out`` (B, Hq, L, E) and ``lse`` (B, Hq, L), float32, natural log.

    The inputs are those :func:`use_tma` accepts (on the CPU under ``TRITON_INTERPRET=1``: the same shapes,
    with ``L``/``S`` multiples of the block). ``block``: ``(BLOCK_M, BLOCK_N)`` or ``(BLOCK_M, BLOCK_N,
    num_warps, num_stages)`` to launch one config without autotuning (the interpreter needs one: 64 x 64 by
    default there; elsewhere 4 warps and 3 stages unless given).
    """
    B, Hq, L, E = query.shape
    H, S = key.shape[1], key.shape[2]
    if INTERPRET and block is None:
        block = (64, 64)
    if block is not None:
        bm, bn, warps, stages = (tuple(block) + (4, 3))[:4]
        if L % bm or S % bn or (is_causal and bm % bn):
            raise ValueError(f"block {block} must divide L = {L} and S = {S} (and BLOCK_N divide BLOCK_M when "
                             "causal)")
    out = torch.empty((B, Hq, L, E), dtype=query.dtype, device=query.device)
    lse = torch.empty((B, Hq, L), dtype=torch.float32, device=query.device)
    bm_box, bn_box = (bm, bn) if block is not None else (None, None)
    desc_q = _descriptor(query, B * Hq * L, bm_box)
    desc_o = _descriptor(out, B * Hq * L, bm_box)
    desc_k = _descriptor(key, B * H * S, bn_box)
    desc_v = _descriptor(value, B * H * S, bn_box)
    args = (desc_q, desc_k, desc_v, desc_o, lse, scale, Hq, Hq // H, L, S,
            triton.next_power_of_2(L), triton.next_power_of_2(S))
    with torch.cuda.device(query.device) if query.is_cuda else _null():
        if block is not None:
            _attn_fwd_tma[(L // bm, B * Hq)](*args, E=E, IS_CAUSAL=is_causal, WARP_SPECIALIZE=False,
                                              BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                              num_stages=1 if INTERPRET else stages)
        else:
            _attn_fwd_tma_tuned[lambda meta: (L // meta["BLOCK_M"], B * Hq)](
                *args, E=E, IS_CAUSAL=is_causal, WARP_SPECIALIZE=False)
    return out, lse


def _null():
    import contextlib

    return contextlib.nullcontext()
