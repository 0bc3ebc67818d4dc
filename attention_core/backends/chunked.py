"""The chunked backend: FlashAttention's online softmax, in plain torch, on any device.

Attention never needs the whole (L, S) score matrix at once. Walk over key/value tiles of ``block_k`` keys,
keep for every query row its running max ``m``, running denominator ``l`` and running output ``acc``, and
rescale them whenever a new tile raises the max:

    m_new = max(m, rowmax(s))      p = exp(s - m_new)      alpha = exp(m - m_new)
    l     = l * alpha + rowsum(p)  acc = acc * alpha + p @ v_tile          out = acc / l

Exponentials are taken base 2, as in FlashAttention and the Triton tutorial: ``log2(e)`` is folded into the
score scale once per query tile, so ``exp(x) = exp2(x * log2(e))`` costs no extra pass, and ``exp2`` is the
cheaper instruction (on this project's CPU, torch's ``exp2_`` takes about 0.6x the time of ``exp_``). The
running max and the log-sum-exp live in base-2 units inside the loops; ``lse`` is stored in natural units.

The backward recomputes each tile's probabilities from the saved log-sum-exp ``lse = m + log(l)``
(``p = exp(s - lse)``), as FlashAttention-2 does, so neither pass holds more than one
(G * block_q, block_k) tile of scores per (batch, kv-head) at a time. Queries are tiled too (``block_q``),
which keeps a tile in cache and lets ``is_causal`` skip every tile above the diagonal.

GQA costs nothing extra: the G = Hq / H query heads that share a key/value head are stacked as extra query
rows, (B, Hq, L, E) -> (B * H, G * L, E), so key/value are never repeated and their gradients are summed
over the group by the matmul itself.

Layout, as in the Triton tutorial: tile loops -> launcher (validate, allocate) -> ``torch.autograd.Function``
-> public function. Dropout is not supported (the registry says so before a call gets here).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["BLOCK_K", "BLOCK_Q", "POISON_OUTPUTS", "attention", "chunked_attention"]

#: Default tile sizes, the fastest measured on a 2-core CPU (float32, E = 64, L = 4096): a (256, 256) tile
#: of scores is 256 KiB per (batch, kv-head).
BLOCK_Q = 256
BLOCK_K = 256

_NEG_INF = float("-inf")
_LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * _LOG2E)
_LN2 = 0.6931471805599453  # ln(2) == 1 / _LOG2E

#: Tests set this to True: the output and log-sum-exp buffers are then filled with NaN before the tiles write
#: them, so a row the loops forgot cannot pass as a plausible value.
POISON_OUTPUTS = False


# ------------------------------------------------------------------------------------------------ tiles


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs are computed in float32: the running sums would lose digits tile after tile."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _Tiles:
    """What the tile loops share: 3-D views of the inputs (in the compute dtype), the mask and the tiling."""

    def __init__(self, query, key, value, attn_mask, is_causal, scale, block_q, block_k):
        B, Hq, L, E = query.shape
        H, S = key.shape[1], key.shape[2]
        self.B, self.H, self.G, self.L, self.S = B, H, Hq // H, L, S
        self.dtype = dt = _compute_dtype(query.dtype)
        self.q = query.to(dt).reshape(B * H, self.G, L, E)  # (B, Hq, L, E) -> (B*H, G, L, E)
        self.k = key.to(dt).reshape(B * H, S, E)  # (B, H, S, E) -> (B*H, S, E)
        self.v = value.to(dt).reshape(B * H, S, value.shape[-1])  # (B, H, S, Ev) -> (B*H, S, Ev)
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dt)
        self.mask = None if attn_mask is None else _mask_5d(attn_mask, H, self.G)
        self.is_causal, self.scale = is_causal, scale
        self.scale2 = scale * _LOG2E  # scores in base-2 units: exp(scale * q.k) == exp2(scale2 * q.k)
        self.block_q, self.block_k = block_q, block_k

    def rows(self, r0: int, r1: int, x: torch.Tensor) -> torch.Tensor:
        """Rows [r0, r1) of every head of a group: (B*H, G, L, D) -> (B*H, G*bl, D)."""
        BH, D = x.shape[0], x.shape[-1]
        return x[:, :, r0:r1].reshape(BH, self.G * (r1 - r0), D)  # (BH, G, bl, D) -> (BH, G*bl, D)

    def key_tiles(self, r0: int, r1: int):
        """Key tile bounds for query rows [r0, r1); causal skips tiles entirely above the diagonal."""
        stop = min(self.S, r1) if self.is_causal else self.S  # causal: query i < r1 sees keys j <= i < r1
        for s0 in range(0, stop, self.block_k):
            yield s0, min(s0 + self.block_k, self.S)

    def scores(self, q_tile: torch.Tensor, r0: int, r1: int, s0: int, s1: int) -> torch.Tensor:
        """Masked scores of one tile in base-2 units (q_tile carries ``scale2``): (B*H, G*bl, bs)."""
        k_t = self.k[:, s0:s1].transpose(1, 2)  # (BH, bs, E) -> (BH, E, bs)
        s = torch.bmm(q_tile, k_t)  # (BH, G*bl, E) @ (BH, E, bs) -> (BH, G*bl, bs)
        s5 = s.view(self.B, self.H, self.G, r1 - r0, s1 - s0)  # (BH, G*bl, bs) -> (B, H, G, bl, bs)
        if self.mask is not None:
            m = self.mask
            m = m[..., r0:r1, :] if m.shape[-2] > 1 else m
            m = m[..., s0:s1] if m.shape[-1] > 1 else m  # (Bm, Hm, Gm, bl?, bs?)
            if m.dtype == torch.bool:
                s5.masked_fill_(~m, _NEG_INF)
            else:
                s5.add_(m, alpha=_LOG2E)  # an additive mask in base-2 units, like the scores
        if self.is_causal and s1 - 1 > r0:  # the tile crosses the diagonal: hide keys j > i
            i = torch.arange(r0, r1, device=s.device)[:, None]  # (bl, 1)
            j = torch.arange(s0, s1, device=s.device)[None, :]  # (1, bs)
            s5.masked_fill_(j > i, _NEG_INF)
        return s


def _mask_5d(mask: torch.Tensor, H: int, G: int) -> torch.Tensor:
    """A 4-D mask broadcastable to (B, Hq, L, S) -> 5-D, broadcastable to (B, H, G, L, S)."""
    Bm, Hm, Lm, Sm = mask.shape
    if Hm == 1:
        return mask.reshape(Bm, 1, 1, Lm, Sm)  # (Bm, 1, Lm, Sm) -> (Bm, 1, 1, Lm, Sm)
    return mask.reshape(Bm, H, G, Lm, Sm)  # (Bm, Hq, Lm, Sm) -> (Bm, H, G, Lm, Sm)


def _forward_tiles(t: _Tiles, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fill ``out`` (B*H, G, L, Ev) and ``lse`` (B*H, G, L, 1) one query tile at a time."""
    BH = t.q.shape[0]
    Ev = t.v.shape[-1]
    for r0 in range(0, t.L, t.block_q):
        r1 = min(r0 + t.block_q, t.L)
        n = t.G * (r1 - r0)
        q_tile = t.rows(r0, r1, t.q) * t.scale2  # (BH, G*bl, E), scaled (base 2) once per tile
        m = q_tile.new_full((BH, n, 1), _NEG_INF)  # running max, base-2 units
        denom = q_tile.new_zeros((BH, n, 1))  # running denominator, "l" in the papers
        acc = q_tile.new_zeros((BH, n, Ev))  # running numerator
        for s0, s1 in t.key_tiles(r0, r1):
            s = t.scores(q_tile, r0, r1, s0, s1)  # (BH, G*bl, bs)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)  # rows with no visible key yet
            p = s.sub_(m_safe).exp2_()  # (BH, G*bl, bs), in place: s is not needed again
            alpha = (m - m_safe).exp2_()  # rescales what was accumulated under the old max
            denom.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
            acc.mul_(alpha).baddbmm_(p, t.v[:, s0:s1])  # += (BH, G*bl, bs) @ (BH, bs, Ev)
            m = m_new
        dead = denom == 0  # fully masked rows: output 0; lse = +inf makes the backward's exp(s - lse) = 0
        o = acc / denom.masked_fill(dead, 1.0)  # (BH, G*bl, Ev)
        out[:, :, r0:r1] = o.view(BH, t.G, r1 - r0, Ev)  # (BH, G*bl, Ev) -> (BH, G, bl, Ev)
        m_safe = m.masked_fill(dead, 0.0)
        lse_tile = ((m_safe + denom.log2()) * _LN2).masked_fill(dead, float("inf"))  # natural units
        lse[:, :, r0:r1] = lse_tile.view(BH, t.G, r1 - r0, 1)  # (BH, G*bl, 1) -> (BH, G, bl, 1)


def _backward_tiles(
    t: _Tiles, grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (B*H, G, L, E), (B*H, S, E), (B*H, S, Ev) from grad_out, out (B*H, G, L, Ev), lse."""
    dq = torch.zeros_like(t.q)  # (BH, G, L, E)
    dk = torch.zeros_like(t.k)  # (BH, S, E)
    dv = torch.zeros_like(t.v)  # (BH, S, Ev)
    delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (BH, G, L, 1): rowsum(dO * O) = rowsum(P * dP)
    for r0 in range(0, t.L, t.block_q):
        r1 = min(r0 + t.block_q, t.L)
        q_tile = t.rows(r0, r1, t.q) * t.scale2  # (BH, G*bl, E), base-2 units as in the forward
        do_tile = t.rows(r0, r1, grad_out)  # (BH, G*bl, Ev)
        lse_tile, delta_tile = t.rows(r0, r1, lse) * _LOG2E, t.rows(r0, r1, delta)  # (BH, G*bl, 1) each
        dq_tile = torch.zeros_like(q_tile)  # (BH, G*bl, E)
        for s0, s1 in t.key_tiles(r0, r1):
            p = t.scores(q_tile, r0, r1, s0, s1).sub_(lse_tile).exp2_()  # (BH, G*bl, bs), recomputed
            dv[:, s0:s1].baddbmm_(p.transpose(1, 2), do_tile)  # += (BH, bs, G*bl) @ (BH, G*bl, Ev)
            dp = torch.bmm(do_tile, t.v[:, s0:s1].transpose(1, 2))  # (BH, G*bl, Ev) @ (BH, Ev, bs)
            ds = dp.sub_(delta_tile).mul_(p)  # (BH, G*bl, bs): dS = P * (dP - delta)
            dq_tile.baddbmm_(ds, t.k[:, s0:s1])  # += (BH, G*bl, bs) @ (BH, bs, E)
            dk[:, s0:s1].baddbmm_(ds.transpose(1, 2), q_tile)  # += (BH, bs, G*bl) @ (BH, G*bl, E), q * scale2
        BH, E = dq.shape[0], dq.shape[-1]
        dq[:, :, r0:r1] = (dq_tile * t.scale).view(BH, t.G, r1 - r0, E)  # (BH, G*bl, E) -> (BH, G, bl, E)
    dk.mul_(_LN2)  # q_tile carried scale * log2(e); dK wants q * scale
    return dq, dk, dv


# -------------------------------------------------------------------------------------------- launcher


def _launch_forward(query, key, value, attn_mask, is_causal, scale, block_q, block_k):
    """Validate the tiling, allocate out (B, Hq, L, Ev) and lse (B, Hq, L, 1), run the tiles."""
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"{name} must be a positive int, got {b!r}")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            "chunked_attention takes canonical 4-D inputs (B, Hq, L, E), (B, H, S, E), (B, H, S, Ev); got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)} "
            "(scaled_dot_product_attention takes any layout)"
        )
    t = _Tiles(query, key, value, attn_mask, is_causal, scale, block_q, block_k)
    BH, L, Ev = t.q.shape[0], t.L, value.shape[-1]
    out = t.q.new_empty((BH, t.G, L, Ev))  # (B*H, G, L, Ev), compute dtype
    lse = t.q.new_empty((BH, t.G, L, 1))  # (B*H, G, L, 1)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
    _forward_tiles(t, out, lse)
    return t, out, lse


class _ChunkedAttention(torch.autograd.Function):
    """Forward by online softmax over tiles; backward recomputes each tile from the saved log-sum-exp."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, is_causal, scale, block_q, block_k):
        t, out, lse = _launch_forward(query, key, value, attn_mask, is_causal, scale, block_q, block_k)
        ctx.save_for_backward(query, key, value, attn_mask, out, lse)
        ctx.config = (is_causal, scale, block_q, block_k)
        B, Hq, L, Ev = query.shape[0], query.shape[1], query.shape[2], value.shape[-1]
        return out.to(query.dtype).view(B, Hq, L, Ev)  # (B*H, G, L, Ev) -> (B, Hq, L, Ev)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        query, key, value, attn_mask, out, lse = ctx.saved_tensors
        t = _Tiles(query, key, value, attn_mask, *ctx.config)
        grad_out = grad_out.to(t.dtype).reshape(out.shape)  # (B, Hq, L, Ev) -> (B*H, G, L, Ev)
        dq, dk, dv = _backward_tiles(t, grad_out, out, lse)
        dq = dq.to(query.dtype).view(query.shape)  # (B*H, G, L, E) -> (B, Hq, L, E)
        dk = dk.to(key.dtype).view(key.shape)  # (B*H, S, E) -> (B, H, S, E)
        dv = dv.to(value.dtype).view(value.shape)  # (B*H, S, Ev) -> (B, H, S, Ev)
        return dq, dk, dv, None, None, None, None, None


# ---------------------------------------------------------------------------------------------- public


def chunked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> torch.Tensor:
    """Tiled attention with O(block_q * block_k) extra memory per (batch, kv-head), forward and backward.

    Takes canonical inputs (see :mod:`attention_core.backends`); the public, validated way in is
    ``scaled_dot_product_attention(..., backend="chunked")``. This function adds the tile sizes.

    Args:
        query: (B, Hq, L, E).
        key: (B, H, S, E), ``Hq % H == 0``.
        value: (B, H, S, Ev).
        attn_mask: ``None`` or 4-D, broadcastable to (B, Hq, L, S): bool (True = takes part) or float
            (added), in the query's dtype; no gradient flows to it.
        is_causal: upper-left aligned causal mask; tiles above the diagonal are skipped.
        scale: score scale, default ``1/sqrt(E)``.
        enable_gqa: accepted for signature parity: GQA follows from ``Hq != H``.
        block_q: query rows per tile.
        block_k: keys per tile.

    Returns:
        (B, Hq, L, Ev) in the query's dtype; fully masked rows are zeros.
    """
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return _ChunkedAttention.apply(query, key, value, attn_mask, is_causal, scale, block_q, block_k)


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
) -> torch.Tensor:
    """Backend entry point on canonical inputs, tiles of :data:`BLOCK_Q` x :data:`BLOCK_K` (read per call)."""
    if dropout_p > 0:
        raise ValueError(f"the chunked backend has no dropout, got dropout_p={dropout_p}")
    return chunked_attention(
        query, key, value, attn_mask, is_causal, scale, enable_gqa, block_q=BLOCK_Q, block_k=BLOCK_K
    )
