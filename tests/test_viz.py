"""Plotting helpers (attention_core.booktools.plots) and notebook helpers (attention_core.booktools.session)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg", force=True)  # headless, whatever MPLBACKEND the test run sets

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import attention_core as ac  # noqa: E402
from attention_core.booktools import plots as viz  # noqa: E402
from attention_core.booktools import session as notebook  # noqa: E402
from attention_core.booktools import widgets  # noqa: E402
from attention_core.regression.data import make_regression_data  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_to_numpy_accepts_tensors_with_grad_arrays_and_lists() -> None:
    t = torch.ones(2, 3, requires_grad=True)
    assert viz.to_numpy(t).shape == (2, 3) and viz.to_numpy(t).dtype == np.float64
    assert viz.to_numpy([1, 2]).tolist() == [1.0, 2.0]
    assert viz.to_numpy(np.zeros(3, dtype=np.float32)).dtype == np.float64


def test_plot_attention_draws_one_heatmap_with_a_colorbar() -> None:
    w = torch.softmax(torch.randn(5, 7, requires_grad=True), dim=-1)  # a tensor with grad
    ax = viz.plot_attention(w, xlabels=list("abcdefg"), ylabels=range(5), title="weights")
    assert isinstance(ax, Axes)
    assert len(ax.images) == 1 and ax.images[0].get_array().shape == (5, 7)
    assert len(ax.figure.axes) == 2  # the heatmap and its colorbar
    assert ax.get_title() == "weights" and ax.get_xlabel() == "keys" and ax.get_ylabel() == "queries"
    assert [t.get_text() for t in ax.get_xticklabels()] == list("abcdefg")
    assert ax.images[0].get_clim() == (0.0, pytest.approx(w.max().item()))


def test_plot_attention_squeezes_leading_ones_thins_ticks_and_draws_into_a_given_ax() -> None:
    fig, axes = plt.subplots(1, 2)
    w = torch.rand(1, 1, 40, 30)
    labels = torch.linspace(0, 1, 30)
    ax = viz.plot_attention(w, xlabels=labels, ax=axes[1], colorbar=False, max_ticks=5, vmax=2.0)
    assert ax is axes[1] and len(fig.axes) == 2
    assert len(ax.get_xticks()) == 5
    assert ax.images[0].get_clim() == (0.0, 2.0)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [(dict(weights=torch.rand(2, 3, 4)), r"\(L, S\)"), (dict(weights=torch.rand(3)), r"\(L, S\)"),
     (dict(weights=torch.rand(2, 3), xlabels=["a"]), "xlabels must have 3 entries"),
     (dict(weights=torch.rand(2, 3), ylabels=["a"]), "ylabels must have 2 entries")],
)
def test_plot_attention_rejects_bad_shapes(kwargs, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        viz.plot_attention(**kwargs)


def test_plot_kernels_one_panel_and_one_line_per_kernel() -> None:
    fig = viz.plot_kernels(ac.KERNELS)
    assert isinstance(fig, Figure) and len(fig.axes) == 3
    assert [ax.get_title() for ax in fig.axes] == list(ac.KERNELS)
    assert all(len(ax.lines) == 2 for ax in fig.axes)  # the kernel and the u = 0 guide
    single = viz.plot_kernels({"gaussian": ac.KERNELS["gaussian"]})
    assert len(single.axes) == 1


def test_plot_regression_lines_and_colours() -> None:
    ds = make_regression_data(n_train=20, n_test=30)
    preds = {"a": torch.zeros(30), "b": torch.ones(30)}
    ax = viz.plot_regression(ds.x_train, ds.y_train, ds.x_test, preds, ds.y_test, title="fit")
    assert len(ax.lines) == 3 and len(ax.collections) == 1  # truth + 2 curves; the dots
    assert ax.get_legend() is not None and ax.get_title() == "fit"
    ax = viz.plot_regression(
        ds.x_train, ds.y_train, ds.x_test, torch.zeros(30), colors=["#123456"], legend=False
    )
    assert len(ax.lines) == 1 and ax.lines[0].get_color() == "#123456" and ax.get_legend() is None


def test_plot_lines_curves_markers_and_log_axes() -> None:
    x = torch.logspace(-2, 1, 10)
    ax = viz.plot_lines(x, {"a": x, "b": 2 * x}, logx=True, logy=True, markers={"pick": 0.1}, xlabel="h")
    assert len(ax.lines) == 3 and ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlabel() == "h" and ax.get_legend() is not None
    ax = viz.plot_lines([0, 1, 2], [3.0, 2.0, 1.0])
    assert len(ax.lines) == 1 and ax.get_legend() is None


def test_bandwidth_explorer_redraws_on_change() -> None:
    ds = make_regression_data(n_train=20, n_test=30)
    box = widgets.bandwidth_explorer(ds.x_train, ds.y_train, ds.x_test, ds.y_test, bandwidth=0.2)
    assert box.slider.value == pytest.approx(0.2) and box.kernel.value == "gaussian"
    png = bytes(box.image.value)
    assert png.startswith(b"\x89PNG")
    first = box.summary.value
    mse = (ac.nadaraya_watson(ds.x_test, ds.x_train, ds.y_train, bandwidth=0.2) - ds.y_test).pow(2).mean()
    assert first == f"gaussian kernel, h = 0.200: test MSE = {mse.item():.4f}"
    box.slider.value = 1.0
    assert box.summary.value.startswith("gaussian kernel, h = 1.000") and bytes(box.image.value) != png
    box.kernel.value = "boxcar"
    assert box.summary.value.startswith("boxcar kernel, h = 1.000")
    assert plt.get_fignums() == []  # drawn off-screen: nothing left for an inline backend to show


def test_setup_seeds_sets_defaults_and_returns_a_device() -> None:
    dev = notebook.setup(seed=5)
    a = torch.rand(3)
    notebook.setup(seed=5)
    assert torch.equal(a, torch.rand(3))
    assert dev.type in ("cpu", "cuda")
    assert matplotlib.rcParams["image.cmap"] == "viridis"
    assert matplotlib.rcParams["axes.prop_cycle"].by_key()["color"][0] == notebook.OKABE_ITO[0]


def test_progress_is_silent_when_disabled(monkeypatch, capsys) -> None:
    monkeypatch.setenv("AC_PROGRESS", "0")
    assert not notebook.progress_enabled()
    assert list(notebook.progress(range(3), desc="x")) == [0, 1, 2]
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("AC_PROGRESS", "1")
    assert notebook.progress_enabled()
    assert list(notebook.progress(range(3), disable=True)) == [0, 1, 2]


def test_bandwidth_explorer_carries_a_static_version_for_the_site() -> None:
    ds = make_regression_data(n_train=20, n_test=30)
    box = widgets.bandwidth_explorer(
        ds.x_train, ds.y_train, ds.x_test, ds.y_test, bandwidth=0.3, static_bandwidths=(0.1, 0.3, 1.0)
    )
    data = box._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    markup = data["text/html"]
    assert markup.count('class="ac-frame"') == 3 and markup.count("data:image/png;base64,") == 3
    assert 'max="2"' in markup and 'value="1"' in markup  # three frames, the initial h = 0.3 shown first
    assert markup == box.static_html()  # same content, same element ids: outputs repeat
    assert plt.get_fignums() == []
    plain = widgets.bandwidth_explorer(ds.x_train, ds.y_train, ds.x_test, ds.y_test, static_bandwidths=None)
    assert "text/html" not in plain._repr_mimebundle_()
