"""The runner of the tables of refused calls (tests/test_errors.py, tests/test_fuzz_regressions.py)."""

from __future__ import annotations

from typing import Callable, Tuple

import pytest


def raises_as_listed(case: Tuple[Callable[[], object], type, str]) -> None:
    """``case`` is ``(call, exception type, pattern)``: ``call()`` raises that type with a message matching
    ``pattern`` (a regular expression, searched)."""
    call, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        call()
