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
    s = q @ k.transpose(-2, -1) * (E ** -0.5 if scale is None else scale)
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
