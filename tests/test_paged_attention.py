"""Paged attention equals attention over a contiguous cache (fp32, <= 1e-6), for random block tables, shared
prefixes after a copy-on-write, GQA and several query tokens; the Triton kernel under the interpreter too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import attention_core as ac
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
