"""The Triton FlashAttention backend: interpreter parity on the CPU, real parity on a GPU.

CPU (CI): the kernels run under ``TRITON_INTERPRET=1`` in one child process (see ``_triton_interp_cases.py``
for why a child), at small shapes, against the float64 reference, forward and backward. This process never
sets the variable, so the GPU tests below and every other test file see ordinary Triton.

GPU (``-m gpu``, skipped without CUDA): the same comparisons at real sizes in fp16/bf16 (and fp32, IEEE dots).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import _triton_interp_cases as cases
import pytest
import torch

from attention_core.backends import AttentionInputs
from attention_core.backends.fused_checks import triton_available, triton_supports

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None


def _child_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    """Run every interpreter case once, in a child process with TRITON_INTERPRET=1; name -> result."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_triton_interp_cases.py")],
        env=_child_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1"),
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, f"interpreter child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", cases.NAMES)
def test_interpreter(interpreter_results: dict, name: str) -> None:
    result = interpreter_results[name]
    if result["ok"] is None:
        pytest.skip(result["detail"])
    assert result["ok"], f"{name}: {result['detail']}"


def _inputs(device: str = "cpu", dtype: torch.dtype = torch.float32, **kw: object) -> AttentionInputs:
    q = torch.randn(1, 2, 8, 16, dtype=dtype, device=device)
    fields = dict(query=q, key=q, value=q, attn_mask=None, dropout_p=0.0, is_causal=False, scale=0.25,
                  enable_gqa=False)
    fields.update(kw)
    return AttentionInputs(**fields)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="checks the answer on a CPU-only machine without the interpreter")
def test_unavailable_on_plain_cpu_with_reason() -> None:
    ok, reason = triton_available()
    assert not ok and ("CUDA" in reason or "not installed" in reason)


def test_available_backends_by_device() -> None:
    """``available_backends("cpu")`` never lists a backend that would refuse CPU tensors (tests use it)."""
    import attention_core as ac

    cpu = ac.available_backends("cpu")
    assert {"reference", "numpy", "torch", "chunked"} <= set(cpu) <= set(ac.available_backends())
    assert "cuda" not in cpu
    assert ("triton" in cpu) == (os.environ.get("TRITON_INTERPRET") == "1")
    assert "numpy" in ac.available_backends(torch.device("cpu"))


def test_supports_refuses_masks_and_dropout_with_reasons() -> None:
    mask = torch.ones(8, 8, dtype=torch.bool).reshape(1, 1, 8, 8)
    assert "attn_mask" in triton_supports(_inputs(attn_mask=mask))
    assert "dropout" in triton_supports(_inputs(dropout_p=0.1))
    big = torch.randn(1, 1, 4, 256)
    assert "head dims" in triton_supports(_inputs(query=big, key=big, value=big))
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert "CUDA" in triton_supports(_inputs())  # CPU tensors without the interpreter


# --------------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON or
                         os.environ.get("TRITON_INTERPRET") == "1", reason="needs a CUDA GPU and triton")

GPU_TOL = {torch.float16: (1e-2, 2e-2), torch.bfloat16: (3e-2, 6e-2), torch.float32: (1e-4, 1e-4)}


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm().clamp_min(1e-12))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,Hq,H,L,S,E,is_causal,window", [
    (2, 8, 8, 1024, 1024, 64, True, None),
    (2, 8, 2, 1000, 1500, 128, False, None),
    (1, 4, 4, 2048, 2048, 64, True, 256),
    (1, 4, 1, 777, 777, 80, False, 100),
    (4, 4, 4, 1, 300, 32, True, None),
])
def test_gpu_parity(dtype, B, Hq, H, L, S, E, is_causal, window) -> None:
    from attention_core.backends import reference, triton_flash
    from attention_core.masks import causal_mask, sliding_window_mask

    if dtype == torch.bfloat16 and torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("bf16 dots need sm_80")
    triton_flash.POISON_OUTPUTS = True
    try:
        q, k, v = (torch.randn(B, h, n, E, device="cuda", dtype=dtype, requires_grad=True)
                   for h, n in ((Hq, L), (H, S), (H, S)))
        out = triton_flash.flash_attention(q, k, v, is_causal=is_causal, window=window)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
    finally:
        triton_flash.POISON_OUTPUTS = False
    mask = sliding_window_mask(L, window, S, causal=is_causal, device="cuda") if window else (
        causal_mask(L, S, device="cuda") if is_causal else None)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference.attention(qd, kd, vd, mask, 0.0, False, E ** -0.5, Hq != H)
    ref.backward(grad_out.double())
    tol_f, tol_b = GPU_TOL[dtype]
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert _rel(out, ref) < tol_f
    for name, t, r in (("dq", q, qd), ("dk", k, kd), ("dv", v, vd)):
        assert _rel(t.grad, r.grad) < tol_b, f"{name}: {_rel(t.grad, r.grad):.2e}"
