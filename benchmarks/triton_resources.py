"""Registers, spills, shared memory and tensor-core instructions of every Triton kernel, found on a CPU.

Compiles each kernel of :mod:`attention_core.backends.triton_flash` (forward, backward preprocess, dK/dV,
dQ) for every autotune configuration, head dims E in {64, 128}, float16 / bfloat16 / float32 (bfloat16 only
where the architecture has bf16 tensor cores: sm_80 and sm_90), causal and not, for sm_75 (T4), sm_80 (A100)
and sm_90 (H100), with :func:`attention_core.backends.triton_inspect.compile_kernel` (Triton's own
``ptxas`` and ``cuobjdump``; no GPU involved). Writes::

    benchmarks/results/triton_resources.json   every compiled kernel, one row each
    benchmarks/results/triton_resources.md     the favoured configs, then every row, as tables

and a copy of the favoured rows into the package (``attention_core/backends/triton_resources.json``) for
the chapter, which may run where this checkout is not. Example (about 4 minutes on 2 idle cores)::

    python benchmarks/triton_resources.py --jobs 2
    python benchmarks/triton_resources.py --archs 90 --dtypes float16 --out /tmp/r   # a quick subset
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import itertools
import json
import os
import platform
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
os.environ.pop("TRITON_INTERPRET", None)  # compiling needs the real kernels, not the interpreted ones
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning

RESULTS = ROOT / "benchmarks" / "results"
PACKAGE_COPY = ROOT / "attention_core" / "backends" / "triton_resources.json"
KERNEL_ORDER = ("fwd", "dq", "dkdv", "preprocess")
#: Largest dynamic shared memory one block may use, bytes (CUDA programming guide, per architecture).
SHARED_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 90: 227 * 1024}


def _dtypes(arch: int, wanted: List[str]) -> List[str]:
    return [d for d in wanted if d != "bfloat16" or arch >= 80]


def _jobs(archs, dtypes, head_dims, modes, kernels) -> List[Dict[str, Any]]:
    from attention_core.backends.triton_inspect import kernel_configs

    jobs = []
    for arch, E, kernel in itertools.product(archs, head_dims, kernels):
        for dtype in _dtypes(arch, dtypes):
            for causal in (modes if kernel != "preprocess" else [True]):  # preprocess has no mask
                for bm, bn, w, st in kernel_configs(kernel, dtype, E, arch):
                    jobs.append(dict(kernel=kernel, arch=arch, dtype=dtype, E=E, causal=causal, BLOCK_M=bm,
                                     BLOCK_N=bn, num_warps=w, num_stages=st))
    return jobs


def _run(job: Dict[str, Any]) -> Dict[str, Any]:
    warnings.filterwarnings("ignore")
    from attention_core.backends.triton_inspect import compile_kernel

    try:
        row = compile_kernel(**job).as_dict()
        row["error"] = None
    except Exception as err:  # one config that fails to compile must not hide the others
        row = dict(job, error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
    row["shared_fits"] = row.get("shared_bytes") is not None and row["shared_bytes"] <= SHARED_LIMIT[job["arch"]]
    return row


def favoured(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """For each (kernel, arch, dtype, E, causal), the row of the config the library names as favoured."""
    from attention_core.backends import triton_flash

    out = []
    for row in rows:
        fav = getattr(triton_flash, "favoured_config", None)
        if fav is None or row.get("error"):
            continue
        cfg = fav(row["kernel"], row["dtype"], row["E"], row["arch"])
        if cfg is not None and (row["BLOCK_M"], row["BLOCK_N"], row["num_warps"], row["num_stages"]) == cfg:
            out.append(row)
    return out


def _fmt(row: Dict[str, Any]) -> str:
    cfg = f"{row['BLOCK_M']}x{row['BLOCK_N']} w{row['num_warps']} s{row['num_stages']}"
    if row.get("error"):
        return (f"| {row['kernel']} | sm_{row['arch']} | {row['dtype']} | {row['E']} | {row['causal']} | {cfg} | "
                f"error: {row['error'][:60]} | | | | | |")
    tc = f"{row['hgmma']} HGMMA" if row["hgmma"] else f"{row['hmma']} HMMA"
    fits = "" if row["shared_fits"] else " (too much)"
    return (f"| {row['kernel']} | sm_{row['arch']} | {row['dtype']} | {row['E']} | {row['causal']} | {cfg} | "
            f"{row['registers']} | {row['spill_stores']} / {row['spill_loads']} | {row['stack_bytes']} | "
            f"{row['shared_bytes'] // 1024} KiB{fits} | {tc} | {row['compile_s']:.1f} |")


HEADER = ("| kernel | arch | dtype | E | causal | config (M x N, warps, stages) | registers | "
          "spill st / ld (B/thread) | stack (B) | shared | tensor-core instr. | compile s |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def _sort_key(row: Dict[str, Any]):
    return (KERNEL_ORDER.index(row["kernel"]), row["arch"], row["dtype"], row["E"], not row["causal"],
            -row["BLOCK_M"], -row["BLOCK_N"], -row["num_warps"], -row["num_stages"])


def write_markdown(path: Path, meta: Dict[str, Any], rows: List[Dict[str, Any]]) -> None:
    fav = favoured(rows)
    lines = [
        "# Triton kernels as the GPU sees them (compiled on a CPU)",
        "",
        f"Made by `{meta['command']}` on {meta['date']} (triton {meta['triton']}, {meta['machine']}).",
        f"Launch specialised as: {meta['launch']}. Bytes are per thread; shared memory per block; "
        "`(too much)`: more shared memory than the architecture gives one block (such a config cannot launch).",
        "Tensor-core instructions are counted in the SASS: HGMMA (sm_90 warpgroup MMA), HMMA (sm_75/sm_80 warp "
        "MMA). float32 dots are IEEE (`input_precision=\"ieee\"`), so they use no tensor cores by design.",
        "",
    ]
    if fav:
        lines += ["## The configs the autotuner is expected to favour", "", HEADER]
        lines += [_fmt(r) for r in sorted(fav, key=_sort_key)]
        lines += [""]
    ok = [r for r in rows if not r.get("error")]
    spilling = sum(1 for r in ok if r["spill_stores"] + r["spill_loads"] > 0)
    lines += ["## Every compiled config", "",
              f"{len(rows)} compiles, {len(rows) - len(ok)} failed, {spilling} spill.", "", HEADER]
    lines += [_fmt(r) for r in sorted(rows, key=_sort_key)]
    path.write_text("\n".join(lines) + "\n")


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", type=int, nargs="+", default=[75, 80, 90])
    p.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16", "float32"])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--modes", nargs="+", default=["causal", "full"], choices=["causal", "full"])
    p.add_argument("--kernels", nargs="+", default=list(KERNEL_ORDER), choices=list(KERNEL_ORDER))
    p.add_argument("--jobs", type=int, default=2, help="compiling processes (at most 2 on this machine)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and the markdown table")
    p.add_argument("--name", default="triton_resources", help="file name stem")
    p.add_argument("--no-package-copy", action="store_true", help="do not update the package's copy")
    args = p.parse_args(argv)

    import triton

    from attention_core.backends.triton_inspect import launch_args

    modes = [m == "causal" for m in args.modes]
    jobs = _jobs(args.archs, args.dtypes, args.head_dims, modes, args.kernels)
    print(f"{len(jobs)} compiles on {args.jobs} processes", flush=True)
    start = time.perf_counter()
    rows = []
    with ProcessPoolExecutor(max_workers=max(1, min(args.jobs, 2))) as pool:
        for i, row in enumerate(pool.map(_run, jobs), 1):
            rows.append(row)
            if i % 20 == 0 or i == len(jobs):
                print(f"  {i}/{len(jobs)} ({time.perf_counter() - start:.0f} s)", flush=True)
    scenario = {k: v.default for k, v in inspect.signature(launch_args).parameters.items()
                if v.kind == v.KEYWORD_ONLY}
    meta = {
        "command": "python benchmarks/triton_resources.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "triton": triton.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        "launch": "contiguous (B, H, N, E) tensors, " + ", ".join(f"{k}={v}" for k, v in scenario.items())
                  + "; the innermost stride is the constant 1, the others divisible by 16",
        "wall_s": round(time.perf_counter() - start, 1),
    }
    rows.sort(key=_sort_key)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    write_markdown(args.out / f"{args.name}.md", meta, rows)
    fav = favoured(rows)
    if fav and not args.no_package_copy:
        PACKAGE_COPY.write_text(json.dumps({"meta": meta, "rows": sorted(fav, key=_sort_key)}, indent=1) + "\n")
    print(f"wrote {args.out / args.name}.json and .md ({meta['wall_s']} s)")


if __name__ == "__main__":
    main()
