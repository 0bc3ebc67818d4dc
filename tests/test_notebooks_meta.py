"""Notebook discipline (STYLE.md section 4), checked on the committed notebooks.

nbval checks that stored outputs repeat; these tests check what nbval cannot: that the stored outputs
come from one clean, in-order run, that nothing failed, that widgets carry their saved state, and that
the escape hatches (NBVAL_IGNORE_OUTPUT / NBVAL_SKIP) stay within budget.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WORKED_TITLE = "#@title Worked solution (double-click to show)"
MARKERS = ("NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP", "NBVAL_RAISES_EXCEPTION")
MARKER_TAGS = ("nbval-ignore-output", "nbval-skip", "raises-exception")
MARKER_BUDGET = 0.10


def _code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]


def _config() -> dict:
    return yaml.safe_load((ROOT / "_config.yml").read_text())


def _toc_files(node) -> list[str]:
    files = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("file", "root"):
                files.append(value)
            else:
                files.extend(_toc_files(value))
    elif isinstance(node, list):
        for item in node:
            files.extend(_toc_files(item))
    return files


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS, "book/ holds no notebooks"


@pytest.fixture(params=NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def nb(request):
    return nbformat.read(request.param, as_version=4)


def test_every_code_cell_ran_once_in_order(nb) -> None:
    counts = [c.execution_count for c in _code_cells(nb)]
    assert None not in counts, f"{counts.count(None)} code cell(s) were never executed"
    assert counts == list(range(1, len(counts) + 1)), f"execution counts out of order: {counts}"


def test_no_error_or_stderr_output(nb) -> None:
    for i, cell in enumerate(_code_cells(nb)):
        for out in cell.get("outputs", []):
            assert out.output_type != "error", f"code cell {i} stored an error: {out.get('ename')}"
            if out.output_type == "stream":
                assert out.name != "stderr", f"code cell {i} wrote to stderr: {out.text[:200]!r}"


def test_widget_views_have_saved_state(nb) -> None:
    views = [
        out["data"][WIDGET_VIEW]["model_id"]
        for cell in _code_cells(nb)
        for out in cell.get("outputs", [])
        if WIDGET_VIEW in out.get("data", {})
    ]
    if not views:
        return
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    missing = [m for m in views if m not in state]
    assert not missing, f"{len(missing)} widget view(s) lack saved state (run `make execute`)"


def test_ignore_and_skip_markers_within_budget(nb) -> None:
    cells = _code_cells(nb)
    marked = [
        c for c in cells
        if any(m in c.source for m in MARKERS) or any(t in c.metadata.get("tags", []) for t in MARKER_TAGS)
    ]
    assert len(marked) <= MARKER_BUDGET * len(cells), (
        f"{len(marked)} of {len(cells)} code cells are marked to skip or ignore output; "
        f"the budget is {MARKER_BUDGET:.0%}"
    )


def test_first_code_cell_installs_from_the_configured_repository(nb) -> None:
    url = _config()["repository"]["url"]
    first = _code_cells(nb)[0].source
    assert '"google.colab" in sys.modules' in first, "the first code cell must guard the install for Colab"
    match = re.search(r"%pip install .*git\+(\S+?)[\"'@\s]", first)
    assert match, "the first code cell must %pip install attention-core from the repository"
    assert match.group(1).rstrip("/") == url.rstrip("/"), (
        f"Colab install URL {match.group(1)} differs from _config.yml repository.url {url}"
    )
    assert "setup(" in first, "the first code cell must seed and choose DEVICE through session.setup()"


def test_notebook_opens_with_a_title(nb) -> None:
    first = nb.cells[0]
    assert first.cell_type == "markdown" and first.source.lstrip().startswith("# "), (
        "a chapter starts with a markdown cell holding its '# ' title"
    )


def test_toc_lists_every_book_file_and_nothing_missing() -> None:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    listed = set(_toc_files(toc))
    pages = [p for p in (ROOT / "book").glob("*") if p.suffix in (".md", ".ipynb")]
    on_disk = {str(p.relative_to(ROOT).with_suffix("")) for p in pages}
    assert on_disk - listed == set(), f"in book/ but not in _toc.yml: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"in _toc.yml but not in book/: {sorted(listed - on_disk)}"


# --- exercises that teach without telling (the referee issue) ------------------------------------------

CHAPTERS = [p for p in NOTEBOOKS if re.match(r"\d\d_", p.name)]


@pytest.fixture(params=CHAPTERS, ids=[p.name for p in CHAPTERS])
def chapter(request):
    return nbformat.read(request.param, as_version=4)


def _tags(cell) -> set:
    return set(cell.metadata.get("tags", []))


def test_objectives_first_and_a_summary_last(chapter) -> None:
    first = next(c.source for c in chapter.cells if c.cell_type == "markdown")
    assert "By the end of the chapter you will be able to" in first, "the first cell states no objectives"
    headings = [c.source for c in chapter.cells if c.cell_type == "markdown" and c.source.startswith("## Summary")]
    assert headings, "no '## Summary' section"


def test_a_code_exercise_whose_checker_is_proven(chapter) -> None:
    """One visible check cell per code exercise, right after the stub, naming an exercise whose checker
    tests/test_code_exercises.py proves against its mutants; no proof feeding it wrong answers in the page."""
    from attention_core.booktools.chapter_exercises import EXERCISES

    cells = chapter.cells
    asks = [i for i, c in enumerate(cells) if c.cell_type == "code" and "exercises.check_exercise(" in c.source]
    assert asks, "no code exercise (a visible exercises.check_exercise call)"
    for i in asks:
        m = re.search(r"exercises\.check_exercise\((\w+), \"([\w.]+)\"\)", cells[i].source)
        assert m and m.group(2) in EXERCISES, f"an unknown exercise: {cells[i].source!r}"
        assert "remove-cell" not in _tags(cells[i])
        stub = cells[i - 1]
        assert stub.cell_type == "code" and f"def {m.group(1)}(" in stub.source, "the check does not follow the stub"
    assert not any("prove_checker(" in c.source or "check_function(" in c.source for c in cells), \
        "a code checker is fed answers in the page (its proof lives in tests/test_code_exercises.py)"


def _is_folded_worked_solution(c) -> bool:
    """A worked-solution cell folded on the site, in Jupyter (source_hidden) and in Colab (a form), silent."""
    return (c.source.startswith(WORKED_TITLE) and bool(_tags(c) & {"hide-input", "hide-cell"})
            and bool(c.metadata.get("jupyter", {}).get("source_hidden"))
            and c.metadata.get("cellView") == "form" and not c.outputs)


def test_proofs_are_hidden_and_answers_never_written_out(chapter) -> None:
    for c in _code_cells(chapter):
        assert not re.search(r"exercises\.prove_(checker|value_check)\(", c.source), \
            "a checker is fed wrong answers in the page (that proof lives in tests/test_numeric_exercises.py)"
        if re.search(r"\.evaluate\(|\.accepts\(", c.source):
            assert "remove-cell" in _tags(c) or _is_folded_worked_solution(c), \
                f"a cell feeding an exercise its answer is not removed nor a folded worked solution: {c.source[:60]!r}"
        for m in re.finditer(r"check_value\(\s*(\"[^\"]*\"|'[^']*')\s*,\s*([^,)\s]+)", c.source):
            assert m.group(2).startswith(("\"ac1:", "'ac1:")), f"a check_value answer written out: {m.group(0)!r}"
        assert not re.search(r"answer_box_html\([^)]*,\s*[-0-9]", c.source), "an answer box with a plain number"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_no_output_carries_a_verdict_on_an_answer(path) -> None:
    """A stored "Correct" (or "Not yet") next to an answer tells the answer: proofs print answer-free lines."""
    from attention_core.booktools.exercises import CORRECT, NOT_YET

    nb = nbformat.read(path, as_version=4)
    for c in _code_cells(nb):
        for out in c.outputs:
            data = out.get("data", {})
            text = "".join(str(x) for x in (out.get("text", ""), data.get("text/plain", ""), data.get("text/html", "")))
            for verdict in (CORRECT, NOT_YET, "reference answer"):
                assert verdict not in text, f"{path.name}: an output carries {verdict!r}: {c.source[:60]!r}"


def test_worked_solutions_are_folded_and_silent(chapter) -> None:
    for c in _code_cells(chapter):
        assert not c.source.lstrip().startswith("# Worked solution"), "a worked solution without its Colab form title"
        if c.source.startswith(WORKED_TITLE):
            assert _tags(c) & {"hide-input", "hide-cell"}, "a worked solution is not folded on the site"
            assert c.metadata.get("jupyter", {}).get("source_hidden"), "a worked solution is not folded in Jupyter"
            assert c.metadata.get("cellView") == "form", "a worked solution is not folded in Colab (cellView form)"
            assert not c.outputs, "a worked solution prints something (it could show the answer)"
