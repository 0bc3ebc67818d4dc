"""Sphinx glue for the book's self-contained site (loaded through ``sphinx.local_extensions`` in _config.yml).

jupyter-book 1.x adds *every* ``.js`` file found under the static folders to every page. The vendored
JavaScript in ``_static/vendor`` (MathJax 3 with its extensions, require.js, the ipywidgets HTML manager;
see ``make site-assets``) must not load that way: MathJax loads its own extensions on demand, and the
widget manager must come after require.js. This extension removes those automatic entries, so the only
vendored scripts on a page are the ones listed explicitly in _config.yml (``mathjax_path`` and
``nb_ipywidgets_js``).

It also resolves cross-references the way Python resolves names: a docstring may name a function by
the path a reader imports it from (``attention_core.use_backend``) or by its short name inside the module
that imports it, while the API page documents it once, under one path. The reference then points at
that page entry when both paths are the same Python object.

It also drops a repeated inline script: sphinx-thebe 0.3.1 registers its ``const THEBE_JS_URL = ...``
snippet twice with this Sphinx, and the second copy throws "Identifier 'THEBE_JS_URL' has already been
declared" on every page.
"""

from __future__ import annotations

import importlib
from typing import Any

VENDOR_PREFIX = "vendor/"


def _name(entry: Any) -> str:
    return entry[0] if isinstance(entry, (tuple, list)) else str(entry)


def _drop_vendor_scripts(app: Any, config: Any) -> None:
    config.html_js_files = [e for e in config.html_js_files if not _name(e).startswith(VENDOR_PREFIX)]
    config.html_css_files = [e for e in config.html_css_files if not _name(e).startswith(VENDOR_PREFIX)]


def _drop_repeated_inline_scripts(app: Any, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    seen: set = set()
    kept = []
    for script in scripts:
        body = getattr(script, "attributes", {}).get("body")
        key = (getattr(script, "filename", None) or "", body)
        if body and key in seen:
            continue
        seen.add(key)
        kept.append(script)
    scripts[:] = kept


# The ipywidgets HTML manager (embed-amd.js) loads its icon fonts from the folder of the URL that require.js
# gives a module's id, by default relative to the page (book/@jupyter-widgets/html-manager/dist/... for the
# manager, book/@jupyter-widgets/ for the controls it draws: 404s). This snippet, placed between require.js
# and embed-amd.js, maps both ids to the folder require.js came from, where `make site-assets` put the fonts.
WIDGET_PATHS = """(function () {
  var s = document.querySelector('script[src*="vendor/require.js"]');
  if (!s || !window.require) return;
  var base = s.src.replace(/require\\.js(\\?.*)?$/, "");
  base = base.replace(/\\/$/, "");
  require.config({paths: {"@jupyter-widgets/html-manager/dist": base, "@jupyter-widgets": base}});
})();"""


def _add_widget_paths(app: Any, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    scripts = context.get("script_files")
    if not isinstance(scripts, list):
        return
    names = [str(getattr(s, "filename", None) or "") for s in scripts]
    require = "_static/" + VENDOR_PREFIX + "require.js"  # the page context names static files with their folder
    if require not in names:
        return
    at = names.index(require)
    app.add_js_file(None, body=WIDGET_PATHS, priority=scripts[at].priority)  # appended to `scripts`
    scripts.insert(at + 1, scripts.pop())  # same priority, so the stable sort keeps it right after require.js


PACKAGE = "attention_core"


def _lookup(path: str) -> Any:
    """The Python object at a dotted ``path`` inside the package, or None."""
    if not path.startswith(PACKAGE):
        return None
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return None
        return obj
    return None


def _resolve_alias(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip(".~")
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = [target]
    if module:
        candidates += [f"{module}.{cls}.{target}", f"{module}.{target}"] if cls else [f"{module}.{target}"]
    domain = env.get_domain("py")
    last = target.rsplit(".", 1)[-1]
    for candidate in candidates:
        obj = _lookup(candidate)
        if obj is None:
            continue
        for name in domain.objects:  # the documented entry holding this very object
            if name != candidate and name.rsplit(".", 1)[-1] == last and _lookup(name) is obj:
                return domain.resolve_xref(env, node["refdoc"], app.builder, "obj", name, node, contnode)
    # A short name used in a docstring shown under another path (e.g. ``leave_one_out_mask`` in the
    # docstring of ``attention_core.nadaraya_watson_weights``): accept the one documented entry of that name.
    if "." not in target:
        matches = [name for name in domain.objects
                   if name.startswith(PACKAGE + ".") and name.rsplit(".", 1)[-1] == target]
        if len({id(_lookup(name)) for name in matches}) == 1:
            return domain.resolve_xref(env, node["refdoc"], app.builder, "obj", matches[0], node, contnode)
    return None


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


def _drop_unused_widget_manager(app: Any, pagename: str, templatename: str, context: dict, doctree: Any) -> None:
    """No widget view on the page (every widget output shows its static HTML): no widget state, no manager.

    The saved widget state stays in the notebook (Jupyter and Colab use it); on the page it would only make
    the browser download and parse the state and start require.js and the widget manager for nothing.
    """
    scripts = context.get("script_files")
    if not isinstance(scripts, list) or WIDGET_VIEW in context.get("body", ""):
        return
    widget_files = {"_static/" + VENDOR_PREFIX + name for name in ("require.js", "embed-amd.js")}
    scripts[:] = [
        s for s in scripts
        if str(getattr(s, "filename", None) or "") not in widget_files
        and getattr(s, "attributes", {}).get("type") != WIDGET_STATE
    ]


def setup(app: Any) -> dict:
    app.connect("config-inited", _drop_vendor_scripts, priority=100)
    app.connect("html-page-context", _drop_repeated_inline_scripts)
    app.connect("missing-reference", _resolve_alias)
    # After myst-nb adds the widget scripts (priority 500):
    app.connect("html-page-context", _drop_unused_widget_manager, priority=890)
    app.connect("html-page-context", _add_widget_paths, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
