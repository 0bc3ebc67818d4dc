"""Every quiz of the book (the chapters' and the review page's) is answered by knowing, not by its layout.

Read from the notebooks themselves (each quiz cell run with a recording stand-in, as in test_review_quiz.py):

- the right option's position is spread evenly over the four slots, across the whole book and on the review page;
- the positions follow no sequence pattern (no cycle A, B, C, D, no run of one slot, no fixed period);
- the right option is not given away by its length (never far longer or far shorter than the others, and the
  longest in at most a quarter of the quizzes) nor by being the only hedged option;
- nothing the reader sees before answering gives the answer: the question and the hint do not contain the right
  option's distinctive words, and the chapter's text after the quiz (its summary) does not state the answer in the
  words that the quiz's explanation uses to justify it (the tells below, read from each quiz by hand).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import nbformat
import pytest
from test_review_quiz import CHAPTERS, REVIEW, _quizzes

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*CHAPTERS, REVIEW]
BY_PAGE = {path.name: _quizzes(path) for path in PAGES}
ALL = [q for page in BY_PAGE.values() for q in page]
#: words that soften a claim; an option that alone carries one is the careful, hence right-looking, one
HEDGE = re.compile(r"\b(may|might|can|could|usually|often|generally|typically|likely|perhaps|possibly|probably|"
                   r"mostly|tends?|alone|by itself|not necessarily|depends)\b", re.I)

#: chapter -> phrases that, visible next to its quiz (stem, hint, summary), would state its answer. Each is the
#: point the quiz's explanation makes, in the words the chapter uses for it.
TELLS = {
    "07": [r"rotat\w* (each pair of )?quer", r"add a (fixed|trained) table"],
    "11": [r"only the new token"],
    "12": [r"positive features where it is large", r"trigonometric features where the kernel is small"],
    "13": [r"so the task does not need", r"very different weights with the same outputs"],
    "14": [r"same function as a convolution", r"convolution with kernel and stride"],
    "15": [r"output follows the target exactly", r"follows the target exactly"],
}


def _positions(quizzes: list[dict]) -> list[int]:
    return [q["answer"] for q in quizzes]


def _balanced(positions: list[int], slack: float) -> bool:
    counts = Counter(positions)
    even = len(positions) / 4
    return all(abs(counts[s] - even) <= slack for s in range(4))


def _patterned(positions: list[int]) -> str | None:
    """Why a sequence of positions reads as a pattern, or None."""
    for i in range(len(positions) - 3):  # four in a cycle, forwards or backwards
        steps = {(positions[j + 1] - positions[j]) % 4 for j in range(i, i + 3)}
        if steps in ({1}, {3}):
            return f"a cycle at {i}: {positions[i:i + 4]}"
    for i in range(len(positions) - 2):
        if positions[i] == positions[i + 1] == positions[i + 2]:
            return f"a run at {i}: {positions[i:i + 3]}"
    for period in (2, 3, 4, 5):  # a repeating block over the whole sequence
        if len(positions) >= 2 * period and all(positions[i] == positions[i % period] for i in range(len(positions))):
            return f"period {period}"
    return None


def _repeats(positions: list[int], spans: dict[int, int]) -> str | None:
    """A stretch that repeats a block of period p <= 4 (not all one slot: runs are found above) over spans[p]
    positions, e.g. A, C, A, C (period 2 over 4) or A, B, D, A, B, D (period 3 over 6); or None."""
    for period, span in spans.items():
        for i in range(len(positions) - span + 1):
            window = positions[i:i + span]
            if len(set(window[:period])) > 1 and all(window[j] == window[j % period] for j in range(span)):
                return f"period {period} at {i}: {window}"
    return None


#: how long a repeated block may not go on: on the review page twice for periods 2 to 4; across the chapters'
#: quizzes (one per chapter, in book order) two and a half times for periods 2 and 3, twice for 4
REVIEW_SPANS = {2: 4, 3: 6, 4: 8}
CHAPTER_SPANS = {2: 5, 3: 7, 4: 8}


def _review_faults(quizzes: list[dict]) -> list[str]:
    """Every cue a sequence of quizzes gives besides knowing: an uneven spread of the right option's slot (more
    than 1 from even), a sequence pattern (a cycle, a run, a repeated block of period <= 4), the right option
    strictly the longest in more than a quarter of the questions, the right option at one length rank (shortest,
    second, third, longest) in more than 40% of them, or the only hedged option; and, for the positions, most
    aligned blocks of four (questions 1-4, 5-8, ...) each a permutation of the four slots, which lets a reader
    infer the fourth answer of a block from the first three."""
    faults = []
    positions = _positions(quizzes)
    if not _balanced(positions, slack=1):
        faults.append(f"uneven slots {sorted(Counter(positions).items())}")
    for why in (_patterned(positions), _repeats(positions, REVIEW_SPANS)):  # both, so neither hides the other
        if why:
            faults.append(f"pattern: {why}")
    blocks = [positions[i:i + 4] for i in range(0, len(positions) - 3, 4)]
    if sum(len(set(b)) == 4 for b in blocks) > len(blocks) / 2:  # by chance 24/256 of blocks are one of each slot
        faults.append(f"pattern: most aligned blocks of four are permutations {blocks}")
    ranks = Counter(sum(len(o) < len(q["options"][q["answer"]]) for o in q["options"]) for q in quizzes)
    if max(ranks.values()) > 0.4 * len(quizzes):  # e.g. "pick the second-longest" must not pay
        faults.append(f"the right option's length rank (options shorter than it) is lopsided {sorted(ranks.items())}")
    longest = sum(len(q["options"][q["answer"]]) > max(len(o) for i, o in enumerate(q["options"]) if i != q["answer"])
                  for q in quizzes)
    if longest > len(quizzes) / 4:
        faults.append(f"the right option strictly the longest in {longest} of {len(quizzes)}")
    for q in quizzes:
        hedged = [bool(HEDGE.search(o)) for o in q["options"]]
        if hedged[q["answer"]] and sum(hedged) == 1:
            faults.append(f"only the right option is hedged: {q['question'][:40]!r}")
    return faults


def _moved(q: dict, slot: int) -> dict:
    """The same question with its right option moved to ``slot`` (swapped with the option there)."""
    options = list(q["options"])
    options[q["answer"]], options[slot] = options[slot], options[q["answer"]]
    return dict(q, options=options, answer=slot)


def test_the_review_page_gives_no_cue() -> None:
    review = BY_PAGE[REVIEW.name]
    assert _review_faults(review) == [], _review_faults(review)


def test_the_review_checks_catch_each_cue_on_the_page_itself() -> None:
    """Mutants of the review page's own questions, one cue each; the check names that cue."""
    review = BY_PAGE[REVIEW.name]
    n = len(review)

    def faults_of(slots: list[int]) -> list[str]:
        return _review_faults([_moved(q, s) for q, s in zip(review, slots)])

    assert any("pattern: a cycle" in f for f in faults_of([i % 4 for i in range(n)]))  # A, B, C, D, A, ...
    assert any("pattern: a cycle" in f for f in faults_of([(3 - i) % 4 for i in range(n)]))  # D, C, B, A, ...
    assert any("pattern: a run" in f for f in faults_of(sorted(i % 4 for i in range(n))))  # blocks of one slot
    assert any("uneven" in f for f in faults_of([(0, 1, 2)[i % 3] for i in range(n)]))  # D never used
    slots = _positions(review)
    assert any("period 3" in f for f in faults_of([0, 2, 3, 0, 2, 3] + slots[6:]))  # A, C, D twice
    i = next(i for i in range(n - 3) if slots[i] != slots[i + 1])  # A, C, A, C inside the page's own order
    assert any("period 2" in f for f in faults_of(slots[:i + 2] + slots[i:i + 2] + slots[i + 4:]))
    twice = slots[:4] * 2 + slots[12:]  # the page's first four slots twice, then its thirteenth on: period 4
    assert any("period 4" in f for f in faults_of(twice)), faults_of(twice)
    perm = [b for k in range(n // 4) for b in ((0, 2, 1, 3), (3, 1, 0, 2), (1, 3, 2, 0))[k % 3]] + slots[n // 4 * 4:]
    assert any("aligned blocks of four are permutations" in f for f in faults_of(perm)), faults_of(perm)
    pad = " and all that it implies"  # the right option padded, the next one padded further: second-longest
    second = [dict(q, options=[o + pad * (j == q["answer"]) + " x" * 40 * (j == (q["answer"] + 1) % 4)
                               for j, o in enumerate(q["options"])]) for q in review]
    assert any("length rank" in f for f in _review_faults(second)), _review_faults(second)
    long_ = [dict(q, options=[o + " and all that it implies" if j == q["answer"] else o
                              for j, o in enumerate(q["options"])]) for q in review]
    assert any("strictly the longest" in f for f in _review_faults(long_))
    hedged = [dict(q, options=[("usually " + o if j == q["answer"] else HEDGE.sub("", o))
                               for j, o in enumerate(q["options"])]) for q in review[:1]] + review[1:]
    assert any("only the right option is hedged" in f for f in _review_faults(hedged))


def test_every_quiz_has_four_options() -> None:
    assert len(ALL) >= 40, len(ALL)
    assert {len(q["options"]) for q in ALL} == {4}


def test_right_positions_spread_evenly_over_the_book_and_the_review_page() -> None:
    book = _positions(ALL)
    assert _balanced(book, slack=1), f"book: {sorted(Counter(book).items())} over {len(book)} quizzes"
    review = _positions(BY_PAGE[REVIEW.name])
    assert _balanced(review, slack=1), f"review page: {sorted(Counter(review).items())}"
    chapters = [q["answer"] for path in CHAPTERS for q in BY_PAGE[path.name]]
    assert _balanced(chapters, slack=1.25), f"chapter quizzes: {sorted(Counter(chapters).items())}"


def test_right_positions_follow_no_pattern() -> None:
    for name, seq in (("chapters", [q["answer"] for p in CHAPTERS for q in BY_PAGE[p.name]]),
                      ("review page", _positions(BY_PAGE[REVIEW.name]))):
        why = _patterned(seq) or _repeats(seq, CHAPTER_SPANS)
        assert why is None, f"{name}: the right positions {seq} show {why}"


def test_no_length_cue() -> None:
    longest = 0
    for q in ALL:
        right = len(q["options"][q["answer"]])
        others = [len(o) for i, o in enumerate(q["options"]) if i != q["answer"]]
        assert right <= 1.3 * max(others), f"the right option is by far the longest: {q['question'][:60]!r}"
        assert right >= 0.7 * min(others), f"the right option is by far the shortest: {q['question'][:60]!r}"
        longest += right > max(others)
    assert longest <= len(ALL) / 4, f"the right option is the longest in {longest} of {len(ALL)} quizzes"


def test_no_hedge_cue() -> None:
    for q in ALL:
        hedged = [bool(HEDGE.search(o)) for o in q["options"]]
        assert not (hedged[q["answer"]] and sum(hedged) == 1), (
            f"only the right option is hedged: {q['question'][:60]!r}")


def _after_quiz_text(path: Path) -> str:
    """The markdown after a chapter's quiz (its summary): what a reader sees before or while answering."""
    cells = nbformat.read(path, as_version=4).cells
    at = max(i for i, c in enumerate(cells) if c.cell_type == "code" and "exercises.quiz(" in c.source)
    text = "\n".join(c.source for c in cells[at + 1:] if c.cell_type == "markdown")
    return re.sub(r"<details>.*?</details>", "", text, flags=re.S)  # folded text is not seen


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.name for p in CHAPTERS])
def test_no_answer_in_the_stem_hint_or_summary(path: Path) -> None:
    (q,) = BY_PAGE[path.name]
    visible = " ".join([q["question"], q["hint"], _after_quiz_text(path)])
    for tell in TELLS.get(path.name[:2], []):
        found = re.search(tell, visible, flags=re.I)
        assert not found, f"{path.name}: {found.group(0)!r} is visible next to the quiz and gives its answer"
    right = set(re.findall(r"[a-z]{5,}", q["options"][q["answer"]].lower()))
    stem = set(re.findall(r"[a-z]{5,}", (q["question"] + " " + q["hint"]).lower()))
    wrong = set().union(*(re.findall(r"[a-z]{5,}", o.lower()) for i, o in enumerate(q["options"]) if i != q["answer"]))
    given = (right & stem) - wrong  # words only the right option shares with the question or hint
    assert len(given) < 2, f"{path.name}: the question or hint repeats the right option's words {sorted(given)}"


def test_the_checks_can_fail() -> None:
    """Each check catches the fault it is for: the old positions, a cycle, a long answer, a lone hedge, a tell."""
    assert not _balanced([1] * 12 + [2] * 3, slack=1.25)  # the chapters' old positions
    assert _patterned([0, 1, 2, 3, 0, 1, 2, 3, 0]) and _patterned([2, 1, 1, 1, 0]) and _patterned([0, 2] * 4)
    assert _patterned([3, 0, 1, 2, 1]) and _patterned([2, 1, 0, 3, 3])  # a cycle inside, forwards and backwards
    assert _patterned([2, 0, 3, 1, 1, 3, 0, 2]) is None
    assert HEDGE.search("Little by itself: the weight scales the value, which may be small")
    assert HEDGE.search("Little alone: it scales the value") and HEDGE.search("it depends on the values")
    old_07 = "RoPE rotates each pair of query and key features by position times frequency"
    assert any(re.search(t, old_07, flags=re.I) for t in TELLS["07"])
    old_14 = "its patch embedding is one linear layer, the same function as a convolution with kernel and stride $p$."
    assert any(re.search(t, old_14, flags=re.I) for t in TELLS["14"])
