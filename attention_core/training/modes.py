"""Switch modules to evaluation or training mode for one call and give them back as they were.

A function that generates, serves or scores with a model puts it in eval mode (dropout off) for its own work; a
training loop puts it in train mode. Neither may leave the caller's model changed: :func:`eval_mode` and
:func:`train_mode` record every submodule's ``training`` flag and restore each one afterwards, also when the call
raises, so a model whose parts were in mixed modes gets exactly those modes back.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.nn as nn

__all__ = ["eval_mode", "train_mode"]


@contextmanager
def _set_mode(training: bool, name: str, modules) -> Iterator[None]:
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"{name} expects torch.nn.Module arguments, got {type(m).__name__}")
    saved = [(sub, sub.training) for m in modules for sub in m.modules()]
    try:
        for m in modules:
            m.train(training)
        yield
    finally:
        for sub, flag in saved:
            sub.training = flag


def eval_mode(*modules: nn.Module):
    """Put ``modules`` (and all their submodules) in eval mode inside the block; restore every flag after it.

    Example::

        with eval_mode(target, draft):
            tokens = decode(target, draft, prompt)
    """
    return _set_mode(False, "eval_mode", modules)


def train_mode(*modules: nn.Module):
    """Put ``modules`` (and all their submodules) in train mode inside the block; restore every flag after it."""
    return _set_mode(True, "train_mode", modules)
