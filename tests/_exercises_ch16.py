"""Chapter 16's code exercise (``ch16.zigzag_block_mask``) for tests/test_code_exercises.py: mistakes beyond the
checker's own list, the library's answer under other names, correct solutions written differently, the worked
copy and the statement's example output."""

from __future__ import annotations

import torch

import attention_core.distributed as acd
from attention_core.distributed import layout


def _split_positions(L, P, r):
    chunks = torch.tensor_split(torch.arange(L), 2 * P)
    return torch.cat([chunks[r], chunks[2 * P - 1 - r]])


EXTRA_MISTAKES = [
    ("float mask instead of bool", lambda L, P, q, k: (_split_positions(L, P, q)[:, None]
                                                       >= _split_positions(L, P, k)[None, :]).float()),
    ("key rank's positions for the queries too", lambda L, P, q, k: _split_positions(L, P, k)[:, None]
     >= _split_positions(L, P, k)[None, :]),
    ("the striped layout", lambda L, P, q, k: torch.arange(q, L, P)[:, None] >= torch.arange(k, L, P)[None, :]),
    ("the late chunk first", lambda L, P, q, k: torch.cat([torch.tensor_split(torch.arange(L), 2 * P)[2 * P - 1 - q],
                                                          torch.tensor_split(torch.arange(L), 2 * P)[q]])[:, None]
     >= _split_positions(L, P, k)[None, :]),
]
LIBRARY = [
    lambda L, P, q, k: acd.positions(L, P, q, "zigzag")[:, None] >= acd.positions(L, P, k, "zigzag")[None, :],
    lambda L, P, q, k: layout.positions(L, P, q, "zigzag")[:, None] >= layout.positions(L, P, k, "zigzag")[None, :],
]


def _alt_loops(L, P, q_rank, k_rank):
    n = [L // (2 * P) + (1 if i < L % (2 * P) else 0) for i in range(2 * P)]
    start = [sum(n[:i]) for i in range(2 * P)]

    def pos(r):
        return [start[c] + t for c in (r, 2 * P - 1 - r) for t in range(n[c])]

    qs, ks = pos(q_rank), pos(k_rank)
    return torch.tensor([[a >= b for b in ks] for a in qs], dtype=torch.bool).reshape(len(qs), len(ks))


def _alt_not_less(L, P, q_rank, k_rank):
    q, k = _split_positions(L, P, q_rank), _split_positions(L, P, k_rank)
    return ~(q[:, None] < k[None, :])


ALTERNATIVES = [_alt_loops, _alt_not_less]

WORKED_COPY = """
def zigzag_block_mask(L, P, q_rank, k_rank):
    chunks = torch.tensor_split(torch.arange(L), 2 * P)
    def pos(r):
        return torch.cat([chunks[r], chunks[2 * P - 1 - r]])
    return pos(q_rank)[:, None] >= pos(k_rank)[None, :]
"""
STATEMENT_OUTPUT = ("[[False, False, False, False], [False, False, False, False], [True, True, True, True], "
                    "[True, True, True, True]]")
