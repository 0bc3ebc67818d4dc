"""Sparse attention patterns: which (query, key) pairs a layer computes, and what two layers reach.

Each pattern comes twice, and the two agree (tested):

- a **mask_mod** predicate in PyTorch FlexAttention's convention, ``mask_mod(b, h, q_idx, kv_idx) -> bool``
  (True = attend), written with tensor operations so it works on broadcast index tensors;
- a **dense** bool (L, S) mask, built from the pattern's definition.

Patterns (all causal by default: key ``j <= i``):

- :func:`strided_mod` (Child et al., 2019, "strided"): the previous ``stride`` positions, and every
  position a multiple of ``stride`` back;
- :func:`fixed_mod` (Child et al., "fixed"): the query's own block of ``block`` positions, and the last
  ``summary`` positions of every block;
- :func:`longformer_mod` (Beltagy et al., 2020): a window of ``window`` on each side, plus global tokens that
  attend to everything and that everything attends to;
- :func:`bigbird_mod` (Zaheer et al., 2020): Longformer's window and globals plus ``num_random`` random keys per
  query row (drawn once, from a seeded generator).

:func:`two_hop_reach` multiplies boolean matrices: ``(M @ M)[i, j]`` is True when some ``k`` has
``M[i, k]`` and ``M[k, j]``, i.e. information flows from key ``j`` to query ``i`` through two layers.
:func:`tiles_visited` counts the (Bq, Bk) tiles of a mask that hold at least one True: the work a tiled kernel
that skips empty tiles does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from attention_core._checks import (
    check_bool_flag,
    check_fits,
    check_positive_int,
    check_tensor,
    fmt_shape,
    short_repr,
)
from attention_core.mask_mods import call_mask_mod

__all__ = [
    "PATTERNS",
    "bigbird_mask",
    "bigbird_mod",
    "dense_from_mod",
    "fixed_mask",
    "fixed_mod",
    "longformer_mask",
    "longformer_mod",
    "reaches_every_pair",
    "strided_mask",
    "strided_mod",
    "tiles_visited",
    "two_hop_reach",
]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _check_globals(global_tokens: object) -> tuple[int, ...]:
    if isinstance(global_tokens, (str, bytes)) or not isinstance(global_tokens, Sequence):
        raise TypeError(f"global_tokens must be a sequence of ints, got {type(global_tokens).__name__}")
    return tuple(check_positive_int(g, "global_tokens[i]", allow_zero=True) for g in global_tokens)


def _check_dense(L: int, S: int, who: str, per: int = 1) -> None:
    """Refuse, before allocating, an (L, S) dense mask (``per`` bytes a pair) that cannot fit in memory."""
    check_fits(L * S * per, f"{who}'s dense (L, S) = ({L}, {S}) mask", "cpu")


def _causal(q_idx: torch.Tensor, kv_idx: torch.Tensor, causal: bool) -> torch.Tensor:
    return kv_idx <= q_idx if causal else torch.ones_like(q_idx - kv_idx, dtype=torch.bool)


def strided_mod(stride: int, *, causal: bool = True) -> MaskMod:
    """Child et al.'s strided pattern: ``|i - j| < stride`` or ``(i - j) % stride == 0``."""
    s = check_positive_int(stride, "stride")
    check_bool_flag(causal, "causal")

    def mask_mod(b, h, q_idx, kv_idx):
        diff = q_idx - kv_idx
        return ((diff.abs() < s) | (diff % s == 0)) & _causal(q_idx, kv_idx, causal)

    return mask_mod


def fixed_mod(block: int, summary: int = 1, *, causal: bool = True) -> MaskMod:
    """Child et al.'s fixed pattern: ``i // block == j // block`` or ``j % block >= block - summary``."""
    c = check_positive_int(block, "block")
    t = check_positive_int(summary, "summary")
    if t > c:
        raise ValueError(f"summary must be <= block ({c}), got {t}")
    check_bool_flag(causal, "causal")

    def mask_mod(b, h, q_idx, kv_idx):
        same = (q_idx // c) == (kv_idx // c)
        return (same | (kv_idx % c >= c - t)) & _causal(q_idx, kv_idx, causal)

    return mask_mod


def _global_table(global_tokens: tuple[int, ...], n: int) -> torch.Tensor:
    table = torch.zeros(n, dtype=torch.bool)
    table[list(global_tokens)] = True
    return table


def longformer_mod(window: int, global_tokens: Sequence[int] = (0,), *, causal: bool = True,
                   max_len: int = 1 << 16) -> MaskMod:
    """Longformer: ``|i - j| <= window``, or ``i`` or ``j`` a global token. ``max_len`` bounds the positions.

    ``window`` is the half-width here (``window`` keys on each side), as in chapter 12's pattern tables;
    :func:`attention_core.mask_mods.longformer` takes the full width (``window // 2`` on each side).
    """
    w = check_positive_int(window, "window", allow_zero=True)
    g = _check_globals(global_tokens)
    n = check_positive_int(max_len, "max_len")
    if any(x >= n for x in g):
        raise ValueError(f"global_tokens must be < max_len = {n}, got {short_repr(g)}")
    check_bool_flag(causal, "causal")
    check_fits(n, f"longformer_mod's (max_len,) = ({n},) table of global tokens", "cpu")
    table = _global_table(g, n)

    def mask_mod(b, h, q_idx, kv_idx):
        tab = table.to(q_idx.device)
        near = (q_idx - kv_idx).abs() <= w
        return (near | tab[q_idx] | tab[kv_idx]) & _causal(q_idx, kv_idx, causal)

    return mask_mod


def bigbird_mod(L: int, window: int, global_tokens: Sequence[int] = (0,), num_random: int = 2, *,
                causal: bool = True, generator: torch.Generator | None = None) -> MaskMod:
    """BigBird: Longformer's window and global tokens, plus ``num_random`` keys per query drawn at random (among
    the keys the query may see if causal), fixed when the mod is built: for sequences up to ``L`` positions."""
    n = check_positive_int(L, "L")
    r = check_positive_int(num_random, "num_random", allow_zero=True)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    _check_dense(n, n, "bigbird_mod")  # it draws and keeps an (L, L) table of random keys
    base = longformer_mod(window, global_tokens, causal=causal, max_len=n)
    rand = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        allowed = i + 1 if causal else n
        pick = torch.randperm(allowed, generator=generator)[:r]
        rand[i, pick] = True

    def mask_mod(b, h, q_idx, kv_idx):
        return base(b, h, q_idx, kv_idx) | rand.to(q_idx.device)[q_idx, kv_idx]

    return mask_mod


def dense_from_mod(mask_mod: MaskMod, L: int, S: int | None = None) -> torch.Tensor:
    """Evaluate ``mask_mod`` on every (query, key) pair: bool (L, S)."""
    L = check_positive_int(L, "L")
    S = L if S is None else check_positive_int(S, "S")
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    _check_dense(L, S, "dense_from_mod")
    q = torch.arange(L).unsqueeze(1)  # (L, 1)
    k = torch.arange(S).unsqueeze(0)  # (1, S)
    zero = torch.zeros((), dtype=torch.long)
    return call_mask_mod(mask_mod, zero, zero, q, k, (L, S)).clone()


# Dense builders, written from the definitions directly (rows of positions), independent of the mods.


def _causal_dense(L: int, causal: bool) -> torch.Tensor:
    full = torch.ones(L, L, dtype=torch.bool)
    return full.tril() if causal else full


def strided_mask(L: int, stride: int, *, causal: bool = True) -> torch.Tensor:
    """Bool (L, L) mask of :func:`strided_mod`: a band of width ``stride`` and every ``stride``-th diagonal."""
    L = check_positive_int(L, "L")
    s = check_positive_int(stride, "stride")
    check_bool_flag(causal, "causal")
    _check_dense(L, L, "strided_mask", 2)
    m = torch.zeros(L, L, dtype=torch.bool)
    for off in range(-(L - 1), L):
        if abs(off) < s or off % s == 0:
            m.diagonal(-off).fill_(True)  # the pairs with i - j = off: a view, O(L) a diagonal
    return m & _causal_dense(L, causal)


def fixed_mask(L: int, block: int, summary: int = 1, *, causal: bool = True) -> torch.Tensor:
    """Bool (L, L) mask of :func:`fixed_mod`: diagonal blocks plus the summary columns of every block."""
    L = check_positive_int(L, "L")
    fixed_mod(block, summary, causal=causal)  # validates
    _check_dense(L, L, "fixed_mask", 2)
    m = torch.zeros(L, L, dtype=torch.bool)
    for a in range(0, L, block):
        m[a:a + block, a:a + block] = True
        m[:, max(a + block - summary, 0):a + block] = True
    return m & _causal_dense(L, causal)


def longformer_mask(L: int, window: int, global_tokens: Sequence[int] = (0,), *, causal: bool = True) -> torch.Tensor:
    """Bool (L, L) mask of :func:`longformer_mod`: a band of half-width ``window``, global rows and columns."""
    L = check_positive_int(L, "L")
    _check_dense(L, L, "longformer_mask", 2)  # before the mod's (L,) table of global tokens
    longformer_mod(window, global_tokens, causal=causal, max_len=L)  # validates
    m = torch.ones(L, L, dtype=torch.bool).triu(-window).tril(window)
    for g in global_tokens:
        m[g, :] = True
        m[:, g] = True
    return m & _causal_dense(L, causal)


def bigbird_mask(L: int, window: int, global_tokens: Sequence[int] = (0,), num_random: int = 2, *,
                 causal: bool = True, generator: torch.Generator | None = None) -> torch.Tensor:
    """Bool (L, L) mask of :func:`bigbird_mod` (same generator state gives the same random keys)."""
    return dense_from_mod(bigbird_mod(L, window, global_tokens, num_random, causal=causal, generator=generator), L)


#: name -> (dense builder, mod builder) for the patterns with a fixed definition.
PATTERNS = {
    "strided": (strided_mask, strided_mod),
    "fixed": (fixed_mask, fixed_mod),
    "longformer": (longformer_mask, longformer_mod),
}


def _check_bool_2d(mask: object, name: str = "mask") -> torch.Tensor:
    check_tensor(mask, name)
    if mask.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: it holds no values to count or multiply")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor, got {mask.dtype}")
    if mask.dim() != 2:
        raise ValueError(f"{name} must be (L, S), got shape {fmt_shape(mask.shape)}")
    return mask


def two_hop_reach(mask: torch.Tensor) -> torch.Tensor:
    """Pairs reached within two layers of ``mask`` (L, L): ``mask | (mask @ mask)`` as a boolean product."""
    _check_bool_2d(mask)
    if mask.shape[0] != mask.shape[1]:
        raise ValueError(f"mask must be square to stack layers, got shape {fmt_shape(mask.shape)}")
    check_fits(mask.numel() * 17, f"two_hop_reach's float64 product of mask {fmt_shape(mask.shape)}", mask.device)
    f = mask.to(torch.float64)
    return mask | ((f @ f) > 0)


def reaches_every_pair(mask: torch.Tensor, *, causal: bool = True) -> bool:
    """Whether two layers of ``mask`` reach every causal pair (``j <= i``), or every pair if not ``causal``."""
    check_bool_flag(causal, "causal")
    reach = two_hop_reach(mask)
    want = _causal_dense(mask.shape[0], causal).to(mask.device)
    return bool((reach | ~want).all())


def tiles_visited(mask: torch.Tensor, block_q: int = 16, block_k: int = 16) -> int:
    """How many (block_q, block_k) tiles of ``mask`` (L, S) hold at least one True (ragged edges count)."""
    _check_bool_2d(mask)
    bq = check_positive_int(block_q, "block_q")
    bk = check_positive_int(block_k, "block_k")
    L, S = mask.shape
    check_fits(-(-L // bq) * bq * -(-S // bk) * bk, f"tiles_visited's padded mask of {fmt_shape(mask.shape)}",
               mask.device)
    pad = torch.zeros(-(-L // bq) * bq, -(-S // bk) * bk, dtype=torch.bool, device=mask.device)
    pad[:L, :S] = mask
    tiles = pad.reshape(pad.shape[0] // bq, bq, pad.shape[1] // bk, bk)  # (L, S) -> (Tq, bq, Tk, bk)
    return int(tiles.any(dim=3).any(dim=1).sum())
