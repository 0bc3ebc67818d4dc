"""The chunked backend: FlashAttention's online softmax, in plain torch, on any device.

Attention never needs the whole (L, S) score matrix at once. Walk over key/value tiles of ``block_k`` keys,
keep for every query row its running max ``m``, running denominator ``l`` and running output ``acc``, and
rescale them whenever a new tile raises the max:

    m_new = max(m, rowmax(s))      p = exp(s - m_new)      alpha = exp(m - m_new)
    l     = l * alpha + rowsum(p)  acc = acc * alpha + p @ v_tile          out = acc / l

The max need not be the exact one: ``m`` cancels in ``acc / l``, and all it has to do is keep ``exp(s - m)``
from overflowing. So, on a CPU, once every row of a query tile has seen a key, its max so far stays fixed for
the remaining key tiles, and they skip the row max, ``alpha`` and the rescale::

    p = exp(s - m)                 l = l + rowsum(p)                       acc = acc + p @ v_tile

The subtraction ``s - m`` happens inside the score product: the query tile carries ``-m`` as one more column
and the keys a column of ones, ``[q, -m] . [k, 1] = q . k - m``. A later score more than about 127 (base-2
units) above the fixed max would overflow a sum; one check per query tile catches that, and the query tile is
redone with the max tracked tile by tile.

Exponentials are taken base 2, as in FlashAttention and the Triton tutorial: ``log2(e)`` is folded into the
score scale once per query tile, so ``exp(x) = exp2(x * log2(e))`` costs no extra pass, and ``exp2`` is the
cheaper instruction (measured in ``benchmarks/NOTES.md``: torch's ``exp2_`` takes a fraction of the time of
``exp_`` on an AMD EPYC; on an Intel Xeon ``exp_`` is faster until its results underflow, past about -87, and
then dozens of times slower). The running max and the log-sum-exp live in base-2 units inside the loops
(natural units when a float mask is added: see ``_Tiles``); ``lse`` is stored in natural units.

The backward recomputes each tile's probabilities from the saved log-sum-exp ``lse = m + log(l)``
(``p = exp(s - lse)``), as FlashAttention-2 does, so neither pass holds more than one tile of scores at a
time. Queries are tiled too (``block_q``), which keeps a tile in cache and lets ``is_causal`` skip every tile
above the diagonal.

GQA costs nothing extra: the G = Hq / H query heads that share a key/value head are stacked as extra query
rows, (B, Hq, L, E) -> (B * H, G * L, E), so key/value are never repeated and their gradients are summed
over the group by the matmul itself.

How the loops are laid out for speed on a CPU (the arithmetic is the same whatever the layout; the
measurements are in ``benchmarks/NOTES.md``), as PyTorch's own C++ kernel does:

- **One (batch, kv-head) at a time** (one per torch thread). Each tile of scores then belongs to one head
  and, at the default (256, 512), takes 512 KiB: it fits in the core's L2 cache (1 MiB or more on Intel
  Xeons since Skylake-SP and AMD EPYCs since Zen 4), so it can stay there during the passes over it (exp2
  and sum, and before the max is fixed also max and subtract) and the P @ V product. A tile of all eight
  heads at once would be 4 MiB, and every pass would have to stream it from the slower L3 (the reasoning
  behind the layout; no cache counters were read). With several threads, each operation splits its work
  head by head, so each thread works on one head's tile, which can then stay in that thread's cache (not
  measured either; two logical CPUs may be two hyperthreads of one core, sharing its L2). Short sequences,
  whose tiles are small, stack more heads in one step, so that every round of Python calls still moves a
  full tile's worth of numbers.
- **No allocation inside the loops.** The tile's buffers are allocated once per call and every operation
  writes into them (``out=``, in-place ``sub_``, ``exp2_``, ``baddbmm_``): each tile lands in memory the
  previous tile just used, which is still in cache, and the allocator stays out of the inner loop. The views
  of a step's key tiles are made once and reused by all its query tiles.
- **Causal tiles end at the diagonal.** A query tile visits the key tiles up to its own last row, and the
  one tile the diagonal crosses takes its mask as a slice of one band made once per call.

Layout, as in the Triton tutorial: tile loops -> launcher (validate, allocate) -> a custom operator with its
autograd, fake (shapes for ``torch.compile``) and vmap rules -> public function. Dropout is not supported
(the registry says so before a call gets here).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from attention_core._checks import (
    check_bool_flag,
    check_floating,
    check_int,
    check_mask_broadcasts,
    check_rank,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_tensor,
    fmt_shape,
)
from attention_core.backends.inputs import AttentionInputs, BackendResult, compute_dtype, no_weights

__all__ = ["BLOCK_K", "BLOCK_Q", "backward_with_lse", "chunked_attention", "forward_with_lse", "merge_partials",
           "run", "supports"]

#: Default tile sizes, the ones PyTorch's CPU kernel uses for long sequences. A (256, 512) float32 tile of
#: scores is 512 KiB, half of a 1 MiB L2 cache, which leaves room for the tile's inputs: 256 queries (64 KiB
#: at E = 64), 512 keys and 512 values (128 KiB each), and the running output (64 KiB). Fewer query rows make
#: the matrix products less efficient (each K and V tile is packed once per product, whatever the row count).
BLOCK_Q = 256
BLOCK_K = 512

_NEG_INF = float("-inf")
_LOG2E = 1.4426950408889634  # log2(e): exp(x) == exp2(x * _LOG2E)
_LN2 = 0.6931471805599453  # ln(2) == 1 / _LOG2E



# ------------------------------------------------------------------------------------------------ tiles


class _Scratch:
    """Flat buffers allocated once per call; ``take(name, *shape)`` views the first elements as ``shape``.

    The views are kept: the tile loops ask for the same few shapes again and again.
    """

    def __init__(self, like: torch.Tensor, **sizes: int):
        self.buffers = {name: like.new_empty(size) for name, size in sizes.items()}
        self.views: dict[tuple, torch.Tensor] = {}

    def take(self, name: str, *shape: int) -> torch.Tensor:
        key = (name, *shape)
        if key not in self.views:
            self.views[key] = self.buffers[name][: math.prod(shape)].view(shape)
        return self.views[key]


class _Tiles:
    """What the tile loops share: 3-D views of the inputs (in the compute dtype), the mask and the tiling.

    The loops visit the B * H (batch, kv-head) pairs in steps of ``heads`` pairs (one per torch thread for long
    sequences); a step's tiles are 3-D, (heads in the step, G * query rows, keys).
    """

    def __init__(self, query, key, value, attn_mask, is_causal, scale, block_q, block_k):
        B, Hq, L, E = query.shape
        H, S = key.shape[1], key.shape[2]
        self.B, self.H, self.G, self.L, self.S = B, H, Hq // H, L, S
        self.dtype = dt = compute_dtype(query.dtype)  # half precision in float32: sums lose digits tile after tile
        self.q = query.to(dt).reshape(B * H, self.G, L, E)  # (B, Hq, L, E) -> (B*H, G, L, E)
        self.k = key.to(dt).reshape(B * H, S, E)  # (B, H, S, E) -> (B*H, S, E)
        self.v = value.to(dt).reshape(B * H, S, value.shape[-1])  # (B, H, S, Ev) -> (B*H, S, Ev)
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(dt)
        elif attn_mask is not None:
            attn_mask = ~attn_mask  # bool: True = hidden from here on, inverted once rather than per tile
        self.mask = None if attn_mask is None else _mask_5d(attn_mask, H, self.G)
        self.is_causal, self.scale = is_causal, scale
        # Scores in base-2 units (exp(scale * q.k) == exp2(scale2 * q.k)), except with a float mask: it is added
        # as given, in natural units, because scaling it by log2(e) would overflow a finite mask such as
        # finfo(float32).min to -inf, and a row of such entries would turn from uniform (the reference's answer)
        # into zeros. Those tiles use exp and log instead of exp2 and log2; the loops read the unit from here.
        self.natural = attn_mask is not None and attn_mask.is_floating_point()
        self.unit = 1.0 if self.natural else _LOG2E  # score units per natural unit
        self.scale2 = scale * self.unit
        self.block_q, self.block_k = block_q, block_k
        bq, bk = min(block_q, L), min(block_k, S)  # the largest tile
        if is_causal:
            # In a tile of queries r0 + a and keys s0 + b, a key is hidden iff s0 + b > r0 + a: it depends on the
            # tile only through s0 - r0. So every tile's causal mask is a slice of one band, made once per call:
            # band[a, c] = c - bk > a, and a tile's mask is band[:bl, c0:c0 + bs] with c0 = s0 - r0 + bk.
            cols, rows = torch.arange(bq + bk, device=query.device), torch.arange(bq, device=query.device)
            self.band = cols[None, :] - bk > rows[:, None]  # (bq, bq + bk), True = hidden
        # (kv-)heads per step: one per torch thread when a head's tile is full-size (each operation then splits
        # its work between the threads head by head, each thread on one head's tile, meant to stay in its cache);
        # more when the sequences are short, up to a full tile's worth of scores per step.
        self.rows, self.keys = self.G * bq, bk  # the largest tile of one head: (G * bq, bk)
        short = block_q * block_k // max(1, self.rows * self.keys)
        self.heads = max(1, min(B * H, max(torch.get_num_threads(), short)))  # at least 1, even when B*H = 0

    def exp_(self, x: torch.Tensor) -> torch.Tensor:
        """``exp2`` in place, of scores in base-2 units (``exp`` in the natural units of a float mask's tiles)."""
        return x.exp_() if self.natural else x.exp2_()

    def head_steps(self):
        """Ranges [h0, h1) of the B*H (batch, kv-head) pairs, ``heads`` at a time."""
        for h0 in range(0, self.q.shape[0], self.heads):
            yield h0, min(h0 + self.heads, self.q.shape[0])

    def key_tiles(self, r0: int, r1: int):
        """Key tile bounds for query rows [r0, r1); causal skips tiles entirely above the diagonal."""
        stop = min(self.S, r1) if self.is_causal else self.S  # causal: query i < r1 sees keys j <= i < r1
        for s0 in range(0, stop, self.block_k):
            yield s0, min(s0 + self.block_k, stop)  # causal: the last tile ends at r1, not past it

    def stack_rows(self, x: torch.Tensor, h0: int, h1: int, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [r0, r1) of the G heads of steps [h0, h1), copied into ``out``: (hb, G, L, D) -> (hb, G*bl, D)."""
        out.view(h1 - h0, self.G, r1 - r0, x.shape[-1]).copy_(x[h0:h1, :, r0:r1])  # (hb, G*bl, D) as (hb, G, bl, D)
        return out

    @staticmethod
    def with_ones(x: torch.Tensor, h0: int, h1: int, out: torch.Tensor) -> torch.Tensor:
        """``x[h0:h1]`` (hb, S, D) with a column of ones, into ``out`` (hb, S, D + 1), transposed: (hb, D + 1, S).

        The query tiles carry one more column too, which holds minus a value per row (a reference max, the
        log-sum-exp), so one product gives the scores *minus* that value: [q, -c] . [k, 1] = q . k - c. The
        subtraction costs one more step of the product's inner loop (E -> E + 1) instead of a pass of its own over
        the (rows, keys) tile. One step of heads at a time, so the copy stays in cache.
        """
        out[..., :-1].copy_(x[h0:h1])
        out[..., -1:].fill_(1.0)
        return out.transpose(1, 2)

    def query_tile(self, h0: int, h1: int, r0: int, r1: int, out: torch.Tensor) -> torch.Tensor:
        """Like :meth:`stack_rows` for the queries, scaled by ``scale2`` on the way, into ``out``: (hb, G*bl, E), or
        (hb, G*bl, E + 1) with a last column (minus what :meth:`scores` subtracts from each row) of 0."""
        E = self.q.shape[-1]
        rows = out.view(h1 - h0, self.G, r1 - r0, out.shape[-1])  # (hb, G*bl, E') as (hb, G, bl, E')
        torch.mul(self.q[h0:h1, :, r0:r1], self.scale2, out=rows[..., :E])
        if out.shape[-1] > E:
            rows[..., E:].zero_()
        return out

    def scores(self, q_tile, k_t, h0: int, h1: int, r0: int, r1: int, s0: int, s1: int, out) -> torch.Tensor:
        """Masked scores of one tile in the tiles' units (q_tile carries ``scale2``), written into ``out``; ``k_t`` is
        the tile's keys, transposed, (hb, E, bs), or from :meth:`with_ones`, (hb, E + 1, bs): then each row's
        score is minus the value in q_tile's last column (a reference max, the log-sum-exp)."""
        s = torch.bmm(q_tile, k_t, out=out)  # (hb, n, E [+ 1]) @ (hb, E [+ 1], bs) -> (hb, n, bs)
        diagonal = self.is_causal and s1 - 1 > r0  # the tile crosses the diagonal
        if self.mask is None and not diagonal:
            return s
        s4 = s.view(h1 - h0, self.G, r1 - r0, s1 - s0)  # (hb, G*bl, bs) -> (hb, G, bl, bs)
        if self.mask is not None:
            m = self.mask_tile(h0, h1, r0, r1, s0, s1)  # broadcastable to (hb, G, bl, bs)
            if m.dtype == torch.bool:
                s4.masked_fill_(m, _NEG_INF)  # m is True where a key is hidden
            else:
                s4.add_(m)  # an additive mask: the scores are in natural units here (see ``natural``)
        if diagonal:  # hide keys j > i
            c0 = s0 - r0 + self.keys  # (self.keys is the band's bk)
            s4.masked_fill_(self.band[: r1 - r0, c0 : c0 + s1 - s0], _NEG_INF)  # (bl, bs), broadcast
        return s

    def mask_tile(self, h0: int, h1: int, r0: int, r1: int, s0: int, s1: int) -> torch.Tensor:
        """The mask's part for heads [h0, h1), rows [r0, r1), keys [s0, s1): (hb or 1, Gm, bl or 1, bs or 1)."""
        m = self.mask  # (Bm, Hm, Gm, Lm, Sm), broadcastable to (B, H, G, L, S)
        m = m[..., r0:r1, :] if m.shape[-2] > 1 else m
        m = m[..., s0:s1] if m.shape[-1] > 1 else m
        if m.shape[0] == 1 and m.shape[1] == 1:
            return m[0]  # (1, Gm, bl?, bs?): the same for every head
        m = m.expand(self.B, self.H, *m.shape[2:])  # (B, H, Gm, bl?, bs?), a view
        if h1 - h0 == 1:
            return m[h0 // self.H, h0 % self.H][None]  # (1, Gm, bl?, bs?), a view
        pairs = torch.arange(h0, h1, device=m.device)
        return m[pairs // self.H, pairs % self.H]  # (hb, Gm, bl?, bs?): several short heads in one step


def _mask_5d(mask: torch.Tensor, H: int, G: int) -> torch.Tensor:
    """A 4-D mask broadcastable to (B, Hq, L, S) -> 5-D, broadcastable to (B, H, G, L, S)."""
    Bm, Hm, Lm, Sm = mask.shape
    if Hm == 1:
        return mask.reshape(Bm, 1, 1, Lm, Sm)  # (Bm, 1, Lm, Sm) -> (Bm, 1, 1, Lm, Sm)
    return mask.reshape(Bm, H, G, Lm, Sm)  # (Bm, Hq, Lm, Sm) -> (Bm, H, G, Lm, Sm)


class _TileViews:
    """Key tile [s0, s1) of a step's tensors, each sliced once per step: ``views(s0, s1)`` -> one view per tensor.

    Keyword arguments name the tensors and where their keys are: ``k_t`` (hb, D, S) on the last dim, the others
    (hb, S, D) on dim 1. The query tiles of a step visit the same key tiles; their views are made once.
    """

    def __init__(self, **tensors: torch.Tensor):
        self.tensors = tensors
        self.cache: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def __call__(self, s0: int, s1: int) -> tuple[torch.Tensor, ...]:
        views = self.cache.get((s0, s1))
        if views is None:
            views = self.cache[s0, s1] = tuple(x[:, :, s0:s1] if name.endswith("_t") else x[:, s0:s1]
                                                for name, x in self.tensors.items())
        return views


def _forward_tiles(t: _Tiles, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fill ``out`` (B*H, G, L, Ev) and ``lse`` (B*H, G, L, 1), one step of heads and one query tile at a time."""
    E, Ev = t.q.shape[-1], t.v.shape[-1]
    n_max = t.heads * t.rows  # rows of the largest tile
    buf = _Scratch(t.q, k=t.heads * t.S * (E + 1), q=n_max * (E + 1), s=n_max * t.keys, acc=n_max * Ev, m=n_max,
                   m_new=n_max, alpha=n_max, l=n_max, rowsum=n_max)
    # The fixed max (see _forward_query_tile) reads one number back per query tile (did a sum overflow?). On a
    # CPU that costs nothing; an accelerator would make the host wait, and a fake tensor (shapes only, as
    # torch.compile traces with) has no number to read: there the max is tracked tile by tile.
    fix_max = t.q.device.type == "cpu" and type(t.q) is torch.Tensor
    for h0, h1 in t.head_steps():
        k_t = t.with_ones(t.k, h0, h1, buf.take("k", h1 - h0, t.S, E + 1))  # (hb, E + 1, S)
        views = _TileViews(k_t=k_t, v=t.v[h0:h1])  # the step's key tiles, sliced once for all its query tiles
        for r0 in range(0, t.L, t.block_q):
            r1 = min(r0 + t.block_q, t.L)
            if not _forward_query_tile(t, buf, views, h0, h1, r0, r1, out, lse, fix_max):
                _forward_query_tile(t, buf, views, h0, h1, r0, r1, out, lse, fix_max=False)  # it overflowed: redo


def _forward_query_tile(t: _Tiles, buf: _Scratch, views: _TileViews, h0: int, h1: int, r0: int, r1: int,
                        out: torch.Tensor, lse: torch.Tensor, fix_max: bool) -> bool:
    """Rows [r0, r1) of heads [h0, h1) of ``out`` and ``lse``, over all their key tiles.

    The running max only has to keep ``exp2(s - m)`` from overflowing; it need not be the exact max. With
    ``fix_max``, once every row has seen a key, its max so far is kept as the reference for the remaining key
    tiles: they skip the max, the rescale and, the reference being subtracted inside the score product, the
    subtraction. A later score more than about 127 above the reference would overflow a sum; then nothing is
    written and False is returned, and the caller redoes the tile with the max tracked tile by tile.
    """
    E, Ev = t.q.shape[-1], t.v.shape[-1]
    hb, n = h1 - h0, t.G * (r1 - r0)  # query rows of this tile: the G heads that share a kv-head, stacked
    q_tile = t.query_tile(h0, h1, r0, r1, buf.take("q", hb, n, E + 1))  # (hb, n, E + 1), times scale2, then 0
    # The running max starts at the lowest finite number, not at -inf: for a row whose keys are all hidden so
    # far, s - m is then -inf - lowest = -inf and exp2 gives 0, where -inf - (-inf) would give NaN.
    lowest = torch.finfo(t.dtype).min
    m, m_new = buf.take("m", hb, n, 1).fill_(lowest), buf.take("m_new", hb, n, 1)  # running max
    denom = buf.take("l", hb, n, 1).zero_()  # running denominator, "l" in the papers
    acc = buf.take("acc", hb, n, Ev).zero_()  # running numerator
    alpha, rowsum = buf.take("alpha", hb, n, 1), buf.take("rowsum", hb, n, 1)
    fixed = False  # True once the max is fixed: q_tile's last column then holds -m
    for s0, s1 in t.key_tiles(r0, r1):
        k_t, v = views(s0, s1)  # (hb, E + 1, bs), (hb, bs, Ev)
        s = t.scores(q_tile, k_t, h0, h1, r0, r1, s0, s1, out=buf.take("s", hb, n, s1 - s0))  # (hb, n, bs)
        if fixed:  # s is already s - m
            p = t.exp_(s)  # (hb, n, bs), exp2 in place
            denom.add_(torch.sum(p, dim=-1, keepdim=True, out=rowsum))  # l + rowsum(p)
            acc.baddbmm_(p, v)  # acc + (hb, n, bs) @ (hb, bs, Ev)
            continue
        torch.amax(s, dim=-1, keepdim=True, out=m_new)  # the tile's row max...
        m_new = torch.maximum(m, m_new, out=m_new)  # ...and the running one, (hb, n, 1)
        p = t.exp_(s.sub_(m_new))  # (hb, n, bs), exp2 in place: the scores are not needed again
        alpha = t.exp_(torch.sub(m, m_new, out=alpha))  # rescales what was summed under the old max
        denom = torch.addcmul(p.sum(dim=-1, keepdim=True), denom, alpha, out=denom)  # l * alpha + rowsum(p)
        acc.mul_(alpha).baddbmm_(p, t.v[h0:h1, s0:s1])  # acc * alpha + (hb, n, bs) @ (hb, bs, Ev)
        m, m_new = m_new, m  # the new max becomes the running one; the old one's buffer is reused
        if fix_max and (t.mask is None or bool((m > lowest).all())):  # no mask: every row has seen key 0
            fixed = True
            torch.neg(m, out=q_tile[..., E:])  # from now on, scores() gives s - m
    if fixed and not math.isfinite(acc.sum() + denom.sum()):  # an overflow (or a NaN or inf in the inputs)
        return False
    dead = denom == 0  # fully masked rows: output 0; lse = +inf makes the backward's exp(s - lse) = 0
    denom.masked_fill_(dead, 1.0)
    shape = (hb, t.G, r1 - r0)
    torch.div(acc.view(*shape, Ev), denom.view(*shape, 1), out=out[h0:h1, :, r0:r1])  # (hb, G, bl, Ev)
    lse_tile = (m + denom.log()) if t.natural else (m + denom.log2()) * _LN2  # (hb, n, 1), natural units
    lse_tile.masked_fill_(dead, float("inf"))
    lse[h0:h1, :, r0:r1] = lse_tile.view(*shape, 1)  # (hb, n, 1) -> (hb, G, bl, 1)
    return True


def _backward_tiles(
    t: _Tiles, grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (B*H, G, L, E), (B*H, S, E), (B*H, S, Ev) from grad_out, out (B*H, G, L, Ev), lse."""
    E, Ev = t.q.shape[-1], t.v.shape[-1]
    dq = torch.empty_like(t.q)  # (BH, G, L, E), every row written once by its query tile
    dk = torch.zeros_like(t.k)  # (BH, S, E), summed over query tiles
    dv = torch.zeros_like(t.v)  # (BH, S, Ev)
    delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (BH, G, L, 1): rowsum(dO * O) = rowsum(P * dP)
    lse2 = lse * t.unit  # (BH, G, L, 1), in the scores' units (base 2 unless a float mask is given)
    n_max = t.heads * t.rows
    buf = _Scratch(t.q, q=n_max * E, do=n_max * Ev, lse=n_max, delta=n_max, dq=n_max * E,
                   s=n_max * t.keys, dp=n_max * t.keys)
    for h0, h1 in t.head_steps():
        hb = h1 - h0
        k, dk_h, dv_h = t.k[h0:h1], dk[h0:h1], dv[h0:h1]  # (hb, S, E), (hb, S, E), (hb, S, Ev)
        views = _TileViews(k_t=k.transpose(1, 2), v_t=t.v[h0:h1].transpose(1, 2), k=k, dk=dk_h, dv=dv_h)
        for r0 in range(0, t.L, t.block_q):
            r1 = min(r0 + t.block_q, t.L)
            n = t.G * (r1 - r0)
            q_tile = t.query_tile(h0, h1, r0, r1, buf.take("q", hb, n, E))  # (hb, n, E), times scale2
            do_tile = t.stack_rows(grad_out, h0, h1, r0, r1, buf.take("do", hb, n, Ev))  # (hb, n, Ev)
            lse_tile = t.stack_rows(lse2, h0, h1, r0, r1, buf.take("lse", hb, n, 1))  # (hb, n, 1)
            delta_tile = t.stack_rows(delta, h0, h1, r0, r1, buf.take("delta", hb, n, 1))  # (hb, n, 1)
            dq_tile = buf.take("dq", hb, n, E).zero_()  # (hb, n, E)
            for s0, s1 in t.key_tiles(r0, r1):
                k_t, v_t, k_s, dk_s, dv_s = views(s0, s1)  # (hb, E, bs), (hb, Ev, bs), (hb, bs, E), .., (hb, bs, Ev)
                s = t.scores(q_tile, k_t, h0, h1, r0, r1, s0, s1, out=buf.take("s", hb, n, s1 - s0))
                p = t.exp_(s.sub_(lse_tile))  # (hb, n, bs), recomputed from the saved log-sum-exp
                dv_s.baddbmm_(p.transpose(1, 2), do_tile)  # += (hb, bs, n) @ (hb, n, Ev)
                dp = torch.bmm(do_tile, v_t, out=buf.take("dp", hb, n, s1 - s0))  # (hb, n, bs)
                ds = dp.sub_(delta_tile).mul_(p)  # (hb, n, bs): dS = P * (dP - delta)
                dq_tile.baddbmm_(ds, k_s)  # += (hb, n, bs) @ (hb, bs, E)
                dk_s.baddbmm_(ds.transpose(1, 2), q_tile)  # += (hb, bs, n) @ (hb, n, E), q * scale2
            shape = (hb, t.G, r1 - r0, E)
            torch.mul(dq_tile.view(shape), t.scale, out=dq[h0:h1, :, r0:r1])  # (hb, n, E) -> (hb, G, bl, E)
    if not t.natural:
        dk.mul_(_LN2)  # q_tile carried scale * log2(e); dK wants q * scale
    return dq, dk, dv


# -------------------------------------------------------------------------------------------- launcher


def _launch_forward(query, key, value, attn_mask, is_causal, scale, block_q, block_k):
    """Allocate out (B, Hq, L, Ev) and lse (B, Hq, L, 1), run the tiles."""
    t = _Tiles(query, key, value, attn_mask, is_causal, scale, block_q, block_k)
    BH, L, Ev = t.q.shape[0], t.L, value.shape[-1]
    out = t.q.new_empty((BH, t.G, L, Ev))  # (B*H, G, L, Ev), compute dtype
    lse = t.q.new_empty((BH, t.G, L, 1))  # (B*H, G, L, 1)
    _forward_tiles(t, out, lse)
    return t, out, lse


class _ChunkedAttention(torch.autograd.Function):
    """Forward by online softmax over tiles; backward recomputes each tile from the saved log-sum-exp. The eager
    path: every tile's operations run (and show) one by one; under ``torch.compile`` or ``torch.func`` the same
    loops run inside the custom operator below."""

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


# A custom operator (as flash-attn registers its kernels): torch.compile sees one opaque call with a fake
# implementation that gives the output shapes, instead of tracing the tile loops; autograd and vmap rules are
# registered beside it. The forward returns the output in the compute dtype (the backward reads it) and lse.


@torch.library.custom_op("attention_core::chunked_forward", mutates_args=())
def _forward_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Optional[torch.Tensor],
                is_causal: bool, scale: float, block_q: int, block_k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(B, Hq, L, Ev) in the compute dtype, and lse (B*H, G, L, 1)."""
    _, out, lse = _launch_forward(query, key, value, attn_mask, is_causal, scale, block_q, block_k)
    B, Hq, L, Ev = query.shape[0], query.shape[1], query.shape[2], value.shape[-1]
    return out.view(B, Hq, L, Ev), lse  # (B*H, G, L, Ev) -> (B, Hq, L, Ev)


@_forward_op.register_fake
def _(query, key, value, attn_mask, is_causal, scale, block_q, block_k):
    B, Hq, L, _ = query.shape
    H, dt = key.shape[1], compute_dtype(query.dtype)
    return (query.new_empty((B, Hq, L, value.shape[-1]), dtype=dt),
            query.new_empty((B * H, Hq // max(H, 1), L, 1), dtype=dt))


@torch.library.custom_op("attention_core::chunked_backward", mutates_args=())
def _backward_op(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                 scale: float, block_q: int, block_k: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients for query, key, value, in their dtypes."""
    t = _Tiles(query, key, value, attn_mask, is_causal, scale, block_q, block_k)
    out = out.reshape(lse.shape[:3] + out.shape[-1:])  # (B, Hq, L, Ev) -> (B*H, G, L, Ev)
    grad_out = grad_out.to(t.dtype).reshape(out.shape)  # (B, Hq, L, Ev) -> (B*H, G, L, Ev)
    dq, dk, dv = _backward_tiles(t, grad_out, out, lse)
    return (dq.to(query.dtype).reshape(query.shape),  # (B*H, G, L, E) -> (B, Hq, L, E)
            dk.to(key.dtype).reshape(key.shape),  # (B*H, S, E) -> (B, H, S, E)
            dv.to(value.dtype).reshape(value.shape))  # (B*H, S, Ev) -> (B, H, S, Ev)


@_backward_op.register_fake
def _(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, block_q, block_k):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, attn_mask, is_causal, scale, block_q, block_k = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, attn_mask, out, lse)
    ctx.config = (is_causal, scale, block_q, block_k)


def _backward(ctx, grad_out, grad_lse):
    query, key, value, attn_mask, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, query, key, value, attn_mask, out, lse, *ctx.config)
    return dq, dk, dv, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _fold(x: Optional[torch.Tensor], dim: Optional[int], n: int, lead: int) -> Optional[torch.Tensor]:
    """vmap's dim of ``x`` (or a new one of size ``n``) folded into its first dim, grown to ``lead`` first."""
    if x is None:
        return None
    x = x.unsqueeze(0).expand(n, *x.shape) if dim is None else x.movedim(dim, 0)  # (n, d0, ...)
    x = x.expand(n, lead, *x.shape[2:]) if x.shape[1] != lead else x  # a broadcast dim 0 of a mask
    return x.reshape(n * lead, *x.shape[2:])  # (n, d0, ...) -> (n * d0, ...)


def _forward_vmap(info, in_dims, query, key, value, attn_mask, is_causal, scale, block_q, block_k):
    """vmap: the mapped dim joins the batch, (n, B, ...) -> (n * B, ...), one call, then split again."""
    n, dq, dk, dv, dm = info.batch_size, *in_dims[:4]
    B = (query.shape[1:] if dq is not None else query.shape)[0]
    q, k, v = (_fold(t, d, n, B) for t, d in ((query, dq), (key, dk), (value, dv)))
    out, lse = _forward_op(q, k, v, _fold(attn_mask, dm, n, B), is_causal, scale, block_q, block_k)
    return (out.unflatten(0, (n, B)), lse.unflatten(0, (n, -1))), (0, 0)


torch.library.register_vmap("attention_core::chunked_forward", _forward_vmap)


# ------------------------------------------------------------------------------- partial results, merged
# The same tile loops, called on one block of keys at a time by a caller that merges the blocks itself (ring
# attention passes key/value blocks between processes: attention_core.distributed).


def forward_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool, scale: float,
                     block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's partial result: ``out`` (B*H, G, L, Ev) and ``lse`` (B*H, G, L, 1), compute dtype, natural
    units, in the kernel's layout (the G query heads that share a key/value head beside each other); a row that
    sees no key of this block has ``out`` 0 and ``lse`` = -inf (it adds nothing when merged). The input is
    checked as :func:`attention_core.backends.chunked.chunked_attention` checks it (4-D tensors, ``scale`` a
    finite float or ``None``)."""
    _check_blocks_and_rank(query, key, value, block_q, block_k, "forward_with_lse")
    scale = _check_canonical(query, key, value, None, is_causal, scale)
    _, out, lse = _launch_forward(query, key, value, None, is_causal, scale, block_q, block_k)
    return out, lse.masked_fill_(lse == float("inf"), _NEG_INF)


def backward_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, grad_out: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, is_causal: bool, scale: float,
                      block_q: int = BLOCK_Q, block_k: int = BLOCK_K
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the gradients, from the *whole* row's ``out`` and ``lse`` (kernel layout, as
    :func:`forward_with_lse` gives them, after merging): dq (B*H, G, L, E), dk (B*H, S, E), dv (B*H, S, Ev), in
    the compute dtype. Summed over the blocks of keys, they are the gradients of attention over all keys."""
    t = _Tiles(query, key, value, None, is_causal, scale, block_q, block_k)
    lse = lse.masked_fill(lse == _NEG_INF, float("inf"))  # a row with no key at all: exp(s - lse) = 0
    return _backward_tiles(t, grad_out.to(t.dtype), out, lse)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the keys of two blocks from each block's normalised output and log-sum-exp (any layout
    whose last dim is the value's, ``lse`` with a 1 there): the online softmax's rescaling, done once::

        lse = log(exp(lse_a) + exp(lse_b))      out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

    computed from the larger of the two, so nothing overflows; a row with ``lse = -inf`` in both stays 0.
    ``out_a`` and ``out_b`` are floating tensors of one shape, ``lse_a`` and ``lse_b`` that shape with a 1 in
    the last dim (``TypeError``/``ValueError`` naming the argument otherwise)."""
    named = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
    for name, t in named.items():
        check_tensor(t, name)
        check_floating(t, name)
    check_same_device(**named)
    if out_a.dim() == 0 or out_b.shape != out_a.shape:
        raise ValueError(f"out_a and out_b must have one shape with at least 1 dim, got {fmt_shape(out_a.shape)} "
                         f"and {fmt_shape(out_b.shape)}")
    want = (*out_a.shape[:-1], 1)
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have out_a's shape with a 1 in the last dim, {want}, got "
                             f"{fmt_shape(t.shape)}")
    m = torch.maximum(lse_a, lse_b)
    m = m.masked_fill(m == _NEG_INF, 0.0)  # both empty: weights exp(-inf) = 0 below, no -inf - -inf
    w_a, w_b = (lse_a - m).exp(), (lse_b - m).exp()
    total = w_a + w_b
    lse = m + total.log()
    total = total.masked_fill(total == 0, 1.0)
    return (w_a * out_a + w_b * out_b) / total, lse


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
            (added), float32 or the query's dtype; no gradient flows to it.
        is_causal: upper-left aligned causal mask; tiles above the diagonal are skipped.
        scale: score scale, default ``1/sqrt(E)``.
        enable_gqa: accepted for signature parity: GQA follows from ``Hq != H``.
        block_q: query rows per tile.
        block_k: keys per tile.

    Returns:
        (B, Hq, L, Ev) in the query's dtype; fully masked rows are zeros.
    """
    check_bool_flag(enable_gqa, "enable_gqa")
    _check_blocks_and_rank(query, key, value, block_q, block_k, "chunked_attention")
    scale = _check_canonical(query, key, value, attn_mask, is_causal, scale)
    return _attend(query, key, value, attn_mask, is_causal, scale, block_q, block_k)


def _check_blocks_and_rank(query: object, key: object, value: object, block_q: object, block_k: object,
                           who: str) -> None:
    """Tile sizes ints >= 1; query, key, value tensors in the canonical 4-D layout."""
    check_int(block_q, "block_q", low=1)
    check_int(block_k, "block_k", low=1)
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(t, name)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"{who} takes canonical 4-D inputs (B, Hq, L, E), (B, H, S, E), (B, H, S, Ev); got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)} "
            "(scaled_dot_product_attention takes any layout)"
        )


def _check_canonical(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: Optional[torch.Tensor], is_causal: object, scale: object) -> float:
    """The refusals of ``scaled_dot_product_attention`` for canonical 4-D inputs, by name; returns the scale."""
    check_floating(query, "query")
    check_same_dtype(query=query, key=key, value=value)
    check_same_device(query=query, key=key, value=value)
    check_bool_flag(is_causal, "is_causal")
    (B, Hq, L, E), (Bk, H, S, Ek), (Bv, Hv, Sv, _) = query.shape, key.shape, value.shape
    shapes = f"query {fmt_shape(query.shape)}, key {fmt_shape(key.shape)}, value {fmt_shape(value.shape)}"
    if E == 0 or Ek != E:
        raise ValueError(f"query and key must have the same feature size E >= 1 (dim -1): got {shapes}")
    if (Bk, H, S) != (Bv, Hv, Sv) or Bk != B:
        raise ValueError(f"key and value must agree in (B, H, S), and B with query's: got {shapes}")
    if (H == 0 and Hq != 0) or (H != 0 and Hq % H != 0):
        raise ValueError(f"query heads (Hq={Hq}) must be a multiple of the key/value heads (H={H}): got {shapes}")
    if attn_mask is not None:
        check_tensor(attn_mask, "attn_mask")
        if is_causal:
            raise ValueError("attn_mask and is_causal=True were both given; pass one (combine them into attn_mask)")
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in (torch.float32, query.dtype):
            raise TypeError(f"attn_mask must be bool, float32 or the query's dtype ({query.dtype}), got "
                            f"{attn_mask.dtype}")
        check_same_device(query=query, attn_mask=attn_mask)
        check_rank(attn_mask, "attn_mask", (4,), "4-D, broadcastable to (B, Hq, L, S)")
        check_mask_broadcasts(attn_mask, "attn_mask", (B, Hq, L, S), "(B, Hq, L, S)")
    value_ = check_scale(scale, positive=False)
    return 1.0 / math.sqrt(E) if value_ is None else value_


def _attend(query, key, value, attn_mask, is_causal, scale, block_q, block_k) -> torch.Tensor:  # noqa: ANN001
    """Checked inputs -> (B, Hq, L, Ev): the autograd Function eagerly, the registered op when traced."""
    if _traced(query, key, value, attn_mask):  # compile or a torch.func transform: one opaque, registered call
        out, _ = _forward_op(query, key, value, attn_mask, is_causal, float(scale), block_q, block_k)
        return out.to(query.dtype)
    return _ChunkedAttention.apply(query, key, value, attn_mask, is_causal, scale, block_q, block_k)


def _traced(*tensors: Optional[torch.Tensor]) -> bool:
    """Under ``torch.compile`` or a ``torch.func`` transform (vmap, grad, ...)?"""
    return torch.compiler.is_compiling() or any(
        t is not None and torch._C._functorch.is_functorch_wrapped_tensor(t) for t in tensors)


def supports(inputs: AttentionInputs) -> Optional[str]:
    """No dropout, no gradient for a float mask, no weights."""
    if inputs.dropout_p > 0:
        return f"it has no dropout (dropout_p={inputs.dropout_p})"
    mask = inputs.attn_mask
    if mask is not None and mask.requires_grad and torch.is_grad_enabled():
        return "its backward does not compute a gradient for a float attn_mask (attn_mask.requires_grad)"
    return no_weights(inputs)


def run(inputs: AttentionInputs) -> BackendResult:
    """Registry entry point: ``(out, None)``, tiles of :data:`BLOCK_Q` x :data:`BLOCK_K` (read per call)."""
    q, k, v, mask, _, is_causal, scale, _ = inputs.args()
    return _attend(q, k, v, mask, is_causal, scale, BLOCK_Q, BLOCK_K), None
