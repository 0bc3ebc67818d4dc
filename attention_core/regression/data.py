"""Data the book generates itself (nothing is downloaded at run time).

For now: a 1-D regression problem for chapter 1 (Nadaraya-Watson kernel regression).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention_core._checks import check_int

__all__ = ["RegressionData", "make_regression_data", "regression_target"]

X_MIN, X_MAX = 0.0, 5.0


def regression_target(x: torch.Tensor) -> torch.Tensor:
    """The smooth function chapter 1 tries to recover: ``f(x) = sin(2x) + 0.4 x``.

    A slow trend plus a wiggle, so that a bandwidth that is too large visibly flattens the wiggle (bias)
    and one that is too small visibly chases the noise (variance).

    Args:
        x: floating tensor of any shape.

    Returns:
        ``f(x)``, same shape and dtype as ``x``.
    """
    return torch.sin(2.0 * x) + 0.4 * x


@dataclass(frozen=True)
class RegressionData:
    """A noisy 1-D regression sample and a clean test grid.

    Attributes:
        x_train: (n_train,) inputs, sorted ascending, drawn uniformly on [0, 5].
        y_train: (n_train,) noisy targets ``f(x_train) + noise * N(0, 1)``.
        x_test: (n_test,) evenly spaced inputs on [0, 5].
        y_test: (n_test,) the noise-free target ``f(x_test)``: test error measures how far an
            estimate is from the truth, not from one more noisy draw.
        noise: the standard deviation of the training noise.
    """

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    noise: float


def make_regression_data(
    n_train: int = 80,
    n_test: int = 200,
    noise: float = 0.3,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> RegressionData:
    """Draw a deterministic sample of the chapter-1 regression problem.

    The same arguments give bit-identical tensors on every machine: the draws come from a private
    ``torch.Generator`` seeded with ``seed`` (the global RNG is neither used nor advanced).

    Args:
        n_train: number of noisy training pairs (>= 1).
        n_test: number of points on the clean test grid (>= 2).
        noise: standard deviation of the Gaussian noise on ``y_train`` (>= 0).
        seed: seed of the private generator.
        dtype: floating dtype of every returned tensor.

    Returns:
        A :class:`RegressionData`.
    """
    check_int(n_train, "n_train", low=1)
    check_int(n_test, "n_test", low=2)
    if not isinstance(noise, (int, float)) or isinstance(noise, bool) or not noise >= 0:
        raise ValueError(f"noise must be a float >= 0, got {noise!r}")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    gen = torch.Generator().manual_seed(seed)
    x_train = X_MIN + (X_MAX - X_MIN) * torch.rand(n_train, generator=gen, dtype=torch.float64)
    x_train = x_train.sort().values
    y_train = regression_target(x_train) + noise * torch.randn(n_train, generator=gen, dtype=torch.float64)
    x_test = torch.linspace(X_MIN, X_MAX, n_test, dtype=torch.float64)
    y_test = regression_target(x_test)
    return RegressionData(
        x_train=x_train.to(dtype),
        y_train=y_train.to(dtype),
        x_test=x_test.to(dtype),
        y_test=y_test.to(dtype),
        noise=float(noise),
    )
