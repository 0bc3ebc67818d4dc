"""Chapter 11's exercises: the decode-step mask (``ch11.decode_mask``, a code exercise) and the loss rise
of a shorter rolling window (exercise 3: ``window_loss_rise`` and its check ``check_window_rise``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake
from attention_core.booktools.exercises_common import (
    ATTENTION_MODULES,
    strategies,
)

__all__ = ["build", "check_window_rise", "window_loss_rise"]


def _decode_reference(L, S, window):
    from attention_core.models.language_model import cached_causal_mask

    return cached_causal_mask(L, S, window)


def _decode(L, S, window, *, upper_left=False, ge=False, no_window=False):
    i = torch.arange(L)[:, None] + (0 if upper_left else S - L)  # (L, 1)
    j = torch.arange(S)[None, :]  # (1, S)
    mask = j <= i
    if window is None or no_window:
        return mask
    return mask & ((j >= i - window) if ge else (j > i - window))


def build() -> FunctionSpec:
    st = strategies()
    sizes = st.integers(1, 8).flatmap(lambda S: st.tuples(st.integers(1, S), st.just(S), st.none() | st.integers(1, 8)))
    return FunctionSpec(
        "decode_mask", _decode_reference, sizes, max_examples=50, arg_names=("L", "S", "window"),
        examples=((2, 4, None), (2, 4, 2), (1, 1, None), (3, 6, 1), (2, 3, 8), (4, 4, 3)),
        dtype=("a bool tensor", lambda L, S, window: torch.bool),
        unavailable=("attention_core.models.language_model.cached_causal_mask", "attention_core.masks.causal_mask",
                     "attention_core.masks.sliding_window_mask"),
        forbidden_modules=("attention_core.masks", "attention_core.mask_mods", "attention_core.sparse_patterns",
                           "attention_core.serving", *ATTENTION_MODULES),
        task="to build the decode-step mask yourself",
        mistakes=(
            Mistake("the L queries are the last L of the S key slots: query i sits at slot S - L + i.",
                    lambda L, S, w: _decode(L, S, w, upper_left=True)),
            Mistake("the window holds `window` keys, the query's own included: one key too many.",
                    lambda L, S, w: _decode(L, S, w, ge=True)),
            Mistake("with an integer window, keys older than the window are masked out.",
                    lambda L, S, w: _decode(L, S, w, no_window=True)),
        ),
    )


# ------------------------------------------------------------------------- ch. 11, exercise 3: a shorter window


def window_loss_rise(model: Any, inputs: torch.Tensor, targets: torch.Tensor, window: int, *, baseline: int = 128,
                     start: int = 512) -> float:
    """How much higher the mean per-token loss on positions ``start`` onwards is with a rolling cache of
    ``window`` keys than with one of ``baseline`` keys, on the passage ``inputs`` (1, L) -> ``targets`` (1, L).
    Computed on whatever passage is given (chapter 11's exercise 3 and its check)."""
    import torch.nn.functional as F

    if not (isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor)) or inputs.shape != targets.shape:
        raise ValueError(f"inputs and targets must be tensors of one shape (1, L), got "
                         f"{getattr(inputs, 'shape', inputs)} and {getattr(targets, 'shape', targets)}")
    if inputs.dim() != 2 or inputs.shape[0] != 1 or not 0 <= start < inputs.shape[1]:
        raise ValueError(f"inputs must be (1, L) with L > start = {start}, got shape {tuple(inputs.shape)}")
    losses = []
    with torch.no_grad():
        for w in (window, baseline):
            logits = model(inputs, model.new_cache(window=w)).logits[0]  # (L, V)
            losses.append(F.cross_entropy(logits, targets[0], reduction="none")[start:].mean().item())
    return losses[0] - losses[1]


def check_window_rise(rise: float, model: Any, inputs: torch.Tensor, targets: torch.Tensor, window: int = 32, *,
                      baseline: int = 128, start: int = 512, atol: float = 1e-3) -> bool:
    """Whether ``rise`` is the rise of the loss (window ``window`` against ``baseline``, positions ``start``
    onwards) on this passage, recomputed here: the check holds on any passage, since it measures the one given."""
    if isinstance(rise, bool) or not isinstance(rise, (int, float)) or not math.isfinite(rise):
        return False
    return abs(rise - window_loss_rise(model, inputs, targets, window, baseline=baseline, start=start)) <= atol
