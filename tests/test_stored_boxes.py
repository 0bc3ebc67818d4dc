"""Every number box's stored page version (the HTML and script the site shows) is what the library builds now.

A change to how a box checks (its script in ``attention_core.booktools.static``) leaves every chapter's stored
box stale until ``python scripts/refresh_boxes.py`` rewrites them (or the chapter is re-executed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("refresh_boxes", ROOT / "scripts" / "refresh_boxes.py")
refresh_boxes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(refresh_boxes)
CHAPTERS = sorted((ROOT / "book").glob("*.ipynb"))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_stored_box_is_the_librarys_current_page_version(path: Path) -> None:
    assert refresh_boxes.stale_boxes(path) == [], "run python scripts/refresh_boxes.py"


def test_the_book_has_boxes_and_a_stale_one_is_found_and_rewritten(tmp_path: Path) -> None:
    """The check can fail: a box whose stored script is an older one is reported, and the rewrite fixes it."""
    source = next(p for p in CHAPTERS if "check_value(" in p.read_text())
    nb = nbformat.read(source, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "check_value(" in c.source)
    out = next(o for o in cell.outputs if 'class="ac-answer"' in o.get("data", {}).get("text/html", ""))
    out["data"]["text/html"] = out["data"]["text/html"].replace("Math.abs(x - e)", "Math.abs(x - e) * 1.0", 1)
    copy = tmp_path / source.name
    nbformat.write(nb, copy)
    assert len(refresh_boxes.stale_boxes(copy)) == 1
    assert len(refresh_boxes.stale_boxes(copy, fix=True)) == 1 and refresh_boxes.stale_boxes(copy) == []
    assert sum("check_value(" in c.source for p in CHAPTERS for c in nbformat.read(p, as_version=4).cells
               if c.cell_type == "code") >= 17
