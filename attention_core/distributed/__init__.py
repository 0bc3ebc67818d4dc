"""Attention across processes: the sequence split among the ranks of a torch.distributed process group.

- :func:`shard` / :func:`unshard`: a rank's part of a sequence in one of three layouts (contiguous, zigzag,
  striped) and the whole sequence back;
- :func:`ring_attention`: key/value blocks passed around a ring (Liu et al. 2023), merged by log-sum-exp;
- :func:`ulysses_attention`: two all-to-alls swap the sequence split for a head split (Jacobs et al. 2023);
- :func:`~attention_core.distributed.launch.run`: a function on N local processes (gloo), from a notebook;
- :mod:`~attention_core.distributed.measure`: bytes, score tiles and memory, counted without processes.

gloo on CPUs, NCCL on GPUs: the code takes the device from the tensors.
"""

from attention_core.distributed.layout import LAYOUTS, local_lengths, positions, segments, shard, unshard
from attention_core.distributed.ring import CommStats, block_plan, kernel_tiles, ring_attention, ring_bytes, ring_tiles
from attention_core.distributed.ulysses import ulysses_attention, ulysses_bytes

__all__ = ["LAYOUTS", "CommStats", "block_plan", "kernel_tiles", "local_lengths", "positions", "ring_attention",
           "ring_bytes", "ring_tiles", "segments", "shard", "ulysses_attention", "ulysses_bytes", "unshard"]
