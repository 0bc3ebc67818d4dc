"""Interpreter cases of the Triton flex kernel, run in a child with TRITON_INTERPRET=1 (tests/test_triton_flex.py).

Prints one JSON object: case name -> the largest |triton - float64 reference| (or the error it raised).
"""

from __future__ import annotations

import json
import os
import sys

import torch

import attention_core.mask_mods as mm
from attention_core.flex_attention import create_block_mask, flex_attention

DOCS = torch.arange(256) // 45


def mods(L, S):
    return {
        "noop": None, "causal": mm.causal, "window": mm.sliding_window(40), "sinks_window": mm.sinks_and_window(4, 40),
        "document": mm.document(DOCS), "prefix_lm": mm.prefix_lm(50), "bottom_right": mm.causal_bottom_right(L, S),
        "document_causal": mm.and_masks(mm.document(DOCS), mm.causal), "window_two_sided": mm.sliding_window(40, False),
    }


def scores(H):
    g = torch.Generator().manual_seed(3)
    return {"none": None, "alibi": mm.alibi(mm.alibi_slopes(H)), "soft_cap": mm.soft_cap(2.0),
            "relative_position_bias": mm.relative_position_bias(torch.randn(H, 21, generator=g), 10)}


def case(mod_name, score_name, dtype, block, L, S, Bm=None):
    B, H, E = 2, 2, 32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, E, generator=g).to(dtype) for n in (L, S, S))
    mod, sm = mods(L, S)[mod_name], scores(H)[score_name]
    bm = None if mod is None else create_block_mask(mod, Bm, None, L, S, BLOCK_SIZE=block)
    with torch.no_grad():
        out = flex_attention(q, k, v, score_mod=sm, block_mask=bm, backend="triton")
        ref = flex_attention(q.double(), k.double(), v.double(), score_mod=sm, block_mask=bm, backend="reference")
    assert out.dtype == dtype and out.shape == ref.shape
    return float((out.double() - ref).abs().max())


CASES = {}
for m in mods(200, 200):  # every mod, ragged L = S = 200, the GPU's (128, 64) tiles, float32
    CASES[f"{m}-none-float32-128x64"] = (m, "none", torch.float32, (128, 64), 200, 200)
for s in ("alibi", "soft_cap", "relative_position_bias"):
    CASES[f"sinks_window-{s}-float32-128x64"] = ("sinks_window", s, torch.float32, (128, 64), 200, 200)
for m in ("causal", "document_causal", "sinks_window"):  # float16 at (64, 64) and (128, 128), round lengths
    CASES[f"{m}-none-float16-64x64"] = (m, "none", torch.float16, (64, 64), 256, 256)
CASES["causal-alibi-float16-128x128"] = ("causal", "alibi", torch.float16, (128, 128), 256, 256)
CASES["document_causal-relative_position_bias-float16-128x32"] = (  # the GPU tiles (GPU_TILES)
    "document_causal", "relative_position_bias", torch.float16, (128, 32), 200, 200)
CASES["sinks_window-soft_cap-float32-32x32"] = ("sinks_window", "soft_cap", torch.float32, (32, 32), 200, 200)
CASES["bottom_right-none-float32-64x32-L<S"] = ("bottom_right", "none", torch.float32, (64, 32), 100, 230)
CASES["sinks_window-none-float32-per-batch-mask"] = ("sinks_window", "none", torch.float32, (64, 64), 200, 200, 2)


def grad_case(mod_name, score_name, dtype, block, L, S, Bm=None):
    """Largest |triton - float64 reference| over out, dq, dk, dv, divided by max(1, the reference's largest |value|)
    (gradients reach ~4 here); inf when a query row that reads no key gets a nonzero dq."""
    B, H, E = 2, 2, 32
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, n, E, generator=g).to(dtype) for n in (L, S, S))
    grad_out = torch.randn(B, H, L, E, generator=g).to(dtype)
    mod, sm = mods(L, S)[mod_name], scores(H)[score_name]
    bm = None if mod is None else create_block_mask(mod, Bm, None, L, S, BLOCK_SIZE=block)
    mine = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flex_attention(*mine, score_mod=sm, block_mask=bm, backend="triton")
    out.backward(grad_out)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = flex_attention(*ref_in, score_mod=sm, block_mask=bm, backend="reference")
    ref.backward(grad_out.double())
    assert all(x.grad.dtype == dtype and x.grad.shape == x.shape for x in mine)
    if mod_name == "bottom_right" and L > S and bool((mine[0].grad[..., : L - S, :] != 0).any()):
        return float("inf")  # rows that read nothing must pass no gradient (exact zeros)
    pairs = [(out.detach(), ref.detach())] + [(a.grad, b.grad) for a, b in zip(mine, ref_in)]
    return max(float((a.double() - b).abs().max()) / max(1.0, float(b.abs().max())) for a, b in pairs)


GRAD_CASES = {}
for m, s, dt, block in (("causal", "none", torch.float32, (128, 64)), ("window", "none", torch.float32, (32, 32)),
                        ("sinks_window", "soft_cap", torch.float32, (64, 64)),
                        ("document", "none", torch.float32, (64, 64)),
                        ("sinks_window", "alibi", torch.float32, (128, 64)),
                        ("causal", "none", torch.float16, (128, 32)),
                        ("sinks_window", "alibi", torch.float16, (64, 64)),
                        ("document_causal", "relative_position_bias", torch.float16, (128, 32)),
                        ("noop", "none", torch.float32, (128, 64)), ("prefix_lm", "none", torch.float32, (64, 64)),
                        ("window_two_sided", "none", torch.float32, (32, 32))):
    GRAD_CASES[f"grad-{m}-{s}-{str(dt)[6:]}-{block[0]}x{block[1]}"] = (m, s, dt, block, 200, 200)
GRAD_CASES["grad-bottom_right-none-float32-64x32-empty-rows"] = (
    "bottom_right", "none", torch.float32, (64, 32), 230, 100)  # the first 130 queries read no key
GRAD_CASES["grad-bottom_right-none-float32-32x64-L<S"] = ("bottom_right", "none", torch.float32, (32, 64), 100, 230)
GRAD_CASES["grad-sinks_window-none-float32-per-batch-mask"] = (
    "sinks_window", "none", torch.float32, (64, 64), 200, 200, 2)


def operators():
    """The kernels are torch.library operators: torch.compile(fullgraph=True) traces them on fake tensors and gives
    eager's gradients; ``opcheck`` tests the forward's schema, fake, autograd registration and AOT dispatch."""
    from attention_core.backends import triton_flex as tf

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 70, 16, generator=g, requires_grad=True) for _ in range(3))
    bm, sm = create_block_mask(mm.sliding_window(20), None, None, 70, 70, BLOCK_SIZE=32), mm.soft_cap(2.0)

    def f(q, k, v):
        return flex_attention(q, k, v, score_mod=sm, block_mask=bm, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    want = torch.autograd.grad(f(q, k, v).square().sum(), (q, k, v))
    got = torch.autograd.grad(compiled(q, k, v).square().sum(), (q, k, v))
    err = max(float((a - b).abs().max()) for a, b in zip(got, want))
    tensors, scalars, constexprs, _ = tf.compile_args(q, k, v, sm, bm, 0.25)
    args = (*[x.detach().requires_grad_(i < 3) for i, x in enumerate(tensors)], 0.25, scalars["CAP"], scalars["P0"],
            scalars["P1"], scalars["P2"], constexprs["MASK"], constexprs["SCORE"], 32, 32)
    checks = torch.library.opcheck(torch.ops.attention_core.triton_flex_forward.default, args)
    return {"compile_grad_err": err, "opcheck": checks}


def errors():
    from attention_core.backends.triton_flex import triton_flex_attention

    q = torch.randn(1, 1, 64, 16)
    q2 = torch.randn(1, 2, 64, 16)
    out = {}
    bm = create_block_mask(mm.strided(8), None, None, 64, 64, BLOCK_SIZE=32)
    for name, call in {
        "unsupported_mask": lambda: flex_attention(q, q, q, block_mask=bm, backend="triton"),
        "captured_grad": lambda: flex_attention(
            q.requires_grad_(), q, q, score_mod=mm.alibi(torch.ones(1, requires_grad=True)), backend="triton"),
        # issue 37: ALiBi slopes for 1 head used on 2 heads: the kernel read slopes[1], past the tensor
        "short_slopes": lambda: flex_attention(q2, q2, q2, score_mod=mm.alibi(torch.ones(1)), backend="triton"),
        "short_slopes_direct": lambda: triton_flex_attention(q2, q2, q2, mm.alibi(torch.ones(1))),
        "short_table": lambda: flex_attention(q2, q2, q2, score_mod=mm.relative_position_bias(torch.zeros(1, 3), 1),
                                              backend="triton"),
    }.items():
        try:
            call()
            out[name] = "no error"
        except (ValueError, NotImplementedError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    # issue 37: a NaN key and value that the causal mask hides from the first rows reach no other row, forward or
    # backward (the front zeroes them and puts NaN back in the rows that read them)
    k, v = torch.randn(1, 1, 64, 16), torch.randn(1, 1, 64, 16)
    k[0, 0, 40], v[0, 0, 40] = float("nan"), float("inf")
    qg, kg, vg = (x.clone().requires_grad_() for x in (torch.randn(1, 1, 64, 16), k, v))
    causal = create_block_mask(mm.causal, None, None, 64, 64, BLOCK_SIZE=32)
    o = flex_attention(qg, kg, vg, block_mask=causal, backend="triton")
    o[:, :, :40].sum().backward()
    out["nan_masked"] = {"rows_before_finite": bool(o[:, :, :40].isfinite().all()),
                         "rows_after_nan": bool(o[:, :, 40:].isnan().all()),
                         "grads_finite": all(bool(x.grad.isfinite().all()) for x in (qg, kg, vg))}
    return out


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    names = sys.argv[1:] or [*CASES, *GRAD_CASES]
    result = {}
    for n in names:
        try:
            result[n] = case(*CASES[n]) if n in CASES else grad_case(*GRAD_CASES[n])
        except Exception as exc:  # noqa: BLE001
            result[n] = f"{type(exc).__name__}: {exc}"
    result["errors"] = errors()
    try:
        result["operators"] = operators()
    except Exception as exc:  # noqa: BLE001
        result["operators"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(result))
