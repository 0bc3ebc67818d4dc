"""The attention path is compile- and transform-friendly: no branch on a tensor's value, no host sync.

``torch.compile(fullgraph=True)`` (the ``eager`` and ``aot_eager`` backends, which trace the graph without
generating code, and inductor, which compiles it to C++ here) and ``torch.func.vmap`` over
:func:`attention_core.scaled_dot_product_attention` give the eager answers for the ``reference``, ``torch`` and
``chunked`` backends, the non-finite policy included. ``chunked`` is a custom operator; its fake implementation
is checked on shapes alone. (The Triton kernels are custom operators too: tests/_triton_interp_cases.py compiles
through them under the interpreter.)
"""

from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import attention_core as ac
from attention_core import _nonfinite
from attention_core.backends import chunked

BACKENDS = ["reference", "torch", "chunked"]


def _inputs(B=2, Hq=4, H=2, L=5, S=7, E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, E, generator=g)
    k, v = torch.randn(B, H, S, E, generator=g), torch.randn(B, H, S, E, generator=g)
    return q, k, v


def _mask_kinds(L=5, S=7):
    g = torch.Generator().manual_seed(1)
    return {
        "none": {},
        "causal": {"is_causal": True},
        "float": {"attn_mask": torch.randn(L, S, generator=g).masked_fill(torch.rand(L, S, generator=g) < 0.3,
                                                                           -math.inf)},
        "bool": {"attn_mask": torch.rand(2, 1, L, S, generator=g) < 0.7},
    }


def _poisoned(q, k, v):
    q, k, v = q.clone(), k.clone(), v.clone()
    q[0, 1, 2, 3] = math.nan
    k[1, 0, 4, 0] = math.inf
    v[0, 1, 6, 2] = -math.inf
    return q, k, v


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
@pytest.mark.parametrize("kind", sorted(_mask_kinds()))
@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_matches_eager(backend, kind, compiler):
    kw = _mask_kinds()[kind]
    torch._dynamo.reset()

    def f(q, k, v):
        return ac.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend, **kw)

    compiled = torch.compile(f, fullgraph=True, backend=compiler)
    for q, k, v in (_inputs(), _poisoned(*_inputs())):  # finite inputs, then the non-finite policy
        want, got = f(q, k, v), compiled(q, k, v)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, equal_nan=True)
    assert got.isnan().any()  # the policy put NaN rows in, under compile as in eager


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_gradients_match_eager(backend):
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in _inputs())
    f = lambda q, k, v: ac.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,  # noqa: E731
                                                        backend=backend)
    want = torch.autograd.grad(f(q, k, v).square().sum(), (q, k, v))
    got = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v).square().sum(),
                              (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inductor_forward_and_gradients_match_eager(backend):
    """Generated code, not only a traced graph: inductor's C++ kernels give the eager forward and gradients."""
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in _inputs())

    def f(q, k, v):
        return ac.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, backend=backend)

    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    want_out, got_out = f(q, k, v), compiled(q, k, v)
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad(want_out.square().sum(), (q, k, v))
    got = torch.autograd.grad(got_out.square().sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", sorted(_mask_kinds()))
@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_matches_a_loop(backend, kind):
    kw = _mask_kinds()[kind]
    q, k, v = _poisoned(*_inputs())
    qs = torch.stack([q, q.flip(-2), q * 0.5])  # (3, B, Hq, L, E): the mapped dim

    def f(q, k, v):
        return ac.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend, **kw)

    got = torch.func.vmap(f, in_dims=(0, None, None))(qs, k, v)
    want = torch.stack([f(x, k, v) for x in qs])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, equal_nan=True)
    ks = torch.stack([k, k.flip(-2)])  # map over key and value too, batched at another dim
    vs = torch.stack([v, -v], dim=2)
    got = torch.func.vmap(f, in_dims=(None, 0, 2))(q, ks, vs)
    want = torch.stack([f(q, ks[i], vs[:, :, i]) for i in range(2)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6, equal_nan=True)


def test_vmap_over_a_batched_mask():
    q, k, v = _inputs(B=1, Hq=2, H=2)
    masks = torch.rand(4, 1, 1, 5, 7, generator=torch.Generator().manual_seed(2)) < 0.6  # mapped, (1, 1, L, S)
    for backend in BACKENDS:
        f = lambda m, b=backend: ac.scaled_dot_product_attention(q, k, v, m, backend=b)  # noqa: E731
        torch.testing.assert_close(torch.func.vmap(f)(masks), torch.stack([f(m) for m in masks]))


def test_no_host_branch_under_transforms_and_on_the_host_when_eager():
    q, k, v = _inputs()
    assert _nonfinite.check_on_host(q, k, v, None)  # eager CPU: the cheap check may branch (no sync there)
    seen = []
    torch.func.vmap(lambda x: seen.append(_nonfinite.check_on_host(x, k, v, None)) or x)(q)
    assert seen == [False]  # a vmapped tensor: tensor operations only
    assert not _nonfinite.check_on_host(q.to("meta"), None)


def test_fake_implementation_gives_the_output_shapes():
    with FakeTensorMode():
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            q = torch.empty(3, 6, 10, 16, dtype=dtype)
            k, v = torch.empty(3, 2, 12, 16, dtype=dtype), torch.empty(3, 2, 12, 5, dtype=dtype)
            out, lse = chunked._forward_op(q, k, v, None, False, 0.25, 4, 4)
            compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
            assert out.shape == (3, 6, 10, 5) and out.dtype == compute
            assert lse.shape == (3 * 2, 3, 10, 1) and lse.dtype == compute
            dq, dk, dv = chunked._backward_op(out, q, k, v, None, out, lse, False, 0.25, 4, 4)
            assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
            assert chunked.chunked_attention(q, k, v).dtype == dtype


def test_custom_op_passes_torch_opcheck():
    q, k, v = _inputs(B=1, Hq=2, H=1, L=3, S=4, E=4)
    q.requires_grad_()
    torch.library.opcheck(chunked._forward_op, (q, k, v, None, True, 0.5, 2, 2))
