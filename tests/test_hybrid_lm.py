"""The hybrid language model (softmax, window and linear layers) and the shipped checkpoints of chapter 12."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from attention_core.models.hybrid_lm import KINDS, HybridLM, build_hybrid_lm
from attention_core.shakespeare import hybrid as hy
from attention_core.training.checkpoint import file_sha256, read_manifest


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_is_causal_and_has_the_same_parameters(kind):
    torch.manual_seed(0)
    model = HybridLM(11, (kind, kind), d_model=16, num_heads=2, context=12, window=3).eval()
    ref = HybridLM(11, ("softmax", "softmax"), d_model=16, num_heads=2, context=12, window=3)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())
    x = torch.randint(0, 11, (2, 12))
    y = x.clone()
    y[:, 7:] = (y[:, 7:] + 1) % 11
    with torch.no_grad():
        torch.testing.assert_close(model(x)[:, :7], model(y)[:, :7])
        assert not torch.allclose(model(x)[:, 7:], model(y)[:, 7:])


def test_a_window_layer_sees_exactly_its_window():
    torch.manual_seed(0)
    model = HybridLM(11, ("window",), d_model=16, num_heads=2, context=12, window=3).eval()
    x = torch.randint(0, 11, (1, 12))
    y = x.clone()
    y[0, 4] = (y[0, 4] + 1) % 11
    with torch.no_grad():
        diff = (model(x) - model(y)).abs().amax(-1)[0]  # (12,)
    assert (diff[4:7] > 0).all() and (diff[7:] == 0).all() and (diff[:4] == 0).all()


def test_decode_state_and_flops_formulas():
    model = HybridLM(11, ("softmax", "window", "linear"), d_model=16, num_heads=2, context=12, window=3)
    E = 8
    assert model.decode_state_elements(100) == 2 * 16 * 100 + 2 * 16 * 3 + 2 * E * (E + 1)
    assert model.decode_state_elements(2) == 2 * 16 * 2 + 2 * 16 * 2 + 2 * E * (E + 1)
    assert model.attention_flops_per_token(100) == 2 * 16 * 100 + 2 * 16 * 3 + 2 * 2 * E * (E + 1)


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"layers": ("softmax", "mamba")}, ValueError, "layers"),
    ({"layers": "softmax"}, ValueError, "layers"),
    ({"d_model": 15}, ValueError, "divisible"),
    ({"window": 0}, ValueError, "window"),
    ({"context": 2.0}, TypeError, "context"),
])
def test_constructor_errors_name_the_argument(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        HybridLM(11, **{"d_model": 16, "num_heads": 2, **kwargs})


def test_forward_errors():
    model = HybridLM(11, ("linear",), d_model=16, num_heads=2, context=4)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens"):
        model(torch.zeros(5, dtype=torch.long))


def test_training_runs_and_repeats():
    recipe = replace(hy.HYBRID_RECIPES["hybrid_linear_softmax"], steps=2, batch_size=2, context=16)
    a, log_a = hy.train_hybrid(recipe)
    b, log_b = hy.train_hybrid(recipe)
    assert log_a.losses == log_b.losses and len(log_a.losses) == 2
    assert [k for k in a.config["layers"]] == ["linear", "softmax"]
    with pytest.raises(TypeError, match="recipe"):
        hy.train_hybrid({"steps": 2})
    with pytest.raises(ValueError, match="name"):
        hy.load_or_train_hybrid("hybrid_mamba")


@pytest.mark.parametrize("name", sorted(hy.HYBRID_RECIPES))
def test_shipped_checkpoints_load_verified_and_are_small(name):
    entry = read_manifest(hy.CHECKPOINT_DIR)[name]
    path = Path(hy.CHECKPOINT_DIR) / entry["file"]
    assert path.stat().st_size < 2 * 2**20 and file_sha256(path) == entry["sha256"]
    model, loaded = hy.load_or_train_hybrid(name)
    assert loaded == entry and isinstance(model, HybridLM)
    assert model.config["layers"] == hy.HYBRID_RECIPES[name].layers.split("+")
    assert build_hybrid_lm(model.config).config == model.config
    assert entry["val_loss"] < 3.0  # far below uniform guessing over 65 characters (ln 65 = 4.17)


def test_building_and_loading_leave_the_global_rng_alone():
    torch.manual_seed(1234)
    torch.rand(3)
    before = torch.get_rng_state()
    hy.load_or_train_hybrid("hybrid_linear")
    a = build_hybrid_lm({"vocab_size": 11, "layers": ["linear"], "d_model": 16, "num_heads": 2}, seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    b = build_hybrid_lm({"vocab_size": 11, "layers": ["linear"], "d_model": 16, "num_heads": 2}, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("tokens,exc,words", [
    (torch.tensor([[0, -1]]), ValueError, r"tokens must be ids in \[0, 11\).*from -1 to 0"),
    (torch.tensor([[0, 11]]), ValueError, r"tokens must be ids in \[0, 11\).*from 0 to 11"),
    (torch.zeros(1, 2), TypeError, "tokens must hold integer token ids"),
    (torch.zeros(2, dtype=torch.long), ValueError, r"tokens must be \(B, L\) token ids, got shape \(2,\)"),
    (torch.zeros(1, 13, dtype=torch.long), ValueError, "longer than the model's context 12"),
    ([[0]], TypeError, "tokens must be a torch.Tensor"),
    (torch.zeros(1, 2, dtype=torch.long, device="meta"), ValueError, "tokens is on meta but the model is on cpu"),
])
def test_bad_tokens_are_refused_by_name(tokens, exc, words):
    with pytest.raises(exc, match=words):
        HybridLM(11, ("softmax", "linear", "window"), d_model=16, num_heads=2, context=12, window=3)(tokens)


def test_empty_batches_and_sequences_give_empty_logits():
    model = HybridLM(11, ("softmax", "linear", "window"), d_model=16, num_heads=2, context=12, window=3)
    assert model(torch.zeros(0, 3, dtype=torch.long)).shape == (0, 3, 11)
    assert model(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0, 11)


@pytest.mark.parametrize("config,exc,words", [
    ({"d_model": 16}, ValueError, r"config lacks the keys \['vocab_size'\]"),
    ({"vocab_size": 11, "heads": 2}, ValueError, r"config has unknown keys \['heads'\]"),
    ([("vocab_size", 11)], TypeError, "config must be a dict"),
    ({"vocab_size": 11, "layers": 3}, ValueError, "layers must be a non-empty sequence"),
])
def test_build_refuses_bad_configs_by_name(config, exc, words):
    with pytest.raises(exc, match=words):
        build_hybrid_lm(config)


def test_seed_study_retrains_with_other_seeds_and_records_them(monkeypatch, tmp_path):
    for name in ("hybrid_window", "hybrid_linear"):
        monkeypatch.setitem(hy.HYBRID_RECIPES, name, replace(hy.HYBRID_RECIPES[name], steps=2, batch_size=2,
                                                             context=16, warmup=1))
    path = tmp_path / "seeds.json"
    record = hy.seed_study([3, 1], ["hybrid_window", "hybrid_linear"], path=path)
    assert record["seeds"] == [3, 1] and hy.load_seed_study(path) == record
    recipe = hy.with_seed(hy.HYBRID_RECIPES["hybrid_linear"], 1)
    assert (recipe.seed, recipe.data_seed) == (1, 2)
    model, _ = hy.train_hybrid(recipe)
    corpus_val = hy.load_corpus().val
    assert record["val_loss"]["hybrid_linear"][1] == round(hy.evaluate_hybrid(model, corpus_val, 16), 4)
    assert len(set(record["val_loss"]["hybrid_window"])) == 2  # another seed, another model
    assert "seed" not in record["recipes"]["hybrid_window"] and record["recipes"]["hybrid_window"]["steps"] == 2
    monkeypatch.setitem(hy.HYBRID_RECIPES, "hybrid_window", replace(hy.HYBRID_RECIPES["hybrid_window"], lr=1.0))
    with pytest.raises(ValueError, match="rerun the study"):
        hy.load_seed_study(path)
    with pytest.raises(ValueError, match="distinct"):
        hy.seed_study([1, 1], ["hybrid_linear"])
    with pytest.raises(ValueError, match="names"):
        hy.seed_study([1], ["hybrid_mamba"])
    with pytest.raises(ValueError, match="seed"):
        hy.with_seed(hy.HYBRID_RECIPES["hybrid_linear"], -1)


def test_the_recorded_seed_study_is_of_the_shipped_recipes():
    record = hy.load_seed_study()
    assert sorted(record["recipes"]) == sorted(hy.HYBRID_RECIPES)
    assert len(record["seeds"]) >= 5 and 0 not in record["seeds"]  # seed 0 is the shipped checkpoints'
    assert all(1.5 < v < 3.0 for losses in record["val_loss"].values() for v in losses)


@pytest.mark.parametrize("args, exc, words", [
    ((-4, 2, "softmax", 4), ValueError, r"d_model must be an int >= 1, got -4"),
    ((8, 0, "softmax", 4), ValueError, r"num_heads must be an int >= 1, got 0"),
    ((8, 2, "window", 2.5), TypeError, r"window must be an int >= 1, got float 2.5"),
    ((8, 3, "softmax", 4), ValueError, r"d_model \(8\) must be divisible by num_heads \(3\)"),
    ((8, 2, "nope", 4), ValueError, r"kind must be one of \('softmax', 'window', 'linear'\), got 'nope'"),
])
def test_mixer_block_refuses_bad_sizes_and_kinds_by_name(args, exc, words):
    from attention_core.models.hybrid_lm import MixerBlock
    with pytest.raises(exc, match=words):
        MixerBlock(*args)
