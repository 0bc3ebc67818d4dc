"""Nadaraya-Watson kernel regression: attention before it had the name (Nadaraya 1964, Watson 1964).

Given keys ``k_i`` with values ``v_i`` and a query ``q``, the estimate is a weighted average of the values,

    f(q) = sum_i alpha(q, k_i) v_i,    alpha(q, k_i) = K(u_i) / sum_j K(u_j),    u_i = ||q - k_i|| / h,

with a kernel ``K`` and a bandwidth ``h > 0``. For the Gaussian kernel the weights are exactly a softmax of
the score ``-||q - k_i||^2 / (2 h^2)``, and that is how they are computed here: the same masked softmax that
every later attention layer in the book uses. The compactly supported kernels (boxcar, Epanechnikov) are
normalised directly, with a guard for queries that see no key at all.

Shapes: queries (L,) or (L, d); keys (S,) or (S, d); values (S,) or (S, Ev); weights (L, S); output (L,)
or (L, Ev). One-dimensional inputs are single features, so ``(n,)`` and ``(n, 1)`` mean the same thing.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple, Union

import torch
from torch import nn

from attention_core._checks import (
    MAX_SIZE,
    check_device,
    check_fits,
    check_floating,
    check_int,
    check_same_device,
    check_same_dtype,
    check_tensor,
    real_to_float,
    short_repr,
)
from attention_core.functional import masked_softmax

__all__ = [
    "KERNELS",
    "BandwidthFit",
    "NadarayaWatson",
    "boxcar",
    "epanechnikov",
    "fit_bandwidth",
    "gaussian",
    "leave_one_out_mask",
    "leave_one_out_mse",
    "nadaraya_watson",
    "nadaraya_watson_weights",
]

Bandwidth = Union[float, int, torch.Tensor]
Kernel = Callable[[torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------------------------------------
# Kernels: functions of the scaled distance u = (q - k) / h, each a probability density on the line.
# The normalising constants cancel in the Nadaraya-Watson ratio; they are kept so that plots compare shapes
# of equal area.
# ---------------------------------------------------------------------------------------------------------


def _gaussian_profile(u2: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * u2) / math.sqrt(2.0 * math.pi)


def _boxcar_profile(u2: torch.Tensor) -> torch.Tensor:
    # The "+ 0 * ..." keeps the autograd graph: a learnable bandwidth gets a zero gradient, not an error.
    return 0.5 * (u2 <= 1.0).to(u2.dtype) + 0.0 * u2.clamp(max=1.0)


def _epanechnikov_profile(u2: torch.Tensor) -> torch.Tensor:
    return 0.75 * torch.clamp(1.0 - u2, min=0.0)


# Each kernel as a function of u^2: that is how the estimator evaluates them, because u = ||q - k|| / h
# has an infinite derivative in ||q - k||^2 at q = k, which would turn gradients into NaN.
_PROFILES: Dict[str, Kernel] = {
    "gaussian": _gaussian_profile,
    "boxcar": _boxcar_profile,
    "epanechnikov": _epanechnikov_profile,
}


def gaussian(u: torch.Tensor) -> torch.Tensor:
    """Gaussian kernel ``exp(-u^2 / 2) / sqrt(2 pi)``: positive everywhere, so every key gets some weight."""
    _check_u(u)
    return _gaussian_profile(u * u)


def boxcar(u: torch.Tensor) -> torch.Tensor:
    """Boxcar (uniform) kernel ``1/2`` for ``|u| <= 1``, else 0: a plain average of the keys within ``h``."""
    _check_u(u)
    return _boxcar_profile(u * u)


def epanechnikov(u: torch.Tensor) -> torch.Tensor:
    """Epanechnikov kernel ``3/4 (1 - u^2)`` for ``|u| <= 1``, else 0: a parabola with compact support.

    Not to be confused with the triangular kernel ``max(0, 1 - |u|)``, which some texts give this name.
    """
    _check_u(u)
    return _epanechnikov_profile(u * u)


def _check_u(u: object) -> None:
    """The kernels' one check: ``u`` is a floating tensor (``TypeError`` naming ``u`` otherwise)."""
    check_tensor(u, "u")
    check_floating(u, "u")


KERNELS: Dict[str, Kernel] = {"gaussian": gaussian, "boxcar": boxcar, "epanechnikov": epanechnikov}
"""Kernel name -> kernel function of the scaled distance ``u``."""


# ---------------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------------


def _check_kernel(kernel: object) -> str:
    if not isinstance(kernel, str):
        raise TypeError(
            f"kernel must be a str, one of {sorted(KERNELS)}; got {type(kernel).__name__} {short_repr(kernel)}"
        )
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    return kernel


def _check_bandwidth(bandwidth: object) -> None:
    """Raise unless ``bandwidth`` is a positive finite number or a 0-d floating tensor holding one."""
    if isinstance(bandwidth, torch.Tensor):
        if bandwidth.dim() != 0:
            raise ValueError(
                f"bandwidth must be a float or a 0-d tensor, got a tensor of shape {tuple(bandwidth.shape)}"
            )
        if not bandwidth.is_floating_point():
            raise TypeError(f"bandwidth must have a floating-point dtype, got {bandwidth.dtype}")
        if bandwidth.device.type == "meta":  # no value to check
            return
        value = float(bandwidth.detach())
        if not (math.isfinite(value) and value > 0.0):
            raise ValueError(f"bandwidth must be positive and finite, got {value!r}")
    elif isinstance(bandwidth, numbers.Real) and not isinstance(bandwidth, bool):
        value = real_to_float(bandwidth)
        if not (math.isfinite(value) and value > 0.0):
            raise ValueError(f"bandwidth must be positive and finite, got {short_repr(bandwidth)}")
    else:
        raise TypeError(
            f"bandwidth must be a positive float or a 0-d tensor, got {type(bandwidth).__name__} "
            f"{short_repr(bandwidth)}"
        )


def _as_features(x: torch.Tensor, name: str, n_name: str) -> torch.Tensor:
    """(n,) -> (n, 1); (n, d) unchanged; anything else raises."""
    check_tensor(x, name)
    check_floating(x, name)
    if x.dim() == 1:
        return x.unsqueeze(-1)  # (n,) -> (n, 1)
    if x.dim() == 2:
        return x
    raise ValueError(
        f"{name} must be 1-D ({n_name},) or 2-D ({n_name}, d), got shape {tuple(x.shape)} ({x.dim()} dims)"
    )


def _check_inputs(queries: torch.Tensor, keys: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    q = _as_features(queries, "queries", "L")
    k = _as_features(keys, "keys", "S")
    check_same_dtype(queries=queries, keys=keys)
    check_same_device(queries=queries, keys=keys)
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"queries and keys must have the same feature dim d; got queries {tuple(queries.shape)} "
            f"(d={q.shape[-1]}) and keys {tuple(keys.shape)} (d={k.shape[-1]})"
        )
    if k.shape[0] == 0:
        raise ValueError("keys must hold at least one key, got shape " + str(tuple(keys.shape)))
    return q, k


def _check_mask(attn_mask: torch.Tensor | None, queries: torch.Tensor, n_queries: int, n_keys: int) -> None:
    if attn_mask is None:
        return
    check_tensor(attn_mask, "attn_mask")
    if attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be a bool tensor (True = attend), got {attn_mask.dtype}")
    check_same_device(queries=queries, attn_mask=attn_mask)
    try:
        ok = torch.broadcast_shapes(attn_mask.shape, (n_queries, n_keys)) == (n_queries, n_keys)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
            f"(L, S) = ({n_queries}, {n_keys})"
        )


def _check_values(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    _check_inputs(queries, keys)
    check_tensor(values, "values")
    check_floating(values, "values")
    if values.dim() not in (1, 2):
        raise ValueError(f"values must be 1-D (S,) or 2-D (S, Ev), got shape {tuple(values.shape)}")
    if values.shape[0] != keys.shape[0]:
        raise ValueError(
            f"keys and values must hold the same number of entries; got keys {tuple(keys.shape)} "
            f"({keys.shape[0]} keys) and values {tuple(values.shape)} ({values.shape[0]} values)"
        )
    check_same_dtype(queries=queries, values=values)
    check_same_device(queries=queries, values=values)


# ---------------------------------------------------------------------------------------------------------
# The estimator
# ---------------------------------------------------------------------------------------------------------


def nadaraya_watson_weights(
    queries: torch.Tensor,
    keys: torch.Tensor,
    kernel: str = "gaussian",
    bandwidth: Bandwidth = 1.0,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Nadaraya-Watson attention weights ``alpha(q, k_i)`` of every query over every key.

    Args:
        queries: (L,) or (L, d) floating tensor.
        keys: (S,) or (S, d) tensor of the same dtype and feature dim ``d``, with S >= 1.
        kernel: ``"gaussian"``, ``"boxcar"`` or ``"epanechnikov"`` (the keys of :data:`KERNELS`).
        bandwidth: the width ``h > 0``, a float or a 0-d floating tensor (gradients flow through it).
        attn_mask: optional bool tensor broadcastable to (L, S); ``True`` = the key takes part (the
            convention of ``torch.nn.functional.scaled_dot_product_attention``). Masking the diagonal gives
            leave-one-out estimates (:func:`leave_one_out_mask`).

    Returns:
        (L, S) tensor, dtype of ``queries``; each row is non-negative and sums to 1. A row whose query has no
        key inside the kernel's support (possible for boxcar and Epanechnikov, or when the mask removes every
        key) is all zeros, never NaN, so that query's estimate is 0.
    """
    kernel = _check_kernel(kernel)
    _check_bandwidth(bandwidth)
    q, k = _check_inputs(queries, keys)
    _check_mask(attn_mask, queries, q.shape[0], k.shape[0])
    if isinstance(bandwidth, torch.Tensor) and bandwidth.device.type == "meta" != q.device.type:
        raise ValueError(f"bandwidth is on the meta device (no value) but queries are on {q.device}")
    check_fits(q.shape[0] * k.shape[0] * max(1, q.shape[1]) * q.element_size(),
               f"nadaraya_watson's (L, S, d) = ({q.shape[0]}, {k.shape[0]}, {q.shape[1]}) differences", q.device)
    h = torch.as_tensor(bandwidth, dtype=q.dtype, device=q.device)
    if h.device.type != "meta" and not bool(h.detach() > 0):
        tiny = torch.finfo(q.dtype).smallest_normal * torch.finfo(q.dtype).eps  # the smallest subnormal
        raise ValueError(f"bandwidth {short_repr(float(bandwidth))} is 0 in the queries' dtype {q.dtype} (below its "
                         f"smallest positive value, {tiny:.3g}): pass a larger bandwidth or float64 queries")
    diff = q.unsqueeze(1) - k.unsqueeze(0)  # (L, 1, d) - (1, S, d) -> (L, S, d)
    sq_dist = diff.pow(2).sum(-1)  # (L, S, d) -> (L, S)
    if kernel == "gaussian":
        # exp(-d^2 / 2h^2) / sum_j exp(-d_j^2 / 2h^2) is a softmax of the score -d^2 / 2h^2, unchanged when every
        # key's d^2 drops by the nearest one's: then a bandwidth so small that d^2 / h^2 overflows still gives
        # the nearest keys weight (the h -> 0 limit, nearest neighbours), not a row of -inf (zeros)
        near = sq_dist if attn_mask is None else sq_dist.masked_fill(~attn_mask, math.inf)
        near = near.detach().amin(-1, keepdim=True)  # (L, 1), the nearest key each query reads
        near = torch.where(torch.isfinite(near), near, 0.0)  # no key, or a NaN/inf one: no shift
        scores = -((sq_dist - near) / h / h) / 2.0  # (L, S); / h / h: h * h underflows to 0 first, d / h does not
        return masked_softmax(scores, attn_mask, dim=-1)
    # Kernels with compact support: K(u), u = ||q - k|| / h, evaluated from u^2 (finite gradients at q = k).
    w = _PROFILES[kernel](sq_dist / h / h)  # (L, S)
    if attn_mask is not None:
        w = w.masked_fill(~attn_mask, 0.0)
    total = w.sum(dim=-1, keepdim=True)  # (L, 1)
    empty = total == 0  # queries with no key inside the support
    return torch.where(empty, torch.zeros_like(w), w / total.masked_fill(empty, 1.0))


def nadaraya_watson(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kernel: str = "gaussian",
    bandwidth: Bandwidth = 1.0,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Nadaraya-Watson estimate ``f(q) = sum_i alpha(q, k_i) v_i`` at every query.

    Args:
        queries: (L,) or (L, d) floating tensor.
        keys: (S,) or (S, d) tensor of the same dtype and feature dim, with S >= 1.
        values: (S,) or (S, Ev) tensor of the same dtype, one value per key.
        kernel: ``"gaussian"``, ``"boxcar"`` or ``"epanechnikov"``.
        bandwidth: ``h > 0``, a float or a 0-d floating tensor (gradients flow through it).
        attn_mask: optional bool (L, S) mask, ``True`` = attend (see :func:`nadaraya_watson_weights`).

    Returns:
        (L,) if ``values`` is 1-D, else (L, Ev). Each output is a convex combination of the values, except
        for a query with no key in the kernel's support, whose output is 0.
    """
    _check_values(queries, keys, values)
    weights = nadaraya_watson_weights(queries, keys, kernel, bandwidth, attn_mask)  # (L, S)
    return weights @ values  # (L, S) @ (S,) -> (L,)  or  (L, S) @ (S, Ev) -> (L, Ev)


def leave_one_out_mask(n: int, device: torch.device | None = None) -> torch.Tensor:
    """(n, n) bool mask that is True everywhere except the diagonal: each point may not attend to itself.

    ``n`` is an int >= 0 and ``device`` ``None`` or a device this machine has (``TypeError``/``ValueError``
    naming the argument otherwise).
    """
    n = check_int(n, "n", low=0, high=MAX_SIZE)
    device = check_device(device)
    return ~torch.eye(n, dtype=torch.bool, device=device)


def leave_one_out_mse(
    x: torch.Tensor, y: torch.Tensor, kernel: str = "gaussian", bandwidth: Bandwidth = 1.0
) -> torch.Tensor:
    """Mean squared error of predicting each ``y_i`` from all the *other* training pairs.

    The training error itself is useless for choosing ``h``: as ``h -> 0`` every training point attends only
    to itself and the error falls to 0. Leaving the point out (masking the diagonal) removes that cheat.

    Args:
        x: (n,) or (n, d) training inputs (used as queries and as keys).
        y: (n,) or (n, Ev) training targets (the values).
        kernel: kernel name.
        bandwidth: ``h > 0``, float or 0-d tensor (differentiable).

    Returns:
        0-d tensor.
    """
    check_tensor(x, "x")  # before x.shape: a list is refused by name, as nadaraya_watson refuses it
    mask = leave_one_out_mask(x.shape[0], device=x.device)  # (n, n)
    pred = nadaraya_watson(x, x, y, kernel, bandwidth, attn_mask=mask)
    return (pred - y).pow(2).mean()


class NadarayaWatson(nn.Module):
    """Nadaraya-Watson regression as a module with a learnable bandwidth.

    The bandwidth is stored as ``log_bandwidth`` so that gradient descent can move it freely while
    ``h = exp(log_bandwidth)`` stays positive.

    Args:
        kernel: ``"gaussian"``, ``"boxcar"`` or ``"epanechnikov"``. Boxcar weights are piecewise constant
            in ``h``, so their gradient is zero: learn the bandwidth with the other two.
        bandwidth: the initial ``h > 0``.
        learn_bandwidth: if False, ``log_bandwidth`` is a buffer, not a parameter.
    """

    def __init__(
        self, kernel: str = "gaussian", bandwidth: float = 1.0, learn_bandwidth: bool = True
    ) -> None:
        super().__init__()
        self.kernel = _check_kernel(kernel)
        _check_bandwidth(bandwidth)
        log_h = torch.tensor(math.log(float(bandwidth)))
        if learn_bandwidth:
            self.log_bandwidth = nn.Parameter(log_h)
        else:
            self.register_buffer("log_bandwidth", log_h)

    @property
    def bandwidth(self) -> torch.Tensor:
        """``h = exp(log_bandwidth)``, a 0-d tensor (differentiable when learned)."""
        return self.log_bandwidth.exp()

    def forward(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Return ``(estimates, weights)``: (L,) or (L, Ev), and the (L, S) attention weights."""
        check_tensor(queries, "queries")
        check_floating(queries, "queries")
        _check_values(queries, keys, values)
        h = self.bandwidth.to(dtype=queries.dtype)  # the parameter is float32; follow the inputs' dtype
        weights = nadaraya_watson_weights(queries, keys, self.kernel, h, attn_mask)  # (L, S)
        return weights @ values, weights  # (L, S) @ (S,) -> (L,)  or  (L, S) @ (S, Ev) -> (L, Ev)

    def extra_repr(self) -> str:
        return f"kernel={self.kernel!r}, bandwidth={float(self.bandwidth.detach()):.4g}"


@dataclass
class BandwidthFit:
    """What :func:`fit_bandwidth` records at every step (before the step's update).

    Attributes:
        loss: leave-one-out mean squared error.
        bandwidth: the bandwidth ``h`` at which that loss was measured.
    """

    loss: List[float] = field(default_factory=list)
    bandwidth: List[float] = field(default_factory=list)


def fit_bandwidth(
    model: NadarayaWatson,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int = 100,
    lr: float = 0.1,
    betas: Tuple[float, float] = (0.9, 0.999),
) -> BandwidthFit:
    """Fit ``model``'s bandwidth by gradient descent (Adam) on the leave-one-out squared error.

    Each training point is a query over all the *other* training points (the diagonal of the (n, n) weight
    matrix is masked); without the mask the loss would be minimised by ``h -> 0``, where every point simply
    returns its own noisy target.

    Args:
        model: a :class:`NadarayaWatson` whose ``log_bandwidth`` is a parameter.
        x: (n,) or (n, d) training inputs.
        y: (n,) or (n, Ev) training targets.
        steps: number of Adam steps.
        lr: Adam's learning rate on ``log h``.
        betas: Adam's decay rates ``(beta1, beta2)``, each in [0, 1). ``beta1`` is the momentum: with the
            default 0.9 the bandwidth can overshoot the minimum before it settles (chapter 1, Figure 5); with
            ``beta1 = 0`` the same run approaches it without passing it (chapter 1 shows both on its data).

    Returns:
        A :class:`BandwidthFit` with the loss and the bandwidth at each step.
    """
    from attention_core.training.progress import progress

    if not isinstance(model, NadarayaWatson):
        raise TypeError(f"model must be a NadarayaWatson, got {type(model).__name__}")
    if not isinstance(model.log_bandwidth, nn.Parameter):
        raise ValueError("model has a fixed bandwidth (learn_bandwidth=False): nothing to fit")
    check_int(steps, "steps", low=1)
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"betas must be a pair of numbers in [0, 1), got {short_repr(betas)}")
    mask = leave_one_out_mask(x.shape[0], device=x.device)  # (n, n), True = attend
    opt = torch.optim.Adam([model.log_bandwidth], lr=lr, betas=(float(betas[0]), float(betas[1])))
    history = BandwidthFit()
    for _ in progress(range(steps), desc="fitting h"):
        opt.zero_grad()
        pred, _ = model(x, x, y, attn_mask=mask)
        loss = (pred - y).pow(2).mean()
        loss.backward()
        history.loss.append(float(loss.detach()))
        history.bandwidth.append(float(model.bandwidth.detach()))
        opt.step()
    return history
