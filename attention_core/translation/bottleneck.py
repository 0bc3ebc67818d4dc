"""Chapter 3's bottleneck experiment beyond the shipped pair of models: other seeds, a longer budget, a wider vector.

The chapter compares the shipped ``"plain"`` and ``"bahdanau"`` models (one seed, 600 steps). This module
records what the comparison looks like when one thing is changed at a time, everything else as the recipe has it:

- ``seed``: another initialisation and another training stream (weights from ``seed``, batches from
  ``data_seed = seed + 1``, so seed 0 is the shipped recipe);
- ``steps``: a longer budget (the cosine schedule is stretched over it and still ends at 5% of the peak rate);
- ``hidden_dim``: a wider encoder, hence a wider summary vector ``c`` (``2 * hidden_dim`` numbers) and decoder.

Each run is scored on the book's 2,000 test numbers by source-length bucket (exact match and token accuracy).
The results go to ``checkpoints/bottleneck_runs.json`` (no weights), which chapter 3 reads:
``python -m attention_core.translation.bottleneck`` (one CPU thread; about an hour on a shared 2-core machine).
Runs already in the file are not repeated, so an interrupted run resumes.
"""

from __future__ import annotations

import platform
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from attention_core.translation.data import Pair
from attention_core.translation.metrics import book_test_set, evaluate_by_bucket
from attention_core.translation.studies import read_runs as read_recorded
from attention_core.translation.studies import study_main
from attention_core.translation.train import CHECKPOINT_DIR, RECIPES, train_recipe

__all__ = ["RUNS", "RUNS_FILE", "main", "read_runs", "run_one"]

#: Where the results are recorded.
RUNS_FILE = CHECKPOINT_DIR / "bottleneck_runs.json"
#: The runs in the order they are made, each a (recipe name, seed, steps, hidden_dim) tuple.
RUNS = (
    *((name, seed, 600, 32) for seed in (1, 2, 3, 4) for name in ("plain", "bahdanau")),  # other seeds
    *(run for seed in (0, 1, 2) for run in (
        ("plain", seed, 600, 64),  # a summary vector c of 128 numbers instead of 64
        ("plain", seed, 1800, 32),  # three times the budget
    )),
)


def run_one(name: str, seed: int, steps: int, hidden_dim: int, test: Optional[Sequence[Pair]] = None
            ) -> Dict[str, Any]:
    """Train the recipe ``name`` (``"plain"`` or ``"bahdanau"``) with weights from ``seed``, batches from
    ``seed + 1``, ``steps`` steps and encoder width ``hidden_dim``, the rest as the recipe has it; score it on
    ``test`` (default: the book's test set) by bucket.

    Returns:
        dict: ``{"name", "seed", "steps", "hidden_dim", "parameters", "final_loss", "exact_match",
        "token_accuracy", "buckets": [{"label", "count", "exact_match", "token_accuracy"}, ...], "seconds"}``.
    """
    if name not in ("plain", "bahdanau"):
        raise ValueError(f"name must be 'plain' or 'bahdanau', got {name!r}")
    base = RECIPES[name]
    recipe = replace(base, seed=seed, data_seed=seed + 1, steps=steps, model={**base.model, "hidden_dim": hidden_dim})
    model, log = train_recipe(recipe, show_progress=False)
    scores = evaluate_by_bucket(model, book_test_set() if test is None else test)
    return {"name": name, "seed": seed, "steps": steps, "hidden_dim": hidden_dim,
            "parameters": sum(p.numel() for p in model.parameters()),
            "final_loss": sum(log.losses[-25:]) / len(log.losses[-25:]),
            "exact_match": scores["exact_match"], "token_accuracy": scores["token_accuracy"],
            "buckets": [{k: b[k] for k in ("label", "count", "exact_match", "token_accuracy")}
                        for b in scores["buckets"]],
            "seconds": round(log.seconds)}


def read_runs(path: Path = RUNS_FILE) -> List[Dict[str, Any]]:
    """The recorded runs (a list of :func:`run_one` rows), or an empty list when the file is missing."""
    return read_recorded(path)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m attention_core.translation.bottleneck [--out FILE]``: the runs of :data:`RUNS` (resumable)."""
    meta = {"command": "python -m attention_core.translation.bottleneck", "threads": 1,
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    study = study_main(argv, main.__doc__, RUNS_FILE, meta)
    for name, seed, steps, hidden in RUNS:
        study.ensure({"name": name, "seed": seed, "steps": steps, "hidden_dim": hidden},
                     partial(run_one, name, seed, steps, hidden),
                     lambda r: f"{r['name']:8s} seed={r['seed']} steps={r['steps']} hidden={r['hidden_dim']}: exact "
                               f"by bucket {[round(b['exact_match'], 3) for b in r['buckets']]}")


if __name__ == "__main__":
    main()
