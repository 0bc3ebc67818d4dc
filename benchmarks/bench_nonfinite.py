"""What the non-finite policy costs, as a fraction of one attention call (torch's CPU SDPA), at L = S = 1,024.

Two ways the policy runs (attention_core/_nonfinite.py):

- eager CPU tensors: one sum per input and one host-side test; the cleaning runs only when that fails;
- under torch.compile, torch.func transforms or on a GPU: tensor operations only, on every call
  (``clean_and_poison``: zero the bad entries, find the rows that read them, add NaN or 0 to those rows).

Rounds are interleaved (SDPA, check, tensor path, SDPA, ...) and the medians compared, so that a shared
machine's slow moments hit every variant alike. Usage::

    python benchmarks/bench_nonfinite.py [--rounds 15] [--threads 1] [--compiled]

``--compiled`` also times what a reader of the compiled path pays: ``torch.compile(fullgraph=True)`` (inductor)
of ``attention_core.scaled_dot_product_attention(..., backend="torch")``, whose policy runs as tensor operations,
against the same compile of ``torch.nn.functional.scaled_dot_product_attention`` (a few minutes of compiling).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attention_core import _nonfinite

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import blas, cpu_model  # noqa: E402


def _time(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--compiled", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    B, H, L, E = 1, 8, args.length, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, E, generator=g) for _ in range(3))
    masks = {"no mask": (None, False), "causal": (None, True),
             "bool mask (L, S)": (torch.rand(1, 1, L, L, generator=g) < 0.9, False)}
    print(f"CPU: {cpu_model()}; ISA: {torch.backends.cpu.get_cpu_capability()}; BLAS: {blas()}; "
          f"torch {torch.__version__}; {args.threads} thread(s); B={B} H={H} L=S={L} E={E} float32; "
          f"{args.rounds} interleaved rounds, medians")
    for name, (mask, causal) in masks.items():
        def sdpa(mask=mask, causal=causal, q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)

        def check(mask=mask, q=q, k=k, v=v):
            return bool(_nonfinite.all_finite(q, k, v, mask))

        def tensor_path(mask=mask, causal=causal, q=q, k=k, v=v):
            q2, k2, v2, m2, poison = _nonfinite.clean_and_poison(q, k, v, mask, causal)
            return poison.out

        sdpa()  # warm up every variant once
        check()
        tensor_path()
        times = {"sdpa": [], "check": [], "tensor": []}
        for _ in range(args.rounds):
            times["sdpa"].append(_time(sdpa, 2))
            times["check"].append(_time(check, 20))
            times["tensor"].append(_time(tensor_path, 5))
        med = {k: statistics.median(t) for k, t in times.items()}
        print(f"{name:17s} SDPA {med['sdpa'] * 1e3:8.2f} ms | eager check {med['check'] * 1e3:6.3f} ms = "
              f"{100 * med['check'] / med['sdpa']:5.2f}% | tensor-only path {med['tensor'] * 1e3:6.3f} ms = "
              f"{100 * med['tensor'] / med['sdpa']:5.2f}%")
        if args.compiled:
            _compiled(name, q, k, v, mask, causal, args.rounds)


def _compiled(name, q, k, v, mask, causal, rounds) -> None:
    import attention_core as ac

    kw = {"attn_mask": mask, "is_causal": causal}
    ours = torch.compile(lambda q, k, v: ac.scaled_dot_product_attention(q, k, v, backend="torch", **kw),
                         fullgraph=True)
    plain = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw), fullgraph=True)
    torch.testing.assert_close(ours(q, k, v), plain(q, k, v))
    times = {"plain": [], "ours": []}
    for _ in range(rounds):
        times["plain"].append(_time(lambda: plain(q, k, v), 2))
        times["ours"].append(_time(lambda: ours(q, k, v), 2))
    a, b = statistics.median(times["ours"]), statistics.median(times["plain"])
    print(f"{name:17s} compiled: torch SDPA {b * 1e3:8.2f} ms | attention_core SDPA {a * 1e3:8.2f} ms = "
          f"{100 * (a / b - 1):+5.1f}%")


if __name__ == "__main__":
    main()
