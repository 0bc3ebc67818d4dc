"""Fuzzing the public edge: every public function either answers or says clearly why not.

Hypothesis draws whole calls, valid and invalid: ranks 0-6, shapes with 0-sized dims, dtypes (bool, integers,
float16, bfloat16, float32, float64, complex), devices (cpu, meta, and device arguments that name no usable
device), masks of any shape and dtype, non-finite values, and option values of every kind (NaN, inf,
negative, ints too large for int64, strings, NumPy scalars, tensors, lists). The property, for each function:

- the call returns a tensor of the documented shape and dtype, and for valid input on the CPU it equals a
  float64 NumPy oracle (tests/_fuzz_oracles.py) within the dtype's tolerance, including the non-finite policy
  of scaled_dot_product_attention (NaN exactly in the rows that read a non-finite value, zeros for rows that
  read nothing); or
- it raises ``ValueError`` or ``TypeError`` whose message names one of the function's arguments.

Anything else (another exception type, a wrong shape or dtype, a NaN where the policy puts none, a value off
the oracle) fails, and Hypothesis shrinks it to a small example; each one found is kept as a plain test in
tests/test_fuzz_regressions.py.

Profiles (registered in tests/conftest.py, chosen by ``--fuzz-profile`` or ``AC_FUZZ_PROFILE``): ``fuzz``,
derandomized, a few hundred examples per function (``make test``); ``slow``, 2,000 per function, fresh random
examples on every run (``make fuzz``, which prints the counts).
"""

from __future__ import annotations

import inspect
import math
import os
import re

import _fuzz_oracles as oracle
import numpy as np
import pytest
import torch
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

import attention_core as ac
from attention_core import masks, positional, scoring
from attention_core.kernel_regression import nadaraya_watson_weights
from attention_core.multihead import kv_cache_bytes

FUZZ = settings.get_profile(os.environ.get("AC_FUZZ_PROFILE", "fuzz"))

NAN, INF = float("nan"), float("inf")
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
OTHERS = (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.complex64, torch.complex128)
#: (atol, rtol) against the float64 oracle: half precision rounds scores, weights and outputs.
TOL = {torch.float64: (1e-10, 1e-10), torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 3e-3),
       torch.bfloat16: (2e-2, 2e-2)}
CPU_BACKENDS = ac.available_backends("cpu")

# ------------------------------------------------------------------------------------------------ values

#: Option values of every kind: the wrong type, the wrong sign, NaN and inf, ints beyond int64, NumPy scalars.
ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2**63, -(2**63) - 1, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["", "0.5", "cpu", "gaussian"]),
    st.sampled_from([np.float32(0.5), np.float64(-1.0), np.int64(2), np.bool_(True), 0.5 + 1j]),
    st.builds(torch.tensor, st.floats(-2, 2)), st.just([1]), st.just(torch.float32),
)
DEVICE_ARGS = st.sampled_from([None, "cpu", torch.device("cpu"), "meta", "cuda", "cuda:1", "nope", 3, 1.5, "mps"])


def sometimes(draw, usual: st.SearchStrategy, odd: st.SearchStrategy, one_in: int = 10):
    """A draw from ``usual``, except one time in ``one_in`` from ``odd`` (shrinking heads for ``usual``)."""
    return draw(odd) if draw(st.integers(0, one_in - 1)) == one_in - 1 else draw(usual)


def sizes(lo: int = 0, hi: int = 4) -> st.SearchStrategy:
    """A size argument: usually small and valid, sometimes anything at all."""
    return st.one_of(st.integers(lo, hi), st.integers(lo, hi), st.integers(lo, hi), ODD)


def make(shape, dtype, seed: int, device: str = "cpu", specials=()) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` with randn-like values from ``seed``; ``specials`` is a list of
    (flat position, value) to write into a floating one (NaN and +-inf)."""
    if device == "meta":
        return torch.empty(shape, dtype=dtype, device="meta")
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.6
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if not dtype.is_floating_point:
        return torch.randint(0 if dtype == torch.uint8 else -3, 4, shape, generator=g).to(dtype)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    if x.numel():
        for pos, val in specials:
            x.view(-1)[pos % x.numel()] = val
    return x


SPECIALS = st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from([NAN, INF, -INF])), min_size=1, max_size=3)


@st.composite
def tensors(draw, shape=None, dtypes=FLOATS + OTHERS, specials=None, device=None, max_rank=6, max_dim=3):
    """A tensor: random rank/shape unless given, a dtype from ``dtypes``, randn-like values, on cpu (or
    ``meta`` one time in 15); NaN/+-inf in some entries if ``specials`` (None: one time in 5)."""
    if shape is None:
        rank = draw(st.integers(0, max_rank))
        shape = tuple(draw(st.lists(st.integers(0, max_dim), min_size=rank, max_size=rank)))
    dtype = draw(st.sampled_from(dtypes))
    device = device or ("meta" if draw(st.integers(0, 14)) == 14 else "cpu")
    if specials is None:
        specials = draw(st.integers(0, 4)) == 4
    return make(shape, dtype, draw(st.integers(0, 2**32 - 1)), device, draw(SPECIALS) if specials else ())


@st.composite
def float_masks(draw, shape, dtype, specials=True):
    """A float (additive) mask of ``shape``: 0, -inf and small biases; NaN and +inf one time in 5."""
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    pick = torch.randint(0, 4, shape, generator=g)
    bias = torch.randn(shape, generator=g, dtype=torch.float64)
    m = torch.where(pick == 0, -INF, torch.where(pick == 1, bias, 0.0))
    if specials and m.numel() and draw(st.integers(0, 4)) == 4:
        m.view(-1)[draw(st.integers(0, m.numel() - 1))] = draw(st.sampled_from([NAN, INF]))
    return m.to(dtype)


@st.composite
def masks_for(draw, full_shape, query_dtype, rank_min=2):
    """None, a mask that broadcasts to ``full_shape`` (bool or float, some dims 1, some leading dims left
    out), or an arbitrary tensor."""
    kind = sometimes(draw, st.sampled_from(["none", "none", "bool", "float", "float"]), st.just("any"))
    if kind == "none":
        return None
    if kind == "any":
        return draw(tensors(max_rank=5))
    keep = [draw(st.booleans()) for _ in full_shape]
    drop = draw(st.integers(0, max(len(full_shape) - rank_min, 0)))
    shape = tuple(d if k else 1 for d, k in zip(full_shape, keep))[drop:]
    if kind == "bool":
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
        return torch.rand(shape, generator=g) < draw(st.sampled_from([0.0, 0.5, 0.8, 1.0]))
    dtype = sometimes(draw, st.sampled_from([torch.float32, query_dtype]), st.sampled_from(FLOATS), one_in=5)
    return draw(float_masks(shape, dtype))


# ------------------------------------------------------------------------------------------- the property


def _names(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p not in ("self", "args", "kwargs")]


def answer(fn, *args, names=None, **kwargs):
    """``fn(*args, **kwargs)``; or ``None`` after checking that it raised ValueError/TypeError naming an argument.

    Any other exception propagates and fails the test.
    """
    names = names or _names(fn)
    try:
        result = fn(*args, **kwargs)
    except (ValueError, TypeError) as err:
        msg = str(err)
        assert any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", msg) for n in names), (
            f"{type(err).__name__} names none of the arguments {names}: {msg}")
        event(f"{getattr(fn, '__name__', type(fn).__name__)}: raised {type(err).__name__}")
        return None
    event(f"{getattr(fn, '__name__', type(fn).__name__)}: answered")
    return result


def close_rotated(got: torch.Tensor, x: torch.Tensor, want: np.ndarray, interleaved: bool, atol, rtol) -> None:
    """RoPE output against the oracle, pair by pair: a pair with a NaN or inf input must come out non-finite
    (whether inf or NaN depends on how a tiny sine rounds, e.g. to 0 in float16, and inf * 0 = NaN); the
    other pairs must equal the oracle."""
    E = x.shape[-1]
    first = np.arange(0, E, 2) if interleaved else np.arange(E // 2)
    second = first + 1 if interleaved else first + E // 2
    a = to64(x)
    bad = ~(np.isfinite(a[..., first]) & np.isfinite(a[..., second]))  # (..., E/2) pairs with a bad input
    g = to64(got)
    for idx in (first, second):
        assert not np.isfinite(g[..., idx][bad]).any(), "a pair with a non-finite input came out finite"
        close(torch.from_numpy(np.where(bad, 0.0, g[..., idx])), np.where(bad, 0.0, want[..., idx]), atol, rtol)


def close(got, want: np.ndarray, atol: float, rtol: float = 0.0, what: str = "") -> None:
    """``got`` (a tensor) equals the oracle's ``want`` within tolerance, NaN where it has NaN."""
    event("compared with the oracle" + (", with NaN" if np.isnan(want).any() else ""))
    np.testing.assert_allclose(oracle.to64(got).astype(np.float64), want, atol=atol, rtol=rtol, equal_nan=True,
                               err_msg=what)


def one_odd(draw, kw: dict, odd: dict | None = None, names=None) -> dict:
    """``kw`` unchanged half the time; else one entry (of ``names``, default all) replaced by an odd value:
    from ``odd[name]`` if given, else :data:`ODD`. Half the calls are thus valid by construction."""
    if draw(st.booleans()):
        name = draw(st.sampled_from(sorted(names or kw)))
        kw = {**kw, name: draw((odd or {}).get(name, ODD))}
        event(f"odd: {name}")
    else:
        event("odd: none")
    return kw


def is_number(x) -> bool:
    return isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, (bool, np.bool_))


def on_cpu(*ts) -> bool:
    return all(t is None or (isinstance(t, torch.Tensor) and t.device.type == "cpu") for t in ts)


# ------------------------------------------------------------------------------------------------- SDPA


#: The ways an attention call is made odd: one per call, for half the calls.
SDPA_ODDITIES = ["dtype", "mixed dtype", "tensor", "object", "mask", "E=0", "is_causal", "scale", "enable_gqa",
                 "dropout_p", "requires_grad", "device"]


@st.composite
def sdpa_calls(draw, with_value=True):
    """Keyword arguments of one attention call. Half are valid by construction: shapes that fit (perhaps
    broadcast, perhaps GQA, perhaps with 0-sized dims), any float dtype, a mask of any valid kind and shape,
    NaN/inf in some rows for half of them, the meta device now and then. The other half get one oddity from
    :data:`SDPA_ODDITIES`."""
    gqa = draw(st.booleans())
    batch = tuple(draw(st.lists(st.sampled_from([1, 2, 2, 0]), max_size=3)))
    H = draw(st.sampled_from([1, 1, 2, 3, 0]))
    Hq = H * draw(st.sampled_from([1, 2, 3])) if gqa else H
    L, S = draw(st.integers(0, 5)), draw(st.integers(0, 5))
    E, Ev = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 3, 0]))
    dtype = draw(st.sampled_from(FLOATS))
    lead = {"query": (*batch, Hq), "key": (*batch, H), "value": (*batch, H)}
    for name in ("key", "value"):  # broadcasting: shrink some of their leading dims to 1
        if draw(st.integers(0, 3)) == 3:
            lead[name] = tuple(1 if draw(st.booleans()) else d for d in lead[name])
    oddity = draw(st.sampled_from(SDPA_ODDITIES)) if draw(st.booleans()) else None
    if oddity == "E=0":
        E = 0
    shapes = {"query": (*lead["query"], L, E), "key": (*lead["key"], S, E), "value": (*lead["value"], S, Ev)}
    if not with_value:
        del shapes["value"]
    device = "meta" if draw(st.integers(0, 14)) == 14 else "cpu"
    bad = draw(st.booleans())  # NaN/inf in some rows of some of query, key, value
    kw = {n: make(s, dtype, draw(st.integers(0, 2**32 - 1)), device,
                  draw(SPECIALS) if bad and draw(st.booleans()) else ())
          for n, s in shapes.items()}
    full = (*torch.broadcast_shapes(*(s[:-2] for s in shapes.values())), L, S) if not gqa else (*batch, Hq, L, S)
    kw["attn_mask"] = draw(masks_for(full, dtype))
    kw["is_causal"] = kw["attn_mask"] is None and draw(st.booleans())
    kw["scale"] = draw(st.none() | st.floats(0.05, 2.0))
    kw["enable_gqa"] = gqa
    if with_value:
        kw["dropout_p"] = 0.0
    names = list(shapes)
    if oddity == "dtype":
        other = draw(st.sampled_from(OTHERS))
        kw.update({n: make(shapes[n], other, 0) for n in names})
    elif oddity == "mixed dtype":
        n = draw(st.sampled_from(names))
        kw[n] = make(shapes[n], draw(st.sampled_from([d for d in FLOATS + OTHERS if d != dtype])), 0)
    elif oddity == "tensor":
        kw[draw(st.sampled_from(names))] = draw(tensors(max_dim=3))
    elif oddity == "object":
        kw[draw(st.sampled_from([*names, "attn_mask"]))] = draw(ODD)
    elif oddity == "mask":
        kw["attn_mask"], kw["is_causal"] = draw(tensors(max_rank=5)), False
    elif oddity in ("is_causal", "scale", "enable_gqa"):
        kw[oddity] = draw(ODD)
    elif oddity == "dropout_p" and with_value:
        kw["dropout_p"] = draw(st.floats(0.0, 0.9) | ODD)
    elif oddity == "requires_grad":
        for n in names:
            kw[n].requires_grad_()
    elif oddity == "device":
        n = draw(st.sampled_from([*names, "attn_mask"]))
        if kw[n] is not None:
            kw[n] = kw[n].to("meta") if kw[n].device.type == "cpu" else torch.zeros(kw[n].shape, dtype=kw[n].dtype)
    event(f"oddity: {oddity}")
    return kw


def _expected_shape(kw, last: int) -> tuple[int, ...]:
    q, k = kw["query"], kw["key"]
    v = kw.get("value", k)
    if kw["enable_gqa"]:
        batch = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        return (*batch, q.shape[-3], q.shape[-2], last)
    return (*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]), q.shape[-2], last)


def _comparable(kw) -> bool:
    """Input the oracle can judge: on the CPU, with a scale that keeps the scores O(1) (scores that overflow
    the dtype are outside the non-finite policy, and a large scale makes the softmax ill-conditioned)."""
    scale = kw["scale"]
    return (on_cpu(kw["query"], kw["key"], kw.get("value"), kw["attn_mask"])
            and (scale is None or (is_number(scale) and scale <= 4)))


def _check_rows(out: torch.Tensor, kw) -> None:
    """The policy's NaN pattern alone (under dropout, where values are random)."""
    want, _ = oracle.attention(kw["query"], kw["key"], kw["value"], kw["attn_mask"], kw["is_causal"], None,
                               kw["enable_gqa"])
    if want.shape[-1]:
        got_nan = torch.isnan(out.detach()).any(-1).numpy()
        np.testing.assert_array_equal(got_nan, np.broadcast_to(np.isnan(want).any(-1), got_nan.shape))


@pytest.mark.parametrize("backend", [None, *CPU_BACKENDS])
@settings(FUZZ)
@given(kw=sdpa_calls(), data=st.data())
def test_scaled_dot_product_attention(backend, kw, data):
    if data.draw(st.integers(0, 19), label="odd backend?") == 19:
        backend = data.draw(st.sampled_from(["triton", "cuda", "nope"]) | ODD, label="backend")
    out = answer(ac.scaled_dot_product_attention, **kw, backend=backend)
    if out is None:
        return
    q, v = kw["query"], kw["value"]
    assert out.dtype == q.dtype and out.device == q.device
    assert tuple(out.shape) == _expected_shape(kw, v.shape[-1])
    if not _comparable(kw):
        return
    if kw["dropout_p"] == 0:
        want, _ = oracle.attention(q, kw["key"], v, kw["attn_mask"], kw["is_causal"], kw["scale"],
                                   kw["enable_gqa"])
        close(out, want, *TOL[q.dtype], what=f"backend={backend}")
    else:  # dropout: random values, but the same NaN rows
        _check_rows(out, kw)


@settings(FUZZ)
@given(kw=sdpa_calls(with_value=False))
def test_attention_weights(kw):
    w = answer(ac.attention_weights, **kw)
    if w is None:
        return
    q, k = kw["query"], kw["key"]
    assert w.dtype == q.dtype and w.device == q.device
    assert tuple(w.shape) == _expected_shape(kw, k.shape[-2])
    if _comparable(kw):
        _, want = oracle.attention(q, k, None, kw["attn_mask"], kw["is_causal"], kw["scale"], kw["enable_gqa"])
        close(w, want, *TOL[q.dtype])


@st.composite
def softmax_calls(draw):
    shape = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=5)))
    dtype = draw(st.sampled_from(FLOATS))
    scores = make(shape, dtype, draw(st.integers(0, 2**32 - 1)), specials=draw(SPECIALS) if draw(st.booleans())
                  else ()) * draw(st.sampled_from([1.0, 4.0, 30.0]))
    kw = dict(scores=scores, mask=draw(masks_for(shape, dtype, rank_min=0)),
              dim=draw(st.integers(-len(shape), len(shape) - 1)))
    return one_odd(draw, kw, {"scores": tensors(max_rank=5) | ODD, "mask": tensors(max_rank=5) | ODD,
                              "dim": st.integers(-7, 7) | ODD})


@settings(FUZZ)
@given(kw=softmax_calls())
def test_masked_softmax(kw):
    w = answer(ac.masked_softmax, **kw)
    if w is None:
        return
    s = kw["scores"]
    assert w.shape == s.shape and w.dtype == s.dtype and w.device == s.device
    if on_cpu(s, kw["mask"]):
        close(w, oracle.masked_softmax(s, kw["mask"], kw["dim"]), *TOL[s.dtype])


# ------------------------------------------------------------------------------------------ mask helpers


def _sizes_of(kw):
    L = kw["L"]
    return L, L if kw.get("S") is None else kw["S"]


def _check_causal(kw, out):
    L, S = _sizes_of(kw)
    assert out.dtype == torch.bool and out.shape == (L, S)
    if out.device.type == "cpu":
        close(out, np.tril(np.ones((L, S), dtype=bool)), 0)


def _check_window(kw, out):
    L, S = _sizes_of(kw)
    assert out.dtype == torch.bool and out.shape == (L, S)
    i, j = np.arange(L)[:, None], np.arange(S)[None, :]
    w = kw["window"]
    want = ((j <= i) & (j > i - w)) if kw.get("causal", True) else (np.abs(i - j) <= w // 2)
    if out.device.type == "cpu":
        close(out, want, 0)


def _check_padding(kw, out):
    lens = kw["valid_lens"]
    assert out.dtype == torch.bool and out.shape == (len(lens), kw["max_len"])
    if out.device.type == "cpu" and on_cpu(*([lens] if isinstance(lens, torch.Tensor) else [])):
        lens = lens.tolist() if isinstance(lens, torch.Tensor) else list(lens)
        close(out, np.arange(kw["max_len"])[None, :] < np.array(lens, dtype=np.int64).reshape(-1, 1), 0)


def _check_to_bool(kw, out):
    m = kw["mask"]
    assert out.dtype == torch.bool and out.shape == m.shape
    if m.device.type == "cpu":
        if m.dtype != torch.bool:
            assert np.isin(to64(m), [0.0, -INF]).all(), "a bias that is not 0/-inf was converted"
        close(out, to64(m) if m.dtype == torch.bool else to64(m) == 0, 0)


def _check_to_additive(kw, out):
    m, dtype = kw["mask"], kw.get("dtype", torch.float32)
    assert out.dtype == dtype and out.shape == m.shape
    if m.device.type == "cpu":
        close(out, np.where(to64(m), 0.0, -INF) if m.dtype == torch.bool else to64(m.to(dtype)), 0)


def _check_mha_mask(kw, out):
    m = kw["mask"]
    assert out.dtype == m.dtype and out.shape == m.shape
    if m.device.type == "cpu":
        close(out, ~to64(m) if m.dtype == torch.bool else to64(m), 0)


def _check_combine(kw, out):
    present = [m for m in kw["masks"] if m is not None]
    if not present:
        assert out is None
        return
    assert out.shape == torch.broadcast_shapes(*(m.shape for m in present))
    floats = [m for m in present if m.is_floating_point()]
    assert out.dtype == (floats[0].dtype if floats else torch.bool)
    if not on_cpu(*present):
        return
    if not floats:
        close(out, np.logical_and.reduce([np.broadcast_to(to64(m), out.shape) for m in present]), 0)
        return
    terms = [np.where(to64(m), 0.0, -INF) if m.dtype == torch.bool else to64(m.to(out.dtype)) for m in present]
    with np.errstate(invalid="ignore"):
        close(out, sum(terms), *TOL[out.dtype])


def to64(t):
    return oracle.to64(t)


@st.composite
def bool_or_float_masks(draw, zero_or_neginf=False):
    """A mask of up to 4 dims: bool, or float made of 0, -inf and (unless ``zero_or_neginf``) biases."""
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=4)))
    if draw(st.booleans()):
        return make(shape, torch.bool, draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from(["cpu", "cpu", "meta"])))
    m = draw(float_masks(shape, draw(st.sampled_from(FLOATS)), specials=not zero_or_neginf))
    return m.clamp(max=0).masked_fill(m < 0, -INF) if zero_or_neginf else m


SIZE = st.integers(0, 5)
ODD_TENSOR = ODD | tensors(max_rank=4)
ODD_DEVICE = st.sampled_from(["cuda", "cuda:1", "nope", 3, 1.5, "mps", "meta"]) | ODD

MASK_HELPERS = {
    "causal_mask": (masks.causal_mask, lambda: st.fixed_dictionaries(
        {"L": SIZE, "S": st.none() | SIZE, "device": st.sampled_from([None, "cpu", torch.device("cpu")])}),
        {"device": ODD_DEVICE}, _check_causal),
    "sliding_window_mask": (masks.sliding_window_mask, lambda: st.fixed_dictionaries(
        {"L": SIZE, "window": st.integers(1, 6), "S": st.none() | SIZE, "causal": st.booleans()}),
        {}, _check_window),
    "padding_mask": (masks.padding_mask, lambda: SIZE.flatmap(lambda n: st.fixed_dictionaries(
        {"valid_lens": st.lists(st.integers(0, n), max_size=4) | st.builds(
            lambda v, dt: torch.tensor(v, dtype=dt), st.lists(st.integers(0, n), max_size=4),
            st.sampled_from([torch.int64, torch.int32, torch.uint8])), "max_len": st.just(n)})),
        {"valid_lens": ODD_TENSOR | st.lists(st.integers(-2, 8) | ODD, min_size=1, max_size=3)}, _check_padding),
    "to_bool_mask": (masks.to_bool_mask, lambda: st.fixed_dictionaries({"mask": bool_or_float_masks(True)}),
                     {"mask": ODD_TENSOR | bool_or_float_masks()}, _check_to_bool),
    "to_additive_mask": (masks.to_additive_mask, lambda: st.fixed_dictionaries(
        {"mask": bool_or_float_masks(), "dtype": st.sampled_from(FLOATS)}),
        {"mask": ODD_TENSOR, "dtype": st.sampled_from(OTHERS) | ODD}, _check_to_additive),
    "to_torch_mha_mask": (masks.to_torch_mha_mask, lambda: st.fixed_dictionaries({"mask": bool_or_float_masks()}),
                          {"mask": ODD_TENSOR}, _check_mha_mask),
    "from_torch_mha_mask": (masks.from_torch_mha_mask, lambda: st.fixed_dictionaries(
        {"mask": bool_or_float_masks()}), {"mask": ODD_TENSOR}, _check_mha_mask),
    "combine_masks": (masks.combine_masks, lambda: st.fixed_dictionaries(
        {"masks": st.lists(st.none() | bool_or_float_masks(), max_size=3)}),
        {"masks": st.lists(st.none() | bool_or_float_masks() | ODD_TENSOR, min_size=1, max_size=3)}, _check_combine),
}


@pytest.mark.parametrize("helper", list(MASK_HELPERS))
@settings(FUZZ)
@given(data=st.data())
def test_mask_helpers(helper, data):
    fn, valid, odd, check = MASK_HELPERS[helper]
    kw = data.draw(valid(), label="valid kwargs")
    kw = one_odd(data.draw, kw, odd)
    if helper == "combine_masks":
        out = answer(fn, *kw["masks"], names=["masks"])
        if out is not None or all(m is None for m in kw["masks"]):
            check(kw, out)
        return
    out = answer(fn, **kw)
    if out is not None:
        check(kw, out)


# ------------------------------------------------------------------------------------ MultiHeadAttention


@st.composite
def mha_configs(draw):
    Hq = draw(st.sampled_from([1, 2, 4]))
    kw = {"embed_dim": Hq * draw(st.sampled_from([1, 2, 3])), "num_heads": Hq,
          "num_kv_heads": draw(st.sampled_from([None, *[g for g in (1, 2, 4) if Hq % g == 0]])),
          "dropout": draw(st.sampled_from([0.0, 0.3])), "bias": draw(st.booleans()),
          "kdim": draw(st.sampled_from([None, 3])), "vdim": draw(st.sampled_from([None, 2])),
          "device": draw(st.sampled_from([None, "cpu"])), "dtype": draw(st.sampled_from([None, *FLOATS]))}
    odd_int = st.integers(-1, 9) | ODD
    return one_odd(draw, kw, {"embed_dim": odd_int, "num_heads": odd_int, "num_kv_heads": odd_int,
                              "kdim": odd_int, "vdim": odd_int, "dropout": st.sampled_from([1.0, -0.1]) | ODD,
                              "device": ODD_DEVICE, "dtype": st.sampled_from(OTHERS + ("float32",)) | ODD})


@settings(FUZZ)
@given(kw=mha_configs())
def test_multihead_construction(kw):
    m = answer(ac.MultiHeadAttention, **kw)
    if m is None:
        return
    D, Hq = kw["embed_dim"], kw["num_heads"]
    dtype = kw.get("dtype") or torch.get_default_dtype()
    assert m.q_proj.weight.shape == (D, D) and m.out_proj.weight.shape == (D, D)
    assert m.k_proj.weight.shape == (D // Hq * (kw.get("num_kv_heads") or Hq), kw.get("kdim") or D)
    assert all(p.dtype == dtype for p in m.parameters())


@st.composite
def mha_calls(draw):
    """A valid small module (GQA or not, kdim/vdim, bias, dtype, train/eval) and the arguments of one call."""
    Hq = draw(st.sampled_from([1, 2, 4]))
    H = Hq // draw(st.sampled_from([g for g in (1, 2, 4) if Hq % g == 0]))
    D = Hq * draw(st.sampled_from([1, 2, 3]))
    kdim, vdim = draw(st.sampled_from([None, 3])), draw(st.sampled_from([None, 2]))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float64]))
    torch.manual_seed(draw(st.integers(0, 2**32 - 1)))
    m = ac.MultiHeadAttention(D, Hq, num_kv_heads=H, dropout=draw(st.sampled_from([0.0, 0.3])),
                              bias=draw(st.booleans()), kdim=kdim, vdim=vdim, dtype=dtype)
    m.train(draw(st.booleans()))
    B, L = draw(st.integers(0, 2)), draw(st.integers(0, 4))
    self_attn = kdim is None and vdim is None and draw(st.booleans())
    S = L if self_attn else draw(st.integers(0, 4))

    def x(shape):
        return make(shape, dtype, draw(st.integers(0, 2**32 - 1)), specials=draw(SPECIALS) if draw(
            st.integers(0, 3)) == 3 else ())

    kw = {"query": x((B, L, D))}
    if not self_attn:
        kw["key"] = x((B, S, kdim or D))
        if vdim is not None or draw(st.booleans()):
            kw["value"] = x((B, S, vdim or D))
    full = draw(st.sampled_from([(L, S), (B, L, S), (B, Hq, L, S)]))
    kw["attn_mask"] = draw(masks_for(full, dtype, rank_min=len(full)))
    kw["key_padding_mask"] = draw(st.none() | masks_for((B, S), dtype, rank_min=2))
    kw["is_causal"], kw["need_weights"] = draw(st.booleans()), draw(st.booleans())
    kw["backend"] = draw(st.sampled_from([None, None, None, *CPU_BACKENDS]))
    wrong = st.sampled_from([d for d in FLOATS + OTHERS if d != dtype]).map(lambda d: make((B, L, D), d, 0))
    kw = one_odd(draw, kw, {n: ODD | tensors(max_rank=4) | wrong for n in ("query", "key", "value")}
                 | {n: ODD | tensors(max_rank=5) for n in ("attn_mask", "key_padding_mask")}
                 | {"backend": ODD | st.just("nope")})
    return m, kw


@np.errstate(all="ignore")
def _mha_oracle(m, kw):
    """Float64 projections, the masks combined as the module documents (bool ones AND-ed, float ones added,
    bool becoming 0/-inf when mixed), attention under the policy, then the output projection."""
    def lin(layer, x):
        w = to64(layer.weight)
        return to64(x) @ w.T + (to64(layer.bias) if layer.bias is not None else 0.0)

    query = kw["query"]
    key = query if kw.get("key") is None else kw["key"]
    value = key if kw.get("value") is None else kw["value"]
    B, L, S = query.shape[0], query.shape[1], key.shape[1]
    Hq, H, E = m.num_heads, m.num_kv_heads, m.head_dim
    q = lin(m.q_proj, query).reshape(B, L, Hq, E).transpose(0, 2, 1, 3)  # (B, L, D) -> (B, Hq, L, E)
    k = lin(m.k_proj, key).reshape(B, S, H, E).transpose(0, 2, 1, 3)  # (B, S, kdim) -> (B, H, S, E)
    v = lin(m.v_proj, value).reshape(B, S, H, E).transpose(0, 2, 1, 3)  # (B, S, vdim) -> (B, H, S, E)
    given = []
    if kw.get("attn_mask") is not None:
        a = kw["attn_mask"]
        given.append(a.unsqueeze(1) if a.dim() == 3 else a)  # (B, L, S) -> (B, 1, L, S)
    if kw.get("key_padding_mask") is not None:
        given.append(kw["key_padding_mask"][:, None, None, :])  # (B, S) -> (B, 1, 1, S)
    causal = bool(kw.get("is_causal"))
    if causal and given:
        given.append(torch.ones(L, S, dtype=torch.bool).tril())
        causal = False
    mask = None
    floats = [g for g in given if g.is_floating_point()]
    if floats:  # added in the first float mask's dtype, as the module does
        dt = floats[0].dtype
        mask = sum(g.to(dt) if g.is_floating_point() else torch.zeros(g.shape, dtype=dt).masked_fill(~g, -INF)
                   for g in given)
        mask = mask.to(torch.float64)
    elif given:
        mask = given[0]
        for g in given[1:]:
            mask = mask & g
    out, weights = oracle.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), mask, causal,
                                    None, H != Hq)
    out = out.transpose(0, 2, 1, 3).reshape(B, L, Hq * E)  # (B, Hq, L, E) -> (B, L, D)
    w_o = to64(m.out_proj.weight)
    return out @ w_o.T + (to64(m.out_proj.bias) if m.out_proj.bias is not None else 0.0), weights


@settings(FUZZ)
@given(call=mha_calls())
def test_multihead_forward(call):
    m, kw = call
    res = answer(m, **kw, names=_names(m.forward))
    if res is None:
        return
    out, weights = res
    q = kw["query"]
    key = q if kw.get("key") is None else kw["key"]
    B, L, S = q.shape[0], q.shape[1], key.shape[1]
    assert out.shape == (B, L, m.embed_dim) and out.dtype == m.q_proj.weight.dtype
    assert (weights is None) == (not kw["need_weights"])
    if weights is not None:
        assert weights.shape == (B, m.num_heads, L, S)
    if not m.training or m.dropout == 0:  # deterministic: compare with the float64 oracle
        want, want_w = _mha_oracle(m, kw)
        atol, rtol = TOL[out.dtype]
        close(out, want, atol * 10, rtol * 10)
        if weights is not None:
            close(weights, want_w, atol * 10, rtol * 10)


# ---------------------------------------------------------------------------------- kernel regression


@st.composite
def nw_calls(draw, with_values=True):
    L, S, d = draw(st.integers(0, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(FLOATS))
    one_d = d == 1 and draw(st.booleans())
    seed = draw(st.integers(0, 2**32 - 1))
    kw = {"queries": make((L,) if one_d else (L, d), dtype, seed),
          "keys": make((S,) if one_d else (S, d), dtype, seed + 1)}
    if with_values:
        kw["values"] = make(draw(st.sampled_from([(S,), (S, 2)])), dtype, seed + 2)
    kw["kernel"] = draw(st.sampled_from(["gaussian", "boxcar", "epanechnikov"]))
    kw["bandwidth"] = draw(st.floats(0.2, 5.0) | st.floats(0.2, 5.0).map(torch.tensor))
    kw["attn_mask"] = draw(st.none() | st.builds(lambda s: make((L, S), torch.bool, s), st.integers(0, 2**32 - 1)))
    return one_odd(draw, kw, {"queries": ODD_TENSOR, "keys": ODD_TENSOR | st.just(torch.zeros(0, d, dtype=dtype)),
                              "values": ODD_TENSOR, "attn_mask": ODD_TENSOR,
                              "kernel": ODD | st.just("triangular"),
                              "bandwidth": ODD | tensors(max_rank=1) | st.sampled_from([0.0, -1.0])})


@pytest.mark.parametrize("fn", [ac.nadaraya_watson, nadaraya_watson_weights], ids=lambda f: f.__name__)
@settings(FUZZ)
@given(data=st.data())
def test_nadaraya_watson(fn, data):
    kw = data.draw(nw_calls(with_values=fn is ac.nadaraya_watson), label="kwargs")
    out = answer(fn, **kw)
    if out is None:
        return
    q, k = kw["queries"], kw["keys"]
    L, S = q.shape[0], k.shape[0]
    want_shape = (L, S) if fn is nadaraya_watson_weights else (L, *kw["values"].shape[1:])
    assert out.shape == want_shape and out.dtype == q.dtype
    h = kw["bandwidth"]
    h = float(h) if isinstance(h, torch.Tensor) and h.device.type == "cpu" else h
    # Half precision is checked for shape and dtype only: its squared distances lose the digits a sharp kernel
    # needs. A tiny or huge bandwidth is ill-conditioned in any precision.
    if (on_cpu(q, k, kw.get("values"), kw["attn_mask"]) and is_number(h) and 0.2 <= h <= 5
            and q.dtype in (torch.float32, torch.float64)):
        w, o, u2 = oracle.nadaraya_watson(q, k, kw.get("values", k), kw["kernel"], h, kw["attn_mask"])
        if kw["kernel"] != "gaussian":  # a pair on the kernel's edge may fall either side when rounded
            assume(not (np.abs(u2 - 1.0) < 1e-2).any())
        atol, rtol = TOL[q.dtype]
        close(out, w if fn is nadaraya_watson_weights else o, atol * 10, rtol * 10)


# ----------------------------------------------------------------------------------------------- scoring


@st.composite
def pairs(draw, dims=None, dtype=None):
    """(query, key) of shapes that fit: leading dims that broadcast, last dims ``dims`` = (Dq, Dk)."""
    batch = tuple(draw(st.lists(st.integers(0, 2), max_size=3)))
    kb = batch if draw(st.integers(0, 3)) < 3 else tuple(1 for _ in batch)
    L, S = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    if dims is None:
        D = draw(st.integers(1, 4))
        dims = (D, D)
    dtype = dtype or draw(st.sampled_from(FLOATS))
    seed = draw(st.integers(0, 2**32 - 1))
    return make((*batch, L, dims[0]), dtype, seed), make((*kb, S, dims[1]), dtype, seed + 1)


@np.errstate(all="ignore")
def _score_oracle(name, q, k, extra, module):
    a, b = to64(q), to64(k)
    if name == "dot":
        return a @ np.swapaxes(b, -1, -2)
    if name == "scaled_dot":
        scale = extra.get("scale")
        return a @ np.swapaxes(b, -1, -2) * (1 / np.sqrt(a.shape[-1]) if scale is None else float(scale))
    if name == "cosine":
        eps, t = float(extra.get("eps", 1e-8)), float(extra.get("temperature", 1.0))
        a = a / np.maximum(np.linalg.norm(a, axis=-1, keepdims=True), eps)
        b = b / np.maximum(np.linalg.norm(b, axis=-1, keepdims=True), eps)
        return a @ np.swapaxes(b, -1, -2) / t
    if name == "general":
        return a @ np.swapaxes(b @ to64(module.W.weight).T, -1, -2)
    if name == "additive":
        h = (a @ to64(module.W_q.weight).T)[..., :, None, :] + (b @ to64(module.W_k.weight).T)[..., None, :, :]
    else:
        w = to64(module.W_c.weight)
        Dq = module.query_dim
        h = (a @ w[:, :Dq].T)[..., :, None, :] + (b @ w[:, Dq:].T)[..., None, :, :]
    return (np.tanh(h) @ to64(module.v.weight).T)[..., 0]


SCORES = ["dot", "scaled_dot", "cosine", "general", "additive", "concat", "make_score"]
ODD_DIM = st.integers(-1, 5) | ODD


@pytest.mark.parametrize("name", SCORES)
@settings(FUZZ)
@given(data=st.data())
def test_scores(name, data):
    draw = data.draw
    extra, module = {}, None
    if name == "make_score":
        score = draw(st.sampled_from(list(scoring.SCORES)))
        kw = {"name": score, **{d: draw(st.integers(1, 4)) for d in scoring.SCORES[score]}}
        if not scoring.SCORES[score] and draw(st.booleans()):
            kw["query_dim"] = kw["key_dim"] = draw(st.integers(1, 4))
        kw = one_odd(draw, kw, {"name": ODD | st.just("bilinear"), "query_dim": ODD_DIM, "key_dim": ODD_DIM,
                                "hidden_dim": ODD_DIM}, names=["name", "query_dim", "key_dim", "hidden_dim"])
        module = answer(scoring.make_score, **kw)
        if module is not None:
            assert isinstance(module, torch.nn.Module)
        return
    if name in ("dot", "scaled_dot", "cosine"):
        fn = {"dot": scoring.dot_score, "scaled_dot": scoring.scaled_dot_score, "cosine": scoring.cosine_score}[name]
        query, key = draw(pairs(), label="query, key")
        kw = {"query": query, "key": key}
        if name == "scaled_dot":
            kw["scale"] = draw(st.none() | st.floats(0.1, 3))
        if name == "cosine":
            kw.update(temperature=draw(st.floats(0.1, 3)), eps=draw(st.sampled_from([1e-8, 1e-3])))
        kw = one_odd(draw, kw, {"query": ODD_TENSOR, "key": ODD_TENSOR | st.just(make((2, 3, 7), torch.float32, 0)),
                                "scale": ODD, "temperature": ODD | st.just(0.0), "eps": ODD | st.just(-1.0)})
        query, key = kw.pop("query"), kw.pop("key")
        extra = kw
        out = answer(fn, query, key, **extra)
    else:
        cls = {"general": scoring.GeneralScore, "additive": scoring.AdditiveScore, "concat": scoring.ConcatScore}[name]
        names = _names(cls.__init__)
        dims = one_odd(draw, {n: draw(st.integers(1, 4)) for n in names}, {n: ODD_DIM for n in names})
        module = answer(cls, **dims)
        if module is None:
            return
        dtype = draw(st.sampled_from([torch.float32, torch.float64]), label="module dtype")
        module.to(dtype)
        query, key = draw(pairs((dims["query_dim"], dims["key_dim"]), dtype), label="query, key")
        qk = one_odd(draw, {"query": query, "key": key}, {
            "query": ODD_TENSOR | st.just(query.to(torch.float16)), "key": ODD_TENSOR | st.just(key[..., :0])})
        query, key = qk["query"], qk["key"]
        out = answer(module, query, key, names=_names(module.forward))
    if out is None:
        return
    lead = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2])
    assert out.shape == (*lead, query.shape[-2], key.shape[-2]) and out.dtype == query.dtype
    moderate = all(v is None or (is_number(v) and 0.05 < v < 10) for n, v in extra.items() if n != "eps")
    if on_cpu(query, key) and moderate:
        atol, rtol = TOL[query.dtype]
        close(out, _score_oracle(name, query, key, extra, module), atol * 20, rtol * 20)


# ------------------------------------------------------------------------------------------- positional

POSITIONAL = ["sinusoidal_encoding", "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding",
              "rotary_angles", "apply_rotary", "rotate_half", "RotaryEmbedding"]
BASE = st.sampled_from([10000.0, 10.0, 2])
ODD_BASE = ODD | st.sampled_from([1.0, 0.5, -3.0])
ODD_X = ODD_TENSOR | st.builds(lambda s: make((2, 3, 5), torch.float32, s), st.integers(0, 9))


def _x(draw, D, dtype=None):
    shape = (draw(st.integers(0, 2)), draw(st.integers(0, 5)), D)
    return make(shape, dtype or draw(st.sampled_from(FLOATS)), draw(st.integers(0, 2**32 - 1)),
                specials=draw(SPECIALS) if draw(st.integers(0, 3)) == 3 else ())


def positional_oracle(layer, x: torch.Tensor, offset: int) -> np.ndarray:
    """What a positional layer must add to ``x`` (B, L, D), in float64. A learned table is the documented sum: the
    table cast to x's dtype (an init_std of 1e18 is inf in float16), added, and the sum held in x's dtype (60000 +
    60000 is inf in float16 too), as float16 gives it; the float64 sum would expect 8.0e18 where float16 has inf."""
    L, D = x.shape[1], x.shape[2]
    if isinstance(layer, positional.SinusoidalPositionalEncoding):
        return to64(x) + oracle.sinusoidal(offset + L, D, float(layer.base))[offset:]
    table = to64(layer.weight.detach()[offset:offset + L].to(x.dtype))
    return to64(torch.from_numpy(to64(x) + table).to(x.dtype))


@pytest.mark.parametrize("name", POSITIONAL)
@settings(FUZZ)
@given(data=st.data())
def test_positional(name, data):
    draw = data.draw
    even = st.integers(1, 3).map(lambda n: 2 * n)
    if name == "sinusoidal_encoding":
        kw = one_odd(draw, {"num_positions": draw(st.integers(0, 6)), "d_model": draw(even), "base": draw(BASE),
                            "dtype": draw(st.sampled_from(FLOATS)), "device": draw(st.sampled_from([None, "cpu"]))},
                     {"num_positions": ODD_DIM, "d_model": ODD_DIM, "base": ODD_BASE,
                      "dtype": st.sampled_from(OTHERS) | ODD, "device": ODD_DEVICE})
        out = answer(positional.sinusoidal_encoding, **kw)
        if out is not None:
            assert out.shape == (kw["num_positions"], kw["d_model"]) and out.dtype == kw["dtype"]
            if out.device.type == "cpu":
                close(out, oracle.sinusoidal(kw["num_positions"], kw["d_model"], float(kw["base"])),
                      TOL[out.dtype][0] * 10 + 1e-6)
        return
    if name in ("SinusoidalPositionalEncoding", "LearnedPositionalEmbedding"):
        D = draw(even)
        args = {"d_model": D, "max_len": draw(st.integers(1, 8)), "dropout": draw(st.sampled_from([0.0, 0.5]))}
        odd = {"d_model": ODD_DIM, "max_len": ODD_DIM, "dropout": ODD | st.just(1.0)}
        if name == "SinusoidalPositionalEncoding":
            cls, args, odd = positional.SinusoidalPositionalEncoding, {**args, "base": draw(BASE)}, {
                **odd, "base": ODD_BASE}
        else:
            cls, args, odd = positional.LearnedPositionalEmbedding, {
                **args, "init_std": draw(st.sampled_from([0.02, 1.0]))}, {**odd, "init_std": ODD}
        layer = answer(cls, **one_odd(draw, args, odd))
        if layer is None:
            return
        layer.eval()
        fwd = one_odd(draw, {"x": _x(draw, D), "offset": draw(st.integers(0, 3))}, {"x": ODD_X, "offset": ODD})
        x, offset = fwd["x"], fwd["offset"]
        out = answer(layer, x, offset, names=["x", "offset"])
        if out is not None:
            assert out.shape == x.shape and out.dtype == x.dtype and out.device == x.device
            if on_cpu(x):
                L = x.shape[1]
                atol, rtol = TOL[x.dtype]  # the sinusoidal table is kept in float32
                close(out, positional_oracle(layer, x, offset), atol * 10 + 1e-6, rtol * 10)
        return
    if name == "rotary_angles":
        kw = one_odd(draw, {"positions": draw(tensors(shape=(draw(st.integers(0, 5)),), dtypes=(
            torch.int64, torch.float32, torch.float64), device="cpu")), "head_dim": draw(even), "base": draw(BASE)},
            {"positions": ODD_TENSOR, "head_dim": ODD_DIM, "base": ODD_BASE})
        res = answer(positional.rotary_angles, **kw)
        if res is not None:
            cos, sin = res
            assert cos.shape == sin.shape == (kw["positions"].shape[0], kw["head_dim"] // 2)
            assert cos.dtype == sin.dtype == torch.float64
        return
    if name == "rotate_half":
        x = one_odd(draw, {"x": draw(tensors(shape=(*draw(st.lists(st.integers(0, 3), max_size=3)), draw(even)),
                                             dtypes=FLOATS))}, {"x": ODD_X})["x"]
        out = answer(positional.rotate_half, x)
        if out is not None:
            assert out.shape == x.shape and out.dtype == x.dtype
            if on_cpu(x):
                h = x.shape[-1] // 2
                close(out, np.concatenate([-to64(x)[..., h:], to64(x)[..., :h]], -1), 0)
        return
    E = draw(even)
    x = draw(tensors(shape=(*draw(st.lists(st.integers(0, 3), max_size=3)), draw(st.integers(0, 5)), E),
                     dtypes=FLOATS))
    L = x.shape[-2]
    if name == "apply_rotary":
        positions = draw(st.none() | tensors(shape=(L,), dtypes=(torch.int64, torch.float32), device=x.device.type))
        kw = one_odd(draw, {"x": x, "positions": positions, "base": draw(BASE), "interleaved": draw(st.booleans())},
                     {"x": ODD_X, "positions": ODD_TENSOR, "base": ODD_BASE})
        out = answer(positional.apply_rotary, **kw)
        if out is None:
            return
        x, positions = kw["x"], kw["positions"]
        assert out.shape == x.shape and out.dtype == x.dtype
        pos = np.arange(x.shape[-2]) if positions is None else to64(positions) if on_cpu(positions) else None
        if on_cpu(x) and pos is not None and np.isfinite(pos).all():
            want = oracle.rotary(x, pos.astype(np.float64), float(kw["base"]), kw["interleaved"])
            atol, rtol = TOL[x.dtype]
            close_rotated(out, x, want, kw["interleaved"], atol * 10 + 1e-9, rtol * 10)
        return
    rope_kw = one_odd(draw, {"head_dim": E, "max_len": draw(st.integers(1, 9)), "base": draw(BASE),
                             "interleaved": draw(st.booleans())},
                      {"head_dim": ODD_DIM, "max_len": ODD_DIM, "base": ODD_BASE})
    rope = answer(positional.RotaryEmbedding, **rope_kw)
    if rope is None:
        return
    key = draw(tensors(shape=(*x.shape[:-2], draw(st.integers(0, 5)), E), dtypes=FLOATS, device=x.device.type))
    kw = one_odd(draw, {"query": x, "key": key, "offset": draw(st.integers(0, 3)),
                        "key_offset": draw(st.none() | st.integers(0, 3))},
                 {"query": ODD_X, "key": ODD_X, "offset": ODD, "key_offset": ODD})
    res = answer(rope, **kw, names=_names(rope.forward))
    if res is None:
        return
    for t, got, start in ((kw["query"], res[0], kw["offset"]),
                          (kw["key"], res[1], kw["offset"] if kw["key_offset"] is None else kw["key_offset"])):
        assert got.shape == t.shape and got.dtype == t.dtype
        if on_cpu(t):  # the module keeps float32 angles: float32's accuracy at best
            want = oracle.rotary(t, np.arange(start, start + t.shape[-2], dtype=np.float64), float(rope.base),
                                 rope.interleaved)
            atol, rtol = TOL[t.dtype]
            close_rotated(got, t, want, rope.interleaved, atol * 10 + 1e-6, rtol * 10)


# --------------------------------------------------------------------------------------- small helpers


@settings(FUZZ)
@given(data=st.data())
def test_weights_entropy(data):
    w = one_odd(data.draw, {"weights": data.draw(tensors(dtypes=FLOATS, max_rank=4, specials=False))},
                {"weights": ODD_TENSOR})["weights"]
    out = answer(ac.weights_entropy, w)
    if out is not None:
        assert out.dtype == w.dtype and out.shape == (w.shape[:-1] if w.dim() else ())
        if on_cpu(w):
            a = to64(w)
            with np.errstate(divide="ignore", invalid="ignore"):
                terms = np.where(a == 0, 0.0, a * np.log(a))
            close(out, -(terms.sum(-1) if a.ndim else terms), *TOL[w.dtype])


@settings(FUZZ)
@given(data=st.data())
def test_kv_cache_bytes(data):
    names = ["num_layers", "num_kv_heads", "head_dim", "tokens", "batch", "bytes_per_element"]
    kw = {n: data.draw(st.integers(0 if n == "tokens" else 1, 2**40)) for n in names}
    kw = one_odd(data.draw, kw, {n: st.integers(-3, 0) | ODD for n in names})
    out = answer(kv_cache_bytes, **kw)
    if out is not None:
        assert isinstance(out, int) and out == 2 * math.prod(kw.values())
