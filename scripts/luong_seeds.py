"""Chapter 4's seed study: the Luong variants retrained from other initialisations, and local-m with the paper's D = 10.

Each run is a book recipe (600 steps of 64 numbers, the same data stream, cosine schedule) with another
parameter seed, and for the local variants possibly another half-width D. Seed 0 with D = 3 is the shipped
checkpoint itself (evaluated, not retrained). Results go to
``attention_core/translation/checkpoints/luong_seeds.json`` after every run, so a partial study is usable.

    OMP_NUM_THREADS=1 python scripts/luong_seeds.py [--seeds 0 1 2 3 4]

Runs on one thread, one run at a time (60 to 269 s each in the recorded study, on a two-core Xeon shared
with other jobs).
"""

from __future__ import annotations

import argparse
import dataclasses
from functools import partial

import torch

from attention_core.translation import metrics, train
from attention_core.translation.studies import RecordedRuns

OUT = train.CHECKPOINT_DIR / "luong_seeds.json"
#: (label, recipe name, window D or None for the recipe's own)
CONFIGS = [("luong_dot", "luong_dot", None), ("luong_general", "luong_general", None),
           ("luong_concat", "luong_concat", None), ("luong_local_p", "luong_local_p", None),
           ("luong_local_m", "luong_local_m", None), ("luong_local_m_D10", "luong_local_m", 10)]


def run_one(label: str, name: str, window: int | None, seed: int, val, test) -> dict:
    recipe = train.RECIPES[name]
    if window is not None:
        recipe = dataclasses.replace(recipe, model={**recipe.model, "window": window})
    recipe = dataclasses.replace(recipe, seed=seed)
    shipped = seed == train.RECIPES[name].seed and window is None
    if shipped:
        model, entry = train.load_or_train(name)
        seconds = None
    else:
        model, log = train.train_recipe(recipe, show_progress=False)
        seconds = round(log.seconds, 1)
    v, t = metrics.evaluate_by_bucket(model, val), metrics.evaluate_by_bucket(model, test)
    return {"label": label, "recipe": name, "window": recipe.model.get("window"), "seed": seed,
            "shipped": shipped, "train_seconds": seconds, "val_exact": v["exact_match"],
            "test_exact": t["exact_match"], "test_exact_21_27": t["buckets"][-1]["exact_match"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--only", nargs="+", default=None, help="labels to run (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    val, test = metrics.book_validation_set(), metrics.book_test_set()
    study = RecordedRuns(OUT, {"about": __doc__.splitlines()[0]})
    for seed in args.seeds:  # seed-major: the variants' runs interleave in time
        for label, name, window in CONFIGS:
            if args.only and label not in args.only:
                continue
            study.ensure({"label": label, "seed": seed}, partial(run_one, label, name, window, seed, val, test),
                         lambda r: f"{r['label']} seed {r['seed']}: val {r['val_exact']:.3f} test "
                                   f"{r['test_exact']:.3f}")


if __name__ == "__main__":
    main()
