"""The CUDA C++ sources of the ``cuda`` backend, read from ``csrc/`` beside this module.

The sources are real files (shipped as package data, see ``pyproject.toml``), so that one and the same device
code goes to ``nvcc`` for a GPU and to ``g++`` for the CPU harness:

================================ ===================================================================
``csrc/flash_kernels.cuh``       device code only: level-1 and level-2 kernels (no host code, no includes of CUDA)
``csrc/flash_dispatch.h``        host dispatch shared by both launchers: checks, head-dim padding, grid
``csrc/flash_launch.cu``         GPU launcher: ``ac_flash_forward``, kernels started with ``<<<>>>``
``csrc/flash_binding.cpp``       the torch side: checks the tensors, calls ``ac_flash_forward``
``csrc/cuda_on_cpu.h``           the CUDA-on-CPU harness (header-only C++17)
``csrc/flash_cpu.cpp``           CPU launcher: ``ac_flash_forward_cpu``, the same kernels on std::threads
``csrc/flash_cpu_main.cpp``      a program around the CPU launcher, for ThreadSanitizer runs
================================ ===================================================================

- :data:`KERNEL_SOURCE`: ``flash_launch.cu`` with its ``#include "..."`` of ``csrc/`` files written out, one
  self-contained translation unit for ``torch.utils.cpp_extension.load_inline`` (which hashes the text it is
  given: a header included by path would not trigger a rebuild when it changes).
- :data:`BINDING_SOURCE`: ``flash_binding.cpp``.
- :data:`DEVICE_SOURCE`: ``flash_kernels.cuh`` alone.

:mod:`attention_core.backends.cuda_flash` compiles and launches them on a GPU;
:mod:`attention_core.backends.cuda_on_cpu` runs them on the CPU.
"""

from __future__ import annotations

import re
from importlib import resources

__all__ = ["BINDING_SOURCE", "CSRC_FILES", "DEVICE_SOURCE", "KERNEL_SOURCE", "csrc_sources", "read_source"]

#: Every file in ``csrc/`` the builds use (the package data must ship them all).
CSRC_FILES = ("cuda_on_cpu.h", "flash_binding.cpp", "flash_cpu.cpp", "flash_cpu_main.cpp", "flash_dispatch.h",
              "flash_kernels.cuh", "flash_launch.cu")

_INCLUDE = re.compile(r'^#include "([^"]+)"[ \t]*$', re.MULTILINE)


def read_source(name: str) -> str:
    """The text of ``csrc/<name>`` (one of :data:`CSRC_FILES`)."""
    if name not in CSRC_FILES:
        raise ValueError(f"name must be one of {CSRC_FILES}, got {name!r}")
    return resources.files(__package__).joinpath("csrc", name).read_text(encoding="utf-8")


def csrc_sources() -> dict:
    """``{file name: text}`` of every file in :data:`CSRC_FILES`."""
    return {name: read_source(name) for name in CSRC_FILES}


def _inline_includes(text: str, sources: dict, done: set | None = None) -> str:
    """Replace each ``#include "name"`` of a file in ``sources`` by its text (recursively, each file once,
    without its ``#pragma once``)."""
    done = set() if done is None else done

    def expand(match: re.Match) -> str:
        name = match.group(1)
        if name not in sources:
            return match.group(0)
        if name in done:
            return f"// (#include \"{name}\": written out above)"
        done.add(name)
        body = sources[name].replace("#pragma once\n", "")
        return f"// ---- {name}\n" + _inline_includes(body, sources, done) + f"\n// ---- end of {name}"

    return _INCLUDE.sub(expand, text)


DEVICE_SOURCE = read_source("flash_kernels.cuh")
BINDING_SOURCE = read_source("flash_binding.cpp")
KERNEL_SOURCE = _inline_includes(read_source("flash_launch.cu"), csrc_sources())
