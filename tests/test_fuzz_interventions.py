"""Interventions are transactional: a state machine opens and closes nested :func:`intervene` blocks on a model's
attention layers (additive, global Luong, multi-head with grouped heads), makes refused calls (a layer of another
kind, a local Luong layer, ``fn`` not callable, something that is not a layer at all), calls that fail inside the
block (an intervention that raises, one that returns the wrong shape), and adversarial searches (one that runs,
one whose ``run`` raises).

After every step: each layer is exactly as it was before the blocks still open were entered (its ``forward``,
its hooks, its weights, its gradients, its mode); a forward call hands each layer's weights to the innermost
open intervention that lists the layer, and to no other one; with no block open, the outputs are the model's own.

Steps: ``make test`` (profile ``fuzz``) runs a few hundred; ``make fuzz`` (profile ``slow``) a few thousand.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import attention_core as ac
from attention_core.explain import adversarial_attention, intervene, uniform_weights
from attention_core.models.rnn_attention import AdditiveAttention, LuongAttention

PROFILE = os.environ.get("AC_FUZZ_PROFILE", "fuzz")
RUNS = {"fuzz": (30, 12), "slow": (250, 12)}[PROFILE]
MACHINE = settings(settings.get_profile(PROFILE), max_examples=RUNS[0], stateful_step_count=RUNS[1])

NAMES = ("additive", "luong", "mha")


class Boom(Exception):
    pass


def _layers():
    g = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers = {"additive": AdditiveAttention(4, 6, 5), "luong": LuongAttention(6, 6, score="general"),
                  "mha": ac.MultiHeadAttention(8, 4, num_kv_heads=2)}
    for m in layers.values():
        m.eval()
    inputs = {"additive": (torch.randn(2, 4, generator=g), torch.randn(2, 3, 6, generator=g)),
              "luong": (torch.randn(2, 6, generator=g), torch.randn(2, 5, 6, generator=g)),
              "mha": (torch.randn(2, 3, 8, generator=g),)}
    return layers, inputs


def _snapshot(layers):
    return {name: (vars(m).get("forward"), tuple(m._forward_hooks), tuple(m._forward_pre_hooks),
                   {k: v.clone() for k, v in m.state_dict().items()}, [p.grad for p in m.parameters()],
                   [s.training for s in m.modules()])
            for name, m in layers.items()}


def _same(a, b) -> bool:
    for name in a:
        fa, ha, pa, sa, ga, ma = a[name]
        fb, hb, pb, sb, gb, mb = b[name]
        if fa is not fb or ha != hb or pa != pb or ma != mb:
            return False
        if any(x is not None or y is not None for x, y in zip(ga, gb)):
            return False
        if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
            return False
    return True


class Tagged:
    """An intervention that logs its tag and the layer's weights' shape, and returns them unchanged (or uniform)."""

    def __init__(self, tag: int, log: list, uniform: bool) -> None:
        self.tag, self.log, self.uniform = tag, log, uniform

    def __call__(self, weights, allowed):
        self.log.append((self.tag, tuple(weights.shape)))
        return uniform_weights(weights, allowed) if self.uniform else weights


class InterventionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.layers, self.inputs = _layers()
        with torch.no_grad():
            self.base = {n: self._call(n) for n in NAMES}
        self.blocks: list = []
        self.open: list = []  # (tag, layer names, snapshot before entering)
        self.log: list = []
        self.tags = 0

    def _call(self, name):
        out = self.layers[name](*self.inputs[name])
        return out[0]

    def teardown(self) -> None:
        while self.blocks:
            self.blocks.pop().__exit__(None, None, None)

    # -------------------------------------------------------------------------------------------- rules

    @rule(names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=4), uniform=st.booleans())
    def enter(self, names, uniform):
        before = _snapshot(self.layers)
        self.tags += 1
        block = intervene([self.layers[n] for n in names], Tagged(self.tags, self.log, uniform))
        block.__enter__()
        self.blocks.append(block)
        self.open.append((self.tags, set(names), before))
        event(f"depth {len(self.open)}")

    @precondition(lambda self: self.open)
    @rule()
    def leave(self):
        _, _, before = self.open.pop()
        self.blocks.pop().__exit__(None, None, None)  # the innermost block
        assert _same(_snapshot(self.layers), before), "leaving a block did not give the layers back"

    @rule(how=st.sampled_from(["linear", "local", "not callable", "not a layer", "none"]),
          names=st.lists(st.sampled_from(NAMES), max_size=3))
    def refused(self, how, names):
        before = _snapshot(self.layers)
        mods, fn = [self.layers[n] for n in names], uniform_weights
        if how == "linear":
            mods.append(torch.nn.Linear(2, 2))
        elif how == "local":
            mods.append(LuongAttention(6, 6, mode="local-m", window=1))
        elif how == "not callable":
            fn = 3
        elif how == "not a layer":
            mods = 5
        else:
            mods = None
        with pytest.raises((TypeError, ValueError)):
            with intervene(mods, fn):
                pass
        assert _same(_snapshot(self.layers), before), f"a refused intervene ({how}) changed a layer"
        event(f"refused: {how}")

    @rule(name=st.sampled_from(NAMES), how=st.sampled_from(["raise", "shape", "list"]))
    def failing_call(self, name, how):
        before = _snapshot(self.layers)

        def fn(weights, allowed):
            if how == "raise":
                raise Boom
            return weights[..., :1] if how == "shape" else weights.tolist()

        with pytest.raises((Boom, TypeError, ValueError)):
            with intervene(self.layers[name], fn):
                self._call(name)
        assert _same(_snapshot(self.layers), before), f"a failing call ({how}) left a layer changed"
        event(f"failed: {how}")

    @rule(names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True), fail=st.booleans())
    def adversary(self, names, fail):
        before = _snapshot(self.layers)
        calls = {"n": 0}

        def run():
            calls["n"] += 1
            if fail and calls["n"] > 1:
                raise Boom
            return torch.cat([self._call(n).flatten(1) for n in names], dim=1).softmax(-1)

        mods = [self.layers[n] for n in names]
        if fail:
            with pytest.raises(Boom):
                adversarial_attention(run, mods, steps=2)
        else:
            adversarial_attention(run, mods, steps=2)
        assert _same(_snapshot(self.layers), before), "the adversary left a layer changed"
        event(f"adversary: {'failed' if fail else 'ran'}")

    @rule(name=st.sampled_from(NAMES))
    def forward(self, name):
        self.log.clear()
        with torch.no_grad():
            out = self._call(name)
        covering = [tag for tag, names, _ in self.open if name in names]
        if covering:
            assert [t for t, _ in self.log] == [covering[-1]], "not the innermost intervention ran, or more ran"
        else:
            assert self.log == [] and torch.equal(out, self.base[name])

    # -------------------------------------------------------------------------------------------- invariant

    @invariant()
    def closed_blocks_leave_nothing_behind(self):
        if not self.open:
            for m in self.layers.values():
                assert "forward" not in vars(m) and not m._forward_hooks


def test_interventions_are_transactional():
    InterventionMachine.TestCase.settings = MACHINE
    InterventionMachine.TestCase().runTest()
