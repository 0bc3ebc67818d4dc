"""Functions the child processes run (importable, so that ``launch.run`` can spawn them): each takes
``(rank, world_size, ...)``, runs distributed attention, and returns plain numbers and tensors."""

from __future__ import annotations

from typing import Dict, List

import torch

from attention_core._checks import check_instance, short_repr
from attention_core.distributed.layout import gather_shapes, shard, unshard
from attention_core.distributed.ring import CommStats, ring_attention
from attention_core.distributed.ulysses import ulysses_attention
from attention_core.functional import scaled_dot_product_attention

__all__ = ["compare_with_sdpa", "forward_block_buffers", "make_inputs", "memory_in_subgroups", "peak_memory"]

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def make_inputs(case: Dict, device: str = "cpu"):
    """The whole sequence's q, k, v and an output gradient, the same on every rank (seeded)."""
    check_instance(case, dict, "case", "a dict")
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


def compare_in_subgroups(rank: int, world_size: int, plan: Dict[int, List[Dict]]) -> Dict[int, List[Dict]]:
    """``plan = {P: cases}``: each world size P runs in the subgroup of ranks 0..P-1 (one spawn for all sizes);
    returns this rank's results per P (ranks outside a subgroup skip it)."""
    import torch.distributed as dist

    out = {}
    for P in sorted(plan):
        group = dist.new_group(list(range(P)))  # every rank takes part in making every group
        if rank < P:
            out[P] = compare_with_sdpa(rank, P, plan[P], group)
    return out


def compare_with_sdpa(rank: int, world_size: int, cases: List[Dict], group=None) -> List[Dict]:
    """For each case: distributed attention vs single-process ``scaled_dot_product_attention`` on the whole
    sequence, forward and the gradients of q, k, v (relative max errors), and what this rank counted."""
    if isinstance(cases, (str, bytes, dict)) or not all(isinstance(c, dict) for c in cases):
        raise TypeError(f"cases must be a list of dicts, got {short_repr(cases)}")
    results = []
    for case in cases:
        if "error" in case:
            results.append(_error_case(rank, world_size, case["error"], group))
            continue
        if case.get("kind") == "shard":
            results.append(_shard_case(rank, world_size, case, group))
            continue
        q, k, v, do = make_inputs(case)
        if "magnitude" in case:
            q, k = q * case["magnitude"], k * case["magnitude"]
        layout, causal = case.get("layout", "zigzag"), case.get("is_causal", False)
        fn = ring_attention if case.get("kind", "ring") == "ring" else ulysses_attention
        extra = {"block_q": case["block"], "block_k": case["block"]} if "block" in case and fn is ring_attention \
            else {}
        if "backend" in case and fn is ulysses_attention:
            extra["backend"] = case["backend"]
        ql, kl, vl = (shard(t, 2, layout, group).requires_grad_() for t in (q, k, v))
        stats = CommStats()
        visits = _count_kernel_tiles() if case.get("count_kernel") else None
        try:
            out = fn(ql, kl, vl, is_causal=causal, scale=case.get("scale"), layout=layout, group=group, stats=stats,
                     **extra)
        finally:
            kernel_tiles = visits() if visits else None
        fwd_bytes = stats.bytes_sent
        out.backward(shard(do, 2, layout, group))
        got = [unshard(t, 2, layout, group) for t in (out.detach(), ql.grad, kl.grad, vl.grad)]
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = scaled_dot_product_attention(qr, kr, vr, is_causal=causal, scale=case.get("scale"),
                                           enable_gqa=q.shape[1] != k.shape[1])
        ref.backward(do)
        want = [ref.detach(), qr.grad, kr.grad, vr.grad]
        row = {"errors": [_rel(a, b) for a, b in zip(got, want)], "fwd_bytes": fwd_bytes,
               "bytes": stats.bytes_sent, "tiles": stats.tiles, "kernel_tiles": kernel_tiles,
               "local": tuple(ql.shape)}
        if q.dtype != torch.float64:  # both against float64 attention on the same (rounded) inputs
            q64, k64, v64 = (t.double() for t in (q, k, v))
            ref64 = scaled_dot_product_attention(q64, k64, v64, is_causal=causal, scale=case.get("scale"),
                                                 enable_gqa=q.shape[1] != k.shape[1])
            row["error64"] = _rel(got[0], ref64)
            row["sdpa_error64"] = _rel(ref.detach(), ref64)
        results.append(row)
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


def _count_kernel_tiles():
    """Count the chunked kernel's score tiles from here on (every call of its tile-scoring method); the
    returned function stops counting and gives the count."""
    from attention_core.backends import chunked

    original, seen = chunked._Tiles.scores, [0]

    def scores(self, *args, **kwargs):
        seen[0] += 1
        return original(self, *args, **kwargs)

    chunked._Tiles.scores = scores

    def stop() -> int:
        chunked._Tiles.scores = original
        return seen[0]

    return stop


def _shard_case(rank: int, world_size: int, case: Dict, group=None) -> Dict:
    """shard then unshard gives the tensor back; the local lengths seen."""
    g = torch.Generator().manual_seed(case.get("seed", 0))
    x = torch.randn(2, case["L"], 3, generator=g)
    part = shard(x, 1, case["layout"], group)
    back = unshard(part, 1, case["layout"], group)
    return {"length": part.shape[1], "roundtrip": bool(torch.equal(back, x)), "part": part}


def _error_case(rank: int, world_size: int, what: str, group=None):
    """A call that must be refused: (exception type name, message), or None if it was accepted."""
    q = torch.randn(1, 4, 6, 8, dtype=torch.float64)
    k = v = torch.randn(1, 2, 6, 8, dtype=torch.float64)
    try:
        if what == "mismatch_dim":  # rank 1 has another head dim
            e = 8 if rank != 1 else 4
            ring_attention(q[..., :e], k[..., :e], v, layout="contiguous", group=group)
        elif what == "mismatch_length":  # rank 0 has one row more than any split gives
            ring_attention(torch.randn(1, 4, 9 if rank == 0 else 6, 8, dtype=torch.float64), k, v,
                           layout="contiguous", group=group)
        elif what == "ulysses_heads":
            ulysses_attention(q, k, v, layout="contiguous", group=group)
        elif what == "unshard_mismatch":
            unshard(torch.zeros(2, 3 + rank, 3 if rank == 0 else 4), 1, "contiguous", group)
        elif what == "too_many_dims":  # the last rank's shape has 17 dims: every rank must refuse, none hang
            x = torch.zeros((1,) * 17) if rank == world_size - 1 else torch.zeros(1, 1, 1)
            unshard(x, 1, "contiguous", group)
        else:
            raise KeyError(what)
    except (TypeError, ValueError, RuntimeError) as err:
        return type(err).__name__, str(err)
    return None


def peak_memory(rank: int, world_size: int, case: Dict, group=None) -> Dict:
    """Peak bytes of the tensors one rank allocates in a forward and backward pass (its inputs apart), the sizes
    of the storages alive at that peak (largest first), and the bytes of its inputs.

    ``case["block"]`` sets the ring's tiles (default: the chunked kernel's own), ``case["backend"]`` the kernel
    of Ulysses' local attention (default: the automatic choice)."""
    check_instance(case, dict, "case", "a dict")
    from attention_core.distributed.measure import PeakTensorMemory

    q, k, v, do = make_inputs(case)
    layout = case.get("layout", "zigzag")
    tensors = [shard(t, 2, layout, group).requires_grad_() for t in (q, k, v)] + [shard(do, 2, layout, group)]
    if case.get("kind", "ring") == "ring":
        fn = ring_attention
        extra = {"block_q": case["block"], "block_k": case["block"]} if "block" in case else {}
    else:
        fn, extra = ulysses_attention, {"backend": case.get("backend")}
    del q, k, v, do
    with PeakTensorMemory() as mem:
        out = fn(*tensors[:3], is_causal=case.get("is_causal", False), layout=layout, group=group, **extra)
        out.backward(tensors[3])
        del out
    return {"peak": mem.peak, "at_peak": mem.at_peak,
            "inputs": sum(t.numel() * t.element_size() for t in tensors)}


def memory_in_subgroups(rank: int, world_size: int, plan: Dict[int, Dict[str, Dict]]) -> Dict[int, Dict[str, Dict]]:
    """``plan = {P: {name: case}}``: :func:`peak_memory` of each case in the subgroup of ranks 0..P-1, for every
    P in one spawn; returns this rank's results per P (ranks outside a subgroup skip it)."""
    import torch.distributed as dist

    out = {}
    for P in sorted(plan):
        group = dist.new_group(list(range(P)))  # every rank takes part in making every group
        if rank < P:
            # A group's first collective sets it up (and may keep its tensors until the cycle collector runs):
            # one all-gather of shapes first, so that what is measured is the attention call's own tensors.
            gather_shapes([torch.zeros(1)], group)
            out[P] = {name: peak_memory(rank, P, case, group) for name, case in plan[P].items()}
    return out


def forward_block_buffers(rank: int, world_size: int, case: Dict) -> int:
    """The most tensor storages of one packed key/value block's size (keys and values of one shard, as the ring
    sends them) alive at one time during this rank's ring attention forward pass, its inputs apart.

    Use shapes where nothing else has that size (``Hq == H`` and ``Ev == E``: a query-sized tensor is half a
    block) and equal shard lengths."""
    check_instance(case, dict, "case", "a dict")
    from attention_core.distributed.measure import PeakTensorMemory

    class _Count(PeakTensorMemory):
        def __init__(self, size: int) -> None:
            super().__init__()
            self.size, self.most = size, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.most = max(self.most, sum(1 for nbytes, _ in self.live.values() if nbytes == self.size))
            return out

    q, k, v, _ = make_inputs(case)
    layout = case.get("layout", "zigzag")
    ql, kl, vl = (shard(t, 2, layout) for t in (q, k, v))
    gather_shapes([torch.zeros(1)])  # the group's first collective, outside the measurement
    with _Count((kl.numel() + vl.numel()) * kl.element_size()) as count:
        out = ring_attention(ql, kl, vl, is_causal=case.get("is_causal", False), layout=layout)
        del out
    return count.most
