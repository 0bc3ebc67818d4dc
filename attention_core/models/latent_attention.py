"""Multi-head latent attention (MLA, DeepSeek-AI 2024, DeepSeek-V2): cache a small latent, not the keys and values.

Per token, MLA compresses the layer input ``h`` (D) into one latent ``c = RMSNorm(W_DKV h)`` (d_c, shared by all
heads) and rebuilds every head's key and value from it, ``k_h = W_UK_h c`` and ``v_h = W_UV_h c`` (E each). The
RMSNorm on the compressed latent is DeepSeek-V2's (section 3.1.2 of the paper: "we employ additional RMS Norm
layers after the compressed latent vectors"; ``kv_a_layernorm`` in its released code); with a compressed query,
``q_a_layernorm`` likewise. Rotary positions cannot pass through the product ``W_UK c`` (the rotation would sit
between ``W_UQ`` and ``W_UK``), so a separate, small *decoupled* key ``k_R = RoPE(W_KR h)`` (d_r, shared by all
heads) carries the position, and each head's query has a matching part ``q_R,h``. Scores are
``(q_h . k_h + q_R,h . k_R) / sqrt(E + d_r)``.

Two ways of computing the same thing:

- **expanded**: rebuild ``k_h`` and ``v_h`` for every cached token, then ordinary multi-head attention (E + d_r
  per head); cheaper for a long prefill when d_c > E (scores over E + d_r numbers per head);
- **absorbed**: ``q_h . (W_UK_h c) = (W_UK_h^T q_h) . c``, so ``W_UK`` folds into the query side, and
  ``W_O_h W_UV_h`` into one output matrix: attention then reads the latent ``c`` and ``k_R`` directly, as
  multi-query attention with a single key ``[c ; k_R]`` (d_c + d_r) and a single value ``c``. At decode time no
  key or value is rebuilt for the S cached tokens.

Caching the latent pays in memory either way (``d_c + d_r`` numbers per token and layer, against ``2 H E`` for
multi-head attention: DeepSeek-V2, H = 128, E = 128, d_c = 512, d_r = 64, stores 576 instead of 32,768); the
absorbed form is what keeps decoding from it cheap in compute. No biases anywhere (DeepSeek-V2 has none), so the
absorption is exact.

:class:`MultiHeadLatentAttention` is the layer on its own, with its :class:`LatentCache`;
:class:`LatentSelfAttention` is the same layer inside :class:`~attention_core.models.language_model.DecoderLM`
(``attention="latent"``), where the model's :class:`~attention_core.models.kv_cache.KVCache` holds the rotary key
as its "key" (B, 1, S, d_r) and the latent as its "value" (B, 1, S, d_c): windows, sinks, left padding and the
transactional guarantee come with it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from attention_core._checks import check_bool_flag, check_floating, check_positive_int, check_tensor, fmt_shape
from attention_core.backends.inputs import scale_or_default
from attention_core.flex_attention import BlockMask, flex_attention
from attention_core.functional import attention
from attention_core.models.kv_cache import KVCache, cached_causal_mask, rotate_at
from attention_core.positional import RotaryEmbedding

__all__ = ["LatentCache", "LatentSelfAttention", "MultiHeadLatentAttention", "latent_score_flops",
           "mla_cache_elements"]


def mla_cache_elements(num_layers: int, kv_latent_dim: int, rope_dim: int, tokens: int, batch: int = 1) -> int:
    """Numbers an MLA cache holds: ``(d_c + d_r)`` per token, layer and sequence (DeepSeek-V2, Table 1)."""
    for name, n in {"num_layers": num_layers, "kv_latent_dim": kv_latent_dim, "rope_dim": rope_dim,
                    "batch": batch}.items():
        check_positive_int(n, name)
    check_positive_int(tokens, "tokens", allow_zero=True)
    return (kv_latent_dim + rope_dim) * num_layers * tokens * batch


class LatentCache:
    """One MLA layer's cache: ``latent`` (B, S, d_c) and the rotated ``rope_key`` (B, S, d_r), nothing else."""

    def __init__(self) -> None:
        self.latent: Optional[torch.Tensor] = None
        self.rope_key: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return 0 if self.latent is None else self.latent.shape[1]

    def update(self, latent: torch.Tensor, rope_key: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' latent (B, L, d_c) and rotated rope key (B, L, d_r); return all of them."""
        if self.latent is not None:
            latent = torch.cat([self.latent, latent], dim=1)  # (B, S0, d_c) + (B, L, d_c) -> (B, S, d_c)
            rope_key = torch.cat([self.rope_key, rope_key], dim=1)  # (B, S0, d_r) + (B, L, d_r) -> (B, S, d_r)
        self.latent, self.rope_key = latent, rope_key
        return latent, rope_key

    def nbytes(self) -> int:
        """Bytes of the cached tensors."""
        return sum(t.numel() * t.element_size() for t in (self.latent, self.rope_key) if t is not None)

    @property
    def batch_size(self) -> Optional[int]:
        """B of the cached tensors, or ``None`` while the cache is empty."""
        return None if self.latent is None else self.latent.shape[0]

    def reset(self) -> None:
        """Forget every cached token."""
        self.latent = self.rope_key = None

    def snapshot(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The state to :meth:`restore` if a call fails half-way (appends build new tensors, so references do)."""
        return self.latent, self.rope_key

    def restore(self, state: Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]) -> None:
        """Put back a :meth:`snapshot`."""
        self.latent, self.rope_key = state


class MultiHeadLatentAttention(nn.Module):
    """Causal multi-head latent attention (DeepSeek-V2), batch-first, with an optional :class:`LatentCache`.

    Args:
        embed_dim: D, input and output width.
        num_heads: H.
        head_dim: E, per-head size of the content query/key and of the value.
        kv_latent_dim: d_c, the cached latent's size (DeepSeek-V2: 4 E).
        rope_dim: d_r, the decoupled rotary key's size, shared by the heads (DeepSeek-V2: E / 2); even.
        q_latent_dim: d_c', compress the queries too (training memory only, not cached); ``None``: no.
        max_positions: positions the rotary table covers.
        rope_base: the rotary wavelength scale.
        latent_norm: RMSNorm on the compressed latent (and query latent), as DeepSeek-V2 does.
    """

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, kv_latent_dim: int, rope_dim: int,
                 q_latent_dim: Optional[int] = None, max_positions: int = 4096, rope_base: float = 10000.0,
                 latent_norm: bool = True) -> None:
        super().__init__()
        for name, n in {"embed_dim": embed_dim, "num_heads": num_heads, "head_dim": head_dim,
                        "kv_latent_dim": kv_latent_dim, "rope_dim": rope_dim}.items():
            check_positive_int(n, name)
        H, E = num_heads, head_dim
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, H, E
        self.kv_latent_dim, self.rope_dim, self.q_latent_dim = kv_latent_dim, rope_dim, q_latent_dim
        self.kv_down = nn.Linear(embed_dim, kv_latent_dim, bias=False)  # W_DKV: h -> c
        self.k_up = nn.Linear(kv_latent_dim, H * E, bias=False)  # W_UK: c -> keys of all heads
        self.v_up = nn.Linear(kv_latent_dim, H * E, bias=False)  # W_UV: c -> values of all heads
        self.k_rope = nn.Linear(embed_dim, rope_dim, bias=False)  # W_KR: h -> the shared rotary key
        if q_latent_dim is None:
            self.q_down, q_in = None, embed_dim
        else:
            self.q_down, q_in = nn.Linear(embed_dim, check_positive_int(q_latent_dim, "q_latent_dim"),
                                          bias=False), q_latent_dim
        self.q_up = nn.Linear(q_in, H * E, bias=False)  # W_UQ: content queries
        self.q_rope = nn.Linear(q_in, H * rope_dim, bias=False)  # W_QR: rotary queries, one per head
        self.out_proj = nn.Linear(H * E, embed_dim, bias=False)  # W_O
        check_bool_flag(latent_norm, "latent_norm")
        self.kv_norm = nn.RMSNorm(kv_latent_dim, eps=1e-6) if latent_norm else None  # kv_a_layernorm
        self.q_norm = nn.RMSNorm(q_latent_dim, eps=1e-6) if latent_norm and q_latent_dim else None
        self.rotary = RotaryEmbedding(rope_dim, max_len=max_positions, base=rope_base)
        self.scale = scale_or_default(None, E + rope_dim)

    def absorbed_weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` folded into the query side and ``W_UV`` into the output projection.

        Returns:
            ``(w_q, w_o)``: w_q (H, d_c, q_in) maps a query input to a query *in latent space* per head
            (``W_UK_h^T W_UQ_h``); w_o (D, H, d_c) maps each head's latent output to the layer output
            (``W_O_h W_UV_h``).
        """
        H, E, dc = self.num_heads, self.head_dim, self.kv_latent_dim
        w_uq = self.q_up.weight.view(H, E, -1)  # (H*E, q_in) -> (H, E, q_in)
        w_uk = self.k_up.weight.view(H, E, dc)  # (H*E, d_c) -> (H, E, d_c)
        w_uv = self.v_up.weight.view(H, E, dc)  # (H*E, d_c) -> (H, E, d_c)
        w_o = self.out_proj.weight.view(self.embed_dim, H, E)  # (D, H*E) -> (D, H, E)
        return torch.einsum("hec,heq->hcq", w_uk, w_uq), torch.einsum("dhe,hec->dhc", w_o, w_uv)

    def forward(self, x: torch.Tensor, cache: Optional[LatentCache] = None, absorbed: bool = False,
                need_weights: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Causal self-attention of ``x`` (B, L, D), after the cached tokens if a cache is given.

        Args:
            x: (B, L, D).
            cache: a :class:`LatentCache` to read and extend, or ``None``.
            absorbed: compute in the absorbed form (attention over the latent) instead of the expanded one.
            need_weights: also return the weights (B, H, L, S).

        Returns:
            ``(out, weights_or_None)``, out (B, L, D).
        """
        check_tensor(x, "x")
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x must be (B, L, D) with D = {self.embed_dim}, got shape {fmt_shape(x.shape)}")
        check_floating(x, "x")
        check_bool_flag(absorbed, "absorbed")
        check_bool_flag(need_weights, "need_weights")
        weight = self.kv_down.weight
        if x.dtype != weight.dtype or x.device != weight.device:
            raise TypeError(f"x must have the module's dtype and device ({weight.dtype} on {weight.device}), got "
                            f"{x.dtype} on {x.device}; convert one (module.to(x.dtype) or x.to(...))")
        if cache is not None and not isinstance(cache, LatentCache):
            raise TypeError(f"cache must be a LatentCache or None, got {type(cache).__name__}")
        past = 0 if cache is None else len(cache)
        if cache is not None:
            if cache.batch_size is not None and cache.batch_size != x.shape[0]:
                raise ValueError(f"x has batch size B = {x.shape[0]} but the cache holds B = {cache.batch_size} "
                                 "sequences; use one cache per batch (or cache.reset())")
            if cache.latent is not None and cache.latent.dtype != x.dtype:
                raise TypeError(f"x is {x.dtype} but the cache holds {cache.latent.dtype}; use a new cache")
        if past + x.shape[1] > self.rotary.max_len:
            raise ValueError(f"positions up to {past + x.shape[1] - 1} (cache {past} + L = {x.shape[1]}) but the "
                             f"module covers max_positions = {self.rotary.max_len}")
        if cache is None:
            return self._forward(x, None, absorbed, need_weights)
        state = cache.snapshot()
        try:  # transactional: a call that raises leaves the cache as it was
            return self._forward(x, cache, absorbed, need_weights)
        except BaseException:
            cache.restore(state)
            raise

    def latent_of(self, x: torch.Tensor) -> torch.Tensor:
        """The cached latent of ``x`` (B, L, D): ``RMSNorm(W_DKV x)`` (B, L, d_c)."""
        c = self.kv_down(x)  # (B, L, d_c)
        return c if self.kv_norm is None else self.kv_norm(c)

    def query_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the query projections read: ``x`` or its normalised compression (B, L, q_in)."""
        if self.q_down is None:
            return x
        c = self.q_down(x)  # (B, L, d_c')
        return c if self.q_norm is None else self.q_norm(c)

    def _forward(self, x: torch.Tensor, cache: Optional[LatentCache], absorbed: bool, need_weights: bool
                 ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        B, L, _ = x.shape
        H, dr = self.num_heads, self.rope_dim
        past = 0 if cache is None else len(cache)
        latent = self.latent_of(x)  # (B, L, d_c)
        rope_key = self.rotary.rotate(self.k_rope(x), offset=past, name="rope key")  # (B, L, d_r)
        if cache is not None:
            latent, rope_key = cache.update(latent, rope_key)  # (B, S, d_c), (B, S, d_r)
        S = latent.shape[1]
        mask = None if cache is None else cached_causal_mask(L, S, device=x.device)
        q_in = self.query_input(x)  # (B, L, q_in)
        q_rope = self.q_rope(q_in).view(B, L, H, dr).transpose(1, 2)  # (B, L, H*d_r) -> (B, H, L, d_r)
        q_rope = self.rotary.rotate(q_rope, offset=past, name="rope query")
        return self.attend_latent(q_in, q_rope, latent, rope_key, mask, cache is None, absorbed, need_weights)

    def attend_latent(self, q_in: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, rope_key: torch.Tensor,
                      mask: Optional[torch.Tensor], is_causal: bool, absorbed: bool, need_weights: bool,
                      block_mask: Optional[BlockMask] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Attention of L queries over S cached tokens given as latents, in either form.

        Args:
            q_in: (B, L, q_in) what the query projections read.
            q_rope: (B, H, L, d_r) the rotated rotary queries.
            latent: (B, S, d_c) the latents of every token attended to.
            rope_key: (B, S, d_r) their rotated rotary keys.
            mask: bool (L, S) or (B, 1, L, S), or ``None``.
            is_causal: SDPA's upper-left causal flag (when ``mask`` is ``None``).
            absorbed: the absorbed form (attention over the latent) or the expanded one.
            need_weights: also return the weights (B, H, L, S).
            block_mask: attend through ``flex_attention`` with this block mask instead (no weights).

        Returns:
            ``(out (B, L, D), weights_or_None)``.
        """
        B, L, _ = q_in.shape
        S = latent.shape[1]
        H, E, dr = self.num_heads, self.head_dim, self.rope_dim
        if absorbed:
            w_q, w_o = self.absorbed_weights()
            q_lat = torch.einsum("blq,hcq->bhlc", q_in, w_q)  # (B, L, q_in) -> (B, H, L, d_c)
            query = torch.cat([q_lat, q_rope], dim=-1)  # (B, H, L, d_c + d_r)
            key = torch.cat([latent, rope_key], dim=-1)[:, None]  # (B, S, d_c + d_r) -> (B, 1, S, d_c + d_r)
            value = latent[:, None]  # (B, S, d_c) -> (B, 1, S, d_c): one key/value head for all H query heads
            if block_mask is not None:
                out, weights = self._attend(query, key, value, mask, is_causal, need_weights, True, block_mask)
            else:  # one key/value head: the H heads' queries become H * L rows of one head (as FlashMLA packs them)
                if is_causal:
                    mask = torch.ones(L, S, dtype=torch.bool, device=q_in.device).tril(S - L)  # (L, S)
                if mask is not None and mask.dim() == 2:
                    mask = mask.repeat(H, 1)  # (L, S) -> (H*L, S): every head's rows alike
                elif mask is not None:
                    mask = mask[:, 0].repeat(1, H, 1)[:, None]  # (B, 1, L, S) -> (B, 1, H*L, S)
                packed = query.reshape(B, 1, H * L, query.shape[-1])  # (B, H, L, d_c + d_r) -> (B, 1, H*L, .)
                out, weights = self._attend(packed, key, value, mask, False, need_weights, False, None)
                out = out.reshape(B, H, L, self.kv_latent_dim)  # (B, 1, H*L, d_c) -> (B, H, L, d_c)
                weights = None if weights is None else weights.view(B, H, L, S)
            return torch.einsum("bhlc,dhc->bld", out, w_o), weights  # (B, H, L, d_c) -> (B, L, D)
        q = self.q_up(q_in).view(B, L, H, E).transpose(1, 2)  # (B, L, H*E) -> (B, H, L, E)
        k = self.k_up(latent).view(B, S, H, E).transpose(1, 2)  # (B, S, d_c) -> (B, H, S, E)
        v = self.v_up(latent).view(B, S, H, E).transpose(1, 2)  # (B, S, d_c) -> (B, H, S, E)
        query = torch.cat([q, q_rope], dim=-1)  # (B, H, L, E + d_r)
        key = torch.cat([k, rope_key[:, None].expand(B, H, S, dr)], dim=-1)  # (B, H, S, E + d_r)
        out, weights = self._attend(query, key, v, mask, is_causal, need_weights, False, block_mask)
        out = out.transpose(1, 2).reshape(B, L, H * E)  # (B, H, L, E) -> (B, L, H*E)
        return self.out_proj(out), weights

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                is_causal: bool, need_weights: bool, gqa: bool, block_mask: Optional[BlockMask] = None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if block_mask is not None:
            return flex_attention(query, key, value, block_mask=block_mask, scale=self.scale, enable_gqa=gqa), None
        args = (query, key, value, mask, 0.0, is_causal, self.scale, gqa)
        return attention(*args, need_weights=need_weights)


class LatentSelfAttention(MultiHeadLatentAttention):
    """MLA as the attention of a :class:`~attention_core.models.language_model.DecoderLM` layer.

    Same weights and arithmetic as :class:`MultiHeadLatentAttention` (no query compression); the rotary table is
    the model's (built for ``rope_dim``), and the cache is the model's :class:`KVCache`, whose per-layer "keys" are
    the rotary keys (B, 1, S, d_r) and "values" the latents (B, 1, S, d_c): ``d_c + d_r`` numbers per token.
    ``absorbed`` picks the form; the model decodes through the cache in the absorbed form by default.
    """

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, kv_latent_dim: int, rope_dim: int) -> None:
        super().__init__(embed_dim, num_heads, head_dim, kv_latent_dim, rope_dim, max_positions=2)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, cache: Optional[KVCache], layer: int,  # type: ignore[override]
                plan, need_weights: bool = False, absorbed: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``x`` (B, L, D) -> ``(out (B, L, D), weights_or_None)``, reading and extending ``cache``'s layer
        ``layer``; ``plan`` (from the model) gives positions, mask and whether cached keys are re-rotated."""
        B, L, _ = x.shape
        H, dr = self.num_heads, self.rope_dim
        latent = self.latent_of(x)[:, None]  # (B, L, d_c) -> (B, 1, L, d_c)
        rope_key = self.k_rope(x)[:, None]  # (B, L, d_r) -> (B, 1, L, d_r)
        q_in = x
        q_rope = self.q_rope(q_in).view(B, L, H, dr).transpose(1, 2)  # (B, L, H*d_r) -> (B, H, L, d_r)
        if plan.rerotate:  # sinks: pre-RoPE keys in the cache, rotated by their slots now
            rope_key, latent = cache.update(layer, rope_key, latent)  # (B, 1, S, d_r), (B, 1, S, d_c)
            S = rope_key.shape[2]
            q_rope = rotary.rotate(q_rope, offset=S - L, name="rope query")
            rope_key = rotary.rotate(rope_key, offset=0, name="rope key")
        else:
            q_rope = rotate_at(rotary, q_rope, plan.positions)
            rope_key = rotate_at(rotary, rope_key, plan.positions)
            if cache is not None:
                rope_key, latent = cache.update(layer, rope_key, latent)
        return self.attend_latent(q_in, q_rope, latent[:, 0], rope_key[:, 0], plan.mask, plan.is_causal, absorbed,
                                  need_weights, plan.block_mask)


def latent_score_flops(L: int, S: int, embed_dim: int, num_heads: int, head_dim: int, kv_latent_dim: int,
                       rope_dim: int, absorbed: bool) -> int:
    """FLOPs (2 per multiply-add) of one MLA layer's attention for L queries over S tokens whose latents are cached.

    Counted, for the parts where the two forms differ: rebuilding keys and values from the S latents (expanded
    only, ``2 S d_c 2 H E``); the scores and the weighted sum (``2 L S H (E + d_r + E)`` expanded,
    ``2 L S H (d_c + d_r + d_c)`` absorbed); the query and output projections (``2 L D H E`` each expanded,
    ``2 L D H d_c`` each absorbed, the up-projections folded into them). Masking is ignored (a causal prefill
    computes about half of the scores in either form); the latent and rotary projections are the same in both.
    """
    for name, n in {"L": L, "S": S, "embed_dim": embed_dim, "num_heads": num_heads, "head_dim": head_dim,
                    "kv_latent_dim": kv_latent_dim, "rope_dim": rope_dim}.items():
        check_positive_int(n, name)
    check_bool_flag(absorbed, "absorbed")
    D, H, E, dc, dr = embed_dim, num_heads, head_dim, kv_latent_dim, rope_dim
    if absorbed:
        return 2 * L * S * H * (2 * dc + dr) + 2 * 2 * L * D * H * dc
    return 2 * S * dc * 2 * H * E + 2 * L * S * H * (2 * E + dr) + 2 * 2 * L * D * H * E
