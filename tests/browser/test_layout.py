"""The site as a reader sees it: the page's chrome (headers, sidebars, buttons) never covers what it frames.

For the intro, the first chapter and the quiz page, at a phone's, a laptop's and a wide screen's width, served
over HTTP and opened from disk (file://), each test checks the layout with bounding boxes (no pixel comparison,
so fonts and anti-aliasing cannot make it flaky):

- one header bar and one search entry point on the page (a second header with its own search field is what
  an unpinned theme stack once produced: sphinx-book-theme 1.3.0 over pydata-sphinx-theme 0.17.1);
- no fixed or sticky element overlaps the sidebar's book title, the article's first heading or a widget
  (a widget is checked where a reader jumping to it would see it: scrolled to the top of the window);
- the sidebar title and the first heading are drawn on top: the browser's hit test at points spread over
  each of them finds that element, not something painted over it;
- where the sidebar is open (laptop and wide), the book's title lies wholly inside its visible part, also on a
  page far down the table of contents, where the theme scrolls the sidebar to the current entry.

A screenshot of the window as the reader first sees it goes to _build/screenshots/layout_*.png.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("AC_SITE_DIR", ROOT / "_build" / "html"))  # the folder conftest serves
SHOTS = SITE.parent / "screenshots"
# The pages of _toc.yml in order (`root:` first).
_FILES = [m.group(2).removesuffix(".md").removesuffix(".ipynb")
          for m in re.finditer(r"^\s*-?\s*(root|file):\s*(\S+)", (ROOT / "_toc.yml").read_text(), re.M)]
# The intro (a Markdown page), the first chapter (a notebook with figures, sliders and answer boxes), the quiz.
LAYOUT_PAGES = [_FILES[0], next(p for p in _FILES if (ROOT / f"{p}.ipynb").exists()), "book/quiz"]
WIDTHS = {"phone": 390, "laptop": 1280, "wide": 1600}
HEIGHT = 900

# Every function below runs in the page. `visible` means drawn with an area, inside the window.
_JS_HELPERS = """
const visible = e => {
  const r = e.getBoundingClientRect(), s = getComputedStyle(e);
  return r.width > 1 && r.height > 1 && s.visibility !== 'hidden' && parseFloat(s.opacity) > 0
    && e.checkVisibility() && r.right > 0 && r.bottom > 0 && r.left < innerWidth && r.top < innerHeight;
};
const outermost = els => els.filter(e => !els.some(o => o !== e && o.contains(e)));
const describe = e => {
  const cls = typeof e.className === 'string' ? e.className.trim().split(/\\s+/).slice(0, 2).join('.') : '';
  return e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') + (cls ? '.' + cls : '');
};
const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom].map(Math.round); };
const chrome = () => Array.from(document.querySelectorAll('body *')).filter(e => {
  const p = getComputedStyle(e).position; return (p === 'fixed' || p === 'sticky') && visible(e);
});
const overlaps = (target, name) => {
  const t = target.getBoundingClientRect(), out = [];
  for (const c of chrome()) {
    if (c.contains(target) || target.contains(c)) continue;
    const r = c.getBoundingClientRect();
    const w = Math.min(t.right, r.right) - Math.max(t.left, r.left);
    const h = Math.min(t.bottom, r.bottom) - Math.max(t.top, r.top);
    if (w > 1 && h > 1) out.push(`${describe(c)} ${JSON.stringify(box(c))} (${getComputedStyle(c).position}) `
      + `overlaps ${name} ${JSON.stringify(box(target))}`);
  }
  return out;
};
const covered = (target, name) => {  // the browser's hit test at a 3 x 3 grid inside the visible part
  const r = target.getBoundingClientRect(), out = [];
  const top = Math.max(r.top, 0), bottom = Math.min(r.bottom, innerHeight);
  for (const fx of [0.1, 0.5, 0.9]) for (const fy of [0.1, 0.5, 0.9]) {
    const x = r.left + fx * r.width, y = top + fy * (bottom - top);
    const hit = document.elementFromPoint(x, y);
    if (hit && !target.contains(hit)) {
      out.push(`${describe(hit)} is drawn over ${name} at (${Math.round(x)}, ${Math.round(y)})`);
      break;
    }
  }
  return out;
};
"""

_LAYOUT_JS = _JS_HELPERS + """
const problems = [];
const headers = outermost(Array.from(document.querySelectorAll(
  'header, [role="banner"], .bd-header, .bd-header-article')).filter(visible));
if (headers.length !== 1)
  problems.push(`${headers.length} header bars, want 1: `
    + headers.map(e => describe(e) + ' ' + JSON.stringify(box(e))).join(', '));
const searches = outermost(Array.from(document.querySelectorAll(
  '.search-button-field, .search-button, .bd-search, input[type="search"]')).filter(visible));
if (searches.length !== 1)
  problems.push(`${searches.length} search entry points, want 1: ${searches.map(describe).join(', ')}`);
const heading = document.querySelector('main article h1, article.bd-article h1');
const targets = [[heading, 'the first heading']];
const sidebar = document.querySelector('.bd-sidebar-primary');
const title = sidebar && sidebar.querySelector('.logo__title');
const folded = !sidebar || !visible(sidebar);  // on a phone the sidebar is a drawer, closed until asked for
if (!folded) {
  if (!title) problems.push('no book title in the sidebar');
  else {
    targets.push([title, 'the sidebar title']);
    const r = title.getBoundingClientRect(), s = sidebar.getBoundingClientRect();
    const top = Math.max(s.top, 0), bottom = Math.min(s.bottom, innerHeight);
    if (r.top < top - 1 || r.bottom > bottom + 1 || r.left < s.left - 1 || r.right > s.right + 1)
      problems.push(`the sidebar title ${JSON.stringify(box(title))} is not fully inside the visible sidebar `
        + `${JSON.stringify([s.left, top, s.right, bottom].map(Math.round))} (scrolled out or cut)`);
  }
}
if (!heading) problems.push('no <h1> in the article');
for (const [t, name] of targets) if (t) problems.push(...overlaps(t, name), ...covered(t, name));
return {problems, sidebar_open: !folded};
"""

_WIDGETS_JS = _JS_HELPERS + """
return outermost(Array.from(document.querySelectorAll(
  '.ac-quiz, .ac-frames, .ac-texts, .ac-answer, .jupyter-widgets, .widget-container'))).length;
"""

_WIDGET_JS = "i => {" + _JS_HELPERS + """
const w = outermost(Array.from(document.querySelectorAll(
  '.ac-quiz, .ac-frames, .ac-texts, .ac-answer, .jupyter-widgets, .widget-container')))[i];
w.scrollIntoView({block: 'start', behavior: 'instant'});  // where a link to it puts it (scroll-padding applies)
const name = 'widget ' + describe(w);
return [...overlaps(w, name), ...covered(w, name)];
}"""


def _fn(body: str) -> str:
    return "() => {" + body + "}"


def _url(scheme: str, site_url: str, site_dir: Path, page: str) -> str:
    return f"{site_url}/{page}.html" if scheme == "http" else (site_dir / f"{page}.html").resolve().as_uri()


@pytest.mark.parametrize("scheme", ["http", "file"])
@pytest.mark.parametrize("width_name", list(WIDTHS))
@pytest.mark.parametrize("page_name", LAYOUT_PAGES)
def test_chrome_covers_nothing(browser, site_url: str, page_name: str, width_name: str, scheme: str) -> None:
    context = browser.new_context(viewport={"width": WIDTHS[width_name], "height": HEIGHT})
    page = context.new_page()
    try:
        page.goto(_url(scheme, site_url, SITE, page_name), wait_until="load")
        # Layout settles once the fonts are in and MathJax has typeset the page.
        page.evaluate("() => document.fonts.ready.then(() => true)")
        page.evaluate("() => window.MathJax && MathJax.startup ? MathJax.startup.promise.then(() => true) : true")
        SHOTS.mkdir(parents=True, exist_ok=True)
        shot = SHOTS / f"layout_{page_name.replace('/', '_')}_{width_name}_{scheme}.png"
        page.screenshot(path=str(shot), animations="disabled")
        result = page.evaluate(_fn(_LAYOUT_JS))
        problems = list(result["problems"])
        if width_name != "phone":
            assert result["sidebar_open"], f"the sidebar is folded away at {WIDTHS[width_name]} px"
        for i in range(page.evaluate(_fn(_WIDGETS_JS))):
            problems += page.evaluate(_WIDGET_JS, i)
        assert not problems, f"{page_name} at {WIDTHS[width_name]} px over {scheme} (see {shot.name}):\n" + "\n".join(
            problems)
    finally:
        context.close()
