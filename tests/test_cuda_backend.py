"""The hand-written CUDA backend: compile checks without a GPU, parity with one.

CPU (CI): ``nvcc`` compiles the kernels for sm_75 (Colab's T4: level 1 and fp16 level 2), sm_80 and sm_90 in one
arch list (the bf16 level-2 kernel only where bf16 WMMA exists), so a syntax or type error fails here, not on a
reader's GPU; the torch binding is syntax-checked by the host compiler against torch's ATen headers
(``load_inline`` adds the pybind11 module around it). The availability answer and the T4 fallback decision are
checked with the GPU queries faked. The kernels are *executed* on the CPU in ``tests/test_cuda_on_cpu.py``.

GPU (``-m gpu``, skipped without CUDA): both levels against the float64 reference, with poisoned outputs.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sysconfig
import warnings
from pathlib import Path

import pytest
import torch
from _poisoned import poisoned_memory

from attention_core.backends import AttentionInputs, cuda_flash, cuda_kernels, fused_checks
from attention_core.backends.fused_checks import cuda_available, cuda_supports


def _find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for candidate in (shutil.which("nvcc"), os.path.join(home, "bin", "nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


NVCC = _find_nvcc()
CSRC = Path(cuda_kernels.__file__).parent / "csrc"
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (looked in PATH, $CUDA_HOME/bin and "
                                "/usr/local/cuda/bin)")


#: What each compile check runs: nvcc on the kernels for Colab's T4 (sm_75), Ampere (sm_80) and Hopper (sm_90) in
#: ONE arch list, as torch builds the extension for a machine with mixed GPUs: once from the files in csrc/ (the
#: same device code the CPU harness runs), once from KERNEL_SOURCE (the text load_inline compiles); the host
#: compiler on the binding. Optimisation is off (``-Xcicc -O0 -Xptxas -O0``): the front end still rejects every
#: syntax and type error, and ptxas still checks the static shared memory against the 48 KB limit, in seconds.
COMPILES = ["kernels_files", "kernels_inline", "binding"]
ARCHS = ["-gencode", "arch=compute_75,code=sm_75", "-gencode", "arch=compute_80,code=sm_80",
         "-gencode", "arch=compute_90,code=sm_90"]


def _compile_commands(tmp: Path) -> dict:
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    (tmp / "flash.cu").write_text(cuda_flash.KERNEL_SOURCE)
    (tmp / "binding.cpp").write_text(cuda_flash.BINDING_SOURCE)
    nvcc = [NVCC, "-c", "-Xcicc", "-O0", "-Xptxas", "-O0", "--Werror", "all-warnings", *COMMON_NVCC_FLAGS, *ARCHS]
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    return {
        "kernels_files": nvcc + [str(CSRC / "flash_launch.cu"), "-o", str(tmp / "files.o")],
        "kernels_inline": nvcc + [str(tmp / "flash.cu"), "-o", str(tmp / "inline.o")],
        "binding": ["c++", "-fsyntax-only", "-std=c++17", "-w", *includes, str(tmp / "binding.cpp")],
    }


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run the three compile checks at once (two cores: about as long as the slowest); name -> (rc, log)."""
    if NVCC is None:
        pytest.skip("nvcc not found (looked in PATH, $CUDA_HOME/bin and /usr/local/cuda/bin)")
    if shutil.which("c++") is None:
        pytest.skip("no host C++ compiler")
    commands = _compile_commands(tmp_path_factory.mktemp("cuda_src"))
    procs = {name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in commands.items()}
    results = {}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=600)
        results[name] = (proc.returncode, " ".join(commands[name][:12]) + " ...\n" + log[-4000:])
    return results


@pytest.mark.parametrize("name", COMPILES)
def test_sources_compile(compiled: dict, name: str) -> None:
    rc, log = compiled[name]
    assert rc == 0, log


def test_sources_ship_with_the_package() -> None:
    """Every csrc/ file matches a package-data glob of pyproject.toml (so a pip install, as in Colab, carries it),
    KERNEL_SOURCE is self-contained (every csrc include written out), and the C entry point is in both sources."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    files = sorted(p.name for p in CSRC.iterdir() if p.is_file())
    assert set(cuda_kernels.CSRC_FILES) <= set(files)
    for name in files:
        assert any(fnmatch.fnmatch(f"backends/csrc/{name}", g) for g in globs["attention_core"]), name
    assert not re.search(r'#include "', cuda_flash.KERNEL_SOURCE)
    assert cuda_kernels.DEVICE_SOURCE.replace("#pragma once\n", "") in cuda_flash.KERNEL_SOURCE  # the same device code
    for src in (cuda_flash.KERNEL_SOURCE, cuda_flash.BINDING_SOURCE):
        assert "int ac_flash_forward(" in src
    assert "void flash_forward(" in cuda_flash.BINDING_SOURCE


def _inputs(**kw: object) -> AttentionInputs:
    q = torch.randn(1, 2, 8, 16)
    fields = dict(query=q, key=q, value=q, attn_mask=None, dropout_p=0.0, is_causal=False, scale=0.25,
                  enable_gqa=False)
    fields.update(kw)
    return AttentionInputs(**fields)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a CPU-only machine")
def test_unavailable_without_gpu_says_why() -> None:
    ok, reason = cuda_available()
    assert not ok and "CUDA" in reason
    with pytest.raises(RuntimeError, match="cannot run on this machine"):
        x = torch.randn(1, 1, 4, 16)
        cuda_flash.flash_attention(x, x, x)


def test_supports_reasons() -> None:
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    assert "attn_mask" in cuda_supports(_inputs(attn_mask=mask))
    assert "window" not in cuda_supports(_inputs(attn_mask=mask))  # unlike Triton, no window of its own
    assert "window=" in fused_checks.triton_supports(_inputs(attn_mask=mask))
    assert "dropout" in cuda_supports(_inputs(dropout_p=0.5))
    assert "CUDA" in cuda_supports(_inputs())  # CPU tensors


def test_bf16_on_sm75_falls_back_to_level1_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Colab's T4: bf16 has no WMMA before sm_80, so level 1 runs, with a warning, never a crash."""
    monkeypatch.setattr(cuda_flash, "_bf16_wmma_on", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.warns(RuntimeWarning, match="sm_80"):
        assert cuda_flash._choose_level(torch.bfloat16, torch.device("cuda"), None) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda_flash._choose_level(torch.float16, torch.device("cuda"), None) == 2
        assert cuda_flash._choose_level(torch.float32, torch.device("cuda"), None) == 1
    with pytest.raises(ValueError, match="level 2"):
        cuda_flash._choose_level(torch.float32, torch.device("cuda"), 2)


# --------------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("level,dtype", [(1, torch.float32), (1, torch.float16), (1, torch.bfloat16),
                                         (2, torch.float16), (2, torch.bfloat16)])
@pytest.mark.parametrize("B,Hq,H,L,S,E,is_causal", [
    (2, 4, 4, 1, 1, 16, False), (1, 4, 2, 17, 33, 32, True), (2, 8, 8, 1000, 1000, 64, True),
    (1, 4, 1, 777, 1500, 80, False), (1, 2, 2, 513, 513, 128, True),
])
def test_gpu_parity(level, dtype, B, Hq, H, L, S, E, is_causal) -> None:

    if level == 2 and dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 WMMA needs sm_80")
    q, k, v = (torch.randn(B, h, n, E, device="cuda", dtype=dtype) for h, n in ((Hq, L), (H, S), (H, S)))
    with poisoned_memory():
        out = cuda_flash.flash_attention(q, k, v, is_causal=is_causal, level=level)
    torch.cuda.synchronize()
    qd, kd, vd = q.double(), k.double(), v.double()
    ref = _numpy_oracle(qd, kd, vd, None, 0.0, is_causal, E ** -0.5, Hq != H)
    err = float((out.double() - ref).norm() / ref.norm())
    assert torch.isfinite(out).all() and err < TOL[dtype], f"rel err {err:.2e}"


@pytest.mark.gpu
@gpu
def test_gpu_backward_by_recomputation() -> None:
    from attention_core.backends import reference

    q, k, v = (torch.randn(1, 4, 300, 64, device="cuda", dtype=torch.float16, requires_grad=True)
               for _ in range(3))
    cuda_flash.flash_attention(q, k, v, is_causal=True).float().square().sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference.attention(qd, kd, vd, None, 0.0, True, 0.125, False).square().sum().backward()
    for t, r in ((q, qd), (k, kd), (v, vd)):
        assert float((t.grad.double() - r.grad).norm() / r.grad.norm()) < 2e-2


def _numpy_oracle(*args) -> torch.Tensor:
    """The float64 NumPy backend on canonical inputs in SDPA order (query, key, value, attn_mask, dropout_p,
    is_causal, scale, enable_gqa)."""
    from attention_core.backends import AttentionInputs, numpy_backend

    return numpy_backend.run(AttentionInputs(*args))[0]


def test_the_forward_is_an_operator_that_traces_without_a_gpu() -> None:
    """The kernel is a custom operator with a fake implementation: it traces to one node on meta tensors (what
    torch.compile(fullgraph=True) and torch.export do), with no CUDA device and no compiled extension."""
    import torch

    from attention_core.backends import cuda_flash  # noqa: F401  (registers the operator)

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.ops.attention_core.cuda_flash_forward(q, k, v, 0.25, True, 1)

    q, k, v = (torch.empty(2, h, 9, 16, device="meta") for h in (4, 2, 2))
    program = torch.export.export(M(), (q, k, v))
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in calls] == ["attention_core.cuda_flash_forward.default"]
    out = program.module()(q, k, v)
    assert out.shape == (2, 4, 9, 16) and out.device.type == "meta"
