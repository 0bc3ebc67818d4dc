"""Guard: the committed resource report of the Triton kernels is today's, and what it says holds on sm_80 / sm_90.

``benchmarks/results/triton_resources.json`` is made by ``make gpu-sweep`` (benchmarks/triton_resources.py): every
kernel compiled for every autotune candidate, dtype (fp16, bf16, fp32), mask mode (causal, full, window), head dim
E in {64, 80, 128}, at L = S = 4096 (a multiple of every tile) and 4001 (a multiple of none, nor of 16), for sm_75,
sm_80 and sm_90, with Triton's own ``ptxas`` (registers, spills, shared memory) and ``cuobjdump`` (tensor-core
instructions). Compiling all of it takes far longer than a test may, so this file checks the report instead:

1. it belongs to today's kernels: it stores a fingerprint of the source of every jit function of
   ``triton_flash``, of the Python rules that turn a launch into compile-time arguments, and of the candidate
   lists; both must match what this checkout computes;
2. it accounts for every launch shape today's candidates make (each compiled, or listed as not compiled);
3. what it says holds: on sm_80 and sm_90 no candidate spills at the round length; at the ragged one, a
   candidate that spills is in ``RAGGED_SPILLS`` (the autotuner never sees it at such a launch), and every
   candidate list keeps a member that does not, or is in ``RAGGED_UNAVOIDABLE`` (every member spills there);
   fp16/bf16 dots became tensor-core instructions; shared memory fits;
4. its numbers are real: a sample of its rows (a ragged length, the window mode, E = 80, bf16, fp32, the
   backward, both architectures) is compiled again here and must match to the byte.

The compiles run in a child process without ``TRITON_INTERPRET`` and with a fresh temporary Triton cache.
About 40 s on 2 idle cores.
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
REPORT = ROOT / "benchmarks" / "results" / "triton_resources.json"
PACKAGE_COPY = ROOT / "attention_core" / "backends" / "triton_resources.json"
#: A slice at L = S = 4000: ragged differently from 4001 (a multiple of 16 and 32, of no tile of 64 or 128).
L4000 = ROOT / "benchmarks" / "results" / "triton_resources_l4000.json"
GUARDED = (80, 90)
#: Dynamic shared memory one block may use (CUDA programming guide): A100 163 KiB, H100 227 KiB.
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}
#: What a compile measures (the other fields of a row describe the launch).
MEASURED = ("registers", "stack_bytes", "spill_stores", "spill_loads", "shared_bytes", "hgmma", "hmma")
DESCRIBE = ("kernel", "arch", "dtype", "E", "mode", "L", "BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
#: The sample recompiled here: the first committed row matching each of these (kernel, arch, dtype, E, mode, L).
#: (Those the report holds: at least three must be there.)
SAMPLE = [("fwd", 80, "float16", 80, "window", 4001), ("dq", 80, "bfloat16", 128, "causal", 4001),
          ("dkdv", 80, "float32", 128, "full", 4001), ("dkdv", 80, "bfloat16", 80, "window", 4001),
          ("dq", 90, "bfloat16", 128, "causal", 4001), ("fwd", 90, "float16", 128, "causal", 4096),
          ("dkdv", 90, "float32", 64, "full", 4096), ("preprocess", 90, "bfloat16", 80, "causal", 4096)]

CHILD = """
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, "benchmarks")
import triton_resources as tr
from attention_core.backends import triton_configs, triton_inspect
scope, sample = json.loads(sys.stdin.read())
jobs = tr._jobs(scope["archs"], scope["dtypes"], scope["head_dims"], scope["modes"], scope["kernels"], scope["lengths"])
print(json.dumps({
    "kernels_fingerprint": triton_inspect.kernels_fingerprint(),
    "candidates_fingerprint": triton_inspect.candidates_fingerprint(),
    "jobs": jobs,
    "ragged_spills": [[list(k), list(v)] for k, v in triton_configs.RAGGED_SPILLS.items()],
    "unavoidable": [[list(k), list(v)] for k, v in triton_configs.RAGGED_UNAVOIDABLE.items()],
    "candidates": [[list(k), [list(s) for s in v]] for k, v in triton_configs.CANDIDATES.items()],
    "sample": [tr.compile_job(job) for job in sample],
}))
"""


def _key(row: dict) -> tuple:
    return tuple(row[k] for k in DESCRIBE)


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(REPORT.read_text())


@pytest.fixture(scope="module")
def sample_jobs(report: dict) -> list:
    jobs = []
    for want in SAMPLE:
        row = next((r for r in report["rows"] if tuple(r[k] for k in DESCRIBE[:6]) == want), None)
        if row is not None:
            jobs.append({k: row[k] for k in DESCRIBE})
    return jobs


@pytest.fixture(scope="module")
def today(report: dict, sample_jobs: list) -> dict:
    """Fingerprints, launch shapes and candidate lists of this checkout, and the sample compiled again."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), TRITON_CACHE_DIR=cache,
                   TRITON_DEFAULT_FP_FUSION="1", OMP_NUM_THREADS="1")
        proc = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps([report["meta"]["scope"], sample_jobs]),
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"compiling failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["ragged_spills"] = {tuple(k[:3]) + (tuple(k[3]),): tuple(v) for k, v in out["ragged_spills"]}
    out["candidates"] = {tuple(k): [tuple(s) for s in v] for k, v in out["candidates"]}
    out["unavoidable"] = {tuple(k): tuple(v) for k, v in out["unavoidable"]}
    return out


def test_report_is_of_todays_kernels_and_candidates(report: dict, today: dict) -> None:
    copy = json.loads(PACKAGE_COPY.read_text())
    for name, meta in (("benchmarks/results", report["meta"]), ("the package copy", copy["meta"])):
        for what in ("kernels_fingerprint", "candidates_fingerprint"):
            assert meta[what] == today[what], (
                f"{name}: the report's {what} {meta[what]} is not today's {today[what]}: the kernels or the "
                "candidate lists changed since it was made; run `make gpu-sweep` and commit the result")


def test_report_covers_every_launch_shape(report: dict, today: dict) -> None:
    scope = report["meta"]["scope"]
    assert set(GUARDED) <= set(scope["archs"]) and set(scope["dtypes"]) == {"float16", "bfloat16", "float32"}
    assert set(scope["modes"]) == {"causal", "full", "window"} and set(scope["head_dims"]) >= {64, 80, 128}
    assert any(L % 128 == 0 for L in scope["lengths"]) and any(L % 16 for L in scope["lengths"]), scope["lengths"]
    want = {_key(j) for j in today["jobs"]}
    have = {_key(r) for r in report["rows"]} | {_key(j) for j in report["not_compiled"]}
    assert want == have, (f"launch shapes of today's candidates missing from the report: {sorted(want - have)[:5]}; "
                          f"in the report but no longer a candidate: {sorted(have - want)[:5]}")
    assert report["meta"]["compiled"] == len(report["rows"]) and report["meta"]["not_compiled"] == len(
        report["not_compiled"])


def _describe(r: dict) -> str:
    return (f"{r['kernel']} sm_{r['arch']} {r['dtype']} E={r['E']} {r['mode']} L={r['L']} "
            f"{r['BLOCK_M']}x{r['BLOCK_N']} w{r['num_warps']} s{r['num_stages']}: {r['registers']} registers, "
            f"spill {r['spill_stores']}/"
            f"{r['spill_loads']} B, HGMMA {r['hgmma']}, HMMA {r['hmma']}, {r['shared_bytes']} B shared")


def _kind(r: dict) -> tuple:
    return (r["kernel"], "fp32" if r["dtype"] == "float32" else "half", 64 if r["E"] <= 64 else 128)


def test_what_the_report_says_holds_on_sm80_and_sm90(report: dict, today: dict) -> None:
    rows = [r for r in report["rows"] if r["arch"] in GUARDED]
    assert not [r for r in rows if r.get("error")], "a candidate failed to compile"
    problems = []
    for r in rows:
        shape = (r["BLOCK_M"], r["BLOCK_N"], r["num_warps"], r["num_stages"])
        spills = r["spill_stores"] + r["spill_loads"]
        ragged = r["kernel"] != "preprocess" and (r["L"] % r["BLOCK_M"] or r["L"] % r["BLOCK_N"])
        listed = ragged and r["arch"] in today["ragged_spills"].get((*_kind(r), shape), ())
        if spills and not listed:
            problems.append("spills and is not in RAGGED_SPILLS: " + _describe(r))
        if r["kernel"] != "preprocess" and r["dtype"] != "float32":
            if (r["hgmma"] if r["arch"] >= 90 else r["hmma"]) == 0:
                problems.append("tl.dot became no tensor-core instruction: " + _describe(r))
        if r["shared_bytes"] > SHARED_LIMIT[r["arch"]]:
            problems.append("needs more shared memory than the GPU gives a block: " + _describe(r))
    assert not problems, "\n".join(problems)
    # every candidate list keeps, on each arch, a member that a ragged launch does not withhold; where none
    # does, the list is in RAGGED_UNAVOIDABLE (nothing is withheld there), and only then
    for (kernel, kind, bucket), shapes in today["candidates"].items():
        if kind == "sm75":
            continue
        for arch in GUARDED:
            kept = [s for s in shapes if arch not in today["ragged_spills"].get((kernel, kind, bucket, s), ())]
            listed = arch in today["unavoidable"].get((kernel, kind, bucket), ())
            assert bool(kept) != listed, (f"{kernel} {kind} E<={bucket} on sm_{arch}: {len(kept)} candidates not "
                                          f"withheld at a ragged length, RAGGED_UNAVOIDABLE says {listed}")


def test_a_sample_of_the_report_compiles_to_the_same_numbers(report: dict, today: dict, sample_jobs: list) -> None:
    assert len(sample_jobs) >= 3, "the report lacks the sampled launch shapes"
    committed = {_key(r): r for r in report["rows"]}
    for row in today["sample"]:
        assert not row.get("error"), row["error"]
        old = committed[_key(row)]
        assert {k: row[k] for k in MEASURED} == {k: old[k] for k in MEASURED}, (
            f"compiled today: {_describe(row)}\ncommitted:      {_describe(old)}")


def test_the_l4000_slice_spills_only_where_the_pruner_withholds(today: dict) -> None:
    """Triton compiles L = 4000 to other code than 4001 (it knows 4000 is a multiple of 16): the favoured causal
    forward spills on sm_80 at 4000 and not at 4001. The committed slice (fp16, E = 128, causal, fwd and dq,
    sm_80 and sm_90, every candidate) must be of today's kernels, and each row that spills must be one the
    pruner withholds at that launch."""
    part = json.loads(L4000.read_text())
    for what in ("kernels_fingerprint", "candidates_fingerprint"):
        assert part["meta"][what] == today[what], f"{L4000.name} is not of today's kernels: regenerate it"
    assert not part["not_compiled"] and part["rows"] and {r["L"] for r in part["rows"]} == {4000}
    problems = []
    for r in part["rows"]:
        shape = (r["BLOCK_M"], r["BLOCK_N"], r["num_warps"], r["num_stages"])
        withheld = bool(r["L"] % r["BLOCK_M"] or r["L"] % r["BLOCK_N"]) and r["arch"] in today["ragged_spills"].get(
            (*_kind(r), shape), ()) and r["arch"] not in today["unavoidable"].get(_kind(r), ())
        if r["spill_stores"] + r["spill_loads"] and not withheld:
            problems.append(_describe(r))
    assert not problems, "spills at L = 4000 and is not withheld there:\n" + "\n".join(problems)
