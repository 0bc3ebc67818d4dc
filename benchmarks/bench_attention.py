"""Speed and memory of every attention implementation, measured in one run, compared with torch SDPA.

Two modes:

- ``--device cpu`` (runs anywhere): float32, B=1, H=8, E=64, L in {512 .. 8192}; naive (the eager
  ``reference`` backend, which materialises the (L, S) scores), ``chunked`` (online softmax in torch) and
  torch's SDPA. Times are medians of ``time.perf_counter`` over repeats after a warm-up; the peak *extra*
  memory of one call is measured in a fresh child process: the kernel's high-water mark of resident memory
  is reset (``/proc/self/clear_refs``) after the inputs exist, the call runs, and VmHWM - VmRSS is read
  back. That counts what the call really allocates (output included), not what a formula says it should.
- ``--device cuda``: fp16 and bf16, L = 512 .. 16384, E = 64 and 128, causal and not; naive, chunked,
  ``triton``, ``cuda`` (forward only) and torch SDPA with each of its backends pinned (flash,
  efficient, cudnn, math) plus its default choice. Times are medians of ``triton.testing.do_bench``
  (CUDA events; it flushes L2 between runs); peak memory from ``torch.cuda.max_memory_allocated`` minus what
  was allocated before the call.

FLOPs: forward ``4 * B * H * L * S * E`` (two matmuls), halved when causal; forward + backward = 3.5x the
forward (the backward does 2.5 forward-sized matmul pairs: dV, dP, dQ, dK, and the recomputed scores).
On a GPU the run also times one large matmul per dtype (the chip's ceiling as this run sees it) and
stores each point's fraction of it.

Every figure goes to ``benchmarks/results/<device>.json`` with the device name, versions and date, and a
plot to ``<device>.png``; the table printed last gives each time as a ratio against torch SDPA measured in
the same run, and (CPU mode) checks the issue's targets. Examples::

    python benchmarks/bench_attention.py --device cpu
    python benchmarks/bench_attention.py --device cuda --lengths 1024 4096 --head-dims 64
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "benchmarks"))

from _machine import describe, save_figure  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CPU_PROVIDERS = ["naive", "chunked", "torch"]
GPU_PROVIDERS = ["naive", "chunked", "triton", "cuda", "torch", "torch-flash", "torch-efficient",
                 "torch-cudnn", "torch-math"]
_SDPA_PINNED = {"torch-flash": "FLASH_ATTENTION", "torch-efficient": "EFFICIENT_ATTENTION",
                "torch-cudnn": "CUDNN_ATTENTION", "torch-math": "MATH"}


@dataclass
class Config:
    """One measured point."""

    provider: str
    mode: str  # "fwd" or "fwd+bwd"
    B: int
    H: int
    L: int
    E: int
    dtype: str
    causal: bool
    median_ms: Optional[float] = None
    times_ms: List[float] = field(default_factory=list)
    tflops: Optional[float] = None
    peak_extra_mib: Optional[float] = None
    note: str = ""


# ------------------------------------------------------------------------------------------- providers


Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_fn(provider: str, causal: bool) -> Attention:
    """``fn(q, k, v) -> out`` for one provider; raises ``RuntimeError`` if it cannot run these inputs."""
    import torch.nn.functional as F

    if provider == "naive":
        from attention_core.backends import reference

        return lambda q, k, v: reference.attention(q, k, v, None, 0.0, causal, q.shape[-1] ** -0.5, False)
    if provider == "chunked":
        from attention_core.backends import chunked

        return lambda q, k, v: chunked.chunked_attention(q, k, v, None, causal, q.shape[-1] ** -0.5, False)
    if provider == "triton":
        from attention_core.backends import triton_flash

        return lambda q, k, v: triton_flash.flash_attention(q, k, v, is_causal=causal)
    if provider == "cuda":
        from attention_core.backends import cuda_flash

        return lambda q, k, v: cuda_flash.flash_attention(q, k, v, is_causal=causal)
    if provider == "torch":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if provider in _SDPA_PINNED:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, _SDPA_PINNED[provider])

        def pinned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return pinned
    raise ValueError(f"unknown provider {provider!r}")


def flops(c: Config) -> float:
    """Useful floating-point operations of one call (see the module docstring)."""
    fwd = 4.0 * c.B * c.H * c.L * c.L * c.E * (0.5 if c.causal else 1.0)
    return fwd * (3.5 if c.mode == "fwd+bwd" else 1.0)


def make_inputs(c: Config, device: str, seed: int = 0) -> List[torch.Tensor]:
    """Fresh random q, k, v (never zeros: they can run faster than real data), grads on for fwd+bwd."""
    g = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, c.dtype)
    return [torch.randn(c.B, c.H, c.L, c.E, generator=g, device=device, dtype=dtype)
            .requires_grad_(c.mode == "fwd+bwd") for _ in range(3)]


def make_call(c: Config, device: str) -> Callable[[], object]:
    fn = attention_fn(c.provider, c.causal)
    q, k, v = make_inputs(c, device)
    if c.mode == "fwd":
        def call() -> object:
            with torch.no_grad():
                return fn(q, k, v)
        return call
    grad_out = torch.randn_like(q)

    def call_bwd() -> object:
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(grad_out)
        return None
    return call_bwd


# ---------------------------------------------------------------------------------------------- timing


def time_cpu_interleaved(calls: Dict[str, Callable[[], object]], min_repeats: int = 5, max_repeats: int = 21,
                         budget_s: float = 12.0) -> Dict[str, List[float]]:
    """Milliseconds of each repeat of every call, taken round-robin after one warm-up each.

    Round-robin (naive, chunked, torch, naive, ...) rather than one provider after the other: when the
    machine's load changes during the run, it changes for all providers alike, so the ratios between their
    medians stay meaningful. At least ``min_repeats`` rounds, more while under ``budget_s``.
    """
    for call in calls.values():
        call()
    times: Dict[str, List[float]] = {name: [] for name in calls}
    spent = 0.0
    while True:
        rounds = len(next(iter(times.values())))
        if rounds >= max_repeats or (rounds >= min_repeats and spent > budget_s):
            return times
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            dt = time.perf_counter() - t0
            times[name].append(dt * 1e3)
            spent += dt


def time_gpu(call: Callable[[], object]) -> List[float]:
    """Median milliseconds from triton.testing.do_bench (CUDA events, L2 flushed, warm-up excluded)."""
    from triton.testing import do_bench

    call()  # compile and autotune outside the timed region (do_bench sizes its loop from a first run)
    torch.cuda.synchronize()
    return [float(do_bench(call, warmup=25, rep=100, return_mode="median"))]


# ---------------------------------------------------------------------------------------------- memory


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field_name}:\s+(\d+)", f.read()).group(1))


def cpu_peak_probe(c: Config) -> float:
    """In this (fresh) process: MiB of resident memory one call adds at its peak, output included."""
    torch.manual_seed(0)
    call = make_call(c, "cpu")  # inputs allocated here, before the baseline
    with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current VmRSS (Linux >= 4.0)
        f.write("5")
    before = _status_kib("VmRSS")
    result = call()
    peak = _status_kib("VmHWM")
    del result
    return (peak - before) / 1024


def cpu_peak_in_child(c: Config) -> Optional[float]:
    """:func:`cpu_peak_probe` in a fresh interpreter: nothing done earlier in this one can hide the peak."""
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    proc = subprocess.run(
        [sys.executable, __file__, "--probe", json.dumps(asdict(c)),
         "--threads", str(torch.get_num_threads())],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    if proc.returncode != 0:
        print(f"  memory probe failed, {c.provider} L={c.L}: {proc.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return float(proc.stdout.strip().splitlines()[-1])


def matmul_peak_tflops(dtype: str, n: int = 8192) -> float:
    """The chip's matmul ceiling as this run sees it: an (n, n) @ (n, n) product of random data, TFLOP/s."""
    a, b = (torch.randn(n, n, device="cuda", dtype=getattr(torch, dtype)) for _ in range(2))
    ms = time_gpu(lambda: a @ b)[0]
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def gpu_peak(call: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak / 2**20


# ------------------------------------------------------------------------------------------------- run


def _failed(c: Config, err: Exception) -> None:
    c.note = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"


def measure(c: Config, device: str) -> Config:
    """One GPU point: peak memory, then the median time (CUDA events)."""
    try:
        call = make_call(c, device)
        c.peak_extra_mib = gpu_peak(call)
        c.times_ms = time_gpu(call)
        c.median_ms = statistics.median(c.times_ms)
        c.tflops = flops(c) / (c.median_ms * 1e-3) / 1e12
    except (RuntimeError, ValueError, TypeError) as err:  # unsupported inputs, OOM, no kernel available
        _failed(c, err)
        torch.cuda.empty_cache()
    return c


def measure_cpu_group(configs: List[Config]) -> List[Config]:
    """CPU points that differ only in the provider: timed round-robin, then each one's memory in a child."""
    calls: Dict[str, Callable[[], object]] = {}
    for c in configs:
        try:
            calls[c.provider] = make_call(c, "cpu")
        except (RuntimeError, ValueError, TypeError) as err:
            _failed(c, err)
    times = time_cpu_interleaved(calls) if calls else {}
    calls.clear()  # free the inputs before the memory probes
    for c in configs:
        if c.provider in times:
            c.times_ms = times[c.provider]
            c.median_ms = statistics.median(c.times_ms)
            c.tflops = flops(c) / (c.median_ms * 1e-3) / 1e12
            if c.mode == "fwd":
                c.peak_extra_mib = cpu_peak_in_child(c)
    return configs


def device_name(device: str) -> str:
    return describe(device)


def versions() -> Dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "not installed"
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    return out


def ratios(results: List[Config]) -> None:
    """Attach to each note the speed ratio against torch SDPA (default dispatch) at the same point."""
    base = {(c.mode, c.L, c.E, c.dtype, c.causal): c.median_ms for c in results if c.provider == "torch"}
    for c in results:
        t = base.get((c.mode, c.L, c.E, c.dtype, c.causal))
        c.__dict__["speed_vs_torch"] = (t / c.median_ms) if (t and c.median_ms) else None


def print_table(results: List[Config]) -> None:
    print(f"\n{'provider':16s} {'mode':8s} {'dtype':8s} {'E':>4s} {'causal':>6s} {'L':>6s} "
          f"{'median ms':>10s} {'TFLOP/s':>8s} {'x torch':>8s} {'peak MiB':>9s}  note")
    for c in results:
        ms = f"{c.median_ms:10.2f}" if c.median_ms else f"{'-':>10s}"
        tf = f"{c.tflops:8.3f}" if c.tflops else f"{'-':>8s}"
        rt = c.__dict__.get("speed_vs_torch")
        rt = f"{rt:8.2f}" if rt else f"{'-':>8s}"
        mem = f"{c.peak_extra_mib:9.1f}" if c.peak_extra_mib is not None else f"{'-':>9s}"
        print(f"{c.provider:16s} {c.mode:8s} {c.dtype:8s} {c.E:4d} {str(c.causal):>6s} {c.L:6d} "
              f"{ms} {tf} {rt} {mem}  {c.note[:60]}")


def check_cpu_targets(results: List[Config]) -> List[dict]:
    """The issue's CPU targets (fp32, B=1, H=8, E=64, forward), from this run's numbers."""
    def get(provider: str, L: int, causal: bool = False) -> Optional[Config]:
        for c in results:
            if (c.provider, c.L, c.causal, c.mode, c.E, c.H, c.B) == (provider, L, causal, "fwd", 64, 8, 1):
                return c
        return None

    checks = []
    ch, tt = get("chunked", 4096), get("torch", 4096)
    if ch and tt and ch.median_ms and tt.median_ms:  # fwd+bwd and 2 threads: bench_chunked_cpu.py
        r = tt.median_ms / ch.median_ms
        checks.append({"target": "chunked speed >= 0.85x torch SDPA at L=4096", "value": round(r, 3),
                       "met": r >= 0.85})
    for L in sorted({c.L for c in results if c.L >= 2048}):
        ch, nv = get("chunked", L), get("naive", L)
        if ch and nv and ch.median_ms and nv.median_ms:
            r = nv.median_ms / ch.median_ms
            checks.append({"target": f"chunked speed >= 2x naive at L={L}", "value": round(r, 3),
                           "met": r >= 2})
    ch, nv = get("chunked", 8192), get("naive", 8192)
    if ch and nv and ch.peak_extra_mib is not None and nv.peak_extra_mib:
        r = ch.peak_extra_mib / nv.peak_extra_mib
        checks.append({"target": "chunked peak extra memory <= 5% of naive's at L=8192", "value": round(r, 4),
                       "met": r <= 0.05})
    return checks


def plot(results: List[Config], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(c.mode, c.dtype, c.E, c.causal) for c in results})
    fig, axes = plt.subplots(len(groups), 2, figsize=(11, 3.2 * len(groups)), squeeze=False)
    for row, (mode, dtype, E, causal) in enumerate(groups):
        pts = [c for c in results if (c.mode, c.dtype, c.E, c.causal) == (mode, dtype, E, causal)]
        for provider in dict.fromkeys(c.provider for c in pts):
            mine = sorted((c for c in pts if c.provider == provider), key=lambda c: c.L)
            xs = [c.L for c in mine if c.tflops]
            axes[row, 0].plot(xs, [c.tflops for c in mine if c.tflops], marker="o", label=provider)
            xm = [c.L for c in mine if c.peak_extra_mib is not None]
            if xm:
                axes[row, 1].plot(xm, [c.peak_extra_mib for c in mine if c.peak_extra_mib is not None],
                                  marker="o", label=provider)
        label = f"{mode}, {dtype}, E={E}, {'causal' if causal else 'full'}"
        axes[row, 0].set(xscale="log", yscale="log", xlabel="L (= S)", ylabel="TFLOP/s", title=label)
        axes[row, 1].set(xscale="log", yscale="log", xlabel="L (= S)", ylabel="peak extra memory (MiB)",
                         title=label)
        for ax in axes[row]:
            ax.grid(True, which="both", alpha=0.3)
        axes[row, 0].legend(fontsize=8)
    save_figure(fig, path, title, fontsize=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=["cpu", "cuda"], default=default_device)
    parser.add_argument("--providers", nargs="+")
    parser.add_argument("--lengths", nargs="+", type=int)
    parser.add_argument("--head-dims", nargs="+", type=int)
    parser.add_argument("--dtypes", nargs="+")
    parser.add_argument("--modes", nargs="+", choices=["fwd", "fwd+bwd"])
    parser.add_argument("--causal", nargs="+", choices=["false", "true"])
    parser.add_argument("--batch", type=int)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, help="JSON path; the plot goes beside it (.png)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # internal: memory probe in a child process
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        print(cpu_peak_probe(Config(**json.loads(args.probe))))
        return
    cpu = args.device == "cpu"
    providers = args.providers or (CPU_PROVIDERS if cpu else GPU_PROVIDERS)
    lengths = args.lengths or ([512, 1024, 2048, 4096, 8192] if cpu else [512, 1024, 2048, 4096, 8192, 16384])
    head_dims = args.head_dims or ([64] if cpu else [64, 128])
    dtypes = args.dtypes or (["float32"] if cpu else ["float16", "bfloat16"])
    modes = args.modes or (["fwd"] if cpu else ["fwd", "fwd+bwd"])
    causals = [c == "true" for c in (args.causal or ["false", "true"])]
    batch = args.batch or (1 if cpu else 4)

    results: List[Config] = []
    for mode, dtype, E, causal, L in itertools.product(modes, dtypes, head_dims, causals, lengths):
        group = [Config(p, mode, batch, args.heads, L, E, dtype, causal) for p in providers
                 if not (p == "cuda" and mode == "fwd+bwd")]  # cuda's backward is the reference's
        group = measure_cpu_group(group) if cpu else [measure(c, args.device) for c in group]
        results.extend(group)
        for c in group:
            shown = f"{c.median_ms:.2f} ms" if c.median_ms else c.note
            print(f"{c.provider:16s} {mode:8s} {dtype:8s} E={E:<4d} causal={causal!s:5s} L={L:<6d} {shown}",
                  flush=True)
    ratios(results)
    peaks = {}
    if not cpu:  # the fraction of the measured matmul ceiling, per dtype (the issue asks for it)
        peaks = {dtype: matmul_peak_tflops(dtype) for dtype in dtypes}
        for c in results:
            c.__dict__["fraction_of_matmul_peak"] = (c.tflops / peaks[c.dtype]) if c.tflops else None
        print("measured matmul peak (TFLOP/s):", {k: round(v, 1) for k, v in peaks.items()})
    print_table(results)
    targets = check_cpu_targets(results) if cpu else []
    for t in targets:
        print(f"target {'MET ' if t['met'] else 'MISS'}  {t['target']}: {t['value']}")

    name = device_name(args.device)
    slug = "cpu_" + "_".join(dtypes) if cpu else re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    out = args.out or RESULTS / f"{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": name, "device_kind": args.device, "versions": versions(),
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/bench_attention.py " + " ".join(sys.argv[1:]),
        "timing": "median of time.perf_counter repeats after a warm-up, providers interleaved round-robin" if cpu
        else
        "triton.testing.do_bench median (CUDA events, L2 flushed)",
        "memory": "VmHWM - VmRSS of one call in a fresh process (clear_refs reset)" if cpu else
        "torch.cuda.max_memory_allocated - memory_allocated before the call",
        "flops": "fwd 4*B*H*L*S*E (x0.5 causal); fwd+bwd 3.5x fwd",
        "matmul_peak_tflops": peaks,
    }
    out.write_text(json.dumps({"meta": meta, "targets": targets,
                               "results": [c.__dict__ for c in results]}, indent=1) + "\n")
    plot(results, out.with_suffix(".png"), f"{name} | torch {meta['versions']['torch']} | {meta['date']}")
    print(f"\nwrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out} and its .png")


if __name__ == "__main__":
    main()
