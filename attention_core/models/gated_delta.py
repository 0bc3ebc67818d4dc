"""A Gated DeltaNet token mixer: the gated delta rule as an attention layer with a fixed-size state.

The layer of Yang, Kautz & Hatamizadeh ("Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025,
section 3.4, "Token mixer block"), per head ``h`` and token ``t`` of the input ``x`` (B, L, D)::

    q, k, v = SiLU(ShortConv(W_q x)), SiLU(ShortConv(W_k x)), SiLU(ShortConv(W_v x))   (per head: E, E, Ev)
    q, k    = q / |q|, k / |k|                                          (L2 normalization, "for training stability")
    alpha_t = exp(-exp(A_log_h) * softplus(w_a . x_t + dt_bias_h))      (in (0, 1]: Mamba2's decay)
    beta_t  = sigmoid(w_b . x_t)                                        (in (0, 1): the write strength)
    S_t     = S_{t-1} (alpha_t (I - beta_t k_t k_t^T)) + beta_t v_t k_t^T,   o_t = S_t q_t      (eq. (10))
    y       = W_o [RMSNorm(o_t) * SiLU(W_g x_t)]                        (output normalization and gate)

What is included, from the paper's section 3.4: the q/k/v projections, the short causal depthwise convolution
(``conv_size`` taps, 4 as in the paper's code) followed by SiLU, L2-normalized queries and keys, a per-token,
per-head decay ``alpha`` from a learned rate (``A_log``, ``dt_bias``: the Mamba2 parameterization the paper builds
on) and write strength ``beta`` from a sigmoid, the per-head RMSNorm of the output times a SiLU gate (following
RetNet, Sun et al. 2023, as the paper says), the output projection.

What is left out or differs: no fused kernels (the chunkwise form runs in PyTorch:
:func:`attention_core.linear_attention.gated_delta_rule_chunked`'s algorithm); no ``1/sqrt(E)`` on the query
(eq. (10) reads ``o_t = S_t q_t``; the paper's released kernels scale the query); one key head per value head
(no grouped heads); ``beta`` stays in (0, 1) (not the (0, 2) of the paper's footnote); the SwiGLU MLP and the
hybrid stacks (H1, H2) are the model's business, not the mixer's. The decode step is the recurrent form, one
token at a time, with :class:`GatedDeltaNetState`: the convolution's last ``conv_size - 1`` inputs and the
(B, H, Ev, E) memory, whatever the number of tokens seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention_core._checks import check_int, check_positive_int, check_tensor, fmt_shape
from attention_core.linear_attention import _gated_delta_chunked, _gated_delta_recurrent
from attention_core.models._inputs import check_sequence_input, check_state_tensors

__all__ = ["GatedDeltaLayer", "GatedDeltaNet", "GatedDeltaNetState"]


@dataclass
class GatedDeltaNetState:
    """What :class:`GatedDeltaNet` keeps between calls while decoding.

    Attributes:
        conv: (B, conv_size - 1, 2 H E + H Ev), the last projected inputs of the short convolution (zeros before
            the first token), or ``None`` without a convolution.
        S: (B, H, Ev, E), the gated delta rule's memory.
    """

    conv: Optional[torch.Tensor]
    S: torch.Tensor

    def nbytes(self) -> int:
        """Bytes held: fixed, whatever the number of tokens seen."""
        return sum(t.numel() * t.element_size() for t in (self.conv, self.S) if t is not None)


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer (batch-first), causal; see the module's docstring for its equations.

    Args:
        embed_dim: D, the width of the input and the output.
        num_heads: H.
        head_dim: E, the query/key width per head (default ``D // H``).
        value_dim: Ev, the value width per head (default ``head_dim``).
        conv_size: taps of the short causal convolution on q, k and v (0: none).
        chunk_size: tokens per chunk of the chunkwise form in :meth:`forward`.
        norm_eps: the output RMSNorm's epsilon.
    """

    def __init__(self, embed_dim: int, num_heads: int, head_dim: Optional[int] = None,
                 value_dim: Optional[int] = None, conv_size: int = 4, chunk_size: int = 64,
                 norm_eps: float = 1e-5) -> None:
        super().__init__()
        D, H = check_positive_int(embed_dim, "embed_dim"), check_positive_int(num_heads, "num_heads")
        if head_dim is None and D % H:
            raise ValueError(f"embed_dim ({D}) must be divisible by num_heads ({H}) when head_dim is not given")
        E = D // H if head_dim is None else check_positive_int(head_dim, "head_dim")
        Ev = E if value_dim is None else check_positive_int(value_dim, "value_dim")
        self.num_heads, self.head_dim, self.value_dim = H, E, Ev
        self.conv_size = check_int(conv_size, "conv_size", low=0)
        self.chunk_size = check_positive_int(chunk_size, "chunk_size")
        self.q_proj = nn.Linear(D, H * E, bias=False)
        self.k_proj = nn.Linear(D, H * E, bias=False)
        self.v_proj = nn.Linear(D, H * Ev, bias=False)
        channels = 2 * H * E + H * Ev
        self.conv_weight = nn.Parameter(torch.empty(channels, 1, conv_size)) if conv_size else None  # depthwise
        if self.conv_weight is not None:
            nn.init.kaiming_uniform_(self.conv_weight, a=math.sqrt(5))  # nn.Conv1d's initialization
        self.a_proj = nn.Linear(D, H, bias=False)  # the decay's rate, per head
        self.b_proj = nn.Linear(D, H, bias=False)  # the write strength, per head
        # Mamba2's decay: A in [1, 16], dt = softplus(. + dt_bias) starting in [0.001, 0.1] (log-uniform)
        self.A_log = nn.Parameter(torch.empty(H).uniform_(1, 16).log())
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus
        self.g_proj = nn.Linear(D, H * Ev, bias=False)  # the output gate
        self.o_norm = nn.RMSNorm(Ev, eps=norm_eps)  # per head, one weight shared by the heads
        self.o_proj = nn.Linear(H * Ev, D, bias=False)

    # -- pieces

    def _conv(self, proj: torch.Tensor, past: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The short causal depthwise convolution, then SiLU: proj (B, L, C) -> (B, L, C), and the new conv state
        (the last ``conv_size - 1`` inputs, the ones before this call included)."""
        if self.conv_weight is None:
            return F.silu(proj), None
        B, L, C = proj.shape
        K = self.conv_size
        if past is None:
            past = proj.new_zeros(B, K - 1, C)  # the tokens before the first are zeros
        seq = torch.cat([past, proj], dim=1)  # (B, K - 1 + L, C)
        out = F.conv1d(seq.transpose(1, 2), self.conv_weight, groups=C)  # (B, C, K - 1 + L) -> (B, C, L)
        return F.silu(out.transpose(1, 2)), seq[:, seq.shape[1] - (K - 1):]  # (B, L, C), (B, K - 1, C)

    def gates(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(log alpha, beta)`` of every token and head, each (B, H, L): ``log alpha <= 0``, ``beta`` in (0, 1)."""
        log_alpha = -self.A_log.exp() * F.softplus(self.a_proj(x) + self.dt_bias)  # (B, L, H)
        beta = torch.sigmoid(self.b_proj(x))  # (B, L, H)
        return log_alpha.transpose(1, 2), beta.transpose(1, 2)  # (B, L, H) -> (B, H, L)

    def _heads(self, x: torch.Tensor, state: Optional[GatedDeltaNetState], keep: Optional[torch.Tensor] = None
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        B, L, _ = x.shape
        H, E, Ev = self.num_heads, self.head_dim, self.value_dim
        proj = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # (B, L, 2HE + HEv)
        if keep is not None:  # a skipped token enters the convolution as the zeros before the first token
            proj = proj * keep.unsqueeze(-1).to(proj.dtype)
        mixed, conv = self._conv(proj, None if state is None else state.conv)
        q, k, v = mixed.split([H * E, H * E, H * Ev], dim=-1)
        q = F.normalize(q.view(B, L, H, E), dim=-1).transpose(1, 2)  # (B, L, H, E) -> (B, H, L, E)
        k = F.normalize(k.view(B, L, H, E), dim=-1).transpose(1, 2)  # (B, L, H, E) -> (B, H, L, E)
        v = v.view(B, L, H, Ev).transpose(1, 2)  # (B, L, H, Ev) -> (B, H, L, Ev)
        return q, k, v, conv

    def _out(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        o = o.transpose(1, 2)  # (B, H, L, Ev) -> (B, L, H, Ev)
        gate = F.silu(self.g_proj(x)).view(B, L, self.num_heads, self.value_dim)  # (B, L, H, Ev)
        return self.o_proj((self.o_norm(o) * gate).reshape(B, L, -1))  # (B, L, H Ev) -> (B, L, D)

    def _check(self, x: object, state: object) -> None:
        check_sequence_input(x, "x", self.q_proj.weight)
        if state is None:
            return
        B = x.shape[0]
        want = {"S": (B, self.num_heads, self.value_dim, self.head_dim)}
        if self.conv_weight is not None:
            want["conv"] = (B, self.conv_size - 1, self.conv_weight.shape[0])
        check_state_tensors(state, "state", GatedDeltaNetState, want, self.q_proj.weight)

    # -- the public calls

    def forward(self, x: torch.Tensor, state: Optional[GatedDeltaNetState] = None, *,
                keep: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, GatedDeltaNetState]:
        """The mixer over a sequence, chunk by chunk (``chunk_size``), continuing from ``state`` if given.

        Args:
            x: (B, L, D), the module's dtype and device.
            state: a :class:`GatedDeltaNetState` from an earlier call (the tokens before ``x``), or ``None``.
            keep: (B, L) bool, or ``None`` (every token): the tokens the state reads. A skipped token (left
                padding) writes nothing (``beta = 0``, ``alpha = 1``) and enters the short convolution as zeros,
                so a row computes what it computes without them; its own output is not meaningful.

        Returns:
            ``(y (B, L, D), state after the last token)``.
        """
        self._check(x, state)
        if keep is not None:
            check_tensor(keep, "keep")
            if keep.dtype != torch.bool or tuple(keep.shape) != tuple(x.shape[:2]):
                raise ValueError(f"keep must be a bool (B, L) = {tuple(x.shape[:2])} tensor, got {keep.dtype} "
                                 f"{fmt_shape(keep.shape)}")
        q, k, v, conv = self._heads(x, state, keep)
        log_alpha, beta = self.gates(x)
        if keep is not None:
            on = keep.unsqueeze(1).to(beta.dtype)  # (B, L) -> (B, 1, L)
            log_alpha, beta = log_alpha * on, beta * on
        o, S = _gated_delta_chunked(q, k, v, log_alpha, beta, None if state is None else state.S, self.chunk_size)
        return self._out(x, o), GatedDeltaNetState(conv, S)

    def step(self, x: torch.Tensor, state: Optional[GatedDeltaNetState] = None
             ) -> Tuple[torch.Tensor, GatedDeltaNetState]:
        """One decoding step with the recurrent form: x (B, D) -> ``(y (B, D), state)``; equal to :meth:`forward`
        on the whole sequence, token after token."""
        check_tensor(x, "x")
        if x.dim() != 2:
            raise ValueError(f"x must be one token per row, (B, D), got {fmt_shape(x.shape)}")
        x = x.unsqueeze(1)  # (B, D) -> (B, 1, D)
        self._check(x, state)
        q, k, v, conv = self._heads(x, state)
        log_alpha, beta = self.gates(x)
        o, S = _gated_delta_recurrent(q, k, v, log_alpha, beta, None if state is None else state.S)
        return self._out(x, o).squeeze(1), GatedDeltaNetState(conv, S)  # (B, 1, D) -> (B, D)


class GatedDeltaLayer(nn.Module):
    """A :class:`GatedDeltaNet` in a :class:`~attention_core.models.language_model.DecoderLM`'s stack (a ``"D"`` of
    ``layer_pattern``), called as the model calls its attention layers: ``(x, rotary, cache, layer, plan, ...)``.

    It has no positions (the delta rule's recurrence orders the tokens) and no keys or values: with a cache it
    reads and writes its :class:`GatedDeltaNetState` in ``cache.state(layer)`` (fixed size, whatever the number
    of tokens). It reads the whole text through its state: a ``window`` (a rolling cache, or a window without a
    cache) limits the attention layers only. Left padding (``plan.real``) is skipped (``keep``). It returns no
    attention weights (``None``).

    Args:
        embed_dim: D; num_heads: H (head width ``D // H``); the rest as :class:`GatedDeltaNet`'s defaults.
    """

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.mixer = GatedDeltaNet(embed_dim, num_heads)

    def forward(self, x: torch.Tensor, rotary: object, cache: object, layer: int, plan: object,
                need_weights: bool = False, absorbed: bool = False) -> Tuple[torch.Tensor, None]:
        """(B, L, D) -> ``(y (B, L, D), None)``, continuing the state the cache holds at ``layer``."""
        state = None if cache is None else cache.state(layer)
        y, state = self.mixer(x, state, keep=getattr(plan, "real", None))
        if cache is not None:
            cache.set_state(layer, state)
        return y, None

    def state_bytes(self, batch: int = 1, bytes_per_element: int = 4) -> int:
        """Bytes of its :class:`GatedDeltaNetState` for ``batch`` sequences: ``(conv_size - 1) (2 H E + H Ev)``
        convolution inputs and the ``H Ev E`` memory per sequence."""
        m = self.mixer
        conv = 0 if m.conv_weight is None else (m.conv_size - 1) * m.conv_weight.shape[0]
        return batch * bytes_per_element * (conv + m.num_heads * m.value_dim * m.head_dim)
