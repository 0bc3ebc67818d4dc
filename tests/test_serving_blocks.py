"""The block allocator and the paged cache under random admit / grow / fork / free sequences (a hypothesis state
machine): no block leaked, none shared wrongly, every sequence reads back exactly the tokens written to it, and
paged attention over the random block tables (shared prefixes, copies on write) equals contiguous attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from attention_core.paged_attention import gather_paged_kv, paged_attention
from attention_core.serving.blocks import BlockAllocator, OutOfBlocks, PagedKVCache

NUM_BLOCKS, BS, H, E = 24, 4, 1, 2


class PagedCacheMachine(RuleBasedStateMachine):
    """Model: each live sequence is a plain list of token values; the cache must agree with it."""

    @initialize()
    def setup(self) -> None:
        self.cache = PagedKVCache(1, NUM_BLOCKS, BS, H, E)
        self.model: dict = {}
        self.next_id = 0
        self.counter = 0.0

    @rule()
    def admit(self) -> None:
        self.cache.add_sequence(self.next_id)
        self.model[self.next_id] = []
        self.next_id += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data(), n=st.integers(1, 9))
    def grow(self, data, n: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.model)))
        free_before = self.cache.allocator.num_free
        try:
            pos = self.cache.reserve(seq, n)
        except OutOfBlocks:
            assert self.cache.allocator.num_free == free_before  # a refused reserve changes nothing
            assert self.cache.lengths[seq] == len(self.model[seq])
            return
        values = [self.counter + i for i in range(n)]
        self.counter += n
        k = torch.tensor(values).view(1, n, 1).expand(H, n, E)  # (H, n, E): a token's value everywhere
        self.cache.write(0, seq, pos, k, -k)
        self.model[seq] += values

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.fork(parent, self.next_id)
        self.model[self.next_id] = list(self.model[parent])
        self.next_id += 1

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.free_sequence(seq)
        del self.model[seq]

    @invariant()
    def contents_match(self) -> None:
        for seq, values in self.model.items():
            table, _ = self.cache.block_table([seq])
            k = gather_paged_kv(self.cache.keys[0], table[0], len(values))
            v = gather_paged_kv(self.cache.values[0], table[0], len(values))
            assert k[0, :, 0].tolist() == values, f"sequence {seq} reads back other tokens"
            assert (-v[0, :, 0]).tolist() == values

    @invariant()
    def paged_attention_equals_contiguous(self) -> None:
        """Decode attention of every live sequence through its (possibly shared, copied-on-write) block table
        equals attention over its tokens laid out contiguously (relative 1e-6)."""
        seqs = [s for s in sorted(self.model) if self.model[s]]
        if not seqs:
            return
        table, lens = self.cache.block_table(seqs)
        q = torch.linspace(-0.02, 0.02, len(seqs) * H * E).view(len(seqs), H, 1, E)
        for path in ("gather", "chunked"):
            out = paged_attention(q, self.cache.keys[0], self.cache.values[0], table, lens, path=path)
            for i, s in enumerate(seqs):
                k = torch.tensor(self.model[s], dtype=torch.float64).view(1, -1, 1).expand(H, -1, E)
                ref = torch.nn.functional.scaled_dot_product_attention(q[i].double(), k, -k)  # (H, 1, E)
                err = (out[i].double() - ref).abs().max() / ref.abs().max().clamp_min(1)
                assert err <= 1e-6, f"{path}: sequence {s} attends to other tokens than its own"

    @invariant()
    def no_leak_and_counts_right(self) -> None:
        alloc = self.cache.allocator
        owners = [0] * NUM_BLOCKS
        for seq, table in self.cache.tables.items():
            assert len(table) == -(-self.cache.lengths[seq] // BS), "a sequence holds a block it does not use"
            for b in table:
                owners[b] += 1
        for b in range(NUM_BLOCKS):
            assert alloc.refcount(b) == owners[b], f"block {b}: refcount {alloc.refcount(b)}, owners {owners[b]}"
        assert alloc.num_free == owners.count(0), "a block is lost (neither free nor held)"
        assert sorted(alloc._free) == [b for b in range(NUM_BLOCKS) if owners[b] == 0]

    @invariant()
    def shared_blocks_hold_the_same_tokens(self) -> None:
        """A block two sequences list must hold, in its used slots, the same tokens for both of them."""
        seen: dict = {}
        for seq, table in self.cache.tables.items():
            n = self.cache.lengths[seq]
            for j, b in enumerate(table):
                chunk = self.model[seq][j * BS : min(n, (j + 1) * BS)]
                if b in seen:
                    other = seen[b]
                    common = min(len(other), len(chunk))
                    assert other[:common] == chunk[:common], f"block {b} is shared by diverged sequences"
                seen[b] = chunk if b not in seen or len(chunk) > len(seen[b]) else seen[b]


PagedCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPagedCache = PagedCacheMachine.TestCase


def test_allocator_refuses_double_free_and_sharing_a_free_block() -> None:
    a = BlockAllocator(2)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match="double free"):
        a.free(b)
    with pytest.raises(ValueError, match="free"):
        a.fork(b)
    a.allocate(), a.allocate()
    with pytest.raises(OutOfBlocks):
        a.allocate()


def test_copy_on_write_only_when_the_shared_block_is_partly_filled() -> None:
    cache = PagedKVCache(1, 8, 4, 1, 2)
    cache.add_sequence(0)
    cache.reserve(0, 4)  # exactly one full block
    cache.fork(0, 1)
    assert cache.blocks_needed(1, 1) == 1  # a fresh block, no copy: the shared one is full
    cache.reserve(1, 1)
    assert cache.tables[1][0] == cache.tables[0][0]
    cache.fork(1, 2)
    assert cache.blocks_needed(2, 1) == 1  # the half-filled shared block must be copied
    cache.reserve(2, 1)
    assert cache.tables[2][1] != cache.tables[1][1] and cache.tables[2][0] == cache.tables[0][0]


# ------------------------------------------------------------------------ issue 37: refusals and crops


@pytest.mark.parametrize("bad,error", [(-1, ValueError), (2, ValueError), (10**30, ValueError), (1.0, TypeError),
                                       (True, TypeError), ("0", TypeError), (None, TypeError)])
def test_allocator_refuses_bad_ids_and_changes_nothing(bad, error) -> None:
    a = BlockAllocator(2)
    held = a.allocate()
    for method in (a.free, a.fork, a.refcount):
        with pytest.raises(error, match="block"):
            method(bad)
    assert a.num_free == 1 and a.refcount(held) == 1
    assert a.allocate() == 1  # never -1 (a free(-1) once put -1 on the free list)
    with pytest.raises(OutOfBlocks):
        a.allocate()


@pytest.mark.parametrize("n", [0, -1, 1.5, True, None])
def test_allocator_refuses_a_bad_size(n) -> None:
    with pytest.raises((TypeError, ValueError), match="num_blocks"):
        BlockAllocator(n)


def test_paged_cache_refuses_what_it_cannot_hold_before_allocating() -> None:
    from attention_core._checks import TooLargeError

    with pytest.raises(TooLargeError, match="pools"):
        PagedKVCache(1, 2**40, 16, 8, 128)
    with pytest.raises(TypeError, match="dtype"):
        PagedKVCache(1, 4, 4, 1, 2, dtype=torch.int64)
    for kw in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
        args = dict(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=1, head_dim=2) | {kw: 0}
        with pytest.raises(ValueError, match=kw):
            PagedKVCache(**args)


def test_paged_cache_methods_refuse_unknown_sequences_and_bad_writes() -> None:
    cache = PagedKVCache(2, 4, 4, 1, 2)
    cache.add_sequence(0)
    pos = cache.reserve(0, 3)
    state = ({s: list(t) for s, t in cache.tables.items()}, dict(cache.lengths), cache.allocator.num_free)
    calls = [(ValueError, "parent", lambda: cache.fork(5, 6)), (ValueError, "child", lambda: cache.fork(0, 0)),
             (TypeError, "seq", lambda: cache.add_sequence("a")), (ValueError, "seq", lambda: cache.free_sequence(3)),
             (ValueError, "new_tokens", lambda: cache.reserve(0, -1)),
             (TypeError, "new_tokens", lambda: cache.reserve(0, 1.5)),
             (ValueError, "layer", lambda: cache.write(2, 0, pos, torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))),
             (ValueError, "key", lambda: cache.write(0, 0, pos, torch.zeros(1, 2, 2), torch.zeros(1, 3, 2))),
             (TypeError, "key", lambda: cache.write(0, 0, pos, torch.zeros(1, 3, 2).double(), torch.zeros(1, 3, 2))),
             (ValueError, "positions", lambda: cache.write(0, 0, range(2, 5), torch.zeros(1, 3, 2),
                                                           torch.zeros(1, 3, 2))),
             (ValueError, "n", lambda: cache.crop(0, 4)), (ValueError, "seqs", lambda: cache.block_table([0, 9]))]
    for error, words, call in calls:
        with pytest.raises(error, match=words):
            call()
        assert ({s: list(t) for s, t in cache.tables.items()}, dict(cache.lengths),
                cache.allocator.num_free) == state, f"a refused call ({words}) changed the cache"


def _model_and_one_sequence():
    """A two-layer decoder (GQA, one kv head) and a 12-block pool with one empty sequence (0) and its view."""
    from attention_core.models.language_model import build_language_model

    model = build_language_model({"vocab_size": 13, "d_model": 16, "num_layers": 2, "num_heads": 2,
                                  "num_kv_heads": 1, "max_positions": 20, "seed": 0}).eval()
    pool = PagedKVCache(2, 12, 4, 1, 8)
    pool.add_sequence(0)
    return model, pool, pool.sequence_view(0)


def test_crop_of_a_sequence_view_crops_the_pool() -> None:
    model, pool, view = _model_and_one_sequence()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5, 6]]), view)
        view.crop(3)
        assert len(view) == pool.lengths[0] == 3 and len(pool.tables[0]) == 1 and pool.allocator.num_free == 11
        got = model(torch.tensor([[9]]), view).logits[0, -1]
        ref = model(torch.tensor([[1, 2, 3, 9]])).logits[0, -1]
    assert (got - ref).abs().max() <= 1e-5


def test_a_sequence_views_restore_after_crop_and_append_is_exact() -> None:
    """snapshot, crop (into a block), append, restore: the same table, length, tokens and free blocks; the
    blocks the crop let go of were pinned by the snapshot, and the cut block was copied before the append."""
    model, pool, view = _model_and_one_sequence()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), view)
        table, _ = pool.block_table([0])
        keys = gather_paged_kv(pool.keys[1], table[0], 7).clone()
        before = (list(pool.tables[0]), pool.lengths[0], pool.allocator.num_free)
        snap = view.snapshot()
        view.crop(2)
        model(torch.tensor([[8, 9, 10, 11, 12, 1, 2, 3]]), view)  # takes the freed blocks back, rewrites slots
        view.restore(snap)
    assert (list(pool.tables[0]), pool.lengths[0]) == before[:2]
    assert torch.equal(gather_paged_kv(pool.keys[1], table[0], 7), keys)
    del snap  # the snapshot's pins go back to the pool with it
    assert pool.allocator.num_free == before[2]
    assert sorted(pool.allocator._free) == [b for b in range(12) if b not in pool.tables[0]]
