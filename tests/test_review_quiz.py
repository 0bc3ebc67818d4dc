"""The review page (book/quiz.ipynb) is worth taking: enough questions, every chapter, no chapter quiz repeated,
every distractor explained with a source, and no pattern that gives the answer away (position or length)."""

from __future__ import annotations

import difflib
import re
from collections import Counter
from pathlib import Path

import nbformat
import pytest

from attention_core.booktools import exercises

ROOT = Path(__file__).resolve().parent.parent
REVIEW = ROOT / "book" / "quiz.ipynb"
CHAPTERS = sorted((ROOT / "book").glob("[01][0-9]_*.ipynb"))
SOURCE = re.compile(r"\{cite:[pt]\}`[\w,]+`|\b[Cc]hapters? \d+|\b[A-Z][a-z]+ et al\.,? \d{4}|documentation|`torch\.")


def _quizzes(path: Path) -> list[dict]:
    """Every quiz a notebook builds, read by running its quiz cells with a recording stand-in for ``quiz``."""
    found: list[dict] = []

    def record(question, options, answer_index, explanation="", hint=""):
        q = exercises.quiz(question, options, answer_index, explanation=explanation, hint=hint)
        found.append({"question": question, "options": list(options), "answer": q.answer_index,
                      "explanation": q.explanation, "hint": hint})
        return q

    class Stand:
        quiz = staticmethod(record)

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and "exercises.quiz(" in cell.source:
            exec(cell.source, {"exercises": Stand, "QUIZZES": []})  # noqa: S102 - the book's own cells
    return found


def _review_sections() -> list[tuple[str, str]]:
    """(heading cell, explanation cell) of each question on the review page, in order."""
    cells = nbformat.read(REVIEW, as_version=4).cells
    out = []
    for i, cell in enumerate(cells):
        if cell.cell_type == "code" and "exercises.quiz(" in cell.source:
            out.append((cells[i - 1].source, cells[i + 1].source))
    return out


REVIEW_QUIZZES = _quizzes(REVIEW)


def test_enough_questions_and_every_chapter_covered() -> None:
    assert len(REVIEW_QUIZZES) >= 15, f"only {len(REVIEW_QUIZZES)} questions"
    sections = _review_sections()
    assert len(sections) == len(REVIEW_QUIZZES)
    per_chapter = Counter(int(n) for heading, _ in sections
                          for n in re.findall(r"\d+", heading.split("Covered in")[-1]))
    covered = set(per_chapter)
    assert set(range(1, 16)) <= covered, f"chapters without a question: {sorted(set(range(1, 16)) - covered)}"
    for chapter in (12, 13, 14, 15, 16, 17, 18):  # the later chapters get at least two questions each
        assert per_chapter[chapter] >= 2, f"chapter {chapter} has {per_chapter[chapter]} question(s) on the review page"


def test_correct_positions_are_spread_evenly() -> None:
    n_options = {len(q["options"]) for q in REVIEW_QUIZZES}
    assert n_options == {4}, f"every question has four options, got {n_options}"
    counts = Counter(q["answer"] for q in REVIEW_QUIZZES)
    even = len(REVIEW_QUIZZES) / 4
    for slot in range(4):
        assert abs(counts[slot] - even) <= 1, f"slot {slot} holds the answer {counts[slot]} times (even: {even:.1f})"


def test_the_answer_is_not_given_away_by_its_length() -> None:
    n = len(REVIEW_QUIZZES)
    longest = sum(len(q["options"][q["answer"]]) >= max(map(len, q["options"])) for q in REVIEW_QUIZZES)
    shortest = sum(len(q["options"][q["answer"]]) <= min(map(len, q["options"])) for q in REVIEW_QUIZZES)
    assert longest <= n / 4, f"the answer is the longest option in {longest} of {n} questions"
    assert shortest <= n / 4, f"the answer is the shortest option in {shortest} of {n} questions"
    ratios = [len(q["options"][q["answer"]]) / (sum(map(len, q["options"])) / 4) for q in REVIEW_QUIZZES]
    assert 0.9 <= sum(ratios) / n <= 1.1, f"answers are {sum(ratios) / n:.2f} times the mean option length"
    for q in REVIEW_QUIZZES:  # no option dwarfs the others
        lengths = list(map(len, q["options"]))
        assert max(lengths) <= 2 * min(lengths), f"unbalanced options: {q['question'][:50]!r} {lengths}"


def test_every_distractor_is_explained_with_its_source() -> None:
    for (heading, details), q in zip(_review_sections(), REVIEW_QUIZZES):
        assert details.startswith("<details>") and details.rstrip().endswith("</details>"), (
            f"{heading.splitlines()[0]}: the explanation is not folded")
        bullets = [line for line in details.splitlines() if line.startswith("- ")]
        assert len(bullets) == len(q["options"]) - 1, f"{heading.splitlines()[0]}: one bullet per wrong option"
        for bullet in bullets:
            assert SOURCE.search(bullet), (
                f"{heading.splitlines()[0]}: a distractor without a source: {bullet[:60]!r}")
        assert SOURCE.search(details.split("\n- ")[0]), f"{heading.splitlines()[0]}: the answer names no source"
        assert q["explanation"] and q["hint"], f"{heading.splitlines()[0]}: no explanation or hint"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[p.name for p in CHAPTERS])
def test_no_question_repeats_a_chapter_quiz(chapter: Path) -> None:
    for mine in _quizzes(chapter):
        for review in REVIEW_QUIZZES:
            same_q = difflib.SequenceMatcher(None, mine["question"].lower(), review["question"].lower()).ratio()
            right = difflib.SequenceMatcher(None, mine["options"][mine["answer"]].lower(),
                                            review["options"][review["answer"]].lower()).ratio()
            assert same_q < 0.6 and not (same_q > 0.4 and right > 0.6), (
                f"the review question {review['question'][:60]!r} is close to {chapter.name}'s quiz")


def test_the_checks_can_fail() -> None:
    """The balance checks catch the review page's old fault: the answer the longest option, never the last."""
    skewed = [dict(q, options=[o if i != q["answer"] else o + " (and more words to make it long)"
                               for i, o in enumerate(q["options"])]) for q in REVIEW_QUIZZES]
    n = len(skewed)
    assert sum(len(q["options"][q["answer"]]) >= max(map(len, q["options"])) for q in skewed) > n / 4
    counts = Counter(min(q["answer"], 2) for q in REVIEW_QUIZZES)  # the last slot never used
    assert any(abs(counts[s] - n / 4) > 1 for s in range(4))


def test_the_rotation_question_gives_the_measured_mechanism() -> None:
    """Chapter 18's fixed-scale control refutes "no single entry sets the tensor's scale" as the reason the Hadamard
    rotation lowers the FP8 error: the hidden explanation must give the measured one (where the error lands)."""
    rotation = [q for q in REVIEW_QUIZZES if "Hadamard" in q["question"]]
    assert len(rotation) == 1
    text = rotation[0]["explanation"]
    assert "sets the tensor's scale" not in text, text
    assert "fixed scale" in text and "one product" in text and "relative" in text, text
