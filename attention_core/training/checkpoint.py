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
import os
import tempfile
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from attention_core._checks import check_device, short_repr

__all__ = [
    "FORMAT",
    "MANIFEST",
    "TrainLog",
    "file_sha256",
    "load_checkpoint",
    "load_or_train_recipe",
    "read_manifest",
    "recipe_entry",
    "record_in_manifest",
    "save_checkpoint",
    "save_recipe_checkpoint",
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
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not getattr(model, "config", None):
        raise ValueError("model.config is empty: build the model from a config dict to checkpoint it")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _replacing(path, "wb") as f:  # a crash mid-write leaves the old file, never half a new one
        torch.save({"format": FORMAT, "config": model.config, "state_dict": state}, f)
    return file_sha256(path)


#: The layout version of a checkpoint file.
FORMAT = 1


class _replacing:
    """Write to a temporary file beside ``path`` and move it over ``path`` only when the ``with`` block ends
    without an error (``os.replace`` is atomic on one filesystem)."""

    def __init__(self, path: Path, mode: str) -> None:
        self.path, self.mode = path, mode

    def __enter__(self):
        fd, self.tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        self.f = os.fdopen(fd, self.mode)
        return self.f

    def __exit__(self, kind, value, tb) -> None:
        self.f.close()
        if kind is None:
            os.chmod(self.tmp, 0o644)  # as a plain write would leave it (mkstemp makes it private)
            os.replace(self.tmp, self.path)
        else:
            os.unlink(self.tmp)


def load_checkpoint(path: PathLike, sha256: str, build: Callable[[Dict[str, Any]], nn.Module],
                    device: Optional[torch.device] = None) -> nn.Module:
    """Verify ``path`` against ``sha256``, then rebuild the model with ``build(config)`` and load its weights
    (in eval mode).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file's sha256 differs from ``sha256`` (checked before the file is unpickled); or a file
            with the right checksum that is not a checkpoint of this layout, or whose weights do not fit the model
            its config builds (the message names the file and what is wrong).
    """
    path = Path(path)
    _check_sha256(sha256, "sha256")
    if not callable(build):
        raise TypeError(f"build must be a callable config -> model, got {type(build).__name__}")
    device = check_device(device)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    seen = file_sha256(path)
    if seen != sha256:
        raise ValueError(f"checkpoint {path} has sha256 {seen}, expected {sha256}: the file is damaged or was "
                         "replaced; retrain it from its recipe")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 (any unpickling failure: not a checkpoint)
        raise ValueError(f"checkpoint {path} cannot be read as a torch file: {type(err).__name__}: {err}") from err
    if not isinstance(blob, dict) or blob.get("format") != FORMAT or not isinstance(blob.get("config"), dict) \
            or not isinstance(blob.get("state_dict"), dict):
        what = sorted(blob) if isinstance(blob, dict) else type(blob).__name__
        raise ValueError(f"checkpoint {path} is not a format-{FORMAT} checkpoint (a dict with 'format', 'config' "
                         f"and 'state_dict'): found {what}")
    try:
        model = build(blob["config"])
    except (TypeError, ValueError) as err:  # the builder's own error, with the file it came from
        raise type(err)(f"checkpoint {path}: its config does not build a model: {err}") from err
    except (KeyError, IndexError, AttributeError) as err:  # a builder that reads keys without checking them
        raise ValueError(f"checkpoint {path}: its config does not build a model ({type(err).__name__}: {err}); "
                         f"config = {short_repr(blob['config'], 200)}") from err
    if not isinstance(model, nn.Module):
        raise TypeError(f"build must return a torch.nn.Module, got {type(model).__name__}")
    _check_state_fits(path, model, blob["state_dict"])
    try:
        model.load_state_dict(blob["state_dict"])
    except RuntimeError as err:
        raise ValueError(f"checkpoint {path}: its weights do not fit the model its config builds: {err}") from err
    return model.to(device or "cpu").eval()


def _check_sha256(sha256: object, name: str) -> str:
    if not isinstance(sha256, str):
        raise TypeError(f"{name} must be a str of 64 hex digits, got {type(sha256).__name__} {short_repr(sha256)}")
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256.lower()):
        raise ValueError(f"{name} must be 64 hex digits (a sha256), got {short_repr(sha256)}")
    return sha256


def _check_state_fits(path: Path, model: nn.Module, state: Dict[str, Any]) -> None:
    """Refuse a state dict whose tensors do not fit ``model`` exactly: a key missing or extra, a shape or a
    dtype that differs (``load_state_dict`` would silently cast a float64 tensor into a float32 parameter)."""
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    bad = [k for k in own if k in state and not isinstance(state[k], torch.Tensor)]
    if missing or extra or bad:
        raise ValueError(f"checkpoint {path}: its weights do not fit the model its config builds: missing "
                         f"{missing[:5]}, unexpected {extra[:5]}, not tensors {bad[:5]}")
    for k, t in own.items():
        if state[k].shape != t.shape or state[k].dtype != t.dtype:
            raise ValueError(f"checkpoint {path}: its weights do not fit the model its config builds: {k!r} is "
                             f"{state[k].dtype} {tuple(state[k].shape)}, the model expects {t.dtype} "
                             f"{tuple(t.shape)}")


def _check_recipe(recipe: object) -> None:
    """``TypeError`` unless ``recipe`` is a dataclass instance with a str ``name``."""
    if not is_dataclass(recipe) or isinstance(recipe, type) or not isinstance(getattr(recipe, "name", None), str):
        raise TypeError(f"recipe must be a recipe (a dataclass with a str name), got {short_repr(recipe)}")


def recipe_entry(recipe: Any, model: nn.Module, log: TrainLog, sha256: Optional[str], every: int = 25
                 ) -> Dict[str, Any]:
    """The manifest record of a model trained from ``recipe`` (a dataclass with a ``name``): file, checksum,
    size, time, loss curve (means of ``every`` steps) and the recipe itself."""
    _check_recipe(recipe)
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


def save_recipe_checkpoint(model: nn.Module, log: TrainLog, recipe: Any, directory: PathLike, every: int = 25,
                           extra: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Write ``<recipe.name>.pt`` in ``directory`` (:func:`save_checkpoint`) and record its entry
    (:func:`recipe_entry`, then the fields of ``extra``: a test accuracy, a validation loss) in the folder's
    manifest; returns the entry."""
    _check_recipe(recipe)
    sha = save_checkpoint(model, Path(directory) / f"{recipe.name}.pt")
    entry = {**recipe_entry(recipe, model, log, sha, every=every), **(extra or {})}
    record_in_manifest(directory, recipe.name, entry)
    return entry


def read_manifest(directory: PathLike) -> Dict[str, Any]:
    """The manifest of a checkpoint folder, or ``{}`` when it has none."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return {}
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"manifest {path} is not valid JSON ({err}); restore it from the repository or retrain "
                         "the recipes it listed") from err
    if not isinstance(manifest, dict):
        raise ValueError(f"manifest {path} must be a JSON object of entries, got a JSON {type(manifest).__name__}")
    for name, entry in manifest.items():
        problems = _entry_problems(entry)
        if problems:
            raise ValueError(f"manifest {path}: entry {name!r} {'; '.join(problems)} (expected 'file' a str, "
                             "'sha256' a str or null, 'recipe' an object)")
    return manifest


def _entry_problems(entry: object) -> List[str]:
    if not isinstance(entry, dict):
        return [f"is a JSON {type(entry).__name__}, not an object"]
    problems = [f"lacks {key!r}" for key in ("file", "recipe") if key not in entry]
    if "file" in entry and not isinstance(entry["file"], str):
        problems.append(f"has 'file' = {short_repr(entry['file'])}")
    if "recipe" in entry and not isinstance(entry["recipe"], dict):
        problems.append(f"has 'recipe' = {short_repr(entry['recipe'])}")
    if not (entry.get("sha256") is None or isinstance(entry["sha256"], str)):
        problems.append(f"has 'sha256' = {short_repr(entry['sha256'])}")
    return problems


def record_in_manifest(directory: PathLike, name: str, entry: Dict[str, Any]) -> None:
    """Set ``name``'s entry in the folder's manifest, under a file lock: several processes may train different
    recipes into one folder at the same time, and each re-reads the manifest before writing it.

    Raises:
        TypeError: ``name`` is not a str, ``entry`` is not a dict, or ``entry`` holds a value ``json.dumps``
            refuses (a set, a tensor); all checked before anything is written.
        ValueError: ``name`` is empty, or ``entry`` is not one :func:`read_manifest` would accept: it must have
            ``"file"`` (a str) and ``"recipe"`` (a dict), and ``"sha256"``, if present, must be a str or None.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a non-empty str (the recipe's name), got {type(name).__name__} "
                        f"{short_repr(name)}")
    if not name:
        raise ValueError("name must be a non-empty str (the recipe's name), got ''")
    if not isinstance(entry, dict):
        raise TypeError(f"entry must be a dict (the manifest entry of {name!r}), got {type(entry).__name__} "
                        f"{short_repr(entry)}")
    problems = _entry_problems(entry)
    if problems:
        raise ValueError(f"entry for {name!r} {'; '.join(problems)} (expected 'file' a str, 'sha256' a str or null, "
                         "'recipe' a dict): read_manifest would refuse the manifest")
    try:
        json.dumps(entry)
    except (TypeError, ValueError) as err:  # a value JSON cannot hold: a set, a tensor
        raise TypeError(f"entry for {name!r} must hold only what JSON can: {err}") from None
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lock = os.open(directory, os.O_RDONLY)  # the folder is the lock: the manifest file itself gets replaced
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = directory / MANIFEST
        text = path.read_text() if path.is_file() else ""
        manifest = json.loads(text) if text.strip() else {}
        manifest[name] = entry
        with _replacing(path, "w") as out:  # readers see the old manifest or the new one, whole
            out.write(json.dumps(dict(sorted(manifest.items())), indent=1) + "\n")
    finally:
        os.close(lock)  # releases the lock


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
    _check_recipe(recipe)
    if not isinstance(retrain, bool):
        raise TypeError(f"retrain must be a bool, got {type(retrain).__name__} {retrain!r}")
    entry = read_manifest(directory).get(recipe.name)
    if not retrain and entry is not None and (Path(directory) / entry["file"]).is_file():
        if entry["recipe"] != asdict(recipe):
            raise ValueError(f"checkpoint {entry['file']!r} was trained with a recipe that differs from the one "
                             f"asked for (the manifest records another recipe for {recipe.name!r}); retrain it "
                             f"with `{how_to_retrain}`")
        if entry.get("sha256") is None:
            raise ValueError(f"the manifest records no sha256 for {recipe.name!r} but the file {entry['file']!r} "
                             f"exists: it cannot be verified; retrain it with `{how_to_retrain}`")
        model = load_checkpoint(Path(directory) / entry["file"], entry["sha256"], build, device)
        count = sum(p.numel() for p in model.parameters())
        if isinstance(entry.get("parameters"), int) and entry["parameters"] != count:
            raise ValueError(f"checkpoint {entry['file']!r} builds a model of {count} parameters but the manifest "
                             f"records {entry['parameters']} for {recipe.name!r}; retrain it with `{how_to_retrain}`")
        return model, entry
    model, log = train()
    return model, recipe_entry(recipe, model, log, sha256=None)
