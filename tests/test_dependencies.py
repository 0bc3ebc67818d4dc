"""The core installs with torch and numpy alone; the book's tools say which extra brings what they need.

The clean environment is simulated in a subprocess whose import system refuses matplotlib, ipywidgets, tqdm and
hypothesis (as if they were not installed): ``import attention_core`` and the attention functions, the models and
the training helpers must work there, and ``attention_core.booktools`` must fail with an ImportError that names
the ``book`` extra. ``scripts/check_core_install.sh`` does the same in a real fresh venv with ``pip install .``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK_ONLY = ("matplotlib", "ipywidgets", "tqdm", "hypothesis")

_BLOCKER = textwrap.dedent(f"""
    import importlib.abc, sys
    BLOCKED = {BOOK_ONLY!r}
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)", name=name)
            return None
    sys.meta_path.insert(0, Block())
    # importlib.util.find_spec asks the finders too: make it answer None for the blocked names
    import importlib.util as u
    _find = u.find_spec
    u.find_spec = lambda name, package=None: None if name.split(".")[0] in BLOCKED else _find(name, package)
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCKER + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_core_runs_without_the_book_extra() -> None:
    r = _run("""
        import torch
        import attention_core as ac
        from attention_core.models import language_model as lm, transformer, bert, latent_attention, rnn_attention
        from attention_core.training import checkpoint, progress, schedules
        from attention_core.translation import train
        q = torch.randn(1, 2, 5, 8)
        out = ac.scaled_dot_product_attention(q, q, q, is_causal=True)
        for name in ac.available_backends("cpu"):
            if name != "triton":
                torch.testing.assert_close(ac.scaled_dot_product_attention(q, q, q, backend=name),
                                           ac.scaled_dot_product_attention(q, q, q, backend="reference"))
        assert list(progress.progress(range(3))) == [0, 1, 2]  # no tqdm: the plain loop
        m = ac.MultiHeadAttention(8, 2)
        y, w = m(torch.randn(2, 3, 8), need_weights=True)
        print("ok", tuple(out.shape), tuple(y.shape))
        print(sorted(n for n in __import__("sys").modules if n.split(".")[0] in {BOOK_ONLY!r}))
    """.replace("{BOOK_ONLY!r}", repr(BOOK_ONLY)))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "ok (1, 2, 5, 8) (2, 3, 8)"
    assert lines[1] == "[]", f"the core imported a book-only package: {lines[1]}"


def test_a_book_tool_without_the_extra_names_it() -> None:
    r = _run("""
        try:
            from attention_core.booktools import plots
        except ImportError as e:
            print(type(e).__name__, e)
        else:
            print("imported")
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("ImportError"), r.stdout
    assert "attention-core[book]" in r.stdout and "matplotlib" in r.stdout and "hypothesis" in r.stdout


def test_the_declared_dependencies_are_the_core_ones() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = sorted(d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"])
    assert names == ["numpy", "torch"]
    book = {d.split(">")[0] for d in project["optional-dependencies"]["book"]}
    assert set(BOOK_ONLY) <= book
    for nb in sorted((ROOT / "book").glob("*.ipynb")):
        assert "attention-core[book" in nb.read_text(), f"{nb.name} does not install the book extra"


def test_a_fresh_venv_installs_and_runs_the_core_alone(tmp_path: Path) -> None:
    """``pip install .`` with no extras in a new venv (torch comes from the local wheel cache; about 30 s)."""
    r = subprocess.run(["bash", str(ROOT / "scripts" / "check_core_install.sh"), str(tmp_path / "venv")],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "core install ok" in r.stdout and "attention-core[book]" in r.stdout
