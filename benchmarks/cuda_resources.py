"""Registers, spills and shared memory of the CUDA C++ kernels (``csrc/flash_kernels.cuh``), found on a CPU.

``nvcc`` compiles ``csrc/flash_launch.cu`` (every kernel the dispatcher can start: level 1 for float32,
float16 and bfloat16, level 2 for float16 and bfloat16, each at the padded head dims D = 16, 32, 64, 128) for
sm_75 (T4), sm_80 (A100) and sm_90 (H100) with the optimisation users get (``-O3``, as
:func:`attention_core.backends.cuda_flash.load_extension` passes to ``load_inline``, plus torch's own
``COMMON_NVCC_FLAGS``) and ``-Xptxas -v``, whose log gives, per kernel and architecture, registers per thread,
stack frame, spill stores and loads (bytes per thread) and static shared memory per block. Writes::

    benchmarks/results/cuda_resources.json    one row per (kernel, arch), and the sources' fingerprint
    benchmarks/results/cuda_resources.md      the same as a table
    attention_core/backends/cuda_resources.json   a copy for the chapter

tests/test_cuda_resources.py fails when the committed report no longer matches the sources (fingerprint), and
recompiles one architecture to compare the numbers. About a minute per architecture on an idle core::

    python benchmarks/cuda_resources.py
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "attention_core" / "backends" / "csrc"
RESULTS = ROOT / "benchmarks" / "results"
PACKAGE_COPY = ROOT / "attention_core" / "backends" / "cuda_resources.json"
ARCHS = (75, 80, 90)
#: What ``load_extension`` passes (``extra_cuda_cflags``); torch adds COMMON_NVCC_FLAGS and -std=c++17.
USER_FLAGS = ("-O3", "-lineinfo")
#: torch.utils.cpp_extension.COMMON_NVCC_FLAGS of torch 2.13, used when torch is not importable.
FALLBACK_COMMON = ("-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                   "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr")
SOURCES = ("flash_kernels.cuh", "flash_dispatch.h", "flash_launch.cu")

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for 'sm_(\d+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_KERNEL = re.compile(r"ac(\d+)flash_fwd_(rowwise|wmma)I(f|6__half|13__nv_bfloat16)Li(\d+)E")
_DTYPE = {"f": "float32", "6__half": "float16", "13__nv_bfloat16": "bfloat16"}


def find_nvcc() -> Optional[str]:
    """``nvcc`` on the PATH, in ``$CUDA_HOME/bin`` or ``/usr/local/cuda/bin``; ``None`` if none."""
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for candidate in (shutil.which("nvcc"), os.path.join(home, "bin", "nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.isfile(candidate):
            return candidate
    return None


def fingerprint() -> str:
    """A hash of the kernel sources, the flags and the nvcc version: what decides the numbers."""
    nvcc = find_nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1] \
        if nvcc else "no nvcc"
    parts = [version, *USER_FLAGS] + [(CSRC / name).read_text() for name in SOURCES]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def common_flags() -> List[str]:
    try:
        from torch.utils.cpp_extension import COMMON_NVCC_FLAGS
        return list(COMMON_NVCC_FLAGS)
    except ImportError:
        return list(FALLBACK_COMMON)


def parse(log: str) -> List[Dict[str, Any]]:
    """Rows of ``ptxas -v`` output: one per kernel entry point and architecture."""
    rows: List[Dict[str, Any]] = []
    for block in log.split("ptxas info    : Compiling entry function")[1:]:
        block = "ptxas info    : Compiling entry function" + block
        entry = _ENTRY.search(block)
        kernel = _KERNEL.search(entry.group(1)) if entry else None
        if kernel is None:
            continue
        spill, regs, smem = _SPILL.search(block), _REGS.search(block), _SMEM.search(block)
        rows.append(dict(level=1 if kernel.group(2) == "rowwise" else 2, dtype=_DTYPE[kernel.group(3)],
                         D=int(kernel.group(4)), arch=int(entry.group(2)), registers=int(regs.group(1)),
                         stack_bytes=int(spill.group(1)), spill_stores=int(spill.group(2)),
                         spill_loads=int(spill.group(3)), shared_bytes=int(smem.group(1)) if smem else 0))
    return rows


def compile_arch(arch: int, nvcc: Optional[str] = None) -> List[Dict[str, Any]]:
    """Compile ``flash_launch.cu`` for ``sm_<arch>`` with ``-Xptxas -v``; the rows of its log."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (looked in PATH, $CUDA_HOME/bin and /usr/local/cuda/bin)")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-c", *USER_FLAGS, *common_flags(), "-std=c++17", "-gencode",
               f"arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v", str(CSRC / "flash_launch.cu"),
               "-o", str(Path(tmp) / "k.o")]
        done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed for sm_{arch}:\n{done.stderr[-4000:]}")
    return parse(done.stderr + done.stdout)


def _key(r: Dict[str, Any]):
    return (r["level"], r["arch"], ("float32", "float16", "bfloat16").index(r["dtype"]), r["D"])


def write_markdown(path: Path, meta: Dict[str, Any], rows: List[Dict[str, Any]]) -> None:
    spilling = [r for r in rows if r["spill_stores"] + r["spill_loads"] > 0]
    lines = ["# The CUDA C++ kernels as the GPU sees them (compiled on a CPU)", "",
             f"Made by `{meta['command']}` on {meta['date']} ({meta['nvcc']}; flags `{meta['flags']}`; sources "
             f"{meta['fingerprint']}). Bytes are per thread, shared memory per block (static).", "",
             f"{len(rows)} kernels, {len(spilling)} spill.", "",
             "| level | arch | dtype | D | registers | spill st / ld (B/thread) | stack (B) | shared |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['level']} | sm_{r['arch']} | {r['dtype']} | {r['D']} | {r['registers']} | "
                     f"{r['spill_stores']} / {r['spill_loads']} | {r['stack_bytes']} | {r['shared_bytes']} B |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--archs", type=int, nargs="+", default=list(ARCHS))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--no-package-copy", action="store_true")
    args = p.parse_args(argv)
    nvcc = find_nvcc()
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:
        rows = [r for part in pool.map(lambda a: compile_arch(a, nvcc), args.archs) for r in part]
    rows.sort(key=_key)
    meta = {
        "command": "python benchmarks/cuda_resources.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "nvcc": subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1],
        "flags": " ".join([*USER_FLAGS, *common_flags(), "-std=c++17", "-Xptxas -v"]),
        "fingerprint": fingerprint(),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda_resources.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    write_markdown(args.out / "cuda_resources.md", meta, rows)
    if not args.no_package_copy:
        PACKAGE_COPY.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out / 'cuda_resources.json'} and .md: {len(rows)} kernels, "
          f"{sum(r['spill_stores'] + r['spill_loads'] > 0 for r in rows)} spill ({meta['wall_s']} s)")


if __name__ == "__main__":
    main()
