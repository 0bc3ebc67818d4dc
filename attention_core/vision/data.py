"""The images of chapter 14: scikit-learn's bundled 8x8 digits, and captions generated from them.

The digits (1,797 grey images with 17 levels, the integers 0 to 16, shipped inside scikit-learn: nothing is
downloaded) are scaled to [0, 1] and split once by a seeded permutation into 1,437 training and 360 test
images (:func:`load_digits`).
:func:`make_caption_set` lays ``cells`` digits side by side into one ``8 x 8*cells`` image and writes its
caption, the digits' names left to right: word ``t`` names cell ``t``, so the region each word should look at
is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from attention_core._checks import check_positive_int, check_tensor

__all__ = ["CaptionSet", "Digits", "START", "WORDS", "caption_text", "load_digits", "make_caption_set", "subset"]

#: The caption vocabulary, the ten digit names and then the start token (index 10).
WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "<start>")
#: Index of the start token in :data:`WORDS`.
START = 10


@dataclass(frozen=True)
class Digits:
    """Images (N, 1, 8, 8) float32 in [0, 1] and labels (N,) long, for the training and test splits."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_digits(test_size: int = 360, seed: int = 0) -> Digits:
    """scikit-learn's 8x8 digits, split by a permutation seeded with ``seed`` (``test_size`` images held out)."""
    try:
        from sklearn.datasets import load_digits as _sk_load
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the digits ship with scikit-learn: pip install 'attention-core[vision]'") from e
    bunch = _sk_load()
    x = torch.tensor(bunch.images, dtype=torch.float32)[:, None] / 16.0  # (1797, 8, 8) -> (1797, 1, 8, 8)
    y = torch.tensor(bunch.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = perm[:test_size], perm[test_size:]
    return Digits(x[train], y[train], x[test], y[test])


def subset(x: torch.Tensor, y: torch.Tensor, n: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``n`` examples drawn without replacement by a permutation seeded with ``seed``."""
    if not 0 < n <= len(y):
        raise ValueError(f"n must be in 1..{len(y)}, got {n}")
    idx = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:n]
    return x[idx], y[idx]


@dataclass(frozen=True)
class CaptionSet:
    """images (N, 1, 8, 8*cells); digits (N, cells) long, the caption's words (= the digit in each cell)."""

    images: torch.Tensor
    digits: torch.Tensor

    def tokens(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing: inputs (N, cells) = start token then the first words; targets (N, cells)."""
        start = torch.full((len(self.digits), 1), START, dtype=torch.long)
        return torch.cat([start, self.digits[:, :-1]], dim=1), self.digits


def make_caption_set(x: torch.Tensor, y: torch.Tensor, n: int, cells: int = 3, seed: int = 0) -> CaptionSet:
    """``n`` images of ``cells`` digits drawn (seeded, with replacement) from ``x, y``, side by side."""
    check_positive_int(n, "n", allow_zero=True)
    check_positive_int(cells, "cells")
    if len(y) == 0 or len(x) != len(y):
        raise ValueError(f"x and y must hold one image per label, at least one: got {len(x)} and {len(y)}")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(y), (n, cells), generator=g)  # (n, cells)
    images = torch.cat([x[idx[:, j]] for j in range(cells)], dim=-1)  # cells x (n, 1, 8, 8) -> (n, 1, 8, 8*cells)
    return CaptionSet(images, y[idx])


def caption_text(words: torch.Tensor) -> str:
    """The words of one caption, e.g. ``"three one four"``."""
    check_tensor(words, "words")
    if words.dim() != 1 or words.is_floating_point() or words.dtype == torch.bool:
        raise ValueError(f"words must be a 1-D tensor of word ids, got {words.dtype} {tuple(words.shape)}")
    bad = [int(w) for w in words if not 0 <= int(w) < len(WORDS)]
    if bad:
        raise ValueError(f"words must be ids in [0, {len(WORDS)}), got {bad[:5]}")
    return " ".join(WORDS[int(w)] for w in words)
