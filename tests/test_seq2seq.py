"""Encoder-decoders: shapes, padding, decoding, gradients, errors (tiny models, CPU)."""

from __future__ import annotations

import pytest
import torch

from attention_core.translation.data import EOS_ID, PAD_ID, NumberWords, collate
from attention_core.translation.metrics import evaluate, exact_match, token_accuracy
from attention_core.translation.rnn import (
    BahdanauDecoder,
    Encoder,
    LuongDecoder,
    PlainDecoder,
    Seq2Seq,
    build_rnn_model,
    count_parameters,
    greedy_decode,
)

TASK = NumberWords(max_digits=6)
CONFIGS = {
    "plain": {"kind": "plain"},
    "bahdanau": {"kind": "bahdanau"},
    "luong-dot": {"kind": "luong", "score": "dot"},
    "luong-concat": {"kind": "luong", "score": "concat"},
    "luong-local-m": {"kind": "luong", "score": "general", "mode": "local-m", "window": 1},
    "luong-local-p": {"kind": "luong", "score": "general", "mode": "local-p", "window": 2},
}


def tiny(name: str, seed: int = 0) -> Seq2Seq:
    return build_rnn_model({**CONFIGS[name], "src_vocab_size": len(TASK.src_vocab),
                        "tgt_vocab_size": len(TASK.tgt_vocab), "embed_dim": 8, "hidden_dim": 6, "seed": seed})


def batch(n: int = 5, seed: int = 0):
    return collate(TASK.sample(n, seed), TASK.src_vocab, TASK.tgt_vocab)


@pytest.mark.parametrize("name", CONFIGS)
def test_teacher_forcing_shapes_and_padding(name: str) -> None:
    model, b = tiny(name), batch()
    logits, weights = model(b.src, b.src_valid_lens, b.tgt_in)
    B, T = b.tgt_in.shape
    assert logits.shape == (B, T, len(TASK.tgt_vocab))
    if name == "plain":
        assert weights is None and not model.has_attention
    else:
        assert weights.shape == (B, T, b.src.shape[1])
        real = (torch.arange(b.src.shape[1]) < b.src_valid_lens[:, None])  # (B, S)
        assert torch.all(weights.masked_select(~real[:, None, :]) == 0)


@pytest.mark.parametrize("name", CONFIGS)
def test_gradients_reach_every_parameter(name: str) -> None:
    model, b = tiny(name), batch(8)
    logits, _ = model(b.src, b.src_valid_lens, b.tgt_in)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), b.tgt_out.flatten(), ignore_index=PAD_ID).backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname


def test_extra_padding_does_not_change_the_result() -> None:
    model, b = tiny("bahdanau"), batch(4)
    extra = torch.cat([b.src, torch.full((4, 3), PAD_ID)], 1)  # (B, S) -> (B, S + 3)
    out1, w1 = model(b.src, b.src_valid_lens, b.tgt_in)
    out2, w2 = model(extra, b.src_valid_lens, b.tgt_in)
    torch.testing.assert_close(out1, out2)
    torch.testing.assert_close(w1, w2[..., : b.src.shape[1]])


def test_encoder_final_state_ignores_padding() -> None:
    torch.manual_seed(0)
    enc = Encoder(10, 4, 3, bidirectional=True)
    src = torch.tensor([[4, 5, 6, 0, 0]])
    alone = enc(src[:, :3], torch.tensor([3]))
    padded = enc(src, torch.tensor([3]))
    torch.testing.assert_close(alone.final, padded.final)
    assert torch.all(padded.outputs[:, 3:] == 0) and padded.mask.tolist() == [[True] * 3 + [False] * 2]


@pytest.mark.parametrize("name", ["plain", "bahdanau", "luong-local-p"])
def test_greedy_decode(name: str) -> None:
    model, b = tiny(name), batch(6)
    out = greedy_decode(model, b.src, b.src_valid_lens, max_len=7)
    assert out.tokens.shape[0] == 6 and out.tokens.shape[1] <= 7
    assert torch.all(out.lengths <= out.tokens.shape[1])
    for row, n in zip(out.tokens.tolist(), out.lengths.tolist()):
        if n < len(row):
            assert row[n] == EOS_ID and all(t == PAD_ID for t in row[n + 1:])
    if name == "plain":
        assert out.weights is None
    else:
        assert out.weights.shape == (*out.tokens.shape, b.src.shape[1])
    assert model.training  # greedy_decode restores the mode it found


def test_build_model_is_seeded() -> None:
    a, b, c = tiny("luong-concat", seed=1), tiny("luong-concat", seed=1), tiny("luong-concat", seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters()))
    assert count_parameters(a) == sum(p.numel() for p in a.parameters())


def test_metrics() -> None:
    assert exact_match(list("123"), list("123")) and not exact_match(list("12"), list("123"))
    assert token_accuracy(list("123"), list("123")) == 1.0
    assert token_accuracy(list("12"), list("123")) == 0.5  # 1, 2 right; 3 and <eos> wrong
    assert token_accuracy(list("1234"), list("123")) == 0.75  # <eos> missing
    model = tiny("bahdanau")
    ev = evaluate(model, TASK.sample(20, 0), TASK.src_vocab, TASK.tgt_vocab, batch_size=7)
    assert len(ev.exact) == 20 and 0 <= ev.exact_match <= ev.token_accuracy <= 1
    rows = ev.by_bucket([1, 5, 30])
    assert sum(r.count for r in rows) == 20 and rows[0].label == "1-4"


def test_bad_inputs_raise_clear_errors() -> None:
    model, b = tiny("bahdanau"), batch(3)
    too_long = b.src_valid_lens.clone()
    too_long[0] = b.src.shape[1] + 2
    with pytest.raises(ValueError, match=r"src_valid_lens must lie in \[1, S=\d+\] .* got \["):
        model(b.src, too_long, b.tgt_in)
    with pytest.raises(ValueError, match=r"src_valid_lens must be \(B,\) = \(3,\)"):
        model(b.src, b.src_valid_lens[:2], b.tgt_in)
    with pytest.raises(ValueError, match=r"src must be \(B, S\) int64 ids, got shape \(3, \d+\) dtype torch.float32"):
        model(b.src.float(), b.src_valid_lens, b.tgt_in)
    with pytest.raises(ValueError, match=r"config\['kind'\] must be one of .*got 'transformer'"):
        build_rnn_model({"kind": "transformer"})
    with pytest.raises(ValueError, match=r"score must be one of .*got 'bilinear'"):
        LuongDecoder(5, 4, 6, 6, score="bilinear")
    with pytest.raises(ValueError, match=r"mode must be one of .*got 'local-x'"):
        LuongDecoder(5, 4, 6, 6, mode="local-x")
    with pytest.raises(ValueError, match=r"^window must be .*, got -2$"):
        LuongDecoder(5, 4, 6, 6, mode="local-p", window=-2)
    with pytest.raises(ValueError, match="score='dot' needs query_dim == key_dim, got query_dim=6 and key_dim=8"):
        LuongDecoder(5, 4, 6, 8, score="dot")
    with pytest.raises(ValueError, match="encoder output size 12 differs from the decoder's enc_dim=10"):
        Seq2Seq(Encoder(5, 4, 6), BahdanauDecoder(5, 4, 6, 10))
    with pytest.raises(ValueError, match="max_len must be an int >= 1, got 0"):
        greedy_decode(model, b.src, b.src_valid_lens, max_len=0)
    assert isinstance(PlainDecoder(5, 4, 6, 6), torch.nn.Module)


@pytest.mark.parametrize("name", ["bahdanau", "luong-dot", "luong-concat"])
def test_attention_scores_are_the_logits_of_the_weights(name: str) -> None:
    from attention_core.functional import masked_softmax
    from attention_core.translation.rnn import alignment_scores

    model, b = tiny(name), batch(4)
    _, weights = model(b.src, b.src_valid_lens, b.tgt_in)
    scores = alignment_scores(model, b.src, b.src_valid_lens, b.tgt_in)
    real = torch.arange(b.src.shape[1]) < b.src_valid_lens[:, None]  # (B, S)
    torch.testing.assert_close(masked_softmax(scores, real[:, None, :]), weights)
    with pytest.raises(ValueError, match="model must have a Bahdanau or Luong decoder, got PlainDecoder"):
        alignment_scores(tiny("plain"), b.src, b.src_valid_lens, b.tgt_in)


@pytest.mark.parametrize("make, exc, words", [
    (lambda: Encoder(-3, 8, 8), ValueError, r"vocab_size must be an int >= 1, got -3"),
    (lambda: Encoder(10, 0, 8), ValueError, r"embed_dim must be an int >= 1, got 0"),
    (lambda: Encoder(10, 8, 8.0), TypeError, r"hidden_dim must be an int >= 1, got float 8.0"),
    (lambda: Encoder(10, 8, 8, bidirectional=1), TypeError, r"bidirectional must be a bool, got int 1"),
    (lambda: PlainDecoder(10, 8, -8, 16), ValueError, r"hidden_dim must be an int >= 1, got -8"),
    (lambda: BahdanauDecoder(10, 8, 8, 16, attn_dim=0), ValueError, r"attn_dim must be an int >= 1, got 0"),
    (lambda: LuongDecoder(10, 8, 8, -16), ValueError, r"enc_dim must be an int >= 1, got -16"),
    (lambda: LuongDecoder(10, 8, 8, 16, input_feeding="yes"), TypeError, r"input_feeding must be a bool"),
])
def test_rnn_constructors_refuse_bad_sizes_by_name(make, exc, words) -> None:
    with pytest.raises(exc, match=words):
        make()


def _m(name: str):
    import importlib
    return importlib.import_module("attention_core." + name)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: Seq2Seq("bad", PlainDecoder(10, 4, 4, 8)), TypeError, r"encoder must be an Encoder, got str"),
    (lambda: Seq2Seq(Encoder(10, 4, 4), "bad"), TypeError,
     r"decoder must be a PlainDecoder, BahdanauDecoder or LuongDecoder, got str"),
    (lambda: _m("translation.rnn").alignment_scores("bad", None, None, None), TypeError,
     r"model must be a Seq2Seq, got str"),
    (lambda: count_parameters([1]), TypeError, r"model must be an nn.Module, got list"),
    (lambda: evaluate("bad", []), TypeError, r"model must be a translation model \(an nn.Module\), got str"),
    (lambda: _m("translation.metrics").evaluate_by_bucket(-3, []), TypeError, r"model must be a translation model"),
    (lambda: _m("translation.train").sequence_loss([[1.0]], torch.zeros(1, 1, dtype=torch.long)), TypeError,
     r"logits must be a torch.Tensor, got list"),
    (lambda: _m("translation.train").sequence_loss(torch.zeros(1, 1, 3), [[0]]), TypeError,
     r"tgt_out must be a torch.Tensor, got list"),
    (lambda: _m("translation.sweep").run_one("bad", 1e-3, 0), ValueError, r"name must be one of \["),
    (lambda: _m("translation.studies").study_main("bad", "d", "out.json", {}), TypeError,
     r"argv must be None or a list of str, got 'bad'"),
])
def test_translation_helpers_refuse_bad_arguments_by_name(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.parametrize("fn", [exact_match, token_accuracy])
@pytest.mark.parametrize("prediction, target, pattern", [
    ([[1.0]], [[1.0]], r"prediction\[0\] must be a str token, got list \[1.0\]"),
    ([1.0, 2.0], ["1"], r"prediction\[0\] must be a str token, got float 1.0"),
    ("bad", ["1"], r"prediction must be a list of str tokens, got str 'bad'"),
    (["1"], -3, r"target must be a list of str tokens, got int -3"),
])
def test_metrics_refuse_non_token_lists(fn, prediction, target, pattern):
    with pytest.raises(TypeError, match=pattern):
        fn(prediction, target)
    assert fn(("1", "2"), ["1", "2"]) == 1  # a tuple of tokens still scores
