"""A small attention-based sentence classifier, in the shape Jain & Wallace (2019) tested.

Tokens are embedded, optionally read by a bidirectional GRU (``encoder="gru"``: every position's state then
carries information about its neighbours; ``encoder="none"``: each position is its token's embedding and
nothing else), pooled by additive attention with a learned query (``e_j = v^T tanh(W_q q + W_k h_j)``, the
:class:`~attention_core.models.rnn_attention.AdditiveAttention` of Bahdanau's decoder), and the pooled vector goes
through one linear layer to the class logits. ``attention="uniform"`` replaces the learned weights by ``1/n``
over the real tokens (the baseline of Wiegreffe & Pinter, 2019).

Shapes: ids (B, S) int64 padded with 0, ``valid_lens`` (B,); logits (B, C); weights (B, S), 0 at padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from attention_core._checks import check_positive_int, check_tensor, fmt_shape
from attention_core.masks import padding_mask
from attention_core.models._inputs import check_token_ids
from attention_core.models.rnn_attention import AdditiveAttention

__all__ = ["CLASSIFIER_DEFAULTS", "AttentionClassifier", "ClassifierOutput", "build_classifier"]

#: Settings :func:`build_classifier` fills in when a config leaves them out.
CLASSIFIER_DEFAULTS: Dict[str, Any] = {"num_classes": 2, "embed_dim": 32, "hidden_dim": 32, "encoder": "gru",
                                       "attention": "additive", "seed": 0}


@dataclass
class ClassifierOutput:
    """Logits (B, C) and the pooling's attention weights (B, S) (0 at padding)."""

    logits: torch.Tensor
    weights: torch.Tensor


class AttentionClassifier(nn.Module):
    """Embedding -> (BiGRU or nothing) -> additive-attention pooling -> linear.

    Args:
        vocab_size: number of token ids (0 is padding).
        num_classes: C.
        embed_dim: embedding size.
        hidden_dim: GRU size per direction, and the additive score's hidden size.
        encoder: ``"gru"`` (bidirectional GRU) or ``"none"`` (the embeddings themselves are the keys).
        attention: ``"additive"`` (learned) or ``"uniform"`` (``1/n`` over real tokens).
        config: the dict :func:`build_classifier` made it from (stored in checkpoints).
    """

    def __init__(self, vocab_size: int, num_classes: int = 2, embed_dim: int = 32, hidden_dim: int = 32,
                 encoder: str = "gru", attention: str = "additive", config: Optional[Dict[str, Any]] = None
                 ) -> None:
        super().__init__()
        for name, n in {"vocab_size": vocab_size, "num_classes": num_classes, "embed_dim": embed_dim,
                        "hidden_dim": hidden_dim}.items():
            check_positive_int(n, name)
        if encoder not in ("gru", "none"):
            raise ValueError(f"encoder must be 'gru' or 'none', got {encoder!r}")
        if attention not in ("additive", "uniform"):
            raise ValueError(f"attention must be 'additive' or 'uniform', got {attention!r}")
        self.encoder_kind, self.attention_kind = encoder, attention
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        self.rnn = nn.GRU(embed_dim, hidden_dim, batch_first=True, bidirectional=True) if encoder == "gru" else None
        key_dim = 2 * hidden_dim if encoder == "gru" else embed_dim
        self.query = nn.Parameter(torch.zeros(key_dim))
        self.attention = AdditiveAttention(key_dim, key_dim, hidden_dim)
        self.out = nn.Linear(key_dim, num_classes)
        self.config = dict(config or {})

    def encode(self, ids: torch.Tensor, valid_lens: torch.Tensor) -> torch.Tensor:
        """The keys (and values) of the pooling: (B, S) ids -> (B, S, Dk), zeros at padding."""
        check_token_ids(ids, "ids", self.embedding.num_embeddings, self.embedding.weight.device)
        check_tensor(valid_lens, "valid_lens")
        if valid_lens.dtype.is_floating_point or valid_lens.dtype == torch.bool or valid_lens.is_complex():
            raise TypeError(f"valid_lens must hold integer lengths, got dtype {valid_lens.dtype}")
        if tuple(valid_lens.shape) != (ids.shape[0],):
            raise ValueError(f"valid_lens must be a ({ids.shape[0]},) tensor of lengths, got shape "
                             f"{fmt_shape(valid_lens.shape)}")
        if valid_lens.device != ids.device:
            raise ValueError(f"valid_lens is on {valid_lens.device} but ids is on {ids.device}")
        if bool((valid_lens < 1).any()) or bool((valid_lens > ids.shape[1]).any()):
            raise ValueError(f"valid_lens must be in [1, {ids.shape[1]}] (S = {ids.shape[1]}), got "
                             f"{valid_lens.tolist()[:8]}")
        emb = self.embedding(ids)  # (B, S) -> (B, S, E)
        if ids.shape[0] == 0:  # an empty batch: nothing to pack
            return emb.new_zeros(0, ids.shape[1], self.query.shape[0])  # (0, S, Dk)
        if self.rnn is None:
            return emb * padding_mask(valid_lens, ids.shape[1])[..., None]
        packed = pack_padded_sequence(emb, valid_lens.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return pad_packed_sequence(out, batch_first=True, total_length=ids.shape[1])[0]  # (B, S, 2H)

    def forward(self, ids: torch.Tensor, valid_lens: torch.Tensor) -> ClassifierOutput:
        """Classify (B, S) padded ids whose first ``valid_lens[b]`` entries are real."""
        return self.pool(self.encode(ids, valid_lens), valid_lens)

    def pool(self, keys: torch.Tensor, valid_lens: torch.Tensor) -> ClassifierOutput:
        """The attention pooling and the output layer on encoded keys (B, S, Dk) (what :meth:`encode` returns):
        the part of the model after the encoder, so that a test of the attention need not re-run the encoder."""
        mask = padding_mask(valid_lens, keys.shape[1])  # (B, S)
        if self.attention_kind == "uniform":
            weights = mask.to(keys.dtype) / valid_lens[:, None].to(keys.dtype)  # (B, S)
            context = (weights[:, None, :] @ keys)[:, 0]  # (B, 1, S) @ (B, S, Dk) -> (B, Dk)
        else:
            query = self.query.expand(keys.shape[0], -1)  # (Dk,) -> (B, Dk)
            context, weights = self.attention(query, keys, attn_mask=mask)  # (B, Dk), (B, S)
        return ClassifierOutput(self.out(context), weights)


def build_classifier(config: Dict[str, Any]) -> AttentionClassifier:
    """An :class:`AttentionClassifier` from a plain dict (what checkpoints store): ``vocab_size`` (required) and
    any of :data:`CLASSIFIER_DEFAULTS`. Parameters are initialised from ``seed`` without touching the global RNG."""
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    if "vocab_size" not in config:
        raise ValueError("config lacks 'vocab_size'")
    unknown = set(config) - set(CLASSIFIER_DEFAULTS) - {"vocab_size"}
    if unknown:
        raise ValueError(f"config has unknown keys {sorted(unknown)}")
    full = {**CLASSIFIER_DEFAULTS, **config}
    check_positive_int(full["seed"], "config['seed']", allow_zero=True)
    kwargs = {k: v for k, v in full.items() if k != "seed"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(full["seed"])
        return AttentionClassifier(**kwargs, config=full)
