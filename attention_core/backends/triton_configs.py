"""Which tile shapes the Triton attention kernels try: autotune candidates per kernel, dtype, head dim and GPU.

A *config* is ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``. Which ones are worth timing was decided on a CPU,
by compiling every candidate for sm_75, sm_80 and sm_90 and reading registers, spills and tensor-core
instructions (:mod:`attention_core.backends.triton_inspect`, ``benchmarks/triton_resources.py``): a
candidate that spills registers to local memory is not worth an autotuner's time. The kernels themselves are
in :mod:`attention_core.backends.triton_flash`.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch
import triton

__all__ = ["CANDIDATES", "PREPROCESS_BLOCK", "RAGGED_SPILLS", "RAGGED_UNAVOIDABLE", "TUNE_KEY", "autotune_configs",
           "check_block",
           "favoured_config", "interpreter_shape", "is_ragged", "kind", "make_config", "prune_for", "shape_of"]

#: A candidate block shape: (BLOCK_M, BLOCK_N, num_warps, num_stages).
Shape = Tuple[int, int, int, int]

#: Autotune candidates per (kernel, kind, head-dim bucket 64 or 128), the one the autotuner is expected to
#: favour first. Kinds: "half" (fp16/bf16 on sm_80+: tensor cores), "fp32" (IEEE dots on the FMA units, with
#: every operand in registers, where fp16-sized tiles spill kilobytes per thread) and "sm75" (any dtype before
#: sm_80, where Triton emits no tensor-core instruction either). What each candidate compiles to is in
#: benchmarks/results/triton_resources.md, for sm_80 and sm_90, every dtype, causal / full / window, E in
#: {64, 80, 128}, at a length that is a multiple of every tile (4096) and at one that is a multiple of none
#: (4001). At 4096 no "half" or "fp32" candidate spills on sm_80 or sm_90. At a ragged length some do (the
#: bounds checks of the masked last tile cost registers): those are in :data:`RAGGED_SPILLS`, and
#: :func:`prune_for` withholds them from the autotuner at such a launch. "sm75" candidates fit a T4's 64 KiB
#: of shared memory. On sm_75 (every launch compiled) no kernel has a tensor-core
#: instruction; the float16 backward at E > 64 spills with every tile (hundreds to thousands of bytes per
#: thread), as do 5 of the 24 float32 dq launches at E > 64 and 2 float32 forward launches; "sm75" lists are not
#: pruned (the library never picks `triton` by itself, and warns on a GPU older than sm_80). For dK/dV,
#: BLOCK_N is the tall key tile and BLOCK_M the short query tile.
CANDIDATES: Dict[Tuple[str, str, int], List[Shape]] = {
    ("fwd", "half", 64): [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3),
                          (64, 32, 4, 3)],
    ("fwd", "half", 128): [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    ("dq", "half", 64): [(128, 32, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3)],
    # (64, 64, 4, 3) dropped: it spills on sm_80 even at L = 4096 when E = 80 (8 bytes stored per thread)
    ("dq", "half", 128): [(128, 32, 8, 3), (64, 64, 8, 3), (64, 32, 4, 3)],
    # (64, 64, 4, 2) dropped: it spills on sm_80 even at L = 4096 in the window mode (40/108 bytes per thread, fp16
    # and bf16), and at a ragged length on sm_80 and sm_90 (28-44 bytes stored)
    ("dkdv", "half", 64): [(32, 128, 8, 3), (16, 128, 4, 3), (32, 64, 4, 3), (16, 64, 4, 3)],
    # (64, 64, 8, 2) dropped: on sm_90 it spills even at L = 4096 (E = 80 causal and window, E = 128 window; 16-60
    # bytes stored per thread, fp16 and bf16), and at a ragged length (20-128 bytes)
    ("dkdv", "half", 128): [(16, 128, 8, 3), (16, 64, 4, 3)],
    ("fwd", "fp32", 64): [(32, 32, 4, 2), (32, 32, 8, 2), (16, 64, 4, 2)],
    ("fwd", "fp32", 128): [(16, 64, 8, 2), (32, 32, 8, 1), (16, 32, 8, 2)],
    ("dq", "fp32", 64): [(32, 32, 8, 2), (16, 32, 4, 2)],
    # (32, 32, 4, 2) dropped: on sm_90 it spills even at L = 4096 in the window mode (1,644 bytes stored per thread
    # at E = 80 and 128), and at a ragged length on sm_80 and sm_90
    ("dq", "fp32", 128): [(32, 32, 8, 2), (16, 32, 4, 2)],
    ("dkdv", "fp32", 64): [(16, 64, 8, 2), (32, 32, 8, 2), (16, 32, 4, 2)],
    ("dkdv", "fp32", 128): [(16, 32, 8, 2), (16, 32, 4, 2)],
    ("fwd", "sm75", 64): [(16, 32, 8, 2), (32, 32, 8, 2), (16, 16, 4, 2)],
    ("fwd", "sm75", 128): [(16, 32, 8, 2), (32, 32, 8, 2), (16, 16, 4, 2)],
    ("dq", "sm75", 64): [(32, 32, 8, 2), (16, 64, 8, 2), (16, 32, 4, 2)],
    ("dq", "sm75", 128): [(16, 16, 4, 2), (16, 32, 4, 2)],
    ("dkdv", "sm75", 64): [(16, 32, 8, 2), (16, 16, 4, 2)],
    ("dkdv", "sm75", 128): [(16, 32, 8, 2), (32, 16, 4, 2)],
}

#: Candidates that spill registers on a GPU when the launch is ragged (L or S not a multiple of the config's
#: tiles), found by compiling them at L = S = 4001: (kernel, kind, bucket, shape) -> the archs where they do.
#: At a round length they do not spill and stay candidates; at a ragged one :func:`prune_for` drops them.
#: 4001 is a multiple of nothing; Triton compiles other masks for a length it knows to be a multiple of 16, and
#: at L = S = 4000 the fp16 causal forward at E = 128 spills on sm_80 in a config (128, 64, 8, 3) that does not
#: spill there at 4001 in that mode (it is withheld all the same: it spills at 4001 in the window mode). The
#: slice compiled at 4000 (fp16, E = 128, causal, fwd and dq, every candidate, sm_80 and sm_90:
#: benchmarks/results/triton_resources_l4000.md) spills only in configs withheld here; other dtypes, modes and
#: head dims at 4000, and other ragged lengths, are not compiled.
RAGGED_SPILLS: Dict[Tuple[str, str, int, Shape], Tuple[int, ...]] = {
    # float32 E=64 full sm_80: 4/4 B
    ("dkdv", "fp32", 64, (16, 32, 4, 2)): (80,),
    # float32 E=128 window sm_90: 136/176 B; float32 E=80 window sm_90: 116/152 B
    ("dkdv", "fp32", 128, (16, 32, 4, 2)): (90,),
    # float32 E=128 window sm_90: 8/8 B; float32 E=80 causal sm_90: 16/16 B; float32 E=80 window sm_80: 12/12 B;
    #   float32 E=80 window sm_90: 12/12 B
    ("dkdv", "fp32", 128, (16, 32, 8, 2)): (80, 90),
    # bfloat16 E=64 window sm_90: 20/20 B; float16 E=64 window sm_90: 20/20 B
    ("dkdv", "half", 64, (16, 128, 4, 3)): (90,),
    # bfloat16 E=128 window sm_90: 20/20 B; bfloat16 E=80 window sm_90: 20/20 B; float16 E=128 window sm_90:
    #   20/20 B; float16 E=80 window sm_90: 20/20 B
    ("dkdv", "half", 128, (16, 64, 4, 3)): (90,),
    # float32 E=128 window sm_80: 12/12 B; float32 E=80 causal sm_80: 16/16 B; float32 E=80 window sm_80: 16/16
    #   B
    ("dq", "fp32", 128, (16, 32, 4, 2)): (80,),
    # float32 E=128 full sm_90: 432/548 B; float32 E=128 window sm_90: 532/808 B; float32 E=80 full sm_80: 12/12
    #   B; float32 E=80 full sm_90: 436/552 B; float32 E=80 window sm_80: 8/8 B; float32 E=80 window sm_90:
    #   536/812 B
    ("dq", "fp32", 128, (32, 32, 8, 2)): (80, 90),
    # bfloat16 E=64 causal sm_80: 8/4 B; float16 E=64 causal sm_80: 8/4 B
    ("dq", "half", 64, (128, 32, 4, 3)): (80,),
    # bfloat16 E=128 causal sm_80: 8/4 B; bfloat16 E=128 full sm_80: 8/4 B; bfloat16 E=80 causal sm_80: 8/4 B;
    #   bfloat16 E=80 full sm_80: 8/4 B; float16 E=128 causal sm_80: 8/4 B; float16 E=128 full sm_80: 8/4 B;
    #   float16 E=80 causal sm_80: 8/4 B; float16 E=80 full sm_80: 8/4 B
    ("dq", "half", 128, (128, 32, 8, 3)): (80,),
    # float32 E=128 window sm_90: 264/368 B; float32 E=80 causal sm_90: 324/320 B; float32 E=80 full sm_80: 8/8
    #   B; float32 E=80 full sm_90: 288/304 B; float32 E=80 window sm_90: 356/440 B
    ("fwd", "fp32", 128, (32, 32, 8, 1)): (80, 90),
    # bfloat16 E=64 window sm_90: 16/20 B; float16 E=64 window sm_90: 16/20 B
    ("fwd", "half", 64, (128, 64, 4, 3)): (90,),
    # bfloat16 E=128 window sm_90: 16/20 B; bfloat16 E=80 window sm_90: 20/24 B; float16 E=128 window sm_90:
    #   16/20 B; float16 E=80 window sm_90: 20/24 B
    ("fwd", "half", 128, (64, 64, 4, 3)): (90,),
    # bfloat16 E=128 causal sm_80: 28/60 B; bfloat16 E=128 window sm_80: 64/120 B; bfloat16 E=80 causal sm_80:
    #   40/76 B; bfloat16 E=80 window sm_80: 108/164 B; float16 E=128 causal sm_80: 28/60 B; float16 E=128
    #   window sm_80: 64/120 B; float16 E=80 causal sm_80: 40/76 B; float16 E=80 window sm_80: 108/164 B
    ("fwd", "half", 128, (128, 64, 8, 2)): (80,),
    # bfloat16 E=128 window sm_80: 8/8 B; bfloat16 E=80 window sm_80: 12/16 B; float16 E=128 window sm_80: 8/8
    #   B; float16 E=80 window sm_80: 12/16 B
    ("fwd", "half", 128, (128, 64, 8, 3)): (80,),
}

#: Candidate lists every member of which spills at some ragged launch on that GPU: (kernel, kind, bucket) ->
#: archs. Withholding them all would leave nothing to run, so there :func:`prune_for` withholds none of them
#: and the autotuner times them all (the spills, listed in RAGGED_SPILLS, are a few to a few hundred bytes).
#: The way out is a smaller tile that compiles without spilling: for dq in float32 at E > 64, a one-off
#: compile of (16, 16, 4, 2) at L = S = 4001 gave no spill on sm_80 in any mode (E = 80 and 128; on sm_90 the
#: window mode spilled 4 bytes), the candidate to add once a sweep has compiled it everywhere.
RAGGED_UNAVOIDABLE: Dict[Tuple[str, str, int], Tuple[int, ...]] = {
    ("dkdv", "fp32", 128): (90,),
    ("dq", "fp32", 128): (80,),
}

#: A new best config is searched for each distinct value of these arguments (and of the tensors' dtypes).
#: ``L_BUCKET``/``S_BUCKET`` are L and S rounded up to a power of two, so a new length does not re-tune;
#: negative when the launch is ragged (:func:`is_ragged`), so a ragged launch never reuses the choice of a
#: round one (their candidates differ, see :data:`RAGGED_SPILLS`). The kernels never read them.
TUNE_KEY = ["L_BUCKET", "S_BUCKET", "E", "Ev", "MODE", "PRECISION"]

#: Rows per program of the backward preprocess (not autotuned: it is a memory-bound row sum).
PREPROCESS_BLOCK = 64


def kind(dtype: object, arch: Optional[int] = None) -> str:
    """"sm75" before sm_80 (``arch`` 75), else "fp32" for float32 inputs, "half" for float16 and bfloat16."""
    if arch is not None and arch < 80:
        return "sm75"
    return "fp32" if str(dtype).replace("torch.", "") in ("float32", "fp32") else "half"


def bucket(E: int) -> int:
    """The head-dim bucket of the candidate lists: 64 up to E = 64, else 128."""
    return 64 if E <= 64 else 128


def shape_of(config: triton.Config) -> Shape:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of a ``triton.Config``."""
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def make_config(shape: Shape) -> triton.Config:
    """A ``triton.Config`` from ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``."""
    bm, bn, warps, stages = shape
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


def autotune_configs(kernel: str, dtype: object, E: int, arch: Optional[int] = None) -> List[triton.Config]:
    """The autotune candidates of ``kernel`` ("fwd", "dq", "dkdv") for ``dtype`` inputs, head dim ``E``, and
    compute capability ``arch`` (e.g. 90; ``None``: sm_80 or newer)."""
    return [make_config(shape) for shape in CANDIDATES[(kernel, kind(dtype, arch), bucket(E))]]


def favoured_config(kernel: str, dtype: object, E: int, arch: Optional[int] = None) -> Optional[Shape]:
    """The candidate the autotuner is expected to pick (the first listed); ``None`` for the preprocess.

    Expected, not measured (no GPU has timed them): the Triton tutorial's tile shapes where they fit, else
    the largest tile that compiles without spilling at L = S = 4096. The resource guard
    (tests/test_triton_resources.py) holds every candidate, this one included, to 0 spills and tensor-core
    instructions on sm_80 and sm_90, except where :data:`RAGGED_SPILLS` withholds it at a ragged launch.
    """
    if kernel == "preprocess":
        return None
    return CANDIDATES[(kernel, kind(dtype, arch), bucket(E))][0]


def _capability(t: torch.Tensor) -> Optional[int]:
    if t.device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(t.device)
    return 10 * major + minor


def is_ragged(L: int, S: int) -> bool:
    """True when L or S is not a multiple of 128, the largest tile: some tile then keeps its bounds checks."""
    return bool(L % 128 or S % 128)


def prune_for(kernel: str):
    """``early_config_prune``: keep the candidates of this call's GPU, dtype and head-dim bucket, less those
    that spill at a ragged launch when this one is (:data:`RAGGED_SPILLS`)."""

    def prune(configs: List[triton.Config], named_args: dict, **kwargs: object) -> List[triton.Config]:
        q = named_args["Q"]
        arch = _capability(q)
        key = (kernel, kind(q.dtype, arch), bucket(max(int(kwargs["E"]), int(kwargs["Ev"]))))
        L, S = int(named_args["L"]), int(named_args["S"])
        wanted = [s for s in CANDIDATES[key]
                  if not ((L % s[0] or S % s[1]) and (arch or 80) in RAGGED_SPILLS.get((*key, s), ()))]
        if (arch or 80) in RAGGED_UNAVOIDABLE.get(key, ()):
            wanted = CANDIDATES[key]
        return [c for c in configs if shape_of(c) in set(wanted or CANDIDATES[key])]

    return prune


def interpreter_shape() -> Shape:
    """The interpreter's one block shape: ``AC_TRITON_INTERPRET_BLOCKS=MxN`` or 32 x 32."""
    text = os.environ.get("AC_TRITON_INTERPRET_BLOCKS", "32x32")
    try:
        bm, bn = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"AC_TRITON_INTERPRET_BLOCKS must look like 128x64, got {text!r}") from None
    check_block(bm, "BLOCK_M (AC_TRITON_INTERPRET_BLOCKS)")
    check_block(bn, "BLOCK_N (AC_TRITON_INTERPRET_BLOCKS)")
    return bm, bn, 4, 1


def check_block(n: object, name: str) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``n`` is a power of two in 16..256."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 16 or n > 256 or n & (n - 1):
        raise ValueError(f"{name} must be a power of two in 16..256, got {n!r}")
