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
from _poisoned import poisoned_memory

from attention_core.backends import AttentionInputs
from attention_core.backends.fused_checks import triton_available, triton_supports

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None


def _child_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


#: Run in a child of its own: a 32-bit offset that wraps reads far outside the tensor and can kill the process.
ALONE = ["int64_row_offsets"]


def _run_cases(names: list) -> dict:
    """Run interpreter cases in a child process with TRITON_INTERPRET=1; name -> result."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_triton_interp_cases.py"), *names],
        env=_child_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1"),
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, (f"interpreter child for {names[:3]}... exited with {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    """Every interpreter case but those in ALONE, run once."""
    return _run_cases([n for n in cases.NAMES if n not in ALONE])


def _check(result: dict, name: str) -> None:
    if result["ok"] is None:
        pytest.skip(result["detail"])
    assert result["ok"], f"{name}: {result['detail']}"


@pytest.mark.parametrize("name", [n for n in cases.NAMES if n not in ALONE])
def test_interpreter(interpreter_results: dict, name: str) -> None:
    _check(interpreter_results[name], name)


@pytest.mark.parametrize("name", ALONE)
def test_interpreter_alone(name: str) -> None:
    _check(_run_cases([name])[name], name)


# ----------------------------------------------------------------------- honest per architecture (no GPU needed)


def test_grid_limit_is_a_clear_error() -> None:
    """B * Hq programs on grid axis 1: past CUDA's 65,535 a ValueError says so, before anything launches."""
    from attention_core.backends.fused_checks import triton_grid_reason

    assert triton_grid_reason(4095, 16, 16) is None  # 65,520 programs fit
    assert triton_grid_reason(65535, 1, 1) is None
    reason = triton_grid_reason(4096, 16, 4)  # 65,536 do not
    assert reason is not None and "65535" in reason and "4096 * 16" in reason
    big = _inputs(query=torch.randn(65536, 1, 1, 16), key=torch.randn(65536, 1, 1, 16),
                  value=torch.randn(65536, 1, 1, 16))
    assert "65535" in triton_supports(big)
    if HAS_TRITON:
        from attention_core.backends import triton_flash

        with pytest.raises(ValueError, match="65535"):
            triton_flash.flash_attention(big.query, big.key, big.value)


def test_sm75_warns_once_that_tensor_cores_are_unused(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from attention_core.backends import fused_checks

    monkeypatch.setattr(fused_checks, "_WARNED_NO_TENSOR_CORES", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    cuda = torch.device("cuda", 0)
    assert not fused_checks.triton_uses_tensor_cores(cuda)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused_checks.triton_tensor_core_warning(cuda)
        fused_checks.triton_tensor_core_warning(cuda)
    assert len(seen) == 1 and "sm_75" in str(seen[0].message) and "tensor cores" in str(seen[0].message)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fused_checks, "_WARNED_NO_TENSOR_CORES", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fused_checks.triton_tensor_core_warning(cuda)
    assert seen == []


class _OnCuda:
    """Stands in for a CUDA tensor where only ``.device`` is read (no GPU here)."""

    device = torch.device("cuda", 0)
    shape = (1, 2, 8, 16)
    requires_grad = False


def test_choose_backend_never_picks_triton_on_sm75(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even first in AUTO_ORDER and able to run, triton is chosen on sm_90 and skipped on sm_75."""
    import dataclasses

    import attention_core.backends as backends

    fake = dataclasses.replace(backends.get_backend("triton"), is_available=lambda: (True, ""),
                               supports=lambda inputs: None)
    monkeypatch.setitem(backends._REGISTRY, "triton", fake)
    monkeypatch.setattr(backends, "AUTO_ORDER", ("triton", "torch", "reference"))
    inputs = _inputs(query=_OnCuda(), key=_OnCuda(), value=_OnCuda())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert backends.choose_backend(inputs).name == "triton"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert backends.choose_backend(inputs).name == "torch"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_autotune_key_is_bucketed() -> None:
    """A new length re-tunes only when it crosses a power of two: the key holds buckets, not L and S."""
    from attention_core.backends import triton_flash

    for tuned in triton_flash._TUNED:
        assert "L" not in tuned.keys and "S" not in tuned.keys and "L_BUCKET" in tuned.keys
    assert triton_flash._buckets(1024, 2048) == (1024, 2048)
    # ragged (not a multiple of the largest tile): a key of its own, since its candidates differ
    assert triton_flash._buckets(1000, 1025) == (-1024, -2048)
    assert triton_flash._buckets(513, 1) == (-1024, -1)
    assert triton_flash._buckets(1024, 2000) == (-1024, -2048)


@pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs triton, compiled kernels (the interpreter has one fixed config)")
def test_candidates_are_pruned_by_dtype_and_head_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 gets its own small tiles, a pre-sm_80 GPU its own too; each call times only its own candidates."""
    from attention_core.backends import triton_flash

    class _Q:  # the only things the pruning reads of the query tensor
        dtype, device = torch.float32, torch.device("cpu")

    def kept(tuned, L: int = 4096, S: int = 4096, **kw: int) -> list:
        named = {"Q": _Q(), "L": L, "S": S}
        return sorted(map(triton_flash.shape_of, tuned.early_config_prune(tuned.configs, named, **kw)))

    for kernel, tuned in zip(("fwd", "dq", "dkdv"), triton_flash._TUNED):
        _Q.dtype, _Q.device = torch.float32, torch.device("cpu")
        assert kept(tuned, E=64, Ev=64) == sorted(triton_flash.CANDIDATES[(kernel, "fp32", 64)])
        _Q.dtype = torch.float16
        assert kept(tuned, E=100, Ev=128) == sorted(triton_flash.CANDIDATES[(kernel, "half", 128)])
        _Q.device = torch.device("cuda", 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
        assert kept(tuned, E=64, Ev=64) == sorted(triton_flash.CANDIDATES[(kernel, "sm75", 64)])
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert kept(tuned, E=64, Ev=64) == sorted(triton_flash.CANDIDATES[(kernel, "half", 64)])
    assert max(bm * bn for bm, bn, _, _ in triton_flash.CANDIDATES[("fwd", "fp32", 128)]) < 128 * 64
    # a candidate known to spill at a ragged launch on this GPU is withheld there, and only there
    first = triton_flash.CANDIDATES[("fwd", "half", 128)][0]
    from attention_core.backends import triton_configs

    monkeypatch.setattr(triton_configs, "RAGGED_SPILLS", {("fwd", "half", 128, first): (80,)})
    monkeypatch.setattr(triton_configs, "RAGGED_UNAVOIDABLE", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    _Q.dtype, _Q.device = torch.float16, torch.device("cuda", 0)
    fwd = triton_flash._TUNED[0]
    assert first in kept(fwd, E=128, Ev=128) and first in kept(fwd, L=4096 + first[0], S=4096, E=128, Ev=128)
    assert first not in kept(fwd, L=4001, S=4001, E=128, Ev=128)
    assert first not in kept(fwd, L=4096, S=4096 + first[1] // 2, E=128, Ev=128)
    assert kept(fwd, L=4001, S=4001, E=128, Ev=128) == sorted(set(triton_flash.CANDIDATES[("fwd", "half", 128)])
                                                               - {first})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert first in kept(fwd, L=4001, S=4001, E=128, Ev=128)  # it spills on sm_80 only
    # where every candidate of a list spills at a ragged launch, none is withheld
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(triton_configs, "RAGGED_UNAVOIDABLE", {("fwd", "half", 128): (80,)})
    assert first in kept(fwd, L=4001, S=4001, E=128, Ev=128)


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
    """Error relative to the reference's norm, or absolute where that norm is below 1: with L = 1 and a causal
    mask the single visible key gets weight 1 whatever the scores, so the exact dq is 0 and any rounding would
    otherwise read as an enormous relative error."""
    x, ref = x.detach().double(), ref.detach()
    return float((x - ref).norm() / ref.norm().clamp_min(1.0))


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
    with poisoned_memory():
        q, k, v = (torch.randn(B, h, n, E, device="cuda", dtype=dtype, requires_grad=True)
                   for h, n in ((Hq, L), (H, S), (H, S)))
        out = triton_flash.flash_attention(q, k, v, is_causal=is_causal, window=window)
        grad_out = torch.randn_like(out)
        out.backward(grad_out)
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
