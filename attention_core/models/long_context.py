"""Running a rotary decoder past its training length with every key kept but the offsets capped.

Past its training length a rotary model meets two new things at once: offsets between query and key it never saw,
and more keys per query than it ever had. A sliding window removes both. :func:`forward_clamped_offsets` removes
only the first: every query still attends to *every* earlier key, but a key further back than ``max_offset`` is
scored as if it sat exactly ``max_offset`` positions back (the rectified RoPE of Su, 2023). Since a rotary score
depends on the two positions only through their difference, the score of query ``i`` and key ``j`` is

- ``rope(q_i, i) . rope(k_j, j)`` when ``i - j <= max_offset`` (as usual),
- ``rope(q_i, max_offset) . rope(k_j, 0)`` when ``i - j > max_offset`` (the offset clamped),

so the model sees no offset above ``max_offset`` and no key is dropped. With ``max_offset >= L - 1`` nothing is
clamped and the logits are the model's own (a test checks it).

An optional ``attn_mask`` drops keys as well (True = the key takes part, joined to the causal mask), so that the
two changes can be made one at a time, in either order: :func:`recent_and_spread_mask` keeps each query's most
recent keys and a few spread over the older ones, so that a query sees few keys but some at long offsets.

It reads the weights of a :class:`~attention_core.models.language_model.DecoderLM` (embedding, blocks, read-out)
and recomputes its forward pass with this attention; the model itself is not changed.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from attention_core._checks import check_positive_int, check_tensor, fmt_shape
from attention_core.masks import causal_mask
from attention_core.models._inputs import check_token_ids
from attention_core.models.language_model import CausalSelfAttention, DecoderLM

__all__ = ["clamped_offset_attention", "forward_clamped_offsets", "recent_and_spread_mask"]


def clamped_offset_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rotary,  # noqa: ANN001
                             max_offset: int, attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal self-attention with rotary positions whose query-key offsets are clamped at ``max_offset``.

    Args:
        query: (B, Hq, L, E) queries *before* the rotation.
        key: (B, H, L, E) keys before the rotation (H divides Hq: grouped heads are repeated).
        value: (B, H, L, Ev).
        rotary: the model's :class:`~attention_core.positional.RotaryEmbedding` (positions ``0 .. L - 1``).
        max_offset: the largest offset any query-key pair is scored at (>= 0).
        attn_mask: optional bool (L, L), True = the key takes part; joined to the causal mask. Every query must
            keep its own key (the diagonal), so that no row is empty.

    Returns:
        (B, Hq, L, Ev).
    """
    max_offset = check_positive_int(max_offset, "max_offset", allow_zero=True)
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(t, name)
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, heads, L, features), got shape {fmt_shape(t.shape)}")
    B, Hq, L, E = query.shape
    if key.shape[0] != B or key.shape[2] != L or key.shape[3] != E or value.shape[:3] != key.shape[:3]:
        raise ValueError(f"key (B, H, L, E) and value (B, H, L, Ev) must match query (B, Hq, L, E) = "
                         f"{fmt_shape(query.shape)}, got {fmt_shape(key.shape)} and {fmt_shape(value.shape)}")
    H = key.shape[1]
    allowed = causal_mask(L, device=query.device)  # (L, L)
    if attn_mask is not None:
        check_tensor(attn_mask, "attn_mask")
        if attn_mask.dtype != torch.bool or attn_mask.shape != (L, L):
            raise ValueError(f"attn_mask must be a bool (L, L) = ({L}, {L}) tensor, got {attn_mask.dtype} of shape "
                             f"{fmt_shape(attn_mask.shape)}")
        if not bool(attn_mask.diagonal().all()):
            raise ValueError("attn_mask must keep every query's own key (its diagonal must be all True)")
        allowed = allowed & attn_mask.to(query.device)
    if Hq % H:
        raise ValueError(f"key has {H} heads, which must divide the query's {Hq}")
    key, value = key.repeat_interleave(Hq // H, dim=1), value.repeat_interleave(Hq // H, dim=1)  # -> (B, Hq, L, .)
    near = rotary.rotate(query, 0, "query") @ rotary.rotate(key, 0, "key").transpose(-2, -1)  # (B, Hq, L, L)
    cap = min(max_offset, rotary.max_len - 1)
    q_far = rotary.rotate(query.unsqueeze(-2), cap, "query")  # every row at position cap: (B, Hq, L, 1, E)
    far = q_far.squeeze(-2) @ key.transpose(-2, -1)  # keys at position 0: offset = cap, (B, Hq, L, L)
    i = torch.arange(L, device=query.device)[:, None]  # (L, 1)
    j = torch.arange(L, device=query.device)[None, :]  # (1, L)
    scores = torch.where(i - j <= max_offset, near, far) / math.sqrt(E)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(-1) @ value  # (B, Hq, L, Ev)


@torch.no_grad()
def forward_clamped_offsets(model, tokens: torch.Tensor, max_offset: int,  # noqa: ANN001
                            attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits (B, L, V) of ``model`` (a ``DecoderLM``) on ``tokens`` (B, L) with every key kept (or those of the
    bool (L, L) ``attn_mask``) and the rotary offsets clamped at ``max_offset`` (see the module's docstring)."""
    if not isinstance(model, DecoderLM) or not isinstance(model.blocks[0].attn, CausalSelfAttention):
        raise TypeError(f"model must be a DecoderLM with standard (not latent) attention, got {type(model).__name__}")
    if model.options.any:
        raise ValueError(f"model has the options {model.options.describe()}: the clamped-offset forward runs the "
                         "plain standard attention only")
    check_token_ids(tokens, "tokens", model.vocab_size, model.embed.weight.device, (torch.int64, torch.int32))
    check_positive_int(max_offset, "max_offset", allow_zero=True)
    B, L = tokens.shape
    if L == 0:
        return model.embed.weight.new_zeros(B, 0, model.vocab_size)  # (B, 0, V)
    if L > model.rotary.max_len:
        raise ValueError(f"tokens has L = {L} positions but the model covers max_positions = {model.rotary.max_len}")
    x = model.embed(tokens)  # (B, L) -> (B, L, D)
    for block in model.blocks:
        attn = block.attn
        h = block.norm1(x)
        q = attn.q_proj(h).view(B, L, attn.num_heads, attn.head_dim).transpose(1, 2)  # (B, L, D) -> (B, Hq, L, E)
        k = attn.k_proj(h).view(B, L, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # -> (B, H, L, E)
        v = attn.v_proj(h).view(B, L, attn.num_kv_heads, attn.head_dim).transpose(1, 2)  # -> (B, H, L, E)
        out = clamped_offset_attention(q, k, v, model.rotary, max_offset, attn_mask)
        x = x + attn.out_proj(out.transpose(1, 2).reshape(B, L, -1))  # (B, Hq, L, E) -> (B, L, D)
        x = x + block.linear2(F.gelu(block.linear1(block.norm2(x))))
    return model.lm_head(model.norm(x))


def recent_and_spread_mask(length: int, recent: int, spread: int) -> torch.Tensor:
    """Bool (length, length): query ``i`` keeps its ``recent`` most recent keys (itself included) and ``spread``
    of the older ones, evenly spaced from key 0 to key ``i - recent`` (all of them when there are fewer).

    So a query sees at most ``recent + spread`` keys, some of them far back: the keys a sliding window drops are
    dropped, but long offsets are not. Causal (no key after its query).
    """
    for name, value in (("length", length), ("recent", recent)):
        check_positive_int(value, name)
    check_positive_int(spread, "spread", allow_zero=True)
    i = torch.arange(length)[:, None]  # (length, 1)
    j = torch.arange(length)[None, :]  # (1, length)
    mask = (j <= i) & (j > i - recent)  # the recent keys, (length, length)
    older = (i - recent + 1).clamp(min=0)  # (length, 1): keys 0 .. older - 1 are older than the recent ones
    mask |= (j < older) & (older <= spread)  # few older keys: keep them all
    step = (older - 1).clamp(min=0).double() / max(spread - 1, 1)  # (length, 1): > 1 where older > spread
    for s in range(spread):  # many: `spread` of them evenly spaced from key 0 to key older - 1, distinct
        mask |= (j == (s * step).round().long()) & (older > spread)
    return mask
