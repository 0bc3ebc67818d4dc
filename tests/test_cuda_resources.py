"""Guard: the committed resource report of the CUDA C++ kernels is today's, complete, and says what it should.

``benchmarks/results/cuda_resources.json`` (``make gpu-sweep``, benchmarks/cuda_resources.py) holds, for every
kernel the dispatcher can start (level 1 in fp32/fp16/bf16, level 2 in fp16/bf16, each at D = 16, 32, 64, 128)
and sm_75, sm_80 and sm_90, what ``nvcc -O3 -Xptxas -v`` reports: registers, stack, spills, shared memory. Here:

1. the report's fingerprint (kernel sources, flags, nvcc version) is today's;
2. it has every (level, dtype, D, arch) the dispatcher compiles (bf16 level 2 only from sm_80 on);
3. spills are exactly the known ones in :data:`KNOWN_SPILLS` (none: no kernel spills on any of the three): a new
   spill, or a known one that grows or goes away, fails until the table (and what the book says) is updated;
4. sm_90 is compiled again and must give the committed numbers.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "benchmarks" / "results" / "cuda_resources.json"
FIELDS = ("registers", "stack_bytes", "spill_stores", "spill_loads", "shared_bytes")

#: (level, dtype, D, arch) -> (spill stores, spill loads), bytes per thread, at -O3: the spills the kernels are
#: allowed. None today. Level 1 spilled 150-185 bytes at D = 128 while one thread held a query row and its
#: accumulator (2 x 128 floats); two threads share a row there now. Level 2 spilled 4-8 bytes in three kernels
#: while its softmax addressed S through 16 per-lane column offsets; it reads a doubled S strip now. An entry here
#: needs its reason, in csrc/README.md and chapter 9 as well.
KNOWN_SPILLS: dict = {}


def _load():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cuda_resources
    finally:
        sys.path.pop(0)
    return cuda_resources


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(REPORT.read_text())


def test_report_is_of_todays_sources(report: dict) -> None:
    cr = _load()
    if cr.find_nvcc() is None:
        pytest.skip("nvcc not found")
    assert report["meta"]["fingerprint"] == cr.fingerprint(), (
        "the CUDA sources, flags or nvcc changed since benchmarks/results/cuda_resources.json was made: run "
        "`python benchmarks/cuda_resources.py` and commit the result")
    package = json.loads((ROOT / "attention_core" / "backends" / "cuda_resources.json").read_text())
    assert package == report


def test_report_has_every_kernel_and_only_the_known_spills(report: dict) -> None:
    want = {(1, dt, D, a) for dt in ("float32", "float16", "bfloat16") for D in (16, 32, 64, 128) for a in (75, 80, 90)}
    want |= {(2, dt, D, a) for dt in ("float16", "bfloat16") for D in (16, 32, 64, 128) for a in (75, 80, 90)
             if dt == "float16" or a >= 80}
    rows = {(r["level"], r["dtype"], r["D"], r["arch"]): r for r in report["rows"]}
    assert set(rows) >= want, f"missing from the report: {sorted(want - set(rows))}"
    spilling = {k: (r["spill_stores"], r["spill_loads"]) for k, r in rows.items()
                if k in want and r["spill_stores"] + r["spill_loads"]}
    assert set(spilling) == set(KNOWN_SPILLS), (f"new spills: {sorted(set(spilling) - set(KNOWN_SPILLS))}; "
                                                f"gone: {sorted(set(KNOWN_SPILLS) - set(spilling))}")
    for k, bytes_ in KNOWN_SPILLS.items():
        assert bytes_ is None or spilling[k] == bytes_, f"{k}: spills {spilling[k]} B, the table says {bytes_}"
    assert all(r["registers"] <= 255 and r["shared_bytes"] <= 48 * 1024 for r in rows.values())


def test_sm90_compiles_to_the_committed_numbers(report: dict) -> None:
    cr = _load()
    if cr.find_nvcc() is None or importlib.util.find_spec("torch") is None:
        pytest.skip("nvcc not found")
    committed = {(r["level"], r["dtype"], r["D"]): r for r in report["rows"] if r["arch"] == 90}
    today = {(r["level"], r["dtype"], r["D"]): r for r in cr.compile_arch(90)}
    assert set(today) == set(committed)
    for k, r in today.items():
        assert {f: r[f] for f in FIELDS} == {f: committed[k][f] for f in FIELDS}, k
