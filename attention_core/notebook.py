"""Small helpers that every chapter's first cell calls: seeding, print and plot defaults, progress bars.

``setup`` makes a notebook's outputs repeat run after run (with ``OMP_NUM_THREADS=1`` set by the canonical
execution). ``progress`` is a tqdm bar that the canonical run switches off (``AC_PROGRESS=0``), because a
bar writes timings, which would make the stored outputs differ on every run.
"""

from __future__ import annotations

import os
import random
from typing import Any, Iterable, Iterator, TypeVar

import torch

__all__ = ["OKABE_ITO", "progress", "progress_enabled", "setup"]

T = TypeVar("T")

# Okabe & Ito's palette, distinguishable under the common colour-vision deficiencies (black dropped:
# the book draws the ground truth in black).
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442")

PLOT_DEFAULTS = {
    "figure.figsize": (6.4, 3.6),
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "font.size": 10,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "image.cmap": "viridis",
    "figure.constrained_layout.use": True,
}


def setup(seed: int = 0) -> torch.device:
    """Seed every RNG, set print and plot defaults, and return the device chapters compute on.

    Seeds Python's ``random``, numpy (if installed) and torch (CPU and every CUDA device) with ``seed``;
    sets ``torch.set_printoptions(precision=4)``; sets matplotlib defaults (figure size, fonts, the
    Okabe-Ito colour cycle, the viridis colormap) so that every figure in the book looks alike.

    Args:
        seed: the seed for every RNG.

    Returns:
        ``torch.device("cuda")`` when a CUDA device is available, else ``torch.device("cpu")``.
    """
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a dependency, but setup should not need it
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device
    torch.set_printoptions(precision=4)
    _set_plot_defaults()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _set_plot_defaults() -> None:
    import matplotlib as mpl
    from cycler import cycler

    mpl.rcParams.update(PLOT_DEFAULTS)
    mpl.rcParams["axes.prop_cycle"] = cycler(color=list(OKABE_ITO))


def progress_enabled() -> bool:
    """False when the environment variable ``AC_PROGRESS`` is ``"0"`` (the canonical, repeatable runs)."""
    return os.environ.get("AC_PROGRESS", "1") != "0"


def progress(iterable: Iterable[T], **kwargs: Any) -> Iterator[T]:
    """Wrap ``iterable`` in a tqdm progress bar (a widget in Jupyter, text in a terminal).

    The bar is disabled when ``AC_PROGRESS=0``, so that no timing text lands in a stored notebook.
    Keyword arguments go to ``tqdm.auto.tqdm`` (e.g. ``desc=``, ``total=``); an explicit ``disable=``
    wins over the environment.
    """
    from tqdm.auto import tqdm

    kwargs.setdefault("disable", not progress_enabled())
    return tqdm(iterable, **kwargs)
