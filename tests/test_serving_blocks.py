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
