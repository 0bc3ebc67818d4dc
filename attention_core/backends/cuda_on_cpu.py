"""The CUDA kernels of the ``cuda`` backend, executed thread by thread on the CPU.

``csrc/cuda_on_cpu.h`` gives CUDA C++ what a GPU gives it: every CUDA thread of a block becomes a
``std::thread``, ``__syncthreads()`` a barrier of the block, ``__syncwarp()``, shuffles and votes warp-wide
exchanges, ``__shared__`` one buffer for the block that runs, ``__half``/``__nv_bfloat16`` 16-bit types with
round-to-nearest-even conversions, and ``nvcuda::wmma`` fragments with their documented semantics. The device
code (``csrc/flash_kernels.cuh``), unchanged, is compiled against it with the host C++ compiler into a small
shared library (called through ``ctypes``) or, for ThreadSanitizer, into a program.

What a run proves: the kernels compute attention (compared with the float64 oracle), with every barrier where
it must be (a thread that skips one, a deadlock, or a warp whose lanes make different collective calls stops
the run), and, built with ``-fsanitize=thread``, with no two threads touching the same memory unordered by a
barrier (ThreadSanitizer reports the race, naming the variable). What it cannot: speed, occupancy, bank
conflicts, coalescing, the warp scheduler's lock-step execution, tensor-core rounding (products are exact,
sums in float). ``csrc/README.md`` says more.

Builds are cached under ``$AC_CUDA_ON_CPU_CACHE`` (default: a folder in the system's temporary directory),
keyed by the hash of the compiler, the flags and every source, so a second run starts at once.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

import torch

from attention_core._checks import check_bool_flag, check_scale, check_tensor
from attention_core.backends.cuda_kernels import csrc_sources
from attention_core.backends.inputs import scale_or_default

__all__ = [
    "ProgramRun",
    "build",
    "compiler_or_reason",
    "find_compiler",
    "flash_forward_cpu",
    "load_library",
    "register_static_shared",
    "run_on_cpu",
    "run_program",
]

_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_BASE_FLAGS = ("-std=c++17", "-O1", "-pthread", "-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas")
_CALL_LOCK = threading.Lock()  # the harness keeps shared memory in static storage: one launch at a time


# ------------------------------------------------------------------------------------------------ compiler


def find_compiler() -> Optional[str]:
    """The C++ compiler to use: ``$CXX``, else the first of ``g++``, ``c++``, ``clang++`` on the PATH."""
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def compiler_or_reason() -> tuple:
    """``(path, "")`` when a C++ compiler is found, else ``(None, why not)``."""
    cxx = find_compiler()
    if cxx is None:
        return None, "no C++ compiler found (looked for $CXX, g++, c++ and clang++ on the PATH)"
    return cxx, ""


def _compiler_id(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    return cxx + "\n" + out.splitlines()[0] if out else cxx


def _cache_root() -> Path:
    root = os.environ.get("AC_CUDA_ON_CPU_CACHE")
    if root:
        return Path(root)
    user = getattr(os, "getuid", lambda: "user")()
    return Path(tempfile.gettempdir()) / f"attention_core_cuda_on_cpu_{user}"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (POSIX ``flock``; no lock where there is none): parallel test workers
    wait for one build instead of each compiling it."""
    try:
        import fcntl
    except ImportError:  # Windows: builds go to distinct names, at worst compiled twice
        yield
        return
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


#: A static ``__shared__`` array declaration on one line: ``__shared__ [__align__(n)] type name[dims];``.
_STATIC_SHARED = re.compile(
    r"^([ \t]*__shared__\b[^;=()]*?(?:__align__\(\d+\)[^;=()]*?)?\b(\w+)\s*(?:\[[^\]]+\]\s*)+;)", re.MULTILINE)


def register_static_shared(text: str) -> str:
    """``text`` with every static ``__shared__`` array declaration followed, on the same line (line numbers in
    messages stay right), by its registration with the harness, which fills it with NaN bytes before each
    block (``ac_cpu::register_static_shared`` in ``cuda_on_cpu.h``): on a GPU its contents are undefined."""
    return _STATIC_SHARED.sub(lambda m: f"{m.group(1)} [[maybe_unused]] static const bool {m.group(2)}_ac_registered"
                              f" = ::ac_cpu::register_static_shared({m.group(2)}, sizeof({m.group(2)}));", text)


def build(*, program: bool = False, sanitize: Optional[str] = None, sources: Optional[Mapping[str, str]] = None,
          extra_flags: Sequence[str] = ()) -> Path:
    """Compile the flash kernels with the CPU harness; returns the path of the (cached) shared library or program.

    Args:
        program: build ``flash_cpu_main`` (a program reading and writing raw files) instead of the library.
        sanitize: ``None`` or ``"thread"`` (ThreadSanitizer: ``-fsanitize=thread -g``; a program, since its
            runtime must start with the process).
        sources: ``{file name: text}`` replacing files of ``csrc/`` (a test removes a barrier from a copy of
            the kernels this way); the others are read from the package.
        extra_flags: more compiler flags (``-D...``).

    Raises:
        RuntimeError: no C++ compiler, or the compilation failed (with the compiler's messages).
    """
    if sanitize not in (None, "thread"):
        raise ValueError(f"sanitize must be None or 'thread', got {sanitize!r}")
    cxx, reason = compiler_or_reason()
    if cxx is None:
        raise RuntimeError(f"cannot build the CUDA-on-CPU kernels: {reason}")
    texts = csrc_sources()
    for name in sources or {}:
        if name not in texts:
            raise ValueError(f"sources may replace files of csrc/ {sorted(texts)}, got {name!r}")
    texts.update(sources or {})
    texts = {n: (t if n == "cuda_on_cpu.h" or not n.endswith((".cuh", ".h")) else register_static_shared(t))
             for n, t in texts.items()}
    flags = list(_BASE_FLAGS) + (["-fsanitize=thread", "-g"] if sanitize else []) + list(extra_flags)
    flags += [] if program else ["-shared", "-fPIC"]
    units = ["flash_cpu.cpp"] + (["flash_cpu_main.cpp"] if program else [])
    digest = hashlib.sha256()
    for part in [_compiler_id(cxx), *flags, *units] + [f"{n}\0{t}" for n, t in sorted(texts.items())]:
        digest.update(part.encode() + b"\0")
    folder = _cache_root() / digest.hexdigest()[:24]
    target = folder / ("flash_cpu_main" if program else "libflash_cpu.so")
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / ".lock"):
        if target.exists():  # another process built it while this one waited
            return target
        for name, text in texts.items():
            (folder / name).write_text(text, encoding="utf-8")
        partial = folder / f".{target.name}.{os.getpid()}"
        cmd = [cxx, *flags, "-I", str(folder), *(str(folder / u) for u in units), "-o", str(partial)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"compiling the CUDA-on-CPU kernels failed:\n{' '.join(cmd)}\n{done.stderr[-6000:]}")
        os.replace(partial, target)  # atomic: no process sees a half-written file
    return target


_LIBRARIES: dict = {}


def load_library(path: Optional[Path] = None) -> ctypes.CDLL:
    """The shared library at ``path`` (default: :func:`build` ``()``), loaded once, with its C signatures set."""
    path = Path(path) if path is not None else build()
    if path not in _LIBRARIES:
        lib = ctypes.CDLL(str(path))
        lib.ac_flash_forward_cpu.restype = ctypes.c_int
        lib.ac_flash_forward_cpu.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 8 + [ctypes.c_float, ctypes.c_int]
        lib.ac_flash_cpu_error.restype = ctypes.c_char_p
        lib.ac_flash_cpu_error.argtypes = [ctypes.c_int]
        _LIBRARIES[path] = lib
    return _LIBRARIES[path]


# ---------------------------------------------------------------------------------------------------- runs


def _problem(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, level: int) -> list:
    """The integer arguments (dtype, level, B, Hq, Hkv, L, S, E) of the C entry points, after checks."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor for the CUDA-on-CPU harness, got one on {t.device}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, E), got shape {tuple(t.shape)}")
        if t.dtype != query.dtype:
            raise TypeError(f"query, key and value must share one dtype, got {name} {t.dtype}, query {query.dtype}")
    if query.dtype not in _DTYPE_CODE:
        raise TypeError(f"query must be float32, float16 or bfloat16, got {query.dtype}")
    if level not in (1, 2):
        raise ValueError(f"level must be 1 or 2, got {level!r}")
    if level == 2 and query.dtype == torch.float32:
        raise ValueError("level 2 (tensor cores) takes float16 or bfloat16 inputs, got float32; use level=1")
    B, Hq, L, E = query.shape
    _, Hkv, S, _ = key.shape
    if key.shape[0] != B or key.shape[3] != E or value.shape != key.shape or Hq % Hkv != 0 or not 1 <= E <= 128:
        raise ValueError(f"expected query (B, Hq, L, E), key and value (B, Hkv, S, E) with Hq % Hkv == 0 and "
                         f"1 <= E <= 128, got query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}")
    return [_DTYPE_CODE[query.dtype], level, B, Hq, Hkv, L, S, E]


def flash_forward_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor, *,
                      is_causal: bool, scale: float, level: int, library: Optional[Path] = None) -> None:
    """Run one kernel level on the CPU, writing ``out`` (contiguous, query's shape and dtype) in place.

    Args:
        query: (B, Hq, L, E) contiguous CPU tensor, float32, float16 or bfloat16; key, value: (B, Hkv, S, E).
        out: where the kernel writes; what it does not write keeps its value (tests fill it with NaN).
        is_causal, scale, level: as :func:`run_on_cpu`.
        library: a library from :func:`build` (default: the package's kernels).

    Raises:
        RuntimeError: the harness stopped the kernel (a deadlock, a barrier skipped by some threads, a broken
            WMMA precondition), with its reason.
    """
    ints = _problem(query, key, value, level)
    for name, t in (("query", query), ("key", key), ("value", value), ("out", out)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if out.shape != query.shape or out.dtype != query.dtype or out.device.type != "cpu":
        raise ValueError(f"out must be a CPU tensor of query's shape {tuple(query.shape)} and dtype {query.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    lib = load_library(library)
    with _CALL_LOCK:
        status = lib.ac_flash_forward_cpu(query.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(), *ints,
                                          float(scale), int(bool(is_causal)))
    if status != 0:
        raise RuntimeError(f"the level-{level} kernel failed on the CPU harness: "
                           f"{lib.ac_flash_cpu_error(status).decode(errors='replace')}")


def run_on_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool = False,
               scale: Optional[float] = None, level: Optional[int] = None) -> torch.Tensor:
    """Attention by the CUDA kernels of the ``cuda`` backend, executed on the CPU by the CUDA-on-CPU harness.

    The first call compiles the kernels with the host C++ compiler (a few seconds; cached on disk). Slow (one
    OS thread per CUDA thread): for small inputs, to check the kernels, not to compute with them.

    Args:
        query: (B, Hq, L, E) CPU tensor, float32, float16 or bfloat16.
        key: (B, H, S, E) with ``Hq % H == 0`` (grouped-query attention when ``H < Hq``).
        value: (B, H, S, E): the same head dim as query, at most 128.
        is_causal: query ``i`` sees keys ``j <= i`` (upper-left aligned, as torch SDPA).
        scale: multiplies the scores; ``1 / sqrt(E)`` by default.
        level: 1 (one thread per query row, two at D = 128; fp32 math) or 2 (WMMA tensor-core tiles, float16/bfloat16);
            ``None``: 2 for float16/bfloat16, 1 for float32, as on a GPU.

    Returns:
        (B, Hq, L, E) in the query's dtype.

    Raises:
        RuntimeError: no C++ compiler (the message says which were looked for), or the harness stopped the kernel.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(t, name)
    check_bool_flag(is_causal, "is_causal")
    level = (1 if query.dtype == torch.float32 else 2) if level is None else level
    _problem(query, key, value, level)
    scale = scale_or_default(check_scale(scale), query.shape[-1])
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
    out = torch.full_like(query, float("nan"))  # anything the kernel fails to write shows up
    if out.numel() == 0:
        return out
    flash_forward_cpu(query, key, value, out, is_causal=is_causal, scale=scale, level=level)
    return out


@dataclass
class ProgramRun:
    """What a run of the ``flash_cpu_main`` program gave: the output (``None`` unless it exited with 0), its exit
    status and its standard error (ThreadSanitizer writes its reports there)."""

    out: Optional[torch.Tensor]
    returncode: int
    stderr: str


def _raw(t: torch.Tensor) -> bytes:
    t = t.contiguous()
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes()


def run_program(program: Path, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool,
                scale: float, level: int, env: Optional[Mapping[str, str]] = None,
                timeout: float = 300.0) -> ProgramRun:
    """Run a program from :func:`build` ``(program=True, ...)`` on CPU tensors, through files.

    ``env`` adds to the environment (``TSAN_OPTIONS``, say). Never raises for the program's own failure: a
    ThreadSanitizer report or a harness error is in the returned ``stderr`` and ``returncode``.
    """
    ints = _problem(query, key, value, level)
    with tempfile.TemporaryDirectory(prefix="ac_cuda_on_cpu_") as tmp:
        paths = [Path(tmp) / n for n in ("q.bin", "k.bin", "v.bin", "o.bin")]
        for path, t in zip(paths, (query, key, value)):
            path.write_bytes(_raw(t))
        cmd = [str(program), *map(str, ints), repr(float(scale)), str(int(bool(is_causal))), *map(str, paths)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, **(env or {})})
        out = None
        if done.returncode == 0:
            raw = torch.frombuffer(bytearray(paths[3].read_bytes()), dtype=torch.uint8)
            out = raw.view(query.dtype).reshape(query.shape).clone()
    return ProgramRun(out, done.returncode, done.stderr)
