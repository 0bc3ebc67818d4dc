"""Counting what context parallelism costs, deterministically: bytes, score tiles, tensor memory.

- :func:`bytes_table`: bytes each rank sends per layer, ring and Ulysses, from the formulas
  (:func:`~attention_core.distributed.ring.ring_bytes`, :func:`~attention_core.distributed.ulysses.ulysses_bytes`);
  the tests check them against the bytes the running code counts.
- :func:`tile_table`: score tiles each rank computes, per layout, at any world size, from the plans
  (no processes); balance = max / mean.
- :class:`PeakTensorMemory`: the peak of the bytes held by tensors torch allocates inside a ``with`` block.
  It watches every operation (a ``TorchDispatchMode``) and every tensor storage an operation creates, until
  the last tensor on that storage is garbage. It measures tensors only (not the allocator's caching, not
  Python objects, not the communication library's own buffers), so it gives the same number on every CPU.
"""

from __future__ import annotations

import gc
import weakref
from typing import Dict, List, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attention_core.distributed.layout import local_lengths
from attention_core.distributed.ring import ring_bytes, ring_tiles
from attention_core.distributed.ulysses import ulysses_bytes

__all__ = ["PeakTensorMemory", "balance", "bytes_table", "tile_table"]


class PeakTensorMemory(TorchDispatchMode):
    """``with PeakTensorMemory() as m: ...`` then ``m.peak``: the most bytes that tensors created inside the
    block held at one time (tensors that existed before are not counted; views and in-place results are not
    new memory), and ``m.at_peak``: the sizes in bytes of the storages alive at that moment, largest first.
    Python's cycle collector is paused inside the block (after one collection), so that the moment a tensor dies
    does not depend on when it would have run."""

    def __init__(self) -> None:
        super().__init__()
        self.live: Dict[int, List[int]] = {}  # storage address -> [bytes, tensors alive on it]
        self.current = 0
        self.peak = 0
        self.at_peak: List[int] = []
        self._gc_was_enabled = False

    def __enter__(self):
        # The first operation a dispatch mode sees in a process imports torch._dynamo, and that import leaves
        # reference cycles that hold the frames running at the time, their tensors too, until the cycle collector
        # runs: a first block would count them. Import it here, before the collection, so that no block is a first.
        import torch._dynamo  # noqa: F401

        # Python's cycle collector runs when its allocation counters say so, which differs from run to run; a
        # tensor in a reference cycle would die at a different moment each time. Collect first, then not inside.
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._gc_was_enabled:
                gc.enable()

    def _drop(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        before = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0:
                continue
            if ptr in self.live:
                self.live[ptr][1] += 1
            elif ptr in before:
                continue  # a view or in-place result of a tensor made before the block
            else:
                self.live[ptr] = [nbytes, 1]
                self.current += nbytes
                if self.current > self.peak:
                    self.peak = self.current
                    self.at_peak = sorted((size for size, _ in self.live.values()), reverse=True)
            weakref.finalize(t, self._drop, ptr)
        return out


def balance(counts: Sequence[int]) -> float:
    """max / mean of per-rank work (1.0: perfectly balanced)."""
    return max(counts) * len(counts) / sum(counts)


def tile_table(L: int, worlds: Sequence[int] = range(2, 9), layouts=("contiguous", "zigzag", "striped"),
               block: int = 64, is_causal: bool = True) -> Dict[str, Dict[int, List[int]]]:
    """``{layout: {P: tiles per rank}}`` of causal ring attention over L positions, ``block`` x ``block`` tiles."""
    return {lay: {P: ring_tiles(L, P, lay, is_causal, block, block) for P in worlds} for lay in layouts}


def bytes_table(L: int, worlds: Sequence[int], heads: int, kv_heads: int, head_dim: int, itemsize: int,
                batch: int = 1, backward: bool = False, layout: str = "contiguous") -> Dict[str, Dict[int, List[int]]]:
    """``{"ring" | "ulysses": {P: bytes each rank sends}}`` for one layer (forward, or forward + backward)."""
    table: Dict[str, Dict[int, List[int]]] = {"ring": {}, "ulysses": {}}
    for P in worlds:
        lengths = local_lengths(L, P, layout)
        table["ring"][P] = ring_bytes(lengths, batch, kv_heads, head_dim, head_dim, itemsize, backward)
        if heads % P == 0 and kv_heads % P == 0:
            table["ulysses"][P] = ulysses_bytes(lengths, batch, heads, kv_heads, head_dim, head_dim, itemsize,
                                                backward)
    return table
