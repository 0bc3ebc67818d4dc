"""What every chapter's first cell calls: seeding, print and plot defaults, the device.

``setup`` makes a notebook's outputs repeat run after run (with ``OMP_NUM_THREADS=1`` set by the canonical
execution). Progress bars live in :mod:`attention_core.training.progress` (the library's training loops use them too);
``progress`` is re-exported here for the chapters.
"""

from __future__ import annotations

import random

import torch

from attention_core.training.progress import progress, progress_enabled

__all__ = ["OKABE_ITO", "progress", "progress_enabled", "setup"]

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
