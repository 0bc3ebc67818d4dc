"""The Transformer's decoder, and the encoder-decoder model trained on the book's translation task.

A decoder block has three sublayers, each in a residual connection with a LayerNorm (post-LN or pre-LN,
as in :mod:`attention_core.transformer`):

1. **masked self-attention** over the target tokens so far (causal: position t sees 0..t);
2. **cross-attention**: queries from the decoder, keys and values from the encoder output ("memory");
3. a position-wise **feed-forward** network.

:class:`TransformerDecoderLayer` keeps ``torch.nn.TransformerDecoderLayer``'s parameter names
(``self_attn``, ``multihead_attn``, ``linear1``, ``linear2``, ``norm1..3``) and
:meth:`TransformerDecoderLayer.from_torch` copies one. As everywhere in the library it is batch-first and its
masks use True = attend (PyTorch's use True = blocked).

:class:`Seq2SeqTransformer` puts an encoder (:class:`~attention_core.transformer.TransformerEncoder`) and a
:class:`TokenDecoder` (target embedding, positions, decoder stack, output layer) together. It speaks the
interface of the RNN models in :mod:`attention_core.seq2seq` (``forward(src, src_valid_lens, tgt_in)``,
``encode``, ``decoder.init_state``/``decoder.step``), so :func:`attention_core.training.train_seq2seq`,
:func:`attention_core.seq2seq.greedy_decode` and :func:`attention_core.metrics.evaluate` work on it unchanged.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn

from attention_core._checks import check_bool_flag, check_positive_int, check_source_batch, check_tensor, fmt_shape
from attention_core.masks import padding_mask
from attention_core.modules import MultiHeadAttention
from attention_core.positional import SinusoidalPositionalEncoding
from attention_core.seq2seq_data import PAD_ID
from attention_core.transformer import (
    Activation,
    TransformerEncoder,
    TransformerEncoderLayer,
    _resolve_activation,
    _torch_activation_name,
)

__all__ = [
    "TRANSFORMER_DEFAULTS",
    "DecoderOutput",
    "DecoderWeights",
    "Memory",
    "Seq2SeqAttentions",
    "Seq2SeqTransformer",
    "TokenDecoder",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "build_transformer",
]


class DecoderWeights(NamedTuple):
    """Attention weights of one decoder layer: self (B, H, T, T) and cross (B, H, T, S)."""

    self_attn: torch.Tensor
    cross_attn: torch.Tensor


class TransformerDecoderLayer(nn.Module):
    """One decoder block: masked self-attention, cross-attention, feed-forward; post-LN or pre-LN.

    Args:
        d_model: model width D.
        num_heads: attention heads H in both attentions (``d_model % num_heads == 0``).
        dim_feedforward: hidden width of the feed-forward network.
        dropout: on the attention weights, after each sublayer and inside the feed-forward network.
        activation: ``"gelu"``, ``"gelu_tanh"``, ``"relu"`` or a callable.
        norm_first: pre-LN (True) or post-LN (False, the 2017 Transformer).
        layer_norm_eps: epsilon of the three LayerNorms.
        bias: biases in the linear layers and LayerNorms.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.0,
        activation: Activation = "gelu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        bias: bool = True,
    ) -> None:
        super().__init__()
        check_positive_int(d_model, "d_model")
        check_positive_int(dim_feedforward, "dim_feedforward")
        check_bool_flag(norm_first, "norm_first")
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=bias)
        self.multihead_attn = MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=bias)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias) for _ in range(3))
        self.dropout = nn.Dropout(dropout)  # inside the feed-forward network
        self.dropout1, self.dropout2, self.dropout3 = (nn.Dropout(dropout) for _ in range(3))  # after each sublayer
        self.norm_first = norm_first
        self.activation_name, self.activation = _resolve_activation(activation)
        self.d_model = d_model

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, activation={self.activation_name!r}"

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout3(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        tgt_mask: Optional[torch.Tensor] = None,
        memory_mask: Optional[torch.Tensor] = None,
        tgt_key_padding_mask: Optional[torch.Tensor] = None,
        memory_key_padding_mask: Optional[torch.Tensor] = None,
        tgt_is_causal: bool = False,
        need_weights: bool = False,
    ) -> Tuple[torch.Tensor, Optional[DecoderWeights]]:
        """Run the block.

        Args:
            x: (B, T, D) target-side states.
            memory: (B, S, D) encoder output.
            tgt_mask: bool (True = attend) or float mask broadcastable to (B, H, T, T), for self-attention.
            memory_mask: the same for cross-attention, broadcastable to (B, H, T, S).
            tgt_key_padding_mask: (B, T), True on real target tokens.
            memory_key_padding_mask: (B, S), True on real source tokens.
            tgt_is_causal: causal self-attention (combines with ``tgt_mask``).
            need_weights: also return both attentions' per-head weights.

        Returns:
            ``(out, weights)``: out (B, T, D); :class:`DecoderWeights` when ``need_weights``, else ``None``.
        """
        for name, t in (("x", x), ("memory", memory)):
            check_tensor(t, name)
            if t.dim() != 3 or t.shape[-1] != self.d_model:
                raise ValueError(f"{name} must be (B, N, D) with D = d_model = {self.d_model}, got shape "
                                 f"{fmt_shape(t.shape)}")
        if x.shape[0] != memory.shape[0]:
            raise ValueError(f"x and memory must share the batch size: got {fmt_shape(x.shape)} and "
                             f"{fmt_shape(memory.shape)}")
        self_kw = dict(attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask, is_causal=tgt_is_causal,
                       need_weights=need_weights)
        cross_kw = dict(attn_mask=memory_mask, key_padding_mask=memory_key_padding_mask, need_weights=need_weights)
        if self.norm_first:
            h = self.norm1(x)
            sa, w_self = self.self_attn(h, **self_kw)
            x = x + self.dropout1(sa)
            ca, w_cross = self.multihead_attn(self.norm2(x), memory, memory, **cross_kw)
            x = x + self.dropout2(ca)
            x = x + self._ff_block(self.norm3(x))
        else:
            sa, w_self = self.self_attn(x, **self_kw)
            x = self.norm1(x + self.dropout1(sa))
            ca, w_cross = self.multihead_attn(x, memory, memory, **cross_kw)
            x = self.norm2(x + self.dropout2(ca))
            x = self.norm3(x + self._ff_block(x))
        return x, (DecoderWeights(w_self, w_cross) if need_weights else None)

    @classmethod
    def from_torch(cls, layer: nn.TransformerDecoderLayer) -> TransformerDecoderLayer:
        """A layer with the weights of ``layer``, computing the same function (batch-first, masks True = attend).

        Raises:
            TypeError: ``layer`` is not a ``torch.nn.TransformerDecoderLayer``.
        """
        if not isinstance(layer, nn.TransformerDecoderLayer):
            raise TypeError(f"layer must be a torch.nn.TransformerDecoderLayer, got {type(layer).__name__}")
        sa = layer.self_attn
        ours = cls(
            d_model=sa.embed_dim,
            num_heads=sa.num_heads,
            dim_feedforward=layer.linear1.out_features,
            dropout=float(layer.dropout.p),
            activation=_torch_activation_name(layer.activation),
            norm_first=bool(layer.norm_first),
            layer_norm_eps=float(layer.norm1.eps),
            bias=layer.linear1.bias is not None,
        )
        ours.self_attn = MultiHeadAttention.from_torch(sa)
        ours.multihead_attn = MultiHeadAttention.from_torch(layer.multihead_attn)
        for name in ("linear1", "linear2", "norm1", "norm2", "norm3"):
            getattr(ours, name).load_state_dict(getattr(layer, name).state_dict())
        p = next(layer.parameters())
        return ours.to(device=p.device, dtype=p.dtype).train(layer.training)


@dataclass
class DecoderOutput:
    """What a :class:`TransformerDecoder` returns.

    Attributes:
        last_hidden_state: (B, T, D), after the last layer (and the final norm, if any).
        self_attentions: per layer (B, H, T, T), when asked for; else ``None``.
        cross_attentions: per layer (B, H, T, S), when asked for; else ``None``.
    """

    last_hidden_state: torch.Tensor
    self_attentions: Optional[Tuple[torch.Tensor, ...]] = None
    cross_attentions: Optional[Tuple[torch.Tensor, ...]] = None


class TransformerDecoder(nn.Module):
    """A stack of decoder layers, optionally followed by a final LayerNorm (pre-LN stacks need one).

    Args:
        decoder_layer: a :class:`TransformerDecoderLayer` (deep-copied ``num_layers`` times) or a factory
            returning a fresh one per call.
        num_layers: how many layers.
        norm: optional module applied to the last layer's output.
    """

    def __init__(
        self,
        decoder_layer: Union[TransformerDecoderLayer, Callable[[], TransformerDecoderLayer]],
        num_layers: int,
        norm: Optional[nn.Module] = None,
    ) -> None:
        super().__init__()
        check_positive_int(num_layers, "num_layers")
        if isinstance(decoder_layer, TransformerDecoderLayer):
            layers: List[nn.Module] = [copy.deepcopy(decoder_layer) for _ in range(num_layers)]
        elif callable(decoder_layer):
            layers = [decoder_layer() for _ in range(num_layers)]
            if not all(isinstance(m, TransformerDecoderLayer) for m in layers):
                raise TypeError("decoder_layer factory must return TransformerDecoderLayer instances")
        else:
            raise TypeError("decoder_layer must be a TransformerDecoderLayer or a factory returning one, "
                            f"got {type(decoder_layer).__name__}")
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.num_layers = num_layers

    def forward(self, x: torch.Tensor, memory: torch.Tensor, need_weights: bool = False, **masks: Any
                ) -> DecoderOutput:
        """Run every layer (``masks``: the mask arguments of :meth:`TransformerDecoderLayer.forward`)."""
        selfs, crosses = [], []
        for layer in self.layers:
            x, w = layer(x, memory, need_weights=need_weights, **masks)
            if w is not None:
                selfs.append(w.self_attn)
                crosses.append(w.cross_attn)
        if self.norm is not None:
            x = self.norm(x)
        if not need_weights:
            return DecoderOutput(x)
        return DecoderOutput(x, tuple(selfs), tuple(crosses))

    @classmethod
    def from_torch(cls, decoder: nn.TransformerDecoder) -> TransformerDecoder:
        """A stack with the weights of ``decoder`` (each layer through :meth:`TransformerDecoderLayer.from_torch`)."""
        if not isinstance(decoder, nn.TransformerDecoder):
            raise TypeError(f"decoder must be a torch.nn.TransformerDecoder, got {type(decoder).__name__}")
        layers = iter([TransformerDecoderLayer.from_torch(m) for m in decoder.layers])
        norm = copy.deepcopy(decoder.norm) if decoder.norm is not None else None
        return cls(lambda: next(layers), num_layers=len(decoder.layers), norm=norm).train(decoder.training)


# ------------------------------------------------------------------------------ the encoder-decoder model


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
    (the interface of :mod:`attention_core.seq2seq`'s decoders; each step re-runs the prefix, no cache).
    """

    def __init__(self, vocab_size: int, d_model: int, num_heads: int, num_layers: int, dim_feedforward: int,
                 dropout: float, activation: Activation, norm_first: bool, max_len: int) -> None:
        super().__init__()
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
