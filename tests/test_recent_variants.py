"""The recent-model options of the decoder: output gate, learned sink logits, QK-norm, cross-layer KV sharing and
local/global layers. Each against a hand-computed case and its paper's equation (a loop written apart from the
implementation), decoding with the cache against recomputation, parameter counts, cache bytes, and the shipped
checkpoints unchanged."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attention_core.flex_attention import create_block_mask
from attention_core.mask_mods import causal
from attention_core.models.attention_variants import count_parameters, layer_is_local, local_decode_mask, sink_attention
from attention_core.models.kv_cache import KVCache
from attention_core.models.language_model import (
    DecoderLM,
    LMConfig,
    build_language_model,
    feedforward_for_budget,
    generate,
    left_pad,
    parameter_count,
)
from attention_core.multihead import kv_cache_bytes
from attention_core.positional import apply_rotary
from attention_core.training.checkpoint import load_checkpoint, read_manifest

V = 23
ALL = {"output_gate": True, "sink_logits": True, "qk_norm": True, "kv_share": 2, "layer_pattern": "LG",
       "local_window": 3}
#: each variant alone, then combinations
VARIANTS = {
    "gate": {"output_gate": True},
    "sinks": {"sink_logits": True},
    "qk_norm": {"qk_norm": True},
    "share": {"kv_share": 2},
    "gemma2": {"layer_pattern": "LG", "local_window": 3},
    "gemma3": {"layer_pattern": "LLLLLG", "local_window": 4},
    "gate+sinks": {"output_gate": True, "sink_logits": True},
    "qk_norm+share+gemma2": {"qk_norm": True, "kv_share": 2, "layer_pattern": "GL", "local_window": 2},
    "share+local groups": {"kv_share": 2, "layer_pattern": "LLGG", "local_window": 3, "sink_logits": True},
    "all": ALL,
}


def variant_model(options: dict, num_kv_heads: int = 2, num_layers: int = 4, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> DecoderLM:
    """A small model with large random weights (peaked attention, so that errors show), every learned scale and
    sink logit random too (an RMSNorm of unit scale commutes with RoPE; a zero sink logit is a special case)."""
    model = build_language_model({"vocab_size": V, "d_model": 32, "num_layers": num_layers, "num_heads": 4,
                                  "num_kv_heads": num_kv_heads, "dim_feedforward": 64, "seed": seed, **options})
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.35, generator=g)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.3, 2.0, generator=g)
            elif name.endswith("sink_logits"):
                p.normal_(0.0, 1.5, generator=g)
    return model.to(dtype).eval()


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def reference_logits(model: DecoderLM, text: torch.Tensor) -> torch.Tensor:
    """Every option by its paper's equation, one query row at a time, from the model's weights only.

    Gate: ``Y' = Y * sigmoid(X W_theta)`` per head, X the block's normalised input (Qiu et al., eq. 5, G1).
    Sinks: ``p_j = exp(z_j) / (exp(s_h) + sum exp(z_j'))``. QK-norm: RMSNorm of each head's q and k, then RoPE.
    Sharing: layers 2g and 2g + 1 use the keys and values of layer 2g. Local layers: keys t - W < j <= t.
    """
    opts = model.options
    B, T = text.shape
    x = model.embed(text)
    shared = {}
    positions = torch.arange(T)
    for i, block in enumerate(model.blocks):
        a = block.attn
        Hq, H, E = a.num_heads, a.num_kv_heads, a.head_dim
        h = block.norm1(x)
        q = (h @ a.q_proj.weight.T).view(B, T, Hq, E).transpose(1, 2)
        if i % opts.kv_share == 0:
            k = (h @ a.k_proj.weight.T).view(B, T, H, E).transpose(1, 2)
            v = (h @ a.v_proj.weight.T).view(B, T, H, E).transpose(1, 2)
            if opts.qk_norm:
                k = rms_norm(k, a.k_norm.weight)
            shared[i // opts.kv_share] = (apply_rotary(k, positions), v)
        k, v = shared[i // opts.kv_share]
        if opts.qk_norm:
            q = rms_norm(q, a.q_norm.weight)
        q = apply_rotary(q, positions)
        local = opts.layer_pattern is not None and opts.layer_pattern[i % len(opts.layer_pattern)] == "L"
        out = torch.zeros(B, Hq, T, E, dtype=x.dtype)
        for b in range(B):
            for hq in range(Hq):
                hk = hq // (Hq // H)
                for t in range(T):
                    keys = [j for j in range(t + 1) if not local or t - j < opts.local_window]
                    z = torch.stack([q[b, hq, t] @ k[b, hk, j] for j in keys]) / math.sqrt(E)
                    num = torch.exp(z)
                    den = num.sum() + (torch.exp(a.sink_logits[hq]) if opts.sink_logits else 0.0)
                    y = sum((num[n] / den) * v[b, hk, j] for n, j in enumerate(keys))
                    if opts.output_gate:
                        y = y * torch.sigmoid(h[b, t] @ a.gate_proj.weight[hq * E:(hq + 1) * E].T)
                    out[b, hq, t] = y
        x = x + out.transpose(1, 2).reshape(B, T, Hq * E) @ a.out_proj.weight.T
        x = x + block.linear2(F.gelu(block.linear1(block.norm2(x))))
    return model.lm_head(model.norm(x))


# ------------------------------------------------------------------------------------------- shipped models

#: Logits of every shipped decoder checkpoint on one text, recorded with the code before these options existed:
#: (the first six logits at the last position, the sum of all logits, the sum of their absolute values).
SHIPPED = {
    "induction_curriculum": ([-2.6958, 0.8462, 1.4256, 0.9702, 0.3649, 4.7164], 960.404, 2138.492),
    "induction_plain": ([-0.7577, 5.0415, 1.0093, -5.9917, -5.5955, 0.6182], -3416.992, 7518.761),
    "kind_gqa": ([-1.2583, 1.5717, 0.021, -4.1485, -3.4524, -0.2033], -2563.524, 6143.981),
    "kind_mha": ([0.9081, 4.0207, -1.0149, -4.2138, -4.2014, 0.3694], -2710.904, 6655.079),
    "kind_mla": ([2.2502, 4.0196, -0.076, -3.6025, -3.9241, 0.5985], -2637.624, 6353.797),
    "kind_mqa": ([-1.8251, 1.7885, -1.9569, -4.1573, -3.7768, -1.0808], -2653.364, 6399.61),
    "shakespeare_char": ([-1.3146, 2.6014, 0.6222, -4.0258, -3.3222, 0.3193], -1893.759, 6378.678),
    "shakespeare_draft": ([-0.7372, 2.032, -0.6648, -4.0537, -3.4229, -0.1014], -2713.735, 5868.943),
    "sink_bos": ([0.9303, 1.2295, 3.0313, 1.2602, -0.3524, 2.8554], 328.059, 4850.059),
}
CHECKPOINTS = Path(__file__).resolve().parent.parent / "attention_core" / "shakespeare" / "checkpoints"


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_checkpoints_load_and_compute_what_they_computed(name: str) -> None:
    entry = read_manifest(CHECKPOINTS)[name]
    model = load_checkpoint(CHECKPOINTS / entry["file"], entry["sha256"], build_language_model)
    assert not model.options.any and not set(model.config) & set(ALL)  # its config names none of the options
    assert all(type(b.attn).__name__ in ("CausalSelfAttention", "LatentSelfAttention") for b in model.blocks)
    assert count_parameters(model) == entry["parameters"]
    text = (torch.arange(40) * 7 % model.vocab_size)[None]
    with torch.no_grad():
        logits = model(text).logits[0]
    head, total, absolute = SHIPPED[name]
    assert torch.allclose(logits[-1, :6], torch.tensor(head), atol=2e-3)
    assert abs(float(logits.double().sum()) - total) < 0.05
    assert abs(float(logits.abs().double().sum()) - absolute) < 0.05


@pytest.mark.parametrize("config,count,total,squares", [
    ({"vocab_size": 23, "seed": 0}, 794240, 1150.6462798409943, 1352.7519074236234),
    ({"vocab_size": 23, "seed": 1, "num_kv_heads": 2, "d_model": 32, "num_layers": 3}, 35456, 221.28724464692831,
     232.73653114667061),
    ({"vocab_size": 23, "seed": 2, "attention": "latent", "kv_latent_dim": 16, "rope_dim": 8, "d_model": 32}, 54240,
     350.29839035447253, 365.9319732917513),
])
def test_a_config_without_the_options_draws_the_weights_it_drew_before(config, count, total, squares) -> None:
    """Same modules in the same order, same draws: recorded with the code before the options existed."""
    model = build_language_model(config)
    with torch.no_grad():
        params = list(model.parameters())
        assert count_parameters(model) == count
        assert math.isclose(float(sum(p.double().sum() for p in params)), total, rel_tol=1e-6)
        assert math.isclose(float(sum(p.double().pow(2).sum() for p in params)), squares, rel_tol=1e-6)
    off = build_language_model({**config, "output_gate": False, "sink_logits": None, "qk_norm": False})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), off.state_dict().values()))


# ------------------------------------------------------------------------------------------- each variant


def test_output_gate_by_hand() -> None:
    """One head, E = D = 2, one token (attention returns its value; RoPE at position 0 is the identity):
    x = [1, 1], W_V = I, W_theta = [[ln 3, 0], [0, 0]] so the gate is sigmoid([ln 3, 0]) = [3/4, 1/2];
    W_O = [[1, 1], [0, 2]]: out = W_O (v * gate) = W_O [3/4, 1/2] = [5/4, 1]."""
    model = build_language_model({"vocab_size": 3, "d_model": 2, "num_layers": 1, "num_heads": 1,
                                  "output_gate": True, "seed": 0}).double()
    a = model.blocks[0].attn
    with torch.no_grad():
        a.v_proj.weight.copy_(torch.eye(2))
        a.gate_proj.weight.copy_(torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0]]))
        a.out_proj.weight.copy_(torch.tensor([[1.0, 1.0], [0.0, 2.0]]))
        x = torch.ones(1, 1, 2, dtype=torch.float64)
        out, _ = a(x, model.rotary, None, 0, model._plan(1, None, None, None, None, x.device))
    assert torch.allclose(out, torch.tensor([[[1.25, 1.0]]], dtype=torch.float64), atol=1e-12)


def test_sink_logits_by_hand() -> None:
    """Scores 0 and ln 2 (exp: 1 and 2), sink logit ln 3 (exp 3): weights 1/6 and 2/6, summing to 1/2;
    values 6 and 12 give 1 + 4 = 5."""
    q = torch.ones(1, 1, 1, 1, dtype=torch.float64)
    k = torch.tensor([0.0, math.log(2.0)], dtype=torch.float64).view(1, 1, 2, 1)
    v = torch.tensor([6.0, 12.0], dtype=torch.float64).view(1, 1, 2, 1)
    sinks = torch.tensor([math.log(3.0)], dtype=torch.float64)
    out, w = sink_attention(q, k, v, sinks, scale=1.0, need_weights=True)
    assert torch.allclose(w, torch.tensor([1 / 6, 2 / 6], dtype=torch.float64).view(1, 1, 1, 2), atol=1e-15)
    assert torch.allclose(out, torch.tensor(5.0, dtype=torch.float64).view(1, 1, 1, 1), atol=1e-13)


def test_sink_attention_is_the_softmax_with_one_more_term_in_its_denominator() -> None:
    """GQA, a causal mask and a fully masked row, against the formula written out."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 4, generator=g, dtype=torch.float64) for h, n in ((4, 5), (2, 5), (2, 5)))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[0] = False  # row 0 reads no key: zeros
    out, w = sink_attention(q, k, v, sinks, mask, enable_gqa=True, need_weights=True)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    z = (q @ kk.transpose(-2, -1) / 2.0).masked_fill(~mask, float("-inf"))
    p = z.exp() / (z.exp().sum(-1, keepdim=True) + sinks.exp().view(1, 4, 1, 1))
    assert torch.allclose(w, p, atol=1e-14) and torch.allclose(out, p @ vv, atol=1e-14)
    assert (out[:, :, 0] == 0).all() and (w.sum(-1) < 1).all()
    causal_out, _ = sink_attention(q, k, v, sinks, is_causal=True, enable_gqa=True)
    full_mask = torch.ones(5, 5, dtype=torch.bool).tril()
    assert torch.allclose(causal_out, sink_attention(q, k, v, sinks, full_mask, enable_gqa=True)[0], atol=1e-14)


def test_sink_attention_checks_its_arguments() -> None:
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"sinks must be \(2,\), one logit per query head"):
        sink_attention(q, q, q, torch.zeros(3))
    with pytest.raises(ValueError, match="attn_mask must be a bool mask"):
        sink_attention(q, q, q, torch.zeros(2), torch.zeros(3, 3))
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor"):
        sink_attention(q, q, q, torch.zeros(2), [[True]])
    with pytest.raises(ValueError, match="must be 4-D"):
        sink_attention(q[0], q, q, torch.zeros(2))


def test_qk_norm_makes_the_scores_blind_to_the_scale_of_the_projections() -> None:
    """RMSNorm(c q) = RMSNorm(q) for c > 0 (up to eps): scaling W_Q and W_K by 50 changes nothing with QK-norm,
    and changes the logits without it (the logit growth QK-norm stops, Dehghani et al. 2023)."""
    text = tokens(1, 9)
    for qk_norm, changes in ((True, False), (None, True)):
        model = variant_model({"qk_norm": qk_norm}, dtype=torch.float64)
        with torch.no_grad():
            before = model(text).logits
            for b in model.blocks:
                b.attn.q_proj.weight.mul_(50.0)
                b.attn.k_proj.weight.mul_(50.0)
            after = model(text).logits
        assert ((after - before).abs().max() > 1e-2) == changes


def test_layer_patterns_are_gemmas() -> None:
    assert [layer_is_local("LG", i) for i in range(4)] == [True, False, True, False]  # Gemma 2: 1:1
    assert [layer_is_local("LLLLLG", i) for i in range(12)] == ([True] * 5 + [False]) * 2  # Gemma 3: 5:1
    assert not layer_is_local(None, 0)


def test_local_layers_see_exactly_the_window() -> None:
    W, T = 3, 9
    model = variant_model({"layer_pattern": "LG", "local_window": W})
    with torch.no_grad():
        weights = model(tokens(1, T), need_weights=True).weights
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    assert torch.equal(weights[0][0, 0] > 0, (j <= i) & (i - j < W))  # layer 0: local
    assert torch.equal(weights[1][0, 0] > 0, j <= i)  # layer 1: global


def test_shared_layers_have_no_key_or_value_projection() -> None:
    model = variant_model({"kv_share": 2})
    owners = [b.attn.k_proj is not None and b.attn.v_proj is not None for b in model.blocks]
    assert owners == [True, False, True, False]
    assert [b.attn.slot for b in model.blocks] == [0, 0, 1, 1]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_variant_computes_its_papers_equation(name: str) -> None:
    model = variant_model(VARIANTS[name], dtype=torch.float64)
    text = tokens(2, 10)
    with torch.no_grad():
        got = model(text).logits
        ref = reference_logits(model, text)
        plain = variant_model({}, dtype=torch.float64)(text).logits
    assert (got - ref).abs().max() < 1e-5  # the rotary table is float32, the reference's angles float64
    assert (got - plain).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------- the cache


def decode(model: DecoderLM, text: torch.Tensor, cache, prompt: int = 3) -> torch.Tensor:
    steps = [model(text[:, :prompt], cache).logits]
    steps += [model(text[:, t:t + 1], cache).logits for t in range(prompt, text.shape[1])]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_decoding_with_the_cache_equals_recomputation(name: str) -> None:
    model = variant_model(VARIANTS[name])
    text = tokens(2, 16)
    with torch.no_grad():
        full = model(text).logits
        cache = model.new_cache()
        got = decode(model, text, cache)
        static = decode(model, text, model.new_cache(max_len=16), prompt=1)
    assert (got - full).abs().max() <= 1e-5 and (static - full).abs().max() <= 1e-5
    assert cache.seen == 16 and cache.num_layers == model.cache_layers


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_cache_with_sinks_that_evicts_nothing_equals_recomputation(name: str) -> None:
    """A StreamingLLM cache stores keys before RoPE and rotates them by slot at every step: with room for the
    whole text the slots are the positions, so it must compute the full model (QK-norm before the cache, the
    shared keys rotated once per group)."""
    model = variant_model(VARIANTS[name])
    text = tokens(2, 12)
    with torch.no_grad():
        got = decode(model, text, model.new_cache(window=13, sinks=2))
        full = model(text).logits
    assert (got - full).abs().max() <= 1e-5


@pytest.mark.parametrize("sinks,window,W", [(2, 4, 3), (1, 3, 5), (3, 5, 5), (0, 4, 2)])
def test_a_local_layer_in_a_streaming_cache_reads_its_window_of_the_text(sinks: int, window: int, W: int) -> None:
    """Decoding token t with StreamingLLM's cache: slot j < sinks holds text index j, the other slots the most
    recent tokens; a local layer reads the kept keys within W of t in the text."""
    cache = KVCache(1, window=window, sinks=sinks)
    for t in range(14):
        cache.seen = t
        S = min(t, sinks + window - 1) + 1
        text = [j if j < sinks else t - (S - 1 - j) for j in range(S)]
        expected = torch.tensor([[t - text[j] < W and (j < sinks or S - 1 - j < window) for j in range(S)]])
        assert torch.equal(local_decode_mask(1, S, W, cache), expected), t
    cache.seen = 0  # a prefill of L tokens: slots are text indices
    i, j = torch.arange(6)[:, None], torch.arange(6)[None]
    want = (j <= i) & (i - j < W) & ((j < sinks) | (i - j < window))
    assert torch.equal(local_decode_mask(6, 6, W, cache), want)


def test_a_call_leaves_no_reference_cycle() -> None:
    """A call's plan carries its keys and values between layers: a cycle would keep them alive until the
    garbage collector runs. The collector is paused during the calls and asked afterwards what it would free;
    only the calls' own objects count (tensors, and instances of the library's classes: a plan, a cache), since
    other threads and first-time imports in the same process can leave unrelated garbage of their own."""
    import gc

    model = variant_model(ALL)
    text = tokens(2, 8)

    def calls():
        model(text)
        cache = model.new_cache()
        model(text[:, :4], cache)
        model(text[:, 4:5], cache)

    with torch.no_grad():
        calls()  # the same calls once before: what a first call sets up once is not garbage of the calls
        gc.collect()
        flags = gc.get_debug()
        gc.disable()
        try:
            gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds unreachable is kept in gc.garbage to inspect
            calls()
            gc.collect()
            ours = [type(o).__qualname__ for o in gc.garbage
                    if isinstance(o, torch.Tensor) or type(o).__module__.startswith("attention_core")]
        finally:
            gc.set_debug(flags)
            gc.garbage.clear()
            gc.enable()
    assert ours == []


def test_every_new_parameter_learns() -> None:
    model = variant_model(ALL).train()
    text = tokens(2, 10)
    loss = F.cross_entropy(model(text[:, :-1]).logits.flatten(0, 1), text[:, 1:].flatten())
    loss.backward()
    for name, p in model.named_parameters():
        if name.endswith(("gate_proj.weight", "sink_logits", "q_norm.weight", "k_norm.weight")):
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    fresh = build_language_model({"vocab_size": V, "d_model": 32, "num_layers": 4, "seed": 0, **ALL})
    a = fresh.blocks[0].attn
    assert (a.sink_logits == 0).all() and (a.q_norm.weight == 1).all() and a.gate_proj.weight.std() < 0.05


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "sinks", "all"])
@pytest.mark.parametrize("window", [2, 5])
def test_decoding_with_a_rolling_cache_equals_windowed_recomputation(name: str, window: int) -> None:
    model = variant_model(VARIANTS[name])
    text = tokens(2, 16)
    with torch.no_grad():
        ref = model(text, window=window).logits
        got = decode(model, text, model.new_cache(window=window))
        oneshot = model(text, model.new_cache(window=window)).logits
    assert (got - ref).abs().max() <= 1e-5 and (oneshot - ref).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["all", "gemma2", "share+local groups"])
def test_left_padded_rows_compute_what_they_compute_alone(name: str) -> None:
    model = variant_model(VARIANTS[name])
    short, long = tokens(1, 5, seed=3)[0], tokens(1, 8, seed=4)[0]
    batch, pad = left_pad([short, long])
    more = tokens(2, 4, seed=5)
    with torch.no_grad():
        cache = model.new_cache()
        got = torch.cat([model(batch, cache, pad=pad).logits] +
                        [model(more[:, t:t + 1], cache).logits for t in range(4)], dim=1)
        alone = [model(torch.cat([r, m])[None]).logits[0] for r, m in ((short, more[0]), (long, more[1]))]
    assert (got[0, 3:] - alone[0]).abs().max() <= 1e-5
    assert (got[1] - alone[1]).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["all", "gemma3", "share+local groups"])
def test_generation_with_and_without_the_cache_agree(name: str) -> None:
    model = variant_model(VARIANTS[name])
    prompt = tokens(2, 4)
    cached = generate(model, prompt, 12, temperature=0.0)
    assert torch.equal(cached, generate(model, prompt, 12, temperature=0.0, use_cache=False))
    sampled = [generate(model, prompt, 12, generator=torch.Generator().manual_seed(0), use_cache=c)
               for c in (True, False)]
    assert torch.equal(*sampled)


def test_a_block_mask_gives_the_dense_answer_and_sinks_refuse_one() -> None:
    text = tokens(2, 12)
    block_mask = create_block_mask(causal, None, None, 12, 12, BLOCK_SIZE=4)
    model = variant_model({"output_gate": True, "qk_norm": True, "kv_share": 2, "layer_pattern": "LG",
                           "local_window": 3})
    with torch.no_grad():
        assert (model(text, block_mask=block_mask).logits - model(text).logits).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="sink_logits"):
        variant_model({"sink_logits": True})(text, block_mask=block_mask)


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_cache_bytes_per_token_with_shared_keys_and_values(num_kv_heads: int) -> None:
    model = variant_model({"kv_share": 2}, num_kv_heads=num_kv_heads)
    plain = variant_model({}, num_kv_heads=num_kv_heads)
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens(2, 17), cache)
    assert cache.num_layers == 2  # one entry per group of two layers
    assert cache.nbytes() == kv_cache_bytes(2, num_kv_heads, 8, 17, batch=2, bytes_per_element=4)
    assert cache.nbytes() == 4 * 2 * 17 * model.num_layers * model.cache_numbers_per_token()
    assert 2 * model.cache_numbers_per_token() == plain.cache_numbers_per_token() == 2 * num_kv_heads * 8


@pytest.mark.parametrize("options,rolling", [
    ({"layer_pattern": "LG", "local_window": 3}, [3, None, 3, None]),  # Gemma 2: every other entry rolls
    ({"layer_pattern": "LLLLLG", "local_window": 4}, [4, 4, 4, 4]),  # Gemma 3 (6 layers would end on a global)
    ({"layer_pattern": "LLGG", "local_window": 3, "kv_share": 2}, [3, None]),  # a group of local layers rolls
    ({"layer_pattern": "LG", "local_window": 3, "kv_share": 2}, [None, None]),  # a mixed group keeps every token
])
def test_entries_read_only_by_local_layers_hold_the_window(options: dict, rolling: list) -> None:
    model = variant_model(options)
    cache = model.new_cache()
    assert cache.layer_windows == (None if set(rolling) == {None} else rolling)
    T = 17
    with torch.no_grad():
        model(tokens(2, 12), cache)
        for t in range(5):
            model(tokens(2, 1, seed=t), cache)
    held = [T if w is None else w - 1 for w in rolling]
    assert [cache.held(g) for g in range(model.cache_layers)] == held and len(cache) == max(held)
    per_entry = 2 * model.num_kv_heads * model.head_dim * 4  # float32 keys and values, per token and batch row
    assert cache.nbytes() == 2 * per_entry * sum(held) == model.cache_bytes(T, batch=2)


@pytest.mark.parametrize("config", [{}, {"kv_share": 2}, {"layer_pattern": "LG", "local_window": 4},
                                    {"layer_pattern": "LLGG", "local_window": 3, "kv_share": 2}, ALL,
                                    {"attention": "latent", "kv_latent_dim": 8, "rope_dim": 4, "num_kv_heads": None}])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_cache_bytes_is_what_the_cache_holds(config: dict, T: int) -> None:
    model = variant_model(config)
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens(3, 1), cache)
        for t in range(1, T):
            model(tokens(3, 1, seed=t), cache)
    assert cache.nbytes() == model.cache_bytes(T, batch=3, bytes_per_element=4)


def test_a_cache_that_rolls_some_layers_is_checked_and_restored() -> None:
    with pytest.raises(ValueError, match="layer_windows must be a sequence of num_layers = 2"):
        KVCache(2, layer_windows=[3])
    with pytest.raises(ValueError, match="not with window=4"):
        KVCache(2, window=4, layer_windows=[3, None])
    with pytest.raises(ValueError, match=r"layer_windows\[1\] must be an int >= 1"):
        KVCache(2, layer_windows=[3, 0])
    model = variant_model({"layer_pattern": "LG", "local_window": 3})
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens(1, 6), cache)
        keys = [k.clone() for k in cache.keys]
        with pytest.raises(ValueError, match="tokens must be ids"):
            model(torch.tensor([[0, V]]), cache)
        with cache.snapshot() as snap:
            model(tokens(1, 2), cache)
            cache.restore(snap)
    assert all(torch.equal(a, b) for a, b in zip(keys, cache.keys))
    with pytest.raises(ValueError, match="crop needs a full cache"):
        cache.crop(1)


# ------------------------------------------------------------------------------------------- parameters

#: chapter 11's model (shakespeare_char: D = 128, 2 layers, 4 heads, feed-forward 512) on its 65 characters
CH11 = {"vocab_size": 65, "d_model": 128, "num_layers": 2, "num_heads": 4, "dim_feedforward": 512, "context": 128}


@pytest.mark.parametrize("options,extra", [
    ({}, 0),
    ({"output_gate": True}, 2 * 128 * 128),  # W_theta: D -> Hq E per layer
    ({"sink_logits": True}, 2 * 4),  # one logit per head and layer
    ({"qk_norm": True}, 2 * (32 + 32)),  # a scale of E for queries and one for keys, per layer
    ({"kv_share": 2}, -2 * 128 * 128),  # the second layer has no W_K, W_V
    ({"layer_pattern": "LG", "local_window": 32}, 0),
    (ALL, 2 * 128 * 128 + 8 + (32 + 32) + 32 - 2 * 128 * 128),
])
def test_parameter_counts_of_chapter_11s_model(options: dict, extra: int) -> None:
    base = count_parameters(build_language_model({**CH11, "seed": 0}))
    assert base == 404096  # the shipped shakespeare_char's manifest count
    assert count_parameters(build_language_model({**CH11, "seed": 0, **options})) == base + extra


@pytest.mark.parametrize("options", [{"output_gate": True}, {"sink_logits": True}, {"qk_norm": True},
                                     {"kv_share": 2}, {"layer_pattern": "LG", "local_window": 32}, ALL])
def test_the_feed_forward_width_matches_a_budget_within_one_percent(options: dict) -> None:
    budget = parameter_count(CH11)
    config = {**CH11, **options}
    state = torch.random.get_rng_state()
    width = feedforward_for_budget(config, budget)
    assert torch.equal(state, torch.random.get_rng_state())  # counted on the meta device: nothing drawn
    gaps = {f: abs(parameter_count({**config, "dim_feedforward": f}) - budget) for f in (width - 1, width, width + 1)}
    assert gaps[width] == min(gaps.values()) and gaps[width] <= 0.01 * budget
    assert parameter_count(config) == count_parameters(build_language_model({**config, "seed": 0}))


def test_count_parameters_counts_a_tied_weight_once() -> None:
    model = build_language_model({**CH11, "seed": 0})
    assert count_parameters(model) == sum(p.numel() for n, p in model.named_parameters())
    assert model.lm_head.weight is model.embed.weight
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        count_parameters(CH11)


# ------------------------------------------------------------------------------------------- the edge


@pytest.mark.parametrize("options,err,pattern", [
    ({"output_gate": 1}, TypeError, "output_gate must be a bool"),
    ({"sink_logits": "yes"}, TypeError, "sink_logits must be a bool"),
    ({"qk_norm": 0}, TypeError, "qk_norm must be a bool"),
    ({"kv_share": 0}, ValueError, "kv_share must be an int >= 1"),
    ({"kv_share": 2.0}, TypeError, "kv_share must be an int"),
    ({"kv_share": 3}, ValueError, "kv_share = 3 must divide num_layers = 4"),
    ({"layer_pattern": "LX", "local_window": 2}, ValueError, "layer_pattern must be a non-empty str"),
    ({"layer_pattern": "GG", "local_window": 2}, ValueError, "at least one 'L'"),
    ({"layer_pattern": ["L"], "local_window": 2}, TypeError, "layer_pattern must be a str"),
    ({"layer_pattern": "LG"}, ValueError, "needs local_window"),
    ({"local_window": 4}, ValueError, "local_window=4 needs layer_pattern"),
    ({"layer_pattern": "LG", "local_window": 0}, ValueError, "local_window must be an int >= 1"),
    ({"attention": "latent", "kv_latent_dim": 8, "rope_dim": 4, "num_kv_heads": None, "qk_norm": True},
     ValueError, "belong to attention='standard'"),
])
def test_the_options_are_checked_at_the_edge(options: dict, err: type, pattern: str) -> None:
    config = {"vocab_size": V, "d_model": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, **options}
    with pytest.raises(err, match=pattern):
        build_language_model(config)


def test_the_paged_engine_and_the_clamped_forward_refuse_the_options() -> None:
    from attention_core.models.long_context import forward_clamped_offsets
    from attention_core.serving.engine import new_paged_cache

    for options in ({"qk_norm": True}, {"layer_pattern": "LG", "local_window": 2}):
        model = variant_model(options)
        with pytest.raises(ValueError, match="the paged engine serves the plain standard attention only"):
            new_paged_cache(model, 8)
        with pytest.raises((TypeError, ValueError), match="standard"):
            forward_clamped_offsets(model, tokens(1, 4), 2)


def test_a_cache_of_the_wrong_size_is_refused() -> None:
    model = variant_model({"kv_share": 2})
    with pytest.raises(ValueError, match="the model caches 2 layers"):
        model(tokens(1, 3), variant_model({}).new_cache())


def test_the_options_travel_in_the_config() -> None:
    model = build_language_model(LMConfig(vocab_size=V, d_model=32, num_layers=4, seed=3, **ALL))
    assert {k: model.config[k] for k in ALL} == ALL and model.config["seed"] == 3
    again = build_language_model(model.config)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
