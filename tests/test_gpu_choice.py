"""Which kernel runs on which GPU, decided on a faked device (no GPU needed), and the GPU check's dry run.

Colab's T4 is sm_75: Triton emits no tensor-core instruction for it (the committed compile report), so neither
the automatic choice nor the book's "own kernel on this GPU" may be ``triton`` there; the tensor-core paths
are torch's SDPA (the automatic choice) and the CUDA backend's WMMA level.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

import attention_core.backends as backends
from attention_core.backends import AttentionInputs
from attention_core.backends.fused_checks import tensor_core_kernel

ROOT = Path(__file__).resolve().parents[1]


class _OnCuda:
    """Stands in for a float16 CUDA tensor where only its attributes are read (no GPU here)."""

    device = torch.device("cuda", 0)
    shape = (1, 2, 8, 16)
    dtype = torch.float16
    requires_grad = False

    def dim(self) -> int:
        return 4


def _inputs() -> AttentionInputs:
    t = _OnCuda()
    return AttentionInputs(query=t, key=t, value=t, attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.25,
                           enable_gqa=False)


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("capability, want", [((7, 5), "cuda"), ((8, 0), "triton"), ((8, 9), "triton"),
                                              ((9, 0), "triton")])
def test_the_books_tensor_core_kernel_per_gpu(monkeypatch: pytest.MonkeyPatch, capability, want) -> None:
    _fake_gpu(monkeypatch, capability)
    assert tensor_core_kernel("cuda") == want
    assert tensor_core_kernel(torch.device("cuda", 0)) == want
    assert tensor_core_kernel("cpu") is None


def test_no_tensor_core_kernel_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tensor_core_kernel("cuda") is None and tensor_core_kernel("cpu") is None


def test_automatic_choice_on_a_t4_is_torch_even_with_the_fused_kernels_first(monkeypatch) -> None:
    """backend=None on sm_75: torch SDPA, even if triton were first in AUTO_ORDER and able to run; on sm_90 the
    same order would pick triton (so the sm_75 answer comes from the capability, not from the order)."""
    for name in ("triton", "cuda"):
        fake = dataclasses.replace(backends.get_backend(name), is_available=lambda: (True, ""),
                                   supports=lambda inputs: None)
        monkeypatch.setitem(backends._REGISTRY, name, fake)
    inputs = _inputs()
    _fake_gpu(monkeypatch, (7, 5))
    assert backends.choose_backend(inputs).name == "torch"  # the real order: torch first
    monkeypatch.setattr(backends, "AUTO_ORDER", ("triton", "torch", "reference"))
    assert backends.choose_backend(inputs).name == "torch"  # triton declines on sm_75 (no tensor cores)
    _fake_gpu(monkeypatch, (9, 0))
    assert backends.choose_backend(inputs).name == "triton"


def test_the_committed_report_shows_no_tensor_core_instruction_on_sm75() -> None:
    """The evidence behind the sm_75 choice: every Triton launch compiled for sm_75 has 0 HMMA and 0 HGMMA,
    while every kernel has HMMA on sm_80 and HGMMA on sm_90."""
    report = json.loads((resources.files("attention_core.backends") / "triton_resources.json").read_text())
    rows = report["rows"]
    t4 = [r for r in rows if r["arch"] == 75]
    assert t4 and all(r["hmma"] == 0 and r["hgmma"] == 0 for r in t4)
    for arch, field in ((80, "hmma"), (90, "hgmma")):
        kernels = {r["kernel"] for r in rows if r["arch"] == arch and r["dtype"] == "float16"}
        assert kernels and all(any(r[field] > 0 for r in rows if r["arch"] == arch and r["kernel"] == k
                                   and r["dtype"] == "float16") for k in kernels)


def test_gpu_check_says_so_in_one_line_without_cuda() -> None:
    """``scripts/gpu_check.py`` on a machine without CUDA: one line, exit 0, nothing written."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the dry run is for machines without it")
    before = set((ROOT / "benchmarks" / "results").glob("gpu_*"))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device here"), proc.stdout
    assert set((ROOT / "benchmarks" / "results").glob("gpu_*")) == before


def test_gpu_check_plan_fits_the_budget() -> None:
    """The phases' caps and the reserve add up to at most 8 minutes; the plan names every gpu test file."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert sum(gpu_check.CAPS.values()) + gpu_check.RESERVE_S <= gpu_check.TOTAL_S <= 8 * 60
    files = gpu_check.gpu_test_files()
    assert "tests/test_gpu_new_kernels.py" in files and "tests/test_gpu_choice.py" not in files
    assert gpu_check.attention_grid()[0] == gpu_check.ISSUE_POINT and len(set(gpu_check.attention_grid())) == 80
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--plan"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "budget 480 s" in proc.stdout
