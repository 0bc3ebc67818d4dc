"""Checkpoints with checksums: what the book ships instead of training every model live.

A checkpoint is one file holding a model's config (the plain dict its builder reads) and its weights. Saving
returns the file's sha256; loading verifies it before anything is unpickled, so a truncated or replaced file
is refused with a message that says how to retrain. A folder of checkpoints has one ``manifest.json``: for each
name, the file, its sha256, the parameter count, the training time, the loss curve and the **recipe** that made
it (a frozen dataclass with a ``name``), so that a checkpoint is always traceable to the code that trained it.

The tasks (:mod:`attention_core.translation`, the language model of chapter 11) build their training CLIs on
these functions; nothing here knows about a task.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

__all__ = [
    "MANIFEST",
    "TrainLog",
    "file_sha256",
    "load_checkpoint",
    "load_or_train_recipe",
    "read_manifest",
    "recipe_entry",
    "record_in_manifest",
    "save_checkpoint",
]

PathLike = Union[str, Path]
#: The manifest's file name inside a checkpoint folder.
MANIFEST = "manifest.json"


@dataclass
class TrainLog:
    """What a training run reports: the loss of every step and the wall time it took."""

    losses: List[float] = field(default_factory=list)
    seconds: float = 0.0


def file_sha256(path: PathLike) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(model: nn.Module, path: PathLike) -> str:
    """Save the model's config and weights (on the CPU) to ``path``; return the file's sha256.

    The model must carry the config dict it was built from (``model.config``), which is what its builder
    reads back in :func:`load_checkpoint`.
    """
    if not getattr(model, "config", None):
        raise ValueError("model.config is empty: build the model from a config dict to checkpoint it")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": 1, "config": model.config, "state_dict": state}, path)
    return file_sha256(path)


def load_checkpoint(path: PathLike, sha256: str, build: Callable[[Dict[str, Any]], nn.Module],
                    device: Optional[torch.device] = None) -> nn.Module:
    """Verify ``path`` against ``sha256``, then rebuild the model with ``build(config)`` and load its weights
    (in eval mode).

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


def recipe_entry(recipe: Any, model: nn.Module, log: TrainLog, sha256: Optional[str], every: int = 25
                 ) -> Dict[str, Any]:
    """The manifest record of a model trained from ``recipe`` (a dataclass with a ``name``): file, checksum,
    size, time, loss curve (means of ``every`` steps) and the recipe itself."""
    return {
        "file": f"{recipe.name}.pt",
        "sha256": sha256,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(log.seconds, 1),
        "loss_every": every,
        "losses": [round(sum(log.losses[i:i + every]) / len(log.losses[i:i + every]), 4)
                   for i in range(0, len(log.losses), every)],
        "recipe": asdict(recipe),
    }


def read_manifest(directory: PathLike) -> Dict[str, Any]:
    """The manifest of a checkpoint folder, or ``{}`` when it has none."""
    path = Path(directory) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def record_in_manifest(directory: PathLike, name: str, entry: Dict[str, Any]) -> None:
    """Set ``name``'s entry in the folder's manifest, under a file lock: several processes may train different
    recipes into one folder at the same time, and each re-reads the manifest before writing it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / MANIFEST, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        manifest = json.loads(text) if text.strip() else {}
        manifest[name] = entry
        f.seek(0)
        f.truncate()
        f.write(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")


def load_or_train_recipe(recipe: Any, directory: PathLike, build: Callable[[Dict[str, Any]], nn.Module],
                         train: Callable[[], Tuple[nn.Module, TrainLog]], retrain: bool = False,
                         device: Optional[torch.device] = None, how_to_retrain: str = "its training CLI"
                         ) -> Tuple[nn.Module, Dict[str, Any]]:
    """The checkpoint that ``directory``'s manifest records for ``recipe.name`` (sha256 verified, rebuilt by
    ``build``), or, when ``retrain`` or when there is no entry or file, a fresh ``train()`` (not written to
    disk).

    Returns:
        ``(model, entry)``: the model in eval mode and its manifest entry (for a fresh run, one describing it,
        with ``"sha256": None``).

    Raises:
        TypeError: ``retrain`` is not a bool.
        ValueError: the checkpoint was trained with another recipe than ``recipe``.
    """
    if not isinstance(retrain, bool):
        raise TypeError(f"retrain must be a bool, got {type(retrain).__name__} {retrain!r}")
    entry = read_manifest(directory).get(recipe.name)
    if not retrain and entry is not None and (Path(directory) / entry["file"]).is_file():
        if entry["recipe"] != asdict(recipe):
            raise ValueError(f"checkpoint {entry['file']!r} was trained with a recipe that differs from the one "
                             f"asked for (the manifest records another recipe for {recipe.name!r}); retrain it "
                             f"with `{how_to_retrain}`")
        return load_checkpoint(Path(directory) / entry["file"], entry["sha256"], build, device), entry
    model, log = train()
    return model, recipe_entry(recipe, model, log, sha256=None)
