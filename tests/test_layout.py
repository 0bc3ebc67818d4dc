"""The walls between the package's three wings, read from the import graph (every import, lazy ones included).

- the attention core (every module outside the wings) imports neither the translation task nor the
  chapters' helpers, nor any other task wing;
- the translation task does not import the chapters' helpers (its progress bars come from the core);
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
#: Subpackages that are wings (tasks or helpers); everything else is the core. ``backends`` is core.
WINGS = sorted(
    f"attention_core.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and p.name != "backends"
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


def _wing_of(module: str) -> str | None:
    return next((w for w in WINGS if module == w or module.startswith(w + ".")), None)


GRAPH = {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def test_the_wings_are_what_the_layout_says() -> None:
    assert "attention_core.translation" in WINGS and HELPERS in WINGS
    assert len(GRAPH) > 30


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _wing_of(m) is None))
def test_the_core_imports_no_wing(module: str) -> None:
    leaks = sorted(m for m in GRAPH[module] if _wing_of(m) is not None)
    assert not leaks, f"{module} (core) imports {leaks}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _wing_of(m) not in (None, HELPERS)))
def test_a_task_does_not_import_the_helpers(module: str) -> None:
    leaks = sorted(m for m in GRAPH[module] if _wing_of(m) == HELPERS)
    assert not leaks, f"{module} (a task) imports the chapters' helpers: {leaks}"


def test_the_detector_sees_a_lazy_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from attention_core.booktools.plots import plot_attention\n")
    assert _wing_of(next(iter(_imports(src) - {"attention_core.booktools.plots"}))) == HELPERS


def test_the_public_contract_is_importable() -> None:
    for name in ("scaled_dot_product_attention", "attention_weights", "masked_softmax", "MultiHeadAttention",
                 "nadaraya_watson", "available_backends", "use_backend"):
        assert callable(getattr(ac, name)), name
