"""The Shakespeare wing: the shipped text and its checksum, the split, the baselines, the checkpoint."""

from __future__ import annotations

import gzip
import json
import math
import shutil
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from attention_core.shakespeare.data import (
    TEXT_FILE,
    CharVocab,
    bigram_loss,
    discounted_ngram_log_probs,
    discounted_ngram_loss,
    discounted_ngram_losses,
    load_text,
    ngram_loss,
    random_batch,
    unigram_loss,
)
from attention_core.shakespeare.train import (
    CHECKPOINT_DIR,
    RECIPE,
    evaluate_loss,
    load_or_train_language_model,
    save_lm_checkpoint,
    train_language_model,
)
from attention_core.training.checkpoint import read_manifest


def test_the_shipped_text_is_verified_and_complete(corpus) -> None:
    text = load_text()
    assert len(text) == 1_115_394 and text.startswith("First Citizen:")
    assert len(corpus.vocab) == 65
    assert len(corpus.train) + len(corpus.val) == len(text)


def test_a_damaged_text_is_refused_with_a_clear_message(tmp_path: Path) -> None:
    raw = bytearray(gzip.decompress(TEXT_FILE.read_bytes()))
    raw[1000] ^= 1  # one flipped bit
    bad = tmp_path / "tinyshakespeare.txt.gz"
    bad.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(ValueError, match="has sha256 [0-9a-f]{64}, expected 86c4e6aa.*damaged"):
        load_text(bad)
    with pytest.raises(FileNotFoundError, match="no corpus file"):
        load_text(tmp_path / "missing.gz")


def test_the_split_is_by_position(corpus) -> None:
    ids = corpus.vocab.encode(load_text())
    n = len(corpus.train)
    assert n == int(0.9 * len(ids))
    assert torch.equal(corpus.train, ids[:n]) and torch.equal(corpus.val, ids[n:])


def test_vocabulary_round_trip_and_unknown_characters() -> None:
    vocab = CharVocab("hello world")
    assert vocab.decode(vocab.encode("lower hold")) == "lower hold"
    assert len(vocab) == 8
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab.encode("z")


def test_batches_are_crops_shifted_by_one(corpus) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = random_batch(corpus.train, 4, 16, g)
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = random_batch(corpus.train, 4, 16, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)


def test_repeated_crops_repeat_a_stretch_of_the_text(corpus) -> None:
    x, y = random_batch(corpus.train, 64, 40, torch.Generator().manual_seed(1), repeat_fraction=1.0,
                        repeat_periods=(5, 9))
    for row in torch.cat([x, y[:, -1:]], dim=1):  # the crop of context + 1 ids
        period = next(p for p in range(5, 10) if torch.equal(row[p:], row[:-p]))
        assert len(set(row[:period].tolist())) > 1  # a stretch of text, not one character
    mixed, _ = random_batch(corpus.train, 400, 60, torch.Generator().manual_seed(2), repeat_fraction=0.5,
                            repeat_periods=(8, 20))
    periodic = sum(any(torch.equal(r[p:], r[:-p]) for p in range(8, 21)) for r in mixed)
    assert 150 < periodic < 250
    with pytest.raises(ValueError, match="repeat_fraction must be a float in \\[0, 1\\]"):
        random_batch(corpus.train, 2, 8, repeat_fraction=1.5)


def test_baselines_match_a_count_by_hand() -> None:
    train, val = torch.tensor([0, 1, 0, 1, 1, 2]), torch.tensor([1, 0, 1])
    # unigram, add-one: counts 2+1, 3+1, 1+1 of 9
    expected = -(2 * math.log(4 / 9) + math.log(3 / 9)) / 3
    assert abs(unigram_loss(train, val, 3) - expected) < 1e-12
    # bigram, add-one: after 1 come 0, 1, 2 (+1 each: 2/6, 2/6, 2/6); after 0 come 1, 1 (3/5)
    expected = -(math.log(2 / 6) + math.log(3 / 5)) / 2
    assert abs(bigram_loss(train, val, 3) - expected) < 1e-12


def test_ngram_loss_counts_by_hand_and_matches_the_unigram_and_bigram() -> None:
    train, val = torch.tensor([0, 1, 0, 1, 1, 2]), torch.tensor([1, 0, 1, 1])
    # trigram, add-one, V = 3: val[1] = 0 from (1) alone (the row's start): after 1 come 0, 1, 2: (1 + 1) / (3 + 3);
    # val[2] = 1 after (1, 0): once, followed by 1: (1 + 1) / (1 + 3); val[3] = 1 after (0, 1): twice, 0 and 1: 2 / 5
    expected = -(math.log(2 / 6) + math.log(2 / 4) + math.log(2 / 5)) / 3
    assert abs(ngram_loss(train, val, 3, 3) - expected) < 1e-12
    # a context never seen predicts uniformly; alpha = 0.5 changes both counts
    assert abs(ngram_loss(train, torch.tensor([2, 2, 0]), 3, 3) - math.log(3)) < 1e-12
    expected = -(math.log(1.5 / 4.5) + math.log(1.5 / 2.5) + math.log(1.5 / 3.5)) / 3
    assert abs(ngram_loss(train, val, 3, 3, alpha=0.5) - expected) < 1e-12
    # rows are separate texts: each row's start backs off, and the mean runs over every predicted character
    rows = torch.tensor([[1, 0, 1, 1], [2, 2, 0, 1]])
    assert abs(ngram_loss(train, rows, 3, 3) - (ngram_loss(train, rows[0], 3, 3) + ngram_loss(train, rows[1], 3, 3)) / 2
               ) < 1e-12
    g = torch.Generator().manual_seed(0)
    train, val = torch.randint(0, 7, (500,), generator=g), torch.randint(0, 7, (80,), generator=g)
    assert abs(ngram_loss(train, val, 7, 1) - unigram_loss(train, val[1:], 7)) < 1e-12
    assert abs(ngram_loss(train, val, 7, 2, alpha=0.3) - bigram_loss(train, val, 7, alpha=0.3)) < 1e-12
    with pytest.raises(ValueError, match="n must be"):
        ngram_loss(train, val, 7, 0)
    with pytest.raises(ValueError, match="at least 2 ids"):
        ngram_loss(train, val[:1], 7, 4)
    with pytest.raises(ValueError, match="vocab_size \\*\\* n must fit"):
        ngram_loss(train, val, 7, 30)
    with pytest.raises(ValueError, match="val must be"):
        ngram_loss(train, val.view(2, 2, 20), 7, 2)


def test_discounted_ngram_counts_by_hand() -> None:
    train = torch.tensor([0, 1, 0, 1, 1, 2])  # counts 2, 3, 1: add-one unigram 3/9, 4/9, 2/9
    # bigrams: after 0 come 1, 1 (c(0 .) = 2, one distinct follower); after 1 come 0, 1, 2 (c(1 .) = 3, three);
    # 2 is never followed by anything. D = 0.5:
    # P(0 | 1) = (1 - 0.5) / 3 + 0.5 * 3 / 3 * 3/9 = 1/3; P(1 | 0) = (2 - 0.5) / 2 + 0.5 * 1 / 2 * 4/9 = 31/36;
    # P(1 | 1) = 0.5 / 3 + 0.5 * 4/9 = 7/18
    logp = discounted_ngram_log_probs(train, torch.tensor([1, 0, 1, 1]), 3, 2, discount=0.5)
    assert torch.allclose(logp, torch.tensor([1 / 3, 31 / 36, 7 / 18], dtype=torch.float64).log(), atol=1e-12)
    # a context never seen backs off unchanged (P(1 | 2) = 4/9); a follower never seen gets only the backoff
    # share (P(0 | 0) = 0 + 0.5 * 1 / 2 * 3/9 = 1/12)
    assert abs(discounted_ngram_log_probs(train, torch.tensor([2, 1]), 3, 2, 0.5).item() - math.log(4 / 9)) < 1e-12
    assert abs(discounted_ngram_log_probs(train, torch.tensor([0, 0]), 3, 2, 0.5).item() - math.log(1 / 12)) < 1e-12
    # trigram: the row's first prediction has one character of context (the bigram's 1/3); then (1, 0) was seen
    # once, followed by 1: P(1 | 1 0) = (1 - 0.5) / 1 + 0.5 * 1 / 1 * 31/36 = 67/72
    logp = discounted_ngram_log_probs(train, torch.tensor([[1, 0, 1]]), 3, 3, discount=0.5)
    assert logp.shape == (1, 2)
    assert torch.allclose(logp, torch.tensor([[1 / 3, 67 / 72]], dtype=torch.float64).log(), atol=1e-12)
    expected = -(math.log(1 / 3) + math.log(67 / 72)) / 2
    assert abs(discounted_ngram_loss(train, torch.tensor([1, 0, 1]), 3, 3, discount=0.5) - expected) < 1e-12
    # n = 1 is the add-one unigram
    g = torch.Generator().manual_seed(0)
    train, val = torch.randint(0, 7, (500,), generator=g), torch.randint(0, 7, (80,), generator=g)
    assert abs(discounted_ngram_loss(train, val, 7, 1) - unigram_loss(train, val[1:], 7)) < 1e-12


@pytest.mark.parametrize("discount", [0.3, 0.75, 1.0])
def test_discounted_ngram_sums_to_one_over_the_vocabulary(discount) -> None:
    g = torch.Generator().manual_seed(1)
    V = 5
    train = torch.randint(0, V, (300,), generator=g) % torch.randint(1, V + 1, (300,), generator=g)  # skewed
    contexts = torch.cartesian_prod(*[torch.arange(V)] * 3)  # (125, 3): every context, seen or not
    rows = torch.cat([contexts.repeat_interleave(V, 0), torch.arange(V).repeat(len(contexts))[:, None]], 1)
    for n in (2, 3, 4, 6):  # shorter, equal and longer than the rows' context
        p = discounted_ngram_log_probs(train, rows, V, n, discount).exp()  # (125 V, 3)
        assert (p > 0).all()
        assert torch.allclose(p[:, -1].view(len(contexts), V).sum(1), torch.ones(len(contexts), dtype=torch.float64),
                              atol=1e-12)
    assert any(discounted_ngram_log_probs(train, rows, V, 4, discount)[:, -1].exp().view(-1, V).max(1).values > 0.5)


def test_discounted_ngram_orders_in_one_pass_and_refusals() -> None:
    g = torch.Generator().manual_seed(2)
    train, val = torch.randint(0, 6, (400,), generator=g), torch.randint(0, 6, (3, 20), generator=g)
    losses = discounted_ngram_losses(train, val, 6, 5)
    assert list(losses) == [1, 2, 3, 4, 5]
    assert all(abs(losses[n] - discounted_ngram_loss(train, val, 6, n)) < 1e-12 for n in losses)
    # rows are separate texts, as in ngram_loss
    both = discounted_ngram_log_probs(train, val[:2], 6, 4)
    assert torch.equal(both[1], discounted_ngram_log_probs(train, val[1], 6, 4))
    for bad in (0, 1.5, -0.2):
        with pytest.raises(ValueError, match="discount must be"):
            discounted_ngram_loss(train, val, 6, 3, discount=bad)
    with pytest.raises(ValueError, match="n must be"):
        discounted_ngram_loss(train, val, 6, 0)
    with pytest.raises(ValueError, match="at least 2 ids"):
        discounted_ngram_loss(train, val[0, :1], 6, 3)
    with pytest.raises(ValueError, match="val must be"):
        discounted_ngram_loss(train, val.view(3, 2, 10), 6, 2)


def test_bigram_beats_unigram_on_shakespeare(corpus) -> None:
    uni = unigram_loss(corpus.train, corpus.val, len(corpus.vocab))
    bi = bigram_loss(corpus.train, corpus.val, len(corpus.vocab))
    assert 2.0 < bi < uni < math.log(65)


def test_the_shipped_checkpoint_is_verified_and_beats_the_bigram(corpus) -> None:
    shipped = read_manifest(CHECKPOINT_DIR).get(RECIPE.name)
    assert shipped is not None and (CHECKPOINT_DIR / shipped["file"]).is_file(), "no shipped checkpoint"
    model, entry = load_or_train_language_model()  # loads (sha256 checked), never trains here
    assert entry == shipped and entry["recipe"] == asdict(RECIPE)
    assert model.config["num_layers"] == RECIPE.num_layers >= 2
    assert (CHECKPOINT_DIR / entry["file"]).stat().st_size < 2_000_000
    loss = evaluate_loss(model, corpus.val, RECIPE.context, max_blocks=32)
    assert loss < bigram_loss(corpus.train, corpus.val, len(corpus.vocab)) - 0.3


def test_a_damaged_checkpoint_or_another_recipe_is_refused(tmp_path: Path) -> None:
    shutil.copytree(CHECKPOINT_DIR, tmp_path / "ckpt")
    with pytest.raises(ValueError, match="differs from the one asked for"):
        load_or_train_language_model(tmp_path / "ckpt", recipe=replace(RECIPE, lr=1.0))
    entry = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())[RECIPE.name]
    with open(tmp_path / "ckpt" / entry["file"], "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="sha256 .* expected"):
        load_or_train_language_model(tmp_path / "ckpt")


def test_training_runs_repeat_and_lower_the_loss(corpus, tmp_path: Path) -> None:
    tiny = replace(RECIPE, name="tiny", d_model=32, num_heads=2, num_kv_heads=1, dim_feedforward=64, context=32,
                   steps=30, batch_size=8, warmup=5)
    torch.set_num_threads(1)
    model, log = train_language_model(tiny, corpus, show_progress=False)
    _, again = train_language_model(tiny, corpus, show_progress=False)
    assert log.losses == again.losses
    assert sum(log.losses[-5:]) / 5 < log.losses[0] - 0.5
    entry = save_lm_checkpoint(model, log, tiny, tmp_path)
    loaded, loaded_entry = load_or_train_language_model(tmp_path, recipe=tiny)
    assert loaded_entry["sha256"] == entry["sha256"]
    x = corpus.val[:33][None, :32]
    assert torch.equal(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize("fn", [unigram_loss, bigram_loss, lambda t, v, V: ngram_loss(t, v, V, 2),
                                lambda t, v, V: discounted_ngram_loss(t, v, V, 3)])
def test_baselines_refuse_ids_outside_the_vocabulary(fn):
    with pytest.raises(ValueError, match=r"val must be ids in \[0, 5\)"):
        fn(torch.arange(5), torch.tensor([7, 1]), 5)
    with pytest.raises(ValueError, match=r"train must be ids in \[0, 5\)"):
        fn(torch.tensor([-1, 2]), torch.tensor([1, 1]), 5)


def _m(name: str):
    import importlib
    return importlib.import_module("attention_core." + name)


def _tiny_lm():
    from attention_core.models.language_model import DecoderLM
    torch.manual_seed(0)
    return DecoderLM(5, d_model=8, num_layers=1, num_heads=2, context=8)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: _m("shakespeare.passages").passage_study("bad"), TypeError, r"corpus must be a Corpus, got str"),
    (lambda: _m("shakespeare.train").probe_sequences("bad"), TypeError, r"vocab must be a CharVocab, got str"),
    (lambda: _m("shakespeare.recent").attention_logits("bad", torch.zeros(1, 2, dtype=torch.long)), TypeError,
     r"model must be a DecoderLM, got str"),
    (lambda: _m("shakespeare.recent").attention_logits(_tiny_lm(), [[1, 2]]), TypeError,
     r"x must be a torch.Tensor, got list"),
    (lambda: _m("shakespeare.recent").attention_logits(_tiny_lm(), torch.zeros(3, dtype=torch.long)), ValueError,
     r"x must be \(B, L\) token ids, got shape \(3,\)"),
    (lambda: _m("shakespeare.recent").max_attention_logit(-3, None), TypeError, r"model must be a DecoderLM, got int"),
    (lambda: _m("shakespeare.recent").measure(_tiny_lm(), "bad", 8), TypeError, r"corpus must be a Corpus, got str"),
    (lambda: _m("shakespeare.recent").train_recent("bad", None), TypeError, r"recipe must be a RecentRecipe, got str"),
])
def test_shakespeare_helpers_refuse_bad_arguments_by_name(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
