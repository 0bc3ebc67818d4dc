"""The encoder-decoder Transformer trained on the number-words task (chapter 8).

:class:`Seq2SeqTransformer` puts the library's blocks together: a source embedding with sinusoidal positions,
a :class:`~attention_core.models.transformer.TransformerEncoder`, and a :class:`TokenDecoder` (target embedding,
positions, a :class:`~attention_core.models.transformer.TransformerDecoder`, output layer). It speaks the
:class:`~attention_core.translation.EncoderDecoder` interface of the RNN models (``forward(src, src_valid_lens,
tgt_in)``, ``encode``, ``decoder.init_state``/``decoder.step``, ``has_attention``), so
:func:`attention_core.translation.train.train_seq2seq`, :func:`attention_core.translation.rnn.greedy_decode` and
:func:`attention_core.translation.metrics.evaluate` work on it unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from attention_core._checks import check_positive_int, check_tensor, fmt_shape
from attention_core.masks import padding_mask
from attention_core.models.transformer import (
    Activation,
    DecoderOutput,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from attention_core.positional import SinusoidalPositionalEncoding
from attention_core.translation.data import PAD_ID, check_source_batch

__all__ = [
    "TRANSFORMER_DEFAULTS",
    "Memory",
    "Seq2SeqAttentions",
    "Seq2SeqTransformer",
    "TokenDecoder",
    "build_transformer",
]


@dataclass
class Memory:
    """The encoded source.

    Attributes:
        outputs: (B, S, D) encoder output (the decoder's keys and values in cross-attention).
        mask: (B, S) bool, True at real source tokens.
        attentions: per encoder layer (B, H, S, S), when asked for; else ``None``.
    """

    outputs: torch.Tensor
    mask: torch.Tensor
    attentions: Optional[Tuple[torch.Tensor, ...]] = None


@dataclass
class Seq2SeqAttentions:
    """Every attention map of a forward pass, per layer, each (B, H, queries, keys)."""

    encoder: Tuple[torch.Tensor, ...]
    decoder_self: Tuple[torch.Tensor, ...]
    cross: Tuple[torch.Tensor, ...]


def _check_sizes(**sizes: object) -> None:
    """``TypeError``/``ValueError`` naming the first of ``sizes`` that is not an int >= 1."""
    for name, size in sizes.items():
        check_positive_int(size, name)


class _Embed(nn.Module):
    """Token embedding times sqrt(D), plus sinusoidal positions (then dropout).

    The embedding starts with standard deviation ``D ** -0.5`` so that after the ``sqrt(D)`` scaling a token's
    features have unit scale, like the position table's. (``nn.Embedding``'s default N(0, 1) start would make
    the tokens ``sqrt(D)`` times larger than the positions, which the model then struggles to read.)
    """

    def __init__(self, vocab_size: int, d_model: int, max_len: int, dropout: float) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model, padding_idx=PAD_ID)
        with torch.no_grad():
            nn.init.normal_(self.tokens.weight, std=d_model**-0.5)
            self.tokens.weight[PAD_ID].zero_()
        self.positions = SinusoidalPositionalEncoding(d_model, max_len=max_len, dropout=dropout)
        self.scale = math.sqrt(d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.positions(self.tokens(ids) * self.scale)  # (B, N) -> (B, N, D)


class TokenDecoder(nn.Module):
    """The target side: embedding + positions, a :class:`TransformerDecoder`, and the output layer.

    ``forward`` runs teacher forcing over a whole target; ``init_state``/``step`` decode one token at a time
    (the interface of :mod:`attention_core.translation.rnn`'s decoders; each step re-runs the prefix, no cache).
    """

    def __init__(self, vocab_size: int, d_model: int, num_heads: int, num_layers: int, dim_feedforward: int,
                 dropout: float, activation: Activation, norm_first: bool, max_len: int) -> None:
        super().__init__()
        _check_sizes(vocab_size=vocab_size, d_model=d_model, num_heads=num_heads, dim_feedforward=dim_feedforward,
                     max_len=max_len)
        check_positive_int(num_layers, "num_layers", allow_zero=True)
        self.embed = _Embed(vocab_size, d_model, max_len, dropout)
        self.layers = TransformerDecoder(
            lambda: TransformerDecoderLayer(d_model, num_heads, dim_feedforward, dropout, activation, norm_first),
            num_layers, norm=nn.LayerNorm(d_model) if norm_first else None,
        )
        self.generator = nn.Linear(d_model, vocab_size)
        self.vocab_size = vocab_size

    def forward(self, tgt_in: torch.Tensor, memory: Memory, need_weights: bool = False
                ) -> Tuple[torch.Tensor, DecoderOutput]:
        """Logits (B, T, V) for every target position (causal), and the stack's output."""
        out = self.layers(self.embed(tgt_in), memory.outputs, need_weights=need_weights, tgt_is_causal=True,
                          memory_key_padding_mask=memory.mask)
        return self.generator(out.last_hidden_state), out

    def init_state(self, memory: Memory) -> torch.Tensor:
        """The tokens fed so far: none, (B, 0)."""
        return memory.outputs.new_empty((memory.outputs.shape[0], 0), dtype=torch.long)

    def step(self, y_prev: torch.Tensor, state: torch.Tensor, memory: Memory, t: int
             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed ``y_prev`` (B,); return next-token logits (B, V), the new prefix, and the last layer's
        cross-attention of the new position, averaged over heads (B, S)."""
        prefix = torch.cat([state, y_prev[:, None]], dim=1)  # (B, t) -> (B, t + 1)
        logits, out = self(prefix, memory, need_weights=True)
        return logits[:, -1], prefix, out.cross_attentions[-1][:, :, -1].mean(1)  # (B, H, T, S) -> (B, S)


class Seq2SeqTransformer(nn.Module):
    """An encoder-decoder Transformer for token-to-token tasks (Vaswani et al., 2017), batch-first.

    Args:
        src_vocab_size, tgt_vocab_size: vocabulary sizes (id 0 is ``<pad>``).
        d_model: width D.
        num_heads: heads H in every attention.
        num_encoder_layers, num_decoder_layers: depth of each side.
        dim_feedforward: hidden width of the feed-forward networks.
        dropout: dropout everywhere (embeddings, attention weights, sublayers).
        activation: feed-forward activation.
        norm_first: pre-LN (True; adds a final LayerNorm to each side) or post-LN (False).
        max_len: longest source or target the position table covers.
        config: the dict :func:`build_transformer` made it from (stored in checkpoints).
    """

    def __init__(self, src_vocab_size: int, tgt_vocab_size: int, d_model: int = 64, num_heads: int = 4,
                 num_encoder_layers: int = 2, num_decoder_layers: int = 2, dim_feedforward: int = 128,
                 dropout: float = 0.1, activation: Activation = "gelu", norm_first: bool = True,
                 max_len: int = 64, config: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        _check_sizes(src_vocab_size=src_vocab_size, tgt_vocab_size=tgt_vocab_size, d_model=d_model,
                     num_heads=num_heads, dim_feedforward=dim_feedforward, max_len=max_len)
        check_positive_int(num_encoder_layers, "num_encoder_layers", allow_zero=True)
        check_positive_int(num_decoder_layers, "num_decoder_layers", allow_zero=True)
        self.src_embed = _Embed(src_vocab_size, d_model, max_len, dropout)
        self.encoder = TransformerEncoder(
            lambda: TransformerEncoderLayer(d_model, num_heads, dim_feedforward, dropout, activation, norm_first),
            num_encoder_layers, norm=nn.LayerNorm(d_model) if norm_first else None,
        )
        self.decoder = TokenDecoder(tgt_vocab_size, d_model, num_heads, num_decoder_layers, dim_feedforward,
                                    dropout, activation, norm_first, max_len)
        self.config = dict(config or {})

    @property
    def has_attention(self) -> bool:
        return True

    def encode(self, src: torch.Tensor, src_valid_lens: torch.Tensor, need_weights: bool = False) -> Memory:
        """Validate and encode (B, S) source ids whose first ``src_valid_lens[b]`` entries are real."""
        _, S = check_source_batch(src, src_valid_lens)
        mask = padding_mask(src_valid_lens, S)  # (B, S)
        out = self.encoder(self.src_embed(src), key_padding_mask=mask, need_weights=need_weights)
        return Memory(out.last_hidden_state, mask, out.attentions)

    def forward(self, src: torch.Tensor, src_valid_lens: torch.Tensor, tgt_in: torch.Tensor,
                need_weights: bool = False) -> Tuple[torch.Tensor, Optional[Seq2SeqAttentions]]:
        """Teacher forcing: logits (B, T, V) for ``tgt_in`` = ``<bos> y_1 .. y_{T-1}``.

        Returns:
            ``(logits, attentions)``: :class:`Seq2SeqAttentions` when ``need_weights``, else ``None``.
        """
        memory = self.encode(src, src_valid_lens, need_weights=need_weights)
        check_tensor(tgt_in, "tgt_in")
        if tgt_in.dim() != 2 or tgt_in.shape[0] != src.shape[0] or tgt_in.dtype != torch.long:
            raise ValueError(f"tgt_in must be (B={src.shape[0]}, T) int64 ids, got shape "
                             f"{fmt_shape(tgt_in.shape)} dtype {tgt_in.dtype}")
        logits, out = self.decoder(tgt_in, memory, need_weights=need_weights)
        if not need_weights:
            return logits, None
        return logits, Seq2SeqAttentions(memory.attentions, out.self_attentions, out.cross_attentions)


#: The book's default Transformer settings; :func:`build_transformer` fills in whatever a config leaves out.
TRANSFORMER_DEFAULTS: Dict[str, Any] = {
    "d_model": 64, "num_heads": 4, "num_encoder_layers": 2, "num_decoder_layers": 2, "dim_feedforward": 128,
    "dropout": 0.1, "activation": "gelu", "norm_first": True, "max_len": 64, "seed": 0,
}


def build_transformer(config: Dict[str, Any]) -> Seq2SeqTransformer:
    """A :class:`Seq2SeqTransformer` from a plain dict (what checkpoints store).

    Keys: ``src_vocab_size``, ``tgt_vocab_size`` (required) and any of :data:`TRANSFORMER_DEFAULTS`.
    Parameters are initialised from ``seed`` without touching the global RNG.
    """
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {type(config).__name__}")
    missing = [k for k in ("src_vocab_size", "tgt_vocab_size") if k not in config]
    if missing:
        raise ValueError(f"config lacks {missing}")
    unknown = set(config) - set(TRANSFORMER_DEFAULTS) - {"src_vocab_size", "tgt_vocab_size", "kind"}
    if unknown:
        raise ValueError(f"config has unknown keys {sorted(unknown)}")
    full = {"kind": "transformer", **TRANSFORMER_DEFAULTS, **config}
    kwargs = {k: v for k, v in full.items() if k not in ("kind", "seed")}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(full["seed"])
        return Seq2SeqTransformer(**kwargs, config=full)
