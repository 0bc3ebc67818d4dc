"""The wing and model methods a reader calls directly refuse junk by name (referee refapio's method sweep):
``record_in_manifest``, ``MiniLM``, ``KVCache``'s methods, the RNN ``Encoder``, ``Vocab.encode``, ``NumberWords``
and ``mask_mods.check_captured``. Each case: the error type, and a message naming the argument and the value seen."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from attention_core import mask_mods
from attention_core.models.bert import BertConfig, BertEncoder
from attention_core.models.kv_cache import KVCache
from attention_core.pretrained.minilm import MiniLM
from attention_core.training.checkpoint import read_manifest, record_in_manifest
from attention_core.translation.data import NumberWords, Vocab
from attention_core.translation.rnn import Encoder


def _raises(call, exc, *words):
    with pytest.raises(exc) as info:
        call()
    for w in words:
        assert re.search(re.escape(w), str(info.value)), (w, str(info.value))


# ------------------------------------------------------------------ record_in_manifest


@pytest.mark.parametrize("name, entry, exc, words", [
    (-3, {}, TypeError, ("name", "-3")),
    ("", {}, ValueError, ("name", "''")),
    (["x"], {}, TypeError, ("name", "list")),
    ("x", "bad", TypeError, ("entry", "'bad'")),
    ("y", -3, TypeError, ("entry", "-3")),
    ("z", ["a"], TypeError, ("entry", "list")),
    ("w", {}, ValueError, ("'w'", "lacks 'file'", "lacks 'recipe'")),
    ("w", {"file": "w.pt"}, ValueError, ("lacks 'recipe'",)),
    ("w", {"recipe": {}}, ValueError, ("lacks 'file'",)),
    ("w", {"file": 3, "recipe": {}}, ValueError, ("'file' = 3",)),
    ("w", {"file": "w.pt", "recipe": "r"}, ValueError, ("'recipe' = 'r'",)),
    ("w", {"file": "w.pt", "recipe": {}, "sha256": 5}, ValueError, ("'sha256' = 5",)),
    ("w", {"file": "w.pt", "recipe": {"steps": {1, 2}}}, TypeError, ("'w'", "JSON", "set")),
])
def test_record_in_manifest_refuses_before_writing(tmp_path, name, entry, exc, words):
    record_in_manifest(tmp_path, "kept", {"file": "kept.pt", "recipe": {}})
    before = (tmp_path / "manifest.json").read_text()
    _raises(lambda: record_in_manifest(tmp_path, name, entry), exc, *words)
    assert (tmp_path / "manifest.json").read_text() == before  # nothing written
    assert json.loads(before) == {"kept": {"file": "kept.pt", "recipe": {}}}
    fresh = tmp_path / "fresh"
    _raises(lambda: record_in_manifest(fresh, name, entry), exc, *words)
    assert not fresh.exists()  # not even the folder


def test_record_in_manifest_still_records(tmp_path):
    record_in_manifest(tmp_path, "a", {"file": "a.pt", "sha256": None, "recipe": {"steps": 3}})
    assert read_manifest(tmp_path) == {"a": {"file": "a.pt", "sha256": None, "recipe": {"steps": 3}}}


# ------------------------------------------------------------------ MiniLM


def _tiny_bert() -> BertEncoder:
    return BertEncoder(BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, max_position_embeddings=16))


class _Tok:
    def encode_batch(self, texts):
        return []

    def id_to_token(self, i):
        return "x"


@pytest.mark.parametrize("model, tokenizer, words", [
    ("bad", _Tok(), ("model", "BertEncoder", "'bad'")),
    (-3, _Tok(), ("model", "-3")),
    (None, _Tok(), ("model", "NoneType")),
    ("tiny", "bad", ("tokenizer", "'bad'")),
    ("tiny", -3, ("tokenizer", "-3")),
    ("tiny", None, ("tokenizer", "NoneType")),
])
def test_minilm_checks_model_and_tokenizer(model, tokenizer, words):
    model = _tiny_bert() if model == "tiny" else model
    _raises(lambda: MiniLM(model, tokenizer), TypeError, *words)


def test_minilm_takes_a_bert_and_a_tokenizer():
    mini = MiniLM(_tiny_bert(), _Tok())
    assert mini.config.hidden_size == 8


# ------------------------------------------------------------------ KVCache


def _filled(num_layers=2, **kw) -> KVCache:
    cache = KVCache(num_layers, **kw)
    for layer in range(num_layers):
        cache.update(layer, torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    cache.step_done(3)
    return cache


@pytest.mark.parametrize("method, args, exc, words", [
    ("step_done", (-3,), ValueError, ("new_tokens", "-3")),
    ("step_done", ("bad",), TypeError, ("new_tokens", "'bad'")),
    ("step_done", (1.5,), TypeError, ("new_tokens", "1.5")),
    ("step_done", (True,), TypeError, ("new_tokens", "True")),
    ("held", (-3,), ValueError, ("layer", "-3")),
    ("held", (2,), ValueError, ("layer", "2")),
    ("held", ("bad",), TypeError, ("layer", "'bad'")),
    ("state", (-3,), ValueError, ("layer", "-3")),
    ("state", ([0],), TypeError, ("layer", "list")),
    ("set_state", (-3, None), ValueError, ("layer", "-3")),
    ("set_state", ("bad", None), TypeError, ("layer", "'bad'")),
    ("check_room", ("bad",), TypeError, ("L", "'bad'")),
    ("check_room", (-3,), ValueError, ("L", "-3")),
    ("positions", (-3,), ValueError, ("L", "-3")),
    ("positions", ("bad",), TypeError, ("L", "'bad'")),
    ("update", (-3, torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)), ValueError, ("layer", "-3")),
    ("update", (0, "bad", torch.randn(1, 2, 1, 4)), TypeError, ("key", "str")),
    ("update", (0, torch.randn(1, 2, 1, 4), [1.0]), TypeError, ("value", "list")),
    ("update", (0, torch.randn(2, 1, 4), torch.randn(1, 2, 1, 4)), ValueError, ("key", "(2, 1, 4)")),
    ("set_padding", ("bad",), TypeError, ("pad", "str")),
    ("set_padding", (torch.zeros(1, 2, dtype=torch.long),), ValueError, ("pad", "(1, 2)")),
    ("set_padding", (torch.zeros(2),), ValueError, ("pad", "torch.float32")),
])
def test_kv_cache_methods_refuse_by_name(method, args, exc, words):
    cache = _filled(max_len=8)
    before = (cache.seen, list(cache._len), cache.pad)
    _raises(lambda: getattr(cache, method)(*args), exc, *words)
    assert (cache.seen, list(cache._len), cache.pad) == before  # a refused call changes nothing


def test_kv_cache_step_done_negative_leaves_seen():
    cache = _filled()
    with pytest.raises(ValueError, match="new_tokens"):
        cache.step_done(-3)
    assert cache.seen == 3
    cache.step_done(0)  # zero tokens is a valid (empty) step
    assert cache.seen == 3 and cache.held(1) == 3
    cache.check_room(0)


# ------------------------------------------------------------------ translation


def _src():
    return torch.tensor([[4, 5, 6], [7, 8, 0]]), torch.tensor([3, 2])


@pytest.mark.parametrize("src, lens, exc, words", [
    (_src()[0].float(), _src()[1], TypeError, ("src", "torch.float32")),
    ("bad", _src()[1], TypeError, ("src", "'bad'")),
    (_src()[0][0], _src()[1], ValueError, ("src", "(3,)")),
    (_src()[0] + 20, _src()[1], ValueError, ("src", "max 28")),
    (_src()[0] - 5, _src()[1], ValueError, ("src", "min -5")),
    (_src()[0], torch.tensor([3, -3]), ValueError, ("src_valid_lens", "min -3")),
    (_src()[0], torch.tensor([4, 2]), ValueError, ("src_valid_lens", "max 4")),
    (_src()[0], torch.tensor([3.0, 2.0]), TypeError, ("src_valid_lens", "torch.float32")),
    (_src()[0], [3, 2], TypeError, ("src_valid_lens", "list")),
    (_src()[0], torch.tensor([3, 2, 1]), ValueError, ("src_valid_lens", "(3,)")),
])
def test_encoder_forward_refuses_by_name(src, lens, exc, words):
    torch.manual_seed(0)
    enc = Encoder(10, 4, 5)
    _raises(lambda: enc(src, lens), exc, *words)


def test_encoder_forward_still_encodes():
    torch.manual_seed(0)
    enc = Encoder(10, 4, 5)
    out = enc(*_src())
    assert out.outputs.shape == (2, 3, 10)


@pytest.mark.parametrize("tokens, words", [
    ("bad", ("tokens", "'bad'")),
    (-3, ("tokens", "-3")),
    (["one", 2], ("tokens[1]", "2")),
])
def test_vocab_encode_refuses_a_string(tokens, words):
    _raises(lambda: Vocab(["one", "two"]).encode(tokens), TypeError, *words)


@pytest.mark.parametrize("method, args, exc, words", [
    ("sample", (-3, 0), ValueError, ("n", "-3")),
    ("sample", ("bad", 0), TypeError, ("n", "'bad'")),
    ("sample", (2, "bad"), TypeError, ("seed", "'bad'")),
    ("sample", (2, 1.5), TypeError, ("seed", "1.5")),
    ("stream", (-3, 0), ValueError, ("batch_size", "-3")),
    ("stream", (0, 0), ValueError, ("batch_size", "0")),
    ("stream", ("bad", 0), TypeError, ("batch_size", "'bad'")),
    ("stream", (2, [0]), TypeError, ("seed", "list")),
    ("number", ("bad",), TypeError, ("rng", "'bad'")),
    ("number", (-3,), TypeError, ("rng", "-3")),
    ("pair", ("bad",), TypeError, ("rng", "'bad'")),
    ("pair", ([1],), TypeError, ("rng", "list")),
])
def test_number_words_methods_refuse_by_name(method, args, exc, words):
    _raises(lambda: getattr(NumberWords(), method)(*args), exc, *words)  # stream: at the call, not on next()


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(zero_prob="0.5"), TypeError, ("zero_prob", "'0.5'")),
    (dict(zero_prob=True), TypeError, ("zero_prob", "bool")),
    (dict(and_prob=None), TypeError, ("and_prob", "None")),
    (dict(and_prob=1.5), ValueError, ("and_prob", "1.5")),
    (dict(zero_prob=-0.1), ValueError, ("zero_prob", "-0.1")),
    (dict(zero_prob=float("nan")), ValueError, ("zero_prob", "nan")),
])
def test_number_words_refuses_a_probability_that_is_not_one(kwargs, exc, words):
    _raises(lambda: NumberWords(**kwargs), exc, *words)


def test_vocab_decode_reads_unknown_ids_as_unk():
    vocab = Vocab(["one", "two"])
    assert vocab.decode([1, 4, 5, 99, -1, 0, 2, 4]) == ["one", "two", "<unk>", "<unk>"]


def test_number_words_valid_calls_unchanged():
    words = NumberWords()
    assert words.sample(3, 7) == words.sample(3, 7) and len(words.sample(0, 7)) == 0
    assert words.pair(random.Random(1)) == words.pair(random.Random(1))
    batch = next(words.stream(4, 0))
    assert batch.src.shape[0] == 4


# ------------------------------------------------------------------ check_captured


@pytest.mark.parametrize("args, exc, words", [
    (("bad", 1, 1, 1, 1, torch.device("cpu")), TypeError, ("mod", "'bad'")),
    ((None, -3, 1, 1, 1, torch.device("cpu")), ValueError, ("B", "-3")),
    ((None, 1, "bad", 1, 1, torch.device("cpu")), TypeError, ("H", "'bad'")),
    ((None, 1, 1, -3, 1, torch.device("cpu")), ValueError, ("L", "-3")),
    ((None, 1, 1, 1, 2.5, torch.device("cpu")), TypeError, ("S", "2.5")),
    ((None, 1, 1, 1, 1, -3), TypeError, ("device", "-3")),
])
def test_check_captured_checks_its_arguments(args, exc, words):
    _raises(lambda: mask_mods.check_captured(*args), exc, *words)


def test_check_captured_passes_valid_calls():
    mask_mods.check_captured(None, 2, 4, 8, 8, torch.device("cpu"))
    mask_mods.check_captured(mask_mods.causal, 2, 4, 8, 8, torch.device("cpu"))


def test_read_manifest_after_refusals(tmp_path):
    for entry in ("bad", -3):
        with pytest.raises(TypeError):
            record_in_manifest(tmp_path, "x", entry)
    assert read_manifest(tmp_path) == {}
