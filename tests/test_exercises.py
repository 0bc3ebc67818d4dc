"""Self-check widgets (attention_core.booktools.exercises), driven programmatically without a Jupyter kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attention_core.booktools import exercises
from attention_core.booktools.exercises import CORRECT, NOT_YET, check, check_value, parse_number, quiz


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
    w = check_value("f(0.9) =", expected=2.5, hint="Which keys are within h?", explanation="Keys 0.5 and 1.")
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
    w = exercises.ValueCheck("x", 1.0, rtol=0.0, atol=1e-3, hint="<b>careful</b>")
    assert w.evaluate(1.0005).startswith(CORRECT)
    assert w.evaluate(1.01) == f"{NOT_YET}. <b>careful</b>"
    assert w.evaluate([1.0, 1.0]).startswith("Enter a single number")
    w.answer.value = "2"
    w.button.click()
    assert "&lt;b&gt;careful&lt;/b&gt;" in w.feedback.value  # user-facing text is escaped
    with pytest.raises(ValueError, match="expected"):
        exercises.ValueCheck("x", float("nan"))


def test_value_check_layout() -> None:
    w = check_value("scale s =", 4.0)
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
    w = check_value("f(0.9) =", expected=2.5, rtol=1e-3)
    data = w._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data and data["text/plain"].startswith("ValueCheck")
    assert 'class="ac-answer"' in data["text/html"] and "f(0.9) =" in data["text/html"]
    assert "2.5" in data["text/html"] and data["text/html"] == w.static_html()
    q = quiz("As h grows?", ["nearest value", "mean of values"], answer_index=1, explanation="Equal scores.")
    html = q._repr_mimebundle_()["text/html"]
    assert 'class="ac-quiz"' in html and html.count('data-correct="1"') == 1 and "Equal scores." in html
