"""Training the book's Transformer on the number-words task, and the checkpoint chapter 8 loads.

The recipe (:data:`TRANSFORMER_RECIPE`) uses the training loop of the RNN models,
:func:`attention_core.training.train_seq2seq` (teacher forcing, Adam, gradient clipping, a tqdm bar), and
the same stream of batches (``NumberWords().stream(batch_size, data_seed)``), so that chapter 8 can compare
the Transformer with chapters 3 and 4's models on equal terms.

``scripts/train_transformer_checkpoint.py`` trains it once and writes ``transformer.pt`` and
``transformer_manifest.json`` (sha256, parameters, training time, loss curve, recipe) into
``attention_core/checkpoints/``. :func:`load_or_train_transformer` loads that file after checking its sha256,
and trains from the recipe instead when asked (``retrain=True``) or when the file is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple, Union

import torch

from attention_core.seq2seq_data import NumberWords
from attention_core.training import (
    TrainLog,
    load_checkpoint,
    load_or_train_recipe,
    recipe_entry,
    record_in_manifest,
    save_checkpoint,
    train_seq2seq,
)
from attention_core.transformer_seq2seq import Seq2SeqTransformer, build_transformer

__all__ = [
    "CHECKPOINT_DIR",
    "TRANSFORMER_MANIFEST",
    "TRANSFORMER_RECIPE",
    "TRANSFORMER_RECIPES",
    "TransformerRecipe",
    "load_or_train_transformer",
    "load_transformer_checkpoint",
    "save_transformer_checkpoint",
    "train_transformer",
]

PathLike = Union[str, Path]
CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoints"
TRANSFORMER_MANIFEST = "transformer_manifest.json"


@dataclass(frozen=True)
class TransformerRecipe:
    """How the book's Transformer is built and trained.

    The model fields go to :func:`~attention_core.transformer_seq2seq.build_transformer`; ``steps``,
    ``batch_size``, ``lr``, ``min_lr_ratio`` (cosine decay), ``clip`` and ``data_seed`` are the training
    budget, the same as :class:`attention_core.training.Recipe`'s for the RNN models.
    The model (about 62k parameters) is as large as the RNN models of chapters 3 and 4. There is no dropout:
    every batch is freshly generated, so the model cannot overfit.
    """

    name: str = "transformer"
    d_model: int = 32
    num_heads: int = 4
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    dim_feedforward: int = 128
    dropout: float = 0.0
    norm_first: bool = True
    steps: int = 600
    batch_size: int = 64
    lr: float = 5e-3
    min_lr_ratio: float = 0.05
    clip: float = 1.0
    seed: int = 0
    data_seed: int = 1

    def config(self, task: NumberWords) -> Dict[str, Any]:
        """The model's config dict for ``task``'s vocabularies."""
        return {
            "src_vocab_size": len(task.src_vocab), "tgt_vocab_size": len(task.tgt_vocab),
            "d_model": self.d_model, "num_heads": self.num_heads, "num_encoder_layers": self.num_encoder_layers,
            "num_decoder_layers": self.num_decoder_layers, "dim_feedforward": self.dim_feedforward,
            "dropout": self.dropout, "norm_first": self.norm_first, "seed": self.seed,
        }


#: The book's Transformer, trained with the budget of chapters 3 and 4's RNN models.
TRANSFORMER_RECIPE = TransformerRecipe()
#: The same model trained twice as long (chapter 8 shows what the extra steps buy).
TRANSFORMER_RECIPES: Dict[str, TransformerRecipe] = {
    r.name: r
    for r in (TRANSFORMER_RECIPE, TransformerRecipe(name="transformer_x2", steps=2 * TRANSFORMER_RECIPE.steps))
}


def train_transformer(recipe: TransformerRecipe = TRANSFORMER_RECIPE, device: Optional[torch.device] = None,
                      show_progress: bool = True) -> Tuple[Seq2SeqTransformer, TrainLog]:
    """Build the Transformer of ``recipe`` and train it from scratch; returns ``(model in eval mode, log)``."""
    if not isinstance(recipe, TransformerRecipe):
        raise TypeError(f"recipe must be a TransformerRecipe, got {type(recipe).__name__}")
    task = NumberWords()
    model = build_transformer(recipe.config(task))
    log = train_seq2seq(model, task.stream(recipe.batch_size, recipe.data_seed), recipe.steps, lr=recipe.lr,
                        clip=recipe.clip, device=device, desc=recipe.name, show_progress=show_progress,
                        min_lr_ratio=recipe.min_lr_ratio)
    return model, log


def save_transformer_checkpoint(model: Seq2SeqTransformer, log: TrainLog, directory: PathLike = CHECKPOINT_DIR,
                                recipe: TransformerRecipe = TRANSFORMER_RECIPE) -> Dict[str, Any]:
    """Write ``<name>.pt`` (config + weights) and its entry in ``transformer_manifest.json``; return the entry."""
    if not isinstance(model, Seq2SeqTransformer) or not model.config:
        raise TypeError("model must be a Seq2SeqTransformer made by build_transformer (it carries its config)")
    sha = save_checkpoint(model, Path(directory) / f"{recipe.name}.pt")
    entry = recipe_entry(recipe, model, log, sha)
    record_in_manifest(directory, recipe.name, entry, TRANSFORMER_MANIFEST)
    return entry


def load_transformer_checkpoint(path: PathLike, sha256: str, device: Optional[torch.device] = None
                                ) -> Seq2SeqTransformer:
    """Verify ``path`` against ``sha256`` (before unpickling), rebuild the model, load its weights (eval mode).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file's sha256 differs from ``sha256``.
    """
    return load_checkpoint(path, sha256, device, build=build_transformer)


def load_or_train_transformer(directory: PathLike = CHECKPOINT_DIR, retrain: bool = False,
                              recipe: TransformerRecipe = TRANSFORMER_RECIPE, device: Optional[torch.device] = None
                              ) -> Tuple[Seq2SeqTransformer, Dict[str, Any]]:
    """The book's Transformer: loaded from ``directory`` (sha256 verified), or trained here.

    Trains from ``recipe`` when ``retrain`` is true or when the manifest has no entry or file for it (the
    trained model is not written to disk). A checkpoint made with a different recipe is refused.

    Returns:
        ``(model, entry)``: the model in eval mode and its manifest entry (for a fresh run, one describing it,
        with ``"sha256": None``).
    """
    return load_or_train_recipe(recipe, directory, TRANSFORMER_MANIFEST, build_transformer,
                                lambda: train_transformer(recipe, device), retrain, device,
                                f"python scripts/train_transformer_checkpoint.py {recipe.name}")
