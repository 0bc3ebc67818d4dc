"""Every CUDA kernel of the ``cuda`` backend executed, thread by thread, on the CPU.

The device code (``csrc/flash_kernels.cuh``), unchanged, is compiled with g++ against the CUDA-on-CPU harness
(``csrc/cuda_on_cpu.h``) and run on CPU tensors:

1. the harness itself: half/bf16 rounding against torch's, shuffles and votes against the CUDA Programming
   Guide's lane rules, WMMA tiles against a matmul, dynamic shared memory, and the misuses it must refuse;
2. parity with the float64 oracle, level 1 (fp32) and level 2 (fp16, bf16), over L, S in {1, 15, 64, 100},
   E in {16, 64, 80, 128} (E = 80 pads to D = 128), causal and not, grouped-query heads (Hq = 4 over H = 2),
   every input and the output inside guard zones (an out-of-bounds write changes a guard, an out-of-bounds
   read brings a NaN in); plus S = 0 (every row fully masked: zeros), B = 2 with Hq = 3 over H = 1, and level 1
   in fp16/bf16; level 2 bit-identical under a scrambled WMMA accumulator layout (it must not depend on it);
3. ThreadSanitizer: the same kernels built with ``-fsanitize=thread`` report no race, under the default and the
   scrambled fragment mapping; copies with one ``__syncthreads`` removed, one ``__syncwarp`` replaced by a
   shuffle (which orders no memory), or the ``__syncwarp`` between ``store_matrix_sync`` and reading the tile
   back removed (a race only when lanes read back what other lanes stored: the scrambled mapping) make it
   report one, naming the shared array;
4. copies of level 2 that only a GPU-like harness breaks: one assumes which lane holds which element of an
   operand fragment, one leaves stale static shared memory in the padding; the oracle must catch both.

Tolerances, |out - ref| <= tol * (1 + |ref|) elementwise: fp32 1e-5; fp16 and bf16 four unit roundoffs of the
output type (4 * 2^-11 and 4 * 2^-8), since the kernels round P and the output to it.
"""

from __future__ import annotations

import ctypes
import math
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from attention_core.backends import cuda_kernels, cuda_on_cpu, numpy_backend

CXX, WHY_NOT = cuda_on_cpu.compiler_or_reason()
pytestmark = pytest.mark.skipif(CXX is None, reason=f"the CUDA-on-CPU harness needs g++: {WHY_NOT}")

CSRC = Path(cuda_kernels.__file__).parent / "csrc"
TOL = {torch.float32: 1e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8}
KERNELS = [(1, torch.float32), (2, torch.float16), (2, torch.bfloat16)]
SIZES = (1, 15, 64, 100)
HEAD_DIMS = (16, 64, 80, 128)


def _ids(kernel: tuple) -> str:
    return f"level{kernel[0]}-{str(kernel[1]).removeprefix('torch.')}"


# ------------------------------------------------------------------------------------------ the harness


def _build_selftest(folder: Path, *flags: str) -> ctypes.CDLL:
    out = folder / "libselftest.so"
    cmd = [CXX, "-std=c++17", "-O1", "-pthread", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
           "-Wno-unknown-pragmas", *flags, "-I", str(CSRC),
           str(Path(__file__).with_name("cuda_on_cpu_selftest.cpp")), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    lib = ctypes.CDLL(str(out))
    lib.st_error.restype = ctypes.c_char_p
    return lib


@pytest.fixture(scope="module")
def selftest(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """tests/cuda_on_cpu_selftest.cpp built against the harness."""
    return _build_selftest(tmp_path_factory.mktemp("selftest"))


@pytest.fixture(scope="module")
def selftest_scrambled(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The same, every WMMA fragment (a, b, accumulator) with a scrambled element-to-lane mapping."""
    return _build_selftest(tmp_path_factory.mktemp("selftest_scrambled"), "-DAC_CPU_WMMA_LAYOUT=1")


def _ptr(a: np.ndarray | torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr())


def test_half_and_bf16_round_to_nearest_even_like_torch(selftest: ctypes.CDLL) -> None:
    """Every 16-bit pattern decodes as torch decodes it; floats (ties, subnormals, overflow, inf, NaN, random
    values in every binade) round as torch rounds them."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    for dtype, decode in ((torch.float16, selftest.st_from_half), (torch.bfloat16, selftest.st_from_bf16)):
        got = np.empty(bits.size, dtype=np.float32)
        decode(_ptr(bits), bits.size, _ptr(got))
        want = torch.from_numpy(bits.view(np.int16)).view(dtype).float().numpy()
        np.testing.assert_array_equal(got, want)  # NaN == NaN here
    rng = np.random.default_rng(0)
    halfway = [float(np.float32(x)) for x in (1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8)]
    specials = [0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e30, -1e30, math.inf, -math.inf, math.nan, 2.0**-24,
                2.0**-25, 3 * 2.0**-26, 2.0**-14 - 2.0**-26, 1e-45, *halfway]
    x = np.concatenate([np.array(specials, dtype=np.float32),
                        (rng.standard_normal(20000) * np.exp2(rng.integers(-30, 30, 20000))).astype(np.float32),
                        rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    for dtype, encode in ((torch.float16, selftest.st_to_half), (torch.bfloat16, selftest.st_to_bf16)):
        got = np.empty(x.size, dtype=np.uint16)
        encode(_ptr(x), x.size, _ptr(got))
        want = torch.from_numpy(x).to(dtype).view(torch.int16).numpy().view(np.uint16)
        nan = np.isnan(x)
        np.testing.assert_array_equal(got[~nan], want[~nan])
        exp_mask, mant_mask = (0x7C00, 0x03FF) if dtype == torch.float16 else (0x7F80, 0x007F)
        assert ((got[nan] & exp_mask) == exp_mask).all() and ((got[nan] & mant_mask) != 0).all()  # still NaN


def _expected_warp_ops(blocks: int, threads: int, width: int, xor_mask: int, src_lane: int, delta: int) -> np.ndarray:
    """The CUDA Programming Guide's lane rules, written out in Python."""
    out = np.zeros((blocks, threads, 10), dtype=np.int64)
    for b in range(blocks):
        for t in range(threads):
            warp0 = t - t % 32
            size = min(32, threads - warp0)  # the last warp may be partial
            lane = t % 32

            def value(src: int, lane: int = lane, t: int = t, warp0: int = warp0, size: int = size) -> int:
                return warp0 + src if 0 <= src < size else t

            src = lane ^ xor_mask
            out[b, t, 0] = t if src >= (lane // width + 1) * width else value(src)
            out[b, t, 1] = value((lane // width) * width + src_lane % width)
            out[b, t, 2] = t if lane % width + delta >= width else value(lane + delta)
            out[b, t, 3] = t if lane % width - delta < 0 else value(lane - delta)
            ballot = sum(1 << j for j in range(size) if j % 3 == 0)
            out[b, t, 4] = ballot - (1 << 32) if ballot >= 1 << 31 else ballot  # as a C int
            out[b, t, 5] = int(size > 5)
            out[b, t, 6] = int(size <= 20)
            out[b, t, 7] = 10 * ((t + 1) % threads)
            out[b, t, 8] = sum(range(size)) if size == 32 else -1  # the butterfly needs a full warp
            out[b, t, 9] = b * 1000 + threads
    return out


@pytest.mark.parametrize("threads,width,xor_mask,src_lane,delta", [(64, 32, 1, 3, 1), (96, 8, 5, 7, 3),
                                                                   (64, 16, 16, 33, 17), (40, 32, 2, 9, 4)])
def test_warp_shuffles_votes_and_barriers(selftest: ctypes.CDLL, threads: int, width: int, xor_mask: int,
                                          src_lane: int, delta: int) -> None:
    """Shuffles (widths 8, 16, 32; sources outside the group), votes, __syncthreads over shared memory,
    two blocks, and a partial last warp (40 threads)."""
    blocks = 2
    out = np.full((blocks, threads, 10), -7, dtype=np.int32)
    assert selftest.st_warp_ops(blocks, threads, width, xor_mask, src_lane, delta, _ptr(out)) == 1, \
        selftest.st_error().decode()
    want = _expected_warp_ops(blocks, threads, width, xor_mask, src_lane, delta)
    if threads % 32:
        out[:, threads - threads % 32:, 8] = -1  # the float butterfly sums over lanes that do not exist
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("scrambled", [False, True], ids=["lanes", "scrambled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_wmma_tile_is_a_matmul(selftest: ctypes.CDLL, selftest_scrambled: ctypes.CDLL, dtype: torch.dtype,
                               scrambled: bool) -> None:
    """d = 2 (a b + c), every layout of a, b and d, against float64 (products of 16-bit floats are exact), with
    each lane holding 8 elements of every fragment (mma_sync gathers them from the warp), under both mappings."""
    selftest = selftest_scrambled if scrambled else selftest
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(16, 16, generator=g).to(dtype) for _ in range(2))
    c = torch.randn(16, 16, generator=g)
    want = 2 * (a.double() @ b.double() + c.double())
    for a_col, b_col, store_col in np.ndindex(2, 2, 2):
        def stored(m: torch.Tensor, col: int) -> torch.Tensor:  # (16, 16) into a 16 x 24 buffer, ldm 24
            buf = torch.full((16, 24), float("nan"), dtype=m.dtype)
            buf[:, :16] = m.T if col else m
            return buf
        d = torch.full((16, 24), float("nan"))
        a_buf, b_buf = stored(a, a_col), stored(b, b_col)  # kept alive through the call
        ok = selftest.st_wmma(1 if dtype == torch.float16 else 2, int(a_col), int(b_col), int(store_col),
                              _ptr(a_buf), _ptr(b_buf), _ptr(c), _ptr(d))
        assert ok == 1, selftest.st_error().decode()
        got = d[:, :16].T if store_col else d[:, :16]
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
        assert d[:, 16:].isnan().all()  # nothing written past the tile


def test_dynamic_shared_memory_is_per_block_and_starts_undefined(selftest: ctypes.CDLL) -> None:
    blocks, threads = 3, 48
    seen_nan = np.zeros(blocks * threads, dtype=np.int32)
    neighbour = np.zeros(blocks * threads, dtype=np.float32)
    assert selftest.st_dynamic_smem(blocks, threads, _ptr(seen_nan), _ptr(neighbour)) == 1, selftest.st_error()
    assert seen_nan.all()
    t = np.arange(threads)
    np.testing.assert_array_equal(neighbour, np.concatenate([100 * b + (t + 1) % threads for b in range(blocks)]))


@pytest.mark.parametrize("which,message", [
    (0, r"not 256-bit \(32-byte\) aligned"), (1, r"ldm = 12 elements of 2 bytes"),
    (2, r"executed \d+ __syncthreads"), (3, r"warp-collective calls"), (4, r"full-warp masks only"),
    (5, r"waited 1(\.0+)? s"), (6, r"__trap\(\)"), (7, r"lane 1 of the warp passed another pointer"),
])
def test_harness_refuses_misuse(selftest: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch, which: int,
                                message: str) -> None:
    """Misaligned or badly strided WMMA access, divergent barriers, partial masks, a deadlock, __trap, lanes of a
    warp loading a fragment from different pointers: each stops the launch with a reason, never a hang or a
    silent wrong answer."""
    monkeypatch.setenv("AC_CPU_BARRIER_TIMEOUT", "1")
    a = torch.zeros(64, dtype=torch.float16)
    assert selftest.st_broken(which, _ptr(a)) == 0
    assert re.search(message, selftest.st_error().decode()), selftest.st_error().decode()


# ---------------------------------------------------------------------------------------- oracle parity


@pytest.fixture(scope="module")
def library() -> Path:
    return cuda_on_cpu.build()


def _guarded(shape: tuple, dtype: torch.dtype, fill: float, guard: float, values: torch.Tensor | None = None):
    """A contiguous tensor of ``shape`` inside a buffer with 64 guard elements before and after it."""
    n = math.prod(shape)
    buf = torch.full((n + 128,), guard, dtype=dtype)
    view = buf[64:64 + n].view(shape)
    view.copy_(values if values is not None else torch.full(shape, fill, dtype=dtype))
    return buf, view


def _run_checked(library: Path, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, level: int,
                 scale: float) -> tuple:
    """Run one kernel on guarded copies; returns (max of |out - ref| / (1 + |ref|), what else went wrong)."""
    nan = float("nan")
    (_, qg), (_, kg), (_, vg) = (_guarded(t.shape, t.dtype, 0.0, nan, t) for t in (q, k, v))
    out_buf, out = _guarded(q.shape, q.dtype, nan, 1024.0)
    cuda_on_cpu.flash_forward_cpu(qg, kg, vg, out, is_causal=is_causal, scale=scale, level=level, library=library)
    problems = []
    if not (out_buf[:64] == 1024.0).all() or not (out_buf[-64:] == 1024.0).all():
        problems.append("wrote outside the output")
    if not torch.isfinite(out).all():
        problems.append(f"{int((~torch.isfinite(out)).sum())} non-finite outputs (unwritten, or read out of bounds)")
    ref = _numpy_oracle(q.double(), k.double(), v.double(), None, 0.0, is_causal, scale,
                                  q.shape[1] != k.shape[1])
    err = float(((out.double() - ref).abs() / (1 + ref.abs())).max()) if out.numel() else 0.0
    return err, problems


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("E", HEAD_DIMS)
@pytest.mark.parametrize("kernel", KERNELS, ids=_ids)
def test_oracle_parity(library: Path, kernel: tuple, E: int, is_causal: bool) -> None:
    """All 16 (L, S) pairs for one kernel, head dim and mask; reports every failing pair."""
    level, dtype = kernel
    g = torch.Generator().manual_seed(E * 2 + is_causal)
    failures, worst = [], 0.0
    for L in SIZES:
        for S in SIZES:
            q = torch.randn(1, 4, L, E, generator=g).to(dtype)
            k, v = (torch.randn(1, 2, S, E, generator=g).to(dtype) for _ in range(2))
            err, problems = _run_checked(library, q, k, v, is_causal, level, E**-0.5)
            worst = max(worst, err)
            if err > TOL[dtype] or problems:
                failures.append(f"L={L} S={S}: error {err:.2e} (tol {TOL[dtype]:.1e}) {'; '.join(problems)}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("kernel", KERNELS + [(1, torch.float16), (1, torch.bfloat16)], ids=_ids)
def test_more_shapes(library: Path, kernel: tuple) -> None:
    """B = 2 with 3 query heads over 1 key/value head, E = 32 (D = 32) and E = 1, a scale that is not 1/sqrt(E),
    and level 1 in fp16/bf16 (what a T4 runs for bf16)."""
    level, dtype = kernel
    g = torch.Generator().manual_seed(7)
    for L, S, E, is_causal in ((70, 33, 32, True), (33, 70, 1, False), (100, 100, 64, True)):
        q = torch.randn(2, 3, L, E, generator=g).to(dtype)
        k, v = (torch.randn(2, 1, S, E, generator=g).to(dtype) for _ in range(2))
        err, problems = _run_checked(library, q, k, v, is_causal, level, 0.3)
        assert err <= TOL[dtype] and not problems, f"L={L} S={S} E={E}: error {err:.2e} {problems}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_level2_does_not_depend_on_the_fragment_layout(library: Path, dtype: torch.dtype) -> None:
    """WMMA leaves the element-to-lane mapping of a fragment unspecified, and level 2 multiplies its output
    fragments element by element: built with a scrambled accumulator mapping, it must give the same bits."""
    scrambled = cuda_on_cpu.build(extra_flags=["-DAC_CPU_WMMA_LAYOUT=1"])
    g = torch.Generator().manual_seed(5)
    for L, S, E, is_causal in ((100, 100, 64, True), (15, 70, 80, False)):
        q = torch.randn(1, 2, L, E, generator=g).to(dtype)
        k, v = (torch.randn(1, 1, S, E, generator=g).to(dtype) for _ in range(2))
        outs = []
        for lib in (library, scrambled):
            outs.append(torch.full_like(q, float("nan")))
            cuda_on_cpu.flash_forward_cpu(q, k, v, outs[-1], is_causal=is_causal, scale=E**-0.5, level=2,
                                          library=lib)
        assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1]), f"L={L} S={S} E={E}"


@pytest.mark.parametrize("kernel", KERNELS, ids=_ids)
def test_no_keys_gives_zeros(library: Path, kernel: tuple) -> None:
    """S = 0: every query row is fully masked, and the kernel itself (not a Python shortcut) writes zeros."""
    level, dtype = kernel
    q = torch.randn(1, 2, 70, 64).to(dtype)
    k = v = torch.empty(1, 2, 0, 64, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    cuda_on_cpu.flash_forward_cpu(q, k, v, out, is_causal=False, scale=0.125, level=level, library=library)
    assert (out == 0).all()


def test_run_on_cpu_matches_sdpa_and_checks_arguments() -> None:
    import attention_core as ac

    q, k, v = (torch.randn(1, 2, 9, 16) for _ in range(3))
    got = cuda_on_cpu.run_on_cpu(q, k, v, is_causal=True)
    torch.testing.assert_close(got, ac.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="level 2"):
        cuda_on_cpu.run_on_cpu(q, k, v, level=2)
    with pytest.raises(ValueError, match="Hq % Hkv"):
        cuda_on_cpu.run_on_cpu(q, k[:, :, :, :8], v)
    with pytest.raises(ValueError, match="scale"):
        cuda_on_cpu.run_on_cpu(q, k, v, scale=-1.0)


# ------------------------------------------------------------------------------------------------- races

TSAN_ENV = {"TSAN_OPTIONS": "halt_on_error=1 exitcode=66 report_signal_unsafe=0"}
#: (level, dtype, B, Hq, H, L, S, E, causal): each kernel at a padded and an unpadded head dim, GQA, two q tiles
TSAN_CASES = [(1, torch.float32, 1, 2, 1, 100, 100, 64, True), (1, torch.float32, 2, 2, 2, 15, 64, 80, False),
              (2, torch.float16, 1, 2, 1, 100, 100, 64, True), (2, torch.bfloat16, 2, 2, 1, 15, 64, 80, False),
              (2, torch.float16, 1, 2, 2, 40, 100, 16, True)]


def _tsan_run(program: Path, case: tuple) -> cuda_on_cpu.ProgramRun:
    level, dtype, B, Hq, H, L, S, E, causal = case
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Hq, L, E, generator=g).to(dtype)
    k, v = (torch.randn(B, H, S, E, generator=g).to(dtype) for _ in range(2))
    run = cuda_on_cpu.run_program(program, q, k, v, is_causal=causal, scale=E**-0.5, level=level, env=TSAN_ENV)
    if run.out is not None:
        ref = _numpy_oracle(q.double(), k.double(), v.double(), None, 0.0, causal, E**-0.5, Hq != H)
        err = float(((run.out.double() - ref).abs() / (1 + ref.abs())).max())
        assert err <= TOL[dtype], f"{case}: error {err:.2e} under ThreadSanitizer"
    return run


@pytest.fixture(scope="module")
def tsan_program() -> Path:
    return cuda_on_cpu.build(program=True, sanitize="thread")


@pytest.mark.parametrize("case", TSAN_CASES, ids=lambda c: f"level{c[0]}-{str(c[1])[6:]}-E{c[7]}")
def test_thread_sanitizer_finds_no_race(tsan_program: Path, case: tuple) -> None:
    run = _tsan_run(tsan_program, case)
    assert run.returncode == 0 and "ThreadSanitizer" not in run.stderr, run.stderr[-6000:]


@pytest.fixture(scope="module")
def tsan_scrambled_program() -> Path:
    """The ThreadSanitizer program with the scrambled fragment mapping: lanes then read back, from a tile that
    store_matrix_sync wrote, elements other lanes stored, so a missing __syncwarp there becomes a race."""
    return cuda_on_cpu.build(program=True, sanitize="thread", extra_flags=["-DAC_CPU_WMMA_LAYOUT=1"])


@pytest.mark.parametrize("case", [c for c in TSAN_CASES if c[0] == 2][:2], ids=lambda c: f"{str(c[1])[6:]}-E{c[7]}")
def test_thread_sanitizer_finds_no_race_under_scrambled_fragments(tsan_scrambled_program: Path, case: tuple) -> None:
    run = _tsan_run(tsan_scrambled_program, case)
    assert run.returncode == 0 and "ThreadSanitizer" not in run.stderr, run.stderr[-6000:]


#: A barrier line of level 2, what replaces it, the shared array whose race ThreadSanitizer must then name, and
#: whether the fragment mapping must be scrambled for the race to exist in the harness.
REMOVED_BARRIERS = {
    "syncthreads": ("    __syncthreads();  // the K, V tiles are complete\n", "", "(k_s|v_s)", False),
    # __syncwarp removed, a shuffle in its place: a shuffle moves values, it orders no memory access, so it must
    # not pass for the missing barrier
    "syncwarp-as-shuffle": ("    __syncwarp();  // the S strip is complete\n",
                            "    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1) - INFINITY);\n", "s_s", False),
    # the __syncwarp between store_matrix_sync and reading the staging tile back: under the default mapping each
    # lane reads back exactly the elements it stored, so only the scrambled mapping (as on a GPU) opens the race
    "syncwarp-before-readback": ("    __syncwarp();\n", "", "t_s", True),
}


@pytest.mark.parametrize("which", list(REMOVED_BARRIERS))
def test_thread_sanitizer_sees_a_removed_barrier(which: str) -> None:
    """A copy of the level-2 kernel without one barrier: ThreadSanitizer must report the race it opens, on the
    shared array the barrier protected (so a clean report above means something)."""
    line, replacement, variable, scrambled = REMOVED_BARRIERS[which]
    source = cuda_kernels.DEVICE_SOURCE
    assert source.count(line) == 1, f"the kernel no longer has the line {line!r}"
    program = cuda_on_cpu.build(program=True, sanitize="thread",
                                sources={"flash_kernels.cuh": source.replace(line, replacement)},
                                extra_flags=["-DAC_CPU_WMMA_LAYOUT=1"] if scrambled else [])
    run = _tsan_run(program, (2, torch.float16, 1, 2, 1, 100, 100, 64, True))
    assert run.returncode == 66 and "WARNING: ThreadSanitizer: data race" in run.stderr, run.stderr[-3000:]
    assert re.search(rf"Location is global '[^']*::{variable}'", run.stderr), run.stderr[-3000:]


# ------------------------------------------------------------------------------- kernels a GPU would break

#: Copies of level 2 that are wrong on a GPU but were right on an older harness: (text, its replacement).
GPU_ONLY_BUGS = {
    # Zeroing the padded head-dim columns of Q and K inside their fragments (matrix_a: column e % 16, matrix_b
    # col_major: row e / 16) instead of when staging them, assuming x[e] is element (e / 16, e % 16) of the tile:
    # true when every lane held the whole tile, false for a lane's share of it.
    "operand-fragment-layout": [
        ("    const bool ok = m0 + r < p.L && d < p.E;\n",
         "    const bool ok = (size_t)(m0 + r) * p.E + d < (size_t)p.L * p.E;  // padded columns: the next row\n"),
        ("      const bool ok = n < p.S && d < p.E;\n      k_s[",
         "      const bool ok = (size_t)n * p.E + d < (size_t)p.S * p.E;\n      k_s["),
        ("    wmma::load_matrix_sync(q_frag[dt], q_s + warp * 16 * LDT + dt * 16, LDT);\n",
         "    wmma::load_matrix_sync(q_frag[dt], q_s + warp * 16 * LDT + dt * 16, LDT);\n"
         "    for (int e = 0; e < q_frag[dt].num_elements; ++e)\n"
         "      if (dt * 16 + e % 16 >= p.E) q_frag[dt].x[e] = from_float<T>(0.f);\n"),
        ("        wmma::load_matrix_sync(k_frag, k_s + nt * 16 * LDT + dt * 16, LDT);\n",
         "        wmma::load_matrix_sync(k_frag, k_s + nt * 16 * LDT + dt * 16, LDT);\n"
         "        for (int e = 0; e < k_frag.num_elements; ++e)\n"
         "          if (dt * 16 + e / 16 >= p.E) k_frag.x[e] = from_float<T>(0.f);\n"),
    ],
    # Staging K and V without writing the zero padding: static shared memory kept zeros from the start of the
    # program, a GPU's holds whatever the last kernel left.
    "stale-shared-memory": [
        ("      k_s[j * LDT + d] = ok ? k[kv_off + (size_t)n * p.E + d] : from_float<T>(0.f);\n",
         "      if (ok) k_s[j * LDT + d] = k[kv_off + (size_t)n * p.E + d];\n"),
        ("      v_s[j * LDT + d] = ok ? v[kv_off + (size_t)n * p.E + d] : from_float<T>(0.f);\n",
         "      if (ok) v_s[j * LDT + d] = v[kv_off + (size_t)n * p.E + d];\n"),
    ],
}


@pytest.mark.parametrize("which", list(GPU_ONLY_BUGS))
def test_oracle_catches_what_only_a_gpu_would_show(which: str) -> None:
    """Each copy is caught by the oracle comparison: the first because operand fragments hold only each lane's
    share, the second because static shared memory starts every block as NaN."""
    source = cuda_kernels.DEVICE_SOURCE
    for old, new in GPU_ONLY_BUGS[which]:
        assert source.count(old) == 1, f"the kernel no longer has the line {old!r}"
        source = source.replace(old, new)
    library = cuda_on_cpu.build(sources={"flash_kernels.cuh": source})
    g = torch.Generator().manual_seed(11)
    # E = 72: padded to D = 128, and the padding starts inside a 16-column fragment
    q = torch.randn(1, 2, 64, 72, generator=g).to(torch.float16)
    k, v = (torch.randn(1, 1, 70, 72, generator=g).to(torch.float16) for _ in range(2))
    err, problems = _run_checked(library, q, k, v, False, 2, 72**-0.5)
    assert err > TOL[torch.float16] or problems, f"{which}: the broken kernel passed (error {err:.2e})"


# ------------------------------------------------------------------------ the register-saving restructures

#: Copies of level 1's two threads per row (D = 128) and of level 2's doubled S strip, each wrong in one way:
#: (replacements, level, what must catch it: "oracle", or a pattern of the harness's error).
RESTRUCTURE_BUGS = {
    # the two halves of q . k never added: each thread scores its key with half of the dot product
    "level1-no-pair-sum": ([("s += __shfl_xor_sync(0xffffffffu, s, lane_mask);", "(void)lane_mask;")], 1, "oracle"),
    # each row walks only its own keys again: the lanes of a warp reach the shuffle different numbers of times
    # (the harness then reports the shuffle or the next __syncthreads stuck, whichever times out first)
    "level1-divergent-shuffle": ([("(R == 1 ? row_end : n_end) - n0", "row_end - n0")], 1, "divergent|deadlock"),
    # the whole warp walks the block's keys, and no row skips those past its own causal limit
    "level1-no-row-bound": ([("      if (R > 1 && n0 + j >= row_end) continue;\n", "")], 1, "oracle"),
    # S stored once: the softmax's straight walk reads the second copy, which the block never wrote
    "level2-one-copy-of-S": ([("wmma::store_matrix_sync(s_w + BN + nt * 16, s_frag, "
                               "2 * BN, wmma::mem_row_major);", "")], 2, "oracle"),
    # the per-tile bound one past the causal limit: row i sees key i + 1
    "level2-bound-off-by-one": ([("min(p.S, i + 1) : p.S) - n0;", "min(p.S, i + 2) : p.S) - n0;")], 2, "oracle"),
}


@pytest.mark.parametrize("which", list(RESTRUCTURE_BUGS))
def test_restructured_kernels_mutants_are_caught(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each broken copy is caught: by the oracle (NaN-poisoned shared memory included) or by the harness's
    warp-collective check. E = 128, causal, L = 100 (two query blocks, the second ragged)."""
    replacements, level, catcher = RESTRUCTURE_BUGS[which]
    source = cuda_kernels.DEVICE_SOURCE
    for old, new in replacements:
        assert source.count(old) == 1, f"the kernel no longer has {old!r}"
        source = source.replace(old, new)
    library = cuda_on_cpu.build(sources={"flash_kernels.cuh": source})
    monkeypatch.setenv("AC_CPU_BARRIER_TIMEOUT", "2")
    dtype = torch.float32 if level == 1 else torch.float16
    g = torch.Generator().manual_seed(13)
    q = torch.randn(1, 2, 100, 128, generator=g).to(dtype)
    k, v = (torch.randn(1, 1, 100, 128, generator=g).to(dtype) for _ in range(2))
    if catcher == "oracle":
        err, problems = _run_checked(library, q, k, v, True, level, 128**-0.5)
        assert err > TOL[dtype] or problems, f"{which}: the broken kernel passed (error {err:.2e})"
    else:
        with pytest.raises(RuntimeError, match=catcher):
            _run_checked(library, q, k, v, True, level, 128**-0.5)


def _numpy_oracle(*args) -> torch.Tensor:
    """The float64 NumPy backend on canonical inputs in SDPA order (query, key, value, attn_mask, dropout_p,
    is_causal, scale, enable_gqa)."""
    from attention_core.backends import AttentionInputs

    return numpy_backend.run(AttentionInputs(*args))[0]
