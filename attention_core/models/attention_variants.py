"""Seven changes recent models made to a decoder's attention, as options of
:class:`~attention_core.models.language_model.DecoderLM` (fields of ``LMConfig``, all off by default).

- **Output gate** (Qiu et al. 2025, "Gated Attention for Large Language Models", section 2.2, eq. (5), gating
  position G1): ``Y' = Y ⊙ σ(X W_θ)``, where ``Y`` is the output of scaled dot-product attention, per head and
  before the heads are concatenated and projected by ``W_O``, and ``X`` is the block's input after its pre-norm
  (the hidden states the queries are computed from). The gate is elementwise and head-specific (``W_θ`` maps D
  to ``Hq E``: one gate per head and feature), the paper's best variant; no bias, as the projections here.
- **Learned sink logits** (OpenAI, gpt-oss, 2025): one learned scalar ``s_h`` per query head joins the softmax's
  denominator, ``p_ij = exp(z_ij) / (exp(s_h) + sum_j' exp(z_ij'))``, as a virtual key whose logit is ``s_h`` and
  whose value is zero: a row may put mass "nowhere", so its weights sum to less than 1. :func:`sink_attention`
  computes it with the library's attention as one extra logit column (a zero key, a zero value, and ``s_h``
  added to that column through a float mask), as gpt-oss's reference code concatenates ``S`` to the scores and
  drops that column after the softmax.
- **QK-norm** (Dehghani et al. 2023; OLMo 2; Qwen3): RMSNorm with a learned scale on the queries and the keys,
  before the rotary rotation. This module follows **Qwen3**: the norm runs over each head's E features
  (``q_norm``/``k_norm`` of size E, one scale vector shared by the heads), after the projection is split into
  heads and before RoPE. OLMo 2 also normalises before RoPE, but over the whole projection (all heads at once,
  a scale of size ``Hq E``) before it is split.
- **Cross-layer KV sharing** (Brandon et al. 2024, "Reducing Transformer Key-Value Cache Size with Cross-Layer
  Attention", CLA with sharing factor ``kv_share``): layers are taken in consecutive groups of ``kv_share``;
  the first layer of a group computes keys and values (it has ``k_proj``/``v_proj``), the others have no key
  or value projection and attend to the first one's keys and values. The cache stores one entry per group:
  ``num_layers / kv_share`` entries instead of ``num_layers``.
- **Local/global interleaving** (Gemma 2: 1 local : 1 global; Gemma 3: 5 local : 1 global): ``layer_pattern``,
  a string of ``"L"`` (local: a causal sliding window of ``local_window`` keys, itself included) and ``"G"``
  (global: every earlier key), repeated over the layers (layer ``i`` is ``layer_pattern[i % len]``; Gemma 2 is
  ``"LG"``, Gemma 3 ``"LLLLLG"``). The window is :func:`attention_core.mask_mods.sliding_window` (dense through
  the decode masks, or a block mask with ``and_masks`` when the call gives one). In the model's full cache, an
  entry that only local layers read rolls on its own (``KVCache(layer_windows=...)``): it keeps
  ``local_window - 1`` tokens between calls, as a rolling cache does, while the global layers' entries keep every
  token (a group of shared keys and values with a global layer in it keeps every token too).
- **Gated delta layers in a hybrid stack** (Yang et al., ICLR 2025, "Gated Delta Networks", their hybrid H1/H2
  models; Qwen3-Next interleaves three Gated DeltaNet layers with one full-attention layer, ``"DDDG"``): a ``"D"``
  of ``layer_pattern`` is a :class:`~attention_core.models.gated_delta.GatedDeltaLayer` instead of attention. It
  keeps a fixed-size state (the cache's ``state(layer)``), has no keys or values (not with ``kv_share > 1``), no
  positions, and reads the whole text (a window limits the attention layers only). At least one layer attends.
- **Indexed top-k attention** (DeepSeek Sparse Attention, DeepSeek-V3.2-Exp, 2025): ``index_topk`` gives every
  attention layer a lightning indexer (:class:`~attention_core.models.indexed_attention.LightningIndexer`,
  ``index_heads`` H_I and ``index_dim`` d_I); eq. (1) scores each query against the keys it may read (causal, within
  the local window, not padding), and it attends to the ``index_topk`` of largest score (ties to the most recent key).
  As in DeepSeek-V3.2's indexer, its queries and keys carry rotary positions (the model's table, block by block of E
  features). Its keys are cached as extra key heads of the layer's cache entry. Training (section 2.1 of the report):
  the indexer reads a detached input and learns from its own loss only, the KL from the main attention's distribution
  (summed over heads, L1-normalised, a target without gradient) to the softmax of its scores
  (``need_index_loss=True``: ``LMOutput.index_loss``, the mean over layers of each layer's mean over queries, where
  the report sums over queries); over every allowed key during a dense warm-up (``index_dense=True``, eq. (3)), over
  the selected keys afterwards (eq. (4)). The selection passes no gradient, so the language-model loss trains the
  rest. What differs from the report: DSA starts from a trained dense model, freezes it during the warm-up and trains
  the indexer alone (1000 steps), then trains everything on the sparse model; a model trained here from scratch trains
  its main weights during the warm-up too (the caller's loop chooses the steps:
  :mod:`attention_core.shakespeare.recent`); DSA's main attention is MLA in its MQA mode, ours the layer's (MHA/GQA);
  no FP8 indexer; k, H_I and d_I are small (the report: 2048, 64, 128).

:class:`VariantSelfAttention` is the attention of a layer with any of these options; a model with none of them
keeps :class:`~attention_core.models.language_model.CausalSelfAttention`, so every existing config and
checkpoint builds the same modules, draws the same initial weights and computes the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn

from attention_core import mask_mods
from attention_core._checks import (
    check_bool_flag,
    check_instance,
    check_positive_int,
    check_tensor,
    fmt_shape,
    short_repr,
)
from attention_core.flex_attention import flex_attention
from attention_core.functional import attention
from attention_core.indexer import indexer_kl_loss, topk_within
from attention_core.models.indexed_attention import (
    LightningIndexer,
    allowed_keys,
    pack_heads,
    unpack_heads,
)
from attention_core.models.kv_cache import KVCache, decode_mask, decode_mask_mod, rotate_at
from attention_core.multihead import MultiHeadAttention
from attention_core.positional import RotaryEmbedding

__all__ = ["AttentionOptions", "VariantSelfAttention", "count_parameters", "layer_is_local", "layer_kind",
           "local_decode_mask", "sink_attention"]

#: The RMSNorm epsilon of the query/key norms (Qwen3's ``rms_norm_eps``).
QK_NORM_EPS = 1e-6
#: The letters of ``layer_pattern``: local attention, global attention, gated delta rule.
LAYER_KINDS = ("L", "G", "D")
#: The indexer's heads H_I and width d_I when ``index_topk`` is given without them.
INDEX_HEADS, INDEX_DIM = 4, 16


def count_parameters(model: nn.Module) -> int:
    """Numbers a model learns: every parameter once (a tied read-out counts with its embedding)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------ options


@dataclass(frozen=True)
class AttentionOptions:
    """The recent-model options of a :class:`~attention_core.models.language_model.DecoderLM`, checked.

    ``output_gate``, ``sink_logits``, ``qk_norm``: on or off; ``kv_share``: layers per key/value group (1: every
    layer its own); ``layer_pattern``/``local_window``: which layers attend through a sliding window, and its
    size (``None``: every layer global).
    """

    output_gate: bool = False
    sink_logits: bool = False
    qk_norm: bool = False
    kv_share: int = 1
    layer_pattern: Optional[str] = None
    local_window: Optional[int] = None
    index_topk: Optional[int] = None
    index_heads: Optional[int] = None
    index_dim: Optional[int] = None

    @classmethod
    def check(cls, num_layers: int, attention: str, output_gate: Optional[bool] = None,
              sink_logits: Optional[bool] = None, qk_norm: Optional[bool] = None, kv_share: Optional[int] = None,
              layer_pattern: Optional[str] = None, local_window: Optional[int] = None,
              index_topk: Optional[int] = None, index_heads: Optional[int] = None,
              index_dim: Optional[int] = None) -> AttentionOptions:
        """Validate the fields at the model's edge (``None`` = off) and return them as options.

        Raises:
            TypeError: a field of the wrong type.
            ValueError: a value out of range, ``kv_share`` not dividing ``num_layers``, ``layer_pattern`` with an
                ``"L"`` but no ``local_window`` (or the reverse), a pattern that leaves no attention layer, gated
                delta layers or the indexer with ``kv_share > 1``, ``index_heads``/``index_dim`` without
                ``index_topk``, or any option with ``attention="latent"``.
        """
        flags = {name: False if v is None else check_bool_flag(v, name)
                 for name, v in (("output_gate", output_gate), ("sink_logits", sink_logits), ("qk_norm", qk_norm))}
        share = 1 if kv_share is None else check_positive_int(kv_share, "kv_share")
        if num_layers % share:
            raise ValueError(f"kv_share = {share} must divide num_layers = {num_layers} (layers share keys and "
                             f"values in groups of kv_share)")
        if layer_pattern is not None:
            if not isinstance(layer_pattern, str):
                raise TypeError(f"layer_pattern must be a str of 'L' (local), 'G' (global) and 'D' (gated delta), "
                                f"got {type(layer_pattern).__name__} {short_repr(layer_pattern)}")
            if not layer_pattern or set(layer_pattern) - set(LAYER_KINDS) or not set(layer_pattern) & {"L", "D"}:
                raise ValueError(f"layer_pattern must be a non-empty str of 'L' (local), 'G' (global) and 'D' "
                                 f"(gated delta) with at least one 'L' or 'D', e.g. 'LG' (Gemma 2), 'LLLLLG' "
                                 f"(Gemma 3) or 'DDDG' (Qwen3-Next), got {layer_pattern!r}")
            if "L" in layer_pattern and local_window is None:
                raise ValueError(f"layer_pattern={layer_pattern!r} needs local_window, the keys a local layer sees")
            kinds = [layer_kind(layer_pattern, i) for i in range(num_layers)]
            if "D" in kinds and all(k == "D" for k in kinds):
                raise ValueError(f"layer_pattern={layer_pattern!r} makes all num_layers = {num_layers} layers gated "
                                 "delta layers: a hybrid stack keeps at least one attention layer ('G' or 'L')")
            if "D" in kinds and share > 1:
                raise ValueError(f"kv_share = {share} with gated delta layers ('D' in layer_pattern="
                                 f"{layer_pattern!r}): a gated delta layer has no keys and values to share; use "
                                 "kv_share=None")
        if local_window is not None:
            local_window = check_positive_int(local_window, "local_window")
            if layer_pattern is None or "L" not in layer_pattern:
                raise ValueError(f"local_window={local_window} needs layer_pattern with an 'L', which layers are "
                                 f"local (e.g. 'LG'), got layer_pattern={layer_pattern!r}")
        if index_topk is None:
            for name, v in (("index_heads", index_heads), ("index_dim", index_dim)):
                if v is not None:
                    raise ValueError(f"{name}={short_repr(v)} needs index_topk, the keys each query keeps")
        else:
            index_topk = check_positive_int(index_topk, "index_topk")
            index_heads = INDEX_HEADS if index_heads is None else check_positive_int(index_heads, "index_heads")
            index_dim = INDEX_DIM if index_dim is None else check_positive_int(index_dim, "index_dim")
            if share > 1:
                raise ValueError(f"index_topk = {index_topk} with kv_share = {share}: each indexed layer caches "
                                 "its own indexer keys; use kv_share=None")
        options = cls(flags["output_gate"], flags["sink_logits"], flags["qk_norm"], share, layer_pattern,
                      local_window, index_topk, index_heads, index_dim)
        if attention != "standard" and options.any:
            raise ValueError(f"output_gate, sink_logits, qk_norm, kv_share, layer_pattern, local_window and "
                             f"index_topk belong to attention='standard', got attention={attention!r} with "
                             f"{options.describe()}")
        return options

    @property
    def any(self) -> bool:
        """True when some option is on (the layers then use :class:`VariantSelfAttention`)."""
        return self.changes_attention or self.layer_pattern is not None

    @property
    def changes_attention(self) -> bool:
        """True when the attention module itself differs (gate, sinks, norms, shared keys and values, indexer)."""
        return (self.output_gate or self.sink_logits or self.qk_norm or self.kv_share > 1
                or self.index_topk is not None)

    @property
    def has_gated_delta(self) -> bool:
        """True when some layer is a gated delta layer (``"D"`` in ``layer_pattern``)."""
        return self.layer_pattern is not None and "D" in self.layer_pattern

    def describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items()
                         if v not in (False, None) and not (k == "kv_share" and v == 1))


def layer_kind(layer_pattern: Optional[str], layer: int) -> str:
    """The kind of layer ``layer``: ``layer_pattern[layer % len]``, ``"G"`` (global attention) without a pattern."""
    return "G" if layer_pattern is None else layer_pattern[layer % len(layer_pattern)]


def layer_is_local(layer_pattern: Optional[str], layer: int) -> bool:
    """Whether layer ``layer`` attends through the local window: ``layer_pattern[layer % len] == "L"``."""
    return layer_kind(layer_pattern, layer) == "L"


def local_decode_mask(L: int, S: int, local_window: int, cache: KVCache, pad: Optional[torch.Tensor] = None, *,
                      device: Optional[torch.device] = None) -> torch.Tensor:
    """The mask (L, S) or (B, 1, L, S) of a local layer's L new queries over the S keys of its cache entry.

    A local layer reads the keys within ``local_window`` of it in the text, among those the cache keeps: the
    ``min(local_window, cache.window)`` most recent slots (in a rolling cache, recent slots are consecutive in
    the text), and, in a StreamingLLM cache (``cache.sinks``), a sink slot ``j`` (text index ``j``) only while the
    query's text index is less than ``j + local_window``. So a cache that evicts nothing computes the model.
    """
    check_positive_int(local_window, "local_window")
    check_instance(cache, KVCache, "cache", "a KVCache")
    w = local_window if cache.window is None else min(local_window, cache.window)
    if not cache.sinks:
        return decode_mask(L, S, w, 0, pad, device=device)
    first, n_sinks = cache.seen, cache.sinks  # the text index of the first new query; sinks never move

    def near_sink(b, h, q_idx, kv_idx):
        return (kv_idx < n_sinks) & (first + q_idx - kv_idx < local_window)

    sink_part = mask_mods.and_masks(mask_mods.causal_bottom_right(L, S), near_sink)
    mod = mask_mods.or_masks(decode_mask_mod(L, S, w, 0, pad), sink_part)
    return mask_mods.dense_mask(mod, 1, 1, L, S, device=device)[0, 0]  # (1, 1, L, S) -> (L, S)


# ------------------------------------------------------------------------------------------------ sinks


def sink_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks: torch.Tensor,
                   attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False, scale: Optional[float] = None,
                   enable_gqa: bool = False, *, need_weights: bool = False
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Attention whose softmax denominator also holds ``exp(sinks[h])``: a virtual key of logit ``sinks[h]``
    and value zero (gpt-oss's learned sinks).

    ``out_i = sum_j exp(z_ij) v_j / (exp(s_h) + sum_j exp(z_ij))``, ``z_ij = scale q_i . k_j`` (+ the mask).
    Computed by :func:`attention_core.functional.attention` over S + 1 keys: the real ones and a zero key with a
    zero value, whose score 0 is raised to ``s_h`` by a float mask (0 on the kept pairs, ``-inf`` on the masked
    ones, ``s_h`` in the last column). A row whose real keys are all masked gives zeros, as the core promises.

    Args:
        query: (B, Hq, L, E) floating.
        key: (B, H, S, E), value (B, H, S, Ev): the query's dtype and device.
        sinks: (Hq,) floating, the learned logits, one per query head.
        attn_mask: bool (True = attend), broadcastable to (B, Hq, L, S), or ``None``.
        is_causal: SDPA's upper-left causal mask (without ``attn_mask``).
        scale: score scale, default ``1 / sqrt(E)``.
        enable_gqa: key/value head ``h`` serves query heads ``h G .. h G + G - 1``.
        need_weights: also return the weights over the real keys (B, Hq, L, S): each row sums to less than 1.

    Returns:
        ``(out (B, Hq, L, Ev), weights or None)``.
    """
    for name, t in (("query", query), ("key", key), ("value", value), ("sinks", sinks)):
        check_tensor(t, name)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"query, key and value must be 4-D (B, H, N, E), got {fmt_shape(query.shape)}, "
                         f"{fmt_shape(key.shape)}, {fmt_shape(value.shape)}")
    B, Hq, L, _ = query.shape
    S = key.shape[2]
    if sinks.shape != (Hq,) or sinks.dtype != query.dtype or sinks.device != query.device:
        raise ValueError(f"sinks must be ({Hq},), one logit per query head, of the query's dtype and device "
                         f"({query.dtype} on {query.device}), got {fmt_shape(sinks.shape)} {sinks.dtype} on "
                         f"{sinks.device}")
    check_bool_flag(is_causal, "is_causal")
    if attn_mask is not None:
        check_tensor(attn_mask, "attn_mask")
        if attn_mask.dtype != torch.bool or is_causal:
            raise ValueError(f"attn_mask must be a bool mask (True = attend), not given with is_causal=True; got "
                             f"{attn_mask.dtype} with is_causal={is_causal}")
    keep = attn_mask
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()  # (L, S): upper-left, as SDPA's
    dt = query.dtype if query.dtype in (torch.float32, torch.float64) else torch.float32
    zeros = torch.zeros((), dtype=dt, device=query.device)
    bias = zeros.expand(1, 1, L, S) if keep is None else torch.where(keep, zeros, float("-inf"))
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))  # (..., L, S) -> 4-D
    Bm = bias.shape[0]
    bias = bias.expand(Bm, Hq, L, S)  # (Bm, Hq, L, S): every head its own sink column
    sink_col = sinks.to(dt).view(1, Hq, 1, 1).expand(Bm, Hq, L, 1)  # (Hq,) -> (Bm, Hq, L, 1)
    bias = torch.cat([bias, sink_col], dim=-1)  # (Bm, Hq, L, S + 1)
    key = torch.cat([key, key.new_zeros(B, key.shape[1], 1, key.shape[3])], dim=2)  # (B, H, S + 1, E)
    value = torch.cat([value, value.new_zeros(B, value.shape[1], 1, value.shape[3])], dim=2)  # (B, H, S + 1, Ev)
    out, weights = attention(query, key, value, bias, 0.0, False, scale, enable_gqa, need_weights=need_weights)
    return out, None if weights is None else weights[..., :S]  # drop the sink's column: (B, Hq, L, S)


# ------------------------------------------------------------------------------------------------ attention


class VariantSelfAttention(MultiHeadAttention):
    """Causal self-attention with rotary positions and the options of :class:`AttentionOptions`.

    Per layer: ``q_proj``, and ``k_proj``/``v_proj`` unless the layer reads another layer's keys and values
    (``kv_owner=False``); ``q_norm``/``k_norm`` (QK-norm), ``gate_proj`` (output gate, D -> Hq E) and
    ``sink_logits`` (Hq,) when their options are on; ``out_proj``. No biases (as Llama). At initialisation the
    sink logits are 0 (each row's denominator gains ``exp(0) = 1``), the norms' scales 1, and ``gate_proj`` is
    drawn as every matrix of the model is (N(0, 0.02): gates start near 1/2).

    Args:
        embed_dim, num_heads, num_kv_heads: as :class:`attention_core.MultiHeadAttention`.
        options: the model's :class:`AttentionOptions`.
        layer: this layer's index (its group ``layer // kv_share`` is its slot in the cache).
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: Optional[int], options: AttentionOptions,
                 layer: int) -> None:
        super().__init__(embed_dim, num_heads, num_kv_heads, bias=False)
        Hq, E = self.num_heads, self.head_dim
        self.options, self.layer = options, layer
        self.slot, self.kv_owner = layer // options.kv_share, layer % options.kv_share == 0
        self.local = layer_is_local(options.layer_pattern, layer)
        if not self.kv_owner:  # CLA: this layer reads the keys and values of its group's first layer
            self.k_proj = self.v_proj = None
        self.q_norm = nn.RMSNorm(E, eps=QK_NORM_EPS) if options.qk_norm else None
        self.k_norm = nn.RMSNorm(E, eps=QK_NORM_EPS) if options.qk_norm and self.kv_owner else None
        self.gate_proj = nn.Linear(embed_dim, Hq * E, bias=False) if options.output_gate else None
        self.sink_logits = nn.Parameter(torch.zeros(Hq)) if options.sink_logits else None
        self.indexer = None
        if options.index_topk is not None:  # DSA's lightning indexer, one per layer (its keys cached with ours)
            self.indexer = LightningIndexer(embed_dim, options.index_heads, options.index_dim)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return f"layer={self.layer}, slot={self.slot}, kv_owner={self.kv_owner}, local={self.local}"

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, cache: Optional[KVCache], layer: int,  # type: ignore[override]
                plan, need_weights: bool = False, absorbed: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Self-attention of ``x`` (B, L, D) after the cached tokens; ``plan`` is the model's (its ``shared`` dict
        carries each group's keys and values from the layer that computes them to the layers that reuse them).

        Returns:
            ``(out (B, L, D), weights (B, Hq, L, S) or None)``.
        """
        B, L, _ = x.shape
        Hq, H, E = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, L, Hq, E).transpose(1, 2)  # (B, L, D) -> (B, Hq, L, E)
        if self.q_norm is not None:
            q = self.q_norm(q)  # RMSNorm over each head's E features, before RoPE (Qwen3)
        index_key = None
        if self.kv_owner:
            k, v, index_key = self._keys_values(x, rotary, cache, plan)  # (B, H, S, E) each, rotated
            plan.shared[self.slot] = (k, v)
        else:
            k, v = plan.shared[self.slot]  # the group's first layer computed (and cached) them in this call
        if plan.rerotate:
            q = rotary.rotate(q, offset=k.shape[2] - L, name="query")  # queries sit at the last L slots
        else:
            q = rotate_at(rotary, q, plan.positions)
        mask, is_causal, scores = plan.mask, plan.is_causal, None
        if self.indexer is not None:  # the keys this layer may read, then each query's top-k of them
            allowed = allowed_keys(plan.mask, plan.is_causal, B, L, k.shape[2], x.device)  # (B, L, S)
            scores = self._index_scores(x.detach(), rotary, plan, k.shape[2], index_key)  # (B, L, S)
            selected = allowed if plan.index_dense else topk_within(scores, allowed, self.options.index_topk)
            mask, is_causal = selected.unsqueeze(1), False  # (B, L, S) -> (B, 1, L, S)
            need_weights = need_weights or plan.index_losses is not None
        if plan.block_mask is not None:
            out, weights = flex_attention(q, k, v, block_mask=plan.block_mask, enable_gqa=H != Hq), None
        elif self.sink_logits is not None:
            out, weights = sink_attention(q, k, v, self.sink_logits, mask, is_causal, None, H != Hq,
                                          need_weights=need_weights)
        else:
            args = (q, k, v, mask, 0.0, is_causal)
            out, weights = attention(*args, enable_gqa=H != Hq, need_weights=need_weights)
        if scores is not None and plan.index_losses is not None:  # eq. (3) (dense) or eq. (4) (the selection)
            plan.index_losses.append(indexer_kl_loss(scores, weights, mask[:, 0], reduction="mean"))
        if self.gate_proj is not None:  # G1: Y' = Y * sigmoid(X W_theta), per head and feature, before W_O
            gate = self.gate_proj(x).view(B, L, Hq, E).transpose(1, 2)  # (B, L, Hq*E) -> (B, Hq, L, E)
            out = out * torch.sigmoid(gate)
        out = out.transpose(1, 2).reshape(B, L, Hq * E)  # (B, Hq, L, E) -> (B, L, D)
        return self.out_proj(out), weights

    def _keys_values(self, x: torch.Tensor, rotary: RotaryEmbedding, cache: Optional[KVCache], plan
                     ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """This group's keys and values (B, H, S, E), rotated, after the cached ones (the cache extended), and the
        indexer's keys (B, S, d_I) (``None`` without an indexer). The cache holds the indexer's keys as extra key
        heads after the H real ones (:func:`pack_index_keys`), so that they roll, evict and restore with them."""
        B, L, _ = x.shape
        H, E = self.num_kv_heads, self.head_dim
        k = self.k_proj(x).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        v = self.v_proj(x).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        if self.k_norm is not None:
            k = self.k_norm(k)  # before RoPE, and before the cache (a sinks cache rotates what it holds)
        if self.indexer is not None:  # the indexer's key (from a detached input) as m extra key heads
            k = torch.cat([k, pack_heads(self.indexer.key(x.detach()), E)], dim=1)  # (B, H + m, L, E)
        if not plan.rerotate:
            k = rotate_at(rotary, k, plan.positions)
        if cache is not None:
            k, v = cache.update(self.slot, k, v)  # (B, H (+ m), S, E)
        if plan.rerotate:  # sinks: the cache holds keys before RoPE; every key is rotated by its slot
            k = rotary.rotate(k, offset=0, name="key")
        if self.indexer is None:
            return k, v, None
        ik = unpack_heads(k[:, H:], 1, self.indexer.index_dim)[:, 0]  # (B, m, S, E) -> (B, S, d_I)
        return k[:, :H], v, ik

    def _index_scores(self, x: torch.Tensor, rotary: RotaryEmbedding, plan, S: int, index_key: torch.Tensor
                      ) -> torch.Tensor:
        """The indexer's scores (B, L, S) of x's queries (rotated at their positions, as the keys are)."""
        q = self.indexer.query(x)  # (B, H_I, L, d_I)
        N, L, E = q.shape[1], q.shape[2], self.head_dim
        packed = pack_heads(q, E)  # (B, H_I m, L, E)
        if plan.rerotate:
            packed = rotary.rotate(packed, offset=S - L, name="query")
        else:
            packed = rotate_at(rotary, packed, plan.positions)
        return self.indexer.scores(x, unpack_heads(packed, N, self.indexer.index_dim), index_key)
