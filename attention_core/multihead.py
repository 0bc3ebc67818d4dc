"""Attention layers built on :func:`attention_core.scaled_dot_product_attention`.

:class:`attention_core.MultiHeadAttention` is batch-first, speaks the SDPA mask convention (True = attend) and
supports grouped-query attention (``num_kv_heads < num_heads``). :meth:`attention_core.MultiHeadAttention.from_torch`
copies a
``torch.nn.MultiheadAttention`` so the two can be compared number for number.
"""

from __future__ import annotations

import torch
from torch import nn

from attention_core._checks import (
    check_bool_flag,
    check_device,
    check_dropout,
    check_floating_dtype,
    check_mask_broadcasts,
    check_module_input,
    check_positive_int,
    check_rank,
    check_tensor,
    fmt_shape,
)
from attention_core.flex_attention import BlockMask, flex_attention
from attention_core.functional import attention
from attention_core.masks import causal_mask, combine_masks

__all__ = ["MultiHeadAttention", "kv_cache_bytes"]


class MultiHeadAttention(nn.Module):
    """Multi-head (and grouped-query) attention, batch-first.

    ``out = out_proj(concat_h attention(q_proj(x_q)_h, k_proj(x_k)_h', v_proj(x_v)_h'))``, where query head
    ``h`` reads key/value head ``h' = h // G``, ``G = num_heads / num_kv_heads`` (G = 1: classic MHA,
    ``num_kv_heads = 1``: multi-query attention).

    Args:
        embed_dim: D, the model width (query input and output size); a multiple of ``num_heads``.
        num_heads: H, query heads; head size E = D / H.
        num_kv_heads: H_kv, key/value heads (default ``num_heads``); must divide ``num_heads``.
        dropout: dropout on the attention weights, applied in training mode only.
        bias: whether the four projections have biases.
        kdim: key input size (default D).
        vdim: value input size (default D).
        device, dtype: factory arguments for the parameters (a floating dtype; default float32). Inputs must
            then have the parameters' dtype and device: the module never casts them (a float64 input into a
            float32 module raises ``TypeError`` rather than silently losing digits).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_int(embed_dim, "embed_dim")
        check_positive_int(num_heads, "num_heads")
        num_kv_heads = num_heads if num_kv_heads is None else check_positive_int(num_kv_heads, "num_kv_heads")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        check_bool_flag(bias, "bias")
        device = check_device(device)
        dtype = None if dtype is None else check_floating_dtype(dtype)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.kdim = embed_dim if kdim is None else check_positive_int(kdim, "kdim")
        self.vdim = embed_dim if vdim is None else check_positive_int(vdim, "vdim")
        self.dropout = check_dropout(dropout, "dropout")
        kv_dim = num_kv_heads * self.head_dim
        factory = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, kv_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, kv_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        *,
        key_padding_mask: torch.Tensor | None = None,
        backend: str | None = None,
        block_mask: BlockMask | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query: (B, L, D).
            key: (B, S, kdim); default ``query`` (self-attention).
            value: (B, S, vdim); default ``key``.
            attn_mask: SDPA convention (bool True = attend, or float added): (L, S), (B, L, S) or
                (B, H, L, S) (size-1 dims broadcast). Never torch.nn.MultiheadAttention's inverted bool
                convention: convert those with :func:`attention_core.from_torch_mha_mask`.
            is_causal: upper-left causal mask; combines with the other masks.
            need_weights: also return the per-head weights (B, H, L, S), computed by the reference backend.
                (``torch.nn.MultiheadAttention`` averages them over heads by default; take
                ``weights.mean(1)`` for that.)
            key_padding_mask: (B, S), True (or 0.0) for real keys, False (or -inf) for padding.
            backend: passed to :func:`attention_core.scaled_dot_product_attention` (or to
                :func:`attention_core.flex_attention` with a ``block_mask``: ``"chunked"`` by default).
            block_mask: a :class:`attention_core.BlockMask` of (L, S) instead of ``attn_mask``/``is_causal``/
                ``key_padding_mask``: attention then skips the tiles it records as empty (no dropout, no weights).

        Returns:
            ``(out, weights)``: out (B, L, D); weights (B, H, L, S) before dropout, or ``None``.
        """
        key = query if key is None else key
        value = key if value is None else value
        B, L, S = self._check_inputs(query, key, value)
        check_bool_flag(need_weights, "need_weights")
        check_bool_flag(is_causal, "is_causal")
        mask = self._merge_masks(attn_mask, key_padding_mask, is_causal, B, L, S, query.device)
        causal_fast = is_causal and mask is None  # a lone causal mask stays a flag, which kernels exploit
        H, H_kv, E = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(query).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        k = self.k_proj(key).view(B, S, H_kv, E).transpose(1, 2)  # (B, S, kdim) -> (B, H_kv, S, E)
        v = self.v_proj(value).view(B, S, H_kv, E).transpose(1, 2)  # (B, S, vdim) -> (B, H_kv, S, E)
        args = (q, k, v, mask, self.dropout if self.training else 0.0, causal_fast)
        if block_mask is not None:
            if mask is not None or is_causal or need_weights or args[4] > 0:
                raise ValueError("block_mask replaces attn_mask, is_causal and key_padding_mask, and takes no "
                                 "dropout and no need_weights")
            out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=H_kv != H, backend=backend or "chunked")
            weights = None
        else:
            out, weights = attention(*args, enable_gqa=H_kv != H, need_weights=need_weights, backend=backend)
        out = out.transpose(1, 2).reshape(B, L, self.embed_dim)  # (B, H, L, E) -> (B, L, H * E)
        return self.out_proj(out), weights

    def _check_inputs(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[int, int, int]:
        """Ranks, widths and lengths of the inputs; returns B, L, S."""
        widths = {"query": self.embed_dim, "key": self.kdim, "value": self.vdim}
        for (name, width), t in zip(widths.items(), (query, key, value)):
            check_tensor(t, name)
            check_rank(t, name, (3,), f"(B, N, {width}) (batch-first)")
            if t.shape[-1] != width:
                raise ValueError(f"{name} must have last dim {width}, got shape {fmt_shape(t.shape)}")
            check_module_input(t, name, self.q_proj.weight)
        if not query.shape[0] == key.shape[0] == value.shape[0]:
            raise ValueError(
                f"query, key and value must share the batch size B: got {fmt_shape(query.shape)}, "
                f"{fmt_shape(key.shape)}, {fmt_shape(value.shape)}"
            )
        if key.shape[1] != value.shape[1]:
            raise ValueError(
                f"key and value must have the same length S: got key {fmt_shape(key.shape)}, "
                f"value {fmt_shape(value.shape)}"
            )
        return query.shape[0], query.shape[1], key.shape[1]

    def _merge_masks(
        self,
        attn_mask: torch.Tensor | None,
        key_padding_mask: torch.Tensor | None,
        is_causal: bool,
        B: int,
        L: int,
        S: int,
        device: torch.device,
    ) -> torch.Tensor | None:
        """One mask broadcastable to (B, H, L, S) from the three ways of giving one (None if none given)."""
        if attn_mask is not None:
            self._check_mask(attn_mask, "attn_mask", device)
            check_rank(attn_mask, "attn_mask", (2, 3, 4), "(L, S), (B, L, S) or (B, H, L, S)")
            if attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(1)  # (B, L, S) -> (B, 1, L, S)
            check_mask_broadcasts(attn_mask, "attn_mask", (B, self.num_heads, L, S), "(B, H, L, S)")
        if key_padding_mask is not None:
            self._check_mask(key_padding_mask, "key_padding_mask", device)
            if tuple(key_padding_mask.shape) != (B, S):
                raise ValueError(
                    f"key_padding_mask must have shape (B, S) = {(B, S)}, "
                    f"got {fmt_shape(key_padding_mask.shape)}"
                )
            key_padding_mask = key_padding_mask[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
        if is_causal and (attn_mask is not None or key_padding_mask is not None):
            causal = causal_mask(L, S, device=device)  # (L, S)
        else:
            causal = None
        return combine_masks(attn_mask, key_padding_mask, causal)

    def _check_mask(self, mask: object, name: str, device: torch.device) -> None:
        """Bool, or float in float32 or the parameters' dtype, on the inputs' device (checked before the masks
        are combined, so that an error names the mask that caused it)."""
        check_tensor(mask, name)
        dtype = self.q_proj.weight.dtype
        if mask.dtype != torch.bool and mask.dtype not in (torch.float32, dtype):
            raise TypeError(
                f"{name} must be bool (True = attend) or float ({torch.float32} or the module's {dtype}), "
                f"got dtype {mask.dtype}"
            )
        if mask.device != device:
            raise ValueError(f"{name} must be on the device of query ({device}), got {mask.device}")

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """A :class:`MultiHeadAttention` computing the same function as ``m``, with copies of its weights.

        Ours is always batch-first: for ``m.batch_first=False``, feed ``x.transpose(0, 1)``, (L, B, D) ->
        (B, L, D). Its masks use the SDPA convention (:func:`attention_core.from_torch_mha_mask` converts).

        Raises:
            TypeError: ``m`` is not a ``torch.nn.MultiheadAttention``.
            ValueError: ``m`` uses ``add_bias_kv`` or ``add_zero_attn``, which this module does not have.
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"m must be a torch.nn.MultiheadAttention, got {type(m).__name__}")
        if m.bias_k is not None or m.bias_v is not None:
            raise ValueError("m uses add_bias_kv=True (a learned extra key/value): not supported")
        if m.add_zero_attn:
            raise ValueError("m uses add_zero_attn=True (an extra all-zero key/value): not supported")
        bias = m.in_proj_bias is not None
        weight = m.out_proj.weight
        new = cls(
            m.embed_dim, m.num_heads, dropout=m.dropout, bias=bias, kdim=m.kdim, vdim=m.vdim,
            device=weight.device, dtype=weight.dtype,
        )
        if m._qkv_same_embed_dim:
            w_q, w_k, w_v = m.in_proj_weight.chunk(3, dim=0)  # (3D, D) -> 3 x (D, D)
        else:
            w_q, w_k, w_v = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
        with torch.no_grad():
            for proj, w in ((new.q_proj, w_q), (new.k_proj, w_k), (new.v_proj, w_v), (new.out_proj, weight)):
                proj.weight.copy_(w)
            if bias:
                b_q, b_k, b_v = m.in_proj_bias.chunk(3)  # (3D,) -> 3 x (D,)
                for proj, b in ((new.q_proj, b_q), (new.k_proj, b_k), (new.v_proj, b_v)):
                    proj.bias.copy_(b)
                new.out_proj.bias.copy_(m.out_proj.bias)
        return new.train(m.training)


def kv_cache_bytes(num_layers: int, num_kv_heads: int, head_dim: int, tokens: int, batch: int = 1,
                   bytes_per_element: int = 2) -> int:
    """Bytes of the key/value cache a decoder keeps while generating: one key and one value vector per
    layer, key/value head and token, ``2 * num_layers * num_kv_heads * head_dim * tokens * batch * bytes``.

    Multi-query and grouped-query attention shrink it by ``num_heads / num_kv_heads`` against multi-head
    attention. ``bytes_per_element`` is 2 for float16/bfloat16, 4 for float32.
    """
    sizes = {"num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "tokens": tokens,
             "batch": batch, "bytes_per_element": bytes_per_element}
    for name, n in sizes.items():
        check_positive_int(n, name, allow_zero=name == "tokens")
    return 2 * num_layers * num_kv_heads * head_dim * tokens * batch * bytes_per_element
