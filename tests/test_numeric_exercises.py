"""Every numeric exercise of the chapters accepts its answer and rejects the mistakes a reader plausibly makes.

The chapters carry only the check (``exercises.check_value(label, "ac1:...", rtol=..., atol=...)``) and a folded
worked solution that asserts, silently, that the check accepts it. The wrong answers live here: each notebook is
parsed, each ``check_value`` call read with ``ast`` (label, encoded answer, tolerances), the checker rebuilt, and
fed the decoded answer (accepted) and every mistake listed below (rejected). Mistakes that depend on a chapter's
state (a trained model, a fitted bandwidth) are written as the numbers the chapter computes.
"""

from __future__ import annotations

import ast
import html
import math
import re
from pathlib import Path

import nbformat
import pytest

from attention_core.booktools import exercises

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "book").glob("[01][0-9]_*.ipynb"))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _softmax0(scores: list[float]) -> float:
    return math.exp(scores[0]) / sum(math.exp(s) for s in scores)


# (chapter number, label) -> plausible wrong answers; the first of each is the one the chapter's proof used.
MISTAKES: dict[tuple[str, str], list[float]] = {
    ("01", "f(0.9) ="): [(1 + 3 + 2) / 3, 3.0, (3 + 2 + 5) / 3, 2.0],  # key 0 in; mean of all; h = 0.6; nearest
    ("01", "f(0.9) =#2"): [2.5, 2.0, 3.0, 1.0],  # boxcar's answer; nearest key; mean of all; weights 1-u (not 1-u^2)
    ("01", "scale s ="): [1 / 0.5, 0.5**2, 2 / 0.5**2, 1 / (2 * 0.5**2)],  # 1/h; h^2; 2/h^2; 1/(2h^2)
    ("01", "learned h ="): [0.210, 2.0, 0.49 * 5**0.5],  # the Gaussian's h; the start, untrained; sd scaled wrong way
    # sigma^4 forgotten; sigma^2; no sqrt
    ("02", "scale s ="): [1 / math.sqrt(16), 1 / math.sqrt(16 * 2**2), 1 / (16 * 2**2 * 2**2)],
    ("02", "weight of key 0 ="): [_softmax0([2, 1, 0, 5, 3]), _softmax0([2, 1, 0, 5]), 1 / 3, _softmax0([2, 1])],
    # no w_v; bias; W_k n' x n
    ("02", "parameters ="): [1000 * 1000 + 1000 * 2000, 3_002_000, 1000 * 1000 + 1000 * 1000 + 1000],
    ("02", "non-zero weights ="): [9, 25, 50, 30, 10],  # query rows masked too; no mask; both sequences; 2 keys per row
    # no v_a; v_a of size d_q; W d_q x d_k; v_a twice
    ("03", "parameters ="): [32 * 16 + 48 * 16, 32 * 16 + 48 * 16 + 32, 32 * 48 + 16, 1312],
    # unmasked; 0 instead of -inf
    ("03", "alpha_1 ="): [_softmax0([2, 0, 5]), 0.5, 1 - _softmax0([2, 0]), _softmax0([2, 0, 0])],
    # exact match; the complement; everything; over all sentences
    ("03", "fraction ="): [2 / 84, 23 / 84, 1.0, 61 / 2000],
    ("04", "parameters ="): [24 * 80, 24 * 80 + 24 + 1, 24 * 48 + 24, 24 * 32 + 24],  # no v_a; a bias on v_a; one input
    ("04", "factor ="): [math.exp(-2), math.exp(-1), 1.0, math.exp(-1 / 8)],  # sigma = D/4; sigma = D; no factor; d=1
    ("04", "D ="): [(27 - 1) - 11 - 1, 16, 11, 27],  # off by one either side; the step; the length
    ("05", "weight of baseball on itself"): [_sigmoid(2 / 3**0.5), 0.5, 1 - _sigmoid(2), _sigmoid(4)],
    ("05", "pairs that take part, L = 6"): [36, 15, 6, 30],  # no mask; diagonal out; diagonal only; upper + diagonal
    ("06", "parameters of MultiHeadAttention(512, 8, num_kv_heads=2)"):
        [4 * (512 * 512 + 512), 2 * 512 * 512 + 2 * 512 * 128, 2 * (512 * 512 + 512) + 2 * (512 * 64 + 64),
         2 * (512 * 512 + 512) + 2 * (512 * 256 + 256)],  # MHA; biases forgotten; one kv head; H_kv E = 256
    ("06", "KiB per token, 4 kv heads"): [40.0, 320.0, 80.0, 160 * 8 / 4],  # one kv head; float32; K or V only; 8 heads
    ("07", "PE[10, 3]"): [math.sin(10 * 10000 ** (-2 / 32)), math.cos(10 * 10000 ** (-3 / 32)), math.cos(10),
                          math.cos(10 * 10000 ** (-1 / 32))],  # sine; i = 3/2; i = 0; exponent 2i/d halved
    ("07", "wavelength (positions)"): [2 * math.pi * 10000, 10000 ** (510 / 512), math.pi * 10000 ** (510 / 512),
                                       2 * math.pi * 10000 ** (508 / 512)],  # 10000; no 2 pi; pi; i - 1
    # no norms; one attention; FFN only
    ("08", "parameters of one decoder layer"): [12_704, 16_992 - 192, 16_992 - 4 * (32**2 + 32),
                                                 2 * 32 * 128 + 128 + 32],
    ("08", "positions processed without a cache"): [10, 45, 100, 11],  # one per step; range(10); L^2; L + 1
    ("09", "KV cache (GiB) ="): [6.25, 2.5, 0.625, 1.25 * 2**30 / 1e9],  # query heads; float32; K only; GB, not GiB
    ("09", "tiles ="): [16 * 15 // 2, 256, 16, 16 * 17],  # diagonal forgotten; all tiles; diagonal only; double count
    # different maxima; sign; l2 lost; factor 3 lost
    ("09", "l ="): [3 + 1, 3 * math.exp(3) + 1, 3 * math.exp(-3), 1 + math.exp(-3)],
    # the rest; BERT-base width; +positions; all
    ("10", "parameters of the word embeddings"): [22_713_216 - 11_720_448, 30522 * 768,
                                                   11_720_448 + 512 * 384, 22_713_216],
    # uniform; bits; sign; a term lost
    ("10", "entropy (nats)"): [math.log(3), 1.5, -1.0397207708399179, 0.5 * math.log(2) + 0.25 * math.log(4)],
    # d_r lost; K or V only; d_r = E; multiplied
    # K or V only (E + 1); (E + 1)/2 rounded down; times the 32 layers; divided by them
    ("12", "tokens at which the cache equals the state"): [129.0, 64.0, 64.5 * 32, 64.5 / 32],
    # the band alone; not causal; dense causal; stride 65; 2 sqrt(L) per row
    ("12", "pairs of the strided pattern, L = 4096, stride 64"): [260128, 774208, 4096 * 4097 / 2, 391168, 4096 * 128],
    ("11", "MHA cache / MLA cache, 32 heads"): [2 * 32 / 4, 32 / 4.5, 2 * 32 / 5, 2 * 32 * 4.5],
    # bits; KL(p||q) = ln 4; the two KLs not halved; the ceiling ln 2
    ("13", "JSD (nats)"): [0.5490, math.log(4), 0.7610, math.log(2)],
    # no class token; per side; pixels per patch; a patch of 14 pixels
    ("14", "tokens of a 224 x 224 image"): [196, 14, 256, (224 // 14) ** 2 + 1],
    # every draft kept; gamma * alpha; one power short; only the last draft counted
    ("15", "tokens per step"): [5.0, 4 * 0.8, (1 - 0.8**4) / (1 - 0.8), 1 + 4 * 0.8**4],
    # P steps instead of P - 1; keys only; the whole sequence's block; float32; forward and backward
    ("16", "MiB per device"): [128.0, 56.0, 896.0, 224.0, 112.0 * 2 + 128.0],
    # one below (64 * 31^2 = 61504 fits); one above; the scaled score 8 c^2 > 65504; c^2 > 65504 without E;
    # the root sqrt(65520 / 128) = 22.62 not taken to the next integer (typed as it is, or rounded up or down)
    # 12 entries instead of 4; keys only; float32; the window forgotten; the local entries left out
    ("17", "KV bytes per token"): [7296.0, 1216.0, 4864.0, 8192.0, 2048.0],
    ("18", "smallest c"): [31.0, 33.0, 91.0, 256.0, 22.6, "22.63", 23.4],
}


def _numeric_exercises() -> list[tuple[str, str, str, dict]]:
    """(chapter number, key into MISTAKES, encoded answer, tolerances) of every check_value call in the chapters."""
    found = []
    for path in CHAPTERS:
        seen: dict[str, int] = {}
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code" or "check_value(" not in cell.source:
                continue
            for node in ast.walk(ast.parse(cell.source)):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "check_value":
                    label, encoded = (ast.literal_eval(a) for a in node.args[:2])
                    tol = {k.arg: ast.literal_eval(k.value) for k in node.keywords
                           if k.arg in ("rtol", "atol", "digits", "decimals", "exact")}
                    seen[label] = seen.get(label, 0) + 1
                    key = label if seen[label] == 1 else f"{label}#{seen[label]}"
                    found.append((path.name[:2], key, encoded, tol))
    return found


EXERCISES = _numeric_exercises()


def test_every_exercise_has_its_mistakes() -> None:
    keys = {(ch, key) for ch, key, _, _ in EXERCISES}
    assert len(EXERCISES) >= 28, f"only {len(EXERCISES)} numeric exercises found"
    assert keys == set(MISTAKES), f"exercises without mistakes: {keys - set(MISTAKES)}; stale: {set(MISTAKES) - keys}"


@pytest.mark.parametrize(("chapter", "key", "encoded", "tol"), EXERCISES, ids=[f"{c}-{k}" for c, k, _, _ in EXERCISES])
def test_numeric_exercise_accepts_its_answer_and_rejects_mistakes(chapter, key, encoded, tol) -> None:
    ex = exercises.ValueCheck(key.split("#")[0], encoded, **tol)
    answer = exercises.decode_answer(encoded)
    assert ex.accepts(answer) and ex.accepts(repr(answer)), f"ch. {chapter} {key!r}: its own answer is rejected"
    wrong = MISTAKES[(chapter, key)]
    assert len(wrong) >= 2
    for value in wrong:
        assert not ex.accepts(value), f"ch. {chapter} {key!r}: the mistake {value!r} is accepted (answer {answer!r})"


# ------------------------------------------------------------------- the formats and precision a chapter writes
# (chapter, label) -> answers as a reader writes them after reading the chapter or the box's stated precision:
# each must be accepted. The chapters write large numbers with thousands separators ("389,152"), and a box that
# states its precision accepts the value rounded to it ("14", "0.4", "3.4" were refused).
WRITTEN_AS: dict[tuple[str, str], list[str]] = {
    ("01", "f(0.9) =#2"): ["2.273", "3/1.32", "2.2727", "2.27273"],  # the solution writes 3/1.32 ≈ 2.273
    ("01", "learned h ="): ["0.49", "0.490"],
    ("01", "scale s ="): ["4", "1/0.25", "4.0"],
    ("02", "scale s ="): ["0.0625", "1/16"],
    ("02", "weight of key 0 ="): ["0.665", "0.6652"],
    ("02", "parameters ="): ["3001000", "3,001,000"],
    ("03", "alpha_1 ="): ["0.881", "0.8808"],
    ("03", "fraction ="): ["0.73", "61/84"],
    ("04", "factor ="): ["0.607", "0.6065"],
    ("04", "parameters ="): ["1944", "1,944"],
    ("05", "weight of baseball on itself"): ["0.881"],
    ("06", "parameters of MultiHeadAttention(512, 8, num_kv_heads=2)"): ["656,640", "656640"],
    ("06", "KiB per token, 4 kv heads"): ["160", "163840/1024"],
    ("07", "PE[10, 3]"): ["0.7901"],
    ("07", "wavelength (positions)"): ["60,600", "60611", "60611.48"],
    ("08", "parameters of one decoder layer"): ["16,992", "16992"],
    ("09", "KV cache (GiB) ="): ["1.25", "5/4"],
    ("09", "l ="): ["1.149", "1.1494"],
    ("10", "parameters of the word embeddings"): ["11,720,448", "11720448"],
    ("10", "entropy (nats)"): ["1.040", "1.04", "1.0397"],
    ("11", "MHA cache / MLA cache, 32 heads"): ["14", "14.2", "14.22", "128/9"],
    ("12", "pairs of the strided pattern, L = 4096, stride 64"): ["389,152", "389152", " 389,152.0 "],
    ("13", "JSD (nats)"): ["0.38", "0.380", "0.3804"],
    ("15", "tokens per step"): ["3.4", "3.36", "3.3616"],
    ("12", "tokens at which the cache equals the state"): ["64.5", "129/2"],
    ("17", "KV bytes per token"): ["2432", "2,432", "2432.0"],
}
#: (chapter, label) -> answers within the old relative tolerance that the stated precision refuses
REFUSED_NOW: dict[tuple[str, str], list[str]] = {
    ("01", "learned h ="): ["0.47", "0.51", "0.5"],  # rtol=0.05 took 0.47-0.51; two significant figures: 0.49
    ("01", "f(0.9) =#2"): ["2.27", "2.28"],  # three decimals asked: 2.273
    ("02", "scale s ="): ["0.063", "0.062"],  # 1/16 exactly
    ("06", "KiB per token, 4 kv heads"): ["160.1", "159.9"],  # a whole number of KiB
    ("12", "tokens at which the cache equals the state"): ["64.6", "64.4", "65"],  # 129/2 exactly
    ("13", "JSD (nats)"): ["0.3", "0.5", "0.4", "0.37", "0.39"],  # to 2 decimal places: 0.38
}


@pytest.mark.parametrize(("chapter", "key"), list(WRITTEN_AS), ids=[f"{c}-{k}" for c, k in WRITTEN_AS])
def test_a_box_accepts_the_formats_the_chapter_writes(chapter, key) -> None:
    (encoded, tol), = [(e, t) for c, k, e, t in EXERCISES if (c, k) == (chapter, key)]
    ex = exercises.ValueCheck(key, encoded, **tol)
    for text in WRITTEN_AS[(chapter, key)]:
        assert ex.accepts(text), f"ch. {chapter} {key!r}: {text!r} is refused"
        assert ex.evaluate(text).startswith(exercises.CORRECT), ex.evaluate(text)


@pytest.mark.parametrize(("chapter", "key"), list(REFUSED_NOW), ids=[f"{c}-{k}" for c, k in REFUSED_NOW])
def test_a_box_refuses_what_is_coarser_than_its_stated_precision(chapter, key) -> None:
    (encoded, tol), = [(e, t) for c, k, e, t in EXERCISES if (c, k) == (chapter, key)]
    ex = exercises.ValueCheck(key.split("#")[0], encoded, **tol)
    for text in REFUSED_NOW[(chapter, key)]:
        assert not ex.accepts(text), f"ch. {chapter} {key!r}: {text!r} is accepted ({ex.name})"


@pytest.mark.parametrize(("chapter", "key", "encoded", "tol"), EXERCISES, ids=[f"{e[0]}-{e[1]}" for e in EXERCISES])
def test_every_box_states_the_precision_it_checks(chapter, key, encoded, tol) -> None:
    """Every number box of the book says what it checks: significant figures, decimal places, or an exact value
    (a count, a whole number); none checks a relative tolerance that its label does not state."""
    assert set(tol) & {"digits", "decimals", "exact"} and not set(tol) & {"rtol", "atol"}, \
        f"ch. {chapter} {key!r}: no precision stated ({tol})"
    ex = exercises.ValueCheck(key.split("#")[0], encoded, **tol)
    said = re.search(r"\((to \d+ (significant figures?|decimal places?)|exact)\)( =)?$", ex.name)
    assert said, ex.name
    said = said[0]
    assert html.escape(said) in ex.static_html()  # the site's box says it too
    twin = re.search(r"<= ([0-9.e+-]+) \+ ([0-9.e+-]+) \* Math.abs\(e\)", ex.static_html())
    assert twin and (float(twin[1]), float(twin[2])) == (ex.atol, ex.rtol)  # and checks with the same tolerance


#: A student's honest tries in chapters 2, 5, 9 and 13, as typed: each box refuses a value rounded coarser than it
#: states, a value off by a factor, and one in the wrong unit (or of the wrong quantity), and accepts the answer
#: written in the forms a student writes it.
STUDENT_TRIES: dict[tuple[str, str], dict[str, list[str]]] = {
    ("02", "scale s ="): {"right": ["0.0625", "1/16", "6.25e-2"], "rounded": ["0.06", "0.063"],
                          "factor": ["0.25", "1/256"], "unit": ["16", "256"]},  # 1/sqrt(d_k); a variance; sd of q.k
    ("02", "weight of key 0 ="): {"right": ["0.665", "0.6652"], "rounded": ["0.67", "0.7"],
                                  "factor": ["7.389", "0.0405"], "unit": ["66.5"]},  # e^2 alone; unmasked; percent
    ("02", "parameters ="): {"right": ["3001000", "3,001,000", "3.001e6"], "rounded": ["3000000", "3e6"],
                             "factor": ["6002000", "2001000"], "unit": ["3.001", "3001"]},  # millions; thousands
    ("02", "non-zero weights ="): {"right": ["15", "15.0"], "rounded": ["14.9"], "factor": ["30", "9"],
                                   "unit": ["0.6", "60"]},  # both sequences; rows masked too; a fraction; percent
    ("05", "weight of baseball on itself"): {"right": ["0.881", "0.8808"], "rounded": ["0.88", "0.9"],
                                             "factor": ["0.982", "0.7602"], "unit": ["88.1"]},  # gap doubled; scaled
    ("05", "pairs that take part, L = 6"): {"right": ["21", "21.0"], "rounded": ["20"], "factor": ["42", "36"],
                                            "unit": ["0.583", "7/12"]},  # counted twice; no mask; a fraction
    ("09", "KV cache (GiB) ="): {"right": ["1.25", "5/4"], "rounded": ["1.3", "1.2", "1"], "factor": ["6.25", "2.5"],
                                 "unit": ["1.342", "1280", "1342177280"]},  # query heads; float32; GB; MiB; bytes
    ("09", "tiles ="): {"right": ["136"], "rounded": ["140"], "factor": ["256", "272", "120"],
                        "unit": ["557056", "0.53"]},  # all tiles; twice; no diagonal; elements; a fraction
    ("09", "l ="): {"right": ["1.149", "1.1494"], "rounded": ["1.15", "1.1"], "factor": ["23.09", "61.26"],
                    "unit": ["5.139", "0.139"]},  # from m1; rescaled the wrong way; log-sum-exp; log l
    ("13", "JSD (nats)"): {"right": ["0.38", "0.3804"], "rounded": ["0.4", "0"], "factor": ["0.761", "0.19"],
                           "unit": ["0.549", "0.165"]},  # not halved; halved twice; bits; log10
}


@pytest.mark.parametrize(("chapter", "key"), list(STUDENT_TRIES), ids=[f"{c}-{k}" for c, k in STUDENT_TRIES])
def test_a_students_honest_tries(chapter, key) -> None:
    (encoded, tol), = [(e, t) for c, k, e, t in EXERCISES if (c, k) == (chapter, key)]
    ex = exercises.ValueCheck(key.split("#")[0], encoded, hint="the box's hint", **tol)
    tries = STUDENT_TRIES[(chapter, key)]
    assert set(tries) == {"right", "rounded", "factor", "unit"}
    for kind, texts in tries.items():
        for text in texts:
            said = ex.evaluate(text)
            if kind == "right":
                assert said.startswith(exercises.CORRECT), (chapter, key, text, said)
            elif _is_a_coarser_rounding(text, exercises.decode_answer(encoded), tol):  # the method was right
                assert said.startswith(f"{exercises.NOT_YET}. That is the answer rounded to "), (chapter, key, text)
                assert said.endswith("until the last step.") and "the box's hint" not in said
            else:
                assert said == f"{exercises.NOT_YET}. the box's hint", (chapter, key, kind, text, said)


def _is_a_coarser_rounding(text: str, expected: float, tol: dict) -> bool:
    """Whether ``text`` is ``expected`` rounded to fewer significant figures or decimals than the box checks,
    typed with no finer digit, and not a tie (which could round either way); never for an exact box (a shorter
    value there is as likely another quantity). Worked out with decimal arithmetic, apart from the library."""
    from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation

    if tol.get("exact") or "/" in text:
        return False
    try:
        typed = Decimal(text.replace(",", ""))
    except InvalidOperation:
        return False
    if "." not in text and "e" not in text.lower():
        typed = typed.normalize()  # a whole number's trailing zeros are not typed digits
    e = Decimal(repr(expected))
    if typed == e:
        return False
    places = range(tol["decimals"]) if "decimals" in tol else [
        k - 1 - e.adjusted() for k in range(1, tol["digits"])]
    for p in places:  # decimal places of each coarser rounding (negative: tens, hundreds)
        q = Decimal(1).scaleb(-p)
        r = (e / q).quantize(Decimal(1), rounding=ROUND_HALF_EVEN) * q
        if r != e and r == typed and abs(e - r) < q / 2 and typed.as_tuple().exponent >= -p:
            return True
    return False


def test_thousands_separators_and_their_look_alikes() -> None:
    assert exercises.parse_number("389,152") == 389152.0 and exercises.parse_number("-8,390,656.5") == -8390656.5
    for text in ("1,2", "12,34", "1,2345", ",123", "1,234,56"):  # not thousands groups: not a number
        assert exercises.parse_number(text) is None, text


def test_stated_precision_accepts_the_rounded_value_and_no_coarser_one() -> None:
    ex = exercises.ValueCheck("r", exercises.encode_answer(14.222), digits=2)
    assert ex.name == "r (to 2 significant figures)"
    assert ex.accepts("14") and ex.accepts("14.2") and not ex.accepts("15") and not ex.accepts("10")
    ex = exercises.ValueCheck("r", exercises.encode_answer(0.3804), decimals=2)
    assert ex.accepts("0.38") and not ex.accepts("0.4") and not ex.accepts("0.37")
    with pytest.raises(ValueError, match="one of digits, decimals or exact=True"):
        exercises.ValueCheck("r", exercises.encode_answer(1.0), digits=2, decimals=1)
    with pytest.raises(ValueError, match="one of digits, decimals or exact=True"):
        exercises.ValueCheck("r", exercises.encode_answer(1.0), digits=2, exact=True)
    ex = exercises.ValueCheck("pairs", exercises.encode_answer(64.5), exact=True)
    assert ex.name == "pairs (exact)" and ex.rtol == 0
    assert exercises.ValueCheck("f(0.9) =", exercises.encode_answer(2.5), exact=True).name == "f(0.9) (exact) ="
    assert ex.accepts("64.5") and ex.accepts("129/2") and not ex.accepts("64.50001") and not ex.accepts("64")
    ex = exercises.ValueCheck("f", exercises.encode_answer(3 / 1.32), decimals=3)
    assert ex.accepts("3/1.32") and ex.accepts("2.273") and not ex.accepts("2.27")
    with pytest.raises(ValueError, match="digits must be a positive int"):
        exercises.ValueCheck("r", exercises.encode_answer(1.0), digits=0)


def test_a_quotient_of_decimals_is_read_as_the_chapters_write_it() -> None:
    assert exercises.parse_number("3/1.32") == 3 / 1.32 and exercises.parse_number(" -1.5 / 0.5 ") == -3.0
    assert exercises.parse_number("1e2/4") == 25.0 and exercises.parse_number("1/4") == 0.25
    for text in ("1/0", "1.5/0.0", "a/2", "1/2/3", "/2", "1/", "1.2.3/4"):
        assert exercises.parse_number(text) is None, text


def test_a_rounding_is_told_only_when_it_was_typed_as_one() -> None:
    """The final referee's case: typing more digits than the rounding has ("2.00"), a tie that could round either
    way, and any shorter value in an exact box (another quantity as likely as a rounding) get the box's hint."""
    box = exercises.ValueCheck("x", exercises.encode_answer(2.46), hint="hint", digits=3)
    assert "rounded to 1 significant figure" in box.evaluate("2")
    assert "rounded to 2 significant figures" in box.evaluate("2.5")
    for text in ("2.0", "2.00", "3", "1/2"):
        assert box.evaluate(text) == f"{exercises.NOT_YET}. hint", text
    tie = exercises.ValueCheck("x", exercises.encode_answer(2.5), hint="hint", decimals=2)
    assert tie.evaluate("2") == tie.evaluate("3") == f"{exercises.NOT_YET}. hint"
    exact = exercises.ValueCheck("x", exercises.encode_answer(0.0625), hint="hint", exact=True)
    assert exact.evaluate("0.063") == exact.evaluate("0.06") == f"{exercises.NOT_YET}. hint"
