"""Figures and a widget for the RNN attention chapters (3 and 4).

- :func:`plot_alignment`: one decoded example's attention weights, target digits against source words;
- :func:`plot_by_bucket`: accuracy per source-length bucket, one line per model (the bottleneck figure);
- :func:`plot_loss_curves`: the training curves stored in the checkpoint manifest;
- :func:`window_weights` and :class:`WindowExplorer`: Luong's local-p window (half-width ``D``, centre
  ``p_t``) laid over the raw scores of a trained model, with sliders, and a kernel-free version for the site.
"""

from __future__ import annotations

import base64
from typing import Any, Mapping, Optional, Sequence

import ipywidgets as widgets
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from attention_core.masks import padding_mask
from attention_core.notebook import OKABE_ITO
from attention_core.rnn_attention import local_attention_weights
from attention_core.viz import figure_to_png, plot_attention

__all__ = ["WindowExplorer", "plot_alignment", "plot_by_bucket", "plot_loss_curves", "window_weights"]


def plot_alignment(weights: torch.Tensor, src_tokens: Sequence[str], tgt_tokens: Sequence[str],
                   ax: Optional[Axes] = None, title: Optional[str] = None, colorbar: bool = False) -> Axes:
    """Heatmap of one example's alignment: (T, S) weights, rows = target tokens, columns = source words.

    Args:
        weights: (T, S) weights; extra rows/columns beyond the token lists (padding, steps after ``<eos>``)
            are cut off.
        src_tokens: the S source words shown on the x axis.
        tgt_tokens: the T target tokens shown on the y axis (e.g. the digits followed by ``<eos>``).
        ax: draw here; a new figure if None.
        title: panel title.
        colorbar: add a colour bar.
    """
    w = weights.detach().cpu()[: len(tgt_tokens), : len(src_tokens)]  # (T, S)
    ax = plot_attention(w, xlabels=list(src_tokens), ylabels=list(tgt_tokens), ax=ax, title=title,
                        xlabel="source word", ylabel="output token", vmax=1.0, colorbar=colorbar,
                        max_ticks=max(len(src_tokens), len(tgt_tokens)))
    ax.tick_params(axis="x", labelrotation=90)
    return ax


def plot_by_bucket(results: Mapping[str, Mapping[str, Any]], metric: str = "exact_match",
                   ax: Optional[Axes] = None, title: Optional[str] = None) -> Axes:
    """Accuracy per source-length bucket, one line per model.

    Args:
        results: model name -> the dict :func:`attention_core.metrics.evaluate_by_bucket` returns.
        metric: ``"exact_match"`` or ``"token_accuracy"``.
        ax: draw here; a new figure if None.
        title: panel title.
    """
    if metric not in ("exact_match", "token_accuracy"):
        raise ValueError(f"metric must be 'exact_match' or 'token_accuracy', got {metric!r}")
    ax = ax or _pyplot_ax()
    for i, (name, res) in enumerate(results.items()):
        buckets = res["buckets"]
        ax.plot(range(len(buckets)), [b[metric] for b in buckets], "o-", lw=2, color=OKABE_ITO[i % len(OKABE_ITO)],
                label=name)
    labels = [b["label"] for b in next(iter(results.values()))["buckets"]]
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("source length (words)")
    ax.set_ylabel(metric.replace("_", " "))
    if title:
        ax.set_title(title)
    ax.legend(loc="lower left")
    return ax


def _pyplot_ax() -> Axes:
    import matplotlib.pyplot as plt

    return plt.subplots()[1]


def plot_loss_curves(entries: Mapping[str, Mapping[str, Any]], ax: Optional[Axes] = None,
                     title: Optional[str] = None) -> Axes:
    """Training loss against step, from manifest entries (``losses`` averaged over ``loss_every`` steps).

    Args:
        entries: model name -> its manifest entry (see :func:`attention_core.training.manifest_entry`).
        ax: draw here; a new figure if None.
        title: panel title.
    """
    ax = ax or _pyplot_ax()
    for i, (name, e) in enumerate(entries.items()):
        every = e["loss_every"]
        steps = [every * (k + 1) for k in range(len(e["losses"]))]
        ax.plot(steps, e["losses"], lw=2, color=OKABE_ITO[i % len(OKABE_ITO)], label=name)
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("cross-entropy (log scale)")
    if title:
        ax.set_title(title)
    ax.legend(loc="upper right")
    return ax


def window_weights(scores: torch.Tensor, center: float, window: int, valid_len: Optional[int] = None,
                   gaussian: bool = True) -> torch.Tensor:
    """Luong's local weights of one query: (S,) raw scores -> (S,) weights around ``center`` = p_t.

    Softmax of the scores inside ``[p_t - D, p_t + D]`` (and inside the first ``valid_len`` positions), zero
    outside; times ``exp(-(s - p_t)^2 / (2 (D/2)^2))`` when ``gaussian`` (local-p).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be (S,) for one query, got shape {tuple(scores.shape)}")
    S = scores.shape[0]
    mask = None if valid_len is None else padding_mask(torch.tensor([valid_len], device=scores.device), S)  # (1, S)
    c = torch.tensor([[float(center)]], dtype=scores.dtype, device=scores.device)  # (1, 1)
    return local_attention_weights(scores[None, None], c, window, mask, gaussian=gaussian)[0, 0]  # -> (S,)


class WindowExplorer(widgets.VBox):
    """Move Luong's local-p window over one decoding step's raw scores from a trained model.

    Sliders choose the half-width ``D`` and the centre ``p_t``; the figure shows the raw scores, the global
    softmax weights, and the local-p weights (softmax inside the window times the Gaussian). A label reports
    the mass the window keeps. Displayed with ipywidgets 8, the output also carries the kernel-free version:
    two sliders over precomputed frames, one moving ``p_t`` at the default ``D``, one moving ``D`` at the
    default ``p_t``. Works with ipywidgets 7.7 and 8.x.

    Args:
        scores: (S,) raw scores of one query over the real source positions.
        src_tokens: the S source words.
        window: initial D.
        center: initial p_t.
        title: what the query is (shown above the figure).
    """

    def __init__(self, scores: torch.Tensor, src_tokens: Sequence[str], window: int = 3, center: float = 0.0,
                 title: str = "") -> None:
        if scores.dim() != 1 or scores.shape[0] != len(src_tokens):
            raise ValueError(f"scores must be (S,) with S = {len(src_tokens)} source words, got shape "
                             f"{tuple(scores.shape)}")
        self.scores = scores.detach().cpu().float()
        self.src_tokens = list(src_tokens)
        self.title = title
        S = len(self.src_tokens)
        self.window = widgets.IntSlider(value=window, min=0, max=max(8, window), description="D",
                                        continuous_update=False)
        self.center = widgets.FloatSlider(value=center, min=0.0, max=float(S - 1), step=0.5, description="p_t",
                                          readout_format=".1f", continuous_update=False)
        self.summary = widgets.Label()
        self.image = widgets.Image(format="png")
        super().__init__(children=[widgets.HBox([self.window, self.center]), self.summary, self.image])
        self._build()
        self.window.observe(self.redraw, names="value")
        self.center.observe(self.redraw, names="value")
        self.redraw()

    def describe(self, window: int, center: float) -> str:
        """The summary line for one setting: the kept mass and the most weighted word."""
        w = window_weights(self.scores, center, window)
        top = int(w.argmax())
        return (f"D = {window}, p_t = {center:.1f}: local-p keeps {float(w.sum()):.3f} of the mass, "
                f"most on '{self.src_tokens[top]}' (position {top}, weight {float(w[top]):.3f})")

    def _build(self) -> None:
        """Create the figure once; :meth:`figure` only moves its artists (much faster than redrawing)."""
        S = len(self.src_tokens)
        x = np.arange(S)
        fig = Figure(figsize=(9.0, 3.4), layout="constrained")  # not pyplot: no inline display, no leak
        ax0, ax1 = fig.subplots(1, 2)
        ax0.bar(x, self.scores.numpy(), color=OKABE_ITO[5])
        ax0.set_ylabel("raw score $e_{t,s}$")
        ax0.set_title("scores of the trained model")
        ax1.bar(x - 0.2, torch.softmax(self.scores, -1).numpy(), width=0.4, color=OKABE_ITO[0],
                label="global softmax")
        self._local = ax1.bar(x + 0.2, np.zeros(S), width=0.4, color=OKABE_ITO[1], label="local-p")
        self._span = ax1.axvspan(-0.5, 0.5, color="0.85", zorder=0)
        self._line = ax1.axvline(0.0, color="0.3", ls=":", lw=1.2, label="$p_t$")
        ax1.set_ylim(0, 1.02)
        ax1.set_ylabel("weight")
        self._title = ax1.set_title("")
        ax1.legend(loc="upper right")
        for ax in (ax0, ax1):
            ax.set_xticks(x, self.src_tokens, rotation=90)
            ax.set_xlabel("source word")
        if self.title:
            fig.suptitle(self.title, fontsize=10)
        self._title.set_text("global vs local-p weights: D = 0, $p_t$ = 0.0")  # a typical title, for the layout
        FigureCanvasAgg(fig).draw()  # settle the layout once, then keep it
        fig.set_layout_engine("none")
        self._fig = fig

    def figure(self, window: int, center: float) -> Figure:
        """The explorer's (off-screen, shared) figure, set to one setting."""
        local = window_weights(self.scores, center, window)
        for bar, h in zip(self._local, local.tolist()):
            bar.set_height(h)
        lo, hi = center - window - 0.5, center + window + 0.5
        self._span.set_x(lo)  # a Rectangle in axes-fraction height
        self._span.set_width(hi - lo)
        self._line.set_xdata([center, center])
        self._title.set_text(f"global vs local-p weights: D = {window}, $p_t$ = {center:.1f}")
        return self._fig

    def redraw(self, *_: Any) -> None:
        """Redraw for the current slider values (called on every change)."""
        D, p = int(self.window.value), float(self.center.value)
        self.summary.value = self.describe(D, p)
        self.image.value = figure_to_png(self.figure(D, p))

    def _uri(self, window: int, center: float, dpi: int = 60) -> str:
        png = figure_to_png(self.figure(window, center), dpi=dpi)
        return "data:image/png;base64," + base64.b64encode(png).decode("ascii")

    def static_html(self, centers: Optional[Sequence[float]] = None, windows: Sequence[int] = (0, 3, 6)
                    ) -> str:
        """Kernel-free version: frames over ``p_t`` (at the current D) and over ``D`` (at the current p_t).

        Args:
            centers: the p_t of the first slider's frames (default: five across the sentence, and the current p_t).
            windows: the D of the second slider's frames.
        """
        from attention_core.static import frame_slider

        D0, p0 = int(self.window.value), float(self.center.value)
        if centers is None:  # five frames across the sentence, plus the current p_t
            S = len(self.src_tokens)
            centers = sorted({float(c) for c in range(0, S, max(1, S // 4))} | {p0})
        centers = list(centers)
        by_center = frame_slider([self._uri(D0, c) for c in centers], [f"{c:.1f}" for c in centers],
                                 label=f"p_t (D = {D0})", alt="raw scores and local-p weights",
                                 initial=min(range(len(centers)), key=lambda i: abs(centers[i] - p0)))
        by_window = frame_slider([self._uri(D, p0) for D in windows], [str(D) for D in windows],
                                 label=f"D (p_t = {p0:.1f})", alt="raw scores and local-p weights",
                                 initial=min(range(len(windows)), key=lambda i: abs(windows[i] - D0)))
        self.figure(D0, p0)  # leave the shared figure at the widget's setting
        return by_center.markup + by_window.markup

    def _repr_mimebundle_(self, **kwargs: Any) -> dict | None:
        parent = getattr(super(), "_repr_mimebundle_", None)
        data = parent(**kwargs) if parent is not None else None
        if data is None:
            return data
        return {**data, "text/html": self.static_html()}
