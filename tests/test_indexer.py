"""DeepSeek Sparse Attention at small scale: the lightning indexer's scores, the causal top-k selection, the KL loss
that trains the indexer, and the attention layer that attends over the selected keys (with its decode cache)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attention_core import indexer as ix
from attention_core.flex_attention import create_block_mask, flex_attention
from attention_core.functional import attention
from attention_core.models.indexed_attention import IndexedAttention, IndexedCache

SMALL = settings(max_examples=40, deadline=None, derandomize=True)


# ------------------------------------------------------------------------------------------------- scores


def test_index_scores_by_hand():
    """Two indexer heads with queries (1, 0) and (0, 1), weights 2 and -1, against keys (1, 1), (-1, 2), (3, -1):
    2 relu(1) - relu(1) = 1; 2 relu(-1) - relu(2) = -2; 2 relu(3) - relu(-1) = 6."""
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])  # (H_I = 2, L = 1, d_I = 2)
    k = torch.tensor([[1.0, 1.0], [-1.0, 2.0], [3.0, -1.0]])  # (S = 3, d_I)
    w = torch.tensor([[2.0], [-1.0]])  # (H_I, L)
    torch.testing.assert_close(ix.indexer_scores(q, k, w), torch.tensor([[1.0, -2.0, 6.0]]))


def test_index_scores_equal_a_loop_over_heads_queries_and_keys():
    g = torch.Generator().manual_seed(0)
    q, k, w = torch.randn(2, 3, 5, 4, generator=g), torch.randn(2, 7, 4, generator=g), torch.randn(2, 3, 5, generator=g)
    got = ix.indexer_scores(q, k, w)
    want = torch.zeros(2, 5, 7)
    for b in range(2):
        for t in range(5):
            for s in range(7):
                want[b, t, s] = sum(w[b, j, t] * max(0.0, float(q[b, j, t] @ k[b, s])) for j in range(3))
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------------------------------------- selection


def test_causal_top_k_by_hand():
    """k = 2; the largest scores sit on future keys and are never chosen. Row 0 has one candidate (itself), row 1
    two; row 2 keeps keys 1 and 2 (scores 3, 2), row 3 keys 0 and 3 (scores 4, 3)."""
    scores = torch.tensor([[0.0, 9, 9, 9], [5, 1, 9, 9], [1, 3, 2, 9], [4, 0, 1, 3]])
    want = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(ix.causal_topk_mask(scores, 2), want)
    # the last two queries of five tokens (decoding): query 0 is at position 3, query 1 at position 4
    scores = torch.tensor([[0.0, 5, 1, 2, 9], [0, 5, 1, 2, 9]])
    want = torch.tensor([[0, 1, 0, 1, 0], [0, 1, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(ix.causal_topk_mask(scores, 2, offset=3), want)


@SMALL
@given(L=st.integers(1, 9), extra=st.integers(0, 4), k=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_selection_is_causal_keeps_min_k_candidates_and_the_largest_scores(L, extra, k, seed):
    S = L + extra
    scores = torch.randn(2, L, S, generator=torch.Generator().manual_seed(seed))
    sel = ix.causal_topk_mask(scores, k, offset=extra)
    t = torch.arange(L)[:, None] + extra  # each query's position
    s = torch.arange(S)[None, :]
    assert not bool((sel & (s > t)).any())  # never a key after the query
    assert torch.equal(sel.sum(-1), torch.clamp(t[:, 0] + 1, max=k).expand(2, L))  # min(k, candidates)
    lowest_kept = scores.masked_fill(~sel, math.inf).amin(-1)  # (2, L)
    best_dropped = scores.masked_fill(sel | (s > t), -math.inf).amax(-1)
    assert bool((lowest_kept >= best_dropped).all())


@pytest.mark.parametrize("k", [6, 7, 100])
def test_top_k_with_k_at_least_the_length_is_the_causal_mask(k):
    scores = torch.randn(3, 6, 6, generator=torch.Generator().manual_seed(k))
    assert torch.equal(ix.causal_topk_mask(scores, k), torch.ones(6, 6, dtype=torch.bool).tril().expand(3, 6, 6))


def test_the_selection_as_a_mask_mod_gives_flex_attention_the_same_answer():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 10, 4, generator=g) for _ in range(3))
    sel = ix.causal_topk_mask(torch.randn(2, 10, 10, generator=g), 3)  # (B, L, S), shared by the heads
    want, _ = attention(q, k, v, attn_mask=sel[:, None])
    block_mask = create_block_mask(ix.selection_mask_mod(sel), 2, None, 10, 10, BLOCK_SIZE=4)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask), want)
    block_mask = create_block_mask(ix.selection_mask_mod(sel[0]), None, None, 10, 10, BLOCK_SIZE=4)
    torch.testing.assert_close(flex_attention(q[:1], k[:1], v[:1], block_mask=block_mask), want[:1])


# ------------------------------------------------------------------------------------------------ KL loss


def test_kl_loss_by_hand():
    """Two heads put all their weight on keys 0 and 1: the target is (1/2, 1/2, 0). Index scores (0, log 3, 100)
    over the keys {0, 1} give softmax (1/4, 3/4) (key 2 is outside the set, its score ignored):
    KL = 1/2 log 2 + 1/2 log(2/3)."""
    weights = torch.tensor([[[1.0, 0.0, 0.0]], [[0.0, 1.0, 0.0]]])  # (H = 2, L = 1, S = 3)
    scores = torch.tensor([[0.0, math.log(3), 100.0]])
    keys = torch.tensor([[True, True, False]])
    loss = ix.indexer_kl_loss(scores, weights, keys)
    torch.testing.assert_close(loss, torch.tensor(0.5 * math.log(2) + 0.5 * math.log(2 / 3)))
    # the sparse stage restricts the target to the selected keys and renormalizes it there: only key 1 is left
    only1 = torch.tensor([[False, True, False]])
    torch.testing.assert_close(ix.indexer_kl_loss(scores, weights, only1), torch.tensor(0.0))


def test_kl_loss_is_zero_when_the_indexer_matches_the_target_and_positive_otherwise():
    g = torch.Generator().manual_seed(2)
    keys = torch.ones(7, 7, dtype=torch.bool).tril()
    weights = torch.softmax(torch.randn(2, 3, 7, 7, generator=g).masked_fill(~keys, -math.inf), -1)  # (B, H, L, S)
    p = weights.sum(1) / weights.sum(1).sum(-1, keepdim=True)  # (B, L, S)
    matched = torch.where(keys, p.clamp_min(1e-30).log() + 5.0, -7.0)  # log p (+ a per-row constant) on the keys
    assert float(ix.indexer_kl_loss(matched, weights, keys)) == pytest.approx(0.0, abs=1e-5)
    other = torch.randn(2, 7, 7, generator=g)
    assert float(ix.indexer_kl_loss(other, weights, keys)) > 0.1
    mean = ix.indexer_kl_loss(other, weights, keys, reduction="mean")
    torch.testing.assert_close(mean * 14, ix.indexer_kl_loss(other, weights, keys))


def test_kl_loss_trains_the_scores_only_and_an_empty_row_adds_nothing():
    weights = torch.softmax(torch.randn(1, 2, 3, 4), -1).requires_grad_()
    scores = torch.randn(1, 3, 4, requires_grad=True)
    keys = torch.tensor([[True, True, False, False], [False] * 4, [True] * 4])
    loss = ix.indexer_kl_loss(scores, weights, keys)
    loss.backward()
    assert weights.grad is None  # the target is detached
    assert bool(torch.isfinite(scores.grad).all()) and bool((scores.grad[0, 1] == 0).all())
    row_sum = ix.indexer_kl_loss(scores[:, ::2], weights[:, :, ::2], keys[::2])
    torch.testing.assert_close(loss, row_sum)


# -------------------------------------------------------------------------------------------------- layer


def _layer(topk: int = 3, seed: int = 0) -> IndexedAttention:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return IndexedAttention(16, 2, topk=topk, index_heads=3, index_dim=8)


def test_decoding_with_the_cache_equals_the_full_forward():
    m = _layer(topk=3)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(3))
    full = m(x)
    assert bool((full.selected.sum(-1) == torch.clamp(torch.arange(1, 11), max=3)).all())
    prefill = m(x[:, :4], cache=m.empty_cache(2))
    outs, cache = [prefill.out], prefill.cache
    for t in range(4, 10):
        step = m(x[:, t:t + 1], cache=cache)
        assert torch.equal(step.selected[:, 0], full.selected[:, t, :t + 1])
        outs.append(step.out)
        cache = step.cache
    torch.testing.assert_close(torch.cat(outs, dim=1), full.out, rtol=1e-5, atol=1e-6)
    assert len(cache) == 10 and cache.nbytes() == 4 * 2 * 10 * (16 + 16 + 8)  # K, V and the indexer's key


def test_top_k_at_least_the_length_is_dense_causal_attention():
    m, big = _layer(topk=2), _layer(topk=10)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(4))
    dense = m(x, dense=True).out
    torch.testing.assert_close(big(x).out, dense)
    q = m.q_proj(x).view(2, 10, 2, 8).transpose(1, 2)
    k = m.k_proj(x).view(2, 10, 2, 8).transpose(1, 2)
    v = m.v_proj(x).view(2, 10, 2, 8).transpose(1, 2)
    o, _ = attention(q, k, v, is_causal=True)
    torch.testing.assert_close(dense, m.o_proj(o.transpose(1, 2).reshape(2, 10, 16)))
    assert not torch.allclose(m(x).out, dense)  # k = 2 < L: another answer


def test_the_index_loss_reaches_the_indexer_only_and_the_output_never_does():
    m = _layer()
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(5), requires_grad=True)
    for dense in (True, False):
        m.zero_grad()
        r = m(x, dense=dense, need_index_loss=True)
        r.index_loss.backward()
        indexer = set(map(id, m.indexer_parameters()))
        for p in m.parameters():
            assert (p.grad is not None) == (id(p) in indexer)
        assert x.grad is None  # the indexer reads a detached input
    m.zero_grad()
    m(x).out.sum().backward()
    assert all(p.grad is None for p in m.indexer_parameters())


def test_the_sparse_stage_loss_is_eq4_over_the_selected_keys():
    """Eq. (4) computed here from the layer's weights: the selection from eq. (1)'s scores, each head's softmax over
    the selected keys, summed over heads and L1-normalized, against the indexer's softmax over the same keys."""
    m = _layer(topk=3)
    x = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(7))
    r = m(x, need_index_loss=True)
    B, L, H, E = 2, 9, 2, 8
    qi = m.index_q(x).view(B, L, 3, 8).permute(0, 2, 1, 3) / math.sqrt(8)  # (B, H_I, L, d_I)
    w = m.index_w(x).permute(0, 2, 1) / math.sqrt(3)  # (B, H_I, L)
    scores = (w[..., None] * torch.relu(qi @ m.index_k(x).transpose(1, 2)[:, None])).sum(1)  # (B, L, S)
    sel = ix.causal_topk_mask(scores, 3)
    assert torch.equal(r.selected, sel)
    q = m.q_proj(x).view(B, L, H, E).transpose(1, 2)
    k = m.k_proj(x).view(B, L, H, E).transpose(1, 2)
    att = torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(E)).masked_fill(~sel[:, None], -math.inf), -1)
    p = att.sum(1) / att.sum(1).sum(-1, keepdim=True)  # (B, L, S), zero off the selection
    log_q = torch.log_softmax(scores.masked_fill(~sel, -math.inf), -1)
    kl = torch.where(sel, p * (p.clamp_min(1e-30).log() - log_q), 0.0).sum(-1)  # (B, L)
    torch.testing.assert_close(r.index_loss, kl.mean())
    dense = m(x, dense=True, need_index_loss=True)  # eq. (3): every earlier key, another value
    assert not torch.allclose(dense.index_loss, r.index_loss)


def test_a_dense_warm_up_teaches_the_indexer_the_attention():
    """The paper's first stage at toy scale: the main model frozen, the indexer trained on eq. (3)'s loss."""
    m = _layer()
    x = torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(6))
    opt = torch.optim.Adam(m.indexer_parameters(), lr=1e-2)
    first = float(m(x, dense=True, need_index_loss=True).index_loss.detach())
    for _ in range(60):
        opt.zero_grad()
        m(x, dense=True, need_index_loss=True).index_loss.backward()
        opt.step()
    last = float(m(x, dense=True, need_index_loss=True).index_loss.detach())
    assert last < 0.5 * first


# ------------------------------------------------------------------------------------------------- errors


_ALL = torch.ones(3, 4, dtype=torch.bool)


@pytest.mark.parametrize("call, error, message", [
    (lambda: ix.causal_topk_mask(torch.randn(3, 3), 0), ValueError, r"k must be an int >= 1, got 0"),
    (lambda: ix.causal_topk_mask(torch.randn(3, 3), 2.0), TypeError, r"k must be an int"),
    (lambda: ix.causal_topk_mask(torch.randn(3), 2), ValueError, r"scores must be \(\.\.\., L, S\)"),
    (lambda: ix.causal_topk_mask(torch.randn(3, 4), 2, offset=2), ValueError, r"offset \+ L must be <= S"),
    (lambda: ix.causal_topk_mask(torch.ones(3, 3, dtype=torch.long), 2), TypeError, r"scores must have a floating"),
    (lambda: ix.topk_within([[0.0] * 4] * 3, _ALL, 2), TypeError, r"scores must be a torch.Tensor, got list"),
    (lambda: ix.topk_within(torch.zeros(3, 4, dtype=torch.long), _ALL, 2), TypeError,
     r"scores must have a floating-point dtype, got torch.int64"),
    (lambda: ix.topk_within(torch.tensor(1.0), torch.tensor(True), 2), ValueError,
     r"scores must be \(\.\.\., L, S\), got shape \(\)"),
    (lambda: ix.topk_within(torch.zeros(3, 4), _ALL.float(), 2), TypeError,
     r"allowed must be a bool tensor, got torch.float32"),
    (lambda: ix.topk_within(torch.zeros(3, 4), _ALL[:, :3], 2), ValueError,
     r"allowed must have the shape of scores \(3, 4\), got \(3, 3\)"),
    (lambda: ix.topk_within(torch.zeros(3, 4), _ALL, 0), ValueError, r"k must be an int >= 1, got 0"),
    (lambda: ix.topk_within(torch.zeros(3, 4), _ALL, -1), ValueError, r"k must be an int >= 1, got -1"),
    (lambda: ix.topk_within(torch.zeros(3, 4), _ALL, 2.5), TypeError, r"k must be an int >= 1, got float 2.5"),
    (lambda: ix.indexer_scores(torch.randn(2, 3, 4), torch.randn(5, 3), torch.randn(2, 3)), ValueError,
     r"query must be \(\.\.\., H_I, L, d_I\) and key \(\.\.\., S, d_I\)"),
    (lambda: ix.indexer_scores(torch.randn(2, 3, 4), torch.randn(5, 4), torch.randn(3, 2)), ValueError,
     r"weights must be \(\.\.\., H_I, L\) = \(2, 3\)"),
    (lambda: ix.indexer_kl_loss(torch.randn(3, 3), torch.rand(2, 3, 4), torch.ones(3, 3, dtype=torch.bool)),
     ValueError, r"attn_weights must be \(\.\.\., H, L, S\)"),
    (lambda: ix.indexer_kl_loss(torch.randn(3, 3), torch.rand(2, 3, 3), torch.ones(3, 3)), ValueError,
     r"keys must be a bool mask"),
    (lambda: ix.indexer_kl_loss(torch.randn(3, 3), torch.rand(2, 3, 3), torch.ones(3, 3, dtype=torch.bool),
                                reduction="max"), ValueError, r"reduction must be one of"),
    (lambda: ix.selection_mask_mod(torch.ones(3, 3)), ValueError, r"selected must be a bool"),
    (lambda: IndexedAttention(10, 3, topk=2), ValueError, r"divisible"),
    (lambda: IndexedAttention(16, 2, topk=0), ValueError, r"topk must be an int >= 1"),
    (lambda: _layer()(torch.randn(1, 3, 8)), ValueError, r"x must be \(B, L, D\) with D = embed_dim = 16"),
    (lambda: _layer()(torch.randn(1, 3, 16), cache=(1, 2)), TypeError, r"cache must be an IndexedCache"),
    (lambda: _layer()(torch.randn(1, 3, 16), cache=_layer().empty_cache(2)), ValueError,
     r"cache.key must have shape \(1, 2, 0, 8\)"),
    (lambda: _layer()(torch.randn(1, 3, 16), dense=1), TypeError, r"dense must be a bool"),
])
def test_bad_arguments_are_refused_with_a_message_that_names_them(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_a_refused_call_leaves_the_cache_alone():
    m = _layer()
    cache = m(torch.randn(1, 3, 16), cache=m.empty_cache(1)).cache
    with pytest.raises(TypeError):
        m(torch.randn(1, 1, 16, dtype=torch.float64), cache=cache)
    assert isinstance(cache, IndexedCache) and len(cache) == 3


def test_scores_too_large_for_memory_are_refused_before_any_work():
    from attention_core._checks import TooLargeError

    q = torch.zeros(1, 1, 1, 8).expand(1, 4, 2**20, 8)  # stride-0 views: tiny storage, huge as read
    k = torch.zeros(1, 1, 8).expand(1, 2**20, 8)
    with pytest.raises(TooLargeError, match="GiB"):
        ix.indexer_scores(q, k, torch.zeros(1, 1, 1).expand(1, 4, 2**20))


def test_ties_go_to_the_most_recent_key():
    """Equal scores (a key whose ReLU terms are all 0 scores exactly 0): each query keeps the most recent keys, so
    the selection of a query is the same alone (decoding) as with others; IndexedAttention selects so too."""
    scores = torch.zeros(6, 6)
    want = torch.zeros(6, 6, dtype=torch.bool)
    for t in range(6):
        want[t, max(0, t - 1): t + 1] = True  # itself and the one before
    assert torch.equal(ix.causal_topk_mask(scores, 2), want)
    last = ix.causal_topk_mask(scores[-1:], 2, offset=5)  # the last query alone, as in decoding
    assert torch.equal(last, want[-1:])
    nan = torch.tensor([[0.0, float("nan"), 0.0, 0.0]])
    assert ix.causal_topk_mask(nan, 2, offset=3).tolist() == [[False, True, False, True]]  # NaN first, then recent
