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

Crops and restores are drawn too: a full cache is cut back (a rolling one refuses), snapshots are taken and
restored after anything (crops, appends, refusals, resets), and the restored cache must hold exactly what the
snapshot saw; the paged sequence also draws the allocator's and the pool's refusals (bad block ids, double
frees, unknown sequences, wrong writes) and checks that no block is lost. A scheduler machine grows a request
trace with bad requests and settings among good ones: every refusal is immediate (each call runs under a time
limit, so a hang fails), and both simulators and the real engine finish every request.

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
from test_scheduler import within

import attention_core as ac
from attention_core.backends import Backend, register_backend
from attention_core.models import language_model as lm
from attention_core.models.latent_attention import LatentCache, MultiHeadLatentAttention
from attention_core.paged_attention import gather_paged_kv
from attention_core.serving.blocks import OutOfBlocks, PagedKVCache
from attention_core.serving.engine import serve
from attention_core.serving.scheduler import Request, continuous_batching, static_batching

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
CACHE_EVENTS: dict = {}  # crops, refused crops and restores of the KVCache machine
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
        CACHE_EVENTS[how] = CACHE_EVENTS.get(how, 0) + 1

    @rule(batch=st.integers(1, 3))
    def reset(self, batch):
        self.cache.reset()
        self.batch, self.accepted, self.last = batch, torch.zeros(batch, 0, dtype=torch.long), None
        self.pad = None
        self.snaps = []
        event("reset" + (", batch changed" if batch != self.accepted.shape[0] else ""))

    @rule(data=st.data())
    def crop(self, data):
        """A full cache is cut back to n tokens (speculative decoding's roll-back); a rolling cache, or n past
        what it holds, is refused and changes nothing."""
        n_held = self.accepted.shape[1]
        low = 0 if self.pad is None else int(self.pad.max()) + 1  # a padded row keeps a real token
        rolling = self.kind in ("window", "sinks")
        if rolling or n_held < low or data.draw(st.integers(0, 4)) == 0:
            before = _state(self.cache)
            n = data.draw(st.integers(0, n_held)) if rolling else n_held + data.draw(st.integers(1, 3))
            with pytest.raises(ValueError, match="crop|n="):
                self.cache.crop(n)
            assert _same_state(before, _state(self.cache)), "a refused crop changed the cache"
            event("refused: crop")
            CACHE_EVENTS["refused: crop"] = CACHE_EVENTS.get("refused: crop", 0) + 1
            return
        n = data.draw(st.integers(low, n_held))
        self.cache.crop(n)
        self.accepted, self.last = self.accepted[:, :n], None
        event("crop")
        CACHE_EVENTS["crop"] = CACHE_EVENTS.get("crop", 0) + 1

    @rule()
    def snapshot(self):
        self.snaps = getattr(self, "snaps", [])[-2:] + [(self.cache.snapshot(), self.accepted.clone(), self.last,
                                                         _state(self.cache), self.pad)]
        event("snapshot")

    @rule(data=st.data())
    def restore(self, data):
        """Back to a snapshot taken earlier, whatever happened since (crops, appends, refusals): exactly."""
        if not getattr(self, "snaps", []):
            return
        snap, accepted, last, state, pad = data.draw(st.sampled_from(self.snaps))
        if accepted.shape[0] != self.batch:  # a reset changed the batch: the snapshot is of the old one
            return
        self.cache.restore(snap)
        self.accepted, self.last, self.pad = accepted.clone(), last, pad
        assert _same_state(state, _state(self.cache)), "restore did not give back the snapshot's cache"
        event("restore")
        CACHE_EVENTS["restore"] = CACHE_EVENTS.get("restore", 0) + 1

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
        if self.pad is not None and self.last is not None:  # each row alone, without its padding, computes the same
            with torch.no_grad():
                for b in range(self.batch):
                    alone = self.model(self.accepted[b : b + 1, int(self.pad[b]) :]).logits[0, -1]
                    torch.testing.assert_close(self.last[b], alone, atol=1e-5, rtol=1e-5)
        assert len(self.cache) == len(fresh) and self.cache.seen == fresh.seen
        for layer in range(LAYERS):
            torch.testing.assert_close(self.cache.keys[layer], fresh.keys[layer], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(self.cache.values[layer], fresh.values[layer], atol=1e-5, rtol=1e-5)
        if self.last is not None:
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

    @rule(take=st.booleans())
    def snapshot_or_restore(self, take):
        """A snapshot, or a restore of the last one (whatever was appended or reset since): exactly."""
        if take or not hasattr(self, "snap"):
            self.snap = (self.cache.snapshot(), self._snap(), self.x.clone(), self.last, self.batch)
            return
        snap, tensors, x, last, batch = self.snap
        self.cache.restore(snap)
        assert self._unchanged(tensors), "restore did not give back the snapshot's latents"
        self.x, self.last, self.batch = x.clone(), last, batch
        event("latent: restore")

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
    CACHE_EVENTS.clear()
    KVCacheMachine.TestCase.settings = MACHINE
    KVCacheMachine.TestCase().runTest()
    print(f"KVCache state machine: {STEPS['model']} checked steps, {CACHE_EVENTS}")
    assert STEPS["model"] >= RUNS[0]
    kinds = {"vocab high", "vocab negative", "batch", "backend, first layer", "backend, later layer", "crop",
             "refused: crop", "restore"}
    assert kinds <= set(CACHE_EVENTS), f"never drawn: {kinds - set(CACHE_EVENTS)}"


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
        after = self._state()  # no gc.collect(): the call released its snapshot, whatever still refers to it
        assert before[:4] == after[:4], f"a refused call ({how}) changed the pool's tables or counts"
        assert set(self.pool._live.get(0, ())) <= {s[0] for s in getattr(self, "snaps", [])}, \
            f"a refused call ({how}) left its snapshot live (pinning blocks until it is collected)"
        assert all(torch.equal(a, b) for a, b in zip(before[4], after[4])), f"a refused call ({how}) changed tokens"
        for block in hog:
            self.pool.allocator.free(block)
        event(f"paged: refused ({how})")
        PAGED_EVENTS[how] = PAGED_EVENTS.get(how, 0) + 1

    def _note(self, kind):
        event(f"paged: {kind}")
        PAGED_EVENTS[kind] = PAGED_EVENTS.get(kind, 0) + 1

    @rule(data=st.data())
    def crop(self, data):
        """Sequence 0 cut back to n tokens, in the pool (blocks past them let go of); n past its length refused."""
        n_held = self.accepted.shape[1]
        view = self.pool.sequence_view(0)
        if data.draw(st.integers(0, 4)) == 0:
            before = self._state()
            with pytest.raises(ValueError, match="n"):
                view.crop(n_held + data.draw(st.integers(1, 3)))
            assert before[:4] == self._state()[:4], "a refused crop changed the pool"
            self._note("refused crop")
            return
        n = data.draw(st.integers(0, n_held))
        view.crop(n)
        self.accepted, self.last = self.accepted[:, :n], None
        assert self.pool.lengths[0] == n and len(self.pool.tables[0]) == -(-n // self.BLOCK)
        self._note("crop")

    @rule()
    def snapshot(self):
        snaps = getattr(self, "snaps", [])
        for dropped in snaps[:-1]:
            dropped[0].release()  # explicitly: the pool's counts never wait for the garbage collector
        self.snaps = snaps[-1:] + [(self.pool.sequence_view(0).snapshot(), self.accepted.clone(), self.last,
                                    self._state())]
        self._note("snapshot")

    @rule(data=st.data())
    def release(self, data):
        """A snapshot released gives its pinned blocks back at once, and can no longer be restored."""
        if not getattr(self, "snaps", []):
            return
        i = data.draw(st.integers(0, len(self.snaps) - 1))
        snap = self.snaps.pop(i)[0]
        pins = list(snap.pins)
        free = self.pool.allocator.num_free
        snap.release()
        assert snap not in set(self.pool._live.get(0, ())) and snap.pins == []
        assert self.pool.allocator.num_free == free + sum(self.pool.allocator.refcount(b) == 0 for b in set(pins))
        before = self._state()
        with pytest.raises(ValueError, match="released"):
            self.pool.sequence_view(0).restore(snap)
        assert before[:4] == self._state()[:4], "restoring a released snapshot changed the pool"
        self._note("release")

    @rule(data=st.data())
    def restore(self, data):
        """Back to an earlier snapshot of sequence 0, whatever happened since (crops, appends, forks)."""
        if not getattr(self, "snaps", []):
            self.snapshot()
            return
        snap, accepted, last, state = data.draw(st.sampled_from(self.snaps))
        self.pool.sequence_view(0).restore(snap)
        self.accepted, self.last = accepted.clone(), last
        now = self._state()
        assert now[0][0] == state[0][0] and now[1][0] == state[1][0], "restore gave back another table or length"
        i = sorted(state[0]).index(0)  # sequence 0's tokens, in every layer, as they were
        n_seqs = len(state[0])
        for layer in range(LAYERS):
            for kv in range(2):
                old = state[4][layer * 2 * n_seqs + 2 * i + kv]
                new = now[4][layer * 2 * len(now[0]) + 2 * sorted(now[0]).index(0) + kv]
                assert torch.equal(old, new), "restore gave back other tokens"
        self._note("restore")

    @rule()
    def refused_bookkeeping(self):
        """The allocator and the pool refuse bad ids, double frees and wrong writes, changing nothing: every kind is
        tried at each firing of this rule (drawn one at a time, a short derandomized run could miss some)."""
        alloc = self.pool.allocator
        for how in ("free -1", "free out of range", "double free", "fork a free block", "free a float",
                    "unknown sequence", "write a wrong dtype", "fork onto an existing child"):
            before = self._state()
            free_block = alloc._free[-1] if alloc._free else None
            if free_block is None and how in ("double free", "fork a free block"):
                continue
            calls = {"free -1": lambda: alloc.free(-1), "free out of range": lambda: alloc.free(self.BLOCKS),
                     "double free": lambda b=free_block: alloc.free(b),
                     "fork a free block": lambda b=free_block: alloc.fork(b),
                     "free a float": lambda: alloc.free(0.0), "unknown sequence": lambda: self.pool.reserve(7, 1),
                     "write a wrong dtype": lambda: self.pool.write(0, 0, range(0, 0), torch.zeros(1, 0, 8).double(),
                                                                    torch.zeros(1, 0, 8).double()),
                     "fork onto an existing child": lambda: self.pool.fork(0, 0)}
            with pytest.raises((TypeError, ValueError)):
                calls[how]()
            after = self._state()
            assert before[:4] == after[:4], f"a refused call ({how}) changed the pool's bookkeeping"
            self._note(how)

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
        if self.last is not None:
            torch.testing.assert_close(self.last, full.logits[:, -1], atol=1e-5, rtol=1e-5)

    @invariant()
    def no_block_lost(self):
        """Every block is free, or held by a table or a live snapshot's pin, exactly as often as counted."""
        alloc = self.pool.allocator
        owners = [0] * self.BLOCKS
        for table in self.pool.tables.values():
            for b in table:
                owners[b] += 1
        for snaps in self.pool._live.values():
            for snap in snaps:
                for b in snap.pins:
                    owners[b] += 1
        assert [alloc.refcount(b) for b in range(self.BLOCKS)] == owners
        assert sorted(alloc._free) == [b for b in range(self.BLOCKS) if owners[b] == 0]


def test_paged_sequence_is_transactional():
    STEPS["paged"] = 0
    PAGED_EVENTS.clear()
    PagedSequenceMachine.TestCase.settings = settings(MACHINE, stateful_step_count=2 * RUNS[1])  # more rules
    PagedSequenceMachine.TestCase().runTest()
    print(f"paged sequence state machine: {STEPS['paged']} checked steps, {PAGED_EVENTS}")
    assert STEPS["paged"] >= RUNS[0]
    kinds = {"vocab", "backend, first layer", "backend, later layer", "out of blocks", "fork", "crop", "refused crop",
             "snapshot", "restore", "release", "free -1", "free out of range", "double free", "fork a free block",
             "free a float", "unknown sequence", "write a wrong dtype", "fork onto an existing child"}
    assert kinds <= set(PAGED_EVENTS), f"never drawn: {kinds - set(PAGED_EVENTS)}"


# ------------------------------------------------------------------------------------------------ scheduler

SCHED_EVENTS: dict = {}
TINY = lm.build_language_model(dict(vocab_size=V, d_model=8, num_layers=1, num_heads=2, max_positions=24, seed=0))


class SchedulerMachine(RuleBasedStateMachine):
    """A request trace grows request by request; bad requests and bad settings are refused at once (never a
    hang: every call runs under a time limit), and after every step both simulators and the real engine
    finish every request with its tokens, at most ``max_batch`` at a time, the engine in the simulator's steps."""

    @initialize(max_batch=st.integers(1, 3))
    def start(self, max_batch):
        self.max_batch, self.trace = max_batch, []

    def _note(self, kind):
        event(f"scheduler: {kind}")
        SCHED_EVENTS[kind] = SCHED_EVENTS.get(kind, 0) + 1

    @rule(arrival=st.integers(0, 4), prompt=st.integers(1, 5), out=st.integers(1, 5))
    def add(self, arrival, prompt, out):
        if len(self.trace) < 5:
            self.trace.append(Request(len(self.trace), arrival, prompt, out))
            self._note("add")

    @rule(how=st.sampled_from(["fractional prompt_len", "fractional output_len", "zero output_len",
                               "negative arrival", "repeated rid", "bool field", "max_batch 0",
                               "fractional max_batch"]))
    def refused(self, how):
        trace, max_batch = list(self.trace), self.max_batch
        bad = {"fractional prompt_len": Request(99, 0, 2.5, 1), "fractional output_len": Request(99, 0, 2, 1.5),
               "zero output_len": Request(99, 0, 2, 0), "negative arrival": Request(99, -1, 2, 1),
               "repeated rid": Request(trace[0].rid if trace else 99, 0, 2, 1), "bool field": Request(99, 0, True, 1)}
        if how in bad:
            trace = trace + [bad[how]] + ([] if trace or how != "repeated rid" else [bad[how]])
        else:
            max_batch = 0 if how == "max_batch 0" else 1.5
        prompts = {r.rid: torch.zeros(2, dtype=torch.long) for r in trace}
        for fn, args in ((static_batching, (trace, max_batch)), (continuous_batching, (trace, max_batch)),
                         (serve, (TINY, trace, prompts, max_batch))):
            with pytest.raises((TypeError, ValueError)):
                within(30, fn, *args)
        self._note(how)

    @invariant()
    def every_request_finishes(self):
        if not self.trace:
            return
        for simulate in (static_batching, continuous_batching):
            res = within(30, simulate, self.trace, self.max_batch)
            last: dict = {}
            for running in res.running:
                assert len(running) <= self.max_batch
                last.update(running)
            assert last == {r.rid: r.output_len for r in self.trace}
        if len(self.trace) % 2:  # the real engine, every other trace length (it runs a model)
            g = torch.Generator().manual_seed(len(self.trace))
            prompts = {r.rid: torch.randint(0, V, (r.prompt_len,), generator=g) for r in self.trace}
            out, steps, _ = within(60, serve, TINY, self.trace, prompts, self.max_batch, num_blocks=64,
                                   block_size=4)
            assert steps == continuous_batching(self.trace, self.max_batch).steps
            assert {i: len(t) for i, t in out.items()} == {r.rid: r.output_len for r in self.trace}


def test_scheduler_and_engine_refuse_at_once_and_always_finish():
    SCHED_EVENTS.clear()
    SchedulerMachine.TestCase.settings = MACHINE
    SchedulerMachine.TestCase().runTest()
    print(f"scheduler state machine: {SCHED_EVENTS}")
    kinds = {"add", "fractional prompt_len", "fractional output_len", "zero output_len", "negative arrival",
             "repeated rid", "bool field", "max_batch 0", "fractional max_batch"}
    assert kinds <= set(SCHED_EVENTS), f"never drawn: {kinds - set(SCHED_EVENTS)}"
