"""Chapter 10's code exercise (``ch10.mean_pool``): the masked mean of a sentence's token vectors.
"""

from __future__ import annotations

import importlib.util

import torch

from attention_core.booktools.code_checks import FunctionSpec, Mistake
from attention_core.booktools.exercises_common import (
    T,
    draw_values,
    strategies,
)

__all__ = ["build"]


#: torch's own masked reductions compute the answer whole (``torch.masked.mean(h, 1, mask=...)``).
TORCH_MASKED_MEAN = ("torch.masked.mean", "torch.masked.sum")
#: the reference library's mean pooling (the module all-MiniLM-L6-v2 ends with), when it is installed.
ST_POOLING = "sentence_transformers.sentence_transformer.modules.pooling.Pooling.forward"


def _pool_reference(hidden, mask):
    from attention_core.models.bert import mean_pool

    return mean_pool(hidden, mask)


def build() -> FunctionSpec:
    st = strategies()

    @st.composite
    def pool_inputs(draw):
        B, L, D = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 4))
        lengths = T(draw(st.lists(st.integers(1, L), min_size=B, max_size=B)))  # real tokens per sentence
        return draw_values(draw, (B, L, D), -5, 5, torch.float64), torch.arange(L) < lengths[:, None]

    f64 = torch.float64
    m = lambda h, mask: mask.to(h.dtype)[..., None]  # noqa: E731 - (B, L) -> (B, L, 1)
    return FunctionSpec(
        "mean_pool", _pool_reference, pool_inputs(), atol=1e-5, rtol=1e-5, max_examples=50,
        arg_names=("hidden", "mask"),
        examples=(
            (T([[[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]], dtype=f64), T([[True, True, False]])),  # the statement's
            (T([[[1.0, 2.0], [3.0, 6.0]], [[5.0, 7.0], [9.0, 9.0]]], dtype=f64), T([[True, True], [True, False]])),
            (T([[[-2.0, 0.5, 3.0]]], dtype=f64), T([[True]])),  # one token
        ),
        unavailable=("attention_core.pretrained.mean_pool", "attention_core.models.bert.mean_pool", *TORCH_MASKED_MEAN,
                     *((ST_POOLING,) if importlib.util.find_spec("sentence_transformers") is not None else ())),
        forbidden_modules=("attention_core.pretrained", "attention_core.models", "attention_core.sentences"),
        task="to write the masked mean yourself",
        mistakes=(
            Mistake("padding tokens are left out: average only the vectors where mask is True.",
                    lambda h, mask: h.mean(1)),
            Mistake("divide by each sentence's number of real tokens, not by L.",
                    lambda h, mask: (h * m(h, mask)).sum(1) / h.shape[1]),
            Mistake("a mean: the masked sum still has to be divided by the number of real tokens.",
                    lambda h, mask: (h * m(h, mask)).sum(1)),
            Mistake("mask is True on the real tokens, not on the padding.",
                    lambda h, mask: (h * m(h, ~mask)).sum(1) / m(h, ~mask).sum(1)),
            Mistake("keep the counts as a (B, 1) column (keepdim) so that they divide each sentence's row.",
                    lambda h, mask: (h * m(h, mask)).sum(1) / mask.sum(1)),
            Mistake("return the mean itself: the scaling to length 1 comes after the pooling, not inside it.",
                    lambda h, mask: torch.nn.functional.normalize((h * m(h, mask)).sum(1) / m(h, mask).sum(1), dim=-1)),
        ),
    )
