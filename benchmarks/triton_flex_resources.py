"""Registers, spills and shared memory of the Triton flex kernels on sm_80 and sm_90, compiled on the CPU.

Compiles ``attention_core.backends.triton_flex._flex_fwd`` and the backward's ``_flex_bwd_dq`` and
``_flex_bwd_dkdv`` (:mod:`attention_core.backends.triton_flex_bwd`) for real GPU targets without a GPU (Triton's
``ASTSource`` -> PTX -> the wheel's ``ptxas -v``; ``cuobjdump -sass`` counts tensor-core instructions), for
the launches a GPU takes at the launcher's largest tiles (``GPU_TILES``): the heaviest branches (document ids +
the relative-bias table) for float16 (E = 64 and 128), bfloat16 (E = 128) and float32 (E = 64), the causal +
soft-cap branch at float16, E = 128; a round length (4096) and, at float16 E = 128, a ragged one (4001); the
launchers' own ``num_warps`` / ``num_stages`` rules (the backward's: ``triton_flex_bwd.launch_config``). (Every
branch x dtype x E was too slow to compile on the loaded machine it ran on: about a minute per compile.) Writes
``benchmarks/results/triton_flex_resources.json``, with a fingerprint of the kernels' source;
``tests/test_triton_flex.py`` checks the fingerprint, that no row spills and that the 16-bit dots became
tensor-core instructions.

    python benchmarks/triton_flex_resources.py --jobs 2
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "triton_flex_resources.json"
ARCHS = (80, 90)
#: (MASK, SCORE) pairs: every mask branch once, every score branch once, the heaviest pairs together.
COMBOS = [(7, 3), (1, 2)]
#: The launcher's GPU tiles (triton_flex.GPU_TILES).
TILES = {"float16": (128, 32), "bfloat16": (128, 32), "float32": (32, 32)}
#: The forward and the backward's two loops (the preprocess is one row sum, no dots).
KERNELS = ("fwd", "bwd_dq", "bwd_dkdv")
#: Head dims compiled per dtype (float32 on a GPU takes E <= 64 only).
HEAD_DIMS = {"float16": (64, 128), "bfloat16": (128,), "float32": (64,)}


def kernel_fingerprint() -> str:
    """sha256 of the source of every jit function of the kernels (forward, backward), and of the warp rule."""
    os.environ.pop("TRITON_INTERPRET", None)
    from attention_core.backends import triton_flex as tf
    from attention_core.backends import triton_flex_bwd as tb
    from attention_core.backends import triton_flex_mods as tm

    parts = [tm._keep.src, tm._score.src, tf._tile.src, tf._flex_fwd.src, inspect.getsource(tf.num_warps_for),
             tb._probs.src, tb._ds.src, tb._dq_tile.src, tb._flex_bwd_dq.src, tb._probs_t.src, tb._dkdv_tile.src,
             tb._flex_bwd_dkdv.src, inspect.getsource(tb.launch_config)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def jobs(quick: bool = False) -> list:
    """The heaviest pair of branches (document loads + the bias table) at every dtype's GPU tile and head dims;
    the soft-cap branch too at float16, E = 128; the ragged length there as well."""
    out = []
    for arch in ARCHS:
        for dtype, (bm, bn) in TILES.items():
            for E in HEAD_DIMS[dtype]:
                wide = (dtype, E) == ("float16", 128) and not quick
                for mask, score in COMBOS if wide else COMBOS[:1]:
                    for L in (4096, 4001) if wide and (mask, score) == COMBOS[0] else (4096,):
                        for kernel in KERNELS:
                            out.append(dict(kernel=kernel, arch=arch, dtype=dtype, E=E, BLOCK_M=bm, BLOCK_N=bn,
                                            MASK=mask, SCORE=score, L=L))
    return out


def compile_job(job: dict) -> dict:
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton

    from attention_core.backends import triton_flex as tf
    from attention_core.backends.triton_inspect import compile_resources

    L = S = job["L"]
    nQ, nK = -(-L // job["BLOCK_M"]), -(-S // job["BLOCK_N"])
    ptr = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[job["dtype"]]
    values = dict(Q=ptr, K=ptr, V=ptr, Out=ptr, DO=ptr, DQ=ptr, DK=ptr, DV=ptr, LSE="*fp32", Delta="*fp32",
                  KV_NUM="*i32", KV_IDX="*i32", FULL_NUM="*i32", FULL_IDX="*i32", Q_NUM="*i32", Q_IDX="*i32",
                  FULL_Q_NUM="*i32", FULL_Q_IDX="*i32", DOC="*i32", SLOPES="*fp32", TABLE="*fp32", sm_scale=0.125,
                  CAP=30.0,
                  L=L, S=S, H=8, HM=1, N_Q_TILES=nQ, N_K_TILES=nK, P0=4, P1=256, P2=64,
                  BM_B=0, BM_H=0, MASK=job["MASK"], SCORE=job["SCORE"], E=job["E"],
                  BLOCK_D=max(16, triton.next_power_of_2(job["E"])), BLOCK_M=job["BLOCK_M"],
                  BLOCK_N=job["BLOCK_N"], IEEE=job["dtype"] == "float32")
    from attention_core.backends import triton_flex_bwd as tb

    fn = {"fwd": tf._flex_fwd, "bwd_dq": tb._flex_bwd_dq, "bwd_dkdv": tb._flex_bwd_dkdv}[job["kernel"]]
    values = {name: values[name] for name in fn.arg_names}
    warps, stages = tf.num_warps_for(getattr(torch, job["dtype"]), job["E"], job["BLOCK_M"], job["BLOCK_N"]), 2
    if job["kernel"] != "fwd":
        warps, stages = tb.launch_config(getattr(torch, job["dtype"]), job["E"])
    found = compile_resources(fn, values, arch=job["arch"], num_warps=warps, num_stages=stages)
    return {**job, "num_warps": warps, "num_stages": stages, **found}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="the heaviest branches only")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    import triton

    todo = jobs(args.quick)
    start = time.perf_counter()
    # fresh interpreters (spawn): a fork of a process that loaded torch and triton can hang in the child
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        rows = list(pool.map(compile_job, todo))
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "triton": triton.__version__,
            "fingerprint": kernel_fingerprint(), "kernels": list(KERNELS), "archs": list(ARCHS), "combos": COMBOS,
            "tiles": TILES,
            "quick": args.quick, "wall_s": round(time.perf_counter() - start, 1),
            "command": "python benchmarks/triton_flex_resources.py " + " ".join(argv or sys.argv[1:])}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    spills = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    print(f"{len(rows)} compiles, {len(spills)} spill, max registers {max(r['registers'] for r in rows)}; "
          f"wrote {args.out} ({meta['wall_s']} s)")


if __name__ == "__main__":
    main()
