"""MultiHeadAttention: the same function as torch.nn.MultiheadAttention, GQA, weights, dropout, gradients."""

from __future__ import annotations

import pytest
import torch

import attention_core as ac
from attention_core.multihead import MultiHeadAttention, kv_cache_bytes

D64 = torch.float64


def torch_mha(embed_dim=8, num_heads=2, batch_first=True, seed=0, **kw):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(embed_dim, num_heads, batch_first=batch_first, dtype=D64, **kw)
    with torch.no_grad():  # torch zero-initialises the biases; make them count
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m.eval()


def run_torch(m, q, k, v, **kw):
    """Call torch's module on batch-first tensors, transposing for batch_first=False."""
    if not m.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (B, N, D) -> (N, B, D)
    out, weights = m(q, k, v, average_attn_weights=False, **kw)
    return (out if m.batch_first else out.transpose(0, 1)), weights  # (L, B, D) -> (B, L, D)


@pytest.mark.parametrize("batch_first", [True, False])
def test_self_attention_equals_torch(batch_first):
    m = torch_mha(batch_first=batch_first)
    x = torch.randn(3, 5, 8, dtype=D64)
    want, want_w = run_torch(m, x, x, x)
    ours = ac.MultiHeadAttention.from_torch(m)
    out, weights = ours(x, need_weights=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(weights, want_w)  # per head: (B, Hq, L, S)
    torch.testing.assert_close(ours(x)[0], want)


@pytest.mark.parametrize("batch_first", [True, False])
def test_cross_attention_with_other_kdim_vdim_equals_torch(batch_first):
    m = torch_mha(embed_dim=12, num_heads=3, batch_first=batch_first, kdim=5, vdim=7)
    q, k, v = torch.randn(2, 4, 12, dtype=D64), torch.randn(2, 6, 5, dtype=D64), torch.randn(2, 6, 7, dtype=D64)
    want, _ = run_torch(m, q, k, v)
    out, _ = ac.MultiHeadAttention.from_torch(m)(q, k, v)
    torch.testing.assert_close(out, want)


def test_causal_mask_converted_for_torch():
    m = torch_mha()
    x = torch.randn(2, 6, 8, dtype=D64)
    want, _ = run_torch(m, x, x, x, attn_mask=ac.to_torch_mha_mask(ac.causal_mask(6)))
    ours = ac.MultiHeadAttention.from_torch(m)
    torch.testing.assert_close(ours(x, attn_mask=ac.causal_mask(6))[0], want)
    torch.testing.assert_close(ours(x, is_causal=True)[0], want)


@pytest.mark.parametrize("batch_first", [True, False])
def test_key_padding_equals_torch(batch_first):
    m = torch_mha(batch_first=batch_first)
    q, kv = torch.randn(2, 4, 8, dtype=D64), torch.randn(2, 6, 8, dtype=D64)
    real = ac.padding_mask([6, 3], 6)  # (B, S), True = real token
    want, want_w = run_torch(m, q, kv, kv, key_padding_mask=ac.to_torch_mha_mask(real))
    out, weights = ac.MultiHeadAttention.from_torch(m)(q, kv, key_padding_mask=real, need_weights=True)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(weights, want_w)
    assert (weights[1, :, :, 3:] == 0).all()


def test_without_bias_equals_torch():
    m = torch_mha(bias=False)
    x = torch.randn(2, 5, 8, dtype=D64)
    ours = ac.MultiHeadAttention.from_torch(m)
    assert ours.q_proj.bias is None and ours.out_proj.bias is None
    torch.testing.assert_close(ours(x)[0], run_torch(m, x, x, x)[0])


def test_mask_shapes_and_merging():
    mha = ac.MultiHeadAttention(8, 2).double()
    x = torch.randn(2, 5, 8, dtype=D64)
    mask = torch.rand(2, 5, 5) > 0.3
    full = mask[:, None].expand(2, 2, 5, 5)  # (B, L, S) -> (B, Hq, L, S)
    torch.testing.assert_close(mha(x, attn_mask=mask)[0], mha(x, attn_mask=full)[0])
    torch.testing.assert_close(mha(x, attn_mask=mask[0])[0][0], mha(x[:1], attn_mask=mask[0])[0][0])
    real = ac.padding_mask([5, 2], 5)
    merged = ac.causal_mask(5) & real[:, None, None, :]
    torch.testing.assert_close(
        mha(x, is_causal=True, key_padding_mask=real)[0], mha(x, attn_mask=merged)[0]
    )


def test_gqa_module_shapes():
    mha = ac.MultiHeadAttention(16, 4, num_kv_heads=2)
    assert mha.k_proj.out_features == mha.v_proj.out_features == 2 * 4  # num_kv_heads * head_dim
    q, kv = torch.randn(3, 5, 16), torch.randn(3, 7, 16)
    out, weights = mha(q, kv, need_weights=True)
    assert out.shape == (3, 5, 16) and weights.shape == (3, 4, 5, 7)
    torch.testing.assert_close(mha(q, kv)[0], out)
    # query heads 0 and 1 read key/value head 0: their weights come from the same keys
    k = mha.k_proj(kv).view(3, 7, 2, 4).transpose(1, 2)  # (B, S, H*E) -> (B, H, S, E)
    q_heads = mha.q_proj(q).view(3, 5, 4, 4).transpose(1, 2)  # (B, L, Hq*E) -> (B, Hq, L, E)
    torch.testing.assert_close(weights[:, 1], ac.attention_weights(q_heads[:, 1], k[:, 0]))


def test_need_weights_rows_sum_to_one_and_masked_are_zero():
    mha = ac.MultiHeadAttention(8, 2)
    x = torch.randn(2, 6, 8)
    mask = torch.rand(6, 6) > 0.4
    mask[:, 0] = True
    _, weights = mha(x, attn_mask=mask, need_weights=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, 6))
    assert (weights.masked_select(~mask.expand_as(weights)) == 0).all()
    assert mha(x)[1] is None


def test_dropout_only_in_training():
    torch.manual_seed(0)
    mha = ac.MultiHeadAttention(8, 2, dropout=0.5)
    x = torch.randn(2, 6, 8)
    mha.train()
    assert not torch.equal(mha(x)[0], mha(x)[0])
    mha.eval()
    first = mha(x)[0]
    torch.testing.assert_close(mha(x)[0], first)
    plain = ac.MultiHeadAttention(8, 2)
    plain.load_state_dict(mha.state_dict())
    torch.testing.assert_close(plain.train()(x)[0], first)


def test_gradients_reach_every_parameter():
    mha = ac.MultiHeadAttention(12, 4, num_kv_heads=2, kdim=6, vdim=5)
    q, k, v = torch.randn(2, 3, 12), torch.randn(2, 4, 6), torch.randn(2, 4, 5)
    mha(q, k, v)[0].square().sum().backward()
    for name, p in mha.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("backend", ac.available_backends("cpu"))
def test_backend_passthrough(backend):
    mha = ac.MultiHeadAttention(8, 4, num_kv_heads=2).double()
    x = torch.randn(2, 5, 8, dtype=D64)
    with torch.no_grad():
        want = mha(x, is_causal=True, backend="reference")[0]
        torch.testing.assert_close(mha(x, is_causal=True, backend=backend)[0], want)


def test_from_torch_keeps_training_mode_and_dropout():
    m = torch_mha(dropout=0.3).train()
    ours = ac.MultiHeadAttention.from_torch(m)
    assert ours.training and ours.dropout == 0.3
    assert ours.q_proj.weight.dtype == D64


def test_kv_cache_bytes_matches_real_cache() -> None:
    layers, B, T = 3, 2, 5
    mha = [MultiHeadAttention(32, 8, num_kv_heads=2).half() for _ in range(layers)]
    x = torch.randn(B, T, 32).half()
    cache = [t for m in mha for t in (m.k_proj(x), m.v_proj(x))]  # what generation keeps per layer
    measured = sum(t.numel() * t.element_size() for t in cache)
    assert measured == kv_cache_bytes(layers, 2, 32 // 8, T, batch=B, bytes_per_element=2)
    assert kv_cache_bytes(layers, 8, 4, T, batch=B) == 4 * kv_cache_bytes(layers, 2, 4, T, batch=B)  # MHA vs G=4
    assert kv_cache_bytes(1, 1, 4, 0) == 0
    with pytest.raises(ValueError, match="num_kv_heads"):
        kv_cache_bytes(2, 0, 64, 10)
