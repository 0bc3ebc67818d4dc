"""The key/value cache shaped like real ones: preallocated, rotated keys stored (sinks: pre-RoPE keys, re-rotated),
left-padded batches, masks from the mask mods, a block-mask path, and latent attention decoding in the absorbed
form. Every path is checked against recomputation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_core import mask_mods
from attention_core.flex_attention import create_block_mask
from attention_core.models.kv_cache import cached_causal_mask, decode_mask, decode_mask_mod
from attention_core.models.language_model import DecoderLM, build_language_model, generate, left_pad
from attention_core.models.latent_attention import latent_score_flops

V = 13
KINDS = {
    "MHA": {"num_kv_heads": 4},
    "GQA": {"num_kv_heads": 2},
    "MQA": {"num_kv_heads": 1},
    "MLA": {"attention": "latent", "kv_latent_dim": 12, "rope_dim": 4},
}


def sharp_model(kind: str = "GQA", num_layers: int = 2, seed: int = 0) -> DecoderLM:
    """A small random model with large weights: peaked attention, so that any position or mask error shows."""
    model = build_language_model({"vocab_size": V, "d_model": 32, "num_layers": num_layers, "num_heads": 4,
                                  "dim_feedforward": 64, "seed": seed, **KINDS[kind]})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.35, generator=g)
    return model.eval()


def rand_tokens(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ recomputation


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("cache_kw", [{}, {"max_len": 40}, {"window": 5}], ids=["full", "static", "window"])
def test_left_padded_batch_decodes_as_each_row_alone(kind: str, cache_kw: dict) -> None:
    """Batched generation with left padding: every row's logits, prefill and each decode step, equal the model run
    on that row alone (no padding), recomputed from scratch (with the same window)."""
    model = sharp_model(kind)
    rows = [rand_tokens(n, seed=n) for n in (6, 2, 9)]
    tokens, pad = left_pad(rows)
    window = cache_kw.get("window")
    cache = model.new_cache(**cache_kw)
    with torch.no_grad():
        out = model(tokens, cache, pad=pad).logits
        for b, r in enumerate(rows):
            alone = model(r[None], window=window).logits[0]
            assert (out[b, int(pad[b]) :] - alone).abs().max() <= 1e-5
        text = list(rows)
        for step in range(12):
            nxt = rand_tokens(3, 1, seed=100 + step)
            got = model(nxt, cache).logits[:, -1]
            for b in range(3):
                text[b] = torch.cat([text[b], nxt[b]])
                alone = model(text[b][None], window=window).logits[0, -1]
                assert (got[b] - alone).abs().max() <= 1e-5, (kind, step, b)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_padding_is_never_read(kind: str) -> None:
    """Other padding ids change nothing for the real tokens, and no attention weight lands on a padding key."""
    model = sharp_model(kind)
    tokens, pad = left_pad([rand_tokens(7), rand_tokens(3, seed=2)])
    other = tokens.clone()
    other[1, : int(pad[1])] = (other[1, : int(pad[1])] + 5) % V
    with torch.no_grad():
        a = model(tokens, model.new_cache(), pad=pad, need_weights=True)
        b = model(other, model.new_cache(), pad=pad).logits
    assert (a.logits[1, int(pad[1]) :] - b[1, int(pad[1]) :]).abs().max() <= 1e-5
    for w in a.weights:
        assert float(w[1, :, int(pad[1]) :, : int(pad[1])].abs().max()) == 0.0


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sinks_equal_streaming_by_definition(kind: str) -> None:
    """One layer (so cached keys depend on their token only): with sinks, every step's logits equal a fresh pass
    over the sinks and the window, at positions = slots in the cache (StreamingLLM)."""
    model = sharp_model(kind, num_layers=1)
    text = rand_tokens(1, 24)
    sinks, window = 2, 5
    cache = model.new_cache(window=window, sinks=sinks)
    with torch.no_grad():
        streamed = torch.cat([model(text[:, t : t + 1], cache).logits for t in range(24)], dim=1)
        for t in range(24):
            kept = sorted(set(range(min(sinks, t + 1))) | set(range(max(0, t - window + 1), t + 1)))
            fresh = model(text[:, kept]).logits[0, -1]
            assert (streamed[0, t] - fresh).abs().max() <= 1e-5, t
    assert len(cache) == sinks + window - 1


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_window_cache_streams_past_the_rotary_table(kind: str) -> None:
    """A window-only cache stores keys rotated at their text position; past max_positions the angles are computed,
    and the logits still equal a windowed recomputation of the text's last tokens (relative positions)."""
    model = build_language_model({"vocab_size": V, "d_model": 32, "num_layers": 2, "num_heads": 4,
                                  "dim_feedforward": 64, "max_positions": 16, "seed": 0, **KINDS[kind]}).eval()
    text = rand_tokens(1, 40)
    cache = model.new_cache(window=4)
    with torch.no_grad():
        last = [model(text[:, t : t + 1], cache).logits[0, -1] for t in range(40)][-1]
        ref = model(text[:, -12:], window=4).logits[0, -1]  # 2 layers x 3 earlier keys: 8 tokens suffice
    assert (last - ref).abs().max() <= 1e-5


# ------------------------------------------------------------------------------------------ what is stored


def test_full_and_window_caches_store_rotated_keys_sinks_store_them_before_rope() -> None:
    model = sharp_model("GQA", num_layers=1)
    text = rand_tokens(1, 6)
    attn = model.blocks[0].attn
    with torch.no_grad():
        h = model.blocks[0].norm1(model.embed(text))
        raw = attn.k_proj(h).view(1, 6, 2, 8).transpose(1, 2)  # (B, H, L, E) before RoPE
        rotated = model.rotary.rotate(raw)
        for kw, want in [({}, rotated), ({"window": 9}, rotated), ({"window": 9, "sinks": 1}, raw)]:
            cache = model.new_cache(**kw)
            model(text, cache)
            assert cache.rotated == ("sinks" not in kw)
            assert (cache.keys[0] - want).abs().max() <= 1e-6, kw
    assert (rotated - raw).abs().max() > 1e-2  # the two differ: the check above can tell them apart


def test_a_static_cache_is_written_in_place_and_refuses_to_overflow() -> None:
    model = sharp_model()
    cache = model.new_cache(max_len=12)
    with torch.no_grad():
        model(rand_tokens(2, 5), cache)
        buffers = [b.data_ptr() for b in cache._k + cache._v]
        for t in range(7):
            model(rand_tokens(2, 1, seed=t), cache)
        assert [b.data_ptr() for b in cache._k + cache._v] == buffers  # no reallocation, no torch.cat
        assert cache.slots == 12 and len(cache) == 12
        before = [k.clone() for k in cache.keys]
        with pytest.raises(ValueError, match="max_len = 12"):
            model(rand_tokens(2, 1), cache)
    assert all(torch.equal(a, b) for a, b in zip(before, cache.keys)) and len(cache) == 12


def test_a_growing_cache_doubles() -> None:
    model = sharp_model()
    cache = model.new_cache()
    slots = []
    with torch.no_grad():
        model(rand_tokens(1, 3), cache)
        for t in range(30):
            model(rand_tokens(1, 1, seed=t), cache)
            slots.append(cache.slots)
    assert sorted(set(slots)) == [6, 12, 24, 48]
    assert cache.nbytes() == 2 * 2 * (1 * 2 * 33 * 8) * 4  # layers x (K, V) x (B H S E) x 4 bytes: in use only


def test_a_rolling_cache_keeps_its_buffer() -> None:
    model = sharp_model()
    cache = model.new_cache(window=4, sinks=1)
    with torch.no_grad():
        model(rand_tokens(1, 2), cache)
        ptr = cache._k[0].data_ptr()
        for t in range(20):
            model(rand_tokens(1, 1, seed=t), cache)
    assert cache._k[0].data_ptr() == ptr and cache.slots == 5 and len(cache) == 4


def test_crop_rolls_back() -> None:
    model = sharp_model()
    text = rand_tokens(1, 9)
    cache = model.new_cache()
    with torch.no_grad():
        model(text, cache)
        cache.crop(5)
        got = model(text[:, 5:6], cache).logits[0, -1]
        ref = model(text[:, :6]).logits[0, -1]
    assert (got - ref).abs().max() <= 1e-5 and len(cache) == 6 == cache.seen


def test_padding_arguments_are_checked() -> None:
    model = sharp_model()
    tokens = rand_tokens(2, 4)
    with pytest.raises(ValueError, match="pad must count"):
        model(tokens, pad=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="pad must be a \\(B,\\)"):
        model(tokens, pad=torch.tensor([0]))
    with pytest.raises(ValueError, match="sinks do not mix"):
        model(tokens, model.new_cache(window=3, sinks=1), pad=torch.tensor([0, 1]))
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens, cache)
    with pytest.raises(ValueError, match="first call"):
        model(tokens, cache, pad=torch.tensor([0, 1]))


# ------------------------------------------------------------------------------------------ masks


def _old_cached_causal_mask(L: int, S: int, window, sinks: int) -> torch.Tensor:
    """The dense formula the mask mods replaced (the library's previous helper)."""
    i = torch.arange(L)[:, None] + (S - L)
    j = torch.arange(S)[None, :]
    if window is None:
        return j <= i
    return (j <= i) & ((j > i - window) | (j < sinks))


@settings(max_examples=150, deadline=None)
@given(S=st.integers(0, 24), data=st.data())
def test_mask_mods_equal_the_old_dense_masks(S: int, data) -> None:
    L = data.draw(st.integers(0, S))
    window = data.draw(st.none() | st.integers(1, 26))
    sinks = 0 if window is None else data.draw(st.integers(0, 4))
    want = _old_cached_causal_mask(L, S, window, sinks)
    assert torch.equal(cached_causal_mask(L, S, window, sinks), want)
    assert torch.equal(decode_mask(L, S, window, sinks), want)
    pad = torch.tensor(data.draw(st.lists(st.integers(0, max(S, 1)), min_size=1, max_size=3)))
    padded = decode_mask(L, S, window, sinks, pad)  # (B, 1, L, S)
    assert torch.equal(padded, want[None, None] & (torch.arange(S)[None, None, None] >= pad[:, None, None, None]))


def test_the_decode_mask_mod_is_composed_from_the_library() -> None:
    mod = decode_mask_mod(3, 8, window=4, sinks=2)
    assert "and" in getattr(mod, "flex_kind", ("",))[0]
    assert torch.equal(mask_mods.dense_mask(decode_mask_mod(8, 8), 1, 1, 8, 8)[0, 0],
                       mask_mods.dense_mask(mask_mods.causal, 1, 1, 8, 8)[0, 0])


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_block_mask_runs_through_flex_attention(kind: str) -> None:
    model = sharp_model(kind)
    x = rand_tokens(2, 19)
    with torch.no_grad():
        causal = create_block_mask(mask_mods.causal, None, None, 19, 19, BLOCK_SIZE=8)
        assert (model(x, block_mask=causal).logits - model(x).logits).abs().max() <= 1e-5
        local = create_block_mask(mask_mods.sliding_window(4), None, None, 19, 19, BLOCK_SIZE=8)
        assert (model(x, block_mask=local).logits - model(x, window=4).logits).abs().max() <= 1e-5
        full = create_block_mask(mask_mods.noop_mask, None, None, 19, 19, BLOCK_SIZE=8)
        assert (model(x, block_mask=full).logits - model(x).logits).abs().max() > 1e-2  # the mask is obeyed
    with pytest.raises(ValueError, match="build it for \\(18, 18\\)"):
        model(x[:, :18], block_mask=causal)
    with pytest.raises(ValueError, match="full-sequence call"):
        model(x, model.new_cache(), block_mask=causal)


# ------------------------------------------------------------------------------------------ latent attention


def test_latent_decoding_absorbed_equals_expanded_token_by_token() -> None:
    model = sharp_model("MLA")
    prompt = rand_tokens(2, 5)
    ca, ce = model.new_cache(), model.new_cache()
    with torch.no_grad():
        la = model(prompt, ca, absorbed=True).logits
        le = model(prompt, ce, absorbed=False).logits
        worst = float((la - le).abs().max())
        for _ in range(20):
            nxt = la[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            la = model(nxt, ca, absorbed=True).logits
            le = model(nxt, ce, absorbed=False).logits
            worst = max(worst, float((la - le).abs().max()))
    assert worst <= 1e-5
    a = generate(model, prompt, 20, temperature=0.0, absorbed=True)
    e = generate(model, prompt, 20, temperature=0.0, absorbed=False)
    assert torch.equal(a, e)


def test_the_latent_cache_holds_d_c_plus_d_r_numbers_per_token() -> None:
    model = sharp_model("MLA")
    cache = model.new_cache()
    with torch.no_grad():
        model(rand_tokens(3, 7), cache)
    assert [tuple(k.shape) for k in cache.keys] == [(3, 1, 7, 4)] * 2  # the rotary keys, (B, 1, S, d_r)
    assert [tuple(v.shape) for v in cache.values] == [(3, 1, 7, 12)] * 2  # the latents, (B, 1, S, d_c)
    assert cache.nbytes() == 4 * 2 * 3 * 7 * model.cache_numbers_per_token() == 4 * 2 * 3 * 7 * 16


def test_latent_rmsnorm_is_on_the_cached_latent() -> None:
    model = sharp_model("MLA", num_layers=1)
    text = rand_tokens(1, 5)
    attn = model.blocks[0].attn
    cache = model.new_cache()
    with torch.no_grad():
        model(text, cache)
        c = attn.kv_down(model.blocks[0].norm1(model.embed(text)))
        normed = attn.kv_norm.weight * c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (cache.values[0][:, 0] - normed).abs().max() <= 1e-5
    assert (c - normed).abs().max() > 1e-2


def test_latent_score_flops_trade_off() -> None:
    """Absorbed: fewer FLOPs to decode (no keys and values rebuilt), more for a long prefill when d_c > E."""
    kw = dict(embed_dim=128, num_heads=4, head_dim=32, kv_latent_dim=64, rope_dim=16)
    assert latent_score_flops(1, 512, absorbed=True, **kw) < latent_score_flops(1, 512, absorbed=False, **kw) / 10
    assert latent_score_flops(512, 512, absorbed=True, **kw) > latent_score_flops(512, 512, absorbed=False, **kw)
    # the expanded decode count, by hand: rebuild K and V, scores + weighted sum, q and out projections
    assert latent_score_flops(1, 10, absorbed=False, **kw) == 2 * 10 * 64 * 2 * 128 + 2 * 10 * 4 * 80 + 4 * 128 * 128
    assert latent_score_flops(1, 10, absorbed=True, **kw) == 2 * 10 * 4 * 144 + 4 * 128 * 4 * 64


def test_a_padded_rows_positions_start_at_its_first_real_token() -> None:
    """The stored (rotated) keys of a left-padded row are those of the row alone: its first real token sits at
    position 0, so padding spends none of the rotary table (RoPE being relative, the scores alone could not tell)."""
    model = sharp_model("GQA")
    rows = [rand_tokens(6), rand_tokens(2, seed=2)]
    tokens, pad = left_pad(rows)
    cache, alone = model.new_cache(), model.new_cache()
    with torch.no_grad():
        model(tokens, cache, pad=pad)
        model(rows[1][None], alone)
    for layer in range(2):
        assert (cache.keys[layer][1, :, int(pad[1]) :] - alone.keys[layer][0]).abs().max() <= 1e-5


def test_a_refusal_after_an_eviction_leaves_a_rolling_cache_unchanged() -> None:
    """With sinks, a long call runs in steps that evict in place; a refusal in a later step restores every slot."""
    from attention_core import use_backend
    from attention_core.backends import Backend, register_backend

    state = {"at": 0, "seen": 0}

    def refuse(inputs):
        state["seen"] += 1
        return "refused on purpose" if state["seen"] == state["at"] else None

    register_backend(Backend("test_kv_refuses_nth", "test only", "attention_core.backends.reference",
                             lambda: (True, ""), refuse), replace=True)
    model = sharp_model()
    cache = model.new_cache(window=3, sinks=1)
    with torch.no_grad():
        model(rand_tokens(1, 6), cache)
        before = ([k.clone() for k in cache.keys], [v.clone() for v in cache.values], len(cache), cache.seen)
        state["at"] = 2 * 2 + 1  # the first layer of the third step: two evictions have happened by then
        with pytest.raises(ValueError, match="refused on purpose"), use_backend("test_kv_refuses_nth"):
            model(rand_tokens(1, 4, seed=3), cache)
    assert state["seen"] >= state["at"]
    assert (len(cache), cache.seen) == before[2:]
    assert all(torch.equal(a, b) for a, b in zip(before[0], cache.keys))
    assert all(torch.equal(a, b) for a, b in zip(before[1], cache.values))


# ------------------------------------------------------------------------ issue 37: exact restore


@pytest.mark.parametrize("kind", ["GQA", "MLA"])
@pytest.mark.parametrize("max_len", [None, 16])
def test_restore_after_crop_and_append_is_exact(kind: str, max_len) -> None:
    """snapshot, crop, append (into the slots the snapshot still counts), restore: the cache holds exactly
    what it held at the snapshot (an append after a crop writes into a copy while a snapshot lives). The
    latent model's cache holds its rotary keys and latents in the same KVCache."""
    model = sharp_model(kind)
    cache = model.new_cache(max_len=max_len)
    with torch.no_grad():
        model(rand_tokens(2, 6), cache)
        want = [t.clone() for t in cache.keys + cache.values]
        snap = cache.snapshot()
        cache.crop(3)
        model(rand_tokens(2, 2, seed=5), cache)
        cache.restore(snap)
        assert len(cache) == cache.seen == 6
        assert all(torch.equal(a, b) for a, b in zip(want, cache.keys + cache.values))
        nxt = rand_tokens(2, 1, seed=9)
        got = model(nxt, cache).logits[:, -1]
    cache2 = model.new_cache()  # the restored cache continues as if the crop and the append never happened
    with torch.no_grad():
        model(rand_tokens(2, 6), cache2)
        ref = model(nxt, cache2).logits[:, -1]
    assert torch.allclose(got, ref, atol=1e-5)


def test_restore_refuses_a_foreign_state() -> None:
    model = sharp_model()
    a, b = model.new_cache(), model.new_cache()
    with pytest.raises(ValueError, match="state"):
        a.restore(b.snapshot())
    with pytest.raises(TypeError, match="state"):
        a.restore((1, 2))
