"""The interface every translation model speaks, written down.

The RNN models (:class:`~attention_core.translation.rnn.Seq2Seq`) and the Transformer
(:class:`~attention_core.translation.transformer.Seq2SeqTransformer`) share no base class, yet training
(:func:`~attention_core.translation.train.train_seq2seq`), greedy decoding
(:func:`~attention_core.translation.rnn.greedy_decode`) and the metrics run on both, because both provide
what :class:`EncoderDecoder` lists. A new model joins by providing the same.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Protocol, Tuple, runtime_checkable

import torch

__all__ = ["EncoderDecoder", "StepDecoder"]


@runtime_checkable
class StepDecoder(Protocol):
    """A decoder that can run one target token at a time."""

    def init_state(self, enc: Any) -> Any:
        """The state before the first step, from the encoded source."""

    def step(self, y_prev: torch.Tensor, state: Any, enc: Any, t: int
             ) -> Tuple[torch.Tensor, Any, Optional[torch.Tensor]]:
        """Feed the previous token ids (B,); return next-token logits (B, V), the new state, and the attention
        weights over the source (B, S) (``None`` for a model without attention)."""


@runtime_checkable
class EncoderDecoder(Protocol):
    """A sequence-to-sequence model over padded batches of token ids (id 0 = ``<pad>``).

    Attributes:
        decoder: a :class:`StepDecoder`.
        config: the dict the model was built from (what checkpoints store).
    """

    decoder: Any
    config: dict

    @property
    def has_attention(self) -> bool:
        """Whether decoding returns attention weights over the source."""

    def encode(self, src: torch.Tensor, src_valid_lens: torch.Tensor) -> Any:
        """Encode (B, S) source ids whose first ``src_valid_lens[b]`` entries are real."""

    def __call__(self, src: torch.Tensor, src_valid_lens: torch.Tensor, tgt_in: torch.Tensor
                 ) -> Tuple[torch.Tensor, Any]:
        """Teacher forcing: logits (B, T, V) for ``tgt_in`` and the attention weights (or ``None``)."""

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...

    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...

    def to(self, *args: Any, **kwargs: Any) -> Any: ...
