"""A small causal language model whose layers mix softmax, sliding-window and linear attention.

Every layer has the same parameters (query, key, value and output projections, a feed-forward network, two
LayerNorms); only how its attention mixes the tokens differs, named per layer in ``layers``:

- ``"softmax"``: causal scaled dot-product attention over every earlier token (a cache that grows);
- ``"window"``: the same, over the last ``window`` tokens only (a cache of fixed size);
- ``"linear"``: causal linear attention with the feature map elu + 1 (a state of fixed size,
  :mod:`attention_core.linear_attention`).

So models that differ only in ``layers`` have exactly the same number of parameters. Positions enter as a learned
embedding added to the input (linear attention has no scores for rotary embeddings to act on in the same way).
"""

from __future__ import annotations

from typing import Any, Dict, Sequence

import torch
import torch.nn as nn

from attention_core._checks import check_positive_int
from attention_core.functional import scaled_dot_product_attention
from attention_core.linear_attention import linear_attention
from attention_core.models._inputs import check_config, check_token_ids

__all__ = ["KINDS", "HybridLM", "MixerBlock", "build_hybrid_lm"]

#: The attention a layer may use.
KINDS = ("softmax", "window", "linear")


class MixerBlock(nn.Module):
    """A pre-LN block: ``h += Attn(LN(h))`` with the attention of ``kind``, then ``h += MLP(LN(h))``."""

    def __init__(self, d_model: int, num_heads: int, kind: str, window: int) -> None:
        super().__init__()
        for name, size in (("d_model", d_model), ("num_heads", num_heads), ("window", window)):
            check_positive_int(size, name)
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.num_heads, self.window = kind, num_heads, window
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        H = self.num_heads
        q, k, v = self.qkv(x).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)  # (B, L, 3D) -> 3 x (B, H, L, E)
        if self.kind == "linear":
            o = linear_attention(q, k, v, is_causal=True)
        else:
            i = torch.arange(L, device=x.device)
            mask = i[None, :] <= i[:, None]  # (L, L) causal
            if self.kind == "window":
                mask = mask & (i[None, :] > i[:, None] - self.window)
            o = scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(B, L, D))  # (B, H, L, E) -> (B, L, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class HybridLM(nn.Module):
    """Token and position embeddings, one :class:`MixerBlock` per entry of ``layers``, a final LayerNorm and
    the tied embedding as the output layer.

    Args:
        vocab_size: number of tokens.
        layers: the attention of each layer, from :data:`KINDS`.
        d_model, num_heads: width and heads (``d_model`` divisible by ``num_heads``).
        context: the longest input (positions are learned).
        window: the window of ``"window"`` layers, the query's own token included.
    """

    def __init__(self, vocab_size: int, layers: Sequence[str] = ("softmax", "softmax"), d_model: int = 64,
                 num_heads: int = 4, context: int = 128, window: int = 16) -> None:
        super().__init__()
        check_positive_int(vocab_size, "vocab_size")
        check_positive_int(d_model, "d_model")
        check_positive_int(num_heads, "num_heads")
        check_positive_int(context, "context")
        check_positive_int(window, "window")
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if isinstance(layers, str) or not isinstance(layers, (list, tuple)) or not layers \
                or any(k not in KINDS for k in layers):
            raise ValueError(f"layers must be a non-empty sequence of {KINDS}, got {layers!r}")
        self.config: Dict[str, Any] = {"vocab_size": vocab_size, "layers": list(layers), "d_model": d_model,
                                       "num_heads": num_heads, "context": context, "window": window}
        self.context = context
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(MixerBlock(d_model, num_heads, k, window) for k in layers)
        self.ln = nn.LayerNorm(d_model)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, L) int64 -> logits (B, L, vocab_size)."""
        check_token_ids(tokens, "tokens", self.config["vocab_size"], self.embed.weight.device)
        L = tokens.shape[1]
        if L > self.context:
            raise ValueError(f"tokens has length {L}, longer than the model's context {self.context}")
        h = self.embed(tokens) + self.pos(torch.arange(L, device=tokens.device))  # (B, L, D)
        for block in self.blocks:
            h = block(h)
        return self.ln(h) @ self.embed.weight.T  # (B, L, D) @ (D, V) -> (B, L, V)

    def decode_state_elements(self, tokens: int) -> int:
        """Numbers one sequence keeps while decoding after ``tokens`` tokens, over all layers: keys and values
        for softmax layers (all tokens) and window layers (the last ``window``), ``E (E + 1)`` per head for
        linear layers (the state ``S`` and the normalizer ``z``)."""
        n = check_positive_int(tokens, "tokens", allow_zero=True)
        D, H = self.config["d_model"], self.config["num_heads"]
        E = D // H
        per = {"softmax": 2 * D * n, "window": 2 * D * min(n, self.config["window"]), "linear": H * E * (E + 1)}
        return sum(per[k] for k in self.config["layers"])

    def attention_flops_per_token(self, tokens: int) -> int:
        """Multiply-adds of attention itself (scores and weighted sums, not the projections) for the token at
        position ``tokens`` while decoding, over all layers: ``2 D n`` for softmax over ``n`` keys, ``2 D w`` for
        a window, ``2 H E (E + 1)`` for a linear layer (one state write, one read)."""
        n = check_positive_int(tokens, "tokens")
        D, H = self.config["d_model"], self.config["num_heads"]
        E = D // H
        per = {"softmax": 2 * D * n, "window": 2 * D * min(n, self.config["window"]), "linear": 2 * H * E * (E + 1)}
        return sum(per[k] for k in self.config["layers"])


def build_hybrid_lm(config: Dict[str, Any], seed: int = 0) -> HybridLM:
    """A :class:`HybridLM` from its config dict (what a checkpoint stores), its weights drawn from a generator
    seeded with ``seed`` inside ``torch.random.fork_rng``: torch's global generator is left as it was."""
    config = check_config(config, "config", ("vocab_size",), ("layers", "d_model", "num_heads", "context", "window"))
    check_positive_int(seed, "seed", allow_zero=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return HybridLM(**config)
