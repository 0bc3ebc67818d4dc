"""Self-check widgets (attention_core.booktools.exercises), driven programmatically without a Jupyter kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attention_core.booktools import exercises
from attention_core.booktools.exercises import (
    CORRECT,
    NOT_YET,
    check,
    check_value,
    decode_answer,
    encode_answer,
    parse_number,
    quiz,
)


@pytest.mark.parametrize(
    "text,expected",
    [("0.25", 0.25), (" 1e-3 ", 1e-3), ("1/4", 0.25), ("-3/2", -1.5), ("\u22122.5", -2.5), (3, 3.0),
     (np.float32(0.5), 0.5), ("", None), ("abc", None), ("1/0", None), (None, None), (True, None)],
)
def test_parse_number(text, expected) -> None:
    assert parse_number(text) == (None if expected is None else pytest.approx(expected))


def test_check_numbers_strings_tensors_and_arrays() -> None:
    assert check(2.5, 2.5)
    assert check("2.5", 2.5) and check("5/2", 2.5)
    assert check(2.51, 2.5, rtol=1e-2) and not check(2.6, 2.5, rtol=1e-2)
    assert check(torch.tensor(4.0), 4.0) and check(torch.tensor([1.0, 2.0]), [1.0, 2.0])
    assert check(np.array([[0.5, 0.5]]), [[0.5, 0.5]])
    assert check(1e-9, 0.0, atol=1e-8) and not check(1e-3, 0.0, atol=1e-8)


@pytest.mark.parametrize("answer", [None, "", "two", float("nan"), float("inf"), [1.0, 2.0], True, object()])
def test_check_rejects_non_answers_without_raising(answer) -> None:
    assert check(answer, 2.0) is False


def test_check_rejects_a_wrong_shape_and_a_bad_expected() -> None:
    assert not check([1.0, 2.0], [1.0, 2.0, 3.0])
    assert not check(torch.ones(2, 2), torch.ones(4))
    with pytest.raises(ValueError, match="expected"):
        check(1.0, "not a number")


def test_value_check_widget_gives_feedback_on_click() -> None:
    w = check_value("f(0.9) =", encode_answer(2.5), hint="Which keys are within h?", explanation="Keys 0.5 and 1.")
    assert w.feedback.value == ""
    w.answer.value = "2.5"
    w.button.click()
    assert CORRECT in w.feedback.value and "Keys 0.5 and 1." in w.feedback.value
    w.answer.value = "3"
    w.button.click()
    assert NOT_YET in w.feedback.value and "Which keys are within h?" in w.feedback.value
    w.answer.value = "five"
    w.button.click()
    assert "Enter a single number" in w.feedback.value
    w.answer.value = "10/4"
    w.button.click()
    assert CORRECT in w.feedback.value


def test_value_check_evaluate_matches_the_widget_and_escapes_html() -> None:
    w = exercises.ValueCheck("x", encode_answer(1.0), rtol=0.0, atol=1e-3, hint="<b>careful</b>")
    assert w.evaluate(1.0005).startswith(CORRECT)
    assert w.evaluate(1.01) == f"{NOT_YET}. <b>careful</b>"
    assert w.evaluate([1.0, 1.0]).startswith("Enter a single number")
    w.answer.value = "2"
    w.button.click()
    assert "&lt;b&gt;careful&lt;/b&gt;" in w.feedback.value  # user-facing text is escaped
    with pytest.raises(ValueError, match="encode_answer"):
        exercises.ValueCheck("x", float("nan"))


def test_value_check_layout() -> None:
    w = check_value("scale s =", encode_answer(4.0))
    row, feedback = w.children
    assert feedback is w.feedback
    assert list(row.children) == [w.answer, w.button]
    assert w.answer.description == "scale s =" and w.button.description == "Check"


def test_quiz_widget_feedback() -> None:
    q = quiz("As h grows?", ["nearest value", "mean of values", "zero"], answer_index=1,
             explanation="All scores tend to 0.", hint="Think of the softmax of equal scores.")
    assert q.options.index is None  # nothing preselected
    q.button.click()
    assert "Pick one of the options" in q.feedback.value
    q.options.index = 0
    q.button.click()
    assert NOT_YET in q.feedback.value and "softmax of equal scores" in q.feedback.value
    q.options.value = "mean of values"
    q.button.click()
    assert CORRECT in q.feedback.value and "All scores tend to 0." in q.feedback.value
    assert q.evaluate(1).startswith(CORRECT) and q.evaluate(2).startswith(NOT_YET)
    assert q.evaluate(None).startswith("Pick")
    assert list(q.children) == [q.prompt, q.options, q.button, q.feedback]


@pytest.mark.parametrize(
    "options,answer_index,exc",
    [(["only one"], 0, ValueError), (["a", "b"], 2, ValueError), (["a", "b"], -1, ValueError),
     (["a", "b"], "0", TypeError), (["a", "b"], True, TypeError)],
)
def test_quiz_validates_its_arguments(options, answer_index, exc) -> None:
    with pytest.raises(exc):
        quiz("?", options, answer_index)


def test_widgets_carry_static_html_for_the_site() -> None:
    w = check_value("f(0.9) =", encode_answer(2.5), rtol=1e-3)
    data = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data and data["text/plain"].startswith("ValueCheck")
    assert 'class="ac-answer"' in data["text/html"] and "f(0.9) =" in data["text/html"]
    assert "2.5" not in data["text/html"] and encode_answer(2.5) in data["text/html"]
    assert data["text/html"] == w.static_html()
    q = quiz("As h grows?", ["nearest value", "mean of values"], answer_index=1, explanation="Equal scores.")
    html = q._repr_mimebundle_()["text/html"]
    assert 'class="ac-quiz"' in html and "data-correct" not in html and "Equal scores." not in html
    assert exercises.encode_quiz(1, "Equal scores.") in html  # index and explanation, encoded together


def test_quiz_answers_are_encoded_and_decoded() -> None:
    enc = exercises.encode_quiz(2, "Why: the scores tie ≈ equally.")
    assert enc.startswith("acq1:") and "Why" not in enc and exercises.decode_quiz(enc) == (
        2, "Why: the scores tie ≈ equally.")
    q = quiz("?", ["a", "b", "c"], enc, hint="h")
    assert q.answer_index == 2 and q.evaluate(2).endswith("equally.") and q.evaluate(0).startswith(NOT_YET)
    with pytest.raises(ValueError, match="explanation"):
        quiz("?", ["a", "b", "c"], enc, explanation="twice")
    for bad in ("acq1:!!", "ac1:abc", 3):
        with pytest.raises(ValueError):
            exercises.decode_quiz(bad)
    with pytest.raises(ValueError):
        exercises.encode_quiz(-1)


def test_value_check_explanations_can_be_encoded() -> None:
    enc = exercises.encode_text("Row i keeps i + 1 keys: sum them.")
    assert enc.startswith("act1:") and "keys" not in enc and exercises.decode_text(enc).startswith("Row i")
    w = check_value("count =", encode_answer(21), explanation=enc)
    assert w.evaluate("21").endswith("sum them.") and "sum them" not in w.static_html()
    plain = check_value("count =", encode_answer(21), explanation="Row i keeps i + 1 keys: sum them.")
    assert plain.static_html() == w.static_html()  # the page is the same either way
    with pytest.raises(ValueError):
        exercises.decode_text("acq1:x")


def test_answers_are_encoded_and_never_shown() -> None:
    enc = encode_answer(0.8808)
    assert "0.8808" not in enc and decode_answer(enc) == 0.8808
    w = check_value("weight", enc, rtol=5e-3, explanation="softmax of 4 and 2")
    assert "0.88" not in w.static_html() and "softmax of 4" not in w.static_html()
    assert w.accepts("0.881") and not w.accepts(0.5)
    with pytest.raises(ValueError, match="encode_answer"):
        check_value("weight", 0.8808)
    with pytest.raises(ValueError, match="damaged"):
        decode_answer("ac1:@@@")
    with pytest.raises(ValueError, match="finite"):
        encode_answer(float("nan"))


def _softmax_spec() -> exercises.FunctionSpec:
    from hypothesis import strategies as st

    import attention_core as ac

    def case(shape):
        return st.tuples(
            st.lists(st.floats(-5, 5, width=32), min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]),
            st.lists(st.booleans(), min_size=shape[0] * shape[1], max_size=shape[0] * shape[1]),
        ).map(lambda t: (torch.tensor(t[0]).view(shape), torch.tensor(t[1]).view(shape)))

    inputs = st.tuples(st.integers(1, 3), st.integers(1, 4)).flatmap(case)
    return exercises.FunctionSpec("masked_softmax", reference=ac.masked_softmax, inputs=inputs, max_examples=40,
                                  arg_names=("scores", "mask"))


def test_code_checker_accepts_reports_and_waits() -> None:
    import attention_core as ac

    spec = _softmax_spec()
    assert exercises.check_function(lambda s, m: ac.masked_softmax(s, m), spec).passed

    def naive(s, m):  # -inf fill without the guard: NaN on a fully masked row
        return torch.softmax(s.masked_fill(~m, float("-inf")), -1)

    report = exercises.check_function(naive, spec)
    assert report.status == "failed" and "NaN at 1 position where" in report.message
    assert "\n  scores = " in report.message and "\n  mask = " in report.message  # the statement's names
    assert "expected" in report.message and "received" in report.message and "argument" not in report.message
    bare = exercises.FunctionSpec("f", ac.masked_softmax, spec.inputs, max_examples=40)
    unnamed = exercises.check_function(naive, bare)
    assert "\n  argument 1 = " in unnamed.message  # a spec without names still shows every input

    def todo(s, m):
        raise NotImplementedError

    assert exercises.check_function(todo, spec).status == "todo"
    assert "Colab" in exercises.check_function(todo, spec)._repr_html_()
    crash = exercises.check_function(lambda s, m: s.view(-1, 7), spec)
    assert crash.status == "failed" and "raised RuntimeError" in crash.message


def test_prove_checker_and_value_check() -> None:
    import attention_core as ac

    spec = _softmax_spec()
    line = exercises.prove_checker(spec, lambda s, m: ac.masked_softmax(s, m), lambda s, m: torch.softmax(s, -1))
    assert "accepts the worked solution" in line
    with pytest.raises(AssertionError, match="accepts a wrong solution"):
        exercises.prove_checker(spec, lambda s, m: ac.masked_softmax(s, m), lambda s, m: ac.masked_softmax(s, m))
    ex = check_value("x", encode_answer(2.0), rtol=0)
    assert "accepts the worked answer" in exercises.prove_value_check(ex, 2.0, 3.0)
    with pytest.raises(AssertionError, match="wrong answer is accepted"):
        exercises.prove_value_check(ex, 2.0, 2.0)


def test_prove_quiz_names_no_option() -> None:
    q = quiz("As h grows?", ["nearest value", "mean of values", "zero"], answer_index=1, explanation="Equal scores.")
    line = exercises.prove_quiz(q)
    assert "one option of 3" in line and "mean" not in line and "1" not in line
    q.evaluate = lambda i: CORRECT if i in (1, 2) else NOT_YET  # a broken quiz: two options accepted
    with pytest.raises(AssertionError, match="more than one option"):
        exercises.prove_quiz(q)
    q.evaluate = lambda i: NOT_YET  # and one that rejects its own answer
    with pytest.raises(AssertionError, match="answer is rejected"):
        exercises.prove_quiz(q)
