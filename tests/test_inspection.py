"""attention_core.pretrained.inspection and attention_core.models.bert on a tiny random BERT (no checkpoint needed)."""

from __future__ import annotations

import math

import pytest
import torch

from attention_core.booktools.widgets import HeadExplorer, head_explorer
from attention_core.models.bert import BertConfig, BertEncoder, mean_pool
from attention_core.pretrained.inspection import (
    attention_entropy,
    attention_received,
    gradient_x_input,
    value_contributions,
)

TINY = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=32, max_position_embeddings=12)


@pytest.fixture(scope="module")
def tiny() -> BertEncoder:
    torch.manual_seed(0)
    return BertEncoder(TINY).eval()


def test_entropy_of_one_hot_and_uniform_rows() -> None:
    mask = torch.tensor([[True, True, True, True, False]])  # 4 real tokens
    w = torch.zeros(1, 2, 5, 5)
    w[0, 0, :, 2] = 1.0  # head 0: every query on one key
    w[0, 1, :, :4] = 0.25  # head 1: evenly over the 4 real keys
    w[0, 1, 4] = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0])  # a padding query row: must not count
    ent = attention_entropy([w, w], mask)
    assert ent.shape == (2, 2)
    torch.testing.assert_close(ent[:, 0], torch.zeros(2))
    torch.testing.assert_close(ent[:, 1], torch.full((2,), math.log(4)))


def test_attention_received_sums_to_one_over_real_keys(tiny: BertEncoder) -> None:
    ids = torch.tensor([[1, 5, 6, 2, 0], [1, 7, 8, 9, 2]])
    mask = ids != 0
    out = tiny(ids, attention_mask=mask, need_weights=True)
    got = attention_received(out.attentions[0], mask)
    assert got.shape == (2, 5)
    torch.testing.assert_close(got.sum(1), torch.ones(2))
    assert got[0, 4] == 0  # the padding key receives nothing
    expected = out.attentions[0][1].mean(0).mean(0)  # no padding in sentence 1: a plain mean
    torch.testing.assert_close(got[1], expected)


def test_shape_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"attentions\[0\] must be \(B, H, L, L\)"):
        attention_entropy([torch.rand(1, 2, 3, 3)], torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="non-empty sequence"):
        attention_entropy(torch.rand(1, 2, 3, 3), torch.ones(1, 3, dtype=torch.bool))


def test_gradient_x_input_is_first_order_exact_for_a_linear_score(tiny: BertEncoder) -> None:
    """For a score linear in one word vector, removing it changes the score by its attribution (approx.)."""
    ids = torch.tensor([[1, 5, 6, 2]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    attributions, value = gradient_x_input(tiny, ids, mask, lambda out: mean_pool(out.last_hidden_state, mask).sum())
    assert attributions.shape == (1, 4) and value.shape == ()
    emb = tiny.embeddings.word_embeddings(ids).detach()
    eps = 1e-3  # scale word vector 2 by (1 - eps): the score moves by about -eps * attribution
    scaled = emb.clone()
    scaled[0, 2] *= 1 - eps
    with torch.no_grad():
        moved = mean_pool(tiny(inputs_embeds=scaled, attention_mask=mask).last_hidden_state, mask).sum()
    assert abs((value - moved).item() - eps * attributions[0, 2].item()) < 1e-2 * eps * abs(attributions[0, 2]) + 1e-6
    assert all(p.grad is None for p in tiny.parameters())
    with pytest.raises(ValueError, match="scalar"):
        gradient_x_input(tiny, ids, mask, lambda out: out.last_hidden_state)


def test_gradient_x_input_on_word_vectors_is_minus_the_position_and_segment_term(tiny: BertEncoder) -> None:
    """The embedding LayerNorm ignores scale: grad . (e + p + s) = 0, so a_i = -grad . (p_i + s_i)."""
    ids = torch.tensor([[1, 5, 6, 2]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    w = torch.randn(TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    score = lambda out: (mean_pool(out.last_hidden_state, mask) @ w).sum().tanh()  # noqa: E731 - non-linear
    attributions, _ = gradient_x_input(tiny, ids, mask, score)
    emb = tiny.embeddings.word_embeddings(ids).detach().requires_grad_()
    score(tiny(inputs_embeds=emb, attention_mask=mask)).backward()
    ps = (tiny.embeddings.position_embeddings.weight[:4] + tiny.embeddings.token_type_embeddings.weight[0]).detach()
    torch.testing.assert_close(attributions[0], -(emb.grad[0] * ps).sum(-1), atol=1e-5, rtol=1e-4)
    assert attributions.abs().max() > 1e-4  # not trivially zero
    tiny.zero_grad(set_to_none=True)


def test_head_explorer_summary_and_static_version(tiny: BertEncoder) -> None:
    ids = torch.tensor([[1, 5, 6, 2]])
    out = tiny(ids, need_weights=True)
    tokens = ["[CLS]", "a", "b", "[SEP]"]
    explorer = head_explorer([a[0] for a in out.attentions], tokens, layer=2, head=3)
    assert isinstance(explorer, HeadExplorer)
    w = out.attentions[1][0, 3]
    assert explorer.summary.value.startswith("layer 2, head 3: mean entropy")
    assert f"largest weight {w.max().item():.2f}" in explorer.summary.value
    explorer.layer.value = 1
    assert explorer.summary.value.startswith("layer 1, head 3")
    assert explorer.image.value[:4] == b"\x89PNG"
    html = explorer.static_html()
    assert html.count('class="ac-frame"') == 2 and 'type="range"' in html
    with pytest.raises(ValueError, match="layer must be in"):
        head_explorer([a[0] for a in out.attentions], tokens, layer=3)
    with pytest.raises(ValueError, match="len\\(tokens\\)"):
        head_explorer([a[0] for a in out.attentions], tokens[:3])


def test_value_contributions_rebuild_the_attention_output(tiny: BertEncoder) -> None:
    """b_O + sum_h sum_j alpha_hij f_hj is the output of the attention module."""
    x = torch.randn(2, 5, 16)
    mha = tiny.encoder.layers[0].self_attn
    with torch.no_grad():
        out, weights = mha(x, need_weights=True)  # (B, L, D), (B, H, L, L)
    f = value_contributions(mha, x)
    assert f.shape == (2, 4, 5, 16)
    rebuilt = torch.einsum("bhij,bhjd->bid", weights, f) + mha.out_proj.bias
    torch.testing.assert_close(rebuilt, out, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"x must be \(B, L, D\) with D = 16"):
        value_contributions(mha, torch.randn(2, 5, 8))


def _m(name: str):
    import importlib
    return importlib.import_module("attention_core." + name)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: _m("models.bert").BertEmbeddings({"hidden_size": 8}), TypeError, r"config must be a BertConfig, got dict"),
    (lambda: _m("models.bert").BertEncoder("bad"), TypeError, r"config must be a BertConfig, got str"),
    (lambda: _m("models.bert").convert_bert_state_dict([1]), TypeError, r"checkpoint must be a mapping"),
    (lambda: _m("models.bert").mean_pool(torch.zeros(1, 2, 4), [[1, 1]]), TypeError,
     r"attention_mask must be a torch.Tensor, got list"),
    (lambda: _m("models.bert").mean_pool(torch.zeros(1, 2, 4), torch.ones(1, 3)), ValueError,
     r"hidden must be \(B, L, D\) and attention_mask \(B, L\), got hidden \(1, 2, 4\) and attention_mask \(1, 3\)"),
    (lambda: _m("pretrained.inspection").value_contributions("bad", torch.zeros(1, 2, 4)), TypeError,
     r"attention must be a MultiHeadAttention, got str"),
    (lambda: _m("pretrained.minilm").max_abs_errors([torch.zeros(1)], [torch.zeros(1)], [[1]]), TypeError,
     r"attention_mask must be a torch.Tensor, got list"),
    (lambda: _m("pretrained.minilm").max_abs_errors(torch.zeros(1), [torch.zeros(1)], torch.ones(1, 1)), TypeError,
     r"ours must be a sequence of tensors"),
    (lambda: _m("pretrained.minilm").library_outputs("bad", "a sentence"), TypeError,
     r"model must be a SentenceTransformer, got str"),
])
def test_bert_and_inspection_helpers_refuse_bad_arguments_by_name(call, exc, words):
    with pytest.raises(exc, match=words):
        call()
