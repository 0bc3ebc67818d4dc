"""Float64 NumPy oracles for tests/test_fuzz.py: what each public function must return, written independently.

Nothing here imports ``attention_core``: each oracle is the textbook formula in float64, plus, for attention,
the library's non-finite policy stated in :func:`attention_core.scaled_dot_product_attention`:

- a NaN or +-inf in query row ``i`` makes output row ``i`` NaN;
- a NaN or +-inf in key row ``j`` or value row ``j`` makes NaN every output row that *reads* key ``j``
  (not removed by the mask or by ``is_causal``, for that query and head);
- a NaN or +inf in a float mask at ``(i, j)`` makes row ``i`` NaN (``-inf`` removes the pair, as always);
- a row that reads no key at all is zeros, whatever its query holds;
- every other row is ordinary attention (the non-finite entries are never read by it).
"""

from __future__ import annotations

import numpy as np
import torch

INF = np.inf


def to64(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a float64 array (bool stays bool)."""
    t = t.detach()
    return t.numpy().copy() if t.dtype == torch.bool else t.to(torch.float64).numpy()


def _clean(x: np.ndarray) -> np.ndarray:
    return np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)


def _softmax_rows(scores: np.ndarray, reads: np.ndarray) -> np.ndarray:
    """Softmax over the last axis of the entries that are read; a row that reads nothing is zeros."""
    scores = np.where(reads, scores, -INF)
    alive = reads.any(-1, keepdims=True)
    top = np.where(alive, scores.max(-1, keepdims=True, initial=-INF), 0.0)
    e = np.where(reads, np.exp(scores - top), 0.0)
    return np.where(alive, e / np.where(alive, e.sum(-1, keepdims=True), 1.0), 0.0)


@np.errstate(all="ignore")  # NaN and inf in, NaN and inf out: the warnings say nothing
def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> tuple[np.ndarray | None, np.ndarray]:
    """Expected ``(out, weights)`` of one attention call under the policy (``out`` is None without value).

    ``attn_mask`` is taken as the library uses it: a float mask in the query's dtype.
    """
    q, k = to64(query), to64(key)
    v = None if value is None else to64(value)
    L, S, E = q.shape[-2], k.shape[-2], q.shape[-1]
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3] if k.shape[-3] else 1
        k = np.repeat(k, group, axis=-3)  # (..., H, S, E) -> (..., Hq, S, E)
        v = None if v is None else np.repeat(v, group, axis=-3)  # (..., H, S, Ev) -> (..., Hq, S, Ev)
    scale = 1.0 / np.sqrt(E) if scale is None else float(scale)
    reads = np.ones((L, S), dtype=bool)
    if is_causal:
        reads = np.tril(reads)  # upper-left aligned
    add = np.zeros((1, 1))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        reads = reads & to64(attn_mask)
    elif attn_mask is not None:
        m = to64(attn_mask.to(query.dtype))
        reads = reads & (m != -INF)
        add = np.where(m != -INF, m, 0.0)  # NaN and +inf stay: they poison the rows that read them
    alive = reads.any(-1)  # (..., L)
    bad_q = ~np.isfinite(q).all(-1)  # (..., L)
    bad_k = ~np.isfinite(k).all(-1)  # (..., S)
    bad_weights = (bad_q | (reads & (bad_k[..., None, :] | ~np.isfinite(add))).any(-1)) & alive
    scores = _clean(q) @ np.swapaxes(_clean(k), -1, -2) * scale + _clean(add)  # (..., L, S)
    weights = _softmax_rows(scores, np.broadcast_to(reads, scores.shape))
    weights = np.where(bad_weights[..., None], np.nan, weights)
    if v is None:
        return None, weights
    bad_v = ~np.isfinite(v).all(-1)  # (..., S)
    bad_out = bad_weights | ((reads & bad_v[..., None, :]).any(-1) & alive)
    clean_w = np.where(np.isnan(weights), 0.0, weights)
    out = clean_w @ _clean(v)  # (..., L, S) @ (..., S, Ev) -> (..., L, Ev)
    return np.where(bad_out[..., None], np.nan, out), weights


@np.errstate(all="ignore")  # NaN and inf in, NaN and inf out: the warnings say nothing
def masked_softmax(scores: torch.Tensor, mask: torch.Tensor | None, dim: int) -> np.ndarray:
    """Softmax along ``dim`` in IEEE float64: removed entries (mask False or -inf, score -inf) get 0; a row
    with nothing left is zeros; a NaN or +inf that takes part makes its row NaN."""
    s = to64(scores)
    if mask is not None and mask.dtype == torch.bool:
        s = np.where(to64(mask), s, -INF)
    elif mask is not None:  # the documented addition happens in the compute precision: so does the oracle's
        compute = torch.float32 if scores.dtype in (torch.float16, torch.bfloat16) else scores.dtype
        m = mask.to(compute)
        s = np.where(to64(m) == -INF, -INF, to64(scores.to(compute) + m))
    s = np.moveaxis(np.broadcast_to(s, tuple(scores.shape)), dim, -1)
    if s.shape[-1] == 0:
        return np.moveaxis(s.copy(), -1, dim)
    dead = (s == -INF).all(-1, keepdims=True)
    top = np.where(dead, 0.0, s.max(-1, keepdims=True))
    with np.errstate(invalid="ignore"):
        e = np.exp(s - top)
        w = np.where(dead, 0.0, e / e.sum(-1, keepdims=True))
    return np.moveaxis(w, -1, dim)


@np.errstate(all="ignore")  # NaN and inf in, NaN and inf out: the warnings say nothing
def nadaraya_watson(queries, keys, values, kernel: str, bandwidth: float, attn_mask) -> tuple[np.ndarray, ...]:
    """Expected ``(weights, out, u2)``; ``u2`` (L, S) lets the caller skip pairs on a kernel's edge."""
    q, k = to64(queries), to64(keys)
    q, k = (x[:, None] if x.ndim == 1 else x for x in (q, k))  # (n,) -> (n, 1)
    u2 = ((q[:, None, :] - k[None, :, :]) ** 2).sum(-1) / bandwidth**2  # (L, S)
    reads = np.ones(u2.shape, dtype=bool) if attn_mask is None else np.broadcast_to(to64(attn_mask), u2.shape)
    if kernel == "gaussian":
        w = _softmax_rows(-0.5 * u2, reads)
    else:
        profile = 0.5 * (u2 <= 1.0) if kernel == "boxcar" else 0.75 * np.clip(1.0 - u2, 0.0, None)
        profile = np.where(reads, profile, 0.0)
        total = profile.sum(-1, keepdims=True)
        w = np.where(total > 0, profile / np.where(total > 0, total, 1.0), 0.0)
    return w, w @ to64(values), u2


@np.errstate(all="ignore")  # NaN and inf in, NaN and inf out: the warnings say nothing
def sinusoidal(num_positions: int, d_model: int, base: float) -> np.ndarray:
    pos = np.arange(num_positions, dtype=np.float64)[:, None]
    i = np.arange(d_model // 2, dtype=np.float64)[None, :]
    angles = pos / base ** (2 * i / d_model)  # (P, D/2)
    table = np.zeros((num_positions, d_model))
    table[:, 0::2], table[:, 1::2] = np.sin(angles), np.cos(angles)
    return table


@np.errstate(all="ignore")  # NaN and inf in, NaN and inf out: the warnings say nothing
def rotary(x: torch.Tensor, positions: np.ndarray, base: float, interleaved: bool) -> np.ndarray:
    """RoPE by the formula: pair ``p`` of the features of row ``m`` turns by ``positions[m] * base^(-2p/E)``."""
    a = to64(x)
    E = a.shape[-1]
    theta = positions[:, None] * base ** (-2.0 * np.arange(E // 2) / E)  # (L, E/2)
    first, second = (np.arange(0, E, 2), np.arange(1, E, 2)) if interleaved else (
        np.arange(E // 2), np.arange(E // 2, E))
    out = a.copy()
    x1, x2 = a[..., first], a[..., second]
    out[..., first] = x1 * np.cos(theta) - x2 * np.sin(theta)
    out[..., second] = x1 * np.sin(theta) + x2 * np.cos(theta)
    return out
