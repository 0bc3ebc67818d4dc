"""Rewrite the stored page version of every number box in the book from the library as it is now.

A chapter's number box (``exercises.check_value(...)``, always called with literal arguments) stores, beside
its widget, the HTML and script the rendered site shows (``ValueCheck.static_html``). When the library changes
how a box checks (its script), every stored box is stale until its chapter is re-executed; this rewrites
only those HTML outputs, from each cell's own call, and leaves every other output as it is. Run it after such a
change (``tests/test_stored_boxes.py`` fails until then):

    python scripts/refresh_boxes.py            # rewrite what is stale, print what changed
    python scripts/refresh_boxes.py --check    # exit 1 if any stored box is stale, change nothing
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path
from typing import Iterator

import nbformat

BOOK = Path(__file__).resolve().parent.parent / "book"


def box_calls(source: str) -> Iterator[ast.Call]:
    """The ``check_value(...)`` calls of a code cell's source (magics and shell lines left out)."""
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "check_value":
            yield node


def value_check(call: ast.Call):
    """The box a chapter's ``check_value(...)`` call builds (its arguments are literals in every chapter)."""
    from attention_core.booktools import exercises

    args = [ast.literal_eval(a) for a in call.args]
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    return exercises.ValueCheck(*args, **kwargs)


def current_markup(call: ast.Call) -> str:
    """The page version the library builds now for this call."""
    return value_check(call).static_html()


def _uid(markup: str) -> str:
    return re.search(r'<div class="ac-answer" id="([^"]+)"', markup)[1]


def stale_boxes(path: Path, fix: bool = False) -> list[str]:
    """The labels of ``path``'s boxes whose stored HTML differs from the library's (rewritten if ``fix``)."""
    nb = nbformat.read(path, as_version=4)
    stale = []
    for cell in nb.cells:
        if cell.cell_type != "code" or "check_value(" not in cell.source:
            continue
        for call in box_calls(cell.source):
            markup = current_markup(call)
            uid = _uid(markup)
            stored = [out for out in cell.get("outputs", [])
                      if f'id="{uid}"' in out.get("data", {}).get("text/html", "")]
            if len(stored) != 1:
                stale.append(f"{path.name}: box {uid} has {len(stored)} stored outputs (re-execute the chapter)")
                continue
            if stored[0]["data"]["text/html"] != markup:
                stale.append(f"{path.name}: box {uid}")
                stored[0]["data"]["text/html"] = markup
    if fix and stale:
        nbformat.write(nb, path)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every chapter in book/")
    parser.add_argument("--check", action="store_true", help="only report stale boxes; exit 1 if any")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted(BOOK.glob("*.ipynb"))
    stale = [line for path in paths for line in stale_boxes(path, fix=not args.check)]
    for line in stale:
        print(("stale: " if args.check else "rewritten: ") + line)
    print(f"{len(stale)} stored box(es) {'stale' if args.check else 'rewritten'} in {len(paths)} notebook(s)")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
