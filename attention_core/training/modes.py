"""Switch modules to evaluation mode for one call and give them back as they were.

A function that generates, serves or scores with a model puts it in eval mode (dropout off) for its own work;
it must not leave the caller's model changed. :func:`eval_mode` records every submodule's ``training`` flag and
restores each one afterwards, also when the call raises, so a model whose parts were in mixed modes gets exactly
those modes back.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.nn as nn

__all__ = ["eval_mode"]


@contextmanager
def eval_mode(*modules: nn.Module) -> Iterator[None]:
    """Put ``modules`` (and all their submodules) in eval mode inside the block; restore every flag after it.

    Example::

        with eval_mode(target, draft):
            tokens = decode(target, draft, prompt)
    """
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"eval_mode expects torch.nn.Module arguments, got {type(m).__name__}")
    saved = [(sub, sub.training) for m in modules for sub in m.modules()]
    try:
        for m in modules:
            m.eval()
        yield
    finally:
        for sub, flag in saved:
            sub.training = flag
