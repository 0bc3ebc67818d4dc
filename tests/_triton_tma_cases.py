"""Parity of the TMA forward kernel (``triton_flash_tma``) under the Triton interpreter, in a child process.

``tests/test_triton_tma.py`` runs ``python tests/_triton_tma_cases.py NAME...`` with ``TRITON_INTERPRET=1`` (a
child, as ``_triton_interp_cases.py`` explains: the variable is read when the kernels are defined) and reads
one JSON line: name -> {"ok", "detail"}. Each case draws inputs (seed in the detail), launches
:func:`flash_attention_forward_tma` at one block shape, and compares

* ``out`` with the float64 reference (``attention_core.backends.reference``) by ``max|x - ref| / max(max|ref|, 1)``,
* ``lse`` with ``torch.logsumexp`` of the float64 scaled scores (absolute error, natural log),
* both with ``triton_flash``'s pointer kernel on the same inputs (what the routing replaces),
* the gradients that ``triton_flash``'s backward computes from this kernel's ``out`` and ``lse`` with the
  float64 autograd gradients (so the ``lse`` is in the units the backward reads).

bfloat16 cannot be checked here: the interpreter's bfloat16 ``tl.dot`` returns garbage (its case reports the
error and is skipped); the descriptor loads of bfloat16 are checked exactly (``bf16_descriptor_load``).
``causal_reads_no_key_past_the_diagonal``: with NaN keys and values after position 128, the causal rows before
128 are bit-identical to a run without those keys (a kernel that loaded a tile past its diagonal would spread
the NaN through ``P @ V`` even where the mask zeroes ``P``).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

# name: ((BLOCK_M, BLOCK_N), (B, Hq, H, L, S, E, is_causal, dtype, scale))
CASES = {
    "fp16_E64_causal_L128_b64x32": ((64, 32), (1, 2, 2, 128, 128, 64, True, "float16", None)),
    "fp16_E64_full_L256_b64x64": ((64, 64), (1, 2, 2, 256, 256, 64, False, "float16", None)),
    "fp16_E128_causal_L256_b128x64": ((128, 64), (1, 2, 2, 256, 256, 128, True, "float16", None)),
    "fp16_E128_full_L128_b128x128": ((128, 128), (2, 1, 1, 128, 128, 128, False, "float16", None)),
    "fp16_E64_causal_gqa_L256_b128x128": ((128, 128), (1, 4, 2, 256, 256, 64, True, "float16", None)),
    "fp16_E128_causal_L128_S256_b64x64": ((64, 64), (1, 2, 1, 128, 256, 128, True, "float16", None)),
    "fp16_E64_causal_L256_S128_b64x32": ((64, 32), (1, 2, 2, 256, 128, 64, True, "float16", None)),
    "fp16_E64_full_L128_S384_scale0.3": ((64, 128), (1, 2, 2, 128, 384, 64, False, "float16", 0.3)),
    "bf16_E64_causal_L128_b64x64": ((64, 64), (1, 2, 2, 128, 128, 64, True, "bfloat16", None)),
}
EXTRA = ["bf16_descriptor_load", "causal_reads_no_key_past_the_diagonal"]
NAMES = list(CASES) + EXTRA

#: out: relative to max|ref| (fp16 output rounding ~5e-4, fp16 probabilities in the P @ V dot);
#: lse: absolute, natural log; grads: as _triton_interp_cases' fp16 backward.
TOL = {"out": 4e-3, "lse": 1e-4, "grad": 1e-2}


def _max_err(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1.0)) if ref.numel() else 0.0


def run_case(name: str, seed: int) -> dict:
    import torch

    from attention_core.backends import reference, triton_flash, triton_flash_tma

    (bm, bn), (B, Hq, H, L, S, E, is_causal, dtype_name, scale) = CASES[name]
    dtype = getattr(torch, dtype_name)
    scale = scale or E ** -0.5
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for shape in ((B, Hq, L, E), (B, H, S, E), (B, H, S, E)))
    out, lse = triton_flash_tma.flash_attention_forward_tma(q, k, v, scale, is_causal, block=(bm, bn))

    mask = torch.ones(L, S, dtype=torch.bool).tril() if is_causal else None  # upper-left aligned
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference.attention(qd, kd, vd, mask, 0.0, False, scale, Hq != H)
    kr = kd.detach().repeat_interleave(Hq // H, 1)  # (B, H, S, E) -> (B, Hq, S, E)
    scores = qd.detach() @ kr.transpose(-1, -2) * scale  # (B, Hq, L, S)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    ref_lse = torch.logsumexp(scores, -1)  # (B, Hq, L)
    errs = {"out": _max_err(out, ref), "lse": float((lse.double() - ref_lse).abs().max())}
    if dtype == torch.bfloat16:
        return {"ok": None, "detail": f"seed={seed} interpreter's bfloat16 tl.dot is wrong: out error "
                                      f"{errs['out']:.3g}, lse error {errs['lse']:.3g} (not a kernel check)"}

    left, right = triton_flash.window_bounds(L, S, is_causal, None)
    ptr_out, ptr_lse = triton_flash.flash_attention_forward(q, k, v, scale, left, right)  # CPU: pointer kernel
    errs["out_vs_pointer"] = _max_err(out, ptr_out)
    errs["lse_vs_pointer"] = float((lse - ptr_lse).abs().max())

    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    dq, dk, dv = triton_flash.flash_attention_backward(grad_out, q, k, v, out, lse, scale, left, right)
    rq, rk, rv = torch.autograd.grad(ref, (qd, kd, vd), grad_out.double())
    errs["grad"] = max(_max_err(dq, rq), _max_err(dk, rk), _max_err(dv, rv))

    finite = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    ok = (finite and errs["out"] <= TOL["out"] and errs["lse"] <= TOL["lse"] and errs["grad"] <= TOL["grad"]
          and errs["out_vs_pointer"] <= TOL["out"] and errs["lse_vs_pointer"] <= TOL["lse"])
    detail = f"seed={seed} finite={finite} " + " ".join(f"{n}={e:.1e}" for n, e in errs.items())
    return {"ok": ok, "detail": detail, "errors": errs}


def run_extra(name: str, seed: int) -> dict:
    import torch
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    if name == "bf16_descriptor_load":  # the TMA path moves bfloat16 exactly; only the interpreter's dot is off
        @triton.jit
        def copy(desc, Out, N: tl.constexpr):
            x = desc.load([N, 0]).to(tl.float32)  # the second (N, N) box
            tl.store(Out + tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :], x)

        g = torch.Generator().manual_seed(seed)
        x = torch.randn(64, 32, generator=g).to(torch.bfloat16)
        out = torch.empty(32, 32)
        copy[(1,)](TensorDescriptor(x, [64, 32], [32, 1], [32, 32]), out, N=32)
        err = float((out - x[32:].float()).abs().max())
        return {"ok": err == 0.0, "detail": f"seed={seed} max error {err}"}
    if name == "causal_reads_no_key_past_the_diagonal":  # the causal skip: keys after a tile's last query unread
        from attention_core.backends import triton_flash_tma

        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 2, 256, 64, generator=g).to(torch.float16) for _ in range(3))
        k[:, :, 128:], v[:, :, 128:] = float("nan"), float("nan")  # poison: keys 128.. would spread NaN
        out, lse = triton_flash_tma.flash_attention_forward_tma(q, k, v, 0.125, True, block=(64, 64))
        first = [t[:, :, :128].contiguous() for t in (q, k, v)]  # (1, 2, 256, 64) -> (1, 2, 128, 64)
        ref, ref_lse = triton_flash_tma.flash_attention_forward_tma(*first, 0.125, True, block=(64, 64))
        same = bool(torch.equal(out[:, :, :128], ref)) and bool(torch.equal(lse[:, :, :128], ref_lse))
        return {"ok": same, "detail": f"seed={seed} rows 0..127 equal to the run without keys 128..: {same}"}
    raise KeyError(name)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    seed = int(os.environ.get("AC_TEST_SEED", "0")) or int.from_bytes(os.urandom(2), "little")
    results = {}
    for name in sys.argv[1:] or NAMES:
        try:
            results[name] = run_case(name, seed) if name in CASES else run_extra(name, seed)
        except Exception:  # noqa: BLE001 - reported to the parent test, which fails with it
            results[name] = {"ok": False, "detail": traceback.format_exc()[-2000:]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
