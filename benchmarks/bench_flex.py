"""Tile skipping on a CPU: ``flex_attention`` (chunked backend, a block mask) against dense masks.

The question: when the mask is sparse, how much of the dense cost does a block mask save, on one CPU thread,
in float32, B = 1, H = 4, E = 64, at L = S = 4,096, 8,192 and 16,384?

Masks (each as a ``mask_mod``, :mod:`attention_core.mask_mods`):

- ``sinks_window``: StreamingLLM, 4 sink keys + a causal window of 256;
- ``documents``: 8 equal packed documents, causal inside each;
- ``causal``.

Providers, timed on the same inputs:

- ``flex``: ``flex_attention(q, k, v, block_mask=create_block_mask(mod, ...))``, 128-tiles (the block mask is
  made once, outside the timing, as one does per batch shape; its creation time is recorded beside, and so is
  the time of the plan the chunked backend makes on the first call and keeps on the block mask: which key
  columns each query block reads, and the predicate's verdicts on partial tiles; the warm-up call makes it,
  as the gather's index lists are made before its timing);
- ``sdpa_dense``: ``F.scaled_dot_product_attention`` given the equivalent dense (L, S) bool mask;
- ``chunked_is_causal`` (causal only): the chunked backend's own ``is_causal`` path;
- ``gather`` (sinks_window only): the hand-written special case, each 256-query block's sinks and window
  gathered and sent through SDPA with its small mask;
- ``torch_flex`` (``--torch-flex``): ``torch.compile(torch.nn.attention.flex_attention)`` with torch's block
  mask, compiled before the timing; recorded as not run (with the reason) where it fails.

How: interleaved rounds (one call of each provider in turn, after a warm-up call each), the median of
``--rounds``; ratios are speed-ups over ``sdpa_dense`` (its median over the provider's). The machine may be
shared with other jobs: a change of load hits every provider of a round alike, so the ratios hold better than
the absolute times; the load average is stored. ``fwd`` runs under ``no_grad``; ``fwd+bwd`` adds
``.backward(grad_out)``.

Also measured: ``--window-sweep`` (sinks 4 + windows 128 ... 2,048 at L = 8,192: time per non-empty tile) and
``--memory`` (the block mask's bytes, and the peak extra resident memory of one flex forward at L = 16,384 in
a fresh process, against a dense (L, S) float32 mask).

The committed run (two invocations, the second adds to the first's JSON)::

    nice -n 0 python benchmarks/bench_flex.py --lengths 4096 8192 --torch-flex --window-sweep --memory
    nice -n 0 python benchmarks/bench_flex.py --lengths 16384 --rounds 3 --append

writes ``benchmarks/results/flex_cpu.json`` and ``flex_cpu.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _machine import machine_line, save_figure  # noqa: E402
from bench_chunked_cpu import git_revision, interleaved, machine  # noqa: E402

import attention_core.mask_mods as mm  # noqa: E402
from attention_core.backends.chunked import chunked_attention  # noqa: E402
from attention_core.backends.chunked_flex import CHUNK_KEYS, MAX_ROWS, _plan_for  # noqa: E402
from attention_core.flex_attention import create_block_mask, flex_attention  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
B, H, E = 1, 4, 64
SINKS, WINDOW, DOCS = 4, 256, 8


def mods(L: int) -> dict:
    return {
        "sinks_window": mm.sinks_and_window(SINKS, WINDOW),
        "documents": mm.and_masks(mm.document(torch.arange(L) // (L // DOCS)), mm.causal),
        "causal": mm.causal,
    }


def gather_window(L: int, block: int = 256):
    """The special case by hand: per 256-query block, its sinks and window keys through SDPA, small mask."""
    mod = mm.sinks_and_window(SINKS, WINDOW)
    plans = []
    for r0 in range(0, L, block):
        r1 = min(L, r0 + block)
        lo = max(SINKS, r0 - WINDOW + 1)
        cols = torch.cat([torch.arange(min(SINKS, lo)), torch.arange(lo, r1)])
        keep = mod(0, 0, torch.arange(r0, r1)[:, None], cols[None, :])  # (bl, nc)
        plans.append((r0, r1, cols, keep))

    def attend(q, k, v):
        outs = [F.scaled_dot_product_attention(q[:, :, r0:r1], k[:, :, cols], v[:, :, cols], attn_mask=keep)
                for r0, r1, cols, keep in plans]
        return torch.cat(outs, dim=2)
    return attend


def torch_flex(mod, L: int):
    from torch.nn.attention.flex_attention import create_block_mask as tcbm
    from torch.nn.attention.flex_attention import flex_attention as tflex

    tbm = tcbm(mod, None, None, L, L, device="cpu")
    compiled = torch.compile(tflex)
    return lambda q, k, v: compiled(q, k, v, block_mask=tbm)


def calls_for(fn, mode: str, L: int):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E, generator=g) for _ in range(3))  # (B, H, L, E) float32
    if mode == "fwd":
        def fwd():
            with torch.no_grad():
                fn(q, k, v)
        return fwd
    for t in (q, k, v):
        t.requires_grad_(True)
    grad_out = torch.randn(B, H, L, E, generator=g)

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(grad_out)
    return fwd_bwd


def measure(L: int, rounds: int, modes, with_torch_flex: bool) -> list:
    points = []
    for name, mod in mods(L).items():
        t0 = time.perf_counter()
        bm = create_block_mask(mod, None, None, L, L)
        create_s = time.perf_counter() - t0
        t0 = time.perf_counter()  # the chunked backend's plan, made on the first call and kept on the block mask
        _plan_for(bm, B, H, L, L, CHUNK_KEYS, torch.device("cpu"), MAX_ROWS)
        plan_s = time.perf_counter() - t0
        dense = mm.dense_mask(mod, 1, 1, L, L)  # (1, 1, L, S) bool
        providers = {"flex": lambda q, k, v, bm=bm: flex_attention(q, k, v, block_mask=bm),
                     "sdpa_dense": lambda q, k, v, m=dense: F.scaled_dot_product_attention(q, k, v, attn_mask=m)}
        if name == "causal":
            providers["chunked_is_causal"] = lambda q, k, v: chunked_attention(q, k, v, is_causal=True)
        if name == "sinks_window":
            providers["gather"] = gather_window(L)
        skipped = {}
        if with_torch_flex:
            try:
                tf = torch_flex(mod, L)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    calls_for(tf, "fwd", L)()  # compiles
                providers["torch_flex"] = tf
            except Exception as exc:  # noqa: BLE001
                skipped["torch_flex"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        for mode in modes:
            calls, not_run = {}, dict(skipped)
            for pname, fn in providers.items():
                if pname == "torch_flex" and mode != "fwd":
                    not_run[pname] = "forward only here (compiled FlexAttention is inference-first on a CPU)"
                    continue
                call = calls_for(fn, mode, L)
                try:
                    call()
                    calls[pname] = call
                except Exception as exc:  # noqa: BLE001
                    not_run[pname] = f"{type(exc).__name__}: {str(exc)[:160]}"
            load0 = os.getloadavg()
            wall, cpu = interleaved(calls, rounds)
            med = {p: statistics.median(ts) for p, ts in wall.items()}
            point = {
                "mask": name, "mode": mode, "L": L, "rounds": rounds,
                "median_ms": med, "cpu_median_ms": {p: statistics.median(ts) for p, ts in cpu.items()},
                "speedup_vs_sdpa_dense": {p: med["sdpa_dense"] / t for p, t in med.items()},
                "nonempty_tiles": bm.nonempty_tiles(), "total_tiles": bm.kv_indices.numel(),
                "block_mask_create_s": create_s, "plan_s": plan_s, "not_run": not_run,
                "loadavg": [load0, os.getloadavg()],
            }
            cpu_med = point["cpu_median_ms"]
            # the same ratios in process CPU time (one thread: the time the call really ran), a cross-check
            # that a load spike on this shared machine did not make them
            if "chunked_is_causal" in med:
                point["flex_over_is_causal"] = med["flex"] / med["chunked_is_causal"]
                point["cpu_flex_over_is_causal"] = cpu_med["flex"] / cpu_med["chunked_is_causal"]
            if "gather" in med:
                point["flex_over_gather"] = med["flex"] / med["gather"]
                point["cpu_flex_over_gather"] = cpu_med["flex"] / cpu_med["gather"]
            points.append(point)
            extra = "".join(f"  flex/{b} {point[f'flex_over_{b}']:.3f} (cpu {point[f'cpu_flex_over_{b}']:.3f})"
                            for b in ("is_causal", "gather") if f"flex_over_{b}" in point)
            print(f"{name:13s} {mode:7s} L={L:6d} " + "  ".join(f"{p} {t:9.1f} ms" for p, t in med.items())
                  + f"  | flex {point['speedup_vs_sdpa_dense']['flex']:.2f}x sdpa_dense{extra} "
                  f"| load {load0[0]:.1f}", flush=True)
    return points


def window_sweep(L: int, rounds: int) -> list:
    """Sinks 4 + windows 128 ... 2048 at one length: flex time per non-empty tile, fwd and fwd+bwd."""
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        calls, tiles = {}, {}
        for w in (128, 256, 512, 1024, 2048):
            bm = create_block_mask(mm.sinks_and_window(SINKS, w), None, None, L, L)
            tiles[w] = bm.nonempty_tiles()
            calls[w] = calls_for(lambda q, k, v, bm=bm: flex_attention(q, k, v, block_mask=bm), mode, L)
        wall, _ = interleaved(calls, rounds)
        per_tile = {w: statistics.median(wall[w]) / tiles[w] for w in calls}
        mean = statistics.mean(per_tile.values())
        for w in calls:
            rows.append({"mode": mode, "L": L, "window": w, "nonempty_tiles": tiles[w],
                         "median_ms": statistics.median(wall[w]), "ms_per_tile": per_tile[w],
                         "deviation_from_mean": per_tile[w] / mean - 1})
            print(f"sweep {mode:7s} window {w:5d}: {tiles[w]:5d} tiles {statistics.median(wall[w]):8.1f} ms "
                  f"{per_tile[w] * 1e3:7.1f} us/tile ({per_tile[w] / mean - 1:+.0%} of the mean)", flush=True)
    return rows


PROBE = """
import sys, torch
sys.path.insert(0, {root!r})
torch.set_num_threads(1)
import attention_core.mask_mods as mm
from attention_core.flex_attention import create_block_mask, flex_attention
L = {L}
q, k, v = (torch.randn(1, 1, L, 64) for _ in range(3))
bm = create_block_mask(mm.sinks_and_window(4, 256), None, None, L, L)
with torch.no_grad():
    small = torch.randn(1, 1, 256, 64)
    flex_attention(small, small, small, block_mask=create_block_mask(mm.causal, None, None, 256, 256))  # imports
    def rss(field):
        return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    base = rss("VmRSS:")
    out = flex_attention(q, k, v, block_mask=bm)
    print(rss("VmHWM:") - base, bm.nbytes())
"""


def memory(L: int) -> dict:
    # glibc returns freed memory at once and maps every large block afresh, so the peak is not hidden by
    # memory freed earlier and kept by the allocator (the block mask's creation slabs)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT), L=L)], capture_output=True,
                          text=True, timeout=600, env=env)
    if proc.returncode:
        return {"L": L, "error": proc.stderr[-300:]}
    peak, mask_bytes = (int(x) for x in proc.stdout.split())
    dense = L * L * 4
    return {"L": L, "H": 1, "peak_extra_bytes_forward": peak, "block_mask_bytes": mask_bytes,
            "dense_float_mask_bytes": dense, "peak_over_dense_mask": peak / dense,
            "block_mask_over_dense_mask": mask_bytes / dense,
            "note": "peak resident memory during one forward call above the resident memory before it "
                    "(includes the (1, 1, L, 64) float32 output, 4 MiB at L = 16384), glibc set to unmap freed "
                    "blocks"}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points, meta = result["points"], result["meta"]
    masks = ["sinks_window", "documents", "causal"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, mode in zip(axes[:2], ("fwd", "fwd+bwd")):
        for i, mask in enumerate(masks):
            for j, prov in enumerate(("flex", "gather", "chunked_is_causal", "torch_flex")):
                mine = sorted((p for p in points if p["mask"] == mask and p["mode"] == mode
                               and prov in p["speedup_vs_sdpa_dense"]), key=lambda p: p["L"])
                if mine:
                    ax.plot([p["L"] for p in mine], [p["speedup_vs_sdpa_dense"][prov] for p in mine],
                            ["o-", "s--", "^:", "x-."][j], color=f"C{i}", label=f"{mask}: {prov}")
        ax.axhline(1, color="k", lw=0.8)
        ax.axhline(10, color="r", lw=0.8, ls=":", label="10x target (sinks_window)")
        ax.set(xscale="log", yscale="log", xlabel="L = S", ylabel="speed-up over SDPA + dense bool mask",
               title=mode)
        ax.set_xticks([4096, 8192, 16384], ["4096", "8192", "16384"])
        ax.xaxis.set_minor_locator(plt.NullLocator())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    sweep = result.get("window_sweep", [])
    ax = axes[2]
    for mode, style in (("fwd", "o-"), ("fwd+bwd", "s--")):
        rows = [r for r in sweep if r["mode"] == mode]
        if rows:
            ax.plot([r["nonempty_tiles"] for r in rows], [r["median_ms"] for r in rows], style, label=mode)
            for r in rows:
                ax.annotate(f"w={r['window']}", (r["nonempty_tiles"], r["median_ms"]), fontsize=6)
    flex_points = [p for p in points if p["mode"] == "fwd"]
    if flex_points:
        ax.plot([p["nonempty_tiles"] for p in flex_points], [p["median_ms"]["flex"] for p in flex_points], "k.",
                label="fwd, every mask and L")
    ax.set(xscale="log", yscale="log", xlabel="non-empty 128x128 tiles", ylabel="flex median ms",
           title="time against non-empty tiles")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path, f"{machine_line(meta['machine'])} | fp32 B={B} H={H} E={E}, 1 thread | "
                f"{meta['date'][:10]} | shared machine, load average {meta['loadavg_start'][0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--torch-flex", action="store_true", help="also time compiled torch FlexAttention")
    parser.add_argument("--window-sweep", action="store_true")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--append", action="store_true", help="add to the existing JSON instead of replacing it")
    parser.add_argument("--out", type=Path, default=RESULTS / "flex_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = json.loads(args.out.read_text()) if args.append and args.out.exists() else {
        "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "machine": machine(),
                 "revision": git_revision(), "loadavg_start": os.getloadavg(), "B": B, "H": H, "E": E,
                 "dtype": "float32", "threads": 1, "block_size": 128,
                 "command": "python " + " ".join(sys.argv)},
        "points": [],
    }
    if args.append:
        result["meta"].setdefault("appended", []).append({"command": "python " + " ".join(sys.argv),
                                                          "date": datetime.datetime.now(datetime.timezone.utc)
                                                          .isoformat(), "loadavg": os.getloadavg()})
    m = result["meta"]["machine"]
    print(f"{m['cpu_model']}, caches {m['caches']}, ATen {m['aten_cpu_capability']}, torch {m['torch']}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for L in args.lengths:
        result["points"] = [p for p in result["points"] if p["L"] != L] + measure(
            L, args.rounds, args.modes, args.torch_flex)
    if args.window_sweep:
        result["window_sweep"] = window_sweep(8192, args.rounds)
    if args.memory:
        result["memory"] = memory(16384)
        print("memory:", result["memory"], flush=True)
    result["meta"]["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
