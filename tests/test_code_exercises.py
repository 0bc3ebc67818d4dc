"""Every chapter's code-exercise checker against the mistakes students make, and against right answers.

For each exercise of :data:`attention_core.booktools.chapter_exercises.EXERCISES` this file holds at least
four plausible mistakes (mutants), the chapter's own warnings first: each must be REJECTED with a report that
names the failing input by the statement's argument names (and, for the checker's known mistakes, gives the
hint naming the mistake). The worked solution of the chapter (read from the notebook) and correct solutions
written differently (another order of operations, float32 where float64 is not asked for) must be ACCEPTED.
Mutants that call the library function computing the whole answer are rejected with a message saying what
the exercise asks for, and the library is whole again afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import math
import re
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("hypothesis")

import _exercises_ch16 as _ch16  # noqa: E402
import _exercises_ch17 as _ch17  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attention_core as ac  # noqa: E402
from attention_core import explain, masks, pretrained  # noqa: E402
from attention_core import linear_attention as la  # noqa: E402
from attention_core import low_precision as lp  # noqa: E402
from attention_core.backends.reference import softmax_with_mask  # noqa: E402
from attention_core.booktools import chapter_exercises as ce  # noqa: E402
from attention_core.booktools import (  # noqa: E402
    code_checks,
    exercises,
    exercises_at_scale,
    exercises_bahdanau,
    exercises_beyond_dense,
    exercises_decoder_lm,
    exercises_explanation,
    exercises_multi_head,
    exercises_positional,
    exercises_scoring,
    exercises_self_attention,
    exercises_serving,
    exercises_vision,
    refusals,
)
from attention_core.booktools import exercises_low_precision as elp  # noqa: E402
from attention_core.functional import masked_softmax as lib_masked_softmax  # noqa: E402
from attention_core.models import language_model as lm  # noqa: E402
from attention_core.models import rnn_attention as ra  # noqa: E402
from attention_core.models import vit  # noqa: E402
from attention_core.models.rnn_attention import local_attention_weights  # noqa: E402
from attention_core.positional import apply_rotary  # noqa: E402
from attention_core.serving import speculative  # noqa: E402

BOOK = Path(__file__).resolve().parents[1] / "book"
NOTEBOOK = {"ch01": "01_kernel_regression", "ch02": "02_scoring_functions", "ch03": "03_bahdanau",
            "ch04": "04_luong", "ch05": "05_self_attention", "ch06": "06_multi_head_attention",
            "ch07": "07_positional_information", "ch08": "08_transformer", "ch09": "09_attention_at_scale",
            "ch10": "10_pretrained_minilm", "ch11": "11_decoder_only_lm",
            "ch12": "12_beyond_dense_attention",
            "ch13": "13_attention_as_explanation",
            "ch14": "14_vision_transformer",
            "ch15": "15_serving", "ch16": "16_attention_across_devices",
            "ch17": "17_recent_models", "ch18": "18_low_precision"}
NEG_INF = float("-inf")
LIBRARY = "is not available while your"  # what a blocked library function says


# ------------------------------------------------------------------------ a student's own copies of the helpers
# The checker refuses every function of the exercise modules while a submission runs (their helpers compute
# answers).
# A mutant that makes a known mistake runs a copy of the helper as a student would have typed it: the same code,
# compiled outside that module's file.

def _recode(code: types.CodeType) -> types.CodeType:
    consts = tuple(_recode(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename="<a student's copy>", co_consts=consts)


_OWN_GLOBALS: dict = {}  # module name -> the globals a student's copies of that module's helpers run in


def _spec_module(value) -> bool:
    """A function of a module that defines exercises (chapter_exercises or a chapter's own spec module)."""
    mod = sys.modules.get(getattr(value, "__module__", None) or "")
    return (isinstance(value, types.FunctionType) and mod is not None
            and mod.__name__.startswith("attention_core.booktools.") and hasattr(mod, "__file__")
            and (mod is ce or "FunctionSpec" in vars(mod) or "exercises" in mod.__name__.rsplit(".", 1)[-1]))


def _outside(value):
    """``value`` with every function of an exercise-spec module it holds or reaches replaced by a student's copy."""
    if not _spec_module(value):
        return value
    return _copy(value)


def _copy(fn):
    own = _OWN_GLOBALS.get(fn.__module__)
    if own is None:
        own = _OWN_GLOBALS[fn.__module__] = dict(vars(sys.modules[fn.__module__]))
        for key, obj in list(own.items()):
            if _spec_module(obj) and obj.__module__ == fn.__module__:
                own[key] = _copy(obj)
    cells = tuple(types.CellType(_outside(c.cell_contents)) for c in fn.__closure__ or ())
    defaults = tuple(_outside(d) for d in fn.__defaults__) if fn.__defaults__ else fn.__defaults__
    out = types.FunctionType(_recode(fn.__code__), own, fn.__name__, defaults, cells or None)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


class _Own:
    """``own._linear`` and the like: a student's copy of a helper of a chapter's exercise module."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        found = [vars(sys.modules[m])[name] for m in ce.SPEC_MODULES if name in vars(sys.modules[m])]
        assert len(found) == 1, f"{name}: defined in {len(found)} exercise modules"
        copy = _outside(found[0])
        setattr(self, name, copy)  # made once, here, from the helper's own code
        return copy


own = _Own()
# Copies made now, outside any check: while a check runs the helpers' bodies refuse, and a copy made from one
# then would refuse too (a mutant would fail for being refused, not for its mistake).
for _name in sorted({n for m in ce.SPEC_MODULES for n, v in vars(sys.modules[m]).items() if _spec_module(v)}):
    if sum(_name in vars(sys.modules[m]) for m in ce.SPEC_MODULES) == 1:
        getattr(own, _name)


# ------------------------------------------------------------------------------------------- mutants: ch. 1-4


def _inside(q, k, h):
    return ((q[:, None] - k[None, :]).abs() <= h).float()  # (L, S)


CH01 = [
    ("keys transposed against queries", lambda q, k, v, h: ((k[:, None] - q[None, :]).abs() <= h).float() @ v
     / ((k[:, None] - q[None, :]).abs() <= h).float().sum(-1).clamp(min=1)),
    ("half-width h/2", lambda q, k, v, h: (_inside(q, k, h / 2) @ v) / _inside(q, k, h / 2).sum(-1).clamp(min=1)),
    ("empty window gives the global mean", lambda q, k, v, h: torch.where(
        _inside(q, k, h).sum(-1) > 0, (_inside(q, k, h) @ v) / _inside(q, k, h).sum(-1).clamp(min=1), v.mean())),
]
CH01_LIBRARY = lambda q, k, v, h: ac.nadaraya_watson(q, k, v, kernel="boxcar", bandwidth=h)  # noqa: E731

CH02 = [
    ("max without keepdim", lambda s, m: torch.softmax((s - s.max(-1).values).masked_fill(~m, NEG_INF), -1)
     .nan_to_num(0.0)),
    ("softmax over the queries", lambda s, m: torch.softmax(s.masked_fill(~m, NEG_INF), 0).nan_to_num(0.0)),
    ("nan_to_num after -1e9", lambda s, m: torch.softmax(s.masked_fill(~m, -1e9), -1).nan_to_num(0.0)),
    # a student's tries that the first checker accepted: the row maximum taken over masked scores too (a masked
    # score of 200 underflows every kept one), and a log-mask with a tiny epsilon (the masked key keeps weight)
    ("max over masked scores too", lambda s, m: (lambda e: torch.where(
        e.sum(-1, keepdim=True) > 0, e / e.sum(-1, keepdim=True).clamp_min(1e-30), torch.zeros_like(e)))(
        torch.exp(s - s.amax(-1, keepdim=True)) * m)),
    ("log-mask with an epsilon", lambda s, m: torch.softmax(s + torch.log(m.float() + 1e-45), -1)
     * m.any(-1, keepdim=True)),
]
CH02_LIBRARY = [lambda s, m: ac.masked_softmax(s, m), lambda s, m: lib_masked_softmax(s, m),
                lambda s, m, _f=ac.masked_softmax: _f(s, m),  # captured as a default argument
                lambda s, m: softmax_with_mask(s, m)]  # the backend's own helper

CH03 = [
    ("mask inverted", lambda s, h, m, W, U, v: torch.softmax(
        (torch.tanh((s @ W.T)[:, None] + h @ U.T) @ v).masked_fill(m, NEG_INF), -1)),
    ("weights not transposed", lambda s, h, m, W, U, v: torch.softmax(
        (torch.tanh((s @ W)[:, None] + h @ U) @ v).masked_fill(~m, NEG_INF), -1)),
]


def _ch04_wrong_axis(scores, center, D):
    dist = torch.arange(scores.shape[-1]) - center[..., None]
    w = torch.softmax(scores.masked_fill(dist.abs() > D, NEG_INF), dim=-2).nan_to_num(0.0)
    return w * torch.exp(-dist**2 / (2 * (D / 2) ** 2))


def _ch04_log_gauss(scores, center, D):  # the Gaussian added to the scores: renormalised weights
    dist = torch.arange(scores.shape[-1]) - center[..., None]
    return torch.softmax((scores - dist**2 / (2 * (D / 2) ** 2)).masked_fill(dist.abs() > D, NEG_INF), -1)


CH04 = [("softmax over decoder steps", _ch04_wrong_axis), ("Gaussian added to the scores", _ch04_log_gauss)]
CH04_LIBRARY = lambda s, c, D: local_attention_weights(s, c, D, gaussian=True)  # noqa: E731


# ------------------------------------------------------------------------------------------- mutants: ch. 5-8


def _ch05_over_queries(q, k, v):
    s = (q @ k.T / q.shape[-1] ** 0.5).masked_fill(~torch.ones(len(q), len(k), dtype=torch.bool).tril(), NEG_INF)
    return torch.softmax(s, dim=0).nan_to_num(0.0) @ v


CH05 = [("softmax over the queries", _ch05_over_queries),
        ("scaled by 1/sqrt(L)", lambda q, k, v: torch.softmax(
            (q @ k.T / len(q) ** 0.5).masked_fill(~torch.ones(len(q), len(q), dtype=torch.bool).tril(), NEG_INF),
            -1) @ v)]
CH05_LIBRARY = [lambda q, k, v: ac.scaled_dot_product_attention(q, k, v, is_causal=True),
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                # the same C function under the names a student found (torch's own bindings)
                lambda q, k, v: torch._C._nn.scaled_dot_product_attention(q, k, v, is_causal=True),
                lambda q, k, v: torch.ops.aten.scaled_dot_product_attention(q, k, v, is_causal=True)]


def _ch06_float32(x, w_q, w_k, w_v, w_o, num_heads):
    return _ch06_alt(x.float(), w_q.float(), w_k.float(), w_v.float(), w_o.float(), num_heads)


def _ch06_library(x, w_q, w_k, w_v, w_o, num_heads):
    mha = ac.MultiHeadAttention(x.shape[-1], num_heads, bias=False, dtype=x.dtype)
    with torch.no_grad():
        for proj, w in [(mha.q_proj, w_q), (mha.k_proj, w_k), (mha.v_proj, w_v), (mha.out_proj, w_o)]:
            proj.weight.copy_(w.T)
        return mha(x, attn_mask=ac.causal_mask(x.shape[1]))[0]


CH06 = [("returns float32", _ch06_float32)]


def _ch07_float32(x, positions):
    return _ch07_complex(x, positions).float()


CH07 = [("returns float32", _ch07_float32),
        ("base 1000", lambda x, p: apply_rotary_like(x, p, base=1000.0))]


def apply_rotary_like(x, positions, base=10000.0):
    N, E = x.shape
    theta = base ** (-torch.arange(0, E, 2, dtype=torch.float64) / E)
    angle = positions[:, None].double() * theta
    a, b = x[:, : E // 2], x[:, E // 2 :]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)


CH08 = [("scaled by 1/sqrt(T)", lambda q, k, v: torch.softmax(
            (q @ k.transpose(-2, -1) / q.shape[-2] ** 0.5).masked_fill(
                ~torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril(), NEG_INF), -1) @ v),
        ("values not weighted", lambda q, k, v: torch.softmax(
            (q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5).masked_fill(
                ~torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril(), NEG_INF), -1).sum(-1, keepdim=True)
         * v)]
CH08_LIBRARY = [lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                lambda q, k, v: ac.scaled_dot_product_attention(q, k, v, is_causal=True),
                # torch's private attention operators, whose first output is the whole answer
                lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)[0],
                lambda q, k, v: torch.ops.aten._scaled_dot_product_attention_math(q, k, v, is_causal=True)[0]]


# ------------------------------------------------------------------------------------------ mutants: ch. 9-11


def _ch09_ones(o1, m1, l1, o2, m2, l2):  # the first block's maximum kept, whatever the second's
    a2 = torch.exp(m2 - m1)
    return o1 + a2 * o2, m1, l1 + a2 * l2


CH09 = [("keeps m1 as the maximum", _ch09_ones)]

CH10 = [("max-pooled", lambda h, m: h.masked_fill(~m[..., None], NEG_INF).amax(1)),
        ("mean over features", lambda h, m: (h * m[..., None]).sum(-1) / m.sum(1, keepdim=True))]
CH10_LIBRARY = [lambda h, m: pretrained.mean_pool(h, m)]


def _ch10_st_pooling(h, m):
    """The reference library's own mean pooling (sentence-transformers' Pooling module)."""
    from sentence_transformers.sentence_transformer.modules import Pooling
    return Pooling(h.shape[-1], pooling_mode="mean")({"token_embeddings": h, "attention_mask": m.long()})[
        "sentence_embedding"]

CH11 = [("float mask", lambda L, S, w: own._decode(L, S, w).float()),
        ("transposed (S, L)", lambda L, S, w: own._decode(L, S, w).T),
        ("window None crashes", lambda L, S, w: own._decode(L, S, w) & (torch.arange(S) > S - 1 - w))]
CH11_LIBRARY = [lambda L, S, w: lm.cached_causal_mask(L, S, w)]
CH12 = [("softmax attention instead", lambda q, k, v: torch.softmax(
            (q @ k.transpose(-2, -1)).masked_fill(~torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril(),
                                                  NEG_INF), -1) @ v),
        ("relu feature map", lambda q, k, v: own._linear(q, k, v, phi=F.relu)),
        ("exp feature map", lambda q, k, v: own._linear(q, k, v, phi=torch.exp)),
        ("state read before the write", lambda q, k, v: own._linear(q, k, v, causal_offset=-1).nan_to_num()),
        ("normalizer over every key", lambda q, k, v: own._linear(q, k, v, normalize=False)
         / own._linear(q, k, torch.ones_like(v[..., :1]), causal=False, normalize=False))]
CH12_LIBRARY = [lambda q, k, v: la.linear_attention(q, k, v, is_causal=True, eps=0.0),
                lambda q, k, v: la.linear_attention_recurrent(q, k, v, eps=0.0)[0],
                lambda q, k, v: la.linear_attention_chunked(q, k, v, chunk_size=2, eps=0.0)]

CH13 = [("operator precedence: A + I / 2", lambda m: _rollout_with(m, lambda a, eye: a + eye / 2)),
        ("residual added once, after the product", lambda m: (own._rollout(m, residual=False)
                                                               + torch.eye(m.shape[-1], dtype=m.dtype)) / 2),
        ("transposed", lambda m: own._rollout(m).transpose(-1, -2)),
        ("layers averaged, not multiplied", lambda m: sum((a + torch.eye(m.shape[-1], dtype=m.dtype)) / 2
                                                          for a in m) / m.shape[0])]
def _rollout_with(maps, layer):
    eye = torch.eye(maps.shape[-1], dtype=maps.dtype)
    out = eye
    for a in maps:
        out = layer(a, eye) @ out
    return out


CH13_LIBRARY = [lambda m: explain.attention_rollout(list(m[:, None]))[0],
                lambda m: explain.residual_attention(m[-1]) @ own._rollout(m[:-1])
                if m.shape[0] > 1 else explain.residual_attention(m[0])]


CH14 = [("unfold without the transpose", lambda x, p: vit_unfold(x, p).transpose(1, 2)),
        ("the last patch dropped (off by one)", lambda x, p: vit_unfold(x, p)[:, :-1]),
        ("the image read transposed", lambda x, p: vit_unfold(x.transpose(-2, -1), p))]


def vit_unfold(x, p):
    """Patches by Tensor.unfold (a view of sliding windows, the student's own reshape of it): not F.unfold."""
    B, C = x.shape[:2]
    windows = x.unfold(2, p, p).unfold(3, p, p)  # (B, C, gh, gw, p, p)
    return windows.permute(0, 2, 3, 1, 4, 5).reshape(B, -1, C * p * p)  # -> (B, N, C*p*p)

CH15 = [("float32 result", lambda p, q: own._residual(p, q).float()),
        ("renormalised p, no subtraction", lambda p, q: p / p.sum(-1, keepdim=True)),
        ("q where p == q", lambda p, q: torch.where(((p - q).clamp_min(0).sum(-1, keepdim=True)) > 0,
                                                     own._residual(p, q), q.flip(-1)))]
CH15_LIBRARY = [lambda p, q: speculative.residual_distribution(p, q)]


# --------------------------------------------------------- a student's tries on ch. 12-15 that the checkers accepted
# Each returned the right values (or the right values on every input the first checkers drew) and is wrong all the
# same: it overwrites the caller's tensors, answers in another dtype than the statement asks for, or guards the
# empty residual with a threshold that also swallows a real, small one.


def _ch12_elu_in_place(query, key, value):
    fq, fk = F.elu(query, inplace=True).add_(1), F.elu(key, inplace=True).add_(1)  # the caller's query and key
    A = (fq @ fk.transpose(-2, -1)) * torch.ones(query.shape[-2], query.shape[-2], dtype=torch.bool).tril()
    return (A @ value) / A.sum(-1, keepdim=True)


def _ch13_residual_in_place(maps):
    eye = torch.eye(maps.shape[-1], dtype=maps.dtype)
    out = eye.clone()
    for a in maps:
        a += eye  # the caller's maps now hold (A + I) / 2
        a /= 2
        out = a @ out
    return out


def _ch14_scratch_images(images, patch_size):
    out = vit_unfold(images, patch_size).clone()
    images.zero_()  # the caller's images used as scratch space
    return out


def _ch15_q_in_place(p, q):
    r = q.neg_().add_(p).clamp_(min=0)  # the caller's q overwritten by the residual
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass, p)


def _ch15_threshold(p, q):
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 1e-3, r / mass.clamp_min(1e-3), p)  # a small real residual taken for none


IN_PLACE = [("ch12.causal_linear_attention", _ch12_elu_in_place, "query"),
            ("ch13.rollout", _ch13_residual_in_place, "maps"),
            ("ch14.patchify", _ch14_scratch_images, "images"),
            ("ch15.residual", _ch15_q_in_place, "q")]
CH12.append(("elu applied in place to query and key", _ch12_elu_in_place))
CH13.append(("(A + I) / 2 written into maps", _ch13_residual_in_place))
CH14.append(("images used as scratch space", _ch14_scratch_images))
CH15 += [("q overwritten in place", _ch15_q_in_place), ("float64 whatever p's dtype", lambda p, q: own._residual(
    p.double(), q.double())), ("empty residual taken below mass 1e-3", _ch15_threshold)]


def _as_list(x):
    return x if isinstance(x, list) else [x]


def _ch07_closure():
    f = apply_rotary

    def rope(x, positions):  # the library function captured in a closure
        return f(x, positions)
    return rope


_ch07_captured = _ch07_closure()


# Routes a student found around the blocked names: the library function held in a dict, or copied with
# types.FunctionType (its own globals); the checker refuses them by their code objects.
_LIBRARY_IN_A_DICT = {"nw": ac.nadaraya_watson, "mp": pretrained.mean_pool, "cm": lm.cached_causal_mask,
                      "lw": local_attention_weights,
                      "pf": vit.patchify}
_NW_COPY = types.FunctionType(ac.nadaraya_watson.__code__, dict(ac.nadaraya_watson.__globals__), "nw_copy",
                              ac.nadaraya_watson.__defaults__, ac.nadaraya_watson.__closure__)


# Routes a student met by accident or by habit (issue 39): the library's answer under another name (a private
# helper, another backend, a mask_mod), torch's whole-answer function where the exercise asks to write it, and
# the checker module's own helpers. Each is refused with the message that says what to write.
_EYE = torch.eye
_UNFOLD = F.unfold  # an alias taken before the check
_TORCH_IN_A_DICT = {"sdpa": F.scaled_dot_product_attention, "im2col": torch._C._nn.im2col}  # C functions
_TORCH_MASKED = {"public": torch.masked.softmax, "private": torch._masked_softmax}  # aliases taken before the check


def _ch02_sdpa_identity(scores, mask):  # the weights, as SDPA's output with identity keys and values
    S = scores.shape[-1]
    return F.scaled_dot_product_attention(scores, _EYE(S), _EYE(S), attn_mask=mask, scale=1.0)


def _ch02_sdpa_in_a_dict(scores, mask):
    S = scores.shape[-1]
    return _TORCH_IN_A_DICT["sdpa"](scores, _EYE(S), _EYE(S), attn_mask=mask, scale=1.0)


def _ch02_numpy_backend(scores, mask):  # another backend of the library
    from attention_core.backends import numpy_backend

    S = scores.shape[-1]
    out = numpy_backend.attention_np(scores.double().numpy(), _EYE(S).double().numpy(), _EYE(S).double().numpy(),
                                     mask.numpy(), scale=1.0)
    return torch.as_tensor(out, dtype=scores.dtype)


def _ch07_private_rotation(x, positions):  # positional's private rotation with its angles
    from attention_core import positional

    cos, sin = positional.rotary_angles(positions, x.shape[-1])
    return positional._rotate(x, cos.to(x.dtype), sin.to(x.dtype), False)


def _ch07_own_angles(x, positions):  # the reader's own angles, in the half-split layout: (N, E) each
    E = x.shape[-1]
    theta = 10000.0 ** (-torch.arange(0, E, 2, dtype=torch.float64) / E)
    angle = (positions.to(torch.float64)[:, None] * theta).repeat(1, 2)  # (N, E/2) -> (N, E)
    return angle.cos().to(x.dtype), angle.sin().to(x.dtype)


def _ch07_onnx_rotary(x, positions):  # torch's ONNX RotaryEmbedding operator with the reader's own angles
    # (called once at import below, so that no lazy import runs during the check and the refusal is the module's)
    theta = 10000.0 ** (-torch.arange(0, x.shape[-1], 2, dtype=torch.float64) / x.shape[-1])
    angle = positions.to(torch.float64)[:, None] * theta  # (N, E/2)
    return torch.onnx.ops.rotary_embedding(x[None, None], angle.cos().to(x.dtype)[None],
                                           angle.sin().to(x.dtype)[None])[0, 0]


if importlib.util.find_spec("torch.onnx.ops"):
    _ch07_onnx_rotary(torch.zeros(2, 2), torch.arange(2))


def _ch07_hf_rotate_half(x, positions):  # Hugging Face's rotate_half with the reader's own angles
    from transformers.models.llama.modeling_llama import rotate_half

    cos, sin = _ch07_own_angles(x, positions)
    return x * cos + rotate_half(x) * sin


def _ch07_hf_apply(x, positions):  # Hugging Face's apply_rotary_pos_emb (GPT-NeoX's module) with own angles
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    cos, sin = _ch07_own_angles(x, positions)
    return apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=0)[0]


def _ch11_bottom_right(L, S, window):  # the decode mask as a mask_mod, evaluated on the grid
    from attention_core import mask_mods

    return mask_mods.causal_bottom_right(L, S)(0, 0, torch.arange(L)[:, None], torch.arange(S)[None, :])


def _ch01_window(q, k, h):
    return (q[:, None] - k[None, :]).abs() <= h  # (L, S) bool: True = inside the window


@torch.jit.script
def _scripted_causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # compiled before the check


_TRACED_CAUSAL_SDPA = torch.jit.trace(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                      (torch.randn(4, 3),) * 3)


_HELD = [F.scaled_dot_product_attention]  # an alias kept in a list, out of reach of the namespace patching


def _profile_off(q, k, v):  # switches the profile hook off, then calls SDPA
    sys.setprofile(None)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _onnx_attention(q, k, v):  # ONNX's Attention with a float causal bias: its own path, not SDPA
    bias = torch.zeros(q.shape[0], k.shape[0], dtype=q.dtype).masked_fill(
        torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))  # (L, S)
    return torch.onnx.ops.attention(q[None, None], k[None, None], v[None, None], attn_mask=bias)[0][0, 0]


if importlib.util.find_spec("torch.onnx.ops"):  # warmed up here, so that no import runs during the check
    _onnx_attention(*(torch.randn(2, 2),) * 3)


def _flex_eager(name):  # torch's FlexAttention in eager Python (its higher-order op's math path), causal
    hop = importlib.import_module("torch._higher_order_ops.flex_attention")

    def run(q, k, v):
        out = getattr(hop, name)(q[None, None], k[None, None], v[None, None], lambda s, b, h, m, n: s,
                                 (lambda b, h, m, n: m >= n,), q.shape[-1] ** -0.5, {})
        return out[0][0, 0]
    return run


ROUTES = {
    # zero scores with the window as the mask: any attention function takes the window's mean
    "ch01.boxcar_nw": [lambda q, k, v, h: ac.attention_weights(q[:, None], k[:, None], attn_mask=_ch01_window(q, k, h),
                                                               scale=0.0) @ v,
                       lambda q, k, v, h: torch.nan_to_num(F.scaled_dot_product_attention(
                           q[None, :, None], k[None, :, None], v[None, :, None], attn_mask=_ch01_window(q, k, h),
                           scale=0.0))[0, :, 0],
                       lambda q, k, v, h: torch.nan_to_num(ac.scaled_dot_product_attention(
                           q[:, None], k[:, None], v[:, None], attn_mask=_ch01_window(q, k, h), scale=0.0))[:, 0]],
    "ch02.masked_softmax": [_ch02_sdpa_identity, _ch02_sdpa_in_a_dict, _ch02_numpy_backend,
                            lambda s, m: ac.attention_weights(s, _EYE(s.shape[-1]), m, scale=1.0),
                            lambda s, m: exercises_scoring._softmax_guarded(s, m),
                            # torch's own masked softmax: NaN in a fully masked row, one nan_to_num from the answer
                            lambda s, m: torch.masked.softmax(s, -1, mask=m).nan_to_num(0.0),
                            lambda s, m: _TORCH_MASKED["public"](s, -1, mask=m).nan_to_num(0.0),
                            lambda s, m: torch.masked.log_softmax(s, -1, mask=m).exp().nan_to_num(0.0),
                            lambda s, m: torch.masked.softmin(-s, -1, mask=m).nan_to_num(0.0),
                            lambda s, m: torch._masked_softmax(s, ~m, -1, 0).nan_to_num(0.0),
                            lambda s, m: _TORCH_MASKED["private"](s, ~m, -1, 0).nan_to_num(0.0),
                            lambda s, m: torch.ops.aten._masked_softmax(s, ~m, -1, 0).nan_to_num(0.0)],
    "ch03.bahdanau_weights": [lambda s, h, m, W, U, v: lib_masked_softmax(
        torch.tanh((s @ W.T)[:, None] + h @ U.T) @ v, m)],  # the library's masked softmax inside
    "ch05.causal_attention": [lambda q, k, v: _TORCH_IN_A_DICT["sdpa"](q, k, v, is_causal=True),
                              lambda q, k, v: exercises_self_attention._causal(q, k, v),
                              # chapter 18's simulated kernel in float32: the library's answer from another room
                              lambda q, k, v: lp.simulate_attention(q[None], k[None], v[None],
                                                                    is_causal=True).out[0],
                              # TorchScript compiled before the check: its SDPA is called from C++
                              _scripted_causal_sdpa, lambda q, k, v: _TRACED_CAUSAL_SDPA(q, k, v),
                              _flex_eager("math_attention"), _flex_eager("sdpa_dense"),
                              # routes to the operator that no name or identity catches: the dispatcher does
                              lambda q, k, v: torch.ops.aten.scaled_dot_product_attention.default.decompose(
                                  q, k, v, None, 0.0, True),
                              lambda q, k, v: torch._C._jit_get_operation("aten::scaled_dot_product_attention")[0](
                                  q, k, v, None, 0.0, True),
                              lambda q, k, v: functools.partial(_HELD[0], is_causal=True)(q, k, v),
                              _profile_off,
                              *((_onnx_attention,) if importlib.util.find_spec("torch.onnx.ops") else ())],
    "ch06.causal_multi_head": [lambda *a: exercises_multi_head._mha(*a)],
    "ch07.rope": [_ch07_private_rotation, lambda x, p: exercises_positional._rope(x, p),
                  *((_ch07_hf_rotate_half, _ch07_hf_apply) if importlib.util.find_spec("transformers") else ()),
                  *((_ch07_onnx_rotary,) if importlib.util.find_spec("torch.onnx.ops") else ())],
    "ch09.merge_partials": [lambda *a: exercises_at_scale._merge(*a)],
    "ch11.decode_mask": [_ch11_bottom_right, lambda L, S, w: exercises_decoder_lm._decode(L, S, w)],
    "ch12.causal_linear_attention": [lambda q, k, v: exercises_beyond_dense._linear(q, k, v)],
    "ch13.rollout": [lambda m: exercises_explanation._rollout(m)],
    "ch14.patchify": [lambda x, p: F.unfold(x, p, stride=p).transpose(1, 2),
                      lambda x, p: torch.nn.Unfold(p, stride=p)(x).transpose(1, 2),
                      lambda x, p: _UNFOLD(x, p, stride=p).transpose(1, 2),
                      lambda x, p: _TORCH_IN_A_DICT["im2col"](x, (p, p), (1, 1), (0, 0), (p, p)).transpose(1, 2),
                      lambda x, p: exercises_vision._patch_perm(x, p, (0, 2, 4, 1, 3, 5))],
    "ch15.residual": [lambda p, q: exercises_serving._residual(p, q)],
}


#: exercise -> [(name, mutant, what the report must say)]; the checker's known mistakes come with their hint.
EXTRA = {
    "ch01.boxcar_nw": (CH01, [
        CH01_LIBRARY,
        lambda q, k, v, h: _LIBRARY_IN_A_DICT["nw"](q, k, v, kernel="boxcar", bandwidth=h),
        lambda q, k, v, h: _NW_COPY(q, k, v, kernel="boxcar", bandwidth=h)]),
    "ch02.masked_softmax": (CH02, CH02_LIBRARY),
    "ch03.bahdanau_weights": (CH03, lambda *a: exercises_bahdanau._bahdanau_reference(*a)),  # AdditiveAttention
    "ch04.local_p_weights": (CH04, [
        CH04_LIBRARY,
        lambda s, c, D: _LIBRARY_IN_A_DICT["lw"](s, c, D, gaussian=True),
        lambda s, c, D: ra.masked_softmax(s) * ra.gaussian_window(c, s.shape[-1], D)]),
    "ch05.causal_attention": (CH05, CH05_LIBRARY),
    "ch06.causal_multi_head": (CH06, _ch06_library),
    "ch07.rope": (CH07, [lambda x, p: apply_rotary(x, p), _ch07_captured]),
    "ch08.causal_attention": (CH08, CH08_LIBRARY),
    "ch09.merge_partials": (CH09, []),
    "ch10.mean_pool": (CH10, CH10_LIBRARY + [lambda h, m: _LIBRARY_IN_A_DICT["mp"](h, m),
                                            # torch's and sentence-transformers' whole-answer functions
                                            lambda h, m: torch.masked.mean(h, dim=1, mask=m[..., None].expand_as(h)),
                                            lambda h, m: torch.masked.sum(h, dim=1, mask=m[..., None].expand_as(h))
                                            / m.sum(1, keepdim=True),
                                            _ch10_st_pooling]),
    "ch11.decode_mask": (CH11, CH11_LIBRARY + [
        lambda L, S, w: _LIBRARY_IN_A_DICT["cm"](L, S, w),
        lambda L, S, w: (masks.causal_mask(S) if w is None else masks.sliding_window_mask(S, w))[S - L:]]),
    "ch12.causal_linear_attention": (CH12, CH12_LIBRARY),
    "ch13.rollout": (CH13, CH13_LIBRARY),
    "ch14.patchify": (CH14, [lambda x, p: vit.patchify(x, p), lambda x, p: _LIBRARY_IN_A_DICT["pf"](x, p)]),
    "ch15.residual": (CH15, CH15_LIBRARY),
    "ch16.zigzag_block_mask": (_ch16.EXTRA_MISTAKES, _ch16.LIBRARY),
    "ch17.sink_attention": (_ch17.EXTRA_MISTAKES, _ch17.LIBRARY),
    "ch18.fake_quantize_blocks": ([
        ("float32 whatever x's dtype", lambda x, b: elp.fake_quantize_blocks_mistake(x, b).float()),
        ("the scale of the block's first row only", lambda x, b: torch.cat([
            elp.fake_quantize_blocks_mistake(x[r:r + b], b, per_tensor=True) if x[r].abs().amax() == 0 else
            (x[r:r + b] / (x[r].abs().amax() / 448)).to(torch.float8_e4m3fn).to(x.dtype) * (x[r].abs().amax() / 448)
            for r in range(0, x.shape[0], b)])),
        ("float16 instead of FP8", lambda x, b: elp.fake_quantize_blocks_mistake(x, b, dtype=torch.float16)),
    ], [lambda x, b: lp.fake_quantize(x, block_size=b),
        lambda x, b: lp.quantize_fp8(x, "e4m3", block_size=b).dequantize(x.dtype)]),
}
MUTANTS: dict = {}
for _key in ce.EXERCISES:
    _spec = ce.spec(_key)
    _extra, _library = EXTRA[_key]
    MUTANTS[_key] = ([(f"known: {m.hint[:40]}", _outside(m.fn), f"Hint: {m.hint}") for m in _spec.mistakes]
                     + [(name, fn, None) for name, fn in _extra]
                     + [(f"calls the library {i}", fn, LIBRARY) for i, fn in enumerate(_as_list(_library))]
                     + [(f"route {i}", fn, LIBRARY) for i, fn in enumerate(ROUTES.get(_key, []))])


# ------------------------------------------------------------------------------- correct, written differently


def _ch01_loop(queries, keys, values, bandwidth):
    out = []
    for q in queries.tolist():
        near = [v for k, v in zip(keys.tolist(), values.tolist()) if abs(q - k) <= bandwidth]
        out.append(sum(near) / len(near) if near else 0.0)
    return torch.tensor(out, dtype=torch.float64)


def _ch02_where(scores, mask):
    s = scores.double().masked_fill(~mask, NEG_INF)
    top = s.max(-1, keepdim=True).values
    e = torch.where(mask, torch.exp(s - torch.where(mask.any(-1, keepdim=True), top, 0.0)), 0.0)
    return (e / e.sum(-1, keepdim=True).clamp(min=1e-300)).float()


def _ch03_einsum(s_prev, h, mask, W_a, U_a, v_a):
    e = torch.einsum("a,bsa->bs", v_a, torch.tanh(torch.einsum("ad,bd->ba", W_a, s_prev)[:, None]
                                                    + torch.einsum("ak,bsk->bsa", U_a, h)))
    e = torch.where(mask, e - e.masked_fill(~mask, NEG_INF).amax(-1, keepdim=True), NEG_INF)
    return e.exp() / e.exp().sum(-1, keepdim=True)


def _ch04_gauss_first(scores, center, D):
    s = torch.arange(scores.shape[-1], dtype=torch.float64)
    d = s - center.double()[..., None]
    g = torch.exp(-2 * d**2 / D**2)
    w = torch.where(d.abs() <= D, scores.double(), NEG_INF).softmax(-1)
    return (g * w).float()


def _ch05_einsum(q, k, v):
    L = q.shape[0]
    s = torch.einsum("ie,je->ij", q.double(), k.double()) / math.sqrt(q.shape[1])
    s = torch.where(torch.arange(L)[None, :] <= torch.arange(L)[:, None], s, NEG_INF)
    return (s.softmax(-1) @ v.double()).float()


def _ch06_alt(x, w_q, w_k, w_v, w_o, num_heads):  # computed in float32, returned in x's dtype
    B, L, D = x.shape
    E = D // num_heads
    x32 = x.float()
    q, k, v = (torch.einsum("bld,de->ble", x32, w.float()).reshape(B, L, num_heads, E) for w in (w_q, w_k, w_v))
    s = torch.einsum("bihe,bjhe->bhij", q, k) * E**-0.5
    s = s + torch.full((L, L), NEG_INF).triu(1)
    o = torch.einsum("bhij,bjhe->bihe", s.softmax(-1), v).reshape(B, L, D)
    return (o @ w_o.float()).to(x.dtype)


def _ch07_complex(x, positions):  # pairs as complex numbers, in float32, returned in x's dtype
    N, E = x.shape
    theta = 10000.0 ** (-torch.arange(E // 2, dtype=torch.float32) * 2 / E)
    z = torch.complex(x[:, : E // 2].float(), x[:, E // 2 :].float()) * torch.polar(
        torch.ones(N, E // 2), positions.float()[:, None] * theta)
    return torch.cat([z.real, z.imag], -1).to(x.dtype)


def _ch08_float64(q, k, v):
    T = q.shape[-2]
    s = torch.matmul(q.double() / math.sqrt(q.shape[-1]), k.double().transpose(-1, -2))
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), NEG_INF)
    return torch.softmax(s, -1) @ v.double()


def _ch09_float32(o1, m1, l1, o2, m2, l2):  # rescale factors in float32
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp((m1 - m).float()).double(), torch.exp((m2 - m).float()).double()
    return o1 * a1 + o2 * a2, m, l1 * a1 + l2 * a2


def _ch10_float32(hidden, mask):
    h = hidden.float()
    counts = mask.sum(-1, keepdim=True)  # (B, 1)
    return torch.stack([h[b, mask[b]].sum(0) for b in range(h.shape[0])]) / counts


def _ch12_running_sums(query, key, value):
    """The recurrent form, one token at a time, in float64 (the reader's dtype given back)."""
    fq, fk = (F.elu(x.double()) + 1 for x in (query, key))
    S = torch.zeros(*fk.shape[:-2], fk.shape[-1], value.shape[-1], dtype=torch.float64)
    z = torch.zeros(fk.shape[:-1][:-1] + fk.shape[-1:], dtype=torch.float64)
    outs = []
    for t in range(fq.shape[-2]):
        S = S + fk[..., t, :, None] * value.double()[..., t, None, :]
        z = z + fk[..., t, :]
        outs.append((fq[..., t, None, :] @ S)[..., 0, :] / (fq[..., t, :] * z).sum(-1, keepdim=True))
    return torch.stack(outs, -2).to(value.dtype)


def _ch14_unfold(images, patch_size):
    return vit_unfold(images, patch_size)


def _ch14_loops(images, patch_size):
    B, C, H, W = images.shape
    p = patch_size
    rows = [images[:, :, r:r + p, c:c + p].reshape(B, -1) for r in range(0, H, p) for c in range(0, W, p)]
    return torch.stack(rows, dim=1)
def _ch15_loop(p, q):
    rows = []
    for pr, qr in zip(p.reshape(-1, p.shape[-1]).float(), q.reshape(-1, q.shape[-1]).float()):
        r = torch.relu(pr - qr)
        rows.append(r / r.sum() if r.sum() > 0 else pr)
    return torch.stack(rows).reshape(p.shape).to(p.dtype)


def _ch11_triangles(L, S, window):
    ones = torch.ones(L, S, dtype=torch.bool)
    mask = ones.tril(S - L)
    return mask if window is None else mask & ~ones.tril(S - L - window)


def _ch13_float32_loop(maps):
    n, L, _ = maps.shape
    out = torch.eye(L)
    for layer in range(n):  # float32, and the identity first: I then each layer on the left
        out = (0.5 * maps[layer].float() + 0.5 * torch.eye(L)) @ out
    return out


def _ch18_padded(x, block):  # all blocks at once: pad the rows to a multiple of the block, one amax per block
    L, E = x.shape
    xc = x.double() if x.dtype == torch.float64 else x.float()
    nb = -(-L // block)
    padded = torch.cat([xc, xc.new_zeros(nb * block - L, E)]).view(nb, block, E)  # (nb, block, E)
    amax = padded.abs().amax(dim=(1, 2), keepdim=True)  # (nb, 1, 1)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / 448)
    out = (padded / scale).to(torch.float8_e4m3fn).to(xc.dtype) * scale
    return out.view(nb * block, E)[:L].to(x.dtype)


ALTERNATIVES = {"ch01.boxcar_nw": [_ch01_loop], "ch02.masked_softmax": [_ch02_where],
                "ch03.bahdanau_weights": [_ch03_einsum], "ch04.local_p_weights": [_ch04_gauss_first],
                "ch05.causal_attention": [_ch05_einsum], "ch06.causal_multi_head": [_ch06_alt],
                "ch07.rope": [_ch07_complex], "ch08.causal_attention": [_ch08_float64],
                "ch09.merge_partials": [_ch09_float32], "ch10.mean_pool": [_ch10_float32],
                "ch11.decode_mask": [_ch11_triangles],
                "ch12.causal_linear_attention": [_ch12_running_sums], "ch13.rollout": [_ch13_float32_loop],
                "ch14.patchify": [_ch14_unfold, _ch14_loops],
                "ch15.residual": [_ch15_loop], "ch18.fake_quantize_blocks": [_ch18_padded]}


# ------------------------------------------------------------------------------------------ worked solutions


def _cells(key):
    nb = json.loads((BOOK / f"{NOTEBOOK[key.split('.')[0]]}.ipynb").read_text())
    return nb["cells"]


def _worked_copy(key):
    """The chapters' worked solutions as they stand in the pages (accepted whether or not the page still
    carries them as code)."""
    name = key.split(".")[1]
    namespace = {"torch": torch, "math": math}
    exec(compile(WORKED_COPIES[key], f"<{key} worked copy>", "exec"), namespace)  # noqa: S102
    return namespace[name]


WORKED_COPIES = {
    "ch01.boxcar_nw": """
def boxcar_nw(queries, keys, values, bandwidth):
    inside = ((queries[:, None] - keys[None, :]).abs() <= bandwidth).float()
    return (inside @ values) / inside.sum(-1).clamp(min=1)
""",
    "ch02.masked_softmax": """
def masked_softmax(scores, mask):
    dead = ~mask.any(dim=-1, keepdim=True)
    w = torch.softmax(scores.masked_fill(~mask, float("-inf")).masked_fill(dead, 0.0), dim=-1)
    return w.masked_fill(dead, 0.0)
""",
    "ch03.bahdanau_weights": """
def bahdanau_weights(s_prev, h, mask, W_a, U_a, v_a):
    hidden = torch.tanh((s_prev @ W_a.T)[:, None, :] + h @ U_a.T)
    return torch.softmax((hidden @ v_a).masked_fill(~mask, float("-inf")), dim=-1)
""",
    "ch04.local_p_weights": """
def local_p_weights(scores, center, D):
    dist = torch.arange(scores.shape[-1], dtype=scores.dtype) - center[..., None]
    w = torch.softmax(scores.masked_fill(dist.abs() > D, float("-inf")), dim=-1)
    return w * torch.exp(-dist**2 / (2 * (D / 2) ** 2))
""",
    "ch05.causal_attention": """
def causal_attention(q, k, v):
    scores = q @ k.T / q.shape[-1] ** 0.5
    future = ~torch.tril(torch.ones_like(scores, dtype=torch.bool))
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v
""",
    "ch06.causal_multi_head": """
def causal_multi_head(x, w_q, w_k, w_v, w_o, num_heads):
    B, L, D = x.shape
    E = D // num_heads
    def heads(t):
        return t.view(B, L, num_heads, E).transpose(1, 2)
    q, k, v = heads(x @ w_q), heads(x @ w_k), heads(x @ w_v)
    scores = q @ k.transpose(-2, -1) / E**0.5
    later = torch.ones(L, L, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(later, float("-inf")).softmax(-1)
    return (weights @ v).transpose(1, 2).reshape(B, L, D) @ w_o
""",
    "ch07.rope": """
def rope(x, positions):
    N, E = x.shape
    theta = 10000.0 ** (-torch.arange(0, E, 2, dtype=torch.float64) / E)
    angle = positions.to(torch.float64)[:, None] * theta
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    a, b = x[:, : E // 2], x[:, E // 2 :]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
""",
    "ch08.causal_attention": """
def causal_attention(q, k, v):
    T, E = q.shape[-2], q.shape[-1]
    scores = q @ k.transpose(-2, -1) / math.sqrt(E)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v
""",
    "ch09.merge_partials": """
def merge_partials(o1, m1, l1, o2, m2, l2):
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    return a1 * o1 + a2 * o2, m, a1 * l1 + a2 * l2
""",
    "ch10.mean_pool": """
def mean_pool(hidden, mask):
    m = mask.to(hidden.dtype)[..., None]
    return (hidden * m).sum(1) / m.sum(1)
""",
    "ch12.causal_linear_attention": """
def causal_linear_attention(query, key, value):
    fq, fk = torch.nn.functional.elu(query) + 1, torch.nn.functional.elu(key) + 1
    L = query.shape[-2]
    A = (fq @ fk.transpose(-2, -1)) * torch.ones(L, L, dtype=torch.bool).tril()
    return (A @ value) / A.sum(-1, keepdim=True)
""",
    "ch11.decode_mask": """
def decode_mask(L, S, window):
    i = torch.arange(L)[:, None] + (S - L)
    j = torch.arange(S)[None, :]
    mask = j <= i
    return mask if window is None else mask & (j > i - window)
""",
    "ch13.rollout": """
def rollout(maps):
    L = maps.shape[-1]
    out = torch.eye(L, dtype=maps.dtype)
    for a in maps:
        out = (a + torch.eye(L, dtype=maps.dtype)) / 2 @ out
    return out
""",
    "ch14.patchify": """
def patchify(images, patch_size):
    B, C, H, W = images.shape
    p = patch_size
    x = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C * p * p)
""",
    "ch15.residual": """
def residual(p, q):
    r = (p - q).clamp_min(0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass, p)
""",
    "ch18.fake_quantize_blocks": """
def fake_quantize_blocks(x, block):
    out = torch.empty_like(x)
    for r0 in range(0, x.shape[0], block):
        part = x[r0:r0 + block]
        amax = part.abs().amax()
        scale = amax / 448 if amax > 0 else torch.ones_like(amax)
        out[r0:r0 + block] = (part / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale
    return out
""",
}


def worked_solution(key):
    """The chapter's worked solution, read from the notebook (a code cell or a fenced block of a solution)."""
    name = key.split(".")[1]
    namespace = {"torch": torch, "math": math, "F": F, "partial_softmax": ce.partial_softmax}
    for cell in _cells(key):
        src = "".join(cell["source"])
        if cell["cell_type"] == "code" and f"def {name}_solution(" in src:
            # the reader who writes the worked solution out in the stub: the same code under the exercise's name
            # (the function the chapter defines as <name>_solution is refused whatever it is called)
            exec(compile(src.replace(f"{name}_solution", name), f"<{key} worked solution>", "exec"),  # noqa: S102
                 namespace)
            return namespace.pop(name)
        if cell["cell_type"] == "markdown":
            for block in re.findall(r"```python\n(.*?)```", src, flags=re.S):
                if f"def {name}_solution(" in block or f"def {name}(" in block:
                    exec(compile(block.replace(f"{name}_solution", name), f"<{key} solution>", "exec"),  # noqa: S102
                         namespace)
                    return namespace.pop(name)
    return None  # the chapter's solution is prose only: the copy below stands for it


# ------------------------------------------------------------------------------------------------------ tests

MUTANT_CASES = [pytest.param(key, i, id=f"{key}-{i}-{name[:30]}")
                for key, rows in MUTANTS.items() for i, (name, _, _) in enumerate(rows)]


def test_at_least_four_mutants_per_exercise(capsys):
    counts = {key: len(rows) for key, rows in MUTANTS.items()}
    with capsys.disabled():
        print("\nmutants per code exercise:", ", ".join(f"{k} {n}" for k, n in counts.items()),
              f"(total {sum(counts.values())})")
    assert set(counts) == set(ce.EXERCISES) and len(counts) == len(ce.EXERCISES)
    assert all(n >= 4 for n in counts.values()), counts


@pytest.mark.parametrize("key,index", MUTANT_CASES)
def test_mutant_is_rejected_with_a_teaching_message(key, index):
    name, mutant, must_say = MUTANTS[key][index]
    spec = ce.spec(key)
    report = code_checks.check_function(mutant, spec)
    assert report.status == "failed", f"{key}: the checker accepts the mistake {name!r}"
    msg = report.message
    for arg in spec.arg_names:  # the failing input, under the statement's names
        assert f"\n  {arg} = " in msg, f"{key}: argument {arg!r} not named in\n{msg}"
    assert "argument 0" not in msg and " it values" not in msg and "1 positions" not in msg
    if must_say is not None:
        assert must_say in msg, f"{key} {name!r}: the report lacks {must_say!r}:\n{msg}"
    if " differ at " in msg:  # a value difference: where, expected, got
        assert re.search(r"the first at index \([0-9, ]*\): expected \S+, got \S+", msg), msg


@pytest.mark.parametrize("key", ce.EXERCISES)
def test_worked_and_alternative_solutions_are_accepted(key):
    spec = ce.spec(key)
    in_page = worked_solution(key)
    for fn in [f for f in (in_page, _worked_copy(key)) if f is not None] + ALTERNATIVES[key]:
        report = code_checks.check_function(fn, spec)
        assert report.passed, f"{key}: a correct solution ({fn.__name__}) is rejected:\n{report.message}"
        assert report.tried >= len(spec.examples) + 10


@pytest.mark.parametrize("key", ce.EXERCISES)
def test_statement_example_and_edge_cases(key):
    """Each exercise's first edge case is the statement's worked example, and its output appears in it."""
    spec = ce.spec(key)
    assert len(spec.examples) >= 3 and len(spec.mistakes) >= 3
    for case in spec.examples:  # every edge case is a valid input of the reference
        spec.reference(*case)
    statement = STATEMENT_OUTPUT[key]
    cells = _cells(key)
    stub = next(i for i, c in enumerate(cells) if c["cell_type"] == "code"
                and "raise NotImplementedError" in "".join(c["source"]) and f"def {key.split('.')[1]}(" in
                "".join(c["source"]))
    text = "".join(cells[stub - 1]["source"])
    assert statement in text, f"{key}: the statement's example output {statement!r} is not in:\n{text}"
    if key == "ch09.merge_partials":  # the statement shows merge's own (o, m, l)
        out = exercises_at_scale._merge(*spec.reader_args(spec.examples[0]))
    else:
        out = spec.reference(*spec.examples[0])
    assert _fmt_example(out) == statement, (key, _fmt_example(out))


def _fmt_example(out):
    if isinstance(out, tuple):
        return "(" + ", ".join(_fmt_example(o) for o in out) + ")"
    if out.dtype == torch.bool:
        return str(out.tolist())
    if out.dim() == 0:
        return str(round(out.item(), 4))
    return str(torch.round(out.double(), decimals=4).tolist())


STATEMENT_OUTPUT = {
    "ch01.boxcar_nw": "[2.0, 5.0]",
    "ch02.masked_softmax": "[[0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]",
    "ch03.bahdanau_weights": "[[0.5, 0.5, 0.0]]",
    "ch04.local_p_weights": "[[[0.0271, 0.1213, 0.2, 0.1213, 0.0271]]]",
    "ch05.causal_attention": "[[2.0], [3.0]]",
    "ch06.causal_multi_head": "[[[1.0, 2.0], [0.5, 1.0]]]",
    "ch07.rope": "[[1.0, 0.0], [-0.4161, 0.9093]]",
    "ch08.causal_attention": "[[[[2.0], [3.0]]]]",
    "ch09.merge_partials": "([2.5413], 2.0, 1.1353)",
    "ch10.mean_pool": "[[2.0, 3.0]]",
    "ch11.decode_mask": "[[True, True, True, False], [True, True, True, True]]",
    "ch12.causal_linear_attention": "[[2.0], [3.0]]",
    "ch13.rollout": "[[0.75, 0.25], [0.5, 0.5]]",
    "ch14.patchify": "[[[0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0], [8.0, 9.0, 12.0, 13.0], [10.0, 11.0, 14.0, 15.0]]]",
    "ch15.residual": "[0.6667, 0.3333, 0.0]",
    "ch18.fake_quantize_blocks": "[[448.0, 1.0], [0.5, 0.0], [7.0, -3.25]]",
}


def test_library_is_unavailable_while_the_reader_runs_and_restored_after():
    spec = ce.spec("ch02.masked_softmax")
    before = (ac.masked_softmax, lib_masked_softmax)
    namespace = {"masked_softmax": ac.masked_softmax, "guarded_softmax": print, "other": torch.softmax}
    with code_checks.unavailable(spec, namespace):
        with pytest.raises(code_checks.NotForThisExercise, match="asks you to write the masked softmax yourself"):
            ac.masked_softmax(torch.zeros(1, 1), None)
        with pytest.raises(code_checks.NotForThisExercise):
            namespace["masked_softmax"](torch.zeros(1, 1))
        with pytest.raises(code_checks.NotForThisExercise):
            namespace["guarded_softmax"]()
        assert namespace["other"] is torch.softmax
    assert (ac.masked_softmax, lib_masked_softmax) == before and namespace["guarded_softmax"] is print
    with pytest.raises(ZeroDivisionError), code_checks.unavailable(spec, namespace):  # restored after an error
        namespace["other"](torch.zeros(1) / 0, 0).item() / 0
    assert ac.masked_softmax is before[0] and namespace["masked_softmax"] is before[0]


def test_ch18_one_scale_per_row_is_named() -> None:
    """A reader's own per-row scaling (not the checker's helper) is told to take amax over the whole block."""
    def per_row(x, block):
        amax = x.abs().amax(dim=-1, keepdim=True)  # (L, 1): one scale per row, whatever block says
        scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
        return (x / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale

    report = code_checks.check_function(per_row, ce.spec("ch18.fake_quantize_blocks"))
    assert report.status == "failed" and "not one per row" in report.message, report.message


def test_ch18_amax_without_abs_is_named() -> None:
    """A reader's scale from the block's largest x (no abs) is told to take the largest |x|."""
    def no_abs(x, block):
        out = torch.empty_like(x)
        for r0 in range(0, x.shape[0], block):
            amax = x[r0:r0 + block].amax()  # the mistake: a negative outlier does not count
            scale = amax / 448 if amax != 0 else torch.ones_like(amax)
            out[r0:r0 + block] = (x[r0:r0 + block] / scale).to(torch.float8_e4m3fn).to(x.dtype) * scale
        return out

    report = code_checks.check_function(no_abs, ce.spec("ch18.fake_quantize_blocks"))
    assert report.status == "failed" and "not its largest x" in report.message, report.message


def test_the_pages_worked_solution_is_unavailable_to_the_reader():
    """Chapter 18's folded worked solution runs in the reader's namespace: a function calling it is refused."""
    page = {"torch": torch}  # the notebook's globals: its worked-solution cell, then the reader's cell
    exec(compile(WORKED_COPIES["ch18.fake_quantize_blocks"].replace("def fake_quantize_blocks(",  # noqa: S102
                                                                     "def fake_quantize_blocks_solution(")
                 + "\ndef fake_quantize_blocks(x, block):\n    return fake_quantize_blocks_solution(x, block)\n",
                 "<ch18 page>", "exec"), page)
    report = code_checks.check_function(page["fake_quantize_blocks"], ce.spec("ch18.fake_quantize_blocks"))
    assert report.status == "failed" and "fake_quantize_blocks_solution) is not available" in report.message, \
        report.message


@pytest.mark.parametrize("key,fn,arg", IN_PLACE, ids=[k for k, _, _ in IN_PLACE])
def test_an_answer_that_changes_its_input_in_place_is_refused(key, fn, arg):
    """Right values, but the caller's tensor overwritten: refused, and the report names the argument."""
    report = code_checks.check_function(fn, ce.spec(key))
    assert report.status == "failed" and f"changed its argument `{arg}` in place" in report.message, report.message


def test_in_place_check_sees_nan_and_shape_changes_and_spares_a_view():
    spec = ce.spec("ch14.patchify")
    ok = code_checks.check_function(lambda x, p: vit_unfold(x, p), spec)  # no change: accepted
    assert ok.passed
    grown = code_checks.check_function(lambda x, p: (lambda out: (x.unsqueeze_(0), out)[1])(vit_unfold(x, p)), spec)
    assert "changed its argument `images` in place" in grown.message  # a shape changed in place
    pristine = (torch.tensor([1.0, float("nan")]),)
    assert code_checks._changed_argument((pristine[0].clone(),), pristine, spec) is None  # NaN equals NaN here
    assert code_checks._changed_argument((torch.tensor([1.0, 2.0]),), pristine, spec) == "`images`"


@pytest.mark.parametrize("key", ce.EXERCISES)
def test_every_unavailable_name_exists(key):
    for path in ce.spec(key).unavailable:
        assert callable(refusals._resolve(path)[2]), path


def test_report_grammar_and_first_difference():
    def one_off(hidden, mask):  # right everywhere but at one position
        m = mask.to(hidden.dtype)[..., None]  # (B, L, 1)
        out = (hidden * m).sum(1) / m.sum(1)
        out[0, 0] += 1
        return out

    report = code_checks.check_function(one_off, ce.spec("ch10.mean_pool"))
    assert "values differ at 1 position of 2; the first at index (0, 0): expected 2, got 3" in report.message


def test_dtype_named_by_the_statement_is_checked():
    report = code_checks.check_function(_ch07_float32, ce.spec("ch07.rope"))
    assert "dtype torch.float32, but the statement asks for x's dtype (torch.float64)" in report.message


def test_exercises_module_still_offers_the_checker():
    assert exercises.check_function is code_checks.check_function and exercises.FunctionSpec is code_checks.FunctionSpec
    assert exercises.CORRECT == code_checks.CORRECT and exercises.NOT_YET == code_checks.NOT_YET
    assert exercises.check_exercise(lambda L, S, w: own._decode(L, S, w), "ch11.decode_mask").passed
    with pytest.raises(KeyError, match="ch07.rope"):
        ce.spec("ch07.nope")


@pytest.mark.parametrize("key", ce.EXERCISES)
def test_notebook_checks_with_this_spec_in_one_cell_after_the_stub(key):
    cells = _cells(key)
    name = key.split(".")[1]
    stub = next(i for i, c in enumerate(cells) if c["cell_type"] == "code" and f"def {name}(" in "".join(c["source"])
                and "raise NotImplementedError" in "".join(c["source"]))
    checker = "".join(cells[stub + 1]["source"])
    assert cells[stub + 1]["cell_type"] == "code" and f'exercises.check_exercise({name}, "{key}")' in checker
    everything = "\n".join("".join(c["source"]) for c in cells)
    assert "prove_checker(" not in everything, f"{key}: a proof cell feeding the checker wrong answers remains"


def test_chapter_9_partial_softmax_is_the_one_the_checker_uses():
    stub = next("".join(c["source"]) for c in _cells("ch09.merge_partials")
                if "def partial_softmax(" in "".join(c["source"]))
    namespace = {"torch": torch}
    exec(compile(stub, "<ch09 stub>", "exec"), namespace)  # noqa: S102 - the book's own code
    s, v = torch.tensor([0.5, -2.0, 3.0], dtype=torch.float64), torch.arange(6, dtype=torch.float64).view(3, 2)
    for a, b in zip(namespace["partial_softmax"](s, v), ce.partial_softmax(s, v)):
        assert torch.equal(a, b)


# chapter 16 (its entries live in tests/_exercises_ch16.py)
ALTERNATIVES["ch16.zigzag_block_mask"] = _ch16.ALTERNATIVES
WORKED_COPIES["ch16.zigzag_block_mask"] = _ch16.WORKED_COPY
STATEMENT_OUTPUT["ch16.zigzag_block_mask"] = _ch16.STATEMENT_OUTPUT
# chapter 17 (its entries live in tests/_exercises_ch17.py)
ALTERNATIVES["ch17.sink_attention"] = _ch17.ALTERNATIVES
WORKED_COPIES["ch17.sink_attention"] = _ch17.WORKED_COPY
STATEMENT_OUTPUT["ch17.sink_attention"] = _ch17.STATEMENT_OUTPUT


WORKED_IN_CODE = [key for key in ce.EXERCISES if any(
    c["cell_type"] == "code" and f"def {key.split('.')[1]}_solution(" in "".join(c["source"]) for c in _cells(key))]


@pytest.mark.parametrize("key", WORKED_IN_CODE)
def test_the_worked_solution_is_refused_under_any_name(key):
    """After "Run all" the chapter's worked solution is in the reader's namespace: calling it, binding the
    exercise's name to it, or an alias of it is refused (by name, and by its code)."""
    name = key.split(".")[1]
    cell = next("".join(c["source"]) for c in _cells(key)
                if c["cell_type"] == "code" and f"def {name}_solution(" in "".join(c["source"]))
    for route in (f"def {name}(*args):\n    return {name}_solution(*args)\n",  # calls it
                  f"{name} = {name}_solution\n",  # binds the name to it
                  f"_mine = {name}_solution\ndef {name}(*args):\n    return _mine(*args)\n"):  # an alias
        namespace = {"torch": torch, "math": math, "F": F, "partial_softmax": ce.partial_softmax}
        exec(compile(cell + "\n" + route, f"<{key} after Run all>", "exec"), namespace)  # noqa: S102
        report = code_checks.check_function(namespace[name], ce.spec(key))
        assert report.status == "failed" and LIBRARY in report.message, (key, route, report.message)
        assert "worked solution" in report.message, report.message
        assert namespace[f"{name}_solution"].__name__ == f"{name}_solution"  # restored afterwards


def test_torch_whole_answer_is_named_in_the_statement():
    """Where torch's function computes the whole answer, the exercise's statement says it is not for this one."""
    for key, words in (("ch14.patchify", "F.unfold"), ("ch02.masked_softmax", "scaled_dot_product_attention")):
        cells = _cells(key)
        name = key.split(".")[1]
        stub = next(i for i, c in enumerate(cells) if c["cell_type"] == "code" and f"def {name}(" in
                    "".join(c["source"]) and "raise NotImplementedError" in "".join(c["source"]))
        assert words in "".join(cells[stub - 1]["source"]), f"{key}: the statement does not name {words}"
        assert words in ce.spec(key).task


# ---------------------------------------------------------------------------------------------------- hints
# A hint names a known mistake only when the submission behaves as that mistake on the inputs that tell them apart.
# Right values in another dtype, or right values with an input changed in place, used to be told about a mistake
# that gives the right values on that input; now the report says what differs and names no mistake.

KNOWN_HINTS = {key: [m.hint for m in ce.spec(key).mistakes] for key in ce.EXERCISES}
DTYPE_ASKED = [key for key in ce.EXERCISES if ce.spec(key).dtype is not None]


def _cast(out, dtype):
    return tuple(_cast(o, dtype) for o in out) if isinstance(out, tuple) else out.to(dtype)


def _names_a_known_mistake(key, message):
    return any(f"Hint: {hint}" in message for hint in KNOWN_HINTS[key])


@pytest.mark.parametrize("key", DTYPE_ASKED)
def test_right_values_in_another_dtype_get_no_mistake_named(key):
    worked = _worked_copy(key)
    other = torch.uint8 if key == "ch11.decode_mask" else None

    def wrong_dtype(*args):
        out = worked(*args)
        if other is not None:
            return _cast(out, other)
        return _cast(out, torch.float32 if out.dtype == torch.float64 else torch.float64)

    report = code_checks.check_function(wrong_dtype, ce.spec(key))
    assert report.status == "failed" and "dtype" in report.message, report.message
    assert not _names_a_known_mistake(key, report.message), report.message


TENSOR_INPUT = [key for key in ce.EXERCISES if key not in ("ch11.decode_mask", "ch16.zigzag_block_mask")]  # ints in


@pytest.mark.parametrize("key", TENSOR_INPUT)
def test_right_values_with_an_input_changed_in_place_get_no_mistake_named(key):
    worked = _worked_copy(key)

    def mutating(*args):
        out = worked(*args)
        out = tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()
        first = next(a for a in args if isinstance(a, torch.Tensor))
        first.logical_not_() if first.dtype == torch.bool else first.add_(1)  # after computing: values right
        return out

    report = code_checks.check_function(mutating, ce.spec(key))
    assert report.status == "failed" and "in place" in report.message, report.message
    assert not _names_a_known_mistake(key, report.message), report.message


def _telling_mistake(key):
    """The first known mistake whose output differs from the library's on the statement's example."""
    spec = ce.spec(key)
    case = spec.examples[0]
    for m in spec.mistakes:
        try:
            if not code_checks._matches(spec.collected(_outside(m.fn), case), spec.reference(*case), spec):
                return m
        except Exception:  # noqa: BLE001
            continue
    return None


HINTED = [key for key in ce.EXERCISES if _telling_mistake(key) is not None]


@pytest.mark.parametrize("key", HINTED)
def test_a_mistake_matched_on_one_input_only_is_not_named(key):
    """Output equal to a known mistake's on the statement's example, another wrong answer elsewhere: the hint
    would name the wrong mistake, so none is named."""
    spec = ce.spec(key)
    mistake = _telling_mistake(key)
    made = _outside(mistake.fn)
    first = spec.reader_args(spec.examples[0])
    worked = _worked_copy(key)

    def same(a, b):
        return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))

    def sometimes(*args):
        if same(args, first):
            return made(*args)
        out = worked(*args)
        if isinstance(out, tuple):
            return (out[0] + 1, *out[1:])
        return ~out if out.dtype == torch.bool else out + 1

    report = code_checks.check_function(sometimes, spec)
    assert report.status == "failed", report.message
    assert f"Hint: {mistake.hint}" not in report.message, report.message
    # the same mistake made everywhere is named
    assert f"Hint: {mistake.hint}" in code_checks.check_function(made, spec).message


def _ch05_future_zero(q, k, v):  # "zero the future scores": masked_fill with 0 instead of -inf
    s = q @ k.T / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), 0.0), dim=-1) @ v


def _ch05_softmax_dim0(q, k, v):  # the softmax over dim 0 (the queries), written with F and -inf
    s = (q @ k.T * q.shape[-1] ** -0.5).masked_fill(~torch.ones(len(q), len(k)).tril().bool(), -math.inf)
    return F.softmax(s, 0) @ v


@pytest.mark.parametrize(("fn", "phrase"), [(_ch05_future_zero, "with -inf, not 0"),
                                            (_ch05_over_queries, "softmax over the keys"),
                                            (_ch05_softmax_dim0, "softmax over the keys")])
def test_ch05_zero_fill_and_wrong_softmax_dim_get_their_hints(fn, phrase):
    report = code_checks.check_function(fn, ce.spec("ch05.causal_attention"))
    hint = report.message.partition("\nHint: ")[2]
    assert report.status == "failed" and phrase in hint, report.message


def test_ch03_untransposed_W_a_gets_its_hint():
    """A reader's ``s_prev @ W_a`` (the .T missing) runs wherever the state and the score's hidden layer have
    the same width, gives wrong weights there, and is named (it crashed elsewhere with no hint before)."""

    def reader(s_prev, h, mask, W_a, U_a, v_a):
        e = torch.tanh((s_prev @ W_a).unsqueeze(1) + torch.einsum("bsk,ak->bsa", h, U_a)) @ v_a
        return torch.softmax(e.masked_fill(~mask, -math.inf), dim=-1)

    report = code_checks.check_function(reader, ce.spec("ch03.bahdanau_weights"))
    assert report.status == "failed", report.message
    assert "Hint: W_a is laid out like an nn.Linear weight" in report.message, report.message


def test_a_mistake_whose_own_output_has_another_shape_is_named():
    """Chapter 16's chunks cut evenly (not as tensor_split cuts them) give a mask of another shape on a length
    that 2P does not divide: the report says the shape differs and names that mistake."""
    spec = ce.spec("ch16.zigzag_block_mask")
    mistake = next(m for m in spec.mistakes if "tensor_split" in m.hint)
    report = code_checks.check_function(_outside(mistake.fn), spec)
    assert report.status == "failed", report.message
    assert " has shape " in report.message and f"Hint: {mistake.hint}" in report.message, report.message


def test_ch16_chunks_cut_with_torch_chunk_are_named():
    """Chapter 16: a reader who cuts the 2P chunks with torch.chunk (ceil-sized chunks, fewer than 2P when L runs
    out) gets a hint that names torch.chunk, not only the shape that differs."""
    def zigzag_block_mask(L, P, q_rank, k_rank):
        chunks = list(torch.chunk(torch.arange(L), 2 * P))
        chunks += [torch.arange(0)] * (2 * P - len(chunks))  # a missing chunk is empty

        def pos(r):
            return torch.cat([chunks[r], chunks[2 * P - 1 - r]])
        return pos(q_rank)[:, None] >= pos(k_rank)[None, :]

    spec = ce.spec("ch16.zigzag_block_mask")
    report = code_checks.check_function(zigzag_block_mask, spec)
    assert report.status == "failed", report.message
    assert "Hint: torch.chunk is not torch.tensor_split" in report.message, report.message


def _ch02_uniform_dead(scores, mask):  # -inf and a guard on the scores, the guarded rows' weights not zeroed
    dead = ~mask.any(-1, keepdim=True)
    return torch.softmax(scores.masked_fill(~mask, NEG_INF).masked_fill(dead, 0.0), -1)


CH02_FINITE_FILLS = {  # a student's own code for each mistake that leaves a fully masked row non-zero -> its hint
    "a finite fill (-1e9, -1e4) is not -inf": lambda s, m: torch.softmax(s.masked_fill(~m, -1e9), -1),
    "-1e9 is a wall of finite height": lambda s, m: torch.softmax(s.masked_fill(~m, -1e9), -1) * m,
    "adding -1e9 is not masking": lambda s, m: torch.softmax(s + (~m).float() * -1e9, -1),
    "a fully masked row gets equal weights": _ch02_uniform_dead,
}


def _no_causal_mask(q, k, v):  # a student's attention without the mask (the heads' shapes as given)
    return torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5, -1) @ v


def _scaled_by_e(q, k, v):  # the causal mask, but the scores divided by E
    s = q @ k.transpose(-2, -1) / q.shape[-1]
    return torch.softmax(s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf")), -1) @ v


@pytest.mark.parametrize("key", ["ch05.causal_attention", "ch08.causal_attention"])
@pytest.mark.parametrize("fn, start", [(_no_causal_mask, "mask the future"), (_scaled_by_e, "divide the scores")])
def test_causal_attention_without_the_mask_or_scaled_by_e_is_told_so(key, fn, start):
    """Two slips a referee tried on chapter 8's checker that got no hint: no causal mask at all, and 1/E."""
    message = code_checks.check_function(fn, ce.spec(key)).message
    named = [hint for hint in KNOWN_HINTS[key] if f"Hint: {hint}" in message]
    assert len(named) == 1 and named[0].startswith(start), message


@pytest.mark.parametrize("start", CH02_FINITE_FILLS)
def test_ch02_each_way_to_a_nonzero_dead_row_gets_its_own_hint(start):
    """A -1e9 fill, a -1e9 fill zeroed afterwards, -1e9 added, and -inf with a guard that leaves the guarded row
    uniform all give a fully masked row non-zero weights (the first and the last the same ones); each is told about
    the mistake it made and no other (the -inf submission used to be told that -1e9 is not -inf)."""
    spec = ce.spec("ch02.masked_softmax")
    message = code_checks.check_function(CH02_FINITE_FILLS[start], spec).message
    named = [hint for hint in KNOWN_HINTS["ch02.masked_softmax"] if f"Hint: {hint}" in message]
    assert len(named) == 1 and named[0].startswith(start), message


def test_values_wrong_only_at_fully_masked_rows_are_said_so():
    def half_in_dead_rows(scores, mask):
        w = _worked_copy("ch02.masked_softmax")(scores, mask)
        return torch.where(mask.any(-1, keepdim=True), w, torch.full_like(w, 0.5))

    report = code_checks.check_function(half_in_dead_rows, ce.spec("ch02.masked_softmax"))
    assert "differs only in rows that the library gives as all zeros" in report.message, report.message
    assert not _names_a_known_mistake("ch02.masked_softmax", report.message)


# --------------------------------------------------------------- ch. 11, exercise 3: a check for any passage


def test_window_rise_check_holds_on_any_passage():
    """The exercise's check recomputes the rise on the passage it is given: the right rise passes on every passage
    (the old hidden bound, 0 <= rise < 0.05, held on the chapter's passage only), a wrong one fails."""
    from attention_core.models.language_model import DecoderLM

    torch.manual_seed(0)
    model = DecoderLM(vocab_size=11, d_model=16, num_layers=2, num_heads=2).eval()
    g = torch.Generator().manual_seed(1)
    rises = []
    for length in (40, 57, 64):  # passages of another length and content than the chapter's
        text = torch.randint(0, 11, (1, length + 1), generator=g)
        inputs, targets = text[:, :-1], text[:, 1:]
        rise = ce.window_loss_rise(model, inputs, targets, 4, baseline=16, start=20)
        rises.append(rise)
        assert ce.check_window_rise(rise, model, inputs, targets, 4, baseline=16, start=20)
        assert not ce.check_window_rise(rise + 0.01, model, inputs, targets, 4, baseline=16, start=20)
        assert not ce.check_window_rise(float("nan"), model, inputs, targets, 4, baseline=16, start=20)
    assert not all(0 <= r < 0.05 for r in rises)  # the old bound does not hold on every passage
    with pytest.raises(ValueError, match="inputs must be"):
        ce.window_loss_rise(model, inputs, targets, 4, start=1000)


@pytest.mark.parametrize("key", WORKED_IN_CODE)
@pytest.mark.parametrize("route", ["partial", "class", "alias-then-del"])
def test_the_worked_solution_is_refused_however_it_is_reached(key, route):
    """Routes that never name the worked solution in the reader's function's globals: a ``functools.partial``
    of it, an object whose ``__call__`` is it, an alias kept after its name is deleted. Its code is refused."""
    name = key.split(".")[1]
    cell = next("".join(c["source"]) for c in _cells(key)
                if c["cell_type"] == "code" and f"def {name}_solution(" in "".join(c["source"]))
    tail = {"partial": f"import functools\n{name} = functools.partial({name}_solution)\n",
            "class": f"class _Mine:\n    __call__ = staticmethod({name}_solution)\n{name} = _Mine()\n",
            "alias-then-del": f"_sol = {name}_solution\ndel {name}_solution\n"
                              f"def {name}(*args):\n    return _sol(*args)\n"}[route]
    namespace = {"torch": torch, "math": math, "F": F, "partial_softmax": ce.partial_softmax}
    exec(compile(cell + "\n" + tail, f"<{key} after Run all>", "exec"), namespace)  # noqa: S102
    report = code_checks.check_function(namespace[name], ce.spec(key))
    assert report.status == "failed" and LIBRARY in report.message, (key, route, report.message)
    assert f"worked solution ({name}_solution)" in report.message, report.message
    assert sys.getprofile() is None or sys.getprofile().__name__ != "hook"  # the hook is removed afterwards


def test_drawn_inputs_belong_to_their_spec_and_go_with_it():
    """The drawn inputs are cached per spec; a freed spec's entry goes, and a spec that gets a freed (or any
    other) spec's id never gets that spec's inputs."""
    import gc

    from hypothesis import strategies as st

    def spec_of(value: float) -> code_checks.FunctionSpec:
        return code_checks.FunctionSpec("f", lambda x: x, st.just((torch.tensor([value]),)))

    first, second = spec_of(1.0), spec_of(2.0)
    drawn = code_checks._drawn(first)
    assert drawn and all(args[0].item() == 1.0 for args in drawn)
    assert code_checks._drawn(first) is drawn  # cached: the same inputs at every call
    # a stale entry under the second spec's id (as if the first had been freed and its id reused)
    code_checks._DRAWN[id(second)] = code_checks._DRAWN[id(first)]
    assert all(args[0].item() == 2.0 for args in code_checks._drawn(second))
    key = id(first)
    del first, drawn
    gc.collect()
    assert key not in code_checks._DRAWN  # freed with its spec
    assert id(second) in code_checks._DRAWN


# ------------------------------------------------------------------ the exercise modules' helpers are refused


def _module_functions(name):
    """The functions defined at the top level of module ``name`` (not those it imports)."""
    mod = sys.modules[name]
    return [obj for obj in vars(mod).values() if isinstance(obj, types.FunctionType) and obj.__module__ == name]


def _call_with_placeholders(fn):
    """Call ``fn`` with ``None`` for each required argument: the checker refuses the call when the function's
    frame starts, before its body could trip over the placeholders."""
    import inspect

    args, kwargs = [], {}
    for p in inspect.signature(fn).parameters.values():
        if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind == p.KEYWORD_ONLY:
            kwargs[p.name] = None
        else:
            args.append(None)
    return fn(*args, **kwargs)


@pytest.mark.parametrize("key", ce.EXERCISES)
def test_every_helper_of_the_chapters_module_and_the_shared_module_is_refused(key):
    """For every chapter, each function of the module that defines its exercise and of the shared helpers
    module raises NotForThisExercise while the reader's function runs; the registry names both in the spec."""
    spec = ce.spec(key)
    own = ce._BUILDERS[key].__module__
    shared = "attention_core.booktools.exercises_common"
    assert own in spec.helpers and shared in spec.helpers, (key, spec.helpers)
    checked = 0
    for name in (own, shared):
        functions = _module_functions(name)
        assert functions, name
        for fn in functions:
            with code_checks.unavailable(spec):
                with pytest.raises(code_checks.NotForThisExercise, match=LIBRARY):
                    _call_with_placeholders(fn)
            checked += 1
    assert checked >= 2
    # the whole route: a reader's function that reaches into either module gets the checker's refusal
    builder, strategies = ce._BUILDERS[key], sys.modules[shared].strategies
    for reach, module in [(lambda *a: builder(), own), (lambda *a: strategies(), shared)]:
        report = code_checks.check_function(reach, spec)
        assert report.status == "failed" and LIBRARY in report.message, (key, report.message)
        assert f"{module}." in report.message, (key, report.message)


def test_another_chapters_helper_is_refused_too():
    """Chapter 2's masked softmax inside chapter 8's attention: one chapter's helper computes part of another's
    answer, so every exercise module is unavailable to every exercise."""

    def with_chapter_2s_softmax(q, k, v):
        L = q.shape[-2]
        s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, L, L)
        return exercises_scoring._softmax_guarded(s, torch.ones(L, L, dtype=torch.bool).tril()) @ v

    report = code_checks.check_function(with_chapter_2s_softmax, ce.spec("ch08.causal_attention"))
    assert report.status == "failed" and "exercises_scoring._softmax_guarded" in report.message, report.message
    assert set(ce.SPEC_MODULES) >= {fn.__module__ for fn in ce._BUILDERS.values()}


# ------------------------------------------------------------------ ch. 1: the half-width hint; routes in threads


def _ch01_half_width(q, k, v, h):
    return (_inside(q, k, h / 2) @ v) / _inside(q, k, h / 2).sum(-1).clamp(min=1)


def test_ch01_a_half_width_window_is_not_told_about_the_edge():
    """`<= h / 2` (h read as the window's full width) and `<` (the edge dropped) agree on the statement's
    example; the edge case with a key between h/2 and h tells them apart, so each gets its own hint."""
    spec = ce.spec("ch01.boxcar_nw")
    edge = next(m for m in spec.mistakes if "(<=, not <)" in m.hint)
    half = next(m for m in spec.mistakes if "half-width" in m.hint)
    # the edge cases themselves tell the two apart, whatever inputs hypothesis draws
    assert any(not torch.equal(half.fn(*case), edge.fn(*case)) for case in spec.examples)
    message = code_checks.check_function(_ch01_half_width, spec).message
    assert f"Hint: {edge.hint}" not in message, message
    assert f"Hint: {half.hint}" in message, message
    strict = lambda q, k, v, h: (((q[:, None] - k[None, :]).abs() < h).float() @ v) / (  # noqa: E731
        (q[:, None] - k[None, :]).abs() < h).float().sum(-1).clamp(min=1)
    assert f"Hint: {edge.hint}" in code_checks.check_function(strict, spec).message


def test_a_hint_needs_the_mistake_on_every_case_not_only_where_it_is_wrong():
    """A submission that matches the edge mistake wherever that mistake is wrong, but is wrong where the mistake
    is right, makes another mistake: the edge hint is not given (a hint chosen on the telling inputs alone
    misnamed the half-width window)."""
    spec = ce.spec("ch01.boxcar_nw")
    edge = next(m for m in spec.mistakes if "(<=, not <)" in m.hint)
    lone = dataclasses.replace(spec, mistakes=(edge,))  # the edge mistake only: no other hint can answer
    message = code_checks.check_function(_ch01_half_width, lone).message
    assert "Hint:" not in message, message


def _pool_routes(ex, stash):
    return {
        "worked solution in a pool": lambda q, k, v, h: ex.submit(stash["solution"], q, k, v, h).result(),
        "a partial of it in a pool": lambda q, k, v, h: ex.submit(stash["partial"], q, k, v, h).result(),
        "library in a pool": lambda q, k, v, h: ex.submit(
            lambda: stash["nw"](q, k, v, kernel="boxcar", bandwidth=h)).result(),
        "library class in a pool": lambda q, k, v, h: ex.submit(
            lambda: stash["cls"](kernel="boxcar", bandwidth=h)(q, k, v)[0]).result(),
        "worked solution in a new thread": lambda q, k, v, h: _in_a_thread(stash["solution"], q, k, v, h),
        # a function of the forbidden module that no name patch reaches (the kernel, through KERNELS): its body
        # refuses too, so a pool started before the check cannot run it; a new thread also gets the hook
        "library kernel in a pool": lambda q, k, v, h: (lambda w: (w @ v) / (w > 0).float().sum(-1).clamp(min=1)
                                                        / w.max().clamp(min=1e-30))(
            ex.submit(stash["kernels"]["boxcar"], (q[:, None] - k[None, :]) / h).result()),
        "library kernel in a new thread": lambda q, k, v, h: _in_a_thread(
            lambda: (lambda w: (w @ v) / w.sum(-1).clamp(min=1))(
                stash["kernels"]["boxcar"]((q[:, None] - k[None, :]) / h))),
    }


def _in_a_thread(f, *args):
    import threading

    out = {}

    def run():
        try:
            out["value"] = f(*args)
        except Exception as err:  # noqa: BLE001 - handed back to the caller's thread
            out["error"] = err

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("started_before", [True, False])
def test_ch01_the_answer_run_in_another_thread_is_refused(started_before):
    """The profile hook sees only its own thread: a submission that hands the worked solution (kept in a dict,
    or as a ``functools.partial``) or the library (a named function, a class, an unnamed kernel) to a worker
    thread used to pass. The blocked functions' bodies refuse for the check's duration, in every thread, and
    come back afterwards."""
    import concurrent.futures
    import functools

    from attention_core import kernel_regression as kr

    namespace = {"torch": torch}
    exec(compile(worked_solution_source("ch01.boxcar_nw"), "<ch01 after Run all>", "exec"), namespace)  # noqa: S102
    solution = namespace["boxcar_nw_solution"]
    stash = {"solution": solution, "partial": functools.partial(solution), "nw": ac.nadaraya_watson,
             "cls": kr.NadarayaWatson, "kernels": dict(kr.KERNELS)}
    spec = ce.spec("ch01.boxcar_nw")
    codes = (solution.__code__, ac.nadaraya_watson.__code__, kr.NadarayaWatson.forward.__code__, kr.boxcar.__code__)
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        if started_before:
            ex.submit(int).result()  # the worker thread exists before the check starts
        for route, body in _pool_routes(ex, stash).items():
            fn = types.FunctionType(compile("def boxcar_nw(q, k, v, h):\n    return body(q, k, v, h)\n", "<reader>",
                                            "exec").co_consts[0], namespace | {"body": body})
            report = code_checks.check_function(fn, spec)
            assert report.status == "failed" and LIBRARY in report.message, (route, report.message)
    assert (solution.__code__, ac.nadaraya_watson.__code__, kr.NadarayaWatson.forward.__code__,
            kr.boxcar.__code__) == codes
    q, k, v = torch.tensor([0.0, 2.0]), torch.tensor([0.0, 0.5, 3.0]), torch.tensor([1.0, 3.0, 5.0])
    assert solution(q, k, v, 1.0).tolist() == [2.0, 5.0]  # the worked solution works again after the check
    assert check_passes_for_an_honest_thread_user(spec)


def check_passes_for_an_honest_thread_user(spec):
    """Threads are not refused as such: a reader's own code run in a thread passes."""
    def mine(q, k, v, h):
        inside = ((q[:, None] - k[None, :]).abs() <= h).float()
        return (inside @ v) / inside.sum(-1).clamp(min=1)

    return code_checks.check_function(lambda q, k, v, h: _in_a_thread(mine, q, k, v, h), spec).passed


def worked_solution_source(key):
    name = key.split(".")[1]
    return next("".join(c["source"]) for c in _cells(key)
                if c["cell_type"] == "code" and f"def {name}_solution(" in "".join(c["source"]))


def test_torch_whole_answer_in_a_new_thread_is_refused():
    """torch's SDPA (a builtin: no body to swap), kept under an alias taken before the check and run in a thread
    started during it, is refused as in the reader's own thread."""
    sdpa = F.scaled_dot_product_attention  # an alias taken before the check

    def causal_attention(q, k, v):
        return _in_a_thread(lambda: sdpa(q[None], k[None], v[None], is_causal=True)[0])

    report = code_checks.check_function(causal_attention, ce.spec("ch05.causal_attention"))
    assert report.status == "failed" and LIBRARY in report.message, report.message


def test_a_refused_call_is_reported_as_refused_not_as_a_disagreement():
    """A submission that calls what the exercise switches off is told so, without the expected output."""
    spec = ce.spec("ch01.boxcar_nw")
    message = code_checks.check_function(CH01_LIBRARY, spec).message
    assert message.startswith(f"{code_checks.NOT_YET}: boxcar_nw called a function this exercise switches off")
    assert LIBRARY in message and "disagrees" not in message and "expected" not in message


@pytest.mark.parametrize("key", ["ch01.boxcar_nw", "ch02.masked_softmax", "ch05.causal_attention",
                                 "ch06.causal_multi_head", "ch08.causal_attention"])
def test_torch_private_sdpa_operators_are_off_wherever_torch_attention_is(key):
    """Every exercise that switches off torch's SDPA also switches off its ``aten::_scaled_dot_product_*``
    operators, which return the whole answer as their first output."""
    from attention_core.booktools.exercises_common import TORCH_ATEN_SDPA

    assert "torch.ops.aten._scaled_dot_product_attention_math" in TORCH_ATEN_SDPA
    assert set(TORCH_ATEN_SDPA) <= set(ce.spec(key).unavailable), key


# ------------------------------------------------------- torch's whole-answer attention under its other names
# torch binds its fused attention operators under several names: ``torch.X``, ``torch.ops.aten.X`` and each
# overload ``torch.ops.aten.X.default``. Each route below computes chapter 6's answer whole and must be refused,
# with a message that names what the reader called (not an AttributeError from a patched-over operator).

_NATIVE_MHA_ALIAS = torch.ops.aten._native_multi_head_attention.default  # an overload taken before the check
_SDPA_DEFAULT_ALIAS = torch.ops.aten.scaled_dot_product_attention.default


def _ch06_native(op):
    """A one-line wrapper around torch's fused multi-head attention (``nn.MultiheadAttention``'s fast path)."""
    def causal_multi_head(x, w_q, w_k, w_v, w_o, num_heads):
        L, D = x.shape[1], x.shape[2]
        return op()(x, x, x, D, num_heads, torch.cat([w_q.T, w_k.T, w_v.T]), torch.zeros(3 * D, dtype=x.dtype),
                    w_o.T, torch.zeros(D, dtype=x.dtype), torch.ones(L, L, dtype=torch.bool).triu(1),
                    False, True, 0)[0]
    return causal_multi_head


def _ch06_heads_around(attend):
    """The reader's own projections and heads, with torch's attention operator for the attention step."""
    def causal_multi_head(x, w_q, w_k, w_v, w_o, num_heads):
        B, L, D = x.shape
        heads = lambda t: t.view(B, L, num_heads, D // num_heads).transpose(1, 2)  # noqa: E731
        out = attend(heads(x @ w_q), heads(x @ w_k), heads(x @ w_v))
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2).reshape(B, L, D) @ w_o
    return causal_multi_head


def _flex_causal(q, k, v):
    from torch.nn.attention import flex_attention as fa

    L = q.shape[-2]
    return fa.flex_attention(q, k, v, block_mask=fa.create_block_mask(lambda b, h, i, j: j <= i, None, None, L, L,
                                                                      device="cpu"))


CH06_TORCH_WHOLE = [
    ("torch._native_multi_head_attention", _ch06_native(lambda: torch._native_multi_head_attention)),
    ("torch.ops.aten._native_multi_head_attention",
     _ch06_native(lambda: torch.ops.aten._native_multi_head_attention)),
    ("torch.ops.aten._native_multi_head_attention.default",
     _ch06_native(lambda: torch.ops.aten._native_multi_head_attention.default)),
    ("torch.ops.aten._native_multi_head_attention.default", _ch06_native(lambda: _NATIVE_MHA_ALIAS)),
    ("torch.ops.aten.scaled_dot_product_attention.default", _ch06_heads_around(
        lambda q, k, v: torch.ops.aten.scaled_dot_product_attention.default(q, k, v, is_causal=True))),
    ("torch.ops.aten.scaled_dot_product_attention.default", _ch06_heads_around(
        lambda q, k, v: _SDPA_DEFAULT_ALIAS(q, k, v, is_causal=True))),
    ("torch.ops.aten.scaled_dot_product_attention", _ch06_heads_around(
        lambda q, k, v: torch.ops.aten.scaled_dot_product_attention(q, k, v, is_causal=True))),
    ("torch._scaled_dot_product_attention_math", _ch06_heads_around(
        lambda q, k, v: torch._scaled_dot_product_attention_math(q, k, v, is_causal=True))),
    ("torch._scaled_dot_product_flash_attention_for_cpu", _ch06_heads_around(
        lambda q, k, v: torch._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True))),
    ("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default", _ch06_heads_around(
        lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v, is_causal=True))),
    ("torch.ops.aten._scaled_dot_product_attention_math.default", _ch06_heads_around(
        lambda q, k, v: torch.ops.aten._scaled_dot_product_attention_math.default(q, k, v, is_causal=True))),
    ("torch.nn.attention.flex_attention.flex_attention", _ch06_heads_around(_flex_causal)),
]


@pytest.mark.parametrize("name,fn", CH06_TORCH_WHOLE, ids=[f"{i}-{n}" for i, (n, _) in enumerate(CH06_TORCH_WHOLE)])
def test_ch06_torch_whole_answer_under_any_of_its_names_is_refused_by_that_name(name, fn):
    """Each route gives the right answer (checked first, outside the check), and the checker refuses it, naming
    the route; torch's operators are whole again afterwards."""
    spec = ce.spec("ch06.causal_multi_head")
    for case in spec.examples[1:3]:
        assert torch.allclose(fn(*case), spec.reference(*case), atol=1e-6), name  # the route is a real answer
    report = code_checks.check_function(fn, spec)
    assert report.status == "failed", f"{name}: the checker accepts torch's whole answer"
    assert f"{name} is not available while your causal_multi_head runs" in report.message, report.message
    assert "AttributeError" not in report.message
    assert torch.ops.aten.scaled_dot_product_attention.default is _SDPA_DEFAULT_ALIAS  # left in place, restored
    assert isinstance(torch.ops.aten._native_multi_head_attention, torch._ops.OpOverloadPacket)


@pytest.mark.parametrize("key", ["ch05.causal_attention", "ch08.causal_attention"])
def test_torch_whole_attention_names_are_off_in_every_attention_exercise(key):
    """The fused multi-head operator and torch's private SDPA functions are off wherever torch's SDPA is."""
    from attention_core.booktools.exercises_common import TORCH_ATTENTION

    assert {"torch._native_multi_head_attention", "torch.ops.aten._native_multi_head_attention",
            "torch._scaled_dot_product_attention_math",
            "torch.nn.attention.flex_attention.flex_attention"} <= set(TORCH_ATTENTION)
    assert set(TORCH_ATTENTION) <= set(ce.spec(key).unavailable), key


def _ch06_own(scale_of, zero_after=False):
    """A reader's own causal multi-head attention (not the checker's helper), with the scores multiplied by
    ``scale_of(E, H)``; ``zero_after``: no mask before the softmax, the later keys' weights zeroed after it."""
    def causal_multi_head(x, w_q, w_k, w_v, w_o, num_heads):
        B, L, D = x.shape
        E = D // num_heads
        heads = lambda t: t.view(B, L, num_heads, E).transpose(1, 2)  # noqa: E731
        s = heads(x @ w_q) @ heads(x @ w_k).transpose(-2, -1) * scale_of(E, num_heads)
        later = torch.ones(L, L, dtype=torch.bool).triu(1)
        w = s.softmax(-1).masked_fill(later, 0.0) if zero_after else s.masked_fill(later, NEG_INF).softmax(-1)
        return (w @ heads(x @ w_v)).transpose(1, 2).reshape(B, L, D) @ w_o
    return causal_multi_head


@pytest.mark.parametrize("fn,hint", [
    (_ch06_own(lambda E, H: 1.0), "without it, they grow with E"),
    (_ch06_own(lambda E, H: H ** -0.5), "not by 1/sqrt(num_heads)"),
    (_ch06_own(lambda E, H: E ** -0.5, zero_after=True), "weights zeroed after it no longer sum to 1"),
], ids=["no scale", "1/sqrt(H)", "zeroed after the softmax"])
def test_ch06_scale_and_mask_mistakes_get_their_hint(fn, hint):
    """A reader's own submission without the scale, with 1/sqrt(H), or with the later keys zeroed after the
    softmax is told which mistake it made; the right scale and mask before the softmax pass."""
    spec = ce.spec("ch06.causal_multi_head")
    report = code_checks.check_function(fn, spec)
    assert report.status == "failed" and hint in report.message, report.message
    assert code_checks.check_function(_ch06_own(lambda E, H: E ** -0.5), spec).passed


def test_switching_the_profile_hook_off_is_refused():
    """A function that turns the check's profile hook off (sys.setprofile(None)) before computing would leave
    the routes only the hook sees unguarded; the call itself is refused, and the hook is back after the check."""
    def own(q, k, v):  # a correct answer, written out
        s = q @ k.T / q.shape[-1] ** 0.5
        return torch.softmax(s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf")), -1) @ v

    def hook_off(q, k, v):
        sys.setprofile(None)
        return own(q, k, v)

    before = sys.getprofile()
    assert code_checks.check_function(own, ce.spec("ch05.causal_attention")).status == "passed"
    report = code_checks.check_function(hook_off, ce.spec("ch05.causal_attention"))
    assert report.status == "failed" and "sys.setprofile" in report.message, report.message
    assert sys.getprofile() is before


def _ch17_own(sink_scale=1.0, stable=True, with_sink=True, unshifted_sink=False):
    """A reader's own sink attention (not the checker's helper): the sink logit times ``sink_scale``, ``exp``
    without the row's maximum when not ``stable``, no sink at all when not ``with_sink``, the scores shifted by
    their own maximum but ``exp(sinks[h])`` unshifted when ``unshifted_sink``."""
    def sink_attention(q, k, v, sinks, mask):
        z = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(~mask, NEG_INF)  # (H, L, S)
        s = (sinks * sink_scale).view(-1, 1, 1)  # (H, 1, 1)
        if not with_sink:
            return torch.softmax(z, -1).nan_to_num(0.0) @ v
        if unshifted_sink:
            m = z.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)  # a fully masked row: no shift
            e = (z - m).exp()
            return (e @ v) / (e.sum(-1, keepdim=True) + s.exp())
        m = torch.maximum(z.amax(-1, keepdim=True), s) if stable else torch.zeros_like(s)
        e = (z - m).exp()
        return (e @ v) / (e.sum(-1, keepdim=True) + (s - m).exp())
    return sink_attention


@pytest.mark.parametrize("fn,hint", [
    (_ch17_own(with_sink=False), "without exp(sinks[h]) each row's weights sum to 1"),
    (_ch17_own(stable=False), "subtract each row's maximum"),
    (_ch17_own(unshifted_sink=True), "exp(sinks[h] - m) for the sink too"),
    (_ch17_own(sink_scale=0.5), None),  # a sink halved: wrong values, no known mistake to name
], ids=["no sink", "exp without the maximum", "exp(s) unshifted", "sink halved"])
def test_ch17_a_readers_own_sink_mistakes_are_refused_and_named(fn, hint):
    """A reader's own sink attention without the sink, or with exp of unshifted scores, is refused with the hint of
    that mistake; one with a mistake the checker does not know is refused without naming one; the reader's own
    correct version passes."""
    spec = ce.spec("ch17.sink_attention")
    report = code_checks.check_function(fn, spec)
    assert report.status == "failed", report.message
    if hint is not None:
        assert hint in report.message, report.message
    else:
        assert not _names_a_known_mistake("ch17.sink_attention", report.message), report.message
    assert code_checks.check_function(_ch17_own(), spec).passed


def test_ch17_a_fully_masked_row_gives_zeros_and_the_sink_is_the_only_key_left():
    """The statement's warning: a query whose keys are all masked puts all its mass on the sink, whose value is zero;
    an answer that gives that row the plain mean of the values (a 0 fill instead of -inf) is refused."""
    spec = ce.spec("ch17.sink_attention")
    q, k, v, sinks, mask = spec.examples[3]
    assert not mask[0].any() and spec.reference(q, k, v, sinks, mask)[0, 0].abs().max() == 0
    zero_fill = _ch17.EXTRA_MISTAKES[1][1]
    assert code_checks.check_function(zero_fill, spec).status == "failed"


def test_ch17_the_librarys_sink_attention_is_refused_by_its_own_name():
    """Called whole, the library's sink_attention is refused by name (not only through the attention it calls)."""
    report = code_checks.check_function(_ch17.LIBRARY[0], ce.spec("ch17.sink_attention"))
    assert report.status == "failed"
    assert "attention_core.models.attention_variants.sink_attention is not available" in report.message, report.message
