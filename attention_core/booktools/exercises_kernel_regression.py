"""Chapter 1's code exercise (``ch01.boxcar_nw``): the boxcar Nadaraya-Watson estimate.

Its edge cases sit on the window's exact edge and on empty windows; its known mistakes are the chapter's
warnings (0 / 0 for an empty window, ``<`` for ``<=``, dividing by every key, a sum for a mean), and h read as
the window's full width (``<= h / 2``). Any attention function with zero scores and the window as its mask takes
the window's mean, so the library's attention and torch's ``scaled_dot_product_attention`` are refused too.
"""

from __future__ import annotations

from attention_core.booktools.code_checks import FunctionSpec, Mistake
from attention_core.booktools.exercises_common import (
    ATTENTION_MODULES,
    TORCH_ATTENTION,
    T,
    draw_values,
    strategies,
)

__all__ = ["build"]


def _boxcar_reference(queries, keys, values, bandwidth):
    import attention_core as ac

    return ac.nadaraya_watson(queries, keys, values, kernel="boxcar", bandwidth=bandwidth)


def _inside(q, k, h, strict=False):
    d = (q[:, None] - k[None, :]).abs()  # (L, S)
    return (d < h if strict else d <= h).to(q.dtype)


def _boxcar_unguarded(q, k, v, h):
    w = _inside(q, k, h)
    return (w @ v) / w.sum(-1)


def _boxcar_strict(q, k, v, h):
    w = _inside(q, k, h, strict=True)
    return (w @ v) / w.sum(-1).clamp(min=1)


def _boxcar_half_width(q, k, v, h):
    w = _inside(q, k, h / 2)
    return (w @ v) / w.sum(-1).clamp(min=1)


def _boxcar_all_keys(q, k, v, h):
    return (_inside(q, k, h) @ v) / k.shape[0]


def _boxcar_sum(q, k, v, h):
    return _inside(q, k, h) @ v


def build() -> FunctionSpec:
    st = strategies()
    grid = st.integers(0, 32).map(lambda i: i / 4)  # 0, 0.25, ..., 8: the window's edge is exact

    @st.composite
    def problems(draw):
        n_q, n_k = draw(st.integers(1, 5)), draw(st.integers(1, 5))
        q = T(draw(st.lists(grid, min_size=n_q, max_size=n_q)))  # (L,)
        k = T(draw(st.lists(grid, min_size=n_k, max_size=n_k)))  # (S,)
        return q, k, draw_values(draw, (n_k,), -5, 5), draw(st.sampled_from([0.25, 0.5, 1.0, 1.5]))

    return FunctionSpec(
        "boxcar_nw", _boxcar_reference, problems(), atol=1e-5, rtol=1e-5, max_examples=50,
        arg_names=("queries", "keys", "values", "bandwidth"),
        examples=(
            (T([0.0, 2.0]), T([0.0, 0.5, 3.0]), T([1.0, 3.0, 5.0]), 1.0),  # the statement's example
            (T([0.0]), T([3.0]), T([2.0]), 1.0),  # an empty window
            (T([0.0, 1.0]), T([1.0, 2.0]), T([4.0, -2.0]), 1.0),  # keys exactly h away
            (T([0.5]), T([0.5]), T([3.0]), 0.25),  # length 1
            (T([0.0]), T([0.75]), T([2.0]), 1.0),  # a key between h/2 and h: tells a half-width window from `<`
        ),
        unavailable=("attention_core.nadaraya_watson", "attention_core.nadaraya_watson_weights",
                     "attention_core.kernel_regression.nadaraya_watson",
                     "attention_core.kernel_regression.nadaraya_watson_weights",
                     "attention_core.kernel_regression.NadarayaWatson",
                     "attention_core.attention_weights", "attention_core.scaled_dot_product_attention",
                     *TORCH_ATTENTION),
        # a zero score with the window as a mask makes any attention function take the window's mean (and
        # guard the empty window): the library's and torch's attention compute the answer whole here too
        forbidden_modules=("attention_core.kernel_regression", *ATTENTION_MODULES),
        task="to write the boxcar estimate yourself",
        mistakes=(
            Mistake("a query with no key within h divides 0 by 0; its estimate must be 0, not NaN.", _boxcar_unguarded),
            Mistake("a key exactly h away is inside the window: the edge is included (<=, not <).", _boxcar_strict),
            Mistake("h is the half-width: the window is [q - h, q + h], so a key up to h away on either side is "
                    "inside (not h / 2).", _boxcar_half_width),
            Mistake("divide each window's sum by the number of keys in that window, not by all S keys.",
                    _boxcar_all_keys),
            Mistake("the estimate is a mean: the window's sum still has to be divided by its count.", _boxcar_sum),
        ),
    )
