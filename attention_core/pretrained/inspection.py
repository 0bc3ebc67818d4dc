"""Looking inside a trained encoder: attention entropy, attention received, gradient x input, a head explorer.

These work on what :class:`~attention_core.models.bert.BertEncoder` returns (per-layer attention weights
(B, H, L, L) and an ``attention_mask`` (B, L)), and are what chapter 10 plots for MiniLM:

- :func:`attention_entropy`: how spread out each head's weights are, averaged over the real queries;
- :func:`attention_received`: how much weight each token receives, averaged over heads and real queries;
- :func:`value_contributions`: the vector each token adds per unit of weight, per head (a weight on a
  token whose vector is short changes little);
- :func:`gradient_x_input`: a gradient-based attribution on the word embeddings, to set beside attention
  (attention weights are not an explanation of the output).

The interactive head explorer of chapter 10 is :class:`attention_core.booktools.widgets.HeadExplorer`.
"""

from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch

from attention_core._checks import check_instance, check_tensor, fmt_shape
from attention_core.functional import weights_entropy
from attention_core.models.bert import BertEncoder, BertOutput
from attention_core.multihead import MultiHeadAttention

__all__ = [
    "attention_entropy",
    "attention_received",
    "gradient_x_input",
    "value_contributions",
]


def _check_weights(attentions: Sequence[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
    """Stack per-layer weights (B, H, L, L) into (N, B, H, L, L), checking them against the mask."""
    if isinstance(attentions, torch.Tensor) or len(attentions) == 0:
        raise TypeError("attentions must be a non-empty sequence of (B, H, L, L) tensors, one per layer")
    check_tensor(attention_mask, "attention_mask")
    for i, a in enumerate(attentions):
        check_tensor(a, f"attentions[{i}]")
        if a.dim() != 4 or a.shape[-1] != a.shape[-2] or (a.shape[0], a.shape[-1]) != tuple(attention_mask.shape):
            raise ValueError(
                f"attentions[{i}] must be (B, H, L, L) with (B, L) = {tuple(attention_mask.shape)} "
                f"(the attention_mask), got {fmt_shape(a.shape)}"
            )
    return torch.stack([a.detach() for a in attentions])


def attention_entropy(attentions: Sequence[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) of each head's attention rows, over the real queries of a batch.

    ``H(p) = -sum_k p_k log p_k`` for one query's weights over the keys (0 log 0 = 0): 0 when the query
    attends to one key only, ``log n`` when it spreads evenly over ``n`` real keys.

    Args:
        attentions: one (B, H, L, L) tensor per layer (N layers).
        attention_mask: (B, L), True/1 on real tokens; padding queries are left out.

    Returns:
        (N, H) float tensor.
    """
    w = _check_weights(attentions, attention_mask).float()  # (N, B, H, L, L)
    ent = weights_entropy(w)  # (N, B, H, L, L) -> (N, B, H, L): one entropy per query row
    m = attention_mask.bool().to(w.device)[None, :, None, :]  # (B, L) -> (1, B, 1, L)
    return (ent * m).sum(dim=(1, 3)) / m.sum(dim=(1, 3))  # (N, H)


def attention_received(weights: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Weight each key receives, averaged over heads and over the real queries: (B, H, L, L) -> (B, L).

    Each row sums to 1 over the real keys (padding keys receive 0).
    """
    w = _check_weights([weights], attention_mask)[0].float()  # (B, H, L, L)
    m = attention_mask.bool().to(w.device).float()  # (B, L)
    per_query = w.mean(1)  # (B, H, L, S) -> (B, L, S)
    return (per_query * m[:, :, None]).sum(1) / m.sum(1, keepdim=True)  # (B, S)


def value_contributions(attention: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    """What each token can add to the attention output, per head: ``f_hj = (x_j W_V^h + b_V^h) W_O^h``.

    The output of multi-head self-attention for query ``i`` is ``b_O + sum_h sum_j alpha_hij f_hj``, so a
    weight ``alpha_hij`` matters only as much as the vector ``f_hj`` it multiplies is long: a large weight on
    a token whose ``f`` is short moves the output little.

    Args:
        attention: a self-attention module with ``num_kv_heads == num_heads``.
        x: (B, L, D), the module's input.

    Returns:
        (B, H, L, D) vectors, without gradient.
    """
    check_instance(attention, MultiHeadAttention, "attention", "a MultiHeadAttention")
    if attention.num_kv_heads != attention.num_heads:
        raise ValueError("attention must have num_kv_heads == num_heads (no grouped-query attention here)")
    check_tensor(x, "x")
    if x.dim() != 3 or x.shape[-1] != attention.embed_dim:
        raise ValueError(f"x must be (B, L, D) with D = {attention.embed_dim}, got {fmt_shape(x.shape)}")
    B, L, D = x.shape
    H, E = attention.num_heads, attention.head_dim
    with torch.no_grad():
        v = attention.v_proj(x).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        w_o = attention.out_proj.weight.view(D, H, E)  # (D, H * E) -> (D, H, E)
        return torch.einsum("bhle,dhe->bhld", v, w_o)  # (B, H, L, D)


def gradient_x_input(
    model: BertEncoder,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score: Callable[[BertOutput], torch.Tensor],
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradient x input on the word embeddings: how much each token's word vector moves a scalar score.

    ``a_i = sum_d (d score / d e_id) e_id`` where ``e_i`` is token ``i``'s word embedding (before positions
    and LayerNorm are added); positive values push the score up. Caution: in BERT the sum ``e_i + p_i + s_i``
    (word, position, segment) goes straight into a LayerNorm, which ignores the scale of its input, so the
    gradient is orthogonal to that sum and ``a_i`` equals ``-(d score / d e_i) . (p_i + s_i)`` exactly: it
    says more about the position than about the word, and is no estimate of removing ``e_i`` (chapter 10
    uses leave-one-out instead).

    Args:
        model: the encoder (put in eval mode by the caller; its parameters get no gradient).
        input_ids: (B, L) token ids.
        attention_mask: (B, L), True/1 on real tokens.
        score: maps the model's :class:`~attention_core.models.bert.BertOutput` to a scalar tensor.

    Returns:
        ``(attributions, score)``: (B, L) attributions (0 on padding) and the score's value.
    """
    if not callable(score):
        raise TypeError(f"score must be a callable BertOutput -> scalar tensor, got {type(score).__name__}")
    emb = model.embeddings.word_embeddings(input_ids).detach().requires_grad_()  # (B, L) -> (B, L, D)
    out = model(inputs_embeds=emb, attention_mask=attention_mask)
    value = score(out)
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(f"score must return a scalar tensor, got {value!r:.80}")
    (grad,) = torch.autograd.grad(value, emb)
    attributions = (grad * emb).sum(-1).detach() * attention_mask.to(emb.dtype)  # (B, L, D) -> (B, L)
    return attributions, value.detach()


