"""booktools.static: kernel-free HTML for the site (the browser test clicks it; these check the markup)."""

from __future__ import annotations

import re
import shutil

import ipywidgets as widgets
import matplotlib.pyplot as plt
import pytest

from attention_core.booktools import static
from attention_core.booktools.exercises import encode_answer

TINY_PNG = (  # a 1x1 PNG
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


def test_frame_slider_shows_one_frame_per_value_with_alt_text() -> None:
    html = static.frame_slider([TINY_PNG, TINY_PNG, TINY_PNG], [0.1, 0.5, 2.0], label="bandwidth h",
                               alt="Nadaraya-Watson fit", initial=1).markup
    assert html.count('class="ac-frame"') == 3
    assert re.findall(r"display:(block|none)", html) == ["none", "block", "none"]
    assert 'max="2"' in html and 'value="1"' in html
    assert 'alt="Nadaraya-Watson fit (bandwidth h = 2.0)"' in html
    assert '<output class="ac-frames-value">0.5</output>' in html


def test_frame_slider_renders_and_closes_figures() -> None:
    plt.close("all")  # figures other tests left open are not this test's business
    figs = []
    for k in range(2):
        fig, ax = plt.subplots(figsize=(2, 1.5))
        ax.plot([0, 1], [0, k])
        figs.append(fig)
    html = static.frame_slider(figs, ["a", "b"], label="k", alt="a line").markup
    assert html.count("data:image/png;base64,") == 2
    assert not any(plt.fignum_exists(f.number) for f in figs), "rendered figures must be closed"


def test_ids_repeat_across_runs_and_differ_across_content() -> None:
    a = static.quiz_html("Q?", ["x", "y"], 0).markup
    assert a == static.quiz_html("Q?", ["x", "y"], 0).markup, "outputs must repeat for nbval"
    ids = {re.search(r'id="([^"]+)"', static.quiz_html(q, ["x", "y"], 0).markup)[1] for q in ("Q1?", "Q2?")}
    assert len(ids) == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(frames=[], values=[]), "frames"),
        (dict(frames=[TINY_PNG], values=[1, 2]), "values"),
        (dict(frames=[TINY_PNG], values=[1], initial=1), "initial"),
    ],
)
def test_frame_slider_validates(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        static.frame_slider(label="x", alt="y", **kwargs)


def test_quiz_marks_no_option_and_escapes_text() -> None:
    from attention_core.booktools.exercises import decode_quiz, encode_quiz

    html = static.quiz_html("Is 1 < 2?", ["<yes>", "no", "maybe"], 0, explanation="ordering").markup
    assert "data-correct" not in html and [f'data-option="{i}"' in html for i in range(3)] == [True] * 3
    assert "&lt;yes&gt;" in html and "<yes>" not in html
    assert "ordering" not in html  # the explanation travels encoded, with the index
    encoded = f'data-answer="{encode_quiz(0, "ordering")}"'
    assert encoded in html and decode_quiz(encode_quiz(0, "ordering")) == (0, "ordering")
    with pytest.raises(ValueError, match="options"):
        static.quiz_html("Q", ["only"], 0)
    with pytest.raises(ValueError, match="answer_index"):
        static.quiz_html("Q", ["a", "b"], 2)


def test_answer_box_carries_the_answer_encoded_and_the_tolerance() -> None:
    html = static.answer_box_html("weight:", encode_answer(0.25), rtol=0.01, atol=0.0, explanation="a quarter").markup
    assert "0.25" not in html and "a quarter" not in html
    assert f'data-answer="{encode_answer(0.25)}"' in html
    assert "<= 0.0 + 0.01 * Math.abs(e)" in html
    with pytest.raises(ValueError, match="encode_answer"):
        static.answer_box_html("weight:", 0.25)


def test_static_fallback_offers_widget_and_html() -> None:
    widget = widgets.IntSlider(value=3)
    quiz = static.quiz_html("Q?", ["a", "b"], 1)
    shown = static.with_static_fallback(widget, quiz)
    bundle = shown._repr_mimebundle_()
    assert bundle["text/html"] == quiz.markup
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == widget.model_id
    assert "text/plain" in bundle


def test_html_repr_is_short_and_stable() -> None:
    html = static.answer_box_html("x:", encode_answer(1.0))
    assert html._repr_html_() == str(html) == html.markup
    assert repr(html) == f"<attention_core.booktools.static.HTML, {len(html.markup)} characters>"


def test_figure_to_data_uri_is_a_png() -> None:
    fig, ax = plt.subplots(figsize=(1, 1))
    uri = static.figure_to_data_uri(fig, dpi=20)
    assert uri.startswith("data:image/png;base64,iVBORw0KGgo")
    assert not plt.fignum_exists(fig.number)


def test_text_slider_shows_one_escaped_text_per_value() -> None:
    html = static.text_slider(["a < b", "c", "d"], ["x", "y", "z"], label="sampling", initial=2).markup
    assert html.count('class="ac-text-frame"') == 3
    assert re.findall(r"display:(block|none)", html) == ["none", "none", "block"]
    assert "a &lt; b" in html and "a < b" not in html
    assert '<output class="ac-texts-value">z</output>' in html
    with pytest.raises(ValueError, match="values"):
        static.text_slider(["a"], ["x", "y"], label="k")


def test_generation_explorer_regenerates_and_carries_a_text_twin() -> None:
    from attention_core.booktools.widgets import GenerationExplorer

    calls = []

    def complete(prompt: str, temperature: float, top_k: int, length: int) -> str:
        calls.append((prompt, temperature, top_k, length))
        return f"<{temperature:g}|{top_k}|{length}>"

    w = GenerationExplorer(complete, prompt="Hi", temperature=1.0, top_k=5, length=20,
                           static_settings=[(0.0, 0), (1.0, 5)])
    assert "Hi&lt;1|5|20&gt;" in w.output.value
    w.length.value = 30
    assert calls[-1] == ("Hi", 1.0, 5, 30) and "Hi&lt;1|5|30&gt;" in w.output.value
    twin = w.static_html()
    assert twin.count('class="ac-text-frame"') == 2 and "greedy (temperature 0)" in twin
    assert "temperature 1, top-k 5" in twin and 'value="1"' in twin  # starts at the widget's setting
    with pytest.raises(TypeError, match="complete must be a callable"):
        GenerationExplorer("not a function")
    assert isinstance(w, widgets.VBox)


_NODE_HARNESS = r"""
const boxes = JSON.parse(require("fs").readFileSync(0, "utf8"));
global.atob = (s) => Buffer.from(s, "base64").toString("binary");
const verdicts = [];
for (const box of boxes) {
  const els = {};
  const root = {dataset: {answer: box.answer, why: box.why}, querySelector(sel) {
    return els[sel] || (els[sel] = {value: "", textContent: "", style: {},
                                    addEventListener(_ev, fn) { this.handler = fn; }});
  }};
  global.document = {getElementById: () => root};
  eval(box.script);
  verdicts.push(box.inputs.map((text) => {
    root.querySelector(".ac-answer-input").value = text;
    root.querySelector(".ac-answer-check").handler();
    return root.querySelector(".ac-answer-feedback").textContent;
  }));
}
process.stdout.write(JSON.stringify(verdicts));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the site's script")
def test_every_book_box_checks_in_the_page_as_it_does_in_the_kernel() -> None:
    """The static twin of each of the book's number boxes (run by node with a stand-in for the page) accepts and
    refuses exactly what the kernel's box does, and tells a too coarsely rounded answer as it does: the answer,
    the forms the chapter writes, what its stated precision refuses, the known mistakes, the student's tries,
    and values just inside and just outside its tolerance."""
    import html as html_lib
    import json
    import subprocess

    from test_numeric_exercises import EXERCISES, MISTAKES, REFUSED_NOW, STUDENT_TRIES, WRITTEN_AS

    from attention_core.booktools import exercises

    boxes, kernel = [], []
    for chapter, key, encoded, tol in EXERCISES:
        ex = exercises.ValueCheck(key.split("#")[0], encoded, **tol)
        e = exercises.decode_answer(encoded)
        width = ex.atol + ex.rtol * abs(e)
        inputs = [repr(e), f"{e:,}", *WRITTEN_AS.get((chapter, key), []), *REFUSED_NOW.get((chapter, key), []),
                  *(repr(float(m)) for m in MISTAKES[(chapter, key)]), repr(e + 0.9 * width), repr(e - 2 * width),
                  *(text for texts in STUDENT_TRIES.get((chapter, key), {}).values() for text in texts),
                  "", "abc", "1/0"]
        markup = ex.static_html()
        attrs = dict(re.findall(r'data-(answer|why)="([^"]*)"', markup))
        script = re.search(r"<script>(.*)</script>", markup, flags=re.S)[1]
        boxes.append({"answer": html_lib.unescape(attrs["answer"]), "why": attrs["why"], "script": script,
                      "inputs": inputs})
        kernel.append([_verdict(ex.evaluate(text)) for text in inputs])
    done = subprocess.run(["node", "-e", _NODE_HARNESS], input=json.dumps(boxes), capture_output=True, text=True,
                          check=True, timeout=60)
    page = [[_verdict(text) for text in texts] for texts in json.loads(done.stdout)]
    for (chapter, key, _, _), box, k, p in zip(EXERCISES, boxes, kernel, page):
        differ = [(text, kk, pp) for text, kk, pp in zip(box["inputs"], k, p) if kk != pp]
        assert not differ, f"ch. {chapter} {key!r}: (input, kernel, page) disagree: {differ}"
        assert k[0] == p[0] == "correct"
    told = [v for verdicts in kernel for v in verdicts if v.startswith("rounded")]
    assert len(told) >= 8, f"the tries include answers rounded too coarsely: {len(told)} told so"


def _verdict(message: str) -> str:
    """What a box said, as the kernel's and the page's messages can be compared: right, the answer rounded too
    coarsely (with what was said), or not yet (the hint, a parse error)."""
    if "Correct" in message:
        return "correct"
    if "rounded to" in message:
        return "rounded: " + message.strip()
    return "not yet"


# ------------------------------------------------------------------ a number box's hints for its known mistakes
#: chapter 9's KV-cache box: what a reader types -> a phrase the hint for that mistake must hold (the referee's
#: tries first: keys forgotten, 4 bytes per number, GB instead of GiB); "" -> the general hint.
_CH09_KV_TRIES = {"6.25": "query heads", "0.625": "keys or values only", "2.5": "4 bytes per number",
                  "1.342177280": "in GB", "1.342": "in GB", "1.34": "in GB", "1,342,177,280": "in bytes",
                  "1280": "in MiB", "3": "Multiply every factor", "12.5": "Multiply every factor",
                  "1.3": "Multiply every factor"}


def _ch09_kv_box():
    """Chapter 9's KV-cache box, rebuilt from the notebook's own check_value call (every keyword it passes)."""
    return _chapter_box("09_attention_at_scale", "KV cache (GiB)")


def test_a_box_names_the_known_mistake_a_value_matches() -> None:
    box = _ch09_kv_box()
    assert len(box.mistakes) >= 4 and "6.25" not in box.static_html()  # the known values stay encoded
    for typed, phrase in _CH09_KV_TRIES.items():
        said = box.evaluate(typed)
        assert said.startswith("\u2717 Not yet.") and phrase in said, (typed, said)
    assert box.accepts("1.25") and box.evaluate("1.25").startswith("\u2713")


#: chapter 5's exercise-1 box (the weight of "baseball" on itself without the scale): a typed value -> a phrase the
#: hint for that mistake must hold (the referee's try first: the weight on "bat"); "" would be the general hint.
_CH05_WEIGHT_TRIES = {"0.119": 'weight on "bat"', ".1192": 'weight on "bat"', "0.76": "1/sqrt(3) still in",
                      "0.760": "1/sqrt(3) still in", "0.5": 'row of "bat"', "0.667": "divides each score",
                      "2/3": "divides each score", "0.982": "softmax of 4 against 0",
                      "0.3": "raw dot products", "0.12": 'weight on "bat"', "0.1": "raw dot products"}


def _chapter_box(stem: str, label: str):
    """A chapter's number box, rebuilt from the notebook's own check_value call (every keyword it passes), as
    scripts/refresh_boxes.py rebuilds it."""
    import importlib.util
    from pathlib import Path

    import nbformat

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("refresh_boxes", root / "scripts" / "refresh_boxes.py")
    refresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(refresh)
    for cell in nbformat.read(root / "book" / f"{stem}.ipynb", as_version=4).cells:
        if cell.cell_type == "code" and label in cell.source and "check_value" in cell.source:
            return refresh.value_check(next(refresh.box_calls(cell.source)))
    raise AssertionError(f"{stem} has no box labelled {label!r}")


def test_ch05_weight_box_names_each_known_mistake() -> None:
    box = _chapter_box("05_self_attention", "weight of baseball on itself")
    assert len(box.mistakes) >= 4 and "0.1192" not in box.static_html()  # the known values stay encoded
    for typed, phrase in _CH05_WEIGHT_TRIES.items():
        said = box.evaluate(typed)
        assert said.startswith("\u2717 Not yet.") and phrase in said, (typed, said)
    for right in ("0.881", ".881", "0.8808"):
        assert box.evaluate(right).startswith("\u2713"), right
    assert "rounded to 2 decimal places" in box.evaluate("0.88")  # a coarser rounding is told as one


def test_mistakes_are_checked_after_the_answer_and_refused_when_malformed() -> None:
    from attention_core.booktools import exercises

    near = exercises.ValueCheck("x =", encode_answer(1.0), exact=True, hint="general", mistakes=[(1.001, "close")])
    assert near.accepts("1") and near.evaluate("1.001") == "\u2717 Not yet. close"
    assert near.evaluate("1.1") == "\u2717 Not yet. general"
    rounded = exercises.ValueCheck("y =", encode_answer(1.1494), decimals=3, hint="g", mistakes=[(1.1, "m")])
    assert "rounded to" in rounded.evaluate("1.1")  # a coarser rounding of the answer is told as one first
    for bad in ([(float("nan"), "h")], [(1.0, "")], [(1.0,)], ["1.0"], exercises.encode_text("not json")):
        with pytest.raises(ValueError, match="mistakes"):
            exercises.ValueCheck("z =", encode_answer(2.0), exact=True, mistakes=bad)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the site's script")
def test_the_page_names_the_same_known_mistake_as_the_kernel() -> None:
    import html as html_lib
    import json
    import subprocess

    box = _ch09_kv_box()
    markup = box.static_html()
    attrs = dict(re.findall(r'data-(answer|why)="([^"]*)"', markup))
    script = re.search(r"<script>(.*)</script>", markup, flags=re.S)[1]
    inputs = [*_CH09_KV_TRIES, "1.25"]
    page = json.loads(subprocess.run(
        ["node", "-e", _NODE_HARNESS], capture_output=True, text=True, check=True, timeout=60,
        input=json.dumps([{"answer": html_lib.unescape(attrs["answer"]), "why": attrs["why"], "script": script,
                           "inputs": inputs}])).stdout)[0]
    for typed, said in zip(inputs, page):
        kernel = box.evaluate(typed).lstrip("\u2717\u2713 ")
        assert said.strip() == kernel, (typed, said, kernel)


def _exact_and_rounded_boxes():
    """Two boxes with known mistakes close to their answers, and what each typed value must get: a mistake's hint
    ("m..."), the general hint ("general") or a right answer ("right")."""
    from attention_core.booktools import exercises

    exact = exercises.ValueCheck("count", encode_answer(3_001_000), exact=True, hint="general",
                                 mistakes=[(3_000_000, "m-three-million"), (3_003_000, "m-3003")])
    exact_tries = {"3,000,000": "m-three-million", "3e6": "m-three-million", "3,003,000": "m-3003",
                   "3,002,000": "general", "2,999,000": "general", "3,004,000": "general", "3,001,000": "right",
                   "3 001 000": "right", "3 000 000": "m-three-million"}
    third = exercises.ValueCheck("w", encode_answer(0.665), digits=3, hint="general", mistakes=[(0.6667, "m-2/3")])
    third_tries = {"0.667": "m-2/3", "0.6667": "m-2/3", "2/3": "m-2/3", "0.666": "general",
                   "0.67": "general", "0.668": "general", "0.665": "right", "0.6650": "right"}
    return [(exact, exact_tries), (third, third_tries)]


def _said(said: str) -> str:
    said = said.strip().lstrip("\u2717\u2713 ")
    return "right" if said.startswith("Correct") else said.removeprefix("Not yet. ")


def test_a_mistake_is_matched_at_the_digits_typed_not_a_fixed_window() -> None:
    """A known mistake's hint meets only that mistake written to the digits typed: never a near-right answer
    beside it (3,002,000 beside 3,001,000 and 3,003,000; 0.666 beside 0.665 and 2/3), nor a value that is the
    answer rounded as well (0.67)."""
    from attention_core.booktools import exercises

    for box, tries in _exact_and_rounded_boxes():
        for typed, want in tries.items():
            assert _said(box.evaluate(typed)) == want, (box.name, typed, box.evaluate(typed))
    with pytest.raises(ValueError, match="accepted by this box"):
        exercises.ValueCheck("w", encode_answer(0.665), digits=3, mistakes=[(0.6654, "rounds to the answer")])


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the site's script")
def test_the_page_matches_mistakes_as_the_kernel_does() -> None:
    import html as html_lib
    import json
    import subprocess

    boxes = _exact_and_rounded_boxes()
    cases = []
    for box, tries in boxes:
        markup = box.static_html()
        attrs = dict(re.findall(r'data-(answer|why)="([^"]*)"', markup))
        cases.append({"answer": html_lib.unescape(attrs["answer"]), "why": attrs["why"],
                      "script": re.search(r"<script>(.*)</script>", markup, flags=re.S)[1], "inputs": list(tries)})
    pages = json.loads(subprocess.run(["node", "-e", _NODE_HARNESS], capture_output=True, text=True, check=True,
                                      timeout=60, input=json.dumps(cases)).stdout)
    for (box, tries), page in zip(boxes, pages):
        for (typed, want), said in zip(tries.items(), page):
            assert _said(said) == want, (box.name, typed, said)
