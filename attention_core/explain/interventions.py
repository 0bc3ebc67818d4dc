"""Change a trained model's attention weights and watch its output: the counterfactual tests of attention.

Jain & Wallace (2019) asked whether a model's prediction depends on *which* attention distribution it computed:
they permuted the weights, and searched for adversarial distributions far from the original (in Jensen-Shannon
divergence) that leave the prediction almost unchanged. Wiegreffe & Pinter (2019) added a uniform baseline.
Here every such test is one function ``fn(weights, allowed) -> new_weights`` applied inside a model's attention
layers by :func:`intervene`, without touching the model's code:

- :func:`uniform_weights`: every allowed position gets ``1 / n``;
- :func:`permute_weights`: each row's weights shuffled among its allowed positions (padding keeps weight 0);
- :class:`Recorder`: keep the weights the model computed (to compare against);
- :func:`adversarial_attention`: per-input adversarial weights (maximise JSD to the original while the
  output's total variation distance stays within ``epsilon``), optimised with Adam on softmax logits.

Layers that :func:`intervene` knows: :class:`~attention_core.models.rnn_attention.AdditiveAttention` and global
:class:`~attention_core.models.rnn_attention.LuongAttention` (the context is recomputed as ``new_weights @ value``), and
:class:`~attention_core.MultiHeadAttention` (per-head weights (B, H, L, S) replaced before they multiply the
values; the output projection then runs as usual). Run models in eval mode: attention dropout is not applied
while a layer is intervened on.

Measures: :func:`jsd` (natural log; its ceiling is ``ln 2``) and :func:`tvd` (total variation distance, in
[0, 1]), both over the last dimension.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Union

import torch
from torch import nn

from attention_core._checks import check_int, check_real, fmt_shape
from attention_core.functional import attention_weights
from attention_core.models.rnn_attention import AdditiveAttention, LuongAttention
from attention_core.multihead import MultiHeadAttention

__all__ = [
    "AdversarialResult",
    "Intervention",
    "Recorder",
    "adversarial_attention",
    "intervene",
    "jsd",
    "permute_weights",
    "tvd",
    "uniform_weights",
]

#: ``fn(weights, allowed) -> new_weights``: weights (..., S) (each row sums to 1 over ``allowed``), allowed a
#: bool tensor of the same shape (False at padding or masked positions); the result has the same shape.
Intervention = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ------------------------------------------------------------------------------------------ measures


def jsd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence over the last dimension, natural log: ``(KL(p||m) + KL(q||m)) / 2``, ``m =
    (p + q) / 2``; ``0 log 0 = 0``. In ``[0, ln 2]``; ``ln 2`` exactly when p and q have disjoint supports.

    Args:
        p, q: (..., S) distributions (non-negative, rows summing to 1), same shape.

    Returns:
        (...,) divergences.
    """
    _check_pair(p, q)
    m = (p + q) / 2

    def kl(a: torch.Tensor) -> torch.Tensor:
        ratio = torch.where(a > 0, a / torch.where(m > 0, m, torch.ones_like(m)), torch.ones_like(a))
        return (a * torch.log(ratio)).sum(-1)  # (..., S) -> (...)

    return ((kl(p) + kl(q)) / 2).clamp(0.0, math.log(2.0))


def tvd(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Total variation distance over the last dimension, ``sum |p - q| / 2``: (..., C) -> (...), in [0, 1]."""
    _check_pair(p, q)
    return (p - q).abs().sum(-1) / 2


def _check_pair(p: torch.Tensor, q: torch.Tensor) -> None:
    if not isinstance(p, torch.Tensor) or not isinstance(q, torch.Tensor):
        raise TypeError(f"p and q must be tensors, got {type(p).__name__} and {type(q).__name__}")
    if p.shape != q.shape or p.dim() == 0:
        raise ValueError(f"p and q must have one shape (..., S), got {fmt_shape(p.shape)} and {fmt_shape(q.shape)}")


# ------------------------------------------------------------------------------------------ interventions


def _check_allowed(weights: object, allowed: object) -> None:
    if not isinstance(weights, torch.Tensor) or not isinstance(allowed, torch.Tensor):
        raise TypeError(f"weights and allowed must be tensors, got {type(weights).__name__} and "
                        f"{type(allowed).__name__}")
    if allowed.dtype != torch.bool or allowed.shape != weights.shape:
        raise ValueError(f"allowed must be a bool tensor of the weights' shape {fmt_shape(weights.shape)}, got "
                         f"{allowed.dtype} {fmt_shape(allowed.shape)}")


def uniform_weights(weights: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Every allowed position of a row gets ``1 / n`` (n = allowed positions); rows with none stay zeros."""
    _check_allowed(weights, allowed)
    allowed_f = allowed.to(weights.dtype)
    return allowed_f / allowed_f.sum(-1, keepdim=True).clamp_min(1.0)


def permute_weights(generator: Optional[torch.Generator] = None) -> Intervention:
    """An intervention that shuffles each row's weights among the row's allowed positions.

    The multiset of a row's weights is kept (so rows still sum to 1) and masked positions keep weight 0. A
    new permutation is drawn for every row at every call, from ``generator`` (default: a fresh generator seeded
    0, so that two runs permute alike).
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    gen = generator if generator is not None else torch.Generator().manual_seed(0)

    def fn(weights: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        _check_allowed(weights, allowed)
        noise = torch.rand(weights.shape, generator=gen).to(weights.device)  # (..., S)
        noise = torch.where(allowed, noise, torch.full_like(noise, 2.0))  # masked positions sort last
        shuffled = noise.argsort(-1)  # allowed positions in random order, then the masked ones
        in_order = (~allowed).to(torch.int8).sort(dim=-1, stable=True).indices  # allowed in index order, then masked
        return torch.zeros_like(weights).scatter(-1, in_order, weights.gather(-1, shuffled))

    return fn


class Recorder:
    """An intervention that changes nothing and keeps, in call order, the weights and allowed masks it saw."""

    def __init__(self) -> None:
        self.weights: List[torch.Tensor] = []
        self.allowed: List[torch.Tensor] = []

    def __call__(self, weights: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        self.weights.append(weights.detach().clone())
        self.allowed.append(allowed.clone())
        return weights


def _checked(new: object, weights: torch.Tensor) -> torch.Tensor:
    """What an intervention returned, if it can replace ``weights``; raise otherwise."""
    if not isinstance(new, torch.Tensor):
        raise TypeError(f"the intervention must return a tensor of weights, got {type(new).__name__}")
    if new.shape != weights.shape:
        raise ValueError(f"the intervention returned shape {fmt_shape(new.shape)} for weights of shape "
                         f"{fmt_shape(weights.shape)}")
    if new.dtype != weights.dtype or new.device != weights.device:
        raise TypeError(f"the intervention returned {new.dtype} on {new.device} for weights of {weights.dtype} on "
                        f"{weights.device}")
    return new


def _additive_hook(fn: Intervention) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: tuple) -> tuple:
        _, weights = output
        key = args[1] if len(args) > 1 else kwargs["key"]
        value = args[2] if len(args) > 2 and args[2] is not None else kwargs.get("value")
        value = key if value is None else value
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if mask is None:
            allowed = torch.ones_like(weights, dtype=torch.bool)
        else:
            allowed = (mask if weights.dim() == 2 else mask[:, None, :]).expand(weights.shape)  # (B, [L,] S)
        new = _checked(fn(weights, allowed), weights)
        if new.dim() == 2:
            return (new[:, None, :] @ value)[:, 0], new  # (B, 1, S) @ (B, S, Dv) -> (B, Dv)
        return new @ value, new  # (B, L, S) @ (B, S, Dv) -> (B, L, Dv)

    return hook


def _additive_forward(m: nn.Module, fn: Intervention) -> Callable:
    """A replacement for ``m.forward`` (additive or global Luong attention): the layer's own forward, then its
    weights through ``fn`` and the context recomputed from what ``fn`` returns."""
    hook = _additive_hook(fn)
    own = type(m).forward

    def forward(*args: object, **kwargs: object) -> tuple:
        return hook(m, args, kwargs, own(m, *args, **kwargs))

    return forward


def _mha_forward(m: MultiHeadAttention, fn: Intervention) -> Callable:
    """A replacement for ``m.forward`` that passes the per-head weights through ``fn`` (eval mode, no dropout)."""

    def forward(query: torch.Tensor, key: Optional[torch.Tensor] = None, value: Optional[torch.Tensor] = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False, need_weights: bool = False, *,
                key_padding_mask: Optional[torch.Tensor] = None, backend: Optional[str] = None,
                block_mask: Optional[object] = None) -> tuple:
        if block_mask is not None:
            raise ValueError("an intervention reads and rewrites the dense weights: give the mask as attn_mask "
                             "(a block mask's mask_mod gives it through mask_mods.dense_mask)")
        key = query if key is None else key
        value = key if value is None else value
        B, L, S = m._check_inputs(query, key, value)
        mask = m._merge_masks(attn_mask, key_padding_mask, is_causal, B, L, S, query.device)
        if is_causal and mask is None:
            mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()  # upper-left aligned
        Hq, H, E = m.num_heads, m.num_kv_heads, m.head_dim
        q = m.q_proj(query).view(B, L, Hq, E).transpose(1, 2)  # (B, L, D) -> (B, Hq, L, E)
        k = m.k_proj(key).view(B, S, H, E).transpose(1, 2)  # (B, S, kdim) -> (B, H, S, E)
        v = m.v_proj(value).view(B, S, H, E).transpose(1, 2)  # (B, S, vdim) -> (B, H, S, E)
        if H != Hq:
            k = k.repeat_interleave(Hq // H, dim=1)  # (B, H, S, E) -> (B, Hq, S, E)
            v = v.repeat_interleave(Hq // H, dim=1)
        weights = attention_weights(q, k, attn_mask=mask)  # (B, Hq, L, S)
        if mask is None:
            allowed = torch.ones_like(weights, dtype=torch.bool)
        elif mask.dtype == torch.bool:
            allowed = mask.expand(weights.shape)
        else:
            allowed = (mask > -math.inf).expand(weights.shape)
        new = _checked(fn(weights, allowed), weights)
        out = (new @ v).transpose(1, 2).reshape(B, L, m.embed_dim)  # (B, Hq, L, E) -> (B, L, Hq * E)
        return m.out_proj(out), (new if need_weights else None)

    return forward


@contextmanager
def intervene(modules: Union[nn.Module, Iterable[nn.Module]], fn: Intervention) -> Iterator[None]:
    """Inside the block, every listed attention layer hands its weights to ``fn`` and uses what ``fn`` returns.

    Args:
        modules: one layer or several: :class:`~attention_core.models.rnn_attention.AdditiveAttention`, global
            :class:`~attention_core.models.rnn_attention.LuongAttention`, :class:`~attention_core.MultiHeadAttention`.
        fn: an :data:`Intervention`. It is called once per forward call of each layer, in call order.

    A layer listed twice is intervened on once. Blocks nest: an inner :func:`intervene` on a layer that an outer
    one already changes applies the inner ``fn`` until it exits, then the outer one again. Every check runs before
    any layer is changed, and on exit (also on error) each layer is exactly as it was: its ``forward``, its hooks,
    its weights.

    Raises:
        TypeError: a module of another kind, ``modules`` not a module or an iterable of them, or ``fn`` not callable.
        ValueError: a local :class:`LuongAttention` (its window is not a renormalised distribution).
    """
    if isinstance(modules, nn.Module):
        mods = [modules]
    else:
        try:
            mods = list(modules)
        except TypeError:
            raise TypeError(f"modules must be an attention layer or an iterable of them, got "
                            f"{type(modules).__name__}") from None
    mods = list({id(m): m for m in mods}.values())  # each layer once, in the order given
    if not callable(fn):
        raise TypeError(f"fn must be callable (weights, allowed) -> weights, got {type(fn).__name__}")
    for mod in mods:
        if isinstance(mod, LuongAttention) and mod.mode != "global":
            raise ValueError(f"only global Luong attention can be intervened on, got mode={mod.mode!r}")
        if not isinstance(mod, (AdditiveAttention, LuongAttention, MultiHeadAttention)):
            raise TypeError(f"modules must be AdditiveAttention, LuongAttention or MultiHeadAttention layers, got "
                            f"{type(mod).__name__}")
    patched = []
    missing = object()
    try:
        for mod in mods:
            patched.append((mod, mod.__dict__.get("forward", missing)))  # an outer intervention's, if any
            # an instance attribute shadows the class's method; an inner block replaces an outer one's
            mod.forward = _mha_forward(mod, fn) if isinstance(mod, MultiHeadAttention) else _additive_forward(mod, fn)
        yield
    finally:
        for mod, before in reversed(patched):
            if before is missing:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = before


# ------------------------------------------------------------------------------------------ adversary


@dataclass
class AdversarialResult:
    """What :func:`adversarial_attention` found.

    Attributes:
        original: the weights the model computed, one tensor per attention call, in call order.
        adversarial: the adversarial weights, same shapes.
        allowed: the allowed masks, same shapes.
        jsd: per call, (...) the JSD of each row between adversarial and original weights.
        output_tvd: (...) the total variation distance between the outputs with the adversarial and with the
            original weights (per output row, as ``run`` returns them).
    """

    original: List[torch.Tensor]
    adversarial: List[torch.Tensor]
    allowed: List[torch.Tensor]
    jsd: List[torch.Tensor]
    output_tvd: torch.Tensor


class _Replay:
    """An intervention that returns ``softmax(logits[i])`` (over allowed positions) at its i-th call."""

    def __init__(self, logits: Sequence[torch.Tensor], allowed: Sequence[torch.Tensor]) -> None:
        self.logits, self.allowed, self.calls = list(logits), list(allowed), 0

    def weights(self, i: int) -> torch.Tensor:
        z = self.logits[i].masked_fill(~self.allowed[i], -math.inf)
        w = torch.softmax(z, -1)
        return torch.nan_to_num(w, nan=0.0)  # a row with no allowed position stays zeros

    def __call__(self, weights: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        i, self.calls = self.calls, self.calls + 1
        if i >= len(self.logits) or self.logits[i].shape != weights.shape:
            raise ValueError("run must call the attention layers in the same order and shapes every time (teacher "
                             "forcing); this call differs from the recorded ones")
        return self.weights(i)


def adversarial_attention(run: Callable[[], torch.Tensor], modules: Union[nn.Module, Iterable[nn.Module]],
                          epsilon: float = 0.01, steps: int = 100, lr: float = 0.1, penalty: float = 100.0,
                          init_noise: float = 1.0, seed: int = 0) -> AdversarialResult:
    """Per-input adversarial attention (after Jain & Wallace, 2019): weights as far as possible from the model's
    own, in JSD, while the output moves by at most ``epsilon`` in total variation distance.

    Maximises ``mean JSD(adv, orig) - penalty * mean relu(TVD(out_adv, out_orig) - epsilon)`` with Adam over
    the adversarial weights' softmax logits, for ``steps`` steps. The logits start at the original weights' logs
    plus Gaussian noise of scale ``init_noise`` (seeded by ``seed``): at the original weights the JSD's gradient
    is zero, so a search started exactly there would never move. The
    unit is the input (the batch row): an input's adversarial weights are those of the step at which every one
    of its output rows met the bound and its mean JSD was largest; an input that never met the bound keeps its
    original weights (JSD 0). Every attention call of ``run`` is replaced (all heads, all layers listed). The
    returned ``output_tvd`` comes from a last run with the chosen weights, so the bound is checked, not assumed.

    Args:
        run: calls the model on a fixed batch and returns output probabilities (B, ..., C); it must call the
            attention layers in the same order every time (teacher forcing, not free decoding), and batch rows
            must not interact.
        modules: the attention layers to replace (see :func:`intervene`).
        epsilon: the bound on each output row's TVD.
        steps, lr, penalty: the optimisation's settings.
        init_noise, seed: the starting point's perturbation.

    Returns:
        :class:`AdversarialResult`.
    """
    if not callable(run):
        raise TypeError(f"run must be a callable () -> output probabilities, got {type(run).__name__}")
    epsilon = check_real(epsilon, "epsilon", low=0, high=1, low_open=True)
    check_int(steps, "steps", low=1)
    lr = check_real(lr, "lr", low=0, low_open=True)
    penalty = check_real(penalty, "penalty", low=0)
    init_noise = check_real(init_noise, "init_noise", low=0)
    check_int(seed, "seed", low=0)
    rec = Recorder()
    with torch.no_grad(), intervene(modules, rec):
        base = run().detach()
    B = base.shape[0]
    if any(w.shape[0] != B for w in rec.weights):
        raise ValueError("every attention call must have the batch size of run()'s output as its first dim")
    gen = torch.Generator().manual_seed(seed)
    logits = [(torch.log(w.clamp_min(1e-8)) + init_noise * torch.randn(w.shape, generator=gen).to(w.device)
               ).requires_grad_() for w in rec.weights]
    replay = _Replay(logits, rec.allowed)
    best = [w.clone() for w in rec.weights]
    best_score = torch.zeros(B)
    opt = torch.optim.Adam(logits, lr=lr)
    for _ in range(steps + 1):
        replay.calls = 0
        with intervene(modules, replay):
            out = run()
        dist = tvd(out, base)  # (B, ...)
        divs = [jsd(replay.weights(i), w) for i, w in enumerate(rec.weights)]  # per call (B, ...)
        with torch.no_grad():
            ok = (dist <= epsilon).reshape(B, -1).all(-1)  # (B,) every output row within the bound
            score = torch.stack([d.reshape(B, -1).mean(-1) for d in divs]).mean(0)  # (B,)
            keep = ok & (score > best_score)
            best_score = torch.where(keep, score, best_score)
            for i in range(len(best)):
                k = keep.reshape(B, *([1] * (best[i].dim() - 1)))
                best[i] = torch.where(k, replay.weights(i).detach(), best[i])
        loss = -torch.cat([d.flatten() for d in divs]).mean() + penalty * torch.relu(dist - epsilon).mean()
        # gradients of the adversarial logits only: the model's parameters (and their .grad) stay untouched
        grads = torch.autograd.grad(loss, logits, allow_unused=True)
        for z, g in zip(logits, grads):
            z.grad = torch.zeros_like(z) if g is None else g
        opt.step()
    check = _Replay([torch.log(b.clamp_min(1e-30)) for b in best], rec.allowed)
    with torch.no_grad(), intervene(modules, check):
        final = tvd(run(), base)
    divs = [jsd(b, w) * a.any(-1) for b, w, a in zip(best, rec.weights, rec.allowed)]
    return AdversarialResult(rec.weights, best, rec.allowed, divs, final)
