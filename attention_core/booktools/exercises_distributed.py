"""Chapter 16's code exercise: the causal mask between two ranks' shards in the zigzag layout.

``zigzag_block_mask(L, P, q_rank, k_rank)`` returns the bool (n_q, n_k) mask, True where query row i of
rank ``q_rank`` may attend to key row j of rank ``k_rank``, when a sequence of L positions is cut into 2P chunks
as ``torch.tensor_split`` cuts it and rank r holds chunks r and 2P-1-r. Registered in
``attention_core.booktools.chapter_exercises.EXERCISES`` as ``"ch16.zigzag_block_mask"``.
"""

from __future__ import annotations

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake

__all__ = ["build", "zigzag_positions_by"]


def _reference(L, P, q_rank, k_rank):
    from attention_core.distributed.layout import positions

    return positions(L, P, q_rank, "zigzag")[:, None] >= positions(L, P, k_rank, "zigzag")[None, :]


def zigzag_positions_by(L: int, P: int, r: int, *, pair=None, sizes="split") -> torch.Tensor:
    """Rank r's positions with a chunk pairing ``pair(r, P)`` (default 2P-1-r) and chunk sizes as
    ``tensor_split`` gives them, or equal sizes with the remainder in the last chunk (``sizes="floor"``), or as
    ``torch.chunk`` cuts them, missing chunks empty (``sizes="chunk"``)."""
    if sizes == "split":
        chunks = torch.tensor_split(torch.arange(L), 2 * P)
    elif sizes == "chunk":  # torch.chunk: chunks of ceil(L / 2P), and fewer than 2P of them when L runs out
        chunks = list(torch.chunk(torch.arange(L), 2 * P))
        chunks += [torch.arange(0)] * (2 * P - len(chunks))
    else:
        n = L // (2 * P)
        chunks = [torch.arange(i * n, (i + 1) * n if i < 2 * P - 1 else L) for i in range(2 * P)]
    j = (2 * P - 1 - r) if pair is None else pair(r, P)
    return torch.cat([chunks[r], chunks[j]])


def _mask(L, P, qr, kr, *, pair=None, sizes="split", strict=False, transpose=False):
    q = zigzag_positions_by(L, P, qr, pair=pair, sizes=sizes)
    k = zigzag_positions_by(L, P, kr, pair=pair, sizes=sizes)
    if transpose:
        return q[:, None] <= k[None, :]
    return q[:, None] > k[None, :] if strict else q[:, None] >= k[None, :]


def _contiguous_rule(L, P, qr, kr):
    """The plain layout's rule applied to zigzag shards: earlier rank whole, own rank causal, later none."""
    nq, nk = len(zigzag_positions_by(L, P, qr)), len(zigzag_positions_by(L, P, kr))
    if kr < qr:
        return torch.ones(nq, nk, dtype=torch.bool)
    if kr > qr:
        return torch.zeros(nq, nk, dtype=torch.bool)
    return torch.ones(nq, nk, dtype=torch.bool).tril()


def _local_tril(L, P, qr, kr):
    """Local row indices compared instead of global positions."""
    nq, nk = len(zigzag_positions_by(L, P, qr)), len(zigzag_positions_by(L, P, kr))
    return torch.ones(nq, nk, dtype=torch.bool).tril()


def build() -> FunctionSpec:
    from hypothesis import strategies as st

    cases = st.integers(1, 4).flatmap(lambda P: st.tuples(st.integers(0, 6 * P + 3), st.just(P),
                                                          st.integers(0, P - 1), st.integers(0, P - 1)))
    return FunctionSpec(
        "zigzag_block_mask", _reference, cases, max_examples=60, arg_names=("L", "P", "q_rank", "k_rank"),
        examples=((8, 2, 0, 1), (8, 2, 1, 1), (11, 3, 2, 0), (13, 3, 0, 2), (5, 4, 3, 3), (9, 2, 1, 0), (1, 1, 0, 0),
                  (14, 2, 0, 0)),
        dtype=("a bool tensor", lambda L, P, q_rank, k_rank: torch.bool),
        unavailable=("attention_core.distributed.layout.positions", "attention_core.distributed.positions",
                     "attention_core.distributed.layout.segments", "attention_core.distributed.segments",
                     "attention_core.distributed.layout.shard", "attention_core.distributed.shard",
                     "attention_core.distributed.ring.block_plan", "attention_core.distributed.block_plan"),
        task="to work out the zigzag positions and the mask yourself",
        mistakes=(
            Mistake("zigzag shards are not contiguous: compare global positions, not rank order (a later rank "
                    "still holds keys that an earlier rank's late chunk sees).", _contiguous_rule),
            Mistake("a query sees its own position: keep the diagonal (q >= k, not q > k).",
                    lambda L, P, q, k: _mask(L, P, q, k, strict=True)),
            Mistake("rank r holds chunks r and 2P-1-r (mirror images), not r and r+P.",
                    lambda L, P, q, k: _mask(L, P, q, k, pair=lambda r, P: r + P)),
            Mistake("chunks are cut as torch.tensor_split cuts them: the first L % 2P chunks hold one more "
                    "position (not equal chunks with the rest at the end).",
                    lambda L, P, q, k: _mask(L, P, q, k, sizes="floor")),
            Mistake("torch.chunk is not torch.tensor_split: it cuts chunks of ceil(L / 2P) positions, the last ones "
                    "short or missing; tensor_split gives the first L % 2P chunks one more position.",
                    lambda L, P, q, k: _mask(L, P, q, k, sizes="chunk")),
            Mistake("rows are queries, columns keys, and a query sees keys at or before it: q >= k, not q <= k.",
                    lambda L, P, q, k: _mask(L, P, q, k, transpose=True)),
            Mistake("local row numbers are not positions: a lower triangle of the block is the mask only when "
                    "both shards hold the same contiguous run.", _local_tril),
        ),
    )
