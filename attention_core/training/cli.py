"""The command line every recipe-based training module shares: ``python -m <wing>.train NAME [NAME ...]``, and
the train-save-record pass behind it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from attention_core.training.checkpoint import TrainLog, save_recipe_checkpoint

__all__ = ["recipes_main", "train_and_record"]


def recipes_main(argv: Optional[Sequence[str]], description: str, recipes: Mapping[str, object],
                 default_out: Path, train_and_save: Callable[[Iterable[str], str], object]) -> None:
    """Parse ``NAME [NAME ...] | --all [--out DIR]`` and call ``train_and_save(names, out)``.

    Unknown or missing names end the program with argparse's usage error (exit status 2), listing the recipes.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("names", nargs="*", help=f"recipes to train, from {sorted(recipes)}")
    parser.add_argument("--all", action="store_true", help="train every recipe")
    parser.add_argument("--out", default=str(default_out), help="checkpoint folder")
    args = parser.parse_args(argv)
    names = sorted(recipes) if args.all else args.names
    unknown = [n for n in names if n not in recipes]
    if unknown or not names:
        parser.error(f"give recipe names from {sorted(recipes)} or --all (got {names})")
    train_and_save(names, args.out)


def train_and_record(recipes: Iterable[Any], directory: Union[str, Path],
                     train: Callable[[Any], Tuple[nn.Module, TrainLog]],
                     measure: Optional[Callable[[nn.Module], Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
    """Train each of ``recipes`` with ``train(recipe) -> (model, log)`` on one CPU thread (so that the runs repeat
    exactly), write ``<name>.pt`` and its manifest entry in ``directory``
    (:func:`~attention_core.training.checkpoint.save_recipe_checkpoint`, with the fields ``measure(model)``
    returns, a test accuracy say), and print one line per model; returns the entries.

    The manifest is updated under a file lock after each model, so several processes may train different
    recipes into one folder at the same time.
    """
    torch.set_num_threads(1)
    entries = []
    for recipe in recipes:
        model, log = train(recipe)
        measured = {} if measure is None else measure(model)
        entry = save_recipe_checkpoint(model, log, recipe, directory, extra=measured)
        tail = log.losses[-50:]
        said = "".join(f", {k.replace('_', ' ')} {v}" for k, v in measured.items())
        print(f"{recipe.name}: {entry['parameters']} parameters, {log.seconds:.1f} s, final loss "
              f"{sum(tail) / len(tail):.4f}{said}, sha256 {entry['sha256'][:12]}...", flush=True)
        entries.append(entry)
    return entries
