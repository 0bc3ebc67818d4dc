"""Self-check widgets for the exercises: type an answer (or pick an option), press Check, read the feedback.

Displayed with ipywidgets 8, each widget also carries a static HTML version (see :mod:`attention_core.booktools.static`)
that the rendered site shows, so readers can check answers there without a kernel. The logic lives in
plain functions and methods (:func:`check`, :meth:`ValueCheck.evaluate`,
:meth:`Quiz.evaluate`) that work without a Jupyter kernel, so they are unit-tested, and a chapter can print
what a widget would say for the reference answer (nbval then checks that line). The widgets use only
ipywidgets features present in both 7.7 (Colab) and 8.x.

Usage in a chapter::

    ex = exercises.check_value("weight on key 2", expected=0.25, hint="Which keys are within h?")
    ex                                   # the widget: a text box, a Check button, a feedback line
    print(ex.evaluate(0.25))             # "Correct: ..." (what the widget says for the reference answer)
"""

from __future__ import annotations

import html
import math
from fractions import Fraction
from typing import Any, Sequence

import ipywidgets as widgets
import numpy as np

from attention_core.booktools.static import StaticTwin, answer_box_html, quiz_html

__all__ = ["CORRECT", "NOT_YET", "Quiz", "ValueCheck", "check", "check_value", "parse_number", "quiz"]

CORRECT = "\u2713 Correct"  # check mark: the message does not rely on colour alone
NOT_YET = "\u2717 Not yet"  # ballot x
_COLORS = {True: "#009E73", False: "#D55E00", None: "#555555"}  # Okabe-Ito green / vermillion / grey


def parse_number(text: Any) -> float | None:
    """A float from user input: ``"0.25"``, ``" 1e-3 "``, ``"1/4"``, ``"-3/2"``; ``None`` if it is not one."""
    if isinstance(text, bool):
        return None
    if isinstance(text, (int, float, np.number)):
        return float(text)
    if not isinstance(text, str):
        return None
    s = text.strip().replace("\u2212", "-")  # accept a typographic minus
    if not s:
        return None
    try:
        return float(s)
    except ValueError:
        pass
    try:
        return float(Fraction(s.replace(" ", "")))
    except (ValueError, ZeroDivisionError):
        return None


def _as_array(x: Any) -> np.ndarray | None:
    if isinstance(x, str):
        value = parse_number(x)
        return None if value is None else np.asarray(value)
    if x is None or isinstance(x, bool):
        return None
    try:
        import torch

        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", torch.float64).numpy()
    except ImportError:  # pragma: no cover
        pass
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    return arr


def check(answer: Any, expected: Any, rtol: float = 1e-2, atol: float = 1e-8) -> bool:
    """True when ``answer`` matches ``expected`` within ``|a - e| <= atol + rtol * |e|`` elementwise.

    ``answer`` may be a number, a string holding one (``"0.25"``, ``"1/4"``), a list, an array or a tensor;
    its shape must equal ``expected``'s (a 0-d tensor matches a plain number). Anything that is not a
    finite number (text, ``None``, NaN, a wrong shape) gives False rather than raising.
    """
    a, e = _as_array(answer), _as_array(expected)
    if e is None:
        raise ValueError(f"expected must be a number or an array of numbers, got {expected!r}")
    if a is None or a.shape != e.shape or not np.all(np.isfinite(a)):
        return False
    return bool(np.allclose(a, e, rtol=rtol, atol=atol))


def _render(message: str, ok: bool | None) -> str:
    return f'<span style="color:{_COLORS[ok]}">{html.escape(message)}</span>'


class ValueCheck(StaticTwin, widgets.VBox):
    """A numeric self-check: a text box, a Check button and a feedback line.

    Attributes:
        answer: the ``Text`` widget the reader types into.
        button: the ``Button``; clicking it (or ``button.click()``) checks the answer.
        feedback: an ``HTML`` widget with the verdict.
    """

    def __init__(
        self,
        name: str,
        expected: float,
        *,
        rtol: float = 1e-2,
        atol: float = 1e-8,
        hint: str = "",
        explanation: str = "",
    ) -> None:
        if not math.isfinite(float(expected)):
            raise ValueError(f"expected must be a finite number, got {expected!r}")
        self.name, self.expected, self.rtol, self.atol = name, float(expected), rtol, atol
        self.hint, self.explanation = hint, explanation
        self.answer = widgets.Text(value="", placeholder="a number, e.g. 0.25 or 1/4", description=name)
        self.answer.style.description_width = "initial"
        self.button = widgets.Button(description="Check", button_style="primary")
        self.feedback = widgets.HTML(value="")
        self.button.on_click(self._on_click)
        super().__init__(children=[widgets.HBox([self.answer, self.button]), self.feedback])

    def evaluate(self, answer: Any) -> str:
        """The feedback text for ``answer`` (what the widget shows after Check)."""
        if _as_array(answer) is None or _as_array(answer).shape != ():
            return "Enter a single number (for example 0.25, 1e-3 or 1/4)."
        if check(answer, self.expected, rtol=self.rtol, atol=self.atol):
            return f"{CORRECT}. {self.explanation}".strip()
        return f"{NOT_YET}. {self.hint}".strip()

    def static_html(self) -> str:
        """The kernel-free version for the rendered site: a number box checked in the browser."""

        return answer_box_html(self.name, self.expected, rtol=self.rtol, atol=self.atol).markup


    def _on_click(self, _button: Any = None) -> None:
        message = self.evaluate(self.answer.value)
        ok = None if message.startswith("Enter") else message.startswith(CORRECT)
        self.feedback.value = _render(message, ok)


class Quiz(StaticTwin, widgets.VBox):
    """A multiple-choice question: radio buttons, a Check button and a feedback line.

    Attributes:
        options: the ``RadioButtons`` (nothing selected at first).
        button: the ``Button``; clicking it (or ``button.click()``) checks the choice.
        feedback: an ``HTML`` widget with the verdict (and the explanation once correct).
    """

    def __init__(
        self, question: str, options: Sequence[str], answer_index: int, explanation: str = "", hint: str = ""
    ) -> None:
        options = [str(o) for o in options]
        if len(options) < 2:
            raise ValueError(f"options must hold at least 2 choices, got {len(options)}")
        if isinstance(answer_index, bool) or not isinstance(answer_index, int):
            raise TypeError(f"answer_index must be an int, got {type(answer_index).__name__}")
        if not 0 <= answer_index < len(options):
            raise ValueError(f"answer_index must be in [0, {len(options)}), got {answer_index}")
        self.question, self.answer_index = question, answer_index
        self.explanation, self.hint = explanation, hint
        self.prompt = widgets.HTML(value=f"<b>{html.escape(question)}</b>")
        self.options = widgets.RadioButtons(options=options, index=None, layout=widgets.Layout(width="auto"))
        self.button = widgets.Button(description="Check", button_style="primary")
        self.feedback = widgets.HTML(value="")
        self.button.on_click(self._on_click)
        super().__init__(children=[self.prompt, self.options, self.button, self.feedback])

    def evaluate(self, index: int | None) -> str:
        """The feedback text for choosing option ``index`` (``None``: nothing chosen)."""
        if index is None:
            return "Pick one of the options first."
        if index == self.answer_index:
            return f"{CORRECT}. {self.explanation}".strip()
        return f"{NOT_YET}. {self.hint}".strip()

    def static_html(self) -> str:
        """The kernel-free version for the rendered site: option buttons that give feedback on a click."""

        options = list(self.options.options)
        return quiz_html(self.question, options, self.answer_index, self.explanation).markup


    def _on_click(self, _button: Any = None) -> None:
        index = self.options.index
        message = self.evaluate(index)
        self.feedback.value = _render(message, None if index is None else index == self.answer_index)


def check_value(
    name: str,
    expected: float,
    *,
    rtol: float = 1e-2,
    atol: float = 1e-8,
    hint: str = "",
    explanation: str = "",
) -> ValueCheck:
    """A :class:`ValueCheck` widget for a numeric answer named ``name``.

    Args:
        name: label in front of the text box.
        expected: the reference answer.
        rtol, atol: tolerance, as in :func:`check`.
        hint: shown after a wrong answer.
        explanation: shown after a correct answer.
    """
    return ValueCheck(name, expected, rtol=rtol, atol=atol, hint=hint, explanation=explanation)


def quiz(
    question: str, options: Sequence[str], answer_index: int, explanation: str = "", hint: str = ""
) -> Quiz:
    """A :class:`Quiz` widget: ``question``, ``options``, the index of the right one, and why it is right."""
    return Quiz(question, options, answer_index, explanation=explanation, hint=hint)
