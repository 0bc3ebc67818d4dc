"""FlexAttention's tiles on a CPU (or any device) in plain torch: empty tiles skipped, full tiles unmasked.

The loops are :mod:`attention_core.backends.chunked`'s online softmax (running max ``m``, denominator ``l``,
output ``acc``; the backward recomputes each tile from the saved log-sum-exp), driven by a
:class:`~attention_core.flex_attention.BlockMask` instead of ``is_causal``:

- a query tile visits only the key tiles the block mask lists for it, full ones and partial ones, in key
  order; an **empty** tile is never read, so a window of 256 keys costs the same at L = 8,192 as at 512;
- the keys of consecutive tiles are read as one slice (a causal row is one run of tiles; a window's sinks are
  a second run, and the chunk is gathered with ``index_select``), up to ``chunk_keys`` keys per product, so each
  step of the Python loop moves a large matrix product rather than one small tile;
- a **full** tile takes no mask; the predicate runs once, when the block mask is first used at a shape, on the
  **partial** tiles' pairs only, and its verdicts are kept (as float16 biases of 0 and -inf, equal ones shared)
  for the next calls and the backward. Columns no query of the tile keeps are dropped (a window's sinks tile
  costs its 4 sinks, not 128 keys), columns every query keeps join the full ones, and the rest take the bias
  inside the score product (``baddbmm``), which costs nothing over the product itself;
- neighbouring query tiles that read nearly the same key tiles (causal) are merged into blocks of 256 rows,
  the chunked backend's query tile: fewer, larger products;
- a ``score_mod`` edits each chunk's scores (natural units: the mod sees ``scale * q.k``, as in PyTorch); its
  derivative, and the gradients of tensors it captured (a bias table, ALiBi slopes), come from autograd on
  that one chunk in the backward, so memory stays O(chunk).

Exponentials are base 2 when there is no ``score_mod`` (``log2(e)`` folded into the query scale, as in the
chunked backend); with one, the scores stay in natural units for the mod. Layout: plan (which keys each query
tile reads) -> tile loops -> ``torch.autograd.Function`` -> public function.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from attention_core.block_mask import BLOCK_SIZE
from attention_core.mask_mods import call_mask_mod, call_score_mod

__all__ = ["CHUNK_KEYS", "captured_tensors", "chunked_flex_attention"]

#: Most keys one product reads: a (256, 512) float32 score chunk of one head is 512 KiB, half of a 1 MiB L2
#: cache, the chunked backend's tile (measured at L = 4,096-16,384, causal: 1,024 keys were 5-15% slower
#: forward + backward once query tiles are merged into 256 rows).
CHUNK_KEYS = 512
#: Most bytes of predicate verdicts the plan keeps for one call (float16, partial columns only), so the forward
#: and the backward reuse them: a window of 256 at L = 16,384 needs 8 MiB. Past it, the loops evaluate the
#: predicate again on the partial columns of each chunk.
PLAN_MASK_BYTES = 16 << 20
#: Merge consecutive query tiles into one block when the block's products cost at most this many times the
#: pairs of their non-empty tiles (causal neighbours r, r + 1: (2r + 4) / (2r + 3) tiles, merged; a window's
#: neighbours: 1.25, not merged, which measured 15-20% faster for a window of 256 at L = 8,192).
MERGE_WASTE = 1.2
#: Most query rows of a merged block (two 128-row tiles: the chunked backend's 256-row query tile).
MAX_ROWS = 256
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_NEG_INF = float("-inf")


# ------------------------------------------------------------------------------------------------- plan


@dataclass
class _Chunk:
    """Keys one product reads, a slice [k0, k1) or gathered ``cols``, and where the mask still applies.

    Columns that no query of the chunk keeps are dropped, columns that every query keeps join the full ones (a
    sink column of a window mask, for one), and in a gathered chunk the still-masked columns come last, so the
    mask touches one slice of the scores.
    """

    k0: int
    k1: int
    cols: torch.Tensor | None  # (nc,) int64 when the keys are not one run; else None
    width: int  # nc
    device: torch.device
    part_pos: slice | torch.Tensor | None = None  # positions of the masked columns within the chunk
    bias: torch.Tensor | None = None  # (g, bl, np) float16, 0 kept / -inf hidden, when the plan kept it
    verdicts: object = None  # else: a function that evaluates the predicate again -> (g, bl, np) bool
    _kv: torch.Tensor | None = None

    @property
    def kv_idx(self) -> torch.Tensor:
        """(1, 1, nc) the keys' positions, for the score_mod (made when first asked for)."""
        if self._kv is None:
            kv = torch.arange(self.k0, self.k1, device=self.device) if self.cols is None else self.cols
            self._kv = kv.view(1, 1, -1)
        return self._kv

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of ``x`` (G, S, D) that the chunk reads: (G, nc, D), a view for a slice."""
        return x[:, self.k0:self.k1] if self.cols is None else x.index_select(1, self.cols)

    def add_into(self, acc: torch.Tensor, x: torch.Tensor) -> None:
        """``acc[:, keys] += x`` for acc (G, S, D), x (G, nc, D)."""
        if self.cols is None:
            acc[:, self.k0:self.k1].add_(x)
        else:
            acc.index_add_(1, self.cols, x)


def _tile_range(t: int, Bk: int, S: int) -> tuple[int, int]:
    return t * Bk, min(S, (t + 1) * Bk)


def _ranges(tiles: list[int], Bk: int, S: int, device) -> torch.Tensor:
    """Key positions of the given tiles, in order: (n,) int64."""
    if not tiles:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(*_tile_range(t, Bk, S), device=device) for t in tiles])


def _verdicts(sub, mixed: list[int], Bk: int, S: int, evaluate, device) -> torch.Tensor:
    """(g, rows, n) bool: which pairs of the merged query tiles ``sub`` and the key tiles ``mixed`` take part.

    Per query tile, a key tile it holds full is all True, one it does not hold all False, and the predicate runs
    once, on that query tile's partial tiles among ``mixed`` only.
    """
    widths = [_tile_range(t, Bk, S)[1] - _tile_range(t, Bk, S)[0] for t in mixed]
    offsets = [sum(widths[:j]) for j in range(len(mixed))]
    said = []
    for r, bl, partial, _ in sub:
        mine = [t for t in mixed if t in partial]
        if mine:
            kv = _ranges(mine, Bk, S, device)
            res = evaluate(r, kv)  # (G or 1, bl or 1, n_r)
            said.append(res.expand(torch.broadcast_shapes(res.shape, (1, bl, kv.numel()))))
        else:
            said.append(None)
    g = max((x.shape[0] for x in said if x is not None), default=1)
    rows = sum(bl for _, bl, _, _ in sub)
    keep = torch.zeros(g, rows, sum(widths), dtype=torch.bool, device=device)
    row0 = 0
    for (_, bl, partial, full), res in zip(sub, said):
        pos = 0
        for t, w, off in zip(mixed, widths, offsets):
            if t in full:
                keep[:, row0:row0 + bl, off:off + w] = True
            elif t in partial:
                keep[:, row0:row0 + bl, off:off + w] = res[..., pos:pos + w]
                pos += w
        row0 += bl
    return keep


def _as_slice(pos: torch.Tensor):
    """``slice(a, b)`` when the sorted positions are one run a, a+1, ..., b-1; else None."""
    n = pos.numel()
    if n and int(pos[-1]) - int(pos[0]) == n - 1:
        return slice(int(pos[0]), int(pos[-1]) + 1)
    return None


def _super_row_plan(sub, Bk: int, S: int, chunk_tiles: int, device, evaluate, keep_bias) -> list[_Chunk]:
    """Chunks of one block of query tiles ``sub`` [(r, rows, partial set, full set)]: the union of their key
    tiles in order, ``chunk_tiles`` at most per chunk. A key tile full for every query tile of the block takes
    no mask; the others (partial for some, or full for one and empty for another) take a bias.

    ``evaluate(r, kv)`` runs the predicate for query tile ``r`` on key positions ``kv``; ``keep_bias(bias)``
    returns the tensor to keep (an equal one kept before, if any), or None past the budget.
    """
    union = sorted(set().union(*(p | f for _, _, p, f in sub)))
    everywhere = set.intersection(*(f for _, _, _, f in sub))
    chunks = []
    for c in range(0, len(union), chunk_tiles):
        part = union[c:c + chunk_tiles]
        full = [t for t in part if t in everywhere]
        mixed = [t for t in part if t not in everywhere]
        runs: list[list[int]] = []  # [start, stop) key ranges of the full tiles, consecutive ones merged
        for t in full:
            a, z = _tile_range(t, Bk, S)
            if runs and runs[-1][1] == a:
                runs[-1][1] = z
            else:
                runs.append([a, z])
        n_full = sum(z - a for a, z in runs)
        still = keep = None
        promoted = part_kv = torch.empty(0, dtype=torch.long, device=device)
        if mixed:
            mixed_kv = _ranges(mixed, Bk, S, device)
            keep = _verdicts(sub, mixed, Bk, S, evaluate, device)  # (g, rows, n_mixed)
            flat = keep.reshape(-1, keep.shape[-1])
            some, every = flat.any(0), flat.all(0)  # (n_mixed,): kept by some query / by every query
            still = some & ~every
            promoted, part_kv = mixed_kv[every], mixed_kv[still]
        n = n_full + promoted.numel() + part_kv.numel()
        if n == 0:
            continue  # every pair of the chunk is masked
        lo = min([a for a, _ in runs] + [int(x[0]) for x in (promoted, part_kv) if x.numel()])
        hi = max([z for _, z in runs] + [int(x[-1]) + 1 for x in (promoted, part_kv) if x.numel()])
        if hi - lo == n:  # one run of keys: a view, the masked columns where they fall
            chunk = _Chunk(lo, hi, None, n, device)
            pos = part_kv - lo
        else:  # gathered: the full columns first, then the masked ones as one slice
            cols = torch.cat([torch.arange(a, z, device=device) for a, z in runs] + [promoted, part_kv])
            chunk = _Chunk(int(cols.min()), int(cols.max()) + 1, cols, n, device)
            pos = torch.arange(n - part_kv.numel(), n, device=device)
        if part_kv.numel():
            chunk.part_pos = _as_slice(pos) or pos
            bias = torch.zeros(keep.shape[0], keep.shape[1], part_kv.numel(), dtype=torch.float16, device=device)
            chunk.bias = keep_bias(bias.masked_fill_(~keep[..., still], _NEG_INF))
            if chunk.bias is None:
                chunk.verdicts = functools.partial(_still_verdicts, sub, mixed, Bk, S, evaluate, device, still)
        chunks.append(chunk)
    return chunks


def _still_verdicts(sub, mixed, Bk, S, evaluate, device, still) -> torch.Tensor:
    return _verdicts(sub, mixed, Bk, S, evaluate, device)[..., still]


class _Plan:
    """For each group of (batch, head) pairs sharing one mask entry: index grids, and for each block of query
    tiles its rows and chunks.

    The predicate runs here, once per call and only on partial tiles; the loops reuse its verdicts, kept as
    float16 biases (consecutive blocks with the same pattern share one tensor, so a window or a causal mask
    keeps a handful), up to :data:`PLAN_MASK_BYTES`.

    Consecutive query tiles are merged into one block of up to ``max_rows`` rows when their key tiles mostly
    coincide (at most :data:`MERGE_WASTE` times the pairs of their non-empty tiles): the products are then
    larger, and there are fewer of them. A merged block masks what one of its tiles does not read.
    """

    def __init__(self, block_mask, B: int, H: int, L: int, S: int, chunk_keys: int, device, max_rows: int):
        if block_mask is None:  # every tile full, no predicate
            Bq = Bk = BLOCK_SIZE
            nQ, nK = -(-L // Bq), -(-S // Bk)
            Bm = Hm = 1
            rows = {(0, 0): [([], list(range(nK))) for _ in range(nQ)]}
            self.mask_mod = None
        else:
            Bq, Bk = block_mask.BLOCK_SIZE
            Bm, Hm = block_mask.shape[:2]
            num, idx = block_mask.kv_num_blocks.tolist(), block_mask.kv_indices.tolist()
            fnum, fidx = block_mask.full_kv_num_blocks.tolist(), block_mask.full_kv_indices.tolist()
            rows = {(b, h): [(idx[b][h][r][:num[b][h][r]], fidx[b][h][r][:fnum[b][h][r]])
                             for r in range(len(num[b][h]))] for b in range(Bm) for h in range(Hm)}
            self.mask_mod = block_mask.mask_mod
        chunk_tiles = max(1, chunk_keys // Bk)
        budget = [PLAN_MASK_BYTES]
        self.groups = []
        for (bm, hm), tiles in rows.items():
            bs = slice(None) if Bm == 1 else slice(bm, bm + 1)
            hs = slice(None) if Hm == 1 else slice(hm, hm + 1)
            b_idx = torch.arange(B, device=device)[bs]
            h_idx = torch.arange(H, device=device)[hs]
            nb, nh = len(b_idx), len(h_idx)
            b_idx = b_idx.view(nb, 1).expand(nb, nh).reshape(-1, 1, 1)  # (G, 1, 1)
            h_idx = h_idx.view(1, nh).expand(nb, nh).reshape(-1, 1, 1)  # (G, 1, 1)
            positions = torch.arange(L, device=device).view(1, L, 1)  # (1, L, 1) query positions

            def evaluate(r, kv, b_idx=b_idx, h_idx=h_idx, positions=positions):
                q_idx = positions[:, r * Bq:min(L, (r + 1) * Bq)]  # (1, bl, 1)
                shape = (b_idx.shape[0], q_idx.shape[1], kv.numel())
                return call_mask_mod(self.mask_mod, b_idx, h_idx, q_idx, kv.view(1, 1, -1), shape)

            previous: dict[tuple, list] = {}  # shape -> the last few biases kept of that shape

            def keep_bias(bias, previous=previous):
                recent = previous.setdefault(tuple(bias.shape), [])
                for old in recent:
                    if torch.equal(old, bias):
                        return old
                if budget[0] < bias.numel() * bias.element_size():
                    return None
                budget[0] -= bias.numel() * bias.element_size()
                recent.insert(0, bias)
                del recent[4:]
                return bias

            plan = []
            for block in _merge(tiles, Bq, L, max_rows):
                sub = [(r, min(L, (r + 1) * Bq) - r * Bq, set(tiles[r][0]), set(tiles[r][1])) for r in block]
                r0, r1 = block[0] * Bq, min(L, (block[-1] + 1) * Bq)
                plan.append((r0, r1, _super_row_plan(sub, Bk, S, chunk_tiles, device, evaluate, keep_bias)))
            self.groups.append(((bs, hs), b_idx, h_idx, plan))


def _plan_for(block_mask, B: int, H: int, L: int, S: int, chunk_keys: int, device, max_rows: int) -> _Plan:
    """The plan of ``block_mask`` for these shapes, made on the first call and kept on the block mask.

    A block mask is a snapshot of its ``mask_mod`` (its tile states were computed when it was created), and the
    plan holds the predicate's verdicts on the partial tiles of that snapshot: the next call with the same
    block mask (the next layer, the next step) reuses them, as the indices, instead of running the predicate
    again. Make a new block mask when the tensors a ``mask_mod`` reads change.
    """
    if block_mask is None:
        return _Plan(None, B, H, L, S, chunk_keys, device, max_rows)
    plans = block_mask.__dict__.setdefault("_chunked_plans", {})  # frozen dataclass: its fields stay as they are
    key = (B, H, L, S, chunk_keys, str(device), max_rows, MERGE_WASTE)
    if key not in plans:
        if len(plans) >= 4:  # a few shapes at most (a block mask serves one shape, or a few batch sizes)
            plans.pop(next(iter(plans)))
        plans[key] = _Plan(block_mask, B, H, L, S, chunk_keys, device, max_rows)
    return plans[key]


def _merge(tiles, Bq: int, L: int, max_rows: int) -> list[list[int]]:
    """Consecutive query tiles in blocks of at most ``max_rows`` rows whose union of key tiles costs at most
    :data:`MERGE_WASTE` times their own non-empty tiles."""
    blocks: list[list[int]] = []
    for r, (p, f) in enumerate(tiles):
        if blocks and (len(blocks[-1]) + 1) * Bq <= max_rows and p + f:
            cand = blocks[-1] + [r]
            own = sum(len(tiles[i][0]) + len(tiles[i][1]) for i in cand)
            union = set().union(*(set(tiles[i][0]) | set(tiles[i][1]) for i in cand))
            if own and len(union) * len(cand) <= MERGE_WASTE * own:
                blocks[-1] = cand
                continue
        blocks.append([r])
    return blocks


def _take(x: torch.Tensor, sel) -> torch.Tensor:
    """(B, H, N, D)[sel] -> (G, N, D), a view when it can be."""
    return x[sel].flatten(0, 1)  # (Bg, Hg, N, D) -> (G, N, D)


# ------------------------------------------------------------------------------------------------ tiles


class _Run:
    """What the loops share: the plan, the mods and the score units."""

    def __init__(self, plan: _Plan, score_mod, scale: float):
        self.plan, self.score_mod, self.scale = plan, score_mod, scale
        self.natural = score_mod is not None  # a score_mod sees natural units
        self.unit = 1.0 if self.natural else _LOG2E
        self.scale2 = scale * self.unit

    def exp_(self, x: torch.Tensor) -> torch.Tensor:
        return x.exp_() if self.natural else x.exp2_()

    def bias(self, chunk: _Chunk, b_idx, h_idx, q_idx, dtype) -> torch.Tensor | None:
        """(G or 1, bl, nc): 0 where the pair takes part, -inf where the predicate hides it; None for no mask.

        Added to the scores (inside the score product when there is no score_mod): an addition broadcast over
        the heads costs a tenth of ``masked_fill_`` with a broadcast mask on this CPU.
        """
        if chunk.part_pos is None:
            return None
        hidden = chunk.bias
        if hidden is None:  # the plan ran out of room to keep it: the predicate again, on the partial tiles only
            hidden = torch.where(chunk.verdicts(), 0.0, _NEG_INF)  # (g, bl, np)
        out = torch.zeros(hidden.shape[0], q_idx.shape[1], chunk.width, dtype=dtype, device=q_idx.device)
        if isinstance(chunk.part_pos, slice):
            out[..., chunk.part_pos] = hidden
        else:
            out.index_copy_(2, chunk.part_pos, hidden.to(dtype).expand(*out.shape[:2], -1))
        return out

    def scores(self, qs, kc, chunk: _Chunk, b_idx, h_idx, q_idx) -> torch.Tensor:
        """A chunk's scores (G, bl, nc): the product, the score_mod, the mask; a fresh tensor (in-place safe)."""
        bias = self.bias(chunk, b_idx, h_idx, q_idx, qs.dtype)
        if self.score_mod is None:
            if bias is None:
                return torch.bmm(qs, kc.transpose(1, 2))  # (G, bl, E) @ (G, E, nc) -> (G, bl, nc)
            return torch.baddbmm(bias.expand(qs.shape[0], -1, -1), qs, kc.transpose(1, 2))
        s = self.modded(torch.bmm(qs, kc.transpose(1, 2)), chunk, b_idx, h_idx, q_idx).clone()
        return s if bias is None else _hide(s, bias)

    def modded(self, s: torch.Tensor, chunk: _Chunk, b_idx, h_idx, q_idx) -> torch.Tensor:
        """The score_mod applied to a chunk of scores (G, bl, nc); a new tensor of that shape."""
        return call_score_mod(self.score_mod, s, b_idx, h_idx, q_idx, chunk.kv_idx)


def _hide(s: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``s`` with the pairs the bias hides set to -inf, in place: a score_mod may give NaN or +inf to a masked
    pair (a captured table's NaN, inf - inf), and ``NaN + -inf`` would be NaN, poisoning a row that does not
    read the pair."""
    return s.masked_fill_(bias == _NEG_INF, _NEG_INF)


def _forward(run: _Run, q, k, v, out, lse) -> None:
    """Fill out (B, H, L, Ev, zeros) and lse (B, H, L, 1, +inf) in natural units; rows that read nothing stay."""
    L = q.shape[2]
    lowest = torch.finfo(q.dtype).min
    for sel, b_idx, h_idx, plan in run.plan.groups:
        qg, kg, vg = _take(q, sel), _take(k, sel), _take(v, sel)  # (G, L, E), (G, S, E), (G, S, Ev)
        og, lg = _take(out, sel), _take(lse, sel)  # (G, L, Ev), (G, L, 1): views of the zeros / +inf below
        rows = torch.arange(L, device=q.device).view(1, L, 1)
        for r0, r1, chunks in plan:
            if not chunks:
                continue  # query rows that read nothing: zeros, lse +inf
            # (1, bl, 1) positions, and the tile's queries times scale (and log2 e): (G, bl, E), one tile at a
            # time so that the forward's extra memory stays a few tiles
            q_idx, qs = rows[:, r0:r1], qg[:, r0:r1] * run.scale2
            for i, chunk in enumerate(chunks):
                s = run.scores(qs, chunk.take(kg), chunk, b_idx, h_idx, q_idx)  # (G, bl, nc)
                if i == 0:  # the first chunk starts the running sums (no rescaling)
                    m = s.amax(-1, keepdim=True).clamp_min_(lowest)  # lowest, not -inf: exp(-inf - m) = 0
                    p = run.exp_(s.sub_(m))  # (G, bl, nc), in place: the scores are not needed again
                    denom = p.sum(-1, keepdim=True)
                    acc = torch.bmm(p, chunk.take(vg))  # (G, bl, nc) @ (G, nc, Ev)
                    continue
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))  # (G, bl, 1)
                p = run.exp_(s.sub_(m_new))
                alpha = run.exp_(m.sub_(m_new))  # rescales what was summed under the old max
                denom = denom.mul_(alpha).add_(p.sum(-1, keepdim=True))
                acc = torch.baddbmm(acc.mul_(alpha), p, chunk.take(vg))  # + (G, bl, nc) @ (G, nc, Ev)
                m = m_new
            alive = denom > 0  # every pair masked: zeros, and lse = +inf so the backward's p is 0
            torch.div(acc, denom.clamp_min(torch.finfo(q.dtype).tiny), out=og[:, r0:r1])
            natural_lse = m.add_(denom.log()) if run.natural else m.add_(denom.log2()).mul_(_LN2)
            lg[:, r0:r1] = torch.where(alive, natural_lse, float("inf"))
        if og.data_ptr() != out[sel].data_ptr():  # not a view after all: write back
            out[sel] = og.view(out[sel].shape)
            lse[sel] = lg.view(lse[sel].shape)


def _backward(run: _Run, q, k, v, out, lse, grad_out, captured):
    """dq, dk, dv (shapes of q, k, v) and the gradients of the score_mod's captured tensors."""
    L = q.shape[2]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # captured tensors' gradients are sums over every chunk: accumulated in float32 at least, cast at the end
    dcap = [torch.zeros_like(c, dtype=torch.promote_types(c.dtype, torch.float32)) for c in captured]
    delta_all = (grad_out * out).sum(-1, keepdim=True)  # (B, H, L, 1): rowsum(dO * O) = rowsum(P * dP)
    for sel, b_idx, h_idx, plan in run.plan.groups:
        qg, kg, vg = _take(q, sel), _take(k, sel), _take(v, sel)
        dog, lg, deltag = _take(grad_out, sel), _take(lse, sel) * run.unit, _take(delta_all, sel)
        dqg, dkg, dvg = torch.zeros_like(qg), torch.zeros_like(kg), torch.zeros_like(vg)
        q_all = qg * run.scale2  # (G, L, E)
        rows = torch.arange(L, device=q.device).view(1, L, 1)
        for r0, r1, chunks in plan:
            if not chunks:
                continue
            q_idx, qs = rows[:, r0:r1], q_all[:, r0:r1]  # (1, bl, 1), (G, bl, E)
            do, lse_t, delta = dog[:, r0:r1], lg[:, r0:r1], deltag[:, r0:r1]  # (G, bl, Ev), (G, bl, 1) x 2
            dq_t = torch.zeros_like(qs)
            for chunk in chunks:
                kc, vc = chunk.take(kg), chunk.take(vg)  # (G, nc, E), (G, nc, Ev)
                if run.score_mod is None:
                    s = run.scores(qs, kc, chunk, b_idx, h_idx, q_idx)  # (G, bl, nc)
                else:
                    with torch.enable_grad():
                        raw = torch.bmm(qs, kc.transpose(1, 2)).requires_grad_()
                        modded = run.modded(raw, chunk, b_idx, h_idx, q_idx)
                    s = modded.detach().clone()
                    bias = run.bias(chunk, b_idx, h_idx, q_idx, s.dtype)
                    if bias is not None:
                        _hide(s, bias)
                p = run.exp_(s.sub_(lse_t))  # (G, bl, nc), recomputed from the saved log-sum-exp
                chunk.add_into(dvg, torch.bmm(p.transpose(1, 2), do))  # (G, nc, bl) @ (G, bl, Ev)
                ds = torch.bmm(do, vc.transpose(1, 2)).sub_(delta).mul_(p)  # dS = P * (dP - delta), (G, bl, nc)
                if run.score_mod is not None:
                    ds = _through_score_mod(raw, modded, ds, captured, dcap)
                dq_t.baddbmm_(ds, kc)  # += (G, bl, nc) @ (G, nc, E)
                chunk.add_into(dkg, torch.bmm(ds.transpose(1, 2), qs))  # (G, nc, bl) @ (G, bl, E)
            dqg[:, r0:r1] = dq_t * run.scale
        dq[sel] = dqg.view(dq[sel].shape)
        dk[sel] = (dkg if run.natural else dkg * _LN2).view(dk[sel].shape)  # qs carried scale * log2(e)
        dv[sel] = dvg.view(dv[sel].shape)
    return dq, dk, dv, [g.to(c.dtype) for g, c in zip(dcap, captured)]


def _through_score_mod(raw, modded, ds, captured, dcap):
    """Chain rule through the score_mod on one chunk: d(raw) and += d(captured tensors)."""
    if not modded.requires_grad:  # the mod ignored the score and every captured tensor
        return torch.zeros_like(ds)
    grads = torch.autograd.grad(modded, [raw, *captured], ds, allow_unused=True)
    for acc, g in zip(dcap, grads[1:]):
        if g is not None:
            acc.add_(g)
    return grads[0] if grads[0] is not None else torch.zeros_like(ds)


# ---------------------------------------------------------------------------------------------- autograd


class _ChunkedFlex(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, query, key, value, *captured):
        dt = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
        q, k, v = query.to(dt), key.to(dt), value.to(dt)
        out = q.new_zeros(*q.shape[:3], v.shape[-1])  # (B, H, L, Ev): rows that read nothing stay 0
        lse = q.new_full((*q.shape[:3], 1), float("inf"))  # (B, H, L, 1): +inf there (the backward's p = 0)
        _forward(run, q, k, v, out, lse)
        ctx.run, ctx.dtypes = run, (query.dtype, key.dtype, value.dtype)
        ctx.captured = captured  # the very tensors the score_mod's closure holds (autograd.grad asks for them)
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(query.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, dcap = _backward(ctx.run, q, k, v, out, lse, grad_out.to(q.dtype), ctx.captured)
        dq, dk, dv = (g.to(d) for g, d in zip((dq, dk, dv), ctx.dtypes))
        return (None, dq, dk, dv, *dcap)


# ---------------------------------------------------------------------------------------------- public


def captured_tensors(fn) -> list[torch.Tensor]:
    """Tensors that require grad and that ``fn`` reaches through its closure, defaults, a ``functools.partial``'s
    arguments or a module's parameters, recursively (a composed mod's inner mods too). These are the tensors
    whose gradients the ``chunked`` backend returns."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(x, depth: int) -> None:
        if depth > 8 or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                found.setdefault(id(x), x)
        elif isinstance(x, torch.nn.Module):
            for p in x.parameters():
                visit(p, depth + 1)
        elif isinstance(x, functools.partial):
            for a in (x.func, *x.args, *x.keywords.values()):
                visit(a, depth + 1)
        elif isinstance(x, (list, tuple)):
            for a in x:
                visit(a, depth + 1)
        elif isinstance(x, dict):
            for a in x.values():
                visit(a, depth + 1)
        elif callable(x):
            for cell in getattr(x, "__closure__", None) or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # an empty cell
                    pass
            for a in (getattr(x, "__defaults__", None) or ()):
                visit(a, depth + 1)
            for a in (getattr(x, "__kwdefaults__", None) or {}).values():
                visit(a, depth + 1)
            if not isinstance(x, type) and hasattr(x, "__dict__") and not hasattr(x, "__code__"):
                visit(vars(x), depth + 1)  # a callable object's attributes

    visit(fn, 0)
    return list(found.values())


def chunked_flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, *,
                           chunk_keys: int = CHUNK_KEYS) -> torch.Tensor:
    """Flex attention over the block mask's non-empty tiles, with autograd for q, k, v and captured tensors.

    Takes validated inputs with as many key/value heads as query heads (the public way in is
    :func:`attention_core.flex_attention.flex_attention`, which checks shapes and expands GQA).

    Args:
        query: (B, H, L, E); key: (B, H, S, E); value: (B, H, S, Ev), one floating dtype.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx)`` or ``None``.
        block_mask: a :class:`~attention_core.flex_attention.BlockMask` of (L, S), or ``None`` (all tiles full).
        scale: score scale, default ``1 / sqrt(E)``.
        chunk_keys: most keys per matrix product (consecutive tiles are merged up to it).

    Returns:
        (B, H, L, Ev) in the query's dtype; rows that read no key are zeros.
    """
    if isinstance(chunk_keys, bool) or not isinstance(chunk_keys, int) or chunk_keys < 1:
        raise ValueError(f"chunk_keys must be a positive int, got {chunk_keys!r}")
    B, H, L, E = query.shape
    S = key.shape[2]
    scale = E ** -0.5 if scale is None else float(scale)
    captured = captured_tensors(score_mod) if score_mod is not None else []
    # a captured tensor's gradient is summed by autograd in that tensor's dtype, chunk by chunk: merged query
    # tiles would double the pairs per sum (in bfloat16, an error past 2 ** -8 * sqrt(pairs))
    max_rows = 0 if captured else MAX_ROWS
    plan = _plan_for(block_mask, B, H, L, S, chunk_keys, query.device, max_rows)
    return _ChunkedFlex.apply(_Run(plan, score_mod, scale), query, key, value, *captured)
