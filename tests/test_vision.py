"""Chapter 14's models and analysis against hand-computed cases: patches, 2-D positions, the ViT, the captioner's
cross-attention, the head statistics, the data and the shipped checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attention_core.models.captioner import Captioner, CaptionerOutput, greedy_caption
from attention_core.models.cnn import SmallCNN, cnn_parameters
from attention_core.models.vit import PatchEmbedding, VisionTransformer, patchify, sincos_2d_positions, unpatchify
from attention_core.multihead import MultiHeadAttention
from attention_core.training.checkpoint import file_sha256, read_manifest
from attention_core.vision.analysis import (
    attention_rollout,
    cell_swap_changes,
    layout_gap,
    layout_gap_null,
    mean_attention_distance,
    patch_distances,
    position_similarity,
    word_region_accuracy,
)

VIT = {"image_size": [8, 8], "patch_size": 2, "in_channels": 1, "num_classes": 10, "d_model": 16,
       "num_layers": 2, "num_heads": 2, "dim_feedforward": 32, "pos": "learned", "pool": "cls", "seed": 0}
CAP = {"image_size": [8, 24], "patch_size": 4, "in_channels": 1, "vocab_size": 11, "max_len": 3, "d_model": 16,
       "num_heads": 2, "dim_feedforward": 32, "encoder_layers": 0, "decoder_layers": 2, "seed": 0}


# ------------------------------------------------------------------------------------------------ patches


def test_patchify_by_hand() -> None:
    img = torch.arange(16.0).reshape(1, 1, 4, 4)
    p = patchify(img, 2)
    assert p.shape == (1, 4, 4)
    assert p[0].tolist() == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]


def test_patchify_channels_first_then_rows() -> None:
    img = torch.stack([torch.arange(4.0).reshape(2, 2), 10 + torch.arange(4.0).reshape(2, 2)])[None]  # (1,2,2,2)
    assert patchify(img, 2)[0, 0].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]


@pytest.mark.parametrize("shape,p", [((2, 3, 8, 12), 4), ((1, 1, 6, 6), 3), ((3, 2, 4, 8), 2), ((1, 1, 5, 5), 1)])
def test_patchify_round_trip(shape, p) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpatchify(patchify(x, p), p, shape[-2:]), x)


def test_patchify_refuses_a_ragged_image() -> None:
    with pytest.raises(ValueError, match="multiple of patch_size"):
        patchify(torch.zeros(1, 1, 6, 8), 4)


def test_patch_embedding_is_a_strided_convolution() -> None:
    torch.manual_seed(0)
    emb = PatchEmbedding((8, 12), 4, 3, 5)
    x = torch.randn(2, 3, 8, 12)
    w = emb.proj.weight.reshape(5, 3, 4, 4)  # (D, C*p*p) -> (D, C, p, p)
    conv = F.conv2d(x, w, emb.proj.bias, stride=4).flatten(2).transpose(1, 2)  # (B, D, 2, 3) -> (B, 6, D)
    torch.testing.assert_close(emb(x), conv, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ positions


def test_sincos_2d_by_hand() -> None:
    table = sincos_2d_positions(2, 3, 8)
    assert table.shape == (6, 8)
    for r in range(2):
        for c in range(3):
            want = [math.sin(r), math.cos(r), math.sin(r / 100), math.cos(r / 100),
                    math.sin(c), math.cos(c), math.sin(c / 100), math.cos(c / 100)]
            torch.testing.assert_close(table[r * 3 + c], torch.tensor(want), atol=1e-6, rtol=0)


def test_sincos_2d_same_row_shares_the_first_half() -> None:
    t = sincos_2d_positions(4, 4, 16).reshape(4, 4, 16)
    assert torch.equal(t[2, 0, :8], t[2, 3, :8]) and torch.equal(t[0, 1, 8:], t[3, 1, 8:])
    assert not torch.equal(t[0, 0], t[0, 1])


def test_sincos_2d_needs_a_multiple_of_four() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        sincos_2d_positions(2, 2, 6)


# ------------------------------------------------------------------------------------------------ ViT


@pytest.mark.parametrize("pos", ["learned", "sincos"])
@pytest.mark.parametrize("pool,tokens", [("cls", 17), ("mean", 16)])
def test_vit_shapes_and_weights(pos, pool, tokens) -> None:
    m = VisionTransformer({**VIT, "pos": pos, "pool": pool}).eval()
    out = m(torch.rand(3, 1, 8, 8), need_weights=True)
    assert out.logits.shape == (3, 10)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (3, 2, tokens, tokens)
    torch.testing.assert_close(out.attentions[1].sum(-1), torch.ones(3, 2, tokens))
    assert isinstance(m.encoder.layers[0].self_attn, MultiHeadAttention)
    assert (pos == "learned") == any(n == "pos_embed" for n, _ in m.named_parameters())


def test_vit_mean_pool_with_no_positions_ignores_patch_order() -> None:
    """Without positions a ViT reads a set of patches: shuffling them changes nothing (so positions matter)."""
    m = VisionTransformer({**VIT, "pool": "mean"}).eval()
    with torch.no_grad():
        m.pos_embed.zero_()
    x = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(2))
    shuffled = unpatchify(patchify(x, 2)[:, perm], 2, (8, 8))
    torch.testing.assert_close(m(x).logits, m(shuffled).logits, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        m.pos_embed.normal_()
    assert not torch.allclose(m(x).logits, m(shuffled).logits, atol=1e-4)


def test_vit_layers_start_different_and_builds_repeat() -> None:
    a, b = VisionTransformer(VIT), VisionTransformer(VIT)
    assert not torch.equal(a.encoder.layers[0].linear1.weight, a.encoder.layers[1].linear1.weight)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_vit_refuses_unknown_options() -> None:
    with pytest.raises(ValueError, match="pool"):
        VisionTransformer({**VIT, "pool": "max"})
    with pytest.raises(ValueError, match="pos"):
        VisionTransformer({**VIT, "pos": "rotary"})


def test_cnn_parameter_count() -> None:
    cfg = {"image_size": [8, 8], "in_channels": 1, "num_classes": 10, "channels": [16, 40], "seed": 0}
    m = SmallCNN(cfg)
    assert sum(p.numel() for p in m.parameters()) == cnn_parameters((8, 8), 1, 10, (16, 40))
    assert m(torch.rand(2, 1, 8, 8)).shape == (2, 10)


# ------------------------------------------------------------------------------------------------ captioner


def test_captioner_cross_attention_reads_patches_and_sums_to_one() -> None:
    m = Captioner(CAP).eval()
    out = m(torch.rand(2, 1, 8, 24), torch.tensor([[10, 3, 4], [10, 0, 9]]), need_weights=True)
    assert out.logits.shape == (2, 3, 11)
    assert len(out.cross_attentions) == 2 and out.cross_attentions[0].shape == (2, 2, 3, 12)
    torch.testing.assert_close(out.cross_attentions[0].sum(-1), torch.ones(2, 2, 3))
    assert isinstance(m.decoder.layers[0].multihead_attn, MultiHeadAttention)


def test_captioner_is_causal() -> None:
    m = Captioner(CAP).eval()
    img = torch.rand(1, 1, 8, 24)
    a = m(img, torch.tensor([[10, 3, 4]])).logits
    b = m(img, torch.tensor([[10, 3, 7]])).logits
    torch.testing.assert_close(a[:, :2], b[:, :2])
    assert not torch.allclose(a[:, 2], b[:, 2])


def test_captioner_memory_slot_is_its_patch_alone() -> None:
    """With no encoder layer, memory slot n depends on patch n only: cross-attention weights are about regions."""
    m = Captioner(CAP).eval()
    x = torch.rand(1, 1, 8, 24)
    y = x.clone()
    y[..., :4, :4] += 1.0  # patch 0 only
    diff = (m.encode(x) - m.encode(y)).abs().sum(-1)[0]  # (N,)
    assert diff[0] > 0 and torch.all(diff[1:] == 0)


def test_greedy_caption_shapes() -> None:
    words, cross = greedy_caption(Captioner(CAP), torch.rand(4, 1, 8, 24), start=10, length=3)
    assert words.shape == (4, 3) and cross.shape == (4, 3, 12)
    torch.testing.assert_close(cross.sum(-1), torch.ones(4, 3))


# ------------------------------------------------------------------------------------------------ analysis


def test_patch_distances_by_hand() -> None:
    d = patch_distances((2, 2), 4)
    assert d[0].tolist() == pytest.approx([0, 4, 4, 4 * math.sqrt(2)])


def test_mean_attention_distance_by_hand() -> None:
    w = torch.zeros(1, 2, 2, 2)
    w[0, 0] = torch.eye(2)  # head 0 looks at itself: 0 px
    w[0, 1] = 0.5  # head 1 spreads evenly over two patches 4 px apart: 2 px
    assert mean_attention_distance(w, (1, 2), 4, has_cls_token=False).tolist() == [0.0, 2.0]


def test_mean_attention_distance_drops_the_class_token() -> None:
    w = torch.tensor([[[[1.0, 0, 0], [0.5, 0.25, 0.25], [0.8, 0.2, 0.0]]]])  # (1, 1, 3, 3): cls first
    # patch 1 reads itself and patch 2 equally (2 px); patch 2 reads only patch 1 (4 px): mean 3 px
    assert mean_attention_distance(w, (1, 2), 4, has_cls_token=True).tolist() == [3.0]


def test_rollout_by_hand() -> None:
    a1 = torch.tensor([[[[0.0, 1.0], [1.0, 0.0]]]])  # swap
    a2 = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]])  # everyone reads token 0
    plain = attention_rollout([a1, a2], residual=0.0)
    assert plain[0].tolist() == [[0.0, 1.0], [0.0, 1.0]]  # A2 @ A1
    half = attention_rollout([a1, a2])  # (I+A1)/2 = all 0.5; (I+A2)/2 = [[1,0],[.5,.5]]
    assert half[0].tolist() == [[0.5, 0.5], [0.5, 0.5]]
    eye = attention_rollout([torch.eye(3).expand(2, 4, 3, 3)] * 3)
    assert torch.equal(eye, torch.eye(3, dtype=torch.float64).expand(2, 3, 3))


def test_rollout_rows_sum_to_one() -> None:
    g = torch.Generator().manual_seed(0)
    layers = [torch.softmax(torch.randn(2, 3, 5, 5, generator=g), -1) for _ in range(3)]
    torch.testing.assert_close(attention_rollout(layers).sum(-1), torch.ones(2, 5, dtype=torch.float64))


def test_position_similarity_by_hand() -> None:
    p = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    s = position_similarity(p)
    torch.testing.assert_close(s, torch.tensor([[1, 0, 1 / math.sqrt(2)], [0, 1, 1 / math.sqrt(2)],
                                                [1 / math.sqrt(2), 1 / math.sqrt(2), 1]], dtype=torch.float64))


def test_word_region_accuracy_by_hand() -> None:
    cross = torch.tensor([[[0.1, 0.7, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]]])  # (1, 2, 4): argmax patches 1 and 3
    regions = torch.tensor([0, 0, 1, 1])
    assert word_region_accuracy(cross, regions, torch.tensor([[0, 1]])) == 1.0
    assert word_region_accuracy(cross, regions, torch.tensor([[0, 0]])) == 0.5
    assert word_region_accuracy(cross, regions, torch.tensor([[1, 0]])) == 0.0


# ------------------------------------------------------------------------------------------------ data, checkpoints


def test_digits_split_and_caption_set() -> None:
    from attention_core.vision.data import START, load_digits, make_caption_set

    d = load_digits()
    assert (len(d.train_y), len(d.test_y)) == (1437, 360)
    assert float(d.train_x.min()) == 0.0 and float(d.train_x.max()) == 1.0
    train_rows = {tuple(r.flatten().tolist()) for r in d.train_x}
    assert sum(tuple(r.flatten().tolist()) in train_rows for r in d.test_x) < 5  # a few duplicates exist in the set
    cs = make_caption_set(d.train_x, d.train_y, 5, cells=3, seed=0)
    assert cs.images.shape == (5, 1, 8, 24) and cs.digits.shape == (5, 3)
    for j in range(3):  # cell j shows a digit labelled digits[:, j]
        cell = cs.images[..., 8 * j: 8 * j + 8]
        for i in range(5):
            hits = (d.train_x == cell[i]).flatten(1).all(1)
            assert bool((d.train_y[hits] == cs.digits[i, j]).all()) and bool(hits.any())
    inputs, targets = cs.tokens()
    assert inputs[:, 0].eq(START).all() and torch.equal(inputs[:, 1:], targets[:, :-1])


@pytest.mark.parametrize("name", ["vit_digits", "captioner_digits"])
def test_shipped_checkpoints(name) -> None:
    from attention_core.vision import train

    entry = read_manifest(train.CHECKPOINT_DIR)[name]
    path = train.CHECKPOINT_DIR / entry["file"]
    assert path.stat().st_size < 2_000_000 and file_sha256(path) == entry["sha256"]
    recipe = train.VIT_RECIPE if name == "vit_digits" else train.CAPTION_RECIPE
    load = train.load_or_train_vit if name == "vit_digits" else train.load_or_train_captioner
    model, got = load(recipe=recipe)
    assert got["sha256"] == entry["sha256"] and not model.training


def test_digits_have_17_grey_levels_scaled_to_unit_interval() -> None:
    from attention_core.vision.data import load_digits

    d = load_digits()
    levels = torch.unique(torch.cat([d.train_x, d.test_x]) * 16)  # the integers 0..16, as the docstring says
    assert torch.equal(levels, torch.arange(17.0))
    assert d.train_x.min() == 0 and d.train_x.max() == 1


def test_shipped_vit_accuracy_matches_its_manifest() -> None:
    from attention_core.vision.data import load_digits
    from attention_core.vision.train import accuracy, load_or_train_vit

    model, entry = load_or_train_vit()
    d = load_digits()
    assert abs(accuracy(model, d.test_x, d.test_y) - entry["test_accuracy"]) <= 1 / 360


def test_cnn_matches_the_vit_parameter_count() -> None:
    from attention_core.vision.train import VIT_RECIPE, cnn_config_matching

    n = sum(p.numel() for p in VisionTransformer(VIT_RECIPE.config()).parameters())
    m = SmallCNN(cnn_config_matching(n))
    assert abs(sum(p.numel() for p in m.parameters()) - n) / n < 0.01


# ------------------------------------------------------------------------------------------------ edges (issue 37)

CNN = {"image_size": [8, 8], "in_channels": 1, "num_classes": 10, "channels": [2, 3]}


def test_a_float64_vit_keeps_float64_end_to_end() -> None:
    m = VisionTransformer(VIT).double().eval()
    x = torch.rand(3, 1, 8, 8, dtype=torch.float64)
    out = m(x, need_weights=True)
    assert out.logits.dtype == torch.float64 and out.logits.shape == (3, 10)
    assert all(a.dtype == torch.float64 for a in out.attentions)
    ref = VisionTransformer(VIT).eval()(x.float()).logits
    assert torch.allclose(out.logits.float(), ref, atol=1e-5)


@pytest.mark.parametrize("build,x", [
    (lambda: VisionTransformer(VIT), torch.rand(2, 1, 8, 8, dtype=torch.float64)),
    (lambda: VisionTransformer(VIT).double(), torch.rand(2, 1, 8, 8)),
    (lambda: SmallCNN(CNN), torch.rand(2, 1, 8, 8, dtype=torch.float64)),
])
def test_images_of_another_dtype_than_the_model_are_refused_by_name(build, x) -> None:
    with pytest.raises(TypeError, match=r"images has dtype torch\.float(64|32) but the module's parameters"):
        build()(x)


@pytest.mark.parametrize("build", [lambda: VisionTransformer(VIT), lambda: SmallCNN(CNN)])
@pytest.mark.parametrize("x,err,pattern", [
    (torch.zeros(2, 1, 8, 8, dtype=torch.uint8), TypeError, r"images must have a floating-point dtype.*uint8"),
    ([[0.0]], TypeError, r"images must be a torch\.Tensor, got list"),
    (torch.rand(1, 8, 8), ValueError, r"images must be \(B, 1, 8, 8\), got shape \(1, 8, 8\)"),
    (torch.rand(1, 2, 8, 8), ValueError, r"images must be \(B, 1, 8, 8\), got shape \(1, 2, 8, 8\)"),
    (torch.rand(1, 1, 12, 12), ValueError, r"images must be \(B, 1, 8, 8\), got shape \(1, 1, 12, 12\)"),
    (torch.rand(1, 1, 8, 8, device="meta"), ValueError, r"images is on meta but the module's parameters are on cpu"),
])
def test_bad_images_are_refused_by_name(build, x, err, pattern) -> None:
    with pytest.raises(err, match=pattern):
        build()(x)


@pytest.mark.parametrize("cls,base", [(VisionTransformer, VIT), (Captioner, CAP), (SmallCNN, CNN)])
def test_bad_configs_are_refused_by_key(cls, base) -> None:
    with pytest.raises(TypeError, match="config must be a dict"):
        cls(3)
    key = sorted(k for k in base if k != "seed")[0]
    with pytest.raises(ValueError, match=rf"config lacks the keys \['{key}'\]"):
        cls({k: v for k, v in base.items() if k != key})
    with pytest.raises(ValueError, match=r"config has unknown keys \['colour'\]"):
        cls({**base, "colour": 1})
    with pytest.raises(TypeError, match=r"config\['seed'\] must be an int"):
        cls({**base, "seed": 1.5})


@pytest.mark.parametrize("key,value,err", [("num_classes", 0, ValueError), ("d_model", 1.5, TypeError),
                                           ("num_layers", 0, ValueError), ("dropout", 1.0, ValueError),
                                           ("image_size", 8, ValueError), ("in_channels", True, TypeError)])
def test_vit_config_values_are_checked(key, value, err) -> None:
    with pytest.raises(err, match=key):
        VisionTransformer({**VIT, key: value})


@pytest.mark.parametrize("key,value", [("encoder_layers", -1), ("max_len", 0), ("vocab_size", 0)])
def test_captioner_config_values_are_checked(key, value) -> None:
    with pytest.raises(ValueError, match=rf"config\['{key}'\]"):
        Captioner({**CAP, key: value})


@pytest.mark.parametrize("tokens,err,pattern", [
    (torch.tensor([[0, -1]] * 2), ValueError, r"tokens must be ids in \[0, 11\).*from -1 to 0"),
    (torch.tensor([[0, 11]] * 2), ValueError, r"tokens must be ids in \[0, 11\).*from 0 to 11"),
    (torch.zeros(2, 2), TypeError, r"tokens must hold integer token ids.*float32"),
    (torch.zeros(2, dtype=torch.long), ValueError, r"tokens must be \(B, L\) token ids, got shape \(2,\)"),
    (torch.zeros(2, 2, 1, dtype=torch.long), ValueError, r"tokens must be \(B, L\).*\(2, 2, 1\)"),
    (torch.zeros(3, 2, dtype=torch.long), ValueError, r"images \(batch 2\) and tokens \(batch 3\)"),
    (torch.zeros(2, 4, dtype=torch.long), ValueError, r"tokens has length 4, more than max_len=3"),
    ([[0]], TypeError, r"tokens must be a torch\.Tensor"),
])
def test_captioner_refuses_bad_tokens_by_name(tokens, err, pattern) -> None:
    with pytest.raises(err, match=pattern):
        Captioner(CAP)(torch.rand(2, 1, 8, 24), tokens)


def test_captioner_refuses_float64_images_and_takes_them_as_a_float64_model() -> None:
    x, t = torch.rand(2, 1, 8, 24, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="images has dtype torch.float64"):
        Captioner(CAP)(x, t)
    assert Captioner(CAP).double()(x, t).logits.dtype == torch.float64


@pytest.mark.parametrize("kwargs,err,pattern", [
    ({"start": 11}, ValueError, r"start must be an int in \[0, 11\)"),
    ({"start": -1}, ValueError, r"start must be an int in \[0, 11\)"),
    ({"start": 1.0}, TypeError, r"start must be an int"),
    ({"length": -1}, ValueError, r"length must be an int in \[0, 3\]"),
    ({"length": 4}, ValueError, r"length must be an int in \[0, 3\]"),
    ({"model": torch.nn.Linear(2, 2)}, TypeError, "model must be a Captioner"),
    ({"images": torch.rand(2, 1, 8, 24, dtype=torch.float64)}, TypeError, "images has dtype torch.float64"),
])
def test_greedy_caption_refuses_bad_arguments_by_name(kwargs, err, pattern) -> None:
    args = {"model": Captioner(CAP), "images": torch.rand(2, 1, 8, 24), "start": 10, "length": 3, **kwargs}
    model = args["model"]
    modes = [m.training for m in model.modules()]
    with pytest.raises(err, match=pattern):
        greedy_caption(**args)
    assert [m.training for m in model.modules()] == modes


def test_greedy_caption_of_zero_words_and_of_an_empty_batch() -> None:
    words, cross = greedy_caption(Captioner(CAP), torch.rand(2, 1, 8, 24), start=10, length=0)
    assert words.shape == (2, 0) and cross.shape == (2, 0, 12)
    words, cross = greedy_caption(Captioner(CAP), torch.rand(0, 1, 8, 24), start=10, length=3)
    assert words.shape == (0, 3) and cross.shape == (0, 3, 12)


def test_vit_and_cnn_on_an_empty_batch() -> None:
    assert VisionTransformer(VIT)(torch.rand(0, 1, 8, 8)).logits.shape == (0, 10)
    assert SmallCNN(CNN)(torch.rand(0, 1, 8, 8)).shape == (0, 10)


def test_caption_helpers_refuse_bad_arguments_by_name() -> None:
    from attention_core.vision import data as vdata

    with pytest.raises(ValueError, match=r"words must be ids in \[0, 11\), got \[99\]"):
        vdata.caption_text(torch.tensor([1, 99]))
    with pytest.raises(ValueError, match="cells must be .*, got 0"):
        vdata.make_caption_set(torch.rand(5, 1, 8, 8), torch.arange(5), 3, cells=0)
    with pytest.raises(ValueError, match=r"\bn must be .*, got -1"):
        vdata.make_caption_set(torch.rand(5, 1, 8, 8), torch.arange(5), -1)
    with pytest.raises(ValueError, match="x and y must hold one image per label"):
        vdata.make_caption_set(torch.rand(0, 1, 8, 8), torch.arange(0), 3)
    with pytest.raises(TypeError, match="has_cls_token must be a bool"):
        mean_attention_distance(torch.rand(1, 2, 4, 4), (2, 2), 2, has_cls_token=1)
    with pytest.raises(TypeError, match="weights must be a torch.Tensor"):
        mean_attention_distance([1.0], (2, 2), 2, has_cls_token=False)


# ------------------------------------------------------------------------------------------------ controls (issue 38)


def test_vit_positions_argument_replaces_the_table_for_one_call() -> None:
    m = VisionTransformer(VIT).eval()
    x = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    own = m(x).logits
    torch.testing.assert_close(m(x, positions=m.pos_embed.detach().clone()).logits, own)
    zeroed = m(x, positions=torch.zeros_like(m.pos_embed)).logits
    assert not torch.allclose(zeroed, own)
    manual = m.head(m.encoder(torch.cat([m.cls_token.expand(3, -1, -1), m.patch_embed(x)], 1))
                    .last_hidden_state[:, 0])  # the model with no positions, by hand
    torch.testing.assert_close(zeroed, manual)
    torch.testing.assert_close(m(x).logits, own)  # the model itself is unchanged
    with pytest.raises(ValueError, match=r"positions must be \(16, 16\).*got \(15, 16\)"):
        m(x, positions=torch.zeros(15, 16))
    with pytest.raises(TypeError, match="positions must be a torch.Tensor"):
        m(x, positions=[0.0])


def test_layout_gap_by_hand_and_on_a_2d_table() -> None:
    pos = torch.zeros(4, 3)  # a 1 x 4 strip: 0 and 3 are 3 patches apart, 0-1, 1-2, 2-3 neighbours
    pos[0], pos[1], pos[2], pos[3] = torch.tensor([1.0, 0, 0]), torch.tensor([1.0, 1, 0]), \
        torch.tensor([0.0, 1, 0]), torch.tensor([0.0, 0, 1])
    near = (2 ** -0.5 + 2 ** -0.5 + 0.0) / 3  # cos(0,1), cos(1,2), cos(2,3)
    assert layout_gap(pos, (1, 4)) == pytest.approx(near - 0.0)
    table = sincos_2d_positions(4, 4, 32)
    null = layout_gap_null(table, (4, 4), draws=200)
    assert null.shape == (200,) and layout_gap(table, (4, 4)) > null.max()  # a real 2-D layout beats them all
    assert torch.equal(null, layout_gap_null(table, (4, 4), draws=200))  # seeded
    with pytest.raises(ValueError, match=r"pos has 16 positions, grid \(3, 4\) has 12"):
        layout_gap(table, (3, 4))


def test_cell_swap_changes_names_the_cell_a_word_reads() -> None:
    class ReadsCell(Captioner):  # word t is the mean brightness of cell t, rounded to a digit
        def forward(self, images, tokens, need_weights=False):
            cells = torch.stack(
                [images[..., 8 * j:8 * j + 8].mean((1, 2, 3)) for j in range(3)], 1)  # (B, 3)
            digit = (cells * 9.99).long().clamp(0, 9)[:, :tokens.shape[1]]  # (B, T)
            return CaptionerOutput(F.one_hot(digit, 11).float())

    g = torch.Generator().manual_seed(0)
    images = torch.rand(50, 1, 8, 24, generator=g)
    donors = 1 - images
    changes = cell_swap_changes(ReadsCell(CAP), images, torch.zeros(50, 3, dtype=torch.long), donors, 8)
    assert changes.shape == (3, 3)
    assert torch.equal(changes - torch.diag(changes.diagonal()), torch.zeros(3, 3))  # no other word moves
    assert (changes.diagonal() > 0.5).all()
    with pytest.raises(ValueError, match="multiple of cell_width=7"):
        cell_swap_changes(ReadsCell(CAP), images, torch.zeros(50, 3, dtype=torch.long), donors, 7)


def _m(name: str):
    import importlib
    return importlib.import_module("attention_core." + name)


@pytest.mark.parametrize("call, exc, words", [
    (lambda: _m("vision.analysis").position_similarity([[0.0, 1.0]]), TypeError,
     r"pos must be a torch.Tensor, got list"),
    (lambda: _m("vision.analysis").layout_gap("bad", (2, 2)), TypeError, r"pos must be a torch.Tensor, got str"),
    (lambda: _m("vision.analysis").layout_gap_null(-3, (2, 2)), TypeError, r"pos must be a torch.Tensor, got int"),
    (lambda: _m("vision.analysis").word_region_accuracy([[[1.0]]], torch.zeros(1), torch.zeros(1, 1)), TypeError,
     r"cross must be a torch.Tensor, got list"),
    (lambda: _m("vision.train").train_classifier("bad", torch.zeros(1), torch.zeros(1), 1, 1, 1e-3, 0, 0.0, 0),
     TypeError, r"model must be a ViT or a CNN \(an nn.Module\), got str"),
    (lambda: _m("vision.train").train_classifier(torch.nn.Linear(1, 1), [1.0], torch.zeros(1), 1, 1, 1e-3, 0, 0.0, 0),
     TypeError, r"x must be a torch.Tensor, got list"),
])
def test_vision_helpers_refuse_bad_arguments_by_name(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.parametrize("args, error, pattern", [
    ((-3,), ValueError, r"parameters must be an int >= 1, got -3"),
    (("bad",), TypeError, r"parameters must be an int >= 1, got str 'bad'"),
    (([[1.0, 2.0]],), TypeError, r"parameters must be an int >= 1, got list"),
    ((1000, "bad"), TypeError, r"seed must be an int, got str 'bad'"),
])
def test_cnn_config_matching_refuses_bad_arguments(args, error, pattern):
    from attention_core.vision.train import cnn_config_matching
    with pytest.raises(error, match=pattern):
        cnn_config_matching(*args)
    assert cnn_config_matching(1000, seed=3)["seed"] == 3  # a valid call unchanged
