"""Fixed-size KV blocks: an allocator with reference counts, and a paged cache with copy-on-write.

:class:`BlockAllocator` hands out block ids from a free list and counts references: :meth:`BlockAllocator.fork`
lets a second sequence share a block, and a block goes back to the free list when its last owner frees it.
:class:`PagedKVCache` keeps, per layer, one pool of key blocks and one of value blocks, (N_blocks, H, bs, E),
and per sequence a block table (a list of block ids) and a length. Appending a token to a sequence whose last
block is shared copies that block first (copy-on-write), so forked sequences never see each other's new tokens.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from attention_core.models.language_model import KVCache

__all__ = ["BlockAllocator", "OutOfBlocks", "PagedKVCache", "PagedSequenceCache"]


class OutOfBlocks(RuntimeError):
    """The pool has no free block left."""


class BlockAllocator:
    """Block ids ``0 .. num_blocks - 1`` with reference counts.

    Args:
        num_blocks: size of the pool.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free: List[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds."""
        return len(self._free)

    def refcount(self, block: int) -> int:
        """How many owners ``block`` has (0: free)."""
        return self._refs[block]

    def allocate(self) -> int:
        """A free block, now with one owner. Raises :class:`OutOfBlocks` when none is left."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def fork(self, block: int) -> int:
        """One more owner for a held ``block`` (a shared prefix); returns it."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is free: only a held block can be shared")
        self._refs[block] += 1
        return block

    def free(self, block: int) -> None:
        """One owner lets go of ``block``; the last one puts it back on the free list."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is already free (double free)")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)


class PagedKVCache:
    """Keys and values of many sequences in fixed-size blocks of one pool per layer.

    Args:
        num_layers: layers of the model.
        num_blocks: blocks in the pool (shared by every sequence).
        block_size: tokens per block.
        num_kv_heads: H, key/value heads per layer.
        head_dim: E.
        dtype: dtype of the pools.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_layers, self.block_size = num_layers, block_size
        self.allocator = BlockAllocator(num_blocks)
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.tables: Dict[int, List[int]] = {}
        self.lengths: Dict[int, int] = {}

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq: int) -> None:
        """Start an empty sequence ``seq``."""
        if seq in self.tables:
            raise ValueError(f"sequence {seq} exists already")
        self.tables[seq], self.lengths[seq] = [], 0

    def fork(self, parent: int, child: int) -> None:
        """``child`` starts as a copy of ``parent`` that shares all its blocks (no data copied)."""
        self.add_sequence(child)
        self.tables[child] = [self.allocator.fork(b) for b in self.tables[parent]]
        self.lengths[child] = self.lengths[parent]

    def free_sequence(self, seq: int) -> None:
        """Drop ``seq``; blocks no other sequence shares return to the pool."""
        for b in self.tables.pop(seq):
            self.allocator.free(b)
        del self.lengths[seq]

    def blocks_needed(self, seq: int, new_tokens: int) -> int:
        """Fresh blocks that appending ``new_tokens`` to ``seq`` would take (copy-on-write included)."""
        n, table = self.lengths[seq], self.tables[seq]
        need = -(-(n + new_tokens) // self.block_size) - len(table)
        if new_tokens and n % self.block_size and self.allocator.refcount(table[-1]) > 1:
            need += 1  # the shared, partly filled last block is copied before it is written
        return need

    def reserve(self, seq: int, new_tokens: int) -> range:
        """Make room for ``new_tokens`` more tokens of ``seq``; returns their positions.

        A shared last block that would be written is copied first (every layer), then released by this
        sequence: copy-on-write. Raises :class:`OutOfBlocks` (and changes nothing) if the pool is too small.
        """
        if self.blocks_needed(seq, new_tokens) > self.allocator.num_free:
            raise OutOfBlocks(f"sequence {seq} needs {self.blocks_needed(seq, new_tokens)} blocks, "
                              f"{self.allocator.num_free} are free")
        n, table = self.lengths[seq], self.tables[seq]
        if new_tokens and n % self.block_size and self.allocator.refcount(table[-1]) > 1:
            old, new = table[-1], self.allocator.allocate()
            for pool in self.keys + self.values:
                pool[new] = pool[old]
            self.allocator.free(old)
            table[-1] = new
        while len(table) * self.block_size < n + new_tokens:
            table.append(self.allocator.allocate())
        self.lengths[seq] = n + new_tokens
        return range(n, n + new_tokens)

    def write(self, layer: int, seq: int, positions: range, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` (H, T, E) of ``seq`` at reserved ``positions`` (T of them) in ``layer``."""
        table = torch.tensor(self.tables[seq], dtype=torch.long)
        pos = torch.tensor(list(positions), dtype=torch.long)
        blocks, slots = table[pos // self.block_size], pos % self.block_size  # (T,), (T,)
        self.keys[layer][blocks, :, slots] = key.transpose(0, 1).to(self.keys[layer].dtype)  # (H, T, E) -> (T, H, E)
        self.values[layer][blocks, :, slots] = value.transpose(0, 1).to(self.values[layer].dtype)

    def block_table(self, seqs: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(block_table (B, max_blocks) int64 padded with 0, seq_lens (B,) int64)`` for ``seqs``."""
        width = max((len(self.tables[s]) for s in seqs), default=0)
        table = torch.zeros(len(seqs), max(width, 1), dtype=torch.long)
        for i, s in enumerate(seqs):
            table[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.long)
        return table, torch.tensor([self.lengths[s] for s in seqs], dtype=torch.long)

    def tokens_held(self) -> int:
        """Token slots in use by some sequence's length (a shared slot counted once per block)."""
        held = set()
        for s, table in self.tables.items():
            for t in range(self.lengths[s]):
                held.add((table[t // self.block_size], t % self.block_size))
        return len(held)

    def sequence_view(self, seq: int) -> PagedSequenceCache:
        """A cache the chapter-11 model can run on (one sequence, B = 1) that stores into this pool."""
        return PagedSequenceCache(self, seq)


class PagedSequenceCache(KVCache):
    """One sequence of a :class:`PagedKVCache`, seen through the :class:`~attention_core.models.language_model.KVCache`
    interface that :class:`~attention_core.models.language_model.DecoderLM` calls (batch of one, full cache).

    ``update`` writes the new keys and values into the sequence's blocks and returns the whole sequence, gathered
    through its block table; the model's attention then runs as usual.
    """

    def __init__(self, paged: PagedKVCache, seq: int) -> None:
        super().__init__(paged.num_layers)
        self.paged, self.seq = paged, seq
        self._start = paged.lengths[seq]
        self._positions: Optional[range] = None
        self.seen = paged.lengths[seq]

    def __len__(self) -> int:
        return self.paged.lengths[self.seq] if self._positions is None else self._positions.start

    @property
    def batch_size(self) -> Optional[int]:
        return 1

    def update(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new (1, H, L, E) keys and values; return the sequence's (1, H, S, E)."""
        from attention_core.paged_attention import gather_paged_kv

        if layer == 0:
            self._positions = self.paged.reserve(self.seq, key.shape[2])
        assert self._positions is not None
        self.paged.write(layer, self.seq, self._positions, key[0], value[0])
        table, _ = self.paged.block_table([self.seq])
        S = self.paged.lengths[self.seq]
        k = gather_paged_kv(self.paged.keys[layer], table[0], S)[None]  # (1, H, S, E)
        v = gather_paged_kv(self.paged.values[layer], table[0], S)[None]
        return k, v

    def step_done(self, new_tokens: int) -> None:
        self.seen += new_tokens
        self._positions = None

    def snapshot(self):  # type: ignore[override]
        """``(length, block table, seen)``: what a failed call must give back (see :meth:`restore`)."""
        return self.paged.lengths[self.seq], list(self.paged.tables[self.seq]), self.seen

    def restore(self, state) -> None:  # type: ignore[override]
        """Undo a call that raised half-way: the blocks it allocated go back to the pool, a shared block that a
        copy-on-write let go of is held again, and the length and table are as they were. Slots past the old
        length that the call wrote stay written but unread (no table points a token at them)."""
        length, table, seen = state
        current, alloc = self.paged.tables[self.seq], self.paged.allocator
        for block in table:
            if block not in current:
                alloc.fork(block)  # released by a copy-on-write in this call; its other owners still hold it
        for block in current:
            if block not in table:
                alloc.free(block)  # allocated (or copied into) by this call
        self.paged.tables[self.seq], self.paged.lengths[self.seq] = list(table), length
        self.seen, self._positions = seen, None

    def nbytes(self) -> int:
        held = len(self.paged.tables[self.seq])
        per_block = sum(p[0].numel() * p.element_size() for p in self.paged.keys + self.paged.values)
        return held * per_block
