"""Which (query, key) pairs the Triton kernels let through, as one compile-time code: shared by the pointer
kernels (:mod:`attention_core.backends.triton_flash`) and the Hopper forward
(:mod:`attention_core.backends.triton_flash_tma`), which asks whether a call's mask is one it covers.

A call's mask is a band ``i - left <= j <= i + right`` (:func:`attention_core.backends.triton_flash.window_bounds`
turns ``is_causal`` and a window into it).
"""

from __future__ import annotations

__all__ = ["CAUSAL", "FULL", "WINDOW", "mask_mode"]

#: ``MODE``: which pairs are visible (see :mod:`attention_core.backends.triton_flash`'s docstring).
FULL, CAUSAL, WINDOW = 0, 1, 2


def mask_mode(L: int, S: int, left: int, right: int) -> int:
    """:data:`FULL` when no bound hides a pair, :data:`CAUSAL` for ``j <= i`` alone, else :data:`WINDOW`.

    A bound hides nothing when it lies beyond every position: ``left >= L - 1`` (``i - left <= 0 <= j``),
    ``right >= S - 1`` (``j <= S - 1 <= i + right``). So a window wider than the sequence costs nothing.
    """
    if left >= L - 1 and right >= S - 1:
        return FULL
    if left >= L - 1 and right == 0:
        return CAUSAL
    return WINDOW
