"""Put a number a cell computed into the chapter's text, so the prose cannot drift from the computation.

On the site, myst-nb's ``glue`` stores the value's display in the cell's output under a name, and the prose
inserts it with myst-nb's ``glue:text`` role (in braces, followed by the name in backticks). In a plain
Jupyter front end (Colab, JupyterLab without the book's build) myst-nb is usually not installed and the role
would show raw; there :func:`glue` just displays the value (or nothing, with ``display=False``), so the
chapter still runs and the reader still sees the number. The book's chapters prefer a literal number in the
prose with an ``assert`` beside it, which reads the same in every front end.

Usage in a chapter::

    from attention_core.booktools.glue import glue
    glue("exact_match", f"{exact_match:.3f}")     # shows '0.024' in the notebook; the site's prose can insert it
"""

from __future__ import annotations

from typing import Any

__all__ = ["glue", "myst_nb_available"]


def myst_nb_available() -> bool:
    """Whether ``myst_nb.glue`` can be imported here (the site build has it; Colab usually does not)."""
    try:
        from myst_nb import glue as _myst_glue  # noqa: F401
    except ImportError:
        return False
    return True


def _display(value: Any) -> None:
    try:
        from IPython.display import display as ipy_display
    except ImportError:  # no IPython at all (a plain script): print what a notebook would show
        print(value)
        return
    ipy_display(value)


def glue(name: str, value: Any, display: bool = True) -> None:
    """Store ``value`` under ``name`` for the book's prose (myst-nb), or just display it without myst-nb.

    Args:
        name: the key the prose refers to with the ``glue:text`` role; a non-empty ``str`` without whitespace.
        value: any object; what is stored (and shown) is its display, so glue a formatted string
            (``f"{acc:.3f}"``) when the text must not depend on the float's noise.
        display: show the value in the cell's output as well. With myst-nb and ``display=False`` the value is
            stored hidden (the site can still insert it); without myst-nb it is then neither shown nor stored.

    Raises:
        TypeError: if ``name`` is not a ``str``.
        ValueError: if ``name`` is empty or holds whitespace.
    """
    if not isinstance(name, str):
        raise TypeError(f"glue: name must be a str, got {type(name).__name__}")
    if not name or any(ch.isspace() for ch in name):
        raise ValueError(f"glue: name must be a non-empty key without whitespace, got {name!r}")
    try:
        from myst_nb import glue as myst_glue
    except ImportError:
        if display:
            _display(value)
        return
    myst_glue(name, value, display=display)
