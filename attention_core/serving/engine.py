"""The chapter-11 model served from a paged KV cache: batched decode over sequences of different lengths.

:func:`paged_forward` runs :class:`~attention_core.models.language_model.DecoderLM`'s layers by hand for a batch of
sequences, each at its own position: the new tokens' keys (rotated, as vLLM stores them) and values go into the
sequences' blocks, and attention reads them back through the block table with
:func:`attention_core.paged_attention.paged_attention`. :func:`serve` replays a request trace with static or
continuous batching on it and returns the text of every request and the wall time.
"""

from __future__ import annotations

import time
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from attention_core.models.language_model import DecoderLM
from attention_core.paged_attention import paged_attention
from attention_core.serving.blocks import PagedKVCache
from attention_core.serving.scheduler import Request

__all__ = ["new_paged_cache", "paged_forward", "serve"]


def new_paged_cache(model: DecoderLM, num_blocks: int, block_size: int = 16) -> PagedKVCache:
    """An empty :class:`~attention_core.serving.blocks.PagedKVCache` shaped for ``model``'s layers (keys stored
    after the rotary rotation)."""
    attn = model.blocks[0].attn
    return PagedKVCache(model.num_layers, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)


@torch.no_grad()
def paged_forward(model: DecoderLM, cache: PagedKVCache, seqs: Sequence[int], tokens: torch.Tensor,
                  path: str = "chunked") -> torch.Tensor:
    """Logits (B, L, V) for ``tokens`` (B, L), the next L tokens of each sequence in ``seqs`` (extends them)."""
    B, L = tokens.shape
    positions = [cache.reserve(s, L) for s in seqs]
    table, lens = cache.block_table(list(seqs))
    x = model.embed(tokens)  # (B, L) -> (B, L, D)
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        Hq, H, E = attn.num_heads, attn.num_kv_heads, attn.head_dim
        h = block.norm1(x)
        q = attn.q_proj(h).view(B, L, Hq, E).transpose(1, 2)  # (B, L, D) -> (B, Hq, L, E)
        k = attn.k_proj(h).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        v = attn.v_proj(h).view(B, L, H, E).transpose(1, 2)
        q = torch.cat([model.rotary.rotate(q[b : b + 1], offset=positions[b].start) for b in range(B)])
        k = torch.cat([model.rotary.rotate(k[b : b + 1], offset=positions[b].start) for b in range(B)])
        for b, s in enumerate(seqs):
            cache.write(layer, s, positions[b], k[b], v[b])
        o = paged_attention(q, cache.keys[layer], cache.values[layer], table, lens, path=path)  # (B, Hq, L, E)
        x = x + attn.out_proj(o.transpose(1, 2).reshape(B, L, Hq * E))  # (B, Hq, L, E) -> (B, L, D)
        x = x + block.linear2(F.gelu(block.linear1(block.norm2(x))))
    return model.lm_head(model.norm(x))


@torch.no_grad()
def serve(model: DecoderLM, requests: Sequence[Request], prompts: Dict[int, torch.Tensor], max_batch: int,
          policy: str = "continuous", num_blocks: int = 512, block_size: int = 16
          ) -> Tuple[Dict[int, List[int]], int, float]:
    """Greedy-decode every request on ``model`` with ``policy`` ``"static"`` or ``"continuous"`` batching.

    Arrivals are in steps (one engine iteration = one step). Each step prefills the admitted requests (one
    call each) and decodes all running ones in one batched call. Static batching keeps a finished request's
    row in the batch until its group is done (decoding padding, as a fixed batch does).

    Returns:
        ``(outputs, steps, seconds)``: the written tokens per request id, the engine steps, the wall time.
    """
    if policy not in ("static", "continuous"):
        raise ValueError(f"policy must be 'static' or 'continuous', got {policy!r}")
    model.eval()
    cache = new_paged_cache(model, num_blocks, block_size)
    waiting = sorted(requests, key=lambda r: (r.arrival, r.rid))
    out: Dict[int, List[int]] = {}
    running: List[int] = []
    by_id = {r.rid: r for r in requests}
    step, start = 0, time.perf_counter()
    while waiting or running:
        admit: List[Request] = []
        if policy == "continuous":
            while waiting and waiting[0].arrival <= step and len(running) + len(admit) < max_batch:
                admit.append(waiting.pop(0))
        elif not running:
            group = waiting[:max_batch]
            if group and max(r.arrival for r in group) <= step:
                admit, waiting = group, waiting[max_batch:]
        decode = list(running)
        if decode:
            last = torch.tensor([[out[i][-1]] for i in decode])  # (B, 1)
            logits = paged_forward(model, cache, decode, last)[:, -1]
            for i, t in zip(decode, logits.argmax(-1).tolist()):
                out[i].append(t)
        for r in admit:
            cache.add_sequence(r.rid)
            logits = paged_forward(model, cache, [r.rid], prompts[r.rid][None])[:, -1]
            out[r.rid] = [int(logits.argmax(-1))]
            running.append(r.rid)
        step += 1
        done = [i for i in running if len(out[i]) >= by_id[i].output_len]
        if policy == "static" and len(done) < len(running):
            done = []
        for i in done:
            running.remove(i)
            cache.free_sequence(i)
    for i in out:
        out[i] = out[i][: by_id[i].output_len]
    return out, step, time.perf_counter() - start
