"""Chapter 11's experiments: distinct-token probes, head scores and ablation, the probed and start-token
recipes and their command line, and the rotary control that clamps offsets instead of dropping keys."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attention_core.models.language_model import build_language_model
from attention_core.models.long_context import (
    clamped_offset_attention,
    forward_clamped_offsets,
    recent_and_spread_mask,
)
from attention_core.shakespeare import heads
from attention_core.shakespeare.data import CharVocab, random_batch, repeat_random_tokens
from attention_core.shakespeare.train import (
    INDUCTION_CURRICULUM,
    INDUCTION_PLAIN,
    SINK_PLAIN_RECIPE,
    SINK_RECIPE,
    evaluate_loss,
    main,
    probe_sequences,
    train_language_model,
)


def _tiny(vocab_size: int = 11, kv: int = 2, seed: int = 0):
    return build_language_model({"vocab_size": vocab_size, "d_model": 32, "num_layers": 2, "num_heads": 4,
                                 "num_kv_heads": kv, "dim_feedforward": 64, "context": 16, "seed": seed}).eval()


# ------------------------------------------------------------------------------------------ the probe text


def test_distinct_repeated_has_no_repeat_inside_a_copy_and_repeats_it_once() -> None:
    tokens = torch.arange(5, 45)
    seqs = heads.distinct_repeated(50, 40, tokens, torch.Generator().manual_seed(1))
    assert seqs.shape == (50, 80)
    first, second = seqs[:, :40], seqs[:, 40:]
    assert torch.equal(first, second)
    assert all(len(row.unique()) == 40 for row in first)  # distinct, all 40 of the 40 tokens
    assert set(seqs.flatten().tolist()) <= set(tokens.tolist())
    again = heads.distinct_repeated(50, 40, tokens, torch.Generator().manual_seed(1))
    assert torch.equal(seqs, again)
    assert not torch.equal(seqs, heads.distinct_repeated(50, 40, tokens, torch.Generator().manual_seed(2)))
    with pytest.raises(ValueError, match="cannot be drawn"):
        heads.distinct_repeated(2, 41, tokens)
    with pytest.raises(ValueError, match="distinct ids"):
        heads.distinct_repeated(2, 3, torch.tensor([1, 1, 2, 3]))


def test_probe_sequences_are_letters_written_twice() -> None:
    vocab = CharVocab("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ \n.,")
    seqs = probe_sequences(vocab, 8, 32)
    text = [vocab.decode(row) for row in seqs]
    assert all(t[:32] == t[32:] and t.isalpha() and len(set(t[:32])) == 32 for t in text)


def test_head_scores_read_the_right_diagonals() -> None:
    N = 6
    prev = torch.zeros(1, 2, 2 * N, 2 * N)
    prev[0, 0, 0, 0] = 1
    for t in range(1, 2 * N):
        prev[0, 0, t, t - 1] = 1  # head 0: exactly the previous token
    for t in range(2 * N):
        prev[0, 1, t, max(t - N + 1, 0) if t >= N else 0] = 1  # head 1: exactly the induction target
    p, ind = heads.head_scores([prev], N)
    assert p.shape == ind.shape == (1, 2)
    assert p[0, 0] == 1 and ind[0, 1] == 1
    assert ind[0, 0] == 0 and p[0, 1] < 0.5  # (an off-by-one in either diagonal moves a 1 to the other head)


def test_copy_accuracy_counts_only_the_predictable_positions() -> None:
    seqs = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])  # N = 4
    logits = torch.full((1, 8, 4), -1.0)
    for t in range(4, 7):  # positions N .. 2N - 2 predict seqs[t + 1]
        logits[0, t, seqs[0, t + 1]] = 1.0
    assert heads.copy_accuracy(logits, seqs, 4) == 1.0
    logits[0, 6] = -1.0
    logits[0, 6, 0] = 1.0  # one wrong out of three
    assert abs(heads.copy_accuracy(logits, seqs, 4) - 2 / 3) < 1e-12


def test_ablating_a_head_silences_it_and_restores_the_weights() -> None:
    model = _tiny()
    x = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    base = model(x).logits
    with heads.ablate_heads(model, [(1, 2)]):
        cut = model(x).logits
        w = model.blocks[1].attn.out_proj.weight
        E = model.head_dim
        assert (w[:, 2 * E : 3 * E] == 0).all() and (w[:, : 2 * E] != 0).any() and (w[:, 3 * E :] != 0).any()
    assert not torch.allclose(cut, base)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(RuntimeError), heads.ablate_heads(model, [(0, 1)]):
        raise RuntimeError("inside")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # restored after an error too
    with pytest.raises(ValueError, match="head must be"), heads.ablate_heads(model, [(0, 4)]):
        pass


def test_probe_copying_of_an_untrained_model_is_near_chance() -> None:
    model = _tiny(vocab_size=40)
    seqs = heads.distinct_repeated(8, 16, torch.arange(40), torch.Generator().manual_seed(0))
    found = heads.probe_copying(model, seqs, 16)
    assert found["previous"].shape == found["induction"].shape == (2, 4)
    assert found["copy_accuracy"] < 0.2 and not model.training


def test_first_token_weight_is_the_weight_on_key_zero() -> None:
    w = torch.zeros(1, 3, 5, 5)
    w[:, 0, :, 0] = 1
    w[:, 1, 2:, 0] = 0.5
    got = heads.first_token_weight([w], start=2)
    assert got.tolist() == [[1.0, 0.5, 0.0]]


# ------------------------------------------------------------------------------------------ the recipes


def test_random_repeats_repeat_random_tokens_with_the_drawn_period() -> None:
    x = torch.arange(200).view(4, 50) % 7
    y = x + 1
    g = torch.Generator().manual_seed(0)
    x2, y2 = repeat_random_tokens(x, y, 30, 1.0, (5, 5), g)
    assert torch.equal(x2[:, 1:], y2[:, :-1])
    assert torch.equal(x2[:, :5], x2[:, 5:10]) and torch.equal(x2[:, :45], x2[:, 5:50])
    assert x2.max() < 30 and not torch.equal(x2, x)
    x3, _ = repeat_random_tokens(x, y, 30, 0.0, (5, 5), g)
    assert torch.equal(x3, x)


def test_experiment_recipes_differ_only_where_they_say() -> None:
    assert INDUCTION_CURRICULUM.repeat_random and INDUCTION_CURRICULUM.repeat_fraction == 0.5
    assert replace(INDUCTION_PLAIN, name=INDUCTION_CURRICULUM.name, repeat_fraction=0.5, repeat_random=True) \
        == INDUCTION_CURRICULUM
    assert replace(SINK_RECIPE, name=INDUCTION_CURRICULUM.name, bos=False) == INDUCTION_CURRICULUM
    assert replace(SINK_PLAIN_RECIPE, name=INDUCTION_PLAIN.name, bos=False) == INDUCTION_PLAIN
    assert SINK_RECIPE.config(65)["vocab_size"] == 66 and INDUCTION_PLAIN.config(65)["vocab_size"] == 65


def test_start_token_training_and_evaluation(corpus) -> None:
    recipe = replace(SINK_RECIPE, steps=3, batch_size=2, context=16, warmup=1, probe_every=2)
    model, log = train_language_model(recipe, corpus, show_progress=False)
    assert model.vocab_size == len(corpus.vocab) + 1
    assert [p["step"] for p in log.probes] == [0, 2, 3]
    V = len(corpus.vocab)
    ids = corpus.val[:65]
    with torch.no_grad():
        x = torch.cat([torch.full((4, 1), V), ids[:64].view(4, 16)[:, :-1]], dim=1)  # by hand
        ref = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), ids[:64].view(4, 16).flatten())
    assert abs(evaluate_loss(model, ids, 16, bos=V) - ref.item()) < 1e-5
    assert abs(evaluate_loss(model, ids, 16) - evaluate_loss(model, ids, 16, bos=V)) > 1e-3


def test_the_command_line_trains_probes_and_records(tmp_path: Path) -> None:
    main(["--recipe", "induction_curriculum", "--steps", "4", "--probe-every", "2", "--out", str(tmp_path)])
    entry = json.loads((tmp_path / "manifest.json").read_text())["induction_curriculum"]
    assert entry["recipe"]["steps"] == 4 and entry["recipe"]["repeat_random"] is True
    assert [p["step"] for p in entry["probes"]] == [0, 2, 4]
    assert len(entry["probes"][0]["induction"]) == 2 and len(entry["probes"][0]["induction"][0]) == 4
    assert (tmp_path / "induction_curriculum.pt").is_file()


def test_the_batches_of_the_plain_and_curriculum_runs_share_their_text(corpus) -> None:
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    x1, _ = random_batch(corpus.train, 4, 16, g1)
    x2, _ = random_batch(corpus.train, 4, 16, g2)
    assert torch.equal(x1, x2)


# ------------------------------------------------------------------------------------------ clamped offsets


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_clamped_offsets_equal_the_model_when_nothing_is_clamped(kv: int) -> None:
    model = _tiny(kv=kv).double()
    x = torch.randint(0, 11, (2, 20), generator=torch.Generator().manual_seed(3))
    ref = model(x).logits
    for cap in (19, 25, 1000):
        assert (forward_clamped_offsets(model, x, cap) - ref).abs().max() < 1e-10
    assert (forward_clamped_offsets(model, x, 5) - ref).abs().max() > 1e-4  # a real cap changes the logits
    assert (forward_clamped_offsets(model, x, 5)[:, :6] - ref[:, :6]).abs().max() < 1e-10  # not before it


def test_clamped_attention_scores_far_keys_at_the_cap() -> None:
    from attention_core.positional import RotaryEmbedding

    rot = RotaryEmbedding(8, max_len=64)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 12, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = clamped_offset_attention(q, k, v, rot, 3)
    # by hand, row 11: keys 8..11 at their offsets, keys 0..7 all at offset 3
    cos, sin = rot.cos.double(), rot.sin.double()

    def r(x, pos):
        c, s = torch.cat([cos[pos], cos[pos]]), torch.cat([sin[pos], sin[pos]])
        x1, x2 = x.chunk(2)
        return x * c + torch.cat([-x2, x1]) * s

    scores = torch.stack([r(q[0, 0, 11], 11 - j if 11 - j <= 3 else 3) @ k[0, 0, j] for j in range(12)])
    want = (scores / 8 ** 0.5).softmax(0) @ v[0, 0]
    assert (out[0, 0, 11] - want).abs().max() < 1e-6  # (the rotary table is float32)


@pytest.mark.parametrize("kv", [4, 1])
def test_clamped_offsets_with_a_window_mask_equal_the_models_sliding_window(kv: int) -> None:
    model = _tiny(kv=kv).double()
    x = torch.randint(0, 11, (2, 20), generator=torch.Generator().manual_seed(4))
    i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
    window = (i - j) < 6  # (20, 20): the 6 most recent keys
    ref = model(x, window=6).logits
    assert (forward_clamped_offsets(model, x, 19, window) - ref).abs().max() < 1e-10  # nothing clamped
    assert (forward_clamped_offsets(model, x, 5, window) - ref).abs().max() < 1e-10  # offsets <= 5 anyway
    few = recent_and_spread_mask(20, 3, 2)  # far keys kept: the cap now matters
    assert (forward_clamped_offsets(model, x, 19, few) - forward_clamped_offsets(model, x, 2, few)).abs().max() > 1e-4
    assert (forward_clamped_offsets(model, x, 19, few) - model(x).logits).abs().max() > 1e-4  # keys dropped


def test_clamped_attention_refuses_a_mask_that_does_not_fit() -> None:
    q = torch.rand(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"attn_mask must be a bool \(L, L\) = \(4, 4\)"):
        clamped_offset_attention(q, q, q, _LM.rotary, 1, torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask must be a bool"):
        clamped_offset_attention(q, q, q, _LM.rotary, 1, torch.ones(4, 4))
    with pytest.raises(ValueError, match="its diagonal must be all True"):
        clamped_offset_attention(q, q, q, _LM.rotary, 1, torch.ones(4, 4, dtype=torch.bool).triu(1))


def test_recent_and_spread_mask_keeps_the_recent_keys_and_spreads_the_rest() -> None:
    m = recent_and_spread_mask(12, 3, 4)
    assert m.shape == (12, 12) and m.dtype == torch.bool and not (m & ~torch.ones(12, 12).tril().bool()).any()
    assert m.diagonal().all() and m.sum(1).max() == 7
    assert m[:7, :7].equal(torch.ones(7, 7).tril().bool()) and not m[:7, 7:].any()  # <= 4 older keys: all kept
    assert m[11].nonzero().flatten().tolist() == [0, 3, 5, 8, 9, 10, 11]  # 0, 8/3, 16/3, 8 rounded + recent 3
    big = recent_and_spread_mask(300, 64, 64)
    assert big.sum(1).max() == 128 and big[299, 236:].all() and big[299, 0] and big[299, 235]
    assert recent_and_spread_mask(5, 2, 0).equal((torch.arange(5)[:, None] - torch.arange(5)[None, :]).le(1)
                                                 & torch.ones(5, 5).tril().bool())
    with pytest.raises(ValueError, match="recent"):
        recent_and_spread_mask(5, 0, 2)


def test_the_passage_study_rows_and_the_recorded_file(corpus) -> None:
    from attention_core.shakespeare.passages import STARTS, load_passage_study, passage_study

    record = passage_study(corpus, starts=[100], length=600)
    row = record["main"][0]
    assert record["starts"] == [100] and len(row) == 7 and len(record["sink"][0]) == 2
    assert row["full"] > row["window 128"] and row["every key, offsets <= 127"] < row["full"]
    with pytest.raises(ValueError, match="does not fit"):
        passage_study(corpus, starts=[len(corpus.val) - 10], length=600)
    shipped = load_passage_study()
    assert shipped["starts"] == list(STARTS) and shipped["length"] == 2048 and len(shipped["main"]) == len(STARTS)


def test_the_sink_recipe_from_the_command_line_reads_its_start_token(tmp_path: Path) -> None:
    main(["--recipe", "sink", "--steps", "2", "--probe-every", "0", "--out", str(tmp_path)])
    entry = json.loads((tmp_path / "manifest.json").read_text())["sink_bos"]
    assert entry["recipe"]["bos"] is True and "probes" not in entry
    model = build_language_model(SINK_RECIPE.config(65))
    assert model.vocab_size == 66


# ------------------------------------------------------------------------------------------ shipped checkpoints


@pytest.mark.parametrize("recipe", [INDUCTION_CURRICULUM, INDUCTION_PLAIN, SINK_RECIPE])
def test_the_shipped_experiment_checkpoints_do_what_the_chapter_says(corpus, recipe) -> None:
    from attention_core.shakespeare.train import load_or_train_language_model

    model, entry = load_or_train_language_model(recipe=recipe)
    assert entry["sha256"] is not None and len(entry["probes"]) == recipe.steps // recipe.probe_every + 1
    probe = probe_sequences(corpus.vocab, 8, seed=1)
    found = heads.probe_copying(model, probe, 32)
    if recipe is INDUCTION_PLAIN:
        assert found["copy_accuracy"] < 0.1
    elif not recipe.bos:
        assert found["copy_accuracy"] > 0.9
    else:  # the start token is where one head parks its attention
        text = torch.cat([torch.tensor([[len(corpus.vocab)]]), corpus.val[None, 5000:5127]], dim=1)
        with torch.no_grad():
            assert heads.first_token_weight(model(text, need_weights=True).weights, 32).max() > 0.5


# ------------------------------------------------------------------------------------------------ edges (issue 37)

_LM = build_language_model({"vocab_size": 9, "d_model": 8, "num_layers": 1, "num_heads": 2, "seed": 0,
                            "max_positions": 16})


@pytest.mark.parametrize("model,tokens,err,pattern", [
    (_LM, torch.tensor([[0, 9]]), ValueError, r"tokens must be ids in \[0, 9\)"),
    (_LM, torch.tensor([[0, -1]]), ValueError, r"tokens must be ids in \[0, 9\)"),
    (_LM, torch.zeros(1, 20, dtype=torch.long), ValueError, "tokens has L = 20 positions but the model covers"),
    (3, torch.zeros(1, 2, dtype=torch.long), TypeError, "model must be a DecoderLM"),
    (build_language_model({"vocab_size": 9, "d_model": 8, "num_layers": 1, "num_heads": 2, "seed": 0,
                           "attention": "latent", "kv_latent_dim": 4, "rope_dim": 2}),
     torch.zeros(1, 3, dtype=torch.long), TypeError, r"standard \(not latent\) attention"),
])
def test_clamped_offsets_refuse_bad_inputs_by_name(model, tokens, err, pattern):
    with pytest.raises(err, match=pattern):
        forward_clamped_offsets(model, tokens, 2)


def test_clamped_offsets_of_an_empty_text_and_bad_head_shapes():
    assert forward_clamped_offsets(_LM, torch.zeros(2, 0, dtype=torch.long), 2).shape == (2, 0, 9)
    with pytest.raises(ValueError, match=r"query must be \(B, heads, L, features\), got shape \(1, 2, 3\)"):
        clamped_offset_attention(torch.rand(1, 2, 3), torch.rand(1, 2, 3, 4), torch.rand(1, 2, 3, 4), _LM.rotary, 1)
    with pytest.raises(ValueError, match="key .* and value .* must match query"):
        clamped_offset_attention(torch.rand(1, 2, 3, 4), torch.rand(1, 2, 5, 4), torch.rand(1, 2, 5, 4), _LM.rotary, 1)


@pytest.mark.parametrize("call,pattern", [
    (lambda: heads.head_scores([torch.rand(1, 2, 6, 6)], 5), r"weights must be \(B, H, 2N, 2N\) = \(B, H, 10, 10\)"),
    (lambda: heads.head_scores([], 3), "weights must be a non-empty list"),
    (lambda: heads.first_token_weight([]), "weights must be a non-empty list"),
    (lambda: heads.probe_copying(_LM, torch.zeros(1, 6, dtype=torch.long), 4),
     r"sequences must be \(B, 2N\) = \(B, 8\)"),
])
def test_head_statistics_refuse_shapes_that_do_not_fit(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


@pytest.mark.parametrize("pairs,err,pattern", [
    ([(5, 0)], ValueError, r"layer must be an int in \[0, 1\)"),
    ([(0, 2)], ValueError, r"head must be an int in \[0, 2\)"),
    ([3], TypeError, r"heads must hold \(layer, head\) pairs"),
])
def test_ablate_heads_refuses_bad_pairs_and_leaves_the_weights(pairs, err, pattern):
    before = {k: v.clone() for k, v in _LM.state_dict().items()}
    with pytest.raises(err, match=pattern):
        with heads.ablate_heads(_LM, [(0, 1)] + pairs):
            pass
    assert all(torch.equal(v, _LM.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("model, pairs, pattern", [
    ("bad", [(0, 0)], r"model must be a DecoderLM, got str 'bad'"),
    (-3, [(0, 0)], r"model must be a DecoderLM, got int -3"),
    (torch.nn.Linear(2, 2), [(0, 0)], r"model must be a DecoderLM, got Linear"),
    (None, "bad", r"heads must be an iterable of \(layer, head\) pairs of ints, got str 'bad'"),
    (None, -3, r"heads must be an iterable of \(layer, head\) pairs of ints, got int -3"),
])
def test_ablate_heads_checks_its_arguments_at_the_call(model, pairs, pattern) -> None:
    model = _tiny() if model is None else model
    with pytest.raises(TypeError, match=pattern):
        heads.ablate_heads(model, pairs)  # refused at the call, before any with block is entered
