"""Uninitialised memory filled with NaN while a kernel runs, so that a row its loops forgot shows up as NaN.

torch does this itself in deterministic mode (``torch.utils.deterministic.fill_uninitialized_memory``): every
``torch.empty``, ``empty_like`` and ``new_empty`` comes back NaN-filled; the kernels need no flag of their own.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.utils.deterministic


@contextmanager
def poisoned_memory() -> Iterator[None]:
    on, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(on, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def poison_from_now_on() -> None:
    """The same for a whole process (a test's subprocess)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
