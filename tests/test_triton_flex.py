"""The Triton flex kernel: interpreter parity at GPU tile shapes, and its committed resource report.

1. Interpreter (CPU, CI): every compiled-in mask mod and score mod, under ``TRITON_INTERPRET=1`` in a child
   process (``_triton_flex_cases.py``), at the GPU's tiles ((128, 64), (64, 64), (128, 128)), ragged and round
   lengths, L < S, a per-batch block mask, float32 and float16, against the float64 dense reference; the
   backward's gradients of q, k and v likewise (causal, windows, sinks, documents, three score mods, rows that
   read no key, L < S and L > S, a per-batch mask); an unsupported mod and a score mod's captured tensor that
   requires a gradient raise clear errors.
2. Resources: ``benchmarks/results/triton_flex_resources.json`` (``benchmarks/triton_flex_resources.py``)
   belongs to today's kernel source (fingerprint), and on sm_80 and sm_90 no row of the forward or the
   backward's two kernels spills, shared memory fits, and 16-bit dots became tensor-core instructions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
REPORT = ROOT / "benchmarks" / "results" / "triton_flex_resources.json"
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="module")
def interp_results() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_triton_flex_cases.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _names(table: str) -> list:
    """The case names of ``_triton_flex_cases.CASES`` (forward) or ``GRAD_CASES`` (``grad-...``)."""
    import _triton_flex_cases

    return sorted(getattr(_triton_flex_cases, table))


@pytest.mark.parametrize("name", _names("CASES") + _names("GRAD_CASES"))
def test_interpreter_parity(interp_results, name):
    """The output against the float64 reference; for a ``grad-`` case out, dq, dk and dv, relative to max(1, the
    reference's largest value)."""
    err = interp_results[name]
    assert isinstance(err, float), err
    tol = 2e-3 if "float16" in name else 1e-5  # float16: the output's own rounding (2**-11 relative)
    relative = " / max(1, |reference|)" if name.startswith("grad-") else ""
    assert err <= tol, f"{name}: max |triton - reference|{relative} = {err}"


@pytest.mark.parametrize("table,prefix", [("CASES", ""), ("GRAD_CASES", "grad-")])
def test_the_cases_cover_every_compiled_mod(table, prefix):
    from attention_core.backends.triton_flex import MASK_KINDS, SCORE_KINDS

    names = _names(table)
    for mask in MASK_KINDS:
        assert any(n.startswith(f"{prefix}{mask}-") for n in names), mask
    for score in (k for k in SCORE_KINDS if k):
        assert any(f"-{score}-" in n for n in names), score


def test_the_gradient_cases_include_float16_and_empty_rows():
    names = _names("GRAD_CASES")
    assert any("float16" in n for n in names) and any("empty-rows" in n for n in names)


def test_unsupported_calls_raise(interp_results):
    errors = interp_results["errors"]
    assert errors["unsupported_mask"].startswith("ValueError") and "strided(8)" in errors["unsupported_mask"]
    assert errors["captured_grad"].startswith("NotImplementedError") and "chunked" in errors["captured_grad"]
    for name, tensor in (("short_slopes", "slopes"), ("short_slopes_direct", "slopes"), ("short_table", "table")):
        msg = errors[name]  # issue 37: was no error, the kernel reading past the captured tensor
        assert msg.startswith("ValueError") and tensor in msg and "2 query heads" in msg, msg
    assert errors["nan_masked"] == {"rows_before_finite": True, "rows_after_nan": True, "grads_finite": True}


def test_operators_compile_and_pass_opcheck(interp_results):
    ops = interp_results["operators"]
    assert isinstance(ops, dict), ops
    assert ops["compile_grad_err"] == 0.0, ops  # the compiled graph launches the same kernels
    assert set(ops["opcheck"].values()) == {"SUCCESS"} and len(ops["opcheck"]) == 4, ops


def test_resource_report_is_todays_and_clean():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import triton_flex_resources as tr

    report = json.loads(REPORT.read_text())
    assert report["meta"]["fingerprint"] == tr.kernel_fingerprint(), (
        "the flex kernel changed since the report: run python benchmarks/triton_flex_resources.py")
    expected = {json.dumps(j, sort_keys=True) for j in tr.jobs()}
    seen = {json.dumps({k: r[k] for k in ("kernel", "arch", "dtype", "E", "BLOCK_M", "BLOCK_N", "MASK", "SCORE", "L")},
                       sort_keys=True) for r in report["rows"]}
    assert expected == seen, "the report does not hold today's launch list"
    assert {r["kernel"] for r in report["rows"]} == {"fwd", "bwd_dq", "bwd_dkdv"}
    for r in report["rows"]:
        assert r["arch"] in (80, 90)
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["shared_bytes"] <= SHARED_LIMIT[r["arch"]], r
        if r["dtype"] != "float32" and r["kernel"] == "bwd_dkdv":  # its dots have BLOCK_N = 32 rows: too few
            assert r["hgmma"] + r["hmma"] > 0, r  # for sm_90's wgmma (64-row tiles), so mma.sync there too
        elif r["dtype"] != "float32":
            assert (r["hgmma"] if r["arch"] == 90 else r["hmma"]) > 0, r
    from attention_core.backends.triton_flex import GPU_TILES

    tiles = {str(d).removeprefix("torch."): t for d, t in GPU_TILES.items()}
    assert {d: tuple(t) for d, t in tr.TILES.items()} == tiles


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_parity(dtype):
    """On a CUDA device (skipped without one): every compiled-in mod and score mod at the GPU tiles, ragged
    L = S = 1000, against the float64 reference on the CPU (block masks are built on the CPU; the launcher
    moves them, the document ids and the score tensors to the device)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import _triton_flex_cases as cases

    from attention_core.backends.triton_flex import GPU_TILES
    from attention_core.flex_attention import create_block_mask, flex_attention

    dt, L = getattr(torch, dtype), 1000
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, L, 64, generator=g).to(dt) for _ in range(3))
    for mask_name, mod in cases.mods(L, L).items():
        if mask_name in ("document", "document_causal"):  # the cases' ids cover 256 positions
            docs = torch.arange(L) // 300
            mod = cases.mm.document(docs) if mask_name == "document" else cases.mm.and_masks(
                cases.mm.document(docs), cases.mm.causal)
        bm = None if mod is None else create_block_mask(mod, None, None, L, L, BLOCK_SIZE=GPU_TILES[dt])
        for score_name, sm in cases.scores(4).items():
            with torch.no_grad():
                out = flex_attention(q.cuda(), k.cuda(), v.cuda(), score_mod=sm, block_mask=bm, backend="triton")
                ref = flex_attention(q.double(), k.double(), v.double(), score_mod=sm, block_mask=bm,
                                     backend="reference")
            tol = 1e-4 if dt == torch.float32 else 2e-2
            err = float((out.double().cpu() - ref).abs().max())
            assert err <= tol, f"{mask_name} x {score_name} in {dtype}: {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_gpu_gradient_parity(dtype):
    """On a CUDA device (skipped without one): dq, dk, dv of causal, window, sinks + window, documents and two
    score mods at the GPU tiles, ragged L = S = 1000, against the float64 reference on the CPU, relative to
    max(1, the reference's largest |gradient|). (Not yet run on a GPU: the tolerances are the forward's, wider
    for bfloat16's 8-bit mantissa.)"""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    import _triton_flex_cases as cases

    from attention_core.backends.triton_flex import GPU_TILES
    from attention_core.flex_attention import create_block_mask, flex_attention

    dt, L = getattr(torch, dtype), 1000
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(2, 4, L, 64, generator=g).to(dt) for _ in range(4))
    docs = torch.arange(L) // 300
    combos = {"causal": (cases.mm.causal, None), "window": (cases.mm.sliding_window(100), None),
              "sinks_window-alibi": (cases.mm.sinks_and_window(4, 100), cases.scores(4)["alibi"]),
              "document": (cases.mm.document(docs), None),
              "causal-soft_cap": (cases.mm.causal, cases.scores(4)["soft_cap"])}
    tol = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-4}[dtype]
    for name, (mod, sm) in combos.items():
        bm = create_block_mask(mod, None, None, L, L, BLOCK_SIZE=GPU_TILES[dt])
        mine = [x.cuda().requires_grad_() for x in (q, k, v)]
        flex_attention(*mine, score_mod=sm, block_mask=bm, backend="triton").backward(grad_out.cuda())
        ref_in = [x.double().requires_grad_() for x in (q, k, v)]
        flex_attention(*ref_in, score_mod=sm, block_mask=bm, backend="reference").backward(grad_out.double())
        for which, a, b in zip("qkv", mine, ref_in):
            err = float((a.grad.double().cpu() - b.grad).abs().max()) / max(1.0, float(b.grad.abs().max()))
            assert err <= tol, f"d{which} of {name} in {dtype}: {err}"
