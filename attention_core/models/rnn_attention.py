"""Attention layers of the RNN era: Bahdanau's additive attention and Luong's global and local attention.

Both read a decoder state (the **query**) and the encoder outputs (the **keys**, which are also the
**values**) and return ``(context, weights)``. They differ in *which* decoder state asks:

- :class:`AdditiveAttention` (Bahdanau et al., arXiv 2014 / ICLR 2015) scores with the **previous** state
  ``s_{t-1}``, before the RNN has read the current input: ``e_tj = v^T tanh(W_q s_{t-1} + W_k h_j)``.
- :class:`LuongAttention` (Luong et al., 2015) scores with the **current** state ``h_t`` (dot, general or
  concat score), either over every source position (``mode="global"``) or over a window of ``2D + 1``
  positions around an aligned position ``p_t`` (``"local-m"``: ``p_t = t``; ``"local-p"``: predicted,
  with a Gaussian of standard deviation ``D / 2`` around ``p_t``).

Shapes: a query is (B, Dq) for one decoder step or (B, L, Dq) for L steps at once; keys (B, S, Dk); values
(B, S, Dv); ``attn_mask`` is a (B, S) bool padding mask, True at real source positions (build it from valid
lengths with :func:`attention_core.masks.padding_mask`). Contexts come back as (B, Dv) or (B, L, Dv),
weights as (B, S) or (B, L, S).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from attention_core._checks import check_int, check_tensor, fmt_shape
from attention_core.functional import masked_softmax
from attention_core.scoring import AdditiveScore, ConcatScore, GeneralScore, dot_score

__all__ = [
    "LUONG_MODES",
    "LUONG_SCORES",
    "AdditiveAttention",
    "LuongAttention",
    "gaussian_window",
    "local_attention_weights",
]

LUONG_SCORES = ("dot", "general", "concat")
LUONG_MODES = ("global", "local-m", "local-p")


def _check_dim(x: object, name: str) -> int:
    return check_int(x, name, low=1)


def _check_inputs(query: torch.Tensor, key: torch.Tensor, value: Optional[torch.Tensor],
                  attn_mask: Optional[torch.Tensor], query_dim: int, key_dim: int
                  ) -> Tuple[torch.Tensor, torch.Tensor, bool]:
    """Validate; return the query as (B, L, Dq), the values, and whether the query was a single step."""
    check_tensor(query, "query")
    check_tensor(key, "key")
    if query.dim() not in (2, 3) or query.shape[-1] != query_dim:
        raise ValueError(f"query must be (B, {query_dim}) or (B, L, {query_dim}), got shape "
                         f"{fmt_shape(query.shape)}")
    if key.dim() != 3 or key.shape[-1] != key_dim or key.shape[0] != query.shape[0]:
        raise ValueError(f"key must be (B={query.shape[0]}, S, {key_dim}), got shape {fmt_shape(key.shape)}")
    value = key if value is None else check_tensor(value, "value")
    if value.dim() != 3 or value.shape[:2] != key.shape[:2]:
        raise ValueError(f"value must be (B, S, Dv) with (B, S) = {tuple(key.shape[:2])} of key, got shape "
                         f"{fmt_shape(value.shape)}")
    if attn_mask is not None:
        check_tensor(attn_mask, "attn_mask")
        if attn_mask.dtype != torch.bool or attn_mask.shape != key.shape[:2]:
            raise ValueError(f"attn_mask must be a bool (B, S) = {tuple(key.shape[:2])} padding mask, got "
                             f"shape {fmt_shape(attn_mask.shape)} and dtype {attn_mask.dtype}")
    single = query.dim() == 2
    return (query[:, None, :] if single else query), value, single  # (B, Dq) -> (B, 1, Dq)


def _check_projected(projected_key: torch.Tensor, key: torch.Tensor, features: int) -> None:
    check_tensor(projected_key, "projected_key")
    expected = (*key.shape[:2], features)
    if tuple(projected_key.shape) != expected:
        raise ValueError(f"projected_key must be (B, S, {features}) = {expected}, got shape "
                         f"{fmt_shape(projected_key.shape)}; make it with project_key(key)")


def _finish(weights: torch.Tensor, value: torch.Tensor, single: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    context = weights @ value  # (B, L, S) @ (B, S, Dv) -> (B, L, Dv)
    if single:
        return context[:, 0], weights[:, 0]  # (B, 1, .) -> (B, .)
    return context, weights


class AdditiveAttention(nn.Module):
    """Bahdanau's additive attention: ``e_j = v^T tanh(W_q q + W_k k_j)``, softmax over real positions.

    In Bahdanau's decoder the query is the *previous* decoder state ``s_{t-1}``. The score is
    :class:`attention_core.scoring.AdditiveScore`; this layer adds the padding mask and the weighted sum.

    Args:
        query_dim: size of the decoder state, Dq.
        key_dim: size of an encoder output, Dk (2 x hidden for a bidirectional encoder).
        hidden_dim: size of the hidden layer inside the score.
    """

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.query_dim = _check_dim(query_dim, "query_dim")
        self.key_dim = _check_dim(key_dim, "key_dim")
        self.hidden_dim = _check_dim(hidden_dim, "hidden_dim")
        self.score = AdditiveScore(query_dim, key_dim, hidden_dim)

    def extra_repr(self) -> str:
        return f"query_dim={self.query_dim}, key_dim={self.key_dim}, hidden_dim={self.hidden_dim}"

    def project_key(self, key: torch.Tensor) -> torch.Tensor:
        """``W_k h_j`` for every source position: (B, S, Dk) -> (B, S, hidden_dim).

        It does not depend on the decoder step, so a decoder computes it once per source sentence and
        passes it to every step as ``projected_key`` (Bahdanau et al. note the same saving in their appendix).
        """
        return self.score.W_k(key)

    def scores(self, query: torch.Tensor, key: torch.Tensor, projected_key: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """Raw scores ``e``: (B, L, Dq), (B, S, Dk) -> (B, L, S); ``projected_key`` from :meth:`project_key`."""
        if projected_key is None:
            return self.score(query, key)
        _check_projected(projected_key, key, self.hidden_dim)
        hidden = self.score.W_q(query)[:, :, None, :] + projected_key[:, None, :, :]  # (B, L, 1, A) + (B, 1, S, A)
        return self.score.v(torch.tanh(hidden))[..., 0]  # (B, L, S, A) -> (B, L, S)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, projected_key: Optional[torch.Tensor] = None
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Context and weights for a (B, Dq) or (B, L, Dq) query over (B, S, Dk) keys.

        Args:
            query: (B, Dq) or (B, L, Dq) decoder state(s); key: (B, S, Dk); value: (B, S, Dv), default ``key``.
            attn_mask: (B, S) bool padding mask, True at real positions.
            projected_key: optional (B, S, hidden_dim) result of :meth:`project_key` for this ``key``.

        Returns:
            ``(context, weights)``: (B, Dv) and (B, S) for a (B, Dq) query; (B, L, Dv) and (B, L, S) otherwise.
            Padded positions (``attn_mask`` False) get weight exactly 0.
        """
        q, value, single = _check_inputs(query, key, value, attn_mask, self.query_dim, self.key_dim)
        scores = self.scores(q, key, projected_key)  # (B, L, Dq), (B, S, Dk) -> (B, L, S)
        mask = None if attn_mask is None else attn_mask[:, None, :]  # (B, S) -> (B, 1, S)
        return _finish(masked_softmax(scores, mask), value, single)


def gaussian_window(center: torch.Tensor, S: int, window: int) -> torch.Tensor:
    """``exp(-(s - p)^2 / (2 (D/2)^2))`` for ``s = 0..S-1``: Luong's local-p bump; (...,) -> (..., S).

    ``window = 0`` gives 1 where ``s == p`` exactly and 0 elsewhere (the limit of the bump).
    """
    check_tensor(center, "center")
    check_int(S, "S", low=0)
    check_int(window, "window", low=0)
    s = torch.arange(S, device=center.device, dtype=center.dtype)  # (S,)
    sigma = max(window / 2.0, 1e-6)
    return torch.exp(-((s - center[..., None]) ** 2) / (2.0 * sigma**2))  # (..., 1) - (S,) -> (..., S)


def local_attention_weights(scores: torch.Tensor, center: torch.Tensor, window: int,
                            attn_mask: Optional[torch.Tensor] = None, gaussian: bool = False) -> torch.Tensor:
    """Luong's local attention weights from raw scores.

    Positions outside ``[p - D, p + D]`` (and padding) are masked out before the softmax, so they get weight
    exactly 0; with ``gaussian`` the softmax weights are then multiplied by :func:`gaussian_window` (local-p),
    after which a row no longer sums to 1 (as in the paper).

    Args:
        scores: (B, L, S) raw scores.
        center: (B, L) aligned positions ``p_t`` (float; 0-based source positions).
        window: the half-width D, an int >= 0.
        attn_mask: optional (B, S) bool padding mask, True at real positions.
        gaussian: multiply by the Gaussian bump (local-p) or not (local-m).

    Returns:
        (B, L, S) weights.
    """
    check_int(window, "window", low=0, note="(the half-width D)")
    B, L, S = scores.shape
    if center.shape != (B, L):
        raise ValueError(f"center must be (B, L) = {(B, L)}, got shape {fmt_shape(center.shape)}")
    s = torch.arange(S, device=scores.device, dtype=scores.dtype)  # (S,)
    inside = (s - center[..., None]).abs() <= window  # (B, L, 1) - (S,) -> (B, L, S)
    if attn_mask is not None:
        inside = inside & attn_mask[:, None, :]  # (B, L, S) & (B, 1, S)
    weights = masked_softmax(scores, inside)
    if gaussian:
        weights = weights * gaussian_window(center, S, window)  # (B, L, S) * (B, L, S)
    return weights


class LuongAttention(nn.Module):
    """Luong's attention: score the *current* decoder state ``h_t`` against every encoder output.

    Scores (Luong et al., 2015, eq. 8):

    - ``"dot"``: ``h_t^T h_s`` (needs ``query_dim == key_dim``);
    - ``"general"``: ``h_t^T W_a h_s``;
    - ``"concat"``: ``v_a^T tanh(W_a [h_t; h_s])``.

    Modes:

    - ``"global"``: softmax over every real source position;
    - ``"local-m"``: ``p_t = t`` (clipped to the last real position), softmax inside ``[p_t - D, p_t + D]``;
    - ``"local-p"``: ``p_t = (S_b - 1) sigmoid(v_p^T tanh(W_p h_t))`` with ``S_b`` the valid length of
      example b; softmax inside the window, then times ``exp(-(s - p_t)^2 / (2 (D/2)^2))``.

    Args:
        query_dim: size of the decoder state, Dq.
        key_dim: size of an encoder output, Dk.
        score: ``"dot"``, ``"general"`` or ``"concat"``.
        mode: ``"global"``, ``"local-m"`` or ``"local-p"``.
        window: the half-width D of the local window (ignored by ``"global"``), an int >= 0.
        hidden_dim: hidden size of the concat score and of the local-p position predictor
            (default: ``query_dim``).
    """

    def __init__(self, query_dim: int, key_dim: int, score: str = "general", mode: str = "global",
                 window: int = 2, hidden_dim: Optional[int] = None) -> None:
        super().__init__()
        self.query_dim = _check_dim(query_dim, "query_dim")
        self.key_dim = _check_dim(key_dim, "key_dim")
        hidden_dim = query_dim if hidden_dim is None else _check_dim(hidden_dim, "hidden_dim")
        if score not in LUONG_SCORES:
            raise ValueError(f"score must be one of {LUONG_SCORES}, got {score!r}")
        if mode not in LUONG_MODES:
            raise ValueError(f"mode must be one of {LUONG_MODES}, got {mode!r}")
        check_int(window, "window", low=0, note="(the half-width D)")
        if score == "dot" and query_dim != key_dim:
            raise ValueError(f"score='dot' needs query_dim == key_dim, got query_dim={query_dim} and "
                             f"key_dim={key_dim}; use score='general' or 'concat' for different sizes")
        self.score_name, self.mode, self.window, self.hidden_dim = score, mode, window, hidden_dim
        if score == "general":
            self.score = GeneralScore(query_dim, key_dim)
        elif score == "concat":
            self.score = ConcatScore(query_dim, key_dim, hidden_dim)
        if mode == "local-p":
            self.position_hidden = nn.Linear(query_dim, hidden_dim, bias=False)  # W_p
            self.position_out = nn.Linear(hidden_dim, 1, bias=False)  # v_p

    def extra_repr(self) -> str:
        window = "" if self.mode == "global" else f", window={self.window}"
        return f"query_dim={self.query_dim}, key_dim={self.key_dim}, score={self.score_name!r}, " \
               f"mode={self.mode!r}{window}"

    def project_key(self, key: torch.Tensor) -> torch.Tensor:
        """The part of the score that depends on the source only, computed once per sentence.

        ``"dot"``: ``h_s`` itself (B, S, Dk); ``"general"``: ``W_a h_s`` (B, S, Dq); ``"concat"``: the key half
        of ``W_a [h_t; h_s]``, (B, S, hidden_dim).
        """
        if self.score_name == "general":
            return self.score.W(key)  # (B, S, Dk) -> (B, S, Dq)
        if self.score_name == "concat":
            W_k = self.score.W_c.weight[:, self.query_dim:]  # (H, Dk)
            return key @ W_k.T  # (B, S, Dk) @ (Dk, H) -> (B, S, H)
        return key

    def _projected_features(self) -> int:
        return {"dot": self.key_dim, "general": self.query_dim, "concat": self.hidden_dim}[self.score_name]

    def scores(self, query: torch.Tensor, key: torch.Tensor, projected_key: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """Raw scores: (B, L, Dq), (B, S, Dk) -> (B, L, S); ``projected_key`` from :meth:`project_key` saves work."""
        if projected_key is None:
            return dot_score(query, key) if self.score_name == "dot" else self.score(query, key)
        _check_projected(projected_key, key, self._projected_features())
        if self.score_name == "concat":
            W_q = self.score.W_c.weight[:, : self.query_dim]  # (H, Dq)
            hidden = (query @ W_q.T)[:, :, None, :] + projected_key[:, None, :, :]  # (B, L, 1, H) + (B, 1, S, H)
            return self.score.v(torch.tanh(hidden))[..., 0]  # (B, L, S, H) -> (B, L, S)
        return query @ projected_key.transpose(1, 2)  # (B, L, Dq) @ (B, Dq, S) -> (B, L, S)

    def position(self, query: torch.Tensor, valid_lens: torch.Tensor, step: int = 0) -> torch.Tensor:
        """Aligned positions p_t, (B, L) float: ``t`` clipped (local-m) or predicted (local-p).

        Args:
            query: (B, L, Dq) decoder states for target steps ``step .. step + L - 1``.
            valid_lens: (B,) source lengths.
            step: the target index of the first query.
        """
        B, L, _ = query.shape
        last = (valid_lens.to(query.dtype) - 1).clamp(min=0)[:, None]  # (B,) -> (B, 1)
        if self.mode == "local-p":
            logit = self.position_out(torch.tanh(self.position_hidden(query)))  # (B, L, Dq) -> (B, L, 1)
            return last * torch.sigmoid(logit[..., 0])  # (B, 1) * (B, L) -> (B, L)
        t = torch.arange(step, step + L, device=query.device, dtype=query.dtype)  # (L,)
        return torch.minimum(t[None, :], last)  # (1, L) vs (B, 1) -> (B, L)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, step: Union[int, None] = 0,
                projected_key: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Context and weights for a (B, Dq) or (B, L, Dq) query over (B, S, Dk) keys.

        Args:
            query: current decoder state(s) h_t.
            key: encoder outputs (B, S, Dk).
            value: defaults to ``key``.
            attn_mask: (B, S) bool padding mask, True at real positions (default: every position is real).
            step: target index of the (first) query, which local-m uses as p_t.
            projected_key: optional result of :meth:`project_key` for this ``key``.

        Returns:
            ``(context, weights)``: (B, Dv) and (B, S) for a (B, Dq) query; (B, L, Dv) and (B, L, S) otherwise.
        """
        q, value, single = _check_inputs(query, key, value, attn_mask, self.query_dim, self.key_dim)
        scores = self.scores(q, key, projected_key)  # (B, L, Dq), (B, S, Dk) -> (B, L, S)
        if self.mode == "global":
            mask = None if attn_mask is None else attn_mask[:, None, :]  # (B, S) -> (B, 1, S)
            return _finish(masked_softmax(scores, mask), value, single)
        B, S = key.shape[:2]
        valid_lens = (attn_mask.sum(-1) if attn_mask is not None
                      else torch.full((B,), S, device=key.device))  # (B, S) -> (B,)
        center = self.position(q, valid_lens, 0 if step is None else step)  # (B, L)
        weights = local_attention_weights(scores, center, self.window, attn_mask,
                                          gaussian=self.mode == "local-p")
        return _finish(weights, value, single)
