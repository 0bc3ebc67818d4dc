"""The RNN chapters' figures and the local-window explorer."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from attention_core.booktools.seq2seq_plots import (  # noqa: E402
    plot_alignment,
    plot_by_bucket,
    plot_loss_curves,
)
from attention_core.booktools.widgets import WindowExplorer, window_weights  # noqa: E402

WORDS = "three hundred and forty - two".split()


def test_window_weights_vanish_outside_the_window_and_padding() -> None:
    scores = torch.linspace(-1, 1, 6)
    w = window_weights(scores, center=2.0, window=1)
    assert torch.all(w[[0, 4, 5]] == 0) and torch.all(w[1:4] > 0)
    assert w.sum() < 1  # the Gaussian shrinks the softmax weights
    m = window_weights(scores, center=2.0, window=1, gaussian=False)
    torch.testing.assert_close(m.sum(), torch.tensor(1.0))
    assert torch.all(window_weights(scores, 4.0, 3, valid_len=4)[4:] == 0)
    with pytest.raises(ValueError, match=r"scores must be \(S,\) for one query, got shape \(1, 6\)"):
        window_weights(scores[None], 2.0, 1)


def test_window_explorer_follows_its_sliders() -> None:
    scores = torch.tensor([0.0, 0.5, 0.2, 3.0, 0.1, 2.0])
    ex = WindowExplorer(scores, WORDS, window=1, center=3.0)
    assert ex.summary.value.startswith("D = 1, p_t = 3.0:") and "'forty'" in ex.summary.value
    assert len(ex.image.value) > 1000
    ex.center.value = 5.0
    assert ex.summary.value.startswith("D = 1, p_t = 5.0:") and "'two'" in ex.summary.value
    html = ex.static_html(centers=[0.0, 5.0], windows=(0, 2))
    assert html.count("data:image/png;base64,") >= 4
    with pytest.raises(ValueError, match=r"scores must be \(S,\) with S = 6 source words, got shape \(5,\)"):
        WindowExplorer(scores[:5], WORDS)


def test_plots_draw_what_they_are_given() -> None:
    ax = plot_alignment(torch.rand(4, 8), WORDS, list("342") + ["<eos>"], title="t")
    assert ax.images[0].get_array().shape == (4, 6)
    res = {"a": {"buckets": [{"label": "1-5", "exact_match": 1.0, "token_accuracy": 1.0},
                             {"label": "6-10", "exact_match": 0.5, "token_accuracy": 0.7}]}}
    ax = plot_by_bucket(res, "token_accuracy")
    assert list(ax.lines[0].get_ydata()) == [1.0, 0.7]
    with pytest.raises(ValueError, match="metric must be 'exact_match' or 'token_accuracy', got 'bleu'"):
        plot_by_bucket(res, "bleu")
    ax = plot_loss_curves({"a": {"loss_every": 25, "losses": [2.0, 1.0, 0.5]}})
    assert list(ax.lines[0].get_xdata()) == [25, 50, 75]


def test_bandwidth_explorer_lays_out_its_controls_and_follows_both() -> None:
    """Chapter 1's explorer: the kernel menu and the bandwidth slider over the summary line and the figure."""
    from attention_core.booktools.widgets import BandwidthExplorer

    x = torch.linspace(0, 5, 20, dtype=torch.float64)
    ex = BandwidthExplorer(x, torch.sin(x), x[::2] + 0.1, torch.sin(x[::2] + 0.1), static_bandwidths=None)
    row, summary, image = ex.children
    assert list(row.children) == [ex.kernel, ex.slider] and summary is ex.summary and image is ex.image
    assert ex.summary.value.startswith("gaussian kernel, h = 0.300:") and ex.image.value[:4] == b"\x89PNG"
    ex.slider.value = 1.0
    assert ex.summary.value.startswith("gaussian kernel, h = 1.000:")
    ex.kernel.value = "boxcar"
    assert ex.summary.value.startswith("boxcar kernel, h = 1.000:")


def test_window_explorer_says_an_empty_window_holds_no_word():
    """D = 0 at a fractional p_t keeps no word: the summary says so instead of naming position 0 (a referee saw
    "most on 'six' (position 0, weight 0.000)")."""
    from attention_core.booktools.widgets import WindowExplorer

    ex = WindowExplorer(torch.arange(6, dtype=torch.float32), list("abcdef"), window=0, center=2.5)
    assert ex.describe(0, 2.5).endswith("the window holds no word (local-p keeps no weight)")
    assert "most on 'c'" in ex.describe(0, 2.0)
