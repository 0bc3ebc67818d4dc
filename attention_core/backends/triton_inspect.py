"""What a GPU would see of the Triton kernels, found without a GPU: registers, spills, shared memory, tensor cores.

Triton compiles for a named GPU target without a driver: :func:`triton.compile` on an ``ASTSource`` with a
``GPUTarget("cuda", 90, 32)`` runs the whole pipeline (Triton IR -> LLVM -> PTX -> ``ptxas`` -> cubin) on
the CPU. The wheel ships ``ptxas`` (whose ``-v`` log gives registers, stack frame and spill bytes per
thread) and ``cuobjdump`` (whose ``-sass`` listing shows the machine instructions: ``HGMMA`` is a Hopper
warpgroup tensor-core instruction, ``HMMA`` an Ampere/Turing warp-level one). This module compiles one
kernel of :mod:`attention_core.backends.triton_flash` for one configuration and reads those numbers.

Why they matter: a thread has at most 255 registers; what does not fit is *spilled* to local memory (really
DRAM, through the L1 cache), and every spill is a slow load or store inside the hottest loop. Registers per
thread also cap how many warps an SM can keep in flight (65,536 registers per SM). A ``tl.dot`` that became
no tensor-core instruction runs on the ordinary FMA units, 8-16x slower for fp16.

The kernels are specialised as a real launch would specialise them: contiguous (B, H, N, E) tensors, so the
innermost stride is the constant 1 and the others divisible by 16 (see :func:`launch_args`).

Everything here imports Triton: call it from a benchmark or a test, never at ``import attention_core``.
The kernels must have been defined without ``TRITON_INTERPRET=1`` (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Tuple

__all__ = ["ARCHS", "KERNELS", "KernelResources", "candidates_fingerprint", "compile_kernel",
           "compile_resources", "kernel_configs",
           "kernels_fingerprint", "launch_args"]

#: Compute capabilities inspected: Turing (T4, Colab's free GPU), Ampere (A100), Hopper (H100).
ARCHS = (75, 80, 90)

#: Short name -> attribute of :mod:`attention_core.backends.triton_flash`.
KERNELS = {"fwd": "_attn_fwd", "preprocess": "_attn_bwd_preprocess", "dkdv": "_attn_bwd_dkdv", "dq": "_attn_bwd_dq"}

_TC_RE = re.compile(r"\b(HGMMA|HMMA)\.")
_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")


@dataclass
class KernelResources:
    """One compiled kernel: what ``ptxas -v`` and ``cuobjdump -sass`` report (bytes are per thread)."""

    kernel: str
    arch: int
    dtype: str
    E: int
    causal: bool
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    hgmma: int
    hmma: int
    compile_s: float

    @property
    def spills(self) -> int:
        """Spilled bytes per thread (stores + loads); 0 is what a fast kernel needs."""
        return self.spill_stores + self.spill_loads

    @property
    def tensor_core_ops(self) -> int:
        """Tensor-core instructions in the SASS (HGMMA + HMMA)."""
        return self.hgmma + self.hmma

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _flash():
    from attention_core.backends import triton_flash

    if triton_flash.INTERPRET:
        raise RuntimeError("the kernels were defined under TRITON_INTERPRET=1; compile them in a process without it")
    return triton_flash


def _jit_fn(kernel: str):
    """The JITFunction of kernel ``kernel`` (under its autotune/heuristics wrappers, if any)."""
    fn = getattr(_flash(), KERNELS[kernel])
    while not hasattr(fn, "arg_names") or not hasattr(fn, "constexprs"):
        fn = fn.fn
    return fn


def kernels_fingerprint() -> str:
    """A hash of everything that decides what the kernels compile to, except the candidate lists.

    The source of every ``@triton.jit`` function of :mod:`~attention_core.backends.triton_flash` (the kernels
    and every helper they call), its numeric module constants, the Triton version, and the source of the Python
    rules that turn a launch into compile-time arguments (:func:`launch_args`, ``kernel_constexprs``,
    ``mask_mode``, ...). A compiled number stored with this hash belongs to the kernels of that hash; any edit
    that could change it changes the hash (moving a kernel down the file does not).
    """
    import hashlib
    import inspect

    import triton

    tf = _flash()
    parts = [triton.__version__]
    for name, value in sorted(vars(tf).items()):
        if isinstance(value, triton.runtime.jit.JITFunction):
            parts.append(f"{name}:{value.src}")
        elif name.isupper() and isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{name}={value!r}")
    for fn in (tf.kernel_constexprs, tf._mode_constexprs, tf.mask_mode, tf.window_bounds, tf._block_dim,
               tf._precision, launch_args, _signature):
        parts.append(inspect.getsource(fn))
    parts.append(repr(sorted(tf._EVEN)))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def candidates_fingerprint() -> str:
    """A hash of the autotune candidate lists and the preprocess block (what a sweep compiles)."""
    import hashlib

    tf = _flash()
    text = repr(sorted(tf.CANDIDATES.items())) + f"|{tf.PREPROCESS_BLOCK}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def kernel_configs(kernel: str, dtype: str, E: int, arch: Optional[int] = None) -> list:
    """The autotune candidates of ``kernel`` for ``dtype``, ``E`` and ``sm_<arch>``, as
    ``(BLOCK_M, BLOCK_N, warps, stages)``."""
    tf = _flash()
    if kernel == "preprocess":
        return [(tf.PREPROCESS_BLOCK, 0, 4, 1)]
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
            for c in tf.autotune_configs(kernel, dtype, E, arch)]


def launch_args(kernel: str, dtype: str, E: int, causal: bool, BLOCK_M: int, BLOCK_N: int, *, B: int = 4,
                Hq: int = 16, H: int = 16, L: int = 4096, S: int = 4096, window: Optional[int] = None
                ) -> Dict[str, Any]:
    """Every argument of ``kernel`` by name, as a launch on contiguous (B, H, N, E) tensors would pass them.

    Pointers are strings (their Triton type), everything else its value; the compile-time arguments come
    from :func:`triton_flash.kernel_constexprs`, the launcher's own rule.
    """
    tf = _flash()
    elt = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}[dtype]
    shapes = {"q": (Hq, L), "o": (Hq, L), "do": (Hq, L), "dq": (Hq, L), "k": (H, S), "v": (H, S), "dk": (H, S),
              "dv": (H, S)}
    values: Dict[str, Any] = {}
    for t, (heads, n) in shapes.items():
        for axis, stride in zip("bhmnd", (heads * n * E, n * E, E, E, 1)):
            values[f"stride_{t}{axis}"] = stride
    left, right = tf.window_bounds(L, S, causal, window)
    L_bucket, S_bucket = tf._buckets(L, S)
    values.update(Hq=Hq, H=H, GROUP=Hq // H, GROUP_PER=Hq // H, L=L, S=S, left=left, right=right,
                  L_BUCKET=L_bucket, S_BUCKET=S_bucket, stride_dks=0, stride_dvs=0, sm_scale=E ** -0.5)
    for name in ("Q", "K", "V", "Out", "DO", "DQ", "DK", "DV"):
        values[name] = elt
    values.update(LSE="*fp32", Delta="*fp32")
    values.update(tf.kernel_constexprs(kernel, L=L, S=S, E=E, Ev=E, left=left, right=right, dtype=dtype,
                                       BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N))
    return values


def _signature(fn, values: Dict[str, Any]):
    """(signature, constexprs, attrs) for ``ASTSource``, specialised as Triton's launcher would."""
    signature, constexprs, attrs = {}, {}, {}
    const_names = {fn.arg_names[i] for i in fn.constexprs}
    for i, name in enumerate(fn.arg_names):
        if name not in values:
            raise KeyError(f"no launch value for argument {name!r} of {fn.__name__}")
        v = values[name]
        if name in const_names:
            signature[name], constexprs[name] = "constexpr", v
        elif isinstance(v, str):  # a pointer: 16-byte aligned, as torch allocates
            signature[name] = v
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            signature[name] = "fp32"
        elif v == 1:  # Triton turns an int argument equal to 1 into a constant
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i64" if abs(v) >= 2**31 else "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_for(fn, signature: Dict[str, Any], constexprs: Dict[Any, Any], attrs: Dict[Any, Any], *, arch: int,
                num_warps: int, num_stages: int) -> Tuple[Any, str, Dict[str, int], float]:
    """Compile the ``@triton.jit`` function ``fn`` for ``sm_<arch>`` from scratch (Triton's on-disk cache is
    bypassed, so a number can never come from an older version of the kernel).

    Returns ``(compiled, sass, resources, seconds)``: Triton's compiled kernel (its ``asm`` holds the PTX and
    the other stages), the SASS from ``cuobjdump``, ``registers``, ``stack_bytes``, ``spill_stores``,
    ``spill_loads`` and ``shared_bytes`` read from ``ptxas -v``, and the compile time.
    """
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    log = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        with knobs.cache.scope(), knobs.compilation.scope(), knobs.nvidia.scope():
            knobs.cache.dir = tmp  # nothing read from or left in ~/.triton
            knobs.compilation.always_compile = True
            knobs.nvidia.dump_ptxas_log = True
            start = time.perf_counter()
            with contextlib.redirect_stdout(log):
                compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                          target=GPUTarget("cuda", arch, 32),
                                          options={"num_warps": num_warps, "num_stages": num_stages})
            seconds = time.perf_counter() - start
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    text = log.getvalue()
    regs, spill = _REGS_RE.search(text), _SPILL_RE.search(text)
    if regs is None or spill is None:
        raise RuntimeError(f"could not read the ptxas log of {fn.__name__} for sm_{arch}:\n{text[-2000:]}")
    resources = {"registers": int(regs.group(1)), "stack_bytes": int(spill.group(1)),
                 "spill_stores": int(spill.group(2)), "spill_loads": int(spill.group(3)),
                 "shared_bytes": int(compiled.metadata.shared)}
    return compiled, sass, resources, seconds


def compile_resources(fn, values: Dict[str, Any], *, arch: int, num_warps: int, num_stages: int) -> Dict[str, Any]:
    """Compile the ``@triton.jit`` function ``fn`` for ``sm_<arch>`` with the launch arguments ``values``
    (specialised by :func:`_signature`) and read its resources from ``ptxas -v`` and the SASS
    (:func:`compile_for`).

    Returns ``registers``, ``stack_bytes``, ``spill_stores``, ``spill_loads``, ``shared_bytes``, ``hgmma``,
    ``hmma`` (tensor-core instructions in the SASS) and ``compile_s``.
    """
    signature, constexprs, attrs = _signature(fn, values)
    _, sass, found, seconds = compile_for(fn, signature, constexprs, attrs, arch=arch, num_warps=num_warps,
                                          num_stages=num_stages)
    counts = {"HGMMA": 0, "HMMA": 0}
    for match in _TC_RE.finditer(sass):
        counts[match.group(1)] += 1
    return {**found, "hgmma": counts["HGMMA"], "hmma": counts["HMMA"], "compile_s": round(seconds, 2)}


def compile_kernel(kernel: str, *, arch: int, dtype: str, E: int, causal: bool = True, BLOCK_M: int,
                   BLOCK_N: int, num_warps: int, num_stages: int, launch: Optional[Dict[str, Any]] = None
                   ) -> KernelResources:
    """Compile one kernel of :mod:`~attention_core.backends.triton_flash` for ``sm_<arch>`` and read its
    resources (:func:`compile_resources`).

    Args:
        kernel: ``"fwd"``, ``"preprocess"``, ``"dkdv"`` or ``"dq"`` (:data:`KERNELS`).
        arch: compute capability as an int, e.g. 90 for sm_90.
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``.
        E: head dim (E = Ev).
        causal: compile the causal variant (else the unmasked one).
        BLOCK_M, BLOCK_N, num_warps, num_stages: the configuration.
        launch: overrides for :func:`launch_args` (e.g. ``L``, ``S``, ``window``).
    """
    values = launch_args(kernel, dtype, E, causal, BLOCK_M, BLOCK_N, **(launch or {}))
    found = compile_resources(_jit_fn(kernel), values, arch=arch, num_warps=num_warps, num_stages=num_stages)
    return KernelResources(kernel=kernel, arch=arch, dtype=dtype, E=E, causal=causal, BLOCK_M=BLOCK_M,
                           BLOCK_N=BLOCK_N, num_warps=num_warps, num_stages=num_stages, **found)
