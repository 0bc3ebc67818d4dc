"""The paged-attention Triton kernel compiles for real GPU targets on this CPU (no driver needed): sm_75 (the T4)
and sm_90 (Hopper), float32 and float16, a ragged head dim (24, padded to 32) and a round one, block sizes 16
and 32; ``ptxas`` reports no register spills."""

from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles the kernel as a GPU would; the interpreter replaces @triton.jit", allow_module_level=True)

import triton.language as tl  # noqa: E402

from attention_core.backends import triton_inspect  # noqa: E402
from attention_core.backends.triton_paged import _paged_fwd  # noqa: E402


def _compile(arch: int, dtype: str, E: int, block_size: int) -> dict:
    ptr = {"float32": "*fp32", "float16": "*fp16"}[dtype]
    values = {"Q": ptr, "KC": ptr, "VC": ptr, "BT": "*i64", "SL": "*i32", "Out": ptr,
              "stride_qb": 8 * 3 * E, "stride_qh": 3 * E, "stride_ql": E,
              "stride_kn": 2 * block_size * E, "stride_kh": block_size * E, "stride_ks": E,
              "stride_vn": 2 * block_size * E, "stride_vh": block_size * E, "stride_vs": E,
              "stride_bt": 7, "stride_ob": 8 * 3 * E, "stride_oh": 3 * E, "stride_ol": E,
              "qk_scale": 0.5, "L": 3, "E": E, "EV": E, "GROUP": 4,
              "BLOCK_SIZE": block_size, "BLOCK_E": triton.next_power_of_2(E), "BLOCK_EV": triton.next_power_of_2(E),
              "CT": tl.float32}  # the compute type the launcher passes for fp16/fp32 inputs
    return triton_inspect.compile_resources(_paged_fwd, values, arch=arch, num_warps=4, num_stages=2)


@pytest.mark.parametrize("arch", [75, 90])
@pytest.mark.parametrize("dtype,E,block_size", [("float32", 24, 16), ("float16", 64, 32), ("float16", 24, 16)])
def test_paged_kernel_compiles_without_spills(arch, dtype, E, block_size) -> None:
    if not os.path.exists(triton_inspect._tool("ptxas")):
        pytest.skip("the triton wheel has no ptxas here")
    found = _compile(arch, dtype, E, block_size)
    assert found["registers"] > 0
    assert found["spill_stores"] == 0 and found["spill_loads"] == 0, f"spills on sm_{arch}: {found}"
