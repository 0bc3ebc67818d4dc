"""The book's interactive figures: each a live ipywidgets widget with a kernel-free twin for the site.

- :class:`BandwidthExplorer` (chapter 1): a bandwidth slider and a kernel menu over a Nadaraya-Watson fit;
- :class:`WindowExplorer` (chapter 4): Luong's local-p window over one decoding step's raw scores;
- :class:`HeadExplorer` (chapter 10): a layer and head selector over one sentence's attention maps;
- :class:`GenerationExplorer` (chapter 11): prompt, temperature, top-k and length over a model's continuation
  (its twin is a slider over precomputed texts).

Each shows its result inside a widget, a figure drawn off-screen into an ``ipywidgets.Image`` or text in an
``ipywidgets.HTML`` (never through an ``Output`` widget, so nothing leaks into the cell's outputs and the saved
widget state holds the result), and gets its static twin from one mechanism,
:class:`~attention_core.booktools.static.StaticTwin`: a slider over precomputed frames that the rendered site
shows where no kernel runs. They work with ipywidgets 7.7 (Colab) and 8.x.
"""

from __future__ import annotations

import base64
import html
import math
from typing import Any, Callable, List, Optional, Sequence, Tuple

import ipywidgets as widgets
import matplotlib
import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from attention_core._checks import fmt_shape
from attention_core.booktools.plots import (
    HEATMAP_CMAP,
    OKABE_ITO,
    figure_to_png,
    plot_attention,
    plot_regression,
    to_numpy,
)
from attention_core.booktools.static import StaticTwin, frame_slider, text_slider
from attention_core.kernel_regression import nadaraya_watson_weights
from attention_core.masks import padding_mask
from attention_core.models.rnn_attention import local_attention_weights
from attention_core.pretrained.inspection import attention_entropy

__all__ = [
    "BandwidthExplorer",
    "GenerationExplorer",
    "HeadExplorer",
    "WindowExplorer",
    "bandwidth_explorer",
    "head_explorer",
    "window_weights",
]


class _FigureExplorer(StaticTwin, widgets.VBox):
    """An explorer laid out as a row of controls over a summary line and a figure: a subclass makes its controls,
    then calls :meth:`_assemble` with them, and draws in ``redraw`` (called now and whenever a control changes)."""

    def _assemble(self, *controls: widgets.Widget) -> None:
        self.summary = widgets.Label()
        self.image = widgets.Image(format="png")
        super().__init__(children=[widgets.HBox(list(controls)), self.summary, self.image])
        for control in controls:
            control.observe(self.redraw, names="value")
        self.redraw()


# ------------------------------------------------------------------------------ chapter 1: kernel regression


class BandwidthExplorer(_FigureExplorer):
    """An interactive Nadaraya-Watson fit: a bandwidth slider and a kernel menu over a live figure.

    The figure shows the fit (left) and the attention weights of one query over the keys (right); a text
    line reports the test error. The figure is drawn off-screen into an ``ipywidgets.Image``, not through
    an ``Output`` widget, so it never leaks into the cell's own outputs (under nbval, say) and the saved
    widget state holds it. Displayed with ipywidgets 8, the output also carries a static version for the
    rendered site, where no kernel runs: a slider over precomputed frames, one per bandwidth in
    ``static_bandwidths`` (see :mod:`attention_core.booktools.static`). Works with ipywidgets 7.7 and 8.x.

    Args:
        x_train, y_train: (n,) training inputs (the keys) and targets (the values).
        x_test, y_test: (m,) test inputs (queries) and true function values.
        kernels: the kernel names on offer (the first is selected).
        bandwidth: the slider's initial ``h`` (log-scaled slider from 0.01 to 10).
        query: the query whose weights are drawn on the right.
        static_bandwidths: the frames of the static version for the rendered site (None: no static version).

    Attributes:
        slider: the ``FloatLogSlider`` for ``h`` (0.01 to 10).
        kernel: the kernel ``Dropdown``.
        summary: a ``Label`` with the kernel, ``h`` and the test error.
        image: the ``Image`` holding the current figure as PNG.
    """

    def __init__(
        self,
        x_train: torch.Tensor,
        y_train: torch.Tensor,
        x_test: torch.Tensor,
        y_test: torch.Tensor,
        kernels: Sequence[str] = ("gaussian", "boxcar", "epanechnikov"),
        bandwidth: float = 0.3,
        query: float = 2.5,
        static_bandwidths: Sequence[float] | None = (0.02, 0.05, 0.15, 0.3, 0.6, 1.5),
    ) -> None:
        self._data = (x_train, y_train, x_test, y_test)
        self._query = float(query)
        self.static_bandwidths = None if static_bandwidths is None else [float(h) for h in static_bandwidths]
        self.slider = widgets.FloatLogSlider(
            value=bandwidth, base=10, min=-2, max=1, step=0.05, description="h", readout_format=".3f",
            continuous_update=False,
        )
        self.kernel = widgets.Dropdown(options=list(kernels), value=kernels[0], description="kernel")
        self._assemble(self.kernel, self.slider)

    def figure(self, bandwidth: float, kernel: str) -> tuple[Figure, float]:
        """The explorer's figure for one setting (an off-screen ``Figure``) and the test error it shows."""
        x_train, y_train, x_test, y_test = self._data
        q = torch.tensor([self._query], dtype=x_train.dtype)
        w = nadaraya_watson_weights(x_test, x_train, kernel, bandwidth)  # (m, n)
        pred = w @ y_train  # (m, n) @ (n,) -> (m,)
        mse = float((pred - y_test).pow(2).mean())
        w_q = nadaraya_watson_weights(q, x_train, kernel, bandwidth)[0]  # (1, n) -> (n,)
        fig = Figure(figsize=(9.0, 3.2), layout="constrained")  # not pyplot: no inline display, no leak
        ax0, ax1 = fig.subplots(1, 2)
        plot_regression(x_train, y_train, x_test, {f"NW, h = {bandwidth:.3f}": pred}, y_test, ax=ax0)
        ax1.vlines(to_numpy(x_train), 0.0, to_numpy(w_q), color=OKABE_ITO[0], lw=1.5)
        ax1.plot(to_numpy(x_train), to_numpy(w_q), "o", color=OKABE_ITO[0], ms=3)
        for ax in (ax0, ax1):
            ax.axvline(self._query, color="0.6", lw=0.8, ls=":")
        ax1.set_xlabel("key $x_i$")
        ax1.set_ylabel(f"weight $\\alpha({self._query:g}, x_i)$")
        ax1.set_xlim(ax0.get_xlim())
        fig.suptitle(f"{kernel} kernel, h = {bandwidth:.3f}: test MSE = {mse:.4f}", fontsize=10)
        return fig, mse

    def redraw(self, *_: Any) -> None:
        """Redraw for the current slider and menu values (called on every change)."""
        h, name = float(self.slider.value), self.kernel.value
        fig, mse = self.figure(h, name)
        self.summary.value = f"{name} kernel, h = {h:.3f}: test MSE = {mse:.4f}"
        self.image.value = figure_to_png(fig)

    def static_html(self) -> str:
        """The kernel-free version: a slider over one precomputed frame per static bandwidth."""
        if self.static_bandwidths is None:
            return ""
        hs = self.static_bandwidths or [float(self.slider.value)]
        name = self.kernel.value
        initial = min(range(len(hs)), key=lambda i: abs(math.log(hs[i] / float(self.slider.value))))
        frames = [self.figure(h, name)[0] for h in hs]
        return frame_slider(
            frames, [f"{h:g}" for h in hs], label=f"bandwidth h ({name} kernel)",
            alt=f"Nadaraya-Watson fit and the weights of the query x = {self._query:g}", initial=initial,
        ).markup



#: The chapter-1 explorer for the training pairs (keys, values) and the test grid; another name for
#: :class:`BandwidthExplorer`, with the same arguments.
bandwidth_explorer = BandwidthExplorer


# ------------------------------------------------------------------------------- chapter 4: Luong's window


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


class WindowExplorer(_FigureExplorer):
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
        self._build()
        self._assemble(self.window, self.center)

    def describe(self, window: int, center: float) -> str:
        """The summary line for one setting: the kept mass and the most weighted word."""
        w = window_weights(self.scores, center, window)
        if not bool((w > 0).any()):  # D = 0 at a fractional p_t: no word within the window
            return f"D = {window}, p_t = {center:.1f}: the window holds no word (local-p keeps no weight)"
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


# ------------------------------------------------------------------------ chapter 10: the heads of MiniLM


class HeadExplorer(_FigureExplorer):
    """A layer and head selector over one sentence's attention maps, with a static version for the site.

    Args:
        attentions: one (H, L, L) tensor per layer, for one sentence (padding removed).
        tokens: the L tokens (labels of rows and columns).
        layer: initial layer, 1-based (layer 1 is the first encoder layer).
        head: initial head, 0-based.

    Attributes:
        layer, head: the two ``IntSlider`` selectors.
        summary: a ``Label`` describing the map shown (entropy, strongest link).
        image: the ``Image`` holding the current figure.
    """

    def __init__(self, attentions: Sequence[torch.Tensor], tokens: Sequence[str], layer: int = 1, head: int = 0):
        self.weights = torch.stack([a.detach().float().cpu() for a in attentions])  # (N, H, L, L)
        N, H, L, S = self.weights.shape
        if L != S or len(tokens) != L:
            raise ValueError(f"attentions must be (H, L, L) per layer with L = len(tokens) = {len(tokens)}, "
                             f"got {fmt_shape(self.weights.shape[1:])}")
        if not (1 <= layer <= N and 0 <= head < H):
            raise ValueError(f"layer must be in [1, {N}] and head in [0, {H - 1}], got layer={layer}, head={head}")
        self.tokens = list(tokens)
        self.layer = widgets.IntSlider(value=layer, min=1, max=N, description="layer", continuous_update=False)
        self.head = widgets.IntSlider(value=head, min=0, max=H - 1, description="head", continuous_update=False)
        self._assemble(self.layer, self.head)

    def describe(self, layer: int, head: int) -> str:
        """One line about a head's map: its mean entropy and its largest weight."""
        w = self.weights[layer - 1, head]  # (L, L)
        ent = attention_entropy([w[None, None]], torch.ones(1, w.shape[0], dtype=torch.bool))[0, 0]
        q, k = divmod(int(w.argmax()), w.shape[1])
        return (f"layer {layer}, head {head}: mean entropy {float(ent):.2f} nats "
                f"(uniform: {math.log(w.shape[1]):.2f}); largest weight {float(w[q, k]):.2f}, "
                f"from {self.tokens[q]!r} to {self.tokens[k]!r}")

    def figure(self, layer: int, head: int) -> Figure:
        """The map of one head, off-screen."""
        fig = Figure(figsize=(5.2, 4.2), layout="constrained")
        plot_attention(self.weights[layer - 1, head], self.tokens, self.tokens, ax=fig.subplots(),
                       vmax=1.0, title=f"layer {layer}, head {head}")
        return fig

    def grid(self, layer: int, cols: int = 4) -> Figure:
        """Every head of one layer as one mosaic image (a frame of the static version).

        One ``imshow`` of the H maps tiled ``cols`` to a row (white gaps between them), which renders far
        faster than H separate axes.
        """
        W = self.weights[layer - 1].numpy()  # (H, L, L)
        H, L, _ = W.shape
        rows, step = -(-H // cols), L + 1  # one blank row/column between maps
        canvas = np.full((rows * step - 1, cols * step - 1), np.nan)  # (rows*(L+1)-1, cols*(L+1)-1)
        for h in range(H):
            r, c = divmod(h, cols)
            canvas[r * step : r * step + L, c * step : c * step + L] = W[h]
        fig = Figure(figsize=(2.1 * cols + 1.2, 2.1 * rows + 0.6))
        ax = fig.add_subplot()
        cmap = matplotlib.colormaps[HEATMAP_CMAP].with_extremes(bad="white")  # the gaps between maps
        im = ax.imshow(canvas, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
        for h in range(H):
            r, c = divmod(h, cols)
            ax.text(c * step + (L - 1) / 2, r * step - 0.7, f"head {h}", ha="center", va="bottom", fontsize=8)
        ax.set_yticks([r * step + i for r in range(rows) for i in range(L)])
        ax.set_yticklabels(self.tokens * rows, fontsize=6)
        ax.set_xticks([c * step + i for c in range(cols) for i in range(L)])
        ax.set_xticklabels(self.tokens * cols, fontsize=6, rotation=90)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(f"layer {layer}: every head (rows: queries, columns: keys)", pad=16)
        fig.colorbar(im, ax=ax, shrink=0.6, label="weight")
        return fig

    def redraw(self, *_: Any) -> None:
        """Redraw for the current selectors."""
        layer, head = int(self.layer.value), int(self.head.value)
        self.summary.value = self.describe(layer, head)
        self.image.value = figure_to_png(self.figure(layer, head))

    def static_html(self, dpi: int = 80) -> str:
        """The kernel-free version: a slider over the layers, each frame showing every head."""
        layers: List[int] = list(range(1, self.weights.shape[0] + 1))
        frames = [self.grid(layer) for layer in layers]
        return frame_slider(frames, layers, label="layer", initial=int(self.layer.value) - 1, dpi=dpi,
                            alt=f"attention maps of every head for: {' '.join(self.tokens)}").markup



def head_explorer(
    attentions: Sequence[torch.Tensor], tokens: Sequence[str], layer: int = 1, head: int = 0
) -> HeadExplorer:
    """A :class:`HeadExplorer` for one sentence: ``attentions`` holds one (H, L, L) tensor per layer."""
    return HeadExplorer(attentions, tokens, layer=layer, head=head)


# ------------------------------------------------------------------------------ chapter 11: text generation


class GenerationExplorer(StaticTwin, widgets.VBox):
    """Prompt, temperature, top-k and length controls over a language model's continuation.

    The widget knows nothing about models: ``complete(prompt, temperature, top_k, length)`` returns the
    generated text (``top_k = 0``: no top-k filter), and must be repeatable (a seeded generator), so that a
    setting always shows the same text. The static twin for the site is a slider over the continuations of the
    widget's prompt under ``static_settings``, a list of ``(temperature, top_k)`` pairs.

    Attributes:
        prompt: a ``Text`` box; temperature: a ``FloatSlider`` (0 = greedy); top_k: an ``IntSlider`` (0 = off);
        length: an ``IntSlider``; output: an ``HTML`` showing the prompt and its continuation.
    """

    def __init__(self, complete: Callable[[str, float, int, int], str], prompt: str = "ROMEO:\n",
                 temperature: float = 0.8, top_k: int = 0, length: int = 200, max_top_k: int = 65,
                 static_settings: Optional[Sequence[Tuple[float, int]]] = ((0.0, 0), (0.5, 0), (0.8, 0),
                                                                           (1.0, 5), (1.0, 0), (1.5, 0))) -> None:
        if not callable(complete):
            raise TypeError(f"complete must be a callable (prompt, temperature, top_k, length) -> str, "
                            f"got {type(complete).__name__}")
        self.complete = complete
        self.static_settings = None if static_settings is None else [(float(t), int(k)) for t, k in static_settings]
        style = {"description_width": "initial"}
        self.prompt = widgets.Text(value=prompt, description="prompt", continuous_update=False)
        self.temperature = widgets.FloatSlider(value=temperature, min=0.0, max=2.0, step=0.1, style=style,
                                               description="temperature", continuous_update=False)
        self.top_k = widgets.IntSlider(value=top_k, min=0, max=max_top_k, description="top-k (0: off)",
                                       style=style, continuous_update=False)
        self.length = widgets.IntSlider(value=length, min=10, max=600, step=10, description="length",
                                        continuous_update=False)
        self.output = widgets.HTML()
        controls = [widgets.HBox([self.prompt, self.length]), widgets.HBox([self.temperature, self.top_k])]
        super().__init__(children=[*controls, self.output])
        for control in (self.prompt, self.temperature, self.top_k, self.length):
            control.observe(self.redraw, names="value")
        self.redraw()

    def text(self, temperature: float, top_k: int) -> str:
        """Prompt + continuation for one setting (the widget's prompt and length)."""
        prompt = self.prompt.value
        return prompt + self.complete(prompt, float(temperature), int(top_k), int(self.length.value))

    def redraw(self, *_: Any) -> None:
        """Regenerate for the current controls."""
        text = self.text(self.temperature.value, self.top_k.value)
        self.output.value = f'<pre style="white-space:pre-wrap">{html.escape(text)}</pre>'

    @staticmethod
    def setting_label(temperature: float, top_k: int) -> str:
        """How a setting is named on the static slider, e.g. ``"temperature 1.0, top-k 5"``."""
        if temperature == 0:
            return "greedy (temperature 0)"
        return f"temperature {temperature:g}" + (f", top-k {top_k}" if top_k else "")

    def static_html(self) -> str:
        """The kernel-free version: a slider over the continuations under ``static_settings``."""
        if not self.static_settings:
            return ""
        current = (float(self.temperature.value), int(self.top_k.value))
        initial = self.static_settings.index(current) if current in self.static_settings else 0
        texts = [self.text(t, k) for t, k in self.static_settings]
        labels = [self.setting_label(t, k) for t, k in self.static_settings]
        return text_slider(texts, labels, label="sampling", initial=initial).markup
