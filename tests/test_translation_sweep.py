"""Chapter 8's learning-rate sweep: the choice of rate, the resumable record and the shipped results."""

from __future__ import annotations

import json

import pytest

from attention_core.translation import sweep
from attention_core.translation.train import RECIPES


def _row(arm, lr, seed, val, test=0.5):
    return {"arm": arm, "lr": lr, "seed": seed, "steps": 600, "val_exact": val, "test_exact": test}


def test_chosen_lr_is_the_best_on_validation_at_seed_0():
    runs = [_row("transformer", 2e-3, 0, 0.8), _row("transformer", 5e-3, 0, 0.9), _row("transformer", 1e-2, 0, 0.7),
            _row("transformer", 2e-3, 1, 0.99)]  # another seed's score does not take part
    assert sweep.chosen_lr(runs, "transformer") == 5e-3


def test_chosen_lr_breaks_ties_towards_the_smaller_rate_and_refuses_a_missing_arm():
    runs = [_row("bahdanau", 1e-2, 0, 0.9), _row("bahdanau", 2e-3, 0, 0.9)]
    assert sweep.chosen_lr(runs, "bahdanau") == 2e-3
    with pytest.raises(ValueError, match="transformer"):
        sweep.chosen_lr(runs, "transformer")


def test_read_sweep_of_a_missing_file_is_empty(tmp_path):
    assert sweep.read_sweep(tmp_path / "none.json") == []


def test_main_resumes_without_repeating_a_recorded_run(tmp_path, monkeypatch):
    out = tmp_path / "sweep.json"
    trained = []

    def fake_run_one(arm, lr, seed, steps=None, test=True):
        trained.append((arm, lr, seed))
        return _row(arm, lr, seed, val={2e-3: 0.5, 5e-3: 0.9, 1e-2: 0.6}.get(lr, 0.1))

    monkeypatch.setattr(sweep, "run_one", fake_run_one)
    sweep.main(["--out", str(out)])
    first = list(trained)
    assert ("transformer", 5e-3, 0) in first and ("bahdanau", RECIPES["bahdanau"].lr, 4) in first
    assert all(lr == 5e-3 for arm, lr, seed in first if arm == "transformer" and seed > 0)
    assert len(first) == len(set(first))
    trained.clear()
    sweep.main(["--out", str(out)])
    assert trained == [] and len(json.loads(out.read_text())["runs"]) == len(first)


def test_shipped_results_hold_each_arm_at_equal_steps():
    runs = sweep.read_sweep()
    if not runs:
        pytest.skip("no lr_sweep.json shipped")
    assert {r["steps"] for r in runs} == {RECIPES["transformer"].steps} == {RECIPES["bahdanau"].steps}
    assert {r["lr"] for r in runs if r["arm"] == "transformer" and r["seed"] == 0} >= set(sweep.LRS)
    assert all(0 <= r["val_exact"] <= 1 and 0 <= r["test_exact"] <= 1 for r in runs)
