"""A small decoder-only Transformer language model, its key/value cache, and how it generates text.

The model (:class:`DecoderLM`, GPT-style) is a token embedding, a stack of pre-LN blocks (causal self-attention
with rotary positions, then a feed-forward network, each in a residual connection) and a read-out tied to the
embedding. Attention may share key/value heads (``num_kv_heads``: grouped-query or multi-query attention).

Generation runs in two phases with a :class:`KVCache`:

- **prefill**: the prompt goes through the model in one pass; every layer stores its keys and values;
- **decode**: each new token goes through alone, attends to the cached keys and values plus its own, and adds
  them to the cache. The logits are those of a full recomputation over the whole text, at a cost per token
  that grows with the length instead of with its square.

The cache stores keys *before* the rotary rotation and rotates them by their slot in the cache when attending
(as StreamingLLM does, Xiao et al., 2023). With nothing evicted, slot = position in the text, and the result is
the usual one. A cache built with ``window=W`` keeps only the ``W - 1`` most recent tokens between steps (each
query sees itself and those: a rolling sliding-window cache of constant size); ``sinks=n`` also keeps the
first ``n`` tokens forever (attention sinks). Slots, not text positions, keep every offset the model sees
within the cache's size, however long the text grows.

The decode step's mask is aligned bottom-right (the last query sees every key), unlike SDPA's ``is_causal``,
which is aligned upper-left: :func:`cached_causal_mask` builds it explicitly.

Sampling (:func:`sample_next_token`, :func:`generate`): greedy (``temperature=0``), temperature, top-k and top-p
(nucleus), drawn with a seeded ``torch.Generator`` so that a generation repeats exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from attention_core._checks import (
    check_bool_flag,
    check_floating,
    check_int,
    check_positive_int,
    check_real,
    check_tensor,
    fmt_shape,
)
from attention_core.functional import attention
from attention_core.masks import sliding_window_mask
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
    "filter_top_k",
    "filter_top_p",
    "generate",
    "sample_next_token",
]


# ------------------------------------------------------------------------------------------------ masks


def cached_causal_mask(
    L: int, S: int, window: Optional[int] = None, sinks: int = 0, *, device: Optional[torch.device] = None
) -> torch.Tensor:
    """Bool (L, S) mask for L new queries attending to S keys whose last L are the queries' own.

    Aligned bottom-right: query ``i`` sits at key slot ``S - L + i`` and sees keys ``j <= S - L + i``. With
    ``window``, only the ``window`` most recent of those (itself included) and, with ``sinks``, also the first
    ``sinks`` keys. For ``L == S`` and no window this is :func:`attention_core.causal_mask`.

    Args:
        L: number of queries (new tokens), ``L <= S``.
        S: number of keys (cached + new).
        window: keys seen per query, itself included; ``None`` = all earlier keys.
        sinks: number of leading keys every query sees (attention sinks), on top of the window.
        device: where to allocate.

    Returns:
        Bool tensor (L, S), True = attend.
    """
    L = check_positive_int(L, "L", allow_zero=True)
    S = check_positive_int(S, "S", allow_zero=True)
    if L > S:
        raise ValueError(f"L (queries) must be <= S (keys, which include the queries' own), got L={L}, S={S}")
    sinks = check_positive_int(sinks, "sinks", allow_zero=True)
    i = torch.arange(L, device=device)[:, None] + (S - L)  # (L, 1) query slots: the last L
    j = torch.arange(S, device=device)[None, :]  # (1, S) key slots
    if window is None:
        return j <= i
    window = check_positive_int(window, "window")
    return (j <= i) & ((j > i - window) | (j < sinks))


# ------------------------------------------------------------------------------------------------ cache


class KVCache:
    """The keys and values of every layer for the tokens generated so far (batch-first per layer).

    Per layer it holds ``keys`` (B, H_kv, S, E) *before* the rotary rotation and ``values`` (B, H_kv, S, E).

    Args:
        num_layers: layers of the model that fills it.
        window: ``None`` (keep everything) or W >= 1: a rolling cache; each query sees itself and the W - 1
            most recent tokens, and only those (plus the sinks) are kept between steps.
        sinks: with a window, the number of first tokens kept for good (attention sinks, Xiao et al., 2023).
    """

    def __init__(self, num_layers: int, window: Optional[int] = None, sinks: int = 0) -> None:
        self.num_layers = check_positive_int(num_layers, "num_layers")
        self.window = None if window is None else check_positive_int(window, "window")
        self.sinks = check_positive_int(sinks, "sinks", allow_zero=True)
        if self.sinks and self.window is None:
            raise ValueError(f"sinks={sinks} needs a window (a full cache keeps every token anyway)")
        self.keys: List[Optional[torch.Tensor]] = [None] * num_layers
        self.values: List[Optional[torch.Tensor]] = [None] * num_layers
        self.seen = 0  # tokens that went through the model (the text position of the next token)

    def __len__(self) -> int:
        """Tokens held now (per layer)."""
        k = self.keys[0]
        return 0 if k is None else k.shape[2]

    @property
    def capacity(self) -> Optional[int]:
        """Keys a query may see at most (sinks + window), or ``None`` for a full cache."""
        return None if self.window is None else self.sinks + self.window

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Append a layer's new keys and values (B, H_kv, L, E); return everything the queries attend to."""
        if self.keys[layer] is not None:
            key = torch.cat([self.keys[layer], key], dim=2)  # (B, H, S0, E) + (B, H, L, E) -> (B, H, S, E)
            value = torch.cat([self.values[layer], value], dim=2)
        self.keys[layer], self.values[layer] = key, value
        return key, value

    def step_done(self, new_tokens: int) -> None:
        """Count ``new_tokens`` as seen and evict what no later query will see (rolling cache only)."""
        self.seen += new_tokens
        if self.window is None or len(self) <= self.sinks + self.window - 1:
            return
        keep = self.window - 1  # the next query brings its own key: W - 1 earlier ones complete its window
        for layer in range(self.num_layers):
            for store in (self.keys, self.values):
                t = store[layer]
                store[layer] = torch.cat([t[:, :, : self.sinks], t[:, :, t.shape[2] - keep :]], dim=2)

    def nbytes(self) -> int:
        """Bytes of every cached key and value tensor."""
        return sum(t.numel() * t.element_size() for store in (self.keys, self.values) for t in store
                   if t is not None)

    @property
    def batch_size(self) -> Optional[int]:
        """B of the cached tensors, or ``None`` while the cache is empty (any batch may fill it)."""
        k = self.keys[0]
        return None if k is None else k.shape[0]

    def reset(self) -> None:
        """Forget every cached token (the cache may then take a batch of another size)."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.seen = 0

    def snapshot(self) -> Tuple[List[Optional[torch.Tensor]], List[Optional[torch.Tensor]], int]:
        """The cache's state, to :meth:`restore` if a call fails half-way. Cheap: appends and evictions build new
        tensors (``torch.cat``) and never write into cached ones, so holding the old references is enough."""
        return list(self.keys), list(self.values), self.seen

    def restore(self, state: Tuple[List[Optional[torch.Tensor]], List[Optional[torch.Tensor]], int]) -> None:
        """Put back a :meth:`snapshot`: the cache is exactly as it was when it was taken."""
        keys, values, seen = state
        self.keys, self.values, self.seen = list(keys), list(values), seen


# ------------------------------------------------------------------------------------------------ model


@dataclass
class LMOutput:
    """What :class:`DecoderLM` returns: ``logits`` (B, L, V) and, when asked, every layer's attention
    weights, a list of (B, Hq, L, S) tensors."""

    logits: torch.Tensor
    weights: Optional[List[torch.Tensor]] = None


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
        cache: Optional[KVCache] = None,
        layer: int = 0,
        window: Optional[int] = None,
        need_weights: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Self-attention of ``x`` (B, L, D), after the cached tokens if a cache is given.

        Args:
            x: (B, L, D) the new tokens' inputs.
            rotary: the model's rotary embedding.
            cache: a :class:`KVCache` (its window and sinks apply), or ``None``: plain causal attention over x.
            layer: this layer's index in the cache.
            window: without a cache, a sliding window (``None``: full causal attention).
            need_weights: also return the weights (B, Hq, L, S).

        Returns:
            ``(out, weights_or_None)``, out (B, L, D).
        """
        B, L, _ = x.shape
        Hq, H, E = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, L, Hq, E).transpose(1, 2)  # (B, L, D) -> (B, Hq, L, E)
        k = self.k_proj(x).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        v = self.v_proj(x).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
        if cache is None:
            mask, is_causal = (None, True) if window is None else (sliding_window_mask(L, window, device=x.device),
                                                                   False)
        else:
            k, v = cache.update(layer, k, v)  # (B, H, S, E): the cached keys and values, then these
            S = k.shape[2]
            mask, is_causal = cached_causal_mask(L, S, cache.window, cache.sinks, device=x.device), False
        q = rotary.rotate(q, offset=k.shape[2] - L, name="query")  # queries sit at the last L slots
        k = rotary.rotate(k, offset=0, name="key")  # keys at slots 0 .. S - 1
        args = (q, k, v, mask, 0.0, is_causal)
        out, weights = attention(*args, enable_gqa=H != Hq, need_weights=need_weights)
        out = out.transpose(1, 2).reshape(B, L, Hq * E)  # (B, Hq, L, E) -> (B, L, D)
        return self.out_proj(out), weights


class DecoderBlock(nn.Module):
    """Pre-LN decoder block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))`` (GELU feed-forward)."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: Optional[int], dim_feedforward: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, num_heads, num_kv_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, d_model)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, cache: Optional[KVCache] = None, layer: int = 0,
                window: Optional[int] = None, need_weights: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(B, L, D) -> (B, L, D), and the attention weights when asked."""
        a, weights = self.attn(self.norm1(x), rotary, cache, layer, window, need_weights)
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
        max_positions: positions the rotary table covers (inputs and cache slots stay below it).
        rope_base: the rotary wavelength scale.
    """

    def __init__(self, vocab_size: int, d_model: int = 128, num_layers: int = 4, num_heads: int = 4,
                 num_kv_heads: Optional[int] = None, dim_feedforward: Optional[int] = None, context: int = 128,
                 max_positions: int = 8192, rope_base: float = 10000.0) -> None:
        super().__init__()
        for name, n in {"vocab_size": vocab_size, "d_model": d_model, "num_layers": num_layers,
                        "context": context, "max_positions": max_positions}.items():
            check_positive_int(n, name)
        dim_feedforward = 4 * d_model if dim_feedforward is None else check_positive_int(dim_feedforward,
                                                                                         "dim_feedforward")
        self.vocab_size, self.d_model, self.num_layers, self.context = vocab_size, d_model, num_layers, context
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            DecoderBlock(d_model, num_heads, num_kv_heads, dim_feedforward) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tied read-out (GPT-2)
        attn = self.blocks[0].attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.rotary = RotaryEmbedding(self.head_dim, max_len=max_positions, base=rope_base)
        self.config: Dict[str, Any] = {}
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.num_layers) if name.endswith(("out_proj.weight",
                                                                              "linear2.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def new_cache(self, window: Optional[int] = None, sinks: int = 0) -> KVCache:
        """An empty :class:`KVCache` for this model (full, or rolling with ``window`` and ``sinks``)."""
        return KVCache(self.num_layers, window, sinks)

    def forward(self, tokens: torch.Tensor, cache: Optional[KVCache] = None, window: Optional[int] = None,
                need_weights: bool = False) -> LMOutput:
        """Logits for the next token at every position of ``tokens``.

        Args:
            tokens: (B, L) token ids, the text after the cached tokens (if any).
            cache: a :class:`KVCache` that this call reads and extends (prefill: empty cache and the prompt;
                decode: one token). ``None``: no cache, ``tokens`` is the whole text.
            window: without a cache, attend through a sliding window of this many keys (the reference for a
                rolling cache); with a cache, use the cache's own window.
            need_weights: also return every layer's attention weights.

        Returns:
            :class:`LMOutput`, logits (B, L, V).
        """
        self._check_call(tokens, cache, window, need_weights)
        if cache is None:
            return self._forward(tokens, None, window, need_weights)
        # Transactional: a call that raises (a backend that refuses, say, in a later layer than the first) leaves
        # the cache exactly as it was, never with some layers appended and others not.
        state = cache.snapshot()
        try:
            if cache.sinks and len(cache) + tokens.shape[1] > cache.capacity:
                if need_weights:
                    raise ValueError("need_weights=True with sinks: feed at most cache.capacity - len(cache) "
                                     "tokens per call (the slots move while tokens are evicted)")
                return self._forward_in_steps(tokens, cache)
            return self._forward(tokens, cache, None, need_weights)
        except BaseException:
            cache.restore(state)
            raise

    def _check_call(self, tokens: torch.Tensor, cache: Optional[KVCache], window: Optional[int],
                    need_weights: bool) -> None:
        """Everything a call can be refused for, checked before any layer touches the cache."""
        check_tensor(tokens, "tokens")
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be a (B, L) integer tensor, got {tokens.dtype} {fmt_shape(tokens.shape)}")
        check_bool_flag(need_weights, "need_weights")
        V = self.vocab_size
        if tokens.device != self.embed.weight.device:
            raise ValueError(f"tokens are on {tokens.device} but the model is on {self.embed.weight.device}")
        if tokens.numel() and (tokens.min() < 0 or tokens.max() >= V):
            raise ValueError(f"tokens must be ids in [0, {V}) (vocab_size = {V}), got values from "
                             f"{int(tokens.min())} to {int(tokens.max())}")
        L, max_len = tokens.shape[1], self.rotary.max_len
        if cache is None:
            if L > max_len:
                raise ValueError(f"tokens has L = {L} positions but the model covers max_positions = {max_len}")
            return
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache (model.new_cache()) or None, got {type(cache).__name__}")
        if window is not None:
            raise ValueError("window is a property of the cache when a cache is given: build it with "
                             "model.new_cache(window=...)")
        if cache.num_layers != self.num_layers:
            raise ValueError(f"cache has num_layers = {cache.num_layers} but the model has {self.num_layers}; "
                             "build it with model.new_cache()")
        if cache.batch_size is not None and cache.batch_size != tokens.shape[0]:
            raise ValueError(f"tokens has batch size B = {tokens.shape[0]} but the cache holds B = "
                             f"{cache.batch_size} sequences; use one cache per batch (or cache.reset())")
        needed = len(cache) + L  # the highest slot this call rotates by, plus one
        if cache.sinks and needed > cache.capacity:  # type: ignore[operator]
            needed = cache.capacity  # fed in steps that evict as they go: slots stay below the capacity
        if needed > max_len:
            raise ValueError(f"the cache holds {len(cache)} tokens and tokens adds L = {L}: slots up to "
                             f"{needed - 1}, but the model covers max_positions = {max_len}")

    def _forward(self, tokens: torch.Tensor, cache: Optional[KVCache], window: Optional[int],
                 need_weights: bool) -> LMOutput:
        x = self.embed(tokens)  # (B, L) -> (B, L, D)
        weights = [] if need_weights else None
        for i, block in enumerate(self.blocks):
            x, w = block(x, self.rotary, cache, i, window, need_weights)
            if weights is not None:
                weights.append(w)
        if cache is not None:
            cache.step_done(tokens.shape[1])
        return LMOutput(self.lm_head(self.norm(x)), weights)

    def _forward_in_steps(self, tokens: torch.Tensor, cache: KVCache) -> LMOutput:
        """With sinks, slots move as tokens are evicted: fill the cache in one pass, then one token at a time."""
        first = max(cache.capacity - len(cache), 1)  # type: ignore[operator]
        logits = [self(tokens[:, :first], cache).logits]
        logits += [self(tokens[:, t : t + 1], cache).logits for t in range(first, tokens.shape[1])]
        return LMOutput(torch.cat(logits, dim=1))  # (B, L, V)


@dataclass(frozen=True)
class LMConfig:
    """The shape of a :class:`DecoderLM` (its constructor's arguments) and the seed of its initialisation.

    ``LMConfig(**model.config)`` rebuilds the config a checkpoint stores; ``None`` for ``num_kv_heads`` and
    ``dim_feedforward`` means ``num_heads`` and ``4 * d_model``, for ``seed`` the global generator.
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
    if config.seed is None:
        model = DecoderLM(**kwargs)
    else:
        check_int(config.seed, "config['seed']")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            model = DecoderLM(**kwargs)
    model.config = recorded
    return model


# --------------------------------------------------------------------------------------------- sampling


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (ties with the k-th kept too); the rest become ``-inf``."""
    k = check_positive_int(k, "top_k")
    if k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the fewest most likely tokens whose probabilities sum to at least ``p``."""
    check_real(p, "top_p", low=0, high=1, low_open=True)
    probs, order = logits.softmax(-1).sort(dim=-1, descending=True)  # (..., V) each
    before = probs.cumsum(-1) - probs  # probability mass of the more likely tokens
    drop_sorted = before >= p  # the set already reached p without this token
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def sample_next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                      top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of ``logits`` (B, V): greedy when ``temperature == 0``, else sampled from
    ``softmax(logits / temperature)`` restricted by ``top_k`` and ``top_p``. Returns (B,) int64."""
    check_tensor(logits, "logits")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be (B, V) with V >= 1, got shape {fmt_shape(logits.shape)}")
    check_floating(logits, "logits")
    if logits.device.type == "meta":
        raise ValueError("logits is a meta tensor: it has no values to sample from")
    check_real(temperature, "temperature", low=0)
    if logits.numel():
        if logits.isnan().any() or (logits == math.inf).any():
            rows = (logits.isnan() | (logits == math.inf)).any(-1).nonzero().flatten().tolist()
            raise ValueError(f"logits must hold no NaN or +inf (rows {rows[:5]} do): they give no distribution")
        if (logits == -math.inf).all(-1).any():
            rows = (logits == -math.inf).all(-1).nonzero().flatten().tolist()
            raise ValueError(f"every logit of rows {rows[:5]} is -inf: nothing can be drawn")
    if temperature == 0:
        return logits.argmax(-1)
    scaled = logits.float() / temperature
    if (torch.isfinite(logits) & ~torch.isfinite(scaled)).any():
        # a tiny temperature overflowed (or is 0 in float32): divide the gaps to the row's best instead (the same
        # softmax): the best stays at 0, the others go to -inf, and the draw tends to greedy as it should
        gap = logits.float() - logits.float().amax(-1, keepdim=True)  # (B, V), <= 0
        scaled = torch.where(gap == 0, 0.0, gap / temperature)
    logits = scaled
    if top_k is not None:
        logits = filter_top_k(logits, top_k)
    if top_p is not None:
        logits = filter_top_p(logits, top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]  # (B, 1) -> (B,)


@torch.no_grad()
def generate(model: DecoderLM, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             generator: Optional[torch.Generator] = None, use_cache: bool = True, window: Optional[int] = None,
             sinks: int = 0) -> torch.Tensor:
    """Continue ``prompt`` (B, P) by ``max_new_tokens`` tokens; returns (B, P + max_new_tokens).

    With ``use_cache`` the prompt is prefilled once and every new token decoded alone from a :class:`KVCache`
    (rolling if ``window`` is given); without, every step recomputes the model over the whole text.
    """
    check_tensor(prompt, "prompt")
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be (B, P) token ids with P >= 1, got shape {fmt_shape(prompt.shape)}")
    check_positive_int(max_new_tokens, "max_new_tokens", allow_zero=True)
    check_bool_flag(use_cache, "use_cache")
    if sinks and not use_cache:
        raise ValueError("sinks need the rolling cache (use_cache=True)")
    model.eval()
    tokens = prompt
    cache = model.new_cache(window, sinks) if use_cache else None
    logits = model(prompt, cache, None if use_cache else window).logits[:, -1]  # prefill: (B, V)
    for step in range(max_new_tokens):
        nxt = sample_next_token(logits, temperature, top_k, top_p, generator)[:, None]  # (B, 1)
        tokens = torch.cat([tokens, nxt], dim=1)
        if step == max_new_tokens - 1:
            break
        if cache is not None:
            logits = model(nxt, cache).logits[:, -1]  # decode: one token against the cache
        else:
            logits = model(tokens, window=window).logits[:, -1]  # recompute everything
    return tokens
