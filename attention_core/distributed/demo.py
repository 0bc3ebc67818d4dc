"""Ring and Ulysses attention on N processes, checked against one process.

    torchrun --nproc-per-node 4 -m attention_core.distributed.demo [--length 4096] [--causal] [--layout zigzag]

Each rank builds the same seeded q, k, v (the whole sequence), keeps its shard, runs ring attention (and
Ulysses when the heads divide), forward and backward, and rank 0 prints one line per rank: bytes sent, score
tiles computed, time, and the largest error of the output and gradients against single-process
``scaled_dot_product_attention``. gloo on CPUs; with CUDA and ``--backend nccl`` each rank calls
``torch.cuda.set_device(LOCAL_RANK)`` before it joins the group and puts its tensors on ``cuda:LOCAL_RANK`` (the
tests record that call without a GPU; this path has not been run on GPUs).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from attention_core.distributed.checks import make_inputs
from attention_core.distributed.layout import shard, unshard
from attention_core.distributed.ring import CommStats, ring_attention
from attention_core.distributed.ulysses import ulysses_attention
from attention_core.functional import scaled_dot_product_attention


def _one(kind: str, case: dict, device: str) -> list:
    q, k, v, do = make_inputs(case, device)
    fn = ring_attention if kind == "ring" else ulysses_attention
    layout = case["layout"] if kind == "ring" else "contiguous"
    ql, kl, vl = (shard(t, 2, layout).requires_grad_() for t in (q, k, v))
    stats = CommStats()
    start = time.perf_counter()
    out = fn(ql, kl, vl, is_causal=case["is_causal"], layout=layout, stats=stats)
    out.backward(shard(do, 2, layout))
    seconds = time.perf_counter() - start
    got = [unshard(t, 2, layout) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = scaled_dot_product_attention(qr, kr, vr, is_causal=case["is_causal"], enable_gqa=q.shape[1] != k.shape[1])
    ref.backward(do)
    err = max(float((a - b).abs().max()) for a, b in zip(got, (ref.detach(), qr.grad, kr.grad, vr.grad)))
    return [stats.bytes_sent, stats.tiles, seconds, err]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", default="zigzag", choices=["contiguous", "zigzag", "striped"])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = p.parse_args(argv)
    device = "cpu"
    if args.backend == "nccl":  # one GPU per process, selected before the group starts (as launch.run does)
        local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group(args.backend)
    rank, P = dist.get_rank(), dist.get_world_size()
    case = {"L": args.length, "Hq": args.heads, "H": args.kv_heads, "E": args.head_dim, "dtype": args.dtype,
            "layout": args.layout, "is_causal": args.causal, "seed": 0}
    kinds = ["ring"] + (["ulysses"] if args.heads % P == 0 and args.kv_heads % P == 0 else [])
    rows = {kind: _one(kind, case, device) for kind in kinds}
    mine = torch.tensor([x for kind in kinds for x in rows[kind]], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(everyone, mine)
    if rank == 0:
        print(f"world size {P}, backend {args.backend}, L={args.length}, heads {args.heads}/{args.kv_heads}, "
              f"E={args.head_dim}, {args.dtype}, causal={args.causal}, ring layout {args.layout}")
        print("kind     rank  bytes sent  tiles  seconds  max error vs SDPA (forward and grads)")
        for i, kind in enumerate(kinds):
            for r, row in enumerate(everyone):
                b, t, s, e = row[4 * i: 4 * i + 4].tolist()
                print(f"{kind:8s} {r:4d} {int(b):11d} {int(t):6d} {s:8.3f}  {e:.2e}")
        if "ulysses" not in kinds:
            print(f"(ulysses skipped: {args.heads} query / {args.kv_heads} kv heads do not divide by {P})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
