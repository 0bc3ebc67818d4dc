"""Speculative decoding: a cheap draft model proposes ``gamma`` tokens, the target model checks them in one call.

The acceptance rule (Leviathan et al., 2023, Algorithm 1; Chen et al., 2023): with target probabilities ``p`` and
draft probabilities ``q`` at a position and the drafted token ``x ~ q``, keep ``x`` with probability
``min(1, p(x) / q(x))``; at the first rejection, sample instead from the residual ``max(0, p - q)`` normalised,
and stop; if all ``gamma`` drafts are kept, sample one more token from the target's next distribution. Every
token that comes out is then distributed exactly as the target model would have sampled it, whatever the draft.

With ``beta = sum_x min(p(x), q(x))`` the chance that a draft is kept and ``alpha`` its mean, a step yields on
average ``(1 - alpha^(gamma + 1)) / (1 - alpha)`` tokens when the acceptances are independent
(:func:`expected_tokens_per_step`, Leviathan et al., eq. 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from attention_core.models.language_model import DecoderLM, KVCache

__all__ = ["SpeculativeStats", "expected_tokens_per_step", "next_token_probs", "residual_distribution",
           "speculative_generate", "speculative_step"]


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """Leviathan et al.'s eq. 1: mean tokens per step, ``(1 - alpha^(gamma+1)) / (1 - alpha)`` (``gamma + 1`` at 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where to sample after a rejection: ``max(0, p - q)`` normalised over the last dim, row by row.

    A row where ``p <= q`` everywhere (so ``p == q``: both sum to 1) can never see a rejection; it returns ``p``
    there rather than 0 / 0. Shapes (..., V) -> (..., V), in ``p``'s dtype.
    """
    residual = (p - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def speculative_step(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One verification step, for N independent rows at once.

    Args:
        target_probs: (N, gamma + 1, V) the target's next-token probabilities after the prefix and after each draft.
        draft_probs: (N, gamma, V) the draft's probabilities that the drafts were sampled from.
        draft_tokens: (N, gamma) int64, the drafted tokens.
        generator: random source for the accept tests and the resampling.

    Returns:
        ``(tokens, n_out)``: tokens (N, gamma + 1) int64, row ``r`` valid in its first ``n_out[r]`` entries (the
        kept drafts, then one token from the residual or from the last target distribution), the rest -1;
        n_out (N,) in 1 .. gamma + 1.
    """
    N, G, V = draft_probs.shape
    if target_probs.shape != (N, G + 1, V) or draft_tokens.shape != (N, G):
        raise ValueError(f"target_probs must be (N, gamma+1, V) = {(N, G + 1, V)} and draft_tokens (N, gamma) = "
                         f"{(N, G)}, got {tuple(target_probs.shape)} and {tuple(draft_tokens.shape)}")
    p = target_probs[:, :G].gather(2, draft_tokens[..., None])[..., 0]  # (N, G): p(x_i)
    q = draft_probs.gather(2, draft_tokens[..., None])[..., 0]  # (N, G): q(x_i)
    u = torch.rand(N, G, generator=generator, dtype=p.dtype)
    keep = u * q < p  # u < p / q, without dividing (q > 0 for a sampled draft)
    n_acc = torch.cumprod(keep.long(), dim=1).sum(1)  # (N,): drafts kept before the first rejection
    rows = torch.arange(N)
    p_next = target_probs[rows, n_acc]  # (N, V): the distribution at the first rejected (or the extra) slot
    q_next = torch.cat([draft_probs, torch.zeros(N, 1, V, dtype=draft_probs.dtype)], 1)[rows, n_acc]
    residual = residual_distribution(p_next, q_next)  # all drafts kept: q_next = 0, so the residual is p itself
    extra = torch.multinomial(residual, 1, generator=generator)[:, 0]  # (N,)
    pos = torch.arange(G + 1)[None, :]
    tokens = torch.cat([draft_tokens, torch.zeros(N, 1, dtype=torch.long)], 1)
    tokens = torch.where(pos < n_acc[:, None], tokens, torch.full_like(tokens, -1))
    tokens[rows, n_acc] = extra
    return tokens, n_acc + 1


def next_token_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax of ``logits / temperature``; ``temperature = 0``: one-hot at the argmax (greedy)."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(logits / temperature, dim=-1)


def _truncate(cache: KVCache, n: int) -> None:
    cache.crop(n)


@dataclass
class SpeculativeStats:
    """What a speculative run did: tokens out of each step, ``beta = sum min(p, q)`` at each draft position, and
    at the first draft position of each step (whose context is accepted text only, as in Leviathan et al.'s
    definition of alpha: the mean of beta over the target's own prefixes)."""

    tokens_per_step: List[int] = field(default_factory=list)
    betas: List[float] = field(default_factory=list)
    first_betas: List[float] = field(default_factory=list)
    target_calls: int = 0
    draft_calls: int = 0

    @property
    def alpha(self) -> float:
        """Mean acceptance probability at the first draft position of each step."""
        return sum(self.first_betas) / max(len(self.first_betas), 1)

    @property
    def mean_tokens_per_step(self) -> float:
        return sum(self.tokens_per_step) / max(len(self.tokens_per_step), 1)


@torch.no_grad()
def speculative_generate(target: DecoderLM, draft: DecoderLM, prompt: torch.Tensor, max_new_tokens: int,
                         gamma: int = 4, temperature: float = 1.0, generator: Optional[torch.Generator] = None
                         ) -> Tuple[torch.Tensor, SpeculativeStats]:
    """Continue ``prompt`` (1, P) by ``max_new_tokens`` tokens with speculative decoding.

    The output is distributed as ``generate(target, prompt, ..., temperature)`` samples; at ``temperature=0``
    it equals greedy decoding of the target token for token. Both models keep a KV cache; after each step both
    caches are cut back to the accepted text.

    Returns:
        ``(tokens (1, P + max_new_tokens), stats)``.
    """
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] < 1:
        raise ValueError(f"prompt must be (1, P) with P >= 1, got shape {tuple(prompt.shape)}")
    if not isinstance(gamma, int) or gamma < 1:
        raise ValueError(f"gamma must be an int >= 1, got {gamma!r}")
    target.eval()
    draft.eval()
    stats = SpeculativeStats()
    t_cache, d_cache = target.new_cache(), draft.new_cache()
    if prompt.shape[1] > 1:  # invariant: both caches hold everything but the last token
        target(prompt[:, :-1], t_cache)
        draft(prompt[:, :-1], d_cache)
    out = prompt[0].tolist()
    P = len(out)
    while len(out) - P < max_new_tokens:
        base = len(out) - 1  # tokens in the caches
        last = torch.tensor([[out[-1]]])
        d_tokens, d_probs = [], []
        for i in range(gamma):
            q = next_token_probs(draft(last if i == 0 else d_tokens[-1][None, None], d_cache).logits[0, -1],
                                 temperature)
            d_probs.append(q)
            d_tokens.append(torch.multinomial(q, 1, generator=generator)[0] if temperature else q.argmax())
        stats.draft_calls += gamma
        feed = torch.stack([last[0, 0]] + d_tokens)[None]  # (1, gamma + 1)
        p = next_token_probs(target(feed, t_cache).logits[0], temperature)  # (gamma + 1, V)
        stats.target_calls += 1
        qs = torch.stack(d_probs)  # (gamma, V)
        betas = torch.minimum(p[:gamma], qs).sum(-1).tolist()
        stats.betas += betas
        stats.first_betas.append(betas[0])
        tokens, n_out = speculative_step(p[None], qs[None], torch.stack(d_tokens)[None], generator)
        n = int(n_out[0])
        new = tokens[0, :n].tolist()
        stats.tokens_per_step.append(n)
        out += new
        keep = base + n  # the last token of `new` is not in the caches yet
        _truncate(t_cache, keep)
        if n - 1 == gamma:  # every draft kept: the draft never saw its own last draft
            draft(d_tokens[-1][None, None], d_cache)
        _truncate(d_cache, keep)
    return torch.tensor([out[: P + max_new_tokens]]), stats
