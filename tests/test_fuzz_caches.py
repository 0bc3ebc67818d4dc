"""Caches are transactional: a state machine drives random prefills, decodes, refused calls, resets and batch
changes through a small language model (and a latent-attention layer), and after every step checks the cache
against a recomputation from the tokens that were accepted.

The caches drawn: full, static (preallocated, ``max_len``), rolling window, window + sinks, a full cache whose
first call is a left-padded batch, and one sequence of a paged pool (chapter 15's blocks, whose prefix a forked
sequence may share, so that a write copies a block first); the models: grouped-query attention and multi-head
latent attention (whose "keys" in the cache are its rotary keys and "values" its latents, decoded in the absorbed
form).

A refused call must leave the cache exactly as it was. The refusals drawn: a token id out of the vocabulary, a
batch of another size, positions past ``max_positions``, and a backend that refuses in a chosen layer (the
first, or a later one, after earlier layers have already appended their keys and values).

Steps: ``make test`` (profile ``fuzz``) runs a few hundred; ``make fuzz`` (profile ``slow``) a few thousand.
Hypothesis prints the counts with ``--hypothesis-show-statistics``; each test also prints its step count.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import attention_core as ac
from attention_core.backends import Backend, register_backend
from attention_core.models import language_model as lm
from attention_core.models.latent_attention import LatentCache, MultiHeadLatentAttention
from attention_core.paged_attention import gather_paged_kv
from attention_core.serving.blocks import OutOfBlocks, PagedKVCache

PROFILE = os.environ.get("AC_FUZZ_PROFILE", "fuzz")
#: (examples, steps per example): about 300 steps in `make test`, 2,500 in `make fuzz`.
RUNS = {"fuzz": (30, 10), "slow": (250, 10)}[PROFILE]
MACHINE = settings(settings.get_profile(PROFILE), max_examples=RUNS[0], stateful_step_count=RUNS[1])

V, MAX_POS, LAYERS = 13, 14, 3
MODELS = {
    "gqa": lm.build_language_model(dict(vocab_size=V, d_model=16, num_layers=LAYERS, num_heads=2, num_kv_heads=1,
                                        max_positions=MAX_POS, seed=0)).eval(),
    "latent": lm.build_language_model(dict(vocab_size=V, d_model=16, num_layers=LAYERS, num_heads=2,
                                           attention="latent", kv_latent_dim=6, rope_dim=4, max_positions=MAX_POS,
                                           seed=0)).eval(),
}
MODEL = MODELS["gqa"]
CACHES = {"full": {}, "static": {"max_len": MAX_POS}, "window": {"window": 4}, "sinks": {"window": 3, "sinks": 1},
          "padded": {}}
STEPS = {"model": 0, "latent": 0, "paged": 0}
PAGED_EVENTS: dict = {}  # what the paged machine did, by kind: every refusal must have been tried

# A backend that refuses the n-th attention call it is asked about (0: refuses nothing): the refusal then
# comes from inside the chosen layer, after the layers before it have appended to the cache.
_REFUSE = {"at": 0, "seen": 0}


def _refuse_nth(inputs) -> str | None:
    _REFUSE["seen"] += 1
    return "refused on purpose by the test" if _REFUSE["seen"] == _REFUSE["at"] else None


register_backend(Backend("test_refuses_nth", "test only", "attention_core.backends.reference",
                         lambda: (True, ""), _refuse_nth), replace=True)


def _tokens(seed: int, batch: int, n: int) -> torch.Tensor:
    return torch.randint(0, V, (batch, n), generator=torch.Generator().manual_seed(seed))


def _state(cache: lm.KVCache):
    return [(k.clone(), v.clone()) if k is not None else None for k, v in zip(cache.keys, cache.values)], cache.seen


def _same_state(a, b) -> bool:
    (layers_a, seen_a), (layers_b, seen_b) = a, b
    if seen_a != seen_b:
        return False
    for x, y in zip(layers_a, layers_b):
        if (x is None) != (y is None):
            return False
        if x is not None and not (torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])):
            return False
    return True


class KVCacheMachine(RuleBasedStateMachine):
    """One cache and the tokens it accepted; every refused call must leave the cache bit-for-bit as it was."""

    @initialize(kind=st.sampled_from(sorted(CACHES)), batch=st.integers(1, 3), model=st.sampled_from(sorted(MODELS)))
    def start(self, kind, batch, model):
        self.kind, self.batch, self.model = kind, batch, MODELS[model]
        event(f"model {model}, cache {kind}")
        self.cache = self.model.new_cache(**CACHES[kind])
        self.accepted = torch.zeros(batch, 0, dtype=torch.long)
        self.pad = None  # the left padding of the first call (padded caches)
        self.last = None  # the logits of the last accepted call's last position

    def _pad_for(self, n: int, seed: int):
        """A padded cache's first call: row b has seed-drawn padding, at most n - 1 tokens."""
        if self.kind != "padded" or self.accepted.shape[1]:
            return None
        return torch.tensor([(seed >> (3 * b)) % n for b in range(self.batch)], dtype=torch.long)

    def _feed(self, tokens: torch.Tensor, pad=None) -> None:
        with torch.no_grad():
            out = self.model(tokens, self.cache, pad=pad)
        if pad is not None:
            self.pad = pad
        self.accepted = torch.cat([self.accepted, tokens], dim=1)
        self.last = out.logits[:, -1]

    @rule(seed=st.integers(0, 2**31), n=st.integers(1, 5))
    def prefill_or_decode(self, seed, n):
        needed = self.accepted.shape[1] + n  # full caches: positions in the text
        if self.kind == "window":  # rotated at positions in the text, computed past the table: never refused
            needed = 0
        if self.kind == "sinks":
            needed = min(len(self.cache) + n, self.cache.capacity)
        tokens = _tokens(seed, self.batch, n)
        if needed > MAX_POS:  # past the rotary table (or the static cache's slots): refused, nothing appended
            before = _state(self.cache)
            with pytest.raises(ValueError, match="max_positions|max_len"):
                self.model(tokens, self.cache)
            assert _same_state(before, _state(self.cache))
            event("refused: past max_positions")
            return
        self._feed(tokens, self._pad_for(n, seed))
        event("prefill" if self.accepted.shape[1] == n else "decode")

    @rule(seed=st.integers(0, 2**31), n=st.integers(1, 3),
          how=st.sampled_from(["vocab high", "vocab negative", "batch", "backend, first layer",
                               "backend, later layer"]))
    def refused_call(self, seed, n, how):
        before = _state(self.cache)
        tokens = _tokens(seed, self.batch, n)
        _REFUSE["at"], _REFUSE["seen"] = 0, 0
        if how == "vocab high":
            tokens[0, -1] = V
        elif how == "vocab negative":
            tokens[-1, 0] = -1
        elif how == "batch":
            if len(self.cache) == 0:  # an empty cache takes a batch of any size
                return
            tokens = _tokens(seed, self.batch + 1, n)
        else:
            _REFUSE["at"] = 1 if how == "backend, first layer" else 1 + seed % (LAYERS - 1) + 1
        backend = "test_refuses_nth" if how.startswith("backend") else None
        with pytest.raises(ValueError, match="tokens|refused on purpose|max_positions|max_len"):
            with torch.no_grad(), ac.use_backend(backend):
                self.model(tokens, self.cache, pad=self._pad_for(n, seed))
        _REFUSE["at"] = 0
        assert _same_state(before, _state(self.cache)), f"a refused call ({how}) changed the cache"
        event(f"refused: {how}")

    @rule(batch=st.integers(1, 3))
    def reset(self, batch):
        self.cache.reset()
        self.batch, self.accepted, self.last = batch, torch.zeros(batch, 0, dtype=torch.long), None
        self.pad = None
        event("reset" + (", batch changed" if batch != self.accepted.shape[0] else ""))

    @invariant()
    def equals_recomputation(self):
        STEPS["model"] += 1
        fresh = self.model.new_cache(**CACHES[self.kind])
        n = self.accepted.shape[1]
        assert self.cache.seen == n
        if n == 0:
            assert len(self.cache) == 0
            return
        chunk = n if self.kind in ("full", "static", "padded") else MAX_POS // 2  # a rolling cache's text may
        with torch.no_grad():                                                   # outgrow the table
            for t0 in range(0, n, chunk):
                full = self.model(self.accepted[:, t0 : t0 + chunk], fresh, pad=self.pad if t0 == 0 else None)
        if self.pad is not None:  # each row alone, without its padding, computes the same last logits
            with torch.no_grad():
                for b in range(self.batch):
                    alone = self.model(self.accepted[b : b + 1, int(self.pad[b]) :]).logits[0, -1]
                    torch.testing.assert_close(self.last[b], alone, atol=1e-5, rtol=1e-5)
        assert len(self.cache) == len(fresh) and self.cache.seen == fresh.seen
        for layer in range(LAYERS):
            torch.testing.assert_close(self.cache.keys[layer], fresh.keys[layer], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(self.cache.values[layer], fresh.values[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(self.last, full.logits[:, -1], atol=1e-5, rtol=1e-5)


MLA = MultiHeadLatentAttention(embed_dim=16, num_heads=2, head_dim=8, kv_latent_dim=8, rope_dim=4,
                               max_positions=MAX_POS).eval()


class LatentCacheMachine(RuleBasedStateMachine):
    """The same for a latent-attention layer's :class:`LatentCache` (its one attention call may be refused)."""

    @initialize(batch=st.integers(1, 3), absorbed=st.booleans())
    def start(self, batch, absorbed):
        self.batch, self.absorbed = batch, absorbed
        self.cache = LatentCache()
        gen = torch.Generator().manual_seed(batch)
        self.x = torch.zeros(batch, 0, 16)
        self.pool = torch.randn(4, MAX_POS + 4, 16, generator=gen)  # inputs to draw from
        self.last = None

    def _snap(self):
        return tuple(None if t is None else t.clone() for t in (self.cache.latent, self.cache.rope_key))

    def _unchanged(self, before) -> bool:
        now = (self.cache.latent, self.cache.rope_key)
        return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                   for a, b in zip(before, now))

    @rule(n=st.integers(1, 5), how=st.sampled_from(["accept", "accept", "backend", "batch", "dtype"]))
    def call(self, n, how):
        past = self.x.shape[1]
        x = self.pool[: self.batch, past : past + n]  # (B, n, 16)
        before = self._snap()
        if how == "batch" and past == 0:  # an empty cache takes a batch of any size
            how = "accept"
        refuse = past + n > MAX_POS or how != "accept"
        if how == "batch":
            x = self.pool[: self.batch + 1, past : past + n]
        elif how == "dtype":
            x = x.double()
        _REFUSE["at"], _REFUSE["seen"] = (1 if how == "backend" else 0), 0
        backend = "test_refuses_nth" if how == "backend" else None
        if refuse:
            with pytest.raises((ValueError, TypeError)), torch.no_grad(), ac.use_backend(backend):
                MLA(x, self.cache, absorbed=self.absorbed)
            _REFUSE["at"] = 0
            assert self._unchanged(before)
            event(f"latent: refused ({'max_positions' if how == 'accept' else how})")
            return
        with torch.no_grad():
            out, _ = MLA(x, self.cache, absorbed=self.absorbed)
        self.x = torch.cat([self.x, x], dim=1)
        self.last = out[:, -1]
        event("latent: accepted")

    @rule(batch=st.integers(1, 3))
    def reset(self, batch):
        self.cache.reset()
        self.batch, self.x, self.last = batch, torch.zeros(batch, 0, 16), None

    @invariant()
    def equals_recomputation(self):
        STEPS["latent"] += 1
        assert len(self.cache) == self.x.shape[1]
        if self.x.shape[1] == 0:
            return
        fresh = LatentCache()
        with torch.no_grad():
            out, _ = MLA(self.x, fresh, absorbed=self.absorbed)
        torch.testing.assert_close(self.cache.latent, fresh.latent, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(self.cache.rope_key, fresh.rope_key, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(self.last, out[:, -1], atol=1e-5, rtol=1e-5)


def test_kv_cache_is_transactional():
    STEPS["model"] = 0
    KVCacheMachine.TestCase.settings = MACHINE
    KVCacheMachine.TestCase().runTest()
    print(f"KVCache state machine: {STEPS['model']} checked steps")
    assert STEPS["model"] >= RUNS[0]


def test_latent_cache_is_transactional():
    STEPS["latent"] = 0
    LatentCacheMachine.TestCase.settings = MACHINE
    LatentCacheMachine.TestCase().runTest()
    print(f"LatentCache state machine: {STEPS['latent']} checked steps")
    assert STEPS["latent"] >= RUNS[0]


class PagedSequenceMachine(RuleBasedStateMachine):
    """Sequence 0 of a paged pool, fed through the model; sometimes forked (sequence 1 then shares its blocks, and
    the next write copies the shared last block). A refused call, in any layer, must leave the pool as it was:
    the same table, length and visible tokens for both sequences, the same reference counts, no block lost."""

    BLOCK, BLOCKS = 3, 12

    @initialize()
    def start(self):
        self.pool = PagedKVCache(LAYERS, self.BLOCKS, self.BLOCK, num_kv_heads=1, head_dim=8)
        self.pool.add_sequence(0)
        self.accepted = torch.zeros(1, 0, dtype=torch.long)
        self.last = None
        self.forked = False

    def _state(self):
        seqs = sorted(self.pool.tables)
        visible = []
        for layer in range(LAYERS):
            table, lens = self.pool.block_table(seqs)
            for i in range(len(seqs)):
                visible.append(gather_paged_kv(self.pool.keys[layer], table[i], int(lens[i])).clone())
                visible.append(gather_paged_kv(self.pool.values[layer], table[i], int(lens[i])).clone())
        refs = [self.pool.allocator.refcount(b) for b in range(self.BLOCKS)]
        return ({s: list(t) for s, t in self.pool.tables.items()}, dict(self.pool.lengths), refs,
                sorted(self.pool.allocator._free), visible)

    @rule(seed=st.integers(0, 2**31), n=st.integers(1, 4))
    def feed(self, seed, n):
        tokens = _tokens(seed, 1, n)
        if self.accepted.shape[1] + n > MAX_POS or self.pool.blocks_needed(0, n) > self.pool.allocator.num_free:
            return
        with torch.no_grad():
            self.last = MODEL(tokens, self.pool.sequence_view(0)).logits[:, -1]
        self.accepted = torch.cat([self.accepted, tokens], dim=1)
        event("paged: " + ("prefill" if self.accepted.shape[1] == n else "decode"))

    @rule()
    def fork(self):
        if 1 in self.pool.tables:
            self.pool.free_sequence(1)
        self.pool.fork(0, 1)
        self.forked = True
        event("paged: fork")
        PAGED_EVENTS["fork"] = PAGED_EVENTS.get("fork", 0) + 1

    @rule(seed=st.integers(0, 2**31), n=st.integers(1, 3),
          how=st.sampled_from(["vocab", "backend, first layer", "backend, later layer", "out of blocks"]))
    def refused_call(self, seed, n, how):
        tokens = _tokens(seed, 1, n)
        if self.accepted.shape[1] + n > MAX_POS:
            return
        hog = []
        if how == "out of blocks":  # take every free block but as many as the call needs, less one
            if self.pool.blocks_needed(0, n) == 0:
                return
            while self.pool.allocator.num_free >= self.pool.blocks_needed(0, n):
                hog.append(self.pool.allocator.allocate())
        before = self._state()
        _REFUSE["at"], _REFUSE["seen"] = 0, 0
        if how == "vocab":
            tokens[0, -1] = V
        elif how.startswith("backend"):
            _REFUSE["at"] = 1 if how == "backend, first layer" else 1 + seed % (LAYERS - 1) + 1
        backend = "test_refuses_nth" if how.startswith("backend") else None
        with pytest.raises((ValueError, OutOfBlocks), match="tokens|refused on purpose|blocks"):
            with torch.no_grad(), ac.use_backend(backend):
                MODEL(tokens, self.pool.sequence_view(0))
        _REFUSE["at"] = 0
        after = self._state()
        assert before[:4] == after[:4], f"a refused call ({how}) changed the pool's tables or counts"
        assert all(torch.equal(a, b) for a, b in zip(before[4], after[4])), f"a refused call ({how}) changed tokens"
        for block in hog:
            self.pool.allocator.free(block)
        event(f"paged: refused ({how})")
        PAGED_EVENTS[how] = PAGED_EVENTS.get(how, 0) + 1

    @invariant()
    def equals_recomputation(self):
        STEPS["paged"] += 1
        n = self.accepted.shape[1]
        assert self.pool.lengths[0] == n
        if n == 0:
            return
        fresh = MODEL.new_cache()
        with torch.no_grad():
            full = MODEL(self.accepted, fresh)
        table, _ = self.pool.block_table([0])
        for layer in range(LAYERS):
            k = gather_paged_kv(self.pool.keys[layer], table[0], n)[None]  # (1, H, n, E)
            v = gather_paged_kv(self.pool.values[layer], table[0], n)[None]
            torch.testing.assert_close(k, fresh.keys[layer][:, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, fresh.values[layer][:, :, :n], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(self.last, full.logits[:, -1], atol=1e-5, rtol=1e-5)


def test_paged_sequence_is_transactional():
    STEPS["paged"] = 0
    PAGED_EVENTS.clear()
    PagedSequenceMachine.TestCase.settings = MACHINE
    PagedSequenceMachine.TestCase().runTest()
    print(f"paged sequence state machine: {STEPS['paged']} checked steps, {PAGED_EVENTS}")
    assert STEPS["paged"] >= RUNS[0]
    kinds = {"vocab", "backend, first layer", "backend, later layer", "out of blocks", "fork"}
    assert kinds <= set(PAGED_EVENTS), f"never drawn: {kinds - set(PAGED_EVENTS)}"
