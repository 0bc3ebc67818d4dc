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

from attention_core.seq2seq import Seq2Seq, greedy_decode
from attention_core.seq2seq_data import EOS, Pair, Vocab, batches, length_buckets

__all__ = ["BucketScore", "Evaluation", "evaluate", "exact_match", "token_accuracy"]


def _with_eos(tokens: Sequence[str]) -> List[str]:
    return [*tokens, EOS]


def exact_match(prediction: Sequence[str], target: Sequence[str]) -> bool:
    """True when the predicted tokens equal the target tokens."""
    return list(prediction) == list(target)


def token_accuracy(prediction: Sequence[str], target: Sequence[str]) -> float:
    """Fraction of the ``len(target) + 1`` positions (counting ``<eos>``) predicted right."""
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


def evaluate(model: Seq2Seq, pairs: Sequence[Pair], src_vocab: Vocab, tgt_vocab: Vocab, batch_size: int = 500,
             max_len: Optional[int] = None, device: Optional[torch.device] = None) -> Evaluation:
    """Greedy-decode every source in ``pairs`` and score it against its target.

    Args:
        model: a trained :class:`~attention_core.seq2seq.Seq2Seq`.
        pairs: ``(source tokens, target tokens)`` examples.
        src_vocab, tgt_vocab: the task's vocabularies.
        batch_size: examples decoded at once.
        max_len: most tokens to decode (default: longest target + 2).
        device: where to run (default: the model's device).
    """
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
