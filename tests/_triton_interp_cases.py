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
#: Parity at the tile shapes the GPU configs use (BLOCK_M x BLOCK_N, pinned with interpreter_blocks; for dK/dV
#: BLOCK_N is the key tile): L and S not multiples of the blocks, L != S, GQA, each mask mode.
#: name: ((BLOCK_M, BLOCK_N), case as in CASES)
TILE_CASES = {
    "tiles_128x64_causal_gqa": ((128, 64), (1, 4, 2, 200, 150, 64, 64, True, None, "float32", None)),
    "tiles_128x64_full_fp16": ((128, 64), (1, 2, 2, 130, 257, 64, 64, False, None, "float16", None)),
    "tiles_64x64_window": ((64, 64), (1, 2, 1, 150, 150, 32, 32, True, 40, "float32", None)),
    "tiles_64x64_full_even": ((64, 64), (1, 2, 2, 128, 192, 128, 128, False, None, "float32", None)),
    "tiles_16x128_causal_Lgt_S": ((16, 128), (1, 2, 2, 160, 100, 64, 64, True, None, "float32", None)),
    "tiles_16x128_two_sided_window": ((16, 128), (1, 2, 2, 90, 140, 32, 32, False, 50, "float32", None)),
}
#: Checks that are not a parity case.
EXTRA = ["import_is_lazy", "no_keys", "non_contiguous_inputs", "lse_matches_logsumexp", "registry_dispatch",
         "refuses_bf16_and_masks", "nonfinite_policy", "gqa_split", "int64_row_offsets", "tile_ranges_brute_force",
         "compile_fullgraph"]
NAMES = list(CASES) + list(TILE_CASES) + EXTRA

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
    from attention_core.backends import triton_flash

    if name in TILE_CASES:
        blocks, case = TILE_CASES[name]
        with triton_flash.interpreter_blocks(*blocks):
            return _parity(case, seed)
    return _parity(CASES[name], seed)


def _parity(case: tuple, seed: int) -> dict:
    """Forward and backward of one case against the float64 oracle."""
    import torch

    from attention_core.backends import triton_flash

    B, Hq, H, L, S, E, Ev, is_causal, window, dtype_name, scale = case
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
    if name == "compile_fullgraph":  # the kernels are custom operators: one graph, fake shapes, same numbers
        from torch._subclasses.fake_tensor import FakeTensorMode

        import attention_core as ac

        q, k, v = (torch.randn(1, 4, 33, 16, generator=g, requires_grad=True) for _ in range(3))
        k2, v2 = (t.detach()[:, :2].clone().requires_grad_() for t in (k, v))  # GQA: 2 key/value heads

        def f(q, k, v):
            return ac.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, backend="triton")

        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
        want = torch.autograd.grad(f(q, k2, v2).square().sum(), (q, k2, v2))
        got_out = compiled(q, k2, v2)
        got = torch.autograd.grad(got_out.square().sum(), (q, k2, v2))
        err = max(_max_err(a, b) for a, b in zip(got, want))
        err = max(err, _max_err(got_out, f(q, k2, v2)))
        with FakeTensorMode():
            fq = torch.empty(2, 4, 7, 16)
            fout, flse = torch.ops.attention_core.triton_flash_forward(fq, fq[:, :2], torch.empty(2, 2, 7, 8), 0.25,
                                                                       0, 7)
        shapes = (tuple(fout.shape), tuple(flse.shape), flse.dtype)
        ok = err <= 2e-5 and shapes == ((2, 4, 7, 8), (2, 4, 7), torch.float32)
        return {"ok": ok, "detail": f"seed={seed} max_err={err:.1e}; fake shapes {shapes}"}
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
    if name == "gqa_split":  # the dK/dV sum over a GQA group split across programs gives the same gradients
        q = torch.randn(1, 4, 40, 16, generator=g, requires_grad=True)
        k, v = (torch.randn(1, 1, 50, 16, generator=g, requires_grad=True) for _ in range(2))
        grads = {}
        try:
            for split in (1, 2, 4):
                triton_flash.GQA_SPLIT = split
                out = triton_flash.flash_attention(q, k, v, is_causal=True)
                grads[split] = torch.autograd.grad(out, (k, v), torch.ones_like(out))
        finally:
            triton_flash.GQA_SPLIT = None
        ref, _, dk, dv, _ = _oracle(q, k, v, True, None, 16 ** -0.5, torch.ones(1, 4, 40, 16))
        errs = [max(_max_err(gk, dk), _max_err(gv, dv)) for gk, gv in grads.values()]
        try:
            triton_flash.GQA_SPLIT = 3  # not a divisor of the group of 4
            triton_flash.flash_attention(q, k, v).sum().backward()
            refused = "no error"
        except ValueError as err:
            refused = str(err)
        finally:
            triton_flash.GQA_SPLIT = None
        ok = max(errs) <= 2e-5 and "divisor" in refused
        return {"ok": ok, "detail": f"seed={seed} errors for split 1, 2, 4: {errs}; split=3: {refused}"}
    if name == "int64_row_offsets":  # row * stride past 2^31 elements: 32-bit offsets would wrap
        L, stride = 1100, 2**21  # row 1099 starts 1099 * 2^21 = 2.3e9 elements in
        try:
            storage = torch.empty(L * stride, dtype=torch.float16)  # 4.6 GB of address space, mostly untouched
        except RuntimeError as err:
            return {"ok": None, "detail": f"cannot reserve {L * stride * 2 / 2**30:.1f} GiB here: {err}"}
        q = storage.as_strided((1, 1, L, 16), (L * stride, L * stride, stride, 1))  # (B, H, L, E), sparse rows
        q.copy_(torch.randn(1, 1, L, 16, generator=g).half())
        q.requires_grad_()
        k, v = (torch.randn(1, 1, 24, 16, generator=g).half().requires_grad_() for _ in range(2))
        with triton_flash.interpreter_blocks(128, 16):
            out = triton_flash.flash_attention(q, k, v)
            grad_out = torch.randn(out.shape, generator=g).half()
            out.backward(grad_out)
        ref, dq, dk, dv, _ = _oracle(q, k, v, False, None, 0.25, grad_out)
        errs = [_max_err(out, ref), _max_err(q.grad, dq), _max_err(k.grad, dk), _max_err(v.grad, dv)]
        del storage
        return {"ok": max(errs) <= 1e-2, "detail": f"seed={seed} out, dq, dk, dv errors: {errs}"}
    if name == "tile_ranges_brute_force":
        return tile_ranges_brute_force()
    raise KeyError(name)


def tile_ranges_brute_force() -> dict:
    """Every block size 16..128, every mode, L != S, both roles: the tiles visited against the visible pairs.

    ``_col_ranges`` (the kernels' own jit function, run here by the interpreter on vectors of row blocks)
    gives three runs of column tiles; this walks them as the kernels' loops do and checks, for every row
    block: each visible (row, column) pair lies in exactly one visited tile, no column is visited twice, an
    unmasked tile is visible to every real row in every real column (forward/dQ: and lies inside the keys),
    no visited tile is hidden from every row, and the runs the kernels skip at compile time are empty.
    """
    import numpy as np
    import torch
    import triton
    import triton.language as tl

    from attention_core.backends import triton_flash as tf

    globals()["_col_ranges"] = tf._col_ranges  # @triton.jit resolves names in this module's globals

    @triton.jit
    def probe(R0, NCOLS, LEFT, RIGHT, OUT, N, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, MODE: tl.constexpr,
              ROWS_ARE_QUERIES: tl.constexpr, NB: tl.constexpr):
        i = tl.arange(0, NB)
        ok = i < N
        r0 = tl.load(R0 + i, mask=ok, other=0)
        lo, a, b, hi = _col_ranges(r0, BLOCK_R, BLOCK_C, tl.load(NCOLS + i, mask=ok, other=1),  # noqa: F821
                                   tl.load(LEFT + i, mask=ok, other=0), tl.load(RIGHT + i, mask=ok, other=0),
                                   MODE, ROWS_ARE_QUERIES)
        zero = r0 * 0  # a closed form may return a plain 0: broadcast it
        tl.store(OUT + i * 4, lo + zero, mask=ok)
        tl.store(OUT + i * 4 + 1, a + zero, mask=ok)
        tl.store(OUT + i * 4 + 2, b + zero, mask=ok)
        tl.store(OUT + i * 4 + 3, hi + zero, mask=ok)

    lengths = [(1, 1), (17, 17), (1, 40), (40, 1), (100, 64), (64, 100), (130, 257), (257, 130), (256, 256)]
    problems, checked = [], 0
    for blk_r in (16, 32, 64, 128):
        for blk_c in (16, 32, 64, 128):
            for rows_are_queries in (True, False):
                combos = {tf.FULL: [], tf.CAUSAL: [], tf.WINDOW: []}
                for L, S in lengths:
                    settings = [tf.window_bounds(L, S, causal, w) for causal in (False, True)
                                for w in (None, 1, 2, 5, 16, 33, 100, 300)]
                    for left, right in set(settings):
                        n_rows, n_cols = (L, S) if rows_are_queries else (S, L)
                        for r0 in range(0, n_rows, blk_r):
                            combos[tf.mask_mode(L, S, left, right)].append((r0, n_rows, n_cols, left, right))
                for mode, rows in combos.items():
                    if not rows:
                        continue
                    arr = torch.tensor(rows, dtype=torch.int32)  # (N, 5): r0, n_rows, n_cols, left, right
                    n = len(rows)
                    out = torch.zeros(n, 4, dtype=torch.int32)
                    probe[(1,)](arr[:, 0].contiguous(), arr[:, 2].contiguous(), arr[:, 3].contiguous(),
                                arr[:, 4].contiguous(), out, n, BLOCK_R=blk_r, BLOCK_C=blk_c, MODE=mode,
                                ROWS_ARE_QUERIES=rows_are_queries, NB=triton.next_power_of_2(n))
                    for (r0, n_rows, n_cols, left, right), (lo, a, b, hi) in zip(rows, out.tolist()):
                        checked += 1
                        err = _check_ranges(np, r0, blk_r, blk_c, n_rows, n_cols, left, right, mode,
                                            rows_are_queries, lo, a, b, hi)
                        if err:
                            problems.append(f"rows {r0}+{blk_r} cols/{blk_c} n_rows={n_rows} n_cols={n_cols} "
                                            f"left={left} right={right} mode={mode} queries={rows_are_queries} "
                                            f"-> {(lo, a, b, hi)}: {err}")
    detail = f"{checked} row blocks checked, {len(problems)} wrong" + (f"; first: {problems[0]}" if problems else "")
    return {"ok": not problems and checked > 1000, "detail": detail}


def _check_ranges(np, r0, blk_r, blk_c, n_rows, n_cols, left, right, mode, rows_are_queries, lo, a, b, hi):
    """The first broken promise of one row block's tile runs, or ''."""
    rows = np.arange(r0, r0 + blk_r)[:, None]  # every row of the block, real or past the end
    cols = np.arange(0, max(hi, n_cols) + 2 * blk_c)[None, :]
    i, j = (rows, cols) if rows_are_queries else (cols, rows)  # query i, key j
    vis = (j >= i - left) & (j <= i + right) & (cols < n_cols)  # (blk_r, n)
    real = rows[:, 0] < n_rows
    runs = [(lo, a, True), (a, b, False), (b, hi, True)]
    if rows_are_queries:
        skipped = ([0] if mode != 2 else []) + ([2] if mode == 0 and n_cols % blk_c == 0 else [])
    else:
        skipped = ([0] if mode == 0 else []) + ([2] if mode != 2 else [])
    for k in skipped:
        if runs[k][0] < runs[k][1]:
            return f"run {k} is not empty but its loop is not compiled"
    count = np.zeros(cols.shape[1], dtype=int)
    for start, end, masked in runs:
        for t in range(start, end, blk_c):
            tile = slice(t, t + blk_c)
            count[tile] += 1
            if not vis[:, tile].any():
                return f"tile {t} is visited but hidden from every row"
            if not masked:
                inside = cols[0, tile] < n_cols
                if rows_are_queries and not inside.all():
                    return f"unmasked tile {t} reaches past the {n_cols} keys"
                if not vis[real][:, tile][:, inside].all():
                    return f"unmasked tile {t} has a hidden pair"
    if (count > 1).any():
        return f"column {int(np.argmax(count > 1))} visited twice"
    seen = vis[real].any(0)
    if (seen & (count == 0)).any():
        return f"visible column {int(np.argmax(seen & (count == 0)))} never visited"
    return ""


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
    from _poisoned import poison_from_now_on


    poison_from_now_on()  # every output buffer starts as NaN
    names = sys.argv[1:] or NAMES
    base = int(os.environ.get("AC_TEST_SEED", random.randrange(2**31)))
    results = {}
    for i, name in enumerate(names):
        if name == "import_is_lazy":
            results[name] = first
            continue
        try:
            fn = run_case if name in CASES or name in TILE_CASES else run_extra
            results[name] = fn(name, base + i)
        except Exception:  # report, keep going: one broken case must not hide the others
            results[name] = {"ok": False, "detail": traceback.format_exc(limit=4)}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
