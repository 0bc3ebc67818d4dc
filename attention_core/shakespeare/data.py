"""The tiny Shakespeare corpus, character by character: the text, its vocabulary, its split, its batches.

The text (1,115,394 characters of Shakespeare's plays, public domain, the corpus of Karpathy's char-rnn) ships
gzip-compressed inside the package; :func:`load_text` checks the sha256 of the decompressed text before
returning it, so a damaged or replaced file is refused with a message that says so.

- :class:`CharVocab`: one token per distinct character (65 here), sorted, with ``encode``/``decode``.
- :func:`load_corpus`: the text encoded, split **by position** (the first 90% to train on, the last 10% to
  validate on: no validation text is ever a neighbour of a training crop).
- :func:`random_batch`: (inputs, targets) crops of ``context`` characters from a split; targets are the inputs
  shifted by one.
- :func:`unigram_loss`, :func:`bigram_loss`, :func:`ngram_loss`: the cross-entropy of counting baselines
  (a table of how often each character follows the previous ``n - 1``) with add-alpha smoothing, which pulls
  every rare context towards uniform and so handicaps long contexts.
- :func:`discounted_ngram_log_probs`, :func:`discounted_ngram_loss`, :func:`discounted_ngram_losses` (every
  order up to ``n`` in one pass): the same tables with interpolated absolute discounting (each order backs off
  to the next shorter one), the stronger count baseline a language model has to beat.
"""

from __future__ import annotations

import gzip
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple, Union

import torch

from attention_core._checks import check_positive_int, check_real, check_tensor, fmt_shape
from attention_core.models._inputs import check_token_ids

__all__ = [
    "TEXT_FILE",
    "TEXT_SHA256",
    "CharVocab",
    "Corpus",
    "bigram_loss",
    "discounted_ngram_log_probs",
    "discounted_ngram_loss",
    "discounted_ngram_losses",
    "load_corpus",
    "load_text",
    "ngram_loss",
    "random_batch",
    "repeat_random_tokens",
    "unigram_loss",
]

PathLike = Union[str, Path]
#: The shipped corpus (gzip).
TEXT_FILE = Path(__file__).resolve().parent / "data" / "tinyshakespeare.txt.gz"
#: sha256 of the decompressed text (as in the README of the data's source folder).
TEXT_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"


def load_text(path: PathLike = TEXT_FILE, sha256: str = TEXT_SHA256) -> str:
    """The corpus as one string, after checking the sha256 of its bytes.

    Args:
        path: a gzip file (``.gz``) or a plain UTF-8 text file.
        sha256: the expected hex digest of the (decompressed) bytes.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the bytes' sha256 differs from ``sha256``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no corpus file at {path}")
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    seen = hashlib.sha256(raw).hexdigest()
    if seen != sha256:
        raise ValueError(f"corpus {path} has sha256 {seen}, expected {sha256}: the file is damaged or is not the "
                         "tiny Shakespeare text; reinstall the package to restore it")
    return raw.decode("utf-8")


class CharVocab:
    """Characters <-> token ids, one id per distinct character of ``text``, in sorted order."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not text:
            raise ValueError(f"text must be a non-empty str, got {type(text).__name__} of length "
                             f"{len(text) if isinstance(text, str) else 'n/a'}")
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """(len(text),) int64 ids; a character outside the vocabulary raises ``ValueError``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        unknown = sorted(set(text) - self.index.keys())
        if unknown:
            raise ValueError(f"text has characters outside the vocabulary: {unknown[:5]!r}")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        """The text of a 1-D sequence of ids."""
        if not isinstance(ids, torch.Tensor):
            try:
                ids = torch.as_tensor(ids)
            except (TypeError, ValueError, RuntimeError) as err:
                raise TypeError(f"ids must be a sequence or tensor of integers, got {type(ids).__name__}: {err}"
                                ) from None
        if ids.device.type == "meta":
            raise ValueError("ids is a meta tensor: it has no values to decode")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"ids must be integers, got dtype {ids.dtype}")
        ids = ids.flatten().tolist()
        bad = [i for i in ids if not 0 <= i < len(self.chars)]
        if bad:  # a negative id would otherwise wrap around silently
            raise ValueError(f"ids must be in [0, {len(self.chars)}) (the vocabulary's size), got {bad[:5]}")
        return "".join(self.chars[i] for i in ids)


@dataclass
class Corpus:
    """The encoded corpus: ``vocab``, ``train`` (N_train,) and ``val`` (N_val,) int64 ids."""

    vocab: CharVocab
    train: torch.Tensor
    val: torch.Tensor


def load_corpus(val_fraction: float = 0.1, path: PathLike = TEXT_FILE, sha256: str = TEXT_SHA256) -> Corpus:
    """The verified corpus, encoded and split by position: train = the first ``1 - val_fraction``, val = the rest."""
    check_real(val_fraction, "val_fraction", low=0, high=1, low_open=True, high_open=True)
    text = load_text(path, sha256)
    vocab = CharVocab(text)
    ids = vocab.encode(text)
    n_train = int(len(ids) * (1 - val_fraction))
    return Corpus(vocab, ids[:n_train], ids[n_train:])


def random_batch(ids: torch.Tensor, batch_size: int, context: int, generator: Optional[torch.Generator] = None,
                 repeat_fraction: float = 0.0, repeat_periods: Tuple[int, int] = (16, 64)
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random crops of ``context + 1`` ids: inputs (B, context) and targets shifted by one.

    With ``repeat_fraction`` > 0, that share of the rows (on average) is a *repeated* crop instead: a stretch of
    ``p`` ids (``p`` drawn from ``repeat_periods``, both ends included) written again and again, so that from
    the second copy on every next token can be read off its previous occurrence. Such text is what teaches a
    model to copy in context (induction heads); natural text has it too, but rarely within a short context.
    """
    check_tensor(ids, "ids")
    check_positive_int(batch_size, "batch_size")
    check_positive_int(context, "context")
    if ids.dim() != 1 or len(ids) <= context:
        raise ValueError(f"ids must be 1-D and longer than context={context}, got shape {fmt_shape(ids.shape)}")
    check_real(repeat_fraction, "repeat_fraction", low=0, high=1)
    lo, hi = repeat_periods
    if not 1 <= lo <= hi:
        raise ValueError(f"repeat_periods must be (low, high) with 1 <= low <= high, got {repeat_periods!r}")
    starts = torch.randint(0, len(ids) - context, (batch_size,), generator=generator)  # (B,)
    crops = torch.stack([ids[s : s + context + 1] for s in starts.tolist()])  # (B, context + 1)
    if repeat_fraction > 0:
        repeat = torch.rand(batch_size, generator=generator) < repeat_fraction  # (B,)
        periods = torch.randint(lo, hi + 1, (batch_size,), generator=generator)  # (B,)
        for b in repeat.nonzero().flatten().tolist():
            crops[b] = crops[b, torch.arange(context + 1) % periods[b]]  # period-p copy of the crop's start
    return crops[:, :-1], crops[:, 1:]


def repeat_random_tokens(inputs: torch.Tensor, targets: torch.Tensor, vocab_size: int, fraction: float,
                         periods: Tuple[int, int], generator: Optional[torch.Generator] = None
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Replace a share ``fraction`` of the rows of a batch by *random* tokens written again and again.

    Each chosen row becomes ``p`` tokens drawn uniformly from ``vocab_size`` (``p`` from ``periods``, both ends
    included), repeated to the row's length: from the second copy on, every next token can be read off its
    previous occurrence, and *only* that way (random tokens have no other structure to learn). Returns new
    (inputs, targets), targets shifted by one as before.
    """
    check_real(fraction, "fraction", low=0, high=1)
    lo, hi = periods
    if not 1 <= lo <= hi:
        raise ValueError(f"periods must be (low, high) with 1 <= low <= high, got {periods!r}")
    B, L = inputs.shape
    crops = torch.cat([inputs, targets[:, -1:]], dim=1)  # (B, L + 1)
    chosen = torch.rand(B, generator=generator) < fraction  # (B,)
    p = torch.randint(lo, hi + 1, (B,), generator=generator)  # (B,)
    noise = torch.randint(0, vocab_size, (B, hi), generator=generator)  # (B, hi)
    for b in chosen.nonzero().flatten().tolist():
        crops[b] = noise[b, torch.arange(L + 1) % p[b]]
    return crops[:, :-1], crops[:, 1:]


def _check_ids(ids: object, name: str, vocab_size: int) -> None:
    check_positive_int(vocab_size, "vocab_size")
    check_token_ids(ids, name, vocab_size, dtypes=(torch.int64, torch.int32), rank=1)


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab_size: int, alpha: float = 1.0) -> float:
    """Cross-entropy (nats per character) on ``val`` of the character frequencies of ``train`` (add-alpha)."""
    _check_ids(train, "train", vocab_size)
    _check_ids(val, "val", vocab_size)
    counts = torch.bincount(train, minlength=vocab_size).double() + alpha  # (V,)
    logp = counts.log() - counts.sum().log()
    return float(-logp[val].mean())


def bigram_loss(train: torch.Tensor, val: torch.Tensor, vocab_size: int, alpha: float = 1.0) -> float:
    """Cross-entropy on ``val`` of ``P(next | current)`` counted on ``train`` (add-alpha smoothing)."""
    _check_ids(train, "train", vocab_size)
    _check_ids(val, "val", vocab_size)
    pairs = train[:-1] * vocab_size + train[1:]
    counts = torch.bincount(pairs, minlength=vocab_size**2).double().view(vocab_size, vocab_size) + alpha
    logp = counts.log() - counts.sum(1, keepdim=True).log()  # (V, V): row = current, column = next
    loss = -logp[val[:-1], val[1:]].mean()
    return float(loss) if math.isfinite(float(loss)) else math.inf


def _ngram_rows(train: torch.Tensor, val: torch.Tensor, vocab_size: int, n: int) -> torch.Tensor:
    """The validation rows (B, N) of an n-gram table's loss, after the checks every table makes: ids in the
    vocabulary, ``val`` of rank 1 or 2 with rows of at least 2 ids, ``n >= 1`` with codes that fit in int64, and
    at least ``n`` training ids."""
    _check_ids(train, "train", vocab_size)
    check_token_ids(val, "val", vocab_size, dtypes=(torch.int64, torch.int32), rank=val.dim() if
                    isinstance(val, torch.Tensor) and val.dim() in (1, 2) else 1)
    check_positive_int(n, "n")
    if vocab_size ** n >= 2 ** 62:
        raise ValueError(f"vocab_size ** n must fit in int64 codes, got {vocab_size} ** {n}")
    rows = (val if val.dim() == 2 else val[None]).long()  # (B, N)
    if rows.shape[1] < 2 or len(train) < n:
        raise ValueError(f"val's rows must hold at least 2 ids and train at least n = {n}, got val of shape "
                         f"{fmt_shape(val.shape)} and train of {len(train)}")
    return rows


def ngram_loss(train: torch.Tensor, val: torch.Tensor, vocab_size: int, n: int, alpha: float = 1.0) -> float:
    """Cross-entropy (nats per character) on ``val`` of ``P(next | up to n - 1 previous)`` counted on ``train``.

    ``val`` is one text (N,) or a batch of separate texts (B, N), as a language model is evaluated on blocks:
    every character after the first of each row is predicted from the ``n - 1`` characters before it **in its
    row**, or from all of them near the row's start (the table of that shorter order), so the table never sees
    more than a model reading the same rows. Add-``alpha`` smoothing:
    ``(count(context, next) + alpha) / (count(context) + alpha * vocab_size)``; a context never seen in ``train``
    predicts uniformly. ``n = 2`` is :func:`bigram_loss`; ``n = 1`` is :func:`unigram_loss` on ``val[1:]``.
    Counts are kept sparse (only the n-grams that occur in ``train``). Add-alpha gives every context
    ``alpha * vocab_size`` pseudo-counts whatever its count, so rare long contexts are pulled towards uniform and
    a longer table can score worse than a shorter one; :func:`discounted_ngram_loss` smooths them properly.
    """
    rows = _ngram_rows(train, val, vocab_size, n)  # (B, N)
    check_real(alpha, "alpha", low=0, low_open=True)

    def codes(windows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(..., k + 1) windows -> base-V codes of their first k ids and of all k + 1."""
        k = windows.shape[-1] - 1
        context = torch.zeros(windows.shape[:-1], dtype=torch.long)
        for j in range(k):
            context = context * vocab_size + windows[..., j]
        return context, context * vocab_size + windows[..., k]

    def counts_of(table: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        keys, counts = torch.unique(table, return_counts=True)  # sorted
        at = torch.searchsorted(keys, queries).clamp(max=len(keys) - 1)
        return torch.where(keys[at] == queries, counts[at], 0).double()

    N, nll, predicted = rows.shape[1], 0.0, 0
    for k in range(n):  # k = characters of context; k < n - 1 only at position k of a row
        first, last = max(k, 1), (N - 1 if k == n - 1 else min(k, N - 1))  # positions predicted with k
        if first > last:
            continue
        seen_ctx, seen_full = codes(train.long().unfold(0, k + 1, 1))  # (T - k,)
        ctx, full = codes(rows.unfold(1, k + 1, 1)[:, first - k : last - k + 1])  # (B, last - first + 1)
        p = (counts_of(seen_full, full.flatten()) + alpha) / (counts_of(seen_ctx, ctx.flatten()) + alpha * vocab_size)
        nll, predicted = nll - float(p.log().sum()), predicted + p.numel()
    return nll / predicted


def _lookup(keys: torch.Tensor, counts: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """``counts`` of ``queries`` in the sorted unique ``keys`` (0 where absent), as float64."""
    queries = queries.contiguous()
    at = torch.searchsorted(keys, queries).clamp(max=len(keys) - 1)
    return torch.where(keys[at] == queries, counts[at], 0).double()


def discounted_ngram_log_probs(train: torch.Tensor, val: torch.Tensor, vocab_size: int, n: int,
                               discount: float = 0.75) -> torch.Tensor:
    """Log ``P(next | up to n - 1 previous)`` of every predicted character of ``val``: (B, N - 1), or (N - 1,).

    Interpolated absolute discounting (Ney, Essen and Kneser 1994, as surveyed by Chen and Goodman 1998), counted
    on ``train``. With ``c`` the counts in ``train``, for a context ``h`` of ``k >= 1`` characters seen at least
    once (as the start of a ``(k + 1)``-gram), and ``h'`` the same context without its first character::

        P(x | h) = max(c(h x) - D, 0) / c(h .) + D * N(h .) / c(h .) * P(x | h')

    where ``c(h .)`` is the number of times ``h`` is followed by something and ``N(h .)`` the number of
    distinct characters that follow it; a context never seen uses ``P(x | h')`` unchanged. The recursion ends in
    the add-one unigram ``(c(x) + 1) / (len(train) + vocab_size)``, so every probability is positive and, for
    ``0 < D <= 1``, each context's probabilities sum to 1 over the vocabulary. ``n = 1`` is that unigram.

    ``val`` is one text (N,) or separate rows (B, N), read as :func:`ngram_loss` reads them: each character after
    a row's first is predicted from the ``n - 1`` characters before it in its row, or from all of them near the
    row's start.
    """
    *_, logp = _discounted_orders(train, val, vocab_size, n, discount)  # orders 1 .. n, each from the one before
    return logp if val.dim() == 2 else logp[0]


def _discounted_orders(train: torch.Tensor, val: torch.Tensor, vocab_size: int, n: int, discount: float
                       ) -> Iterator[torch.Tensor]:
    """Yield the (B, N - 1) log-probabilities of :func:`discounted_ngram_log_probs` for orders 1, 2, .., n."""
    rows = _ngram_rows(train, val, vocab_size, n)  # (B, N)
    D = check_real(discount, "discount", low=0, high=1, low_open=True)
    train = train.long()
    unigram = torch.bincount(train, minlength=vocab_size).double() + 1  # (V,)
    p = (unigram / unigram.sum())[rows[:, 1:]]  # (B, N - 1): order 1 (no context), for every predicted character
    yield p.log()
    seen, asked = train, rows  # base-V codes of the k-character windows of train and of the rows
    for k in range(1, n):  # k characters of context; the targets at positions >= k have them
        if k < rows.shape[1]:
            seen_ctx, asked_ctx = seen[:-1], asked[:, :-1]  # contexts: windows of k characters followed by one
            seen = seen_ctx * vocab_size + train[k:]  # (T - k,): the (k + 1)-grams
            asked = asked_ctx * vocab_size + rows[:, k:]  # (B, N - k): target at position k + i
            full_keys, full_counts = torch.unique(seen, return_counts=True)  # sorted
            ctx_keys, inverse, followers = torch.unique_consecutive(full_keys // vocab_size, return_inverse=True,
                                                                    return_counts=True)  # followers: N(h .)
            ctx_counts = torch.zeros(len(ctx_keys), dtype=torch.long).index_add_(0, inverse, full_counts)  # c(h .)
            c_h, c_hx = _lookup(ctx_keys, ctx_counts, asked_ctx), _lookup(full_keys, full_counts, asked)
            lower = p[:, k - 1 :]
            mixed = (((c_hx - D).clamp(min=0) + D * _lookup(ctx_keys, followers, asked_ctx) * lower)
                     / c_h.clamp(min=1))
            p = torch.cat([p[:, : k - 1], torch.where(c_h > 0, mixed, lower)], dim=1)
        yield p.log()


def discounted_ngram_loss(train: torch.Tensor, val: torch.Tensor, vocab_size: int, n: int,
                          discount: float = 0.75) -> float:
    """Cross-entropy (nats per character) on ``val`` of :func:`discounted_ngram_log_probs`' table."""
    return float(-discounted_ngram_log_probs(train, val, vocab_size, n, discount).mean())


def discounted_ngram_losses(train: torch.Tensor, val: torch.Tensor, vocab_size: int, max_n: int,
                            discount: float = 0.75) -> Dict[int, float]:
    """``{n: discounted_ngram_loss(train, val, vocab_size, n, discount)}`` for n = 1 .. ``max_n``, counted in
    one pass (each order's table is built once and reused by the longer ones)."""
    return {n: float(-logp.mean()) for n, logp in enumerate(_discounted_orders(train, val, vocab_size, max_n,
                                                                               discount), start=1)}
