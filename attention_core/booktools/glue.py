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

import math
from typing import Any, Iterable

__all__ = ["between", "glue", "myst_nb_available"]

_LADDER = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)  # the mantissas of the bounds :func:`between` may print


def _ladder_value(x: float, up: bool) -> float:
    """The smallest ladder value >= x (``up``) or the largest <= x: m * 10**k with m in ``_LADDER``."""
    k = math.floor(math.log10(x))
    steps = [m * 10.0 ** e for e in (k - 1, k, k + 1) for m in _LADDER]
    return min(v for v in steps if v >= x) if up else max(v for v in steps if v <= x)


def _ladder_text(v: float) -> str:
    k = math.floor(math.log10(v) + 1e-9)
    m = round(v / 10.0 ** k, 1)
    return f"{m:g}e{k:+03d}"


def between(values: Iterable[float], margin: float = 1.1) -> str:
    """Bounds on positive measurements that do not depend on the CPU's rounding: ``"1e-02 to 2e-02"``.

    A measured float such as an RMSE carries rounding noise of about 1e-6 of its size that changes with the CPU
    and torch's kernels, so its printed digits can differ on another machine. This prints instead a lower bound
    ``lo`` and an upper bound ``hi`` taken from the ladder 1, 1.5, 2, 3, 5, 7 times a power of ten, with
    ``lo <= min(values) / margin`` and ``hi >= max(values) * margin``: every value sits at least ``margin`` times
    inside its bounds, so noise cannot move a value across them, and the printed bounds change only if
    ``min / margin`` or ``max * margin`` crosses a ladder step (noise of 1e-6 relative does that for a tiny
    fraction of the possible values; nbval checks the chapters under two sets of CPU kernels). Put the claim's
    own ``assert`` beside the printed bounds: the bounds describe the measurement, the assert checks the claim.

    Args:
        values: one or more finite positive numbers (floats, or a tensor or array of them).
        margin: a float > 1: how far inside the bounds every value must sit.

    Returns:
        ``"lo to hi"`` with each bound written as ``2e-02`` or ``1.5e-02``.

    Raises:
        TypeError: if ``margin`` is not a real number.
        ValueError: if ``values`` is empty or holds a value that is not finite and positive, or ``margin <= 1``.
    """
    if isinstance(margin, bool) or not isinstance(margin, (int, float)):
        raise TypeError(f"between: margin must be a real number > 1, got {type(margin).__name__}")
    if not margin > 1 or not math.isfinite(margin):
        raise ValueError(f"between: margin must be a finite number > 1, got {margin!r}")
    flat = [float(v) for v in (values.flatten().tolist() if hasattr(values, "flatten") else values)]
    if not flat:
        raise ValueError("between: values is empty; expected at least one positive number")
    bad = [v for v in flat if not (math.isfinite(v) and v > 0)]
    if bad:
        raise ValueError(f"between: values must be finite and positive, got {bad[0]!r}")
    lo, hi = _ladder_value(min(flat) / margin, up=False), _ladder_value(max(flat) * margin, up=True)
    return f"{_ladder_text(lo)} to {_ladder_text(hi)}"


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
