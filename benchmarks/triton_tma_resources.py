"""Registers, spills, wgmma and TMA instructions of the TMA forward kernel on sm_90, compiled on the CPU.

Compiles ``attention_core.backends.triton_flash_tma._attn_fwd_tma`` for ``GPUTarget("cuda", 90, 32)`` without
a GPU (Triton's ``ASTSource`` -> PTX -> the wheel's ``ptxas -v`` for registers and spills; ``cuobjdump -sass``
for the machine code), specialised as a launch on contiguous tensors is: the four tensor descriptors as
``tensordesc<dtype[box, E]>`` arguments, ``L``/``S`` divisible by 16. For each launch shape it records:

* ``registers``, ``spill_stores``, ``spill_loads`` (bytes per thread), ``shared_bytes``;
* ``wgmma_ptx`` (``wgmma.mma_async`` in the PTX) and ``hgmma`` (``HGMMA.`` in the SASS): Hopper's warpgroup
  tensor-core instructions;
* ``tma_load_ptx`` / ``tma_store_ptx`` (``cp.async.bulk.tensor`` global -> shared / shared -> global in the
  PTX) and ``utmaldg`` / ``utmastg`` (``UTMALDG`` / ``UTMASTG`` in the SASS): the TMA copies;
* ``warp_specialize_ops``: ``ttg.warp_specialize`` regions in the TTGIR (0: no warp specialisation).

``warp_specialize_probe``: a few shapes compiled again with ``WARP_SPECIALIZE=True``, to record whether
Triton's Hopper warp-specialisation pass splits this loop (see :data:`WS_PROBES`). ``candidate_scan``: the
tutorial's Hopper configuration space at float16, causal, L = 16384 (:data:`SCAN`), from which the candidates
were picked.

Launch shapes: float16 and bfloat16, E = 64 and 128, causal and not, L = S = 16384 and 4096 (B = 4, Hq = H = 8),
each at every autotune candidate of its head dim (``triton_flash_tma.CANDIDATES``). Writes
``benchmarks/results/triton_tma_resources.json`` with a fingerprint of the kernel's source
(:func:`kernel_fingerprint`); ``tests/test_triton_tma.py`` checks the fingerprint and every row.

    python benchmarks/triton_tma_resources.py            # 143 compiles, ~2-5 s each here
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import inspect
import json
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "benchmarks" / "results" / "triton_tma_resources.json"
ARCH = 90
B, H = 4, 8
DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128)
LENGTHS = (16384, 4096)

_PATTERNS = {
    "wgmma_ptx": (r"\bwgmma\.mma_async\.", "ptx"),
    "tma_load_ptx": (r"\bcp\.async\.bulk\.tensor\.\dd\.shared::cta?\.global|\bcp\.async\.bulk\.tensor\.\dd\."
                     r"shared::cluster\.global", "ptx"),
    "tma_store_ptx": (r"\bcp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", "ptx"),
    "hgmma": (r"\bHGMMA\.", "sass"),
    "utmaldg": (r"\bUTMALDG\b", "sass"),
    "utmastg": (r"\bUTMASTG\b", "sass"),
}


def _module():
    os.environ.pop("TRITON_INTERPRET", None)
    from attention_core.backends import triton_flash_tma

    if triton_flash_tma.INTERPRET:
        raise RuntimeError("the kernel was defined under TRITON_INTERPRET=1; compile it in a process without it")
    return triton_flash_tma


def kernel_fingerprint() -> str:
    """sha256 (16 hex) of the Triton version, every jit function of triton_flash_tma and the candidate list."""
    import triton

    tm = _module()
    parts = [triton.__version__, repr(tm.CANDIDATES), inspect.getsource(tm._prune)]
    for name, value in sorted(vars(tm).items()):
        if isinstance(value, triton.runtime.jit.JITFunction):
            parts.append(f"{name}:{value.src}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def jobs() -> list:
    """Every launch shape of the report: (dtype, E, causal, L, (BLOCK_M, BLOCK_N, warps, stages)), each
    candidate the autotuner may time at that launch."""
    tm = _module()
    return [(dtype, E, causal, L, shape) for dtype in DTYPES for E in HEAD_DIMS for causal in (True, False)
            for L in LENGTHS for shape in tm.CANDIDATES[E] if not causal or shape[0] % shape[1] == 0]


def _signature(fn, dtype: str, E: int, causal: bool, L: int, shape: tuple, warp_specialize: bool = False):
    bm, bn = shape[:2]
    elt = {"float16": "fp16", "bfloat16": "bf16"}[dtype]
    values = {"desc_q": f"tensordesc<{elt}[{bm}, {E}]>", "desc_o": f"tensordesc<{elt}[{bm}, {E}]>",
              "desc_k": f"tensordesc<{elt}[{bn}, {E}]>", "desc_v": f"tensordesc<{elt}[{bn}, {E}]>",
              "LSE": "*fp32", "sm_scale": "fp32", "Hq": H, "GROUP": 1, "L": L, "S": L, "L_BUCKET": L,
              "S_BUCKET": L}
    constexprs = {"E": E, "IS_CAUSAL": causal, "WARP_SPECIALIZE": warp_specialize, "BLOCK_M": bm, "BLOCK_N": bn}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        v = values[name]
        if isinstance(v, str):
            signature[name] = v
            if v.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif v == 1:  # Triton turns an int argument equal to 1 into a constant
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def compile_job(job: tuple, warp_specialize: bool = False) -> dict:
    """Compile one launch shape for sm_90 from scratch (no Triton cache) and read its resources."""
    from attention_core.backends.triton_inspect import compile_for

    dtype, E, causal, L, shape = job
    fn = _module()._attn_fwd_tma
    signature, constexprs, attrs = _signature(fn, dtype, E, causal, L, shape, warp_specialize)
    row = {"dtype": dtype, "E": E, "causal": causal, "L": L, "S": L, "BLOCK_M": shape[0], "BLOCK_N": shape[1],
           "num_warps": shape[2], "num_stages": shape[3]}
    compiled, sass, found, seconds = compile_for(fn, signature, constexprs, attrs, arch=ARCH, num_warps=shape[2],
                                                 num_stages=shape[3])
    row.update(compile_s=round(seconds, 1), **found)
    asm = {"ptx": compiled.asm["ptx"], "sass": sass}
    for name, (pattern, where) in _PATTERNS.items():
        row[name] = len(re.findall(pattern, asm[where]))
    row["warp_specialize_ops"] = compiled.asm["ttgir"].count("ttg.warp_specialize")  # partitions made
    return row


#: The tutorial's Hopper space, scanned to pick the candidates: fp16, causal (its masked loop is the heavier),
#: L = 16384, BLOCK_M in {64, 128}, BLOCK_N in {32, 64, 128} dividing it, 4 and 8 warps, 2-4 stages.
SCAN = [("float16", E, True, 16384, (bm, bn, w, st)) for E in HEAD_DIMS for bm in (128, 64) for bn in (128, 64, 32)
        if bm % bn == 0 for w in (8, 4) for st in (2, 3, 4)]


#: Launch shapes compiled once more with ``WARP_SPECIALIZE=True`` (``tl.range(..., warp_specialize=True)``):
#: does Triton's Hopper pass partition this loop? (The tutorial turns it on in its tests on Blackwell only.)
WS_PROBES = [("float16", 128, True, 16384, (128, 64, 8, 3)), ("float16", 128, True, 16384, (128, 32, 4, 3)),
             ("float16", 64, False, 16384, (128, 64, 4, 3))]


def warp_specialize_probe() -> list:
    """Each probe compiled with warp specialisation on: its row (``warp_specialize_ops`` > 0 if the loop was
    split into partitions), or the compiler's error."""
    out = []
    for job in WS_PROBES:
        with tempfile.TemporaryFile(mode="w+") as log:  # the MLIR pass manager writes to file descriptor 2
            sys.stderr.flush()
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)
            try:
                row = compile_job(job, warp_specialize=True)
            except Exception as err:  # noqa: BLE001 - recorded: the compiler refused
                row = {"dtype": job[0], "E": job[1], "causal": job[2], "L": job[3], "BLOCK_M": job[4][0],
                       "BLOCK_N": job[4][1], "num_warps": job[4][2], "num_stages": job[4][3],
                       "error": f"{type(err).__name__}: {str(err).splitlines()[-1][:300] if str(err) else ''}"}
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            log.seek(0)
            text = log.read()
        if "error" in row:
            failed = re.search(r"Pipeline failed while executing \[`(\w+)`", text)
            first = re.search(r"(error: .*|Assertion .*)", text)
            row["failed_pass"] = failed.group(1) if failed else None
            row["first_message"] = first.group(1)[:300] if first else None
        out.append(row)
        print(f"[warp_specialize] {row}", flush=True)
    return out


def scan() -> list:
    """Every shape of :data:`SCAN` compiled (the evidence behind ``triton_flash_tma.CANDIDATES``)."""
    rows = []
    for i, job in enumerate(SCAN, 1):
        rows.append(compile_job(job))
        print(f"[scan {i}/{len(SCAN)}] {rows[-1]}", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--limit", type=int, default=None, help="compile only the first N launch shapes")
    parser.add_argument("--probe-only", action="store_true",
                        help="redo only the warp-specialisation probe of the existing report")
    args = parser.parse_args(argv)
    import triton

    if args.probe_only:
        report = json.loads(args.out.read_text())
        if report["meta"]["kernel_fingerprint"] != kernel_fingerprint():
            raise SystemExit("the report is of another kernel: regenerate it whole")
        report["warp_specialize_probe"] = warp_specialize_probe()
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"updated the probe of {args.out}")
        return 0

    todo = jobs()[:args.limit]
    rows = []
    for i, job in enumerate(todo, 1):
        row = compile_job(job)
        rows.append(row)
        print(f"[{i}/{len(todo)}] {row}", flush=True)
    report = {"meta": {"kernel_fingerprint": kernel_fingerprint(), "triton": triton.__version__, "arch": ARCH,
                       "B": B, "Hq": H, "H": H, "date": datetime.date.today().isoformat(),
                       "what": "sm_90 compile of triton_flash_tma._attn_fwd_tma on a CPU (no GPU): ptxas -v, "
                               "PTX and cuobjdump -sass instruction counts; no timing"},
              "rows": rows, "warp_specialize_probe": warp_specialize_probe(), "candidate_scan": scan()}
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
