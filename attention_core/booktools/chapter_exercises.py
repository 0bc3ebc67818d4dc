"""The chapters' code exercises: one registry of every chapter's exercise, each defined in its chapter's module.

Each exercise is a :class:`~attention_core.booktools.code_checks.FunctionSpec` named ``"chNN.function"``
(``spec("ch07.rope")``), built by its chapter's module (``exercises_<chapter>.py``: its reference, its inputs,
its known mistakes), with the helpers every chapter shares in :mod:`~attention_core.booktools.exercises_common`.
Its inputs reach the values where the chapter's warnings matter: explicit edge cases first (fully masked rows,
empty windows, the window's exact edge, length 1, scores large enough to overflow ``exp``), then generated ones.
Its :class:`~attention_core.booktools.code_checks.Mistake` list names the chapter's plausible mistakes, so that
a reader whose output matches one gets a one-line hint.

Every function of those modules computes answers (references, known mistakes, helpers): ``spec()`` names
them all in the spec's ``helpers``, so that none is available while a reader's function runs.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Callable, Dict

from attention_core.booktools import (
    exercises_at_scale,
    exercises_bahdanau,
    exercises_beyond_dense,
    exercises_common,
    exercises_decoder_lm,
    exercises_distributed,
    exercises_explanation,
    exercises_kernel_regression,
    exercises_low_precision,
    exercises_luong,
    exercises_multi_head,
    exercises_positional,
    exercises_pretrained,
    exercises_recent,
    exercises_scoring,
    exercises_self_attention,
    exercises_serving,
    exercises_transformer,
    exercises_vision,
)
from attention_core.booktools.code_checks import FunctionSpec
from attention_core.booktools.exercises_at_scale import partial_softmax
from attention_core.booktools.exercises_decoder_lm import check_window_rise, window_loss_rise

__all__ = ["EXERCISES", "SPEC_MODULES", "check_window_rise", "partial_softmax", "spec", "window_loss_rise"]

_BUILDERS: Dict[str, Callable[[], FunctionSpec]] = {
    "ch01.boxcar_nw": exercises_kernel_regression.build,
    "ch02.masked_softmax": exercises_scoring.build,
    "ch03.bahdanau_weights": exercises_bahdanau.build,
    "ch04.local_p_weights": exercises_luong.build,
    "ch05.causal_attention": exercises_self_attention.build,
    "ch06.causal_multi_head": exercises_multi_head.build,
    "ch07.rope": exercises_positional.build,
    "ch08.causal_attention": exercises_transformer.build,
    "ch09.merge_partials": exercises_at_scale.build,
    "ch10.mean_pool": exercises_pretrained.build,
    "ch11.decode_mask": exercises_decoder_lm.build,
    "ch12.causal_linear_attention": exercises_beyond_dense.build,
    "ch13.rollout": exercises_explanation.build,
    "ch14.patchify": exercises_vision.build,
    "ch15.residual": exercises_serving.build,
    "ch16.zigzag_block_mask": exercises_distributed.build,
    "ch17.sink_attention": exercises_recent.build,
    "ch18.fake_quantize_blocks": exercises_low_precision.ch18_spec,
}
#: The chapters' code exercises, by name (``"chNN.function"``).
EXERCISES = tuple(_BUILDERS)

#: The modules whose functions are the checker's own helpers: every chapter's exercise module and the shared
#: one. All of them are unavailable to every exercise (one chapter's helper can compute part of another's
#: answer: chapter 2's masked softmax inside chapter 8's attention).
SPEC_MODULES = tuple(dict.fromkeys([*(b.__module__ for b in _BUILDERS.values()), exercises_common.__name__]))


@cache
def spec(exercise: str) -> FunctionSpec:
    """The :class:`FunctionSpec` of a chapter's code exercise, e.g. ``spec("ch02.masked_softmax")``."""
    if exercise not in _BUILDERS:
        raise KeyError(f"exercise must be one of {', '.join(EXERCISES)}; got {exercise!r}")
    return dataclasses.replace(_BUILDERS[exercise](), helpers=SPEC_MODULES)
