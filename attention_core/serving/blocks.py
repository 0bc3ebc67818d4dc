"""Fixed-size KV blocks: an allocator with reference counts, and a paged cache with copy-on-write.

:class:`BlockAllocator` hands out block ids from a free list and counts references: :meth:`BlockAllocator.fork`
lets a second sequence share a block, and a block goes back to the free list when its last owner frees it.
:class:`PagedKVCache` keeps, per layer, one pool of key blocks and one of value blocks, (N_blocks, H, bs, E),
and per sequence a block table (a list of block ids) and a length. Appending a token to a sequence whose last
block is shared copies that block first (copy-on-write), so forked sequences never see each other's new tokens.

Every method validates its arguments before it changes anything (a ``TypeError``/``ValueError`` naming the
argument), so a refused call leaves the allocator and the cache as they were. :class:`PagedSequenceCache` (one
sequence seen as a :class:`~attention_core.models.kv_cache.KVCache`) can be cropped, snapshotted and restored
exactly: a block that the sequence lets go of while a live snapshot still lists it is kept (pinned) for that
snapshot until the snapshot is restored or released. Release is explicit -- ``snap.release()``, or a ``with``
block around the snapshot -- so the pool's reference counts never depend on when the garbage collector runs;
a snapshot dropped unreleased gives its pins back when it is collected (a fallback only).
"""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from attention_core._checks import check_fits, check_floating_dtype, check_int, check_tensor, fmt_shape, short_repr
from attention_core.models.language_model import KVCache

__all__ = ["BlockAllocator", "OutOfBlocks", "PagedKVCache", "PagedSequenceCache"]

#: Bytes of bookkeeping per block (its entry in the free list and its reference count, as Python ints).
_BOOKKEEPING_BYTES = 64


class OutOfBlocks(RuntimeError):
    """The pool has no free block left."""


class BlockAllocator:
    """Block ids ``0 .. num_blocks - 1`` with reference counts.

    Args:
        num_blocks: size of the pool, an int >= 1.
    """

    def __init__(self, num_blocks: int) -> None:
        check_int(num_blocks, "num_blocks", low=1)
        check_fits(num_blocks * _BOOKKEEPING_BYTES, f"the bookkeeping of num_blocks = {num_blocks} blocks", "cpu")
        self.num_blocks = num_blocks
        self._free: List[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds."""
        return len(self._free)

    def _block(self, block: object, name: str = "block") -> int:
        return check_int(block, name, low=0, high=self.num_blocks, high_open=True,
                         note=f"(a block id of this pool of {self.num_blocks})")

    def refcount(self, block: int) -> int:
        """How many owners ``block`` has (0: free)."""
        return self._refs[self._block(block)]

    def allocate(self) -> int:
        """A free block, now with one owner. Raises :class:`OutOfBlocks` when none is left."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} blocks are in use")
        block = self._free.pop()
        self._refs[block] = 1
        return block

    def fork(self, block: int) -> int:
        """One more owner for a held ``block`` (a shared prefix); returns it."""
        self._block(block)
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is free: only a held block can be shared")
        self._refs[block] += 1
        return block

    def free(self, block: int) -> None:
        """One owner lets go of ``block``; the last one puts it back on the free list."""
        self._block(block)
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is already free (double free)")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)


class _PagedSnapshot:
    """A :class:`PagedSequenceCache` snapshot: the sequence's length, table and ``seen``, and the references
    (``pins``) it holds on blocks the sequence let go of since (given back by :meth:`release`)."""

    __slots__ = ("owner", "seq", "length", "table", "seen", "pins", "released", "_unpin", "__weakref__")

    def __init__(self, owner: PagedKVCache, seq: int, length: int, table: List[int], seen: int) -> None:
        self.owner, self.seq, self.length, self.table, self.seen = owner, seq, length, table, seen
        self.pins: List[int] = []
        self.released = False
        # a fallback for a snapshot dropped unreleased: its pins go back when it is collected
        self._unpin = weakref.finalize(self, _unpin, owner.allocator, self.pins)

    def release(self) -> None:
        """Give back the blocks this snapshot pins, and pin no more (idempotent). It cannot be restored after."""
        if self.released:
            return
        self.released = True
        live = self.owner._live.get(self.seq)
        if live is not None:
            live.discard(self)
        self._unpin()  # runs _unpin once, now; the collector will not run it again

    def __enter__(self) -> _PagedSnapshot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _unpin(allocator: BlockAllocator, pins: List[int]) -> None:
    for block in pins:
        allocator.free(block)
    pins.clear()


class PagedKVCache:
    """Keys and values of many sequences in fixed-size blocks of one pool per layer.

    Args:
        num_layers: layers of the model.
        num_blocks: blocks in the pool (shared by every sequence).
        block_size: tokens per block.
        num_kv_heads: H, key/value heads per layer.
        head_dim: E.
        dtype: floating dtype of the pools (keys and values written must have it).
        device: where the pools live (default: the CPU).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> None:
        from attention_core._checks import check_device

        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            check_int(v, name, low=1)
        check_floating_dtype(dtype)
        device = check_device(device) or torch.device("cpu")
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        nbytes = 2 * num_layers * num_blocks * num_kv_heads * block_size * head_dim * torch.empty(
            (), dtype=dtype).element_size()
        check_fits(nbytes, f"the pools of {num_layers} layers x (keys, values) x {shape}", device)
        self.allocator = BlockAllocator(num_blocks)
        self.num_layers, self.block_size = num_layers, block_size
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.tables: Dict[int, List[int]] = {}
        self.lengths: Dict[int, int] = {}
        self._live: Dict[int, weakref.WeakSet[_PagedSnapshot]] = {}  # per sequence, snapshots that may restore

    # ------------------------------------------------------------------ checks
    def _seq(self, seq: object, name: str = "seq") -> int:
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"{name} must be an int (a sequence id), got {type(seq).__name__} {short_repr(seq)}")
        if seq not in self.tables:
            raise ValueError(f"{name} = {seq} is not a sequence of this cache (it holds {sorted(self.tables)[:20]})")
        return seq

    def _release(self, seq: int, block: int) -> None:
        """``seq`` lets go of ``block``: a live snapshot of ``seq`` that lists it and holds no pin on it yet takes
        the reference over (so restoring it finds the block as it was); else the reference is freed."""
        for snap in list(self._live.get(seq, ())):
            if block in snap.table and block not in snap.pins:
                snap.pins.append(block)
                return
        self.allocator.free(block)

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq: int) -> None:
        """Start an empty sequence ``seq`` (an int id not in use)."""
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"seq must be an int (a sequence id), got {type(seq).__name__} {short_repr(seq)}")
        if seq in self.tables:
            raise ValueError(f"sequence {seq} exists already")
        self.tables[seq], self.lengths[seq] = [], 0

    def fork(self, parent: int, child: int) -> None:
        """``child`` starts as a copy of ``parent`` that shares all its blocks (no data copied)."""
        self._seq(parent, "parent")
        if isinstance(child, bool) or not isinstance(child, int):
            raise TypeError(f"child must be an int (a sequence id), got {type(child).__name__} {short_repr(child)}")
        if child in self.tables:
            raise ValueError(f"child = {child} exists already")
        self.tables[child] = [self.allocator.fork(b) for b in self.tables[parent]]
        self.lengths[child] = self.lengths[parent]

    def free_sequence(self, seq: int) -> None:
        """Drop ``seq``; blocks no other sequence (or live snapshot) holds return to the pool."""
        self._seq(seq)
        for b in self.tables.pop(seq):
            self._release(seq, b)
        del self.lengths[seq]
        self._live.pop(seq, None)

    def blocks_needed(self, seq: int, new_tokens: int) -> int:
        """Fresh blocks that appending ``new_tokens`` to ``seq`` would take (copy-on-write included)."""
        self._seq(seq)
        check_int(new_tokens, "new_tokens", low=0)
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
        need = self.blocks_needed(seq, new_tokens)
        if need > self.allocator.num_free:
            raise OutOfBlocks(f"sequence {seq} needs {need} blocks, {self.allocator.num_free} are free")
        n, table = self.lengths[seq], self.tables[seq]
        if new_tokens and n % self.block_size and self.allocator.refcount(table[-1]) > 1:
            old, new = table[-1], self.allocator.allocate()
            for pool in self.keys + self.values:
                pool[new] = pool[old]
            table[-1] = new
            self._release(seq, old)
        while len(table) * self.block_size < n + new_tokens:
            table.append(self.allocator.allocate())
        self.lengths[seq] = n + new_tokens
        return range(n, n + new_tokens)

    def crop(self, seq: int, n: int) -> None:
        """Keep the first ``n`` tokens of ``seq`` (0 <= n <= its length); blocks past them are let go of."""
        self._seq(seq)
        check_int(n, "n", low=0, high=self.lengths[seq], note=f"(sequence {seq} holds {self.lengths[seq]} tokens)")
        table = self.tables[seq]
        keep = -(-n // self.block_size)
        if n % self.block_size:  # the kept, partly cut block: a live snapshot that saw more of it keeps it as is
            for snap in list(self._live.get(seq, ())):
                block = table[keep - 1]
                if snap.length > n and block in snap.table and block not in snap.pins:
                    snap.pins.append(self.allocator.fork(block))  # shared now: the next write copies it first
        for b in table[keep:]:
            self._release(seq, b)
        del table[keep:]
        self.lengths[seq] = n

    def write(self, layer: int, seq: int, positions: range, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` (H, T, E) of ``seq`` at reserved ``positions`` (T of them) in ``layer``."""
        check_int(layer, "layer", low=0, high=self.num_layers, high_open=True)
        self._seq(seq)
        if not isinstance(positions, range) or positions.step != 1:
            raise TypeError(f"positions must be a range (what reserve returned), got {short_repr(positions)}")
        if positions.start < 0 or positions.stop > self.lengths[seq]:
            raise ValueError(f"positions {positions} must lie in the reserved slots [0, {self.lengths[seq]}) of "
                             f"sequence {seq}")
        pool_k, pool_v = self.keys[layer], self.values[layer]
        T = len(positions)
        for name, t, pool in (("key", key, pool_k), ("value", value, pool_v)):
            check_tensor(t, name)
            want = (pool.shape[1], T, pool.shape[3])
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must be (H, T, E) = {want}, got {fmt_shape(t.shape)}")
            if t.dtype != pool.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but the pool holds {pool.dtype} (never cast silently)")
            if t.device != pool.device:
                raise ValueError(f"{name} is on {t.device} but the pool is on {pool.device}")
        self._write(layer, seq, positions, key, value)

    def _write(self, layer: int, seq: int, positions: range, key: torch.Tensor, value: torch.Tensor) -> None:
        """:meth:`write` without its checks, for callers that reserved ``positions`` and shaped the tensors."""
        pool_k, pool_v = self.keys[layer], self.values[layer]
        table = torch.tensor(self.tables[seq], dtype=torch.long)
        pos = torch.arange(positions.start, positions.stop, dtype=torch.long)
        blocks, slots = table[pos // self.block_size], pos % self.block_size  # (T,), (T,)
        blocks, slots = blocks.to(pool_k.device), slots.to(pool_k.device)
        pool_k[blocks, :, slots] = key.transpose(0, 1)  # (H, T, E) -> (T, H, E)
        pool_v[blocks, :, slots] = value.transpose(0, 1)

    def block_table(self, seqs: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(block_table (B, max_blocks) int64 padded with 0, seq_lens (B,) int64)`` for ``seqs``."""
        if isinstance(seqs, (str, bytes)) or not isinstance(seqs, Sequence):
            raise TypeError(f"seqs must be a list of sequence ids, got {type(seqs).__name__}")
        for s in seqs:
            self._seq(s, "seqs")
        return self._block_table(seqs)

    def _block_table(self, seqs: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`block_table` of sequences known to the pool, without the checks."""
        device = self.keys[0].device
        width = max((len(self.tables[s]) for s in seqs), default=0)
        table = torch.zeros(len(seqs), max(width, 1), dtype=torch.long)
        for i, s in enumerate(seqs):
            table[i, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.long)
        lens = torch.tensor([self.lengths[s] for s in seqs], dtype=torch.long)
        return table.to(device), lens.to(device)

    def tokens_held(self) -> int:
        """Token slots in use by some sequence's length (a shared slot counted once per block)."""
        held = set()
        for s, table in self.tables.items():
            for t in range(self.lengths[s]):
                held.add((table[t // self.block_size], t % self.block_size))
        return len(held)

    def sequence_view(self, seq: int) -> PagedSequenceCache:
        """A cache the chapter-11 model can run on (one sequence, B = 1) that stores into this pool."""
        return PagedSequenceCache(self, self._seq(seq))


class PagedSequenceCache(KVCache):
    """One sequence of a :class:`PagedKVCache`, seen through the :class:`~attention_core.models.language_model.KVCache`
    interface that :class:`~attention_core.models.language_model.DecoderLM` calls (batch of one, full cache).

    ``update`` writes the new keys and values into the sequence's blocks and returns the whole sequence, gathered
    through its block table; the model's attention then runs as usual. :meth:`crop` cuts the sequence in the pool;
    :meth:`snapshot` / :meth:`restore` put it back exactly (see the module docstring).
    """

    def __init__(self, paged: PagedKVCache, seq: int) -> None:
        if not isinstance(paged, PagedKVCache):
            raise TypeError(f"paged must be a PagedKVCache, got {type(paged).__name__}")
        paged._seq(seq)
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
        if self._positions is None:
            raise RuntimeError("update(layer > 0) before update(layer=0) of the same call")
        if layer == 0:  # the model's tensors, checked once per call: the later layers write them unchecked
            self.paged.write(layer, self.seq, self._positions, key[0], value[0])
        else:
            self.paged._write(layer, self.seq, self._positions, key[0], value[0])
        table, _ = self.paged._block_table([self.seq])
        S = self.paged.lengths[self.seq]
        k = gather_paged_kv(self.paged.keys[layer], table[0], S)[None]  # (1, H, S, E)
        v = gather_paged_kv(self.paged.values[layer], table[0], S)[None]
        return k, v

    def step_done(self, new_tokens: int) -> None:
        self.seen += new_tokens
        self._positions = None

    def crop(self, n: int) -> None:
        """Keep the first ``n`` tokens of the sequence, in the pool too (blocks past them are let go of)."""
        self.paged.crop(self.seq, n)
        self.seen, self._positions = n, None

    def reset(self) -> None:
        """Forget every token of the sequence (its blocks are let go of)."""
        self.crop(0)

    def snapshot(self):  # type: ignore[override]
        """The sequence's length, block table and ``seen``: what :meth:`restore` gives back. Until the snapshot is
        released (``snap.release()``, or ``with view.snapshot() as snap:``), blocks the sequence lets go of (a
        crop, a copy-on-write) stay pinned for it."""
        self.paged._seq(self.seq)
        snap = _PagedSnapshot(self.paged, self.seq, self.paged.lengths[self.seq], list(self.paged.tables[self.seq]),
                              self.seen)
        self.paged._live.setdefault(self.seq, weakref.WeakSet()).add(snap)
        return snap

    def restore(self, state) -> None:  # type: ignore[override]
        """Put back a :meth:`snapshot`: the same length, table and tokens. Blocks allocated since go back to the
        pool; blocks let go of since are held again (the snapshot pinned them, so they are as they were)."""
        if not isinstance(state, _PagedSnapshot):
            raise TypeError(f"state must be what this cache's snapshot() returned, got {type(state).__name__}")
        if state.owner is not self.paged or state.seq != self.seq:
            raise ValueError(f"state is a snapshot of another sequence (seq {state.seq}) or pool")
        if state.released:
            raise ValueError("state was released (its pinned blocks went back to the pool): it cannot be restored")
        self.paged._seq(self.seq)
        current, alloc = self.paged.tables[self.seq], self.paged.allocator
        for block in state.table:
            if block not in current:  # let go of since: pinned by the snapshot or held by another owner, unchanged
                if block in state.pins:
                    state.pins.remove(block)  # the pin's reference becomes the table's again
                else:
                    alloc.fork(block)
        for block in current:
            if block not in state.table:
                self.paged._release(self.seq, block)  # allocated (or copied into) since the snapshot
        self.paged.tables[self.seq], self.paged.lengths[self.seq] = list(state.table), state.length
        self.seen, self._positions = state.seen, None
        for block in [b for b in state.pins if b in state.table]:  # the table holds them again: no pin needed
            state.pins.remove(block)
            alloc.free(block)

    def nbytes(self) -> int:
        held = len(self.paged.tables[self.seq])
        per_block = sum(p[0].numel() * p.element_size() for p in self.paged.keys + self.paged.values)
        return held * per_block
