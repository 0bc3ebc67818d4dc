"""Old import paths of modules that moved to their rooms, kept so that existing code and notebooks still run.

``import attention_core.language_model`` gives the very module object of
``attention_core.models.language_model`` (loaded on first use, nothing is imported before), so ``isinstance``
checks, patches and pickles see one module, not a copy. New code uses the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Dict, Optional

#: old dotted path -> the module's home now
MOVED: Dict[str, str] = {
    "attention_core.transformer": "attention_core.models.transformer",
    "attention_core.language_model": "attention_core.models.language_model",
    "attention_core.bert": "attention_core.models.bert",
    "attention_core.latent_attention": "attention_core.models.latent_attention",
    "attention_core.rnn_attention": "attention_core.models.rnn_attention",
    "attention_core.checkpoint": "attention_core.training.checkpoint",
    "attention_core.progress": "attention_core.training.progress",
    "attention_core.inspection": "attention_core.pretrained.inspection",
    "attention_core.regression_data": "attention_core.regression.data",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old path with the module at its new one."""

    def __init__(self) -> None:
        self._homes: Dict[str, tuple] = {}

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: ANN001 (the finder protocol)
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:  # noqa: ANN001
        module = importlib.import_module(MOVED[spec.name])
        self._homes[spec.name] = (module.__spec__, module.__loader__)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the old name's spec on the module: give it its own back.
        old = module.__spec__.name
        module.__spec__, module.__loader__ = self._homes.pop(old)


def install() -> Optional[_MovedFinder]:
    """Put the finder on ``sys.meta_path`` once (idempotent)."""
    if any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        return None
    finder = _MovedFinder()
    sys.meta_path.append(finder)
    return finder
