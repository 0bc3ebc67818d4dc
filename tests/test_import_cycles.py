"""No import circle in ``attention_core``: the graph of every import, module-level and function-level, is acyclic.

A function-level import does not make a circle harmless, it only hides it until the function runs; so the walk
reads every ``import`` and ``from ... import`` at any depth of a file (and ``importlib.import_module`` with a
literal name). An edge goes to the module imported (``from attention_core.backends import chunked`` is the
module ``attention_core.backends.chunked``; ``from attention_core.flex_attention import BlockMask`` is
``attention_core.flex_attention``) and to each package above it whose ``__init__`` runs first (not the importer's
own packages, which are already running). Any strongly connected set of two or more modules, or a module that
imports itself, is a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _named(node: ast.AST, importer: str, is_package: bool) -> list[str]:
    """The dotted names one import node reaches: candidates, most specific first per imported name."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: resolved against the importer's package
            package = importer.split(".") if is_package else importer.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        return [f"{base}.{a.name}" for a in node.names] + [base]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return [node.args[0].value]
    return []


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the package's modules it imports (every depth of the file), with the packages above them."""
    files = {_module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = _named(node, module, is_package)
            if isinstance(node, ast.ImportFrom):  # `from M import n`: the submodule M.n if it is one, else M
                base = names[-1]
                names = [n if n in files else base for n in names[:-1]]
            for name in names:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # the module and each package whose __init__ runs before it
                    target = ".".join(parts[:i])
                    if target in files and target != module and not module.startswith(target + "."):
                        edges.add(target)
        graph[module] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (and self-importers), each as one circle's path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1 or v in graph[v]:
                    found.append(_one_circle(graph, set(component)))
    return found


def _one_circle(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A path a -> ... -> a inside one strongly connected set (breadth-first from its first module)."""
    start = min(component)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_attention_core_has_no_import_circle() -> None:
    graph = import_graph(ROOT, "attention_core")
    assert len(graph) > 100 and "attention_core.block_mask" in graph["attention_core.flex_attention"]
    found = circles(graph)
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_block_mask_sits_below_the_flex_backends() -> None:
    graph = import_graph(ROOT, "attention_core")
    for backend in ("attention_core.backends.chunked_flex", "attention_core.backends.triton_flex"):
        assert "attention_core.block_mask" in graph[backend], backend
        assert "attention_core.flex_attention" not in graph[backend], backend
    assert "attention_core.backends.triton_flex_mods" in graph["attention_core.backends.triton_flex_bwd"]
    assert "attention_core.backends.triton_flex" not in graph["attention_core.backends.triton_flex_bwd"]
    assert not graph["attention_core.block_mask"] & {"attention_core.flex_attention", "attention_core.backends"}


def _package(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return import_graph(tmp_path, "pkg")


# (files of a toy package "pkg", one module and the imports the walk must find in it, the circles it must find)
WALKS = {
    "a circle hidden in a function": ({
        "__init__.py": "",
        "front.py": "from pkg.sub.back import run\n",
        "sub/__init__.py": "",
        "sub/back.py": "def run():\n    from pkg.front import SIZE\n    return SIZE\n",
        "leaf.py": "import torch\n",
    }, ("pkg.sub.back", {"pkg.front"}), [["pkg.front", "pkg.sub.back", "pkg.front"]]),
    "relative imports, package inits and import_module": ({
        "__init__.py": "",
        "a.py": "from .sub import b\n",
        "sub/__init__.py": "import importlib\n\ndef f():\n    return importlib.import_module('pkg.a')\n",
        "sub/b.py": "X = 1\n",
    }, ("pkg.a", {"pkg.sub", "pkg.sub.b"}), [["pkg.a", "pkg.sub", "pkg.a"]]),
    "an acyclic package": ({
        "__init__.py": "from pkg.front import run\n",
        "front.py": "from pkg.rooms.back import run\nfrom pkg.rooms import SIZE\n",
        "rooms/__init__.py": "SIZE = 128\n",
        "rooms/back.py": "def run():\n    from pkg.rooms import SIZE\n    return SIZE\n",
    }, ("pkg.front", {"pkg.rooms", "pkg.rooms.back"}), []),
}


@pytest.mark.parametrize("case", list(WALKS))
def test_the_walk_finds_every_import_and_circle_of_a_toy_package(tmp_path: Path, case: str) -> None:
    files, (module, imports), expected = WALKS[case]
    graph = _package(tmp_path, files)
    assert graph[module] == imports
    assert circles(graph) == expected
