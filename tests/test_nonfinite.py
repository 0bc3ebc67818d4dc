"""The non-finite policy of scaled_dot_product_attention, backend by backend (the fuzz test checks it on random
calls too; these are the cases a reader can follow).

Policy: a NaN or +-inf in query row i makes output row i NaN; one in key or value row j makes NaN every row
that reads key j (not removed by the mask or is_causal); a NaN or +inf in a float mask at (i, j) makes row i
NaN, while -inf removes the pair; a row that reads no key is zeros, whatever its query holds; every other row
equals the result without the bad value. The triton backend is checked under the interpreter in
tests/_triton_interp_cases.py ("nonfinite_policy").
"""

from __future__ import annotations

import pytest
import torch

import attention_core as ac

BACKENDS = ac.available_backends("cpu")
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True, params=["host check", "tensor ops"])
def policy_path(request, monkeypatch):
    """Every test runs twice: as eager CPU calls do (a host-side check, the cleaning only when it fails) and as
    a GPU, ``torch.compile`` or ``torch.func`` call does (tensor operations only, on every call)."""
    if request.param == "tensor ops":
        monkeypatch.setattr("attention_core.functional.check_on_host", lambda *tensors: False)
    return request.param


def qkv(L=4, S=5, E=8, Ev=3, H=2, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g).to(dtype) for shape in ((1, H, L, E), (1, H, S, E), (1, H, S, Ev)))


def nan_rows(out: torch.Tensor) -> list[list[int]]:
    """For each head, the indices of the rows holding a NaN."""
    return [torch.nonzero(torch.isnan(out[0, h]).any(-1)).flatten().tolist() for h in range(out.shape[1])]


def assert_rows_equal(got, want, rows):
    """Rows ``rows`` of every head equal ``want``'s (the result on clean inputs)."""
    torch.testing.assert_close(got[..., rows, :], want[..., rows, :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_bad_query_row_poisons_only_its_row(backend, bad):
    q, k, v = qkv()
    clean = ac.scaled_dot_product_attention(q, k, v, backend=backend)
    q[0, 1, 2, 5] = bad
    out = ac.scaled_dot_product_attention(q, k, v, backend=backend)
    assert nan_rows(out) == [[], [2]]  # head 1, row 2 only: torch's CPU kernel alone used to return zeros
    assert_rows_equal(out[:, :1], clean[:, :1], [0, 1, 2, 3])
    assert_rows_equal(out[:, 1:], clean[:, 1:], [0, 1, 3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["key", "value"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_bad_key_or_value_poisons_the_rows_that_read_it(backend, where, bad):
    q, k, v = qkv(L=4, S=4)
    clean = ac.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    (k if where == "key" else v)[0, 0, 2, 1] = bad  # key/value row 2 of head 0
    out = ac.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    assert nan_rows(out) == [[2, 3], []]  # causal: rows 0 and 1 never read key 2
    assert_rows_equal(out[:, :1], clean[:, :1], [0, 1])  # ... and equal the clean result (no 0 * NaN leak)
    assert_rows_equal(out[:, 1:], clean[:, 1:], [0, 1, 2, 3])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_masked_out_bad_value_is_never_read(backend, kind):
    q, k, v = qkv(L=3, S=4)
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[0, 1] = keep[2, 1] = False  # rows 0 and 2 do not read key 1
    mask = keep if kind == "bool" else torch.zeros(3, 4).masked_fill(~keep, -INF)
    clean = ac.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    k[0, :, 1, 0], v[0, :, 1, 2] = NAN, INF
    out = ac.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    assert nan_rows(out) == [[1], [1]]
    assert_rows_equal(out, clean, [0, 2])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [NAN, INF])
def test_nan_or_plus_inf_in_a_float_mask_poisons_its_row(backend, bad):
    q, k, v = qkv(L=3, S=4)
    mask = torch.zeros(3, 4)
    mask[0, 3] = -INF  # removes a pair: not an error
    clean = ac.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    mask[1, 2] = bad
    out = ac.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
    assert nan_rows(out) == [[1], [1]]
    assert_rows_equal(out, clean, [0, 2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_that_reads_nothing_stays_zero_even_with_a_nan_query(backend):
    q, k, v = qkv(L=3, S=4)
    q[0, :, 1] = NAN
    for mask in (torch.tensor([[True] * 4, [False] * 4, [True] * 4]),
                 torch.tensor([[0.0] * 4, [-INF] * 4, [0.0] * 4])):
        out = ac.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend=backend)
        assert (out[0, :, 1] == 0).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_keys_at_all_gives_zeros(backend):
    q, k, v = qkv(S=0)
    q[0, 0, 0, 0] = NAN
    out = ac.scaled_dot_product_attention(q, k, v, backend=backend)
    assert out.shape == (1, 2, 4, 3) and (out == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_poisons_every_query_head_of_the_group(backend):
    q, k, v = qkv(H=1)
    q = q.repeat(1, 4, 1, 1)  # (1, 4, L, E): 4 query heads share one key/value head
    k, v = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)  # (1, 2, S, .): 2 groups of 2
    v[0, 1, 0, 0] = NAN  # value row 0 of key/value head 1 -> query heads 2 and 3
    out = ac.scaled_dot_product_attention(q, k, v, enable_gqa=True, backend=backend)
    assert nan_rows(out) == [[], [], [0, 1, 2, 3], [0, 1, 2, 3]]


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b in ("reference", "torch")])
def test_dropout_keeps_the_pattern(backend):
    q, k, v = qkv()
    q[0, 0, 1, 0] = NAN
    torch.manual_seed(0)
    out = ac.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend=backend)
    assert nan_rows(out) == [[1], []]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_every_backend_agrees_in_every_dtype(dtype):
    q, k, v = qkv(dtype=dtype)
    q[0, 1, 3, 0], k[0, 0, 4, 2] = INF, NAN
    outs = {b: ac.scaled_dot_product_attention(q, k, v, backend=b) for b in BACKENDS}
    patterns = {b: nan_rows(o) for b, o in outs.items()}
    assert all(p == [[0, 1, 2, 3], [3]] for p in patterns.values()), patterns


def test_weights_follow_the_policy_and_values_do_not_touch_them():
    q, k, v = qkv(L=3, S=4)
    k[0, 0, 0, 0], v[0, 1, 2, 0] = NAN, NAN
    w = ac.attention_weights(q, k, is_causal=True)
    assert nan_rows(w) == [[0, 1, 2], []]  # every row reads key 0
    out, w2 = ac.functional.attention_with_weights(q, k, v, is_causal=True)
    assert nan_rows(w2) == [[0, 1, 2], []] and nan_rows(out) == [[0, 1, 2], [2]]


def test_multihead_attention_follows_the_policy():
    torch.manual_seed(0)
    m = ac.MultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 4, 8)
    clean, _ = m(x, is_causal=True, need_weights=True)
    x[1, 2, 3] = NAN  # token 2 of sequence 1: its own row and, causally, the later ones
    out, weights = m(x, is_causal=True, need_weights=True)
    assert torch.isnan(out[1]).any(-1).tolist() == [False, False, True, True]
    assert torch.equal(out[0], clean[0]) and torch.equal(out[1, :2], clean[1, :2])
    assert torch.isnan(weights[1]).any(-1).tolist() == [[False, False, True, True]] * 2


def test_gradients_stay_finite_outside_the_poisoned_rows():
    q, k, v = (t.requires_grad_() for t in qkv(L=3, S=3))
    with torch.no_grad():
        q[0, 0, 0, 0] = NAN
    out = ac.scaled_dot_product_attention(q, k, v)
    out[:, :, 1:].sum().backward()  # a loss that reads only clean rows
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert (q.grad[0, 0, 0] == 0).all()  # the poisoned row got no gradient from this loss
