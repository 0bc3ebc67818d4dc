"""Progress bars for long loops (training, fitting), that repeatable runs switch off.

``progress`` is a tqdm bar (a widget in Jupyter, text in a terminal). A bar writes timings, which would make
stored notebook outputs differ from run to run, so it is disabled when the environment variable
``AC_PROGRESS`` is ``"0"`` (the canonical notebook run and the test suite set it).
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Iterator, TypeVar

__all__ = ["progress", "progress_enabled"]

T = TypeVar("T")


def progress_enabled() -> bool:
    """False when the environment variable ``AC_PROGRESS`` is ``"0"`` (the canonical, repeatable runs)."""
    return os.environ.get("AC_PROGRESS", "1") != "0"


def progress(iterable: Iterable[T], **kwargs: Any) -> Iterator[T]:
    """Wrap ``iterable`` in a tqdm progress bar (a widget in Jupyter, text in a terminal).

    The bar is disabled when ``AC_PROGRESS=0``, so that no timing text lands in a stored notebook.
    Keyword arguments go to ``tqdm.auto.tqdm`` (e.g. ``desc=``, ``total=``); an explicit ``disable=``
    wins over the environment.
    """
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the core installs without tqdm (it comes with the `book` extra): no bar, same loop
        return iter(iterable)
    kwargs.setdefault("disable", not progress_enabled())
    return tqdm(iterable, **kwargs)
