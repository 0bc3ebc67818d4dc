"""Static and continuous batching in model steps, the KV-memory accounting, and the real-model engine agreeing
with both the simulator (steps) and plain greedy decoding (tokens)."""

from __future__ import annotations

import pytest
import torch

from attention_core._checks import TooLargeError
from attention_core.models.language_model import build_language_model, generate
from attention_core.serving.engine import serve
from attention_core.serving.scheduler import (
    Request,
    continuous_batching,
    kv_memory_usage,
    random_trace,
    static_batching,
    static_groups,
)

TRACE = [Request(0, 0, 3, 5), Request(1, 0, 2, 1), Request(2, 1, 4, 2), Request(3, 2, 1, 4)]


def test_static_by_hand() -> None:
    res = static_batching(TRACE, 2)
    # group (0, 1): steps 0-4 (the longest writes 5); group (2, 3): starts at 5, writes 4 -> ends at 9
    assert res.finish == {0: 5, 1: 5, 2: 9, 3: 9} and res.steps == 9


def test_static_idle_starts_with_whatever_is_waiting() -> None:
    """Issue 38: an idle static batcher starts with the requests waiting, as the paper's baselines do (it does
    not wait for max_batch of them); start="full" keeps the old, waiting behaviour."""
    trace = [Request(0, 0, 1, 3), Request(1, 5, 1, 2), Request(2, 6, 1, 1)]
    idle = static_batching(trace, 2)  # (0) at 0-2; idle at 3, (1) arrives at 5: alone at 5-6; (2) at 7
    assert idle.start == {0: 0, 1: 5, 2: 7} and idle.finish == {0: 3, 1: 7, 2: 8}
    assert static_batching(trace, 2, start="idle").finish == idle.finish
    full = static_batching(trace, 2, start="full")  # (0, 1) waits for 1 (arrives at 5); (2) after it
    assert full.start == {0: 5, 1: 5, 2: 8} and full.finish == {0: 8, 1: 8, 2: 9}
    for start in ("idle", "full"):
        assert static_groups(trace, 2, start) == [(res.start[g[0].rid], g) for res in [static_batching(trace, 2, start)]
                                                  for g in _groups(res, trace)]
    with pytest.raises(ValueError, match="start"):
        static_batching(trace, 2, start="eager")
    prompts = {r.rid: torch.tensor([1 + r.rid]) for r in trace}  # the engine starts its groups the same way
    for start, steps in (("idle", 8), ("full", 9)):
        out, engine_steps, _ = serve(_tiny_model(), trace, prompts, max_batch=2, policy="static", start=start)
        assert engine_steps == steps and {i: len(t) for i, t in out.items()} == {0: 3, 1: 2, 2: 1}


def _groups(res, trace):
    by_start: dict = {}
    for r in sorted(trace, key=lambda r: (r.arrival, r.rid)):
        by_start.setdefault(res.start[r.rid], []).append(r)
    return [by_start[s] for s in sorted(by_start)]


def test_continuous_by_hand() -> None:
    res = continuous_batching(TRACE, 2)
    # step 0: 0, 1 join; 1 leaves after it. step 1: 2 joins, writes 2 -> leaves after step 2.
    # step 3: 3 joins (arrived at 2), writes 4 -> done after step 6. Request 0 ends after step 4.
    assert res.start == {0: 0, 1: 0, 2: 1, 3: 3}
    assert res.finish == {0: 5, 1: 1, 2: 3, 3: 7} and res.steps == 7
    assert all(len(r) <= 2 for r in res.running)


def test_every_request_writes_its_tokens_and_batches_stay_bounded() -> None:
    reqs = random_trace(200, seed=1, arrival_rate=0.2, prompt_mean=20, output_mean=30, max_len=256)
    for res in (static_batching(reqs, 8), continuous_batching(reqs, 8)):
        assert all(len(r) <= 8 for r in res.running)
        last = {}
        for step in res.running:
            last.update(step)
        assert last == {r.rid: r.output_len for r in reqs}
    c, s = continuous_batching(reqs, 8), static_batching(reqs, 8)
    assert c.steps <= s.steps and c.mean_latency(reqs) < s.mean_latency(reqs)


def test_memory_accounting() -> None:
    reqs = [Request(0, 0, 5, 4)]  # holds 6, 7, 8, 9 tokens over its 4 steps: 30 token-steps
    use = kv_memory_usage(reqs, continuous_batching(reqs, 1), max_len=64, block_size=4)
    assert use["max"] == pytest.approx(30 / (4 * 64))
    assert use["pow2"] == pytest.approx(30 / (4 * (5 + 4)))  # Orca (Pow2): the prompt + the output rounded up
    assert use["oracle"] == pytest.approx(30 / (4 * 9))
    assert use["paged"] == pytest.approx(30 / (8 + 8 + 8 + 12))
    reqs = [Request(0, 0, 5, 5)]  # 6 .. 10 tokens: 40 token-steps; output 5 -> 8 reserved for it, not 16 in all
    assert kv_memory_usage(reqs, continuous_batching(reqs, 1), max_len=64)["pow2"] == pytest.approx(40 / (5 * 13))
    reqs = [Request(0, 0, 58, 5)]  # 58 + 8 = 66 > max_len: a reservation never passes the model's limit
    use = kv_memory_usage(reqs, continuous_batching(reqs, 1), max_len=64)
    assert use["pow2"] == pytest.approx(use["max"]) == pytest.approx((5 * 58 + 15) / (5 * 64))


@pytest.mark.parametrize("policy,start", [("static", "idle"), ("static", "full"), ("continuous", "idle")])
def test_real_engine_matches_greedy_and_the_simulator(policy, start) -> None:
    model = build_language_model({"vocab_size": 17, "d_model": 32, "num_layers": 2, "num_heads": 4,
                                  "num_kv_heads": 2, "dim_feedforward": 64, "context": 64, "seed": 3}).eval()
    with torch.no_grad():  # sharper logits, so that greedy texts differ from request to request
        model.lm_head.weight.mul_(8)
    reqs = random_trace(7, seed=2, arrival_rate=0.5, prompt_mean=6, output_mean=6, max_len=40)
    g = torch.Generator().manual_seed(0)
    prompts = {r.rid: torch.randint(0, 17, (r.prompt_len,), generator=g) for r in reqs}
    out, steps, _ = serve(model, reqs, prompts, max_batch=3, policy=policy, num_blocks=64, block_size=4, start=start)
    sim = static_batching(reqs, 3, start=start) if policy == "static" else continuous_batching(reqs, 3)
    assert steps == sim.steps
    for r in reqs:
        ref = generate(model, prompts[r.rid][None], r.output_len, temperature=0.0)[0, r.prompt_len :]
        assert out[r.rid] == ref.tolist(), f"request {r.rid}"


# ------------------------------------------------------------------------ issue 37: validation, termination


def within(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a daemon thread; a call still running after ``seconds`` fails the test (a
    hang fails instead of blocking the suite). Returns the result or re-raises the call's exception."""
    import threading

    box: dict = {}

    def run():
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as err:  # handed to the test's thread
            box["err"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {seconds} s (a loop that spins)"
    if "err" in box:
        raise box["err"]
    return box["out"]


def _tiny_model():
    return build_language_model({"vocab_size": 17, "d_model": 16, "num_layers": 1, "num_heads": 2,
                                 "max_positions": 32, "seed": 3})


BAD_SERVE = [
    (ValueError, "max_batch", dict(max_batch=0)), (TypeError, "max_batch", dict(max_batch=1.5)),
    (TypeError, "prompt_len", dict(requests=[Request(0, 0, 2.5, 2)])),
    (TypeError, "output_len", dict(requests=[Request(0, 0, 2, 1.5)])),
    (ValueError, "output_len", dict(requests=[Request(0, 0, 2, 0)])),
    (ValueError, "arrival", dict(requests=[Request(0, -1, 2, 1)])),
    (ValueError, "rid", dict(requests=[Request(0, 0, 2, 1), Request(0, 1, 2, 1)])),
    (TypeError, "requests", dict(requests=[(0, 0, 2, 1)])),
    (ValueError, "policy", dict(policy="fifo")), (ValueError, "start", dict(policy="static", start="full-ish")),
    (ValueError, "num_blocks", dict(num_blocks=0)), (TypeError, "block_size", dict(block_size=None)),
    (ValueError, "num_blocks", dict(num_blocks=1, block_size=1)),
    (ValueError, "prompts", dict(prompts={})),
    (ValueError, "prompts", dict(prompts={0: torch.tensor([1, 2, 17])})),
    (TypeError, "prompts", dict(prompts={0: torch.tensor([1.0, 2.0, 3.0])})),  # a dtype: TypeError
    (ValueError, "max_positions", dict(requests=[Request(0, 0, 3, 40)])),
    (TypeError, "model", dict(model=None)),
]


@pytest.mark.parametrize("error,words,change", BAD_SERVE, ids=[f"{w}-{i}" for i, (_, w, _) in enumerate(BAD_SERVE)])
def test_serve_refuses_bad_arguments_at_once(error, words, change) -> None:
    args = dict(model=_tiny_model(), requests=[Request(0, 0, 3, 2)], prompts={0: torch.tensor([1, 2, 3])},
                max_batch=2) | change
    with pytest.raises(error, match=words):
        within(30, serve, **args)


@pytest.mark.parametrize("simulate", [static_batching, continuous_batching])
def test_the_simulators_refuse_bad_traces_at_once(simulate) -> None:
    for error, words, change in BAD_SERVE[:8]:
        args = dict(requests=[Request(0, 0, 3, 2)], max_batch=2) | change
        with pytest.raises(error, match=words):
            within(10, simulate, **args)
    with pytest.raises(ValueError, match="max_tokens"):
        continuous_batching([Request(0, 0, 3, 2)], 1, max_tokens=0)


def test_serve_with_a_small_pool_waits_instead_of_running_out() -> None:
    """Continuous batching admits a request only when the pool can hold it to its end: with room for one
    request at a time it serializes them (and never raises OutOfBlocks half-way)."""
    model = _tiny_model()
    reqs = [Request(i, 0, 4, 5) for i in range(3)]
    prompts = {i: torch.tensor([1, 2, 3, i]) for i in range(3)}
    out, steps, _ = within(60, serve, model, reqs, prompts, max_batch=3, num_blocks=2, block_size=4)
    assert steps == 15 and all(len(out[i]) == 5 for i in range(3))
    for r in reqs:
        ref = generate(model.eval(), prompts[r.rid][None], r.output_len, temperature=0.0)[0, r.prompt_len :]
        assert out[r.rid] == ref.tolist()


def test_serve_gives_the_model_its_modes_back() -> None:
    model = _tiny_model().train()
    model.blocks[0].eval()  # mixed modes, given back as they were
    modes = [m.training for m in model.modules()]
    within(60, serve, model, [Request(0, 0, 3, 2)], {0: torch.tensor([1, 2, 3])}, max_batch=1)
    assert [m.training for m in model.modules()] == modes
    with pytest.raises(ValueError):
        serve(model, [Request(0, 0, 3, 2)], {0: torch.tensor([1, 2, 3])}, max_batch=1, num_blocks=1,
              block_size=1)
    assert [m.training for m in model.modules()] == modes


def test_random_trace_and_memory_accounting_refuse_bad_arguments() -> None:
    for kw, error in [("n", (ValueError, -1)), ("arrival_rate", (ValueError, 0.0)), ("sigma", (ValueError, -1.0)),
                      ("max_len", (ValueError, 1)), ("prompt_mean", (ValueError, float("nan"))),
                      ("n", (TypeError, 2.0)), ("seed", (TypeError, None))]:
        with pytest.raises(error[0], match=kw):
            random_trace(**({"n": 3} | {kw: error[1]}))
    with pytest.raises(TooLargeError, match="n"):
        random_trace(2**60)
    reqs = [Request(0, 0, 5, 4)]
    res = continuous_batching(reqs, 1)
    with pytest.raises(ValueError, match="max_len"):
        kv_memory_usage(reqs, res, max_len=4)
    with pytest.raises(TypeError, match="schedule"):
        kv_memory_usage(reqs, None, max_len=64)
    with pytest.raises(ValueError, match="schedule"):
        kv_memory_usage([Request(1, 0, 5, 4)], res, max_len=64)


@pytest.mark.parametrize("fields", [(0, 0, 1, 10**400), (0, 2**63, 1, 1), (0, 0, 1, 2**50)])
def test_traces_too_long_to_schedule_are_refused_before_any_step(fields) -> None:
    for fn, args in ((static_batching, ([Request(*fields)], 1)), (continuous_batching, ([Request(*fields)], 1)),
                     (serve, (_tiny_model(), [Request(*fields)], {0: torch.tensor([1])}, 1))):
        with pytest.raises(TooLargeError, match="steps"):
            within(20, fn, *args)


def _m(name: str):
    import importlib
    return importlib.import_module("attention_core." + name)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: _m("serving.scheduler").step_bound("bad"), TypeError,
     r"requests must be a list or tuple of Request, got 'bad'"),
    (lambda: _m("serving.scheduler").check_steps([[1.0, 2.0]]), TypeError,
     r"requests must be a list or tuple of Request"),
    (lambda: _m("serving.scheduler").static_groups([1], 2), TypeError, r"requests must be a list or tuple of Request"),
    (lambda: _m("serving.scheduler").static_groups([], 0), ValueError, r"max_batch must be an int >= 1, got 0"),
    (lambda: _m("serving.scheduler").static_groups([], 2, "busy"), ValueError, r"start must be one of"),
])
def test_scheduler_helpers_refuse_bad_arguments_by_name(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
