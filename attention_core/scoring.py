"""Score functions: how much a query (..., L, Dq) "matches" each key (..., S, Dk), as scores (..., L, S).

Attention is ``softmax(score(q, k)) @ v``; the lineage differs mostly in the score:

============ ================================== =============================== =====================
name         score(q, k)                        parameters                      from
============ ================================== =============================== =====================
dot          q . k                              none (Dq == Dk)                 Sukhbaatar et al. 2015
scaled_dot   q . k / sqrt(D)                    none (Dq == Dk)                 Vaswani et al. 2017
cosine       cos(q, k) / temperature            none                            Graves et al. 2014
general      q^T W k                            W (Dq, Dk)                      Luong et al. 2015
additive     v^T tanh(W_q q + W_k k)            W_q, W_k, v                     Bahdanau et al. 2014
concat       v^T tanh(W_c [q; k])               W_c, v                          Luong et al. 2015
============ ================================== =============================== =====================

(The dot score is Sukhbaatar et al.'s memory-network match; Luong et al. gave the score its name, "dot".)

Pure functions where there is nothing to learn, small ``nn.Module`` subclasses where there is;
:func:`make_score` builds any of them by name (always as a module, so a model can hold it as a submodule).
The modules never cast their inputs: query and key must have the parameters' dtype and device (convert the
input, or the module with ``.to(...)``), else a ``TypeError``/``ValueError`` says which.
"""

from __future__ import annotations

import torch
from torch import nn

from attention_core._checks import (
    broadcast_or_none,
    check_floating,
    check_min_rank,
    check_module_input,
    check_positive_float,
    check_positive_int,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_tensor,
    fmt_shape,
    short_repr,
)
from attention_core.backends.inputs import scale_or_default

__all__ = [
    "SCORES",
    "AdditiveScore",
    "ConcatScore",
    "CosineScore",
    "DotScore",
    "GeneralScore",
    "ScaledDotScore",
    "cosine_score",
    "dot_score",
    "make_score",
    "scaled_dot_score",
]


def _check_pair(query: torch.Tensor, key: torch.Tensor, same_dim: bool) -> None:
    """Queries (..., L, Dq) and keys (..., S, Dk) whose leading dims broadcast (and Dq == Dk if asked)."""
    for name, t in (("query", query), ("key", key)):
        check_tensor(t, name)
        check_floating(t, name)
        check_min_rank(t, name, 2, "(..., N, D)")
    check_same_dtype(query=query, key=key)
    check_same_device(query=query, key=key)
    if same_dim and query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same last dim for a dot-product score: got query "
            f"{fmt_shape(query.shape)}, key {fmt_shape(key.shape)} (use GeneralScore or AdditiveScore)"
        )
    if broadcast_or_none(query.shape[:-2], key.shape[:-2]) is None:
        raise ValueError(
            f"the leading dims of query {fmt_shape(query.shape)} and key {fmt_shape(key.shape)} "
            "do not broadcast"
        )


def _check_last_dim(x: torch.Tensor, name: str, expected: int, weight: torch.Tensor) -> None:
    if x.shape[-1] != expected:
        raise ValueError(f"{name} must have last dim {expected}, got shape {fmt_shape(x.shape)}")
    check_module_input(x, name, weight)


def dot_score(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``q . k`` for every pair: (..., L, D), (..., S, D) -> (..., L, S)."""
    _check_pair(query, key, same_dim=True)
    return query @ key.transpose(-2, -1)  # (..., L, D) @ (..., D, S) -> (..., L, S)


def scaled_dot_score(query: torch.Tensor, key: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``q . k * scale``, ``scale`` defaulting to ``1/sqrt(D)``: (..., L, D), (..., S, D) -> (..., L, S).

    Why ``1/sqrt(D)``: for q, k with independent unit-variance entries, ``q . k`` has variance D; scaling
    brings it back to 1, so the softmax does not saturate as D grows.
    """
    _check_pair(query, key, same_dim=True)
    scale = check_scale(scale)
    if query.shape[-1] == 0:
        raise ValueError(
            f"query and key must have at least one feature (D >= 1 in dim -1) for a scaled score: got query "
            f"{fmt_shape(query.shape)}, key {fmt_shape(key.shape)}"
        )
    scale = scale_or_default(scale, query.shape[-1])
    return query @ key.transpose(-2, -1) * scale  # (..., L, D) @ (..., D, S) -> (..., L, S)


def cosine_score(
    query: torch.Tensor, key: torch.Tensor, temperature: float = 1.0, eps: float = 1e-8
) -> torch.Tensor:
    """Cosine similarity divided by ``temperature``: (..., L, D), (..., S, D) -> (..., L, S), in [-1/t, 1/t].

    ``eps`` (a float > 0) guards zero vectors (their score is 0).
    """
    _check_pair(query, key, same_dim=True)
    temperature = check_positive_float(temperature, "temperature")
    eps = check_positive_float(eps, "eps")
    eps = min(eps, torch.finfo(query.dtype).max)  # an eps beyond the dtype's range acts as its largest value
    q = query / query.norm(dim=-1, keepdim=True).clamp_min(eps)  # (..., L, D), unit rows
    k = key / key.norm(dim=-1, keepdim=True).clamp_min(eps)  # (..., S, D), unit rows
    return q @ k.transpose(-2, -1) / temperature  # (..., L, D) @ (..., D, S) -> (..., L, S)


class DotScore(nn.Module):
    """Module form of :func:`dot_score`."""

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return dot_score(query, key)


class ScaledDotScore(nn.Module):
    """Module form of :func:`scaled_dot_score`."""

    def __init__(self, scale: float | None = None) -> None:
        super().__init__()
        self.scale = check_scale(scale)

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return scaled_dot_score(query, key, self.scale)


class CosineScore(nn.Module):
    """Module form of :func:`cosine_score`."""

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        self.temperature = check_positive_float(temperature, "temperature")

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return cosine_score(query, key, self.temperature)


class GeneralScore(nn.Module):
    """Luong's "general" (bilinear) score ``q^T W k``; queries and keys may differ in size.

    Args:
        query_dim: Dq.
        key_dim: Dk.
    """

    def __init__(self, query_dim: int, key_dim: int) -> None:
        super().__init__()
        self.query_dim = check_positive_int(query_dim, "query_dim")
        self.key_dim = check_positive_int(key_dim, "key_dim")
        self.W = nn.Linear(key_dim, query_dim, bias=False)  # weight (Dq, Dk): W k

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """(..., L, Dq), (..., S, Dk) -> (..., L, S)."""
        _check_pair(query, key, same_dim=False)
        _check_last_dim(query, "query", self.query_dim, self.W.weight)
        _check_last_dim(key, "key", self.key_dim, self.W.weight)
        return query @ self.W(key).transpose(-2, -1)  # (..., L, Dq) @ (..., Dq, S) -> (..., L, S)


class AdditiveScore(nn.Module):
    """Bahdanau's additive score ``v^T tanh(W_q q + W_k k)``.

    Computed by broadcasting: (..., L, 1, d_a) + (..., 1, S, d_a) -> (..., L, S, d_a), so it holds an
    (L, S, d_a) tensor: fine for the sequence lengths of RNN translation, the reason dot products won later.

    Args:
        query_dim: Dq.
        key_dim: Dk.
        hidden_dim: d_a, the size of the hidden layer (the book's notation; not the number of heads H).
    """

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.query_dim = check_positive_int(query_dim, "query_dim")
        self.key_dim = check_positive_int(key_dim, "key_dim")
        check_positive_int(hidden_dim, "hidden_dim")
        self.W_q = nn.Linear(query_dim, hidden_dim, bias=False)
        self.W_k = nn.Linear(key_dim, hidden_dim, bias=False)
        self.v = nn.Linear(hidden_dim, 1, bias=False)

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """(..., L, Dq), (..., S, Dk) -> (..., L, S)."""
        _check_pair(query, key, same_dim=False)
        _check_last_dim(query, "query", self.query_dim, self.W_q.weight)
        _check_last_dim(key, "key", self.key_dim, self.W_q.weight)
        q = self.W_q(query).unsqueeze(-2)  # (..., L, Dq) -> (..., L, 1, H)
        k = self.W_k(key).unsqueeze(-3)  # (..., S, Dk) -> (..., 1, S, H)
        return self.v(torch.tanh(q + k)).squeeze(-1)  # (..., L, S, H) -> (..., L, S, 1) -> (..., L, S)


class ConcatScore(nn.Module):
    """Luong's concat score ``v^T tanh(W_c [q; k])``.

    ``W_c [q; k]`` equals ``W_c[:, :Dq] q + W_c[:, Dq:] k``, so it is computed like :class:`AdditiveScore`,
    by broadcasting, without building the (L, S, Dq + Dk) concatenation. (The two differ by history, not
    algebra: Luong scores the current decoder state, Bahdanau the previous one.)

    Args:
        query_dim: Dq.
        key_dim: Dk.
        hidden_dim: H.
    """

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.query_dim = check_positive_int(query_dim, "query_dim")
        self.key_dim = check_positive_int(key_dim, "key_dim")
        check_positive_int(hidden_dim, "hidden_dim")
        self.W_c = nn.Linear(query_dim + key_dim, hidden_dim, bias=False)  # weight (H, Dq + Dk)
        self.v = nn.Linear(hidden_dim, 1, bias=False)

    def forward(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """(..., L, Dq), (..., S, Dk) -> (..., L, S)."""
        _check_pair(query, key, same_dim=False)
        _check_last_dim(query, "query", self.query_dim, self.W_c.weight)
        _check_last_dim(key, "key", self.key_dim, self.W_c.weight)
        W_q, W_k = self.W_c.weight.split([self.query_dim, self.key_dim], dim=1)  # (H, Dq), (H, Dk)
        q = (query @ W_q.T).unsqueeze(-2)  # (..., L, Dq) @ (Dq, H) -> (..., L, 1, H)
        k = (key @ W_k.T).unsqueeze(-3)  # (..., S, Dk) @ (Dk, H) -> (..., 1, S, H)
        return self.v(torch.tanh(q + k)).squeeze(-1)  # (..., L, S, H) -> (..., L, S)


#: The names :func:`make_score` knows, with the dims each one needs.
SCORES = {
    "dot": (),
    "scaled_dot": (),
    "cosine": (),
    "general": ("query_dim", "key_dim"),
    "additive": ("query_dim", "key_dim", "hidden_dim"),
    "concat": ("query_dim", "key_dim", "hidden_dim"),
}


def make_score(
    name: str,
    query_dim: int | None = None,
    key_dim: int | None = None,
    hidden_dim: int | None = None,
) -> nn.Module:
    """Build a score module by name: one of :data:`SCORES`.

    Args:
        name: "dot", "scaled_dot", "cosine", "general", "additive" or "concat".
        query_dim: Dq (needed by general, additive, concat).
        key_dim: Dk (needed by general, additive, concat).
        hidden_dim: H (needed by additive, concat).

    Returns:
        An ``nn.Module`` mapping (query (..., L, Dq), key (..., S, Dk)) to scores (..., L, S).
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, one of {sorted(SCORES)}; got {type(name).__name__} {short_repr(name)}")
    if name not in SCORES:
        raise ValueError(f"unknown score name {name!r}; known scores: {sorted(SCORES)}")
    dims = {"query_dim": query_dim, "key_dim": key_dim, "hidden_dim": hidden_dim}
    missing = [d for d in SCORES[name] if dims[d] is None]
    if missing:
        raise ValueError(f"score {name!r} needs {', '.join(SCORES[name])}; missing: {', '.join(missing)}")
    if not SCORES[name]:
        if query_dim is not None and key_dim is not None and query_dim != key_dim:
            raise ValueError(
                f"score {name!r} compares q . k, so query_dim must equal key_dim, "
                f"got {query_dim} and {key_dim}"
            )
        return {"dot": DotScore, "scaled_dot": ScaledDotScore, "cosine": CosineScore}[name]()
    if name == "general":
        return GeneralScore(query_dim, key_dim)
    return {"additive": AdditiveScore, "concat": ConcatScore}[name](query_dim, key_dim, hidden_dim)
