"""The chapter-11 model served from a paged KV cache: batched decode over sequences of different lengths.

:func:`paged_forward` runs :class:`~attention_core.models.language_model.DecoderLM`'s layers by hand for a batch of
sequences, each at its own position: the new tokens' keys (rotated, as vLLM stores them) and values go into the
sequences' blocks, and attention reads them back through the block table with
:func:`attention_core.paged_attention.paged_attention`. :func:`serve` replays a request trace with static or
continuous batching on it and returns the text of every request and the wall time.

Both validate every argument before any work (a ``TypeError``/``ValueError`` naming it). A refused
:func:`paged_forward` leaves the cache as it was; :func:`serve` admits a request only when the pool can hold
it to its last token, so it never runs out of blocks half-way, and its loop is bounded (it raises instead of
spinning). :func:`serve` gives the model back in the training mode it came in.
"""

from __future__ import annotations

import math
import time
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F

from attention_core._checks import check_int, fmt_shape, short_repr
from attention_core.models._inputs import check_token_ids
from attention_core.models.language_model import DecoderLM
from attention_core.paged_attention import PAGED_PATHS, _paged_attention
from attention_core.serving.blocks import OutOfBlocks, PagedKVCache
from attention_core.serving.scheduler import Request, check_schedule, check_start, static_groups, step_bound
from attention_core.training.modes import eval_mode

__all__ = ["new_paged_cache", "paged_forward", "serve"]


def _check_model(model: object) -> DecoderLM:
    if not isinstance(model, DecoderLM):
        raise TypeError(f"model must be a DecoderLM (chapter 11's model), got {type(model).__name__}")
    if model.attention != "standard":
        raise ValueError(f"model has attention = {model.attention!r}: the paged engine serves standard "
                         "(MHA/GQA) attention only, whose cache holds keys and values")
    if model.options.any:
        raise ValueError(f"model has the options {model.options.describe()}: the paged engine serves the plain "
                         "standard attention only (no gate, sink logits, QK-norm, shared keys or local layers)")
    return model


def new_paged_cache(model: DecoderLM, num_blocks: int, block_size: int = 16) -> PagedKVCache:
    """An empty :class:`~attention_core.serving.blocks.PagedKVCache` shaped for ``model``'s layers (keys stored
    after the rotary rotation), in the model's dtype and on its device."""
    _check_model(model)
    attn = model.blocks[0].attn
    weight = model.embed.weight
    return PagedKVCache(model.num_layers, num_blocks, block_size, attn.num_kv_heads, attn.head_dim,
                        dtype=weight.dtype, device=weight.device)


def _check_forward(model: DecoderLM, cache: PagedKVCache, seqs: Sequence[int], tokens: torch.Tensor,
                   path: str) -> List[int]:
    """Every refusal of :func:`paged_forward`, before the cache is touched."""
    _check_model(model)
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache (new_paged_cache(model, ...)), got {type(cache).__name__}")
    attn = model.blocks[0].attn
    want = (model.num_layers, attn.num_kv_heads, attn.head_dim)
    have = (cache.num_layers, cache.keys[0].shape[1], cache.keys[0].shape[3])
    if have != want:
        raise ValueError(f"cache has (num_layers, num_kv_heads, head_dim) = {have} but the model needs {want}; "
                         "build it with new_paged_cache(model, ...)")
    if cache.keys[0].dtype != model.embed.weight.dtype or cache.keys[0].device != model.embed.weight.device:
        raise ValueError(f"cache holds {cache.keys[0].dtype} on {cache.keys[0].device} but the model is "
                         f"{model.embed.weight.dtype} on {model.embed.weight.device}")
    if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
        raise TypeError(f"seqs must be a list of sequence ids, got {type(seqs).__name__}")
    seqs = list(seqs)
    for s in seqs:
        cache._seq(s, "seqs")
    if len(set(seqs)) != len(seqs):
        raise ValueError(f"seqs must not repeat a sequence, got {short_repr(seqs)}")
    check_token_ids(tokens, "tokens", model.vocab_size, model.embed.weight.device, (torch.int32, torch.int64))
    B, L = tokens.shape
    if B != len(seqs) or L < 1:
        raise ValueError(f"tokens must be (B, L) with B = len(seqs) = {len(seqs)} and L >= 1, got "
                         f"{fmt_shape(tokens.shape)}")
    longest = max(cache.lengths[s] for s in seqs) + L
    if longest > model.rotary.max_len:
        raise ValueError(f"tokens adds L = {L} to sequences holding up to {longest - L} tokens: positions up to "
                         f"{longest - 1}, but the model covers max_positions = {model.rotary.max_len}")
    if not isinstance(path, str) or path not in PAGED_PATHS:
        raise ValueError(f"path must be one of {PAGED_PATHS}, got {short_repr(path)}")
    need = sum(cache.blocks_needed(s, L) for s in seqs)
    if need > cache.allocator.num_free:
        raise OutOfBlocks(f"seqs need {need} blocks for L = {L} more tokens, {cache.allocator.num_free} are free")
    return seqs


@torch.no_grad()
def paged_forward(model: DecoderLM, cache: PagedKVCache, seqs: Sequence[int], tokens: torch.Tensor,
                  path: str = "chunked") -> torch.Tensor:
    """Logits (B, L, V) for ``tokens`` (B, L), the next L tokens of each sequence in ``seqs`` (extends them).

    Transactional: every argument is checked before the cache is touched (``TypeError``/``ValueError``, or
    :class:`~attention_core.serving.blocks.OutOfBlocks` when the pool cannot hold the new tokens), and a call
    that fails later (a path that refuses, say) gives every sequence back its length, table and blocks.
    """
    seqs = _check_forward(model, cache, seqs, tokens, path)
    views = [cache.sequence_view(s) for s in seqs]
    snaps = [v.snapshot() for v in views]
    try:
        return _paged_forward(model, cache, seqs, tokens, path)
    except BaseException:
        for v, snap in zip(views, snaps):
            v.restore(snap)
        raise
    finally:  # the transaction is over: no block stays pinned for these snapshots
        for snap in snaps:
            snap.release()


def _paged_forward(model: DecoderLM, cache: PagedKVCache, seqs: List[int], tokens: torch.Tensor,
                   path: str) -> torch.Tensor:
    B, L = tokens.shape
    positions = [cache.reserve(s, L) for s in seqs]
    table, lens = cache._block_table(seqs)  # one table per call, read by every layer
    scale = 1.0 / math.sqrt(model.blocks[0].attn.head_dim)
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
        for b, s in enumerate(seqs):  # the model's own tensors at reserved positions: written unchecked
            cache._write(layer, s, positions[b], k[b], v[b])
        o = _paged_attention(q, cache.keys[layer], cache.values[layer], table, lens, scale, path)  # (B, Hq, L, E)
        x = x + attn.out_proj(o.transpose(1, 2).reshape(B, L, Hq * E))  # (B, Hq, L, E) -> (B, L, D)
        x = x + block.linear2(F.gelu(block.linear1(block.norm2(x))))
    return model.lm_head(model.norm(x))


def _check_serve(model, requests, prompts, max_batch, policy, num_blocks, block_size, start) -> Dict[int, Request]:
    _check_model(model)
    by_id = check_schedule(requests, max_batch)
    if not isinstance(policy, str) or policy not in ("static", "continuous"):
        raise ValueError(f"policy must be 'static' or 'continuous', got {short_repr(policy)}")
    check_start(start)
    check_int(num_blocks, "num_blocks", low=1)
    check_int(block_size, "block_size", low=1)
    if not isinstance(prompts, dict):
        raise TypeError(f"prompts must be a dict from request id to a (prompt_len,) token tensor, got "
                        f"{type(prompts).__name__}")
    V, max_len, device = model.vocab_size, model.rotary.max_len, model.embed.weight.device
    for rid, r in by_id.items():
        if rid not in prompts:
            raise ValueError(f"prompts has no entry for request {rid}")
        t = check_token_ids(prompts[rid], f"prompts[{rid}]", V, device, (torch.int32, torch.int64), rank=1)
        if tuple(t.shape) != (r.prompt_len,):
            raise ValueError(f"prompts[{rid}] must be a ({r.prompt_len},) integer tensor (its prompt_len), got "
                             f"{t.dtype} {fmt_shape(t.shape)}")
        if r.prompt_len + r.output_len - 1 > max_len:
            raise ValueError(f"request {rid} needs prompt_len + output_len - 1 = {r.prompt_len + r.output_len - 1} "
                             f"positions, but the model covers max_positions = {max_len}")
        if _blocks_for(r, block_size) > num_blocks:
            raise ValueError(f"request {rid} needs {_blocks_for(r, block_size)} blocks of block_size = {block_size} "
                             f"alone, but num_blocks = {num_blocks}")
    if policy == "static":  # a group decodes every member until its longest one is done
        for _, group in static_groups(list(by_id.values()), max_batch, start):
            length = max(r.output_len for r in group)
            need = sum(_blocks_for(r, block_size, length) for r in group)
            if need > num_blocks:
                raise ValueError(f"num_blocks = {num_blocks} cannot hold the static group of requests "
                                 f"{[r.rid for r in group]} ({need} blocks): raise num_blocks or lower max_batch")
            longest = max(r.prompt_len for r in group) + length - 1
            if longest > max_len:
                raise ValueError(f"the static group of requests {[r.rid for r in group]} decodes up to position "
                                 f"{longest - 1}, but the model covers max_positions = {max_len}")
    return by_id


def _blocks_for(r: Request, block_size: int, steps: int = 0) -> int:
    """Blocks a request holds at its end: its prompt and every written token but the last (never fed back);
    ``steps``: decoded for that many steps instead (a static group runs to its longest member's end)."""
    return -(-(r.prompt_len + max(steps, r.output_len) - 1) // block_size)


@torch.no_grad()
def serve(model: DecoderLM, requests: Sequence[Request], prompts: Dict[int, torch.Tensor], max_batch: int,
          policy: str = "continuous", num_blocks: int = 512, block_size: int = 16, start: str = "idle"
          ) -> Tuple[Dict[int, List[int]], int, float]:
    """Greedy-decode every request on ``model`` with ``policy`` ``"static"`` or ``"continuous"`` batching.

    Arrivals are in steps (one engine iteration = one step). Each step prefills the admitted requests (one
    call each) and decodes all running ones in one batched call. Static batching keeps a finished request's
    row in the batch until its group is done (decoding padding, as a fixed batch does); its group starts when
    the engine is idle with every waiting request up to ``max_batch`` (``start="idle"``), or once ``max_batch``
    requests have arrived (``start="full"``), as :func:`~attention_core.serving.scheduler.static_batching`
    schedules them (``start`` is ignored by continuous batching). Continuous batching
    admits a request only when the pool can hold it, with every running request, to its last token.

    Every argument is checked first: ``max_batch``, ``num_blocks``, ``block_size`` ints >= 1; each request's
    fields ints (:func:`~attention_core.serving.scheduler.check_requests`), its prompt a (prompt_len,) tensor of
    ids, its length within the model's positions and the pool. The model runs in eval mode and gets its own
    modes back, also on error.

    Returns:
        ``(outputs, steps, seconds)``: the written tokens per request id, the engine steps, the wall time.
    """
    by_id = _check_serve(model, requests, prompts, max_batch, policy, num_blocks, block_size, start)
    with eval_mode(model):
        return _serve(model, by_id, prompts, max_batch, policy, num_blocks, block_size, start)


def _serve(model, by_id, prompts, max_batch, policy, num_blocks, block_size, start="idle"):
    """The engine loop on checked arguments. It calls the unchecked ``_paged_forward``: the ids come from argmax,
    the lengths were checked against the model's positions, admission keeps every request's blocks in the pool,
    and the cache is this call's own (a failure discards it, so no snapshot is needed)."""
    cache = new_paged_cache(model, num_blocks, block_size)
    waiting = sorted(by_id.values(), key=lambda r: (r.arrival, r.rid))
    out: Dict[int, List[int]] = {}
    running: List[int] = []
    step, began = 0, time.perf_counter()
    bound = step_bound(list(by_id.values()))  # every step admits, decodes or waits for an arrival
    while waiting or running:
        if step > bound:
            raise RuntimeError(f"serve made no progress after {step} steps (bound {bound}); this is a bug")
        admit: List[Request] = []
        if policy == "continuous":
            held = sum(_blocks_for(by_id[i], block_size) for i in running)
            while waiting and waiting[0].arrival <= step and len(running) + len(admit) < max_batch:
                need = _blocks_for(waiting[0], block_size)
                if held + need > num_blocks:
                    break  # admitted when running requests finish and free their blocks
                held += need
                admit.append(waiting.pop(0))
        elif not running:
            group = waiting[:max_batch]
            if start == "idle":  # every request waiting now, up to max_batch (waiting is in arrival order)
                group = [r for r in group if r.arrival <= step]
            if group and max(r.arrival for r in group) <= step:
                admit, waiting = group, waiting[len(group):]
        decode = list(running)
        if decode:
            last = torch.tensor([[out[i][-1]] for i in decode], device=model.embed.weight.device)  # (B, 1)
            logits = _paged_forward(model, cache, decode, last, "chunked")[:, -1]
            for i, t in zip(decode, logits.argmax(-1).tolist()):
                out[i].append(t)
        for r in admit:
            cache.add_sequence(r.rid)
            logits = _paged_forward(model, cache, [r.rid], prompts[r.rid][None], "chunked")[:, -1]
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
    return out, step, time.perf_counter() - began
