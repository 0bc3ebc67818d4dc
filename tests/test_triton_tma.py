"""The TMA forward kernel (``triton_flash_tma``): interpreter parity, the routing rule, the sm_90 compile report.

1. Parity under ``TRITON_INTERPRET=1`` in a child process (``_triton_tma_cases.py``): O and the log-sum-exp
   against the float64 reference and the pointer kernel, and ``triton_flash``'s backward fed with them.
2. The routing rule :func:`use_tma` on CPU tensors with the device capability faked: only sm_90 and the
   covered inputs go to the TMA kernel; ``triton_flash.flash_attention_forward`` follows it.
3. ``benchmarks/results/triton_tma_resources.json`` belongs to today's kernel (a fingerprint of its jit
   source and candidates) and says what a fast kernel needs: no spill, wgmma, TMA loads and stores, shared
   memory within an H100's 227 KiB, at every launch shape it covers; one row is compiled again here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import _triton_tma_cases as cases
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "benchmarks" / "results" / "triton_tma_resources.json"
HAS_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
SHARED_LIMIT = 227 * 1024  # dynamic shared memory one block may use on sm_90


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------ 1. interpreter parity


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_triton_tma_cases.py"), *cases.NAMES],
                          env=_env(TRITON_INTERPRET="1", OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (f"interpreter child exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", cases.NAMES)
def test_interpreter_parity(interpreter_results: dict, name: str) -> None:
    result = interpreter_results[name]
    if result["ok"] is None:
        pytest.skip(result["detail"])
    assert result["ok"], f"{name}: {result['detail']}"


# ------------------------------------------------------------------------------------------ 2. routing rule


@pytest.fixture
def tma(monkeypatch: pytest.MonkeyPatch):
    """triton_flash_tma with the device capability faked as sm_90 (set ``tma.fake`` to change it)."""
    from attention_core.backends import triton_flash_tma

    state = {"capability": (9, 0)}
    monkeypatch.setattr(triton_flash_tma, "device_capability", lambda t: state["capability"])
    monkeypatch.setattr(triton_flash_tma, "ENABLED", True)
    triton_flash_tma.fake = state
    yield triton_flash_tma
    del triton_flash_tma.fake


def _qkv(B=1, Hq=2, H=2, L=256, S=256, E=128, Ev=None, dtype=torch.float16):
    return (torch.randn(B, Hq, L, E, dtype=dtype), torch.randn(B, H, S, E, dtype=dtype),
            torch.randn(B, H, S, Ev or E, dtype=dtype))


def _routed(tma, q, k, v, is_causal=True, window=None) -> bool:
    from attention_core.backends.triton_flash import window_bounds

    return tma.use_tma(q, k, v, *window_bounds(q.shape[2], k.shape[2], is_causal, window))


def test_sm90_routes_the_covered_inputs(tma) -> None:
    for dtype in (torch.float16, torch.bfloat16):
        for E in (64, 128):
            for causal in (True, False):
                assert _routed(tma, *_qkv(E=E, dtype=dtype), is_causal=causal), (dtype, E, causal)
    assert _routed(tma, *_qkv(Hq=4, H=1))  # GQA
    assert _routed(tma, *_qkv(L=128, S=384), is_causal=False)  # L != S
    assert _routed(tma, *_qkv(), window=256)  # a window as wide as the sequence hides nothing: plain causal


def test_the_route_is_off_unless_switched_on() -> None:
    """Until the kernel has run on a GPU, sm_90 calls keep the pointer kernel unless AC_TRITON_TMA=1 is set
    before the module is imported."""
    code = "from attention_core.backends import triton_flash_tma as t; print(t.ENABLED)"
    for value, want in ((None, "False"), ("0", "False"), ("1", "True")):
        env = {k: v for k, v in os.environ.items() if k != "AC_TRITON_TMA"}
        if value is not None:
            env["AC_TRITON_TMA"] = value
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want, (value, out.stdout, out.stderr)


def test_other_gpus_are_not_routed(tma) -> None:
    for capability in ((8, 0), (7, 5), (8, 9), (9, 1), (10, 0), None):
        tma.fake["capability"] = capability
        assert not _routed(tma, *_qkv()), capability


def test_uncovered_inputs_are_not_routed(tma) -> None:
    assert not _routed(tma, *_qkv(dtype=torch.float32))
    for E in (32, 80, 96, 256):
        assert not _routed(tma, *_qkv(E=E)), E
    assert not _routed(tma, *_qkv(E=128, Ev=64))
    assert not _routed(tma, *_qkv(), window=64)  # a causal window that hides pairs
    assert not _routed(tma, *_qkv(), is_causal=False, window=64)  # a two-sided one
    for L, S in ((200, 256), (256, 200), (64, 256), (256, 0)):
        assert not _routed(tma, *_qkv(L=L, S=S)), (L, S)
    q, k, v = _qkv()
    assert not _routed(tma, q.transpose(1, 2).contiguous().transpose(1, 2), k, v)  # (B, L, H, E) storage
    buf = torch.randn(q.numel() + 1, dtype=q.dtype)
    assert not _routed(tma, buf[1:].view(q.shape), k, v)  # 2-byte offset: not 16-byte aligned
    assert not _routed(tma, q[:0], k[:0], v[:0])  # B = 0
    tma.ENABLED = False
    assert not _routed(tma, q, k, v)


def test_public_forward_follows_the_rule(tma, monkeypatch: pytest.MonkeyPatch) -> None:
    """``flash_attention_forward`` launches the TMA kernel exactly when ``use_tma`` says so, with the mode."""
    from attention_core.backends import triton_flash

    calls = []
    monkeypatch.setattr(tma, "flash_attention_forward_tma",
                        lambda q, k, v, scale, is_causal: calls.append((scale, is_causal)) or ("out", "lse"))
    q, k, v = _qkv()
    for causal in (True, False):
        left, right = triton_flash.window_bounds(256, 256, causal, None)
        assert triton_flash.flash_attention_forward(q, k, v, 0.5, left, right) == ("out", "lse")
    assert calls == [(0.5, True), (0.5, False)]
    monkeypatch.setattr(triton_flash, "_attn_fwd_tuned", None)  # the pointer kernel, reached when not routed
    tma.fake["capability"] = (8, 0)
    with pytest.raises(TypeError):
        triton_flash.flash_attention_forward(q, k, v, 0.5, *triton_flash.window_bounds(256, 256, True, None))
    assert len(calls) == 2


def test_kernels_fingerprint_is_untouched_by_the_tma_module() -> None:
    """The TMA kernel and its rule live outside what ``triton_inspect.kernels_fingerprint`` hashes."""
    proc = subprocess.run([sys.executable, "-c", "from attention_core.backends import triton_inspect as t, "
                           "triton_flash as f; print(t.kernels_fingerprint()); "
                           "print(sorted(n for n in vars(f) if 'tma' in n.lower()))"],
                          env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fingerprint, names = proc.stdout.split("\n")[:2]
    committed = json.loads((ROOT / "benchmarks" / "results" / "triton_resources.json").read_text())
    assert fingerprint == committed["meta"]["kernels_fingerprint"]
    assert names == "[]", f"triton_flash holds TMA names at module level: {names}"


# --------------------------------------------------------------------------------- 3. sm_90 compile report


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(REPORT.read_text())


CHILD = """
import json, sys
sys.path.insert(0, "benchmarks")
import triton_tma_resources as tr
job = json.loads(sys.stdin.read())
out = {"fingerprint": tr.kernel_fingerprint(), "jobs": [[j[0], j[1], j[2], j[3], list(j[4])] for j in tr.jobs()]}
if job:
    out["sample"] = tr.compile_job((job[0], job[1], job[2], job[3], tuple(job[4])))
print(json.dumps(out))
"""

MEASURED = ("registers", "spill_stores", "spill_loads", "shared_bytes", "wgmma_ptx", "hgmma", "tma_load_ptx",
            "tma_store_ptx", "utmaldg", "utmastg", "warp_specialize_ops")


def _job(row: dict) -> list:
    return [row["dtype"], row["E"], row["causal"], row["L"],
            [row["BLOCK_M"], row["BLOCK_N"], row["num_warps"], row["num_stages"]]]


@pytest.fixture(scope="module")
def today(report: dict) -> dict:
    """Today's fingerprint and launch shapes, and the report's first row compiled again (~5 s)."""
    sample = _job(report["rows"][0]) if report["rows"] else None
    proc = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(sample),
                          env=_env(TRITON_DEFAULT_FP_FUSION="1"), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_report_is_of_todays_kernel(report: dict, today: dict) -> None:
    assert report["meta"]["kernel_fingerprint"] == today["fingerprint"], (
        "triton_flash_tma's kernel or candidates changed since benchmarks/results/triton_tma_resources.json was "
        "made: run `python benchmarks/triton_tma_resources.py` and commit the result")


def test_report_covers_every_launch_shape(report: dict, today: dict) -> None:
    have = sorted(_job(r) for r in report["rows"])
    assert have == sorted(today["jobs"])
    assert {(r["dtype"], r["E"], r["causal"], r["L"]) for r in report["rows"]} == {
        (d, E, c, L) for d in ("float16", "bfloat16") for E in (64, 128) for c in (True, False) for L in (16384, 4096)}


def test_every_row_is_a_fast_kernel(report: dict) -> None:
    problems = []
    for r in report["rows"]:
        what = f"{r['dtype']} E={r['E']} causal={r['causal']} L={r['L']} {r['BLOCK_M']}x{r['BLOCK_N']} " \
               f"w{r['num_warps']} s{r['num_stages']}: " + ", ".join(f"{k} {r[k]}" for k in MEASURED)
        if r["spill_stores"] or r["spill_loads"]:
            problems.append("spills: " + what)
        if not (r["wgmma_ptx"] > 0 and r["hgmma"] > 0):
            problems.append("no wgmma: " + what)
        if not (r["tma_load_ptx"] > 0 and r["utmaldg"] > 0 and r["tma_store_ptx"] > 0 and r["utmastg"] > 0):
            problems.append("no TMA load or store: " + what)
        if r["shared_bytes"] > SHARED_LIMIT:
            problems.append("too much shared memory: " + what)
    assert report["rows"] and not problems, "\n".join(problems)


def test_a_row_compiles_to_the_same_numbers(report: dict, today: dict) -> None:
    old, new = report["rows"][0], today["sample"]
    assert {k: new[k] for k in MEASURED} == {k: old[k] for k in MEASURED}


# ------------------------------------------------------------------------------------ 4. make gpu-check


def test_gpu_check_names_the_forward_kernel(tma) -> None:
    """The benchmark phase records which Triton forward ran at each point (here on CPU tensors, faked sm_90)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert gpu_check.triton_forward_kernel("float16", 128, True, 256, device="cpu") == "tma"
    assert gpu_check.triton_forward_kernel("bfloat16", 64, False, 128, device="cpu") == "tma"
    assert gpu_check.triton_forward_kernel("float32", 128, True, 256, device="cpu") == "pointer"
    tma.fake["capability"] = (8, 0)
    assert gpu_check.triton_forward_kernel("float16", 128, True, 256, device="cpu") == "pointer"


# ------------------------------------------------------------------------------ 5. on a lent sm_90 GPU only

sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                          reason="needs an sm_90 GPU (H100/H200)")


@pytest.mark.gpu
@sm90
@pytest.mark.parametrize("dtype,Hq,H,L,S,E,is_causal", [
    (torch.float16, 8, 8, 1024, 1024, 128, True),
    (torch.bfloat16, 8, 8, 1024, 1024, 64, False),
    (torch.float16, 8, 2, 512, 1536, 64, True),
    (torch.bfloat16, 4, 4, 1536, 512, 128, True),
])
def test_gpu_tma_matches_the_pointer_kernel_and_the_reference(dtype, Hq, H, L, S, E, is_causal,
                                                               monkeypatch) -> None:
    """On sm_90: routed (once switched on), and out, lse and the gradients (triton_flash's backward) agree with the
    pointer kernel and the float64 reference; the favoured candidate of the head dim only (no autotuning)."""
    from attention_core.backends import reference, triton_flash, triton_flash_tma

    monkeypatch.setattr(triton_flash_tma, "ENABLED", True)

    q, k, v = (torch.randn(2, h, n, E, device="cuda", dtype=dtype) for h, n in ((Hq, L), (H, S), (H, S)))
    left, right = triton_flash.window_bounds(L, S, is_causal, None)
    assert triton_flash_tma.use_tma(q, k, v, left, right)
    out, lse = triton_flash_tma.flash_attention_forward_tma(q, k, v, E ** -0.5, is_causal,
                                                           block=triton_flash_tma.CANDIDATES[E][0])
    saved = triton_flash_tma.ENABLED
    triton_flash_tma.ENABLED = False
    try:
        ptr_out, ptr_lse = triton_flash.flash_attention_forward(q, k, v, E ** -0.5, left, right)
    finally:
        triton_flash_tma.ENABLED = saved
    mask = torch.ones(L, S, dtype=torch.bool, device="cuda").tril() if is_causal else None
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference.attention(qd, kd, vd, mask, 0.0, False, E ** -0.5, Hq != H)
    tol = 1e-2 if dtype == torch.float16 else 3e-2
    assert torch.isfinite(out).all() and (out.double() - ref).norm() / ref.norm() < tol
    assert (out.double() - ptr_out.double()).norm() / ptr_out.double().norm() < tol
    assert (lse - ptr_lse).abs().max() < 1e-3
    grad_out = torch.randn_like(out)
    dq, dk, dv = triton_flash.flash_attention_backward(grad_out, q, k, v, out, lse, E ** -0.5, left, right)
    ref.backward(grad_out.double())
    for name, g, r in (("dq", dq, qd.grad), ("dk", dk, kd.grad), ("dv", dv, vd.grad)):
        assert (g.double() - r).norm() / r.norm() < 2 * tol, name


def test_warp_specialisation_probe_matches_the_docstring(report: dict) -> None:
    """With ``WARP_SPECIALIZE=True`` Triton's sm_90 pass either fails or leaves the loop unsplit (the same numbers
    as the launched code): the reason the kernel launches with it off. A Triton that splits the loop fails this
    test, the signal to time the split version on a GPU."""
    launched = {tuple(_job(r)[:4] + [tuple(_job(r)[4])]): r for r in report["rows"]}
    probes = report["warp_specialize_probe"]
    assert probes and any("error" not in p for p in probes)
    for p in probes:
        if "error" in p:
            assert p["failed_pass"] == "NVGPUWarpSpecialization", p  # it failed there, not elsewhere
            continue
        assert p["warp_specialize_ops"] == 0, p
        same = launched[tuple(_job(p)[:4] + [tuple(_job(p)[4])])]
        assert {k: p[k] for k in MEASURED} == {k: same[k] for k in MEASURED}


def test_candidates_come_from_the_scan_of_the_tutorial_space(report: dict) -> None:
    """Each candidate compiled without spilling and within shared memory in ``candidate_scan`` (fp16, causal,
    L = 16384), and keeps the tutorial's Hopper rule (8 warps only for a 128 x 128 tile) but the one exception
    the module names, (128, 64, 8, 3) at E = 128."""
    from attention_core.backends import triton_flash_tma

    scanned = {(r["E"], (r["BLOCK_M"], r["BLOCK_N"], r["num_warps"], r["num_stages"])): r
               for r in report["candidate_scan"]}
    outside_rule = set()
    for E, shapes in triton_flash_tma.CANDIDATES.items():
        for shape in shapes:
            r = scanned[(E, shape)]
            assert r["spill_stores"] + r["spill_loads"] == 0 and r["shared_bytes"] <= SHARED_LIMIT, r
            if shape[2] == 8 and shape[0] * shape[1] < 128 * 128:
                outside_rule.add((E, shape))
    assert outside_rule == {(128, (128, 64, 8, 3))}
