"""attention_core.distributed: ring and Ulysses attention against single-process attention.

Every world size 1..4 is one spawn of local gloo processes that runs many cases (processes take seconds to
start); the layouts, the causal masks between shards and the byte and tile formulas are also checked without
processes.
"""

from __future__ import annotations

import ast
import gc
import itertools
import subprocess
from pathlib import Path

import pytest
import torch

from attention_core.backends.chunked import merge_partials
from attention_core.distributed import (
    LAYOUTS,
    block_plan,
    checks,
    launch,
    local_lengths,
    positions,
    ring_attention,
    ring_bytes,
    ring_tiles,
    segments,
    shard,
    ulysses_attention,
    ulysses_bytes,
)
from attention_core.distributed.layout import unshard
from attention_core.distributed.measure import PeakTensorMemory, balance, tile_table

ROOT = Path(__file__).resolve().parent.parent
TOL = {"float64": 1e-10, "float32": 2e-5}


# ------------------------------------------------------------------------------------------ no processes


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("L", [0, 1, 5, 16, 17, 23])
def test_layouts_partition_the_sequence_like_tensor_split(layout, P, L) -> None:
    parts = [positions(L, P, r, layout) for r in range(P)]
    assert sorted(torch.cat(parts).tolist()) == list(range(L))  # every position once
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == local_lengths(L, P, layout)
    assert all(bool((p[1:] > p[:-1]).all()) for p in parts)  # sorted: local order is global order
    if layout == "contiguous":
        assert [p.tolist() for p in parts] == [t.tolist() for t in torch.tensor_split(torch.arange(L), P)]
    if layout == "striped":
        assert [p.tolist() for p in parts] == [list(range(r, L, P)) for r in range(P)]
    if layout == "zigzag" and L >= 2 * P:
        chunks = torch.tensor_split(torch.arange(L), 2 * P)
        assert [p.tolist() for p in parts] == [torch.cat([chunks[r], chunks[2 * P - 1 - r]]).tolist()
                                               for r in range(P)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("P", [2, 3, 4, 7])
@pytest.mark.parametrize("L", [7, 16, 29])
def test_block_plans_cover_exactly_the_causal_mask_from_global_positions(layout, P, L) -> None:
    """The kernel calls of a query shard against a key shard visit exactly the pairs q >= k, none twice."""
    for r, src in itertools.product(range(P), range(P)):
        qp, kp = positions(L, P, r, layout), positions(L, P, src, layout)
        want = qp[:, None] >= kp[None, :]
        got = torch.zeros_like(want, dtype=torch.long)
        for q0, q1, k0, k1, causal in block_plan(segments(L, P, r, layout), segments(L, P, src, layout), True):
            rows, cols = torch.arange(q0, q1)[:, None], torch.arange(k0, k1)[None, :]
            got[q0:q1, k0:k1] += (cols - k0 <= rows - q0) if causal else torch.ones(q1 - q0, k1 - k0,
                                                                                       dtype=torch.bool)
        assert torch.equal(got, want.long()), (layout, P, L, r, src)


def test_zigzag_and_striped_balance_the_causal_work_and_contiguous_does_not() -> None:
    table = tile_table(8192, range(2, 9), block=64)
    whole = sum(min(r + 1, 128) for r in range(128))  # one process: query tile r visits key tiles 0..r
    for P in range(2, 9):
        assert balance(table["contiguous"][P]) > 1.4
        assert balance(table["zigzag"][P]) < 1.01 and balance(table["striped"][P]) < 1.03
        if 8192 % (2 * P * 64) == 0:
            assert sum(table["zigzag"][P]) == whole  # no tile computed twice
    assert table["contiguous"][2] == [64 * 65 // 2, 64 * 64 + 64 * 65 // 2]  # its own triangle; plus a whole block


def test_merge_partials_is_attention_over_both_blocks_even_at_huge_scores() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.randn(3, 10, generator=g, dtype=torch.float64) * 600  # exp overflows float64 past ~709
    v = torch.randn(10, 4, generator=g, dtype=torch.float64)
    parts = [(torch.softmax(s[:, a:b], -1) @ v[a:b], torch.logsumexp(s[:, a:b], -1, keepdim=True))
             for a, b in ((0, 4), (4, 10))]
    out, lse = merge_partials(*parts[0], *parts[1])
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1, keepdim=True))
    empty = torch.full((3, 1), float("-inf"), dtype=torch.float64)
    out, lse = merge_partials(torch.zeros(3, 4, dtype=torch.float64), empty, *parts[0])
    torch.testing.assert_close(out, parts[0][0])
    out, lse = merge_partials(torch.zeros(3, 4, dtype=torch.float64), empty, torch.zeros(3, 4, dtype=torch.float64),
                              empty)
    assert out.abs().max() == 0 and bool(torch.isneginf(lse).all())


def test_refusals_without_a_process_group() -> None:
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="process group"):
        ring_attention(x, x, x)
    with pytest.raises(RuntimeError, match="process group"):
        shard(x, 2)
    for bad in ("zig-zag", "ring", None):
        with pytest.raises(ValueError, match="layout must be one of"):
            ring_attention(x, x, x, layout=bad)
        with pytest.raises(ValueError, match="layout must be one of"):
            ulysses_attention(x, x, x, layout=bad)
        with pytest.raises(ValueError, match="layout must be one of"):
            shard(x, 2, bad)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):  # refused before any message is sent
        ulysses_attention(x, x, x, backend="nope")
    with pytest.raises(ValueError, match="4-D"):
        ring_attention(x[0], x[0], x[0])
    with pytest.raises(ValueError, match="multiple of"):
        ring_attention(torch.randn(1, 3, 4, 8), x, x)


@pytest.mark.parametrize("fn", [ring_attention, ulysses_attention])
def test_bad_arguments_are_refused_before_any_message(fn) -> None:
    """Refused on each rank before the first collective (here there is no process group at all: a check that
    came later would raise the group's RuntimeError instead)."""
    who = fn.__name__
    x = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=rf"{who}: k must be on the device of q \(cpu\)"):
        fn(x, x.to("meta"), x)
    with pytest.raises(TypeError, match=rf"{who}: v must have the dtype of q"):
        fn(x, x, x.double())
    with pytest.raises(TypeError, match=rf"{who}: q must have a floating-point dtype"):
        fn(x.long(), x.long(), x.long())
    with pytest.raises(TypeError, match=rf"{who}: k must be a torch.Tensor, got list"):
        fn(x, [1.0], x)
    with pytest.raises(TypeError, match=rf"{who}: is_causal must be a bool, got int 1"):
        fn(x, x, x, is_causal=1)
    with pytest.raises(TypeError, match=rf"{who}: scale must be a finite float or None, got str"):
        fn(x, x, x, scale="0.3")
    with pytest.raises(ValueError, match=rf"{who}: scale must be a finite float or None, got nan"):
        fn(x, x, x, scale=float("nan"))
    if fn is ring_attention:
        with pytest.raises(ValueError, match=r"ring_attention: block_q must be an int >= 1 .*got 0"):
            fn(x, x, x, block_q=0)
        with pytest.raises(TypeError, match=r"ring_attention: block_k must be an int >= 1 .*got float 8.0"):
            fn(x, x, x, block_k=8.0)


def test_nccl_children_select_their_own_gpu(monkeypatch) -> None:
    """With backend="nccl" each child sets cuda:rank as its device before it joins the group (no GPU here: the
    calls are recorded, and the group's start is where the child stops)."""
    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(("set_device", d)))

    def init(backend, **kw):
        seen.append(("init", backend, kw["rank"]))
        raise RuntimeError("stop here")

    monkeypatch.setattr(launch.dist, "init_process_group", init)

    class Box(list):
        put = list.append

    for backend, rank in (("nccl", 2), ("gloo", 1)):
        seen.clear()
        box = Box()
        launch._child(print, rank, 3, 0, backend, box, ())
        assert box[0][:2] == (rank, False) and "stop here" in box[0][2]
        want = [("set_device", rank), ("init", "nccl", rank)] if backend == "nccl" else [("init", "gloo", rank)]
        assert seen == want, seen


def test_the_demo_with_nccl_selects_its_local_gpu_before_the_group(monkeypatch) -> None:
    """``demo --backend nccl`` under torchrun calls torch.cuda.set_device(LOCAL_RANK) before it joins the group,
    as launch.run's children do (no GPU here: the calls are recorded, and the group's start is where it stops)."""
    from attention_core.distributed import demo

    seen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(("set_device", d)))

    def init(backend, *args, **kw):
        seen.append(("init", backend))
        raise RuntimeError("stop here")

    monkeypatch.setattr(demo.dist, "init_process_group", init)
    for backend, local, want in (("nccl", "2", [("set_device", 2), ("init", "nccl")]),
                                 ("gloo", "1", [("init", "gloo")])):
        seen.clear()
        monkeypatch.setenv("LOCAL_RANK", local)
        with pytest.raises(RuntimeError, match="stop here"):
            demo.main(["--backend", backend])
        assert seen == want, seen


def test_the_timeline_legend_sits_above_rank_0s_bars() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from attention_core.booktools.distributed_views import plot_timeline

    events = [("comm", 0.0, 1.0), ("compute", 0.1, 0.9), ("wait", 0.9, 1.0)]
    fig = plot_timeline([{"events": events}] * 4)
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    assert legend.y0 >= ax.get_window_extent().y1 - 1  # outside the axes, above them: over no bar
    assert legend.y1 <= ax.title.get_window_extent().y0 + 1  # and under the title
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_peak_tensor_memory_counts_new_tensors_until_they_die() -> None:
    a = torch.zeros(1000)
    with PeakTensorMemory() as m:
        b = torch.ones(1000, dtype=torch.float64)  # 8000 bytes
        c = b[:10]  # a view: nothing new
        a.add_(1)  # in place on an older tensor: nothing new
        del b
        d = torch.ones(500)  # 2000 bytes, while the storage of b is still held by c
        del c
        e = torch.ones(2000)  # 8000 bytes, after b's storage died
        assert not gc.isenabled()  # the cycle collector waits: when it would run differs from run to run
    assert m.peak == max(8000 + 2000, 2000 + 8000) and m.current == 2000 + 8000
    assert m.at_peak == [8000, 2000]  # the storages alive at the (first) peak, largest first
    del d, e
    assert gc.isenabled()  # the cycle collector, paused inside the block, runs again after it


# ---------------------------------------------------------------------------------------------- spawns


def _cases(P: int) -> list:
    """Many cases for one world size, run in one spawn."""
    cases = []
    ragged, even = 6 * P + 1, 4 * P  # 2P does not divide the first
    for layout, causal, dtype in itertools.product(LAYOUTS, (False, True), ("float64", "float32")):
        cases.append(dict(kind="ring", layout=layout, is_causal=causal, dtype=dtype, L=ragged, Hq=4, H=2,
                          block=4, seed=len(cases)))
        if dtype == "float64":
            cases.append(dict(kind="ulysses", layout=layout, is_causal=causal, dtype=dtype, L=ragged, Hq=2 * P,
                              H=P, seed=len(cases)))
    cases += [
        dict(kind="ring", layout="zigzag", is_causal=True, L=even, Hq=2, H=2, B=2, E=16, Ev=8, block=3),
        dict(kind="ring", layout="striped", is_causal=True, L=even, Hq=2, H=1, B=1, block=2, count_kernel=True),
        dict(kind="ring", layout="zigzag", is_causal=True, L=ragged, Hq=2, H=1, B=1, block=2, count_kernel=True),
        dict(kind="ring", layout="contiguous", is_causal=False, L=ragged, S=2 * P + 3, Hq=2, H=2),  # L != S
        dict(kind="ring", layout="striped", is_causal=True, L=ragged, S=3 * P + 2, Hq=2, H=2, block=2),
        dict(kind="ring", layout="zigzag", is_causal=True, L=ragged, Hq=2, H=2, magnitude=25.0, block=4),
        dict(kind="ring", layout="striped", is_causal=False, L=ragged, Hq=2, H=2, magnitude=25.0, block=4),
        dict(kind="ring", layout="zigzag", is_causal=True, L=even, Hq=4, H=2, scale=0.3, block=4),
        dict(kind="ulysses", layout="zigzag", is_causal=True, L=even, Hq=P, H=P, Ev=4, scale=0.3),
        dict(kind="ulysses", layout="striped", is_causal=True, L=ragged, Hq=2 * P, H=P, backend="chunked",
             count_kernel=True),
    ]
    if P == 2:
        cases.append(dict(kind="ring", layout="zigzag", is_causal=True, L=64, Hq=4, H=2, E=16, dtype="bfloat16",
                          block=8))
    if P > 1:
        cases += [dict(error="mismatch_dim"), dict(error="mismatch_length"), dict(error="unshard_mismatch"),
                  dict(error="too_many_dims")]
    if P == 3:
        cases.append(dict(error="ulysses_heads"))
    cases += [dict(kind="shard", layout=lay, L=L) for lay in LAYOUTS for L in (2 * P + 3, 4 * P)]
    return cases


@pytest.fixture(scope="module")
def spawned():
    """One spawn of 4 processes runs every world size 1..4, each in the subgroup of ranks 0..P-1."""
    plan = {P: _cases(P) for P in (1, 2, 3, 4)}
    results = launch.run(checks.compare_in_subgroups, 4, plan)
    return {P: (P, plan[P], [results[r][P] for r in range(P)]) for P in plan}


@pytest.fixture(params=[1, 2, 3, 4])
def world(request, spawned):
    return spawned[request.param]


def test_ring_and_ulysses_equal_single_process_attention_forward_and_backward(world) -> None:
    P, cases, results = world
    n = 0
    for i, case in enumerate(cases):
        if "error" in case or case.get("kind") == "shard":
            continue
        row = results[0][i]
        dtype = case.get("dtype", "float64")
        if dtype == "bfloat16":  # as SDPA's own tolerance: no further from float64 than torch's bf16 SDPA
            assert row["error64"] <= 2 * row["sdpa_error64"] + 1e-3, (case, row)
        elif "magnitude" in case:  # saturated softmax: dq and dk are ~1e-12 and pure rounding; out and dv are not
            assert max(row["errors"][0], row["errors"][3]) < TOL[dtype], (case, row["errors"])
        else:
            assert max(row["errors"]) < TOL[dtype], (case, row["errors"])
        n += 1
    assert n >= 15


def test_bytes_sent_equal_the_formulas(world) -> None:
    P, cases, results = world
    for i, case in enumerate(cases):
        if "error" in case or case.get("kind") == "shard":
            continue
        L, S = case["L"], case.get("S", case["L"])
        B, Hq, H, E = case.get("B", 1), case.get("Hq", 2), case.get("H", 2), case.get("E", 8)
        Ev = case.get("Ev", E)
        item = {"float64": 8, "float32": 4, "bfloat16": 2}[case.get("dtype", "float64")]
        lay = case["layout"]
        if case["kind"] == "ring":
            lengths = local_lengths(S, P, lay)
            fwd = ring_bytes(lengths, B, H, E, Ev, item)
            both = ring_bytes(lengths, B, H, E, Ev, item, backward=True, acc_itemsize=max(item, 4))
        else:
            lengths = local_lengths(L, P, lay)
            fwd = ulysses_bytes(lengths, B, Hq, H, E, Ev, item)
            both = ulysses_bytes(lengths, B, Hq, H, E, Ev, item, backward=True)
        assert [r[i]["fwd_bytes"] for r in results] == fwd, case
        assert [r[i]["bytes"] for r in results] == both, case
        if case["kind"] == "ring" and P > 1 and len(set(lengths)) == 1:
            assert fwd == [(P - 1) * lengths[0] * B * H * (E + Ev) * item] * P  # the closed form


def test_tiles_counted_are_the_kernels_tiles(world) -> None:
    P, cases, results = world
    for i, case in enumerate(cases):
        if case.get("count_kernel") and case["kind"] == "ulysses":  # backend="chunked": its local call is that kernel
            assert all(r[i]["kernel_tiles"] > 0 for r in results), case
        elif case.get("count_kernel"):
            tiles = ring_tiles(case["L"], P, case["layout"], case["is_causal"], case["block"], case["block"])
            assert [r[i]["tiles"] for r in results] == tiles
            assert [r[i]["kernel_tiles"] for r in results] == tiles, case


def test_shard_and_unshard_give_the_whole_tensor_back(world) -> None:
    P, cases, results = world
    for i, case in enumerate(cases):
        if case.get("kind") == "shard":
            assert all(r[i]["roundtrip"] for r in results), case
            assert [r[i]["length"] for r in results] == local_lengths(case["L"], P, case["layout"])
            x = torch.randn(2, case["L"], 3, generator=torch.Generator().manual_seed(0))
            for r in range(P):
                assert torch.equal(results[r][i]["part"], x[:, positions(case["L"], P, r, case["layout"])])


def test_clear_errors_across_ranks(world) -> None:
    P, cases, results = world
    for i, case in enumerate(cases):
        what = case.get("error")
        if what is None:
            continue
        for r in range(P):
            kind, msg = results[r][i]
            assert kind == "ValueError", (what, kind, msg)
            if what == "mismatch_dim":
                assert "differ across ranks" in msg and "rank" in msg
            if what == "mismatch_length":
                assert "not the 'contiguous' split" in msg
            if what == "ulysses_heads":
                assert "divisible by the world size 3" in msg and "(4)" in msg
            if what == "too_many_dims":  # one all-gather brought every rank's shapes: all refuse alike
                assert f"got 17 dims on rank {P - 1}" in msg


def test_the_ring_forward_holds_at_most_two_key_value_blocks() -> None:
    """Besides its inputs, a rank holds the block it computes with and the one arriving, never a third: the
    previous block's views are dropped before the next receive buffer is made (they were not: 3 on every rank)."""
    case = dict(L=96 * 3, Hq=4, H=4, E=16, dtype="float32", is_causal=True, layout="zigzag")
    assert launch.run(checks.forward_block_buffers, 3, case) == [2, 2, 2]


def _leftovers(rank: int, world_size: int, n: int) -> dict:
    """How many of ``n`` calls of Ulysses' all-to-all and of ``gather_shapes`` left a buffer alive after they
    returned (the all-to-all's send and receive buffers; every tensor gather_shapes made)."""
    import weakref

    from attention_core.distributed import ulysses
    from attention_core.distributed.layout import gather_shapes
    from attention_core.distributed.measure import PeakTensorMemory

    late = {"all_to_all": 0, "gather_shapes": 0}
    for _ in range(n):
        send = torch.randn(world_size * 257)
        dead = []
        weakref.finalize(send, dead.append, "send")
        recv = ulysses._all_to_all(send, [257] * world_size, [257] * world_size, None, None)
        weakref.finalize(recv, dead.append, "recv")
        del send, recv
        late["all_to_all"] += len(dead) < 2
    x = torch.zeros(2, 3)
    for _ in range(n // 5):  # each measurement starts with a full collection (half a second)
        with PeakTensorMemory() as mem:  # it counts the tensors made inside and drops each when it dies
            gather_shapes([x])
        late["gather_shapes"] += mem.current != 0
    return late


def test_peak_tensor_memory_counts_a_first_block_like_the_next() -> None:
    """The first operation a dispatch mode sees in a process imports torch._dynamo, whose import-time cycles held
    the running frames' tensors: a process's first measured block counted 0.2 MiB more (ch. 16's one process)."""
    code = (
        "import torch\n"
        "from attention_core.backends.chunked import chunked_attention\n"
        "from attention_core.distributed.measure import PeakTensorMemory\n"
        "q, k, v = (torch.randn(1, 4, 512, 32, requires_grad=True) for _ in range(3))\n"
        "peaks = []\n"
        "for _ in range(3):\n"
        "    for t in (q, k, v):\n"
        "        t.grad = None\n"
        "    with PeakTensorMemory() as m:\n"
        "        chunked_attention(q, k, v, is_causal=True).sum().backward()\n"
        "    peaks.append(m.peak)\n"
        "print(peaks)\n"
    )
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout
    peaks = ast.literal_eval(out)
    assert peaks[0] == peaks[1] == peaks[2], peaks


def test_collectives_let_go_of_their_buffers_when_they_return() -> None:
    """A rank's memory must not depend on thread timing: gloo's all_to_all_single and all_gather kept their
    buffers on a worker thread after wait() and dropped them there later (1 call in 6 here), so a rank's peak
    changed from run to run. Point-to-point requests are let go of by the calling thread: no call may leave one."""
    assert launch.run(_leftovers, 3, 60) == [{"all_to_all": 0, "gather_shapes": 0}] * 3


def test_a_child_error_comes_back_with_its_traceback() -> None:
    with pytest.raises(RuntimeError, match=r"rank 0 of 1 raised:\n(.|\n)*KeyError: 'no such case'"):
        launch.run(checks.compare_with_sdpa, 1, [dict(error="no such case")])
    with pytest.raises(ValueError, match="world_size"):
        launch.run(checks.compare_with_sdpa, 0, [])


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "torchrun").exists(), reason="torchrun not installed")
def test_torchrun_runs_the_demo() -> None:
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "torchrun"), "--nproc-per-node", "2", "-m",
                          "attention_core.distributed.demo", "--length", "96", "--causal", "--dtype", "float64",
                          "--head-dim", "8"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.splitlines() if line.startswith(("ring ", "ulysses "))]
    assert len(lines) == 4
    assert all(float(line[-1]) < 1e-10 for line in lines)
    ring = [int(x[2]) for x in lines if x[0] == "ring"]
    assert ring == ring_bytes([48, 48], 1, 4, 8, 8, 8, backward=True)


@pytest.mark.parametrize("dim", [0, -1])
def test_a_0d_tensor_is_refused_naming_the_argument(dim) -> None:
    """A 0-d tensor has no dim to split: ValueError naming it (it was a ZeroDivisionError), before any group."""
    for fn, name in ((shard, "x"), (unshard, "x_local")):
        with pytest.raises(ValueError, match=rf"^{name} must have at least 1 dim"):
            fn(torch.tensor(1.0), dim)


def test_shard_dim_errors_name_dim() -> None:
    x = torch.ones(3, 4)
    with pytest.raises(ValueError, match=r"^dim must index a dim of x \(shape \(3, 4\)\), in \[-2, 1\], got 2$"):
        shard(x, 2)
    for bad in (1.5, True, None):
        with pytest.raises(TypeError, match=r"^dim must be an int, got "):
            shard(x, bad)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_a_rank_outside_the_world_is_refused_by_name(layout) -> None:
    from attention_core.distributed.layout import positions

    for rank in (-1, 2, 5):
        with pytest.raises(ValueError, match=r"rank must be an int in \[0, world_size\) = \[0, 2\)"):
            positions(8, 2, rank, layout)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        positions(8, 0, 0, layout)
    with pytest.raises(ValueError, match="L must be an int >= 0"):
        positions(-1, 2, 0, layout)


def _m(name: str):
    import importlib
    return importlib.import_module("attention_core." + name)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: _m("distributed.checks").make_inputs("bad"), TypeError, r"case must be a dict, got str"),
    (lambda: _m("distributed.checks").peak_memory(0, 1, [1]), TypeError, r"case must be a dict, got list"),
    (lambda: _m("distributed.checks").forward_block_buffers(0, 1, -3), TypeError, r"case must be a dict, got int"),
    (lambda: _m("distributed.checks").compare_with_sdpa(0, 1, "bad"), TypeError, r"cases must be a list of dicts"),
])
def test_distributed_check_helpers_refuse_bad_arguments_by_name(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.parametrize("args, error, pattern", [
    ((-3, 5, False), ValueError, r"n must be an int >= 0 \(query rows\), got -3"),
    ((5, -3, False), ValueError, r"m must be an int >= 0 \(keys\), got -3"),
    ((64.5, 64, False), TypeError, r"n must be an int >= 0 \(query rows\), got float 64.5"),
    ((64, 64, "yes"), TypeError, r"causal must be a bool, got str 'yes'"),
    ((64, 64, False, 0), ValueError, r"block_q must be an int >= 1, got 0"),
    ((64, 64, False, 16, [1]), TypeError, r"block_k must be an int >= 1, got list"),
])
def test_kernel_tiles_refuses_bad_arguments(args, error, pattern):
    from attention_core.distributed.ring import kernel_tiles
    with pytest.raises(error, match=pattern):
        kernel_tiles(*args)
    assert kernel_tiles(0, 5, False) == 0 and kernel_tiles(64, 64, True, 16, 16) == 10  # valid calls unchanged


@pytest.mark.parametrize("tensors, pattern", [
    ("bad", r"tensors must be a non-empty list of torch.Tensor, got str 'bad'"),
    (-3, r"tensors must be a non-empty list of torch.Tensor, got int -3"),
    ([], r"tensors must be a non-empty list of torch.Tensor, got list \[\]"),
    ([[1.0, 2.0]], r"tensors\[0\] must be a torch.Tensor, got list"),
])
def test_gather_shapes_refuses_what_is_not_a_list_of_tensors(tensors, pattern):
    from attention_core.distributed.layout import gather_shapes
    with pytest.raises(TypeError, match=pattern):
        gather_shapes(tensors)  # refused before any collective (no process group here)
