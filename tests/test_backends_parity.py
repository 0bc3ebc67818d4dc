"""Every available backend against torch's F.scaled_dot_product_attention and the float64 NumPy oracle.

Hypothesis draws the whole call: leading dims, heads (GQA or not), lengths, head sizes, the mask kind and its
broadcast shape, fully masked rows, scale, dtype, and for the chunked backend the tile sizes. Tensors come
from a torch generator seeded by Hypothesis, so a failure replays exactly.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attention_core as ac
from attention_core.backends import chunked
from attention_core.backends.numpy_backend import attention_np

#: (atol, rtol) against the float64 oracle on the same (upcast) inputs. Half precision rounds the scores,
#: the weights and the output to 8 (bf16) or 11 (fp16) mantissa bits; float32 sums at most 65 terms.
TOLERANCES = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1e-2, 1e-2),
}
LENGTHS = [1, 2, 3, 5, 17, 33, 65]
BACKENDS = ac.available_backends("cpu")
PARITY = settings(
    max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def cases(draw, dtypes=tuple(TOLERANCES), allow_fully_masked=True):
    """One attention call, as a dict of shapes and options (tensors are made by :func:`make_tensors`)."""
    batch = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    gqa = draw(st.booleans())
    H = draw(st.integers(1, 3))
    Hq = H * draw(st.integers(1, 3)) if gqa else H
    case = dict(
        batch=batch, H=H, Hq=Hq, gqa=gqa,
        L=draw(st.sampled_from(LENGTHS)), S=draw(st.sampled_from(LENGTHS)),
        E=draw(st.sampled_from([2, 8, 16])), Ev=draw(st.sampled_from([3, 8])),
        dtype=draw(st.sampled_from(dtypes)),
        scale=draw(st.one_of(st.none(), st.floats(0.05, 2.0))),
        mask=draw(st.sampled_from(["none", "bool", "float", "causal"])),
        seed=draw(st.integers(0, 2**31 - 1)),
        blocks=draw(st.sampled_from([(4, 8), (16, 4), (256, 256)])),
    )
    lead = (*batch, Hq)
    full = (*lead, case["L"], case["S"])
    keep = [draw(st.booleans()) for _ in full]  # which dims of the mask are full-size (others are 1)
    drop = draw(st.integers(0, len(lead)))  # how many leading dims the mask leaves out
    case["mask_shape"] = tuple(d if k else 1 for d, k in zip(full, keep))[drop:]
    case["dead_rows"] = allow_fully_masked and case["mask"] in ("bool", "float") and draw(st.booleans())
    return case


def make_tensors(case):
    """query (..., Hq, L, E), key/value (..., H, S, E/Ev) and the mask, in float64 (cast later)."""
    g = torch.Generator().manual_seed(case["seed"])
    b, L, S = case["batch"], case["L"], case["S"]
    q = torch.randn(*b, case["Hq"], L, case["E"], generator=g, dtype=torch.float64)
    k = torch.randn(*b, case["H"], S, case["E"], generator=g, dtype=torch.float64)
    v = torch.randn(*b, case["H"], S, case["Ev"], generator=g, dtype=torch.float64)
    shape = case["mask_shape"]
    mask = None
    if case["mask"] == "bool":
        mask = torch.rand(*shape, generator=g) > 0.3
        if case["dead_rows"] and shape[-2] > 1:
            mask[..., :: 2, :] = False  # every other query row sees nothing
    elif case["mask"] == "float":
        mask = torch.randn(*shape, generator=g, dtype=torch.float64)
        mask = mask.masked_fill(torch.rand(*shape, generator=g) < 0.3, float("-inf"))
        if case["dead_rows"] and shape[-2] > 1:
            mask[..., :: 2, :] = float("-inf")
    return q, k, v, mask


def dead_rows(case, mask, out_shape):
    """Bool (..., L, 1): the rows whose keys are all masked."""
    if mask is None:
        return torch.zeros(out_shape[:-1] + (1,), dtype=torch.bool)
    keep = mask if mask.dtype == torch.bool else mask != float("-inf")
    return (~keep.any(-1, keepdim=True)).expand(*out_shape[:-1], 1)


def oracle(q, k, v, mask, case):
    """Float64 NumPy attention on the (already rounded) inputs, heads repeated for GQA."""
    group = case["Hq"] // case["H"]
    kk = np.repeat(k.double().numpy(), group, axis=-3)  # (..., H, S, E) -> (..., Hq, S, E)
    vv = np.repeat(v.double().numpy(), group, axis=-3)  # (..., H, S, Ev) -> (..., Hq, S, Ev)
    m = None if mask is None else (mask.numpy() if mask.dtype == torch.bool else mask.double().numpy())
    return torch.from_numpy(attention_np(q.double().numpy(), kk, vv, m, case["mask"] == "causal", case["scale"]))


@contextlib.contextmanager
def chunked_blocks(blocks):
    """Run the chunked backend with other tile sizes, so that small inputs still span several tiles."""
    saved = chunked.BLOCK_Q, chunked.BLOCK_K
    chunked.BLOCK_Q, chunked.BLOCK_K = blocks
    try:
        yield
    finally:
        chunked.BLOCK_Q, chunked.BLOCK_K = saved


def call(case, q, k, v, mask, backend):
    kwargs = dict(scale=case["scale"], enable_gqa=case["gqa"], is_causal=case["mask"] == "causal")
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    with chunked_blocks(case["blocks"]):
        return ac.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend, **kwargs)


def test_every_backend_is_tested():
    assert {"reference", "numpy", "torch", "chunked"} <= set(BACKENDS)


@PARITY
@given(case=cases())
def test_forward_parity(case):
    dtype = case["dtype"]
    q, k, v, mask = (None if t is None else (t if t.dtype == torch.bool else t.to(dtype)) for t in make_tensors(case))
    expected = oracle(q, k, v, mask, case)
    torch_out = call(case, q, k, v, mask, None)
    dead = dead_rows(case, mask, tuple(expected.shape))
    atol, rtol = TOLERANCES[dtype]
    for name in BACKENDS:
        out = call(case, q, k, v, mask, name)
        assert out.dtype == dtype and out.shape == expected.shape, name
        assert not out.isnan().any(), name
        assert (out.masked_select(dead) == 0).all(), f"{name}: fully masked rows must be zeros"
        torch.testing.assert_close(out.double(), expected, atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(out, torch_out, atol=2 * atol, rtol=2 * rtol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@settings(PARITY, max_examples=60)
@given(case=cases(dtypes=(torch.float64,)))
def test_gradient_parity(case):
    q, k, v, mask = make_tensors(case)
    out_shape = torch.broadcast_shapes(q.shape[:-1], k.shape[:-3] + (1, 1)) + (case["Ev"],)
    grad_out = torch.randn(out_shape, generator=torch.Generator().manual_seed(case["seed"] + 1), dtype=q.dtype)

    def grads(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        call(case, *leaves, mask, backend).backward(grad_out)
        return [t.grad for t in leaves]

    expected = grads(None)
    for name in ("reference", "torch", "chunked"):
        for got, want, what in zip(grads(name), expected, "qkv"):
            assert torch.isfinite(got).all(), f"{name} d{what}"
            torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9,
                                       msg=lambda m, name=name, what=what: f"{name} d{what}: {m}")


@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_masked_everywhere_gives_zeros(backend, dtype):
    q, k, v = (torch.randn(2, 3, 4, 8).to(dtype) for _ in range(3))
    for mask in (torch.zeros(4, 4, dtype=torch.bool), torch.full((4, 4), float("-inf"), dtype=dtype)):
        out = ac.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
        assert (out == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_reference_computes_half_inputs_in_float32_and_answers_in_their_dtype(dtype):
    """Weights in float32 for 16-bit inputs (as torch's math path), multiplied by the values in float32; the
    weights and the output come back in the inputs' dtype."""
    from attention_core.backends import reference as ref

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g).mul(3).to(dtype) for _ in range(3))
    in_float32 = ref.attention_weights(q.float(), k.float(), None, True, 0.35, False)
    w_compute = ref.attention_weights(q, k, None, True, 0.35, False, in_compute_dtype=True)
    assert w_compute.dtype == torch.float32 and torch.equal(w_compute, in_float32)
    w = ref.attention_weights(q, k, None, True, 0.35, False)
    assert w.dtype == dtype and torch.equal(w, in_float32.to(dtype))
    out, weights = ref.attention_with_weights(q, k, v, None, 0.0, True, 0.35, False)
    assert out.dtype == weights.dtype == dtype and torch.equal(weights, w)
    assert torch.equal(out, (in_float32 @ v.float()).to(dtype))
