"""Chapter 8's comparison: a learning-rate sweep for the Transformer, then several seeds for both arms.

The book's recipes give Bahdanau's RNN model and the Transformer one learning rate (5e-3, the rate that came
with the RNN recipes, not tuned for the Transformer).
This module trains both arms for the same number of steps on the same kind of batches, with

1. a learning-rate sweep of the Transformer at seed 0 (``LRS``, one more step past the grid's edge if the best
   lies there), scored on the 500 validation numbers
   (:func:`~attention_core.translation.metrics.book_validation_set`), and its best rate chosen there;
2. more seeds (a seed sets the initial weights, ``seed``, and the training stream, ``data_seed = seed + 1``):
   the Transformer at its chosen rate, Bahdanau's model at the recipes' rate (not at a rate chosen for it);
3. Bahdanau's model at the same rates ``LRS``, seed 0 only, which shows whether the recipes' rate is its best
   (the grid is not extended for it);

each run scored on the validation and on the test set.

The results go to ``checkpoints/lr_sweep.json`` (no weights), which chapter 8 reads:
``python -m attention_core.translation.sweep`` (one CPU thread; about half an hour on a quiet 2-core machine).
Runs that are already in the file are not repeated, so an interrupted sweep resumes.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from attention_core.translation.metrics import book_test_set, book_validation_set, evaluate_by_bucket
from attention_core.translation.studies import read_runs, study_main
from attention_core.translation.train import CHECKPOINT_DIR, RECIPES, load_or_train, train_recipe

__all__ = ["ARMS", "LRS", "SEEDS", "SWEEP_FILE", "chosen_lr", "read_sweep", "run_one", "main"]

#: The two arms compared (names of :data:`~attention_core.translation.train.RECIPES`).
ARMS = ("bahdanau", "transformer")
#: The learning rates tried for each arm at seed 0 (5e-3 is the recipes' rate).
LRS = (2e-3, 5e-3, 1e-2)
#: The seeds run for each arm (the Transformer at its chosen rate, Bahdanau's model at the recipes' rate).
SEEDS = (0, 1, 2, 3, 4)
#: Where the results are recorded.
SWEEP_FILE = CHECKPOINT_DIR / "lr_sweep.json"


def run_one(name: str, lr: float, seed: int, steps: Optional[int] = None, test: bool = True) -> Dict[str, Any]:
    """Train the recipe ``name`` with learning rate ``lr`` and seed ``seed`` (weights from ``seed``, batches from
    ``seed + 1``), everything else as the recipe has it; score it by exact match on the validation set (and on the
    test set when ``test``). When these settings are the recipe's own, the shipped checkpoint is that run and is
    loaded instead of trained again (``"source": "checkpoint"``)."""
    if not isinstance(name, str) or name not in RECIPES:
        raise ValueError(f"name must be one of {sorted(RECIPES)}, got {name!r}")
    recipe = replace(RECIPES[name], lr=lr, seed=seed, data_seed=seed + 1, **({"steps": steps} if steps else {}))
    if recipe == RECIPES[name]:
        model, entry = load_or_train(name)
        source, final_loss = "checkpoint", entry["losses"][-1]
    else:
        model, log = train_recipe(recipe, show_progress=False)
        source, final_loss = "trained", sum(log.losses[-25:]) / len(log.losses[-25:])
    row: Dict[str, Any] = {"arm": name, "lr": lr, "seed": seed, "steps": recipe.steps, "source": source,
                           "final_loss": final_loss,
                           "val_exact": evaluate_by_bucket(model, book_validation_set())["exact_match"]}
    if test:
        scores = evaluate_by_bucket(model, book_test_set())
        row["test_exact"] = scores["exact_match"]
        row["test_buckets"] = [b["exact_match"] for b in scores["buckets"]]
    return row


def read_sweep(path: Path = SWEEP_FILE) -> List[Dict[str, Any]]:
    """The recorded runs (a list of :func:`run_one` rows), or an empty list when the file is missing."""
    return read_runs(path)


def chosen_lr(runs: Sequence[Dict[str, Any]], arm: str, seed: int = 0) -> float:
    """The learning rate with the best validation exact match for ``arm`` among the runs at ``seed`` (ties: the
    smaller rate)."""
    rows = [r for r in runs if r["arm"] == arm and r["seed"] == seed]
    if not rows:
        raise ValueError(f"no recorded run of arm {arm!r} at seed {seed}")
    return max(rows, key=lambda r: (r["val_exact"], -r["lr"]))["lr"]


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m attention_core.translation.sweep [--out FILE]``: the sweep, then the seeds (resumable)."""
    meta = {"command": "python -m attention_core.translation.sweep", "threads": 1, "lrs": list(LRS),
            "seeds": list(SEEDS), "arms": list(ARMS)}
    study = study_main(argv, main.__doc__, SWEEP_FILE, meta)
    runs = study.runs

    def ensure(arm: str, lr: float, seed: int) -> None:
        study.ensure({"arm": arm, "lr": lr, "seed": seed}, lambda: run_one(arm, lr, seed),
                     lambda r: f"{arm:12s} lr={lr:g} seed={seed}: val {r['val_exact']:.3f} test {r['test_exact']:.3f}")

    # The Transformer's sweep first, then seeds of both arms, Bahdanau's at the recipes' rate (a tilt towards the
    # Transformer), then Bahdanau's own sweep: an interrupted run has the runs that matter most.
    for lr in LRS:
        ensure("transformer", lr, 0)
    best = chosen_lr(runs, "transformer")
    if best in (min(LRS), max(LRS)):  # a best rate at the edge of the grid: one more step past it
        ensure("transformer", best / 2 if best == min(LRS) else best * 2, 0)
    for seed in SEEDS[1:]:
        ensure("transformer", chosen_lr(runs, "transformer"), seed)
        ensure("bahdanau", RECIPES["bahdanau"].lr, seed)
    for lr in LRS:
        ensure("bahdanau", lr, 0)


if __name__ == "__main__":
    main()
