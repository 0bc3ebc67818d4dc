"""Training the translation models, and the checkpoints the chapters load instead of training live.

One path for every model of chapters 3, 4 and 8:

- :func:`train_seq2seq`: teacher forcing, cross-entropy over real target tokens, Adam with a cosine
  learning-rate decay, gradient-norm clipping, a progress bar (:func:`attention_core.training.progress.progress`, off
  when ``AC_PROGRESS=0``). It trains any :class:`~attention_core.translation.EncoderDecoder`, RNN or Transformer.
- :class:`Recipe` and :data:`RECIPES`: how each of the book's models is built and trained, under stable names
  (``"plain"``, ``"bahdanau"``, ``"luong_dot"``, ``"luong_general"``, ``"luong_concat"``, ``"luong_local_m"``,
  ``"luong_local_p"``, ``"transformer"``, ``"transformer_x2"``).
- :func:`load_or_train`: the shipped checkpoint (sha256 verified, see :mod:`attention_core.training.checkpoint`), or a
  fresh training run when asked or when the file is missing.
- the command line, ``python -m attention_core.translation.train NAME [NAME ...] | --all``, which made every
  shipped checkpoint and its record in ``checkpoints/manifest.json`` (sha256, parameters, training time, loss
  curve, recipe).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from attention_core._checks import check_int, check_tensor
from attention_core.training.checkpoint import TrainLog, load_or_train_recipe, read_manifest
from attention_core.training.cli import recipes_main, train_and_record
from attention_core.training.loop import TrainRecipe, fit, recipe_named
from attention_core.translation.data import PAD_ID, Batch, NumberWords, Pair
from attention_core.translation.protocol import EncoderDecoder
from attention_core.translation.rnn import build_rnn_model
from attention_core.translation.transformer import build_transformer

__all__ = [
    "CHECKPOINT_DIR",
    "RECIPES",
    "Recipe",
    "build_model",
    "load_or_train",
    "main",
    "read_checkpoint_manifest",
    "sequence_loss",
    "train_and_save",
    "train_recipe",
    "train_seq2seq",
    "training_pairs",
]

PathLike = Union[str, Path]
#: Folder of the shipped checkpoints (package data), with their sha256 manifest.
CHECKPOINT_DIR = Path(str(resources.files("attention_core.translation") / "checkpoints"))


def sequence_loss(logits: torch.Tensor, tgt_out: torch.Tensor, pad_id: int = PAD_ID) -> torch.Tensor:
    """Mean cross-entropy over the real (non-pad) target tokens: (B, T, V), (B, T) -> scalar."""
    check_tensor(logits, "logits")
    check_tensor(tgt_out, "tgt_out")
    if logits.dim() != 3 or logits.shape[:2] != tgt_out.shape:
        raise ValueError(f"logits must be (B, T, V) with (B, T) = {tuple(tgt_out.shape)} of tgt_out, got shape "
                         f"{tuple(logits.shape)}")
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=pad_id)  # (B*T, V), (B*T,)


def train_seq2seq(model: EncoderDecoder, batches: Iterator[Batch], steps: int, lr: float = 3e-3, clip: float = 1.0,
                  device: Optional[torch.device] = None, desc: str = "training", show_progress: bool = True,
                  min_lr_ratio: Optional[float] = None) -> TrainLog:
    """Train ``model`` in place for ``steps`` batches with teacher forcing.

    Args:
        model: the encoder-decoder; it is moved to ``device``.
        batches: an iterator of :class:`~attention_core.translation.data.Batch` (e.g. ``NumberWords.stream``).
        steps: number of optimiser steps.
        lr: Adam's learning rate.
        clip: the largest gradient norm; larger gradients are scaled down to it.
        device: where to train (default: where the model is).
        desc: label of the progress bar.
        show_progress: show a tqdm bar (still off when ``AC_PROGRESS=0``).
        min_lr_ratio: when given, the learning rate follows a cosine from ``lr`` down to
            ``min_lr_ratio * lr`` at the last step; otherwise it stays at ``lr``.

    Returns:
        A :class:`TrainLog`. Runs repeat exactly for the same model init and batches on one CPU thread.
    """
    check_int(steps, "steps", low=1)
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip!r}")
    if min_lr_ratio is not None and not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1] or None, got {min_lr_ratio!r}")
    device = device or next(model.parameters()).device
    model.to(device)
    # the loop's settings as a recipe (a constant rate when min_lr_ratio is None: the optimiser keeps ``lr``)
    loop = TrainRecipe(desc, steps=steps, lr=lr, min_lr_ratio=min_lr_ratio or 0.0, clip=clip)
    log = fit(model, loop, lambda step: next(batches).to(device), _teacher_forced_loss,
              lr_at=None if min_lr_ratio is not None else (lambda step: None), show_progress=show_progress)
    model.eval()
    return log


def _teacher_forced_loss(model: EncoderDecoder, batch: Batch) -> torch.Tensor:
    logits, _ = model(batch.src, batch.src_valid_lens, batch.tgt_in)
    return sequence_loss(logits, batch.tgt_out)


def build_model(config: Dict[str, Any]) -> EncoderDecoder:
    """Any of the book's translation models from its config dict (what checkpoints store): the Transformer
    when ``config["kind"] == "transformer"``, else an RNN model (see
    :func:`~attention_core.translation.rnn.build_rnn_model`)."""
    if isinstance(config, dict) and config.get("kind") == "transformer":
        return build_transformer(config)
    return build_rnn_model(config)


# -------------------------------------------------------------------------------- the book's recipes


@dataclass(frozen=True)
class Recipe(TrainRecipe, steps=600, batch_size=64, lr=5e-3, min_lr_ratio=0.05, clip=1.0):
    """How one of the book's translation models is built and trained.

    ``model`` holds the model's settings (``kind``: ``"plain"``, ``"bahdanau"``, ``"luong"`` or
    ``"transformer"``, and that kind's sizes; see :func:`build_model`); the other fields are the training
    budget (those of :class:`~attention_core.training.loop.TrainRecipe`): the same batches, steps, schedule and
    clipping for every model, and one learning rate for all, the rate that came with the RNN recipes (not tuned
    for the Transformer; :mod:`attention_core.translation.sweep` gives the Transformer and Bahdanau's model a
    small learning-rate sweep each, and several seeds). Training batches come from
    ``NumberWords().stream(batch_size, data_seed)``; Adam, no warm-up, the learning rate on a cosine from ``lr`` to
    ``min_lr_ratio * lr``, gradient norm clipped at ``clip``; parameters are initialised from ``seed``.
    """

    model: Dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """The model family (``"plain"``, ``"bahdanau"``, ``"luong"`` or ``"transformer"``)."""
        return self.model["kind"]

    def config(self, task: NumberWords) -> Dict[str, Any]:
        """The model's config dict (what :func:`build_model` reads) for ``task``'s vocabularies."""
        return {**self.model, "src_vocab_size": len(task.src_vocab), "tgt_vocab_size": len(task.tgt_vocab),
                "seed": self.seed}


_RNN = {"embed_dim": 32, "hidden_dim": 32}
_LUONG = {"kind": "luong", **_RNN, "input_feeding": True, "window": 3}
#: The Transformer is as large as the RNN models (about 62k parameters); no dropout, as for the RNN models: every
#: batch is freshly drawn (short numbers do recur in the stream, and some test numbers occur in it: chapter 8
#: counts them).
_TRANSFORMER = {"kind": "transformer", "d_model": 32, "num_heads": 4, "num_encoder_layers": 2,
                "num_decoder_layers": 2, "dim_feedforward": 128, "dropout": 0.0, "norm_first": True}

#: The book's models, by their stable checkpoint names (``checkpoints/<name>.pt``).
RECIPES: Dict[str, Recipe] = {r.name: r for r in (
    Recipe("plain", {"kind": "plain", **_RNN}),
    Recipe("bahdanau", {"kind": "bahdanau", **_RNN}),
    Recipe("luong_dot", {**_LUONG, "score": "dot", "mode": "global"}),
    Recipe("luong_general", {**_LUONG, "score": "general", "mode": "global"}),
    Recipe("luong_concat", {**_LUONG, "score": "concat", "mode": "global"}),
    Recipe("luong_local_m", {**_LUONG, "score": "general", "mode": "local-m"}),
    Recipe("luong_local_p", {**_LUONG, "score": "general", "mode": "local-p"}),
    Recipe("transformer", dict(_TRANSFORMER)),
    Recipe("transformer_x2", dict(_TRANSFORMER), steps=1200),  # the same model, trained twice as long
)}


def _recipe(name: Union[str, Recipe]) -> Recipe:
    return recipe_named(name, RECIPES, Recipe)


def training_pairs(name: Union[str, Recipe]) -> List[Pair]:
    """Every example the recipe ``name`` trains on, in order: the ``steps`` batches of ``batch_size`` pairs that
    ``NumberWords().stream(batch_size, data_seed)`` yields (the stream and ``sample`` draw from one
    ``random.Random(data_seed)`` in the same order), with repeats kept."""
    recipe = _recipe(name)
    return NumberWords().sample(recipe.steps * recipe.batch_size, recipe.data_seed)


def train_recipe(name: Union[str, Recipe], device: Optional[torch.device] = None, show_progress: bool = True
                 ) -> Tuple[EncoderDecoder, TrainLog]:
    """Build and train the book's model ``name`` (a key of :data:`RECIPES`, or a :class:`Recipe`) from scratch."""
    recipe = _recipe(name)
    task = NumberWords()
    model = build_model(recipe.config(task))
    device = device or torch.device("cpu")
    batches = task.stream(recipe.batch_size, recipe.data_seed)
    log = fit(model.to(device), recipe, lambda step: next(batches).to(device), _teacher_forced_loss,
              show_progress=show_progress)
    return model.eval(), log


def read_checkpoint_manifest(directory: PathLike = CHECKPOINT_DIR) -> Dict[str, Any]:
    """The manifest of the translation checkpoints: per name, file, sha256, parameters, training time, loss
    curve (means of ``loss_every`` steps) and recipe."""
    return read_manifest(directory)


def load_or_train(name: Union[str, Recipe], directory: PathLike = CHECKPOINT_DIR, retrain: bool = False,
                  device: Optional[torch.device] = None) -> Tuple[EncoderDecoder, Dict[str, Any]]:
    """The book's model ``name``: loaded from ``directory`` (checksum verified) or trained here.

    Trains from the recipe when ``retrain`` is true, or when the folder has no manifest entry or file for it
    (e.g. a notebook opened alone). The trained model is not written to disk.

    Args:
        name: a key of :data:`RECIPES` (e.g. ``"bahdanau"``, ``"transformer"``) or a :class:`Recipe`.
        directory: the checkpoint folder (default: the one shipped in the package).
        retrain: train from scratch even when a checkpoint exists.
        device: where to put (and train) the model.

    Returns:
        ``(model, entry)``: the model in eval mode and its manifest entry (for a fresh run, one describing it,
        with ``"sha256": None``).
    """
    recipe = _recipe(name)
    return load_or_train_recipe(recipe, directory, build_model, lambda: train_recipe(recipe, device),
                                retrain, device, f"python -m attention_core.translation.train {recipe.name}")


def train_and_save(names: Sequence[str], directory: PathLike = CHECKPOINT_DIR, show_progress: bool = True) -> None:
    """Train each recipe in ``names``, save ``<name>.pt`` in ``directory`` and record it in the manifest.

    The manifest is updated under a file lock after each model, so several processes may train different
    recipes into one folder at the same time. Runs on one thread, so that they repeat exactly.
    """
    train_and_record([_recipe(n) for n in names], directory, lambda r: train_recipe(r, show_progress=show_progress))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m attention_core.translation.train NAME [NAME ...]`` (or ``--all``): train and save checkpoints."""
    recipes_main(argv, main.__doc__, RECIPES, CHECKPOINT_DIR, train_and_save)


if __name__ == "__main__":
    main()
