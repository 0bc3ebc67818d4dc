"""Numbers in the book's prose come from the computation (issue 22).

Every number with three or more significant digits in a markdown cell of a book notebook, or in a
``book/*.md`` page, must be backed by one of:

- the notebook's stored outputs (any text-like output, glued values included) or its code cells' sources
  (an ``assert`` beside the prose, e.g. ``assert f"{acc:.3f}" == "0.468"``), compared as numbers: "0.468"
  matches 0.468, 0.4680 and a printed 0.46812 (a printed value that rounds to it); "1,024" matches 1024;
  "93.3%" matches 93.3 (or 0.933);
- an entry of ``tests/prose_numbers_allowlist.txt`` (``notebook  number  citation-key``) whose key is in
  ``references.bib``: a constant from the literature, with its source.

Not counted as prose numbers: code spans and fences (MyST roles such as ``{cite:p}`...``` and
``{glue:text}`...``` included, so a glued number is backed by construction), link targets, HTML attributes,
years (1900 to 2035, so 2048 stays a number) written as years, equation labels, and section / figure /
table / chapter / equation numbers. Math is included: ``$d_k = 512$`` counts.

Parametrized by page, so ``pytest tests/test_prose_numbers.py -k 03_`` checks one chapter; a failure lists
every offender of the page with its cell and context.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal, InvalidOperation
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
PAGES = sorted(BOOK.glob("*.ipynb")) + sorted(BOOK.glob("*.md"))
ALLOWLIST = ROOT / "tests" / "prose_numbers_allowlist.txt"
BIB = ROOT / "references.bib"
MIN_SIGNIFICANT = 3
LAST_YEAR = 2035  # a citation or date after this is impossible; 2048 is a length, not a year

# --- what in markdown is not prose ----------------------------------------------------------------------

_FENCE = re.compile(r"^(?P<f>`{3,}|~{3,}|:{3,})[^\n]*\n.*?^(?P=f)[ \t]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)  # `x`, ``x``; MyST roles {r}`x` lose their body
_ROLE_NAME = re.compile(r"\{[\w:.-]+\}")
_LINK_TARGET = re.compile(r"\]\([^)]*\)")  # [text](target): keep the text, drop the target
_REF_DEF = re.compile(r"^\s*\[[^\]]+\]:\s*\S+.*$", re.M)
_URL = re.compile(r"(?:https?|ftp)://\S+|www\.\S+|doi:\S+|arXiv:\s*\d{4}\.\d{4,5}(?:v\d+)?", re.I)
_HTML_TAG = re.compile(r"<[^>\n]+>")
_LABEL = re.compile(r"^\((?:[\w:.-]+)\)=\s*$|\\label\{[^}]*\}|\\tag\{[^}]*\}|\$\$\s*\([\w:.-]+\)", re.M)
_ANCHOR_TARGET = re.compile(r"^\s*\(?[\w-]+\)=\s*$", re.M)
_REFERENCE_WORDS = (
    r"(?:sections?|sec\.|§|figures?|figs?\.|tables?|tab\.|chapters?|ch\.|chs\.|equations?|eqs?\.|"
    r"appendix|appendices|algorithms?|alg\.|lines?|pages?|pp?\.|theorem|lemma|cells?|issues?)"
)
_REFERENCE = re.compile(
    _REFERENCE_WORDS + r"\s*\(?\d+(?:\.\d+)*\)?(?:\s*(?:[-\u2013,]|and|or|to)\s*\(?\d+(?:\.\d+)*\)?)*", re.I
)

# A number: optional sign, digits with optional thousands separators (comma or thin space) or an underscore
# (Python), optional fraction, optional exponent (1e-5, 1.5 \times 10^{-3} is two numbers), optional %.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:_\d+)*(?:\.\d+)?(?:[eE][-+]?\d+)?)(?P<pct>\s?%)?"
    r"(?![\w])"
)
_MONTHS = (
    r"(?:January|February|March|April|May|June|July|August|September|October|November|December|"
    r"Jan\.?|Feb\.?|Mar\.?|Apr\.?|Jun\.?|Jul\.?|Aug\.?|Sep\.?|Sept\.?|Oct\.?|Nov\.?|Dec\.?)"
)
_YEAR_BEFORE = re.compile(
    r"(?:\b(?:in|since|of|until|till|from|by|before|after|around|circa|c\.|to|and|or|early|late|mid|"
    r"arXiv|ICLR|ICML|NeurIPS|NIPS|ACL|EMNLP|NAACL|CVPR|ICCV|ECCV|COLING|AAAI|JMLR|TACL|Interspeech|"
    r"spring|summer|autumn|fall|winter|version|the|v\d+|" + _MONTHS + r")\s*[,]?\s*|et al\.,?\s*|"
    r"[(\[/;,\u2013-]\s*|^\s*(?:[-*+]\s+)?\*{1,2}|\s\*{1,2})$",
    re.I,
)
_YEAR_AFTER = re.compile(
    r"^\s*(?:[)\]/;:\u2013\u2014-]|\*{1,2}\s*[\u2013\u2014:-]|[a-z]?\)|,|\.|'s|\u2019s|"
    r"\s+(?:paper|version|preprint|model|edition|survey|study)|$)",
    re.I,
)


# A folded solution (<details>) holds an exercise's answer and its hand derivation: the answer is checked by the
# exercise's own checker and tests (tests/test_code_exercises.py, tests/test_answers_hidden.py), and it cannot
# appear in an output without giving the answer away, so its numbers are not prose claims of the page.
_FOLDED_SOLUTION = re.compile(r"<details>.*?</details>", re.S | re.I)


def _strip_non_prose(text: str) -> str:
    """Markdown with everything that is not prose (or math) blanked out, line structure kept."""

    def blank(match: re.Match) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    for pattern in (_FOLDED_SOLUTION, _FENCE, _CODE_SPAN, _LINK_TARGET, _REF_DEF, _URL, _HTML_TAG, _LABEL,
                    _ANCHOR_TARGET, _ROLE_NAME, _REFERENCE):
        text = pattern.sub(blank, text)
    return text


def significant_digits(literal: str) -> int:
    """Significant digits of a number as written: '0.468' -> 3, '1,024' -> 4, '4096' -> 4, '1000' -> 1,
    '0.500' -> 3, '2.4e-07' -> 2, '93.3' -> 3."""
    mantissa = re.split(r"[eE]", literal.replace(",", "").replace("_", ""))[0]
    if "." in mantissa:
        digits = mantissa.replace(".", "").lstrip("0")
        return len(digits)
    return len(mantissa.lstrip("0").rstrip("0"))


def _is_year(literal: str, before: str, after: str) -> bool:
    if not re.fullmatch(r"\d{4}", literal) or not 1900 <= int(literal) <= LAST_YEAR:
        return False
    return bool(_YEAR_BEFORE.search(before[-40:]) or _YEAR_AFTER.match(after[:20]))


def prose_numbers(markdown: str) -> list[tuple[str, str]]:
    """(literal, context) for every prose number of ``markdown`` with >= 3 significant digits."""
    text = _strip_non_prose(markdown)
    found = []
    for match in _NUMBER.finditer(text):
        literal = match.group("num")
        before, after = text[: match.start()], text[match.end("num"):]
        if significant_digits(literal) < MIN_SIGNIFICANT or _is_year(literal, before, after):
            continue
        literal += "%" if match.group("pct") else ""
        context = " ".join(markdown[max(0, match.start() - 50): match.end() + 30].split())
        found.append((literal, context))
    return found


# --- what backs a number --------------------------------------------------------------------------------

def to_decimal(literal: str) -> Decimal | None:
    try:
        return abs(Decimal(literal.rstrip("%").strip().replace(",", "").replace("_", "")))
    except (InvalidOperation, ArithmeticError):  # not a number, or a hash's digits read as 21e1933718
        return None


def _places(literal: str) -> int:
    mantissa = re.split(r"[eE]", literal.rstrip("%").replace(",", ""))[0]
    return len(mantissa.split(".")[1]) if "." in mantissa else 0


_BACKING_NUMBER = re.compile(r"(?<![\w.])\d[\d,_]*(?:\.\d+)?(?:[eE][-+]?\d+)?")


def backing_numbers(sources: list[str]) -> set[Decimal]:
    """Every number written in ``sources`` (code, outputs), as an absolute Decimal."""
    values = set()
    for source in sources:
        for literal in _BACKING_NUMBER.findall(source):
            literal = literal.rstrip(",")
            if re.search(r",(?!\d{3}(?!\d))", literal):  # "1,2,3" is a list, not 123: read its parts
                parts = [p for p in re.split(r"[,]", literal) if p]
            else:
                parts = [literal]
            for part in parts:
                value = to_decimal(part)
                if value is not None:
                    values.add(value)
    return values


def is_backed(literal: str, values: set[Decimal]) -> bool:
    """``literal`` (as written in prose) equals a backing number, or a backing number rounds to it."""
    value = to_decimal(literal)
    if value is None:
        return False
    candidates = [value]
    if literal.endswith("%"):
        candidates.append(value / 100)  # "93.3%" may be printed as 0.933
    places = _places(literal)
    for candidate in candidates:
        if candidate in values:
            return True
        scale = places + (2 if candidate is not value else 0)
        quantum = Decimal(1).scaleb(-scale)
        for v in values:
            # a printed value with more digits that rounds to the prose number (either rounding rule)
            if abs(v - candidate) < quantum and any(
                v.quantize(quantum, rounding=r) == candidate for r in (ROUND_HALF_UP, ROUND_HALF_EVEN)
            ):
                return True
    return False


def _output_texts(cell) -> list[str]:
    texts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            texts.append(out.get("text", ""))
        for mime, data in out.get("data", {}).items():
            if mime.split("/")[-1] in ("plain", "html", "markdown", "latex", "json") or mime.startswith("text/"):
                texts.append(data if isinstance(data, str) else str(data))
    return texts


def _bib_keys() -> set[str]:
    return set(re.findall(r"@\w+\s*\{\s*([^,\s]+)\s*,", BIB.read_text()))


def read_allowlist() -> dict[str, dict[str, str]]:
    """{page name: {number as written: citation key}} from the allowlist file."""
    entries: dict[str, dict[str, str]] = {}
    if not ALLOWLIST.exists():
        return entries
    for line in ALLOWLIST.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        page, number, key = line.split()
        entries.setdefault(page, {})[number] = key
    return entries


def page_markdown_and_backing(path: Path) -> tuple[list[tuple[int, str]], list[str]]:
    """[(cell index, markdown)], [code sources and output texts] of a notebook or a .md page."""
    if path.suffix == ".md":
        return [(0, path.read_text())], []
    nb = nbformat.read(path, as_version=4)
    markdown = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"]
    backing = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            backing.append(cell.source)
            backing.extend(_output_texts(cell))
    return markdown, backing


def offenders(path: Path, allowed: dict[str, str]) -> list[str]:
    markdown, backing = page_markdown_and_backing(path)
    values = backing_numbers(backing)
    missing = []
    for index, source in markdown:
        for literal, context in prose_numbers(source):
            if literal in allowed or literal.rstrip("%") in allowed or is_backed(literal, values):
                continue
            missing.append(f"cell {index}: {literal!r} in \u2026{context}\u2026")
    return missing


# --- the tests ------------------------------------------------------------------------------------------

def test_the_allowlist_cites_known_sources_for_known_pages() -> None:
    keys, names = _bib_keys(), {p.name for p in PAGES}
    for page, numbers in read_allowlist().items():
        assert page in names, f"allowlist names {page}, which is not a page of book/"
        for number, key in numbers.items():
            assert key in keys, f"allowlist: {page} {number} cites {key!r}, which references.bib lacks"
            assert to_decimal(number) is not None, f"allowlist: {page} {number!r} is not a number"


@pytest.mark.parametrize("path", PAGES, ids=[p.name for p in PAGES])
def test_prose_numbers_come_from_the_computation(path: Path) -> None:
    found = offenders(path, read_allowlist().get(path.name, {}))
    assert not found, (
        f"{path.name}: {len(found)} prose number(s) with >= {MIN_SIGNIFICANT} significant digits appear in no "
        "output, assert or code cell of the page and are not allowlisted (tests/prose_numbers_allowlist.txt: "
        "page, number, references.bib key):\n  " + "\n  ".join(found)
    )


# --- the rules themselves, on small examples ------------------------------------------------------------

@pytest.mark.parametrize(
    "markdown,expected",
    [
        ("accuracy 0.468 and exact match 0.024", ["0.468"]),
        ("with `0.468` in code and ```\n1234\n``` fenced", []),
        ("```python\nx = 0.46812\n```\nthen 12.5", ["12.5"]),
        ("{cite:t}`vaswani2017` (2017) and in 2014, at ICLR 2015; Luong et al. 2015", []),
        ("- **1964** \u2014 kernels; the 2014 models; **2017**: the Transformer", []),
        ("a length of 2048 tokens and 1,024 keys", ["2048", "1,024"]),
        ("see Section 3.2.1, Figure 12, Table 2.13 and eq. (3.14)", []),
        ("a [link 0.5](https://arxiv.org/abs/1409.0473) and arXiv:1706.03762", []),
        ("$$\nd_k = 512\n$$ (eq-scale)", ["512"]),
        ("93.3% of rows, 100 words, 1000 steps, 0.50", ["93.3%"]),
        ("the {glue:text}`acc` accuracy", []),
        ("<img src=\"fig_1234.png\" width=\"640\"> 2.4e-07", []),
        ("<details>\n<summary>Solution</summary>\n\n3/1.32 = 2.273\n\n</details>\nbut 0.468 here", ["0.468"]),
    ],
)
def test_what_counts_as_a_prose_number(markdown, expected) -> None:
    assert [literal for literal, _ in prose_numbers(markdown)] == expected


@pytest.mark.parametrize(
    "literal,backing,ok",
    [
        ("0.468", "print(0.468)", True),
        ("0.468", "0.4680", True),
        ("0.468", "acc 0.46812", True),
        ("0.468", "acc 0.4686", False),
        ("0.468", "0.469", False),
        ("1,024", "L = 1024", True),
        ("1024", "1,024 keys", True),
        ("93.3%", "93.3", True),
        ("93.3%", "share 0.933", True),
        ("93.3%", "share 0.934", False),
        ("4096", "40960", False),
        ("1.5", "x = -1.5", True),
    ],
)
def test_what_backs_a_prose_number(literal, backing, ok) -> None:
    assert is_backed(literal, backing_numbers([backing])) is ok


def test_an_unbacked_number_is_reported(tmp_path, monkeypatch) -> None:
    """The test can fail: a notebook whose prose carries a number no cell computes is an offender."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("Accuracy is 0.468 and the loss 2.31."),
        nbformat.v4.new_code_cell("acc = 0.46812\nprint(f'{acc:.3f}')", outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="0.468\n")]),
    ]
    path = tmp_path / "99_probe.ipynb"
    nbformat.write(nb, path)
    assert [o.split("'")[1] for o in offenders(path, {})] == ["2.31"]
    assert offenders(path, {"2.31": "vaswani2017"}) == []
