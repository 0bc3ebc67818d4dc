"""Run a function on N local processes joined in a torch.distributed process group, and collect the results.

``run(fn, world_size, *args)`` starts ``world_size`` processes (``torch.multiprocessing``, start method
"spawn", so it works from a notebook and on every OS), joins them in a gloo group on a free port of
127.0.0.1, calls ``fn(rank, world_size, *args)`` in each, and returns their results in rank order. ``fn`` must
be importable by the children (defined in a module, not in the notebook). An exception in any child is raised
in the caller with the child's traceback, and the other children are stopped.

The same functions run under ``torchrun`` (``python -m attention_core.distributed.demo``). With
``backend="nccl"`` each child first calls ``torch.cuda.set_device(rank)`` (one GPU per process); ``fn`` must
still put its tensors on ``cuda`` itself. The tests check, with the CUDA calls recorded instead of made, that
each child selects its GPU before it joins the group; the path has not been run on GPUs.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, backend: str, results: Any, args: tuple) -> None:
    try:
        torch.set_num_threads(1)  # one core each: N processes share the machine's cores
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per process: "cuda" means cuda:rank in this child
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                 world_size=world_size, timeout=timedelta(seconds=120))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller, with its traceback
        results.put((rank, False, traceback.format_exc()))


def run(fn: Callable, world_size: int, *args: Any, backend: str = "gloo", timeout: float = 300.0) -> List[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each in its own process.

    Args:
        fn: a module-level function ``fn(rank, world_size, *args)``; its result must be picklable (tensors are).
        world_size: how many processes, at least 1.
        args: passed to every call (picklable).
        backend: ``"gloo"`` (CPUs) or ``"nccl"`` (one GPU per process, selected by ``set_device(rank)``;
            not run on GPUs by the tests).
        timeout: seconds to wait for all results.

    Raises:
        RuntimeError: a child raised (its traceback is in the message) or died, or the time ran out.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1; got {world_size!r}")
    if not callable(fn) or getattr(fn, "__module__", None) == "__main__" and "__file__" not in vars(
            __import__("__main__")):
        raise ValueError(f"fn must be a function the child processes can import (defined in a module, not in a "
                         f"notebook or an interactive session); got {fn!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # the children read it when torch starts
    try:
        procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, backend, results, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = old
    got: dict = {}
    waited = 0.0
    try:
        while len(got) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue_module.Empty:
                waited += 1.0
                dead = [r for r, p in enumerate(procs) if r not in got and not p.is_alive() and p.exitcode]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} of {world_size} died (exit code "
                                       f"{procs[dead[0]].exitcode}) without a result") from None
                if waited > timeout:
                    raise RuntimeError(f"run: no result from ranks {sorted(set(range(world_size)) - set(got))} "
                                       f"after {timeout:.0f} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} raised:\n{payload}")
            got[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) == world_size else 0.1)
            if p.is_alive():
                p.terminate()
                p.join()
    return [got[r] for r in range(world_size)]
