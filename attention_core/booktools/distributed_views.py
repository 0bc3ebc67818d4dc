"""Chapter 16's distributed runs and figures: one function that every spawned rank runs (so the chapter starts
its processes once), and the per-rank timeline plot."""

from __future__ import annotations

from typing import Dict, List

import torch

from attention_core.distributed import checks

__all__ = ["chapter_run", "plot_timeline", "torch_context_parallel"]


def torch_context_parallel(rank: int, world_size: int, case: Dict, is_causal: bool) -> Dict:
    """PyTorch's own ``context_parallel`` on the same inputs: ``{"ok": max error vs SDPA}`` or the exception's
    type and first line."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel._attention import context_parallel_unshard

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (world_size,))
    q, k, v, _ = checks.make_inputs(case, device)
    qq, kk, vv = q.clone(), k.clone(), v.clone()
    try:
        with context_parallel(mesh, buffers=[qq, kk, vv], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=is_causal)
            whole = context_parallel_unshard(mesh, [out], [2])[0]
    except Exception as err:  # noqa: BLE001 - what it does here is the result
        return {"error": type(err).__name__, "message": str(err).splitlines()[0] if str(err) else ""}
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    return {"ok": float((whole - ref).abs().max())}


def chapter_run(rank: int, world_size: int, cfg: Dict) -> Dict:
    """Everything chapter 16 runs on its processes: equality cases, a timed run, peak memory per rank at each
    world size of ``cfg["memory"]`` (subgroups of ranks 0..P-1); optionally the cases of ``cfg["bytes"]``
    (``{P: cases}``, in the same subgroups) and the most key/value blocks alive at once in the ring's forward
    pass (``cfg["fwd_blocks"]``, a case)."""
    out = {"compare": checks.compare_with_sdpa(rank, world_size, cfg["cases"])}
    out["timeline"] = checks.run_with_stats(rank, world_size, cfg["timeline"])
    if "bytes" in cfg:
        out["bytes"] = checks.compare_in_subgroups(rank, world_size, cfg["bytes"])
    if "fwd_blocks" in cfg:
        out["fwd_blocks"] = checks.forward_block_buffers(rank, world_size, cfg["fwd_blocks"])
    out["memory"] = checks.memory_in_subgroups(rank, world_size, cfg["memory"])
    return out


def plot_timeline(timelines: List[Dict], title: str = "ring attention, forward then backward"):
    """One row per rank: compute (blue), blocked waiting for the network (orange), messages in flight (grey)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.55 * len(timelines)), layout="constrained")
    colors = {"comm": ("#BBBBBB", 0.5), "compute": ("#0072B2", 0.45), "wait": ("#D55E00", 0.2)}  # drawn in this order
    for r, t in enumerate(timelines):
        for kind, (color, h) in colors.items():
            spans = [(a, b - a) for k, a, b in t["events"] if k == kind]
            ax.broken_barh(spans, (r - h / 2, h), color=color, label=kind if r == 0 else None)
    ax.set_yticks(range(len(timelines)), [f"rank {r}" for r in range(len(timelines))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the call")
    ax.set_title(title, pad=22)  # room for the legend between the title and rank 0's bars
    ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=8, frameon=False)  # above the bars
    return fig
