"""Decoder blocks and the encoder-decoder Transformer: PyTorch parity, causality, decoding, checkpoints."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

import attention_core as ac
from attention_core.models.transformer import TransformerDecoder, TransformerDecoderLayer
from attention_core.training.checkpoint import (
    MANIFEST,
    TrainLog,
    load_checkpoint,
    recipe_entry,
    record_in_manifest,
    save_checkpoint,
)
from attention_core.translation.data import NumberWords, collate
from attention_core.translation.rnn import greedy_decode
from attention_core.translation.train import CHECKPOINT_DIR, RECIPES, build_model, load_or_train, sequence_loss
from attention_core.translation.transformer import Seq2SeqTransformer, build_transformer

TRANSFORMER_RECIPE = RECIPES["transformer"]

B, T, S, D, H, FF = 2, 5, 7, 16, 4, 32
ATOL = 1e-5


def _torch_decoder_layer(norm_first: bool, activation: str = "relu") -> nn.TransformerDecoderLayer:
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(D, H, dim_feedforward=FF, dropout=0.0, activation=activation,
                                       norm_first=norm_first, batch_first=True)
    with torch.no_grad():  # LayerNorms start at (1, 0): perturb them so a mix-up of norm1..3 would show
        for norm in (layer.norm1, layer.norm2, layer.norm3):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    return layer.eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x, memory = torch.randn(B, T, D, generator=g), torch.randn(B, S, D, generator=g)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, 4:] = False  # the second source has 4 real tokens
    return x, memory, keep


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_layer_from_torch_equals_pytorch(norm_first: bool, activation: str) -> None:
    ref = _torch_decoder_layer(norm_first, activation)
    ours = TransformerDecoderLayer.from_torch(ref)
    x, memory, keep = _inputs()
    causal = ac.causal_mask(T)
    with torch.no_grad():
        expected = ref(x, memory, tgt_mask=~causal, memory_key_padding_mask=~keep)  # torch: True = blocked
        got, w = ours(x, memory, tgt_is_causal=True, memory_key_padding_mask=keep, need_weights=True)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(ours(x, memory, tgt_mask=causal, memory_key_padding_mask=keep)[0], expected,
                                   atol=ATOL, rtol=0)
    assert w.self_attn.shape == (B, H, T, T) and w.cross_attn.shape == (B, H, T, S)
    assert torch.all(w.self_attn[..., ~causal] == 0)  # no query sees a later target token
    assert torch.all(w.cross_attn[1, :, :, 4:] == 0)  # nor a padded source token
    torch.testing.assert_close(w.cross_attn.sum(-1), torch.ones(B, H, T))


def test_decoder_stack_from_torch_equals_pytorch() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(D, H, FF, dropout=0.0, batch_first=True, norm_first=True)
    ref = nn.TransformerDecoder(layer, num_layers=2, norm=nn.LayerNorm(D)).eval()
    ours = TransformerDecoder.from_torch(ref)
    x, memory, keep = _inputs()
    with torch.no_grad():
        expected = ref(x, memory, tgt_mask=~ac.causal_mask(T), memory_key_padding_mask=~keep)
        out = ours(x, memory, need_weights=True, tgt_is_causal=True, memory_key_padding_mask=keep)
    torch.testing.assert_close(out.last_hidden_state, expected, atol=ATOL, rtol=0)
    assert len(out.self_attentions) == len(out.cross_attentions) == 2


def _model(**overrides: object) -> tuple[Seq2SeqTransformer, NumberWords]:
    task = NumberWords(max_digits=6)
    config = {"src_vocab_size": len(task.src_vocab), "tgt_vocab_size": len(task.tgt_vocab), "d_model": 16,
              "num_heads": 2, "num_encoder_layers": 1, "num_decoder_layers": 2, "dim_feedforward": 32,
              "dropout": 0.0, **overrides}
    return build_transformer(config), task


def test_seq2seq_shapes_and_attention_maps() -> None:
    model, task = _model()
    batch = collate(task.sample(3, seed=0), task.src_vocab, task.tgt_vocab)
    logits, att = model(batch.src, batch.src_valid_lens, batch.tgt_in, need_weights=True)
    Bb, Ss = batch.src.shape
    Tt = batch.tgt_in.shape[1]
    assert logits.shape == (Bb, Tt, len(task.tgt_vocab))
    assert [a.shape for a in att.encoder] == [(Bb, 2, Ss, Ss)]
    assert [a.shape for a in att.decoder_self] == [(Bb, 2, Tt, Tt)] * 2
    assert [a.shape for a in att.cross] == [(Bb, 2, Tt, Ss)] * 2
    assert model(batch.src, batch.src_valid_lens, batch.tgt_in)[1] is None


def test_padding_and_future_tokens_do_not_change_the_logits() -> None:
    model, task = _model()
    batch = collate(task.sample(4, seed=1), task.src_vocab, task.tgt_vocab)
    logits = model(batch.src, batch.src_valid_lens, batch.tgt_in)[0]
    src = batch.src.clone()
    src[src == 0] = 5  # overwrite the padding with a real token id
    tgt = batch.tgt_in.clone()
    tgt[:, -1] = 7  # change the last input token: earlier positions must not notice
    logits2 = model(src, batch.src_valid_lens, tgt)[0]
    torch.testing.assert_close(logits2[:, :-1], logits[:, :-1], atol=1e-5, rtol=0)


def test_step_by_step_decoding_equals_teacher_forcing() -> None:
    model, task = _model()
    model.eval()
    batch = collate(task.sample(3, seed=2), task.src_vocab, task.tgt_vocab)
    with torch.no_grad():
        full = model(batch.src, batch.src_valid_lens, batch.tgt_in)[0]
        memory = model.encode(batch.src, batch.src_valid_lens)
        state = model.decoder.init_state(memory)
        for t in range(batch.tgt_in.shape[1]):
            step_logits, state, w = model.decoder.step(batch.tgt_in[:, t], state, memory, t)
            torch.testing.assert_close(step_logits, full[:, t], atol=1e-5, rtol=0)
            assert w.shape == batch.src.shape
    result = greedy_decode(model, batch.src, batch.src_valid_lens, max_len=4)
    assert result.tokens.shape[0] == 3 and result.weights.shape[:2] == result.tokens.shape


def test_gradients_reach_every_parameter() -> None:
    model, task = _model(dropout=0.1)
    model.train()
    batch = collate(task.sample(4, seed=3), task.src_vocab, task.tgt_vocab)
    sequence_loss(model(batch.src, batch.src_valid_lens, batch.tgt_in)[0], batch.tgt_out).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None and "tokens.weight" not in n]
    assert not missing


def test_checkpoint_round_trip_and_checksum(tmp_path) -> None:
    small = {**TRANSFORMER_RECIPE.model, "d_model": 16, "num_heads": 2, "dim_feedforward": 32}
    recipe = replace(TRANSFORMER_RECIPE, model=small, steps=1)
    model = build_transformer(recipe.config(NumberWords()))
    sha = save_checkpoint(model, tmp_path / "transformer.pt")
    entry = recipe_entry(recipe, model, TrainLog([1.0, 0.5], 1.0), sha)
    record_in_manifest(tmp_path, recipe.name, entry)
    assert json.loads((tmp_path / MANIFEST).read_text())["transformer"]["sha256"] == entry["sha256"]
    loaded, seen = load_or_train(recipe, tmp_path)
    assert seen == entry
    for (n, p), (_, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="has sha256 .* expected 00"):
        load_checkpoint(tmp_path / "transformer.pt", "00" * 32, build_model)
    with pytest.raises(ValueError, match="another recipe"):
        load_or_train(replace(recipe, steps=2), tmp_path)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "missing.pt", entry["sha256"], build_model)
    retrained, fresh = load_or_train(replace(recipe, steps=2), tmp_path, retrain=True)
    assert fresh["sha256"] is None and len(fresh["losses"]) == 1 and not retrained.training
    with pytest.raises(TypeError, match="retrain must be a bool"):
        load_or_train(recipe, tmp_path, retrain="yes")


def test_bad_inputs_name_the_argument() -> None:
    model, task = _model()
    batch = collate(task.sample(2, seed=4), task.src_vocab, task.tgt_vocab)
    with pytest.raises(ValueError, match="src must be \\(B, S\\) int64"):
        model(batch.src.float(), batch.src_valid_lens, batch.tgt_in)
    with pytest.raises(ValueError, match="src_valid_lens must lie in"):
        model(batch.src, batch.src_valid_lens * 0, batch.tgt_in)
    with pytest.raises(ValueError, match="tgt_in must be"):
        model(batch.src, batch.src_valid_lens, batch.tgt_in[:1])
    with pytest.raises(ValueError, match=r"embed_dim \(16\) must be divisible by num_heads \(3\)"):
        _model(num_heads=3)
    with pytest.raises(ValueError, match="unknown keys"):
        build_transformer({"src_vocab_size": 5, "tgt_vocab_size": 5, "width": 3})
    layer = TransformerDecoderLayer(D, H, FF)
    with pytest.raises(ValueError, match="memory must be"):
        layer(torch.randn(B, T, D), torch.randn(B, S, D + 1))
    with pytest.raises(TypeError, match="layer must be a torch.nn.TransformerDecoderLayer"):
        TransformerDecoderLayer.from_torch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="sequence length L = 70"):
        model.decoder(torch.zeros(1, 70, dtype=torch.long), model.encode(batch.src, batch.src_valid_lens))


def test_shipped_checkpoint_matches_its_manifest_and_the_recipe() -> None:
    from dataclasses import asdict

    entry = json.loads((CHECKPOINT_DIR / MANIFEST).read_text())["transformer"]
    assert entry["recipe"] == asdict(TRANSFORMER_RECIPE), "python -m attention_core.translation.train transformer"
    model = load_checkpoint(CHECKPOINT_DIR / entry["file"], entry["sha256"], build_model)
    assert isinstance(model, Seq2SeqTransformer)
    assert sum(p.numel() for p in model.parameters()) == entry["parameters"]
    assert len(entry["losses"]) * entry["loss_every"] == TRANSFORMER_RECIPE.steps


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"src_vocab_size": -3}, ValueError, r"src_vocab_size must be an int >= 1, got -3"),
    ({"tgt_vocab_size": 0}, ValueError, r"tgt_vocab_size must be an int >= 1, got 0"),
    ({"d_model": 64.0}, TypeError, r"d_model must be an int >= 1, got float 64.0"),
    ({"dim_feedforward": -1}, ValueError, r"dim_feedforward must be an int >= 1, got -1"),
    ({"num_decoder_layers": -2}, ValueError, r"num_decoder_layers must be an int >= 0, got -2"),
    ({"max_len": 0}, ValueError, r"max_len must be an int >= 1, got 0"),
])
def test_seq2seq_transformer_refuses_bad_sizes_by_name(kwargs, exc, words):
    with pytest.raises(exc, match=words):
        Seq2SeqTransformer(**{"src_vocab_size": 10, "tgt_vocab_size": 10, **kwargs})
