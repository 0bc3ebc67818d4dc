"""What a Vision Transformer's heads do, and where a captioner's words look; each a small function on weights.

- :func:`mean_attention_distance`: the attention-weighted distance in pixels between a query patch and the
  patches it reads, per layer and head (Dosovitskiy et al., 2021, Figure 7 right);
- :func:`attention_rollout`: attention multiplied through the layers with the residual path counted as half of
  each layer (Abnar & Zuidema, 2020); the one of :mod:`attention_core.explain`, named here too;
- :func:`position_similarity`: cosine similarity between position embeddings (Figure 7 centre), and
  :func:`layout_gap` with its control :func:`layout_gap_null` (the same vectors on a shuffled grid);
- :func:`word_region_accuracy`: the share of words whose strongest cross-attention falls on the region they name,
  and :func:`cell_swap_changes`, the intervention that says which cell decides each word.
"""

from __future__ import annotations

from typing import Tuple

import torch

from attention_core._checks import check_bool_flag, check_floating, check_positive_int, check_tensor
from attention_core.explain.attribution import attention_rollout
from attention_core.models.captioner import Captioner
from attention_core.training.modes import eval_mode

__all__ = ["attention_rollout", "cell_swap_changes", "layout_gap", "layout_gap_null", "mean_attention_distance",
           "patch_distances", "position_similarity", "word_region_accuracy"]


def patch_distances(grid: Tuple[int, int], patch_size: int) -> torch.Tensor:
    """Euclidean distance in pixels between patch centres: (N, N), patches in reading order."""
    gh, gw = grid
    r, c = torch.meshgrid(torch.arange(gh, dtype=torch.float64), torch.arange(gw, dtype=torch.float64),
                          indexing="ij")
    centres = torch.stack([r.flatten(), c.flatten()], dim=-1) * patch_size  # (N, 2)
    return torch.cdist(centres, centres)  # (N, N)


def mean_attention_distance(weights: torch.Tensor, grid: Tuple[int, int], patch_size: int,
                            has_cls_token: bool) -> torch.Tensor:
    """Mean attention distance per head, in pixels.

    Args:
        weights: (B, H, T, T) attention weights of one layer; T = N patches (+ 1 class token first).
        grid: (rows, columns) of patches.
        patch_size: pixels per patch side.
        has_cls_token: drop the class token's row and column; each patch row is then renormalised over the
            patches, so the distance is the mean over where the query reads *in the image*.

    Returns:
        (H,) float64, for each head the weighted distance sum_k w_qk * d(q, k), averaged over queries and images.
    """
    check_tensor(weights, "weights")
    check_floating(weights, "weights")
    check_bool_flag(has_cls_token, "has_cls_token")
    if weights.dim() != 4 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must be (B, H, T, T), got {tuple(weights.shape)}")
    w = weights.to(torch.float64)
    if has_cls_token:
        w = w[..., 1:, 1:]  # (B, H, T, T) -> (B, H, N, N)
        w = w / w.sum(-1, keepdim=True).clamp_min(1e-300)
    N = grid[0] * grid[1]
    if w.shape[-1] != N:
        raise ValueError(f"weights cover {w.shape[-1]} patches, grid {grid} has {N}")
    d = patch_distances(grid, patch_size)  # (N, N)
    return (w * d).sum(-1).mean(dim=(0, 2))  # (B, H, N, N) -> (B, H, N) -> (H,)


def position_similarity(pos: torch.Tensor) -> torch.Tensor:
    """Cosine similarity between every pair of position embeddings: (N, D) -> (N, N)."""
    check_tensor(pos, "pos")
    if pos.dim() != 2:
        raise ValueError(f"pos must be (N, D), got {tuple(pos.shape)}")
    p = pos.detach().to(torch.float64)
    p = p / p.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return p @ p.T  # (N, D) @ (D, N) -> (N, N)


def word_region_accuracy(cross: torch.Tensor, patch_region: torch.Tensor, word_region: torch.Tensor) -> float:
    """Share of words whose strongest cross-attention lands on a patch of the region the word names.

    Args:
        cross: (B, T, N) cross-attention of each word over the patches (e.g. the head mean).
        patch_region: (N,) long, the region each patch belongs to.
        word_region: (B, T) long, the region each word names.
    """
    check_tensor(cross, "cross")
    check_tensor(patch_region, "patch_region")
    check_tensor(word_region, "word_region")
    if cross.dim() != 3 or patch_region.shape != cross.shape[-1:] or word_region.shape != cross.shape[:2]:
        raise ValueError(f"shapes disagree: cross {tuple(cross.shape)}, patch_region {tuple(patch_region.shape)}, "
                         f"word_region {tuple(word_region.shape)}")
    hit = patch_region[cross.argmax(-1)] == word_region  # (B, T)
    return hit.double().mean().item()


def layout_gap(pos: torch.Tensor, grid: Tuple[int, int], near: float = 1.0, far: float = 3.0) -> float:
    """Mean cosine similarity of neighbouring positions minus that of distant ones.

    Args:
        pos: (N, D) position vectors, patches in reading order on ``grid``.
        grid: (rows, columns) of patches.
        near: pairs whose centres are at most ``near`` patches apart (and not the same patch) are neighbours.
        far: pairs at least ``far`` patches apart are distant.

    Returns:
        A float, positive when neighbours are more alike than distant patches (a 2-D layout), negative when
        they are less alike; when the similarities ignore the grid it falls among the gaps of shuffled grids
        (:func:`layout_gap_null`).
    """
    check_tensor(pos, "pos")
    sim = position_similarity(pos)  # (N, N)
    if sim.shape[0] != grid[0] * grid[1]:
        raise ValueError(f"pos has {sim.shape[0]} positions, grid {grid} has {grid[0] * grid[1]}")
    d = patch_distances(grid, 1)  # (N, N), in patches
    return (sim[(d > 0) & (d <= near)].mean() - sim[d >= far].mean()).item()


def layout_gap_null(pos: torch.Tensor, grid: Tuple[int, int], draws: int = 1000, seed: int = 0,
                    near: float = 1.0, far: float = 3.0) -> torch.Tensor:
    """The control for :func:`layout_gap`: the gap of the same vectors placed on the grid in a random order.

    Returns (draws,) float64: the gap after each of ``draws`` random relabellings of the positions (seeded). A
    layout learned from data puts the real gap above nearly all of them, vectors that ignore the grid put it
    anywhere among them, and a gap below nearly all of them means neighbours less alike than distant patches.
    """
    check_tensor(pos, "pos")
    check_positive_int(draws, "draws")
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([layout_gap(pos[torch.randperm(pos.shape[0], generator=g)], grid, near, far)
                         for _ in range(draws)], dtype=torch.float64)


@torch.no_grad()
def cell_swap_changes(model: Captioner, images: torch.Tensor, tokens: torch.Tensor, donors: torch.Tensor,
                      cell_width: int) -> torch.Tensor:
    """Which cell decides each word: replace one cell's pixels and see which words change.

    Args:
        model: a :class:`~attention_core.models.captioner.Captioner` (run in eval mode, its modes given back).
        images: (B, C, H, W) images made of ``W / cell_width`` cells side by side.
        tokens: (B, T) the caption's input tokens (teacher forcing: the start token, then the true words), so
            each word is predicted from the true words before it.
        donors: (B, C, H, W) other images of the same layout; cell ``j`` of ``images`` is replaced by cell ``j``
            of ``donors``.
        cell_width: pixels per cell.

    Returns:
        (cells, T) float64, entry ``[j, t]`` is the share of images whose predicted word ``t`` changes when
        cell ``j`` is replaced.
    """
    check_tensor(images, "images")
    check_tensor(donors, "donors")
    check_positive_int(cell_width, "cell_width")
    if donors.shape != images.shape or images.dim() != 4 or images.shape[-1] % cell_width:
        raise ValueError(f"images and donors must be one (B, C, H, W) shape whose W is a multiple of cell_width="
                         f"{cell_width}, got {tuple(images.shape)} and {tuple(donors.shape)}")
    with eval_mode(model):
        base = model(images, tokens).logits.argmax(-1)  # (B, T)
        rows = []
        for j in range(images.shape[-1] // cell_width):
            cols = slice(j * cell_width, (j + 1) * cell_width)
            swapped = images.clone()
            swapped[..., cols] = donors[..., cols]
            rows.append((model(swapped, tokens).logits.argmax(-1) != base).double().mean(0))  # (T,)
    return torch.stack(rows)  # (cells, T)
