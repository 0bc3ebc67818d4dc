"""Functions the child processes run (importable, so that ``launch.run`` can spawn them): each takes
``(rank, world_size, ...)``, runs distributed attention, and returns plain numbers and tensors."""

from __future__ import annotations

from typing import Dict, List

import torch

from attention_core.distributed.layout import shard, unshard
from attention_core.distributed.ring import CommStats, ring_attention
from attention_core.distributed.ulysses import ulysses_attention
from attention_core.functional import scaled_dot_product_attention

__all__ = ["compare_with_sdpa", "make_inputs"]

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def make_inputs(case: Dict, device: str = "cpu"):
    """The whole sequence's q, k, v and an output gradient, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    B, Hq, H, L = case.get("B", 1), case.get("Hq", 2), case.get("H", 2), case["L"]
    S, E, Ev = case.get("S", L), case.get("E", 8), case.get("Ev", case.get("E", 8))
    dt = DTYPES[case.get("dtype", "float64")]
    q = torch.randn(B, Hq, L, E, generator=g).to(device, dt)
    k = torch.randn(B, H, S, E, generator=g).to(device, dt)
    v = torch.randn(B, H, S, Ev, generator=g).to(device, dt)
    do = torch.randn(B, Hq, L, Ev, generator=g).to(device, dt)
    return q, k, v, do


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 for empty tensors)."""
    if b.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300))


def compare_with_sdpa(rank: int, world_size: int, cases: List[Dict]) -> List[Dict]:
    """For each case: distributed attention vs single-process ``scaled_dot_product_attention`` on the whole
    sequence, forward and the gradients of q, k, v (relative max errors), and what this rank counted."""
    results = []
    for case in cases:
        q, k, v, do = make_inputs(case)
        layout, causal = case.get("layout", "zigzag"), case.get("is_causal", False)
        fn = ring_attention if case.get("kind", "ring") == "ring" else ulysses_attention
        extra = {"block_q": case["block"], "block_k": case["block"]} if "block" in case and fn is ring_attention \
            else {}
        ql, kl, vl = (shard(t, 2, layout).requires_grad_() for t in (q, k, v))
        stats = CommStats()
        out = fn(ql, kl, vl, is_causal=causal, scale=case.get("scale"), layout=layout, stats=stats, **extra)
        fwd_bytes = stats.bytes_sent
        out.backward(shard(do, 2, layout))
        got = [unshard(t, 2, layout) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=case.get("scale"),
                                           enable_gqa=q.shape[1] != k.shape[1])
        ref.backward(do)
        want = [ref.detach(), qr.grad, kr.grad, vr.grad]
        results.append({"errors": [_rel(a, b) for a, b in zip(got, want)], "fwd_bytes": fwd_bytes,
                        "bytes": stats.bytes_sent, "tiles": stats.tiles, "local": tuple(ql.shape)})
    return results


def run_with_stats(rank: int, world_size: int, case: Dict) -> Dict:
    """One forward and backward with a :class:`CommStats`: bytes, tiles and the timed events of this rank."""
    q, k, v, do = make_inputs(case)
    layout = case.get("layout", "zigzag")
    fn = ring_attention if case.get("kind", "ring") == "ring" else ulysses_attention
    ql, kl, vl = (shard(t, 2, layout).requires_grad_() for t in (q, k, v))
    stats = CommStats()
    out = fn(ql, kl, vl, is_causal=case.get("is_causal", False), layout=layout, stats=stats)
    forward_events = len(stats.events)
    out.backward(shard(do, 2, layout))
    return {"bytes": stats.bytes_sent, "tiles": stats.tiles, "events": stats.events,
            "forward_events": forward_events}


def call(rank: int, world_size: int, name: str, kwargs: Dict):
    """Call one of the public functions by name with made-up inputs, for the error tests: returns the
    exception's type name and message (or None)."""
    import attention_core.distributed as acd

    try:
        getattr(acd, name)(**{k: (v(rank) if callable(v) else v) for k, v in kwargs.items()})
    except (TypeError, ValueError, RuntimeError) as e:
        return type(e).__name__, str(e)
    return None


def peak_memory(rank: int, world_size: int, case: Dict) -> Dict:
    """Peak bytes of the tensors one rank allocates in a forward and backward pass (its inputs apart), and
    the bytes of its inputs; ``world_size`` 1 with ``kind="single"`` runs the chunked kernel on the whole
    sequence in one process."""
    from attention_core.distributed.measure import PeakTensorMemory

    q, k, v, do = make_inputs(case)
    layout = case.get("layout", "zigzag")
    block = case.get("block", 256)
    if case.get("kind") == "single":
        from attention_core.backends.chunked import chunked_attention

        tensors = [t.clone().requires_grad_() for t in (q, k, v)] + [do]
        call = lambda: chunked_attention(*tensors[:3], is_causal=case.get("is_causal", False),  # noqa: E731
                                         block_q=block, block_k=block)
    else:
        tensors = [shard(t, 2, layout).requires_grad_() for t in (q, k, v)] + [shard(do, 2, layout)]
        fn = ring_attention if case.get("kind", "ring") == "ring" else ulysses_attention
        extra = {"block_q": block, "block_k": block} if fn is ring_attention else {}
        call = lambda: fn(*tensors[:3], is_causal=case.get("is_causal", False), layout=layout, **extra)  # noqa: E731
    del q, k, v, do
    with PeakTensorMemory() as mem:
        out = call()
        out.backward(tensors[3])
        del out
    return {"peak": mem.peak, "inputs": sum(t.numel() * t.element_size() for t in tensors)}
