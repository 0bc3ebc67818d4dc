"""Every page of the built site, opened in a real browser (Debian Chromium driven by Playwright).

For each page in _toc.yml: no failed request, no 4xx/5xx and no request leaving 127.0.0.1; every image
decoded; math typeset by the site's own MathJax where the page has math, labelled equations numbered;
widgets rendered where a notebook embedded a widget view; on notebook pages a Colab link that points at
that notebook; copy buttons on code; static sliders that change the figure; quizzes and answer boxes
that give feedback on a click and mark no option as right; folded solutions (<details>) that open; no
JavaScript error except the ones listed in ALLOWED_JS_ERRORS with a reason; every figure has alt text; every
chapter has a quiz and solutions.
The search page, the indexes and an offline search are checked too. A screenshot of every page goes to
_build/screenshots/ (JPEG, full page), plus the first chapter at a phone's width (390 px), where the page
must not scroll sideways.

The site folder is _build/html, or $AC_SITE_DIR when set (e.g. a build made with --path-output); the pages
are those of _toc.yml, or of $AC_TOC (e.g. a trial build with `jupyter-book build . --toc FILE`).
"""

from __future__ import annotations

import base64
import os
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("AC_SITE_DIR", ROOT / "_build" / "html"))  # the same folder conftest serves
SHOTS = SITE.parent / "screenshots"

# Console errors that are not ours to fix, each with the reason it is harmless. Keep this list short.
ALLOWED_JS_ERRORS: dict[str, str] = {}


def _toc_files(node) -> list[str]:
    out: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            out += [value] if key in ("file", "root") else _toc_files(value)
    elif isinstance(node, list):
        for item in node:
            out += _toc_files(item)
    return out


TOC = yaml.safe_load(Path(os.environ.get("AC_TOC", ROOT / "_toc.yml")).read_text())  # $AC_TOC: a trial toc
PAGES = [p.removesuffix(".md").removesuffix(".ipynb") for p in _toc_files(TOC)]
# Pages Sphinx adds on its own: the search page (its index loads from the site too) and the indexes.
PAGES += ["search", "genindex", "py-modindex"]
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
REPO = CONFIG["repository"]["url"].rstrip("/").split("github.com/")[-1]
BRANCH = CONFIG["repository"].get("branch", "main")
BOOK_PATH = (CONFIG["repository"].get("path_to_book") or "").strip("/")


def _is_notebook(page: str) -> bool:
    return (ROOT / f"{page}.ipynb").exists()


def _colab_url(page: str) -> str:
    path = f"{BOOK_PATH}/{page}.ipynb" if BOOK_PATH else f"{page}.ipynb"
    return f"https://colab.research.google.com/github/{REPO}/blob/{BRANCH}/{path}"


def _open(browser, site_url: str, page_path: str, width: int = 1280):
    context = browser.new_context(viewport={"width": width, "height": 900})
    problems: list[str] = []
    js_errors: list[str] = []

    def offline(route):  # the site must render with no network: anything not served here is a failure
        if route.request.url.startswith(site_url):
            route.continue_()
        else:
            problems.append(f"request leaving the site: {route.request.url[:120]}")
            route.abort()

    context.route(re.compile(r"^(?!data:).*"), offline)
    page = context.new_page()
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url[:120]} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
    page.on("pageerror", lambda e: js_errors.append(f"page error: {e}"))
    page.on("console", lambda m: m.type == "error" and js_errors.append(f"console error: {m.text}"))
    response = page.goto(f"{site_url}/{page_path}", wait_until="load")
    if response is None or response.status != 200:
        context.close()
        status = response.status if response else None
        pytest.fail(f"{page_path} was not served (HTTP {status}): was the site built from this _toc.yml?")
    # MathJax 3 typesets after load; its startup promise resolves once the page is done.
    page.evaluate("() => window.MathJax && MathJax.startup ? MathJax.startup.promise.then(() => true) : true")
    return context, page, problems, js_errors


def _not_allowed(errors: list[str]) -> list[str]:
    return [e for e in errors if not any(pattern in e for pattern in ALLOWED_JS_ERRORS)]


def _check_math(page) -> None:
    n_math = page.locator(".math").count()
    if n_math:
        page.wait_for_function("document.querySelectorAll('mjx-container').length > 0", timeout=20000)
        typeset = page.locator("mjx-container").count()
        assert typeset >= n_math, f"only {typeset} of {n_math} math elements were typeset"
        assert page.locator("mjx-merror").count() == 0, "MathJax reported a TeX error"
    labelled = page.locator("div.math[id^='equation-']")
    unnumbered = [labelled.nth(i).get_attribute("id") for i in range(labelled.count())
                  if labelled.nth(i).locator(".eqno").count() == 0]
    assert not unnumbered, f"labelled equations without a number: {unnumbered}"


def _check_images(page) -> None:
    broken = page.evaluate(
        "Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 80))"
    )
    assert not broken, f"images that did not load: {broken}"
    # Alt text: a notebook figure needs `mystnb: image: alt:` cell metadata (myst-nb's default alt is the file path).
    no_alt = page.evaluate(
        "Array.from(document.images).filter(i => !i.alt.trim() || i.alt.includes('_images/'))"
        ".map(i => i.src.slice(-24))"
    )
    assert not no_alt, f"figures without alt text (add it with scripts/add_alt_text.py): {no_alt}"
    # Captioned figures (MyST figures, or `mystnb: figure:` cell metadata) carry a number (numfig).
    unnumbered = page.evaluate(
        "Array.from(document.querySelectorAll('figure figcaption, div.figure p.caption'))"
        ".filter(c => !c.querySelector('.caption-number')).map(c => c.textContent.slice(0, 40))"
    )
    assert not unnumbered, f"captioned figures without a number: {unnumbered}"


def _check_widgets(page) -> None:
    # A notebook output shown as a widget view gets drawn by the site's widget manager from saved state.
    n_views = page.locator('script[type="application/vnd.jupyter.widget-view+json"]').count()
    if n_views:
        page.wait_for_function(
            "n => document.querySelectorAll('.jupyter-widgets.widget-inline-hbox, .jupyter-widgets.widget-box,"
            " .jupyter-widgets.widget-html, .jupyter-widgets.widget-slider, .widget-container, .lm-Widget')"
            ".length >= n", arg=1, timeout=20000)
        missing = page.evaluate(
            """() => Array.from(document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]'))
                 .filter(s => !s.parentElement.querySelector('.jupyter-widgets, .lm-Widget')).length"""
        )
        assert missing == 0, f"{missing} of {n_views} embedded widgets were not rendered"


def _check_colab(page, page_name: str) -> None:
    hrefs = page.eval_on_selector_all("a[href*='colab.research.google.com']", "as => as.map(a => a.href)")
    want = _colab_url(page_name)
    assert want in hrefs, f"no Colab link to {want}; found {hrefs}"


def _check_copy_buttons(page) -> None:
    n_code = page.locator("div.cell_input div.highlight, div.highlight-python div.highlight").count()
    if n_code:
        assert page.locator("button.copybtn").count() >= n_code, "code blocks without a copy button"


def _check_sliders(page) -> None:
    for root in page.locator(".ac-frames").all():
        shown = root.locator("img.ac-frame:visible")
        assert shown.count() == 1, "a static slider should show exactly one frame"
        before, value_before = shown.get_attribute("src"), root.locator("output").inner_text()
        rng = root.locator("input[type=range]")
        target = rng.get_attribute("max") if rng.get_attribute("value") != rng.get_attribute("max") else "0"
        rng.fill(target)
        after = root.locator("img.ac-frame:visible")
        assert after.count() == 1 and after.get_attribute("src") != before, "moving a static slider kept the figure"
        assert root.locator("output").inner_text() != value_before, "the slider's value label did not change"
        assert after.get_attribute("alt"), "a slider frame has no alt text"
    for root in page.locator(".ac-texts").all():  # sliders over texts (generated samples)
        shown = root.locator(".ac-text-frame:visible")
        assert shown.count() == 1, "a text slider should show exactly one text"
        before, value_before = shown.inner_text(), root.locator("output").inner_text()
        rng = root.locator("input[type=range]")
        target = rng.get_attribute("max") if rng.get_attribute("value") != rng.get_attribute("max") else "0"
        rng.fill(target)
        after = root.locator(".ac-text-frame:visible")
        assert after.count() == 1 and after.inner_text() != before, "moving a text slider kept the text"
        assert root.locator("output").inner_text() != value_before, "the text slider's value label did not change"


def _check_quizzes(page) -> None:
    for quiz in page.locator(".ac-quiz").all():
        assert quiz.locator("[data-correct]").count() == 0, "a quiz marks its right option in the page"
        encoded = quiz.get_attribute("data-answer") or ""
        assert encoded.startswith("acq1:"), "a quiz whose answer is not encoded"
        right, _, why = base64.b64decode(encoded[5:][::-1]).decode().partition("|")
        assert not why or why not in page.inner_text("body"), "a quiz's explanation is visible before an answer"
        feedback = quiz.locator(".ac-quiz-feedback")
        wrong = quiz.locator(f".ac-quiz-option:not([data-option='{right}'])").first
        wrong.scroll_into_view_if_needed()
        wrong.click()
        assert feedback.inner_text().startswith("Not quite"), "a wrong quiz answer gave no feedback"
        quiz.locator(f".ac-quiz-option[data-option='{right}']").click()
        assert feedback.inner_text().startswith("Correct"), "the right quiz answer was not confirmed"
        assert why.strip() in feedback.inner_text(), "the right quiz answer came without its explanation"


def _answer_forms(value: float) -> set:
    """How an answer would be written out in a page: at 4 significant digits and in full, and integers of 4 or
    more digits with and without thousands separators. Shorter forms (2.5, 0.88, 160) occur in any page for
    other reasons, so they are not searched for."""
    if value == int(value):
        return {str(int(value)), f"{int(value):,}"} if abs(value) >= 1000 else set()
    return {f for f in (f"{value:.4g}", repr(value)) if len(f.lstrip("-0.").replace(".", "")) >= 3}


def _check_answer_boxes(page) -> None:
    visible = page.inner_text("body")  # innerText leaves out folded solutions (hidden until clicked)
    for box in page.locator(".ac-answer").all():
        encoded = box.get_attribute("data-answer") or ""
        assert encoded.startswith("ac1:"), "an answer box whose answer is not encoded"
        assert not re.search(r"\be = [-+0-9.]", box.evaluate("b => b.nextElementSibling.textContent")), (
            "an answer box's script holds its answer in plain text")
        expected = float(base64.b64decode(encoded[4:][::-1]).decode())
        shown = sorted(f for f in _answer_forms(expected) if re.search(rf"(?<![\w.]){re.escape(f)}(?![\w])", visible))
        assert not shown, f"an exercise's answer is visible on the page before it is asked for: {shown}"
        box.locator(".ac-answer-input").fill(repr(expected * 3 + 7))
        box.locator(".ac-answer-check").click()
        assert "Not yet" in box.locator(".ac-answer-feedback").inner_text(), "a wrong answer was accepted"
        box.locator(".ac-answer-input").fill(repr(expected))
        box.locator(".ac-answer-check").click()
        assert "Correct" in box.locator(".ac-answer-feedback").inner_text(), "the right answer was rejected"


def _check_dropdowns(page) -> None:
    # Solutions are HTML <details> blocks (they fold in every notebook front end too): closed until clicked.
    assert page.locator("div.admonition.dropdown").count() == 0, "a MyST dropdown (plain text in a notebook)"
    for box in page.locator("article details").all():
        assert box.get_attribute("open") is None, "a solution is open before it is asked for"
        body = box.locator("> :not(summary)").first
        assert not body.is_visible(), "a solution is visible before it is asked for"
        box.locator("> summary").click()
        body.wait_for(state="visible", timeout=5000)


FULL_PAGE_MAX = 25_000  # px; taller pages (the API reference) get their first 8,000 px, a full shot costs ~30 s


def _screenshot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = str(SHOTS / f"{name.replace('/', '_')}.jpg")  # JPEG: about half the time of a PNG for a long page
    if page.evaluate("document.documentElement.scrollHeight") <= FULL_PAGE_MAX:
        page.screenshot(path=path, full_page=True, type="jpeg", quality=70, animations="disabled")
    else:
        size = page.viewport_size
        page.set_viewport_size({"width": size["width"], "height": 8000})
        page.screenshot(path=path, type="jpeg", quality=70, animations="disabled")
        page.set_viewport_size(size)


@pytest.mark.parametrize("page_name", PAGES)
def test_page(browser, site_url: str, page_name: str) -> None:
    context, page, problems, js_errors = _open(browser, site_url, f"{page_name}.html")
    try:
        _screenshot(page, page_name)  # as the reader first sees it (math typeset), before any check can fail
        _check_math(page)
        _check_images(page)
        _check_widgets(page)
        if _is_notebook(page_name):
            _check_colab(page, page_name)
            # Every chapter ends with exercises: a quiz answerable on the page and worked solutions behind a click.
            assert page.locator(".ac-quiz").count() >= 1, "a chapter without a quiz on the page"
            assert page.locator("article details").count() >= 1, "a chapter without folded solutions"
        _check_copy_buttons(page)
        _check_sliders(page)
        _check_quizzes(page)
        _check_answer_boxes(page)
        _check_dropdowns(page)
        assert not problems, "\n".join(problems)
        assert not _not_allowed(js_errors), "\n".join(_not_allowed(js_errors))
    finally:
        context.close()


def test_phone_width(browser, site_url: str) -> None:
    """The first chapter at a phone's width (390 px): the text fits, nothing scrolls sideways."""
    chapter = next(p for p in PAGES if _is_notebook(p))
    context, page, problems, js_errors = _open(browser, site_url, f"{chapter}.html", width=390)
    try:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "phone_390px.png"), full_page=False)
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"the page scrolls sideways by {overflow}px at 390px width"
        wide = page.evaluate(
            """() => Array.from(document.querySelectorAll('article p, article li, article h1, article h2, article img'))
                 .filter(e => e.getBoundingClientRect().right > window.innerWidth + 1)
                 .map(e => e.tagName + ': ' + (e.textContent || e.alt || '').slice(0, 40))"""
        )
        assert not wide, f"text or figures wider than the phone's screen: {wide[:5]}"
        assert not problems, "\n".join(problems)
        assert not _not_allowed(js_errors), "\n".join(_not_allowed(js_errors))
    finally:
        context.close()


def test_search_works_offline(browser, site_url: str) -> None:
    """The site's own search (searchindex.js, no server side) finds a word every chapter uses."""
    context, page, problems, js_errors = _open(browser, site_url, "search.html?q=softmax")
    try:
        page.wait_for_selector("#search-results ul.search li", timeout=20000)
        hits = page.locator("#search-results ul.search li a").evaluate_all("as => as.map(a => a.href)")
        assert any("/book/" in h for h in hits), f"no chapter in the results: {hits[:5]}"
        assert not problems, "\n".join(problems)
        assert not _not_allowed(js_errors), "\n".join(_not_allowed(js_errors))
    finally:
        context.close()
