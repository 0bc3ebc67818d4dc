"""The exercises in a real notebook front end: JupyterLab from .venv, driven in Chromium.

JupyterLab is started on a free port of 127.0.0.1, with no token, on a copy of book/ (so that nothing it saves
touches the committed notebooks), with cell windowing off so that every cell is in the page. For two chapters:

- no answer is visible when the notebook opens (numbers, solution code, quiz explanations: the same answers
  tests/test_answers_hidden.py derives from the notebook), and a folded solution shows its text only after its
  <summary> is clicked;
- the kernel runs only the cells an exercise needs (the chapter's first code cell and the exercise's), and the
  exercise's Check button accepts the worked answer typed into it (chapter 5: a number box; chapter 2: the quiz).

Skips only when Chromium cannot be installed (scripts/ensure_chromium.sh); JupyterLab is always shut down.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from test_answers_hidden import (  # noqa: E402
    COINCIDENCES,
    ENCODED_NUMBER,
    ENCODED_QUIZ,
    number_forms,
    solution_code_lines,
)

from attention_core.booktools.exercises import CORRECT, decode_answer, decode_quiz  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
START_TIMEOUT_S = 120
KERNEL_TIMEOUT_MS = 180_000


def _chromium() -> str:
    if not Path(CHROMIUM).exists():
        done = subprocess.run([str(ROOT / "scripts" / "ensure_chromium.sh")], capture_output=True, text=True)
        if done.returncode != 0 or not Path(CHROMIUM).exists():
            pytest.skip(f"Chromium cannot be installed here: {done.stderr.strip()[:200]}")
    return CHROMIUM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1:<free port>, no token, serving a copy of book/; yields its base URL."""
    work = tmp_path_factory.mktemp("lab")
    shutil.copytree(ROOT / "book", work / "book")
    settings = work / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port = _free_port()
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(work / "config"), "JUPYTER_RUNTIME_DIR": str(work / "runtime")}
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               "--port-retries=0", "--IdentityProvider.token=", "--ServerApp.password=",
               "--ServerApp.disable_check_xsrf=True", f"--ServerApp.root_dir={work / 'book'}",
               f"--LabApp.user_settings_dir={work / 'settings'}", f"--LabApp.workspaces_dir={work / 'workspaces'}",
               "--LabApp.news_url=", "--LabApp.expose_app_in_browser=True",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI often run as root
        command.append("--allow-root")
    log = open(work / "lab.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=5).read()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail(f"JupyterLab did not start:\n{(work / 'lab.log').read_text()[-2000:]}")
                time.sleep(1)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture()
def page(lab, request):
    _chromium()  # skips when Chromium cannot be installed
    browser = request.getfixturevalue("browser")  # the session's Chromium (tests/browser/conftest.py)
    url = lab
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    # JupyterLab talks only to its own server: anything else would be a request off this machine.
    context.route(re.compile(r"^(?!data:|blob:).*"),
                  lambda route: route.continue_() if route.request.url.startswith(url) else route.abort())
    yield context.new_page(), url
    context.close()


def _open(page, url: str, name: str):
    page.goto(f"{url}/lab/tree/{name}?reset", wait_until="domcontentloaded")  # ?reset: this notebook alone
    panel = page.locator(".jp-NotebookPanel:visible")
    panel.locator(".jp-Cell").first.wait_for(timeout=120_000)
    page.wait_for_function(  # every cell of the notebook is in the page (windowing off), its markdown rendered
        "n => document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell').length >= n",
        arg=len(nbformat.read(ROOT / "book" / name, as_version=4).cells), timeout=120_000)
    return panel


def _answers(name: str) -> list[str]:
    nb = nbformat.read(ROOT / "book" / name, as_version=4)
    sources = "\n".join(c.source for c in nb.cells)
    found = [f for e in set(ENCODED_NUMBER.findall(sources)) for f in number_forms(decode_answer(e))
             if (name, f) not in COINCIDENCES]
    found += [decode_quiz(e)[1] for e in set(ENCODED_QUIZ.findall(sources))]
    return found + sorted(solution_code_lines(nb))


def _visible(panel) -> str:
    return " ".join(panel.inner_text().split())  # innerText leaves out what a closed <details> hides


def _visible_everywhere(page, panel) -> str:
    """The notebook's visible text from top to bottom: scrolled through, since editors draw lazily."""
    cells = nbformat.read(ROOT / "book" / panel_name(page), as_version=4).cells
    n_markdown = sum(c.cell_type == "markdown" for c in cells)
    page.wait_for_function("n => document.querySelectorAll('.jp-NotebookPanel:not(.lm-mod-hidden) "
                           ".jp-MarkdownCell.jp-mod-rendered .jp-RenderedMarkdown').length >= n",
                           arg=n_markdown, timeout=120_000)
    scroller = panel.locator(".jp-WindowedPanel-outer").first
    texts, top = [], 0
    while top <= scroller.evaluate("e => e.scrollHeight"):
        scroller.evaluate("(e, y) => e.scrollTo(0, y)", top)
        page.wait_for_timeout(50)
        texts.append(_visible(panel))
        top += 600
    scroller.evaluate("e => e.scrollTo(0, 0)")
    return " ".join(texts)


def panel_name(page) -> str:
    return page.url.split("/lab/tree/")[-1].split("?")[0]


def _assert_nothing_shown(page, panel, name: str) -> None:
    shown = _visible_everywhere(page, panel)
    compact = re.sub(r"\s+", "", shown)
    leaks = [a for a in _answers(name) if a and (re.search(rf"(?<![\w.]){re.escape(a)}(?![\w])", shown)
                                                 or (len(a) >= 20 and re.sub(r"\s+", "", a) in compact))]
    assert not leaks, f"{name}: answers visible in JupyterLab before they are asked for: {leaks[:5]}"


def _unfold_one(panel) -> None:
    details = panel.locator(".jp-MarkdownCell details").first
    body = details.locator(":scope > :not(summary)").first
    assert not body.is_visible(), "a folded solution's text is visible before its summary is clicked"
    details.locator(":scope > summary").click()
    body.wait_for(state="visible", timeout=10_000)
    assert len(details.inner_text()) > len(details.locator(":scope > summary").inner_text()) + 20


def _run_cells(page, panel, *needles: str) -> list:
    """Clear every output, then run the first code cell and the code cells whose source contains each needle,
    in order, each to completion; returns the locators of the cells run for the needles."""
    page.evaluate("() => window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
    cells = panel.locator(".jp-CodeCell")
    sources = [" ".join(c.split()) for c in cells.evaluate_all(
        "cs => cs.map(c => (c.querySelector('.jp-InputArea-editor') || {}).textContent || '')")]
    indices = [0] + [next(i for i, s in enumerate(sources) if " ".join(needle.split()) in s) for needle in needles]
    for i in indices:
        cell = cells.nth(i)
        cell.locator(".jp-InputPrompt").click()
        page.keyboard.press("Escape")
        page.keyboard.press("Control+Enter")
        page.wait_for_function("c => /\\[\\d+\\]/.test(c.querySelector('.jp-InputPrompt').textContent)",
                               arg=cell.element_handle(), timeout=KERNEL_TIMEOUT_MS)
        outputs = " ".join(cell.locator(".jp-OutputArea").all_inner_texts())
        assert "Traceback" not in outputs and "Error" not in outputs, f"cell {i} raised: {outputs[-400:]}"
    return [cells.nth(i) for i in indices[1:]]


def _wait_text(page, element, text: str) -> None:
    page.wait_for_function("([e, t]) => e.textContent.includes(t)", arg=[element.element_handle(), text],
                           timeout=30_000)


def _open_exercise(page, name: str, start: str):
    """Open chapter ``name``, check that it shows no answer, unfold one fold; returns the page, the notebook panel
    and the source of the exercise cell that starts with ``start``."""
    page, url = page
    panel = _open(page, url, name)
    _assert_nothing_shown(page, panel, name)
    _unfold_one(panel)
    nb = nbformat.read(ROOT / "book" / name, as_version=4)
    return page, panel, next(c.source for c in nb.cells if c.source.startswith(start))


def test_chapter_5_hides_its_answers_and_checks_a_number(page) -> None:
    page, panel, source = _open_exercise(page, "05_self_attention.ipynb", "ex1 = exercises.check_value(")
    worked = decode_answer(ENCODED_NUMBER.search(source).group(1))
    (cell,) = _run_cells(page, panel, source.splitlines()[0])
    box = cell.locator(".widget-text input")
    box.wait_for(timeout=60_000)
    feedback = cell.locator(".widget-html").last
    box.fill(repr(worked * 3 + 7))
    cell.locator("button:has-text('Check')").click()
    _wait_text(page, feedback, "Not yet")
    box.fill(repr(worked))
    cell.locator("button:has-text('Check')").click()
    _wait_text(page, feedback, CORRECT)


def test_chapter_2_hides_its_answers_and_checks_the_quiz(page) -> None:
    page, panel, source = _open_exercise(page, "02_scoring_functions.ipynb", "quiz = exercises.quiz(")
    right, why = decode_quiz(ENCODED_QUIZ.search(source).group(1))
    (cell,) = _run_cells(page, panel, source.splitlines()[0])
    radios = cell.locator(".widget-radio-box input[type=radio]")
    radios.first.wait_for(timeout=60_000)
    assert why not in _visible(panel), "the quiz's explanation is visible before an answer"
    feedback = cell.locator(".widget-html").last
    radios.nth((right + 1) % radios.count()).check()
    cell.locator("button:has-text('Check')").click()
    _wait_text(page, feedback, "Not yet")
    radios.nth(right).check()
    cell.locator("button:has-text('Check')").click()
    _wait_text(page, feedback, CORRECT)
    assert why in _visible(panel), "the right answer came without its explanation"
