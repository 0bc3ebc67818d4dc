"""Training the RNN encoder-decoders, and the checkpoints the chapters load instead of training live.

- :func:`train_seq2seq`: teacher forcing, cross-entropy over real target tokens, Adam (optionally with a
  cosine learning-rate decay), gradient-norm clipping, a tqdm bar (:func:`attention_core.notebook.progress`,
  off when ``AC_PROGRESS=0``).
- :func:`save_checkpoint` / :func:`load_checkpoint`: one file per model holding its config and weights; the
  file's sha256 is returned on save and verified on load, so a truncated or altered file is refused.
- :data:`RECIPES` and :func:`load_or_train`: how every model of chapters 3 and 4 is trained, under stable
  names (``"plain"``, ``"bahdanau"``, ``"luong_dot"``, ``"luong_general"``, ``"luong_concat"``,
  ``"luong_local_m"``, ``"luong_local_p"``). The chapters load the checkpoints in :data:`CHECKPOINT_DIR` that
  ``python -m attention_core.training --all`` made with these same recipes (sha256, parameter count,
  training time and loss curve are in ``manifest.json`` beside them) and retrain when a file is missing or
  when asked to.
- :func:`evaluate_by_bucket`, :func:`book_test_set`, :data:`BUCKET_EDGES` (from
  :mod:`attention_core.metrics`): the length experiment's test set and scores, shared with chapter 8.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from attention_core.metrics import BUCKET_EDGES, book_test_set, evaluate_by_bucket
from attention_core.notebook import progress
from attention_core.seq2seq import Seq2Seq, build_model, count_parameters
from attention_core.seq2seq_data import PAD_ID, Batch, NumberWords

__all__ = [
    "BUCKET_EDGES",
    "CHECKPOINT_DIR",
    "MANIFEST",
    "RECIPES",
    "Recipe",
    "TrainLog",
    "book_test_set",
    "evaluate_by_bucket",
    "file_sha256",
    "load_checkpoint",
    "load_or_train",
    "load_or_train_recipe",
    "main",
    "manifest_entry",
    "read_manifest",
    "recipe_entry",
    "record_in_manifest",
    "save_checkpoint",
    "sequence_loss",
    "train_and_save",
    "train_recipe",
    "train_seq2seq",
]

PathLike = Union[str, Path]
MANIFEST = "manifest.json"
#: Folder of the shipped checkpoints (package data), with their sha256 manifest.
CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoints"


def sequence_loss(logits: torch.Tensor, tgt_out: torch.Tensor, pad_id: int = PAD_ID) -> torch.Tensor:
    """Mean cross-entropy over the real (non-pad) target tokens: (B, T, V), (B, T) -> scalar."""
    if logits.dim() != 3 or logits.shape[:2] != tgt_out.shape:
        raise ValueError(f"logits must be (B, T, V) with (B, T) = {tuple(tgt_out.shape)} of tgt_out, got shape "
                         f"{tuple(logits.shape)}")
    return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=pad_id)  # (B*T, V), (B*T,)


@dataclass
class TrainLog:
    """What a training run reports: the loss of every step and the wall time it took."""

    losses: List[float] = field(default_factory=list)
    seconds: float = 0.0


def train_seq2seq(model: Seq2Seq, batches: Iterator[Batch], steps: int, lr: float = 3e-3, clip: float = 1.0,
                  device: Optional[torch.device] = None, desc: str = "training", show_progress: bool = True,
                  min_lr_ratio: Optional[float] = None) -> TrainLog:
    """Train ``model`` in place for ``steps`` batches with teacher forcing.

    Args:
        model: the encoder-decoder; it is moved to ``device``.
        batches: an iterator of :class:`~attention_core.seq2seq_data.Batch` (e.g. ``NumberWords.stream``).
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
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip!r}")
    if min_lr_ratio is not None and not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"min_lr_ratio must be in [0, 1] or None, got {min_lr_ratio!r}")
    device = device or next(model.parameters()).device
    model.to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    log = TrainLog()
    start = time.perf_counter()
    bar = progress(range(steps), desc=desc, **({} if show_progress else {"disable": True}))
    for i in bar:
        if min_lr_ratio is not None:
            frac = 0.5 * (1 + math.cos(math.pi * i / max(steps - 1, 1)))  # 1 -> 0
            for group in optimizer.param_groups:
                group["lr"] = lr * (min_lr_ratio + (1 - min_lr_ratio) * frac)
        batch = next(batches).to(device)
        logits, _ = model(batch.src, batch.src_valid_lens, batch.tgt_in)
        loss = sequence_loss(logits, batch.tgt_out)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        log.losses.append(loss.item())
        if hasattr(bar, "set_postfix") and len(log.losses) % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    log.seconds = time.perf_counter() - start
    model.eval()
    return log


# ------------------------------------------------------------------------------------------ checkpoints


def file_sha256(path: PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(model: nn.Module, path: PathLike) -> str:
    """Save the model's config and weights (on the CPU) to ``path``; return the file's sha256.

    Any model that carries the config it was built from (``model.config``) can be saved: the RNN models of
    :func:`~attention_core.seq2seq.build_model` and the Transformer of
    :func:`~attention_core.transformer_seq2seq.build_transformer`.
    """
    if not getattr(model, "config", None):
        raise ValueError("model.config is empty: build the model with build_model(config) to checkpoint it")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": 1, "config": model.config, "state_dict": state}, path)
    return file_sha256(path)


def load_checkpoint(path: PathLike, sha256: str, device: Optional[torch.device] = None,
                    build: Callable[[Dict[str, Any]], nn.Module] = build_model) -> nn.Module:
    """Verify ``path`` against ``sha256``, then rebuild the model with ``build(config)`` and load its weights
    (in eval mode). ``build`` is :func:`~attention_core.seq2seq.build_model` for the RNN models.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file's sha256 differs from ``sha256`` (checked before the file is unpickled).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    seen = file_sha256(path)
    if seen != sha256:
        raise ValueError(f"checkpoint {path} has sha256 {seen}, expected {sha256}: the file is damaged or was "
                         "replaced; retrain it from its recipe")
    blob = torch.load(path, map_location="cpu", weights_only=True)
    model = build(blob["config"])
    model.load_state_dict(blob["state_dict"])
    return model.to(device or "cpu").eval()


# -------------------------------------------------------------------------------- the book's recipes


@dataclass(frozen=True)
class Recipe:
    """How one of the book's models is built and trained (all share the task and the sizes).

    ``kind``, ``score``, ``mode``, ``window`` select the model (see :func:`attention_core.seq2seq.build_model`);
    the rest is the training budget. Training batches come from ``NumberWords().stream(batch_size, data_seed)``;
    the learning rate follows a cosine from ``lr`` to ``min_lr_ratio * lr``.
    """

    name: str
    kind: str
    score: str = "general"
    mode: str = "global"
    window: int = 3
    embed_dim: int = 32
    hidden_dim: int = 32
    steps: int = 600
    batch_size: int = 64
    lr: float = 5e-3
    min_lr_ratio: float = 0.05
    clip: float = 1.0
    seed: int = 0
    data_seed: int = 1

    def config(self, task: NumberWords) -> Dict[str, Any]:
        """The model's config dict (what :func:`~attention_core.seq2seq.build_model` reads) for ``task``."""
        cfg: Dict[str, Any] = {"kind": self.kind, "src_vocab_size": len(task.src_vocab),
                               "tgt_vocab_size": len(task.tgt_vocab), "embed_dim": self.embed_dim,
                               "hidden_dim": self.hidden_dim, "seed": self.seed}
        if self.kind == "luong":
            cfg.update(score=self.score, mode=self.mode, window=self.window, input_feeding=True)
        return cfg


#: The book's models, by their stable checkpoint names (``attention_core/checkpoints/<name>.pt``).
RECIPES: Dict[str, Recipe] = {r.name: r for r in (
    Recipe("plain", "plain"),
    Recipe("bahdanau", "bahdanau"),
    Recipe("luong_dot", "luong", score="dot"),
    Recipe("luong_general", "luong", score="general"),
    Recipe("luong_concat", "luong", score="concat"),
    Recipe("luong_local_m", "luong", score="general", mode="local-m"),
    Recipe("luong_local_p", "luong", score="general", mode="local-p"),
)}


def train_recipe(name: str, device: Optional[torch.device] = None, show_progress: bool = True
                 ) -> Tuple[Seq2Seq, TrainLog]:
    """Build and train the book's model ``name`` (a key of :data:`RECIPES`) from scratch."""
    if name not in RECIPES:
        raise ValueError(f"name must be one of {sorted(RECIPES)}, got {name!r}")
    recipe = RECIPES[name]
    task = NumberWords()
    model = build_model(recipe.config(task))
    log = train_seq2seq(model, task.stream(recipe.batch_size, recipe.data_seed), recipe.steps, lr=recipe.lr,
                        clip=recipe.clip, device=device, desc=name, show_progress=show_progress,
                        min_lr_ratio=recipe.min_lr_ratio)
    return model, log


def recipe_entry(recipe: Any, model: nn.Module, log: TrainLog, sha256: Optional[str], every: int = 25
                 ) -> Dict[str, Any]:
    """The manifest record of a model trained from ``recipe`` (a dataclass with a ``name``): file, checksum,
    size, time, loss curve (means of ``every`` steps) and the recipe itself."""
    return {
        "file": f"{recipe.name}.pt",
        "sha256": sha256,
        "parameters": count_parameters(model),
        "train_seconds": round(log.seconds, 1),
        "loss_every": every,
        "losses": [round(sum(log.losses[i:i + every]) / len(log.losses[i:i + every]), 4)
                   for i in range(0, len(log.losses), every)],
        "recipe": asdict(recipe),
    }


def manifest_entry(name: str, model: Seq2Seq, log: TrainLog, sha256: Optional[str], every: int = 25
                   ) -> Dict[str, Any]:
    """The manifest record of the book's RNN model ``name`` (a key of :data:`RECIPES`)."""
    return recipe_entry(RECIPES[name], model, log, sha256, every)


def read_manifest(directory: PathLike = CHECKPOINT_DIR, filename: str = MANIFEST) -> Dict[str, Any]:
    """The manifest (``manifest.json`` unless ``filename`` says otherwise) of a checkpoint folder, or ``{}``."""
    path = Path(directory) / filename
    return json.loads(path.read_text()) if path.is_file() else {}


def record_in_manifest(directory: PathLike, name: str, entry: Dict[str, Any], filename: str = MANIFEST) -> None:
    """Set ``name``'s entry in the folder's manifest, under a file lock: several processes may train different
    recipes into one folder at the same time, and each re-reads the manifest before writing it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / filename, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        manifest = json.loads(text) if text.strip() else {}
        manifest[name] = entry
        f.seek(0)
        f.truncate()
        f.write(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")


def load_or_train_recipe(recipe: Any, directory: PathLike, filename: str,
                         build: Callable[[Dict[str, Any]], nn.Module], train: Callable[[], Tuple[nn.Module, TrainLog]],
                         retrain: bool, device: Optional[torch.device], how_to_retrain: str
                         ) -> Tuple[nn.Module, Dict[str, Any]]:
    """What :func:`load_or_train` and the Transformer's loader share: the checkpoint that the manifest
    ``filename`` in ``directory`` records for ``recipe.name`` (sha256 verified, rebuilt by ``build``), or,
    when ``retrain`` or when there is no entry or file, a fresh ``train()`` (not written to disk).

    Raises:
        TypeError: ``retrain`` is not a bool.
        ValueError: the checkpoint was trained with another recipe than ``recipe``.
    """
    if not isinstance(retrain, bool):
        raise TypeError(f"retrain must be a bool, got {type(retrain).__name__} {retrain!r}")
    entry = read_manifest(directory, filename).get(recipe.name)
    if not retrain and entry is not None and (Path(directory) / entry["file"]).is_file():
        if entry["recipe"] != asdict(recipe):
            raise ValueError(f"checkpoint {entry['file']!r} was trained with a recipe that differs from the one "
                             f"asked for (the manifest records another recipe for {recipe.name!r}); retrain it "
                             f"with `{how_to_retrain}`")
        return load_checkpoint(Path(directory) / entry["file"], entry["sha256"], device, build=build), entry
    model, log = train()
    return model, recipe_entry(recipe, model, log, sha256=None)


def load_or_train(name: str, directory: PathLike = CHECKPOINT_DIR, retrain: bool = False,
                  device: Optional[torch.device] = None) -> Tuple[Seq2Seq, Dict[str, Any]]:
    """The book's model ``name``: loaded from ``directory`` (checksum verified) or trained here.

    Trains from the recipe when ``retrain`` is true, or when the folder has no manifest entry or file for it
    (e.g. a notebook opened alone in Colab). The trained model is not written to disk.

    Args:
        name: a key of :data:`RECIPES`, e.g. ``"bahdanau"`` or ``"luong_general"``.
        directory: the checkpoint folder (default: the one shipped in the package).
        retrain: train from scratch even when a checkpoint exists.
        device: where to put (and train) the model.

    Returns:
        ``(model, entry)``: the model in eval mode and its manifest entry (for a fresh run, one describing it,
        with ``"sha256": None``).
    """
    if name not in RECIPES:
        raise ValueError(f"name must be one of {sorted(RECIPES)}, got {name!r}")
    return load_or_train_recipe(RECIPES[name], directory, MANIFEST, build_model, lambda: train_recipe(name, device),
                                retrain, device, f"python -m attention_core.training {name}")


def train_and_save(names: Sequence[str], directory: PathLike = CHECKPOINT_DIR, show_progress: bool = True) -> None:
    """Train each recipe in ``names``, save ``<name>.pt`` in ``directory`` and record it in the manifest.

    The manifest is updated under a file lock after each model (:func:`record_in_manifest`), so several
    processes may train different recipes into one folder at the same time.
    """
    torch.set_num_threads(1)
    directory = Path(directory)
    for name in names:
        model, log = train_recipe(name, show_progress=show_progress)
        sha = save_checkpoint(model.cpu(), directory / f"{name}.pt")
        record_in_manifest(directory, name, manifest_entry(name, model, log, sha))
        print(f"{name}: {count_parameters(model)} parameters, {log.seconds:.0f} s, final loss "
              f"{sum(log.losses[-50:]) / len(log.losses[-50:]):.4f}, sha256 {sha[:12]}...", flush=True)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m attention_core.training NAME [NAME ...]`` (or ``--all``): train and save checkpoints."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("names", nargs="*", help=f"recipes to train, from {sorted(RECIPES)}")
    parser.add_argument("--all", action="store_true", help="train every recipe")
    parser.add_argument("--out", default=str(CHECKPOINT_DIR), help="checkpoint folder")
    args = parser.parse_args(argv)
    names = sorted(RECIPES) if args.all else args.names
    unknown = [n for n in names if n not in RECIPES]
    if unknown or not names:
        parser.error(f"give recipe names from {sorted(RECIPES)} or --all (got {names})")
    train_and_save(names, args.out)


if __name__ == "__main__":
    main()
