"""Parity checks of the Triton kernels under the interpreter, run in a child process.

Why a child process: ``TRITON_INTERPRET=1`` is read when ``@triton.jit`` decorates a kernel, i.e. when
``attention_core.backends.triton_flash`` is first imported. Setting it in the pytest process would make every
Triton kernel of the session interpreted (and wrong for the GPU tests), and unsetting it later changes
nothing. So ``tests/test_triton_backend.py`` runs ``python tests/_triton_interp_cases.py`` once with the
variable set, and this script prints one JSON object: case name -> {"ok", "detail"}. The case list below is
importable without torch or triton, so the parent can parametrize its tests over the names.

Each case draws fresh random inputs (the seed is in every detail line, and ``AC_TEST_SEED`` fixes it), runs
forward and backward with every output buffer NaN-poisoned first, and compares with the float64 reference
(eager torch in float64, autograd for the gradients) by ``max|x - ref| / max(max|ref|, 1)``.
"""

from __future__ import annotations

import json
import os
import random
import sys
import traceback

# name: (B, Hq, H, L, S, E, Ev, is_causal, window, dtype, scale)
CASES = {
    "single_position": (1, 2, 2, 1, 1, 16, 16, False, None, "float32", None),
    "L17_causal": (1, 2, 2, 17, 17, 16, 16, True, None, "float32", None),
    "L33_full_batch2": (2, 2, 2, 33, 33, 32, 32, False, None, "float32", None),
    "L100_S64_causal_gqa": (1, 4, 2, 100, 64, 64, 32, True, None, "float32", None),
    "L64_S100_odd_dims_gqa": (1, 2, 1, 64, 100, 24, 40, False, None, "float32", None),
    "L100_window16_causal": (1, 2, 2, 100, 100, 32, 32, True, 16, "float32", None),
    "L100_S70_window20_two_sided": (1, 2, 2, 100, 70, 32, 32, False, 20, "float32", None),
    "L64_S17_window8_empty_rows": (1, 1, 1, 64, 17, 32, 32, True, 8, "float32", None),
    "L33_scale_0.3": (1, 1, 1, 33, 33, 16, 16, False, None, "float32", 0.3),
    "L100_E128_full": (1, 1, 1, 100, 100, 128, 128, False, None, "float32", None),
    "L1_S40_causal": (1, 2, 2, 1, 40, 16, 16, True, None, "float32", None),
    "L64_fp16_causal": (1, 2, 2, 64, 64, 64, 64, True, None, "float16", None),
    "L33_fp16_gqa_window10": (1, 4, 1, 33, 33, 32, 32, True, 10, "float16", None),
}
#: Checks that are not a parity case.
EXTRA = ["import_is_lazy", "no_keys", "non_contiguous_inputs", "lse_matches_logsumexp", "registry_dispatch",
         "refuses_bf16_and_masks", "nonfinite_policy"]
NAMES = list(CASES) + EXTRA

TOL = {"float32": (2e-5, 2e-5), "float16": (4e-3, 1e-2)}  # (forward, backward)


def _max_err(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1.0)) if ref.numel() else 0.0


def _oracle(q, k, v, is_causal, window, scale, grad_out):
    """Float64 reference output and gradients, with the window as an explicit bool mask."""
    import torch

    from attention_core.backends import reference
    from attention_core.masks import causal_mask, sliding_window_mask

    L, S = q.shape[2], k.shape[2]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = None
    if window is not None:
        mask = sliding_window_mask(L, window, S, causal=is_causal)
    elif is_causal:
        mask = causal_mask(L, S)
    out = reference.attention(qd, kd, vd, mask, 0.0, False, scale, q.shape[1] != k.shape[1])
    dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), grad_out.double())
    return out, dq, dk, dv, mask


def run_case(name: str, seed: int) -> dict:
    import torch

    from attention_core.backends import triton_flash

    B, Hq, H, L, S, E, Ev, is_causal, window, dtype_name, scale = CASES[name]
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g).to(dtype).requires_grad_()
               for shape in ((B, Hq, L, E), (B, H, S, E), (B, H, S, Ev)))
    out = triton_flash.flash_attention(q, k, v, is_causal=is_causal, scale=scale, window=window)
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad_out)
    ref, dq, dk, dv, mask = _oracle(q, k, v, is_causal, window, scale or E ** -0.5, grad_out)
    tol_f, tol_b = TOL[dtype_name]
    errs = {"out": _max_err(out, ref), "dq": _max_err(q.grad, dq), "dk": _max_err(k.grad, dk),
            "dv": _max_err(v.grad, dv)}
    finite = all(bool(torch.isfinite(t).all()) for t in (out, q.grad, k.grad, v.grad))
    ok = finite and errs["out"] <= tol_f and max(errs["dq"], errs["dk"], errs["dv"]) <= tol_b
    detail = f"seed={seed} finite={finite} " + " ".join(f"{n}={e:.1e}" for n, e in errs.items())
    if mask is not None and not bool(mask.any(-1).all()):  # rows that see nothing must be exact zeros
        empty = ~mask.any(-1)  # (L,)
        zero = bool((out.detach()[:, :, empty] == 0).all()) and bool((q.grad[:, :, empty] == 0).all())
        ok = ok and zero
        detail += f" empty_rows={int(empty.sum())} zero={zero}"
    return {"ok": ok, "detail": detail}


def run_extra(name: str, seed: int) -> dict:
    import torch

    from attention_core.backends import triton_flash

    g = torch.Generator().manual_seed(seed)
    if name == "no_keys":  # S = 0: every row sees nothing, so zeros and zero gradients, not NaN
        q = torch.randn(1, 1, 5, 16, generator=g, requires_grad=True)
        k, v = (torch.randn(1, 1, 0, 16, requires_grad=True) for _ in range(2))
        out = triton_flash.flash_attention(q, k, v)
        out.sum().backward()
        ok = out.shape == (1, 1, 5, 16) and bool((out == 0).all()) and bool((q.grad == 0).all())
        return {"ok": ok, "detail": f"out {tuple(out.shape)} all zero: {bool((out == 0).all())}"}
    if name == "non_contiguous_inputs":  # (B, L, H, E) storage seen as (B, H, L, E): strides, not copies
        q, k, v = (torch.randn(2, 33, 2, 32, generator=g).transpose(1, 2).requires_grad_() for _ in range(3))
        out = triton_flash.flash_attention(q, k, v, is_causal=True)
        grad_out = torch.randn(out.shape, generator=g).transpose(2, 3).contiguous().transpose(2, 3)
        out.backward(grad_out)
        ref, dq, dk, dv, _ = _oracle(q, k, v, True, None, 32 ** -0.5, grad_out)
        err = max(_max_err(out, ref), _max_err(q.grad, dq), _max_err(k.grad, dk), _max_err(v.grad, dv))
        return {"ok": err <= 2e-5, "detail": f"seed={seed} max_err={err:.1e}"}
    if name == "lse_matches_logsumexp":
        q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
        scale = 0.25
        left, right = triton_flash.window_bounds(40, 40, True, None)
        _, lse = triton_flash.flash_attention_forward(q, k, v, scale, left, right)
        scores = (q.double() @ k.double().transpose(-1, -2)) * scale  # (1, 2, 40, 40)
        scores = scores.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
        err = float((lse.double() - scores.logsumexp(-1)).abs().max())
        return {"ok": err <= 1e-5, "detail": f"seed={seed} max_abs_err={err:.1e}"}
    if name == "registry_dispatch":
        import attention_core as ac
        from attention_core.backends import get_backend

        try:
            get_backend("triton")
        except ValueError as err:
            return {"ok": None, "detail": f"'triton' is not registered yet: {err}"}
        q, k, v = (torch.randn(1, 2, 17, 16, generator=g) for _ in range(3))
        out = ac.scaled_dot_product_attention(q, k, v, is_causal=True, backend="triton")
        ref = ac.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                              backend="reference")
        err = _max_err(out, ref)
        try:
            ac.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(17, 17, dtype=torch.bool),
                                            backend="triton")
            refused = "no error"
        except ValueError as e:
            refused = str(e)
        ok = err <= 2e-5 and "attn_mask" in refused
        return {"ok": ok, "detail": f"seed={seed} max_err={err:.1e}; with a mask: {refused}"}
    if name == "nonfinite_policy":  # scaled_dot_product_attention's policy holds for the fused kernel too
        import attention_core as ac

        q, k, v = (torch.randn(1, 2, 17, 16, generator=g) for _ in range(3))
        q[0, 0, 3, 1], k[0, 1, 5, 0] = float("nan"), float("inf")
        out = ac.scaled_dot_product_attention(q, k, v, is_causal=True, backend="triton")
        ref = ac.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                              backend="reference")
        rows = torch.isnan(out).any(-1)[0].tolist()  # (2, 17)
        want = [[i == 3 for i in range(17)], [i >= 5 for i in range(17)]]  # query row 3; rows reading key 5
        finite = ~torch.isnan(ref)
        err = _max_err(out[finite], ref[finite])
        ok = rows == want and torch.equal(torch.isnan(out), torch.isnan(ref)) and err <= 2e-5
        return {"ok": ok, "detail": f"seed={seed} NaN rows as the policy says: {rows == want}; max_err={err:.1e}"}
    if name == "refuses_bf16_and_masks":
        q = torch.randn(1, 1, 8, 16, dtype=torch.bfloat16)
        try:
            triton_flash.flash_attention(q, q, q)
            return {"ok": False, "detail": "bfloat16 under the interpreter was accepted"}
        except TypeError as err:
            msg = str(err)
        try:
            triton_flash.flash_attention(q.float(), q.float()[..., :8], q.float())
            return {"ok": False, "detail": "mismatched head dims were accepted"}
        except ValueError as err:
            msg2 = str(err)
        return {"ok": "bfloat16" in msg and "head dim" in msg2, "detail": f"{msg} | {msg2}"}
    raise KeyError(name)


def import_is_lazy() -> dict:
    """``import attention_core`` and asking what can run must not import Triton (nor compile anything)."""
    import attention_core as ac
    from attention_core.backends import fused_checks

    names = ac.available_backends()
    fused_checks.cuda_available()
    lazy = "triton" not in sys.modules and "attention_core.backends.triton_flash" not in sys.modules
    return {"ok": lazy and "triton" in names, "detail": f"available: {names}; triton imported: {not lazy}"}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (tests/test_triton_backend.py does)")
    first = import_is_lazy()  # before anything below imports triton
    from attention_core.backends import triton_flash

    triton_flash.POISON_OUTPUTS = True
    names = sys.argv[1:] or NAMES
    base = int(os.environ.get("AC_TEST_SEED", random.randrange(2**31)))
    results = {}
    for i, name in enumerate(names):
        if name == "import_is_lazy":
            results[name] = first
            continue
        try:
            fn = run_case if name in CASES else run_extra
            results[name] = fn(name, base + i)
        except Exception:  # report, keep going: one broken case must not hide the others
            results[name] = {"ok": False, "detail": traceback.format_exc(limit=4)}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
