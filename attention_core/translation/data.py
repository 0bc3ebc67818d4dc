"""A synthetic translation task for the RNN chapters: English number words -> digits.

The task, generated on the fly from a seed (nothing is downloaded)::

    three hundred and forty - two million five thousand and seven   ->   3 4 2 0 0 5 0 0 7

Generator
    ``NumberWords.pair(rng)`` draws a digit count ``d`` uniformly from ``1..max_digits`` (default 12), a
    leading digit in ``1..9`` (``0..9`` when ``d == 1``) and every further digit independently: ``0`` with
    probability ``zero_prob`` (default 0.25, so that "missing" groups such as *three million and five* are
    common), otherwise uniform in ``1..9``. The number is written in words in one of two styles, chosen per
    example: British with "and" (``"one hundred and five"``, ``"two thousand and one"``; probability
    ``and_prob`` = 0.5) or American without it. Hyphens of compound tens are their own token
    (``"forty - two"``). Scales go up to *billion*, so ``max_digits <= 12``.

Sizes
    Source: word tokens, 1 (``"seven"``) to 27 (``"nine hundred and ninety - nine billion ..."``) tokens,
    about 1.5 words per digit on average (19 words for ``d = 12``, 4.4 for ``d = 3``), so the lengths
    range widely, as the bottleneck experiment needs.
    Target: ``d`` digit tokens (1..12). Vocabularies are closed: 38 source tokens and 14 target tokens,
    both counting the four specials ``<pad>=0, <bos>=1, <eos>=2, <unk>=3``.

The decoder is trained to read ``<bos> y_1 .. y_T`` and predict ``y_1 .. y_T <eos>`` (teacher forcing);
:func:`collate` builds both, padded, with the valid lengths the masks are made from.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence, Tuple

import torch

from attention_core._checks import check_instance, check_int, check_real, check_tensor, fmt_shape, short_repr

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIALS: Tuple[str, ...] = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

ONES: Tuple[str, ...] = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen"
).split()
TENS: Tuple[str, ...] = ("", "", *"twenty thirty forty fifty sixty seventy eighty ninety".split())
SCALES: Tuple[str, ...] = ("", "thousand", "million", "billion")
MAX_DIGITS = 3 * len(SCALES)

Pair = Tuple[List[str], List[str]]


def _is_sequence(x: object) -> bool:
    """A list, tuple or other sequence, but not a string (whose items would be read as tokens)."""
    return isinstance(x, Sequence) and not isinstance(x, (str, bytes))


def _check_tokens(tokens: object, name: str) -> None:
    """Raise ``TypeError`` unless ``tokens`` is a sequence (not a string) of strings: a sentence as tokens."""
    if not _is_sequence(tokens):
        raise TypeError(f"{name} must be a list of str tokens, got {type(tokens).__name__} {short_repr(tokens)}")
    for j, t in enumerate(tokens):
        if not isinstance(t, str):
            raise TypeError(f"{name}[{j}] must be a str token, got {type(t).__name__} {short_repr(t)}")


class Vocab:
    """A closed token <-> id map whose first four ids are ``<pad>, <bos>, <eos>, <unk>``.

    Args:
        tokens: the non-special tokens, in id order (duplicates and specials are dropped).
    """

    def __init__(self, tokens: Sequence[str]) -> None:
        self.itos: List[str] = list(SPECIALS)
        for tok in tokens:
            if tok not in self.itos:
                self.itos.append(tok)
        self.stoi: Dict[str, int] = {t: i for i, t in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __len__(self) -> int:
        return len(self.itos)

    def __repr__(self) -> str:
        return f"Vocab({len(self)} tokens: {' '.join(self.itos[:8])} ...)"

    def encode(self, tokens: Sequence[str]) -> List[int]:
        """Token ids; unknown tokens map to ``<unk>``.

        Raises:
            TypeError: ``tokens`` is not a list of str tokens (a str is refused: split it into tokens first).
        """
        _check_tokens(tokens, "tokens")
        return [self.stoi.get(t, UNK_ID) for t in tokens]

    def decode(self, ids: Sequence[int]) -> List[str]:
        """Tokens up to the first ``<eos>``, without ``<pad>`` and ``<bos>``; an id outside ``0 .. len(self) - 1``
        (a model's output over a larger vocabulary, say) decodes to ``<unk>``. Its argument is not checked."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            if i not in (PAD_ID, BOS_ID):
                out.append(self.itos[i] if 0 <= i < len(self.itos) else UNK)
        return out


def group_to_words(group: int, use_and: bool) -> List[str]:
    """Words for ``0 < group < 1000``: ``105 -> ['one', 'hundred', 'and', 'five']`` (with ``use_and``)."""
    if not 0 < group < 1000:
        raise ValueError(f"group must be in 1..999, got {group}")
    words: List[str] = []
    hundreds, rest = divmod(group, 100)
    if hundreds:
        words += [ONES[hundreds], "hundred"]
        if rest and use_and:
            words.append("and")
    if rest >= 20:
        words.append(TENS[rest // 10])
        if rest % 10:
            words += ["-", ONES[rest % 10]]
    elif rest:
        words.append(ONES[rest])
    return words


def number_to_words(n: int, use_and: bool = True) -> List[str]:
    """English words for ``0 <= n < 10**12`` as tokens, e.g. ``2001 -> two thousand and one``.

    With ``use_and`` (British style) "and" follows "hundred" and precedes a final group below 100 when a
    higher group exists; without it (American style) no "and" appears.
    """
    check_int(n, "n", low=0, high=10**MAX_DIGITS, high_open=True)
    if n == 0:
        return ["zero"]
    groups = [(n // 1000**i) % 1000 for i in range(len(SCALES))]  # units, thousands, millions, billions
    words: List[str] = []
    for i in reversed(range(len(SCALES))):
        if groups[i] == 0:
            continue
        if i == 0 and use_and and n >= 1000 and groups[0] < 100:
            words.append("and")
        words += group_to_words(groups[i], use_and)
        if SCALES[i]:
            words.append(SCALES[i])
    return words


class NumberWords:
    """The number-words -> digits task (see the module docstring for the generator and sizes).

    Args:
        max_digits: largest digit count, ``1..12``.
        zero_prob: probability that a non-leading digit is 0.
        and_prob: probability that an example uses the British style with "and".
    """

    def __init__(self, max_digits: int = 12, zero_prob: float = 0.25, and_prob: float = 0.5) -> None:
        check_int(max_digits, "max_digits", low=1, high=MAX_DIGITS)
        zero_prob = check_real(zero_prob, "zero_prob", low=0.0, high=1.0)  # a probability; a bool is refused
        and_prob = check_real(and_prob, "and_prob", low=0.0, high=1.0)
        self.max_digits, self.zero_prob, self.and_prob = max_digits, zero_prob, and_prob
        self.src_vocab = Vocab([*ONES, *TENS[2:], "hundred", *SCALES[1:], "and", "-"])
        self.tgt_vocab = Vocab([str(d) for d in range(10)])

    def __repr__(self) -> str:
        return (f"NumberWords(max_digits={self.max_digits}, zero_prob={self.zero_prob}, "
                f"and_prob={self.and_prob})")

    def number(self, rng: random.Random) -> int:
        """Draw one number: digit count uniform in ``1..max_digits``, then the digits."""
        check_instance(rng, random.Random, "rng", "a random.Random")
        d = rng.randint(1, self.max_digits)
        if d == 1:
            return rng.randint(0, 9)
        digits = [rng.randint(1, 9)]
        for _ in range(d - 1):
            digits.append(0 if rng.random() < self.zero_prob else rng.randint(1, 9))
        return int("".join(map(str, digits)))

    def pair(self, rng: random.Random) -> Pair:
        """One ``(source words, target digits)`` example (``rng`` is checked by :meth:`number`, its first use)."""
        n = self.number(rng)
        use_and = rng.random() < self.and_prob
        return number_to_words(n, use_and), list(str(n))

    def sample(self, n: int, seed: int) -> List[Pair]:
        """``n`` examples, the same for the same ``seed`` (Python's ``random.Random``)."""
        check_int(n, "n", low=0, note="(examples)")
        check_int(seed, "seed")
        rng = random.Random(seed)
        return [self.pair(rng) for _ in range(n)]

    def stream(self, batch_size: int, seed: int) -> Iterator[Batch]:
        """An endless iterator of freshly generated, collated batches (its arguments are checked at the call)."""
        check_int(batch_size, "batch_size", low=1)
        check_int(seed, "seed")
        return self._batches(batch_size, random.Random(seed))

    def _batches(self, batch_size: int, rng: random.Random) -> Iterator[Batch]:
        while True:
            yield collate([self.pair(rng) for _ in range(batch_size)], self.src_vocab, self.tgt_vocab)


@dataclass
class Batch:
    """A padded batch.

    Attributes:
        src: (B, S) int64 source ids, padded with ``<pad>``.
        src_valid_lens: (B,) int64 true source lengths.
        tgt_in: (B, T) int64 decoder inputs ``<bos> y_1 .. y_{T-1}``.
        tgt_out: (B, T) int64 decoder targets ``y_1 .. <eos>``, padded with ``<pad>``.
        tgt_valid_lens: (B,) int64 target lengths counting ``<eos>``.
    """

    src: torch.Tensor
    src_valid_lens: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor
    tgt_valid_lens: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(t.to(device) for t in (self.src, self.src_valid_lens, self.tgt_in, self.tgt_out,
                                              self.tgt_valid_lens)))

    def __len__(self) -> int:
        return self.src.shape[0]


def pad(seqs: Sequence[Sequence[int]], value: int = PAD_ID) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-pad id lists into a (B, max_len) int64 tensor; also return the (B,) valid lengths."""
    check_int(value, "value", low=0, note="(the padding id)")
    if not _is_sequence(seqs):
        raise TypeError(f"seqs must be a list of id lists, got {type(seqs).__name__} {short_repr(seqs)}")
    if len(seqs) == 0:
        raise ValueError("seqs must hold at least one sequence, got 0")
    for i, s in enumerate(seqs):
        if not _is_sequence(s):
            raise TypeError(f"seqs[{i}] must be a list of ints >= 0 (token ids), got {type(s).__name__} "
                            f"{short_repr(s)}")
        for j, t in enumerate(s):
            check_int(t, f"seqs[{i}][{j}]", low=0, note="(a token id)")
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    out = torch.full((len(seqs), max(1, int(lens.max()))), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    return out, lens


def collate(pairs: Sequence[Pair], src_vocab: Vocab, tgt_vocab: Vocab) -> Batch:
    """Encode, add ``<bos>``/``<eos>`` to the target and pad: a list of pairs -> :class:`Batch`."""
    check_instance(src_vocab, Vocab, "src_vocab", "a Vocab")
    check_instance(tgt_vocab, Vocab, "tgt_vocab", "a Vocab")
    if not _is_sequence(pairs):
        raise TypeError(f"pairs must be a list of (source tokens, target tokens) pairs, got "
                        f"{type(pairs).__name__} {short_repr(pairs)}")
    for i, pair in enumerate(pairs):
        if not _is_sequence(pair) or len(pair) != 2:
            raise TypeError(f"pairs[{i}] must be a (source tokens, target tokens) pair, got "
                            f"{type(pair).__name__} {short_repr(pair)}")
        _check_tokens(pair[0], f"pairs[{i}][0]")
        _check_tokens(pair[1], f"pairs[{i}][1]")
    src, src_lens = pad([src_vocab.encode(s) for s, _ in pairs])
    tgt_ids = [tgt_vocab.encode(t) for _, t in pairs]
    tgt_in, _ = pad([[BOS_ID, *t] for t in tgt_ids])
    tgt_out, tgt_lens = pad([[*t, EOS_ID] for t in tgt_ids])
    return Batch(src, src_lens, tgt_in, tgt_out, tgt_lens)


def batches(pairs: Sequence[Pair], src_vocab: Vocab, tgt_vocab: Vocab, batch_size: int,
            shuffle: bool = False, seed: int = 0) -> Iterator[Batch]:
    """Collated batches over a fixed list of pairs, in order or shuffled by ``seed``."""
    check_int(batch_size, "batch_size", low=1)
    order = list(range(len(pairs)))
    if shuffle:
        random.Random(seed).shuffle(order)
    for start in range(0, len(order), batch_size):
        yield collate([pairs[i] for i in order[start:start + batch_size]], src_vocab, tgt_vocab)


def length_buckets(lengths: Sequence[int], edges: Sequence[int]) -> List[int]:
    """Bucket index of each length: bucket ``i`` holds ``edges[i] <= length < edges[i + 1]``."""
    if list(edges) != sorted(edges) or len(edges) < 2:
        raise ValueError(f"edges must be increasing with at least two entries, got {list(edges)}")
    out = []
    for n in lengths:
        if not edges[0] <= n < edges[-1]:
            raise ValueError(f"length {n} is outside the bucket edges [{edges[0]}, {edges[-1]})")
        out.append(max(i for i in range(len(edges) - 1) if edges[i] <= n))
    return out


def check_source_batch(src: object, src_valid_lens: object) -> tuple[int, int]:
    """Validate a batch of source ids for the encoder-decoders; return its (B, S).

    ``src`` must be (B, S) int64 ids and ``src_valid_lens`` (B,) integers in [1, S]: row b's first
    ``src_valid_lens[b]`` ids are real, the rest padding.
    """
    check_tensor(src, "src")
    check_tensor(src_valid_lens, "src_valid_lens")
    if src.dim() != 2 or src.dtype != torch.long:
        raise ValueError(f"src must be (B, S) int64 ids, got shape {fmt_shape(src.shape)} dtype {src.dtype}")
    B, S = src.shape
    if src_valid_lens.shape != (B,) or src_valid_lens.is_floating_point():
        raise ValueError(f"src_valid_lens must be (B,) = ({B},) integers, got shape "
                         f"{fmt_shape(src_valid_lens.shape)} dtype {src_valid_lens.dtype}")
    if B and (int(src_valid_lens.min()) < 1 or int(src_valid_lens.max()) > S):
        raise ValueError(f"src_valid_lens must lie in [1, S={S}] (the encoder output has {S} positions), "
                         f"got {src_valid_lens.tolist()}")
    return B, S
