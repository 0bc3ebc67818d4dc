"""Paged attention equals attention over a contiguous cache (fp32, <= 1e-6), for random block tables, shared
prefixes after a copy-on-write, GQA and several query tokens; the Triton kernel under the interpreter too."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import attention_core as ac
from attention_core._checks import TooLargeError
from attention_core.paged_attention import gather_paged_kv, paged_attention
from attention_core.serving.blocks import PagedKVCache

ROOT = Path(__file__).resolve().parent.parent


def _random_paged(seed: int, B: int, Hq: int, H: int, L: int, E: int, bs: int, n_blocks: int = 64):
    """Random contiguous K/V per sequence, scattered into random distinct blocks; returns both views."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(L, 6 * bs, (B,), generator=g)
    kc = torch.randn(n_blocks, H, bs, E, generator=g)
    vc = torch.randn(n_blocks, H, bs, E, generator=g)
    perm = torch.randperm(n_blocks, generator=g).tolist()
    width = int(-(-lens.max() // bs))
    table = torch.full((B, width), 10**6, dtype=torch.long)  # unused entries hold garbage ids on purpose
    ks, vs = [], []
    for b in range(B):
        n = int(-(-lens[b] // bs))
        ids = [perm.pop() for _ in range(n)]
        table[b, :n] = torch.tensor(ids)
        ks.append(gather_paged_kv(kc, table[b], int(lens[b])))
        vs.append(gather_paged_kv(vc, table[b], int(lens[b])))
    q = torch.randn(B, Hq, L, E, generator=g)
    return q, kc, vc, table, lens, ks, vs


def _contiguous(q, ks, vs, lens):
    outs = []
    for b in range(q.shape[0]):
        S, L = int(lens[b]), q.shape[2]
        mask = torch.ones(L, S, dtype=torch.bool).tril(S - L)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[b : b + 1].double(), ks[b][None].double(), vs[b][None].double(), mask,
            enable_gqa=q.shape[1] != ks[b].shape[0])[0])
    return torch.stack(outs)


@pytest.mark.parametrize("path", ["gather", "chunked"])
@pytest.mark.parametrize("seed,B,Hq,H,L,E,bs", [(0, 3, 2, 2, 1, 16, 4), (1, 4, 4, 2, 1, 8, 16),
                                                 (2, 2, 2, 1, 5, 16, 8), (3, 5, 1, 1, 3, 32, 1)])
def test_paged_equals_contiguous(path, seed, B, Hq, H, L, E, bs) -> None:
    q, kc, vc, table, lens, ks, vs = _random_paged(seed, B, Hq, H, L, E, bs)
    out = paged_attention(q, kc, vc, table, lens, path=path)
    assert (out.double() - _contiguous(q, ks, vs, lens)).abs().max() <= 1e-6


def test_shared_prefix_after_copy_on_write() -> None:
    """Two sequences forked from one prompt share its blocks until one writes into the shared last block."""
    g = torch.Generator().manual_seed(5)
    H, E, bs = 2, 8, 4
    cache = PagedKVCache(1, 32, bs, H, E)
    cache.add_sequence(0)
    prompt_k, prompt_v = torch.randn(H, 6, E, generator=g), torch.randn(H, 6, E, generator=g)
    cache.write(0, 0, cache.reserve(0, 6), prompt_k, prompt_v)  # blocks: [full, half]
    cache.fork(0, 1)
    assert cache.tables[0] == cache.tables[1]
    tails = {}
    for s in (0, 1):
        k, v = torch.randn(H, 3, E, generator=g), torch.randn(H, 3, E, generator=g)
        cache.write(0, s, cache.reserve(s, 3), k, v)
        tails[s] = (torch.cat([prompt_k, k], 1), torch.cat([prompt_v, v], 1))
    assert cache.tables[0][0] == cache.tables[1][0]  # the full prompt block is still shared
    assert cache.tables[0][1] != cache.tables[1][1]  # the half-filled one was copied on write
    assert cache.allocator.refcount(cache.tables[0][0]) == 2
    table, lens = cache.block_table([0, 1])
    q = torch.randn(2, H, 1, E, generator=g)
    ref = _contiguous(q, [tails[0][0], tails[1][0]], [tails[0][1], tails[1][1]], lens)
    for path in ("gather", "chunked"):
        out = paged_attention(q, cache.keys[0], cache.values[0], table, lens, path=path)
        assert (out.double() - ref).abs().max() <= 1e-6


def test_paged_forward_equals_the_model() -> None:
    """The batched paged engine gives the model's own logits for sequences at different positions."""
    from attention_core.models.language_model import build_language_model
    from attention_core.serving.engine import new_paged_cache, paged_forward

    model = build_language_model({"vocab_size": 11, "d_model": 32, "num_layers": 2, "num_heads": 4,
                                  "num_kv_heads": 2, "dim_feedforward": 64, "context": 64, "seed": 0}).eval()
    g = torch.Generator().manual_seed(0)
    texts = [torch.randint(0, 11, (n,), generator=g) for n in (7, 12, 3)]
    cache = new_paged_cache(model, 32, block_size=4)
    for i, t in enumerate(texts):
        cache.add_sequence(i)
        paged_forward(model, cache, [i], t[None, :-1])
    logits = paged_forward(model, cache, [0, 1, 2], torch.stack([t[-1:] for t in texts]))[:, -1]
    with torch.no_grad():
        ref = torch.stack([model(t[None]).logits[0, -1] for t in texts])
    assert (logits - ref).abs().max() <= 1e-5


def test_errors_name_the_argument() -> None:
    q, kc, vc, table, lens, *_ = _random_paged(0, 2, 2, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_attention(q, kc, vc, table, lens * 0)
    with pytest.raises(ValueError, match="path"):
        paged_attention(q, kc, vc, table, lens, path="nope")
    with pytest.raises(ValueError, match="block_table"):
        paged_attention(q, kc, vc, table[:1], lens)


_TRITON_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_paged_attention import _random_paged, _contiguous
    from attention_core.paged_attention import paged_attention
    errs = {}
    for seed, B, Hq, H, L, E, bs in [(0, 2, 2, 2, 1, 16, 16), (1, 3, 4, 2, 1, 24, 4), (2, 2, 2, 1, 3, 16, 8)]:
        q, kc, vc, table, lens, ks, vs = _random_paged(seed, B, Hq, H, L, E, bs)
        out = paged_attention(q, kc, vc, table, lens, path="triton")
        errs[str(seed)] = float((out.double() - _contiguous(q, ks, vs, lens)).abs().max())
        # float64 stays float64 (the kernel computes in it)
        q64, kc64, vc64 = q.double(), kc.double(), vc.double()
        out64 = paged_attention(q64, kc64, vc64, table, lens, path="triton")
        assert out64.dtype == torch.float64
        errs[str(seed) + " float64 / 1e6"] = float((out64 - _contiguous(q, ks, vs, lens)).abs().max()) * 1e6
    from test_paged_attention import _poisoned_pool
    q, kc, vc, table, lens = _poisoned_pool()
    out = paged_attention(q, kc, vc, table, lens, path="triton")
    ref = paged_attention(q, kc, vc, table, lens, path="gather")
    errs["poisoned pool"] = float((out - ref).abs().max()) if bool(torch.isfinite(out).all()) else 1.0
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[1, :, 3], vc2[1, :, 3] = float("inf"), float("nan")
    q2 = torch.randn(1, 2, 2, 16, dtype=torch.float64)
    o2 = paged_attention(q2, kc2, vc2, torch.tensor([[1]]), torch.tensor([4]), path="triton")
    r2 = paged_attention(q2, kc2, vc2, torch.tensor([[1]]), torch.tensor([4]), path="gather")
    same = bool(torch.equal(torch.isfinite(o2), torch.isfinite(r2))) and bool(torch.isnan(o2[:, :, 1]).all())
    errs["nan policy"] = float((o2[:, :, 0] - r2[:, :, 0]).abs().max()) if same else 1.0
    print(json.dumps(errs))
""")


def test_triton_paged_kernel_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT, str(ROOT / "tests")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert max(errs.values()) <= 1e-6, errs


def test_contiguous_reference_is_the_library_sdpa() -> None:
    q, kc, vc, table, lens, ks, vs = _random_paged(9, 1, 2, 2, 2, 8, 4)
    S = int(lens[0])
    mask = torch.ones(2, S, dtype=torch.bool).tril(S - 2)
    lib = ac.scaled_dot_product_attention(q.double(), ks[0][None].double(), vs[0][None].double(), mask)
    assert (lib - _contiguous(q, ks, vs, lens)).abs().max() <= 1e-12


def test_the_model_runs_on_a_paged_sequence_cache() -> None:
    """DecoderLM with a PagedSequenceCache (prefill, then decode; a fork after the prompt) gives the logits of a
    full recomputation."""
    from attention_core.models.language_model import build_language_model

    model = build_language_model({"vocab_size": 11, "d_model": 32, "num_layers": 2, "num_heads": 4,
                                  "num_kv_heads": 2, "dim_feedforward": 64, "context": 64, "seed": 1}).eval()
    attn = model.blocks[0].attn
    pool = PagedKVCache(2, 16, 4, attn.num_kv_heads, attn.head_dim)
    pool.add_sequence(0)
    text = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    with torch.no_grad():
        model(text[:, :5], pool.sequence_view(0))
        pool.fork(0, 1)  # both continue the 5-token prompt, differently
        a = model(text[:, 5:], pool.sequence_view(0)).logits[0, -1]
        b = model(torch.tensor([[7]]), pool.sequence_view(1)).logits[0, -1]
        ref_a = model(text).logits[0, -1]
        ref_b = model(torch.cat([text[:, :5], torch.tensor([[7]])], 1)).logits[0, -1]
    assert (a - ref_a).abs().max() <= 1e-5 and (b - ref_b).abs().max() <= 1e-5
    assert pool.lengths == {0: 7, 1: 6} and pool.tables[0][0] == pool.tables[1][0]


# ------------------------------------------------------------------------ issue 37: the core's standard


def _poisoned_pool(dtype=torch.float64):
    """Two sequences whose pools hold inf/NaN only where they must not be read: sequence 0 (2 tokens in block 0)
    has stale slots 2, 3 of inf keys and NaN values, and its padding table entry points at block 0; sequence 1
    (5 tokens, blocks 1 and 2) has NaN keys and inf values in the stale slots of block 2."""
    g = torch.Generator().manual_seed(0)
    H, E, bs = 2, 16, 4
    kc = torch.randn(8, H, bs, E, generator=g, dtype=dtype)
    vc = torch.randn(8, H, bs, E, generator=g, dtype=dtype)
    kc[0, :, 2:], vc[0, :, 2:] = math.inf, math.nan
    kc[2, :, 1:], vc[2, :, 1:] = math.nan, math.inf
    table, lens = torch.tensor([[0, 0], [1, 2]]), torch.tensor([2, 5])
    q = torch.randn(2, H, 1, E, generator=g, dtype=dtype)
    return q, kc, vc, table, lens


@pytest.mark.parametrize("path", ["gather", "chunked"])
def test_stale_and_padding_slots_never_poison_another_sequence(path) -> None:
    q, kc, vc, table, lens = _poisoned_pool()
    out = paged_attention(q, kc, vc, table, lens, path=path)
    assert torch.isfinite(out).all(), f"{path}: a stale slot or a padding entry reached an output"
    clean_k, clean_v = kc.nan_to_num(0.0, 0.0, 0.0), vc.nan_to_num(0.0, 0.0, 0.0)
    ref = paged_attention(q, clean_k, clean_v, table, lens, path="gather")  # stale slots never read anyway
    assert (out - ref).abs().max() <= 1e-12


@pytest.mark.parametrize("path", ["gather", "chunked"])
def test_a_later_tokens_nan_never_reaches_an_earlier_query(path) -> None:
    """L = 2 queries over 4 tokens: the last token's NaN value and inf key are read by the last query only (its
    row is NaN, the core's policy); the first query's row is finite and equal on every path."""
    q, kc, vc, _, _ = _poisoned_pool()
    kc, vc = kc.clone(), vc.clone()
    kc[1, :, 3], vc[1, :, 3] = math.inf, math.nan
    q2 = torch.randn(1, 2, 2, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    table, lens = torch.tensor([[1]]), torch.tensor([4])
    out = paged_attention(q2, kc, vc, table, lens, path=path)
    assert torch.isfinite(out[:, :, 0]).all() and torch.isnan(out[:, :, 1]).all()
    ref = paged_attention(q2[:, :, :1], kc, vc, table, lens - 1, path="gather")  # the first query, alone
    assert (out[:, :, :1] - ref).abs().max() <= 1e-12


@pytest.mark.parametrize("path", ["gather", "chunked"])
def test_float64_is_computed_in_float64(path) -> None:
    q, kc, vc, table, lens, ks, vs = _random_paged(4, 3, 4, 2, 2, 16, 4)
    q, kc, vc = q.double() * 3, kc.double(), vc.double()
    ks, vs = [k.double() for k in ks], [v.double() for v in vs]
    out = paged_attention(q, kc, vc, table, lens, path=path)
    assert out.dtype == torch.float64
    assert (out - _contiguous(q, ks, vs, lens)).abs().max() <= 1e-12  # float32 arithmetic errs by ~1e-7


def test_strided_and_broadcast_inputs_equal_contiguous_ones() -> None:
    q, kc, vc, table, lens, ks, vs = _random_paged(6, 2, 2, 2, 1, 8, 4)
    want = paged_attention(q, kc, vc, table, lens)
    kt = kc.transpose(2, 3).contiguous().transpose(2, 3)  # same values, other strides
    for path in ("gather", "chunked"):
        assert torch.allclose(paged_attention(q, kt, vc, table, lens, path=path), want, atol=1e-6)
        assert torch.allclose(paged_attention(q, kc, vc, table.t().contiguous().t(), lens.int(), path=path), want,
                              atol=1e-6)
    one = kc[:1].expand(64, -1, -1, -1)  # stride 0: every block is block 0
    out = paged_attention(q, one, one, table, lens)
    assert torch.allclose(out, paged_attention(q, one.contiguous(), one.contiguous(), table, lens, path="gather"),
                          atol=1e-6)


def test_errors_name_the_argument_and_refuse_before_work() -> None:
    q, kc, vc, table, lens, *_ = _random_paged(0, 2, 2, 2, 1, 8, 4)
    cases = [
        (TypeError, "key_cache", dict(key_cache=kc.double())),
        (TypeError, "query", dict(query=q.long())),
        (TypeError, "block_table", dict(block_table=table.float())),
        (TypeError, "seq_lens", dict(seq_lens=lens.float())),
        (ValueError, "meta", dict(query=q.to("meta"), key_cache=kc.to("meta"), value_cache=vc.to("meta"),
                                  block_table=table.to("meta"), seq_lens=lens.to("meta"))),
        (ValueError, "block_table", dict(block_table=table.to("meta"))),
        (ValueError, "E >= 1", dict(query=q[..., :0], key_cache=kc[..., :0])),
        (ValueError, "H >= 1", dict(query=q[:, :0], key_cache=kc[:, :0], value_cache=vc[:, :0])),
        (ValueError, "block_size", dict(key_cache=kc[:, :, :0], value_cache=vc[:, :, :0])),
        (ValueError, "scale", dict(scale=math.nan)),
        (TypeError, "scale", dict(scale="1")),
        (ValueError, "path", dict(path=None)),
        (ValueError, "block_table", dict(block_table=torch.full_like(table, -1))),
    ]
    for error, words, change in cases:
        args = dict(query=q, key_cache=kc, value_cache=vc, block_table=table, seq_lens=lens) | change
        with pytest.raises(error, match=words):
            paged_attention(**args)
    # a stride-0 block table that claims 2**40 tokens is refused before anything the size of it is allocated
    huge = torch.zeros(1, 1, dtype=torch.long).expand(1, 2**40)
    with pytest.raises(TooLargeError, match="seq_lens"):
        paged_attention(q[:1], kc, vc, huge, torch.tensor([2**40 * 4]))


def test_empty_batches_and_zero_queries_give_empty_outputs() -> None:
    q, kc, vc, table, lens, *_ = _random_paged(0, 2, 2, 2, 1, 8, 4)
    for path in ("gather", "chunked"):
        assert paged_attention(q[:0], kc, vc, table[:0], lens[:0], path=path).shape == (0, 2, 1, 8)
        assert paged_attention(q[:, :, :0], kc, vc, table, lens, path=path).shape == (2, 2, 0, 8)


def test_paged_forward_refuses_before_reserving() -> None:
    """A bad token (or a wrong batch, a position past the model) leaves every sequence's length and table as
    they were: the check runs before any block is reserved."""
    from attention_core.models.language_model import build_language_model
    from attention_core.serving.engine import new_paged_cache, paged_forward

    model = build_language_model({"vocab_size": 11, "d_model": 16, "num_layers": 2, "num_heads": 2,
                                  "max_positions": 12, "seed": 0}).eval()
    cache = new_paged_cache(model, 8, block_size=4)
    cache.add_sequence(0), cache.add_sequence(1)
    paged_forward(model, cache, [0], torch.tensor([[1, 2, 3]]))
    before = ({s: list(t) for s, t in cache.tables.items()}, dict(cache.lengths), cache.allocator.num_free)
    bad = [(ValueError, "tokens", [0, 1], torch.tensor([[1, 2], [3, 11]])),
           (ValueError, "tokens", [0, 1], torch.tensor([[1, 2]])),
           (ValueError, "max_positions", [0], torch.ones(1, 10, dtype=torch.long)),
           (ValueError, "seqs", [0, 0], torch.ones(2, 1, dtype=torch.long)),
           (ValueError, "seqs", [7], torch.ones(1, 1, dtype=torch.long)),
           (TypeError, "model", [0], torch.ones(1, 1, dtype=torch.long))]
    for error, words, seqs, tokens in bad:
        with pytest.raises(error, match=words):
            paged_forward(model if words != "model" else None, cache, seqs, tokens)
        assert ({s: list(t) for s, t in cache.tables.items()}, dict(cache.lengths),
                cache.allocator.num_free) == before, f"a refused call ({words}) changed the cache"
    with pytest.raises(ValueError, match="path"):  # refused after reserving: rolled back
        paged_forward(model, cache, [0, 1], torch.ones(2, 1, dtype=torch.long), path="nope")
    assert ({s: list(t) for s, t in cache.tables.items()}, dict(cache.lengths), cache.allocator.num_free) == before
