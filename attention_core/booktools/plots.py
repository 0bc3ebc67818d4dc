"""Plotting helpers shared by the chapters: one look for every figure in the book.

Colours are colour-blind safe: ``viridis`` for heatmaps (perceptually uniform, readable in grey) and the
Okabe-Ito palette for lines. Every helper accepts tensors (CPU or GPU, with or without grad) as well as
numpy arrays and lists. Helpers that draw one panel take ``ax=None`` and return the ``Axes``; helpers that
draw several panels return the ``Figure``. In a notebook, assign the result (``ax = viz.plot_...``) so the
inline backend shows the figure exactly once, at the end of the cell.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Mapping, Sequence, Union

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from attention_core.booktools.session import OKABE_ITO

__all__ = [
    "HEATMAP_CMAP",
    "OKABE_ITO",
    "TRUTH_COLOR",
    "figure_to_png",
    "plot_attention",
    "plot_kernels",
    "plot_lines",
    "plot_regression",
    "to_numpy",
]

HEATMAP_CMAP = "viridis"
TRUTH_COLOR = "black"
DATA_COLOR = "0.55"  # grey for observed points: they are context, the curves are the message
PANEL_SIZE = (3.2, 2.8)  # inches per panel in multi-panel figures

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence[float]]


def to_numpy(x: ArrayLike) -> np.ndarray:
    """A float numpy array from a tensor (any device, detached), array or sequence."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _new_ax(ax: Axes | None, figsize: tuple | None = None) -> Axes:
    if ax is not None:
        return ax
    _, ax = plt.subplots(figsize=figsize)
    return ax


def _tick_positions(n: int, max_ticks: int) -> np.ndarray:
    if n <= max_ticks:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_ticks).round().astype(int))


def _fmt_label(label: Any) -> str:
    if isinstance(label, (float, np.floating)):
        return f"{label:.2g}"
    if isinstance(label, torch.Tensor):
        return _fmt_label(label.item())
    return str(label)


def plot_attention(
    weights: ArrayLike,
    xlabels: Sequence[Any] | None = None,
    ylabels: Sequence[Any] | None = None,
    ax: Axes | None = None,
    title: str | None = None,
    xlabel: str = "keys",
    ylabel: str = "queries",
    cmap: str = HEATMAP_CMAP,
    vmax: float | None = None,
    colorbar: bool = True,
    max_ticks: int = 12,
) -> Axes:
    """Heatmap of an attention matrix: one row per query, one column per key, with a colorbar.

    Args:
        weights: (L, S) weights, or any shape that is (L, S) after dropping leading dims of size 1.
        xlabels: optional S labels for the keys (numbers are shown with 2 significant digits; when there
            are more than ``max_ticks``, evenly spaced ones are shown).
        ylabels: optional L labels for the queries.
        ax: draw here; a new figure if None.
        title: optional panel title.
        xlabel, ylabel: axis titles.
        cmap: colormap, viridis by default (colour-blind safe).
        vmax: top of the colour scale (default: the largest weight); the bottom is 0.
        colorbar: add a colorbar.
        max_ticks: most tick labels per axis.

    Returns:
        The ``Axes`` (``ax.images[0]`` is the heatmap).
    """
    w = to_numpy(weights)
    while w.ndim > 2 and w.shape[0] == 1:
        w = w[0]
    if w.ndim != 2:
        raise ValueError(f"weights must be (L, S) (leading dims of size 1 allowed), got shape {w.shape}")
    L, S = w.shape
    for name, labels, n in (("xlabels", xlabels, S), ("ylabels", ylabels, L)):
        if labels is not None and len(labels) != n:
            raise ValueError(
                f"{name} must have {n} entries for weights of shape {w.shape}, got {len(labels)}"
            )
    ax = _new_ax(ax)
    im = ax.imshow(w, cmap=cmap, vmin=0.0, vmax=vmax, aspect="auto", interpolation="nearest")
    for labels, n, set_ticks, set_labels in (
        (xlabels, S, ax.set_xticks, ax.set_xticklabels),
        (ylabels, L, ax.set_yticks, ax.set_yticklabels),
    ):
        if labels is not None:
            pos = _tick_positions(n, max_ticks)
            set_ticks(pos)
            set_labels([_fmt_label(labels[i]) for i in pos])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if colorbar:
        ax.figure.colorbar(im, ax=ax, shrink=0.9)
    return ax


def plot_kernels(
    kernels: Mapping[str, Callable[[torch.Tensor], torch.Tensor]],
    u_max: float = 2.5,
    num: int = 501,
) -> Figure:
    """The kernels side by side, one panel each, as functions of the scaled distance ``u = (q - k) / h``.

    Args:
        kernels: name -> kernel function of a tensor ``u`` (e.g. :data:`attention_core.KERNELS`).
        u_max: the panels show ``u`` in ``[-u_max, u_max]``.
        num: number of evaluation points.

    Returns:
        The ``Figure``, one ``Axes`` per kernel, each with one line.
    """
    u = torch.linspace(-u_max, u_max, num, dtype=torch.float64)
    n = len(kernels)
    fig, axes = plt.subplots(1, n, figsize=(PANEL_SIZE[0] * n * 0.8, PANEL_SIZE[1] * 0.8), sharey=True)
    axes = np.atleast_1d(axes)
    for i, (ax, (name, fn)) in enumerate(zip(axes, kernels.items())):
        ku = to_numpy(fn(u))
        color = OKABE_ITO[i % len(OKABE_ITO)]
        ax.plot(to_numpy(u), ku, color=color, lw=2)
        ax.fill_between(to_numpy(u), ku, color=color, alpha=0.2, lw=0)
        ax.set_title(name)
        ax.set_xlabel("u = (q - k) / h")
        ax.axvline(0.0, color="0.8", lw=0.8, zorder=0)
    axes[0].set_ylabel("K(u)")
    return fig


def plot_regression(
    x_train: ArrayLike,
    y_train: ArrayLike,
    x_test: ArrayLike,
    predictions: Union[ArrayLike, Mapping[str, ArrayLike]],
    y_test: ArrayLike | None = None,
    ax: Axes | None = None,
    title: str | None = None,
    colors: Sequence[str] | None = None,
    legend: bool = True,
) -> Axes:
    """Training points, the true function and one or more fitted curves.

    Args:
        x_train, y_train: (n,) observed pairs, drawn as grey dots.
        x_test: (m,) points where the curves are evaluated.
        predictions: (m,) curve, or a mapping label -> (m,) curve (one Okabe-Ito colour each).
        y_test: optional (m,) true function, drawn as a black dashed line.
        ax: draw here; a new figure if None.
        title: optional title.
        colors: one colour per prediction (default: the Okabe-Ito palette in order).
        legend: draw a legend.

    Returns:
        The ``Axes`` (one line per prediction, plus one for ``y_test``; the dots are a collection).
    """
    ax = _new_ax(ax)
    xt = to_numpy(x_test)
    ax.scatter(to_numpy(x_train), to_numpy(y_train), s=12, color=DATA_COLOR, label="training data", zorder=1)
    if y_test is not None:
        ax.plot(xt, to_numpy(y_test), color=TRUTH_COLOR, ls="--", lw=1.2, label="true function", zorder=2)
    if not isinstance(predictions, Mapping):
        predictions = {"estimate": predictions}
    colors = list(colors) if colors is not None else list(OKABE_ITO)
    for i, (label, pred) in enumerate(predictions.items()):
        ax.plot(xt, to_numpy(pred), color=colors[i % len(colors)], lw=2, label=label, zorder=3)
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    if legend:
        ax.legend(loc="best")
    if title:
        ax.set_title(title)
    return ax


def _plain_log_ticks(axis: Any) -> None:
    """Log-axis ticks at 1, 2, 5 times powers of ten, labelled 0.2, 1, 50 rather than 2 x 10^-1."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_lines(
    x: ArrayLike,
    ys: Union[ArrayLike, Mapping[str, ArrayLike]],
    ax: Axes | None = None,
    xlabel: str = "",
    ylabel: str = "",
    title: str | None = None,
    logx: bool = False,
    logy: bool = False,
    markers: Mapping[str, float] | None = None,
) -> Axes:
    """One or more curves over a shared x (loss curves, errors against a hyperparameter).

    Args:
        x: (n,) x values.
        ys: (n,) curve, or a mapping label -> (n,) curve.
        ax: draw here; a new figure if None.
        xlabel, ylabel, title: labels.
        logx, logy: logarithmic axes.
        markers: optional label -> x position, drawn as dotted vertical lines (e.g. a chosen bandwidth).

    Returns:
        The ``Axes`` (one line per curve, plus one per marker).
    """
    ax = _new_ax(ax)
    xs = to_numpy(x)
    if not isinstance(ys, Mapping):
        ys = {"": ys}
    for i, (label, y) in enumerate(ys.items()):
        ax.plot(xs, to_numpy(y), color=OKABE_ITO[i % len(OKABE_ITO)], lw=2, label=label or None)
    for j, (label, pos) in enumerate((markers or {}).items()):
        ax.axvline(float(pos), color="0.3", ls=":" if j % 2 == 0 else "-.", lw=1.2, label=label)
    if logx:
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis)
    if logy:
        ax.set_yscale("log")
        _plain_log_ticks(ax.yaxis)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    if any(ys) or markers:
        ax.legend(loc="best")
    return ax


def figure_to_png(fig: Figure, dpi: int = 100) -> bytes:
    """The PNG bytes of ``fig`` (for an ``ipywidgets.Image``)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


