"""What a benchmark says about the machine it ran on: CPU model and vendor, ISA, caches, BLAS (STYLE §5 asks for
CPU, ISA and BLAS beside every CPU figure). Every benchmark imports these, so the description is the same in all
of them; so is the title line of every figure (:func:`machine_line`, :func:`save_figure`)."""

from __future__ import annotations

import contextlib
import os
import platform
import re
from pathlib import Path
from typing import Dict, List

import torch

__all__ = ["blas", "cache_sizes", "cpu_isa", "cpu_model", "cpu_vendor", "describe", "machine_line", "save_figure"]


def _cpuinfo(key: str) -> str:
    """The first ``key : value`` line of /proc/cpuinfo ('' where there is none or no such file)."""
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    return ""


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    return _cpuinfo("vendor_id") or platform.machine()


def cpu_isa() -> List[str]:
    """The SIMD/matrix extensions the kernel reports (AVX2, AVX-512 subsets, AMX), from /proc/cpuinfo's flags."""
    return sorted(f for f in _cpuinfo("flags").split() if re.match(r"(avx|amx|fma)", f))


def cache_sizes() -> Dict[str, str]:
    """L1d/L2/L3 of CPU 0 as the kernel reports them, e.g. {'L1d': '48K', 'L2': '1024K', 'L3': '32768K'}."""
    out = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        with contextlib.suppress(OSError):
            level, kind = (index / "level").read_text().strip(), (index / "type").read_text().strip()
            if kind != "Instruction":
                out[f"L{level}{'d' if level == '1' else ''}"] = (index / "size").read_text().strip()
    return out


def blas() -> str:
    """The BLAS torch was built with, as ``torch.__config__.show()`` names it (MKL, OpenBLAS, ...)."""
    shown = torch.__config__.show()
    line = next((ln.strip(" -") for ln in shown.splitlines() if "Math Kernel Library" in ln or "OpenBLAS" in ln), "")
    info = re.search(r"BLAS_INFO=([^,\s]+)", shown)
    return line or (info.group(1) if info else "unknown")


def describe(device: str = "cpu") -> str:
    """One line: the GPU's name, or the CPU's model, logical CPUs, ATen capability and BLAS."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return (f"{cpu_model()} ({os.cpu_count()} logical CPUs, ATen {torch.backends.cpu.get_cpu_capability()}, "
            f"BLAS {blas()})")


def machine_line(machine: Dict) -> str:
    """``"<CPU model> | ATen <capability> | torch <version>"`` from a result's recorded ``machine`` entry."""
    return f"{machine['cpu_model']} | ATen {machine['aten_cpu_capability']} | torch {machine['torch']}"


def save_figure(fig, path, title: str, fontsize: int = 9) -> None:
    """Give ``fig`` its title line, lay it out, write it to ``path`` (PNG, 110 dpi) and close it."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
