"""Block masks: which tiles of the (L, S) grid of (query, key) pairs attention must visit.

The (L, S) grid is cut into tiles of ``BLOCK_SIZE`` queries by ``BLOCK_SIZE`` keys. For each tile,
:func:`create_block_mask` evaluates the ``mask_mod`` once and records whether the tile is **empty** (no pair
takes part), **full** (every pair takes part) or **partial**. A :class:`BlockMask` stores, per (batch, head,
query tile), the count and the indices of its partial tiles and of its full tiles: O((L / Bq) (S / Bk))
integers, never an (L, S) tensor.

This module sits below everything that reads a block mask: :mod:`attention_core.flex_attention` (the front
end, which re-exports these names) and the flex backends (:mod:`attention_core.backends.chunked_flex`,
:mod:`attention_core.backends.triton_flex`) all import it, and it imports none of them. The names and argument
orders are PyTorch's (``torch.nn.attention.flex_attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attention_core._checks import check_device, check_fits
from attention_core.mask_mods import MaskMod, call_mask_mod

__all__ = ["BLOCK_SIZE", "EMPTY", "FULL", "PARTIAL", "BlockMask", "create_block_mask"]

#: PyTorch's default tile: 128 queries by 128 keys.
BLOCK_SIZE = 128
#: Elements of the (rows, S) slab of the predicate that :func:`create_block_mask` evaluates at once (4 MiB of bools).
_SLAB = 1 << 22

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockMask:
    """Which tiles of the (L, S) grid attention must visit, per (batch, head, query tile).

    Attributes:
        seq_lengths: ``(L, S)``.
        BLOCK_SIZE: ``(Bq, Bk)``, queries and keys per tile.
        kv_num_blocks: (Bm, Hm, nQ) int32, partial tiles per query tile (``Bm``, ``Hm`` are 1 when the mask is
            the same for every batch row or head).
        kv_indices: (Bm, Hm, nQ, nK) int32, the partial tiles' key-tile indices first, in increasing order.
        full_kv_num_blocks: (Bm, Hm, nQ) int32, full tiles per query tile.
        full_kv_indices: (Bm, Hm, nQ, nK) int32, likewise.
        mask_mod: the predicate, evaluated on partial tiles only.
    """

    seq_lengths: tuple[int, int]
    BLOCK_SIZE: tuple[int, int]
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: torch.Tensor
    full_kv_indices: torch.Tensor
    mask_mod: MaskMod

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(Bm, Hm, L, S)``."""
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    def tile_states(self) -> torch.Tensor:
        """(Bm, Hm, nQ, nK) int8: 0 empty, 1 partial, 2 full."""
        Bm, Hm, nQ, nK = self.kv_indices.shape
        states = torch.zeros(Bm, Hm, nQ, nK, dtype=torch.int8, device=self.kv_indices.device)
        cols = torch.arange(nK, device=states.device)  # (nK,)
        for num, idx, state in ((self.kv_num_blocks, self.kv_indices, PARTIAL),
                                (self.full_kv_num_blocks, self.full_kv_indices, FULL)):
            valid = cols < num[..., None]  # (Bm, Hm, nQ, nK): the first num entries are tiles
            states.scatter_add_(-1, idx.long(), torch.where(valid, state, 0).to(torch.int8))
        return states

    def nonempty_tiles(self) -> int:
        """Tiles attention visits, summed over the mask's (batch, head) entries."""
        return int(self.kv_num_blocks.sum()) + int(self.full_kv_num_blocks.sum())

    def sparsity(self) -> float:
        """Percentage of tiles that are empty (skipped), as PyTorch's ``BlockMask.sparsity``."""
        total = self.kv_indices.numel()
        return 100.0 * (1 - self.nonempty_tiles() / total) if total else 0.0

    def nbytes(self) -> int:
        """Bytes held by the mask's tensors: O(nQ * nK), to set beside a dense mask's L * S."""
        return sum(t.numel() * t.element_size() for t in (self.kv_num_blocks, self.kv_indices,
                                                          self.full_kv_num_blocks, self.full_kv_indices))

    def to_string(self, b: int = 0, h: int = 0) -> str:
        """One line per query tile: ``#`` full, ``+`` partial, ``.`` empty."""
        rows = self.tile_states()[b, h].tolist()
        return "\n".join("".join(".+#"[s] for s in row) for row in rows)

    def __repr__(self) -> str:
        return (f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, sparsity={self.sparsity():.2f}%, "
                f"mask_mod={getattr(self.mask_mod, '__name__', self.mask_mod)})")


def _block_size(BLOCK_SIZE) -> tuple[int, int]:
    if not isinstance(BLOCK_SIZE, (int, tuple, list)):
        raise TypeError(f"BLOCK_SIZE must be a positive int or a pair of them, got {type(BLOCK_SIZE).__name__} "
                        f"{BLOCK_SIZE!r:.60}")
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    if len(sizes) != 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"BLOCK_SIZE must be a positive int or a pair of them, got {BLOCK_SIZE!r}")
    return sizes


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., nK) bool -> counts (...,) int32 and indices (..., nK) int32, the True tiles first, in order."""
    num = tiles.sum(-1, dtype=torch.int32)
    idx = torch.sort((~tiles).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return num, idx


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str | None = "cpu",
    BLOCK_SIZE: int | tuple[int, int] = BLOCK_SIZE,
) -> BlockMask:
    """Evaluate ``mask_mod`` tile by tile and record each tile as empty, full or partial.

    The predicate is evaluated on a slab of query rows at a time (at most 4 Mi pairs), so creating the mask
    takes O(L * S) time but only O(slab + nQ * nK) memory.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (see :mod:`attention_core.mask_mods`).
        B: batch size, or ``None`` for a mask that is the same for every batch row (evaluated at ``b = 0``).
        H: number of query heads, or ``None`` likewise (``h = 0``).
        Q_LEN: L, queries.
        KV_LEN: S, keys.
        device: where the mask's tensors live.
        BLOCK_SIZE: tile size, an int or ``(Bq, Bk)``.

    Returns:
        A :class:`BlockMask` of shape (B or 1, H or 1, L, S).
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    for name, n in (("B", B), ("H", H)):
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {n!r}")
    for name, n in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    Bq, Bk = _block_size(BLOCK_SIZE)
    Bm, Hm, L, S = B or 1, H or 1, Q_LEN, KV_LEN
    nQ, nK = -(-L // Bq), -(-S // Bk)
    # two bool grids and two int32 index tensors of (Bm, Hm, nQ, nK), and the sort's int64 indices
    device = check_device(device) or torch.device("cpu")
    check_fits(Bm * Hm * nQ * nK * 18, f"create_block_mask's (B, H, nQ, nK) = ({Bm}, {Hm}, {nQ}, {nK}) tile tables",
               device)
    any_ = torch.zeros(Bm, Hm, nQ, nK, dtype=torch.bool, device=device)
    all_ = torch.zeros(Bm, Hm, nQ, nK, dtype=torch.bool, device=device)
    tiles_per_slab = max(1, _SLAB // max(1, Bq * nK * Bk))  # query tiles evaluated at once
    check_fits(2 * min(nQ, tiles_per_slab) * Bq * nK * Bk, f"create_block_mask's padded slab of "
               f"{min(nQ, tiles_per_slab)} tiles of BLOCK_SIZE = {(Bq, Bk)} by {nK} key tiles", device)
    kv = torch.arange(S, device=device)
    for b in range(Bm):
        for h in range(Hm):
            bt, ht = torch.tensor(b, device=device), torch.tensor(h, device=device)
            for t0 in range(0, nQ, tiles_per_slab):
                t1 = min(nQ, t0 + tiles_per_slab)
                q = torch.arange(t0 * Bq, min(L, t1 * Bq), device=device)
                keep = call_mask_mod(mask_mod, bt, ht, q[:, None], kv[None, :], (len(q), S))  # (rows, S)
                pad = (0, nK * Bk - S, 0, (t1 - t0) * Bq - len(q))  # ragged edges: outside pairs are neither
                tiles_any = F.pad(keep, pad, value=False).view(t1 - t0, Bq, nK, Bk)
                tiles_all = F.pad(keep, pad, value=True).view(t1 - t0, Bq, nK, Bk)
                any_[b, h, t0:t1] = tiles_any.any(3).any(1)  # (tiles, nK)
                all_[b, h, t0:t1] = tiles_all.all(3).all(1)
    full = any_ & all_
    partial = any_ & ~all_
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask((L, S), (Bq, Bk), kv_num, kv_idx, full_num, full_idx, mask_mod)
