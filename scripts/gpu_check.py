"""The GPU check: everything the book has that needs a GPU, in one run of at most 8 minutes on an H100/H200.

What it does, in this order, each phase with its own time cap (the budget below; a phase that runs out
stops, and the JSON lists what it did not get to):

  (a) ``pytest -m gpu`` over the test files that carry the ``gpu`` marker (a 60 s limit per test where
      pytest-timeout is installed);
  (b) every chapter, ``book/*.ipynb``, executed top to bottom by nbclient on this machine (the chapter's own
      device choice: ``session.setup`` returns the GPU), four at a time in their own processes; outputs are
      not compared, an error fails, each chapter's wall time is recorded (a chapter whose import is missing
      on this machine is recorded as ``missing-module``, not as a failure of the book);
  (c) the attention benchmark (``benchmarks/bench_attention.py``'s providers and timing, ``do_bench``
      medians): ``triton`` and ``cuda`` (forward only; its backward is the reference's) against torch SDPA,
      each point saying which Triton forward kernel ran (``triton_forward_kernel``: ``tma``, the tensor-
      descriptor kernel of ``triton_flash_tma`` on sm_90, or ``pointer``), and at the forward points of
      L = 16384 that ran ``tma`` the pointer kernel timed too (``triton-pointer``),
      fwd and fwd+bwd, float16 and bfloat16, D = 64 and 128, L = 1k ... 16k, causal and not, B = 4, H = 8,
      the issue's point first (fwd+bwd, L = 16384, fp16, D = 128, causal); the CUDA kernels' level 1
      (float32) at L = 4096; then the Triton flex kernel against torch's compiled FlexAttention
      (sliding window and causal block masks) and the Triton paged kernel against the gather path (decode);
  (d) ``benchmarks/results/gpu_<device>_<date>.json`` (copied to ``$OUT`` when that is set) and a summary
      of one screen.

Budget (seconds, wall clock; the whole run stops by 480):

  ====================  =====  ==================================================================
  phase                 cap    what fills it
  ====================  =====  ==================================================================
  setup                 ~10    imports, device query
  (a) gpu tests          110   ~60 tests; nvcc builds the CUDA extension once (~40 s), Triton compiles
  (b) chapters           150   16 notebooks, 4 at a time, each limited to 120 s
  (c) attention bench    140   80 shapes x {triton, torch, cuda}, most important first
  (c) flex + paged        50   2 masks x 2 lengths (torch.compile of FlexAttention ~10-20 s each), decode
  (d) report              ~5
  reserve                 ~15
  ====================  =====  ==================================================================

Without CUDA it prints one line and exits 0 (``--plan`` prints the phases and the shapes it would run).

How to run it on a lent GPU machine (one ``run`` call; that machine has no network, and its own ``python3``
holds a CUDA build of torch and Triton, which this check uses: ``requirements.txt`` pins the CPU build of
this workplace and is *not* installed there). The few packages the chapters need and that machine lacks
travel as wheels. Once, here (a machine with a package registry)::

    python scripts/gpu_check.py --fetch-wheels        # pip download into .whl/ (ignored by git), ~20 MB

then, as the ``run`` command, with ``carry: [".whl"]``::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; \
      PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py

(``make gpu-check`` is the same last command on a machine where the CUDA torch is the venv's.) On another
CUDA machine with network access: ``pip install nbclient nbformat ipykernel ipywidgets matplotlib pytest``
next to a CUDA torch (``pip install torch --index-url https://download.pytorch.org/whl/cu126``, say), then
``python scripts/gpu_check.py``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import itertools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

TOTAL_S = 480.0  # 8 minutes, everything included
CAPS = {"tests": 110.0, "chapters": 150.0, "attention": 140.0, "flex_paged": 50.0}
RESERVE_S = 15.0  # for the report, whatever the phases did
CHAPTER_TIMEOUT_S = 120  # one notebook, start to end
CHAPTER_WORKERS = 4
TEST_TIMEOUT_S = 60  # one test (pytest-timeout)

# (c): the grid. The issue's point first, then the rest in an order that spreads the coverage: if the phase runs
# out, what was measured still spans both dtypes, both head dims and both modes.
LENGTHS = [16384, 4096, 1024, 8192, 2048]
B, H = 4, 8
ISSUE_POINT = ("fwd+bwd", "float16", 128, True, 16384)
PROVIDERS = ["torch", "triton", "cuda"]

# Packages the chapters and tests need that the lent H200's image lacks (KINDS.md lists what it holds): carried
# as wheels. Pure-Python ones unless noted; versions are read from this machine's environment at fetch time.
WHEELS = ["nbclient", "nbformat", "jupyter_client", "jupyter_core", "ipykernel", "ipython", "comm", "traitlets",
          "tornado", "pyzmq", "debugpy", "nest_asyncio", "fastjsonschema", "jsonschema", "jsonschema-specifications",
          "referencing", "rpds-py", "matplotlib-inline", "ipywidgets", "widgetsnbextension", "jupyterlab_widgets",
          "decorator", "jedi", "parso", "pexpect", "ptyprocess", "prompt_toolkit", "wcwidth", "stack_data",
          "executing", "asttokens", "pure_eval", "ipython_pygments_lexers", "platformdirs"]


class Clock:
    """Wall time since the start, and how much a phase may still spend."""

    def __init__(self, total: float = TOTAL_S):
        self.t0, self.total = time.perf_counter(), total

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.total - RESERVE_S - self.now()

    def cap(self, phase: str) -> float:
        """Seconds phase ``phase`` may run: its cap, or what is left of the whole, whichever is less."""
        return max(0.0, min(CAPS[phase], self.left()))


# ---------------------------------------------------------------------------------------------- (a) tests


def gpu_test_files() -> List[str]:
    """The test files that use the ``gpu`` marker (collecting only them keeps imports the lent machine lacks
    out of the run)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")
                  if "mark.gpu" in p.read_text())


def run_tests(cap: float) -> dict:
    files = gpu_test_files()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rfE", *files]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += [f"--timeout={TEST_TIMEOUT_S}"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(cap, 1.0))
        out, rc, timed_out = proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        rc, timed_out = None, True
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped|deselected)", out)}
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return {"files": files, "command": " ".join(cmd[1:]), "seconds": round(time.perf_counter() - t0, 1),
            "returncode": rc, "timed_out": timed_out, "counts": counts, "failed": failed,
            "ok": rc == 0 and not timed_out, "tail": out[-3000:],
            "skipped_by_budget": "the rest of the run (cap reached)" if timed_out else None}


# ------------------------------------------------------------------------------------------- (b) chapters


def chapters() -> List[Path]:
    return sorted((ROOT / "book").glob("*.ipynb"))


def execute_one(path: Path, timeout: int) -> dict:
    """Run one notebook (in this process) and return {status, seconds, error}; the file is not written."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    status, error = "ok", ""
    try:
        client.execute()
    except CellTimeoutError as err:
        status, error = "timeout", str(err).splitlines()[0][:300]
    except CellExecutionError as err:
        text = str(err)
        missing = re.search(r"ModuleNotFoundError: No module named '([^']+)'", text)
        status = "missing-module" if missing else "error"
        error = f"no module {missing.group(1)}" if missing else text.strip().splitlines()[-1][:300]
    return {"status": status, "seconds": round(time.perf_counter() - t0, 1), "error": error}


def run_chapters(cap: float, clock: Clock) -> dict:
    """Every chapter in its own process, ``CHAPTER_WORKERS`` at a time, none started past the cap."""
    missing = [m for m in ("nbformat", "nbclient", "ipykernel") if importlib.util.find_spec(m) is None]
    if missing:  # say why in the report rather than fail 16 times
        return {"chapters": {}, "skipped_by_budget": [p.name for p in chapters()], "seconds": 0.0, "ok": False,
                "not_run": f"missing {', '.join(missing)} (carry them as wheels: scripts/gpu_check.py --fetch-wheels)"}
    sys.path.insert(0, str(ROOT))
    from conftest import NOTEBOOK_ENV  # the environment of the canonical run (threads, hash seed, backend)

    env = {**os.environ, **{k: v for k, v in NOTEBOOK_ENV.items() if k not in os.environ}}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = clock.now()
    todo, running, results = list(chapters()), {}, {}
    while todo or running:
        spent = clock.now() - start
        while todo and len(running) < CHAPTER_WORKERS and spent < cap - 10:
            path = todo.pop(0)
            timeout = int(max(10, min(CHAPTER_TIMEOUT_S, cap - spent)))
            proc = subprocess.Popen([sys.executable, __file__, "--one-notebook", str(path), "--timeout",
                                     str(timeout)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            running[path] = (proc, clock.now(), timeout)
        for path, (proc, t0, timeout) in list(running.items()):
            if proc.poll() is None:
                if clock.now() - t0 > timeout + 20 or clock.now() - start > cap + 20:
                    proc.kill()
                    results[path.name] = {"status": "timeout", "seconds": round(clock.now() - t0, 1),
                                          "error": "killed at the phase's cap"}
                    del running[path]
                continue
            out, err = proc.communicate()
            line = out.strip().splitlines()[-1] if out.strip() else ""
            try:
                results[path.name] = json.loads(line)
            except json.JSONDecodeError:
                results[path.name] = {"status": "error", "seconds": round(clock.now() - t0, 1),
                                      "error": (err.strip().splitlines() or ["no output"])[-1][:300]}
            del running[path]
        if todo and clock.now() - start >= cap - 10 and not running:
            break
        time.sleep(0.2)
    skipped = [p.name for p in todo]
    return {"chapters": results, "skipped_by_budget": skipped, "workers": CHAPTER_WORKERS,
            "seconds": round(clock.now() - start, 1),
            "ok": all(r["status"] in ("ok", "missing-module") for r in results.values()) and not skipped}


# ------------------------------------------------------------------------------------------ (c) benchmarks


def attention_grid() -> List[tuple]:
    """(mode, dtype, E, causal, L), the issue's point first; see LENGTHS for the order's reason."""
    grid = [ISSUE_POINT]
    for L, mode, dtype, E, causal in itertools.product(LENGTHS, ("fwd", "fwd+bwd"), ("float16", "bfloat16"),
                                                       (128, 64), (True, False)):
        if (mode, dtype, E, causal, L) not in grid:
            grid.append((mode, dtype, E, causal, L))
    return grid


def _bench_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    import bench_attention

    return bench_attention


def _time(call: Callable[[], object]) -> float:
    """Median ms of ``do_bench`` (CUDA events, L2 flushed), shorter than bench_attention's to fit the budget."""
    import torch
    from triton.testing import do_bench

    call()
    torch.cuda.synchronize()
    return float(do_bench(call, warmup=10, rep=40, return_mode="median"))


def triton_forward_kernel(dtype: str, E: int, causal: bool, L: int, device: str = "cuda") -> str:
    """Which forward kernel ``triton_flash`` runs at this point: ``"tma"`` (``triton_flash_tma``, sm_90 and the
    shapes ``use_tma`` covers) or ``"pointer"`` (``_attn_fwd``); ``"unknown: ..."`` if that cannot be told."""
    import torch

    try:
        from attention_core.backends import triton_flash, triton_flash_tma

        q, k, v = (torch.empty(B, H, L, E, dtype=getattr(torch, dtype), device=device) for _ in range(3))
        routed = triton_flash_tma.use_tma(q, k, v, *triton_flash.window_bounds(L, L, causal, None))
        return "tma" if routed else "pointer"
    except Exception as err:  # noqa: BLE001  (no Triton here, say: the timing still stands)
        return f"unknown: {type(err).__name__}: {str(err)[:100]}"


def _time_pointer_kernel(ba, c) -> float:
    """The forward with the TMA route switched off (``triton_flash_tma.ENABLED``): the pointer kernel's time."""
    from attention_core.backends import triton_flash_tma

    saved = triton_flash_tma.ENABLED
    triton_flash_tma.ENABLED = False
    try:
        return _time(ba.make_call(c, "cuda"))
    finally:
        triton_flash_tma.ENABLED = saved


def run_attention(cap: float) -> dict:
    import torch

    from attention_core.backends import triton_flash_tma

    triton_flash_tma.ENABLED = True  # off by default until this check has run it: time it (and the pointer kernel)
    ba = _bench_module()
    t0, points, skipped = time.perf_counter(), [], []
    grid = attention_grid()
    for i, (mode, dtype, E, causal, L) in enumerate(grid):
        if time.perf_counter() - t0 > cap:
            skipped = [dict(zip(("mode", "dtype", "E", "causal", "L"), g)) for g in grid[i:]]
            break
        point = {"mode": mode, "dtype": dtype, "E": E, "causal": causal, "L": L, "B": B, "H": H, "ms": {},
                 "notes": {}}
        for provider in PROVIDERS:
            if provider == "cuda" and mode == "fwd+bwd":
                continue  # its backward is the eager reference's
            c = ba.Config(provider, mode, B, H, L, E, dtype, causal)
            try:
                point["ms"][provider] = _time(ba.make_call(c, "cuda"))
            except Exception as err:  # noqa: BLE001  (unsupported shape, OOM, a compile error: recorded)
                point["notes"][provider] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
                torch.cuda.empty_cache()
        # which Triton forward ran (both directions start with it): "tma" on sm_90 at the shapes it covers
        point["triton_forward_kernel"] = triton_forward_kernel(dtype, E, causal, L)
        if point["triton_forward_kernel"] == "tma" and mode == "fwd" and L == max(LENGTHS) and "triton" in point["ms"]:
            try:  # the pointer kernel at the same point, for the comparison of the two kernels
                point["ms"]["triton-pointer"] = _time_pointer_kernel(ba, ba.Config("triton", mode, B, H, L, E, dtype,
                                                                                   causal))
            except Exception as err:  # noqa: BLE001
                point["notes"]["triton-pointer"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        fl = ba.flops(ba.Config("torch", mode, B, H, L, E, dtype, causal))
        point["tflops"] = {p: fl / (ms * 1e-3) / 1e12 for p, ms in point["ms"].items()}
        if "torch" in point["ms"]:
            point["speed_vs_torch"] = {p: point["ms"]["torch"] / ms for p, ms in point["ms"].items() if p != "torch"}
        points.append(point)
    level1 = []
    for causal in (False, True):  # the CUDA kernels' level 1 (fp32 CUDA cores), one shape, if time is left
        if time.perf_counter() - t0 > cap:
            skipped.append({"cuda level 1": f"float32 L=4096 causal={causal}"})
            continue
        c = ba.Config("cuda", "fwd", B, H, 4096, 64, "float32", causal)
        try:
            level1.append({"causal": causal, "L": 4096, "E": 64, "dtype": "float32",
                           "ms": {"cuda": _time(ba.make_call(c, "cuda")),
                                  "torch": _time(ba.make_call(ba.Config("torch", "fwd", B, H, 4096, 64,
                                                                        "float32", causal), "cuda"))}})
        except Exception as err:  # noqa: BLE001
            level1.append({"causal": causal, "note": f"{type(err).__name__}: {str(err)[:200]}"})
    return {"points": points, "cuda_level1": level1, "skipped_by_budget": skipped,
            "seconds": round(time.perf_counter() - t0, 1), "timing": "triton.testing.do_bench median, warmup 10 ms, "
            "rep 40 ms, after one untimed call (compile, autotune)", "B": B, "H": H}


def run_flex_paged(cap: float) -> dict:
    """Triton flex vs torch's compiled FlexAttention (fwd, fp16, E = 64), Triton paged vs gather (decode)."""
    import torch
    import torch.nn.attention.flex_attention as tfa

    import attention_core.mask_mods as mm
    from attention_core.backends.triton_flex import GPU_TILES
    from attention_core.flex_attention import create_block_mask, flex_attention
    from attention_core.paged_attention import paged_attention

    t0, flex, paged, skipped = time.perf_counter(), [], [], []
    dt = torch.float16
    compiled = torch.compile(tfa.flex_attention)
    for L, (name, mod) in itertools.product((4096, 16384), (("sliding_window_256", mm.sliding_window(256)),
                                                            ("causal", mm.causal))):
        if time.perf_counter() - t0 > cap:
            skipped.append(f"flex {name} L={L}")
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, L, 64, device="cuda", dtype=dt, generator=g) for _ in range(3))
        row = {"mask": name, "L": L, "E": 64, "dtype": "float16", "mode": "fwd", "ms": {}, "notes": {}}
        try:
            bm = create_block_mask(mod, None, None, L, L, device="cuda", BLOCK_SIZE=GPU_TILES[dt])
            row["ms"]["triton_flex"] = _time(lambda q=q, k=k, v=v, bm=bm: flex_attention(q, k, v, block_mask=bm,
                                                                                          backend="triton"))
        except Exception as err:  # noqa: BLE001
            row["notes"]["triton_flex"] = f"{type(err).__name__}: {str(err)[:200]}"
        try:
            tbm = tfa.create_block_mask(mod, None, None, L, L, device="cuda")
            row["ms"]["torch_flex"] = _time(lambda q=q, k=k, v=v, tbm=tbm: compiled(q, k, v, block_mask=tbm))
        except Exception as err:  # noqa: BLE001
            row["notes"]["torch_flex"] = f"{type(err).__name__}: {str(err)[:200]}"
        if len(row["ms"]) == 2:
            row["triton_speed_vs_torch_flex"] = row["ms"]["torch_flex"] / row["ms"]["triton_flex"]
        flex.append(row)
    for seq in (4096, 16384):  # decode: one new token per sequence, 32 query heads over 8 kv-heads (GQA)
        if time.perf_counter() - t0 > cap:
            skipped.append(f"paged seq_len={seq}")
            continue
        g = torch.Generator(device="cuda").manual_seed(1)
        Bp, Hq, Hk, E, bs = 16, 32, 8, 128, 16
        per_seq = seq // bs
        n_blocks = Bp * per_seq
        kc, vc = (torch.randn(n_blocks, Hk, bs, E, device="cuda", dtype=dt, generator=g) for _ in range(2))
        table = torch.randperm(n_blocks, device="cuda", generator=g).view(Bp, per_seq)
        lens = torch.full((Bp,), seq, device="cuda")
        q = torch.randn(Bp, Hq, 1, E, device="cuda", dtype=dt, generator=g)
        row = {"B": Bp, "Hq": Hq, "H": Hk, "E": E, "block_size": bs, "seq_len": seq, "dtype": "float16", "ms": {},
               "notes": {}}
        for path in ("triton", "gather"):
            try:
                row["ms"][path] = _time(lambda path=path, q=q, kc=kc, vc=vc, table=table, lens=lens:
                                        paged_attention(q, kc, vc, table, lens, path=path))
            except Exception as err:  # noqa: BLE001
                row["notes"][path] = f"{type(err).__name__}: {str(err)[:200]}"
        if len(row["ms"]) == 2:
            row["triton_speed_vs_gather"] = row["ms"]["gather"] / row["ms"]["triton"]
        paged.append(row)
    return {"flex": flex, "paged": paged, "skipped_by_budget": skipped, "seconds": round(time.perf_counter() - t0, 1)}


# ---------------------------------------------------------------------------------------------- (d) report


def device_info() -> dict:
    import torch

    info = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    for mod in ("triton",):
        spec = importlib.util.find_spec(mod)
        info[mod] = __import__(mod).__version__ if spec else None
    info["nvcc"] = shutil.which("nvcc")
    return info


def summary(report: dict) -> List[str]:
    lines = [f"gpu-check {report['device']['device']} (sm_{''.join(map(str, report['device']['capability']))}), "
             f"torch {report['device']['torch']}, triton {report['device'].get('triton')}, {report['date']}, "
             f"{report['seconds']:.0f} s of {TOTAL_S:.0f}"]
    t = report.get("tests")
    if t:
        lines.append(f"(a) gpu tests: {t['counts']} in {t['seconds']} s{' TIMED OUT' if t['timed_out'] else ''}"
                     + (f"; failed: {', '.join(t['failed'][:5])}" if t["failed"] else ""))
    c = report.get("chapters")
    if c:
        bad = {n: r for n, r in c["chapters"].items() if r["status"] != "ok"}
        times = " ".join(f"{n[:2]}:{r['seconds']:.0f}" for n, r in sorted(c["chapters"].items()))
        lines.append(f"(b) chapters: {len(c['chapters']) - len(bad)}/{len(c['chapters'])} ok in {c['seconds']} s"
                     f"; seconds {times}")
        lines += [f"    {n}: {r['status']}: {r['error'][:110]}" for n, r in bad.items()]
        if c.get("not_run"):
            lines.append(f"    chapters not run: {c['not_run']}")
        elif c["skipped_by_budget"]:
            lines.append(f"    not run (budget): {', '.join(c['skipped_by_budget'])}")
    a = report.get("attention")
    if a:
        lines.append(f"(c) attention, B={a['B']} H={a['H']}: {len(a['points'])} shapes in {a['seconds']} s "
                     f"({len(a['skipped_by_budget'])} not run); speed vs torch SDPA (torch ms / ms):")
        lines.append(f"    {'mode':7s} {'dtype':8s} {'E':>3s} {'causal':6s} {'L':>5s} {'torch ms':>9s} "
                     f"{'triton':>7s} {'kernel':>7s} {'ptr':>5s} {'cuda':>7s}")
        for p in a["points"]:
            if p["L"] in (4096, 16384) and p["E"] == 128 or p is a["points"][0]:
                r = p.get("speed_vs_torch", {})
                lines.append(f"    {p['mode']:7s} {p['dtype']:8s} {p['E']:3d} {p['causal']!s:6s} {p['L']:5d} "
                             f"{p['ms'].get('torch', float('nan')):9.2f} {r.get('triton', float('nan')):7.2f} "
                             f"{p.get('triton_forward_kernel', '?')[:7]:>7s} "
                             f"{r.get('triton-pointer', float('nan')):5.2f} {r.get('cuda', float('nan')):7.2f}")
        lines.append("    (kernel: the Triton forward that ran, tma or pointer; ptr: the pointer kernel's speed at "
                     "fwd points that ran tma, L = 16384)")
        for row in a["cuda_level1"]:
            if "ms" in row:
                lines.append(f"    cuda level 1 fp32 L=4096 causal={row['causal']}: {row['ms']['cuda']:.2f} ms, "
                             f"torch {row['ms']['torch']:.2f} ms")
    fp = report.get("flex_paged")
    if fp:
        for r in fp["flex"]:
            lines.append(f"    flex {r['mask']:18s} L={r['L']:5d}: " + " ".join(f"{k} {v:.2f} ms" for k, v in
                                                                             r["ms"].items())
                         + (f" (triton {r['triton_speed_vs_torch_flex']:.2f}x)" if "triton_speed_vs_torch_flex"
                            in r else "") + (f" {r['notes']}" if r["notes"] else ""))
        for r in fp["paged"]:
            lines.append(f"    paged decode seq={r['seq_len']:5d}: " + " ".join(f"{k} {v:.3f} ms" for k, v in
                                                                           r["ms"].items())
                         + (f" (triton {r['triton_speed_vs_gather']:.2f}x)" if "triton_speed_vs_gather" in r else "")
                         + (f" {r['notes']}" if r["notes"] else ""))
    for phase in report["not_run"]:
        lines.append(f"not run: {phase}")
    lines.append(f"wrote {report['path']}")
    return lines


# --------------------------------------------------------------------------------------------------- main


def plan() -> List[str]:
    """What a run would do, without running it (no GPU needed)."""
    grid = attention_grid()
    return [f"budget {TOTAL_S:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in CAPS.items())
            + f", reserve {RESERVE_S:.0f} s",
            f"(a) pytest -m gpu over {len(gpu_test_files())} files: {' '.join(gpu_test_files())}",
            f"(b) {len(chapters())} chapters, {CHAPTER_WORKERS} at a time, {CHAPTER_TIMEOUT_S} s each at most",
            f"(c) {len(grid)} attention shapes x {PROVIDERS}, first {grid[0]}; flex 4, paged 2"]


def fetch_wheels() -> int:
    """Download the wheels the lent GPU machine lacks (Python 3.12, manylinux x86-64) into .whl/."""
    from importlib.metadata import PackageNotFoundError, version

    dest = ROOT / ".whl"
    dest.mkdir(exist_ok=True)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["--platform=manylinux2014_x86_64"]
    for name in WHEELS:
        try:
            spec = f"{name}=={version(name)}"
        except PackageNotFoundError:
            spec = name
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), spec]
        if subprocess.run(cmd).returncode != 0:
            print(f"could not download {spec}", file=sys.stderr)
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"{len(list(dest.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {dest}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="print the phases and shapes; run nothing")
    parser.add_argument("--fetch-wheels", action="store_true", help="download the wheels the GPU machine lacks")
    parser.add_argument("--phases", nargs="+", default=["tests", "chapters", "attention", "flex_paged"],
                        choices=["tests", "chapters", "attention", "flex_paged"])
    parser.add_argument("--one-notebook", type=Path, help=argparse.SUPPRESS)  # internal: (b)'s worker
    parser.add_argument("--timeout", type=int, default=CHAPTER_TIMEOUT_S, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one_notebook:
        print(json.dumps(execute_one(args.one_notebook, args.timeout)))
        return 0
    if args.fetch_wheels:
        return fetch_wheels()
    if args.plan:
        print("\n".join(plan()))
        return 0

    try:
        import torch
        cuda = torch.cuda.is_available()
        why = f"torch {torch.__version__}, torch.version.cuda = {torch.version.cuda}"
    except ImportError:
        cuda, why = False, "torch is not installed"
    if not cuda:
        print(f"gpu-check: no CUDA device here ({why}); nothing run (see scripts/gpu_check.py for the GPU machine)")
        return 0

    clock = Clock()
    report: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "device": device_info(), "budget_s": {"total": TOTAL_S, **CAPS, "reserve": RESERVE_S},
                    "command": "python scripts/gpu_check.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "not_run": []}
    runners = {"tests": lambda cap: run_tests(cap), "chapters": lambda cap: run_chapters(cap, clock),
               "attention": run_attention, "flex_paged": run_flex_paged}
    for phase in ["tests", "chapters", "attention", "flex_paged"]:
        if phase not in args.phases:
            continue
        cap = clock.cap(phase)
        if cap < 5:
            report["not_run"].append(f"{phase} (no time left)")
            continue
        print(f"[{clock.now():5.0f} s] {phase} (cap {cap:.0f} s)", flush=True)
        try:
            report[phase] = runners[phase](cap)
        except Exception as err:  # noqa: BLE001  (one phase's crash must not lose the others' results)
            report[phase] = {"crashed": f"{type(err).__name__}: {err}"[:500]}
            report["not_run"].append(f"{phase} crashed: {type(err).__name__}: {str(err)[:200]}")
    report["seconds"] = round(clock.now(), 1)

    slug = re.sub(r"[^a-z0-9]+", "_", report["device"]["device"].lower()).strip("_")
    path = RESULTS / f"gpu_{slug}_{report['date'][:10]}.json"
    report["path"] = str(path.relative_to(ROOT))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    if os.environ.get("OUT"):
        shutil.copy(path, Path(os.environ["OUT"]) / path.name)
    print("\n".join(summary({k: v for k, v in report.items() if not (isinstance(v, dict) and "crashed" in v)})))
    ok = all(report.get(p, {}).get("ok", True) for p in ("tests", "chapters"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
