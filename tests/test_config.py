"""The book's settings live in one place (_config.yml); these tests keep everything that repeats them in sync.

- the Colab install line of every notebook installs from the repository named in _config.yml, which is
  also where the Colab launch buttons point;
- the API page documents every module of attention_core;
- the Sphinx glue in site/ac_site.py keeps vendored scripts off the automatic list and resolves names
  the way Python does.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb"))
INSTALL = re.compile(
    r'%pip install -q "attention-core(?:\[(?P<extras>[\w,]+)\])? @ git\+(?P<url>https://[^"@]+?)(?:\.git)?(?:@[^"]+)?"'
)


def _first_code_cell(path: Path) -> str:
    nb = json.loads(path.read_text())
    return next("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


def test_repository_is_one_github_url() -> None:
    repo = CONFIG["repository"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", repo["url"]), repo["url"]
    assert repo.get("branch"), "repository.branch: the Colab links need a branch"
    assert CONFIG["launch_buttons"]["colab_url"] == "https://colab.research.google.com"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_colab_install_matches_repository(path: Path) -> None:
    first = _first_code_cell(path)
    match = INSTALL.search(first)
    assert match, f"{path.name}: the first code cell has no `%pip install -q \"attention-core @ git+...\"` line"
    assert match["url"].rstrip("/") == CONFIG["repository"]["url"].rstrip("/"), (
        f"{path.name} installs from {match['url']}, _config.yml names {CONFIG['repository']['url']}"
    )


def test_site_settings() -> None:
    sphinx = CONFIG["sphinx"]["config"]
    assert sphinx["numfig"] and sphinx["math_numfig"], "figures and equations are numbered"
    assert not sphinx["mathjax_path"].startswith(("http:", "https:", "//")), "MathJax comes from the site"
    assert all(not p.startswith(("http:", "https:", "//")) for p in sphinx["nb_ipywidgets_js"]), "no CDN"
    assert CONFIG["execute"]["execute_notebooks"] == "off", "the site shows the committed outputs"


def _public_modules() -> list:
    """Every public module and package of attention_core, at any depth. The backend modules are reached
    through the registry (``attention_core.backends``), which documents them; private modules start with _."""
    found = []
    for path in (ROOT / "attention_core").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if len(parts) == 1 or any(p.startswith("_") for p in parts) or (len(parts) > 2 and parts[1] == "backends"):
            continue
        found.append(".".join(parts))
    return found


def test_public_modules_are_found_recursively() -> None:
    modules = _public_modules()
    assert "attention_core.translation.train" in modules and "attention_core.booktools.widgets" in modules


def test_api_page_documents_every_module() -> None:
    """Each module has an ``automodule`` section, or all its public names sit in the public-API section."""
    import importlib

    api = (ROOT / "book" / "api.md").read_text()
    public = api.split("## ", 2)[1]  # the first section: names documented as attention_core.<name>
    modules = sorted(_public_modules())
    missing = []
    for name in modules:
        if f"automodule:: {name}\n" in api:
            continue
        names = getattr(importlib.import_module(name), "__all__", None) or ["<no __all__>"]
        if not all(re.search(rf":: {n}\n", public) for n in names):
            missing.append(name)
    assert not missing, f"book/api.md documents neither the module nor all its public names: {missing}"


# --- site/ac_site.py: the Sphinx glue -------------------------------------------------------------------

sys.path.insert(0, str(ROOT / "site"))
import ac_site  # noqa: E402


def test_vendored_scripts_leave_the_automatic_list() -> None:
    config = SimpleNamespace(
        html_js_files=["vendor/mathjax/input/tex/extensions/ams.js", "ac.js", ("vendor/require.js", {})],
        html_css_files=["ac.css", "vendor/x.css"],
    )
    ac_site._drop_vendor_scripts(None, config)
    assert config.html_js_files == ["ac.js"]
    assert config.html_css_files == ["ac.css"]


def test_repeated_inline_scripts_are_dropped_once() -> None:
    def js(filename, **attributes):
        return SimpleNamespace(filename=filename, attributes=attributes, priority=500)

    scripts = [js(None, body="const A = 1"), js("a.js"), js("", body="const A = 1"), js(None, body="const B = 2")]
    context = {"script_files": scripts}
    ac_site._drop_repeated_inline_scripts(None, "page", "page.html", context, None)
    assert [(s.filename, s.attributes.get("body")) for s in scripts] == [
        (None, "const A = 1"), ("a.js", None), (None, "const B = 2")
    ]


def test_lookup_follows_python_names() -> None:
    import attention_core
    import attention_core.functional

    assert ac_site._lookup("attention_core.scaled_dot_product_attention") is (
        attention_core.functional.scaled_dot_product_attention
    )
    assert ac_site._lookup("attention_core.no_such_name") is None
    assert ac_site._lookup("os.path") is None, "only the book's package is looked up"


def test_widget_manager_only_where_a_widget_view_is_shown() -> None:
    def js(filename, **attributes):
        return SimpleNamespace(filename=filename, attributes=attributes, priority=500)

    def page(body):
        scripts = [js("_static/doctools.js"), js(None, type=ac_site.WIDGET_STATE, body="{}"),
                   js("_static/vendor/require.js"), js("_static/vendor/embed-amd.js")]
        ac_site._drop_unused_widget_manager(None, "p", "page.html", {"script_files": scripts, "body": body}, None)
        return [s.filename for s in scripts]

    assert page("<p>static HTML only</p>") == ["_static/doctools.js"]
    shown = f'<script type="{ac_site.WIDGET_VIEW}">{{}}</script>'
    assert page(shown) == ["_static/doctools.js", None, "_static/vendor/require.js", "_static/vendor/embed-amd.js"]
