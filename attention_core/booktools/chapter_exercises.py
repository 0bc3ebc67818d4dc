"""The chapters' code exercises: what each asks for, the inputs that test it, and its known mistakes.

Each exercise is a :class:`~attention_core.booktools.code_checks.FunctionSpec` named ``"chNN.function"``
(``spec("ch07.rope")``). Its inputs reach the values where the chapter's warnings matter: explicit edge
cases first (fully masked rows, empty windows, the window's exact edge, length 1, scores large enough to
overflow ``exp``), then generated ones. Its :class:`~attention_core.booktools.code_checks.Mistake` list names
the chapter's plausible mistakes, so that a reader whose output matches one gets a one-line hint.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any, Callable, Dict

import torch

from attention_core.booktools import exercises_distributed
from attention_core.booktools.code_checks import FunctionSpec, Mistake

__all__ = ["EXERCISES", "check_window_rise", "partial_softmax", "spec", "window_loss_rise"]

T = torch.tensor
NEG_INF = float("-inf")


#: Where the library computes attention whole (any backend, any wrapper): unavailable to every exercise that
#: asks for a softmax or an attention to be written by hand.
_ATTENTION_MODULES = ("attention_core.functional", "attention_core.backends", "attention_core.multihead",
                      "attention_core.flex_attention", "attention_core.paged_attention", "attention_core.models")
#: torch's own attention, under the names a student finds (its bindings included).
_TORCH_ATTENTION = ("torch.nn.functional.scaled_dot_product_attention", "torch._C._nn.scaled_dot_product_attention",
                    "torch.ops.aten.scaled_dot_product_attention", "torch.nn.functional.multi_head_attention_forward")


def _st() -> Any:
    from hypothesis import strategies as st

    return st


def _values(draw: Any, shape: tuple, lo: float, hi: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    st = _st()
    n = math.prod(shape)
    width = 32 if dtype == torch.float32 else 64
    return T(draw(st.lists(st.floats(lo, hi, width=width), min_size=n, max_size=n)), dtype=dtype).view(shape)


def _rows_mask(draw: Any, L: int, S: int) -> torch.Tensor:
    """(L, S) bool: each row all kept, all masked, or random (so that both kinds of full row appear)."""
    st = _st()
    rows = []
    for _ in range(L):
        kind = draw(st.sampled_from(["random", "random", "all", "none"]))
        rows.append([kind == "all"] * S if kind != "random" else draw(st.lists(st.booleans(), min_size=S, max_size=S)))
    return T(rows, dtype=torch.bool)


# -------------------------------------------------------------------------------- ch. 1: boxcar Nadaraya-Watson


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


def _boxcar_all_keys(q, k, v, h):
    return (_inside(q, k, h) @ v) / k.shape[0]


def _boxcar_sum(q, k, v, h):
    return _inside(q, k, h) @ v


def _ch01() -> FunctionSpec:
    st = _st()
    grid = st.integers(0, 32).map(lambda i: i / 4)  # 0, 0.25, ..., 8: the window's edge is exact

    @st.composite
    def problems(draw):
        n_q, n_k = draw(st.integers(1, 5)), draw(st.integers(1, 5))
        q = T(draw(st.lists(grid, min_size=n_q, max_size=n_q)))  # (L,)
        k = T(draw(st.lists(grid, min_size=n_k, max_size=n_k)))  # (S,)
        return q, k, _values(draw, (n_k,), -5, 5), draw(st.sampled_from([0.25, 0.5, 1.0, 1.5]))

    return FunctionSpec(
        "boxcar_nw", _boxcar_reference, problems(), atol=1e-5, rtol=1e-5, max_examples=50,
        arg_names=("queries", "keys", "values", "bandwidth"),
        examples=(
            (T([0.0, 2.0]), T([0.0, 0.5, 3.0]), T([1.0, 3.0, 5.0]), 1.0),  # the statement's example
            (T([0.0]), T([3.0]), T([2.0]), 1.0),  # an empty window
            (T([0.0, 1.0]), T([1.0, 2.0]), T([4.0, -2.0]), 1.0),  # keys exactly h away
            (T([0.5]), T([0.5]), T([3.0]), 0.25),  # length 1
        ),
        unavailable=("attention_core.nadaraya_watson", "attention_core.nadaraya_watson_weights",
                     "attention_core.kernel_regression.nadaraya_watson",
                     "attention_core.kernel_regression.nadaraya_watson_weights",
                     "attention_core.kernel_regression.NadarayaWatson"),
        forbidden_modules=("attention_core.kernel_regression",),
        task="to write the boxcar estimate yourself",
        mistakes=(
            Mistake("a query with no key within h divides 0 by 0; its estimate must be 0, not NaN.", _boxcar_unguarded),
            Mistake("a key exactly h away is inside the window: the edge is included (<=, not <).", _boxcar_strict),
            Mistake("divide each window's sum by the number of keys in that window, not by all S keys.",
                    _boxcar_all_keys),
            Mistake("the estimate is a mean: the window's sum still has to be divided by its count.", _boxcar_sum),
        ),
    )


# -------------------------------------------------------------------------------------- ch. 2: masked softmax


def _softmax_naive(scores, mask):
    return torch.softmax(scores.masked_fill(~mask, NEG_INF), dim=-1)


def _softmax_1e9(scores, mask):
    return torch.softmax(scores.masked_fill(~mask, -1e9), dim=-1)


def _softmax_no_max(scores, mask):
    e = torch.exp(scores) * mask
    s = e.sum(-1, keepdim=True)
    return torch.where(s > 0, e / s, torch.zeros_like(e))


def _softmax_not_renormalised(scores, mask):
    return torch.softmax(scores, dim=-1) * mask


def _softmax_inverted(scores, mask):
    return _softmax_guarded(scores, ~mask)


def _softmax_guarded(scores, mask):
    dead = ~mask.any(dim=-1, keepdim=True)
    w = torch.softmax(scores.masked_fill(~mask, NEG_INF).masked_fill(dead, 0.0), dim=-1)
    return w.masked_fill(dead, 0.0)


def _ch02() -> FunctionSpec:
    st = _st()

    @st.composite
    def scores_and_masks(draw):
        L, S = draw(st.integers(1, 4)), draw(st.integers(1, 5))
        scale = draw(st.sampled_from([1.0, 1.0, 1.0, 40.0]))  # x 40: beyond exp's float32 range (~88)
        return _values(draw, (L, S), -5, 5) * scale, _rows_mask(draw, L, S)

    return FunctionSpec(
        "masked_softmax", _reference("attention_core.masked_softmax"), scores_and_masks(), atol=1e-6, rtol=1e-5,
        max_examples=50, arg_names=("scores", "mask"),
        examples=(
            (T([[0.0, 0.0, 5.0], [1.0, 2.0, 3.0]]), T([[True, True, False], [False, False, False]])),  # statement
            (T([[100.0, 99.0, -100.0]]), T([[True, True, True]])),  # exp(100) overflows float32
            (T([[-200.0, -199.0, 200.0]]), T([[True, True, False]])),  # the largest score is a masked one
            (T([[2.0]]), T([[False]])),  # length 1, masked
            (T([[2.0]]), T([[True]])),  # length 1, kept
        ),
        unavailable=("attention_core.masked_softmax", "attention_core.functional.masked_softmax",
                     "attention_core.backends.reference.softmax_with_mask", *_TORCH_ATTENTION),
        unavailable_globals=("guarded_softmax",),
        forbidden_modules=_ATTENTION_MODULES,
        task="to write the masked softmax yourself (an attention function such as scaled_dot_product_attention "
             "computes it whole)",
        mistakes=(
            Mistake("a row whose keys are all masked: softmax of all -inf is NaN, and that row must be zeros.",
                    _softmax_naive),
            Mistake("-1e9 is not -inf: a fully masked row then gets equal weights instead of zeros.", _softmax_1e9),
            Mistake("exp of a large score overflows to inf: subtract each row's maximum first (as torch.softmax "
                    "does).", _softmax_no_max),
            Mistake("zeroing masked weights after the softmax leaves rows that no longer sum to 1.",
                    _softmax_not_renormalised),
            Mistake("mask is True where a (query, key) pair takes part, not where it is masked.", _softmax_inverted),
        ),
    )


def _reference(path: str) -> Callable[..., Any]:
    """A reference that looks the library function up when called (so a test can patch it)."""

    def call(*args: Any) -> Any:
        from attention_core.booktools.code_checks import _resolve

        return _resolve(path)[2](*args)

    call.__name__ = path.rsplit(".", 1)[-1]
    return call


# ------------------------------------------------------------------------------------- ch. 3: Bahdanau weights


def _bahdanau_reference(s_prev, h, mask, W_a, U_a, v_a):
    from attention_core.models.rnn_attention import AdditiveAttention

    layer = AdditiveAttention(W_a.shape[1], U_a.shape[1], W_a.shape[0])
    with torch.no_grad():
        layer.score.W_q.weight.copy_(W_a)
        layer.score.W_k.weight.copy_(U_a)
        layer.score.v.weight.copy_(v_a[None])
        return layer(s_prev, h, attn_mask=mask)[1]


def _bahdanau_scores(s_prev, h, W_a, U_a, v_a, tanh=True):
    hidden = (s_prev @ W_a.T)[:, None, :] + h @ U_a.T  # (B, 1, d_a) + (B, S, d_a)
    return (torch.tanh(hidden) if tanh else hidden) @ v_a  # (B, S)


def _bahdanau_unmasked(s_prev, h, mask, W_a, U_a, v_a):
    return torch.softmax(_bahdanau_scores(s_prev, h, W_a, U_a, v_a), dim=-1)


def _bahdanau_no_tanh(s_prev, h, mask, W_a, U_a, v_a):
    return torch.softmax(_bahdanau_scores(s_prev, h, W_a, U_a, v_a, tanh=False).masked_fill(~mask, NEG_INF), -1)


def _bahdanau_mask_after(s_prev, h, mask, W_a, U_a, v_a):
    return torch.softmax(_bahdanau_scores(s_prev, h, W_a, U_a, v_a), dim=-1) * mask


def _bahdanau_batch_axis(s_prev, h, mask, W_a, U_a, v_a):
    return torch.softmax(_bahdanau_scores(s_prev, h, W_a, U_a, v_a).masked_fill(~mask, NEG_INF), dim=0)


def _ch03() -> FunctionSpec:
    st = _st()

    @st.composite
    def step_inputs(draw):
        B, S, Dq, Dk, A = (draw(st.integers(1, 4)) for _ in range(5))
        lens = T(draw(st.lists(st.integers(1, S), min_size=B, max_size=B)))  # real words per sentence
        return (_values(draw, (B, Dq), -3, 3), _values(draw, (B, S, Dk), -3, 3), torch.arange(S) < lens[:, None],
                _values(draw, (A, Dq), -3, 3), _values(draw, (A, Dk), -3, 3), _values(draw, (A,), -3, 3))

    one = torch.ones
    return FunctionSpec(
        "bahdanau_weights", _bahdanau_reference, step_inputs(), atol=1e-6, rtol=1e-5, max_examples=50,
        arg_names=("s_prev", "h", "mask", "W_a", "U_a", "v_a"),
        examples=(
            (T([[1.0]]), T([[[1.0], [-1.0], [5.0]]]), T([[True, True, False]]), T([[1.0]]), T([[1.0]]),
             T([0.0])),  # the statement's example: equal scores, padding at the end
            (one(2, 1), one(2, 1, 1), T([[True], [True]]), one(1, 1), one(1, 1), one(1)),  # one word
            (T([[0.5, -1.0]]), T([[[1.0], [2.0]]]), T([[True, False]]), T([[1.0, 2.0], [0.0, 1.0]]),
             T([[1.0], [-1.0]]), T([1.0, 2.0])),
        ),
        unavailable=("attention_core.models.rnn_attention.AdditiveAttention", "attention_core.scoring.AdditiveScore",
                     "attention_core.models.rnn_attention.AdditiveScore"),
        forbidden_modules=(*_ATTENTION_MODULES, "attention_core.scoring"),
        task="to write the additive score, the mask and the softmax yourself",
        mistakes=(
            Mistake("padded positions must get weight 0: mask the scores before the softmax.", _bahdanau_unmasked),
            Mistake("the score is v_a . tanh(W_a s + U_a h): the tanh is missing.", _bahdanau_no_tanh),
            Mistake("masking after the softmax leaves weights that no longer sum to 1 over the real words.",
                    _bahdanau_mask_after),
            Mistake("the softmax runs over the source positions (the last axis), not over the batch.",
                    _bahdanau_batch_axis),
        ),
    )


# ----------------------------------------------------------------------------------------- ch. 4: local-p weights


def _local_reference(scores, center, D):
    from attention_core.models.rnn_attention import local_attention_weights

    return local_attention_weights(scores, center, D, gaussian=True)


def _local(scores, center, D, *, sigma=None, strict=False, window=True, renorm=False, rounded=False):
    p = center.round() if rounded else center
    dist = torch.arange(scores.shape[-1], dtype=scores.dtype) - p[..., None]  # (B, L, S)
    outside = (dist.abs() >= D) if strict else (dist.abs() > D)
    w = torch.softmax(scores.masked_fill(outside, NEG_INF) if window else scores, dim=-1)
    sigma = D / 2 if sigma is None else sigma
    w = w * torch.exp(-dist**2 / (2 * sigma**2))
    return w / w.sum(-1, keepdim=True) if renorm else w


def _ch04() -> FunctionSpec:
    st = _st()

    @st.composite
    def window_inputs(draw):
        B, L, S, D = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 7)), draw(st.integers(1, 4))
        half = st.integers(0, 2 * (S - 1)).map(lambda i: i / 2)  # positions on a half grid: exact window edges
        anywhere = st.floats(0, S - 1, width=32)
        center = T(draw(st.lists(half | anywhere, min_size=B * L, max_size=B * L))).view(B, L)
        return _values(draw, (B, L, S), -4, 4), center, D

    return FunctionSpec(
        "local_p_weights", _local_reference, window_inputs(), atol=1e-6, rtol=1e-5, max_examples=50,
        arg_names=("scores", "center", "D"),
        examples=(
            (torch.zeros(1, 1, 5), T([[2.0]]), 2),  # the statement's example: uniform scores, centred window
            (torch.zeros(1, 1, 5), T([[2.0]]), 1),  # keys exactly D away
            (T([[[1.0, 2.0, 3.0, 4.0]]]), T([[1.5]]), 1),  # p between two words
            (T([[[0.5]]]), T([[0.0]]), 1),  # one source word
        ),
        unavailable=("attention_core.models.rnn_attention.local_attention_weights",
                     "attention_core.models.rnn_attention.LuongAttention",
                     "attention_core.models.rnn_attention.gaussian_window",
                     "attention_core.models.rnn_attention.masked_softmax"),
        forbidden_modules=_ATTENTION_MODULES,
        task="to write the window, the softmax and the Gaussian yourself",
        mistakes=(
            Mistake("the Gaussian's sigma is D/2, not D.", lambda s, c, D: _local(s, c, D, sigma=D)),
            Mistake("a position exactly D away from p_t is inside the window (<=, not <).",
                    lambda s, c, D: _local(s, c, D, strict=True)),
            Mistake("positions farther than D from p_t get weight 0: mask them before the softmax.",
                    lambda s, c, D: _local(s, c, D, window=False)),
            Mistake("the Gaussian multiplies the softmax weights; the rows are not renormalised afterwards.",
                    lambda s, c, D: _local(s, c, D, renorm=True)),
            Mistake("p_t is a real number: measure distances from p_t itself, not from a rounded position.",
                    lambda s, c, D: _local(s, c, D, rounded=True)),
        ),
    )


# --------------------------------------------------------------------------------- ch. 5 and 8: causal attention


def _sdpa_causal(q, k, v):
    import attention_core as ac

    return ac.scaled_dot_product_attention(q, k, v, is_causal=True)


def _causal(q, k, v, *, scale=None, diagonal=0, late=False, upper=False, manual=False):
    T_, E = q.shape[-2], q.shape[-1]
    s = q @ k.transpose(-2, -1) * (E**-0.5 if scale is None else scale)  # (..., T, T)
    keep = torch.ones(T_, T_, dtype=torch.bool)
    keep = keep.triu() if upper else keep.tril(diagonal)
    if late:
        return (torch.softmax(s, dim=-1) * keep) @ v
    s = s.masked_fill(~keep, NEG_INF)
    if manual:  # exp without subtracting the row's maximum
        e = torch.exp(s)
        return (e / e.sum(-1, keepdim=True)) @ v
    return torch.softmax(s, dim=-1) @ v


_CAUSAL_MISTAKES = (
    Mistake("mask before the softmax: zeroing future weights afterwards leaves rows that do not sum to 1.",
            lambda q, k, v: _causal(q, k, v, late=True)),
    Mistake("scale the scores by 1/sqrt(E) before the softmax.", lambda q, k, v: _causal(q, k, v, scale=1.0)),
    Mistake("a query sees itself: keep the diagonal (tril, not tril(-1)); otherwise the first row has no key.",
            lambda q, k, v: _causal(q, k, v, diagonal=-1)),
    Mistake("query i sees keys 0..i, the lower triangle, not the upper one.",
            lambda q, k, v: _causal(q, k, v, upper=True)),
    Mistake("exp of a large score overflows to inf: subtract each row's maximum first (torch.softmax does).",
            lambda q, k, v: _causal(q, k, v, manual=True)),
)
_CAUSAL_UNAVAILABLE = ("attention_core.scaled_dot_product_attention", "attention_core.attention_weights",
                       "attention_core.functional.scaled_dot_product_attention",
                       "attention_core.functional.attention_weights", *_TORCH_ATTENTION)


def _large(*shape: int) -> torch.Tensor:
    """Integer entries up to 30: scores of 300 to 1150, beyond exp's float32 range, computed exactly."""
    return (torch.arange(math.prod(shape), dtype=torch.float32).view(shape) % 7 - 3) * 10


def _ch05() -> FunctionSpec:
    st = _st()

    @st.composite
    def qkv_triples(draw):
        L, E = draw(st.integers(1, 5)), draw(st.integers(1, 4))
        return tuple(_values(draw, (L, E), -3, 3) for _ in range(3))  # q, k, v: (L, E) each

    return FunctionSpec(
        "causal_attention", _sdpa_causal, qkv_triples(), atol=1e-5, rtol=1e-5, max_examples=50,
        arg_names=("q", "k", "v"),
        examples=(
            (T([[0.0], [0.0]]), T([[0.0], [0.0]]), T([[2.0], [4.0]])),  # the statement's example
            (T([[1.0, 2.0]]), T([[3.0, -1.0]]), T([[5.0, 6.0]])),  # length 1
            (_large(3, 4), _large(3, 4), _large(3, 4) / 10),  # large scores
        ),
        unavailable=_CAUSAL_UNAVAILABLE, forbidden_modules=_ATTENTION_MODULES,
        task="to write the scores, the causal mask and the softmax yourself",
        mistakes=_CAUSAL_MISTAKES,
    )


def _ch08() -> FunctionSpec:
    st = _st()

    @st.composite
    def qkv(draw):
        B, H, L, E = (draw(st.integers(1, 3)) for _ in range(4))
        return tuple(_values(draw, (B, H, L, E), -3, 3) for _ in range(3))

    return FunctionSpec(
        "causal_attention", _sdpa_causal, qkv(), atol=1e-5, rtol=1e-5, max_examples=50,
        arg_names=("q", "k", "v"),
        examples=(
            (torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1), T([2.0, 4.0]).view(1, 1, 2, 1)),  # the statement's
            (T([1.0, 2.0]).view(1, 1, 1, 2), T([3.0, -1.0]).view(1, 1, 1, 2), T([5.0, 6.0]).view(1, 1, 1, 2)),
            (_large(2, 1, 3, 4), _large(2, 1, 3, 4), _large(2, 1, 3, 4) / 10),  # large scores
        ),
        unavailable=_CAUSAL_UNAVAILABLE, forbidden_modules=_ATTENTION_MODULES,
        task="to write the scores, the causal mask and the softmax yourself",
        mistakes=_CAUSAL_MISTAKES,
    )


# --------------------------------------------------------------------------------- ch. 6: causal multi-head


def _mha_reference(x, w_q, w_k, w_v, w_o, num_heads):
    import attention_core as ac

    mha = ac.MultiHeadAttention(x.shape[-1], num_heads, bias=False, dtype=x.dtype)
    with torch.no_grad():
        for proj, w in [(mha.q_proj, w_q), (mha.k_proj, w_k), (mha.v_proj, w_v), (mha.out_proj, w_o)]:
            proj.weight.copy_(w.T)  # nn.Linear computes x @ weight.T
        return mha(x, attn_mask=ac.causal_mask(x.shape[1]))[0]


def _mha(x, w_q, w_k, w_v, w_o, H, *, mask=True, scale_d=False, split="ok", merge="ok", out=True, right=True):
    B, L, D = x.shape
    E = D // H
    if not right:
        w_q, w_k, w_v, w_o = w_q.T, w_k.T, w_v.T, w_o.T

    def heads(t):
        if split == "view":  # (B, L, D) read as (B, H, L, E): mixes positions and heads
            return t.reshape(B, H, L, E)
        return t.view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)

    q, k, v = heads(x @ w_q), heads(x @ w_k), heads(x @ w_v)
    s = q @ k.transpose(-2, -1) / math.sqrt(D if scale_d else E)  # (B, H, L, L)
    if mask:
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), NEG_INF)
    o = torch.softmax(s, dim=-1) @ v  # (B, H, L, E)
    o = o.reshape(B, L, D) if merge == "reshape" else o.transpose(1, 2).reshape(B, L, D)  # -> (B, L, D)
    return o @ w_o if out else o


def _ch06() -> FunctionSpec:
    st = _st()

    @st.composite
    def mha_inputs(draw):
        B, L, H, E = (draw(st.integers(1, n)) for n in (2, 5, 3, 3))
        D = H * E
        ts = [_values(draw, s, -1, 1, torch.float64) for s in [(B, L, D)] + [(D, D)] * 4]
        return (*ts, H)

    def ex(B, L, H, E):
        D = H * E
        g = torch.Generator().manual_seed(B * 1000 + L * 100 + H * 10 + E)
        return (*(torch.rand(s, generator=g, dtype=torch.float64) * 2 - 1 for s in [(B, L, D)] + [(D, D)] * 4), H)

    eye = torch.eye(2, dtype=torch.float64)
    return FunctionSpec(
        "causal_multi_head", _mha_reference, mha_inputs(), atol=1e-4, rtol=1e-4, max_examples=40,
        arg_names=("x", "w_q", "w_k", "w_v", "w_o", "num_heads"),
        examples=(
            (T([[[1.0, 2.0], [0.0, 0.0]]], dtype=torch.float64), eye, eye, eye, eye, 2),  # the statement's
            ex(1, 1, 1, 1), ex(2, 4, 2, 3), ex(1, 5, 3, 2), ex(2, 3, 3, 1),  # one token; heads of size 1
        ),
        dtype=("x's dtype", lambda x, *_: x.dtype),
        unavailable=("attention_core.MultiHeadAttention", "attention_core.multihead.MultiHeadAttention",
                     "torch.nn.MultiheadAttention", *_TORCH_ATTENTION),
        forbidden_modules=_ATTENTION_MODULES,
        task="to write the projections, the heads and the causal attention yourself",
        mistakes=(
            Mistake("query i of every head sees keys j <= i only: apply the causal mask.",
                    lambda *a: _mha(*a, mask=False)),
            Mistake("scale by 1/sqrt(E), the size of one head, not by 1/sqrt(D).", lambda *a: _mha(*a, scale_d=True)),
            Mistake("split the last axis into heads, (B, L, H, E), then transpose to (B, H, L, E).",
                    lambda *a: _mha(*a, split="view")),
            Mistake("transpose (B, H, L, E) back to (B, L, H, E) before reshaping to (B, L, D).",
                    lambda *a: _mha(*a, merge="reshape")),
            Mistake("after concatenating the heads, apply the output projection w_o.", lambda *a: _mha(*a, out=False)),
            Mistake("the weights act on the right: x @ w_q, not x @ w_q.T.", lambda *a: _mha(*a, right=False)),
        ),
    )


# ------------------------------------------------------------------------------------------------- ch. 7: RoPE


def _rope_reference(x, positions):
    from attention_core.positional import apply_rotary

    return apply_rotary(x, positions)


def _rope(x, positions, *, interleaved=False, two=True, sign=1.0, shift=0, index=False, times_m=True):
    N, E = x.shape
    i = torch.arange(E // 2, dtype=torch.float64)
    theta = 10000.0 ** (-(2 * i if two else i) / E)  # (E/2,)
    m = (torch.arange(N) if index else positions + shift).to(torch.float64)[:, None]  # (N, 1)
    angle = (m * theta if times_m else theta.expand(N, -1))
    cos, sin = angle.cos().to(x.dtype), (sign * angle.sin()).to(x.dtype)
    if interleaved:
        a, b = x[:, 0::2], x[:, 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(1)
    a, b = x[:, : E // 2], x[:, E // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def _ch07() -> FunctionSpec:
    st = _st()

    @st.composite
    def rope_inputs(draw):
        N, E = draw(st.integers(1, 5)), 2 * draw(st.integers(1, 4))
        positions = T(draw(st.lists(st.integers(0, 100), min_size=N, max_size=N)))
        return _values(draw, (N, E), -5, 5, torch.float64), positions

    f64 = torch.float64
    return FunctionSpec(
        "rope", _rope_reference, rope_inputs(), atol=1e-4, rtol=1e-4, max_examples=50,
        arg_names=("x", "positions"),
        examples=(
            (T([[1.0, 0.0], [1.0, 0.0]], dtype=f64), T([0, 2])),  # the statement's example
            (T([[3.0, -4.0]], dtype=f64), T([0])),  # position 0: unchanged
            (T([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [-1.0, 0.5, 2.0, 0.0]], dtype=f64), T([7, 0, 3])),
        ),
        dtype=("x's dtype", lambda x, positions: x.dtype),
        unavailable=("attention_core.positional.apply_rotary", "attention_core.positional.RotaryEmbedding"),
        forbidden_modules=("attention_core.positional", "attention_core.models"),
        task="to write the rotation of each pair yourself",
        mistakes=(
            Mistake("pair i is made of features i and i + E/2 here, not of neighbours 2i and 2i + 1.",
                    lambda x, p: _rope(x, p, interleaved=True)),
            Mistake("theta_i = 10000^(-2i/E): the exponent has a factor 2.", lambda x, p: _rope(x, p, two=False)),
            Mistake("(a, b) -> (a cos - b sin, a sin + b cos): the pair turns the other way.",
                    lambda x, p: _rope(x, p, sign=-1.0)),
            Mistake("turn each row by its position from positions, not by its row number.",
                    lambda x, p: _rope(x, p, index=True)),
            Mistake("positions are used as given (0-based): do not add 1.", lambda x, p: _rope(x, p, shift=1)),
            Mistake("the angle is m theta_i: multiply the frequency by the row's position.",
                    lambda x, p: _rope(x, p, times_m=False)),
        ),
    )


# ------------------------------------------------------------------------------------- ch. 9: merging partials


def partial_softmax(scores: torch.Tensor, values: torch.Tensor) -> tuple:
    """One block of keys: scores (n,), values (n, Ev) -> o (Ev,), m (), l () (chapter 9's helper)."""
    m = scores.max()
    p = torch.exp(scores - m)  # (n,)
    return p @ values, m, p.sum()


def _whole_row(s1, v1, s2, v2):
    s, v = torch.cat([s1, s2]), torch.cat([v1, v2])  # (n1 + n2,), (n1 + n2, Ev)
    return torch.softmax(s, 0) @ v, s.max(), torch.exp(s - s.max()).sum()


def _merge_collect(out):
    o, m, total = out
    return o / total, m, total


def _merge(o1, m1, l1, o2, m2, l2, *, rescale=True, sign=1, l_too=True, pick=torch.maximum, unstable=False,
           normalise=False):
    m = pick(m1, m2)
    if unstable:
        a1, a2 = torch.exp(m1), torch.exp(m2)
        o, total = (a1 * o1 + a2 * o2) * torch.exp(-m), (a1 * l1 + a2 * l2) * torch.exp(-m)
        return o, m, total
    a1, a2 = (torch.exp(sign * (m1 - m)), torch.exp(sign * (m2 - m))) if rescale else (1.0, 1.0)
    o, total = a1 * o1 + a2 * o2, (a1 * l1 + a2 * l2) if l_too else l1 + l2
    return (o / total if normalise else o), m, total


def _ch09() -> FunctionSpec:
    st = _st()

    @st.composite
    def two_blocks(draw):
        n1, n2, Ev = (draw(st.integers(1, 5)) for _ in range(3))
        scale = draw(st.sampled_from([1.0, 1.0, 1.0, 100.0]))  # x 100: exp(800) overflows float64
        f64 = torch.float64
        return (_values(draw, (n1,), -8, 8, f64) * scale, _values(draw, (n1, Ev), -8, 8, f64),
                _values(draw, (n2,), -8, 8, f64) * scale, _values(draw, (n2, Ev), -8, 8, f64))

    f64 = torch.float64
    return FunctionSpec(
        "merge_partials", _whole_row, two_blocks(), atol=1e-6, rtol=1e-5, max_examples=50,
        arg_names=("o1", "m1", "l1", "o2", "m2", "l2"),
        examples=(
            (T([0.0], dtype=f64), T([[4.0]], dtype=f64), T([2.0], dtype=f64), T([[2.0]], dtype=f64)),  # statement
            (T([800.0, 0.0], dtype=f64), T([[1.0], [2.0]], dtype=f64), T([-800.0], dtype=f64),
             T([[3.0]], dtype=f64)),  # exp(800) overflows
            (T([1.0], dtype=f64), T([[1.0, 2.0]], dtype=f64), T([3.0, 0.5], dtype=f64),
             T([[0.0, 1.0], [4.0, -1.0]], dtype=f64)),  # the second block holds the maximum
        ),
        prepare=lambda s1, v1, s2, v2: (*partial_softmax(s1, v1), *partial_softmax(s2, v2)),
        collect=_merge_collect, output_names=("o / l", "m", "l"),
        forbidden_modules=_ATTENTION_MODULES,
        task="to write the merge of two partial results yourself",
        mistakes=(
            Mistake("the two sums are measured from different maxima: rescale each to the common maximum before "
                    "adding.", lambda *a: _merge(*a, rescale=False)),
            Mistake("rescale by exp(m1 - m), which is at most 1, not by exp(m - m1).", lambda *a: _merge(*a, sign=-1)),
            Mistake("rescale l1 and l2 as well as o1 and o2.", lambda *a: _merge(*a, l_too=False)),
            Mistake("the merged maximum m is the larger of m1 and m2.", lambda *a: _merge(*a, pick=torch.minimum)),
            Mistake("exp(m1) overflows for large scores: rescale with exp(m1 - m), which is at most 1.",
                    lambda *a: _merge(*a, unstable=True)),
            Mistake("return the unnormalised o (a sum, like l); the division by l comes at the end.",
                    lambda *a: _merge(*a, normalise=True)),
        ),
    )


# ------------------------------------------------------------------------------------------- ch. 10: mean pool


def _pool_reference(hidden, mask):
    from attention_core.models.bert import mean_pool

    return mean_pool(hidden, mask)


def _ch10() -> FunctionSpec:
    st = _st()

    @st.composite
    def pool_inputs(draw):
        B, L, D = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
        lengths = T(draw(st.lists(st.integers(1, L), min_size=B, max_size=B)))  # real tokens per sentence
        return _values(draw, (B, L, D), -5, 5, torch.float64), torch.arange(L) < lengths[:, None]

    f64 = torch.float64
    m = lambda h, mask: mask.to(h.dtype)[..., None]  # noqa: E731 - (B, L) -> (B, L, 1)
    return FunctionSpec(
        "mean_pool", _pool_reference, pool_inputs(), atol=1e-5, rtol=1e-5, max_examples=50,
        arg_names=("hidden", "mask"),
        examples=(
            (T([[[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]], dtype=f64), T([[True, True, False]])),  # the statement's
            (T([[[1.0, 2.0], [3.0, 6.0]], [[5.0, 7.0], [9.0, 9.0]]], dtype=f64), T([[True, True], [True, False]])),
            (T([[[-2.0, 0.5, 3.0]]], dtype=f64), T([[True]])),  # one token
        ),
        unavailable=("attention_core.pretrained.mean_pool", "attention_core.models.bert.mean_pool"),
        forbidden_modules=("attention_core.pretrained", "attention_core.models", "attention_core.sentences"),
        task="to write the masked mean yourself",
        mistakes=(
            Mistake("padding tokens are left out: average only the vectors where mask is True.",
                    lambda h, mask: h.mean(1)),
            Mistake("divide by each sentence's number of real tokens, not by L.",
                    lambda h, mask: (h * m(h, mask)).sum(1) / h.shape[1]),
            Mistake("a mean: the masked sum still has to be divided by the number of real tokens.",
                    lambda h, mask: (h * m(h, mask)).sum(1)),
            Mistake("mask is True on the real tokens, not on the padding.",
                    lambda h, mask: (h * m(h, ~mask)).sum(1) / m(h, ~mask).sum(1)),
            Mistake("keep the counts as a (B, 1) column (keepdim) so that they divide each sentence's row.",
                    lambda h, mask: (h * m(h, mask)).sum(1) / mask.sum(1)),
        ),
    )


# ------------------------------------------------------------------------------------------ ch. 11: decode mask


def _decode_reference(L, S, window):
    from attention_core.models.language_model import cached_causal_mask

    return cached_causal_mask(L, S, window)


def _decode(L, S, window, *, upper_left=False, ge=False, no_window=False):
    i = torch.arange(L)[:, None] + (0 if upper_left else S - L)  # (L, 1)
    j = torch.arange(S)[None, :]  # (1, S)
    mask = j <= i
    if window is None or no_window:
        return mask
    return mask & ((j >= i - window) if ge else (j > i - window))


def _ch11() -> FunctionSpec:
    st = _st()
    sizes = st.integers(1, 8).flatmap(lambda S: st.tuples(st.integers(1, S), st.just(S), st.none() | st.integers(1, 8)))
    return FunctionSpec(
        "decode_mask", _decode_reference, sizes, max_examples=50, arg_names=("L", "S", "window"),
        examples=((2, 4, None), (2, 4, 2), (1, 1, None), (3, 6, 1), (2, 3, 8), (4, 4, 3)),
        dtype=("a bool tensor", lambda L, S, window: torch.bool),
        unavailable=("attention_core.models.language_model.cached_causal_mask", "attention_core.masks.causal_mask",
                     "attention_core.masks.sliding_window_mask"),
        forbidden_modules=("attention_core.masks", "attention_core.mask_mods", "attention_core.sparse_patterns",
                           "attention_core.serving", *_ATTENTION_MODULES),
        task="to build the decode-step mask yourself",
        mistakes=(
            Mistake("the L queries are the last L of the S key slots: query i sits at slot S - L + i.",
                    lambda L, S, w: _decode(L, S, w, upper_left=True)),
            Mistake("the window holds `window` keys, the query's own included: one key too many.",
                    lambda L, S, w: _decode(L, S, w, ge=True)),
            Mistake("with an integer window, keys older than the window are masked out.",
                    lambda L, S, w: _decode(L, S, w, no_window=True)),
        ),
    )


# ------------------------------------------------------------------------- ch. 11, exercise 3: a shorter window


def window_loss_rise(model: Any, inputs: torch.Tensor, targets: torch.Tensor, window: int, *, baseline: int = 128,
                     start: int = 512) -> float:
    """How much higher the mean per-token loss on positions ``start`` onwards is with a rolling cache of
    ``window`` keys than with one of ``baseline`` keys, on the passage ``inputs`` (1, L) -> ``targets`` (1, L).
    Computed on whatever passage is given (chapter 11's exercise 3 and its check)."""
    import torch.nn.functional as F

    if not (isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor)) or inputs.shape != targets.shape:
        raise ValueError(f"inputs and targets must be tensors of one shape (1, L), got "
                         f"{getattr(inputs, 'shape', inputs)} and {getattr(targets, 'shape', targets)}")
    if inputs.dim() != 2 or inputs.shape[0] != 1 or not 0 <= start < inputs.shape[1]:
        raise ValueError(f"inputs must be (1, L) with L > start = {start}, got shape {tuple(inputs.shape)}")
    losses = []
    with torch.no_grad():
        for w in (window, baseline):
            logits = model(inputs, model.new_cache(window=w)).logits[0]  # (L, V)
            losses.append(F.cross_entropy(logits, targets[0], reduction="none")[start:].mean().item())
    return losses[0] - losses[1]


def check_window_rise(rise: float, model: Any, inputs: torch.Tensor, targets: torch.Tensor, window: int = 32, *,
                      baseline: int = 128, start: int = 512, atol: float = 1e-3) -> bool:
    """Whether ``rise`` is the rise of the loss (window ``window`` against ``baseline``, positions ``start``
    onwards) on this passage, recomputed here: the check holds on any passage, since it measures the one given."""
    if isinstance(rise, bool) or not isinstance(rise, (int, float)) or not math.isfinite(rise):
        return False
    return abs(rise - window_loss_rise(model, inputs, targets, window, baseline=baseline, start=start)) <= atol


# ------------------------------------------------------------------------------ ch. 12: causal linear attention


def _linear_reference(query, key, value):
    from attention_core.linear_attention import linear_attention

    return linear_attention(query, key, value, is_causal=True, eps=0.0)


def _linear(q, k, v, *, phi=None, causal_offset=0, normalize=True, causal=True):
    phi = phi or (lambda x: torch.nn.functional.elu(x) + 1)
    A = phi(q) @ phi(k).transpose(-2, -1)  # (..., L, L)
    if causal:
        A = A * torch.ones(A.shape[-2:], dtype=torch.bool).tril(causal_offset)
    return (A @ v) / A.sum(-1, keepdim=True) if normalize else A @ v


def _ch12() -> FunctionSpec:
    st = _st()

    @st.composite
    def qkv(draw):
        batch = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
        L, E, Ev = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
        dtype = draw(st.sampled_from([torch.float32, torch.float64]))
        return tuple(_values(draw, (*batch, L, n), -4, 4, dtype) for n in (E, E, Ev))

    return FunctionSpec(
        "causal_linear_attention", _linear_reference, qkv(), atol=1e-5, rtol=1e-5, max_examples=50,
        arg_names=("query", "key", "value"),
        examples=(
            (T([[0.0], [0.0]]), T([[0.0], [0.0]]), T([[2.0], [4.0]])),  # the statement's example
            (T([[1.0, -2.0]]), T([[3.0, 0.5]]), T([[5.0, 6.0]])),  # one token
            (T([[-3.0], [2.0], [-1.0]]), T([[1.0], [-3.0], [2.0]]), T([[1.0], [2.0], [3.0]])),  # elu < 0 matters
            (torch.linspace(-4, 4, 24).view(2, 3, 4), torch.linspace(4, -4, 24).view(2, 3, 4),
             torch.arange(12.0).view(2, 3, 2)),  # a batch, large values
        ),
        unavailable=("attention_core.linear_attention.linear_attention",
                     "attention_core.linear_attention.linear_attention_recurrent",
                     "attention_core.linear_attention.linear_attention_chunked"),
        forbidden_modules=("attention_core.linear_attention", "attention_core.shakespeare", *_ATTENTION_MODULES),
        task="to write causal linear attention yourself",
        mistakes=(
            Mistake("the feature map is elu(x) + 1: elu alone is negative for x < 0, and the normalizer can vanish.",
                    lambda q, k, v: _linear(q, k, v, phi=torch.nn.functional.elu)),
            Mistake("query i reads keys 0..i, itself included: the mask keeps the diagonal.",
                    lambda q, k, v: _linear(q, k, v, causal_offset=-1)),
            Mistake("causal: query i must not read the keys after it.",
                    lambda q, k, v: _linear(q, k, v, causal=False)),
            Mistake("divide by the normalizer phi(q_i) . sum_j phi(k_j), so the weights of a row sum to 1.",
                    lambda q, k, v: _linear(q, k, v, normalize=False)),
        ),
    )


# ------------------------------------------------------------------------------------------ ch. 13: rollout


def _rollout_reference(maps):
    from attention_core.explain.attribution import attention_rollout

    return attention_rollout([m[None] for m in maps])[0].to(maps.dtype)


def _rollout(maps, *, residual=True, half=True, reverse=False, last_only=False):
    eye = torch.eye(maps.shape[-1], dtype=maps.dtype)
    layers = [((m + eye) / 2 if half else m + eye) if residual else m for m in maps]
    if last_only:
        return layers[-1]
    out = layers[0]
    for a in layers[1:]:
        out = out @ a if reverse else a @ out
    return out


def _ch13() -> FunctionSpec:
    st = _st()

    @st.composite
    def stacks(draw):
        n, L = draw(st.integers(1, 4)), draw(st.integers(1, 5))
        scores = _values(draw, (n, L, L), -4, 4, torch.float64)
        return (torch.softmax(scores, -1),)

    f64 = torch.float64
    return FunctionSpec(
        "rollout", _rollout_reference, stacks(), atol=1e-6, rtol=1e-6, max_examples=50, arg_names=("maps",),
        examples=(
            (T([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]], dtype=f64),),  # the chapter's two-layer toy
            (T([[[0.5, 0.5], [0.2, 0.8]]], dtype=f64),),  # one layer
            (T([[[1.0]], [[1.0]], [[1.0]]], dtype=f64),),  # one token
            (T([[[0.9, 0.1, 0.0], [0.0, 0.3, 0.7], [0.5, 0.0, 0.5]], [[0.2, 0.2, 0.6], [1.0, 0.0, 0.0],
                                                                        [0.0, 0.5, 0.5]]], dtype=f64),),
        ),
        unavailable=("attention_core.explain.attention_rollout", "attention_core.explain.attribution.attention_rollout",
                     "attention_core.explain.residual_attention",
                     "attention_core.explain.attribution.residual_attention"),
        forbidden_modules=("attention_core.explain",),
        task="to roll the layers out yourself",
        mistakes=(
            Mistake("each layer's map is (A + I) / 2: the residual connection keeps half of every token.",
                    lambda maps: _rollout(maps, residual=False)),
            Mistake("A + I must be halved so that each row still sums to 1.",
                    lambda maps: _rollout(maps, half=False)),
            Mistake("a later layer mixes the earlier mixtures: multiply it on the left, A'_2 @ A'_1.",
                    lambda maps: _rollout(maps, reverse=True)),
            Mistake("every layer takes part, not only the last.",
                    lambda maps: _rollout(maps, last_only=True)),
        ),
    )


# ----------------------------------------------------------------------------------------- ch. 14: patchify


def _patchify_reference(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    from attention_core.models.vit import patchify

    return patchify(images, patch_size)


def _patch_perm(images: torch.Tensor, p: int, order: tuple) -> torch.Tensor:
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // p, p, W // p, p).permute(*order)  # a chosen order of (B, C, gh, p, gw, p)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


def _ch14() -> FunctionSpec:
    st = _st()

    @st.composite
    def patch_inputs(draw):
        B, C, p = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
        gh, gw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        return _values(draw, (B, C, gh * p, gw * p), -5, 5), p

    ar = lambda *shape: torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)  # noqa: E731
    return FunctionSpec(
        "patchify", _patchify_reference, patch_inputs(), atol=0.0, rtol=0.0, max_examples=40,
        arg_names=("images", "patch_size"),
        examples=((ar(1, 1, 4, 4), 2), (ar(1, 2, 4, 6), 2), (ar(2, 3, 6, 3), 3), (ar(1, 1, 2, 4), 1)),
        unavailable=("attention_core.models.vit.patchify", "torch.nn.functional.unfold", "torch._C._nn.im2col",
                     "torch.ops.aten.im2col"),
        forbidden_modules=("attention_core.models", "attention_core.vision"),
        task="to cut the image into patches yourself (F.unfold computes the whole answer)",
        mistakes=(
            Mistake("a plain reshape to (B, N, C*p*p) mixes pixels of different patches: split H and W into "
                    "(patches, p) first, then move the two patch axes together.",
                    lambda x, p: x.reshape(x.shape[0], -1, x.shape[1] * p * p)),
            Mistake("patches go in reading order: along a row of patches first, then down.",
                    lambda x, p: _patch_perm(x, p, (0, 4, 2, 1, 3, 5))),
            Mistake("each patch is flattened channel first, then row by row, as a (C, p, p) block.",
                    lambda x, p: _patch_perm(x, p, (0, 2, 4, 3, 5, 1))),
            Mistake("inside a patch the pixels go row by row (the row index before the column index).",
                    lambda x, p: _patch_perm(x, p, (0, 2, 4, 1, 5, 3))),
        ),
    )


# ---------------------------------------------------------------------------------- ch. 15: residual distribution


def _residual_reference(p, q):
    from attention_core.serving.speculative import residual_distribution

    return residual_distribution(p, q)


def _residual(p, q, *, normalise=True, reverse=False, guard=True, per_row=True, op="sub"):
    r = (q - p if reverse else p - q).clamp_min(0) if op == "sub" else torch.maximum(p, q)
    if not normalise:
        return r
    mass = r.sum(-1, keepdim=True) if per_row else r.sum()
    out = r / mass
    return torch.where(mass > 0, out, p) if guard else out


def _ch15() -> FunctionSpec:
    st = _st()

    @st.composite
    def pairs(draw):
        B, V = draw(st.integers(1, 3)), draw(st.integers(1, 6))
        dtype = draw(st.sampled_from([torch.float64, torch.float32]))  # the answer must come back in p's dtype
        p = _values(draw, (B, V), 0.01, 1.0, torch.float64)
        p = p / p.sum(-1, keepdim=True)
        kind = draw(st.sampled_from(["equal", "random"] + (["near"] if dtype == torch.float32 else [])))
        if kind == "random":
            q = _values(draw, (B, V), 0.01, 1.0, torch.float64)
        else:  # the draft agrees on the first row, exactly or nearly (a residual of small mass, not none)
            q = p.clone()
            if kind == "near" and V > 1:
                q[0] = q[0] * (1 + 1e-3 * _values(draw, (V,), -1.0, 1.0, torch.float64))
            if B > 1:
                q[1:] = _values(draw, (B - 1, V), 0.01, 1.0, torch.float64)
        q = q / q.sum(-1, keepdim=True)
        if kind == "equal":
            q[0] = p[0]  # exactly: renormalising could leave a residual of rounding noise
        return p.to(dtype), q.to(dtype)

    f64 = torch.float64
    return FunctionSpec(
        "residual", _residual_reference, pairs(), atol=1e-6, rtol=1e-5, max_examples=60, arg_names=("p", "q"),
        examples=(
            (T([0.4, 0.4, 0.2], dtype=f64), T([0.2, 0.3, 0.5], dtype=f64)),  # the statement's
            (T([[0.5, 0.5], [0.9, 0.1]], dtype=f64), T([[0.5, 0.5], [0.1, 0.9]], dtype=f64)),  # p == q in a row
            (T([1.0], dtype=f64), T([1.0], dtype=f64)),  # one token
            (T([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]], dtype=f64), T([[0.1, 0.2, 0.7], [0.3, 0.3, 0.4]], dtype=f64)),
            (T([[0.5002, 0.4998], [0.25, 0.75]]), T([[0.5, 0.5], [0.5, 0.5]])),  # float32; a residual of mass 2e-4
        ),
        dtype=("p's dtype", lambda p, q: p.dtype),
        unavailable=("attention_core.serving.speculative.residual_distribution",),
        forbidden_modules=("attention_core.serving",),
        task="to write the residual distribution yourself",
        mistakes=(
            Mistake("a distribution: divide max(0, p - q) by its sum so that it adds up to 1.",
                    lambda p, q: _residual(p, q, normalise=False)),
            Mistake("the residual is where the target wants more than the draft gave: max(0, p - q), not q - p.",
                    lambda p, q: _residual(p, q, reverse=True)),
            Mistake("where p == q the residual sums to 0: return p there, not 0 / 0.",
                    lambda p, q: _residual(p, q, guard=False)),
            Mistake("normalise each row (the last dim) on its own, not all rows together.",
                    lambda p, q: _residual(p, q, per_row=False)),
            Mistake("the residual is the part of p that q does not cover: p - q clipped at 0, not max(p, q).",
                    lambda p, q: _residual(p, q, op="max")),
        ),
    )


# ------------------------------------------------------------------------------------------------------ index

from attention_core.booktools.exercises_low_precision import ch18_spec as _ch18  # noqa: E402

_BUILDERS: Dict[str, Callable[[], FunctionSpec]] = {
    "ch01.boxcar_nw": _ch01,
    "ch02.masked_softmax": _ch02,
    "ch03.bahdanau_weights": _ch03,
    "ch04.local_p_weights": _ch04,
    "ch05.causal_attention": _ch05,
    "ch06.causal_multi_head": _ch06,
    "ch07.rope": _ch07,
    "ch08.causal_attention": _ch08,
    "ch09.merge_partials": _ch09,
    "ch10.mean_pool": _ch10,
    "ch11.decode_mask": _ch11,
    "ch12.causal_linear_attention": _ch12,
    "ch13.rollout": _ch13,
    "ch14.patchify": _ch14,
    "ch15.residual": _ch15,
    "ch16.zigzag_block_mask": lambda: exercises_distributed.build(),  # its spec lives in exercises_distributed
    "ch18.fake_quantize_blocks": _ch18,
}
#: The chapters' code exercises, by name (``"chNN.function"``).
EXERCISES = tuple(_BUILDERS)


@cache
def spec(exercise: str) -> FunctionSpec:
    """The :class:`FunctionSpec` of a chapter's code exercise, e.g. ``spec("ch02.masked_softmax")``."""
    if exercise not in _BUILDERS:
        raise KeyError(f"exercise must be one of {', '.join(EXERCISES)}; got {exercise!r}")
    return _BUILDERS[exercise]()
