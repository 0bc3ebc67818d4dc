"""Chapter 14's code exercise (``ch14.patchify``): cutting images into flattened patches in reading order.
"""

from __future__ import annotations

import math

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake
from attention_core.booktools.exercises_common import (
    draw_values,
    strategies,
)

__all__ = ["build"]


def _patchify_reference(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    from attention_core.models.vit import patchify

    return patchify(images, patch_size)


def _patch_perm(images: torch.Tensor, p: int, order: tuple) -> torch.Tensor:
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // p, p, W // p, p).permute(*order)  # a chosen order of (B, C, gh, p, gw, p)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def patch_inputs(draw):
        B, C, p = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
        gh, gw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        return draw_values(draw, (B, C, gh * p, gw * p), -5, 5), p

    ar = lambda *shape: torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)  # noqa: E731
    return FunctionSpec(
        "patchify", _patchify_reference, patch_inputs(), atol=0.0, rtol=0.0, max_examples=40,
        arg_names=("images", "patch_size"),
        examples=((ar(1, 1, 4, 4), 2), (ar(1, 2, 4, 6), 2), (ar(2, 3, 6, 3), 3), (ar(1, 1, 2, 4), 1)),
        unavailable=("attention_core.models.vit.patchify", "torch.nn.functional.unfold", "torch._C._nn.im2col",
                     "torch.ops.aten.im2col"),
        forbidden_modules=("attention_core.models", "attention_core.vision"),
        task="to cut the image into patches yourself (F.unfold computes the whole answer)",
        mistakes=(
            Mistake("a plain reshape to (B, N, C*p*p) mixes pixels of different patches: split H and W into "
                    "(patches, p) first, then move the two patch axes together.",
                    lambda x, p: x.reshape(x.shape[0], -1, x.shape[1] * p * p)),
            Mistake("patches go in reading order: along a row of patches first, then down.",
                    lambda x, p: _patch_perm(x, p, (0, 4, 2, 1, 3, 5))),
            Mistake("each patch is flattened channel first, then row by row, as a (C, p, p) block.",
                    lambda x, p: _patch_perm(x, p, (0, 2, 4, 3, 5, 1))),
            Mistake("inside a patch the pixels go row by row (the row index before the column index).",
                    lambda x, p: _patch_perm(x, p, (0, 2, 4, 1, 5, 3))),
        ),
    )
