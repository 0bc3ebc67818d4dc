"""The explain wing on hand-computed cases: rollout, flow, interventions, attributions, and the classifier task."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import attention_core as ac
from attention_core.explain import (
    Recorder,
    adversarial_attention,
    attention_flow,
    attention_rollout,
    gradient_x_input,
    integrated_gradients,
    intervene,
    jsd,
    leave_one_out,
    permute_weights,
    spearman,
    tvd,
    uniform_weights,
)
from attention_core.models.classifier import build_classifier
from attention_core.models.rnn_attention import AdditiveAttention
from attention_core.sentences import data as sdata
from attention_core.sentences import train as strain
from attention_core.training.checkpoint import read_manifest

T = torch.tensor


def _layers(*maps):
    return [T(m, dtype=torch.float64)[None] for m in maps]  # each (1, L, L)


# ------------------------------------------------------------------------------------------ rollout and flow


def test_rollout_two_layer_toy_by_hand():
    # layer 1: both tokens read token 0; layer 2: both read token 1
    a1, a2 = [[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]
    raw = attention_rollout(_layers(a1, a2), residual=False)[0]
    assert torch.equal(raw, T([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64))
    # with (A + I)/2: A1' = [[1, 0], [.5, .5]], A2' = [[.5, .5], [0, 1]]; A2' A1' = [[.75, .25], [.5, .5]]
    res = attention_rollout(_layers(a1, a2))[0]
    assert torch.allclose(res, T([[0.75, 0.25], [0.5, 0.5]], dtype=torch.float64), atol=0, rtol=0)


def test_rollout_residual_weight_is_the_identitys_share():
    a1, a2 = [[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]
    # r = 1/4: A1' = [[1, 0], [.75, .25]], A2' = [[.25, .75], [0, 1]]; A2' A1' = [[.8125, .1875], [.75, .25]]
    quarter = attention_rollout(_layers(a1, a2), residual=0.25)[0]
    assert torch.equal(quarter, T([[0.8125, 0.1875], [0.75, 0.25]], dtype=torch.float64))
    assert torch.equal(attention_rollout(_layers(a1, a2), residual=0.5), attention_rollout(_layers(a1, a2)))
    assert torch.equal(attention_rollout(_layers(a1, a2), residual=0.0), attention_rollout(_layers(a1, a2), False))
    with pytest.raises(ValueError, match="residual"):
        attention_rollout(_layers(a1, a2), residual=1.5)


def test_the_vision_wing_uses_this_rollout():
    from attention_core.vision import analysis

    assert analysis.attention_rollout is attention_rollout


def test_rollout_averages_heads_and_keeps_rows_stochastic():
    a = torch.softmax(torch.randn(3, 2, 4, 5, 5, generator=torch.Generator().manual_seed(0)), -1)  # 3 layers
    r = attention_rollout(list(a))
    assert r.shape == (2, 5, 5)
    assert torch.allclose(r.sum(-1), torch.ones(2, 5, dtype=torch.float64))
    manual = (a[2].mean(1).double() + torch.eye(5)) / 2 @ ((a[1].mean(1).double() + torch.eye(5)) / 2) @ (
        (a[0].mean(1).double() + torch.eye(5)) / 2)
    assert torch.allclose(r, manual)


def test_flow_on_a_tiny_graph_by_hand():
    half = [[0.5, 0.5], [0.5, 0.5]]
    # two layers of all-0.5 edges, output token 0: each input has two disjoint paths of capacity 0.5 -> flow 1,
    # while rollout splits the output's unit of mass: 0.5 each
    flow = attention_flow(_layers(half, half), output=0, residual=False)
    assert torch.equal(flow, T([[1.0, 1.0]], dtype=torch.float64))
    assert torch.equal(attention_rollout(_layers(half, half), residual=False)[0, 0], T([0.5, 0.5], dtype=torch.float64))
    # one layer [[1, 0], [.5, .5]] with the residual: A' = [[1, 0], [.25, .75]]; output token 1 -> [.25, .75]
    flow = attention_flow(_layers([[1.0, 0.0], [0.5, 0.5]]), output=1)
    assert torch.allclose(flow, T([[0.25, 0.75]], dtype=torch.float64), atol=1e-12)
    # a bottleneck: layer 1 sends 0.2 of token 0 to position 1; layer 2 reads only position 1 -> flow 0.2, 0.8
    flow = attention_flow(_layers([[1.0, 0.0], [0.2, 0.8]], [[0.0, 1.0], [0.0, 1.0]]), output=0, residual=False)
    assert torch.allclose(flow, T([[0.2, 0.8]], dtype=torch.float64), atol=1e-12)


def test_flow_ignores_padding_and_takes_output_weights():
    a = torch.softmax(torch.randn(2, 1, 4, 4, generator=torch.Generator().manual_seed(1)), -1)
    mask = T([[True, True, True, False]])
    u = T([[0.5, 0.5, 0.0, 0.0]])
    flow = attention_flow(list(a), output=u, attention_mask=mask)
    assert flow[0, 3] == 0
    assert flow.shape == (1, 4) and bool((flow[0, :3] > 0).all())
    with pytest.raises(ValueError, match="output"):
        attention_flow(list(a), output=7)


# ------------------------------------------------------------------------------------------ interventions


def _weights_and_mask():
    g = torch.Generator().manual_seed(0)
    allowed = T([[True, True, True, False, False], [True, True, True, True, True], [False] * 5])
    w = ac.masked_softmax(torch.randn(3, 5, generator=g), allowed)
    return w, allowed


def test_uniform_weights_by_hand():
    w, allowed = _weights_and_mask()
    u = uniform_weights(w, allowed)
    assert u.shape == w.shape
    assert torch.allclose(u[0], T([1 / 3, 1 / 3, 1 / 3, 0, 0]))
    assert torch.allclose(u[1], torch.full((5,), 0.2))
    assert torch.equal(u[2], torch.zeros(5))


def test_permute_keeps_each_rows_weights_and_zeros():
    w, allowed = _weights_and_mask()
    fn = permute_weights(torch.Generator().manual_seed(3))
    moved = 0
    for _ in range(20):
        p = fn(w, allowed)
        assert p.shape == w.shape
        assert torch.equal(p[~allowed], torch.zeros_like(p[~allowed]))
        for r in range(3):
            assert torch.equal(p[r].sort().values, w[r].sort().values)
        moved += int(not torch.equal(p, w))
    assert moved >= 15  # it does shuffle
    assert torch.allclose(fn(w, allowed)[:2].sum(-1), torch.ones(2))


def test_jsd_and_tvd_by_hand():
    p, q = T([1.0, 0.0]), T([0.0, 1.0])
    assert math.isclose(jsd(p, q).item(), math.log(2), rel_tol=1e-6)
    assert jsd(p, p).item() == 0 and tvd(p, q).item() == 1
    a, b = T([0.5, 0.5]), T([1.0, 0.0])
    # m = (.75, .25): KL(a||m) = .5 ln(.5/.75) + .5 ln(.5/.25); KL(b||m) = ln(1/.75)
    want = 0.5 * (0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(2) + math.log(1 / 0.75))
    assert math.isclose(jsd(a, b).item(), want, rel_tol=1e-6)
    assert math.isclose(tvd(a, b).item(), 0.5)


def test_intervene_on_additive_attention_recomputes_the_context():
    g = torch.Generator().manual_seed(0)
    att = AdditiveAttention(4, 6, 5)
    q, k = torch.randn(2, 4, generator=g), torch.randn(2, 3, 6, generator=g)
    mask = T([[True, True, False], [True, True, True]])
    ctx, w = att(q, k, attn_mask=mask)
    rec = Recorder()
    with intervene(att, rec):
        ctx2, w2 = att(q, k, attn_mask=mask)
    assert torch.equal(ctx, ctx2) and torch.equal(rec.weights[0], w) and torch.equal(rec.allowed[0], mask)
    with intervene(att, uniform_weights):
        ctx3, w3 = att(q, k, attn_mask=mask)
    assert torch.allclose(ctx3[0], k[0, :2].mean(0)) and torch.allclose(ctx3[1], k[1].mean(0))
    ctx4, _ = att(q, k, attn_mask=mask)  # the hook is gone after the block
    assert torch.equal(ctx4, ctx)


def test_intervene_on_multihead_attention():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    mha = ac.MultiHeadAttention(8, 2).eval()
    x, mem = torch.randn(2, 3, 8, generator=g), torch.randn(2, 4, 8, generator=g)
    kpm = T([[True, True, True, False], [True, True, True, True]])
    out, w = mha(x, mem, key_padding_mask=kpm, need_weights=True)
    rec = Recorder()
    with intervene(mha, rec):
        out2, w2 = mha(x, mem, key_padding_mask=kpm, need_weights=True)
    assert torch.allclose(out, out2, atol=1e-6) and torch.allclose(w, w2, atol=1e-6)
    assert rec.allowed[0].shape == (2, 2, 3, 4) and not bool(rec.allowed[0][0, :, :, 3].any())
    with intervene(mha, uniform_weights):
        out3, w3 = mha(x, mem, key_padding_mask=kpm, need_weights=True)
    v = mha.v_proj(mem)  # uniform weights: every query gets the mean of the real values
    want0 = mha.out_proj(v[0, :3].mean(0))
    assert torch.allclose(out3[0], want0.expand(3, 8), atol=1e-6)
    assert torch.allclose(w3.sum(-1), torch.ones(2, 2, 3))
    out4, _ = mha(x, mem, key_padding_mask=kpm)
    assert torch.allclose(out4, out, atol=1e-6) and "forward" not in vars(mha)
    with intervene(mha, uniform_weights):  # causal self-attention: a query sees itself and the past only
        _, wc = mha(x, is_causal=True, need_weights=True)
    assert torch.allclose(wc[0, 0], T([[1.0, 0, 0], [0.5, 0.5, 0], [1 / 3, 1 / 3, 1 / 3]]))


def test_intervene_refuses_other_modules():
    with pytest.raises(TypeError, match="modules"):
        with intervene(torch.nn.Linear(2, 2), uniform_weights):
            pass


# ------------------------------------------------------------------------------------------ attributions


def test_integrated_gradients_completeness_exact_for_a_quadratic():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1, 3, 4, generator=g, dtype=torch.float64)
    x = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)

    def score(z):
        return (w * z * z).sum((1, 2))

    ig = integrated_gradients(score, x, steps=4)
    assert torch.allclose(ig, (w * x * x).sum(-1))  # midpoint rule is exact for a linear gradient
    assert torch.allclose(ig.sum(1), score(x) - score(torch.zeros_like(x)))


def test_integrated_gradients_completeness_for_a_network():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    base = torch.randn(1, 5, 4, dtype=torch.float64)

    def score(z):
        return net(z).sum((1, 2))

    ig = integrated_gradients(score, x, baseline=base, steps=64)
    gap = score(x) - score(base.expand_as(x))
    assert torch.allclose(ig.sum(1), gap, atol=1e-3)
    assert not torch.allclose(integrated_gradients(score, x, baseline=base, steps=1).sum(1), gap, atol=1e-3)


def test_gradient_x_input_and_leave_one_out_by_hand():
    w = T([[[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]]])
    x = T([[[1.0, 1.0], [2.0, 0.0], [4.0, -2.0]]])
    assert torch.equal(gradient_x_input(lambda z: (w * z).sum((1, 2)), x), T([[3.0, 6.0, 1.0]]))
    c = T([[0.1, 0.7, -0.2, 5.0]])
    mask = T([[True, True, True, False]])
    loo = leave_one_out(lambda keep: (c * keep).sum(1), mask)
    assert torch.allclose(loo, T([[0.1, 0.7, -0.2, 0.0]], dtype=torch.float64))


def test_spearman_by_hand_and_with_ties():
    assert spearman(T([[1.0, 2.0, 3.0]]), T([[1.0, 3.0, 2.0]])).item() == pytest.approx(0.5)
    assert spearman(T([[1.0, 1.0, 2.0]]), T([[1.0, 2.0, 3.0]])).item() == pytest.approx(math.sqrt(3) / 2)
    # tied entries share rank 1.5: ranks (1.5, 1.5, 3, 4) against (1, 2, 3, 4) -> 4.5 / sqrt(4.5 * 5) = 3 / sqrt(10)
    assert spearman(T([[1.0, 1.0, 2.0, 3.0]]), T([[1.0, 2.0, 3.0, 4.0]])).item() == pytest.approx(3 / math.sqrt(10))
    last_out = T([[True, True, True, False]])
    assert spearman(T([[3.0, 1.0, 2.0, 9.0]]), T([[30.0, 10.0, 20.0, -5.0]]), last_out).item() == 1
    assert math.isnan(spearman(T([[1.0, 1.0]]), T([[1.0, 2.0]])).item())


# ------------------------------------------------------------------------------------------ the classifier task


def test_the_task_plants_exactly_one_cue_that_decides_the_label():
    for e in sdata.sample(300, 5):
        cues = [i for i, w in enumerate(e.words) if w in sdata.POSITIVE + sdata.NEGATIVE]
        assert cues == [e.cue]
        assert (e.words[e.cue] in sdata.POSITIVE) == (e.label == 1)
        assert sdata.MIN_LEN <= len(e.words) <= sdata.MAX_LEN
    b = sdata.collate(sdata.sample(5, 1))
    assert bool((b.ids.gather(1, b.cues[:, None]) > len(sdata.FILLERS)).all())


def test_classifier_shapes_and_padding():
    m = build_classifier({"vocab_size": len(sdata.VOCAB)}).eval()
    b = sdata.collate(sdata.sample(4, 0))
    out = m(b.ids, b.valid_lens)
    assert out.logits.shape == (4, 2) and out.weights.shape == b.ids.shape
    assert torch.allclose(out.weights.sum(-1), torch.ones(4))
    pad = torch.arange(b.ids.shape[1])[None] >= b.valid_lens[:, None]
    assert bool((out.weights[pad] == 0).all())
    u = build_classifier({"vocab_size": len(sdata.VOCAB), "attention": "uniform", "encoder": "none"})
    w = u(b.ids, b.valid_lens).weights
    assert int(b.valid_lens.min()) < b.ids.shape[1]  # some rows are padded
    for r in range(4):
        n = int(b.valid_lens[r])
        assert torch.allclose(w[r, :n], torch.full((n,), 1 / n)) and bool((w[r, n:] == 0).all())


@pytest.mark.parametrize("name", sorted(strain.RECIPES))
def test_shipped_classifiers_load_verified_and_small(name):
    model, entry = strain.load_or_train(name)
    path = strain.CHECKPOINT_DIR / entry["file"]
    assert entry["sha256"] is not None and path.stat().st_size < 2_000_000
    assert entry["recipe"]["name"] == name
    test = sdata.collate(sdata.test_set(200))
    assert strain.accuracy(model, test) >= 0.95


def test_a_tampered_checkpoint_is_refused(tmp_path: Path):
    import shutil

    for f in ("manifest.json", "embed.pt"):
        shutil.copy(strain.CHECKPOINT_DIR / f, tmp_path / f)
    with open(tmp_path / "embed.pt", "ab") as fh:
        fh.write(b"0")
    with pytest.raises(Exception, match="sha256|checksum"):
        strain.load_or_train("embed", directory=tmp_path)


def test_adversary_stays_within_its_bound_and_moves_the_weights():
    model, _ = strain.load_or_train("embed")
    b = sdata.collate(sdata.test_set(40))
    keys = model.encode(b.ids, b.valid_lens).detach()
    res = adversarial_attention(lambda: model.pool(keys, b.valid_lens).logits.softmax(-1), model.attention,
                                epsilon=0.02, steps=40)
    assert bool((res.output_tvd <= 0.02 + 1e-6).all())
    assert res.jsd[0].shape == (40,) and bool((res.jsd[0] >= 0).all()) and bool((res.jsd[0] <= math.log(2)).all())
    assert float(res.jsd[0].max()) > 0.05
    with torch.no_grad():  # the reported TVD is the output's with the returned weights
        base = model.pool(keys, b.valid_lens).logits.softmax(-1)
        with intervene(model.attention, lambda w, a: res.adversarial[0]):
            moved = model.pool(keys, b.valid_lens).logits.softmax(-1)
    assert torch.allclose(tvd(moved, base), res.output_tvd, atol=1e-5)
    assert float(res.output_tvd.max()) > 0
    kept = res.jsd[0] == 0  # inputs that never met the bound keep the model's own weights
    assert torch.equal(res.adversarial[0][kept], res.original[0][kept])


def test_the_training_cli_reproduces_a_shipped_checkpoint(tmp_path: Path):
    """Retraining by the recipe reproduces what holds on any CPU, not the bits.

    Bit-identical weights hold only on the CPU that made the checkpoint (another vendor's BLAS sums in another
    order; seen: red on an Intel Xeon with AMX for a checkpoint made on an AMD EPYC). What must hold everywhere:
    the same recipe and parameter count in the manifest, the logged loss curve within a tolerance of the shipped
    one, and the same test accuracy.
    """
    strain.main(["embed", "--out", str(tmp_path)])
    fresh_entry = read_manifest(tmp_path)["embed"]
    fresh = torch.load(tmp_path / "embed.pt", weights_only=True)["state_dict"]
    shipped, entry = strain.load_or_train("embed")
    assert set(fresh) == set(shipped.state_dict())
    assert all(fresh[k].shape == v.shape for k, v in shipped.state_dict().items())
    assert fresh_entry["recipe"] == entry["recipe"]
    assert fresh_entry["parameters"] == entry["parameters"]
    assert fresh_entry["loss_every"] == entry["loss_every"] and len(fresh_entry["losses"]) == len(entry["losses"])
    for got, want in zip(fresh_entry["losses"], entry["losses"]):  # rounding differs by CPU; the curve does not
        assert abs(got - want) <= 0.02 + 0.1 * want, (fresh_entry["losses"], entry["losses"])
    assert abs(fresh_entry["test_accuracy"] - entry["test_accuracy"]) <= 0.02


@pytest.mark.parametrize("name", ["bahdanau", "luong_general", "transformer"])
def test_interventions_on_the_shipped_translators(name):
    from attention_core.translation import metrics
    from attention_core.translation import train as ttrain
    from attention_core.translation.data import NumberWords, collate

    task = NumberWords()
    b = collate(metrics.book_test_set()[:8], task.src_vocab, task.tgt_vocab)
    model, _ = ttrain.load_or_train(name)
    layers = model.decoder.attention if name != "transformer" else [
        layer.multihead_attn for layer in model.decoder.layers.layers]
    with torch.no_grad():
        base = model(b.src, b.src_valid_lens, b.tgt_in)[0]
        rec = Recorder()
        with intervene(layers, rec):
            same = model(b.src, b.src_valid_lens, b.tgt_in)[0]
        with intervene(layers, uniform_weights):
            flat = model(b.src, b.src_valid_lens, b.tgt_in)[0]
    assert torch.allclose(same, base, atol=1e-5)
    calls = b.tgt_in.shape[1] if name != "transformer" else 2  # one call per step, or one per decoder layer
    assert len(rec.weights) == calls
    pad = ~rec.allowed[0]
    assert bool((rec.weights[0][pad] == 0).all()) and bool(pad.any())  # padding takes no weight
    assert (flat - base).abs().max() > 1.0


def test_local_luong_attention_is_refused():
    from attention_core.translation import train as ttrain

    model, _ = ttrain.load_or_train("luong_local_p")
    with pytest.raises(ValueError, match="global"):
        with intervene(model.decoder.attention, uniform_weights):
            pass


# ------------------------------------------------------------------------------------------ edges (issue 37)


def test_nested_interventions_on_one_layer_unwind_to_the_layer_as_it_was():
    torch.manual_seed(0)
    mha = ac.MultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    base, _ = mha(x)
    rec = Recorder()
    with intervene(mha, uniform_weights):
        uni, _ = mha(x)
        with intervene(mha, rec):
            again, _ = mha(x)  # the inner intervention runs
        assert len(rec.weights) == 1
        after_inner, _ = mha(x)  # the outer one is back
        assert torch.equal(after_inner, uni)
    assert "forward" not in vars(mha) and torch.allclose(mha(x)[0], base)


def test_a_layer_listed_twice_is_intervened_on_once():
    att = AdditiveAttention(4, 6, 5)
    q, k = torch.randn(2, 4), torch.randn(2, 3, 6)
    mha = ac.MultiHeadAttention(6, 2).eval()
    rec = Recorder()
    with intervene([att, att, mha, mha], rec):
        att(q, k)
        mha(k)
    assert len(rec.weights) == 2
    assert "forward" not in vars(mha) and not att._forward_hooks


@pytest.mark.parametrize("modules,fn,err,pattern", [
    (5, uniform_weights, TypeError, "modules must be an attention layer or an iterable of them, got int"),
    ("AdditiveAttention", uniform_weights, TypeError, "modules must be AdditiveAttention"),
    (None, uniform_weights, TypeError, "modules must be an attention layer"),
])
def test_intervene_refuses_what_is_not_a_layer_by_name(modules, fn, err, pattern):
    with pytest.raises(err, match=pattern):
        with intervene(modules, fn):
            pass


@pytest.mark.parametrize("fn,err,pattern", [
    (lambda w, a: w.tolist(), TypeError, "the intervention must return a tensor of weights, got list"),
    (lambda w, a: w[..., :1], ValueError, "the intervention returned shape"),
    (lambda w, a: w.double(), TypeError, "the intervention returned torch.float64"),
])
def test_an_intervention_that_returns_something_else_is_refused(fn, err, pattern):
    att, mha = AdditiveAttention(4, 6, 5), ac.MultiHeadAttention(6, 2).eval()
    with pytest.raises(err, match=pattern):
        with intervene(att, fn):
            att(torch.randn(2, 4), torch.randn(2, 3, 6))
    with pytest.raises(err, match=pattern):
        with intervene(mha, fn):
            mha(torch.randn(2, 3, 6))
    assert not att._forward_hooks and "forward" not in vars(mha)


def test_the_adversary_leaves_the_models_gradients_alone():
    m = build_classifier({"vocab_size": len(sdata.VOCAB)}).eval()
    batch = sdata.collate(sdata.sample(4, seed=3))
    for p in m.parameters():
        p.grad = None
    adversarial_attention(lambda: m(batch.ids, batch.valid_lens).logits.softmax(-1), m.attention, steps=3)
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("kwargs,err,pattern", [
    ({"epsilon": "0.1"}, TypeError, "epsilon must be a float in"), ({"epsilon": 0.0}, ValueError, "epsilon"),
    ({"steps": 0}, ValueError, "steps must be an int >= 1"), ({"lr": -1.0}, ValueError, "lr must be"),
    ({"penalty": math.nan}, ValueError, "penalty"), ({"init_noise": -1.0}, ValueError, "init_noise"),
    ({"seed": 1.5}, TypeError, "seed must be an int"), ({"run": 3}, TypeError, "run must be a callable"),
])
def test_adversary_arguments_are_checked(kwargs, err, pattern):
    m = build_classifier({"vocab_size": len(sdata.VOCAB)}).eval()
    batch = sdata.collate(sdata.sample(2, seed=3))
    args = {"run": lambda: m(batch.ids, batch.valid_lens).logits.softmax(-1), "modules": m.attention, **kwargs}
    with pytest.raises(err, match=pattern):
        adversarial_attention(**args)


@pytest.mark.parametrize("ids,lens,err,pattern", [
    (T([[1, -2], [3, 0]]), T([2, 1]), ValueError, r"ids must be ids in \[0, 10\).*from -2 to 3"),
    (T([[1, 10], [3, 0]]), T([2, 1]), ValueError, r"ids must be ids in \[0, 10\).*from 0 to 10"),
    (T([[1.0, 2.0]]), T([2]), TypeError, "ids must hold integer token ids"),
    (T([1, 2]), T([2]), ValueError, r"ids must be \(B, L\) token ids, got shape \(2,\)"),
    (T([[1, 2]]), T([1.5]), TypeError, "valid_lens must hold integer lengths"),
    (T([[1, 2]]), T([[2]]), ValueError, r"valid_lens must be a \(1,\) tensor of lengths, got shape \(1, 1\)"),
    (T([[1, 2]]), T([3]), ValueError, r"valid_lens must be in \[1, 2\]"),
    (torch.zeros(2, 0, dtype=torch.long), T([0, 0]), ValueError, r"valid_lens must be in \[1, 0\]"),
])
def test_the_classifier_refuses_bad_ids_by_name(ids, lens, err, pattern):
    with pytest.raises(err, match=pattern):
        build_classifier({"vocab_size": 10})(ids, lens)


def test_the_classifier_on_an_empty_batch():
    for encoder in ("gru", "none"):
        out = build_classifier({"vocab_size": 10, "encoder": encoder})(torch.zeros(0, 3, dtype=torch.long),
                                                                       torch.zeros(0, dtype=torch.long))
        assert out.logits.shape == (0, 2) and out.weights.shape == (0, 3)


@pytest.mark.parametrize("config,err,pattern", [
    ({"vocab_size": 0}, ValueError, "vocab_size must be .*, got 0"),
    ({"vocab_size": 1.5}, TypeError, "vocab_size must be an int"),
    ({"vocab_size": 5, "seed": 1.5}, TypeError, r"config\['seed'\] must be an int"),
    ({"vocab_size": 5, "hidden_dim": 0}, ValueError, "hidden_dim must be .*, got 0"),
    ({"vocab_size": 5, "num_classes": 0}, ValueError, "num_classes must be .*, got 0"),
])
def test_classifier_configs_are_checked_by_name(config, err, pattern):
    with pytest.raises(err, match=pattern):
        build_classifier(config)


def test_nested_interventions_on_an_additive_layer_apply_the_innermost_only():
    att = AdditiveAttention(4, 6, 5)
    q, k = torch.randn(2, 4), torch.randn(2, 3, 6)
    outer, inner = Recorder(), Recorder()
    with intervene(att, outer):
        with intervene(att, inner):
            att(q, k)
        assert len(inner.weights) == 1 and outer.weights == []
        att(q, k)
        assert len(outer.weights) == 1
    assert "forward" not in vars(att) and not att._forward_hooks


def test_the_intervention_helpers_check_their_arguments():
    with pytest.raises(ValueError, match=r"allowed must be a bool tensor of the weights' shape \(2, 3\)"):
        uniform_weights(torch.rand(2, 3), torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="allowed must be a bool tensor"):
        permute_weights()(torch.rand(2, 3), torch.ones(2, 3))
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got int"):
        permute_weights(3)


def _m(name: str):
    import importlib
    return importlib.import_module("attention_core." + name)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: _m("explain.attribution").residual_attention([[1.0]]), TypeError,
     r"attention must be a torch.Tensor, got list"),
    (lambda: _m("explain.attribution").leave_one_out("bad", torch.ones(1, 2, dtype=torch.bool)), TypeError,
     r"score must be a callable, got str"),
    (lambda: _m("explain.attribution").leave_one_out(lambda m: m.sum(-1), [[True]]), TypeError,
     r"attention_mask must be a torch.Tensor, got list"),
    (lambda: _m("sentences.data").collate("bad"), TypeError, r"examples must be a sequence of Example, got 'bad'"),
    (lambda: _m("sentences.train").accuracy("bad", None), TypeError, r"model must be an AttentionClassifier, got str"),
    (lambda: _m("sentences.train").accuracy(torch.nn.Linear(1, 1), [1]), TypeError,
     r"batch must be a SentenceBatch, got list"),
])
def test_explain_and_sentences_helpers_refuse_bad_arguments_by_name(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.parametrize("call, error, pattern", [
    (lambda: sdata.sample(-3, 0), ValueError, r"n must be an int >= 0 \(examples\), got -3"),
    (lambda: sdata.sample("bad", 0), TypeError, r"n must be an int >= 0 \(examples\), got str 'bad'"),
    (lambda: sdata.sample(2, [[1.0, 2.0]]), TypeError, r"seed must be an int, got list"),
    (lambda: next(sdata.stream(-3, 0)), ValueError, r"batch_size must be an int >= 1, got -3"),
    (lambda: next(sdata.stream("bad", 0)), TypeError, r"batch_size must be an int >= 1, got str 'bad'"),
])
def test_sentence_sampling_refuses_bad_arguments(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()
    assert sdata.sample(0, 0) == [] and len(sdata.sample(3, 0)) == 3  # valid calls unchanged
