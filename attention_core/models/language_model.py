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
latent and a rotary key per token, and decoding reads it in the absorbed form).

Sampling (:func:`sample_next_token`, :func:`generate`): greedy (``temperature=0``), temperature, top-k and top-p
(nucleus), drawn with a seeded ``torch.Generator`` so that a generation repeats exactly.

This module gathers three rooms under one name: the model (:mod:`attention_core.models.decoder_lm`), sampling
(:mod:`attention_core.models.sampling`) and generation (:mod:`attention_core.models.generation`), which imports
the other two.
"""

from __future__ import annotations

from attention_core.models.decoder_lm import (
    CausalSelfAttention,
    DecoderBlock,
    DecoderLM,
    LMConfig,
    LMOutput,
    build_language_model,
    left_pad,
)
from attention_core.models.generation import generate
from attention_core.models.kv_cache import KVCache, cached_causal_mask
from attention_core.models.sampling import filter_top_k, filter_top_p, sample_next_token

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
    "left_pad",
    "sample_next_token",
]
