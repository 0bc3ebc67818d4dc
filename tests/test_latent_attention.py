"""Multi-head latent attention: absorbed == expanded, the cache holds only the latent and the rotary key."""

from __future__ import annotations

import pytest
import torch

from attention_core.models.latent_attention import LatentCache, MultiHeadLatentAttention, mla_cache_elements

D, H, E, DC, DR = 32, 4, 8, 12, 4


def layer(q_latent_dim: int | None = None, seed: int = 0) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    m = MultiHeadLatentAttention(D, H, E, DC, DR, q_latent_dim=q_latent_dim)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)  # peaked attention: errors in positions or absorption show
    return m.eval()


def inputs(B: int = 2, L: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, L, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("q_latent_dim", [None, 16])
def test_absorbed_equals_expanded(q_latent_dim: int | None) -> None:
    m, x = layer(q_latent_dim), inputs()
    with torch.no_grad():
        expanded, w_exp = m(x, need_weights=True)
        absorbed, w_abs = m(x, absorbed=True, need_weights=True)
    assert (absorbed - expanded).abs().max() <= 1e-5
    assert (w_abs - w_exp).abs().max() <= 1e-5
    assert w_exp.shape == (2, H, 11, 11) and torch.equal(w_exp[0, 0].triu(1), torch.zeros(11, 11))  # causal


def test_absorbed_weights_are_the_products_of_the_up_projections() -> None:
    m = layer()
    w_q, w_o = m.absorbed_weights()
    assert w_q.shape == (H, DC, D) and w_o.shape == (D, H, DC)
    h = 2
    w_uq = m.q_up.weight[h * E : (h + 1) * E]  # (E, D)
    w_uk = m.k_up.weight[h * E : (h + 1) * E]  # (E, d_c)
    assert torch.allclose(w_q[h], w_uk.T @ w_uq, atol=1e-6)
    w_uv = m.v_up.weight[h * E : (h + 1) * E]  # (E, d_c)
    assert torch.allclose(w_o[:, h], m.out_proj.weight[:, h * E : (h + 1) * E] @ w_uv, atol=1e-6)


@pytest.mark.parametrize("absorbed", [False, True])
def test_decode_with_the_latent_cache_equals_the_full_pass(absorbed: bool) -> None:
    m, x = layer(16), inputs(L=14)
    cache = LatentCache()
    with torch.no_grad():
        full, _ = m(x)
        steps = [m(x[:, :5], cache, absorbed=absorbed)[0]]
        steps += [m(x[:, t : t + 1], cache, absorbed=absorbed)[0] for t in range(5, 14)]
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-5
    assert len(cache) == 14


def test_the_cache_holds_only_the_latent_and_the_rotated_rope_key() -> None:
    m, x = layer(), inputs(L=9)
    cache = LatentCache()
    with torch.no_grad():
        m(x, cache, absorbed=True)
        c = m.kv_down(x)
        latent = m.kv_norm.weight * c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm by hand
        rope_key = m.rotary.rotate(m.k_rope(x))
    tensors = {k: v for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}
    assert sorted(tensors) == ["latent", "rope_key"]
    assert torch.allclose(cache.latent, latent, atol=1e-6) and torch.allclose(cache.rope_key, rope_key, atol=1e-6)
    assert cache.nbytes() == 4 * mla_cache_elements(1, DC, DR, tokens=9, batch=2)
    assert cache.nbytes() < 4 * 2 * H * E * 9 * 2  # smaller than an MHA cache of the same heads


def test_positions_matter_through_the_rope_part() -> None:
    """Shifting every cached rope key by one position changes the output: the rotary path is live."""
    m, x = layer(), inputs(L=8)
    with torch.no_grad():
        full, _ = m(x)
        cache = LatentCache()
        m(x[:, :7], cache)
        cache.rope_key = m.rotary.rotate(m.k_rope(x[:, :7]), offset=1)
        shifted, _ = m(x[:, 7:], cache)
    assert (shifted - full[:, 7:]).abs().max() > 1e-3


def test_arguments_are_checked() -> None:
    m = layer()
    with pytest.raises(ValueError, match="x must be \\(B, L, D\\) with D = 32"):
        m(torch.randn(2, 3, 31))
    with pytest.raises(ValueError, match="rope_dim must be even|head_dim must be even"):
        MultiHeadLatentAttention(D, H, E, DC, 3)
    with pytest.raises(ValueError, match="kv_latent_dim"):
        MultiHeadLatentAttention(D, H, E, 0, DR)


_FLOPS = dict(L=4, S=8, embed_dim=16, num_heads=2, head_dim=4, kv_latent_dim=4, rope_dim=2, absorbed=False)


@pytest.mark.parametrize("name, value, error", [
    ("L", -3, ValueError), ("S", 0, ValueError), ("embed_dim", "bad", TypeError), ("num_heads", [[1.0]], TypeError),
    ("head_dim", -3, ValueError), ("kv_latent_dim", 2.5, TypeError), ("rope_dim", -1, ValueError),
    ("absorbed", "yes", TypeError),
])
def test_latent_score_flops_refuses_bad_arguments(name, value, error):
    from attention_core.models.latent_attention import latent_score_flops
    with pytest.raises(error, match=rf"^{name} must be an? (int >= 1|bool), got ") as caught:
        latent_score_flops(**{**_FLOPS, name: value})
    assert str(caught.value).endswith(repr(value))  # what it was
    assert latent_score_flops(**_FLOPS) == 2 * 8 * 4 * 2 * 2 * 4 + 2 * 4 * 8 * 2 * (2 * 4 + 2) + 2 * 2 * 4 * 16 * 2 * 4
