"""Transformer encoder and decoder blocks built on :class:`attention_core.MultiHeadAttention`, task-free.

An encoder block is self-attention followed by a position-wise feed-forward network, each wrapped in a residual
connection and a LayerNorm. Where the LayerNorm sits gives the two variants in use:

- post-LN (``norm_first=False``, the 2017 Transformer and BERT): ``x = norm(x + sublayer(x))``;
- pre-LN (``norm_first=True``, GPT-2 and most models since): ``x = x + sublayer(norm(x))``.

The layer keeps ``torch.nn.TransformerEncoderLayer``'s parameter names (``self_attn``, ``linear1``,
``linear2``, ``norm1``, ``norm2``), and :meth:`TransformerEncoderLayer.from_torch` copies the weights of a
PyTorch layer into one of ours, which then computes the same function. Two differences on purpose:

- batch-first always: ``x`` is (B, L, D);
- masks follow the SDPA convention of the whole library, True = attend (PyTorch's ``src_mask`` and
  ``src_key_padding_mask`` use True = *blocked*; convert with :func:`attention_core.from_torch_mha_mask`
  or ``~mask``).

A decoder block (:class:`TransformerDecoderLayer`) has three sublayers, each in a residual connection with a
LayerNorm: masked self-attention over the target tokens so far (causal: position t sees 0..t);
cross-attention, with queries from the decoder and keys and values from the encoder output ("memory"); and the
feed-forward network. It keeps ``torch.nn.TransformerDecoderLayer``'s parameter names (``self_attn``,
``multihead_attn``, ``linear1``, ``linear2``, ``norm1..3``) and :meth:`TransformerDecoderLayer.from_torch`
copies one.

Each call returns ``(out, weights_or_None)`` like every module of the library; the stacks return an
:class:`EncoderOutput` / :class:`DecoderOutput` with every layer's attention weights, which is what the book
plots. The attention backend is the one :func:`attention_core.use_backend` selects.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, List, NamedTuple, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from attention_core._checks import check_bool_flag, check_positive_int, check_tensor, fmt_shape
from attention_core.flex_attention import BlockMask
from attention_core.multihead import MultiHeadAttention

__all__ = [
    "DecoderOutput",
    "DecoderWeights",
    "EncoderOutput",
    "TransformerDecoder",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
]

Activation = Union[str, Callable[[torch.Tensor], torch.Tensor]]

_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact: 0.5 x (1 + erf(x / sqrt 2)), what BERT uses
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's approximation
}


def _resolve_activation(activation: Activation) -> Tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
    if isinstance(activation, str):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)} or a callable, got {activation!r}")
        return activation, _ACTIVATIONS[activation]
    if callable(activation):
        return getattr(activation, "__name__", type(activation).__name__), activation
    raise TypeError(f"activation must be a str or a callable, got {type(activation).__name__}")


def _torch_activation_name(activation: object) -> Activation:
    """Map the activation stored on a ``torch.nn.TransformerEncoderLayer`` to one of ours."""
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu:
        return "gelu"
    if isinstance(activation, nn.GELU):
        return "gelu_tanh" if activation.approximate == "tanh" else "gelu"
    return activation  # any other callable is used as is


def _stack(layer: Union[nn.Module, Callable[[], nn.Module]], num_layers: int, kind: type, name: str
           ) -> nn.ModuleList:
    """``num_layers`` deep copies of ``layer`` (as PyTorch's stacks do), or ``num_layers`` calls of a factory."""
    check_positive_int(num_layers, "num_layers")
    if isinstance(layer, kind):
        return nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))
    if not callable(layer):
        raise TypeError(f"{name} must be a {kind.__name__} or a factory returning one, got {type(layer).__name__}")
    layers = [layer() for _ in range(num_layers)]
    bad = [type(m).__name__ for m in layers if not isinstance(m, kind)]
    if bad:
        raise TypeError(f"{name} factory must return {kind.__name__}, got {bad[0]}")
    return nn.ModuleList(layers)


def _stack_from_torch(cls: type, stack: nn.Module, torch_cls: type, layer_cls: type, name: str) -> nn.Module:
    """``cls`` (our encoder or decoder stack) with the weights of torch's ``stack`` (a ``torch_cls``): each layer
    through ``layer_cls.from_torch``, the final norm copied, the training mode kept."""
    if not isinstance(stack, torch_cls):
        raise TypeError(f"{name} must be a torch.nn.{torch_cls.__name__}, got {type(stack).__name__}")
    layers = iter([layer_cls.from_torch(m) for m in stack.layers])
    norm = copy.deepcopy(stack.norm) if stack.norm is not None else None
    return cls(lambda: next(layers), num_layers=len(stack.layers), norm=norm).train(stack.training)


class _SublayerStack(nn.Module):
    """What the encoder and decoder layers share: torch's names for the feed-forward network and the norms
    (``linear1``, ``linear2``, ``norm1..n``, ``dropout``), its activation handling, and the weight copy from
    torch's layers. A subclass names its attention sublayers in ``_ATTENTION``."""

    #: the attention sublayers, by torch's names, each a MultiHeadAttention; one LayerNorm and dropout follow each,
    #: and one more of each the feed-forward network
    _ATTENTION: Tuple[str, ...] = ()

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
        for name in self._ATTENTION:  # made first, in this order: the same draws from the generator as before
            setattr(self, name, MultiHeadAttention(d_model, num_heads, dropout=dropout, bias=bias))
        n_norms = len(self._ATTENTION) + 1
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)
        for i in range(1, n_norms + 1):
            setattr(self, f"norm{i}", nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias))
        self.dropout = nn.Dropout(dropout)  # inside the feed-forward network
        for i in range(1, n_norms + 1):  # after each sublayer
            setattr(self, f"dropout{i}", nn.Dropout(dropout))
        self.norm_first = norm_first
        self.activation_name, self.activation = _resolve_activation(activation)
        self.d_model = d_model
        self._n_norms = n_norms

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, activation={self.activation_name!r}"

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward sublayer with the dropout after it (the last sublayer's)."""
        after = getattr(self, f"dropout{self._n_norms}")
        return after(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    @classmethod
    def _from_torch_layer(cls, layer: nn.Module, torch_cls: type) -> nn.Module:
        if not isinstance(layer, torch_cls):
            raise TypeError(f"layer must be a torch.nn.{torch_cls.__name__}, got {type(layer).__name__}")
        mha = getattr(layer, cls._ATTENTION[0])
        ours = cls(
            d_model=mha.embed_dim,
            num_heads=mha.num_heads,
            dim_feedforward=layer.linear1.out_features,
            dropout=float(layer.dropout.p),
            activation=_torch_activation_name(layer.activation),
            norm_first=bool(layer.norm_first),
            layer_norm_eps=float(layer.norm1.eps),
            bias=layer.linear1.bias is not None,
        )
        for name in cls._ATTENTION:
            setattr(ours, name, MultiHeadAttention.from_torch(getattr(layer, name)))
        for name in ("linear1", "linear2", *(f"norm{i}" for i in range(1, ours._n_norms + 1))):
            getattr(ours, name).load_state_dict(getattr(layer, name).state_dict())
        p = next(layer.parameters())
        return ours.to(device=p.device, dtype=p.dtype).train(layer.training)


class TransformerEncoderLayer(_SublayerStack):
    """One encoder block: self-attention + feed-forward, residuals, post-LN or pre-LN.

    Args:
        d_model: model width D.
        num_heads: attention heads H (``d_model % num_heads == 0``).
        dim_feedforward: hidden width of the feed-forward network.
        dropout: dropout on the attention weights, after each sublayer and inside the feed-forward network.
        activation: ``"gelu"`` (exact, erf), ``"gelu_tanh"``, ``"relu"`` or a callable.
        norm_first: pre-LN (True) or post-LN (False, the original Transformer and BERT).
        layer_norm_eps: epsilon of both LayerNorms (BERT uses 1e-12).
        bias: biases in the linear layers and the LayerNorms.
    """

    _ATTENTION = ("self_attn",)

    def _sa_block(self, x: torch.Tensor, **attn_kwargs: object) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        out, weights = self.self_attn(x, **attn_kwargs)
        return self.dropout1(out), weights


    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run the block.

        Args:
            x: (B, L, D) floating.
            attn_mask: ``None``, or bool (True = attend) / float (added) broadcastable to (B, H, L, L).
            key_padding_mask: ``None``, or (B, L): True (or 0.0) on real tokens, False (or -inf) on padding.
                Padding keys get no attention; padding *queries* still produce (meaningless) rows, as in
                PyTorch and BERT.
            is_causal: causal self-attention; combines with the masks.
            need_weights: also return the per-head attention weights (computed by the reference backend).

        Returns:
            ``(out, weights)``: out (B, L, D); weights (B, H, L, L) when ``need_weights`` else ``None``.
        """
        check_tensor(x, "x")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, L, D) with D = d_model = {self.d_model}, got {fmt_shape(x.shape)}")
        attn_kwargs = dict(
            attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
            need_weights=need_weights,
        )
        if self.norm_first:
            sa, weights = self._sa_block(self.norm1(x), **attn_kwargs)
            x = x + sa
            x = x + self._ff_block(self.norm2(x))
        else:
            sa, weights = self._sa_block(x, **attn_kwargs)
            x = self.norm1(x + sa)
            x = self.norm2(x + self._ff_block(x))
        return x, weights

    @classmethod
    def from_torch(cls, layer: nn.TransformerEncoderLayer) -> TransformerEncoderLayer:
        """A layer with the weights of ``layer``, computing the same function (batch-first).

        PyTorch's layer may be ``batch_first=False``; ours always takes (B, L, D), so transpose its
        input. Its masks use True = blocked; ours True = attend.
        """
        return cls._from_torch_layer(layer, nn.TransformerEncoderLayer)


@dataclass
class EncoderOutput:
    """What a :class:`TransformerEncoder` returns.

    Attributes:
        last_hidden_state: (B, L, D), after the last layer (and the final norm, if any).
        hidden_states: ``num_layers + 1`` tensors (B, L, D): the input, then each layer's output (the last
            one before the final norm), when asked for; else ``None``.
        attentions: ``num_layers`` tensors (B, H, L, L) of attention weights, when asked for; else ``None``.
    """

    last_hidden_state: torch.Tensor
    hidden_states: Optional[Tuple[torch.Tensor, ...]] = None
    attentions: Optional[Tuple[torch.Tensor, ...]] = None


class TransformerEncoder(nn.Module):
    """A stack of encoder layers, optionally followed by a final LayerNorm (pre-LN models need one).

    Args:
        encoder_layer: a :class:`TransformerEncoderLayer` (deep-copied ``num_layers`` times, as in PyTorch),
            or a factory ``() -> TransformerEncoderLayer`` called ``num_layers`` times (fresh weights each).
        num_layers: how many layers.
        norm: optional final module applied to the last layer's output.
    """

    def __init__(
        self,
        encoder_layer: Union[TransformerEncoderLayer, Callable[[], TransformerEncoderLayer]],
        num_layers: int,
        norm: Optional[nn.Module] = None,
    ) -> None:
        super().__init__()
        self.layers = _stack(encoder_layer, num_layers, TransformerEncoderLayer, "encoder_layer")
        self.norm = norm
        self.num_layers = num_layers

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        need_weights: bool = False,
        output_hidden_states: bool = False,
    ) -> EncoderOutput:
        """Run every layer in turn (arguments as in :meth:`TransformerEncoderLayer.forward`).

        Returns:
            :class:`EncoderOutput`; ``hidden_states`` when ``output_hidden_states``, ``attentions`` when
            ``need_weights``.
        """
        check_tensor(x, "x")
        if x.dim() != 3:
            raise ValueError(f"x must be (B, L, D), got {fmt_shape(x.shape)}")
        hidden: List[torch.Tensor] = [x]
        attentions: List[torch.Tensor] = []
        for layer in self.layers:
            x, weights = layer(
                x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
                need_weights=need_weights,
            )
            hidden.append(x)
            if weights is not None:
                attentions.append(weights)
        if self.norm is not None:
            x = self.norm(x)
        return EncoderOutput(
            last_hidden_state=x,
            hidden_states=tuple(hidden) if output_hidden_states else None,
            attentions=tuple(attentions) if need_weights else None,
        )

    @classmethod
    def from_torch(cls, encoder: nn.TransformerEncoder) -> TransformerEncoder:
        """A stack with the weights of ``encoder`` (each layer through :meth:`TransformerEncoderLayer.from_torch`)."""
        return _stack_from_torch(cls, encoder, nn.TransformerEncoder, TransformerEncoderLayer, "encoder")


# ------------------------------------------------------------------------------------------- decoder


class DecoderWeights(NamedTuple):
    """Attention weights of one decoder layer: self (B, H, T, T) and cross (B, H, T, S)."""

    self_attn: torch.Tensor
    cross_attn: torch.Tensor


class TransformerDecoderLayer(_SublayerStack):
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

    _ATTENTION = ("self_attn", "multihead_attn")

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
        tgt_block_mask: Optional[BlockMask] = None,
        memory_block_mask: Optional[BlockMask] = None,
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
            tgt_block_mask: a :class:`~attention_core.flex_attention.BlockMask` of (T, T) for self-attention,
                instead of ``tgt_mask``/``tgt_key_padding_mask``/``tgt_is_causal`` (a causal, sliding-window or
                packed-documents mask as a predicate: the tiles it records as empty are never computed).
            memory_block_mask: the same for cross-attention, (T, S), instead of ``memory_mask`` and
                ``memory_key_padding_mask``. With a block mask that attention takes no dropout and returns no
                weights (see :meth:`attention_core.MultiHeadAttention.forward`).

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
        if tgt_block_mask is not None:  # passed only when given, so a wrapped attention's forward needs no new name
            self_kw["block_mask"] = tgt_block_mask
        if memory_block_mask is not None:
            cross_kw["block_mask"] = memory_block_mask
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
        return cls._from_torch_layer(layer, nn.TransformerDecoderLayer)


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
        self.layers = _stack(decoder_layer, num_layers, TransformerDecoderLayer, "decoder_layer")
        self.norm = norm
        self.num_layers = num_layers

    def forward(self, x: torch.Tensor, memory: torch.Tensor, need_weights: bool = False, **masks: Any
                ) -> DecoderOutput:
        """Run every layer (``masks``: the mask arguments of :meth:`TransformerDecoderLayer.forward`, block masks
        included: ``tgt_block_mask=create_block_mask(causal, None, None, T, T)`` gives every layer's
        self-attention the same tiles)."""
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
        return _stack_from_torch(cls, decoder, nn.TransformerDecoder, TransformerDecoderLayer, "decoder")
