"""Speculative sampling: its output distribution is the target's (chi-square on 20,000+ samples, at a stated
significance), greedy speculative decoding equals greedy decoding, tokens per step follow Leviathan et al.'s eq. 1."""

from __future__ import annotations

import pytest
import torch

from attention_core.models.language_model import build_language_model, generate
from attention_core.serving.speculative import expected_tokens_per_step, speculative_generate, speculative_step

SIGNIFICANCE = 1e-3  # the test fails the sampler when p < 0.001 (a correct sampler fails one run in a thousand)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square test of ``counts`` against ``probs`` (dof = cells - 1)."""
    n = counts.sum()
    expected = probs.double() * n
    assert expected.min() >= 5, "cells too small for the chi-square approximation"
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(counts.numel() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))  # the chi-square survival function


def _markov(V: int, seed: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    law = torch.softmax(sharp * torch.randn(V, V, generator=g, dtype=torch.float64), -1)  # (V, V): row = prev
    return 0.7 * law + 0.3 / V  # every cell of the three-token law keeps >= (0.3 / V)^3 of the mass


def _speculative_markov(target: torch.Tensor, draft: torch.Tensor, first: int, K: int, gamma: int, N: int,
                        seed: int) -> torch.Tensor:
    """N independent speculative runs of two order-1 Markov models from token ``first``; the first K tokens."""
    g = torch.Generator().manual_seed(seed)
    V = target.shape[0]
    buf = torch.full((N, K + gamma + 1), -1, dtype=torch.long)
    count = torch.zeros(N, dtype=torch.long)
    last = torch.full((N,), first, dtype=torch.long)
    rows = torch.arange(N)
    while int(count.min()) < K:
        d_tokens, d_probs, prev = [], [], last
        for _ in range(gamma):
            q = draft[prev]  # (N, V)
            x = torch.multinomial(q, 1, generator=g)[:, 0]
            d_tokens.append(x), d_probs.append(q)
            prev = x
        ctx = torch.stack([last] + d_tokens, 1)  # (N, gamma + 1): the token before each target position
        p = target[ctx]  # (N, gamma + 1, V)
        tokens, n_out = speculative_step(p, torch.stack(d_probs, 1), torch.stack(d_tokens, 1), g)
        active = count < K
        for j in range(gamma + 1):
            put = active & (j < n_out)
            idx = (count + j).clamp(max=buf.shape[1] - 1)
            buf[rows[put], idx[put]] = tokens[put, j]
        last = torch.where(active, tokens[rows, n_out - 1], last)
        count = torch.where(active, count + n_out, count)
    assert V ** K < 10**6
    return buf[:, :K]


@pytest.mark.parametrize("gamma", [1, 3])
def test_output_distribution_is_the_targets(gamma: int) -> None:
    """Joint law of the first three tokens (64 cells, V = 4) over 40,000 runs vs the target chain's."""
    V, K, N = 4, 3, 40_000
    target, draft = _markov(V, 0, 1.0), _markov(V, 1, 1.5)
    out = _speculative_markov(target, draft, first=0, K=K, gamma=gamma, N=N, seed=gamma)
    cells = out[:, 0] * V * V + out[:, 1] * V + out[:, 2]
    counts = torch.bincount(cells, minlength=V**K)
    law = (target[0][:, None, None] * target[:, :, None] * target[None, :, :]).flatten()  # P(a) P(b|a) P(c|b)
    assert chi_square_p_value(counts, law) > SIGNIFICANCE


def test_the_test_rejects_a_wrong_sampler() -> None:
    """The same test on the draft's own law (what 'accept everything' produces) fails by far."""
    V, N = 4, 40_000
    target, draft = _markov(V, 0, 1.0), _markov(V, 1, 1.5)
    g = torch.Generator().manual_seed(0)
    a = torch.multinomial(draft[0], N, replacement=True, generator=g)
    b = torch.multinomial(draft[a], 1, generator=g)[:, 0]
    c = torch.multinomial(draft[b], 1, generator=g)[:, 0]
    counts = torch.bincount(a * 16 + b * 4 + c, minlength=64)
    law = (target[0][:, None, None] * target[:, :, None] * target[None, :, :]).flatten()
    assert chi_square_p_value(counts, law) < 1e-12


def test_tokens_per_step_follow_eq_1() -> None:
    """Context-free target and draft (same p, q at every position): acceptances are i.i.d., eq. 1 is exact."""
    g = torch.Generator().manual_seed(3)
    V, gamma, N = 6, 4, 50_000
    p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1)
    alpha = float(torch.minimum(p, q).sum())
    d_tokens = torch.multinomial(q, N * gamma, replacement=True, generator=g).view(N, gamma)
    _, n_out = speculative_step(p.expand(N, gamma + 1, V), q.expand(N, gamma, V), d_tokens, g)
    measured = n_out.double().mean().item()
    assert abs(measured / expected_tokens_per_step(alpha, gamma) - 1) < 0.01


def _tiny_models():
    cfg = {"vocab_size": 13, "d_model": 32, "num_heads": 4, "num_kv_heads": 4, "dim_feedforward": 64,
           "context": 96}
    target = build_language_model({**cfg, "num_layers": 2, "seed": 0}).eval()
    draft = build_language_model({**cfg, "num_layers": 1, "seed": 1}).eval()
    return target, draft


@pytest.fixture(scope="module")
def shipped():
    """Chapter 11's model and the one-layer draft, from their checkpoints."""
    from attention_core.shakespeare.data import load_corpus
    from attention_core.shakespeare.train import DRAFT_RECIPE, load_or_train_language_model

    target, _ = load_or_train_language_model()
    draft, _ = load_or_train_language_model(recipe=DRAFT_RECIPE)
    return target, draft, load_corpus().vocab


@pytest.mark.parametrize("gamma", [1, 2, 5])
def test_greedy_speculative_equals_greedy(shipped, gamma: int) -> None:
    target, draft, vocab = shipped
    prompt = vocab.encode("ROMEO:\nI will")[None]
    ref = generate(target, prompt, 60, temperature=0.0)
    assert len(set(ref[0, -60:].tolist())) >= 5  # a text, not one repeated character
    out, stats = speculative_generate(target, draft, prompt, 60, gamma=gamma, temperature=0.0)
    assert out.tolist() == ref.tolist()
    assert sum(stats.tokens_per_step) >= 60 and stats.target_calls == len(stats.tokens_per_step)
    assert 1 < stats.mean_tokens_per_step  # the draft is right often enough to save target calls


def test_speculative_with_itself_as_draft_accepts_everything() -> None:
    target, _ = _tiny_models()
    out, stats = speculative_generate(target, target, torch.tensor([[3]]), 30, gamma=3, temperature=1.0,
                                      generator=torch.Generator().manual_seed(0))
    assert set(stats.tokens_per_step[:-1]) == {4} and abs(stats.alpha - 1) < 1e-5
    assert out.shape == (1, 31)


def test_call_counts_are_the_model_calls_made() -> None:
    """``target_calls`` and ``draft_calls`` count every forward call after the prompt, including the draft's
    extra call after a step that kept every draft (a draft identical to the target keeps them all)."""
    import copy

    target, draft = _tiny_models()
    for d in (draft, copy.deepcopy(target)):
        seen = {"target": 0, "draft": 0}
        hooks = [m.register_forward_hook(lambda *_, k=k, s=seen: s.__setitem__(k, s[k] + 1))
                 for k, m in (("target", target), ("draft", d))]
        try:
            _, stats = speculative_generate(target, d, torch.tensor([[3]]), 30, gamma=3, temperature=1.0,
                                            generator=torch.Generator().manual_seed(0))
        finally:
            for h in hooks:
                h.remove()
        assert stats.target_calls == seen["target"] == len(stats.tokens_per_step)
        full = sum(n == 4 for n in stats.tokens_per_step)
        assert stats.draft_calls == seen["draft"] == 3 * len(stats.tokens_per_step) + full
    assert full >= 5  # the identical draft did take the extra-call branch


def test_real_model_first_token_distribution() -> None:
    """At a fixed prefix, 20,000 speculative first tokens of two real (untrained) models follow the target."""
    target, draft = _tiny_models()
    prefix = torch.tensor([[4, 4, 9]])
    with torch.no_grad():
        p = torch.softmax(target(prefix).logits[0, -1].double(), -1)
        q = torch.softmax(draft(prefix).logits[0, -1].double(), -1)
    N = 20_000
    g = torch.Generator().manual_seed(11)
    d = torch.multinomial(q, N, replacement=True, generator=g)[:, None]  # (N, 1)
    # with gamma = 1 the first token only needs the target's law at the prefix; the second slot is never read
    # for it, so any distribution may fill it
    tokens, _ = speculative_step(torch.stack([p, p])[None].expand(N, 2, -1), q[None, None].expand(N, 1, -1), d, g)
    counts = torch.bincount(tokens[:, 0], minlength=13)
    assert chi_square_p_value(counts, p) > SIGNIFICANCE


def test_draft_checkpoint_is_the_recipes(shipped, tmp_path) -> None:
    """The shipped draft: one layer, made by DRAFT_RECIPE (manifest entry, sha256 checked on load), < 2 MB; the
    command line trains that recipe when asked for it."""
    from dataclasses import asdict

    from attention_core.shakespeare.train import CHECKPOINT_DIR, DRAFT_RECIPE, main
    from attention_core.training.checkpoint import read_manifest

    _, draft, _ = shipped
    entry = read_manifest(CHECKPOINT_DIR)[DRAFT_RECIPE.name]
    assert entry["recipe"] == asdict(DRAFT_RECIPE) and draft.num_layers == 1
    assert (CHECKPOINT_DIR / entry["file"]).stat().st_size < 2_000_000
    main(["--recipe", "draft", "--steps", "3", "--out", str(tmp_path)])
    made = read_manifest(tmp_path)
    assert list(made) == [DRAFT_RECIPE.name] and made[DRAFT_RECIPE.name]["recipe"]["steps"] == 3
    assert made[DRAFT_RECIPE.name]["recipe"]["num_layers"] == 1


# ------------------------------------------------------------------------ issue 37: RNG, modes, validation


def _pair():
    cfg = {"vocab_size": 11, "d_model": 16, "num_layers": 1, "num_heads": 2, "max_positions": 40}
    return build_language_model(cfg | {"seed": 0}), build_language_model(cfg | {"seed": 1})


def test_greedy_speculative_decoding_leaves_the_global_rng_alone() -> None:
    target, draft = _pair()
    torch.manual_seed(1234)
    torch.rand(3)
    before = torch.get_rng_state()
    out, _ = speculative_generate(target, draft, torch.tensor([[1, 2, 3]]), 12, gamma=3, temperature=0.0)
    assert torch.equal(torch.get_rng_state(), before), "greedy speculative decoding drew from the global generator"
    assert out.tolist() == generate(target, torch.tensor([[1, 2, 3]]), 12, temperature=0.0).tolist()


def test_speculative_generate_gives_both_models_their_modes_back() -> None:
    target, draft = _pair()
    target.train()
    draft.train()
    draft.blocks[0].eval()
    modes = [m.training for m in target.modules()] + [m.training for m in draft.modules()]
    speculative_generate(target, draft, torch.tensor([[1, 2]]), 4, gamma=2, temperature=0.0)
    assert [m.training for m in target.modules()] + [m.training for m in draft.modules()] == modes
    with pytest.raises(ValueError, match="max_positions"):  # refused: the modes are untouched too
        speculative_generate(target, draft, torch.tensor([[1, 2]]), 50, gamma=2)
    assert [m.training for m in target.modules()] + [m.training for m in draft.modules()] == modes


@pytest.mark.parametrize("change,error,words", [
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens"), (dict(max_new_tokens=2.5), TypeError, "max_new_tokens"),
    (dict(gamma=0), ValueError, "gamma"), (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"), (dict(temperature=1e-320), ValueError, "temperature"),
    (dict(prompt=torch.tensor([[1, 11]])), ValueError, "prompt"), (dict(prompt=torch.tensor([1, 2])), ValueError,
                                                                    "prompt"),
    (dict(prompt=torch.tensor([[1.0, 2.0]])), ValueError, "prompt"), (dict(generator=3), TypeError, "generator"),
    (dict(draft=None), TypeError, "draft")])
def test_speculative_generate_refuses_bad_arguments(change, error, words) -> None:
    target, draft = _pair()
    args = dict(target=target, draft=draft, prompt=torch.tensor([[1, 2]]), max_new_tokens=4) | change
    with pytest.raises(error, match=words):
        speculative_generate(**args)


def test_speculative_step_refuses_bad_inputs() -> None:
    p = torch.full((1, 3, 4), 0.25)
    q = torch.full((1, 2, 4), 0.25)
    x = torch.zeros(1, 2, dtype=torch.long)
    cases = [((p, q, x + 4), ValueError, "draft_tokens"), ((p, q, x.int()), TypeError, "draft_tokens"),
             ((p * -1, q, x), ValueError, "target_probs"), ((p, q.double(), x), TypeError, "draft_probs"),
             ((p[:, :2], q, x), ValueError, "target_probs"), ((p, q, x, 1), TypeError, "generator")]
    for args, error, words in cases:
        with pytest.raises(error, match=words):
            speculative_step(*args)
    tokens, n = speculative_step(p[:0], q[:0], x[:0])
    assert tokens.shape == (0, 3) and n.shape == (0,)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_step(float("nan"), 2)
    with pytest.raises(TypeError, match="gamma"):
        expected_tokens_per_step(0.5, 1.5)


# ------------------------------------------------------------------------ issue 38: alpha over every generated token


def test_acceptance_rates_are_beta_at_every_generated_tokens_prefix() -> None:
    """Leviathan et al. (§4.2) measure alpha as the mean of sum min(p, q) over every generated token's prefix:
    entry i is beta at the prefix tokens[:P + i], computed here one prefix at a time."""
    from attention_core.serving.speculative import acceptance_rates, next_token_probs

    target, draft = _tiny_models()
    tokens = torch.tensor([[1, 5, 2, 7, 7, 0, 12, 3, 9]])
    P = 3
    for temperature in (1.0, 0.7):
        betas = acceptance_rates(target, draft, tokens, P, temperature)
        assert betas.shape == (tokens.shape[1] - P,) and betas.dtype == torch.float64
        with torch.no_grad():
            want = [float(torch.minimum(next_token_probs(target(tokens[:, :t]).logits[0, -1].double(), temperature),
                                        next_token_probs(draft(tokens[:, :t]).logits[0, -1].double(), temperature)
                                        ).sum()) for t in range(P, tokens.shape[1])]
        assert torch.allclose(betas, torch.tensor(want, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(acceptance_rates(target, target, tokens, P), torch.ones(6, dtype=torch.float64))


def test_acceptance_rates_refuse_bad_arguments() -> None:
    from attention_core.serving.speculative import acceptance_rates

    target, draft = _pair()
    for args, error, words in [((target, draft, torch.tensor([[1, 2]]), 2), ValueError, "prompt_len"),
                               ((target, draft, torch.tensor([[1, 2]]), 0), ValueError, "prompt_len"),
                               ((target, draft, torch.tensor([1, 2]), 1), ValueError, "tokens"),
                               ((target, draft, torch.tensor([[1, 11]]), 1), ValueError, "tokens"),
                               ((target, None, torch.tensor([[1, 2]]), 1), TypeError, "draft"),
                               ((target, draft, torch.zeros(1, 45, dtype=torch.long), 1), ValueError, "max_positions")]:
        with pytest.raises(error, match=words):
            acceptance_rates(*args)
