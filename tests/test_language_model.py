"""The decoder-only language model: cache == recomputation, rolling windows, sinks, GQA cache size, sampling."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import attention_core as ac
from attention_core.models.language_model import (
    DecoderLM,
    KVCache,
    build_language_model,
    cached_causal_mask,
    filter_top_k,
    filter_top_p,
    generate,
    sample_next_token,
)
from attention_core.positional import apply_rotary

V = 23


def sharp_model(num_kv_heads: int = 2, num_layers: int = 2, seed: int = 0) -> DecoderLM:
    """A small random model with large weights, so that attention is peaked and position errors show."""
    model = build_language_model({"vocab_size": V, "d_model": 32, "num_layers": num_layers, "num_heads": 4,
                                  "num_kv_heads": num_kv_heads, "dim_feedforward": 64, "seed": seed})
    g = torch.Generator().manual_seed(seed)  # building leaves the global generator alone: draw from our own
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.35, generator=g)
    return model.eval()


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ masks


def test_cached_mask_is_causal_when_no_past_and_bottom_right_aligned_otherwise() -> None:
    assert torch.equal(cached_causal_mask(5, 5), ac.causal_mask(5))
    m = cached_causal_mask(2, 6)
    assert m[-1].all() and m[0].tolist() == [True] * 5 + [False]  # the last query sees every key
    assert not torch.equal(m, ac.causal_mask(2, 6))  # SDPA's is_causal would be upper-left


@pytest.mark.parametrize("L,S,window,sinks", [(1, 9, 4, 0), (3, 9, 4, 2), (9, 9, 3, 1), (4, 6, None, 0)])
def test_cached_mask_matches_its_definition(L: int, S: int, window: int | None, sinks: int) -> None:
    got = cached_causal_mask(L, S, window, sinks)
    for i in range(L):
        slot = S - L + i
        for j in range(S):
            expected = j <= slot and (window is None or j > slot - window or j < sinks)
            assert bool(got[i, j]) == expected, (i, j)


def test_cached_mask_rejects_more_queries_than_keys() -> None:
    with pytest.raises(ValueError, match="L \\(queries\\) must be <= S"):
        cached_causal_mask(4, 3)


# ------------------------------------------------------------------------------------------------ cache


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_every_cached_token_has_the_logits_of_full_recomputation(num_kv_heads: int) -> None:
    model = sharp_model(num_kv_heads)
    text = tokens(2, 6)
    cache = model.new_cache()
    with torch.no_grad():
        logits = model(text, cache).logits[:, -1]  # prefill
        for step in range(25):
            nxt = sample_next_token(logits, temperature=1.0, generator=torch.Generator().manual_seed(step))
            text = torch.cat([text, nxt[:, None]], dim=1)
            logits = model(nxt[:, None], cache).logits[:, -1]  # decode
            full = model(text).logits[:, -1]  # recompute everything
            assert (logits - full).abs().max() <= 1e-5, f"step {step}"
    assert len(cache) == text.shape[1] == cache.seen


def test_cache_is_not_trivially_equal_a_wrong_position_breaks_it() -> None:
    """Guard for the test above: the model is sensitive enough that a one-slot position error is visible."""
    model = sharp_model()
    text = tokens(1, 12)
    with torch.no_grad():
        full = model(text).logits[:, -1]
        cache = model.new_cache()
        model(text[:, :-1], cache)
        cache.keys = [torch.cat([k[:, :, :1], k], dim=2) for k in cache.keys]  # shift every slot by one
        cache.values = [torch.cat([v[:, :, :1], v], dim=2) for v in cache.values]
        shifted = model(text[:, -1:], cache).logits[:, -1]
    assert (shifted - full).abs().max() > 1e-2


@pytest.mark.parametrize("window", [1, 4, 7])
def test_decode_with_a_window_equals_windowed_full_recomputation(window: int) -> None:
    model = sharp_model()
    text = tokens(2, 30)
    with torch.no_grad():
        ref = model(text, window=window).logits  # one pass, sliding-window mask
        unwindowed = model(text).logits
        cache = model.new_cache(window=window)
        steps = [model(text[:, :3], cache).logits] + [model(text[:, t : t + 1], cache).logits for t in range(3, 30)]
        got = torch.cat(steps, dim=1)
        oneshot = model(text, model.new_cache(window=window)).logits  # prefill longer than the window
    assert (got - ref).abs().max() <= 1e-5
    assert (oneshot - ref).abs().max() <= 1e-5
    assert (ref[:, -1] - unwindowed[:, -1]).abs().max() > 1e-2  # the window really changes the answer
    assert len(cache) == window - 1  # a rolling cache: constant size


def streaming_reference(model: DecoderLM, text: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """StreamingLLM by definition, token by token: query t sees the first ``sinks`` tokens and the ``window`` most
    recent ones (itself included), with rotary positions = slots in the cache (sinks first, then the window)."""
    B, T = text.shape
    x = model.embed(text)
    for block in model.blocks:
        a = block.attn
        Hq, H, E = a.num_heads, a.num_kv_heads, a.head_dim
        h = block.norm1(x)
        q = a.q_proj(h).view(B, T, Hq, E).transpose(1, 2)
        k = a.k_proj(h).view(B, T, H, E).transpose(1, 2).repeat_interleave(Hq // H, dim=1)
        v = a.v_proj(h).view(B, T, H, E).transpose(1, 2).repeat_interleave(Hq // H, dim=1)
        outs = []
        for t in range(T):
            seen = sorted(set(range(min(sinks, t + 1))) | set(range(max(0, t - window + 1), t + 1)))
            q_slot = min(t, sinks + window - 1)
            slots = torch.tensor([j if j < sinks else q_slot - (t - j) for j in seen])
            kt = apply_rotary(k[:, :, seen], slots)
            qt = apply_rotary(q[:, :, t : t + 1], torch.tensor([q_slot]))
            outs.append(F.scaled_dot_product_attention(qt, kt, v[:, :, seen]))
        attn = torch.cat(outs, dim=2).transpose(1, 2).reshape(B, T, Hq * E)
        x = x + a.out_proj(attn)
        x = x + block.linear2(F.gelu(block.linear1(block.norm2(x))))
    return model.lm_head(model.norm(x))


@pytest.mark.parametrize("window,sinks", [(5, 2), (3, 1), (6, 4)])
def test_sinks_decode_equals_streaming_by_definition(window: int, sinks: int) -> None:
    model = sharp_model()
    text = tokens(2, 24)
    with torch.no_grad():
        ref = streaming_reference(model, text, window, sinks)
        cache = model.new_cache(window=window, sinks=sinks)
        got = torch.cat([model(text[:, :2], cache).logits] +
                        [model(text[:, t : t + 1], cache).logits for t in range(2, 24)], dim=1)
        oneshot = model(text, model.new_cache(window=window, sinks=sinks)).logits
        no_sinks = model(text, window=window).logits
    assert (got - ref).abs().max() <= 1e-5
    assert (oneshot - ref).abs().max() <= 1e-5
    assert (got[:, -1] - no_sinks[:, -1]).abs().max() > 1e-2  # the sinks matter
    assert len(cache) == sinks + window - 1


def test_sink_cache_holds_the_first_tokens_and_the_most_recent_ones() -> None:
    model = sharp_model()
    text = tokens(1, 20)
    window, sinks = 5, 3
    cache = model.new_cache(window=window, sinks=sinks)
    with torch.no_grad():
        model(text, cache)
        block = model.blocks[0]  # layer 0's keys depend on their own token only
        keys = block.attn.k_proj(block.norm1(model.embed(text))).view(1, 20, 2, 8).transpose(1, 2)
    kept = list(range(sinks)) + list(range(20 - (window - 1), 20))
    assert torch.allclose(cache.keys[0], keys[:, :, kept], atol=1e-6)
    assert cache.seen == 20


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_cache_bytes_follow_the_formula(num_kv_heads: int) -> None:
    model = sharp_model(num_kv_heads, num_layers=3)
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens(2, 17), cache)
    assert cache.nbytes() == ac.kv_cache_bytes(3, num_kv_heads, 8, 17, batch=2, bytes_per_element=4)
    assert tuple(cache.keys[0].shape) == (2, num_kv_heads, 17, 8)


def test_cache_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="sinks=2 needs a window"):
        KVCache(2, sinks=2)
    model = sharp_model()
    with pytest.raises(ValueError, match="window is a property of the cache"):
        model(tokens(1, 4), model.new_cache(), window=3)
    with pytest.raises(TypeError, match="tokens must be a \\(B, L\\) integer tensor"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="tokens must be a \\(B, L\\) integer tensor"):
        model(torch.zeros(4, dtype=torch.long))


# --------------------------------------------------------------------------------------------- sampling


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    for k in (1, 5, 40):
        kept = torch.isfinite(filter_top_k(logits, k))
        assert (kept.sum(-1) == k).all()
        assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, logits.topk(k).indices, True))


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    probs = logits.softmax(-1)
    for p in (0.1, 0.5, 0.9, 1.0):
        kept = torch.isfinite(filter_top_p(logits, p))
        for row in range(6):
            n = int(kept[row].sum())
            top = probs[row].sort(descending=True).values
            assert top[:n].sum() >= p - 1e-6  # reaches p ...
            assert n == 1 or top[: n - 1].sum() < p  # ... and one token fewer would not
            assert torch.equal(kept[row], probs[row] >= top[n - 1])  # the most likely ones


def test_sampling_respects_the_filters_and_repeats_with_a_seed() -> None:
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(2)).repeat(2000, 1)
    draws = sample_next_token(logits, 1.0, top_k=4, generator=torch.Generator().manual_seed(3))
    assert set(draws.tolist()) == set(logits[0].topk(4).indices.tolist())
    again = sample_next_token(logits, 1.0, top_k=4, generator=torch.Generator().manual_seed(3))
    assert torch.equal(draws, again)
    freq = torch.bincount(draws, minlength=30).double() / len(draws)
    expected = filter_top_k(logits[:1], 4).softmax(-1)[0].double()
    assert (freq - expected).abs().max() < 0.05
    assert torch.equal(sample_next_token(logits[:3], 0.0), logits[:3].argmax(-1))  # temperature 0: greedy


def test_generate_repeats_with_a_seed_and_cache_changes_nothing() -> None:
    model = sharp_model()
    prompt = tokens(2, 5)
    runs = [generate(model, prompt, 20, temperature=0.8, top_p=0.9, generator=torch.Generator().manual_seed(s),
                     use_cache=c) for s, c in ((0, True), (0, True), (0, False), (1, True))]
    assert runs[0].shape == (2, 25) and torch.equal(runs[0][:, :5], prompt)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0], runs[3])
    greedy = generate(model, prompt, 10, temperature=0.0, window=4)
    assert torch.equal(greedy, generate(model, prompt, 10, temperature=0.0, window=4, use_cache=False))


def test_sampling_arguments_are_checked() -> None:
    logits = torch.randn(2, 5)
    with pytest.raises(ValueError, match="temperature must be a finite float >= 0"):
        sample_next_token(logits, -1.0)
    with pytest.raises(ValueError, match="top_p must be a float in \\(0, 1\\]"):
        filter_top_p(logits, 1.5)
    with pytest.raises(ValueError, match="top_k must be"):
        filter_top_k(logits, 0)
    with pytest.raises(ValueError, match="sinks need the rolling cache"):
        generate(sharp_model(), tokens(1, 3), 2, sinks=1, window=2, use_cache=False)


# ------------------------------------------------------------------------------------------------ sampling edges


def test_top_k_at_its_boundaries() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, -math.inf, 0.5]])
    assert torch.equal(filter_top_k(logits, 5), logits)  # k = V: unchanged
    assert torch.equal(filter_top_k(logits, 7), logits)  # k > V: unchanged
    assert torch.isfinite(filter_top_k(logits, 1)).tolist() == [[False, True, True, False, False]]  # ties kept
    assert torch.isfinite(filter_top_k(logits, 3)).tolist() == [[True, True, True, False, False]]
    for k, err in ((0, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError), (None, TypeError)):
        with pytest.raises(err, match="top_k must be an int >= 1"):
            filter_top_k(logits, k)


def test_top_p_at_its_boundaries() -> None:
    logits = torch.tensor([[2.0, 2.0, 0.0, -math.inf]])
    assert torch.equal(filter_top_p(logits, 1.0), logits)  # p = 1: every token
    assert torch.isfinite(filter_top_p(logits, 1e-9)).sum() == 1  # tiny p: the most likely token only
    # a p below float32's range (0 once compared with float32 masses): still the most likely token, never none
    assert torch.isfinite(filter_top_p(torch.tensor([[15.41]]), 1.8671296365308567e-270)).sum() == 1
    assert torch.isfinite(filter_top_p(logits, 5e-324)).sum() == 1
    for p, err in ((0.0, ValueError), (1.5, ValueError), (math.nan, ValueError), (-0.1, ValueError),
                   (math.inf, ValueError), ("0.5", TypeError), (None, TypeError)):
        with pytest.raises(err, match="top_p must be a float in"):
            filter_top_p(logits, p)


@pytest.mark.parametrize("fn,arg", [(filter_top_k, 2), (filter_top_p, 0.5)])
def test_the_filters_refuse_nan_logits(fn, arg) -> None:
    with pytest.raises(ValueError, match=r"logits must hold no NaN \(rows \[1\]"):
        fn(torch.tensor([[0.0, 1.0, 2.0], [0.0, math.nan, 1.0]]), arg)
    with pytest.raises(TypeError, match="logits must have a floating-point dtype"):
        fn(torch.tensor([[0, 1, 2]]), arg)


def test_temperature_at_its_boundaries() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, -math.inf], [1.0, 0.0, -1.0, -2.0]])
    g = torch.Generator().manual_seed(0)
    assert sample_next_token(logits, 0.0).tolist() == [1, 0]  # greedy: the lowest id among ties
    tiny = torch.stack([sample_next_token(logits, 1e-30, generator=g) for _ in range(50)])
    assert set(tiny[:, 0].tolist()) <= {1, 2} and (tiny[:, 1] == 0).all()  # tends to greedy, no overflow
    for t, err in ((math.inf, ValueError), (-1.0, ValueError), (math.nan, ValueError), ("1", TypeError),
                   (None, TypeError)):
        with pytest.raises(err, match="temperature must be a finite float >= 0"):
            sample_next_token(logits, t)


def test_logits_with_inf_and_nan() -> None:
    ok = torch.tensor([[-math.inf, 0.0, -math.inf]])
    assert sample_next_token(ok, 1.0, generator=torch.Generator().manual_seed(0)).tolist() == [1]
    for bad, pattern in ((torch.tensor([[0.0, math.nan]]), "no NaN or \\+inf"),
                         (torch.tensor([[0.0, math.inf]]), "no NaN or \\+inf"),
                         (torch.tensor([[-math.inf, -math.inf]]), "every logit of rows \\[0\\] is -inf")):
        with pytest.raises(ValueError, match=pattern):
            sample_next_token(bad, 1.0)


def test_top_k_one_is_greedy_and_draws_nothing() -> None:
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(4))
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    assert torch.equal(sample_next_token(logits, 0.7, top_k=1, generator=g), logits.argmax(-1))
    assert torch.equal(g.get_state(), state)


@pytest.mark.parametrize("kwargs,err,pattern", [
    ({"top_k": 0}, ValueError, "top_k must be an int >= 1"),
    ({"top_k": -2}, ValueError, "top_k must be an int >= 1"),
    ({"top_p": 0.0}, ValueError, "top_p must be a float in"),
    ({"top_p": math.nan}, ValueError, "top_p must be a float in"),
    ({"generator": 3}, TypeError, "generator must be a torch.Generator or None"),
])
def test_sampling_settings_are_checked_even_when_greedy(kwargs, err, pattern) -> None:
    with pytest.raises(err, match=pattern):
        sample_next_token(torch.randn(2, 5), 0.0, **kwargs)
    with pytest.raises(err, match=pattern):
        generate(sharp_model(), tokens(1, 3), 2, temperature=0.0, **kwargs)


@pytest.mark.parametrize("kwargs,err,pattern", [
    ({"model": torch.nn.Linear(2, 2)}, TypeError, "model must be a DecoderLM"),
    ({"pad": [0]}, TypeError, "pad must be a torch.Tensor"),
    ({"prompt": torch.tensor([[0, V]])}, ValueError, rf"tokens must be ids in \[0, {V}\)"),
    ({"temperature": -1.0}, ValueError, "temperature must be"),
])
def test_generate_refuses_bad_arguments_and_gives_the_modes_back(kwargs, err, pattern) -> None:
    model = sharp_model().train()
    model.blocks[0].eval()  # mixed modes come back exactly
    modes = [m.training for m in model.modules()]
    args = {"model": model, "prompt": tokens(1, 3), "max_new_tokens": 2, **kwargs}
    with pytest.raises(err, match=pattern):
        generate(**args)
    assert [m.training for m in model.modules()] == modes
    generate(model, tokens(1, 3), 2, temperature=0.0)
    assert [m.training for m in model.modules()] == modes


@pytest.mark.parametrize("P,n,kwargs,pattern", [
    (5, 5, {"use_cache": True}, "positions up to 8, but the model covers max_positions = 8"),
    (5, 5, {"use_cache": False}, "positions up to 8, but the model covers max_positions = 8"),
    (3, 5, {"max_len": 6}, "the cache must hold 7 tokens, but max_len = 6"),
])
def test_generate_refuses_a_text_past_the_model_before_drawing_anything(P, n, kwargs, pattern) -> None:
    model = build_language_model({"vocab_size": V, "d_model": 8, "num_layers": 1, "num_heads": 2, "max_positions": 8,
                                  "seed": 0})
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match=pattern):
        generate(model, tokens(1, P), n, **kwargs)
    assert torch.equal(torch.get_rng_state(), before)
    assert generate(model, tokens(1, 5), 4, temperature=0.0).shape == (1, 9)  # positions 0 .. 7: fits
    assert generate(model, tokens(1, 5), 9, temperature=0.0, window=3).shape == (1, 14)  # rolling: no limit


def test_left_pad_refuses_rows_that_are_not_ids_of_one_dtype() -> None:
    from attention_core.models.language_model import left_pad

    with pytest.raises(TypeError, match="rows must all hold int64"):
        left_pad([torch.tensor([1, 2]), torch.tensor([1.5])])
    with pytest.raises(TypeError, match="rows must all hold int64"):
        left_pad([torch.tensor([1, 2]), torch.tensor([1], dtype=torch.int32)])


# ------------------------------------------------------------------------------------------------ rooms


def test_sampling_and_generation_are_their_own_modules_re_exported() -> None:
    """The model, sampling and generation live apart; language_model re-exports the last two (same objects)."""
    from pathlib import Path

    from attention_core.models import generation, language_model, sampling

    assert language_model.generate is generation.generate
    for name in ("filter_top_k", "filter_top_p", "sample_next_token"):
        assert getattr(language_model, name) is getattr(sampling, name), name
    for module in (generation, language_model, sampling):
        assert len(Path(module.__file__).read_text().splitlines()) <= 700, module.__name__
    with pytest.raises(TypeError, match="^model must be a DecoderLM"):  # a module without the model's interface
        generate(torch.nn.Linear(2, 2), tokens(1, 2), 1)


def test_generate_checks_its_settings_once_not_per_token(monkeypatch) -> None:
    """The loop calls the unchecked sampling core: the settings are validated once per call, whatever its length."""
    from attention_core.models import generation, sampling

    calls = []
    real = sampling._check_sampling

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(sampling, "_check_sampling", counting)
    monkeypatch.setattr(generation, "_check_sampling", counting)
    for kw in (dict(temperature=0.0), dict(temperature=0.8, top_k=5, top_p=0.9)):
        calls.clear()
        out = generate(sharp_model(), tokens(2, 3), 6, generator=torch.Generator().manual_seed(0), **kw)
        assert out.shape == (2, 9) and len(calls) == 1, (kw, len(calls))


def test_the_sampler_and_serving_share_one_logits_check() -> None:
    from attention_core.models import sampling
    from attention_core.serving import speculative

    assert speculative._check_logits is sampling._check_logits
    for fn in (lambda x: sample_next_token(x, 1.0), lambda x: speculative.next_token_probs(x, 1.0)):
        with pytest.raises(TypeError, match="^logits must have a floating-point dtype"):
            fn(torch.zeros(1, 3, dtype=torch.long))
        with pytest.raises(ValueError, match=r"^logits must be \(.*V\) with V >= 1, got shape \(1, 0\)"):
            fn(torch.zeros(1, 0))
        with pytest.raises(ValueError, match=r"^logits is a meta tensor"):
            fn(torch.zeros(1, 3, device="meta"))
    with pytest.raises(ValueError, match=r"^logits must be \(B, V\) with V >= 1, got shape \(3,\)"):
        sample_next_token(torch.zeros(3), 1.0)
    assert speculative.next_token_probs(torch.zeros(3), 1.0).shape == (3,)  # (..., V): any leading dims
    # the filters compare and never normalise: +inf and an all -inf row pass, NaN does not
    row = torch.tensor([[math.inf, 0.0], [-math.inf, -math.inf]])
    assert torch.equal(filter_top_k(row, 1), torch.tensor([[math.inf, -math.inf], [-math.inf, -math.inf]]))


@pytest.mark.parametrize("args, exc, words", [
    ((-4, 2, None, 16), ValueError, r"d_model must be an int >= 1, got -4"),
    ((8, -2, None, 16), ValueError, r"num_heads must be an int >= 1, got -2"),
    ((8, 2, None, 0), ValueError, r"dim_feedforward must be an int >= 1, got 0"),
    ((8, 2, None, "16"), TypeError, r"dim_feedforward must be an int >= 1, got str"),
])
def test_decoder_block_refuses_bad_sizes_by_name(args, exc, words):
    from attention_core.models.language_model import DecoderBlock
    with pytest.raises(exc, match=words):
        DecoderBlock(*args)
