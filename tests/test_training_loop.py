"""The one training loop (`training.loop.fit`) and the recipe base every wing's recipes derive from."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from attention_core.training.loop import TrainRecipe, fit, make_optimizer

ROOT = Path(__file__).resolve().parents[1] / "attention_core"
WINGS = ("translation", "sentences", "shakespeare", "vision")


def _tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Dropout(0.0), nn.Linear(4, 2))


def _data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, generator=g)
    return x, (x[:, 0] > 0).long()


def _run(recipe: TrainRecipe, model: nn.Module = None, **kwargs):
    model = _tiny() if model is None else model
    x, y = _data()
    log = fit(model, recipe, lambda step: (x[step % 8 * 8:][:8], y[step % 8 * 8:][:8]),
              lambda m, b: F.cross_entropy(m(b[0]), b[1]), show_progress=False, **kwargs)
    return model, log


def test_every_step_gets_the_recipes_learning_rate_and_the_hook_sees_each_step():
    recipe = TrainRecipe("t", steps=7, lr=0.1, warmup=2, min_lr_ratio=0.25)
    model = _tiny()
    opt = recipe.optimizer(model)
    seen = []
    _run(recipe, model, optimizer=opt, on_step=lambda step, m: seen.append((step, opt.param_groups[0]["lr"])))
    assert seen == [(s, recipe.lr_at(s)) for s in range(7)]
    assert seen[0][1] == pytest.approx(0.05) and seen[-1][1] == pytest.approx(0.025)


def test_a_constant_rate_when_the_schedule_returns_none():
    recipe = TrainRecipe("t", steps=4, lr=0.1, warmup=2)
    model = _tiny()
    opt = recipe.optimizer(model)
    seen = []
    _run(recipe, model, optimizer=opt, lr_at=lambda step: None, on_step=lambda s, m: seen.append(
        opt.param_groups[0]["lr"]))
    assert seen == [0.1] * 4


def test_runs_repeat_exactly_and_clipping_changes_the_run():
    a, log_a = _run(TrainRecipe("t", steps=6, lr=0.05))
    b, log_b = _run(TrainRecipe("t", steps=6, lr=0.05))
    c, log_c = _run(TrainRecipe("t", steps=6, lr=0.05, clip=1e-3))
    assert log_a.losses == log_b.losses and len(log_a.losses) == 6
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert log_c.losses[1:] != log_a.losses[1:]  # a tiny clip slows every step after the first


def test_clip_bounds_the_gradient_norm_of_each_step():
    recipe = TrainRecipe("t", steps=3, lr=1e-9, clip=1e-2)
    norms = []

    def hook(step, m):
        norms.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in m.parameters()])).item())

    _run(recipe, on_step=hook)
    assert len(norms) == 3 and max(norms) <= 1e-2 * (1 + 1e-5)


def test_modes_come_back_also_when_the_loss_raises():
    model = _tiny().eval()
    model[2].train()  # mixed modes
    modes = [m.training for m in model.modules()]
    seen = []

    def loss_of(m, b):
        seen.append([s.training for s in m.modules()])
        if len(seen) == 2:
            raise RuntimeError("boom")
        return F.cross_entropy(m(b[0]), b[1])

    x, y = _data()
    with pytest.raises(RuntimeError, match="boom"):
        fit(model, TrainRecipe("t", steps=5), lambda s: (x[:8], y[:8]), loss_of, show_progress=False)
    assert all(seen[0]) and [m.training for m in model.modules()] == modes


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(TypeError, match="model must be"):
        fit("model", TrainRecipe("t"), lambda s: None, lambda m, b: None)
    with pytest.raises(TypeError, match="recipe must be a TrainRecipe"):
        fit(_tiny(), {"steps": 3}, lambda s: None, lambda m, b: None)
    for steps in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="recipe.steps"):
            fit(_tiny(), TrainRecipe("t", steps=steps), lambda s: None, lambda m, b: None)
    with pytest.raises(ValueError, match="weight_decay"):
        make_optimizer(_tiny(), "adam", 1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match="kind"):
        make_optimizer(_tiny(), "sgd", 1e-3)
    with pytest.raises(TypeError):
        TrainRecipe("t", 10)  # the training fields are keywords: a positional one is a mistake


def test_adamw_decays_the_matrices_only():
    model = _tiny()
    opt = make_optimizer(model, "adamw", 1e-3, weight_decay=0.1, betas=(0.9, 0.99))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    assert decayed == {id(p) for p in model.parameters() if p.dim() >= 2}
    assert all(g["betas"] == (0.9, 0.99) for g in opt.param_groups)


def test_every_wings_recipe_is_a_train_recipe_with_its_optimizer():
    from attention_core.sentences.train import RECIPES as sentences
    from attention_core.shakespeare.hybrid import HYBRID_RECIPES
    from attention_core.shakespeare.train import RECIPES as shakespeare
    from attention_core.translation.train import RECIPES as translation
    from attention_core.vision.train import CAPTION_RECIPE, VIT_RECIPE

    expect = {"adam": [*translation.values(), *sentences.values()],
              "adamw": [*shakespeare.values(), *HYBRID_RECIPES.values(), VIT_RECIPE, CAPTION_RECIPE]}
    for kind, recipes in expect.items():
        for r in recipes:
            assert isinstance(r, TrainRecipe) and r.OPTIMIZER == kind, r.name
    assert {r.BETAS for r in [*shakespeare.values(), *HYBRID_RECIPES.values()]} == {(0.9, 0.99)}
    assert VIT_RECIPE.BETAS == CAPTION_RECIPE.BETAS == (0.9, 0.999)


def test_no_wing_writes_its_own_loop():
    """The task wings build no optimiser and call no backward: `training.loop.fit` does, for all of them."""
    found = []
    for wing in WINGS + ("models",):
        for path in sorted((ROOT / wing).glob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"torch\.optim\.|\.backward\(|clip_grad_norm_", line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, found


# The schedules the shipped checkpoints were trained with, as each wing wrote them before they shared one loop:
# bit-for-bit equality keeps every checkpoint reproducible from its recorded recipe.
def _vision_schedule(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(steps - warmup, 1)))


def _sentences_schedule(step, steps, lr, min_lr_ratio):
    frac = step / max(steps - 1, 1)
    cosine = 0.5 * (1 + math.cos(math.pi * frac))
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * cosine)


def test_the_shared_schedules_equal_those_the_checkpoints_were_trained_with_bit_for_bit():
    from attention_core.sentences.train import RECIPES as sentences
    from attention_core.vision.train import CAPTION_RECIPE, VIT_RECIPE

    for r in (VIT_RECIPE, CAPTION_RECIPE, dataclasses.replace(VIT_RECIPE, steps=37, warmup=5, lr=7e-3)):
        assert [r.lr_at(s) for s in range(r.steps)] == [_vision_schedule(s, r.steps, r.lr, r.warmup)
                                                        for s in range(r.steps)]
    for r in (*sentences.values(), dataclasses.replace(sentences["gru"], steps=53, lr=1.7e-3, min_lr_ratio=0.3)):
        assert [r.lr_at(s) for s in range(r.steps)] == [_sentences_schedule(s, r.steps, r.lr, r.min_lr_ratio)
                                                        for s in range(r.steps)]


def test_the_vision_schedule_refuses_a_floor_it_would_ignore():
    from attention_core.vision.train import VIT_RECIPE

    with pytest.raises(ValueError, match="min_lr_ratio"):
        dataclasses.replace(VIT_RECIPE, min_lr_ratio=0.1).lr_at(500)


def test_every_manifest_records_the_recipe_the_library_has():
    import json

    from attention_core.sentences.train import RECIPES as sentences
    from attention_core.shakespeare.hybrid import HYBRID_RECIPES
    from attention_core.shakespeare.train import RECIPES as shakespeare
    from attention_core.translation.train import RECIPES as translation
    from attention_core.vision.train import CAPTION_RECIPE, VIT_RECIPE

    known = {r.name: r for r in (*translation.values(), *sentences.values(), *shakespeare.values(),
                                 *HYBRID_RECIPES.values(), VIT_RECIPE, CAPTION_RECIPE)}
    seen = 0
    for manifest in sorted(ROOT.rglob("checkpoints/manifest.json")):
        for name, entry in json.loads(manifest.read_text()).items():
            assert entry["recipe"] == dataclasses.asdict(known[name]), (manifest, name)
            seen += 1
    assert seen >= 25


def test_recipe_named_takes_a_recipe_or_a_known_name_and_lists_the_names_otherwise():
    from attention_core.training.loop import recipe_named

    a, b = TrainRecipe("a"), TrainRecipe("b", steps=2)
    recipes = {"a": a, "b": b}
    assert recipe_named("b", recipes, TrainRecipe) is b
    other = TrainRecipe("c")
    assert recipe_named(other, recipes, TrainRecipe) is other  # a recipe passes through, known or not
    with pytest.raises(ValueError, match=r"name must be one of \['a', 'b'\], got 'c'"):
        recipe_named("c", recipes, TrainRecipe)


def test_train_and_record_saves_each_model_with_its_measures_on_one_thread(tmp_path, capsys, monkeypatch):
    from attention_core.training.checkpoint import file_sha256, read_manifest
    from attention_core.training.cli import train_and_record

    class Tiny(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.net = _tiny(config["seed"])

        def forward(self, x):
            return self.net(x)

    def train(recipe):
        model = Tiny({"seed": recipe.seed})
        x, y = _data()
        return model, fit(model, recipe, lambda step: (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                          show_progress=False)

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    recipes = [TrainRecipe("one", steps=3), TrainRecipe("two", steps=2, seed=1)]
    entries = train_and_record(recipes, tmp_path, train, lambda m: {"test_accuracy": 0.5})
    assert threads == [1]
    manifest = read_manifest(tmp_path)
    assert sorted(manifest) == ["one", "two"] and [manifest["one"], manifest["two"]] == entries
    for r, e in zip(recipes, entries):
        assert e["sha256"] == file_sha256(tmp_path / f"{r.name}.pt") and e["recipe"] == dataclasses.asdict(r)
        assert e["test_accuracy"] == 0.5 and len(e["losses"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("two: 34 parameters, ")
    assert ", test accuracy 0.5, sha256 " in lines[0]


def test_a_wing_gives_training_defaults_as_class_keywords_and_they_stay_keyword_only():
    @dataclasses.dataclass(frozen=True)
    class Mine(TrainRecipe, steps=40, lr=2e-3, clip=0.5):
        width: int = 8

    r = Mine("m", 16)
    assert (r.width, r.steps, r.lr, r.clip, r.batch_size) == (16, 40, 2e-3, 0.5, 1)
    by_name = {f.name: f for f in dataclasses.fields(Mine)}
    assert [f.name for f in dataclasses.fields(Mine)][:3] == ["name", "steps", "batch_size"]  # TrainRecipe's order
    assert by_name["steps"].kw_only and by_name["clip"].type == "Optional[float]" and not by_name["width"].kw_only
    assert Mine("m", steps=3).steps == 3
    with pytest.raises(TypeError):
        Mine("m", 16, 99)  # steps is not positional

    @dataclasses.dataclass(frozen=True)
    class Child(Mine):  # no keywords: the parent's defaults hold
        depth: int = 2

    assert Child("c").steps == 40 and Child("c").lr == 2e-3


@pytest.mark.parametrize("body", ["unknown", "declared", "positional"])
def test_a_class_keyword_that_is_not_a_training_field_is_refused(body):
    refused = r"class keywords must be training fields of TrainRecipe .*got \['(lerning_rate|steps|name)'\]"
    with pytest.raises(TypeError, match=refused):
        if body == "unknown":
            class Typo(TrainRecipe, lerning_rate=1e-3):
                pass
        elif body == "declared":
            class Twice(TrainRecipe, steps=3):
                steps: int = 4
        else:
            class Name(TrainRecipe, name="n"):
                pass
