"""BERT, the encoder, assembled from the library's blocks: embeddings, post-LN layers, pooler.

BERT (Devlin et al., 2019) is a stack of post-LN Transformer encoder layers over word + position + segment
embeddings. Here every layer is a :class:`~attention_core.models.transformer.TransformerEncoderLayer` (post-LN,
exact GELU) whose self-attention is :class:`~attention_core.MultiHeadAttention`, so any attention backend
of the library runs inside it. :func:`convert_bert_state_dict` renames a Hugging Face BERT checkpoint's
tensors to this model's parameter names; :mod:`attention_core.pretrained.minilm` loads a real one (MiniLM).

Inputs are validated at the edge: ``input_ids`` must be a padded (B, L) integer tensor (a ragged Python
list gets a ``TypeError`` pointing at :meth:`attention_core.pretrained.MiniLM.tokenize`), ``L`` at most
the position table (``max_position_embeddings``), ``attention_mask`` (B, L) with a real token per row.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from attention_core._checks import check_instance, check_tensor, fmt_shape
from attention_core.models.transformer import TransformerEncoder, TransformerEncoderLayer

__all__ = [
    "BertConfig",
    "BertEmbeddings",
    "BertEncoder",
    "BertOutput",
    "convert_bert_state_dict",
    "mean_pool",
]

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class BertConfig:
    """The hyper-parameters of a BERT encoder (the fields of a Hugging Face ``config.json`` that matter).

    Defaults are MiniLM-L6-H384's.
    """

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    pad_token_id: int = 0

    @classmethod
    def from_json(cls, path: PathLike) -> BertConfig:
        """Read ``config.json``; refuse what this implementation does not build (non-absolute positions...)."""
        raw = json.loads(Path(path).read_text())
        if raw.get("model_type", "bert") != "bert":
            raise ValueError(f"config {path}: model_type must be 'bert', got {raw.get('model_type')!r}")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"config {path}: only absolute position embeddings are built here")
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"config {path}: hidden_act must be 'gelu' (exact), got {raw.get('hidden_act')!r}")
        return cls(**{f.name: raw[f.name] for f in fields(cls) if f.name in raw})


# --------------------------------------------------------------------------------------------- model


@dataclass
class BertOutput:
    """What :class:`BertEncoder` returns.

    Attributes:
        last_hidden_state: (B, L, D), the last layer's token vectors.
        hidden_states: ``num_layers + 1`` tensors (B, L, D): the embeddings, then each layer's output
            (the same indexing as ``transformers``' ``output_hidden_states``).
        attentions: ``num_layers`` tensors (B, H, L, L) when ``need_weights``, else ``None``.
        pooler_output: (B, D), ``tanh(W h_[CLS] + b)``, BERT's next-sentence head (unused by MiniLM's
            sentence embeddings, but part of the checkpoint).
    """

    last_hidden_state: torch.Tensor
    hidden_states: Tuple[torch.Tensor, ...]
    attentions: Optional[Tuple[torch.Tensor, ...]]
    pooler_output: torch.Tensor


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm and dropout: (B, L) ids -> (B, L, D)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        check_instance(config, BertConfig, "config", "a BertConfig")
        D = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, D, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, D)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, D)
        self.norm = nn.LayerNorm(D, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, inputs_embeds: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """``inputs_embeds`` (B, L, D) are the word vectors (``word_embeddings(input_ids)``)."""
        B, L, D = inputs_embeds.shape
        positions = torch.arange(L, device=inputs_embeds.device)  # (L,), 0 .. L-1 for every sentence
        x = inputs_embeds + self.position_embeddings(positions) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.norm(x))  # (B, L, D)


class BertEncoder(nn.Module):
    """A BERT encoder from the library's blocks: embeddings, ``num_hidden_layers`` post-LN layers, pooler.

    Args:
        config: the hyper-parameters (:class:`BertConfig`).
    """

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        check_instance(config, BertConfig, "config", "a BertConfig")
        self.config = config
        self.embeddings = BertEmbeddings(config)

        def layer() -> TransformerEncoderLayer:
            return TransformerEncoderLayer(
                config.hidden_size,
                config.num_attention_heads,
                dim_feedforward=config.intermediate_size,
                dropout=config.hidden_dropout_prob,
                activation="gelu",
                norm_first=False,
                layer_norm_eps=config.layer_norm_eps,
            )

        self.encoder = TransformerEncoder(layer, config.num_hidden_layers)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self,
        input_ids: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        token_type_ids: Optional[torch.Tensor] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        need_weights: bool = False,
    ) -> BertOutput:
        """Encode a padded batch.

        Args:
            input_ids: (B, L) integer token ids; or give ``inputs_embeds`` instead.
            attention_mask: (B, L) bool or 0/1, True/1 = real token; ``None``: every token is real.
            token_type_ids: (B, L) segment ids (0 for single sentences, the default).
            inputs_embeds: (B, L, D) word vectors instead of ids (e.g. to take gradients w.r.t. them).
            need_weights: also return every layer's per-head attention weights.

        Returns:
            :class:`BertOutput`.
        """
        cfg = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids (B, L) and inputs_embeds (B, L, D)")
        if input_ids is not None:
            _check_input_ids(input_ids, cfg)
            inputs_embeds = self.embeddings.word_embeddings(input_ids)  # (B, L) -> (B, L, D)
        check_tensor(inputs_embeds, "inputs_embeds")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != cfg.hidden_size:
            raise ValueError(
                f"inputs_embeds must be (B, L, D) with D = {cfg.hidden_size}, got {fmt_shape(inputs_embeds.shape)}"
            )
        B, L, _ = inputs_embeds.shape
        _check_length(L, cfg, "input_ids" if input_ids is not None else "inputs_embeds")
        mask = _check_attention_mask(attention_mask, B, L, inputs_embeds.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros(B, L, dtype=torch.long, device=inputs_embeds.device)
        check_tensor(token_type_ids, "token_type_ids")
        if tuple(token_type_ids.shape) != (B, L):
            raise ValueError(f"token_type_ids must be (B, L) = {(B, L)}, got {fmt_shape(token_type_ids.shape)}")

        x = self.embeddings(inputs_embeds, token_type_ids)  # (B, L, D)
        enc = self.encoder(
            x, key_padding_mask=mask, need_weights=need_weights, output_hidden_states=True
        )
        pooled = torch.tanh(self.pooler(enc.last_hidden_state[:, 0]))  # [CLS] vector (B, D) -> (B, D)
        return BertOutput(enc.last_hidden_state, enc.hidden_states, enc.attentions, pooled)


def _check_input_ids(input_ids: object, cfg: BertConfig) -> None:
    if isinstance(input_ids, (list, tuple)):
        raise TypeError(
            f"input_ids must be a padded (B, L) torch.Tensor of token ids, got a {type(input_ids).__name__}; "
            "sentences of different lengths need padding and an attention_mask: use MiniLM.tokenize(sentences)"
        )
    check_tensor(input_ids, "input_ids")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, L), got shape {fmt_shape(input_ids.shape)}")
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= cfg.vocab_size):
        raise ValueError(
            f"input_ids must lie in [0, vocab_size = {cfg.vocab_size}), "
            f"got values in [{int(input_ids.min())}, {int(input_ids.max())}]"
        )


def _check_length(L: int, cfg: BertConfig, name: str) -> None:
    if L == 0:
        raise ValueError(f"{name} holds no tokens (length 0); a sentence needs at least [CLS] and [SEP]")
    if L > cfg.max_position_embeddings:
        raise ValueError(
            f"{name} has {L} tokens but the position table has {cfg.max_position_embeddings} rows; "
            "shorten the text or tokenize with truncate=True"
        )


def _check_attention_mask(mask: Optional[torch.Tensor], B: int, L: int, device: torch.device) -> torch.Tensor:
    if mask is None:
        return torch.ones(B, L, dtype=torch.bool, device=device)
    check_tensor(mask, "attention_mask")
    if tuple(mask.shape) != (B, L):
        raise ValueError(f"attention_mask must be (B, L) = {(B, L)}, got {fmt_shape(mask.shape)}")
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"attention_mask must be bool or integer 0/1 (1 = real token), got dtype {mask.dtype}")
        mask = mask.bool()
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"attention_mask has no real token in row(s) {empty}; every sentence needs one")
    return mask


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average the real tokens' vectors: (B, L, D), (B, L) -> (B, D) (padding is left out).

    This is ``sentence-transformers``' mean pooling; MiniLM's sentence embedding is its L2 normalisation.
    """
    check_tensor(hidden, "hidden")
    check_tensor(attention_mask, "attention_mask")
    if hidden.dim() != 3 or attention_mask.shape != hidden.shape[:2]:
        raise ValueError(f"hidden must be (B, L, D) and attention_mask (B, L), got hidden {fmt_shape(hidden.shape)} "
                         f"and attention_mask {fmt_shape(attention_mask.shape)}")
    m = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, L) -> (B, L, 1)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)  # (B, D)


# ------------------------------------------------------------------------------------ checkpoint names

_LAYER_NAMES = {
    "attention.self.query": "self_attn.q_proj",
    "attention.self.key": "self_attn.k_proj",
    "attention.self.value": "self_attn.v_proj",
    "attention.output.dense": "self_attn.out_proj",
    "attention.output.LayerNorm": "norm1",
    "intermediate.dense": "linear1",
    "output.dense": "linear2",
    "output.LayerNorm": "norm2",
}
_OTHER_NAMES = {
    "embeddings.word_embeddings": "embeddings.word_embeddings",
    "embeddings.position_embeddings": "embeddings.position_embeddings",
    "embeddings.token_type_embeddings": "embeddings.token_type_embeddings",
    "embeddings.LayerNorm": "embeddings.norm",
    "pooler.dense": "pooler",
}
_LAYER_RE = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
_OTHER_RE = re.compile(r"^(.+)\.(weight|bias)$")


def convert_bert_state_dict(checkpoint: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Rename a Hugging Face BERT checkpoint's tensors to :class:`BertEncoder`'s parameter names.

    ``encoder.layer.3.attention.self.query.weight`` -> ``encoder.layers.3.self_attn.q_proj.weight``, etc.
    (BERT's ``LayerNorm`` keeps its ``weight``/``bias`` names in current checkpoints; old ``gamma``/``beta``
    ones are not handled.) The ``embeddings.position_ids`` buffer (0..511) is checked and dropped: positions
    are computed. Any other name raises, so nothing is silently left out.

    Raises:
        ValueError: a tensor name this model has no place for, or a ``position_ids`` buffer that is not
            ``0, 1, ..., n-1``.
    """
    check_instance(checkpoint, Mapping, "checkpoint", "a mapping of names to tensors")
    out: Dict[str, torch.Tensor] = {}
    for name, tensor in checkpoint.items():
        if name == "embeddings.position_ids":
            if not torch.equal(tensor.flatten().cpu(), torch.arange(tensor.numel())):
                raise ValueError("checkpoint tensor embeddings.position_ids is not 0, 1, ..., n-1")
            continue
        m = _LAYER_RE.match(name)
        if m and m.group(2) in _LAYER_NAMES:
            out[f"encoder.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"] = tensor
            continue
        m = _OTHER_RE.match(name)
        if m and m.group(1) in _OTHER_NAMES:
            out[f"{_OTHER_NAMES[m.group(1)]}.{m.group(2)}"] = tensor
            continue
        raise ValueError(f"checkpoint tensor {name!r} has no place in BertEncoder")
    return out
