"""Causal self-attention over the top-k keys a lightning indexer selects (DeepSeek Sparse Attention, small).

DeepSeek-V3.2-Exp (DeepSeek-AI, 2025, section 1) adds to each attention layer an indexer (eq. (1)) whose scores
choose, for every query token, the ``k`` earlier tokens it attends to (eq. (2)); the main attention then runs over
those only. :class:`IndexedAttention` is that layer at the scale of this book, built from the library's pieces:
:func:`attention_core.indexer.indexer_scores`, :func:`attention_core.indexer.causal_topk_mask` (a bool mask, True =
attend) and :func:`attention_core.functional.attention` with that mask.

Training, as the report's section 2.1, is the caller's loop; the layer gives what it needs:

- ``dense=True``: attention over every earlier token (the warm-up stage); with ``need_index_loss=True`` the
  output carries eq. (3)'s loss, the KL from the main attention (summed over heads, L1-normalized) to the
  indexer's softmax over every earlier key. The paper trains only the indexer then (:meth:`indexer_parameters`
  are those parameters; freeze the rest);
- ``dense=False``: the top-k selection; the loss is eq. (4)'s, over the selected keys only.

In both, the indexer reads a *detached* copy of the layer input and the target is detached: the indexer learns
from its loss alone and the main model from the language-model loss alone (the report: "the indexer input is
detached from the computational graph"). The selection itself passes no gradient.

What differs from the paper: the main attention is plain multi-head attention with one key/value per head (DSA is
instantiated on MLA in its MQA mode, every query head sharing one latent key/value entry); no FP8 indexer, no
Hadamard rotation, no rotary position on the indexer (this layer has no positions of its own: the model adds them
to its input); ``k`` (``topk``), the indexer heads ``H_I`` (``index_heads``) and their width ``d_I``
(``index_dim``) are small (the paper: k = 2048, H_I = 64, d_I = 128); the index score scales its queries by
``1/sqrt(d_I)`` and its weights by ``1/sqrt(H_I)`` (eq. (1) writes none; ours keep the scores O(1) at
initialization); the sparse stage's target is the weights of the attention that ran (each head's softmax over the
selected keys), summed over heads and L1-normalized. The query's own token is a candidate and not forced.

Decoding: :class:`IndexedCache` holds the keys and values of every earlier token and the indexer's own key per
token (``d_I`` numbers a token); a call with a cache appends to a new cache and selects, for each new query, among
every cached token and the new ones up to itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.nn as nn

from attention_core._checks import check_bool_flag, check_positive_int, check_tensor, fmt_shape
from attention_core.functional import attention
from attention_core.indexer import causal_allowed, causal_topk_mask, indexer_kl_loss, indexer_scores
from attention_core.models._inputs import check_sequence_input, check_state_tensors

__all__ = ["IndexedAttention", "IndexedAttentionOutput", "IndexedCache", "LightningIndexer", "allowed_keys",
           "pack_heads", "unpack_heads"]


def _lightning_scores(m: nn.Module, x: torch.Tensor, index_key: torch.Tensor) -> torch.Tensor:
    """Eq. (1) for the queries of x (B, L, D) against index keys (B, S, d_I): (B, L, S); ``m`` has ``index_q``,
    ``index_w``, ``index_heads`` and ``index_dim``."""
    B, L, _ = x.shape
    q = m.index_q(x).view(B, L, m.index_heads, m.index_dim).transpose(1, 2)  # (B, L, H_I d_I) -> (B, H_I, L, d_I)
    w = m.index_w(x).transpose(1, 2) / math.sqrt(m.index_heads)  # (B, L, H_I) -> (B, H_I, L)
    return indexer_scores(q / math.sqrt(m.index_dim), index_key, w)  # (B, L, S)


class LightningIndexer(nn.Module):
    """DSA's lightning indexer alone (eq. (1)), as a decoder layer with ``index_topk`` carries it: ``index_q``
    (D -> H_I d_I), ``index_k`` (D -> d_I, one key per token), ``index_w`` (D -> H_I), no biases; the scores
    scale as :class:`IndexedAttention`'s (queries by ``1/sqrt(d_I)``, weights by ``1/sqrt(H_I)``). The layer
    rotates its queries and keys (RoPE, as DeepSeek-V3.2's indexer does) before :meth:`scores`."""

    def __init__(self, embed_dim: int, index_heads: int, index_dim: int) -> None:
        super().__init__()
        D = check_positive_int(embed_dim, "embed_dim")
        self.index_heads = check_positive_int(index_heads, "index_heads")
        self.index_dim = check_positive_int(index_dim, "index_dim")
        self.index_q = nn.Linear(D, index_heads * index_dim, bias=False)
        self.index_k = nn.Linear(D, index_dim, bias=False)
        self.index_w = nn.Linear(D, index_heads, bias=False)

    def key(self, x: torch.Tensor) -> torch.Tensor:
        """The indexer keys of x (B, L, D): (B, 1, L, d_I) (one head, shared by the indexer heads)."""
        return self.index_k(x).unsqueeze(1)  # (B, L, d_I) -> (B, 1, L, d_I)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """The indexer queries of x (B, L, D): (B, H_I, L, d_I)."""
        B, L, _ = x.shape
        return self.index_q(x).view(B, L, self.index_heads, self.index_dim).transpose(1, 2)  # -> (B, H_I, L, d_I)

    def scores(self, x: torch.Tensor, query: torch.Tensor, index_key: torch.Tensor) -> torch.Tensor:
        """Eq. (1): ``query`` (B, H_I, L, d_I) (from x (B, L, D), rotated) against ``index_key`` (B, S, d_I)
        -> (B, L, S); the weights ``w_{t,j}`` come from x."""
        w = self.index_w(x).transpose(1, 2) / math.sqrt(self.index_heads)  # (B, L, H_I) -> (B, H_I, L)
        return indexer_scores(query / math.sqrt(self.index_dim), index_key, w)  # (B, L, S)


def allowed_keys(mask: Optional[torch.Tensor], is_causal: bool, B: int, L: int, S: int,
                 device: torch.device) -> torch.Tensor:
    """The keys each query may read, (B, L, S) bool, from an attention call's bool ``mask`` ((L, S) or
    (B, 1, L, S), True = attend) or its ``is_causal`` flag (SDPA's upper-left), or every key when neither."""
    if mask is not None:
        check_tensor(mask, "mask")
    if mask is None:
        allowed = causal_allowed(L, S, 0, device) if is_causal else torch.ones(L, S, dtype=torch.bool, device=device)
        return allowed.expand(B, L, S)
    if mask.dtype != torch.bool:
        raise ValueError(f"an indexed layer needs a bool attention mask, got {mask.dtype}")
    return (mask if mask.dim() == 2 else mask[:, 0]).expand(B, L, S)  # (B, 1, L, S) -> (B, L, S)


def pack_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Vectors (B, N, L, d) as ``m = ceil(d / E)`` heads of width E each, zero-padded: (B, N m, L, E). The
    indexer's keys travel so in a :class:`~attention_core.models.kv_cache.KVCache` entry beside the layer's keys,
    and its queries and keys are rotated so by the model's rotary table (RoPE block by block)."""
    check_tensor(x, "x")
    check_positive_int(head_dim, "head_dim")
    if x.dim() != 4:
        raise ValueError(f"x must be (B, N, L, d), got shape {fmt_shape(x.shape)}")
    B, N, L, d = x.shape
    m = -(-d // head_dim)
    padded = torch.nn.functional.pad(x, (0, m * head_dim - d))  # (B, N, L, m E)
    return padded.view(B, N, L, m, head_dim).transpose(2, 3).reshape(B, N * m, L, head_dim)  # -> (B, N m, L, E)


def unpack_heads(heads: torch.Tensor, N: int, d: int) -> torch.Tensor:
    """The inverse of :func:`pack_heads`: (B, N m, L, E) -> (B, N, L, d)."""
    check_tensor(heads, "heads")
    check_positive_int(N, "N")
    check_positive_int(d, "d", allow_zero=True)
    if heads.dim() != 4 or heads.shape[1] % N:
        raise ValueError(f"heads must be (B, N m, L, E) with N = {N} dividing dim 1, got shape "
                         f"{fmt_shape(heads.shape)}")
    B, Nm, L, E = heads.shape
    m = Nm // N
    return heads.view(B, N, m, L, E).transpose(2, 3).reshape(B, N, L, m * E)[..., :d]  # -> (B, N, L, d)


@dataclass(frozen=True)
class IndexedCache:
    """The tokens seen so far: ``key``, ``value`` (B, H, S, E) of the main attention and ``index_key`` (B, S, d_I)
    of the indexer."""

    key: torch.Tensor
    value: torch.Tensor
    index_key: torch.Tensor

    def __len__(self) -> int:
        return self.key.shape[2]

    def nbytes(self) -> int:
        """Bytes held: keys, values and indexer keys."""
        return sum(t.numel() * t.element_size() for t in (self.key, self.value, self.index_key))


@dataclass
class IndexedAttentionOutput:
    """What :meth:`IndexedAttention.forward` returns.

    Attributes:
        out: (B, L, D), the layer's output.
        selected: (B, L, S) bool, the keys each query attended to (True = attend).
        index_loss: the indexer's KL loss (eq. (3) if dense, eq. (4) if sparse; mean over queries), or ``None``.
        cache: the cache after this call (the keys of every token so far), or ``None`` if none was given.
    """

    out: torch.Tensor
    selected: torch.Tensor
    index_loss: Optional[torch.Tensor]
    cache: Optional[IndexedCache]


class IndexedAttention(nn.Module):
    """Causal multi-head self-attention over the top-``topk`` keys of a lightning indexer (batch-first).

    Args:
        embed_dim: D.
        num_heads: H (``D % H == 0``; head width E = D / H).
        topk: keys each query keeps (k >= 1); ``topk >= L`` gives dense causal attention.
        index_heads: H_I, the indexer's heads.
        index_dim: d_I, the indexer's query/key width.
        bias: biases in the main projections.
    """

    def __init__(self, embed_dim: int, num_heads: int, topk: int, index_heads: int = 4, index_dim: int = 16,
                 bias: bool = False) -> None:
        super().__init__()
        D, H = check_positive_int(embed_dim, "embed_dim"), check_positive_int(num_heads, "num_heads")
        if D % H:
            raise ValueError(f"embed_dim ({D}) must be divisible by num_heads ({H})")
        self.num_heads, self.head_dim = H, D // H
        self.topk = check_positive_int(topk, "topk")
        self.index_heads = check_positive_int(index_heads, "index_heads")
        self.index_dim = check_positive_int(index_dim, "index_dim")
        check_bool_flag(bias, "bias")
        self.q_proj, self.k_proj = nn.Linear(D, D, bias=bias), nn.Linear(D, D, bias=bias)
        self.v_proj, self.o_proj = nn.Linear(D, D, bias=bias), nn.Linear(D, D, bias=bias)
        self.index_q = nn.Linear(D, index_heads * index_dim, bias=False)  # q^I_{t,j}
        self.index_k = nn.Linear(D, index_dim, bias=False)  # k^I_s, one per token
        self.index_w = nn.Linear(D, index_heads, bias=False)  # w_{t,j}

    def indexer_parameters(self) -> Iterator[nn.Parameter]:
        """The indexer's parameters: what the dense warm-up trains (everything else frozen)."""
        for m in (self.index_q, self.index_k, self.index_w):
            yield from m.parameters()

    def index_scores(self, x: torch.Tensor, index_key: torch.Tensor) -> torch.Tensor:
        """Eq. (1) for the queries of x (B, L, D) against index keys (B, S, d_I): (B, L, S)."""
        return _lightning_scores(self, x, index_key)

    def _check(self, x: object, cache: object) -> None:
        check_sequence_input(x, "x", self.q_proj.weight)
        if cache is None:
            return
        B, S = x.shape[0], len(cache) if isinstance(cache, IndexedCache) else 0
        want = {"key": (B, self.num_heads, S, self.head_dim), "value": (B, self.num_heads, S, self.head_dim),
                "index_key": (B, S, self.index_dim)}
        check_state_tensors(cache, "cache", IndexedCache, want, self.q_proj.weight)

    def forward(self, x: torch.Tensor, *, cache: Optional[IndexedCache] = None, dense: bool = False,
                need_index_loss: bool = False) -> IndexedAttentionOutput:
        """Attend, each query over its selected keys.

        Args:
            x: (B, L, D), the module's dtype and device; the tokens after those in ``cache``.
            cache: the earlier tokens' :class:`IndexedCache` (decoding), or ``None`` (x is the whole sequence).
            dense: attend to every earlier token (the warm-up stage) instead of the top-k.
            need_index_loss: compute the indexer's KL loss (runs the reference attention, which returns weights).

        Returns:
            An :class:`IndexedAttentionOutput`.
        """
        self._check(x, cache)
        check_bool_flag(dense, "dense")
        check_bool_flag(need_index_loss, "need_index_loss")
        B, L, D = x.shape
        H, E = self.num_heads, self.head_dim
        q = self.q_proj(x).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        k = self.k_proj(x).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        v = self.v_proj(x).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        x_index = x.detach()  # the indexer learns from its own loss only
        index_key = self.index_k(x_index)  # (B, L, d_I)
        offset = 0 if cache is None else len(cache)
        if cache is not None:
            k = torch.cat([cache.key, k], dim=2)  # (B, H, S, E)
            v = torch.cat([cache.value, v], dim=2)
            index_key = torch.cat([cache.index_key, index_key], dim=1)  # (B, S, d_I)
        S = offset + L
        need_scores = need_index_loss or not dense
        scores = self.index_scores(x_index, index_key) if need_scores else None  # (B, L, S)
        if dense:
            selected = causal_allowed(L, S, offset, x.device).expand(B, L, S)
        else:
            selected = causal_topk_mask(scores, self.topk, offset=offset)  # (B, L, S)
        o, weights = attention(q, k, v, attn_mask=selected.unsqueeze(1), need_weights=need_index_loss)
        out = self.o_proj(o.transpose(1, 2).reshape(B, L, D))  # (B, H, L, E) -> (B, L, D)
        loss = None
        if need_index_loss:  # eq. (3) over every earlier key, or eq. (4) over the selected ones
            loss = indexer_kl_loss(scores, weights, selected, reduction="mean")
        new_cache = None if cache is None else IndexedCache(k, v, index_key)
        return IndexedAttentionOutput(out, selected, loss, new_cache)

    def empty_cache(self, batch_size: int) -> IndexedCache:
        """A cache with no token yet, for a batch of ``batch_size`` (the module's dtype and device)."""
        B = check_positive_int(batch_size, "batch_size")
        w = self.q_proj.weight
        kv = w.new_zeros(B, self.num_heads, 0, self.head_dim)
        return IndexedCache(kv, kv.clone(), w.new_zeros(B, 0, self.index_dim))
