"""How the chunked flex backend plans its work, and that every shortcut of the plan leaves the answer alone.

- the predicate's verdicts are computed once per block mask and shape, on partial tiles only, and reused by the
  next calls (forward and backward);
- columns of a partial tile that no query keeps are dropped and columns that every query keeps need no mask
  (the sinks of a window), so a window's sinks tile costs 4 columns, not 128;
- neighbouring query tiles whose key tiles mostly coincide (causal) are merged into one block, the pairs one of
  them does not read masked; a window's are not;
- past the memory budget for verdicts, the loops evaluate the predicate again and the answer is the same.
"""

from __future__ import annotations

import pytest
import torch

import attention_core.mask_mods as mm
from attention_core.backends import chunked_flex
from attention_core.flex_attention import create_block_mask, flex_attention

E = 8


def _qkv(B, H, L, S, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, E, generator=g, dtype=torch.float64) for n in (L, S, S))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _both(q, k, v, bm, **kw):
    """chunked and reference outputs and gradients."""
    results = []
    for backend in ("chunked", "reference"):
        out = flex_attention(q, k, v, block_mask=bm, backend=backend, **kw)
        weight = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view(out.shape)
        results.append((out, torch.autograd.grad((out * weight).sum(), [q, k, v])))
    return results


def _assert_same(results):
    (out, grads), (ref, ref_grads) = results
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def _plan(bm, B, H, L, S):
    return chunked_flex._plan_for(bm, B, H, L, S, chunked_flex.CHUNK_KEYS, torch.device("cpu"),
                                  chunked_flex.MAX_ROWS)


def _blocks(plan):
    return plan.groups[0][3]  # [(r0, r1, chunks)]


def test_causal_neighbours_are_merged_and_the_answer_is_the_same():
    L = 700  # ragged against 64-tiles
    bm = create_block_mask(mm.causal, None, None, L, L, BLOCK_SIZE=64)
    blocks = _blocks(_plan(bm, 2, 3, L, L))
    assert max(r1 - r0 for r0, r1, _ in blocks) == 256  # four 64-row tiles in one block, far from the start
    assert blocks[-1][1] == L and all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))  # every row, once
    _assert_same(_both(*_qkv(2, 3, L, L), bm))


def test_a_window_is_not_merged_and_its_sinks_cost_their_own_columns():
    L, sinks, window = 1024, 4, 256
    bm = create_block_mask(mm.sinks_and_window(sinks, window), None, None, L, L)  # 128-tiles
    blocks = _blocks(_plan(bm, 1, 2, L, L))
    assert all(r1 - r0 == 128 for r0, r1, _ in blocks if r0 >= 2 * window)  # past the start: one tile a block
    # a query tile far from the start reads the 4 sinks, not the 128 keys of the sinks' tile, and its window's
    # 3 tiles less the one key no query of the tile reaches (384 - 1); the sinks, the middle tile and the one
    # diagonal key every query of the tile reads need no mask, the other 255 columns do
    last = blocks[-1][2]
    assert [c.width for c in last] == [sinks + 384 - 1]
    assert last[0].part_pos == slice(sinks + 128 + 1, sinks + 384 - 1)
    _assert_same(_both(*_qkv(1, 2, L, L), bm))


def test_the_predicate_runs_once_per_block_mask_and_shape():
    evaluated = []

    def counting(b, h, q_idx, kv_idx):
        evaluated.append(int(torch.broadcast_shapes(q_idx.shape, kv_idx.shape).numel()))
        return mm.causal(b, h, q_idx, kv_idx)

    L = 256
    bm = create_block_mask(counting, None, None, L, L, BLOCK_SIZE=64)
    q, k, v = _qkv(1, 2, L, L)
    evaluated.clear()
    out = flex_attention(q, k, v, block_mask=bm)
    assert sum(evaluated) == 4 * 64 * 64  # the four diagonal tiles, once
    out.sum().backward()  # the backward reuses the verdicts
    flex_attention(q, k, v, block_mask=bm)  # so does the next call
    assert sum(evaluated) == 4 * 64 * 64
    flex_attention(q[:, :1], k[:, :1], v[:, :1], block_mask=bm)  # another shape: planned again
    assert sum(evaluated) == 2 * 4 * 64 * 64


def test_one_block_mask_serves_several_shapes():
    """Plans are kept per shape: a block mask used with two batch sizes gives each its own answer."""
    L = 300
    bm = create_block_mask(mm.sliding_window(50), None, None, L, L, BLOCK_SIZE=64)
    for B, H in ((1, 2), (3, 1), (1, 2)):
        _assert_same(_both(*_qkv(B, H, L, L, seed=B), bm))


@pytest.mark.parametrize("name", ["causal", "sinks_window", "documents"])
def test_past_the_budget_the_predicate_runs_again_with_the_same_answer(name, monkeypatch):
    L = 600
    mod = {"causal": mm.causal, "sinks_window": mm.sinks_and_window(3, 70),
           "documents": mm.and_masks(mm.document(torch.arange(L) // 150), mm.causal)}[name]
    bm = create_block_mask(mod, None, None, L, L, BLOCK_SIZE=64)
    q, k, v = _qkv(2, 2, L, L)
    expected = _both(q, k, v, bm)[1]
    monkeypatch.setattr(chunked_flex, "PLAN_MASK_BYTES", 0)
    fresh = create_block_mask(mod, None, None, L, L, BLOCK_SIZE=64)
    chunks = [c for _, _, cs in _blocks(_plan(fresh, 2, 2, L, L)) for c in cs]
    assert any(c.part_pos is not None for c in chunks) and all(c.bias is None for c in chunks)
    results = _both(q, k, v, fresh)
    _assert_same([results[0], expected])


def test_equal_verdicts_are_kept_once():
    """A causal mask's diagonal looks the same from every block: a handful of bias tensors, not one per block."""
    L = 4096
    bm = create_block_mask(mm.causal, None, None, L, L)
    chunks = [c for _, _, cs in _blocks(_plan(bm, 1, 1, L, L)) for c in cs]
    kept = {id(c.bias) for c in chunks if c.bias is not None}
    assert len([c for c in chunks if c.bias is not None]) >= 16 and len(kept) <= 4


def test_per_batch_masks_and_a_score_mod_are_not_merged_wrongly():
    """Key padding per batch row (one plan group per row) and a score_mod with a captured tensor."""
    B, H, L, S = 2, 2, 500, 430
    bm = create_block_mask(mm.and_masks(mm.key_padding([430, 200]), mm.causal_bottom_right(L, S)), B, None, L, S,
                           BLOCK_SIZE=64)
    _assert_same(_both(*_qkv(B, H, L, S), bm))
    slopes = mm.alibi_slopes(H).double().requires_grad_()
    q, k, v = _qkv(B, H, L, S, seed=3)
    outs = [flex_attention(q, k, v, score_mod=mm.alibi(slopes), block_mask=bm, backend=b)
            for b in ("chunked", "reference")]
    torch.testing.assert_close(outs[0], outs[1])
    g = [torch.autograd.grad(o.sum(), [slopes]) for o in outs]
    torch.testing.assert_close(g[0], g[1])
