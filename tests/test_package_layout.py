"""The rooms of the package, read from the import graph (every import, lazy ones included).

- **primitives** (the root modules and ``backends/``) import no model, no task and no book tool;
- **training** (checkpoints, progress, schedules, modes) imports nothing else of the package but the argument
  checks (`_checks`, a leaf every room may use), so any room may use it;
- **models** (``models/``) import primitives and training only: no task, no book tool;
- **tasks** (every other subpackage but ``booktools``: translation, shakespeare, regression, pretrained, ...)
  never import the book's tools;
- **booktools** is imported by the chapters alone;
- the public contract of STYLE.md section 2 is reachable as ``import attention_core as ac``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import attention_core as ac

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attention_core"
HELPERS = "attention_core.booktools"
MODELS = "attention_core.models"
TRAINING = "attention_core.training"
#: subpackages that belong to the primitives
PRIMITIVE_PACKAGES = {"attention_core.backends", "attention_core.distributed"}
#: every subpackage that is a task wing (anything that is not primitives, models, training or the book's tools)
TASKS = sorted(
    f"attention_core.{p.name}" for p in PACKAGE.iterdir()
    if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))
    and f"attention_core.{p.name}" not in PRIMITIVE_PACKAGES | {HELPERS, MODELS, TRAINING}
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set:
    """Every attention_core module ``path`` imports, at any depth of the file (function-level ones too)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("attention_core"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("attention_core"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # `from attention_core import booktools`
    return found


def _room(module: str) -> str:
    """primitives | training | models | task | booktools"""
    def under(pkg: str) -> bool:
        return module == pkg or module.startswith(pkg + ".")

    if under(HELPERS):
        return "booktools"
    if under(MODELS):
        return "models"
    if under(TRAINING):
        return "training"
    if any(under(t) for t in TASKS):
        return "task"
    return "primitives"


GRAPH = {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}
#: what each room may import besides itself
ALLOWED = {
    "training": {"training"},
    "primitives": {"primitives", "training"},
    "models": {"primitives", "training", "models"},
    "task": {"primitives", "training", "models", "task"},
    "booktools": {"primitives", "training", "models", "task", "booktools"},
}


#: leaf modules every room may use: the argument checks (one message style everywhere), which import nothing
#: of the package themselves (asserted below), so no wall is crossed through them.
SHARED_LEAVES = {"attention_core._checks"}


def _is_shared_leaf(module: str) -> bool:
    return any(module == leaf or module.startswith(leaf + ".") for leaf in SHARED_LEAVES)


def test_shared_leaves_import_nothing_of_the_package() -> None:
    for leaf in SHARED_LEAVES:
        assert not {m for m in GRAPH[leaf] if m != "attention_core"}, leaf


def test_the_rooms_are_what_the_layout_says() -> None:
    assert {"attention_core.translation", "attention_core.shakespeare", "attention_core.pretrained",
            "attention_core.regression"} <= set(TASKS)
    assert _room("attention_core.models.language_model") == "models"
    assert _room("attention_core.functional") == _room("attention_core.backends.chunked") == "primitives"
    assert _room("attention_core.training.checkpoint") == "training"
    assert _room("attention_core.distributed.ring") == "primitives"
    assert len(GRAPH) > 40


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_room_imports_upward(module: str) -> None:
    room = _room(module)
    leaks = sorted(m for m in GRAPH[module] if m != "attention_core" and _room(m) not in ALLOWED[room]
                   and not _is_shared_leaf(m))
    assert not leaks, f"{module} ({room}) imports {[(m, _room(m)) for m in leaks]}"


def test_the_root_holds_primitives_only() -> None:
    """No model or task module at the root: the old names are aliases (attention_core/_moved.py), not files."""
    from attention_core._moved import MOVED

    for old in MOVED:
        assert not (PACKAGE / (old.split(".")[-1] + ".py")).exists(), old


def test_the_detector_sees_a_lazy_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from attention_core.booktools.plots import plot_attention\n")
    assert "attention_core.booktools.plots" in _imports(src)
    assert _room("attention_core.booktools.plots") not in ALLOWED["task"]


def test_old_import_paths_give_the_same_module() -> None:
    import attention_core.language_model as old
    from attention_core.checkpoint import save_checkpoint

    import attention_core.models.language_model as new

    assert old is new and old.__name__ == "attention_core.models.language_model"
    assert old.__spec__.name == "attention_core.models.language_model"
    from attention_core.training import checkpoint

    assert save_checkpoint is checkpoint.save_checkpoint


def test_the_public_contract_is_importable() -> None:
    for name in ("scaled_dot_product_attention", "attention_weights", "masked_softmax", "MultiHeadAttention",
                 "nadaraya_watson", "available_backends", "use_backend"):
        assert callable(getattr(ac, name)), name
