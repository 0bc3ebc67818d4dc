"""Learning-rate schedules of the training recipes."""

from __future__ import annotations

import math

__all__ = ["cosine_lr"]


def cosine_lr(step: int, *, lr: float, steps: int, warmup: int = 0, min_lr_ratio: float = 0.0) -> float:
    """The learning rate at ``step`` (0-based) of ``steps``: linear warm-up over ``warmup`` steps to ``lr``, then
    a half cosine from ``lr`` down to ``min_lr_ratio * lr`` at the last step (a run shorter than its warm-up, as
    in a quick check of a recipe, stays in the warm-up).

    Raises:
        ValueError: ``steps`` < 1, ``warmup`` < 0, ``step`` outside [0, ``steps``), ``lr`` <= 0 or
            ``min_lr_ratio`` outside [0, 1].
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0, got steps={steps!r}, warmup={warmup!r}")
    if not 0 <= step < steps:
        raise ValueError(f"step must be in [0, steps) = [0, {steps}), got {step!r}")
    if not lr > 0 or not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"need lr > 0 and min_lr_ratio in [0, 1], got lr={lr!r}, min_lr_ratio={min_lr_ratio!r}")
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(steps - warmup - 1, 1)  # 0 at the first step after warm-up, 1 at the last
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
