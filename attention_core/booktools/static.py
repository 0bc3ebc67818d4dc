"""Interactivity that keeps working on the static site, where no Python kernel runs.

A live ipywidgets callback does nothing on a rendered page. The helpers here produce self-contained
HTML (markup plus a few lines of inline JavaScript, no network) for the things a site reader
should still be able to do:

- :func:`frame_slider`: move a slider over precomputed figures (e.g. one per bandwidth);
- :func:`text_slider`: the same over precomputed texts (e.g. one generated text per sampling setting);
- :func:`quiz_html`: answer a multiple-choice question and get feedback;
- :func:`answer_box_html`: type a number and have it checked against the expected value.

:class:`StaticTwin` (a mixin for widget classes) and :func:`with_static_fallback` (for a widget assembled
in a cell) pair a live widget with such HTML in one output: Jupyter and Colab show the widget, the site
(which prefers ``text/html`` over a widget view, see ``_config.yml``) shows the HTML. Element ids are
derived from the content, so re-running a notebook gives identical outputs.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
from typing import Any, Optional, Sequence, Tuple

__all__ = [
    "HTML",
    "StaticFallback",
    "StaticTwin",
    "answer_box_html",
    "figure_to_data_uri",
    "frame_slider",
    "quiz_html",
    "text_slider",
    "with_static_fallback",
]


class HTML:
    """A minimal rich-display object holding HTML (IPython renders it; ``str`` gives the markup)."""

    def __init__(self, markup: str) -> None:
        self.markup = markup

    def _repr_html_(self) -> str:
        return self.markup

    def __str__(self) -> str:
        return self.markup

    def __repr__(self) -> str:
        return f"<attention_core.booktools.static.HTML, {len(self.markup)} characters>"


def _uid(kind: str, *parts: Any) -> str:
    digest = hashlib.sha1(json.dumps([kind, *map(str, parts)]).encode()).hexdigest()[:10]
    return f"ac-{kind}-{digest}"


def figure_to_data_uri(fig: Any, *, dpi: int = 80) -> str:
    """Render a matplotlib figure to a ``data:image/png;base64,...`` URI and close the figure."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def frame_slider(
    frames: Sequence[Any],
    values: Sequence[Any],
    *,
    label: str,
    alt: str,
    initial: int = 0,
    dpi: int = 80,
) -> HTML:
    """A slider over precomputed figures: works in any browser, with no kernel.

    Args:
        frames: matplotlib figures (closed after rendering) or ready ``data:`` URIs, one per value.
        values: the parameter value each frame shows (printed beside the slider).
        label: the parameter's name, e.g. ``"bandwidth h"``.
        alt: alt text for the figure (the value is appended per frame).
        initial: index of the frame shown first.
        dpi: resolution of rendered figures.

    Returns:
        An :class:`~attention_core.booktools.static.HTML` object; display it in a notebook cell.

    Raises:
        ValueError: if ``frames`` is empty, lengths differ, or ``initial`` is out of range.
    """
    _check_slider(frames, values, initial, "frames", "figure")
    uris = [f if isinstance(f, str) else figure_to_data_uri(f, dpi=dpi) for f in frames]
    uid = _uid("frames", label, *values)
    imgs = "\n".join(
        f'<img class="ac-frame" src="{uri}" alt="{html.escape(alt)} ({html.escape(label)} = {html.escape(str(v))})"'
        f' style="display:{"block" if i == initial else "none"};max-width:100%">'
        for i, (uri, v) in enumerate(zip(uris, values))
    )
    return _slider("frames", "ac-frame", uid, imgs, values, label, " =", initial)


def _script(uid: str, body: str) -> str:
    """``body`` as a script that runs once for the element ``uid``, with ``root`` bound to it (a page may show an
    output twice, e.g. in a notebook viewer; the guard keeps the handlers from being attached twice)."""
    return (f'<script>(function () {{\n  var root = document.getElementById("{uid}");\n'
            f'  if (!root || root.dataset.bound) return;\n  root.dataset.bound = "1";\n{body}}})();</script>')


def _check_slider(items: Sequence[Any], values: Sequence[Any], initial: int, name: str, noun: str) -> None:
    if len(items) == 0:
        raise ValueError(f"{name}: expected at least one {noun}, got none")
    if len(items) != len(values):
        raise ValueError(f"values: expected one value per {noun} ({len(items)}), got {len(values)}")
    if not 0 <= initial < len(items):
        raise ValueError(f"initial: expected an index in [0, {len(items) - 1}], got {initial}")


def _slider(kind: str, item_class: str, uid: str, items: str, values: Sequence[Any], label: str, sep: str,
            initial: int) -> HTML:
    """The markup both sliders share: a labelled range input over ``items`` (each of class ``item_class``,
    the ``initial`` one visible), and the few lines of script that show the chosen one."""
    labels = json.dumps([str(v) for v in values])
    markup = f"""<div class="ac-{kind}" id="{uid}">
<label>{html.escape(label)}{sep} <output class="ac-{kind}-value">{html.escape(str(values[initial]))}</output>
<input type="range" class="ac-{kind}-range" min="0" max="{len(values) - 1}" step="1" value="{initial}"
 aria-label="{html.escape(label)}" style="vertical-align:middle;width:14em"></label>
{items}
</div>
""" + _script(uid, f"""  var labels = {labels}, items = root.querySelectorAll(".{item_class}");
  var range = root.querySelector(".ac-{kind}-range"), out = root.querySelector(".ac-{kind}-value");
  range.addEventListener("input", function () {{
    var k = Number(range.value);
    items.forEach(function (item, i) {{ item.style.display = i === k ? "block" : "none"; }});
    out.textContent = labels[k];
  }});
""")
    return HTML(markup)


def text_slider(texts: Sequence[str], values: Sequence[Any], *, label: str, initial: int = 0) -> HTML:
    """A slider over precomputed texts (e.g. one generated text per sampling setting), shown as preformatted
    text (readable by screen readers, unlike a figure): works in any browser, with no kernel.

    Raises:
        ValueError: if ``texts`` is empty, lengths differ, or ``initial`` is out of range.
    """
    _check_slider(texts, values, initial, "texts", "text")
    uid = _uid("texts", label, *values, *texts)
    blocks = "\n".join(
        f'<pre class="ac-text-frame" style="display:{"block" if i == initial else "none"};white-space:pre-wrap">'
        f"{html.escape(t)}</pre>"
        for i, t in enumerate(texts)
    )
    return _slider("texts", "ac-text-frame", uid, blocks, values, label, ":", initial)


def quiz_html(question: str, options: Sequence[str], answer_index: int, explanation: str = "") -> HTML:
    """A multiple-choice question answerable on the static page, with feedback on each click.

    No button says which option is right: the quiz carries the index and the explanation in one
    ``data-answer`` attribute, encoded as :func:`attention_core.booktools.exercises.encode_quiz` writes them
    (reversed base64), and the page decodes it only when an option is clicked.

    Raises:
        ValueError: if there are fewer than two options or ``answer_index`` is out of range.
    """
    if len(options) < 2:
        raise ValueError(f"options: expected at least two choices, got {len(options)}")
    if not 0 <= answer_index < len(options):
        raise ValueError(f"answer_index: expected an index in [0, {len(options) - 1}], got {answer_index}")
    uid = _uid("quiz", question, *options)
    buttons = "\n".join(
        f'<button type="button" class="ac-quiz-option" data-option="{i}">{html.escape(opt)}</button>'
        for i, opt in enumerate(options)
    )
    encoded = "acq1:" + base64.b64encode(f"{answer_index}|{explanation}".encode()).decode()[::-1]
    markup = f"""<div class="ac-quiz" id="{uid}" data-answer="{encoded}"
 style="border-left:4px solid #0072B2;padding:0.4em 0.8em">
<p class="ac-quiz-question"><strong>Quiz.</strong> {html.escape(question)}</p>
<div class="ac-quiz-options" style="display:flex;flex-direction:column;gap:0.3em;align-items:flex-start">
{buttons}
</div>
<p class="ac-quiz-feedback" role="status" aria-live="polite"></p>
</div>
""" + _script(uid, """  var feedback = root.querySelector(".ac-quiz-feedback");
  function unhide(s) { return decodeURIComponent(escape(atob(s.split("").reverse().join("")))); }
  root.querySelectorAll(".ac-quiz-option").forEach(function (button) {
    button.addEventListener("click", function () {
      var answer = unhide(root.dataset.answer.slice(5)), bar = answer.indexOf("|");
      var ok = button.dataset.option === answer.slice(0, bar);
      feedback.textContent = ok ? ("Correct. " + answer.slice(bar + 1)).trim()
                                : "Not quite: think again and pick another answer.";
      feedback.style.color = ok ? "#009E73" : "#D55E00";
    });
  });
""")
    return HTML(markup)


def rounded_message(rounded: str, precision: str) -> str:
    """What a number box says to the answer rounded coarser than it checks (the kernel's box and the page's)."""
    checks = "the exact value" if precision == "exact" else precision
    return (f"\u2717 Not yet. That is the answer rounded to {rounded}; this box checks {checks}: keep every digit "
            "until the last step.")


def answer_box_html(prompt: str, encoded: str, *, rtol: float = 1e-2, atol: float = 1e-6, explanation: str = "",
                    hint: str = "", roundings: Sequence[Tuple[float, str]] = (), precision: str = "",
                    mistakes: Sequence[Tuple[float, str, float]] = ()) -> HTML:
    """A number box checked in the browser against an answer that stays hidden.

    ``encoded`` is the answer as :func:`attention_core.booktools.exercises.encode_answer` writes it (base64 of
    the number's text, reversed); the page decodes it only to compare (``|x - e| <= atol + rtol*|e|``). The
    explanation, shown once the answer is right, is stored the same way. ``roundings`` (``(unit, text)``, finest
    first) and ``precision`` (what the box checks): a wrong value that is the answer rounded to a coarser unit is
    told so, as the kernel's box tells it, instead of the hint. ``mistakes`` (``(value, hint, half)``, ``half``
    half a unit of the value's last written digit): a wrong value that is one, one rounded at the last digit typed (two
    significant digits at least, and not also the answer rounded there), or a fraction within ``half`` of one,
    gets its hint instead of the general one, as in the kernel's box (stored encoded like
    the explanation, since a mistake's value can give the answer away).
    """
    told = {text: rounded_message(text, precision) for _, text in roundings}
    if not isinstance(encoded, str) or not encoded.startswith("ac1:"):
        raise ValueError(f"encoded: expected an answer made by encode_answer ('ac1:...'), got {encoded!r}")
    uid = _uid("answer", prompt, encoded)
    why = base64.b64encode(explanation.encode()).decode()[::-1]
    known = json.dumps([[v, h, w] for v, h, w in mistakes])
    known = base64.b64encode(known.encode()).decode()[::-1] if mistakes else ""
    markup = f"""<div class="ac-answer" id="{uid}" data-answer="{html.escape(encoded)}" data-why="{why}">
<label>{html.escape(prompt)} <input type="text" inputmode="decimal" class="ac-answer-input" style="width:8em"></label>
<button type="button" class="ac-answer-check">Check</button>
<span class="ac-answer-feedback" role="status" aria-live="polite"></span>
</div>
""" + _script(uid, f"""\
  function unhide(s) {{ return decodeURIComponent(escape(atob(s.split("").reverse().join("")))); }}
  function parse(s) {{
    s = s.trim().replace("\u2212", "-");
    if (/^[+-]?[0-9]{{1,3}}(,[0-9]{{3}})+(\\.[0-9]*)?$/.test(s)) {{ s = s.replace(/,/g, ""); }}  // 389,152
    var t = s.replace(/ /g, "");  // 3 001 000, as the kernel's box reads it
    if (t !== s && /^[+-]?[0-9]*\\.?[0-9]+$/.test(t)) {{ s = t; }}
    var m = s.match(/^(-?[0-9.eE+-]+)\\s*\\/\\s*([0-9.eE+-]+)$/);
    return m ? Number(m[1]) / Number(m[2]) : (s === "" ? NaN : Number(s));
  }}
  var input = root.querySelector(".ac-answer-input"), out = root.querySelector(".ac-answer-feedback");
  root.querySelector(".ac-answer-check").addEventListener("click", function () {{
    var x = parse(input.value), e = Number(unhide(root.dataset.answer.slice(4)));
    var ok = isFinite(x) && Math.abs(x - e) <= {atol!r} + {rtol!r} * Math.abs(e);
    var rounded = null, units = {json.dumps([[u, t] for u, t in roundings])}, told = {json.dumps(told)};
    var m = input.value.replace(/,/g, "").match(/^\\s*[+-]?(\\d*)(?:\\.(\\d*))?(?:[eE]([+-]?\\d+))?\\s*$/), last = null;
    if (m && (m[1] || m[2])) {{  // the power of ten of the last digit typed; a whole number's trailing zeros not
      var ex = Number(m[3] || 0);
      last = m[2] !== undefined ? ex - m[2].length
        : (/[1-9]/.test(m[1]) ? ex + m[1].length - m[1].replace(/0+$/, "").length : ex);
    }}
    for (var i = 0; !ok && isFinite(x) && last !== null && rounded === null && i < units.length; i++) {{
      var u = units[i][0];
      if (Math.abs(x - Math.round(x / u) * u) <= 1e-6 * u && Math.abs(x - e) < 0.5 * u * (1 - 1e-9)
          && last >= Math.log10(u) - 1e-9) {{
        rounded = told[units[i][1]];
      }}
    }}
    var known = {json.dumps(known)} ? JSON.parse(unhide({json.dumps(known)})) : [], because = {json.dumps(hint)};
    for (var j = 0; !ok && rounded === null && isFinite(x) && j < known.length; j++) {{  // a known mistake
      var v = known[j][0], half = last === null ? 0 : 0.5 * Math.pow(10, last);
      var sig = last === null || x === 0 ? 0 : Math.floor(Math.log10(Math.abs(x))) - last + 1;
      if (Math.abs(x - v) <= 1e-9 * Math.max(1, Math.abs(v)) || (last === null && Math.abs(x - v) <= known[j][2])
          || (sig >= 2 && Math.abs(x - v) <= half * (1 + 1e-9) && Math.abs(x - e) > half * (1 + 1e-9))) {{
        because = known[j][1]; break;
      }}
    }}
    out.textContent = ok ? " Correct. " + unhide(root.dataset.why)
      : (rounded !== null ? " " + rounded : " Not yet. " + because);
    out.style.color = ok ? "#009E73" : "#D55E00";
  }});
""")
    return HTML(markup)


def _bundle_with_html(widget: Any, markup: str, include: Any = None, exclude: Any = None) -> dict:
    """The display data of ``widget`` (a widget view) plus ``text/html`` = ``markup``."""
    parent = getattr(widget, "_repr_mimebundle_", None)
    if parent is not None:  # ipywidgets 8
        data = dict(parent(include=include, exclude=exclude) or {})
    else:  # ipywidgets 7.x has no mimebundle method: build the view reference by hand
        data = {
            "text/plain": repr(widget),
            "application/vnd.jupyter.widget-view+json": {
                "version_major": 2,
                "version_minor": 0,
                "model_id": widget.model_id,
            },
        }
    if markup:
        data["text/html"] = markup
    return data


class StaticTwin:
    """Mixin for a widget class that has a kernel-free twin: ``class MyExplorer(StaticTwin, widgets.VBox)``.

    The subclass implements :meth:`static_html`. Displayed with ipywidgets 8, the output holds both the widget
    view and ``text/html``; the site's ``_config.yml`` ranks ``text/html`` first, so the page shows the twin
    while Jupyter and Colab show the live widget. (ipywidgets 7.x displays through ``_ipython_display_`` and
    never asks for the bundle: there the widget displays as before.)
    """

    def static_html(self) -> str:
        """The kernel-free markup; ``""`` for none."""
        raise NotImplementedError

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Optional[dict]:
        parent = getattr(super(), "_repr_mimebundle_", None)
        data = parent(include=include, exclude=exclude) if parent is not None else None
        if data is None:
            return None
        markup = self.static_html()
        return {**data, "text/html": markup} if markup else data


class StaticFallback:
    """Displays a live widget (Jupyter, Colab) and static HTML (the rendered site) as one output: the same
    display data as :class:`StaticTwin`, for a widget assembled in a notebook cell."""

    def __init__(self, widget: Any, static: HTML) -> None:
        self.widget = widget
        self.static = static

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict:
        return _bundle_with_html(self.widget, self.static.markup, include, exclude)


def with_static_fallback(widget: Any, static: HTML) -> StaticFallback:
    """Pair a live widget with HTML that works without a kernel; display the result in a cell.

    Args:
        widget: an ipywidgets widget (7.x or 8.x).
        static: its kernel-free stand-in, e.g. from :func:`frame_slider` or :func:`quiz_html`.

    Returns:
        A :class:`StaticFallback`; display it in a notebook cell.
    """
    return StaticFallback(widget, static)
