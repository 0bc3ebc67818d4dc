"""``chunked`` against PyTorch's own CPU flash-attention kernel: forward, and forward + backward.

The question this script answers: how close does the book's FlashAttention in plain PyTorch
(``attention_core.backends.chunked``) come to ATen's C++ kernel (``F.scaled_dot_product_attention`` on the
CPU), in float32, B = 1, H = 8, E = 64, causal and not, with 1 and with 2 torch threads?

How it measures (see ``benchmarks/NOTES.md``):

- Inputs are always 4-D (B, H, L, E): SDPA on 3-D inputs silently takes its slow math path, which would
  flatter any competitor. Random normal data, never zeros.
- Every point is timed in **interleaved rounds**: one call of each provider in turn (chunked, torch,
  chunked, torch, ...), after one warm-up call each, for ``--rounds`` rounds. The figure is each provider's
  median, and the ratio is torch's median over chunked's (1.0 = as fast, 0.85 = 15% slower). On a machine
  shared with other jobs, a change of load hits both providers alike, so the ratio holds while the absolute
  times drift. The load average before and after each point is stored beside it.
- ``fwd``: one call under ``torch.no_grad()``. ``fwd+bwd``: forward, then ``.backward(grad_out)``, through
  chunked's own autograd Function and through SDPA's autograd (ATen's flash-attention backward).
- ``--baseline REV`` adds a provider ``chunked@REV``: ``attention_core/backends/chunked.py`` as it was at git
  revision REV, loaded beside today's, so a before/after comparison is interleaved too.
- The JSON names the CPU (model, cache sizes, logical CPUs), the ATen CPU capability torch dispatched to
  (``torch.backends.cpu.get_cpu_capability()``; ``ATEN_CPU_CAPABILITY=avx2`` or ``default`` in the
  environment lowers it), the torch version and the load average.
- ``--memory`` also measures the peak extra memory of one forward call of ``chunked`` and of the naive
  backend at L = 8192 (each in a fresh process; ``bench_attention.cpu_peak_in_child``).

Example (the committed run)::

    python benchmarks/bench_chunked_cpu.py --threads 1 2 --rounds 9 --memory

writes ``benchmarks/results/cpu_flash_<cpu>_<capability>.json`` and a ``.png`` beside it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "benchmarks"))

from _machine import blas, cache_sizes, cpu_isa, cpu_model, cpu_vendor, machine_line, save_figure  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TARGET = 0.9  # the target (issue 44; 0.85 before it): chunked at least 0.9x the speed of torch SDPA

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------------------- providers


def load_chunked(rev: Optional[str]):
    """Today's chunked module, or the one at git revision ``rev`` loaded as a separate module."""
    from attention_core.backends import chunked

    if rev is None:
        return chunked
    source = subprocess.run(["git", "show", f"{rev}:attention_core/backends/chunked.py"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / f"chunked_{re.sub(r'[^A-Za-z0-9]', '_', rev)}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _chunked_call(module, causal: bool) -> Attention:
    """``fn(q, k, v)`` for a chunked module of any revision: ``chunked_attention`` now, ``attention`` before."""
    scale = lambda q: q.shape[-1] ** -0.5  # noqa: E731
    if hasattr(module, "chunked_attention"):
        return lambda q, k, v: module.chunked_attention(q, k, v, None, causal, scale(q), False)
    return lambda q, k, v: module.attention(q, k, v, None, 0.0, causal, scale(q), False)


def providers(baseline: Optional[str], causal: bool) -> Dict[str, Attention]:
    """name -> fn(q, k, v) for chunked (today's and, if asked, the baseline revision's) and torch SDPA."""
    fns: Dict[str, Attention] = {}
    for name, rev in (("chunked", None), (f"chunked@{baseline}", baseline)):
        if name == "chunked" or baseline:
            module = load_chunked(rev)
            fns[name] = _chunked_call(module, causal)
    fns["torch"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return fns


def make_call(fn: Attention, mode: str, B: int, H: int, L: int, E: int) -> Callable[[], None]:
    """A no-argument call of one provider on its own fresh 4-D inputs (B, H, L, E)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E, generator=g) for _ in range(3))  # (B, H, L, E) each, float32
    if mode == "fwd":
        def fwd() -> None:
            with torch.no_grad():
                fn(q, k, v)
        return fwd
    for t in (q, k, v):
        t.requires_grad_(True)
    grad_out = torch.randn(B, H, L, E, generator=g)  # (B, H, L, E)

    def fwd_bwd() -> None:
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(grad_out)
    return fwd_bwd


def interleaved(calls: Dict[str, Callable[[], None]], rounds: int):
    """Wall and CPU milliseconds of ``rounds`` calls of each provider, round-robin, after one warm-up each.

    CPU time (``time.process_time``, all of this process's threads) is the cross-check for a loaded machine:
    with one thread it counts only the time the call actually ran, not the time it waited for a core.
    """
    for call in calls.values():
        call()
    wall: Dict[str, List[float]] = {name: [] for name in calls}
    cpu: Dict[str, List[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t0, c0 = time.perf_counter(), time.process_time()
            call()
            wall[name].append((time.perf_counter() - t0) * 1e3)
            cpu[name].append((time.process_time() - c0) * 1e3)
    return wall, cpu


# ------------------------------------------------------------------------------------------ the machine


def git_revision() -> str:
    """The checkout's commit, with ``+changes`` when chunked.py differs from it."""
    run = lambda *cmd: subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    rev = run("git", "rev-parse", "--short", "HEAD") or "unknown"
    return rev + ("+changes" if run("git", "status", "--porcelain", "attention_core/backends/chunked.py") else "")


def machine() -> dict:
    return {
        "cpu_vendor": cpu_vendor(),
        "isa": cpu_isa(),
        "blas": blas(),
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "caches": cache_sizes(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "ATEN_CPU_CAPABILITY_env": os.environ.get("ATEN_CPU_CAPABILITY"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "mkl": torch.backends.mkl.is_available(),
    }


# ---------------------------------------------------------------------------------------------- report


def plot(points: List[dict], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(p["mode"], p["threads"]) for p in points}, key=lambda x: (x[0] != "fwd", x[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4), squeeze=False)
    for ax, (mode, threads) in zip(axes[0], panels):
        names = sorted({n for p in points for n in p["speed_vs_torch"]})
        for causal, style in ((False, "o-"), (True, "s--")):
            for color, name in enumerate(names):
                mine = sorted((p for p in points if (p["mode"], p["threads"], p["causal"]) == (mode, threads, causal)
                               and name in p["speed_vs_torch"]), key=lambda p: p["L"])
                if mine:
                    ax.plot([p["L"] for p in mine], [p["speed_vs_torch"][name] for p in mine], style,
                            color=f"C{color}", label=f"{name}{', causal' if causal else ''}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(TARGET, color="r", lw=0.8, ls=":", label=f"target {TARGET}")
        ax.set(xscale="log", xlabel="L (= S)", ylabel="speed vs torch SDPA (torch ms / ms)",
               title=f"{mode}, {threads} thread{'s' if threads > 1 else ''}")
        lengths = sorted({p["L"] for p in points if p["mode"] == mode})
        ax.set_xticks(lengths, [str(L) for L in lengths])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, path, f"{machine_line(meta['machine'])} | fp32 B=1 H=8 E=64 | {meta['date'][:10]} | load "
                f"average {meta['loadavg_start'][0]:.1f} -> {meta['loadavg_end'][0]:.1f}")


def memory_check(L: int) -> dict:
    """Peak extra MiB of one forward call of chunked and of naive at length L, each in a fresh process."""
    from bench_attention import Config, cpu_peak_in_child

    peaks = {p: cpu_peak_in_child(Config(p, "fwd", 1, 8, L, 64, "float32", False)) for p in ("chunked", "naive")}
    ratio = peaks["chunked"] / peaks["naive"] if peaks["chunked"] is not None and peaks["naive"] else None
    return {"L": L, "peak_extra_mib": peaks, "chunked_over_naive": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds per point (>= 7 advised)")
    parser.add_argument("--fwd-lengths", nargs="*", type=int, default=[1024, 2048, 4096])
    parser.add_argument("--bwd-lengths", nargs="*", type=int, default=[1024, 2048])
    parser.add_argument("--causal", nargs="+", choices=["false", "true"], default=["false", "true"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--baseline", help="git revision whose chunked.py runs beside today's")
    parser.add_argument("--memory", action="store_true", help="also measure peak memory at L = 8192")
    parser.add_argument("--out", type=Path, help="JSON path (default: benchmarks/results/cpu_flash_<cpu>.json)")
    args = parser.parse_args()

    meta = {
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/bench_chunked_cpu.py " + " ".join(sys.argv[1:]),
        "workload": f"float32, B=1, H={args.heads}, E={args.head_dim}, S=L, 4-D inputs",
        "timing": f"median of {args.rounds} interleaved rounds (one call per provider per round, round-robin) "
                  "after one warm-up call each; time.perf_counter",
        "ratio": "speed_vs_torch = torch median ms / provider median ms (1.0 = as fast as torch SDPA); "
                 "cpu_speed_vs_torch: the same from process CPU time (a cross-check under load; with 2 threads "
                 "it also counts the OpenMP threads' spinning)",
        "loadavg_start": os.getloadavg(),
        "chunked_revision": git_revision(),
    }
    print(f"{meta['machine']['cpu_model']}, {meta['machine']['logical_cpus']} logical CPUs, caches "
          f"{meta['machine']['caches']}, ATen capability {meta['machine']['aten_cpu_capability']}, "
          f"BLAS {meta['machine']['blas']}, ISA {' '.join(meta['machine']['isa'])}, "
          f"torch {meta['machine']['torch']}, load average {meta['loadavg_start'][0]:.2f}", flush=True)

    points = []
    causals = [c == "true" for c in args.causal]
    jobs = [("fwd", L) for L in args.fwd_lengths] + [("fwd+bwd", L) for L in args.bwd_lengths]
    for threads in args.threads:
        torch.set_num_threads(threads)
        for mode, L in jobs:
            for causal in causals:
                fns = providers(args.baseline, causal)
                calls = {name: make_call(fn, mode, 1, args.heads, L, args.head_dim) for name, fn in fns.items()}
                load0 = os.getloadavg()[0]
                times, cpu = interleaved(calls, args.rounds)
                med = {name: statistics.median(ts) for name, ts in times.items()}
                med_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
                point = {"threads": threads, "mode": mode, "causal": causal, "L": L, "rounds": args.rounds,
                         "median_ms": med, "times_ms": times, "median_cpu_ms": med_cpu,
                         "speed_vs_torch": {n: med["torch"] / m for n, m in med.items() if n != "torch"},
                         "cpu_speed_vs_torch": {n: med_cpu["torch"] / m for n, m in med_cpu.items() if n != "torch"},
                         "loadavg": [load0, os.getloadavg()[0]]}
                points.append(point)
                shown = "  ".join(f"{n} {m:8.1f} ms" for n, m in med.items())
                ratios = "  ".join(f"{n} {r:.3f}x" for n, r in point["speed_vs_torch"].items())
                cpu_ratios = " ".join(f"{r:.3f}x" for r in point["cpu_speed_vs_torch"].values())
                print(f"threads={threads} {mode:7s} causal={causal!s:5s} L={L:<5d} {shown}  | {ratios}  "
                      f"(cpu time: {cpu_ratios}; load {load0:.2f})", flush=True)
    meta["loadavg_end"] = os.getloadavg()

    targets = []  # the targets are for one thread; two threads are reported beside them, not checked
    for threads in [t for t in args.threads if t == 1]:
        for mode, L in (("fwd", 4096), ("fwd+bwd", 2048)):
            for causal in causals:
                p = next((p for p in points if (p["threads"], p["mode"], p["L"], p["causal"]) ==
                          (threads, mode, L, causal)), None)
                if p:
                    r = p["speed_vs_torch"]["chunked"]
                    targets.append({"threads": threads, "mode": mode, "L": L, "causal": causal,
                                    "target": f"chunked >= {TARGET}x torch SDPA", "value": round(r, 3),
                                    "met": r >= TARGET})
    memory = memory_check(8192) if args.memory else None

    names = list(points[0]["speed_vs_torch"])
    print(f"\nspeed vs torch SDPA (wall-time medians; CPU-time medians in brackets)\n"
          f"{'threads':>7s} {'mode':8s} {'causal':6s} {'L':>5s}  " + "  ".join(f"{n:>22s}" for n in names))
    for p in points:
        print(f"{p['threads']:7d} {p['mode']:8s} {p['causal']!s:6s} {p['L']:5d}  " +
              "  ".join(f"{p['speed_vs_torch'][n]:13.3f}x ({p['cpu_speed_vs_torch'][n]:.3f}x)" for n in names))
    for t in targets:
        print(f"target {'MET ' if t['met'] else 'MISS'} {t['threads']} thread(s) {t['mode']:7s} L={t['L']} "
              f"causal={t['causal']!s:5s}: {t['value']:.3f} (>= {TARGET})")
    if memory:
        print(f"memory at L={memory['L']}: {memory['peak_extra_mib']} MiB, chunked/naive = "
              f"{memory['chunked_over_naive']}")

    cap = meta["machine"]["aten_cpu_capability"].lower()
    slug = re.sub(r"[^a-z0-9]+", "_", meta["machine"]["cpu_model"].lower()).strip("_")
    out = args.out or RESULTS / f"cpu_flash_{slug}_{cap}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "targets": targets, "memory": memory, "points": points},
                              indent=1) + "\n")
    plot(points, meta, out.with_suffix(".png"))
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} and its .png")


if __name__ == "__main__":
    main()
