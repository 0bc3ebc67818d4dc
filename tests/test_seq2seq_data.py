"""The number-words -> digits task: words, vocabularies, padding, batching, buckets."""

from __future__ import annotations

import pytest
import torch

from attention_core.translation.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    NumberWords,
    Vocab,
    batches,
    collate,
    length_buckets,
    number_to_words,
    pad,
)


@pytest.mark.parametrize(
    ("n", "use_and", "words"),
    [
        (0, True, "zero"),
        (7, True, "seven"),
        (42, False, "forty - two"),
        (105, True, "one hundred and five"),
        (105, False, "one hundred five"),
        (2001, True, "two thousand and one"),
        (2001, False, "two thousand one"),
        (3_000_005, True, "three million and five"),
        (342_017_905, True, "three hundred and forty - two million seventeen thousand nine hundred and five"),
    ],
)
def test_number_to_words(n: int, use_and: bool, words: str) -> None:
    assert " ".join(number_to_words(n, use_and)) == words


def test_number_to_words_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match=r"^n must be .*, got -1$"):
        number_to_words(-1)
    with pytest.raises(TypeError, match=r"^n must be .*, got float 1.5$"):
        number_to_words(1.5)  # type: ignore[arg-type]


def test_longest_source_has_27_tokens() -> None:
    assert len(number_to_words(999_999_999_999)) == 27


def test_vocab_roundtrip_and_specials() -> None:
    vocab = Vocab(["a", "b", "a"])
    assert len(vocab) == 6 and vocab.itos[:4] == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert vocab.encode(["a", "zzz"]) == [4, 3]
    assert vocab.decode([BOS_ID, 4, 5, EOS_ID, 4]) == ["a", "b"]


def test_task_is_seeded_and_covers_every_length() -> None:
    task = NumberWords()
    assert task.sample(50, seed=3) == task.sample(50, seed=3)
    assert task.sample(50, seed=3) != task.sample(50, seed=4)
    pairs = task.sample(3000, seed=0)
    lens = [len(s) for s, _ in pairs]
    assert min(lens) == 1 and max(lens) >= 24
    assert {len(t) for _, t in pairs} == set(range(1, 13))
    for src, tgt in pairs[:200]:  # the source words spell the target number
        assert int("".join(tgt)) >= 0 and all(w in task.src_vocab.stoi for w in src)
        assert " ".join(number_to_words(int("".join(tgt)), "and" in src)) == " ".join(src)
    assert len(task.src_vocab) == 38 and len(task.tgt_vocab) == 14


def test_task_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match=r"^max_digits must be .*, got 13$"):
        NumberWords(max_digits=13)
    with pytest.raises(ValueError, match=r"^zero_prob must be a float in \[0.0, 1.0\], got 1.5$"):
        NumberWords(zero_prob=1.5)


def test_pad_and_collate() -> None:
    ids, lens = pad([[5, 6, 7], [8]])
    assert ids.tolist() == [[5, 6, 7], [8, PAD_ID, PAD_ID]] and lens.tolist() == [3, 1]
    task = NumberWords()
    b = collate([(["seven"], ["7"]), (["forty", "-", "two"], ["4", "2"])], task.src_vocab, task.tgt_vocab)
    assert b.src.shape == (2, 3) and b.src_valid_lens.tolist() == [1, 3]
    assert b.tgt_in[:, 0].tolist() == [BOS_ID, BOS_ID]
    assert b.tgt_out.tolist()[0] == [task.tgt_vocab.stoi["7"], EOS_ID, PAD_ID]
    assert b.tgt_valid_lens.tolist() == [2, 3] and b.tgt_in.shape == b.tgt_out.shape
    assert b.src.dtype == torch.long and len(b) == 2


def test_batches_cover_all_pairs_once() -> None:
    task = NumberWords()
    pairs = task.sample(23, seed=0)
    got = list(batches(pairs, task.src_vocab, task.tgt_vocab, batch_size=5, shuffle=True, seed=1))
    assert [len(b) for b in got] == [5, 5, 5, 5, 3]
    assert sum(int(b.src_valid_lens.sum()) for b in got) == sum(len(s) for s, _ in pairs)


def test_stream_is_seeded() -> None:
    task = NumberWords()
    a, b = next(task.stream(8, seed=2)), next(task.stream(8, seed=2))
    assert torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)


def test_length_buckets() -> None:
    assert length_buckets([1, 5, 6, 27], [1, 6, 11, 28]) == [0, 0, 1, 2]
    with pytest.raises(ValueError, match="length 30 is outside"):
        length_buckets([30], [1, 6, 28])


_TASK = NumberWords()


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: pad([[1.5, 2.7]]), TypeError, r"seqs\[0\]\[0\] must be an int >= 0 \(a token id\), got float 1.5"),
    (lambda: pad([[1, -3]]), ValueError, r"seqs\[0\]\[1\] must be an int >= 0 \(a token id\), got -3"),
    (lambda: pad("bad"), TypeError, r"seqs must be a list of id lists, got str 'bad'"),
    (lambda: pad(-3), TypeError, r"seqs must be a list of id lists, got int -3"),
    (lambda: pad([5]), TypeError, r"seqs\[0\] must be a list of ints >= 0 \(token ids\), got int 5"),
    (lambda: pad([[1]], value=-3), ValueError, r"value must be an int >= 0 \(the padding id\), got -3"),
    (lambda: collate([[1.0, 2.0]] * 3, _TASK.src_vocab, _TASK.tgt_vocab), TypeError,
     r"pairs\[0\]\[0\] must be a list of str tokens, got float 1.0"),
    (lambda: collate([[1.0, 2.0]] * 3, [[1.0, 2.0]], [[1.0, 2.0]]), TypeError, r"src_vocab must be a Vocab, got list"),
    (lambda: collate([(["one"], ["1"])], _TASK.src_vocab, "bad"), TypeError, r"tgt_vocab must be a Vocab, got str"),
    (lambda: collate("bad", _TASK.src_vocab, _TASK.tgt_vocab), TypeError, r"pairs must be a list of \(source"),
    (lambda: collate([(["one"],)], _TASK.src_vocab, _TASK.tgt_vocab), TypeError, r"pairs\[0\] must be a \(source"),
    (lambda: collate([("one", ["1"])], _TASK.src_vocab, _TASK.tgt_vocab), TypeError,
     r"pairs\[0\]\[0\] must be a list of str tokens, got str 'one'"),
    (lambda: collate([(["one"], [1])], _TASK.src_vocab, _TASK.tgt_vocab), TypeError,
     r"pairs\[0\]\[1\]\[0\] must be a str token, got int 1"),
    (lambda: next(batches(_TASK.sample(3, seed=0), _TASK.src_vocab, _TASK.tgt_vocab, "2")), TypeError,
     r"batch_size must be an int >= 1, got str '2'"),
])
def test_pad_and_collate_refuse_bad_arguments(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
    ids, lens = pad([(5, 6), [7]])  # tuples and lists of ints still pad as before
    assert ids.tolist() == [[5, 6], [7, PAD_ID]] and lens.tolist() == [2, 1]
