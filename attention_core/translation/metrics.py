"""Sequence metrics: exact match and token accuracy, overall and by source-length bucket.

- **Exact match**: the predicted digits, up to ``<eos>``, equal the target.
- **Token accuracy**: position by position over the target followed by ``<eos>``: the fraction of
  positions ``i <= len(target)`` where ``prediction[i]`` (with ``<eos>`` appended) equals ``target[i]``
  (with ``<eos>`` appended). A missing position counts as wrong, so stopping early or late costs tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

import torch
from torch import nn

from attention_core._checks import check_instance
from attention_core.translation.data import EOS, NumberWords, Pair, Vocab, _check_tokens, batches, length_buckets
from attention_core.translation.protocol import EncoderDecoder
from attention_core.translation.rnn import greedy_decode

__all__ = [
    "BUCKET_EDGES",
    "TEST_SEED",
    "TEST_SIZE",
    "VALIDATION_SEED",
    "VALIDATION_SIZE",
    "BucketScore",
    "Evaluation",
    "book_test_set",
    "book_validation_set",
    "evaluate",
    "evaluate_by_bucket",
    "exact_match",
    "seen_in_training",
    "token_accuracy",
]

#: Source-length buckets of the book's length experiments, [1, 6), [6, 11), [11, 16), [16, 21), [21, 28).
BUCKET_EDGES = (1, 6, 11, 16, 21, 28)
#: The fixed test set of chapters 3, 4 and 8 is ``NumberWords().sample(TEST_SIZE, TEST_SEED)``.
TEST_SIZE, TEST_SEED = 2000, 2024
#: The validation set (model selection) is drawn with its own seed, then cleared of test pairs.
VALIDATION_SIZE, VALIDATION_SEED = 500, 2025


def _with_eos(tokens: Sequence[str]) -> List[str]:
    return [*tokens, EOS]


def exact_match(prediction: Sequence[str], target: Sequence[str]) -> bool:
    """True when the predicted tokens equal the target tokens."""
    _check_tokens(prediction, "prediction")
    _check_tokens(target, "target")
    return list(prediction) == list(target)


def token_accuracy(prediction: Sequence[str], target: Sequence[str]) -> float:
    """Fraction of the ``len(target) + 1`` positions (counting ``<eos>``) predicted right."""
    _check_tokens(prediction, "prediction")
    _check_tokens(target, "target")
    gold, pred = _with_eos(target), _with_eos(prediction)
    return sum(int(i < len(pred) and pred[i] == g) for i, g in enumerate(gold)) / len(gold)


@dataclass(frozen=True)
class BucketScore:
    """Scores of the examples whose source length lies in ``[low, high)``."""

    low: int
    high: int
    count: int
    exact_match: float
    token_accuracy: float

    @property
    def label(self) -> str:
        return f"{self.low}-{self.high - 1}"


@dataclass
class Evaluation:
    """Per-example results of a greedy decode over a test set.

    Attributes:
        src_lens: source length of every example (tokens).
        exact: exact match of every example.
        token_acc: token accuracy of every example.
        predictions: predicted target tokens of every example.
    """

    src_lens: List[int]
    exact: List[bool]
    token_acc: List[float]
    predictions: List[List[str]]

    @property
    def exact_match(self) -> float:
        return sum(self.exact) / len(self.exact)

    @property
    def token_accuracy(self) -> float:
        return sum(self.token_acc) / len(self.token_acc)

    def by_bucket(self, edges: Sequence[int]) -> List[BucketScore]:
        """Scores per source-length bucket ``[edges[i], edges[i + 1])``; empty buckets get NaN scores."""
        idx = length_buckets(self.src_lens, edges)
        rows = []
        for b in range(len(edges) - 1):
            members = [i for i, k in enumerate(idx) if k == b]
            n = len(members)
            em = sum(self.exact[i] for i in members) / n if n else float("nan")
            ta = sum(self.token_acc[i] for i in members) / n if n else float("nan")
            rows.append(BucketScore(edges[b], edges[b + 1], n, em, ta))
        return rows


def evaluate(model: EncoderDecoder, pairs: Sequence[Pair], src_vocab: Optional[Vocab] = None,
             tgt_vocab: Optional[Vocab] = None, batch_size: int = 500, max_len: Optional[int] = None,
             device: Optional[torch.device] = None) -> Evaluation:
    """Greedy-decode every source in ``pairs`` and score it against its target.

    Args:
        model: a trained :class:`~attention_core.translation.EncoderDecoder` (RNN or Transformer).
        pairs: ``(source tokens, target tokens)`` examples.
        src_vocab, tgt_vocab: the task's vocabularies (default: those of :class:`NumberWords`).
        batch_size: examples decoded at once.
        max_len: most tokens to decode (default: longest target + 2).
        device: where to run (default: the model's device).
    """
    check_instance(model, nn.Module, "model", "a translation model (an nn.Module)")
    if len(pairs) == 0:
        raise ValueError("pairs must hold at least one example, got 0")
    if src_vocab is None or tgt_vocab is None:
        task = NumberWords()
        src_vocab, tgt_vocab = src_vocab or task.src_vocab, tgt_vocab or task.tgt_vocab
    device = device or next(model.parameters()).device
    max_len = max_len or max(len(t) for _, t in pairs) + 2
    preds: List[List[str]] = []
    stream: Iterable = batches(pairs, src_vocab, tgt_vocab, batch_size)
    for batch in stream:
        batch = batch.to(device)
        result = greedy_decode(model, batch.src, batch.src_valid_lens, max_len=max_len)
        preds += [tgt_vocab.decode(row) for row in result.tokens.tolist()]
    golds = [t for _, t in pairs]
    return Evaluation(
        src_lens=[len(s) for s, _ in pairs],
        exact=[exact_match(p, g) for p, g in zip(preds, golds)],
        token_acc=[token_accuracy(p, g) for p, g in zip(preds, golds)],
        predictions=preds,
    )


def book_test_set(n: int = TEST_SIZE, seed: int = TEST_SEED) -> List[Pair]:
    """The fixed test set of the length experiments: ``NumberWords().sample(n, seed)`` (2,000 pairs by default)."""
    return NumberWords().sample(n, seed)


def book_validation_set(n: int = VALIDATION_SIZE, seed: int = VALIDATION_SEED) -> List[Pair]:
    """The validation set on which the chapters choose between models: ``n`` pairs drawn with ``seed``, none of
    them in :func:`book_test_set` (short numbers repeat, so a plain draw would share pairs with the test set;
    removing them tilts this set slightly towards longer numbers)."""
    in_test = {(tuple(s), tuple(t)) for s, t in book_test_set()}
    pairs: List[Pair] = []
    draw = n
    while len(pairs) < n:  # draw more until n pairs outside the test set remain
        draw += n
        pairs = [p for p in NumberWords().sample(draw, seed) if (tuple(p[0]), tuple(p[1])) not in in_test]
    return pairs[:n]


def evaluate_by_bucket(model: EncoderDecoder, pairs: Sequence[Pair], edges: Sequence[int] = BUCKET_EDGES,
                       batch_size: int = 500, device: Optional[torch.device] = None) -> dict:
    """Greedy-decode ``pairs`` in batches and score them overall and per source-length bucket.

    Works for any model with the interface of :class:`~attention_core.translation.rnn.Seq2Seq` (``encode``,
    ``decoder.init_state``, ``decoder.step``, ``has_attention``), the Transformer of
    :mod:`attention_core.translation.transformer` included. Uses the vocabularies of :class:`NumberWords`.

    Args:
        model: a trained model.
        pairs: ``(source words, target digits)`` examples, e.g. :func:`book_test_set`.
        edges: increasing bucket edges; bucket ``i`` holds sources with ``edges[i] <= length < edges[i + 1]``.
        batch_size: examples decoded at once.
        device: where to run (default: the model's device).

    Returns:
        dict: ``{"edges": [...], "count": n, "exact_match": float, "token_accuracy": float, "buckets": [...]}``,
        where a bucket is ``{"label": "21-27", "low": 21, "high": 28, "count": int, "exact_match": float,
        "token_accuracy": float}``; an empty bucket has NaN scores.
    """
    check_instance(model, nn.Module, "model", "a translation model (an nn.Module)")
    ev = evaluate(model, pairs, batch_size=batch_size, device=device)
    return {
        "edges": list(edges),
        "count": len(ev.exact),
        "exact_match": ev.exact_match,
        "token_accuracy": ev.token_accuracy,
        "buckets": [{"label": b.label, "low": b.low, "high": b.high, "count": b.count,
                     "exact_match": b.exact_match, "token_accuracy": b.token_accuracy}
                    for b in ev.by_bucket(edges)],
    }


def seen_in_training(pairs: Sequence[Pair], training: Iterable[Pair], edges: Sequence[int] = BUCKET_EDGES
                     ) -> List[int]:
    """How many of ``pairs`` have a source that also occurs in ``training``, per source-length bucket.

    Args:
        pairs: ``(source words, target digits)`` examples, e.g. :func:`book_test_set`.
        training: the examples a model was trained on, e.g.
            :func:`attention_core.translation.train.training_pairs`.
        edges: increasing bucket edges; bucket ``i`` holds sources with ``edges[i] <= length < edges[i + 1]``.

    Returns:
        list of int: one count per bucket (``len(edges) - 1`` entries); their sum is the number of ``pairs``
        whose source words the model met in training (a source has one target, so the pair was met too).
    """
    met = {tuple(src) for src, _ in training}
    counts = [0] * (len(edges) - 1)
    for src, _ in pairs:
        bucket = length_buckets([len(src)], edges)[0]
        counts[bucket] += tuple(src) in met
    return counts
