"""Guard: the Triton kernels keep the shape a GPU needs, checked on a CPU by compiling them for sm_80 and sm_90.

For the forward, dQ and dK/dV kernels at head dims 64 and 128, in float16, with the config the autotuner is
expected to favour (:func:`attention_core.backends.triton_flash.favoured_config`), compile for Ampere (sm_80)
and Hopper (sm_90) with Triton's own ``ptxas`` and read the result (``triton_inspect``): a kernel that spills
registers to local memory, or whose ``tl.dot`` no longer became tensor-core instructions (HMMA on sm_80,
HGMMA on sm_90), would be several times slower on a real GPU, and this test fails.

The compiles run in one child process without ``TRITON_INTERPRET`` (interpreted kernels cannot be compiled)
and with a fresh, temporary Triton cache that is deleted afterwards, so a result never comes from an older
version of a kernel. About 30 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("fwd", "dq", "dkdv")
HEAD_DIMS = (64, 128)
ARCHS = (80, 90)
#: Dynamic shared memory one block may use (CUDA programming guide): A100 163 KiB, H100 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}

CHILD = f"""
import json, sys, warnings
warnings.filterwarnings("ignore")
from attention_core.backends import triton_flash, triton_inspect
rows = []
for kernel in {KERNELS}:
    for E in {HEAD_DIMS}:
        for arch in {ARCHS}:
            bm, bn, warps, stages = triton_flash.favoured_config(kernel, "float16", E)
            r = triton_inspect.compile_kernel(kernel, arch=arch, dtype="float16", E=E, causal=True, BLOCK_M=bm,
                                              BLOCK_N=bn, num_warps=warps, num_stages=stages)
            rows.append(r.as_dict())
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    """(kernel, E, arch) -> the compiled kernel's resources, from one child process."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), TRITON_CACHE_DIR=cache,
                   TRITON_DEFAULT_FP_FUSION="1", OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"compiling failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return {(r["kernel"], r["E"], r["arch"]): r for r in rows}


def _describe(r: dict) -> str:
    return (f"{r['kernel']} E={r['E']} sm_{r['arch']} fp16 {r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']} "
            f"s{r['num_stages']}: {r['registers']} registers, spill {r['spill_stores']}/{r['spill_loads']} B, "
            f"HGMMA {r['hgmma']}, HMMA {r['hmma']}")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("E", HEAD_DIMS)
@pytest.mark.parametrize("kernel", KERNELS)
def test_favoured_config_fits_the_gpu(compiled: dict, kernel: str, E: int, arch: int) -> None:
    r = compiled[(kernel, E, arch)]
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"spills registers to local memory: {_describe(r)}"
    tensor_cores = r["hgmma"] if arch >= 90 else r["hmma"]
    assert tensor_cores > 0, f"tl.dot did not become tensor-core instructions: {_describe(r)}"
    assert r["shared_bytes"] <= SHARED_LIMIT[arch], f"needs {r['shared_bytes']} B of shared memory: {_describe(r)}"
