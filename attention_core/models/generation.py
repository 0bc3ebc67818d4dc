"""Generation: continue a prompt with a :class:`~attention_core.models.language_model.DecoderLM`, token by token.

With a key/value cache the prompt is prefilled once and every new token decoded alone against the cache; without,
every step recomputes the model over the whole text. :func:`generate` checks its arguments once; the loop then
calls the unchecked sampling core (``attention_core.models.sampling._sample``) at every token, after a check
of the values of the model's logits (no NaN or ``+inf``, a finite logit per row).

:mod:`attention_core.models.language_model` re-exports :func:`generate`, so this module does not import the model
class back (that would be an import circle): it takes a module with the language model's interface
(``new_cache``, ``rotary.max_len`` and its call signature), in this library
:class:`~attention_core.models.language_model.DecoderLM`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from attention_core._checks import check_bool_flag, check_positive_int, check_tensor, fmt_shape
from attention_core.models.sampling import _check_sampling, _check_values, _sample
from attention_core.training.modes import eval_mode

__all__ = ["generate"]


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             generator: Optional[torch.Generator] = None, use_cache: bool = True, window: Optional[int] = None,
             sinks: int = 0, *, pad: Optional[torch.Tensor] = None, absorbed: Optional[bool] = None,
             max_len: Optional[int] = None) -> torch.Tensor:
    """Continue ``prompt`` (B, P) by ``max_new_tokens`` tokens; returns (B, P + max_new_tokens).

    With ``use_cache`` the prompt is prefilled once and every new token decoded alone from a :class:`KVCache`
    (rolling if ``window`` is given; ``max_len`` preallocates it); without, every step recomputes the model over
    the whole text. ``pad`` (B,): the prompt rows are left-padded by that many tokens (see :func:`left_pad`).
    ``absorbed``: latent attention's form (default: absorbed with the cache).

    The model runs in eval mode and every submodule's mode is given back afterwards, also when the call raises.
    Greedy decoding (``temperature=0`` or ``top_k=1``) draws no random number; sampling draws from
    ``generator`` only (torch's global generator when it is ``None``). The sampling settings are those of
    :func:`sample_next_token`, checked before the prompt is read.
    """
    if not (isinstance(model, nn.Module) and callable(getattr(model, "new_cache", None))
            and isinstance(getattr(getattr(model, "rotary", None), "max_len", None), int)):
        raise TypeError(f"model must be a DecoderLM (a module with new_cache and rotary positions), got "
                        f"{type(model).__name__}")
    check_tensor(prompt, "prompt")
    if prompt.dim() != 2 or prompt.shape[1] == 0:
        raise ValueError(f"prompt must be (B, P) token ids with P >= 1, got shape {fmt_shape(prompt.shape)}")
    check_positive_int(max_new_tokens, "max_new_tokens", allow_zero=True)
    check_bool_flag(use_cache, "use_cache")
    if sinks and not use_cache:
        raise ValueError("sinks need the rolling cache (use_cache=True)")
    temperature, top_k, top_p = _check_sampling(temperature, top_k, top_p, generator)
    if pad is not None:
        check_tensor(pad, "pad")
    fed = prompt.shape[1] + max(max_new_tokens - 1, 0)  # the last new token is sampled, never fed back
    if (not use_cache or (window is None and not sinks)) and fed > model.rotary.max_len:
        raise ValueError(f"prompt has P = {prompt.shape[1]} tokens and max_new_tokens = {max_new_tokens}: positions "
                         f"up to {fed - 1}, but the model covers max_positions = {model.rotary.max_len} (a rolling "
                         "cache, window=..., has no such limit)")
    if use_cache and window is None and not sinks and isinstance(max_len, int) and fed > max_len:
        raise ValueError(f"prompt has P = {prompt.shape[1]} tokens and max_new_tokens = {max_new_tokens}: the cache "
                         f"must hold {fed} tokens, but max_len = {max_len}")
    with eval_mode(model):
        return _generate(model, prompt, max_new_tokens, temperature, top_k, top_p, generator, use_cache, window,
                         sinks, pad, absorbed, max_len)


def _generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int, temperature: float,
              top_k: Optional[int], top_p: Optional[float], generator: Optional[torch.Generator], use_cache: bool,
              window: Optional[int], sinks: int, pad: Optional[torch.Tensor], absorbed: Optional[bool],
              max_len: Optional[int]) -> torch.Tensor:
    tokens = prompt
    cache = model.new_cache(window, sinks, max_len) if use_cache else None
    pad_row = None if pad is None else pad.to(prompt.device)
    logits = model(prompt, cache, None if use_cache else window, pad=pad_row,
                   absorbed=absorbed).logits[:, -1]  # prefill: (B, V)
    for step in range(max_new_tokens):
        _check_values(logits, "logits", allow_posinf=False)  # the model's output, not an argument: every token
        nxt = _sample(logits, temperature, top_k, top_p, generator)[:, None]  # (B, 1)
        tokens = torch.cat([tokens, nxt], dim=1)
        if step == max_new_tokens - 1:
            break
        if cache is not None:
            logits = model(nxt, cache, absorbed=absorbed).logits[:, -1]  # decode: one token against the cache
        else:
            logits = model(tokens, window=window, pad=pad_row, absorbed=absorbed).logits[:, -1]  # recompute
    return tokens
