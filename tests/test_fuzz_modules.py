"""The fuzz property of tests/test_fuzz.py extended to the newer modules: the language model and its cache,
sampling, latent attention, the vocabularies and checkpoints. Each call either answers (with the documented
shape and range) or raises ``ValueError``/``TypeError`` naming one of its arguments; anything else fails.

Profiles as in tests/test_fuzz.py (``fuzz`` in ``make test``, ``slow`` in ``make fuzz``); the example counts
are printed with ``--hypothesis-show-statistics``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_fuzz import FUZZ, ODD, answer, tensors

from attention_core.models import language_model as lm
from attention_core.models.latent_attention import LatentCache, MultiHeadLatentAttention
from attention_core.shakespeare.data import CharVocab
from attention_core.training.checkpoint import load_checkpoint, save_checkpoint
from attention_core.translation.data import Vocab

V = 9
MODEL = lm.build_language_model({"vocab_size": V, "d_model": 8, "num_layers": 2, "num_heads": 2,
                                 "max_positions": 12, "seed": 0}).eval()
MLA = MultiHeadLatentAttention(8, 2, 4, kv_latent_dim=4, rope_dim=2, max_positions=12).eval()
SMALL = settings(FUZZ, max_examples=max(50, FUZZ.max_examples // 3))  # each call runs a model


def mostly(usual, *odd):
    """``usual`` three times in four, else one of ``odd`` (``st.one_of`` would flatten ODD's many branches and
    draw from it far more often)."""
    return st.integers(0, 3).flatmap(lambda i: usual if i < 3 else st.one_of(*odd))


def token_tensors():
    ids = st.builds(lambda b, n, lo, hi, seed: torch.randint(lo, hi + 1, (b, n),
                                                             generator=torch.Generator().manual_seed(seed)),
                    st.integers(0, 3), st.integers(0, 14), st.sampled_from([0, 0, 0, -1]),
                    st.sampled_from([V - 1, V - 1, V - 1, 0, V]), st.integers(0, 2**31))
    return mostly(ids, tensors(max_rank=3, max_dim=4), ODD)


@st.composite
def caches(draw):
    kind = draw(st.sampled_from(["none", "fresh", "filled", "window", "odd"]))
    if kind == "none":
        return None
    if kind == "odd":
        return draw(ODD)
    cache = MODEL.new_cache(window=3) if kind == "window" else MODEL.new_cache()
    if kind == "filled":
        with torch.no_grad():
            MODEL(torch.zeros(draw(st.integers(1, 3)), draw(st.integers(1, 11)), dtype=torch.long), cache)
    return cache


def _state(cache):
    if not isinstance(cache, lm.KVCache):
        return None
    return [None if k is None else k.clone() for k in cache.keys], cache.seen


@SMALL
@given(tokens=token_tensors(), cache=caches(), need_weights=mostly(st.booleans(), ODD))
def test_language_model_forward(tokens, cache, need_weights):
    before = _state(cache)
    with torch.no_grad():
        out = answer(MODEL, tokens, cache, need_weights=need_weights,
                     names=["tokens", "cache", "need_weights", "vocab_size", "max_positions"])
    if out is None:
        after = _state(cache)
        assert before is None or (before[1] == after[1] and all(
            (a is None and b is None) or torch.equal(a, b) for a, b in zip(before[0], after[0]))), \
            "a refused call changed the cache"
        return
    B, L = tokens.shape
    assert out.logits.shape == (B, L, V) and out.logits.dtype == torch.float32
    assert torch.isfinite(out.logits).all()


VALID_LOGITS = st.builds(lambda b, v, seed, dt: (torch.randn(b, v, generator=torch.Generator().manual_seed(seed))
                                                 * 10).to(dt), st.integers(0, 3), st.integers(1, 6),
                        st.integers(0, 2**31), st.sampled_from([torch.float32, torch.float16, torch.float64]))


@settings(FUZZ)
@given(logits=mostly(VALID_LOGITS, tensors(max_rank=3, max_dim=5), ODD),
       temperature=mostly(st.sampled_from([0.0, 1.0, 0.7, 1e-30, 1e-300, 5e-45, 1e30]), ODD),
       top_k=mostly(st.none() | st.integers(1, 6), ODD), top_p=mostly(st.none() | st.floats(0.01, 1.0), ODD),
       seed=st.integers(0, 2**31))
def test_sample_next_token(logits, temperature, top_k, top_p, seed):
    got = answer(lm.sample_next_token, logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed),
                 names=["logits", "temperature", "top_k", "top_p", "generator"])
    if got is None:
        return
    B, Vl = logits.shape
    assert got.shape == (B,) and got.dtype == torch.int64
    assert ((got >= 0) & (got < Vl)).all()
    finite = logits.float() > -math.inf
    assert finite.gather(1, got[:, None]).all(), "a token whose logit is -inf was drawn"
    event("sampled" if temperature else "greedy")


@st.composite
def latent_caches(draw):
    kind = draw(st.sampled_from(["none", "fresh", "filled", "odd"]))
    if kind == "odd":
        return draw(ODD)
    if kind == "none":
        return None
    cache = LatentCache()
    if kind == "filled":
        with torch.no_grad():
            MLA(torch.zeros(draw(st.integers(1, 3)), draw(st.integers(1, 11)), 8), cache)
    return cache


@SMALL
@given(x=mostly(st.builds(lambda b, n, dt: torch.randn(b, n, 8).to(dt), st.integers(0, 3), st.integers(0, 13),
                          st.sampled_from([torch.float32, torch.float32, torch.float64, torch.float16])),
               tensors(shape=None, max_rank=4, max_dim=4), ODD),
       cache=latent_caches(), absorbed=mostly(st.booleans(), ODD))
def test_latent_attention_forward(x, cache, absorbed):
    before = (cache.latent, cache.rope_key) if isinstance(cache, LatentCache) else None
    with torch.no_grad():
        got = answer(MLA, x, cache, absorbed, names=["x", "cache", "absorbed", "need_weights", "max_positions"])
    if got is None:
        if before is not None:
            assert (cache.latent, cache.rope_key) == before, "a refused call changed the latent cache"
        return
    out, _ = got
    assert out.shape == x.shape and out.dtype == x.dtype


@settings(FUZZ)
@given(text=mostly(st.text(alphabet="abc \n!", max_size=20), st.text(max_size=5), ODD),
       ids=mostly(st.lists(st.integers(-1, 6), max_size=6).map(torch.tensor), tensors(max_rank=2), ODD))
def test_vocabularies(text, ids):
    vocab = CharVocab("abc \n!")
    encoded = answer(vocab.encode, text, names=["text"])
    if encoded is not None:
        assert vocab.decode(encoded) == text
    decoded = answer(vocab.decode, ids, names=["ids"])
    if decoded is not None:
        assert len(decoded) == torch.as_tensor(ids).numel()
    words = Vocab(["one", "two"])
    if isinstance(ids, torch.Tensor) and ids.device.type == "cpu" and not (ids.dtype.is_floating_point
                                                                          or ids.dtype.is_complex):
        out = words.decode(ids.flatten().tolist())  # unknown ids read as <unk>, never an IndexError
        assert all(isinstance(w, str) for w in out)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "m.pt"
    return path, save_checkpoint(MODEL, path)


@settings(FUZZ, max_examples=50)
@given(sha=mostly(st.just("right"), st.text(max_size=8), ODD))
def test_checkpoint_refuses_a_wrong_checksum(saved, sha):
    path, right = saved
    sha = right if sha == "right" else sha
    got = answer(load_checkpoint, path, sha, lm.build_language_model, names=["sha256", "path"])
    if got is not None:
        assert sha == right
        assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(), MODEL.state_dict().values()))


# ------------------------------------------------------------------------ paged attention and serving (issue 37)


@st.composite
def paged_calls(draw):
    """A valid paged call (random tables with padding entries pointing anywhere, NaN/inf in some slots, some of
    them stale), or one argument replaced by something odd."""
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    B, H, group, L = draw(st.integers(0, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(0, 3))
    E, bs, N = draw(st.integers(1, 5)), draw(st.sampled_from([1, 2, 4])), draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16]))
    width = draw(st.integers(1, 4))
    lens = torch.randint(L, max(L, width * bs) + 1, (B,), generator=g)
    table = torch.randint(0, N, (B, width), generator=g)
    kc = torch.randn(N, H, bs, E, generator=g).to(dtype)
    vc = torch.randn(N, H, bs, E + 1, generator=g).to(dtype)
    for t in (kc, vc):
        if draw(st.integers(0, 2)) == 0:
            t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    args = {"query": torch.randn(B, H * group, L, E, generator=g).to(dtype), "key_cache": kc, "value_cache": vc,
            "block_table": table, "seq_lens": lens, "scale": draw(st.none() | st.floats(0.1, 2.0)),
            "path": draw(st.sampled_from(["chunked", "gather"]))}
    if draw(st.integers(0, 3)) == 0:
        name = draw(st.sampled_from(sorted(args)))
        args[name] = draw(ODD | tensors(max_rank=4, max_dim=3))
    return args


@SMALL
@given(call=paged_calls())
def test_paged_attention(call):
    from attention_core.paged_attention import paged_attention

    out = answer(paged_attention, **call, names=["query", "key_cache", "value_cache", "block_table", "seq_lens",
                                                  "scale", "path"])
    if out is None:
        return
    q, v = call["query"], call["value_cache"]
    assert out.shape == (*q.shape[:3], v.shape[3]) and out.dtype == q.dtype
    other = paged_attention(**(call | {"path": "gather" if call["path"] == "chunked" else "chunked"}))
    assert torch.equal(torch.isfinite(out), torch.isfinite(other)), "the paths disagree on which rows are NaN"
    tol = 1e-12 if q.dtype == torch.float64 else (1e-5 if q.dtype == torch.float32 else 5e-3)
    fin = torch.isfinite(out)
    assert torch.allclose(out[fin].double(), other[fin].double(), atol=tol, rtol=tol)
    event(f"paged: {'some NaN rows' if not fin.all() else 'finite'}")


@settings(FUZZ)
@given(ops=st.lists(st.tuples(st.sampled_from(["allocate", "free", "fork", "refcount"]),
                              mostly(st.integers(-1, 4), ODD)), max_size=12))
def test_block_allocator(ops):
    from attention_core.serving.blocks import BlockAllocator, OutOfBlocks

    a = BlockAllocator(4)
    refs = [0] * 4
    for op, block in ops:
        if op == "allocate":
            try:
                b = a.allocate()
            except OutOfBlocks:
                assert 0 not in refs
                continue
            assert 0 <= b < 4 and refs[b] == 0
            refs[b] = 1
            continue
        before = list(refs)
        got = answer(getattr(a, op), block, names=["block"])
        if got is None and op != "free":
            assert [a.refcount(i) for i in range(4)] == before, "a refused call changed the counts"
            continue
        if op == "free" and not (isinstance(block, int) and not isinstance(block, bool) and 0 <= block < 4
                                 and refs[block] > 0):
            assert [a.refcount(i) for i in range(4)] == before, "a refused free changed the counts"
            continue
        if op == "fork":
            refs[block] += 1
        elif op == "free":
            refs[block] -= 1
        assert [a.refcount(i) for i in range(4)] == refs
    assert a.num_free == refs.count(0)


@settings(FUZZ)
@given(max_batch=mostly(st.integers(1, 3), ODD), fields=st.lists(st.tuples(
    mostly(st.integers(0, 3), ODD), mostly(st.integers(1, 3), ODD), mostly(st.integers(1, 3), ODD)), max_size=4),
       max_tokens=mostly(st.none() | st.integers(1, 20), ODD))
def test_schedulers(max_batch, fields, max_tokens):
    from test_scheduler import within

    from attention_core.serving.scheduler import Request, continuous_batching, static_batching

    reqs = [Request(i, *f) for i, f in enumerate(fields)]
    for fn, kw in ((static_batching, {}), (continuous_batching, {"max_tokens": max_tokens})):
        res = answer(lambda fn=fn, kw=kw: within(20, fn, reqs, max_batch, **kw),  # a hang fails, in a thread
                     names=["max_batch", "max_tokens", "requests"] + [
                         f"requests[{i}].{n}" for i in range(len(reqs)) for n in ("arrival", "prompt_len",
                                                                                  "output_len", "rid")])
        if res is not None:
            assert set(res.finish) == {r.rid for r in reqs}
            assert all(len(r) <= max_batch for r in res.running)


@settings(FUZZ)
@given(logits=mostly(st.builds(lambda n, v, s: torch.randn(n, v, generator=torch.Generator().manual_seed(s)),
                               st.integers(0, 3), st.integers(1, 5), st.integers(0, 99)),
                     tensors(max_rank=3, max_dim=4), ODD),
       temperature=mostly(st.sampled_from([0.0, 0.5, 1.0]), ODD))
def test_next_token_probs(logits, temperature):
    from attention_core.serving.speculative import next_token_probs

    p = answer(next_token_probs, logits, temperature, names=["logits", "temperature"])
    if p is not None and torch.isfinite(logits).all():
        assert p.shape == logits.shape and torch.allclose(p.sum(-1).double(), torch.ones(p.shape[:-1]).double(),
                                                          atol=1e-3)


# ------------------------------------------------------------------------------------------------ issue 37: the
# task models (ViT, CNN, captioner, classifier, hybrid LM), greedy captions, the filters and generation


from attention_core.models.captioner import Captioner, greedy_caption  # noqa: E402
from attention_core.models.classifier import build_classifier  # noqa: E402
from attention_core.models.cnn import SmallCNN  # noqa: E402
from attention_core.models.hybrid_lm import HybridLM  # noqa: E402
from attention_core.models.vit import VisionTransformer  # noqa: E402

VIT = VisionTransformer({"image_size": [4, 4], "patch_size": 2, "in_channels": 1, "num_classes": 3, "d_model": 8,
                         "num_layers": 1, "num_heads": 2, "dim_feedforward": 8, "pos": "learned", "pool": "cls"}).eval()
CNN = SmallCNN({"image_size": [4, 4], "in_channels": 1, "num_classes": 3, "channels": [2, 2]}).eval()
CAP = Captioner({"image_size": [4, 8], "patch_size": 4, "in_channels": 1, "vocab_size": 5, "max_len": 3,
                 "d_model": 8, "num_heads": 2, "dim_feedforward": 8, "encoder_layers": 1, "decoder_layers": 1}).eval()
CLF = build_classifier({"vocab_size": 6, "embed_dim": 4, "hidden_dim": 4})
HYB = HybridLM(6, ("softmax", "linear", "window"), d_model=8, num_heads=2, context=5, window=2).eval()


def image_tensors(shape):
    good = st.builds(lambda b, seed, dt: torch.rand(b, *shape, generator=torch.Generator().manual_seed(seed)).to(dt),
                     st.integers(0, 3), st.integers(0, 2**31),
                     st.sampled_from([torch.float32, torch.float32, torch.float64, torch.float16]))
    return mostly(good, tensors(max_rank=5, max_dim=4), ODD)


def id_tensors(vocab, max_len):
    ids = st.builds(lambda b, n, lo, hi, seed: torch.randint(lo, hi + 1, (b, n),
                                                             generator=torch.Generator().manual_seed(seed)),
                    st.integers(0, 3), st.integers(0, max_len + 1), st.sampled_from([0, 0, 0, -1]),
                    st.sampled_from([vocab - 1, vocab - 1, vocab]), st.integers(0, 2**31))
    return mostly(ids, tensors(max_rank=3, max_dim=4), ODD)


@SMALL
@given(images=image_tensors((1, 4, 4)), model=st.sampled_from(["vit", "cnn"]))
def test_image_classifiers(images, model):
    m = VIT if model == "vit" else CNN
    with torch.no_grad():
        out = answer(m, images, names=["images"])
    if out is None:
        return
    logits = out.logits if model == "vit" else out
    assert logits.shape == (images.shape[0], 3) and logits.dtype == images.dtype == torch.float32


@SMALL
@given(images=image_tensors((1, 4, 8)), tokens=id_tensors(5, 3), need_weights=mostly(st.booleans(), ODD))
def test_captioner_forward(images, tokens, need_weights):
    with torch.no_grad():
        out = answer(CAP, images, tokens, need_weights=need_weights, names=["images", "tokens", "need_weights"])
    if out is not None:
        assert out.logits.shape == (*tokens.shape, 5) and torch.isfinite(out.logits).all()


@SMALL
@given(images=image_tensors((1, 4, 8)), start=mostly(st.integers(0, 4), st.integers(-2, 7), ODD),
       length=mostly(st.integers(0, 3), st.integers(-2, 6), ODD))
def test_greedy_caption(images, start, length):
    CAP.train()
    got = answer(greedy_caption, CAP, images, start, length)
    assert all(m.training for m in CAP.modules()), "greedy_caption changed the model's mode"
    CAP.eval()
    if got is not None:
        words, cross = got
        assert words.shape == (images.shape[0], length) and ((words >= 0) & (words < 5)).all()
        assert cross.shape == (images.shape[0], length, 2)


@SMALL
@given(ids=id_tensors(6, 4), lens=mostly(st.builds(lambda b, n: torch.full((b,), n), st.integers(0, 3),
                                                   st.integers(1, 4)), tensors(max_rank=2, max_dim=4), ODD))
def test_sentence_classifier(ids, lens):
    with torch.no_grad():
        out = answer(CLF, ids, lens, names=["ids", "valid_lens"])
    if out is not None:
        assert out.logits.shape == (ids.shape[0], 2) and torch.isfinite(out.logits).all()


@SMALL
@given(tokens=id_tensors(6, 5))
def test_hybrid_language_model(tokens):
    with torch.no_grad():
        out = answer(HYB, tokens, names=["tokens"])
    if out is not None:
        assert out.shape == (*tokens.shape, 6) and torch.isfinite(out).all()


@settings(FUZZ)
@given(logits=mostly(VALID_LOGITS, tensors(max_rank=3, max_dim=5), ODD),
       k=mostly(st.integers(1, 8), st.integers(-2, 0), ODD), p=mostly(st.floats(0.01, 1.0), ODD))
def test_filters(logits, k, p):
    for fn, arg, name in ((lm.filter_top_k, k, "top_k"), (lm.filter_top_p, p, "top_p")):
        got = answer(fn, logits, arg, names=["logits", name])
        if got is None:
            continue
        assert got.shape == logits.shape and got.dtype == logits.dtype
        kept = got > -math.inf
        assert torch.equal(got[kept], logits[kept])  # what is kept is unchanged
        assert (kept | (logits == -math.inf)).any(-1).all() or logits.shape[-1] == 0


@SMALL
@given(prompt=token_tensors(), n=mostly(st.integers(0, 3), ODD),
       temperature=mostly(st.sampled_from([0.0, 0.8, 1e-30]), ODD), top_k=mostly(st.none() | st.integers(1, 9), ODD),
       generator=mostly(st.none(), ODD))
def test_generate(prompt, n, temperature, top_k, generator):
    MODEL.train()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    got = answer(lm.generate, MODEL, prompt, n, temperature, top_k, None, generator,
                 names=["prompt", "tokens", "max_new_tokens", "temperature", "top_k", "generator", "max_positions"])
    assert all(m.training for m in MODEL.modules()), "generate changed the model's mode"
    MODEL.eval()
    if got is None or temperature == 0 or top_k == 1:
        assert torch.equal(torch.get_rng_state(), before), "a refused or greedy call touched the global RNG"
    if got is not None:
        assert got.shape == (prompt.shape[0], prompt.shape[1] + n) and torch.equal(got[:, : prompt.shape[1]], prompt)


# ------------------------------------------------------------------------------ flex and linear attention (issue 37)
# Each call answers (shape, dtype, and the values of a float64 dense oracle under the non-finite policy: NaN exactly
# in the rows that read a bad query, key or value, never in another) or raises an error naming its argument.

import numpy as np  # noqa: E402

from attention_core import linear_attention as la  # noqa: E402
from attention_core import mask_mods as mm  # noqa: E402
from attention_core.flex_attention import create_block_mask, flex_attention  # noqa: E402
from attention_core.mask_mods import dense_mask  # noqa: E402

FLEX_NAMES = ["query", "key", "value", "score_mod", "block_mask", "scale", "enable_gqa", "backend", "mask_mod",
              "slopes", "table", "document_ids"]
FLEX_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def _with_specials(t: torch.Tensor, draw) -> torch.Tensor:
    if t.numel() and draw(st.integers(0, 3)) == 3:
        t = t.clone()
        for _ in range(draw(st.integers(1, 2))):
            t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    return t


def _flex_oracle(q, k, v, score_mod, mask_mod, scale):
    """float64 dense attention under the policy, written from the definition (GQA repeated here)."""
    B, Hq, L, E = q.shape
    H, S = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(Hq // H, 1), v.repeat_interleave(Hq // H, 1)
    keep = dense_mask(mask_mod, B, Hq, L, S)
    bad_q = ~q.isfinite().all(-1)  # (B, Hq, L)
    bad_kv = ~(k.isfinite().all(-1) & v.isfinite().all(-1))  # (B, Hq, S)
    poison = (bad_q & keep.any(-1)) | (keep & bad_kv[:, :, None, :]).any(-1)
    q, k, v = (t.double().nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v))
    s = q @ k.transpose(-2, -1) * (E ** -0.5 if scale is None else float(scale))
    if score_mod is not None:
        s = mm.dense_scores(score_mod, s)
    s = s.masked_fill(~keep, -math.inf)
    if S == 0:  # no key: every row reads nothing, zeros
        return torch.zeros(B, Hq, L, v.shape[-1], dtype=torch.float64).numpy()
    m = s.amax(-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0).clamp_min(-1e300)
    p = (s - m).exp()
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    return (p @ v).masked_fill(poison[..., None], math.nan).numpy()


@st.composite
def flex_calls(draw):
    B, Hk, G, L, S = (draw(st.integers(lo, hi)) for lo, hi in ((0, 2), (1, 2), (1, 2), (0, 20), (0, 20)))
    E = draw(st.sampled_from([1, 4, 8]))
    Hq = Hk * G
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    q, k, v = (_with_specials(torch.randn(B, h, n, E, generator=g, dtype=torch.float64).to(dtype), draw)
               for h, n in ((Hq, L), (Hk, S), (Hk, S)))
    heads = draw(st.sampled_from([Hq, Hq, 1]))  # a captured tensor for fewer heads: refused
    score_mod = draw(st.sampled_from([None, mm.alibi(mm.alibi_slopes(heads)), mm.soft_cap(3.0),
                                      mm.relative_position_bias(torch.randn(heads, 5, generator=g), 2)]))
    mask_mod = draw(st.sampled_from([mm.noop_mask, mm.causal, mm.sliding_window(4), mm.prefix_lm(3),
                                     mm.causal_bottom_right(L, S), mm.document(torch.arange(25) // 7),
                                     mm.and_masks(mm.causal, mm.document(torch.arange(25) // 6))]))
    block = draw(st.sampled_from([4, 8, (4, 8), 16]))
    block_mask = draw(mostly(st.just("made"), st.none(), ODD, st.just("other_shape")))
    if block_mask == "made":
        block_mask = create_block_mask(mask_mod, draw(st.sampled_from([None, B or None])), None, L, S, BLOCK_SIZE=block)
    elif block_mask == "other_shape":
        block_mask = create_block_mask(mask_mod, None, None, L + 1, S, BLOCK_SIZE=block)
    kw = {"score_mod": score_mod, "block_mask": block_mask, "scale": draw(mostly(st.none() | st.floats(-2, 2), ODD)),
          "enable_gqa": draw(mostly(st.just(G > 1) | st.booleans(), ODD)),
          "backend": draw(mostly(st.sampled_from(["chunked", "reference"]), ODD))}
    args = [q, k, v]
    if draw(st.integers(0, 9)) == 9:  # an odd tensor in one place
        args[draw(st.integers(0, 2))] = draw(tensors(max_rank=5, max_dim=3))
    return args, kw


@settings(FUZZ, max_examples=max(30, FUZZ.max_examples // 3), deadline=None)
@given(call=flex_calls())
def test_flex_attention(call):
    (q, k, v), kw = call
    out = answer(flex_attention, q, k, v, names=FLEX_NAMES, **kw)
    if out is None:
        return
    assert out.shape == (*q.shape[:3], v.shape[-1]) and out.dtype == q.dtype and out.device == q.device
    if q.device.type == "meta" or q.numel() == 0 or out.numel() == 0:
        return
    if kw["scale"] is not None and abs(float(kw["scale"])) > 4:
        # as for the core (tests/test_fuzz.py, judged inputs): scores that overflow the compute dtype are outside
        # the non-finite policy, and a huge scale makes the softmax ill-conditioned; such a call must only answer
        # (shape, dtype and device checked above) or refuse clearly
        event("flex: a scale past 4, not compared")
        return
    bm = kw["block_mask"]
    want = _flex_oracle(q, k, v, kw["score_mod"], mm.noop_mask if bm is None else bm.mask_mod, kw["scale"])
    got = out.detach().double().numpy()
    assert np.array_equal(np.isnan(got).any(-1), np.isnan(want).any(-1)), "NaN in other rows than the policy's"
    rows = ~np.isnan(want).any(-1)
    np.testing.assert_allclose(got[rows], want[rows], atol=FLEX_TOL[q.dtype], rtol=FLEX_TOL[q.dtype])
    event("flex: compared" + (", with NaN rows" if not rows.all() else ""))


LINEAR_FNS = {"parallel": la.linear_attention, "chunked": la.linear_attention_chunked,
              "recurrent": lambda *a, **kw: la.linear_attention_recurrent(*a, **kw)[0]}


@settings(FUZZ, deadline=None)
@given(form=st.sampled_from(sorted(LINEAR_FNS)), shape=st.tuples(st.integers(0, 2), st.integers(0, 9),
                                                                   st.integers(0, 4)),
       dtype=st.sampled_from([torch.float64, torch.float32]), seed=st.integers(0, 2**31), data=st.data())
def test_linear_attention_forms_agree_and_keep_nan_in_the_rows_that_read_it(form, shape, dtype, seed, data):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (_with_specials(torch.randn(shape, generator=g, dtype=dtype), data.draw) for _ in range(3))
    kw = {"feature_map": data.draw(mostly(st.sampled_from(["elu", "relu"]), ODD))}
    if form == "chunked":
        kw["chunk_size"] = data.draw(mostly(st.integers(1, 5), ODD))
    else:
        kw["is_causal"] = True
    out = answer(LINEAR_FNS[form], q, k, v, names=["query", "key", "value", "feature_map", "chunk_size",
                                                   "is_causal"], **kw)
    if out is None:
        return
    assert out.shape == (*shape[:2], shape[2]) and out.dtype == dtype
    ref = la.linear_attention_recurrent(q, k, v, feature_map=kw["feature_map"])[0]
    bad = ~ref.isfinite().all(-1)
    assert torch.equal(~out.isfinite().all(-1), bad), "non-finite rows differ from the recurrent form's"
    torch.testing.assert_close(out[~bad], ref[~bad], atol=1e-4, rtol=1e-4)


@settings(FUZZ, deadline=None)
@given(L=mostly(st.integers(1, 12), ODD), stride=mostly(st.integers(1, 5), ODD), block=mostly(st.integers(1, 8), ODD),
       kind=st.sampled_from(["strided", "fixed", "longformer"]), causal=mostly(st.booleans(), ODD))
def test_sparse_patterns_dense_equals_mod(L, stride, block, kind, causal):
    from attention_core import sparse_patterns as sp

    names = ["L", "stride", "block", "window", "causal", "summary", "global_tokens", "max_len"]
    dense, mod = sp.PATTERNS[kind]
    arg = stride if kind != "longformer" else block
    mask = answer(dense, L, arg, causal=causal, names=names)
    if mask is None:
        return
    assert mask.shape == (L, L) and mask.dtype == torch.bool
    assert torch.equal(mask, sp.dense_from_mod(mod(arg, causal=causal), L))
    tiles = answer(sp.tiles_visited, mask, block, stride, names=["mask", "block_q", "block_k"])
    assert tiles is None or 0 <= tiles <= -(-L // block) * -(-L // stride)


@settings(FUZZ, deadline=None)
@given(bandwidth=mostly(st.sampled_from([1e-30, 1e-45, 5e-324, 1e-200, 1e30, 1e300, 0.3, 2.0]), ODD),
       kernel=mostly(st.sampled_from(["gaussian", "boxcar", "epanechnikov"]), ODD),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.float16]), seed=st.integers(0, 2**31))
def test_nadaraya_watson_gives_convex_combinations_at_any_bandwidth(bandwidth, kernel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in (5, 7))
    v = (1 + torch.rand(7, generator=g, dtype=torch.float64)).to(dtype)  # in [1, 2]: a 0 is outside
    out = answer(ac_nadaraya_watson(), q, k, v, kernel, bandwidth, names=["queries", "keys", "values", "kernel",
                                                                        "bandwidth"])
    if out is None:
        return
    assert out.shape == (5,) and out.dtype == dtype and out.isfinite().all()
    lo, hi = float(v.min()), float(v.max())
    slack = 1e-2 if dtype == torch.float16 else 1e-9
    inside = (out >= lo - slack) & (out <= hi + slack)
    if kernel == "gaussian":  # positive everywhere: every query reads its nearest keys at least (the h -> 0 limit)
        assert inside.all(), "not a convex combination of the values"
    else:  # compact support: a query with no key within h gives 0
        assert ((out == 0) | inside).all(), "not a convex combination (nor 0)"


def ac_nadaraya_watson():
    import attention_core as ac

    return ac.nadaraya_watson
