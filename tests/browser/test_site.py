"""Every page of the built site, opened in a real browser (Debian Chromium driven by Playwright).

For each page in _toc.yml: no failed request and no 4xx/5xx; every image decoded; math typeset where
the page has math; widgets rendered where a notebook embedded them; on notebook pages a Colab link that
points at that notebook; static sliders that change the figure; quizzes and answer boxes that give
feedback on a click; no JavaScript error except the ones listed in ALLOWED_JS_ERRORS with a reason.
A screenshot of every page goes to _build/screenshots/ (plus the first chapter at phone width).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "_build" / "screenshots"

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


PAGES = _toc_files(yaml.safe_load((ROOT / "_toc.yml").read_text()))
REPO_URL = yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"].rstrip("/")


def _is_notebook(page: str) -> bool:
    return (ROOT / f"{page}.ipynb").exists()


def _open(browser, site_url: str, page_path: str, width: int = 1280):
    context = browser.new_context(viewport={"width": width, "height": 900})
    page = context.new_page()
    problems: list[str] = []
    js_errors: list[str] = []
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
    page.on("pageerror", lambda e: js_errors.append(f"page error: {e}"))
    page.on("console", lambda m: m.type == "error" and js_errors.append(f"console error: {m.text}"))
    page.goto(f"{site_url}/{page_path}", wait_until="load")
    page.wait_for_load_state("networkidle")
    return context, page, problems, js_errors


def _not_allowed(errors: list[str]) -> list[str]:
    return [e for e in errors if not any(pattern in e for pattern in ALLOWED_JS_ERRORS)]


@pytest.mark.parametrize("page_name", PAGES)
def test_page(browser, site_url: str, page_name: str) -> None:
    context, page, problems, js_errors = _open(browser, site_url, f"{page_name}.html")
    try:
        # Math: every math node is typeset by the site's own MathJax.
        n_math = page.locator(".math").count()
        if n_math:
            page.wait_for_function("document.querySelectorAll('mjx-container').length > 0", timeout=20000)
            assert page.locator("mjx-container").count() >= n_math, "some math was not typeset"

        # Images: all decoded (hidden slider frames included).
        broken = page.evaluate(
            "Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 80))"
        )
        assert not broken, f"images that did not load: {broken}"

        # Widgets: a notebook that saved widget state gets them rendered by the site's widget manager.
        n_views = page.locator('script[type="application/vnd.jupyter.widget-view+json"]').count()
        if n_views:
            page.wait_for_selector(".jupyter-widgets", timeout=20000)

        # Colab: notebook pages link to Colab at this very notebook.
        if _is_notebook(page_name):
            hrefs = page.eval_on_selector_all("a[href*='colab.research.google.com']", "as => as.map(a => a.href)")
            repo = REPO_URL.split("github.com/")[-1]
            want = f"colab.research.google.com/github/{repo}/blob/main/{page_name}.ipynb"
            assert any(want in h for h in hrefs), f"no Colab link to {want}; found {hrefs}"

        # Static sliders change the figure shown.
        for root in page.locator(".ac-frames").all():
            before = root.locator("img.ac-frame:visible").get_attribute("src")
            last = root.locator("input[type=range]").get_attribute("max")
            root.locator("input[type=range]").fill(last)
            after = root.locator("img.ac-frame:visible").get_attribute("src")
            assert after != before, "moving a static slider did not change the figure"

        # Quizzes and answer boxes give feedback on a click.
        for quiz in page.locator(".ac-quiz").all():
            quiz.locator(".ac-quiz-option").first.click()
            assert quiz.locator(".ac-quiz-feedback").inner_text().strip(), "a quiz gave no feedback"
            quiz.locator(".ac-quiz-option[data-correct='1']").click()
            assert quiz.locator(".ac-quiz-feedback").inner_text().startswith("Correct")

        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"{page_name.replace('/', '_')}.png"), full_page=True)
        assert not problems, "\n".join(problems)
        assert not _not_allowed(js_errors), "\n".join(_not_allowed(js_errors))
    finally:
        context.close()


def test_phone_width(browser, site_url: str) -> None:
    """The first chapter at a phone's width (390 px): no horizontal overflow of the page itself."""
    chapter = next(p for p in PAGES if _is_notebook(p))
    context, page, problems, js_errors = _open(browser, site_url, f"{chapter}.html", width=390)
    try:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "phone_390px.png"), full_page=False)
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 1, f"the page scrolls sideways by {overflow}px at 390px width"
        assert not problems, "\n".join(problems)
    finally:
        context.close()
