"""A sentence-classification task whose deciding token is planted, so explanations can be checked against it.

Every sentence is 6 to 14 words drawn uniformly from :data:`FILLERS` (words that say nothing about the label),
with exactly one cue word planted at a uniform position: a word of :data:`POSITIVE` (label 1) or of
:data:`NEGATIVE` (label 0), each with probability 1/2. Nothing else carries the label, so a faithful
explanation of a correct prediction must point at the cue. Real reviews are not like this (many words carry
weight, negation flips them); the task is designed so that the ground truth is known.

Ids: 0 is ``<pad>``; then the fillers, the positive cues, the negative cues (:data:`VOCAB`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence

import torch

from attention_core._checks import check_int, short_repr

__all__ = [
    "FILLERS",
    "NEGATIVE",
    "POSITIVE",
    "VOCAB",
    "SentenceBatch",
    "Example",
    "collate",
    "sample",
    "stream",
    "test_set",
]

#: The words that say nothing about the label.
FILLERS = ("the", "a", "film", "plot", "actor", "scene", "music", "story", "was", "is", "and", "with", "of",
           "this", "that", "it", "in", "camera", "ending", "cast", "script", "long", "old", "new", "night", "city",
           "house", "friend", "very", "quite")
#: Cue words of label 1.
POSITIVE = ("good", "great", "superb", "lovely", "brilliant", "fine")
#: Cue words of label 0.
NEGATIVE = ("bad", "awful", "dull", "poor", "weak", "boring")
#: Every token by id (``<pad>``, the fillers, the positive cues, the negative cues).
VOCAB: List[str] = ["<pad>", *FILLERS, *POSITIVE, *NEGATIVE]
WORD_ID: Dict[str, int] = {w: i for i, w in enumerate(VOCAB)}
MIN_LEN, MAX_LEN = 6, 14
TEST_SEED = 2019


@dataclass(frozen=True)
class Example:
    """One sentence: its words, its label (1 positive, 0 negative) and the cue's position."""

    words: tuple
    label: int
    cue: int


@dataclass
class SentenceBatch:
    """A padded batch: ids (B, S) int64, valid_lens (B,), labels (B,), cue positions (B,)."""

    ids: torch.Tensor
    valid_lens: torch.Tensor
    labels: torch.Tensor
    cues: torch.Tensor


def _example(rng: random.Random) -> Example:
    n = rng.randint(MIN_LEN, MAX_LEN)
    words = [rng.choice(FILLERS) for _ in range(n - 1)]
    label = rng.randint(0, 1)
    cue = rng.randint(0, n - 1)
    words.insert(cue, rng.choice(POSITIVE if label else NEGATIVE))
    return Example(tuple(words), label, cue)


def sample(n: int, seed: int) -> List[Example]:
    """``n`` examples from ``random.Random(seed)``."""
    check_int(n, "n", low=0, note="(examples)")
    check_int(seed, "seed")
    rng = random.Random(seed)
    return [_example(rng) for _ in range(n)]


def test_set(n: int = 1000, seed: int = TEST_SEED) -> List[Example]:
    """The held-out examples the chapter measures on (a seed no recipe trains with)."""
    return sample(n, seed)


def collate(examples: Sequence[Example]) -> SentenceBatch:
    """Pad a list of examples into a :class:`SentenceBatch`."""
    if isinstance(examples, (str, bytes)) or not all(isinstance(e, Example) for e in examples):
        raise TypeError(f"examples must be a sequence of Example, got {short_repr(examples)}")
    if not examples:
        raise ValueError("examples is empty")
    S = max(len(e.words) for e in examples)
    ids = torch.zeros(len(examples), S, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.words)] = torch.tensor([WORD_ID[w] for w in e.words])
    return SentenceBatch(ids, torch.tensor([len(e.words) for e in examples]), torch.tensor([e.label for e in examples]),
                         torch.tensor([e.cue for e in examples]))


def stream(batch_size: int, seed: int) -> Iterator[SentenceBatch]:
    """Endless training batches from ``random.Random(seed)``."""
    check_int(batch_size, "batch_size", low=1)
    check_int(seed, "seed")
    rng = random.Random(seed)
    while True:
        yield collate([_example(rng) for _ in range(batch_size)])
