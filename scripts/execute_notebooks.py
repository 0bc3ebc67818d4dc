"""Execute the book's notebooks in place: the one canonical run whose outputs are committed.

Usage: python scripts/execute_notebooks.py [NOTEBOOK ...]   (default: every book/*.ipynb)

Each notebook runs top to bottom in a fresh kernel from its own folder (as nbval and Colab run it),
with widget state saved so the site can show widgets, in the environment that makes outputs repeat (one
thread, progress bars off, fixed hash seed): the one conftest.py sets for nbval, so both run alike.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from conftest import NOTEBOOK_ENV  # noqa: E402  (one definition of the notebooks' environment)

for _name, _value in NOTEBOOK_ENV.items():
    os.environ.setdefault(_name, _value)
BUDGET_S = 90.0  # every chapter must execute within this on the 2-core CPU machine


def execute(path: Path, timeout: int = 600) -> float:
    """Run one notebook in place and return its wall time in seconds."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        store_widget_state=True,
        record_timing=False,
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "book").glob("*.ipynb"))
    over = []
    for path in paths:
        elapsed = execute(path)
        flag = "" if elapsed <= BUDGET_S else f"  OVER the {BUDGET_S:.0f} s budget"
        print(f"{path.name}: {elapsed:6.1f} s{flag}", flush=True)
        if elapsed > BUDGET_S:
            over.append(path.name)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
