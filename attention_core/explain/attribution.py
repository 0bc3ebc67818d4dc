"""Which input tokens matter? Attention-based and gradient-based attributions, and a reference to rank them by.

Attention-based (Abnar & Zuidema, 2020), from a stack of self-attention maps:

- :func:`attention_rollout`: ``R = A'_n ... A'_2 A'_1`` with ``A'_l = (A_l + I) / 2`` (heads averaged; the
  identity stands for the residual connection), so ``R[i, j]`` is how much of input token ``j`` reaches position
  ``i`` after the last layer if attention mixes linearly;
- :func:`attention_flow`: the same layers as a graph (node = token at a layer, edge capacity = ``A'_l[i, j]``),
  and each input token's importance the maximum flow from it to the output; networkx computes the flows.

Gradient-based, for a differentiable ``score(x) -> (B,)`` of input vectors ``x`` (B, L, D):

- :func:`gradient_x_input`: ``sum_d x_id * d score / d x_id``;
- :func:`integrated_gradients` (Sundararajan et al., 2017): ``(x - x') . mean_k grad(x' + a_k (x - x'))`` over
  ``a_k = (k + 1/2) / m``; its attributions add up to ``score(x) - score(x')`` as ``m`` grows (completeness).

Reference: :func:`leave_one_out`, the score's drop when one token is left out. :func:`spearman` ranks any of
them against it.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from attention_core._checks import check_tensor, fmt_shape

__all__ = [
    "attention_flow",
    "attention_rollout",
    "gradient_x_input",
    "integrated_gradients",
    "leave_one_out",
    "residual_attention",
    "spearman",
]

Score = Callable[[torch.Tensor], torch.Tensor]


def _stack(attentions: Sequence[torch.Tensor]) -> torch.Tensor:
    """Layers of (B, H, L, L) or (B, L, L) maps -> (n, B, L, L), heads averaged."""
    if isinstance(attentions, torch.Tensor) or not len(attentions):
        raise TypeError("attentions must be a non-empty sequence of per-layer tensors (B, H, L, L) or (B, L, L)")
    maps = []
    for i, a in enumerate(attentions):
        if not isinstance(a, torch.Tensor) or a.dim() not in (3, 4) or a.shape[-1] != a.shape[-2]:
            got = fmt_shape(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            raise ValueError(f"attentions[{i}] must be (B, H, L, L) or (B, L, L), got {got}")
        maps.append(a.mean(1) if a.dim() == 4 else a)  # (B, H, L, L) -> (B, L, L)
    if len({m.shape for m in maps}) != 1:
        raise ValueError(f"every layer's map must have one shape, got {[fmt_shape(m.shape) for m in maps]}")
    return torch.stack(maps).double()  # (n, B, L, L)


def residual_attention(attention: torch.Tensor, residual: Union[bool, float] = True) -> torch.Tensor:
    """The residual path counted into each map: ``r I + (1 - r) A`` with ``r = residual`` (rows still sum to 1).

    ``True`` is ``r = 1/2``, ``(A + I) / 2`` (Abnar & Zuidema's choice); ``False`` or ``0`` leaves ``A`` unchanged.
    (..., L, L) in, the same shape out."""
    check_tensor(attention, "attention")
    r = 0.5 if residual is True else 0.0 if residual is False else float(residual)
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"residual must be a bool or a weight in [0, 1], got {residual!r}")
    if r == 0.0:
        return attention
    eye = torch.eye(attention.shape[-1], dtype=attention.dtype, device=attention.device)
    return r * eye + (1 - r) * attention


def attention_rollout(attentions: Sequence[torch.Tensor], residual: Union[bool, float] = True) -> torch.Tensor:
    """Attention rollout: ``A'_n @ ... @ A'_1`` over the layers, in float64.

    Args:
        attentions: per layer, (B, H, L, L) or (B, L, L) weights (row = query); heads are averaged.
        residual: the identity's weight ``r`` in ``A' = r I + (1 - r) A`` (the residual connection); ``True`` is
            ``1/2``, Abnar & Zuidema's choice, ``False`` the raw maps.

    Returns:
        (B, L, L) float64; row ``i`` is position ``i``'s mixture of input tokens after the last layer.
    """
    maps = residual_attention(_stack(attentions), residual)
    out = maps[0]
    for a in maps[1:]:
        out = a @ out  # (B, L, L) @ (B, L, L): the later layer mixes the earlier mixtures
    return out


def attention_flow(attentions: Sequence[torch.Tensor], output: Union[int, torch.Tensor] = 0,
                   attention_mask: Optional[torch.Tensor] = None, residual: bool = True,
                   resolution: float = 1e-6) -> torch.Tensor:
    """Attention flow: each input token's maximum flow to the output through the layers' attention graph.

    Nodes are ``(layer, position)`` for layers ``0..n`` (0 = the inputs); the edge from ``(l - 1, j)`` to
    ``(l, i)`` has capacity ``A'_l[i, j]``; a sink is fed by the last layer's positions with capacities
    ``output`` (one-hot at a position such as ``[CLS]``, or a pooling's weights). Capacities are rounded to
    multiples of ``resolution`` so that the max-flow solver works on integers (exact there).

    Args:
        attentions: per layer, (B, H, L, L) or (B, L, L).
        output: the position whose representation is explained (an int), or (B, L) weights over positions.
        attention_mask: (B, L) bool, True at real tokens; padding takes no part (default: all real).
        residual: use ``(A + I) / 2`` for each layer.
        resolution: the capacities' grid.

    Returns:
        (B, L) float64 flows (0 at padding).
    """
    try:
        import networkx as nx
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("attention_flow needs networkx: `pip install networkx` (or attention-core[book])") from err
    maps = residual_attention(_stack(attentions), residual)  # (n, B, L, L)
    n, B, L, _ = maps.shape
    if isinstance(output, int) and not isinstance(output, bool):
        if not 0 <= output < L:
            raise ValueError(f"output must be a position in [0, {L}), got {output}")
        out_w = torch.zeros(B, L, dtype=torch.float64)
        out_w[:, output] = 1.0
    elif isinstance(output, torch.Tensor) and tuple(output.shape) == (B, L):
        out_w = output.detach().double().cpu()
    else:
        raise ValueError(f"output must be an int position or a (B, L) = {(B, L)} tensor of weights, got {output!r:.60}")
    mask = torch.ones(B, L, dtype=torch.bool) if attention_mask is None else attention_mask.bool().cpu()
    if tuple(mask.shape) != (B, L):
        raise ValueError(f"attention_mask must be (B, L) = {(B, L)}, got {fmt_shape(mask.shape)}")
    scale = 1.0 / resolution
    caps = torch.round(maps.detach().cpu() * scale).long()  # (n, B, L, L)
    sink_caps = torch.round(out_w * scale).long()  # (B, L)
    flows = torch.zeros(B, L, dtype=torch.float64)
    for b in range(B):
        real = mask[b].nonzero().flatten().tolist()
        g = nx.DiGraph()
        for layer in range(1, n + 1):
            for i in real:
                for j in real:
                    c = int(caps[layer - 1, b, i, j])
                    if c > 0:
                        g.add_edge((layer - 1, j), (layer, i), capacity=c)
        for i in real:
            if int(sink_caps[b, i]) > 0:
                g.add_edge((n, i), "sink", capacity=int(sink_caps[b, i]))
        for j in real:
            if (0, j) in g and "sink" in g:
                flows[b, j] = nx.maximum_flow_value(g, (0, j), "sink") / scale
    return flows


def _check_inputs(x: torch.Tensor, score: Score) -> None:
    if not callable(score):
        raise TypeError(f"score must be callable x (B, L, D) -> (B,), got {type(score).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.dtype.is_floating_point:
        got = fmt_shape(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"x must be a floating (B, L, D) tensor of input vectors, got {got}")


def _grad(score: Score, x: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_()
    value = score(x)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != (x.shape[0],):
        raise ValueError(f"score must return a (B,) = ({x.shape[0]},) tensor, got {value!r:.80}")
    (g,) = torch.autograd.grad(value.sum(), x)  # rows are independent, so the sum's gradient is per row
    return g


def gradient_x_input(score: Score, x: torch.Tensor) -> torch.Tensor:
    """Gradient x input: ``a_i = sum_d x_id * d score / d x_id``, (B, L, D) -> (B, L).

    ``score`` maps input vectors (B, L, D) to one number per row, (B,); rows must not interact.
    """
    _check_inputs(x, score)
    return (_grad(score, x) * x).sum(-1).detach()  # (B, L, D) -> (B, L)


def integrated_gradients(score: Score, x: torch.Tensor, baseline: Optional[torch.Tensor] = None,
                         steps: int = 32) -> torch.Tensor:
    """Integrated gradients along the straight path from ``baseline`` (default zeros) to ``x``: (B, L).

    ``a_i = sum_d (x - x')_id * mean_k d score / d x_id at x' + a_k (x - x')``, ``a_k = (k + 1/2) / steps``
    (the midpoint rule: exact when the gradient is linear along the path). Completeness:
    ``sum_i a_i -> score(x) - score(x')`` as ``steps`` grows.
    """
    _check_inputs(x, score)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    base = torch.zeros_like(x) if baseline is None else baseline.expand_as(x)
    total = torch.zeros_like(x)
    for k in range(steps):
        alpha = (k + 0.5) / steps
        total += _grad(score, base + alpha * (x - base))
    return ((x - base) * total / steps).sum(-1).detach()  # (B, L, D) -> (B, L)


def leave_one_out(score: Callable[[torch.Tensor], torch.Tensor], attention_mask: torch.Tensor,
                  positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Leave-one-out importance: ``score(all tokens) - score(all but token i)`` for every position ``i``.

    Args:
        score: maps a (B, L) bool mask of the tokens kept to (B,) scores.
        attention_mask: (B, L) bool, True at real tokens.
        positions: (B, L) bool, the positions to leave out in turn (default: every real token).

    Returns:
        (B, L) float64; 0 where a position was not left out.
    """
    if not callable(score):
        raise TypeError(f"score must be a callable, got {type(score).__name__}")
    check_tensor(attention_mask, "attention_mask")
    mask = attention_mask.bool()
    todo = mask if positions is None else positions.bool() & mask
    with torch.no_grad():
        full = score(mask).double()  # (B,)
        out = torch.zeros(mask.shape, dtype=torch.float64)
        for i in range(mask.shape[1]):
            if not bool(todo[:, i].any()):
                continue
            kept = mask.clone()
            kept[:, i] = False
            out[:, i] = torch.where(todo[:, i].cpu(), (full - score(kept).double()).cpu(), torch.zeros(()).double())
    return out


def _ranks(v: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n along the last dim, ties sharing their average rank."""
    less = (v[..., None, :] < v[..., :, None]).sum(-1)  # (..., n): how many are smaller
    equal = (v[..., None, :] == v[..., :, None]).sum(-1)  # (..., n): how many are equal (itself included)
    return less.double() + (equal.double() + 1) / 2


def spearman(a: torch.Tensor, b: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Spearman's rank correlation of each row of ``a`` with the same row of ``b`` (ties get average ranks).

    Args:
        a, b: (B, L) scores.
        mask: (B, L) bool, the entries that take part (default all).

    Returns:
        (B,) float64 correlations in [-1, 1]; NaN for a row with fewer than 2 entries or constant ranks.
    """
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dim() != 2:
        raise ValueError("a and b must be tensors of one shape (B, L)")
    mask = torch.ones_like(a, dtype=torch.bool) if mask is None else mask.bool()
    out = torch.full((a.shape[0],), float("nan"), dtype=torch.float64)
    for r in range(a.shape[0]):
        x, y = a[r][mask[r]].double().cpu(), b[r][mask[r]].double().cpu()
        if x.numel() < 2:
            continue
        rx, ry = _ranks(x), _ranks(y)
        rx, ry = rx - rx.mean(), ry - ry.mean()
        den = (rx.square().sum() * ry.square().sum()).sqrt()
        if den > 0:
            out[r] = (rx * ry).sum() / den
    return out
