"""Registers, spills, shared memory and tensor-core instructions of every Triton kernel, found on a CPU.

Compiles each kernel of :mod:`attention_core.backends.triton_flash` (forward, backward preprocess, dK/dV,
dQ) for every autotune candidate the autotuner may pick, head dims E in {64, 80, 128} (80: a head dim that
is not a power of two, zero-padded to 128 inside the kernel), float16 / bfloat16 / float32 (bfloat16 only
where the architecture has bf16 tensor cores: sm_80 and sm_90), the three mask modes (causal, full, and a
causal sliding window of 256 keys), at two lengths L = S: 4096 (a multiple of every tile, so no bounds
checks are compiled in) and 4001 (a multiple of no tile and not even of 16: every load and store keeps its
bounds check, and Triton cannot assume L divisible by 16), for sm_75 (T4), sm_80 (A100) and sm_90 (H100),
with :func:`attention_core.backends.triton_inspect.compile_kernel` (Triton's own ``ptxas`` and
``cuobjdump``; no GPU involved). Writes::

    benchmarks/results/triton_resources.json   every compiled kernel, one row each, and the fingerprints
    benchmarks/results/triton_resources.md     every row that spills, the favoured configs, then every row

and a copy of the favoured rows into the package (``attention_core/backends/triton_resources.json``) for
the chapter, which may run where this checkout is not. Both JSON files store
:func:`~attention_core.backends.triton_inspect.kernels_fingerprint` and ``candidates_fingerprint``:
tests/test_triton_resources.py fails when they no longer match today's kernels and candidate lists, and
recompiles a sample of rows to check the numbers themselves.

Each compile is cached (``--cache``, keyed by the kernels' fingerprint and the launch), so a sweep that was
interrupted, or re-run after a candidate list lost a member, compiles only what it has not seen. The full
sweep is ``make gpu-sweep`` (about 1,500 compiles; see benchmarks/NOTES.md for its time). Examples::

    python benchmarks/triton_resources.py --jobs 2
    python benchmarks/triton_resources.py --archs 90 --dtypes float16 --out /tmp/r --no-package-copy  # a subset
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import json
import os
import platform
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FuturesTimeout
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
os.environ.pop("TRITON_INTERPRET", None)  # compiling needs the real kernels, not the interpreted ones
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning

RESULTS = ROOT / "benchmarks" / "results"
PACKAGE_COPY = ROOT / "attention_core" / "backends" / "triton_resources.json"
KERNEL_ORDER = ("fwd", "dq", "dkdv", "preprocess")
MODE_ORDER = ("causal", "full", "window")
#: The sliding window of the "window" mode (causal, the 256 most recent keys): any window compiles the same.
WINDOW = 256
#: The lengths swept: a multiple of every tile, and a multiple of none (nor of 16).
LENGTHS = (4096, 4001)
DEFAULT_CACHE = (Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "attention_core"
                 / "triton_resources.jsonl")
#: The fields of a row that a compile measures (the rest describe the job).
MEASURED = ("registers", "stack_bytes", "spill_stores", "spill_loads", "shared_bytes", "hgmma", "hmma")
#: Largest dynamic shared memory one block may use, bytes (CUDA programming guide, per architecture).
SHARED_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 90: 227 * 1024}


def _dtypes(arch: int, wanted: List[str]) -> List[str]:
    return [d for d in wanted if d != "bfloat16" or arch >= 80]


def _jobs(archs, dtypes, head_dims, modes, kernels, lengths) -> List[Dict[str, Any]]:
    from attention_core.backends.triton_inspect import kernel_configs

    jobs = []
    for arch, E, kernel in itertools.product(archs, head_dims, kernels):
        for dtype in _dtypes(arch, dtypes):
            # the preprocess has no mask, and the length is a runtime bound of its one masked load
            for mode in (modes if kernel != "preprocess" else ["causal"]):
                for L in (lengths if kernel != "preprocess" else [lengths[0]]):
                    for bm, bn, w, st in kernel_configs(kernel, dtype, E, arch):
                        jobs.append(dict(kernel=kernel, arch=arch, dtype=dtype, E=E, mode=mode, L=L, BLOCK_M=bm,
                                         BLOCK_N=bn, num_warps=w, num_stages=st))
    return jobs


def _job_key(job: Dict[str, Any], fingerprint: str) -> str:
    return hashlib.sha256((fingerprint + json.dumps(job, sort_keys=True)).encode()).hexdigest()[:24]


def compile_job(job: Dict[str, Any]) -> Dict[str, Any]:
    """Compile one job (a row's describing fields) and return the row, ``error`` set if it failed."""
    from attention_core.backends.triton_inspect import compile_kernel

    launch = {"L": job["L"], "S": job["L"], "window": WINDOW if job["mode"] == "window" else None}
    args = {k: v for k, v in job.items() if k not in ("mode", "L")}
    try:
        row = compile_kernel(**args, causal=job["mode"] != "full", launch=launch).as_dict()
        row["error"] = None
    except Exception as err:  # one config that fails to compile must not hide the others
        row = dict(args, error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
    row = dict(job, **{k: v for k, v in row.items() if k not in job and k != "causal"})
    row["shared_fits"] = row.get("shared_bytes") is not None and row["shared_bytes"] <= SHARED_LIMIT[job["arch"]]
    return row


def _run(job: Dict[str, Any]) -> Dict[str, Any]:
    warnings.filterwarnings("ignore")
    return compile_job(job)


def favoured(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """For each (kernel, arch, dtype, E, mode, L), the row of the config the library names as favoured."""
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
        return (f"| {row['kernel']} | sm_{row['arch']} | {row['dtype']} | {row['E']} | {row['mode']} | {row['L']} | "
                f"{cfg} | error: {row['error'][:60]} | | | | | |")
    tc = f"{row['hgmma']} HGMMA" if row["hgmma"] else f"{row['hmma']} HMMA"
    fits = "" if row["shared_fits"] else " (too much)"
    return (f"| {row['kernel']} | sm_{row['arch']} | {row['dtype']} | {row['E']} | {row['mode']} | {row['L']} | "
            f"{cfg} | {row['registers']} | {row['spill_stores']} / {row['spill_loads']} | {row['stack_bytes']} | "
            f"{row['shared_bytes'] // 1024} KiB{fits} | {tc} | {row['compile_s']:.1f} |")


HEADER = ("| kernel | arch | dtype | E | mode | L = S | config (M x N, warps, stages) | registers | "
          "spill st / ld (B/thread) | stack (B) | shared | tensor-core instr. | compile s |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _sort_key(row: Dict[str, Any]):
    return (KERNEL_ORDER.index(row["kernel"]), row["arch"], row["dtype"], row["E"], MODE_ORDER.index(row["mode"]),
            -row["L"], -row["BLOCK_M"], -row["BLOCK_N"], -row["num_warps"], -row["num_stages"])


def write_markdown(path: Path, meta: Dict[str, Any], rows: List[Dict[str, Any]],
                   missing: List[Dict[str, Any]]) -> None:
    fav = favoured(rows)
    lines = [
        "# Triton kernels as the GPU sees them (compiled on a CPU)",
        "",
        f"Made by `{meta['command']}` on {meta['date']} (triton {meta['triton']}, {meta['machine']}; "
        f"kernels {meta['kernels_fingerprint']}, candidates {meta['candidates_fingerprint']}).",
        f"Launch specialised as: {meta['launch']}. Bytes are per thread; shared memory per block; "
        "`(too much)`: more shared memory than the architecture gives one block (such a config cannot launch).",
        "Tensor-core instructions are counted in the SASS: HGMMA (sm_90 warpgroup MMA), HMMA (sm_75/sm_80 warp "
        "MMA). float32 dots are IEEE (`input_precision=\"ieee\"`), so they use no tensor cores by design.",
        "",
    ]
    spill = [r for r in rows if not r.get("error") and r["spill_stores"] + r["spill_loads"] > 0]
    lines += ["## Every row that spills", "",
              f"{len(spill)} rows spill registers to local memory"
              + (" (on sm_80 / sm_90: " + str(sum(r["arch"] >= 80 for r in spill)) + ")." if spill else "."), ""]
    if spill:
        lines += [HEADER] + [_fmt(r) for r in sorted(spill, key=_sort_key)] + [""]
    if fav:
        lines += ["## The configs the autotuner is expected to favour", "", HEADER]
        lines += [_fmt(r) for r in sorted(fav, key=_sort_key)]
        lines += [""]
    if missing:
        lines += [f"## Not compiled ({len(missing)} of {len(rows) + len(missing)})", "",
                  "The sweep stopped at its time limit before these; `make gpu-sweep` compiles them.", "",
                  "| kernel | arch | dtype | E | mode | L = S | config |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {j['kernel']} | sm_{j['arch']} | {j['dtype']} | {j['E']} | {j['mode']} | {j['L']} | "
                  f"{j['BLOCK_M']}x{j['BLOCK_N']} w{j['num_warps']} s{j['num_stages']} |"
                  for j in sorted(missing, key=_sort_key)] + [""]
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
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 80, 128])
    p.add_argument("--modes", nargs="+", default=list(MODE_ORDER), choices=list(MODE_ORDER))
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="L = S values")
    p.add_argument("--kernels", nargs="+", default=list(KERNEL_ORDER), choices=list(KERNEL_ORDER))
    p.add_argument("--jobs", type=int, default=2, help="compiling processes (at most 2 on this machine)")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and the markdown table")
    p.add_argument("--name", default="triton_resources", help="file name stem")
    p.add_argument("--no-package-copy", action="store_true", help="do not update the package's copy")
    p.add_argument("--favoured-only", action="store_true", help="only the config each kernel is expected to favour")
    p.add_argument("--max-minutes", type=float, default=None, help="stop compiling after this long and write the "
                   "report with the rows not compiled listed in it (0: only what the cache holds)")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="compiled rows, reused while the kernels "
                   "are unchanged (--cache '' to compile everything)")
    args = p.parse_args(argv)

    import triton

    from attention_core.backends.triton_inspect import candidates_fingerprint, kernels_fingerprint

    cache = Path(args.cache) if args.cache else None
    fingerprint = kernels_fingerprint()
    jobs = _jobs(args.archs, args.dtypes, args.head_dims, args.modes, args.kernels, args.lengths)
    if args.favoured_only:
        jobs = favoured(jobs)
    cached: Dict[str, Dict[str, Any]] = {}
    if cache is not None and cache.is_file():
        for line in cache.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # a line another sweep is writing right now
                continue
            cached[entry["key"]] = entry["row"]
    # the launch shapes most likely to spill first (ragged lengths, then sm_80), so a cut-short sweep has them
    todo = sorted((j for j in jobs if _job_key(j, fingerprint) not in cached),
                  key=lambda j: (j["L"] == max(args.lengths), j["arch"], j["E"] == 64, j["dtype"] == "float32"))
    print(f"{len(jobs)} rows, {len(jobs) - len(todo)} cached, {len(todo)} to compile on {args.jobs} processes",
          flush=True)
    start = time.perf_counter()
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
    deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    if todo and (deadline is None or args.max_minutes > 0):
        with ProcessPoolExecutor(max_workers=max(1, min(args.jobs, 2))) as pool:
            futures = {pool.submit(_run, job): job for job in todo}
            try:
                for i, future in enumerate(as_completed(futures, timeout=None if deadline is None
                                                        else max(1.0, deadline - time.time())), 1):
                    job, row = futures[future], future.result()
                    cached[_job_key(job, fingerprint)] = row
                    if cache is not None and not row.get("error"):
                        with cache.open("a") as f:
                            f.write(json.dumps({"key": _job_key(job, fingerprint), "row": row}) + "\n")
                    if i % 20 == 0 or i == len(todo):
                        print(f"  {i}/{len(todo)} ({time.perf_counter() - start:.0f} s)", flush=True)
            except FuturesTimeout:
                print(f"time limit: {args.max_minutes} minutes; the rest is listed as not compiled", flush=True)
                pool.shutdown(wait=False, cancel_futures=True)
    rows = [cached[_job_key(j, fingerprint)] for j in jobs if _job_key(j, fingerprint) in cached]
    missing = [j for j in jobs if _job_key(j, fingerprint) not in cached]
    meta = {
        "command": "python benchmarks/triton_resources.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "triton": triton.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, no GPU",
        "launch": (f"contiguous (B, H, N, E) tensors, B=4, Hq=16, H=16, L = S in {args.lengths}, modes "
                   f"{args.modes} (window: causal, {WINDOW} keys); the innermost stride is the constant 1"),
        "kernels_fingerprint": fingerprint,
        "candidates_fingerprint": candidates_fingerprint(),
        "compile_s_total": round(sum(r.get("compile_s") or 0 for r in rows), 1),
        "scope": {"archs": args.archs, "dtypes": args.dtypes, "head_dims": args.head_dims, "modes": args.modes,
                  "lengths": args.lengths, "kernels": args.kernels},
        "compiled": len(rows),
        "not_compiled": len(missing),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    rows.sort(key=_sort_key)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows, "not_compiled": missing},
                                                           indent=1) + "\n")
    write_markdown(args.out / f"{args.name}.md", meta, rows, missing)
    fav = favoured(rows)
    if fav and not args.no_package_copy:
        from attention_core.backends.triton_configs import RAGGED_SPILLS, RAGGED_UNAVOIDABLE, bucket, kind

        def withheld(r: Dict[str, Any]) -> bool:  # never offered to the autotuner at this launch
            shape = (r["BLOCK_M"], r["BLOCK_N"], r["num_warps"], r["num_stages"])
            ragged = r["kernel"] != "preprocess" and bool(r["L"] % r["BLOCK_M"] or r["L"] % r["BLOCK_N"])
            key = (r["kernel"], kind(r["dtype"], r["arch"]), bucket(r["E"]))
            return (ragged and r["arch"] in RAGGED_SPILLS.get((*key, shape), ())
                    and r["arch"] not in RAGGED_UNAVOIDABLE.get(key, ()))

        def unavoidable(r: Dict[str, Any]) -> bool:  # every candidate of its list spills at a ragged launch
            key = (r["kernel"], kind(r["dtype"], r["arch"]), bucket(r["E"]))
            return r["arch"] in RAGGED_UNAVOIDABLE.get(key, ())

        spilling = [dict(r, withheld=withheld(r), unavoidable=unavoidable(r)) for r in rows
                    if not r.get("error") and r["spill_stores"] + r["spill_loads"] > 0]
        PACKAGE_COPY.write_text(json.dumps({"meta": meta, "rows": sorted(fav, key=_sort_key),
                                            "not_compiled": len(missing),
                                            "spilling": sorted(spilling, key=_sort_key)}, indent=1) + "\n")
    print(f"wrote {args.out / args.name}.json and .md ({meta['wall_s']} s)")


if __name__ == "__main__":
    main()
