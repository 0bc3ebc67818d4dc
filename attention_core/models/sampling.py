"""Sampling the next token from a language model's logits: greedy, temperature, top-k and top-p (nucleus).

Every public function checks its arguments once (``_check_logits``, ``_check_sampling``) and then calls
an unchecked core (``_filter_top_k``, ``_filter_top_p``, ``_sample``);
:func:`attention_core.models.generation.generate` checks its settings once and calls the cores at every token.
``_tempered_logits`` is the one place a temperature scales logits, for the sampler and for serving's
:func:`~attention_core.serving.speculative.next_token_probs`. Draws come from a seeded ``torch.Generator`` so
that a generation repeats exactly; greedy choices draw nothing.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from attention_core._checks import check_floating, check_int, check_real, check_tensor, fmt_shape

__all__ = ["filter_top_k", "filter_top_p", "sample_next_token"]


# ------------------------------------------------------------------------------------------------ checks


def _check_logits(logits: object, name: str = "logits", *, rank: Optional[int] = None,
                  allow_posinf: bool = True) -> torch.Tensor:
    """Refuse logits that give nothing to filter, sample or turn into probabilities, naming ``name``.

    A tensor (``TypeError``) of a floating dtype (``TypeError``), of shape (..., V) with V >= 1 (exactly
    ``rank`` dims when given: (B, V) for ``rank=2``), not a meta tensor, with no NaN (``ValueError``). With
    ``allow_posinf=False`` (a distribution is wanted: the sampler, serving's probabilities) also no ``+inf``,
    and every row keeps a logit above ``-inf``. The filters take ``+inf`` (they compare, never normalise).
    """
    check_tensor(logits, name)
    check_floating(logits, name)
    if logits.dim() == 0 or logits.shape[-1] == 0 or (rank is not None and logits.dim() != rank):
        layout = {None: "(..., V)", 2: "(B, V)"}.get(rank, f"a {rank}-D (..., V) tensor")
        raise ValueError(f"{name} must be {layout} with V >= 1, got shape {fmt_shape(logits.shape)}")
    if logits.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor: it has no values to filter or sample from")
    _check_values(logits, name, allow_posinf)
    return logits


def _check_values(logits: torch.Tensor, name: str, allow_posinf: bool) -> None:
    """The values part of ``_check_logits`` (also run on the model's logits at every generated token)."""
    if not logits.numel():
        return
    flat = logits.reshape(-1, logits.shape[-1])  # (rows, V)
    bad = flat.isnan() if allow_posinf else flat.isnan() | (flat == math.inf)
    if bad.any():
        rows = bad.any(-1).nonzero().flatten().tolist()
        what = "NaN" if allow_posinf else "NaN or +inf"
        raise ValueError(f"{name} must hold no {what} (rows {rows[:5]} do): they give no distribution")
    if not allow_posinf and (flat == -math.inf).all(-1).any():
        rows = (flat == -math.inf).all(-1).nonzero().flatten().tolist()
        raise ValueError(f"every logit of rows {rows[:5]} is -inf in {name}: nothing can be drawn")


def _check_sampling(temperature: object, top_k: object, top_p: object, generator: object
                    ) -> tuple[float, Optional[int], Optional[float]]:
    """Validate the sampling settings (before any work); return ``(temperature, top_k, top_p)``, the reals as
    floats, for the unchecked ``_sample``."""
    temperature = check_real(temperature, "temperature", low=0)
    if top_k is not None:
        top_k = check_int(top_k, "top_k", low=1, note="(tokens kept per row) or None")
    if top_p is not None:
        top_p = check_real(top_p, "top_p", low=0, high=1, low_open=True)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    return temperature, top_k, top_p


# ------------------------------------------------------------------------------------------------ cores
# Unchecked: the callers have validated the logits and the settings.


def _filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k >= logits.shape[-1]:
        return logits
    kth = logits.topk(k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    if p >= 1.0:
        return logits
    probs, order = logits.softmax(-1).sort(dim=-1, descending=True)  # (..., V) each
    before = probs.cumsum(-1) - probs  # probability mass of the more likely tokens
    drop_sorted = before >= p  # the set already reached p without this token
    drop_sorted[..., 0] = False  # the most likely token always stays (a p below float32's range compares as 0)
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def _tempered_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` for a softmax over the last dim, safe at every finite magnitude.

    ``temperature`` is a float > 0 and each row of ``logits`` (checked by the callers) holds no NaN or ``+inf``
    and at least one finite value. Computed in float64 for float64 logits and in float32 otherwise (never in a
    narrower type than the input's). ``-inf`` stays ``-inf``. Where ``logits / temperature`` overflows (a tiny
    temperature, or huge logits), each row is shifted by its largest logit first -- the softmax is unchanged --
    so the best token gives 0 and the others a large negative value or ``-inf``: the greedy limit, never NaN.
    The one place the language model's sampler and serving's :func:`~attention_core.serving.next_token_probs`
    scale by a temperature.
    """
    work = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    scaled = work / temperature
    finite = torch.isfinite(work)
    if bool((finite & ~torch.isfinite(scaled)).any()):
        gap = work - work.amax(-1, keepdim=True)  # (..., V), <= 0; -inf where the logit is -inf
        # the best token stays at 0 even where the temperature rounds to 0 in float32 (0 / 0 would be NaN)
        scaled = torch.where(gap == 0, torch.zeros_like(gap), gap / temperature)
    return scaled


def _sample(logits: torch.Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float],
            generator: Optional[torch.Generator]) -> torch.Tensor:
    """(B, V) -> (B,) int64: greedy (no draw) when ``temperature == 0`` or ``top_k == 1``, else one draw."""
    if temperature == 0 or top_k == 1:
        return logits.argmax(-1)
    logits = _tempered_logits(logits, temperature)
    if top_k is not None:
        logits = _filter_top_k(logits, top_k)
    if top_p is not None:
        logits = _filter_top_p(logits, top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]  # (B, 1) -> (B,)


# ------------------------------------------------------------------------------------------------ public


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (ties with the k-th kept too); the rest become ``-inf``.

    Boundaries: ``k >= V`` keeps every logit (the row unchanged); ``k = 1`` keeps the largest (and any tie with
    it); ``k < 1``, a bool or a non-int is refused, and so are NaN logits. ``-inf`` logits stay ``-inf``.
    """
    _check_logits(logits)
    return _filter_top_k(logits, check_int(k, "top_k", low=1, note="(tokens kept per row)"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the fewest most likely tokens whose probabilities sum to at least ``p``.

    Boundaries: ``p`` in ``(0, 1]``; ``p = 1`` keeps every token (the row unchanged, whatever the rounding of
    the cumulative sum); a tiny ``p`` keeps the most likely token (and the tokens tied with it that come first in
    the sort); ``p <= 0``, ``p > 1``, NaN or a non-number is refused, and so are NaN logits.
    """
    _check_logits(logits)
    return _filter_top_p(logits, check_real(p, "top_p", low=0, high=1, low_open=True))


def sample_next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                      top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One token per row of ``logits`` (B, V): greedy when ``temperature == 0`` or ``top_k == 1``, else sampled
    from ``softmax(logits / temperature)`` restricted by ``top_k`` and ``top_p``. Returns (B,) int64.

    Greedy picks the largest logit, the lowest id among ties, and draws no random number: torch's global
    generator is not touched. Sampling draws from ``generator`` (the global generator only when it is ``None``).
    Boundaries: ``temperature`` a finite float >= 0 (a tiny one tends to greedy without overflowing; ``inf``,
    NaN and negative values are refused); ``top_k`` an int >= 1 or None (``>= V`` keeps every token);
    ``top_p`` in ``(0, 1]`` or None. Logits may hold ``-inf`` (never drawn) but no NaN or ``+inf``, and a row
    must keep one finite logit.
    """
    _check_logits(logits, rank=2, allow_posinf=False)
    temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p, generator)
    return _sample(logits, temperature, top_k, top_p, generator)
