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

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from attention_core._checks import check_int, check_real, check_tensor, fmt_shape, short_repr
from attention_core.models.language_model import DecoderLM, KVCache
from attention_core.models.sampling import _check_logits, _tempered_logits
from attention_core.training.modes import eval_mode

__all__ = ["SpeculativeStats", "expected_tokens_per_step", "next_token_probs", "residual_distribution",
           "speculative_generate", "speculative_step"]


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """Leviathan et al.'s eq. 1: mean tokens per step, ``(1 - alpha^(gamma+1)) / (1 - alpha)`` (``gamma + 1`` at 1)."""
    alpha = check_real(alpha, "alpha", low=0.0, high=1.0)
    check_int(gamma, "gamma", low=0)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where to sample after a rejection: ``max(0, p - q)`` normalised over the last dim, row by row.

    A row where ``p <= q`` everywhere (so ``p == q``: both sum to 1) can never see a rejection; it returns ``p``
    there rather than 0 / 0. Shapes (..., V) -> (..., V), in ``p``'s dtype.
    """
    for name, t in (("p", p), ("q", q)):
        check_tensor(t, name)
        if not t.is_floating_point() or t.dim() < 1:
            raise ValueError(f"{name} must be a floating (..., V) tensor of probabilities, got {t.dtype} "
                             f"{fmt_shape(t.shape)}")
    if p.shape != q.shape or p.dtype != q.dtype or p.device != q.device:
        raise ValueError(f"p and q must have one shape, dtype and device, got p {p.dtype} {fmt_shape(p.shape)} on "
                         f"{p.device}, q {q.dtype} {fmt_shape(q.shape)} on {q.device}")
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
    for name, t in (("target_probs", target_probs), ("draft_probs", draft_probs), ("draft_tokens", draft_tokens)):
        check_tensor(t, name)
    if draft_probs.dim() != 3:
        raise ValueError(f"draft_probs must be (N, gamma, V), got shape {fmt_shape(draft_probs.shape)}")
    for name, t in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating probabilities, got {t.dtype}")
    if draft_probs.dtype != target_probs.dtype:
        raise TypeError(f"draft_probs must have the dtype of target_probs ({target_probs.dtype}), got "
                        f"{draft_probs.dtype}")
    if draft_tokens.dtype != torch.int64:
        raise TypeError(f"draft_tokens must be int64, got {draft_tokens.dtype}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    devices = {t.device for t in (target_probs, draft_probs, draft_tokens)}
    if len(devices) > 1:
        raise ValueError(f"target_probs, draft_probs and draft_tokens must be on one device, got {devices}")
    N, G, V = draft_probs.shape
    if target_probs.shape != (N, G + 1, V) or draft_tokens.shape != (N, G):
        raise ValueError(f"target_probs must be (N, gamma+1, V) = {(N, G + 1, V)} and draft_tokens (N, gamma) = "
                         f"{(N, G)}, got {tuple(target_probs.shape)} and {tuple(draft_tokens.shape)}")
    if V < 1:
        raise ValueError(f"draft_probs must have V >= 1 tokens, got shape {fmt_shape(draft_probs.shape)}")
    if draft_tokens.numel() and (int(draft_tokens.min()) < 0 or int(draft_tokens.max()) >= V):
        raise ValueError(f"draft_tokens must be ids in [0, V = {V}), got values from {int(draft_tokens.min())} "
                         f"to {int(draft_tokens.max())}")
    for name, t in (("target_probs", target_probs), ("draft_probs", draft_probs)):
        if t.numel() and not (bool(torch.isfinite(t).all()) and bool((t >= 0).all())
                              and bool((t.sum(-1) > 0).all())):
            raise ValueError(f"{name} must hold finite probabilities >= 0, each row with some mass")
    if N == 0:
        return torch.empty(0, G + 1, dtype=torch.long, device=draft_tokens.device), torch.empty(
            0, dtype=torch.long, device=draft_tokens.device)
    p = target_probs[:, :G].gather(2, draft_tokens[..., None])[..., 0]  # (N, G): p(x_i)
    q = draft_probs.gather(2, draft_tokens[..., None])[..., 0]  # (N, G): q(x_i)
    u = torch.rand(N, G, generator=generator, dtype=p.dtype, device=p.device)
    keep = u * q < p  # u < p / q, without dividing (q > 0 for a sampled draft)
    n_acc = torch.cumprod(keep.long(), dim=1).sum(1)  # (N,): drafts kept before the first rejection
    rows = torch.arange(N, device=p.device)
    p_next = target_probs[rows, n_acc]  # (N, V): the distribution at the first rejected (or the extra) slot
    q_next = torch.cat([draft_probs, torch.zeros(N, 1, V, dtype=draft_probs.dtype, device=p.device)], 1)[rows, n_acc]
    residual = residual_distribution(p_next, q_next)  # all drafts kept: q_next = 0, so the residual is p itself
    extra = torch.multinomial(residual, 1, generator=generator)[:, 0]  # (N,)
    pos = torch.arange(G + 1, device=p.device)[None, :]
    tokens = torch.cat([draft_tokens, torch.zeros(N, 1, dtype=torch.long, device=p.device)], 1)
    tokens = torch.where(pos < n_acc[:, None], tokens, torch.full_like(tokens, -1))
    tokens[rows, n_acc] = extra
    return tokens, n_acc + 1


def next_token_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Softmax of ``logits / temperature`` over the last dim, in ``logits``' dtype; ``temperature = 0``: one-hot at
    the argmax (greedy). The scaling is the one :func:`~attention_core.models.language_model.sample_next_token`
    uses: a tiny temperature or huge logits give the greedy limit, never NaN; ``-inf`` logits get
    probability 0. Logits holding NaN or ``+inf``, or a row of only ``-inf``, are refused (no distribution)."""
    _check_logits(logits, allow_posinf=False)  # the sampler's check: (..., V) floating, no NaN/+inf, a finite logit
    temperature = check_real(temperature, "temperature", low=0.0)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return torch.softmax(_tempered_logits(logits, temperature), dim=-1).to(logits.dtype)


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
    it equals greedy decoding of the target token for token, and draws nothing from any random generator (the
    accept test is then a comparison of argmaxes). Both models keep a KV cache; after each step both caches are
    cut back to the accepted text. Both models run in eval mode and get their own modes back, also on error.

    Returns:
        ``(tokens (1, P + max_new_tokens), stats)``.
    """
    _check_speculative(target, draft, prompt, max_new_tokens, gamma, temperature, generator)
    with eval_mode(target, draft):
        return _speculative_generate(target, draft, prompt, max_new_tokens, gamma, float(temperature), generator)


def _check_speculative(target, draft, prompt, max_new_tokens, gamma, temperature, generator) -> None:
    for name, m in (("target", target), ("draft", draft)):
        if not isinstance(m, DecoderLM):
            raise TypeError(f"{name} must be a DecoderLM, got {type(m).__name__}")
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"target and draft must share a vocabulary, got vocab_size {target.vocab_size} and "
                         f"{draft.vocab_size}")
    check_tensor(prompt, "prompt")
    if prompt.dim() != 2 or prompt.shape[0] != 1 or prompt.shape[1] < 1 or prompt.dtype not in (torch.int32,
                                                                                                   torch.int64):
        raise ValueError(f"prompt must be a (1, P) integer tensor with P >= 1, got {prompt.dtype} "
                         f"{fmt_shape(prompt.shape)}")
    V = target.vocab_size
    if int(prompt.min()) < 0 or int(prompt.max()) >= V:
        raise ValueError(f"prompt must hold ids in [0, {V}) (vocab_size), got values from {int(prompt.min())} to "
                         f"{int(prompt.max())}")
    for name, m in (("target", target), ("draft", draft)):
        if prompt.device != m.embed.weight.device:
            raise ValueError(f"prompt is on {prompt.device} but {name} is on {m.embed.weight.device}")
    check_int(max_new_tokens, "max_new_tokens", low=0)
    check_int(gamma, "gamma", low=1)
    t = check_real(temperature, "temperature", low=0.0)
    if t and not math.isfinite(1.0 / t):
        raise ValueError(f"temperature must be 0 (greedy) or large enough that 1 / temperature is finite, got "
                         f"{short_repr(temperature)}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    # the caches hold up to P + max_new_tokens - 1 + gamma positions (drafts past the end are fed, then cut)
    need = prompt.shape[1] + max_new_tokens + gamma - 1
    for name, m in (("target", target), ("draft", draft)):
        if max_new_tokens and need > m.rotary.max_len:
            raise ValueError(f"prompt (P = {prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) + gamma ({gamma}) "
                             f"needs {need} positions, but {name} covers max_positions = {m.rotary.max_len}")


def _greedy_step(p: torch.Tensor, d_tokens: List[torch.Tensor]) -> Tuple[List[int], int]:
    """Greedy verification (one-hot p and q): keep drafts while they are the target's argmax, then the target's
    own argmax; what :func:`speculative_step` gives for one-hot inputs, without a random draw."""
    best = p.argmax(-1).tolist()  # (gamma + 1,)
    new: List[int] = []
    for i, x in enumerate(d_tokens):
        if int(x) != best[i]:
            break
        new.append(best[i])
    new.append(best[len(new)])
    return new, len(new)


def _speculative_generate(target, draft, prompt, max_new_tokens, gamma, temperature, generator):
    stats = SpeculativeStats()
    t_cache, d_cache = target.new_cache(), draft.new_cache()
    if prompt.shape[1] > 1:  # invariant: both caches hold everything but the last token
        target(prompt[:, :-1], t_cache)
        draft(prompt[:, :-1], d_cache)
    out = prompt[0].tolist()
    P = len(out)
    device = prompt.device
    while len(out) - P < max_new_tokens:  # every step adds at least one token
        base = len(out) - 1  # tokens in the caches
        last = torch.tensor([[out[-1]]], device=device)
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
        if temperature:
            tokens, n_out = speculative_step(p[None], qs[None], torch.stack(d_tokens)[None], generator)
            n = int(n_out[0])
            new = tokens[0, :n].tolist()
        else:  # greedy: no random draw at all (the global generator is left alone)
            new, n = _greedy_step(p, d_tokens)
        stats.tokens_per_step.append(n)
        out += new
        keep = base + n  # the last token of `new` is not in the caches yet
        _truncate(t_cache, keep)
        if n - 1 == gamma:  # every draft kept: the draft never saw its own last draft
            draft(d_tokens[-1][None, None], d_cache)
        _truncate(d_cache, keep)
    return torch.tensor([out[: P + max_new_tokens]], device=device), stats
