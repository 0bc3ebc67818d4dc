"""The recorded recipe of issue 42's comparison (attention_core.shakespeare.recent): its smoke setting runs every
step and writes a well-formed manifest and results file; the recipes keep the budget within 1%."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from attention_core.models.language_model import build_language_model, parameter_count
from attention_core.shakespeare import recent
from attention_core.training.checkpoint import file_sha256, load_checkpoint


def test_every_variant_keeps_the_baselines_budget_within_one_percent() -> None:
    budget = parameter_count(recent.BASE.config(65))
    for variant in recent.VARIANTS:
        r = recent.recipe_for(variant, 1)
        assert r.seed == 1 and r.data_seed == 2 and r.steps == recent.BASE.steps and r.bos
        assert abs(parameter_count(r.config(65)) - budget) <= 0.01 * budget, variant
    assert recent.recipe_for("indexed", 0).index_warmup == recent.BASE.steps // 5
    with pytest.raises(ValueError, match="variant must be one of"):
        recent.recipe_for("nope", 0)


@pytest.mark.parametrize("options", [{"qk_norm": True}, {}, {"layer_pattern": "LG", "local_window": 3}])
def test_the_recomputed_logits_are_the_ones_softmax_saw(options: dict) -> None:
    model = build_language_model({"vocab_size": 11, "d_model": 16, "num_layers": 2, "num_heads": 2,
                                  "num_kv_heads": 1, "seed": 0, **options}).double()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(8.0)  # peaked rows
        x = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(0))
        weights = model(x, need_weights=True).weights
        logits = recent.attention_logits(model, x)
    for w, z in zip(weights, logits):
        assert (torch.softmax(z, dim=-1) - w).abs().max() < 1e-9
    assert recent.max_attention_logit(model, x) == max(float(z.max()) for z in logits)


def test_the_smoke_setting_writes_a_manifest_and_results(tmp_path) -> None:
    results = recent.main(["--smoke", "--out", str(tmp_path)])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["summary"].keys() == set(recent.VARIANTS) == results["runs"].keys()
    assert set(manifest) == {f"recent_{v}_s0" for v in recent.VARIANTS}
    for name, entry in manifest.items():
        assert entry["sha256"] == file_sha256(tmp_path / entry["file"])
        assert entry["recipe"]["name"] == name and entry["recipe"]["steps"] == 3 and entry["recipe"]["bos"]
        model = load_checkpoint(tmp_path / entry["file"], entry["sha256"], build_language_model)
        assert model.config["vocab_size"] == 66
    for variant, runs in written["runs"].items():
        (run,) = runs
        assert abs(run["budget_gap"]) <= 0.01 and math.isfinite(run["val_loss"])
        assert 0.0 <= run["first_token_mass"] <= 1.0 and run["kv_bytes_per_token"] > 0
        for measure in ("mean", "min", "max"):
            assert math.isfinite(written["summary"][variant]["val_loss"][measure])
    assert written["runs"]["kv_share"][0]["kv_bytes_per_token"] == written["runs"]["baseline"][0][
        "kv_bytes_per_token"] / 2
    assert written["runs"]["gated_delta"][0]["kv_bytes_per_further_token"] == written["runs"]["baseline"][0][
        "kv_bytes_per_further_token"] / 2
    assert set(written["floors"]) >= {"bigram", "trigram", "unigram"}
    assert written["floors"]["trigram"] < written["floors"]["bigram"] < written["floors"]["unigram"]
    study = written["high_lr"]
    assert study["sweep"] and set(study["runs"]) == {"baseline", "qk_norm"}
    again = recent.main(["--smoke", "--high-lr-only", "--out", str(tmp_path)])  # the study alone, replaced
    rewritten = json.loads((tmp_path / "results.json").read_text())
    assert rewritten["high_lr"]["command"].endswith("--high-lr-only") and again["runs"] == rewritten["runs"]
    assert rewritten["runs"] == written["runs"] and all(s["steps"] == 3 for s in rewritten["high_lr"]["sweep"])


def test_divergence_is_a_validation_loss_above_the_unigram_floor_or_not_finite() -> None:
    assert recent._diverged(float("nan"), 3.3) and recent._diverged(float("inf"), 3.3)
    assert recent._diverged(3.4, 3.3) and not recent._diverged(2.4, 3.3)


def test_the_indexer_learns_in_training_and_the_warm_up_is_dense() -> None:
    """The indexed variant's loss carries the indexer's KL: its weights move (they get no gradient otherwise)."""
    from dataclasses import replace

    from attention_core.shakespeare.data import load_corpus

    corpus = load_corpus()
    recipe = recent.recipe_for("indexed", 0, replace(recent.BASE, steps=2, warmup=1))
    assert recipe.index_warmup == 1  # the first of the two steps attends densely
    fresh = build_language_model(recipe.config(len(corpus.vocab)))
    model, log = recent.train_recent(recipe, corpus)
    moved = {n: not torch.equal(p, dict(fresh.named_parameters())[n]) for n, p in model.named_parameters()}
    assert all(moved[n] for n in moved if ".indexer." in n) and len(log.losses) == 2


def test_the_committed_comparison_is_whole_and_its_checkpoints_are_what_the_manifest_says() -> None:
    """The recorded run (``python -m attention_core.shakespeare.recent``): every variant with three seeds, each
    checkpoint's sha256 and recipe in the manifest, the budget within 1%, the summaries the mean, min and max of
    the runs."""
    results = json.loads((recent.RECENT_DIR / "results.json").read_text())
    manifest = json.loads((recent.RECENT_DIR / "manifest.json").read_text())
    assert set(results["runs"]) == set(recent.VARIANTS) and results["seeds"] == list(recent.SEEDS)
    for variant, runs in results["runs"].items():
        assert [r["seed"] for r in runs] == list(recent.SEEDS)
        for r in runs:
            entry = manifest[f"recent_{variant}_s{r['seed']}"]
            path = recent.RECENT_DIR / entry["file"]
            assert entry["sha256"] == r["sha256"] == file_sha256(path) and path.stat().st_size < 1_000_000
            assert entry["recipe"] == {**entry["recipe"], "variant": variant, "seed": r["seed"], "steps": recent.STEPS}
            assert abs(r["budget_gap"]) <= 0.01
        for measure, s in results["summary"][variant].items():
            values = [r[measure] for r in runs]
            assert s["min"] == min(values) and s["max"] == max(values)
            assert math.isclose(s["mean"], sum(values) / len(values), rel_tol=1e-9, abs_tol=1e-12)
    assert set(results["high_lr"]["runs"]) == {"baseline", "qk_norm"}


def test_the_sink_study_smoke_setting_trains_its_three_variants_at_the_sink_scale(tmp_path) -> None:
    results = recent.main(["--sink-scale", "--smoke", "--out", str(tmp_path)])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert set(results["runs"]) == set(recent.SINK_VARIANTS) and "high_lr" not in results
    assert set(manifest) == {f"recent_{v}_s0" for v in recent.SINK_VARIANTS}
    for entry in manifest.values():
        assert entry["recipe"]["context"] == 128 and entry["recipe"]["batch_size"] == 32 and entry["recipe"]["bos"]
    assert results["command"].endswith("--smoke --sink-scale")
    with pytest.raises(SystemExit):
        recent.main(["--sink-scale", "--high-lr-only", "--out", str(tmp_path)])


def test_the_committed_sink_study_is_whole_at_the_sink_recipes_scale() -> None:
    """The recorded sink study (``python -m attention_core.shakespeare.recent --sink-scale``): the baseline, the
    output gate and sink logits, three seeds each, 2000 steps of 32 crops of 128, each checkpoint as the manifest
    says, the budget within 1%."""
    results = json.loads((recent.RECENT_SINK_DIR / "results.json").read_text())
    manifest = json.loads((recent.RECENT_SINK_DIR / "manifest.json").read_text())
    assert tuple(results["runs"]) == recent.SINK_VARIANTS and results["seeds"] == list(recent.SINK_SEEDS)
    assert results["base_recipe"]["steps"] == 2000 and results["base_recipe"]["context"] == 128
    for variant, runs in results["runs"].items():
        assert [r["seed"] for r in runs] == [0, 1, 2]
        for r in runs:
            entry = manifest[f"recent_{variant}_s{r['seed']}"]
            path = recent.RECENT_SINK_DIR / entry["file"]
            assert entry["sha256"] == r["sha256"] == file_sha256(path) and path.stat().st_size < 1_000_000
            assert entry["recipe"]["steps"] == 2000 and entry["recipe"]["batch_size"] == 32
            assert abs(r["budget_gap"]) <= 0.01
        for measure, s in results["summary"][variant].items():
            values = [r[measure] for r in runs]
            assert s["min"] == min(values) and s["max"] == max(values)


def test_reuse_keeps_the_recorded_runs_and_trains_only_new_seeds(tmp_path, monkeypatch) -> None:
    base = dataclasses.replace(recent.BASE, steps=3, warmup=1)
    kw = dict(variants=("baseline", "qk_norm"), high_lrs=(1e-2, 3.0), val_blocks=4, decode_tokens=2)
    first = recent.run_comparison(tmp_path, base, seeds=(0,), **kw)
    trained, train = [], recent.train_recent
    monkeypatch.setattr(recent, "train_recent", lambda r, *a, **k: trained.append(r.name) or train(r, *a, **k))
    more = recent.run_comparison(tmp_path, base, seeds=(0, 1), reuse=True, **kw)
    assert len(trained) == 4  # seed 1 of both variants and of both high-rate arms; no sweep again
    assert more["runs"]["baseline"][0] == first["runs"]["baseline"][0]  # kept as recorded, decode time included
    assert [r["seed"] for r in more["runs"]["qk_norm"]] == [0, 1]
    assert more["high_lr"]["sweep"] == first["high_lr"]["sweep"]
    assert more["high_lr"]["runs"]["baseline"][0] == first["high_lr"]["runs"]["baseline"][0]
    assert [r["seed"] for r in more["high_lr"]["runs"]["qk_norm"]] == [0, 1]
    other = recent.run_comparison(tmp_path / "x", dataclasses.replace(base, lr=1e-3), seeds=(0,), reuse=True, **kw)
    assert other["runs"]["baseline"][0]["sha256"] != first["runs"]["baseline"][0]["sha256"]  # another recipe: trained


@pytest.mark.parametrize("args, pattern", [
    (("bad",), r"out must be a pathlib.Path \(the results' directory\), got str 'bad'"),
    ((-3,), r"out must be a pathlib.Path \(the results' directory\), got int -3"),
    ((None, "bad"), r"base must be a RecentRecipe, got str 'bad'"),
])
def test_run_comparison_checks_its_directory_and_recipe_before_training(args, pattern, tmp_path):
    args = (tmp_path / "out", *args[1:]) if args[0] is None else args
    with pytest.raises(TypeError, match=pattern):
        recent.run_comparison(*args)
    assert not (tmp_path / "out").exists()  # refused before anything was written
