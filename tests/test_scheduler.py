"""Static and continuous batching in model steps, the KV-memory accounting, and the real-model engine agreeing
with both the simulator (steps) and plain greedy decoding (tokens)."""

from __future__ import annotations

import pytest
import torch

from attention_core.models.language_model import build_language_model, generate
from attention_core.serving.engine import serve
from attention_core.serving.scheduler import (
    Request,
    continuous_batching,
    kv_memory_usage,
    random_trace,
    static_batching,
)

TRACE = [Request(0, 0, 3, 5), Request(1, 0, 2, 1), Request(2, 1, 4, 2), Request(3, 2, 1, 4)]


def test_static_by_hand() -> None:
    res = static_batching(TRACE, 2)
    # group (0, 1): steps 0-4 (the longest writes 5); group (2, 3): starts at 5, writes 4 -> ends at 9
    assert res.finish == {0: 5, 1: 5, 2: 9, 3: 9} and res.steps == 9


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
    assert use["pow2"] == pytest.approx(30 / (4 * 16))
    assert use["oracle"] == pytest.approx(30 / (4 * 9))
    assert use["paged"] == pytest.approx(30 / (8 + 8 + 8 + 12))


@pytest.mark.parametrize("policy,simulate", [("static", static_batching), ("continuous", continuous_batching)])
def test_real_engine_matches_greedy_and_the_simulator(policy, simulate) -> None:
    model = build_language_model({"vocab_size": 17, "d_model": 32, "num_layers": 2, "num_heads": 4,
                                  "num_kv_heads": 2, "dim_feedforward": 64, "context": 64, "seed": 3}).eval()
    with torch.no_grad():  # sharper logits, so that greedy texts differ from request to request
        model.lm_head.weight.mul_(8)
    reqs = random_trace(7, seed=2, arrival_rate=0.5, prompt_mean=6, output_mean=6, max_len=40)
    g = torch.Generator().manual_seed(0)
    prompts = {r.rid: torch.randint(0, 17, (r.prompt_len,), generator=g) for r in reqs}
    out, steps, _ = serve(model, reqs, prompts, max_batch=3, policy=policy, num_blocks=64, block_size=4)
    assert steps == simulate(reqs, 3).steps
    for r in reqs:
        ref = generate(model, prompts[r.rid][None], r.output_len, temperature=0.0)[0, r.prompt_len :]
        assert out[r.rid] == ref.tolist(), f"request {r.rid}"
