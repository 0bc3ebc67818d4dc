"""Static and continuous batching of a request trace, counted in model steps, and KV-memory accounting.

The step model: in one model step the engine runs the prompt of every request it admits in that step (prefill,
which also yields the request's first output token) together with one decode token for every request already
running. A request with ``output_len`` tokens to write is therefore busy for ``output_len`` steps.

- :func:`static_batching`: requests are taken in arrival order in groups of at most ``max_batch``, and a group
  runs until its longest member finishes (finished rows idle; every member leaves when the group does). With
  ``start="idle"`` (the default) a group starts as soon as the engine is idle and a request is waiting, with
  every waiting request up to ``max_batch`` (the request-level baselines of Kwon et al., 2023, §6.1, take "up
  to B number of earliest arrived requests", B the batch size); with ``start="full"`` it waits until ``max_batch``
  requests (or the last ones of the trace) have arrived.
- :func:`continuous_batching` (Orca's iteration-level scheduling, Yu et al., 2022): at every step, finished
  requests leave and waiting ones join, up to ``max_batch`` running.

Counts of steps do not depend on the machine, which is why the chapter compares the two this way first.
:func:`kv_memory_usage` replays a schedule and measures, at every step, the share of reserved KV slots that
hold a token under four reservation policies (the policies of Kwon et al., 2023, §6.1 and Fig. 2, without their
allocator: no external fragmentation is counted).

Every step counts as one model call whatever it holds (prompts included), for every policy alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from attention_core._checks import check_fits, check_int, check_real, short_repr

__all__ = ["Request", "STATIC_STARTS", "ScheduleResult", "check_requests", "check_schedule", "check_start",
           "check_steps", "continuous_batching", "kv_memory_usage", "random_trace", "static_batching", "static_groups",
           "step_bound"]


@dataclass(frozen=True)
class Request:
    """A request: id, the step it arrives at, its prompt length and the number of tokens it will write (>= 1)."""

    rid: int
    arrival: int
    prompt_len: int
    output_len: int


@dataclass
class ScheduleResult:
    """What a schedule did: per request its first step and the step after its last token; and per step the
    running requests (id -> tokens it has written by the end of that step)."""

    start: Dict[int, int] = field(default_factory=dict)
    finish: Dict[int, int] = field(default_factory=dict)
    running: List[Dict[int, int]] = field(default_factory=list)

    @property
    def steps(self) -> int:
        """Steps from the first step to the last one (the makespan)."""
        return max(self.finish.values(), default=0)

    def mean_latency(self, requests: Sequence[Request]) -> float:
        """Mean of ``finish - arrival`` in steps."""
        return sum(self.finish[r.rid] - r.arrival for r in requests) / max(len(requests), 1)

    def throughput(self, requests: Sequence[Request]) -> float:
        """Output tokens per step."""
        return sum(r.output_len for r in requests) / max(self.steps, 1)


def check_requests(requests: Sequence[Request]) -> Dict[int, Request]:
    """``{rid: request}`` after checking a trace: a list of :class:`Request` with int fields (a bool or a float
    is refused), distinct ids, ``arrival >= 0``, ``prompt_len >= 1`` and ``output_len >= 1``."""
    if isinstance(requests, (str, bytes, dict)) or not isinstance(requests, Sequence):
        raise TypeError(f"requests must be a list of Request, got {type(requests).__name__}")
    by_id: Dict[int, Request] = {}
    for i, r in enumerate(requests):
        if not isinstance(r, Request):
            raise TypeError(f"requests[{i}] must be a Request, got {type(r).__name__} {short_repr(r)}")
        check_int(r.rid, f"requests[{i}].rid")
        check_int(r.arrival, f"requests[{i}].arrival", low=0)
        check_int(r.prompt_len, f"requests[{i}].prompt_len", low=1)
        check_int(r.output_len, f"requests[{i}].output_len", low=1)
        if r.rid in by_id:
            raise ValueError(f"requests[{i}].rid = {r.rid} repeats an earlier request's id")
        by_id[r.rid] = r
    return by_id


def check_schedule(requests: Sequence[Request], max_batch: int) -> Dict[int, Request]:
    """The checks every scheduler (and the engine) runs first: the requests, ``max_batch``, the step bound."""
    by_id = check_requests(requests)
    check_int(max_batch, "max_batch", low=1)
    check_steps(requests)
    return by_id


def check_steps(requests: Sequence[Request]) -> int:
    """The step bound of a (checked) trace; raises ``TooLargeError`` when a
    schedule that long (one record per step) could not be held in memory, before any step runs."""
    bound = step_bound(requests)
    shown = min(bound, 2**63)  # a 400-digit bound must not overflow the message's float
    check_fits(shown * _BYTES_PER_STEP, f"requests whose arrivals and output_len need up to {shown} steps",
               "cpu")
    return bound


#: Bytes a schedule keeps per step (its ``running`` record), at the least.
_BYTES_PER_STEP = 64


def _check_requests(requests: object) -> None:
    """``TypeError`` unless ``requests`` is a list or tuple of :class:`Request` (a trace's kind only: its values
    are checked by the schedules)."""
    if not isinstance(requests, (list, tuple)) or not all(isinstance(r, Request) for r in requests):
        raise TypeError(f"requests must be a list or tuple of Request, got {short_repr(requests)}")


def step_bound(requests: Sequence[Request]) -> int:
    """Steps that always suffice: wait for the last arrival, then run every request alone, one after another."""
    _check_requests(requests)
    return max((r.arrival for r in requests), default=0) + sum(r.output_len for r in requests) + len(requests) + 1


STATIC_STARTS = ("idle", "full")


def check_start(start: object) -> str:
    """``start`` of static batching: ``"idle"`` or ``"full"`` (a ``ValueError`` naming it otherwise)."""
    if not isinstance(start, str) or start not in STATIC_STARTS:
        raise ValueError(f"start must be one of {STATIC_STARTS} (when a static group starts), got {short_repr(start)}")
    return start


def static_groups(requests: Sequence[Request], max_batch: int, start: str = "idle") -> List[tuple]:
    """``[(begin, group), ...]``: the groups static batching runs, in order, and the step each starts at (on a
    checked trace; see :func:`static_batching`)."""
    _check_requests(requests)
    check_int(max_batch, "max_batch", low=1)
    check_start(start)
    order = sorted(requests, key=lambda r: (r.arrival, r.rid))
    groups, clock, i = [], 0, 0
    while i < len(order):
        if start == "full":
            group = order[i : i + max_batch]
            begin = max(clock, max(r.arrival for r in group))
        else:  # idle: the engine takes every request waiting when it is free (or the next one to arrive)
            begin = max(clock, order[i].arrival)
            group = [r for r in order[i : i + max_batch] if r.arrival <= begin]
        i += len(group)
        groups.append((begin, group))
        clock = begin + max(r.output_len for r in group)
    return groups


def static_batching(requests: Sequence[Request], max_batch: int, start: str = "idle") -> ScheduleResult:
    """Groups of at most ``max_batch`` in arrival order, each run to its longest member's end; a group starts
    when the engine is idle with whatever is waiting (``start="idle"``) or once ``max_batch`` requests have
    arrived (``start="full"``). See the module doc."""
    check_schedule(requests, max_batch)
    check_start(start)
    res = ScheduleResult()
    for begin, group in static_groups(requests, max_batch, start):
        length = max(r.output_len for r in group)
        while len(res.running) < begin + length:
            res.running.append({})
        for r in group:
            res.start[r.rid] = begin
            res.finish[r.rid] = begin + length  # results come back when the whole group is done
            for s in range(length):
                res.running[begin + s][r.rid] = min(s + 1, r.output_len)
    return res


def continuous_batching(requests: Sequence[Request], max_batch: int,
                        max_tokens: Optional[int] = None) -> ScheduleResult:
    """Admit and retire at every step, at most ``max_batch`` running (and, if given, at most ``max_tokens``
    prompt + written tokens held at once, a KV-memory budget checked at admission for the request's full length).
    """
    by_id = check_schedule(requests, max_batch)
    if max_tokens is not None:
        check_int(max_tokens, "max_tokens", low=1)
    waiting = sorted(requests, key=lambda r: (r.arrival, r.rid))
    written: Dict[int, int] = {}
    res, step, bound = ScheduleResult(), 0, step_bound(requests)
    while waiting or written:
        if step > bound:
            raise RuntimeError(f"continuous_batching made no progress after {step} steps (bound {bound}); a bug")
        budget = sum(by_id[i].prompt_len + by_id[i].output_len for i in written)
        while waiting and waiting[0].arrival <= step and len(written) < max_batch:
            r = waiting[0]
            if max_tokens is not None and written and budget + r.prompt_len + r.output_len > max_tokens:
                break
            waiting.pop(0)
            written[r.rid] = 0
            res.start[r.rid] = step
            budget += r.prompt_len + r.output_len
        for i in written:
            written[i] += 1
        res.running.append(dict(written))
        step += 1
        for i in [i for i, n in written.items() if n == by_id[i].output_len]:
            res.finish[i] = step
            del written[i]
    return res


def random_trace(n: int, seed: int = 0, arrival_rate: float = 1.0, prompt_mean: float = 64.0,
                 output_mean: float = 64.0, sigma: float = 1.0, max_len: int = 2048) -> List[Request]:
    """``n`` requests with Poisson arrivals (``arrival_rate`` per step) and skewed (log-normal) prompt and output
    lengths of the given means, each total clipped to ``max_len`` (an int >= 2)."""
    check_int(n, "n", low=0)
    check_fits(n * 64, f"a trace of n = {n} requests", "cpu")
    check_int(seed, "seed", low=0, high=2**64 - 1)
    check_real(arrival_rate, "arrival_rate", low=0.0, low_open=True)
    check_real(prompt_mean, "prompt_mean", low=0.0, low_open=True)
    check_real(output_mean, "output_mean", low=0.0, low_open=True)
    check_real(sigma, "sigma", low=0.0)
    check_int(max_len, "max_len", low=2)
    g = torch.Generator().manual_seed(seed)
    gaps = -torch.log(torch.rand(n, generator=g, dtype=torch.float64)) / arrival_rate
    arrivals = torch.cumsum(gaps, 0).floor().long().tolist()
    mu_shift = -0.5 * sigma**2  # log-normal with mean exp(mu + sigma^2 / 2)

    def lengths(mean: float) -> List[int]:
        z = torch.randn(n, generator=g, dtype=torch.float64)
        return torch.exp(math.log(mean) + mu_shift + sigma * z).ceil().long().clamp(1, max_len - 1).tolist()

    prompts, outputs = lengths(prompt_mean), lengths(output_mean)
    return [Request(i, arrivals[i], prompts[i], max(1, min(outputs[i], max_len - prompts[i])))
            for i in range(n)]


def kv_memory_usage(requests: Sequence[Request], schedule: ScheduleResult, max_len: int,
                    block_size: int = 16) -> Dict[str, float]:
    """Share of reserved KV slots that hold a token, summed over all steps of ``schedule``, per policy:

    - ``"max"``: every running request reserves ``max_len`` slots (the model's maximum length);
    - ``"pow2"``: it reserves its prompt plus its output length rounded up to a power of two (Kwon et al.'s
      Orca (Pow2): "if the true output length is 25, it reserves 32 positions for outputs"), at most ``max_len``;
    - ``"oracle"``: it reserves exactly its final length (prompt + output known in advance);
    - ``"paged"``: it holds ``block_size``-token blocks for the tokens it has so far (PagedAttention).

    Tokens held by a request at a step: its prompt plus the tokens written by the end of the step.
    """
    by_id = check_requests(requests)
    if not isinstance(schedule, ScheduleResult):
        raise TypeError(f"schedule must be a ScheduleResult, got {type(schedule).__name__}")
    check_int(max_len, "max_len", low=1)
    check_int(block_size, "block_size", low=1)
    longest = max((r.prompt_len + r.output_len for r in by_id.values()), default=0)
    if longest > max_len:
        raise ValueError(f"max_len = {max_len} is shorter than a request's final length {longest}")
    unknown = {rid for running in schedule.running for rid in running} - set(by_id)
    if unknown:
        raise ValueError(f"schedule runs requests {sorted(unknown)[:10]} that requests does not list")
    used = 0
    reserved = {"max": 0, "pow2": 0, "oracle": 0, "paged": 0}
    for running in schedule.running:
        for rid, n in running.items():
            r = by_id[rid]
            tokens, final = r.prompt_len + n, r.prompt_len + r.output_len
            used += tokens
            reserved["max"] += max_len
            reserved["pow2"] += min(max_len, r.prompt_len + (1 << (r.output_len - 1).bit_length()))
            reserved["oracle"] += final
            reserved["paged"] += -(-tokens // block_size) * block_size
    return {k: used / v for k, v in reserved.items()}
