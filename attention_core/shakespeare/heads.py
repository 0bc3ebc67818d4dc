"""What the heads of a character model do: previous-token and induction heads, their ablation, attention sinks.

The probe text for copying is a sequence of ``N`` **distinct** tokens written twice
(:func:`distinct_repeated`): inside the first copy nothing repeats, so at every position ``t`` of the second
copy the current token has exactly one earlier occurrence, at ``t - N``, and the token to predict is the one that
followed it, at ``t - N + 1``. Copying is then unambiguous, and its top-1 accuracy (:func:`copy_accuracy`) has a
clear chance level.

- :func:`head_scores`: per layer and head, the mean weight from ``t`` to ``t - 1`` (previous-token score) and
  from a second-copy position ``t`` to ``t - N + 1`` (induction score);
- :func:`ablate_heads`: a context manager that zeroes heads' slices of the output projection (their outputs no
  longer reach the residual stream) and puts them back;
- :func:`probe_copying`: the scores and the copy accuracy of a model in one call (what the training log records);
- :func:`first_token_weight`: the mean weight every head puts on the first key (an attention sink's signature).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import ContextManager, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from attention_core._checks import check_instance, check_int, check_positive_int, check_tensor, fmt_shape, short_repr
from attention_core.models.language_model import DecoderLM
from attention_core.training.modes import eval_mode

__all__ = [
    "ablate_heads",
    "copy_accuracy",
    "distinct_repeated",
    "first_token_weight",
    "head_scores",
    "probe_copying",
]


def distinct_repeated(num_sequences: int, length: int, tokens: torch.Tensor,
                      generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(num_sequences, 2 * length) ids: ``length`` distinct tokens drawn from ``tokens`` (without replacement),
    then the same ``length`` tokens again.

    Args:
        num_sequences: B.
        length: N, at most ``len(tokens)``.
        tokens: (T,) the ids to draw from (distinct ids).
        generator: seeded generator for repeatable draws.
    """
    check_positive_int(num_sequences, "num_sequences")
    check_positive_int(length, "length")
    check_tensor(tokens, "tokens")
    if tokens.dim() != 1 or len(tokens.unique()) != len(tokens):
        raise ValueError(f"tokens must be a 1-D tensor of distinct ids, got shape {fmt_shape(tokens.shape)}")
    if length > len(tokens):
        raise ValueError(f"length={length} distinct tokens cannot be drawn from {len(tokens)} tokens")
    first = torch.stack([tokens[torch.randperm(len(tokens), generator=generator)[:length]]
                         for _ in range(num_sequences)])  # (B, N)
    return torch.cat([first, first], dim=1)  # (B, 2N)


def head_scores(weights: List[torch.Tensor], length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Previous-token and induction scores, each (layers, H), from every layer's weights (B, H, 2N, 2N) on
    :func:`distinct_repeated` sequences of ``length`` N.

    Previous-token: mean weight from ``t`` to ``t - 1`` over ``t = 1 .. 2N - 1``. Induction: mean weight from
    ``t`` to ``t - N + 1`` over the second copy's ``t = N .. 2N - 1``.
    """
    check_positive_int(length, "length")
    if not isinstance(weights, (list, tuple)) or not weights:
        raise ValueError(f"weights must be a non-empty list of per-layer (B, H, 2N, 2N) tensors, got "
                         f"{type(weights).__name__}")
    for w in weights:
        check_tensor(w, "weights")
        if w.dim() != 4 or w.shape[-2:] != (2 * length, 2 * length):
            raise ValueError(f"weights must be (B, H, 2N, 2N) = (B, H, {2 * length}, {2 * length}) for length "
                             f"N = {length}, got {fmt_shape(w.shape)}")
    N = length
    t = torch.arange(1, 2 * N)  # queries that have a previous token
    u = torch.arange(N, 2 * N)  # queries in the second copy
    previous = torch.stack([w[:, :, t, t - 1].mean((0, 2)) for w in weights])  # (layers, H)
    induction = torch.stack([w[:, :, u, u - N + 1].mean((0, 2)) for w in weights])  # (layers, H)
    return previous, induction


def copy_accuracy(logits: torch.Tensor, sequences: torch.Tensor, length: int) -> float:
    """Top-1 accuracy of the next-token predictions made inside the second copy.

    The predictions at positions ``N .. 2N - 2`` (targets ``N + 1 .. 2N - 1``) can be read off the first copy;
    the one at ``N - 1`` (the second copy's first token) cannot, and is left out.
    """
    N = length
    pred = logits[:, N : 2 * N - 1].argmax(-1)  # (B, N - 1)
    return float((pred == sequences[:, N + 1 : 2 * N]).double().mean())


def ablate_heads(model: DecoderLM, heads: Iterable[Tuple[int, int]]) -> ContextManager[None]:
    """Within the ``with`` block, heads ``(layer, head)`` of a ``DecoderLM`` write nothing to the residual
    stream (their columns of the output projection are zero); the weights are restored on exit.

    The model's type and that ``heads`` is an iterable are checked at the call, the pairs on entering the block.
    """
    check_instance(model, DecoderLM, "model", "a DecoderLM")
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Iterable):
        raise TypeError(f"heads must be an iterable of (layer, head) pairs of ints, got {type(heads).__name__} "
                        f"{short_repr(heads)}")
    return _ablate_heads(model, heads)


@contextmanager
def _ablate_heads(model: DecoderLM, heads: Iterable[Tuple[int, int]]) -> Iterator[None]:
    saved = []
    try:
        with torch.no_grad():
            for pair in heads:
                if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                    raise TypeError(f"heads must hold (layer, head) pairs of ints, got {pair!r:.40}")
                layer, head = pair
                check_int(layer, "layer", low=0, high=len(model.blocks), high_open=True)
                attn = model.blocks[layer].attn
                E = attn.head_dim
                check_int(head, "head", low=0, high=attn.num_heads, high_open=True)
                cols = attn.out_proj.weight[:, head * E : (head + 1) * E]  # (D, E): this head's slice
                saved.append((cols, cols.clone()))
                cols.zero_()
        yield
    finally:
        with torch.no_grad():
            for cols, value in reversed(saved):
                cols.copy_(value)


@torch.no_grad()
def probe_copying(model, sequences: torch.Tensor, length: int) -> Dict[str, object]:  # noqa: ANN001
    """``{"previous": (layers, H), "induction": (layers, H), "copy_accuracy": float, "loss_first",
    "loss_second": float}`` of ``model`` on :func:`distinct_repeated` ``sequences``."""
    check_positive_int(length, "length")
    check_tensor(sequences, "sequences")
    if sequences.dim() != 2 or sequences.shape[1] != 2 * length:
        raise ValueError(f"sequences must be (B, 2N) = (B, {2 * length}) for length N = {length} (two copies), "
                         f"got {fmt_shape(sequences.shape)}")
    with eval_mode(model):
        out = model(sequences, need_weights=True)
    previous, induction = head_scores(out.weights, length)
    N = length
    logp = out.logits[:, :-1].log_softmax(-1).gather(-1, sequences[:, 1:, None])[..., 0]  # (B, 2N - 1)
    return {"previous": previous, "induction": induction,
            "copy_accuracy": copy_accuracy(out.logits, sequences, length),
            "loss_first": float(-logp[:, : N - 1].mean()), "loss_second": float(-logp[:, N:].mean())}


def first_token_weight(weights: List[torch.Tensor], start: int = 0) -> torch.Tensor:
    """(layers, H): the mean weight each head puts on key 0, over queries ``start ..`` (and the batch)."""
    if not isinstance(weights, (list, tuple)) or not weights:
        raise ValueError(f"weights must be a non-empty list of per-layer (B, H, L, S) tensors, got "
                         f"{type(weights).__name__}")
    return torch.stack([w[:, :, start:, 0].mean((0, 2)) for w in weights])
