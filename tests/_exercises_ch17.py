"""Chapter 17's code exercise (``ch17.sink_attention``) for tests/test_code_exercises.py: mistakes beyond the
checker's own list (as a student writes them), the library's answer under other names, correct solutions written
differently, the worked copy and the statement's example output."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import attention_core as ac
from attention_core import functional
from attention_core.models import attention_variants


def _student(q, k, v, sinks, mask, *, fill=float("-inf"), use_mask=True, flip=False, out_dtype=None,
             sink_row=False):
    """A student's own sink attention with one mistake switched on."""
    z = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (H, L, S)
    if use_mask:
        z = z.masked_fill(~mask, fill)
    s = sinks.flip(0) if flip else sinks
    col = s.view(1, -1, 1).expand(z.shape[0], z.shape[1], 1) if sink_row else s.view(-1, 1, 1).expand(
        z.shape[0], z.shape[1], 1)
    w = torch.softmax(torch.cat([z, col], dim=-1), dim=-1)[..., :-1]  # (H, L, S + 1) -> (H, L, S)
    out = w @ v
    return out if out_dtype is None else out.to(out_dtype)


EXTRA_MISTAKES = [
    ("float32 whatever q's dtype", lambda q, k, v, s, m: _student(q, k, v, s, m, out_dtype=torch.float32)),
    ("masked scores filled with 0", lambda q, k, v, s, m: _student(q, k, v, s, m, fill=0.0)),
    ("the mask ignored", lambda q, k, v, s, m: _student(q, k, v, s, m, use_mask=False)),
    ("the heads' sinks in reverse order", lambda q, k, v, s, m: _student(q, k, v, s, m, flip=True)),
    ("renormalised after dropping the sink", lambda q, k, v, s, m: (lambda w: (w / w.sum(-1, keepdim=True)
                                                                             .clamp_min(1e-30)) @ v)(
        torch.softmax(torch.cat([(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~m, -math.inf),
                                 s.view(-1, 1, 1).expand(q.shape[0], q.shape[1], 1)], -1), -1)[..., :-1])),
]


def _with_zero_key(fn):
    """The library's attention over one more key: a zero key, a zero value, the sink through a float mask."""
    def call(q, k, v, s, m):
        H, L, S = q.shape[0], q.shape[1], k.shape[1]
        bias = torch.zeros(H, L, S + 1, dtype=q.dtype).masked_fill(
            torch.cat([~m, torch.zeros(L, 1, dtype=torch.bool)], -1), -math.inf)
        bias[..., -1] = s.view(-1, 1)
        k1 = torch.cat([k, k.new_zeros(H, 1, k.shape[2])], 1)
        v1 = torch.cat([v, v.new_zeros(H, 1, v.shape[2])], 1)
        return fn(q, k1, v1, bias)
    return call


LIBRARY = [
    lambda q, k, v, s, m: attention_variants.sink_attention(q[None], k[None], v[None], s, m)[0][0],
    _with_zero_key(lambda q, k, v, b: ac.scaled_dot_product_attention(q, k, v, attn_mask=b)),
    _with_zero_key(lambda q, k, v, b: functional.attention(q, k, v, b, 0.0, False)[0]),
    _with_zero_key(lambda q, k, v, b: F.scaled_dot_product_attention(q, k, v, attn_mask=b)),
]


def _alt_exp(q, k, v, sinks, mask):  # by hand: the row max over scores and sink, exp, one division
    z = torch.einsum("hle,hse->hls", q, k) * q.shape[-1] ** -0.5
    z = torch.where(mask, z, torch.tensor(float("-inf"), dtype=z.dtype))
    s = sinks[:, None, None]  # (H, 1, 1)
    m = torch.maximum(z.amax(-1, keepdim=True), s)  # the sink is never masked: m is finite
    e = (z - m).exp()
    return torch.einsum("hls,hse->hle", e, v) / (e.sum(-1, keepdim=True) + (s - m).exp())


def _alt_logsumexp(q, k, v, sinks, mask):  # float64 inside, back to q's dtype
    z = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    z = z.masked_fill(~mask, float("-inf"))
    lse = torch.logaddexp(torch.logsumexp(z, -1, keepdim=True), sinks.double().view(-1, 1, 1))
    return ((z - lse).exp() @ v.double()).to(q.dtype)


ALTERNATIVES = [_alt_exp, _alt_logsumexp, _student]
WORKED_COPY = """
def sink_attention(q, k, v, sinks, mask):
    z = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    z = z.masked_fill(~mask, float("-inf"))
    col = sinks.view(-1, 1, 1).expand(z.shape[0], z.shape[1], 1)
    w = torch.softmax(torch.cat([z, col], dim=-1), dim=-1)
    return w[..., :-1] @ v
"""
STATEMENT_OUTPUT = "[[[1.5], [3.0]]]"
