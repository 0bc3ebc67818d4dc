"""The chunked backend: gradients, tiling, causal tile skipping, and that it never builds an (L, S) matrix."""

from __future__ import annotations

import pytest
import torch
from _poisoned import poisoned_memory
from torch.utils._python_dispatch import TorchDispatchMode

import attention_core as ac
from attention_core.backends import chunked
from attention_core.backends.chunked import chunked_attention
from attention_core.backends.reference import attention as reference_attention

BLOCKS = [(2, 3), (64, 64)]  # several tiles each way, and a single tile


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    """Every output buffer starts as NaN, so a tile the loops skipped by mistake shows up."""
    with poisoned_memory():
        yield


def inputs(B=1, Hq=2, H=1, L=5, S=7, E=3, Ev=2, dtype=torch.float64, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, L, E, generator=g, dtype=dtype)
    k = torch.randn(B, H, S, E, generator=g, dtype=dtype)
    v = torch.randn(B, H, S, Ev, generator=g, dtype=dtype)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def masks(L, S, seed=0):
    """Named masks for (L, S) attention; the bool and float ones fully mask the last query row."""
    g = torch.Generator().manual_seed(seed)
    bool_mask = torch.rand(L, S, generator=g) > 0.4
    bool_mask[-1] = False
    float_mask = torch.randn(1, 1, L, S, generator=g, dtype=torch.float64)
    float_mask[..., -1, :] = float("-inf")
    key_mask = torch.rand(1, 1, 1, S, generator=g) > 0.3
    return {"none": None, "bool": bool_mask[None, None], "float": float_mask, "key": key_mask, "causal": "causal"}


def run(fn, q, k, v, mask, **kw):
    causal = isinstance(mask, str)
    return fn(q, k, v, None if causal else mask, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1], **kw)


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("mask_name", ["none", "bool", "float", "key", "causal"])
def test_gradcheck_chunked(mask_name, blocks):
    q, k, v = inputs(grad=True)
    mask = masks(5, 7)[mask_name]
    block_q, block_k = blocks
    fn = lambda q, k, v: run(chunked_attention, q, k, v, mask, block_q=block_q, block_k=block_k)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("mask_name", ["none", "bool", "float", "causal"])
def test_gradcheck_reference_through_public_api(mask_name):
    q, k, v = inputs(grad=True)
    mask = masks(5, 7)[mask_name]
    fn = lambda q, k, v: run(ac.scaled_dot_product_attention, q, k, v, mask, backend="reference")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_reference_float_mask_gradient():
    q, k, v = inputs()
    mask = torch.randn(1, 1, 5, 7, dtype=torch.float64, requires_grad=True)
    fn = lambda m: ac.scaled_dot_product_attention(q, k, v, attn_mask=m, backend="reference", enable_gqa=True)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (mask,))


@pytest.mark.parametrize("L,S,blocks", [(13, 13, (3, 8)), (9, 21, (8, 3)), (21, 9, (3, 8)), (1, 17, (8, 3)),
                                        (17, 1, (3, 8))])
@pytest.mark.parametrize("mask_name", ["none", "bool", "float", "key", "causal"])
def test_forward_and_backward_equal_reference(L, S, blocks, mask_name):
    q, k, v = inputs(B=2, Hq=6, H=2, L=L, S=S, E=4, Ev=5, seed=L * S)
    mask = masks(L, S, seed=L + S)[mask_name]
    block_q, block_k = blocks
    results = []
    for fn, kw in ((chunked_attention, dict(block_q=block_q, block_k=block_k)), (_ref, {})):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(fn, *leaves, mask, **kw)
        out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).view(out.shape))
        results.append([out, *(t.grad for t in leaves)])
    for got, want, what in zip(*results, ["out", "dq", "dk", "dv"]):
        assert torch.isfinite(got).all(), what
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12, msg=lambda m, what=what: f"{what}: {m}")


def _ref(q, k, v, mask, is_causal, enable_gqa):
    return reference_attention(q, k, v, mask, 0.0, is_causal, q.shape[-1] ** -0.5, enable_gqa)


def test_fully_masked_rows_have_zero_output_and_gradient():
    q, k, v = inputs(L=6, S=9, grad=True)
    mask = torch.ones(6, 9, dtype=torch.bool)
    mask[2] = False
    out = chunked_attention(q, k, v, mask[None, None], block_q=2, block_k=4)
    out.sum().backward()
    assert (out[:, :, 2] == 0).all()
    assert (q.grad[:, :, 2] == 0).all()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(dtype):
    q, k, v = inputs(B=1, Hq=2, H=2, L=40, S=300, E=16, Ev=16, dtype=torch.float64)
    want = _ref(q, k, v, None, False, False)
    got = chunked_attention(q.to(dtype), k.to(dtype), v.to(dtype), block_q=8, block_k=8)
    assert got.dtype == dtype
    ref_err = (_ref(q.to(dtype), k.to(dtype), v.to(dtype), None, False, False).double() - want).abs().max()
    assert (got.double() - want).abs().max() <= 2 * ref_err + 1e-3


_CUSTOM_OPS = {"chunked_forward": chunked._forward_op, "chunked_backward": chunked._backward_op}


class _Recorder(TorchDispatchMode):
    """Records, for every aten op that runs, its name and the size of its largest output tensor."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inner = _CUSTOM_OPS.get(str(func.overloadpacket.__name__))
        if inner is not None:  # the backend's custom operators: record the aten ops inside them
            with self:
                return inner._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        sizes = [t.numel() for t in outs if isinstance(t, torch.Tensor)]
        self.ops.append((str(func.overloadpacket.__name__), max(sizes, default=0)))
        return out


@pytest.mark.parametrize("is_causal", [False, True])
def test_never_allocates_an_L_by_S_matrix(is_causal):
    B, Hq, H, L, S, block = 2, 4, 2, 64, 96, 16
    q, k, v = inputs(B=B, Hq=Hq, H=H, L=L, S=S, E=8, Ev=8, dtype=torch.float32, grad=True)
    mask = None if is_causal else (torch.rand(1, 1, 1, S) > 0.2)  # a key mask: O(S), not O(L * S)
    with _Recorder() as rec:
        out = chunked_attention(q, k, v, mask, is_causal=is_causal, block_q=block, block_k=block)
        out.backward(torch.ones_like(out))
    largest = max(size for _, size in rec.ops)
    G = Hq // H
    assert largest <= max(B * H * G * block * block, B * Hq * L * 8, B * H * S * 8)  # a tile, or an input
    assert largest < B * Hq * L * S // 4
    with _Recorder() as naive:  # the check can fail: the reference does build (B, Hq, L, S)
        _ref(q, k, v, mask, is_causal, True).sum().backward()
    assert max(size for _, size in naive.ops) >= B * Hq * L * S


def test_causal_skips_tiles_above_the_diagonal():
    q, k, v = inputs(B=1, Hq=1, H=1, L=64, S=64, E=4, Ev=4, dtype=torch.float32)
    counts = {}
    for causal in (False, True):
        with _Recorder() as rec:
            chunked_attention(q, k, v, is_causal=causal, block_q=16, block_k=16)
        counts[causal] = sum(name == "bmm" for name, _ in rec.ops)  # one score matmul per visited tile
    assert counts[False] == 16  # 4 query tiles x 4 key tiles
    assert counts[True] == 1 + 2 + 3 + 4  # tiles on or below the diagonal only


@pytest.mark.parametrize("L,S", [(5, 40), (40, 5)])
def test_causal_skipping_with_unequal_lengths(L, S):
    q, k, v = inputs(B=1, Hq=2, H=2, L=L, S=S, E=4, Ev=3)
    got = chunked_attention(q, k, v, is_causal=True, block_q=4, block_k=4)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_empty_lengths():
    for L, S in ((0, 5), (5, 0), (0, 0)):
        q, k, v = inputs(L=L, S=S, Hq=1)
        out = chunked_attention(q, k, v, block_q=2, block_k=2)
        assert out.shape == (1, 1, L, 2) and (out == 0).all()


@pytest.mark.parametrize("bad, error", [(dict(block_q=0), ValueError), (dict(block_k=-1), ValueError),
                                        (dict(block_q=2.5), TypeError), (dict(block_k=True), TypeError)])
def test_bad_blocks(bad, error):
    q, k, v = inputs()
    with pytest.raises(error, match="block_. must be an int >= 1"):
        chunked_attention(q, k, v, **bad)


def test_rejects_non_canonical_layout():
    q, k, v = (t[0] for t in inputs())
    with pytest.raises(ValueError, match="4-D"):
        chunked_attention(q, k, v)


def _count(rec, name):
    return sum(op == name for op, _ in rec.ops)


@pytest.mark.parametrize("is_causal", [False, True])
def test_forward_fixes_the_max_after_the_first_key_tile(is_causal):
    # Without a mask every row sees key 0, so after the first key tile the max is fixed: one row max per query
    # tile, not one per tile (the later tiles skip the max and the rescale), and the output is still exact.
    q, k, v = inputs(B=1, Hq=2, H=1, L=64, S=64, E=4, Ev=3)
    with _Recorder() as rec:
        got = chunked_attention(q, k, v, is_causal=is_causal, enable_gqa=True, block_q=16, block_k=16)
    tiles = 1 + 2 + 3 + 4 if is_causal else 16
    assert _count(rec, "bmm") == tiles  # each tile's scores computed once: no query tile was redone
    assert _count(rec, "amax") == 4  # one per query tile
    torch.testing.assert_close(got, _ref(q, k, v, None, is_causal, True), atol=1e-12, rtol=1e-12)


def test_forward_fixes_the_max_once_every_row_has_seen_a_key():
    # The first key tile is hidden from every row: the max is tracked until the second tile, then fixed; no row's
    # reference is the "lowest" start value (it would overflow every sum, and the query tile would be redone).
    q, k, v = inputs(B=1, Hq=1, H=1, L=8, S=24, E=4, Ev=3)
    mask = torch.ones(1, 1, 8, 24, dtype=torch.bool)
    mask[..., :8] = False
    with _Recorder() as rec:
        got = chunked_attention(q, k, v, mask, block_q=8, block_k=8)
    assert _count(rec, "bmm") == 3 and _count(rec, "amax") == 2
    torch.testing.assert_close(got, _ref(q, k, v, mask, False, False), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype, big", [(torch.float32, 200.0), (torch.float64, 1000.0)])
def test_a_later_score_far_above_the_fixed_max_is_redone_exactly(dtype, big):
    # Key 2's score is `big` (natural units) above the first tile's max: exp2 of it overflows the fixed-max sums
    # (float32 past 2^128, float64 past 2^1024), so the query tile is redone with the max tracked tile by tile.
    q = torch.ones(1, 1, 1, 1, dtype=dtype, requires_grad=True)
    k = torch.tensor([0.0, 0.5, big], dtype=dtype).view(1, 1, 3, 1).requires_grad_()
    v = torch.tensor([1.0, 2.0, 3.0], dtype=dtype).view(1, 1, 3, 1).requires_grad_()
    with _Recorder() as rec:
        out = chunked_attention(q, k, v, scale=1.0, block_q=1, block_k=1)
    assert _count(rec, "bmm") == 3 + 3  # three tiles, twice
    torch.testing.assert_close(out, _ref_scaled(q, k, v, 1.0))
    out.backward(torch.ones_like(out))
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    _ref_scaled(q, k, v, 1.0).backward(torch.ones_like(out))
    for got, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, t.grad)


def _ref_scaled(q, k, v, scale):
    return reference_attention(q, k, v, None, 0.0, False, scale, False)
