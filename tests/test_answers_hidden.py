"""No answer is readable before the reader asks for it, in a plain notebook front end.

JupyterLab, classic Notebook, VS Code and Colab know nothing of Jupyter Book: they show every cell, the ones the
site removes (``remove-cell``) included, and a MyST ``{admonition} :class: dropdown`` as plain text. What all of
them fold is an HTML ``<details>`` element. So each notebook is rendered here as such a front end would show it:
nbconvert's HTML export, with no tag handling, every cell and output kept. The one thing applied is what
JupyterLab, Notebook 7 and VS Code do with a cell whose metadata says ``jupyter.source_hidden``, and Colab with
one whose metadata says ``cellView: form``: they fold its input (the worked-solution code cells). A cell that
carries both is rendered here as a folded ``<details>``; a cell with only one of them is shown in full.

The answers are read from the notebooks themselves: numbers from the encoded ``"ac1:..."`` strings (decoded
with the library's own decoder), quiz answers and explanations from the ``"acq1:..."`` strings, solution code
from the code blocks inside ``<details>``. Then the text a reader sees, everything outside a ``<details>``
element, must contain none of them, and no quiz may say which option is right.
"""

from __future__ import annotations

import ast
import functools
import html
import re
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from attention_core.booktools.exercises import decode_answer, decode_quiz, decode_text

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
ENCODED_NUMBER = re.compile(r"[\"'](ac1:[A-Za-z0-9+/=]+)[\"']")
ENCODED_QUIZ = re.compile(r"[\"'](acq1:[A-Za-z0-9+/=]+)[\"']")
ENCODED_TEXT = re.compile(r"[\"'](act1:[A-Za-z0-9+/=]+)[\"']")
DETAILS_BLOCK = re.compile(r"<details>(.*?)</details>", re.S)
# A MyST dropdown holds a solution too (the site folds it, a notebook front end shows it as plain text).
MYST_DROPDOWN = re.compile(r"^(`{3,}|:{3,})\{(admonition|dropdown)\}.*?\n(.*?)^\1[ \t]*$", re.S | re.M)


# ------------------------------------------------------------------------------------------ the rendering


def _fold_hidden_inputs(nb):
    """What JupyterLab, Notebook 7 and VS Code show for a cell whose input is marked hidden: a folded input."""
    nb = nbformat.from_dict(nb)  # a copy
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "code" and is_folded_everywhere(cell):
            cells.append(nbformat.v4.new_markdown_cell(
                "<details>\n<summary>(input hidden)</summary>\n\n```python\n" + cell.source + "\n```\n\n</details>"))
            cell.source = ""  # the input, folded, then the cell with its outputs
        cells.append(cell)
    nb.cells = cells
    return nb


def is_folded_everywhere(cell) -> bool:
    """A code cell whose input every front end folds: ``jupyter.source_hidden`` (JupyterLab, Notebook 7, VS Code)
    AND ``cellView: form`` (Colab, which ignores source_hidden). With only one of them, it is shown unfolded."""
    return bool(cell.metadata.get("jupyter", {}).get("source_hidden")) and cell.metadata.get("cellView") == "form"


def render_plain(nb) -> str:
    """The notebook as HTML, the way a notebook front end shows it: all cells, no Jupyter Book tags honoured."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab")
    body, _ = exporter.from_notebook_node(_fold_hidden_inputs(nb))
    return body


class _VisibleText(HTMLParser):
    """The text of an HTML page outside ``<details>`` (folded), ``<script>``, ``<style>`` and ``<head>``."""

    HIDDEN = {"details", "script", "style", "head", "template"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth: dict[str, int] = dict.fromkeys(self.HIDDEN, 0)
        self.parts: list[str] = []
        self.summaries: list[str] = []
        self._in_summary = 0

    def handle_starttag(self, tag, attrs) -> None:
        if tag in self.HIDDEN:
            self.depth[tag] += 1
        if tag == "summary":
            self._in_summary += 1

    def handle_endtag(self, tag) -> None:
        if tag in self.HIDDEN and self.depth[tag]:
            self.depth[tag] -= 1
        if tag == "summary" and self._in_summary:
            self._in_summary -= 1

    def handle_data(self, data) -> None:
        hidden = any(self.depth.values())
        # A folded element's <summary> is what the reader sees of it: only the summary of the outermost one.
        if not hidden or (self._in_summary and self.depth["details"] == 1 and not self.depth["script"]):
            self.parts.append(data)


def visible_text(page: str) -> str:
    parser = _VisibleText()
    parser.feed(page)
    return " ".join(" ".join(parser.parts).split())


# ------------------------------------------------------------------------------------------ the answers


def _norm(text: str) -> str:
    return " ".join(text.split())


def number_forms(value: float) -> set[str]:
    """How an answer would be written out: at 3 and 4 significant digits, to three decimals, in full, and an
    integer of 4 or more digits with and without separators. Forms with fewer than 3 significant digits
    (2.5, 0.88, 160) occur in any page for other reasons, so they are not searched for."""
    if value == int(value):
        n = int(value)
        return {str(n), f"{n:,}", f"{n:,}".replace(",", "{,}")} if abs(n) >= 1000 else set()
    forms = {f"{value:.3g}", f"{value:.4g}", f"{value:.3f}", repr(value)}
    return {f for f in forms if len(f.lstrip("-0.").replace(".", "")) >= 3}


def solution_code_lines(nb) -> set[str]:
    """The distinctive lines of the code inside every ``<details>`` (or MyST dropdown) of the notebook's markdown:
    fenced or indented blocks; comments, ``def`` lines and lines under 20 characters left out."""
    lines: set[str] = set()
    for cell in nb.cells:
        if cell.cell_type != "markdown":
            continue
        bodies = DETAILS_BLOCK.findall(cell.source) + [
            body for _, kind, body in MYST_DROPDOWN.findall(cell.source)
            if kind == "dropdown" or ":class: dropdown" in body]
        for body in bodies:
            code = re.findall(r"```[a-z]*\n(.*?)```", body, re.S)
            code += re.findall(r"((?:^(?: {4}|\t).*\n?)+)", body, re.M)  # indented blocks
            for block in code:
                for line in block.splitlines():
                    line = _norm(line.split("#")[0])
                    if len(line) >= 20 and not line.startswith(("def ", "return ")):
                        lines.add(line)
    return lines


def _compact(text: str) -> str:
    return re.sub(r"\s+", "", text)


def _sources(nb) -> str:
    return "\n".join(c.source for c in nb.cells)


@functools.cache
def _rendered(path: Path) -> tuple[str, str]:
    page = render_plain(nbformat.read(path, as_version=4))
    return page, visible_text(page)


# Numbers that occur in a chapter for another reason than the exercise whose answer they equal, with the reason.
COINCIDENCES: dict[tuple[str, str], str] = {
    ("05_self_attention.ipynb", "0.881"): "the mean row entropy at temperature 1 in the temperature table, not the "
                                          "weight of exercise 1",
}


def problems(nb, page: str, shown: str, shown_nb=None, name: str = "") -> list[str]:
    """Every answer of ``nb`` that the rendered ``page`` (visible text ``shown``) of ``shown_nb`` (default: ``nb``
    itself, or a changed copy of it) lets a reader see."""
    shown_nb = nb if shown_nb is None else shown_nb
    found: list[str] = []
    sources = _sources(nb)
    for encoded in sorted(set(ENCODED_NUMBER.findall(sources))):
        value = decode_answer(encoded)
        for form in sorted(number_forms(value)):
            if (name, form) in COINCIDENCES:
                continue
            if re.search(rf"(?<![\w.]){re.escape(form)}(?![\w]|\.\d)", shown):
                found.append(f"the numeric answer {form} is visible")
    for encoded in sorted(set(ENCODED_QUIZ.findall(sources))):
        _, why = decode_quiz(encoded)
        if why and _norm(why) in shown:
            found.append(f"a quiz explanation is visible: {why[:60]!r}")
    for encoded in sorted(set(ENCODED_TEXT.findall(sources))):
        why = decode_text(encoded)
        if why and _norm(why) in shown:
            found.append(f"an exercise's explanation is visible: {why[:60]!r}")
    # The site shows a quiz's text/html twin (a front end shows its widget): neither may mark the right option.
    outputs = str([c.get("outputs", []) for c in shown_nb.cells if c.cell_type == "code"])
    if "data-correct" in page or "data-correct" in outputs:
        found.append("a quiz button carries data-correct (the right option is marked in the page)")
    compact = _compact(shown)  # code is highlighted token by token: compare it without whitespace
    for line in sorted(solution_code_lines(nb)):
        if _compact(line) in compact:
            found.append(f"solution code is visible: {line[:70]!r}")
    found += quiz_calls_that_tell(shown_nb)
    return found


def quiz_calls_that_tell(nb) -> list[str]:
    """Quiz calls whose source shows the right index or the explanation: ``quiz(q, options, 1, explanation=...)``."""
    told = []
    for cell in nb.cells:
        if cell.cell_type != "code" or "quiz(" not in cell.source:
            continue
        try:
            tree = ast.parse("\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith("%")))
        except SyntaxError:
            continue
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and getattr(call.func, "attr", getattr(call.func, "id", "")) == "quiz"):
                continue
            answer = call.args[2] if len(call.args) > 2 else next(
                (k.value for k in call.keywords if k.arg == "answer_index"), None)
            if answer is not None and not (isinstance(answer, ast.Constant) and isinstance(answer.value, str)
                                           and answer.value.startswith("acq1:")):
                told.append(f"a quiz call gives its answer in plain text: {ast.unparse(answer)!r}")
            if any(k.arg == "explanation" for k in call.keywords) or len(call.args) > 3:
                told.append("a quiz call spells out its explanation")
    for cell in nb.cells:  # a numeric exercise's explanation often says how to get the number
        for m in re.finditer(r"check_value\((?:[^()]|\([^()]*\))*?explanation=([\"'])(.*?)\1", cell.source, re.S):
            if m.group(2) and not m.group(2).startswith("act1:"):
                told.append(f"a numeric exercise spells out its explanation: {m.group(2)[:50]!r}")
    return told


# ------------------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_no_answer_is_visible_in_a_plain_front_end(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    page, shown = _rendered(path)
    found = problems(nb, page, shown, name=path.name)
    assert not found, f"{path.name}, rendered as JupyterLab or Colab shows it:\n  " + "\n  ".join(found)


def test_the_answers_are_found_at_all() -> None:
    """The search has something to search for: encoded numbers and quizzes in every chapter, solution code in
    most, and each of those answers is present in the page once its folds are opened."""
    chapters = [p for p in NOTEBOOKS if re.match(r"\d\d_", p.name)]
    with_code = 0
    for path in chapters:
        nb = nbformat.read(path, as_version=4)
        sources = _sources(nb)
        assert ENCODED_NUMBER.search(sources), f"{path.name}: no encoded numeric answer found"
        assert ENCODED_QUIZ.search(sources), f"{path.name}: no encoded quiz found"
        lines = solution_code_lines(nb)
        with_code += bool(lines)
        page, _ = _rendered(path)
        opened = _compact(html.unescape(re.sub(r"<[^>]+>", " ", page)))
        for line in lines:
            assert _compact(line) in opened, f"{path.name}: solution line not found in the page at all: {line!r}"
    assert with_code >= len(chapters) // 2, f"solution code found in only {with_code} chapters"


def test_a_dropdown_put_back_is_caught() -> None:
    """The mutant of the issue: one solution written back as a MyST dropdown (plain text in a notebook)."""
    path = ROOT / "book" / "02_scoring_functions.ipynb"
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells
                if c.cell_type == "markdown" and "```python" in c.source and "<details>" in c.source)
    cell.source = cell.source.replace("<details>\n<summary>Solution</summary>\n", "````{admonition} Solution\n"
                                      ":class: dropdown\n").replace("</details>", "````")
    page = render_plain(nb)
    found = problems(nbformat.read(path, as_version=4), page, visible_text(page))
    assert any("solution code is visible" in f for f in found), found


def test_a_numeric_solution_put_back_is_caught() -> None:
    path = ROOT / "book" / "01_kernel_regression.ipynb"
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "markdown" and "3/1.32" in c.source)
    cell.source = cell.source.replace("<details>", "<div>").replace("</details>", "</div>")
    page = render_plain(nb)
    found = problems(nbformat.read(path, as_version=4), page, visible_text(page), nb)
    assert any("numeric answer 2.273" in f for f in found), found


def test_a_quiz_showing_its_index_is_caught() -> None:
    path = ROOT / "book" / "06_multi_head_attention.ipynb"
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "exercises.quiz(" in c.source)
    encoded = ENCODED_QUIZ.search(cell.source).group(1)
    index, why = decode_quiz(encoded)
    cell.source = cell.source.replace(repr(encoded), f"{index}, explanation={why!r}")
    page = render_plain(nb)
    found = problems(nbformat.read(path, as_version=4), page, visible_text(page), nb)
    assert any("plain text" in f for f in found) and any("explanation is visible" in f for f in found), found


def test_a_plain_explanation_of_a_numeric_exercise_is_caught() -> None:
    path = ROOT / "book" / "08_transformer.ipynb"
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "check_value(" in c.source)
    encoded = ENCODED_TEXT.search(cell.source).group(1)
    cell.source = cell.source.replace(encoded, decode_text(encoded))
    page = render_plain(nb)
    found = problems(nbformat.read(path, as_version=4), page, visible_text(page), nb)
    assert any("numeric exercise spells out" in f for f in found), found
    assert any("explanation is visible" in f for f in found), found


def test_a_marked_static_quiz_is_caught() -> None:
    """The site's twin of a quiz must not mark its right button (it used to carry data-correct="1")."""
    path = ROOT / "book" / "05_self_attention.ipynb"
    nb = nbformat.read(path, as_version=4)
    page, shown = _rendered(path)
    assert not problems(nb, page, shown, name=path.name)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            markup = out.get("data", {}).get("text/html", "")
            if "ac-quiz-option" in markup:
                out["data"]["text/html"] = markup.replace('data-option="1"', 'data-correct="1"', 1)
    assert any("data-correct" in f for f in problems(nbformat.read(path, as_version=4), page, shown, nb))


def test_visible_text_leaves_out_folded_elements() -> None:
    page = "<p>seen</p><details><summary>Solution</summary><p>hidden 0.123</p></details><script>x=1</script>"
    assert visible_text(page) == "seen Solution"
