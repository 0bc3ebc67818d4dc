"""Training the sentence classifiers and the checkpoints the chapter on attention as explanation loads.

:data:`RECIPES` names the shipped models: ``gru`` (BiGRU + additive attention, the shape Jain & Wallace tested),
``embed`` (no encoder: the attention pools the word embeddings themselves) and their ``_uniform`` twins, trained
with weights ``1/n`` instead of learned attention (Wiegreffe & Pinter's baseline); ``gru_seed1`` ... ``gru_seed4``
and ``embed_seed1`` ... ``embed_seed4`` are ``gru`` and ``embed`` again from parameter seeds 1 to 4. Each
checkpoint is written with its recipe and sha256 in ``checkpoints/manifest.json``.

Command line (one CPU thread, a few seconds per model)::

    python -m attention_core.sentences.train --all
    python -m attention_core.sentences.train gru --out /tmp/ckpt
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from attention_core._checks import check_instance
from attention_core.models.classifier import AttentionClassifier, build_classifier
from attention_core.sentences.data import VOCAB, SentenceBatch, collate, stream
from attention_core.training.checkpoint import TrainLog, load_or_train_recipe
from attention_core.training.cli import recipes_main, train_and_record
from attention_core.training.loop import TrainRecipe, fit, recipe_named

__all__ = ["CHECKPOINT_DIR", "RECIPES", "ClassifierRecipe", "accuracy", "load_or_train", "main", "train_recipe"]

PathLike = Union[str, Path]
#: Folder of the shipped checkpoints (package data) and their manifest.
CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoints"


@dataclass(frozen=True)
class ClassifierRecipe(TrainRecipe, steps=400, batch_size=64, lr=3e-3, min_lr_ratio=0.1):
    """How one classifier is built and trained: ``model`` holds :func:`build_classifier`'s settings (besides
    ``vocab_size``); Adam for ``steps`` steps on fresh batches of ``batch_size`` from ``stream(batch_size,
    data_seed)``, learning rate on a cosine from ``lr`` to ``min_lr_ratio * lr``, no warm-up, no clipping,
    parameters from ``seed`` (the fields of :class:`~attention_core.training.loop.TrainRecipe`)."""

    model: Dict[str, Any] = field(default_factory=dict)

    def config(self) -> Dict[str, Any]:
        return {**self.model, "vocab_size": len(VOCAB), "seed": self.seed}


#: The shipped classifiers, by their checkpoint names (``checkpoints/<name>.pt``).
RECIPES: Dict[str, ClassifierRecipe] = {r.name: r for r in (
    ClassifierRecipe("gru", {"encoder": "gru", "attention": "additive"}),
    ClassifierRecipe("gru_uniform", {"encoder": "gru", "attention": "uniform"}),
    ClassifierRecipe("embed", {"encoder": "none", "attention": "additive"}),
    ClassifierRecipe("embed_uniform", {"encoder": "none", "attention": "uniform"}),
    # the same two attention recipes from other parameter seeds (the data stream is shared), so that a result
    # of the chapter can be checked on five trained models of each kind, and the weights of two models compared
    *(ClassifierRecipe(f"{kind}_seed{s}", {"encoder": enc, "attention": "additive"}, seed=s)
      for kind, enc in (("gru", "gru"), ("embed", "none")) for s in range(1, 5)),
)}


def _recipe(name: Union[str, ClassifierRecipe]) -> ClassifierRecipe:
    return recipe_named(name, RECIPES, ClassifierRecipe)


def train_recipe(name: Union[str, ClassifierRecipe], show_progress: bool = True
                 ) -> Tuple[AttentionClassifier, TrainLog]:
    """Build the classifier of recipe ``name`` and train it from scratch; returns ``(model in eval mode, log)``."""
    recipe = _recipe(name)
    model = build_classifier(recipe.config())
    batches = stream(recipe.batch_size, recipe.data_seed)
    log = fit(model, recipe, lambda step: next(batches), _loss, show_progress=show_progress)
    return model.eval(), log


def _loss(model: AttentionClassifier, batch: SentenceBatch) -> torch.Tensor:
    return F.cross_entropy(model(batch.ids, batch.valid_lens).logits, batch.labels)


@torch.no_grad()
def accuracy(model: AttentionClassifier, batch: SentenceBatch) -> float:
    """Share of ``batch`` classified correctly."""
    check_instance(model, nn.Module, "model", "an AttentionClassifier")
    check_instance(batch, SentenceBatch, "batch", "a SentenceBatch")
    return (model(batch.ids, batch.valid_lens).logits.argmax(-1) == batch.labels).double().mean().item()


def load_or_train(name: Union[str, ClassifierRecipe], directory: PathLike = CHECKPOINT_DIR, retrain: bool = False
                  ) -> Tuple[AttentionClassifier, Dict[str, Any]]:
    """The classifier ``name``: loaded from ``directory`` (sha256 verified) or trained here (not saved)."""
    recipe = _recipe(name)
    return load_or_train_recipe(recipe, directory, build_classifier, lambda: train_recipe(recipe), retrain, None,
                                f"python -m attention_core.sentences.train {recipe.name}")


def train_and_save(names: Sequence[str], directory: PathLike = CHECKPOINT_DIR, show_progress: bool = True) -> None:
    """Train each recipe in ``names`` on one thread, save ``<name>.pt`` and record it in the manifest."""
    from attention_core.sentences.data import test_set

    test = collate(test_set())
    train_and_record([_recipe(n) for n in names], directory, lambda r: train_recipe(r, show_progress=show_progress),
                     lambda model: {"test_accuracy": round(accuracy(model, test), 4)})


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m attention_core.sentences.train NAME [NAME ...]`` (or ``--all``): train and save checkpoints."""
    recipes_main(argv, main.__doc__, RECIPES, CHECKPOINT_DIR, train_and_save)


if __name__ == "__main__":
    main()
