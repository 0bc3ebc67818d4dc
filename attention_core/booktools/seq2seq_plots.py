"""Figures for the RNN attention chapters (3 and 4).

- :func:`plot_alignment`: one decoded example's attention weights, target digits against source words;
- :func:`plot_by_bucket`: accuracy per source-length bucket, one line per model (the bottleneck figure);
- :func:`plot_loss_curves`: the training curves stored in the checkpoint manifest;

The local-p window explorer of chapter 4 is :class:`attention_core.booktools.widgets.WindowExplorer`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch
from matplotlib.axes import Axes

from attention_core.booktools.plots import plot_attention
from attention_core.booktools.session import OKABE_ITO

__all__ = ["plot_alignment", "plot_by_bucket", "plot_loss_curves"]


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
        results: model name -> the dict :func:`attention_core.translation.metrics.evaluate_by_bucket` returns.
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
        entries: model name -> its manifest entry (see :func:`attention_core.training.checkpoint.recipe_entry`).
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


