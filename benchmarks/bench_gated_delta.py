"""The gated delta rule's two forms at a small size: the recurrent reference (L rank-1 updates) against the
chunkwise WY/UT form (L / C triangular solves and matrix products), forward only, float32, one thread.

Rounds are interleaved (recurrent, chunked C1, chunked C2, ...) and the medians reported, so that a shared machine's
slow moments hit every variant alike; the spread (min, max) is printed beside each median. Usage::

    python benchmarks/bench_gated_delta.py [--rounds 9] [--L 512] [--B 1] [--H 4] [--E 32] [--chunks 16 32 64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from attention_core import linear_attention as la

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import blas, cpu_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--L", type=int, default=512)
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--E", type=int, default=32)
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    B, H, L, E = args.B, args.H, args.L, args.E
    q, k, v = (torch.randn(B, H, L, E, generator=g) for _ in range(3))
    alpha = 0.5 + 0.5 * torch.rand(B, H, L, generator=g)
    beta = torch.rand(B, H, L, generator=g)
    variants = {"recurrent": lambda: la.gated_delta_rule_recurrent(q, k, v, alpha, beta)}
    for C in args.chunks:
        variants[f"chunked C={C}"] = lambda C=C: la.gated_delta_rule_chunked(q, k, v, alpha, beta, chunk_size=C)
    ref = variants["recurrent"]()[0]
    for name, fn in variants.items():  # warm-up, and the forms agree
        err = (fn()[0] - ref).abs().max().item()
        assert err < 1e-4, (name, err)
    times = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    print(f"{cpu_model()}, BLAS {blas()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"load {os.getloadavg()[0]:.2f} (a machine shared with other jobs); B={B} H={H} L={L} E=Ev={E}, float32, "
          f"forward, median of {args.rounds} interleaved rounds [min, max]")
    base = statistics.median(times["recurrent"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:14s} {1e3 * med:9.2f} ms [{1e3 * min(ts):.2f}, {1e3 * max(ts):.2f}]  "
              f"{base / med:5.1f}x the recurrent form's speed")


if __name__ == "__main__":
    main()
