"""A small decoder-only Transformer language model, its key/value cache, and how it generates text.

The model (:class:`DecoderLM`, GPT-style) is a token embedding, a stack of pre-LN blocks (causal self-attention
with rotary positions, then a feed-forward network, each in a residual connection) and a read-out tied to the
embedding. Attention may share key/value heads (``num_kv_heads``: grouped-query or multi-query attention).

Generation runs in two phases with a :class:`KVCache`:

- **prefill**: the prompt goes through the model in one pass; every layer stores its keys and values;
- **decode**: each new token goes through alone, attends to the cached keys and values plus its own, and adds
  them to the cache. The logits are those of a full recomputation over the whole text, at a cost per token
  that grows with the length instead of with its square.

The cache (:class:`~attention_core.models.kv_cache.KVCache`) is preallocated per layer and written in place. A full
or window-only cache stores keys already rotated at their position in the text (rotated once, never again); a
cache with ``sinks=n`` (StreamingLLM, Xiao et al., 2023) stores keys before the rotation and rotates them by
their slot at every step, because evicting an old token moves every later one to a new slot. A cache built with
``window=W`` keeps only the ``W - 1`` most recent tokens between steps (each query sees itself and those).
Batched generation takes left-padded prompts (``pad``): positions start at each row's first real token and no
real token reads padding.

Masks come from :mod:`attention_core.mask_mods` (:func:`~attention_core.models.kv_cache.decode_mask_mod`); the
decode step's mask is aligned bottom-right (the last query sees every key), unlike SDPA's ``is_causal``.
A full-sequence call may instead take a ``block_mask``
(:func:`attention_core.flex_attention.create_block_mask`), run through
:func:`attention_core.flex_attention.flex_attention`.

The attention of every layer is multi-head (``num_kv_heads = num_heads``), grouped-query, multi-query
(``num_kv_heads = 1``) or multi-head latent attention (``attention="latent"``, DeepSeek-V2: the cache holds a
latent and a rotary key per token, and decoding reads it in the absorbed form). Standard attention takes the
options of recent models (:mod:`attention_core.models.attention_variants`): an output gate, learned sink logits,
QK-norm, keys and values shared across layers, local/global layers, gated delta layers in a hybrid stack (their
fixed-size state in the cache), top-k attention chosen by a learned indexer; all are off unless a config names them.
:func:`parameter_count` and :func:`feedforward_for_budget` count a config's parameters and match a budget.

Sampling (:func:`sample_next_token`, :func:`generate`): greedy (``temperature=0``), temperature, top-k and top-p
(nucleus), drawn with a seeded ``torch.Generator`` so that a generation repeats exactly. They live in their own
modules, :mod:`attention_core.models.sampling` and :mod:`attention_core.models.generation`, and are re-exported
here; neither imports this module back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from attention_core._checks import (
    check_bool_flag,
    check_int,
    check_positive_int,
    check_tensor,
    fmt_shape,
)
from attention_core.flex_attention import BlockMask, create_block_mask, flex_attention
from attention_core.functional import attention
from attention_core.mask_mods import and_masks, sliding_window
from attention_core.models.attention_variants import (
    AttentionOptions,
    VariantSelfAttention,
    count_parameters,
    layer_is_local,
    layer_kind,
    local_decode_mask,
)
from attention_core.models.gated_delta import GatedDeltaLayer
from attention_core.models.generation import generate
from attention_core.models.kv_cache import KVCache, _release_snapshot, cached_causal_mask, decode_mask, rotate_at
from attention_core.models.latent_attention import LatentSelfAttention
from attention_core.models.sampling import filter_top_k, filter_top_p, sample_next_token
from attention_core.multihead import MultiHeadAttention
from attention_core.positional import RotaryEmbedding

__all__ = [
    "DecoderBlock",
    "DecoderLM",
    "KVCache",
    "LMConfig",
    "LMOutput",
    "CausalSelfAttention",
    "build_language_model",
    "cached_causal_mask",
    "feedforward_for_budget",
    "filter_top_k",
    "filter_top_p",
    "generate",
    "left_pad",
    "parameter_count",
    "sample_next_token",
]


# ------------------------------------------------------------------------------------------------ plan


@dataclass
class _Plan:
    """What every layer of one call shares: where the new tokens sit and what they may read.

    ``positions``: rotation positions of the new tokens, (L,) or (B, L) (``None`` when ``rerotate``);
    ``rerotate``: the cache holds keys before the rotation (sinks) and every key is rotated by its slot;
    ``mask``/``is_causal``: the attention mask (dense, from the mask mods) or SDPA's flag;
    ``block_mask``: a flex-attention block mask instead (full-sequence calls only);
    ``shared``: each key/value group's keys and values, from the layer that computes them to the layers that
    reuse them (cross-layer sharing); ``local``: the plan of each local layer (a sliding window), by layer;
    ``real``: (B, L) bool, the tokens that are not left padding (``None``: all; the gated delta layers skip the
    others); ``index_dense``: indexed layers attend to every allowed key (the indexer's warm-up);
    ``index_losses``: a list each indexed layer appends its indexer loss to, or ``None`` (not asked).
    """

    positions: Optional[torch.Tensor]
    rerotate: bool
    mask: Optional[torch.Tensor]
    is_causal: bool
    block_mask: Optional[BlockMask] = None
    shared: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    local: Dict[int, _Plan] = field(default_factory=dict)
    real: Optional[torch.Tensor] = None
    index_dense: bool = False
    index_losses: Optional[List[torch.Tensor]] = None


def left_pad(rows: List[torch.Tensor], pad_id: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D prompts of different lengths, padded on the left: ``(tokens (B, P), pad (B,) int64)``."""
    if not rows or any(not isinstance(r, torch.Tensor) or r.dim() != 1 or r.numel() == 0 for r in rows):
        raise ValueError("rows must be a non-empty list of non-empty 1-D token tensors")
    if any(r.dtype != rows[0].dtype or r.dtype not in (torch.int64, torch.int32) for r in rows):
        raise TypeError(f"rows must all hold int64 (or int32) token ids of one dtype, got "
                        f"{sorted({str(r.dtype) for r in rows})}")
    P = max(r.numel() for r in rows)
    tokens = torch.full((len(rows), P), pad_id, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        tokens[i, P - r.numel() :] = r
    return tokens, torch.tensor([P - r.numel() for r in rows], dtype=torch.long)


# ------------------------------------------------------------------------------------------------ model


@dataclass
class LMOutput:
    """What :class:`DecoderLM` returns: ``logits`` (B, L, V) and, when asked, every layer's attention
    weights, a list of (B, Hq, L, S) tensors (``None`` for a gated delta layer), and the indexer loss
    (``need_index_loss``: the mean over the indexed layers of DSA's KL, a 0-d tensor)."""

    logits: torch.Tensor
    weights: Optional[List[Optional[torch.Tensor]]] = None
    index_loss: Optional[torch.Tensor] = None


class CausalSelfAttention(MultiHeadAttention):
    """Causal multi-head (or grouped-query) self-attention with rotary positions and an optional cache.

    The projections and their checks are those of :class:`attention_core.MultiHeadAttention` (no biases here,
    as in Llama); queries and keys are rotated (RoPE) between the projection and the attention.
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: Optional[int] = None) -> None:
        super().__init__(embed_dim, num_heads, num_kv_heads, bias=False)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        rotary: RotaryEmbedding,
        cache: Optional[KVCache],
        layer: int,
        plan: _Plan,
        need_weights: bool = False,
        absorbed: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Self-attention of ``x`` (B, L, D), after the cached tokens if a cache is given.

        Args:
            x: (B, L, D) the new tokens' inputs.
            rotary: the model's rotary embedding.
            cache: a :class:`KVCache` to read and extend at ``layer``, or ``None``.
            layer: this layer's index in the cache.
            plan: positions, mask and rotation policy of this call (built once by the model).
            need_weights: also return the weights (B, Hq, L, S).
            absorbed: unused here (latent attention only).

        Returns:
            ``(out, weights_or_None)``, out (B, L, D).
        """
        B, L, _ = x.shape
        Hq, H, E = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, L, Hq, E).transpose(1, 2)  # (B, L, D) -> (B, Hq, L, E)
        k = self.k_proj(x).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        v = self.v_proj(x).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        if plan.rerotate:  # sinks: the cache holds keys before RoPE; slots move as tokens are evicted
            k, v = cache.update(layer, k, v)  # (B, H, S, E): the cached keys and values, then these
            q = rotary.rotate(q, offset=k.shape[2] - L, name="query")  # queries sit at the last L slots
            k = rotary.rotate(k, offset=0, name="key")  # keys at slots 0 .. S - 1, rotated anew
        else:  # rotate once, at the tokens' positions in the text; the cache keeps rotated keys
            q, k = rotate_at(rotary, q, plan.positions), rotate_at(rotary, k, plan.positions)
            if cache is not None:
                k, v = cache.update(layer, k, v)  # (B, H, S, E)
        if plan.block_mask is not None:
            out, weights = flex_attention(q, k, v, block_mask=plan.block_mask, enable_gqa=H != Hq), None
        else:
            args = (q, k, v, plan.mask, 0.0, plan.is_causal)
            out, weights = attention(*args, enable_gqa=H != Hq, need_weights=need_weights)
        out = out.transpose(1, 2).reshape(B, L, Hq * E)  # (B, Hq, L, E) -> (B, L, D)
        return self.out_proj(out), weights


class DecoderBlock(nn.Module):
    """Pre-LN decoder block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (GELU feed-forward).

    ``attn`` is :class:`CausalSelfAttention` (MHA, GQA, MQA) or, with ``latent=(d_c, d_r)``,
    :class:`~attention_core.models.latent_attention.LatentSelfAttention` (MLA, head size D / num_heads), or, with
    ``options`` that change the attention (gate, sink logits, QK-norm, shared keys and values, indexer),
    :class:`~attention_core.models.attention_variants.VariantSelfAttention` for layer ``layer``, or, for a ``"D"``
    of ``layer_pattern``, :class:`~attention_core.models.gated_delta.GatedDeltaLayer` (the gated delta rule).
    """

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: Optional[int], dim_feedforward: int,
                 latent: Optional[Tuple[int, int]] = None, options: Optional[AttentionOptions] = None,
                 layer: int = 0) -> None:
        super().__init__()
        for name, size in (("d_model", d_model), ("num_heads", num_heads), ("dim_feedforward", dim_feedforward)):
            check_positive_int(size, name)
        self.norm1 = nn.LayerNorm(d_model)
        if options is not None and layer_kind(options.layer_pattern, layer) == "D":
            self.attn: nn.Module = GatedDeltaLayer(d_model, check_positive_int(num_heads, "num_heads"))
        elif options is not None and options.changes_attention:
            self.attn = VariantSelfAttention(d_model, num_heads, num_kv_heads, options, layer)
        elif latent is None:
            self.attn = CausalSelfAttention(d_model, num_heads, num_kv_heads)
        else:
            check_positive_int(num_heads, "num_heads")
            if d_model % num_heads:
                raise ValueError(f"d_model = {d_model} must be divisible by num_heads = {num_heads}")
            self.attn = LatentSelfAttention(d_model, num_heads, d_model // num_heads, *latent)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, cache: Optional[KVCache], layer: int, plan: _Plan,
                need_weights: bool = False, absorbed: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(B, L, D) -> (B, L, D), and the attention weights when asked."""
        a, weights = self.attn(self.norm1(x), rotary, cache, layer, plan, need_weights, absorbed)
        x = x + a
        x = x + self.linear2(F.gelu(self.linear1(self.norm2(x))))
        return x, weights


class DecoderLM(nn.Module):
    """A decoder-only Transformer language model (GPT-style, pre-LN, rotary positions, tied read-out).

    Args:
        vocab_size: V, number of tokens.
        d_model: D, the model width.
        num_layers: number of :class:`DecoderBlock`.
        num_heads: query heads per layer (D divisible by it; head size E = D / num_heads, even for RoPE).
        num_kv_heads: key/value heads (default ``num_heads``: MHA; 1: MQA; in between: GQA).
        dim_feedforward: hidden width of the feed-forward networks (default 4 D).
        context: the length the model is trained on (recorded; longer inputs are allowed).
        max_positions: positions the rotary table covers (a full cache's text and a cache's slots stay below it).
        rope_base: the rotary wavelength scale.
        attention: ``"standard"`` (MHA/GQA/MQA by ``num_kv_heads``) or ``"latent"`` (MLA).
        kv_latent_dim: MLA's d_c, the cached latent's size (``attention="latent"`` only).
        rope_dim: MLA's d_r, the decoupled rotary key's size, even (``attention="latent"`` only).
        output_gate, sink_logits, qk_norm, kv_share, layer_pattern, local_window: the recent-model options of
            :mod:`attention_core.models.attention_variants` (output gate, learned sink logits, QK-norm,
            cross-layer key/value sharing, local/global layers, and ``"D"`` in ``layer_pattern``: gated delta
            layers, :class:`~attention_core.models.gated_delta.GatedDeltaLayer`); ``None`` = off (standard
            attention only).
        index_topk, index_heads, index_dim: learned sparse attention (DeepSeek Sparse Attention): every attention
            layer gets a lightning indexer (``index_heads`` heads of width ``index_dim``, defaults 4 and 16) and
            each query attends to the ``index_topk`` keys of largest index score among those it may read. The
            indexer learns from its own loss only (``need_index_loss``); see
            :mod:`attention_core.models.attention_variants`.
    """

    def __init__(self, vocab_size: int, d_model: int = 128, num_layers: int = 4, num_heads: int = 4,
                 num_kv_heads: Optional[int] = None, dim_feedforward: Optional[int] = None, context: int = 128,
                 max_positions: int = 8192, rope_base: float = 10000.0, attention: str = "standard",
                 kv_latent_dim: Optional[int] = None, rope_dim: Optional[int] = None,
                 output_gate: Optional[bool] = None, sink_logits: Optional[bool] = None,
                 qk_norm: Optional[bool] = None, kv_share: Optional[int] = None, layer_pattern: Optional[str] = None,
                 local_window: Optional[int] = None, index_topk: Optional[int] = None,
                 index_heads: Optional[int] = None, index_dim: Optional[int] = None) -> None:
        super().__init__()
        for name, n in {"vocab_size": vocab_size, "d_model": d_model, "num_layers": num_layers,
                        "context": context, "max_positions": max_positions}.items():
            check_positive_int(n, name)
        dim_feedforward = 4 * d_model if dim_feedforward is None else check_positive_int(dim_feedforward,
                                                                                         "dim_feedforward")
        if attention not in ("standard", "latent"):
            raise ValueError(f"attention must be 'standard' or 'latent', got {attention!r}")
        latent = None
        if attention == "latent":
            if kv_latent_dim is None or rope_dim is None or num_kv_heads is not None:
                raise ValueError("attention='latent' needs kv_latent_dim and rope_dim (and no num_kv_heads), got "
                                 f"kv_latent_dim={kv_latent_dim}, rope_dim={rope_dim}, num_kv_heads={num_kv_heads}")
            latent = (check_positive_int(kv_latent_dim, "kv_latent_dim"), check_positive_int(rope_dim, "rope_dim"))
        elif kv_latent_dim is not None or rope_dim is not None:
            raise ValueError("kv_latent_dim and rope_dim belong to attention='latent'")
        self.options = AttentionOptions.check(num_layers, attention, output_gate, sink_logits, qk_norm, kv_share,
                                              layer_pattern, local_window, index_topk, index_heads, index_dim)
        self.vocab_size, self.d_model, self.num_layers, self.context = vocab_size, d_model, num_layers, context
        self.attention = attention
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            DecoderBlock(d_model, num_heads, num_kv_heads, dim_feedforward, latent, self.options, i)
            for i in range(num_layers)
        )
        self.local_layers = tuple(layer_is_local(layer_pattern, i) for i in range(num_layers))
        self.recurrent_layers = tuple(layer_kind(layer_pattern, i) == "D" for i in range(num_layers))
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tied read-out (GPT-2)
        attn = self.blocks[self.recurrent_layers.index(False)].attn  # an attention layer (there is one)
        self.num_heads, self.head_dim = attn.num_heads, attn.head_dim
        self.num_kv_heads = attn.num_kv_heads if latent is None else None
        rotary_dim = self.head_dim if latent is None else latent[1]
        self.rotary = RotaryEmbedding(rotary_dim, max_len=max_positions, base=rope_base)
        self.config: Dict[str, Any] = {}
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.num_layers) if name.endswith(("out_proj.weight", "o_proj.weight",
                                                                              "linear2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith(".bias"):  # not the gated delta layers' dt_bias (Mamba2's initialisation)
                nn.init.zeros_(p)

    def new_cache(self, window: Optional[int] = None, sinks: int = 0, max_len: Optional[int] = None) -> KVCache:
        """An empty :class:`KVCache` for this model (full, or rolling with ``window`` and ``sinks``; ``max_len``:
        preallocate that many slots, a static cache). A full cache of a model with local layers rolls the entries
        that only local layers read (``layer_windows``): they hold ``local_window - 1`` tokens between calls."""
        W, share = self.options.local_window, self.options.kv_share
        recurrent = list(self.recurrent_layers) if any(self.recurrent_layers) else None  # kv_share is 1 then
        if W is None or window is not None or sinks:
            return KVCache(self.cache_layers, window, sinks, max_len=max_len, recurrent=recurrent)
        rolling = [W if all(self.local_layers[g * share : (g + 1) * share]) else None for g in range(self.cache_layers)]
        return KVCache(self.cache_layers, max_len=max_len, layer_windows=None if set(rolling) == {None} else rolling,
                       recurrent=recurrent)

    @property
    def cache_layers(self) -> int:
        """How many entries the cache holds, one per layer or one per group of ``kv_share`` layers that share keys
        and values."""
        return self.num_layers // self.options.kv_share

    def cache_numbers_per_token(self) -> int:
        """Numbers the cache holds per token and attention layer: ``2 H_kv E`` (``2 H_kv E / kv_share`` when
        layers share keys and values), plus ``ceil(d_I / E) E`` with an indexer (its key per token, stored as
        extra key heads), or ``d_c + d_r`` for latent attention."""
        a = self.blocks[self.recurrent_layers.index(False)].attn
        if self.attention == "latent":
            return a.kv_latent_dim + a.rope_dim
        index = 0 if self.options.index_dim is None else -(-self.options.index_dim // a.head_dim) * a.head_dim
        return (2 * a.num_kv_heads * a.head_dim + index) // self.options.kv_share

    def cache_bytes(self, tokens: int, batch: int = 1, bytes_per_element: int = 4) -> int:
        """Bytes that :meth:`new_cache`'s full cache holds after ``tokens`` tokens: the keys and values of every
        attention layer's (or key/value group's) ``tokens``, except the entries only local layers read, which keep
        at most ``local_window - 1``; and the fixed-size state of every gated delta layer (once ``tokens >= 1``)."""
        tokens = check_positive_int(tokens, "tokens", allow_zero=True)
        batch, bytes_per_element = check_positive_int(batch, "batch"), check_positive_int(bytes_per_element,
                                                                                         "bytes_per_element")
        windows = self.new_cache().layer_windows or [None] * self.cache_layers
        held = sum(tokens if w is None else min(tokens, w - 1)
                   for w, rec in zip(windows, self.recurrent_layers if self.options.kv_share == 1 else
                                     [False] * self.cache_layers) if not rec)
        per_entry = self.num_layers * self.cache_numbers_per_token() // self.cache_layers
        states = sum(b.attn.state_bytes(batch, bytes_per_element) for b, rec in zip(self.blocks, self.recurrent_layers)
                     if rec) if tokens else 0
        return held * per_entry * batch * bytes_per_element + states

    def forward(self, tokens: torch.Tensor, cache: Optional[KVCache] = None, window: Optional[int] = None,
                need_weights: bool = False, *, pad: Optional[torch.Tensor] = None,
                block_mask: Optional[BlockMask] = None, absorbed: Optional[bool] = None,
                need_index_loss: bool = False, index_dense: bool = False) -> LMOutput:
        """Logits for the next token at every position of ``tokens``.

        Args:
            tokens: (B, L) token ids, the text after the cached tokens (if any).
            cache: a :class:`KVCache` that this call reads and extends (prefill: empty cache and the prompt;
                decode: one token). ``None``: no cache, ``tokens`` is the whole text.
            window: without a cache, attend through a sliding window of this many keys (the reference for a
                rolling cache); with a cache, use the cache's own window.
            need_weights: also return every layer's attention weights.
            pad: (B,) int64, left padding of each row of ``tokens`` (no cache, or an empty cache, which keeps it
                for the following calls). Padding keys are never read; each row's positions start at its first
                real token. Not with sinks.
            block_mask: a :class:`~attention_core.flex_attention.BlockMask` of shape (L, L) for a call without a
                cache, window or padding: attention runs through ``flex_attention`` (its mask mod decides causality).
            absorbed: latent attention only: the absorbed form (default with a cache) or the expanded one
                (default without).
            need_index_loss: a model with ``index_topk`` only: also return the indexer loss (``index_loss``).
            index_dense: a model with ``index_topk`` only: indexed layers attend to every key they may read (the
                indexer's dense warm-up, DSA's eq. (3)) instead of their top-k.

        Returns:
            :class:`LMOutput`, logits (B, L, V).
        """
        self._check_call(tokens, cache, window, need_weights, pad, block_mask)
        for name, flag in (("need_index_loss", need_index_loss), ("index_dense", index_dense)):
            if check_bool_flag(flag, name) and self.options.index_topk is None:
                raise ValueError(f"{name}=True needs a model with an indexer (index_topk), got index_topk=None")
        index = (index_dense, [] if need_index_loss else None)
        absorbed = (cache is not None) if absorbed is None else check_bool_flag(absorbed, "absorbed")
        if cache is None:
            return self._forward(tokens, None, window, need_weights, pad, block_mask, absorbed, index)
        # Transactional: a call that raises (a backend that refuses, say, in a later layer than the first) leaves
        # the cache exactly as it was, never with some layers appended and others not.
        state = cache.snapshot()
        try:
            if pad is not None:
                cache.set_padding(pad)
            if cache.sinks and len(cache) + tokens.shape[1] > cache.capacity:
                if need_weights or need_index_loss or index_dense:
                    raise ValueError("need_weights, need_index_loss or index_dense with sinks: feed at most "
                                     "cache.capacity - len(cache) tokens per call (the slots move while tokens are "
                                     "evicted)")
                return self._forward_in_steps(tokens, cache, absorbed)
            return self._forward(tokens, cache, None, need_weights, None, None, absorbed, index)
        except BaseException:
            cache.restore(state)
            raise
        finally:  # the transaction is over: the snapshot keeps nothing (pinned blocks, kept slots) past this call
            _release_snapshot(state)

    def _check_call(self, tokens: torch.Tensor, cache: Optional[KVCache], window: Optional[int],
                    need_weights: bool, pad: Optional[torch.Tensor] = None,
                    block_mask: Optional[BlockMask] = None) -> None:
        """Everything a call can be refused for, checked before any layer touches the cache."""
        check_tensor(tokens, "tokens")
        if tokens.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"tokens must be a (B, L) integer tensor (int64 or int32), got {tokens.dtype} "
                            f"{fmt_shape(tokens.shape)}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be a (B, L) integer tensor, got {tokens.dtype} {fmt_shape(tokens.shape)}")
        check_bool_flag(need_weights, "need_weights")
        V = self.vocab_size
        if tokens.device != self.embed.weight.device:
            raise ValueError(f"tokens are on {tokens.device} but the model is on {self.embed.weight.device}")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= V):
            raise ValueError(f"tokens must be ids in [0, {V}) (vocab_size = {V}), got values from "
                             f"{int(tokens.min())} to {int(tokens.max())}")
        L, max_len = tokens.shape[1], self.rotary.max_len
        if pad is not None:
            if (not isinstance(pad, torch.Tensor) or pad.dim() != 1 or pad.shape[0] != tokens.shape[0]
                    or pad.is_floating_point() or pad.dtype == torch.bool):
                raise ValueError(f"pad must be a (B,) = ({tokens.shape[0]},) integer tensor, got {pad!r:.80}")
            if pad.numel() and (int(pad.min()) < 0 or int(pad.max()) >= L):
                raise ValueError(f"pad must count 0 .. L - 1 = {L - 1} padding tokens per row (each row keeps a "
                                 f"real token), got {pad.tolist()}")
        if block_mask is not None:
            if not isinstance(block_mask, BlockMask):
                raise TypeError(f"block_mask must be a BlockMask (create_block_mask), got {type(block_mask).__name__}")
            if cache is not None or window is not None or pad is not None or need_weights:
                raise ValueError("block_mask is for a full-sequence call: no cache, window, pad or need_weights")
            if self.options.sink_logits:
                raise ValueError("block_mask does not take the learned sink logits (sink_logits=True): flex "
                                 "attention has no sink column; call without block_mask")
            if self.options.index_topk is not None or self.options.has_gated_delta:
                raise ValueError(f"block_mask is for attention layers only: not with an indexer (index_topk="
                                 f"{self.options.index_topk}) or gated delta layers (layer_pattern="
                                 f"{self.options.layer_pattern!r}), whose keys the mask mod cannot choose; call "
                                 "without block_mask")
            if tuple(block_mask.seq_lengths) != (L, L):
                raise ValueError(f"block_mask covers {tuple(block_mask.seq_lengths)} but tokens has L = {L}: "
                                 f"build it for ({L}, {L})")
        if cache is None:
            if L > max_len:
                raise ValueError(f"tokens has L = {L} positions but the model covers max_positions = {max_len}")
            return
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache (model.new_cache()) or None, got {type(cache).__name__}")
        if window is not None:
            raise ValueError("window is a property of the cache when a cache is given: build it with "
                             "model.new_cache(window=...)")
        if cache.num_layers != self.cache_layers:
            raise ValueError(f"cache has num_layers = {cache.num_layers} but the model caches {self.cache_layers} "
                             f"layers ({self.num_layers} layers, kv_share = {self.options.kv_share}); build it with "
                             "model.new_cache()")
        if cache.batch_size is not None and cache.batch_size != tokens.shape[0]:
            raise ValueError(f"tokens has batch size B = {tokens.shape[0]} but the cache holds B = "
                             f"{cache.batch_size} sequences; use one cache per batch (or cache.reset())")
        if pad is not None:
            if len(cache) or cache.seen:
                raise ValueError("pad is given with the first call of a cache (the prompt), not with later ones")
            if cache.sinks:
                raise ValueError("left padding and sinks do not mix: the sinks would be padding (feed rows alone)")
        if cache.max_len is not None:
            cache.check_room(min(L, max(cache.capacity - len(cache), 1)) if cache.sinks else L)  # type: ignore[operator]
        if cache.sinks:  # slots: fed in steps that evict as they go, so they stay below the capacity
            needed = min(len(cache) + L, cache.capacity)  # type: ignore[type-var]
            if needed > max_len:
                raise ValueError(f"the cache holds {len(cache)} tokens and tokens adds L = {L}: slots up to "
                                 f"{needed - 1}, but the model covers max_positions = {max_len}")
        elif cache.window is None and cache.seen + L > max_len:
            raise ValueError(f"the cache holds {cache.seen} tokens and tokens adds L = {L}: positions up to "
                             f"{cache.seen + L - 1}, but the model covers max_positions = {max_len}")

    def _plan(self, L: int, cache: Optional[KVCache], window: Optional[int], pad: Optional[torch.Tensor],
              block_mask: Optional[BlockMask], device: torch.device) -> _Plan:
        """Positions and mask of a call, shared by every layer (``local``: the local layers' plan, if any)."""
        plan = self._global_plan(L, cache, window, pad, block_mask, device)
        if any(self.recurrent_layers):  # the gated delta layers skip left padding
            first, pad0 = (0, pad) if cache is None else (cache.seen, cache._pad0)
            if pad0 is not None:
                plan.real = torch.arange(first, first + L, device=device)[None] >= pad0.to(device)[:, None]  # (B, L)
        W = self.options.local_window
        if W is None:
            return plan
        if cache is None:  # the local window, within the call's own window if it gives one
            w = W if window is None else min(W, window)
            if block_mask is not None:
                Bm, Hm = block_mask.shape[:2]
                bm = create_block_mask(and_masks(block_mask.mask_mod, sliding_window(w)), Bm, Hm, L, L,
                                       device=device, BLOCK_SIZE=block_mask.BLOCK_SIZE)
                local = replace(plan, block_mask=bm, local={})  # its own (empty) dict: no reference cycle
            else:
                local = replace(plan, mask=decode_mask(L, L, w, 0, pad, device=device), is_causal=False, local={})
            plan.local.update((i, local) for i, is_local in enumerate(self.local_layers) if is_local)
            return plan
        made: Dict[int, _Plan] = {}
        for i in (i for i, is_local in enumerate(self.local_layers) if is_local):
            held, keys_pad = len(cache), cache.pad
            if cache.layer_windows is not None:  # this layer's entry may roll alone: its own slots and padding
                held = cache.held(i // self.options.kv_share)
                if keys_pad is not None:  # slot 0 holds text index seen - held
                    keys_pad = (keys_pad - (cache.seen - held)).clamp(min=0)
            if held not in made:
                made[held] = replace(plan, mask=local_decode_mask(L, held + L, W, cache, keys_pad, device=device),
                                     is_causal=False, local={})
            plan.local[i] = made[held]
        return plan

    def _global_plan(self, L: int, cache: Optional[KVCache], window: Optional[int], pad: Optional[torch.Tensor],
                     block_mask: Optional[BlockMask], device: torch.device) -> _Plan:
        if cache is None:
            positions = torch.arange(L, device=device)
            if pad is not None:
                positions = (positions[None] - pad.to(device)[:, None]).clamp(min=0)  # (B, L)
            if block_mask is not None:
                return _Plan(positions, False, None, False, block_mask)
            if window is None and pad is None:
                return _Plan(positions, False, None, True)
            return _Plan(positions, False, decode_mask(L, L, window, 0, pad, device=device), False)
        S = len(cache) + L
        mask = decode_mask(L, S, cache.window, cache.sinks, cache.pad, device=device)
        if cache.pad is None and cache.window is None and L == 1:
            mask = None  # one new token reads every cached key: no mask at all
        if cache.rotated:
            return _Plan(cache.positions(L, device), False, mask, False)
        return _Plan(None, True, mask, False)

    def _forward(self, tokens: torch.Tensor, cache: Optional[KVCache], window: Optional[int],
                 need_weights: bool, pad: Optional[torch.Tensor] = None, block_mask: Optional[BlockMask] = None,
                 absorbed: bool = False, index: Tuple[bool, Optional[List[torch.Tensor]]] = (False, None)
                 ) -> LMOutput:
        plan = self._plan(tokens.shape[1], cache, window, pad, block_mask, tokens.device)
        plan.index_dense, plan.index_losses = index
        for local in plan.local.values():  # the local layers' plans (copies made before these were set)
            local.index_dense, local.index_losses = index
        x = self.embed(tokens)  # (B, L) -> (B, L, D)
        weights = [] if need_weights else None
        for i, block in enumerate(self.blocks):
            x, w = block(x, self.rotary, cache, i, plan.local.get(i, plan), need_weights, absorbed)
            if weights is not None:
                weights.append(w)
        if cache is not None:
            cache.step_done(tokens.shape[1])
        losses = plan.index_losses
        index_loss = None if losses is None else torch.stack(losses).mean()
        return LMOutput(self.lm_head(self.norm(x)), weights, index_loss)

    def _forward_in_steps(self, tokens: torch.Tensor, cache: KVCache, absorbed: bool) -> LMOutput:
        """With sinks, slots move as tokens are evicted: fill the cache in one pass, then one token at a time."""
        first = max(cache.capacity - len(cache), 1)  # type: ignore[operator]
        logits = [self(tokens[:, :first], cache, absorbed=absorbed).logits]
        logits += [self(tokens[:, t : t + 1], cache, absorbed=absorbed).logits for t in range(first, tokens.shape[1])]
        return LMOutput(torch.cat(logits, dim=1))  # (B, L, V)


@dataclass(frozen=True)
class LMConfig:
    """The shape of a :class:`DecoderLM` (its constructor's arguments) and the seed of its initialisation.

    ``LMConfig(**model.config)`` rebuilds the config a checkpoint stores; ``None`` for ``num_kv_heads`` and
    ``dim_feedforward`` means ``num_heads`` and ``4 * d_model``, for ``seed`` the global generator, for
    ``attention`` ``"standard"`` (``"latent"`` with ``kv_latent_dim`` and ``rope_dim``: multi-head latent attention).
    The recent-model options (``output_gate``, ``sink_logits``, ``qk_norm``, ``kv_share``, ``layer_pattern`` with
    ``local_window`` (its letters ``"L"``, ``"G"`` and ``"D"``, a gated delta layer), ``index_topk`` with
    ``index_heads`` and ``index_dim``; :mod:`attention_core.models.attention_variants`) are off when ``None``, so
    a config that does not name them, every shipped checkpoint's among them, builds the model it always built.
    """

    vocab_size: int
    d_model: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: Optional[int] = None
    dim_feedforward: Optional[int] = None
    context: int = 128
    max_positions: int = 8192
    rope_base: float = 10000.0
    seed: Optional[int] = None
    attention: Optional[str] = None
    kv_latent_dim: Optional[int] = None
    rope_dim: Optional[int] = None
    output_gate: Optional[bool] = None
    sink_logits: Optional[bool] = None
    qk_norm: Optional[bool] = None
    kv_share: Optional[int] = None
    layer_pattern: Optional[str] = None
    local_window: Optional[int] = None
    index_topk: Optional[int] = None
    index_heads: Optional[int] = None
    index_dim: Optional[int] = None

    def to_dict(self) -> Dict[str, Any]:
        """The fields that differ from ``None``, as a checkpoint's ``config`` records them."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def build_language_model(config: Union[LMConfig, Dict[str, Any]]) -> DecoderLM:
    """A :class:`DecoderLM` from an :class:`LMConfig` or a dict of its fields; the model keeps the config as a
    dict, ``model.config``, so that checkpoints can rebuild it.

    With a ``seed``, the weights are drawn from a generator seeded with it inside ``torch.random.fork_rng``:
    torch's global generator is left exactly as it was (loading a checkpoint does not reseed the caller's
    random numbers). Without one, the initialisation draws from the global generator, as ``nn.Linear`` does.

    Raises:
        TypeError: ``config`` is neither, or a dict with a key that is not a field of :class:`LMConfig`.
    """
    recorded, config, kwargs = _read_config(config)
    if config.seed is None:
        model = DecoderLM(**kwargs)
    else:
        check_int(config.seed, "config['seed']")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = DecoderLM(**kwargs)
    model.config = recorded
    return model


def parameter_count(config: Union[LMConfig, Dict[str, Any]]) -> int:
    """Parameters of the model ``config`` builds, each once (the tied read-out with its embedding), counted on the
    meta device: nothing is allocated and no random number is drawn."""
    _, _, kwargs = _read_config(config)
    with torch.device("meta"):
        return count_parameters(DecoderLM(**kwargs))


def feedforward_for_budget(config: Union[LMConfig, Dict[str, Any]], budget: int) -> int:
    """The ``dim_feedforward`` (>= 1) that brings the model of ``config`` nearest to ``budget`` parameters: the
    knob a comparison of attention variants turns so that every model has the same budget (the count is linear in
    it, ``num_layers (2 D + 1)`` per unit)."""
    budget = check_positive_int(budget, "budget")
    _, base, _ = _read_config(config)
    one, two = (parameter_count({**base.to_dict(), "dim_feedforward": f}) for f in (1, 2))
    return max(1, round((budget - one) / (two - one)) + 1)


def _read_config(config: Union[LMConfig, Dict[str, Any]]) -> Tuple[Dict[str, Any], LMConfig, Dict[str, Any]]:
    """``(the dict a checkpoint records, the LMConfig, DecoderLM's keyword arguments)`` of a config."""
    if isinstance(config, dict):
        unknown = sorted(set(config) - {f.name for f in fields(LMConfig)})
        if unknown:
            raise TypeError(f"config has keys that are not LMConfig fields: {unknown}")
        if "vocab_size" not in config:
            raise TypeError("config must give vocab_size")
        recorded, config = dict(config), LMConfig(**config)
    elif isinstance(config, LMConfig):
        recorded = config.to_dict()
    else:
        raise TypeError(f"config must be an LMConfig or a dict, got {type(config).__name__}")
    kwargs = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "seed"}
    if kwargs["attention"] is None:
        kwargs["attention"] = "standard"
    return recorded, config, kwargs
