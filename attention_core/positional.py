"""Positional information for attention: sinusoidal encodings, learned embeddings, rotary embeddings.

Attention by itself treats its keys as a set: permuting the inputs permutes the outputs and nothing else.
Three ways of telling it where each token sits:

- **Sinusoidal encoding** (Vaswani et al., 2017), a fixed table added to the token embeddings::

      PE[pos, 2i]     = sin(pos / base^(2i / D))
      PE[pos, 2i + 1] = cos(pos / base^(2i / D))

  :func:`sinusoidal_encoding` builds the table, :class:`SinusoidalPositionalEncoding` adds it.
- **Learned embedding** (BERT, GPT-2): a trainable (max_len, D) table added to the token embeddings,
  :class:`LearnedPositionalEmbedding`. It knows nothing beyond ``max_len``.
- **Rotary embedding**, RoPE (Su et al., 2021): queries and keys (not values) are rotated, pair of features
  by pair of features, by an angle proportional to their position, so that the score ``q_m . k_n`` depends
  on the positions only through the offset ``m - n``. :func:`apply_rotary` rotates one tensor,
  :class:`RotaryEmbedding` precomputes the angles and rotates a query and a key together.

RoPE pairs features in one of two layouts: ``interleaved=False`` (default; GPT-NeoX and Hugging Face's Llama
code) pairs feature ``i`` with ``i + E/2``; ``interleaved=True`` (the RoFormer paper and Meta's reference Llama
code) pairs ``2i`` with ``2i + 1``. Hugging Face permutes the rows of Llama's W_Q and W_K so that the
half-split layout gives the same scores as Meta's.
Both rotate pair ``i`` by ``pos * base^(-2i / E)`` and have the relative property.
"""

from __future__ import annotations

from typing import Tuple, Union

import torch
from torch import nn

from attention_core._checks import (
    check_bool_flag,
    check_device,
    check_dropout,
    check_floating,
    check_floating_dtype,
    check_positive_float,
    check_positive_int,
    check_real,
    check_tensor,
    fmt_shape,
)

__all__ = [
    "LearnedPositionalEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionalEncoding",
    "apply_rotary",
    "rotary_angles",
    "rotate_half",
    "sinusoidal_encoding",
]

Device = Union[torch.device, str, None]


def _check_base(base: object) -> float:
    return check_real(base, "base", low=1, low_open=True)


def _check_even(dim: object, name: str) -> int:
    check_positive_int(dim, name)
    if dim % 2:
        raise ValueError(f"{name} must be even (features come in (sin, cos) or rotation pairs), got {dim}")
    return dim


def _check_offset(offset: object, name: str = "offset") -> int:
    return check_positive_int(offset, name, allow_zero=True)


# ------------------------------------------------------------------------------------------- sinusoidal


def sinusoidal_encoding(
    num_positions: int,
    d_model: int,
    base: float = 10000.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: Device = None,
) -> torch.Tensor:
    """The sinusoidal table of Vaswani et al. (2017): (num_positions, d_model).

    Column ``2i`` holds ``sin(pos * w_i)`` and column ``2i + 1`` holds ``cos(pos * w_i)``, with the
    frequency ``w_i = base^(-2i / d_model)``: from one radian per position (``i = 0``) down to about
    ``1 / base`` radian per position. Row 0 is ``[0, 1, 0, 1, ...]``.

    Args:
        num_positions: number of rows (positions 0 .. num_positions - 1); may be 0.
        d_model: number of columns; must be even.
        base: the wavelength scale (10000 in the paper).
        dtype: floating dtype of the result (computed in float64, then cast).
        device: where to allocate.

    Returns:
        Tensor (num_positions, d_model).
    """
    num_positions = check_positive_int(num_positions, "num_positions", allow_zero=True)
    d_model = _check_even(d_model, "d_model")
    base = _check_base(base)
    check_floating_dtype(dtype)
    device = check_device(device)
    if num_positions * d_model > 2**63 - 1:
        raise ValueError(f"num_positions * d_model = {num_positions} * {d_model} is more than a tensor can hold")
    pos = torch.arange(num_positions, dtype=torch.float64)[:, None]  # (P,) -> (P, 1)
    freq = base ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (D/2,)
    angles = pos * freq  # (P, 1) * (D/2,) -> (P, D/2)
    table = torch.stack([angles.sin(), angles.cos()], dim=-1)  # (P, D/2, 2)
    return table.reshape(num_positions, d_model).to(device=device, dtype=dtype)  # (P, D/2, 2) -> (P, D)


def _check_sequence(x: object, d_model: int, offset: int, table: torch.Tensor, kind: str) -> torch.Tensor:
    """Validate a (B, L, D) input to an additive positional layer whose table has ``max_len`` rows."""
    max_len = table.shape[0]
    check_tensor(x, "x")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"x must be (B, L, D) with D = d_model = {d_model}, got shape {fmt_shape(x.shape)}")
    check_floating(x, "x")
    if x.device != table.device:
        raise ValueError(f"x is on {x.device} but the {kind} table is on {table.device}; move one of them")
    L = x.shape[1]
    if offset + L > max_len:
        raise ValueError(
            f"x has sequence length L = {L} (positions {offset} .. {offset + L - 1}) but the {kind} table "
            f"holds max_len = {max_len} positions; build it with a larger max_len"
        )
    return x


class SinusoidalPositionalEncoding(nn.Module):
    """Adds the sinusoidal table to a batch of embeddings (then dropout, as in the paper).

    The table is a buffer (saved with the model, never trained), precomputed for ``max_len`` positions.

    Args:
        d_model: embedding width D (even).
        max_len: positions precomputed; longer inputs raise ``ValueError``.
        base: see :func:`sinusoidal_encoding`.
        dropout: dropout on the sum, in training mode.
    """

    def __init__(self, d_model: int, max_len: int = 512, base: float = 10000.0, dropout: float = 0.0) -> None:
        super().__init__()
        self.d_model = _check_even(d_model, "d_model")
        self.max_len = check_positive_int(max_len, "max_len")
        self.base = _check_base(base)
        self.dropout = nn.Dropout(check_dropout(dropout, "dropout"))
        self.register_buffer("table", sinusoidal_encoding(max_len, d_model, self.base), persistent=False)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, max_len={self.max_len}, base={self.base:g}"

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``x + PE[offset : offset + L]``: (B, L, D) -> (B, L, D).

        Args:
            x: (B, L, D) embeddings.
            offset: position of ``x[:, 0]`` (nonzero when decoding one token at a time).
        """
        offset = _check_offset(offset)
        x = _check_sequence(x, self.d_model, offset, self.table, "sinusoidal")
        pe = self.table[offset : offset + x.shape[1]].to(x.dtype)  # (L, D)
        return self.dropout(x + pe)  # (B, L, D) + (L, D) -> (B, L, D)


class LearnedPositionalEmbedding(nn.Module):
    """A trainable position table added to a batch of embeddings (BERT, GPT-2).

    Args:
        max_len: number of positions with a row; longer inputs raise ``ValueError`` (there is no row to
            look up, which is this method's known limit).
        d_model: embedding width D.
        dropout: dropout on the sum, in training mode.
        init_std: standard deviation of the normal initialisation (0.02 as in GPT-2 and BERT), >= 0.
    """

    def __init__(self, max_len: int, d_model: int, dropout: float = 0.0, init_std: float = 0.02) -> None:
        super().__init__()
        self.max_len = check_positive_int(max_len, "max_len")
        self.d_model = check_positive_int(d_model, "d_model")
        init_std = check_positive_float(init_std, "init_std", allow_zero=True)
        if max_len * d_model > 2**63 - 1:
            raise ValueError(f"max_len * d_model = {max_len} * {d_model} is more than a tensor can hold")
        self.weight = nn.Parameter(torch.empty(max_len, d_model))
        nn.init.normal_(self.weight, std=init_std)
        self.dropout = nn.Dropout(check_dropout(dropout, "dropout"))

    def extra_repr(self) -> str:
        return f"max_len={self.max_len}, d_model={self.d_model}"

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """``x + P[offset : offset + L]``: (B, L, D) -> (B, L, D), in ``x``'s dtype (the table is cast to it,
        as :class:`SinusoidalPositionalEncoding` does; gradients still reach the float32 table)."""
        offset = _check_offset(offset)
        x = _check_sequence(x, self.d_model, offset, self.weight, "learned")
        return self.dropout(x + self.weight[offset : offset + x.shape[1]].to(x.dtype))  # (B, L, D) + (L, D)


# ----------------------------------------------------------------------------------------------- rotary


def rotary_angles(
    positions: torch.Tensor, head_dim: int, base: float = 10000.0
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the RoPE angles ``pos * base^(-2i / head_dim)``, each (L, head_dim / 2).

    Args:
        positions: (L,) positions (integer or floating); computed in float64.
        head_dim: E, the query/key size per head (even).
        base: the wavelength scale (10000 in RoFormer and Llama 2).

    Returns:
        ``(cos, sin)``, float64 tensors (L, E/2) on ``positions``' device.
    """
    _check_positions(positions)
    head_dim = _check_even(head_dim, "head_dim")
    base = _check_base(base)
    freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim)
    angles = positions.to(torch.float64)[:, None] * freq  # (L, 1) * (E/2,) -> (L, E/2)
    return angles.cos(), angles.sin()


def _check_positions(positions: object, L: int | None = None, x: torch.Tensor | None = None) -> torch.Tensor:
    check_tensor(positions, "positions")
    if positions.dim() != 1 or (L is not None and positions.shape[0] != L):
        want = "1-D (L,)" if L is None else f"(L,) = ({L},) for x of shape {fmt_shape(x.shape)}"
        raise ValueError(f"positions must be {want}, got shape {fmt_shape(positions.shape)}")
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"positions must be integer or floating, got dtype {positions.dtype}")
    if x is not None and positions.device != x.device:
        raise ValueError(f"positions must be on the device of x ({x.device}), got {positions.device}")
    return positions


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last dim (halves): the 90-degree turn of every (i, i + E/2) pair.

    Args:
        x: (..., E) floating, E even.
    """
    x = _check_rotary_input(x, "x", min_rank=1)
    x1, x2 = x.chunk(2, dim=-1)  # (..., E) -> 2 x (..., E/2)
    return torch.cat([-x2, x1], dim=-1)  # -> (..., E)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate (..., L, E) by angles given as (L, E/2) cos/sin tables (already in x's dtype)."""
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))  # (..., L, E) -> (..., L, E/2, 2)
        a, b = pairs[..., 0], pairs[..., 1]  # (..., L, E/2) each
        out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)  # (..., L, E/2, 2)
        return out.flatten(-2)  # (..., L, E/2, 2) -> (..., L, E)
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)  # (L, E/2) -> (L, E)
    return x * cos + rotate_half(x) * sin


def _check_rotary_input(x: object, name: str, min_rank: int = 2) -> torch.Tensor:
    check_tensor(x, name)
    if x.dim() < min_rank:
        layout = "(..., L, E)" if min_rank == 2 else "(..., E)"
        raise ValueError(f"{name} must have at least {min_rank} dims {layout}, got shape {fmt_shape(x.shape)}")
    check_floating(x, name)
    if x.shape[-1] % 2 or x.shape[-1] == 0:
        raise ValueError(
            f"{name} must have an even last dim E >= 2 (RoPE rotates features in pairs), "
            f"got shape {fmt_shape(x.shape)}"
        )
    return x


def apply_rotary(
    x: torch.Tensor,
    positions: torch.Tensor | None = None,
    base: float = 10000.0,
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate queries or keys by their positions (RoPE).

    Pair ``i`` of the features of the token at position ``m`` turns by the angle ``m * base^(-2i / E)``, so
    that ``apply_rotary(q)[m] . apply_rotary(k)[n]`` depends on ``m`` and ``n`` only through ``m - n``.

    Args:
        x: (..., L, E) with E even, e.g. (B, H, L, E) queries.
        positions: (L,) position of each row; default ``0 .. L - 1``.
        base: the wavelength scale.
        interleaved: pair features ``(2i, 2i + 1)`` (RoFormer, Meta's Llama code) instead of ``(i, i + E/2)``
            (GPT-NeoX, Hugging Face's Llama code).

    Returns:
        Tensor of ``x``'s shape and dtype; the norm of every pair is unchanged.
    """
    x = _check_rotary_input(x, "x")
    check_bool_flag(interleaved, "interleaved")
    L = x.shape[-2]
    if positions is None:
        positions = torch.arange(L, device=x.device)
    else:
        _check_positions(positions, L, x)
    cos, sin = rotary_angles(positions, x.shape[-1], base)  # (L, E/2) each
    return _rotate(x, cos.to(x.dtype), sin.to(x.dtype), interleaved)


class RotaryEmbedding(nn.Module):
    """RoPE with the angles precomputed for ``max_len`` positions; rotates a query and a key together.

    Args:
        head_dim: E, the size of one head's queries and keys (even).
        max_len: positions precomputed; longer inputs raise ``ValueError``.
        base: the wavelength scale.
        interleaved: the pairing layout (see :func:`apply_rotary`).
    """

    def __init__(
        self, head_dim: int, max_len: int = 2048, base: float = 10000.0, interleaved: bool = False
    ) -> None:
        super().__init__()
        self.head_dim = _check_even(head_dim, "head_dim")
        self.max_len = check_positive_int(max_len, "max_len")
        self.base = _check_base(base)
        self.interleaved = check_bool_flag(interleaved, "interleaved")
        if max_len * head_dim > 2**63 - 1:
            raise ValueError(f"max_len * head_dim = {max_len} * {head_dim} is more than a tensor can hold")
        cos, sin = rotary_angles(torch.arange(max_len), head_dim, self.base)
        self.register_buffer("cos", cos.float(), persistent=False)  # (max_len, E/2)
        self.register_buffer("sin", sin.float(), persistent=False)  # (max_len, E/2)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, max_len={self.max_len}, base={self.base:g}, "
                f"interleaved={self.interleaved}")

    def rotate(self, x: torch.Tensor, offset: int = 0, name: str = "x", offset_name: str = "offset") -> torch.Tensor:
        """Rotate (..., L, E) whose first row sits at position ``offset``."""
        x = _check_rotary_input(x, name)
        offset = _check_offset(offset, offset_name)
        L, E = x.shape[-2:]
        if E != self.head_dim:
            raise ValueError(
                f"{name} must have last dim head_dim = {self.head_dim}, got shape {fmt_shape(x.shape)}"
            )
        if offset + L > self.max_len:
            raise ValueError(
                f"{name} has sequence length L = {L} (positions {offset} .. {offset + L - 1}) but the rotary "
                f"table holds max_len = {self.max_len} positions; build it with a larger max_len"
            )
        if x.device != self.cos.device:
            raise ValueError(f"{name} is on {x.device} but the rotary table is on {self.cos.device}; move one")
        cos = self.cos[offset : offset + L].to(x.dtype)  # (L, E/2)
        sin = self.sin[offset : offset + L].to(x.dtype)  # (L, E/2)
        return _rotate(x, cos, sin, self.interleaved)

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, offset: int = 0, key_offset: int | None = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` (..., L, E) and ``key`` (..., S, E); values are never rotated.

        Args:
            query: (..., L, E), first row at position ``offset``.
            key: (..., S, E), first row at position ``key_offset`` (default ``offset``).
            offset: position of the first query.
            key_offset: position of the first key.

        Returns:
            ``(query, key)`` rotated, same shapes and dtypes.
        """
        if key_offset is None:
            return self.rotate(query, offset, "query"), self.rotate(key, offset, "key")
        return self.rotate(query, offset, "query"), self.rotate(key, key_offset, "key", "key_offset")
