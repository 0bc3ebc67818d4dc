"""Training loop and checkpoints: the loss falls, runs repeat, checksums are verified."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch

from attention_core.training.checkpoint import TrainLog, file_sha256, load_checkpoint, read_manifest, save_checkpoint
from attention_core.translation import train as training
from attention_core.translation.data import NumberWords
from attention_core.translation.metrics import book_test_set, evaluate_by_bucket
from attention_core.translation.rnn import build_rnn_model
from attention_core.translation.train import (
    CHECKPOINT_DIR,
    RECIPES,
    Recipe,
    build_model,
    load_or_train,
    sequence_loss,
    train_and_save,
    train_seq2seq,
)

TASK = NumberWords(max_digits=3)


def tiny(kind: str = "bahdanau"):
    return build_rnn_model({"kind": kind, "src_vocab_size": len(TASK.src_vocab), "tgt_vocab_size": len(TASK.tgt_vocab),
                        "embed_dim": 8, "hidden_dim": 8, "seed": 0})


def test_short_training_lowers_the_loss() -> None:
    model = tiny()
    log = train_seq2seq(model, TASK.stream(32, seed=0), steps=40, lr=1e-2, show_progress=False)
    assert len(log.losses) == 40 and log.seconds > 0
    assert sum(log.losses[-5:]) / 5 < 0.8 * sum(log.losses[:5]) / 5


def test_seeded_runs_repeat_exactly() -> None:
    runs = []
    for _ in range(2):
        model = tiny("luong")
        log = train_seq2seq(model, TASK.stream(16, seed=3), steps=5, show_progress=False)
        runs.append((log.losses, [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_sequence_loss_ignores_padding() -> None:
    logits = torch.randn(2, 3, 5)
    tgt = torch.tensor([[4, 2, 0], [3, 0, 0]])
    full = torch.nn.functional.cross_entropy(logits[tgt != 0], tgt[tgt != 0])
    torch.testing.assert_close(sequence_loss(logits, tgt), full)
    with pytest.raises(ValueError, match=r"logits must be \(B, T, V\) with \(B, T\) = \(2, 3\)"):
        sequence_loss(logits[:, :2], tgt)


def test_bad_training_arguments() -> None:
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        train_seq2seq(tiny(), TASK.stream(4, 0), steps=0)
    with pytest.raises(ValueError, match="lr must be > 0, got -1"):
        train_seq2seq(tiny(), TASK.stream(4, 0), steps=1, lr=-1)


def test_checkpoint_roundtrip_and_checksum(tmp_path) -> None:
    model = tiny("luong")
    path = tmp_path / "m.pt"
    sha = save_checkpoint(model, path)
    assert sha == file_sha256(path) and len(sha) == 64
    loaded = load_checkpoint(path, sha, build_model)
    assert loaded.config == model.config and not loaded.training
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"has sha256 [0-9a-f]{{64}}, expected {sha}"):
        load_checkpoint(path, sha, build_model)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "missing.pt", sha, build_model)


def test_load_or_train_uses_the_manifest(tmp_path, monkeypatch) -> None:
    model = tiny()
    sha = save_checkpoint(model, tmp_path / "bahdanau.pt")
    entry = {"file": "bahdanau.pt", "sha256": sha, "recipe": asdict(RECIPES["bahdanau"])}
    (tmp_path / "manifest.json").write_text(json.dumps({"bahdanau": entry}))
    loaded, got = load_or_train("bahdanau", tmp_path)
    assert got["sha256"] == sha and loaded.config == model.config

    calls = []

    def fake_train(recipe, device=None, show_progress=True):  # noqa: ARG001
        calls.append(recipe.name)
        return tiny(), TrainLog(losses=[1.0, 0.5], seconds=0.1)

    monkeypatch.setattr(training, "train_recipe", fake_train)
    _, fresh = load_or_train("bahdanau", tmp_path, retrain=True)
    _, missing = load_or_train("plain", tmp_path)
    assert calls == ["bahdanau", "plain"] and fresh["sha256"] is None and missing["losses"] == [0.75]


def test_unknown_recipe() -> None:
    with pytest.raises(ValueError, match=r"name must be one of .*got 'gpt'"):
        training.train_recipe("gpt")


def test_cosine_schedule_is_validated_and_trains() -> None:
    with pytest.raises(ValueError, match="min_lr_ratio must be in \\[0, 1\\] or None, got 2"):
        train_seq2seq(tiny(), TASK.stream(4, 0), steps=1, min_lr_ratio=2)
    log = train_seq2seq(tiny(), TASK.stream(16, 0), steps=3, min_lr_ratio=0.1, show_progress=False)
    assert len(log.losses) == 3


def test_evaluate_by_bucket_adds_up() -> None:
    pairs = NumberWords().sample(40, seed=5)
    res = evaluate_by_bucket(tiny(), pairs, edges=(1, 6, 28), batch_size=16)
    assert res["edges"] == [1, 6, 28] and res["count"] == 40
    assert [b["label"] for b in res["buckets"]] == ["1-5", "6-27"]
    assert sum(b["count"] for b in res["buckets"]) == 40
    weighted = sum(b["count"] * b["token_accuracy"] for b in res["buckets"]) / 40
    assert abs(weighted - res["token_accuracy"]) < 1e-9
    assert len(book_test_set(10)) == 10 and book_test_set(10) == book_test_set(10)


def test_train_and_save_then_load(tmp_path, monkeypatch) -> None:
    small = Recipe("bahdanau", {"kind": "bahdanau", "embed_dim": 4, "hidden_dim": 4}, steps=2, batch_size=4)
    monkeypatch.setitem(RECIPES, "bahdanau", small)
    train_and_save(["bahdanau"], tmp_path, show_progress=False)
    entry = read_manifest(tmp_path)["bahdanau"]
    assert entry["sha256"] == file_sha256(tmp_path / "bahdanau.pt") and entry["recipe"] == asdict(small)
    model, got = load_or_train("bahdanau", tmp_path)
    assert got == entry and model.config["hidden_dim"] == 4
    monkeypatch.setitem(RECIPES, "bahdanau", replace(small, steps=3))
    with pytest.raises(ValueError, match="trained with a recipe that differs"):
        load_or_train("bahdanau", tmp_path)
    with pytest.raises(SystemExit):
        training.main(["nonsense"])


def test_shipped_checkpoints_load_and_translate() -> None:
    manifest = read_manifest(CHECKPOINT_DIR)
    assert sorted(manifest) == sorted(RECIPES)
    pairs = book_test_set(100)
    for name, entry in manifest.items():
        path = CHECKPOINT_DIR / entry["file"]
        assert path.stat().st_size < 2_000_000, name
        model, got = load_or_train(name)  # verifies the sha256
        assert got["sha256"] == file_sha256(path) and got["recipe"] == asdict(RECIPES[name])
        if name == "bahdanau":
            assert evaluate_by_bucket(model, pairs)["exact_match"] > 0.8


def test_one_recipe_type_builds_every_model_kind() -> None:
    kinds = {r.kind for r in RECIPES.values()}
    assert kinds == {"plain", "bahdanau", "luong", "transformer"}
    for recipe in RECIPES.values():
        model = build_model(recipe.config(NumberWords()))
        assert isinstance(model, training.EncoderDecoder), recipe.name


def test_validation_set_is_disjoint_from_the_test_set_and_repeats() -> None:
    from attention_core.translation.metrics import book_validation_set

    val, test = book_validation_set(), book_test_set()
    in_test = {(tuple(s), tuple(t)) for s, t in test}
    assert len(val) == 500 and not any((tuple(s), tuple(t)) in in_test for s, t in val)
    assert val == book_validation_set() and book_validation_set(20) == val[:20]


def test_training_pairs_are_the_stream_the_recipe_trains_on() -> None:
    from itertools import islice

    from attention_core.translation.data import collate

    recipe = replace(RECIPES["bahdanau"], steps=3, batch_size=5, data_seed=11)
    pairs = training.training_pairs(recipe)
    task = NumberWords()
    assert len(pairs) == 15
    for i, batch in enumerate(islice(task.stream(recipe.batch_size, recipe.data_seed), recipe.steps)):
        expected = collate(pairs[5 * i:5 * (i + 1)], task.src_vocab, task.tgt_vocab)
        assert torch.equal(batch.src, expected.src) and torch.equal(batch.tgt_out, expected.tgt_out)
    assert training.training_pairs("bahdanau") == training.training_pairs("luong_local_p")  # one shared stream
    assert len(training.training_pairs("transformer_x2")) == 2 * len(training.training_pairs("transformer"))


def test_seen_in_training_counts_sources_per_bucket() -> None:
    from attention_core.translation.metrics import seen_in_training

    def p(n_words: int, tag: str = "a"):
        return [tag] * n_words, ["1"]

    test = [p(2), p(2, "b"), p(5), p(6), p(7), p(7), p(12), p(22)]
    training_set = [p(2), p(5), p(7), p(22), p(3)]
    assert seen_in_training(test, training_set) == [2, 2, 0, 0, 1]  # a repeated test source counts each time
    assert seen_in_training(test, training_set, edges=(1, 11, 28)) == [4, 1]
    assert seen_in_training(test, []) == [0] * 5
    with pytest.raises(ValueError, match="outside the bucket edges"):
        seen_in_training([p(30)], training_set)


def test_book_test_numbers_met_in_training() -> None:
    """Chapters 3, 4 and 8 assert these counts: the short test numbers recur in the 600-step stream."""
    from attention_core.translation.metrics import seen_in_training

    seen = seen_in_training(book_test_set(), training.training_pairs("bahdanau"))
    assert seen == [482, 71, 0, 0, 0]


def test_one_cosine_schedule_for_every_recipe() -> None:
    from attention_core.training.schedules import cosine_lr

    lrs = [cosine_lr(i, lr=1.0, steps=10, warmup=2, min_lr_ratio=0.1) for i in range(10)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == 1.0 and abs(lrs[-1] - 0.1) < 1e-12
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # decays after the warm-up
    assert [cosine_lr(i, lr=1.0, steps=3, warmup=100) for i in range(3)] == [0.01, 0.02, 0.03]  # a short check run
    # the translation loop's old formula, no warm-up: cos from lr to min_lr_ratio * lr over steps - 1
    import math
    assert cosine_lr(4, lr=2.0, steps=9, min_lr_ratio=0.5) == 2.0 * (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    with pytest.raises(ValueError, match="warmup >= 0"):
        cosine_lr(0, lr=1.0, steps=3, warmup=-1)
    for step in (-1, 3, 20):  # a step outside the run has no rate (it used to divide by zero or extrapolate)
        with pytest.raises(ValueError, match=r"step must be in \[0, steps\) = \[0, 3\)"):
            cosine_lr(step, lr=1.0, steps=3)


def test_the_shared_recipe_command_line(tmp_path):
    from attention_core.training.cli import recipes_main

    calls = []
    recipes = {"b": 1, "a": 2}
    recipes_main(["--all", "--out", str(tmp_path)], "d", recipes, tmp_path / "x", lambda n, o: calls.append((n, o)))
    recipes_main(["b"], "d", recipes, tmp_path / "x", lambda n, o: calls.append((n, o)))
    assert calls == [(["a", "b"], str(tmp_path)), (["b"], str(tmp_path / "x"))]
    for argv in (["a", "zzz"], []):
        with pytest.raises(SystemExit) as exit_:
            recipes_main(argv, "d", recipes, tmp_path, lambda n, o: calls.append((n, o)))
        assert exit_.value.code == 2
    assert len(calls) == 2  # nothing trained after a refusal


def test_eval_mode_restores_every_flag_also_on_error():
    import torch.nn as nn

    from attention_core.training.modes import eval_mode

    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)).train()
    model[0].eval()  # mixed modes: the caller's choice must survive
    with eval_mode(model):
        assert not any(m.training for m in model.modules())
    assert model.training and not model[0].training and model[1].training
    with pytest.raises(RuntimeError):
        with eval_mode(model):
            raise RuntimeError("boom")
    assert model.training and not model[0].training and model[1].training
    with pytest.raises(TypeError, match="nn.Module"):
        with eval_mode("not a model"):
            pass


def test_train_mode_restores_every_flag_also_on_error():
    import torch.nn as nn

    from attention_core.training.modes import train_mode

    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5)).eval()
    model[1].train()  # mixed modes
    with train_mode(model):
        assert all(m.training for m in model.modules())
    assert not model.training and not model[0].training and model[1].training
    with pytest.raises(RuntimeError):
        with train_mode(model):
            raise RuntimeError("boom")
    assert not model.training and not model[0].training and model[1].training
    with pytest.raises(TypeError, match="train_mode expects"):
        with train_mode(model, 3):
            pass


# ------------------------------------------------------------------------------------------------ modes (issue 37)


def _mode_cases():
    """(name, model, call): every public function of the models and task wings that runs a caller's model in
    eval (or train) mode for its own work."""
    from attention_core.models.captioner import Captioner, greedy_caption
    from attention_core.models.hybrid_lm import build_hybrid_lm
    from attention_core.models.language_model import build_language_model, generate
    from attention_core.models.vit import VisionTransformer
    from attention_core.shakespeare import heads, hybrid
    from attention_core.shakespeare import train as shakespeare_train
    from attention_core.translation.rnn import build_rnn_model, greedy_decode
    from attention_core.vision import train as vision_train

    lm = build_language_model({"vocab_size": 9, "d_model": 8, "num_layers": 2, "num_heads": 2, "seed": 0})
    vit = VisionTransformer({"image_size": [4, 4], "patch_size": 2, "in_channels": 1, "num_classes": 3, "d_model": 8,
                             "num_layers": 1, "num_heads": 2, "dim_feedforward": 8, "pos": "learned", "pool": "cls",
                             "dropout": 0.1})
    cap = Captioner({"image_size": [4, 8], "patch_size": 4, "in_channels": 1, "vocab_size": 5, "max_len": 2,
                     "d_model": 8, "num_heads": 2, "dim_feedforward": 8, "encoder_layers": 1, "decoder_layers": 1})
    hy = build_hybrid_lm({"vocab_size": 9, "d_model": 8, "num_heads": 2, "context": 4})
    ids = torch.arange(20) % 9
    seq = torch.tensor([[1, 2, 3, 1, 2, 3]])
    mt = build_rnn_model({"kind": "bahdanau", "src_vocab_size": 9, "tgt_vocab_size": 9, "embed_dim": 4,
                          "hidden_dim": 6, "seed": 0})
    src = torch.tensor([[4, 5, 6], [4, 5, 0]])
    x, y = torch.rand(6, 1, 4, 4), torch.arange(6) % 3
    return [
        ("generate greedy", lm, lambda: generate(lm, seq, 3, temperature=0.0)),
        ("generate sampled", lm, lambda: generate(lm, seq, 3, generator=torch.Generator().manual_seed(0))),
        ("generate no cache", lm, lambda: generate(lm, seq, 2, temperature=0.0, use_cache=False)),
        ("greedy_caption", cap, lambda: greedy_caption(cap, torch.rand(2, 1, 4, 8), 0, 2)),
        ("vision accuracy", vit, lambda: vision_train.accuracy(vit, x, y)),
        ("vision train_classifier", vit, lambda: vision_train.train_classifier(vit, x, y, 1, 4, 1e-3, 1, 0.0, 0)),
        ("probe_copying", lm, lambda: heads.probe_copying(lm, seq, 3)),
        ("evaluate_loss", lm, lambda: shakespeare_train.evaluate_loss(lm, ids, 4, max_blocks=2)),
        ("evaluate_hybrid", hy, lambda: hybrid.evaluate_hybrid(hy, ids, context=4, max_blocks=2)),
        ("translation greedy_decode", mt, lambda: greedy_decode(mt, src, torch.tensor([3, 2]), max_len=3)),
    ]


def _mixed_modes(model: torch.nn.Module) -> list:
    model.train()
    for i, m in enumerate(model.modules()):
        m.training = i % 3 != 1  # a pattern that neither train() nor eval() reproduces
    return [m.training for m in model.modules()]


@pytest.mark.parametrize("case", range(10))
def test_calls_that_switch_modes_give_every_flag_back(case: int) -> None:
    name, model, call = _mode_cases()[case]
    modes = _mixed_modes(model)
    call()
    assert [m.training for m in model.modules()] == modes, f"{name} changed the caller's modes"

    class Boom(Exception):
        pass

    def boom(module, args):
        raise Boom

    handles = [m.register_forward_pre_hook(boom) for m in model.modules() if not list(m.children())]
    try:
        with pytest.raises(Boom):
            call()
    finally:
        for h in handles:
            h.remove()
    assert [m.training for m in model.modules()] == modes, f"{name} changed the caller's modes on error"


def _m(name: str):
    import importlib
    return importlib.import_module("attention_core." + name)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: _m("training.checkpoint").recipe_entry("bad", None, None, None), TypeError,
     r"recipe must be a recipe \(a dataclass with a str name\), got 'bad'"),
    (lambda: _m("training.checkpoint").save_recipe_checkpoint(None, None, [1], "unused"), TypeError,
     r"recipe must be a recipe"),
    (lambda: _m("training.checkpoint").load_or_train_recipe(-3, "unused", None, None), TypeError,
     r"recipe must be a recipe"),
])
def test_training_recipe_helpers_refuse_bad_arguments_by_name(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
