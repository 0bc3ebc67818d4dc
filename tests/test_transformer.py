"""Encoder blocks: the same function as PyTorch's layers, masks in the SDPA convention, clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attention_core as ac
from attention_core.models.transformer import EncoderOutput, TransformerEncoder, TransformerEncoderLayer

B, L, D, H, FF = 2, 6, 16, 4, 32
ATOL = 1e-5


def _torch_layer(norm_first: bool, activation: str, batch_first: bool = True, bias: bool = True):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        D, H, dim_feedforward=FF, dropout=0.0, activation=activation, norm_first=norm_first,
        batch_first=batch_first, bias=bias,
    )
    with torch.no_grad():  # LayerNorms start at (1, 0): give them some weight so a mix-up would show
        for norm in (layer.norm1, layer.norm2):
            norm.weight.uniform_(0.5, 1.5)
            if norm.bias is not None:
                norm.bias.uniform_(-0.5, 0.5)
    return layer.eval()


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(B, L, D, generator=torch.Generator().manual_seed(seed))


def _padding() -> torch.Tensor:
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[1, 4:] = False  # the second sequence has 4 real tokens
    return keep


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_from_torch_equals_pytorch_layer(norm_first: bool, activation: str) -> None:
    ref = _torch_layer(norm_first, activation)
    ours = TransformerEncoderLayer.from_torch(ref)
    assert ours.norm_first is norm_first and ours.activation_name == activation
    x, keep = _x(), _padding()
    with torch.no_grad():
        out, w = ours(x)
        torch.testing.assert_close(out, ref(x), atol=ATOL, rtol=0)
        assert w is None
        # padding: ours True = real token, PyTorch's True = padding
        out = ours(x, key_padding_mask=keep)[0]
        expected = ref(x, src_key_padding_mask=~keep)
        torch.testing.assert_close(out[keep], expected[keep], atol=ATOL, rtol=0)
        # causal attention as a mask and as a flag
        causal = ac.causal_mask(L)
        expected = ref(x, src_mask=~causal)
        torch.testing.assert_close(ours(x, attn_mask=causal)[0], expected, atol=ATOL, rtol=0)
        torch.testing.assert_close(ours(x, is_causal=True)[0], expected, atol=ATOL, rtol=0)


def test_from_torch_sequence_first_layer_and_tanh_gelu() -> None:
    ref = _torch_layer(False, "gelu", batch_first=False)
    ref.activation = nn.GELU(approximate="tanh")
    ours = TransformerEncoderLayer.from_torch(ref)
    assert ours.activation_name == "gelu_tanh"
    x = _x()
    with torch.no_grad():
        expected = ref(x.transpose(0, 1)).transpose(0, 1)  # (L, B, D) in, (L, B, D) out
        torch.testing.assert_close(ours(x)[0], expected, atol=ATOL, rtol=0)


def test_from_torch_without_bias() -> None:
    ref = _torch_layer(True, "relu", bias=False)
    ours = TransformerEncoderLayer.from_torch(ref)
    assert ours.linear1.bias is None and ours.norm1.bias is None
    with torch.no_grad():
        torch.testing.assert_close(ours(_x())[0], ref(_x()), atol=ATOL, rtol=0)


def test_weights_are_per_head_distributions_that_skip_padding() -> None:
    layer = TransformerEncoderLayer.from_torch(_torch_layer(False, "gelu"))
    keep = _padding()
    with torch.no_grad():
        out, w = layer(_x(), key_padding_mask=keep, need_weights=True)
        out_plain, _ = layer(_x(), key_padding_mask=keep)
    assert w.shape == (B, H, L, L)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, L), atol=1e-6, rtol=0)
    assert torch.all(w[1, :, :, 4:] == 0), "padding keys must get exactly zero weight"
    torch.testing.assert_close(out, out_plain, atol=ATOL, rtol=0)


def test_stack_from_torch_equals_pytorch_encoder() -> None:
    ref = nn.TransformerEncoder(
        _torch_layer(True, "gelu"), num_layers=3, norm=nn.LayerNorm(D), enable_nested_tensor=False
    ).eval()
    ours = TransformerEncoder.from_torch(ref)
    x, keep = _x(), _padding()
    with torch.no_grad():
        res = ours(x, key_padding_mask=keep, need_weights=True, output_hidden_states=True)
        expected = ref(x, src_key_padding_mask=~keep)
    assert isinstance(res, EncoderOutput)
    torch.testing.assert_close(res.last_hidden_state[keep], expected[keep], atol=ATOL, rtol=0)
    assert len(res.hidden_states) == 4 and len(res.attentions) == 3
    assert res.hidden_states[0] is x
    assert all(a.shape == (B, H, L, L) for a in res.attentions)


def test_stack_copies_a_layer_and_calls_a_factory() -> None:
    layer = TransformerEncoderLayer(D, H, FF)
    copied = TransformerEncoder(layer, num_layers=2)
    assert copied.layers[0] is not layer
    assert torch.equal(copied.layers[0].linear1.weight, copied.layers[1].linear1.weight)
    fresh = TransformerEncoder(lambda: TransformerEncoderLayer(D, H, FF), num_layers=2)
    assert not torch.equal(fresh.layers[0].linear1.weight, fresh.layers[1].linear1.weight)
    out = fresh(_x())
    assert out.hidden_states is None and out.attentions is None and out.last_hidden_state.shape == (B, L, D)


def test_backends_agree() -> None:
    layer = TransformerEncoderLayer.from_torch(_torch_layer(False, "gelu"))
    keep = _padding()
    with torch.no_grad():
        with ac.use_backend("reference"):
            expected = layer(_x(), key_padding_mask=keep)[0]
        for name in ac.available_backends("cpu"):
            with ac.use_backend(name):  # models take the backend from the context, not an argument
                out = layer(_x(), key_padding_mask=keep)[0]
            torch.testing.assert_close(out, expected, atol=ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_gradients_flow() -> None:
    layer = TransformerEncoderLayer(D, H, FF, dropout=0.1).train()
    x = _x().requires_grad_()
    layer(x, key_padding_mask=_padding())[0].sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is not None for p in layer.parameters())


def test_bad_inputs_name_the_argument() -> None:
    layer = TransformerEncoderLayer(D, H, FF)
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.randn(L, D))
    with pytest.raises(ValueError, match="x must be .*d_model = 16"):
        layer(torch.randn(B, L, D + 1))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        layer([[0.0] * D])
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, S\) = \(2, 6\)"):
        layer(_x(), key_padding_mask=torch.ones(B, L + 1, dtype=torch.bool))
    with pytest.raises(TypeError, match="backend"):
        layer(_x(), backend="torch")  # use ac.use_backend(...) around a model
    with pytest.raises(ValueError, match="activation must be one of"):
        TransformerEncoderLayer(D, H, FF, activation="swish")
    with pytest.raises(TypeError, match="layer must be a torch.nn.TransformerEncoderLayer"):
        TransformerEncoderLayer.from_torch(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="encoder_layer must be"):
        TransformerEncoder(3, num_layers=2)
    with pytest.raises(ValueError, match="num_layers"):
        TransformerEncoder(layer, num_layers=0)


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_a_stack_from_torch_copies_the_norm_keeps_the_mode_and_refuses_another_module(kind):
    from attention_core.models.transformer import TransformerDecoder

    ours, theirs, layer = ((TransformerEncoder, nn.TransformerEncoder, nn.TransformerEncoderLayer) if kind == "encoder"
                           else (TransformerDecoder, nn.TransformerDecoder, nn.TransformerDecoderLayer))
    with pytest.raises(TypeError, match=f"{kind} must be a torch.nn.{theirs.__name__}, got Linear"):
        ours.from_torch(nn.Linear(2, 2))
    torch.manual_seed(0)
    ref = theirs(layer(8, 2, 16, dropout=0.0, batch_first=True), num_layers=3, norm=nn.LayerNorm(8),
                 **({"enable_nested_tensor": False} if kind == "encoder" else {}))
    for training in (True, False):
        got = ours.from_torch(ref.train(training))
        assert got.training == training and got.num_layers == len(got.layers) == 3
        assert torch.equal(got.norm.weight, ref.norm.weight) and got.norm is not ref.norm
