"""The gated delta rule and DSA's indexed (learned top-k) attention as options of the decoder (issue 42, item 1):
``"D"`` layers in ``layer_pattern`` and ``index_topk``; hand-computed cases, the cache against recomputation for
every supported combination, counts, and the checks at the edge."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attention_core.flex_attention import create_block_mask
from attention_core.indexer import indexer_kl_loss, topk_within
from attention_core.mask_mods import causal
from attention_core.models.attention_variants import count_parameters
from attention_core.models.gated_delta import GatedDeltaLayer
from attention_core.models.indexed_attention import pack_heads, unpack_heads
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
from attention_core.positional import apply_rotary

V = 23
#: each new option alone, then with the others (and with the options that were there before)
VARIANTS = {
    "delta hybrid": {"layer_pattern": "DG"},
    "qwen3-next": {"layer_pattern": "DDDG"},
    "delta+local": {"layer_pattern": "DLG", "local_window": 3},
    "indexed": {"index_topk": 3},
    "indexed k=1": {"index_topk": 1, "index_heads": 2, "index_dim": 8},
    "indexed wide": {"index_topk": 2, "index_dim": 12},  # d_I not a multiple of E: padded heads in the cache
    "indexed+local": {"layer_pattern": "LG", "local_window": 4, "index_topk": 2},
    "indexed+sinks+gate+qk_norm": {"index_topk": 2, "sink_logits": True, "output_gate": True, "qk_norm": True},
    "all new": {"layer_pattern": "DLG", "local_window": 3, "index_topk": 2, "sink_logits": True,
                "output_gate": True, "qk_norm": True},
}


def variant_model(options: dict, num_kv_heads: int = 2, num_layers: int = 4, seed: int = 0,
                  dtype: torch.dtype = torch.float64) -> DecoderLM:
    """A small model with large random matrices (peaked attention and index scores, so that errors show)."""
    model = build_language_model({"vocab_size": V, "d_model": 32, "num_layers": num_layers, "num_heads": 4,
                                  "num_kv_heads": num_kv_heads, "dim_feedforward": 64, "seed": seed, **options})
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.35, generator=g)
            elif name.endswith("sink_logits"):
                p.normal_(0.0, 1.5, generator=g)
    return model.to(dtype).eval()


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def decode(model: DecoderLM, text: torch.Tensor, cache, prompt: int) -> torch.Tensor:
    steps = [model(text[:, :prompt], cache).logits]
    steps += [model(text[:, t:t + 1], cache).logits for t in range(prompt, text.shape[1])]
    return torch.cat(steps, dim=1)


# ------------------------------------------------------------------------------------------- hand cases


def delta_rule_by_hand(layer: GatedDeltaLayer, x: torch.Tensor) -> torch.Tensor:
    """Yang et al.'s token mixer for x (1, T, D), one token at a time with explicit matrices: short causal conv +
    SiLU on q, k, v; L2-normalised q, k; ``S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``,
    ``o_t = S_t q_t``; ``y = W_o (RMSNorm(o_t) * SiLU(W_g x_t))``."""
    m = layer.mixer
    H, E = m.num_heads, m.head_dim
    T = x.shape[1]
    proj = torch.cat([x[0] @ m.q_proj.weight.T, x[0] @ m.k_proj.weight.T, x[0] @ m.v_proj.weight.T], -1)  # (T, C)
    K = m.conv_size
    padded = torch.cat([torch.zeros(K - 1, proj.shape[1], dtype=x.dtype), proj])
    conv = torch.stack([(padded[t:t + K] * m.conv_weight[:, 0, :].T).sum(0) for t in range(T)])  # (T, C)
    q, k, v = F.silu(conv).split([H * E, H * E, H * E], -1)
    S = torch.zeros(H, E, E, dtype=x.dtype)
    ys = []
    for t in range(T):
        o = []
        for h in range(H):
            qt, kt, vt = (z[t, h * E:(h + 1) * E] for z in (q, k, v))
            qt, kt = qt / qt.norm(), kt / kt.norm()
            dt = F.softplus(x[0, t] @ m.a_proj.weight[h] + m.dt_bias[h])
            alpha = torch.exp(-torch.exp(m.A_log[h]) * dt)
            beta = torch.sigmoid(x[0, t] @ m.b_proj.weight[h])
            transition = alpha * (torch.eye(E, dtype=x.dtype) - beta * torch.outer(kt, kt))
            S[h] = S[h] @ transition + beta * torch.outer(vt, kt)
            oh = S[h] @ qt
            oh = oh / torch.sqrt(oh.pow(2).mean() + m.o_norm.eps) * m.o_norm.weight
            o.append(oh * F.silu(x[0, t] @ m.g_proj.weight[h * E:(h + 1) * E].T))
        ys.append(torch.cat(o) @ m.o_proj.weight.T)
    return torch.stack(ys)[None]  # (1, T, D)


def test_a_delta_layer_of_the_stack_is_the_papers_token_mixer() -> None:
    model = variant_model({"layer_pattern": "DG"})
    assert isinstance(model.blocks[0].attn, GatedDeltaLayer) and isinstance(model.blocks[2].attn, GatedDeltaLayer)
    assert not isinstance(model.blocks[1].attn, GatedDeltaLayer)
    x = model.embed(tokens(1, 9))
    block = model.blocks[0]
    with torch.no_grad():
        got, _ = block.attn(block.norm1(x), model.rotary, None, 0, model._plan(9, None, None, None, None, x.device))
        want = delta_rule_by_hand(block.attn, block.norm1(x))
    assert (got - want).abs().max() < 1e-10


def test_the_delta_layers_keep_mamba2s_decay_initialisation() -> None:
    """GPT-2's init zeroes every bias of the model, but ``dt_bias`` is the inverse softplus of a step in
    [0.001, 0.1]: it must survive (else every layer would forget with exp(-A ln 2) per token)."""
    model = build_language_model({"vocab_size": V, "d_model": 32, "num_layers": 2, "layer_pattern": "DG",
                                  "seed": 0})
    dt = F.softplus(model.blocks[0].attn.mixer.dt_bias)
    assert ((dt > 0.00099) & (dt < 0.1001)).all()
    assert model.blocks[0].attn.mixer.o_proj.weight.std() < 0.02  # residual projection scaled as out_proj's


def index_logits_by_hand(model: DecoderLM, text: torch.Tensor) -> torch.Tensor:
    """Every layer of an ``index_topk`` model (plain options otherwise, d_I = E) by DSA's equations: eq. (1)
    ``I_ts = sum_j w_tj ReLU(q_tj . k_s)`` with RoPE on the indexer's queries and keys (scaled by
    ``1/sqrt(d_I)`` and ``1/sqrt(H_I)``), each query's k keys of largest ``I`` among ``s <= t`` (ties to the
    most recent), and softmax attention over those keys only."""
    B, T = text.shape
    x = model.embed(text)
    pos = torch.arange(T)
    k_top = model.options.index_topk
    for block in model.blocks:
        a, ix = block.attn, block.attn.indexer
        Hq, H, E, HI, dI = a.num_heads, a.num_kv_heads, a.head_dim, ix.index_heads, ix.index_dim
        assert dI == E
        h = block.norm1(x)
        q = apply_rotary((h @ a.q_proj.weight.T).view(B, T, Hq, E).transpose(1, 2), pos)
        k = apply_rotary((h @ a.k_proj.weight.T).view(B, T, H, E).transpose(1, 2), pos)
        v = (h @ a.v_proj.weight.T).view(B, T, H, E).transpose(1, 2)
        qi = apply_rotary((h @ ix.index_q.weight.T).view(B, T, HI, dI).transpose(1, 2), pos) / math.sqrt(dI)
        ki = apply_rotary((h @ ix.index_k.weight.T)[:, None], pos)[:, 0]  # (B, T, dI)
        w = (h @ ix.index_w.weight.T) / math.sqrt(HI)  # (B, T, HI)
        out = torch.zeros(B, Hq, T, E, dtype=x.dtype)
        for b in range(B):
            for t in range(T):
                score = [sum(w[b, t, j] * torch.relu(qi[b, j, t] @ ki[b, s]) for j in range(HI)) for s in range(t + 1)]
                order = sorted(range(t + 1), key=lambda s: (-float(score[s]), -s))[:k_top]
                for hq in range(Hq):
                    hk = hq // (Hq // H)
                    z = torch.stack([q[b, hq, t] @ k[b, hk, s] for s in order]) / math.sqrt(E)
                    out[b, hq, t] = (torch.softmax(z, 0)[:, None] * v[b, hk, order]).sum(0)
        x = x + out.transpose(1, 2).reshape(B, T, Hq * E) @ a.out_proj.weight.T
        x = x + block.linear2(F.gelu(block.linear1(block.norm2(x))))
    return model.lm_head(model.norm(x))


@pytest.mark.parametrize("k", [1, 3])
def test_indexed_attention_is_dsas_equations(k: int) -> None:
    model = variant_model({"index_topk": k, "index_heads": 2, "index_dim": 8}, num_layers=2)
    text = tokens(2, 9)
    with torch.no_grad():
        got = model(text).logits
        want = index_logits_by_hand(model, text)
        dense = model(text, index_dense=True).logits
    assert (got - want).abs().max() < 1e-5  # the rotary table is float32, the reference's angles float64
    assert (got - dense).abs().max() > 1e-2  # the selection changes the answer


def test_topk_at_least_the_length_is_dense_attention() -> None:
    """k >= T keeps every earlier key: the model computes the plain model with the same weights."""
    indexed = variant_model({"index_topk": 16}, num_layers=2)
    plain = build_language_model({"vocab_size": V, "d_model": 32, "num_layers": 2, "num_heads": 4,
                                  "num_kv_heads": 2, "dim_feedforward": 64}).to(torch.float64).eval()
    plain.load_state_dict({n: p for n, p in indexed.state_dict().items() if ".indexer." not in n})
    text = tokens(2, 16)
    with torch.no_grad():
        assert (indexed(text).logits - plain(text).logits).abs().max() < 1e-12


def test_top_one_attention_returns_the_value_of_the_chosen_key() -> None:
    """With k = 1 the softmax has one term: each query's attention output is the value of its selected key."""
    model = variant_model({"index_topk": 1, "index_heads": 2, "index_dim": 8}, num_layers=1)
    a = model.blocks[0].attn
    text = tokens(1, 7)
    weights = model(text, need_weights=True).weights[0]  # (1, Hq, L, S)
    assert torch.equal(weights.sum(-1), torch.ones(1, 4, 7, dtype=torch.float64))
    assert ((weights == 0) | (weights == 1)).all() and torch.equal(weights.triu(1), torch.zeros_like(weights))
    assert weights[0, 0, 0, 0] == 1 and a.options.index_topk == 1


def test_ties_go_to_the_most_recent_key() -> None:
    scores = torch.tensor([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]])  # (1, 2, 4)
    allowed = torch.tensor([[[True, True, True, True], [True, True, True, False]]])
    assert topk_within(scores, allowed, 1).int().tolist() == [[[0, 0, 1, 0], [0, 0, 1, 0]]]
    assert topk_within(scores, allowed, 2).int().tolist() == [[[0, 1, 1, 0], [0, 1, 1, 0]]]
    assert topk_within(scores, allowed, 9).int().tolist() == allowed.int().tolist()  # fewer than k: all of them


def test_indexer_keys_pack_into_key_heads_and_back() -> None:
    x = torch.arange(2 * 3 * 5 * 6, dtype=torch.float32).view(2, 3, 5, 6)  # (B, N, L, d = 6)
    heads = pack_heads(x, 4)  # two heads of 4 per vector, the second padded with two zeros
    assert heads.shape == (2, 6, 5, 4)
    assert heads[0, 0, 0].tolist() == [0, 1, 2, 3] and heads[0, 1, 0].tolist() == [4, 5, 0, 0]
    assert torch.equal(unpack_heads(heads, 3, 6), x)


# ------------------------------------------------------------------------------------------- the indexer's training


def test_the_indexer_learns_from_its_kl_loss_only_and_the_model_from_the_lm_loss_only() -> None:
    """DSA (section 2.1): the indexer's input is detached; its loss is the KL from the main attention (summed over
    heads, L1-normalised: a target, no gradient) to the indexer's softmax."""
    model = variant_model({"index_topk": 2, "layer_pattern": "DG"}, dtype=torch.float32).train()
    text = tokens(2, 10)
    out = model(text[:, :-1], need_index_loss=True)
    lm = F.cross_entropy(out.logits.flatten(0, 1), text[:, 1:].flatten())
    indexer = {n for n, _ in model.named_parameters() if ".indexer." in n}
    assert len(indexer) == 2 * 3  # two attention layers, three matrices each
    grads = torch.autograd.grad(lm, list(model.parameters()), allow_unused=True, retain_graph=True)
    for (n, _), g in zip(model.named_parameters(), grads):
        assert (g is None or g.abs().sum() == 0) == (n in indexer), n  # every other parameter learns
    grads = torch.autograd.grad(out.index_loss, list(model.parameters()), allow_unused=True)
    for (n, _), g in zip(model.named_parameters(), grads):
        assert (g is not None and g.abs().sum() > 0) == (n in indexer), n


def test_the_index_loss_is_eq_3_dense_and_eq_4_sparse() -> None:
    model = variant_model({"index_topk": 2}, num_layers=1)
    a = model.blocks[0].attn
    text = tokens(2, 8)
    with torch.no_grad():
        for dense in (True, False):
            out = model(text, need_weights=True, need_index_loss=True, index_dense=dense)
            x = model.blocks[0].norm1(model.embed(text))
            _, _, ik = a._keys_values(x, model.rotary, None, model._plan(8, None, None, None, None, x.device))
            scores = a._index_scores(x, model.rotary, model._plan(8, None, None, None, None, x.device), 8, ik)
            keys = out.weights[0].sum(1) > 0  # the keys attention read: every earlier one, or the top 2
            assert keys.sum(-1).max() == (8 if dense else 2)
            want = indexer_kl_loss(scores, out.weights[0], keys, reduction="mean")
            assert abs(float(out.index_loss) - float(want)) < 1e-12 and float(out.index_loss) > 0


# ------------------------------------------------------------------------------------------- the cache


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("T,prompt", [(1, 1), (6, 1), (16, 5), (70, 66)])
def test_decoding_with_the_cache_equals_recomputation(name: str, T: int, prompt: int) -> None:
    """Prompt in one call, then one token at a time (70 > the delta rule's chunk of 64: the chunked prefill hands
    its state to the decode steps across a chunk boundary)."""
    model = variant_model(VARIANTS[name])
    text = tokens(2, T)
    with torch.no_grad():
        full = model(text).logits
        cache = model.new_cache()
        got = decode(model, text, cache, prompt)
        static = decode(model, text, model.new_cache(max_len=T), prompt=1)
        chunks = torch.cat([model(text[:, i:i + 7], c).logits for c in [model.new_cache()]
                            for i in range(0, T, 7)], dim=1)
    assert (got - full).abs().max() < 1e-9 and (static - full).abs().max() < 1e-9
    assert (chunks - full).abs().max() < 1e-9
    assert cache.seen == T


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_cache_with_sinks_that_evicts_nothing_equals_recomputation(name: str) -> None:
    model = variant_model(VARIANTS[name])
    text = tokens(2, 12)
    with torch.no_grad():
        got = decode(model, text, model.new_cache(window=13, sinks=2), 3)
        full = model(text).logits
    assert (got - full).abs().max() < 1e-9


@pytest.mark.parametrize("name", ["delta hybrid", "indexed", "all new"])
@pytest.mark.parametrize("window", [2, 5])
def test_decoding_with_a_rolling_cache_equals_windowed_recomputation(name: str, window: int) -> None:
    """A window limits the attention layers (and the keys an indexer chooses among); a delta layer reads the
    whole text through its state, in both."""
    model = variant_model(VARIANTS[name])
    text = tokens(2, 16)
    with torch.no_grad():
        ref = model(text, window=window).logits
        got = decode(model, text, model.new_cache(window=window), 3)
    assert (got - ref).abs().max() < 1e-9


@pytest.mark.parametrize("name", ["delta hybrid", "indexed", "all new"])
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
        nocache = model(torch.cat([batch, more], 1), pad=pad).logits
    assert (got[0, 3:] - alone[0]).abs().max() < 1e-9 and (got[1] - alone[1]).abs().max() < 1e-9
    assert (nocache[0, 3:] - alone[0]).abs().max() < 1e-9


@pytest.mark.parametrize("name", ["qwen3-next", "indexed+sinks+gate+qk_norm", "all new"])
def test_generation_with_and_without_the_cache_agree(name: str) -> None:
    model = variant_model(VARIANTS[name])
    prompt = tokens(2, 4)
    assert torch.equal(generate(model, prompt, 12, temperature=0.0),
                       generate(model, prompt, 12, temperature=0.0, use_cache=False))


def test_a_refused_call_leaves_the_delta_state_and_the_cache_as_they_were() -> None:
    model = variant_model({"layer_pattern": "DG", "index_topk": 2})
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens(1, 5), cache)
        state, keys = cache.state(0), [None if k is None else k.clone() for k in cache.keys]
        last = model.blocks[3].attn
        original = last.forward

        def broken(*args, **kwargs):
            raise RuntimeError("a backend refused")
        last.forward = broken
        try:
            with pytest.raises(RuntimeError, match="a backend refused"):
                model(tokens(1, 2, seed=9), cache)
        finally:
            last.forward = original
        assert cache.state(0) is state and cache.seen == 5 and len(cache) == 5
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(keys, cache.keys))
        again = model(tokens(1, 2, seed=9), cache).logits
        full = model(torch.cat([tokens(1, 5), tokens(1, 2, seed=9)], 1)).logits[:, 5:]
    assert (again - full).abs().max() < 1e-9


def test_the_cache_holds_states_for_delta_layers_and_refuses_to_crop_them() -> None:
    model = variant_model({"layer_pattern": "DG"})
    cache = model.new_cache()
    assert cache.recurrent == (True, False, True, False)
    with torch.no_grad():
        model(tokens(2, 3), cache)
    assert len(cache) == 3 and cache.batch_size == 2 and cache.keys[0] is None and cache.state(0) is not None
    with pytest.raises(ValueError, match="crop needs a cache of keys and values only"):
        cache.crop(1)
    with pytest.raises(ValueError, match="layer 1 holds keys and values"):
        cache.set_state(1, None)
    with pytest.raises(ValueError, match="recurrent must be a sequence of num_layers = 2 bools"):
        KVCache(2, recurrent=[True, True])
    with pytest.raises(ValueError, match="recurrent must be a sequence of num_layers = 2 bools"):
        KVCache(2, recurrent=[1, 0])
    cache.reset()
    assert cache.state(0) is None and len(cache) == 0


# ------------------------------------------------------------------------------------------- counts


def test_cache_bytes_by_hand() -> None:
    """D = 32, H = 4, E = 8, 2 KV heads, 4 layers 'DG': each delta layer holds (4 - 1) * 3 * 32 convolution inputs
    and 4 * 8 * 8 memory numbers whatever T; each attention layer 2 * 2 * 8 numbers per token; an indexer of
    d_I = 12 adds two key heads of 8 per token."""
    delta = variant_model({"layer_pattern": "DG"})
    assert delta.cache_bytes(0) == 0
    assert delta.cache_bytes(10, batch=3) == 3 * 4 * (2 * (3 * 96 + 256) + 2 * 10 * 32)
    indexed = variant_model({"index_topk": 2, "index_dim": 12})
    assert indexed.cache_numbers_per_token() == 32 + 16
    assert indexed.cache_bytes(10) == 4 * 4 * 10 * 48


@pytest.mark.parametrize("config", [VARIANTS["delta hybrid"], VARIANTS["indexed wide"], VARIANTS["all new"]])
@pytest.mark.parametrize("T", [1, 9])
def test_cache_bytes_is_what_the_cache_holds(config: dict, T: int) -> None:
    model = variant_model(config, dtype=torch.float32)
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens(3, 1), cache)
        for t in range(1, T):
            model(tokens(3, 1, seed=t), cache)
    assert cache.nbytes() == model.cache_bytes(T, batch=3)


#: chapter 11's model (shakespeare_char: D = 128, 2 layers, 4 heads, feed-forward 512) on its 65 characters
CH11 = {"vocab_size": 65, "d_model": 128, "num_layers": 2, "num_heads": 4, "dim_feedforward": 512, "context": 128}


@pytest.mark.parametrize("options,extra", [
    # a delta layer: W_q, W_k, W_v 3 * 128^2, conv 384 * 4, a and b 2 * 128 * 4, A_log and dt_bias 2 * 4,
    # W_g and W_o 2 * 128^2, the output norm 32; instead of W_q, W_k, W_v, W_o (4 * 128^2)
    ({"layer_pattern": "DG"}, 3 * 128 ** 2 + 1536 + 1024 + 8 + 2 * 128 ** 2 + 32 - 4 * 128 ** 2),
    # an indexer per layer: W_q^I 128 * 4 * 16, W_k^I 128 * 16, w 128 * 4
    ({"index_topk": 8}, 2 * 128 * (64 + 16 + 4)),
    ({"index_topk": 8, "index_heads": 2, "index_dim": 32}, 2 * 128 * (64 + 32 + 2)),
])
def test_parameter_counts_of_chapter_11s_model(options: dict, extra: int) -> None:
    base = count_parameters(build_language_model({**CH11, "seed": 0}))
    assert base == 404096
    assert count_parameters(build_language_model({**CH11, "seed": 0, **options})) == base + extra
    assert parameter_count({**CH11, **options}) == base + extra


@pytest.mark.parametrize("options", [{"layer_pattern": "DG"}, {"index_topk": 8}, {"layer_pattern": "GD"},
                                     {"layer_pattern": "DG", "index_topk": 8, "output_gate": True}])
def test_the_feed_forward_width_matches_a_budget_within_one_percent(options: dict) -> None:
    budget = parameter_count(CH11)
    config = {**CH11, **options}
    state = torch.random.get_rng_state()
    width = feedforward_for_budget(config, budget)
    assert torch.equal(state, torch.random.get_rng_state())  # counted on the meta device: nothing drawn
    assert abs(parameter_count({**config, "dim_feedforward": width}) - budget) <= 0.01 * budget


# ------------------------------------------------------------------------------------------- the edge


@pytest.mark.parametrize("options,err,pattern", [
    ({"layer_pattern": "DX"}, ValueError, "layer_pattern must be a non-empty str of 'L' .*, got 'DX'"),
    ({"layer_pattern": "GG"}, ValueError, "at least one 'L' or 'D'"),
    ({"layer_pattern": "D"}, ValueError, "makes all num_layers = 4 layers gated delta layers"),
    ({"layer_pattern": "DDDG", "num_layers": 3}, ValueError, "makes all num_layers = 3 layers"),
    ({"layer_pattern": "DG", "kv_share": 2}, ValueError, "kv_share = 2 with gated delta layers"),
    ({"layer_pattern": "DG", "local_window": 3}, ValueError, "local_window=3 needs layer_pattern with an 'L'"),
    ({"layer_pattern": "DL"}, ValueError, "needs local_window"),
    ({"index_topk": 0}, ValueError, "index_topk must be an int >= 1"),
    ({"index_topk": 2.0}, TypeError, "index_topk must be an int"),
    ({"index_topk": 2, "index_heads": 0}, ValueError, "index_heads must be an int >= 1"),
    ({"index_topk": 2, "index_dim": "8"}, TypeError, "index_dim must be an int"),
    ({"index_dim": 8}, ValueError, "index_dim=8 needs index_topk"),
    ({"index_heads": 2}, ValueError, "index_heads=2 needs index_topk"),
    ({"index_topk": 2, "kv_share": 2}, ValueError, "index_topk = 2 with kv_share = 2"),
    ({"attention": "latent", "kv_latent_dim": 8, "rope_dim": 4, "num_kv_heads": None, "index_topk": 2},
     ValueError, "belong to attention='standard'"),
    ({"attention": "latent", "kv_latent_dim": 8, "rope_dim": 4, "num_kv_heads": None, "layer_pattern": "DG"},
     ValueError, "belong to attention='standard'"),
])
def test_the_options_are_checked_at_the_edge(options: dict, err: type, pattern: str) -> None:
    """A refused config names the field, the value and what was expected, and draws nothing (a build without a
    seed would take its weights from the global generator)."""
    config = {"vocab_size": V, "d_model": 32, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, **options}
    state = torch.random.get_rng_state()
    with pytest.raises(err, match=pattern):
        build_language_model(config)
    assert torch.equal(state, torch.random.get_rng_state())


def test_the_calls_are_checked_at_the_edge() -> None:
    plain, indexed, delta = (variant_model(o) for o in ({}, {"index_topk": 2}, {"layer_pattern": "DG"}))
    text = tokens(1, 4)
    with pytest.raises(ValueError, match="need_index_loss=True needs a model with an indexer"):
        plain(text, need_index_loss=True)
    with pytest.raises(ValueError, match="index_dense=True needs a model with an indexer"):
        delta(text, index_dense=True)
    with pytest.raises(TypeError, match="need_index_loss must be a bool"):
        indexed(text, need_index_loss=1)
    block_mask = create_block_mask(causal, None, None, 4, 4, BLOCK_SIZE=4)
    for model in (indexed, delta):
        with pytest.raises(ValueError, match="block_mask is for attention layers only"):
            model(text, block_mask=block_mask)
    cache = indexed.new_cache(window=3, sinks=1)
    with pytest.raises(ValueError, match="need_index_loss or index_dense with sinks"):
        indexed(tokens(1, 6), cache, need_index_loss=True)
    assert len(cache) == 0 and cache.seen == 0
    with pytest.raises(ValueError, match="keep must be a bool"):
        delta.blocks[0].attn.mixer(torch.zeros(1, 3, 32, dtype=torch.float64), keep=torch.ones(1, 3))


def test_the_options_travel_in_the_config() -> None:
    options = {"layer_pattern": "DLG", "local_window": 3, "index_topk": 2, "index_heads": 2, "index_dim": 8}
    model = build_language_model(LMConfig(vocab_size=V, d_model=32, num_layers=4, seed=3, **options))
    assert {k: model.config[k] for k in options} == options
    again = build_language_model(model.config)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def _m(name: str):
    import importlib
    return importlib.import_module("attention_core." + name)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: _m("models.indexed_attention").pack_heads(torch.zeros(1, 1, 2, 6), 0), ValueError,
     r"head_dim must be an int >= 1, got 0"),
    (lambda: _m("models.indexed_attention").pack_heads(torch.zeros(2, 6), 4), ValueError,
     r"x must be \(B, N, L, d\), got shape \(2, 6\)"),
    (lambda: _m("models.indexed_attention").pack_heads([[1.0]], 4), TypeError, r"x must be a torch.Tensor, got list"),
    (lambda: _m("models.indexed_attention").unpack_heads(torch.zeros(1, 3, 2, 4), 2, 6), ValueError,
     r"heads must be \(B, N m, L, E\) with N = 2 dividing dim 1, got shape \(1, 3, 2, 4\)"),
    (lambda: _m("models.indexed_attention").unpack_heads(torch.zeros(1, 2, 2, 4), 0, 6), ValueError,
     r"N must be an int >= 1, got 0"),
    (lambda: _m("models.indexed_attention").allowed_keys("bad", False, 1, 2, 2, "cpu"), TypeError,
     r"mask must be a torch.Tensor, got str"),
    (lambda: _m("models.attention_variants").local_decode_mask(1, 2, 2, "bad"), TypeError,
     r"cache must be a KVCache, got str"),
    (lambda: _m("models.attention_variants").local_decode_mask(1, 2, -3, "bad"), ValueError,
     r"local_window must be an int >= 1, got -3"),
    (lambda: _m("models.kv_cache").rotate_at("bad", torch.zeros(1, 1, 2, 4), torch.arange(2)), TypeError,
     r"rotary must be a RotaryEmbedding, got str"),
    (lambda: _m("models.kv_cache").rotate_at(_m("positional").RotaryEmbedding(4, 8), torch.zeros(1, 1, 2, 4), [0, 1]),
     TypeError, r"positions must be a torch.Tensor, got list"),
    (lambda: _m("models.rnn_attention").gaussian_window([1.0], 4, 2), TypeError, r"center must be a torch.Tensor"),
    (lambda: _m("models.rnn_attention").gaussian_window(torch.zeros(2), -4, 2), ValueError,
     r"S must be an int >= 0, got -4"),
    (lambda: _m("models.rnn_attention").gaussian_window(torch.zeros(2), 4, -2), ValueError,
     r"window must be an int >= 0, got -2"),
])
def test_indexed_and_variant_helpers_refuse_bad_arguments_by_name(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
