"""Transformer encoder blocks built on :class:`attention_core.MultiHeadAttention`.

One block is self-attention followed by a position-wise feed-forward network, each wrapped in a residual
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

Each call returns ``(out, weights_or_None)`` like every module of the library; the stack returns an
:class:`EncoderOutput` with every layer's hidden state and attention weights, which is what the book plots.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from attention_core._checks import check_bool_flag, check_positive_int, check_tensor, fmt_shape
from attention_core.modules import MultiHeadAttention

__all__ = ["EncoderOutput", "TransformerEncoder", "TransformerEncoderLayer"]

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


class TransformerEncoderLayer(nn.Module):
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
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
        self.dropout = nn.Dropout(dropout)  # inside the feed-forward network
        self.dropout1 = nn.Dropout(dropout)  # after self-attention
        self.dropout2 = nn.Dropout(dropout)  # after the feed-forward network
        self.norm_first = norm_first
        self.activation_name, self.activation = _resolve_activation(activation)
        self.d_model = d_model

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, activation={self.activation_name!r}"

    def _sa_block(self, x: torch.Tensor, **attn_kwargs: object) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        out, weights = self.self_attn(x, **attn_kwargs)
        return self.dropout1(out), weights

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        key_padding_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        need_weights: bool = False,
        backend: Optional[str] = None,
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
            backend: attention backend for this call (``None``: the current default); must be ``None`` or
                ``"reference"`` when ``need_weights``.

        Returns:
            ``(out, weights)``: out (B, L, D); weights (B, H, L, L) when ``need_weights`` else ``None``.
        """
        check_tensor(x, "x")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must be (B, L, D) with D = d_model = {self.d_model}, got {fmt_shape(x.shape)}")
        attn_kwargs = dict(
            attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal,
            need_weights=need_weights, backend=backend,
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
        if not isinstance(layer, nn.TransformerEncoderLayer):
            raise TypeError(f"layer must be a torch.nn.TransformerEncoderLayer, got {type(layer).__name__}")
        mha = layer.self_attn
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
        ours.self_attn = MultiHeadAttention.from_torch(mha)
        for name in ("linear1", "linear2", "norm1", "norm2"):
            getattr(ours, name).load_state_dict(getattr(layer, name).state_dict())
        p = next(layer.parameters())
        return ours.to(device=p.device, dtype=p.dtype).train(layer.training)


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
        check_positive_int(num_layers, "num_layers")
        if isinstance(encoder_layer, TransformerEncoderLayer):
            layers: List[nn.Module] = [copy.deepcopy(encoder_layer) for _ in range(num_layers)]
        elif callable(encoder_layer):
            layers = [encoder_layer() for _ in range(num_layers)]
            bad = [type(m).__name__ for m in layers if not isinstance(m, TransformerEncoderLayer)]
            if bad:
                raise TypeError(f"encoder_layer factory must return TransformerEncoderLayer, got {bad[0]}")
        else:
            raise TypeError(
                "encoder_layer must be a TransformerEncoderLayer or a factory returning one, "
                f"got {type(encoder_layer).__name__}"
            )
        self.layers = nn.ModuleList(layers)
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
        backend: Optional[str] = None,
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
                need_weights=need_weights, backend=backend,
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
        if not isinstance(encoder, nn.TransformerEncoder):
            raise TypeError(f"encoder must be a torch.nn.TransformerEncoder, got {type(encoder).__name__}")
        layers = iter([TransformerEncoderLayer.from_torch(m) for m in encoder.layers])
        norm = copy.deepcopy(encoder.norm) if encoder.norm is not None else None
        return cls(lambda: next(layers), num_layers=len(encoder.layers), norm=norm).train(encoder.training)
