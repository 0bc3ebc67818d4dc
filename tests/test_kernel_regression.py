"""Nadaraya-Watson kernel regression (attention_core.kernel_regression) and its data (regression_data)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attention_core as ac
from attention_core import kernel_regression as kr
from attention_core.regression.data import make_regression_data, regression_target

KERNEL_NAMES = ["gaussian", "boxcar", "epanechnikov"]


@pytest.fixture(autouse=True)
def _quiet_progress(monkeypatch):
    monkeypatch.setenv("AC_PROGRESS", "0")


def _sorted_points(n: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(n, generator=gen, dtype=dtype).sort().values * 4.0


# ---------------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize("name,variance", [("gaussian", 1.0), ("boxcar", 1 / 3), ("epanechnikov", 1 / 5)])
def test_kernels_are_densities_with_known_variance(name: str, variance: float) -> None:
    u = torch.linspace(-8, 8, 160_001, dtype=torch.float64)
    k = ac.KERNELS[name](u)
    assert (k >= 0).all()
    assert torch.trapezoid(k, u).item() == pytest.approx(1.0, abs=1e-3)
    assert torch.trapezoid(u**2 * k, u).item() == pytest.approx(variance, abs=1e-3)
    assert torch.equal(k, ac.KERNELS[name](-u))  # symmetric


@pytest.mark.parametrize("name", ["boxcar", "epanechnikov"])
def test_compact_kernels_vanish_outside_support(name: str) -> None:
    u = torch.tensor([-3.0, -1.0001, 1.0001, 2.0, 50.0])
    assert (ac.KERNELS[name](u) == 0).all()
    assert ac.KERNELS[name](torch.tensor(0.0)) > 0


def test_kernels_dict_lists_the_three_kernels() -> None:
    assert sorted(ac.KERNELS) == sorted(KERNEL_NAMES)


# -------------------------------------------------------------------------------------------- estimator


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
@pytest.mark.parametrize("d", [None, 1, 3])
def test_weight_rows_sum_to_one(kernel: str, d) -> None:
    gen = torch.Generator().manual_seed(1)
    shape_q, shape_k = ((7,), (11,)) if d is None else ((7, d), (11, d))
    q = torch.rand(shape_q, generator=gen, dtype=torch.float64)
    k = torch.rand(shape_k, generator=gen, dtype=torch.float64)
    w = ac.nadaraya_watson_weights(q, k, kernel=kernel, bandwidth=5.0)  # wide: every query sees keys
    assert w.shape == (7, 11)
    assert (w >= 0).all()
    assert torch.allclose(w.sum(-1), torch.ones(7, dtype=torch.float64))


def test_gaussian_weights_are_softmax_of_negative_squared_distance() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    k = torch.randn(9, 3, generator=gen, dtype=torch.float64)
    h = 0.7
    sq = torch.cdist(q, k) ** 2  # independent route to ||q - k||^2
    e = torch.exp(-sq / (2 * h * h))
    expected = e / e.sum(-1, keepdim=True)
    got = ac.nadaraya_watson_weights(q, k, kernel="gaussian", bandwidth=h)
    assert torch.allclose(got, expected, atol=1e-12)
    assert torch.allclose(got, torch.softmax(-sq / (2 * h * h), dim=-1), atol=1e-12)


def test_gaussian_weights_equal_dot_product_attention_with_key_bias() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 2, generator=gen, dtype=torch.float64)
    k = torch.randn(8, 2, generator=gen, dtype=torch.float64)
    h = 0.9
    bias = -(k * k).sum(-1)[None, :] / (2 * h * h)  # (1, S)
    w = ac.attention_weights(q, k, attn_mask=bias, scale=1 / h**2)
    assert torch.allclose(w, ac.nadaraya_watson_weights(q, k, bandwidth=h), atol=1e-10)


@pytest.mark.parametrize("kernel", ["boxcar", "epanechnikov"])
def test_compact_kernel_weights_are_zero_beyond_the_bandwidth(kernel: str) -> None:
    q = _sorted_points(20, 4)
    k = _sorted_points(30, 5)
    h = 0.3
    w = ac.nadaraya_watson_weights(q, k, kernel=kernel, bandwidth=h)
    far = (q[:, None] - k[None, :]).abs() > h
    assert (w[far] == 0).all()
    seen = (~far).any(-1)
    assert torch.allclose(w[seen].sum(-1), torch.ones(int(seen.sum()), dtype=w.dtype))


def test_boxcar_averages_the_keys_inside_the_window() -> None:
    keys = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0])
    values = torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0])
    out = ac.nadaraya_watson(torch.tensor([0.9]), keys, values, kernel="boxcar", bandwidth=0.5)
    assert out.item() == pytest.approx(2.5)
    out = ac.nadaraya_watson(torch.tensor([0.9]), keys, values, kernel="epanechnikov", bandwidth=0.5)
    assert out.item() == pytest.approx(3.0 / 1.32, rel=1e-6)


@pytest.mark.parametrize("kernel", ["boxcar", "epanechnikov"])
def test_query_outside_every_window_gives_zeros_not_nan(kernel: str) -> None:
    keys = torch.tensor([0.0, 1.0], requires_grad=False)
    h = torch.tensor(0.1, requires_grad=True)
    q = torch.tensor([0.05, 0.5])  # the second query sees no key
    w = ac.nadaraya_watson_weights(q, keys, kernel=kernel, bandwidth=h)
    assert torch.equal(w[1], torch.zeros(2))
    out = ac.nadaraya_watson(q, keys, torch.tensor([3.0, 4.0]), kernel=kernel, bandwidth=h)
    assert out[1].item() == 0.0 and out[0].item() == pytest.approx(3.0)
    out.sum().backward()
    assert torch.isfinite(h.grad)


def test_small_bandwidth_returns_nearest_keys_value() -> None:
    keys = torch.linspace(0, 1, 11, dtype=torch.float64)  # spacing 0.1
    values = torch.arange(11, dtype=torch.float64) ** 2
    gen = torch.Generator().manual_seed(6)
    q = torch.rand(50, generator=gen, dtype=torch.float64)
    nearest = (q[:, None] - keys[None, :]).abs().argmin(-1)
    ok = ((q[:, None] - keys[None, :]).abs().sort(-1).values.diff(dim=-1)[:, 0] > 1e-3)  # no near-ties
    for kernel in ("gaussian", "epanechnikov"):
        h = 1e-3 if kernel == "gaussian" else 0.05
        out = ac.nadaraya_watson(q, keys, values, kernel=kernel, bandwidth=h)
        assert torch.allclose(out[ok], values[nearest][ok], atol=1e-6), kernel


def test_tiny_bandwidth_at_the_keys_interpolates_the_values() -> None:
    keys = _sorted_points(25, 7)
    values = torch.randn(25, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    out = ac.nadaraya_watson(keys, keys, values, bandwidth=1e-6)
    assert torch.allclose(out, values, atol=1e-9)


@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_large_bandwidth_returns_the_mean_of_the_values(kernel: str) -> None:
    keys = _sorted_points(25, 8)
    values = torch.randn(25, 3, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    q = torch.linspace(-1, 5, 9, dtype=torch.float64)
    out = ac.nadaraya_watson(q, keys, values, kernel=kernel, bandwidth=1e6)
    assert out.shape == (9, 3)
    assert torch.allclose(out, values.mean(0).expand(9, 3), atol=1e-6)


def test_one_dim_inputs_equal_single_feature_inputs() -> None:
    q, k = _sorted_points(6, 9), _sorted_points(10, 10)
    v = torch.randn(10, dtype=torch.float64)
    a = ac.nadaraya_watson(q, k, v, bandwidth=0.4)
    b = ac.nadaraya_watson(q[:, None], k[:, None], v, bandwidth=0.4)
    c = ac.nadaraya_watson(q, k, v[:, None], bandwidth=0.4)
    assert a.shape == (6,) and c.shape == (6, 1)
    assert torch.allclose(a, b) and torch.allclose(a, c[:, 0])


def test_attn_mask_true_means_attend() -> None:
    x = _sorted_points(8, 11)
    y = torch.randn(8, dtype=torch.float64)
    mask = kr.leave_one_out_mask(8)
    assert mask.dtype == torch.bool and not mask.diagonal().any() and mask.sum() == 8 * 7
    for kernel in KERNEL_NAMES:
        w = ac.nadaraya_watson_weights(x, x, kernel=kernel, bandwidth=10.0, attn_mask=mask)
        assert (w.diagonal() == 0).all()
        assert torch.allclose(w.sum(-1), torch.ones(8, dtype=torch.float64))
    loo = kr.leave_one_out_mse(x, y, bandwidth=1e4)
    by_hand = torch.stack([(y[torch.arange(8) != i].mean() - y[i]) ** 2 for i in range(8)]).mean()
    assert torch.allclose(loo, by_hand, atol=1e-6)  # h -> inf: each point predicted by the others' mean


@pytest.mark.parametrize("kernel", ["gaussian", "epanechnikov"])
def test_gradients_flow_to_a_tensor_bandwidth(kernel: str) -> None:
    x = _sorted_points(30, 12)
    y = torch.sin(x)
    h = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
    loss = kr.leave_one_out_mse(x, y, kernel=kernel, bandwidth=h)  # q == k on the (masked) diagonal
    loss.backward()
    assert h.grad is not None and torch.isfinite(h.grad) and h.grad.abs() > 0
    h.grad = None
    out = ac.nadaraya_watson(x, x, y, kernel=kernel, bandwidth=h)  # unmasked: zero distances take part
    out.sum().backward()
    assert torch.isfinite(h.grad)


def test_gradcheck_of_the_gaussian_estimator() -> None:
    q = torch.rand(4, 2, dtype=torch.float64, requires_grad=True)
    k = torch.rand(5, 2, dtype=torch.float64, requires_grad=True)
    v = torch.rand(5, 3, dtype=torch.float64, requires_grad=True)
    h = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v, h: ac.nadaraya_watson(q, k, v, bandwidth=h), (q, k, v, h))


# ------------------------------------------------------------------------------------ module and fitting


def test_module_returns_estimates_and_weights() -> None:
    m = kr.NadarayaWatson(kernel="epanechnikov", bandwidth=0.5)
    assert [n for n, _ in m.named_parameters()] == ["log_bandwidth"]
    assert m.bandwidth.item() == pytest.approx(0.5)
    assert "epanechnikov" in repr(m)
    q, k = _sorted_points(5, 13), _sorted_points(9, 14)
    v = torch.randn(9, 2, dtype=torch.float64)
    out, w = m(q, k, v)
    assert out.shape == (5, 2) and w.shape == (5, 9) and out.dtype == torch.float64
    assert torch.allclose(out, ac.nadaraya_watson(q, k, v, kernel="epanechnikov", bandwidth=0.5))
    fixed = kr.NadarayaWatson(bandwidth=0.5, learn_bandwidth=False)
    assert list(fixed.parameters()) == [] and "log_bandwidth" in dict(fixed.named_buffers())


def test_fit_bandwidth_lowers_the_leave_one_out_loss() -> None:
    ds = make_regression_data(n_train=60, n_test=50, seed=1)
    model = kr.NadarayaWatson(bandwidth=2.0)
    fit = kr.fit_bandwidth(model, ds.x_train, ds.y_train, steps=80, lr=0.1)
    assert len(fit.loss) == len(fit.bandwidth) == 80
    assert fit.bandwidth[0] == pytest.approx(2.0)
    h = model.bandwidth.detach()
    final = kr.leave_one_out_mse(ds.x_train, ds.y_train, bandwidth=h).item()
    assert final < 0.5 * fit.loss[0]
    assert 0.05 < h.item() < 0.5  # it did not collapse to h -> 0: the diagonal is masked

    def test_mse(bw):
        return (ac.nadaraya_watson(ds.x_test, ds.x_train, ds.y_train, bandwidth=bw) - ds.y_test).pow(2).mean()

    assert test_mse(h) < test_mse(2.0)


def test_fit_bandwidth_momentum_is_what_overshoots() -> None:
    # Adam's default beta1 = 0.9 carries h past the leave-one-out minimum before it settles (chapter 1,
    # Figure 5); with beta1 = 0 the same run approaches the minimum from above without passing it.
    ds = make_regression_data(seed=0)
    runs = {}
    for beta1 in (0.9, 0.0):
        model = kr.NadarayaWatson(bandwidth=2.0)
        fit = kr.fit_bandwidth(model, ds.x_train, ds.y_train, steps=150, lr=0.1, betas=(beta1, 0.999))
        runs[beta1] = (min(fit.bandwidth), model.bandwidth.item())
    lowest, final = runs[0.9]
    assert lowest < 0.8 * final  # overshoot with momentum
    lowest, final = runs[0.0]
    assert lowest > 0.99 * final  # none without
    assert runs[0.9][1] == pytest.approx(runs[0.0][1], rel=0.02)  # the same minimum either way


@pytest.mark.parametrize("betas", [(0.9,), (0.9, 1.0), (-0.1, 0.999), "ab", (True, 0.999), (0.9, float("nan"))])
def test_fit_bandwidth_rejects_bad_betas(betas) -> None:
    ds = make_regression_data(n_train=10, n_test=5)
    model = kr.NadarayaWatson(bandwidth=2.0)
    with pytest.raises(ValueError, match="betas"):
        kr.fit_bandwidth(model, ds.x_train, ds.y_train, betas=betas)
    assert model.bandwidth.item() == pytest.approx(2.0)  # a refused call changes nothing


def test_fit_bandwidth_rejects_a_fixed_bandwidth() -> None:
    ds = make_regression_data(n_train=10, n_test=5)
    with pytest.raises(ValueError, match="learn_bandwidth=False"):
        kr.fit_bandwidth(kr.NadarayaWatson(learn_bandwidth=False), ds.x_train, ds.y_train)
    with pytest.raises(ValueError, match="steps"):
        kr.fit_bandwidth(kr.NadarayaWatson(), ds.x_train, ds.y_train, steps=0)
    with pytest.raises(TypeError, match="model"):
        kr.fit_bandwidth(torch.nn.Linear(1, 1), ds.x_train, ds.y_train)


# ------------------------------------------------------------------------------------------ validation

Q1 = torch.rand(4)
K1 = torch.rand(6)
V1 = torch.rand(6)


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        (dict(bandwidth=0.0), ValueError, "bandwidth must be positive"),
        (dict(bandwidth=-1.0), ValueError, "bandwidth must be positive"),
        (dict(bandwidth=float("nan")), ValueError, "bandwidth must be positive and finite"),
        (dict(bandwidth=float("inf")), ValueError, "bandwidth must be positive and finite"),
        (dict(bandwidth=torch.tensor(-0.5)), ValueError, "bandwidth"),
        (dict(bandwidth=torch.tensor([0.5, 1.0])), ValueError, "0-d tensor"),
        (dict(bandwidth=torch.tensor(1)), TypeError, "bandwidth must have a floating-point dtype"),
        (dict(bandwidth=True), TypeError, "bandwidth"),
        (dict(bandwidth="1.0"), TypeError, "bandwidth"),
        (
            dict(kernel="triangular"),
            ValueError,
            r"kernel must be one of \['boxcar', 'epanechnikov', 'gaussian'\]",
        ),
        (dict(kernel=None), TypeError, "kernel must be a str"),
        (dict(values=torch.rand(5)), ValueError, r"same number.*6 keys.*5 values"),
        (dict(keys=torch.rand(6, 2)), ValueError, r"same feature dim.*d=1.*d=2"),
        (dict(queries=torch.rand(2, 3, 4)), ValueError, r"queries must be 1-D \(L,\) or 2-D \(L, d\).*3 d"),
        (dict(keys=torch.rand(6, 1, 1)), ValueError, r"keys must be 1-D \(S,\) or 2-D \(S, d\)"),
        (dict(values=torch.rand(6, 2, 2)), ValueError, r"values must be 1-D \(S,\) or 2-D \(S, Ev\)"),
        (dict(queries=torch.arange(4)), TypeError, "queries must have a floating-point dtype"),
        (dict(values=torch.arange(6)), TypeError, "values must have a floating-point dtype"),
        (dict(keys=torch.rand(6, dtype=torch.float64)), TypeError, "keys must have the dtype of queries"),
        (dict(queries=[0.1, 0.2]), TypeError, "queries must be a torch.Tensor"),
        (dict(keys=torch.rand(0)), ValueError, "at least one key"),
        (dict(attn_mask=torch.ones(4, 5, dtype=torch.bool)), ValueError, r"attn_mask of shape \(4, 5\)"),
        (dict(attn_mask=torch.ones(4, 6)), TypeError, "attn_mask must be a bool tensor"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(kwargs, exc, pattern) -> None:
    args = dict(queries=Q1, keys=K1, values=V1, kernel="gaussian", bandwidth=1.0)
    args.update(kwargs)
    if args["keys"].shape[0] == 0:
        args["values"] = torch.rand(0)
    with pytest.raises(exc, match=pattern):
        ac.nadaraya_watson(**args)


def test_module_validates_kernel_and_bandwidth() -> None:
    with pytest.raises(ValueError, match="kernel must be one of"):
        kr.NadarayaWatson(kernel="cosine")
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        kr.NadarayaWatson(bandwidth=0.0)


# ------------------------------------------------------------------------------------------- properties

finite = st.floats(min_value=-100, max_value=100, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    keys=st.lists(finite, min_size=1, max_size=12),
    data=st.data(),
    bandwidth=st.floats(min_value=1e-3, max_value=1e3),
    kernel=st.sampled_from(KERNEL_NAMES),
)
def test_estimate_is_a_convex_combination_of_the_values(keys, data, bandwidth, kernel) -> None:
    n = len(keys)
    values = data.draw(st.lists(finite, min_size=n, max_size=n))
    queries = data.draw(st.lists(finite, min_size=1, max_size=6))
    k, v, q = (torch.tensor(x, dtype=torch.float32) for x in (keys, values, queries))
    w = ac.nadaraya_watson_weights(q, k, kernel=kernel, bandwidth=bandwidth)
    out = ac.nadaraya_watson(q, k, v, kernel=kernel, bandwidth=bandwidth)
    assert not out.isnan().any() and not w.isnan().any()
    assert (w >= 0).all()
    sums = w.sum(-1)
    assert ((sums - 1).abs() < 1e-5).logical_or(sums == 0).all()  # 1, or 0 when no key is in the support
    tol = 1e-4 * (1 + v.abs().max())
    seen = sums > 0
    assert (out[seen] >= v.min() - tol).all() and (out[seen] <= v.max() + tol).all()
    assert (out[~seen] == 0).all()
    if kernel == "gaussian":
        assert seen.all()


# ----------------------------------------------------------------------------------------------- data


def test_regression_data_is_deterministic_and_well_formed() -> None:
    a = make_regression_data(n_train=30, n_test=40, noise=0.2, seed=3)
    b = make_regression_data(n_train=30, n_test=40, noise=0.2, seed=3)
    c = make_regression_data(n_train=30, n_test=40, noise=0.2, seed=4)
    for name in ("x_train", "y_train", "x_test", "y_test"):
        assert torch.equal(getattr(a, name), getattr(b, name))
        assert getattr(a, name).dtype == torch.float32
    assert not torch.equal(a.y_train, c.y_train)
    assert a.x_train.shape == (30,) and a.x_test.shape == (40,)
    assert (a.x_train.diff() >= 0).all() and a.x_train.min() >= 0 and a.x_train.max() <= 5
    assert torch.allclose(a.y_test, regression_target(a.x_test), atol=1e-6)
    resid = a.y_train - regression_target(a.x_train)
    assert 0.1 < resid.std().item() < 0.3
    clean = make_regression_data(n_train=5, noise=0.0)
    assert torch.allclose(clean.y_train, regression_target(clean.x_train), atol=1e-6)


def test_regression_data_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    make_regression_data()
    assert torch.equal(torch.rand(1), before)


@pytest.mark.parametrize(
    "kwargs", [dict(n_train=0), dict(n_test=1), dict(noise=-0.1), dict(n_train=2.5), dict(dtype=torch.int64)]
)
def test_regression_data_rejects_bad_arguments(kwargs) -> None:
    with pytest.raises((ValueError, TypeError)):
        make_regression_data(**kwargs)
