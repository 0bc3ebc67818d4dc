"""Chapter 3's extra runs (other seeds, a longer budget, a wider vector): the runner and the recorded file."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from attention_core.translation import bottleneck
from attention_core.translation.metrics import BUCKET_EDGES, book_test_set
from attention_core.translation.train import RECIPES, train_recipe

SMALL_TEST = book_test_set()[:40]


def test_seed_zero_is_the_shipped_recipe() -> None:
    """Seed 0 at the recipe's width trains exactly as the recipe does (weights from 0, batches from 1)."""
    torch.set_num_threads(1)
    row = bottleneck.run_one("plain", 0, 3, 32, test=SMALL_TEST)
    _, log = train_recipe(replace(RECIPES["plain"], steps=3), show_progress=False)
    assert row["final_loss"] == pytest.approx(sum(log.losses) / 3, abs=1e-6)
    other = bottleneck.run_one("plain", 1, 3, 32, test=SMALL_TEST)
    assert other["final_loss"] != pytest.approx(row["final_loss"], abs=1e-6)


def test_a_row_records_its_settings_and_buckets() -> None:
    narrow = bottleneck.run_one("bahdanau", 2, 2, 16, test=SMALL_TEST)
    wide = bottleneck.run_one("bahdanau", 2, 2, 24, test=SMALL_TEST)
    assert (narrow["name"], narrow["seed"], narrow["steps"], narrow["hidden_dim"]) == ("bahdanau", 2, 2, 16)
    assert wide["parameters"] > narrow["parameters"]
    assert [b["label"] for b in narrow["buckets"]] == ["1-5", "6-10", "11-15", "16-20", "21-27"]
    assert sum(b["count"] for b in narrow["buckets"]) == len(SMALL_TEST)


def test_only_the_two_models_of_chapter_3() -> None:
    with pytest.raises(ValueError, match="name must be"):
        bottleneck.run_one("luong_dot", 0, 1, 32, test=SMALL_TEST)


def test_the_recorded_file_holds_each_listed_run_once() -> None:
    runs = bottleneck.read_runs()
    if not runs:
        pytest.skip("no recorded runs")
    keys = [(r["name"], r["seed"], r["steps"], r["hidden_dim"]) for r in runs]
    assert len(keys) == len(set(keys)) and set(keys) <= set(bottleneck.RUNS)
    for r in runs:
        assert len(r["buckets"]) == len(BUCKET_EDGES) - 1 and sum(b["count"] for b in r["buckets"]) == 2000
        assert all(0 <= b["exact_match"] <= b["token_accuracy"] <= 1 for b in r["buckets"])
