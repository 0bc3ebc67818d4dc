"""The Transformer decoder takes block masks: each layer's self-attention (and cross-attention) through
``flex_attention`` equals the same layer given the equivalent dense mask, outputs and gradients."""

from __future__ import annotations

import pytest
import torch

import attention_core.mask_mods as mm
from attention_core.flex_attention import create_block_mask
from attention_core.models.transformer import TransformerDecoder, TransformerDecoderLayer

B, T, S, D, H = 2, 75, 50, 32, 4  # ragged against the 32-tiles
BLOCK = 32


def _layer(norm_first: bool, seed: int = 0) -> TransformerDecoderLayer:
    torch.manual_seed(seed)
    return TransformerDecoderLayer(D, H, dim_feedforward=64, norm_first=norm_first).double().eval()


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64, requires_grad=True)
    memory = torch.randn(B, S, D, generator=g, dtype=torch.float64, requires_grad=True)
    return x, memory


def _value_and_grads(module, x, memory, **masks):
    out = module(x, memory, **masks)
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    weight = torch.linspace(-1, 1, hidden.numel(), dtype=torch.float64).view(hidden.shape)
    grads = torch.autograd.grad((hidden * weight).sum(), [x, memory, *module.parameters()])
    return hidden, grads


def _dense(mod):
    return mm.dense_mask(mod, 1, 1, T, T)[0, 0]  # (T, T) bool


_WINDOW = mm.sinks_and_window(3, 20)
_DOCS = mm.and_masks(mm.document(torch.arange(T) // 30), mm.causal)
SELF_MODS = {
    "causal": (mm.causal, dict(tgt_is_causal=True)),
    "sinks_window": (_WINDOW, dict(tgt_mask=_dense(_WINDOW))),
    "documents_causal": (_DOCS, dict(tgt_mask=_dense(_DOCS))),
}


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("name", sorted(SELF_MODS))
def test_decoder_layer_self_attention_block_mask_equals_the_dense_mask(name, norm_first):
    mod, dense_kw = SELF_MODS[name]
    layer = _layer(norm_first)
    x, memory = _inputs()
    bm = create_block_mask(mod, None, None, T, T, BLOCK_SIZE=BLOCK)
    out, grads = _value_and_grads(layer, x, memory, tgt_block_mask=bm)
    ref, ref_grads = _value_and_grads(layer, x, memory, **dense_kw)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_decoder_layer_cross_attention_block_mask_equals_the_dense_mask():
    """Cross-attention (T, S) with per-batch key padding, through a block mask with B entries."""
    layer = _layer(False)
    x, memory = _inputs()
    mod = mm.key_padding([S, 23])
    bm = create_block_mask(mod, B, None, T, S, BLOCK_SIZE=BLOCK)
    causal = create_block_mask(mm.causal, None, None, T, T, BLOCK_SIZE=BLOCK)
    out, grads = _value_and_grads(layer, x, memory, tgt_block_mask=causal, memory_block_mask=bm)
    dense = mm.dense_mask(mod, B, 1, T, S)  # (B, 1, T, S)
    ref, ref_grads = _value_and_grads(layer, x, memory, tgt_is_causal=True, memory_mask=dense)
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_stack_passes_the_block_mask_to_every_layer(norm_first):
    layers = iter([_layer(norm_first, seed=s) for s in (0, 1, 2)])
    norm = torch.nn.LayerNorm(D).double() if norm_first else None
    decoder = TransformerDecoder(lambda: next(layers), num_layers=3, norm=norm).eval()
    x, memory = _inputs()
    mod = mm.sinks_and_window(2, 17)
    bm = create_block_mask(mod, None, None, T, T, BLOCK_SIZE=BLOCK)
    out, grads = _value_and_grads(decoder, x, memory, tgt_block_mask=bm)
    ref, ref_grads = _value_and_grads(decoder, x, memory, tgt_mask=mm.dense_mask(mod, 1, 1, T, T)[0, 0])
    torch.testing.assert_close(out, ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)
    # and it is not the unmasked function: the window changes the answer
    free, _ = _value_and_grads(decoder, x, memory)
    assert (free - ref).abs().max() > 1e-3


def test_block_mask_replaces_the_other_masks():
    layer = _layer(False)
    x, memory = _inputs()
    bm = create_block_mask(mm.causal, None, None, T, T, BLOCK_SIZE=BLOCK)
    with pytest.raises(ValueError, match="block_mask replaces"):
        layer(x, memory, tgt_block_mask=bm, tgt_is_causal=True)
    wrong = create_block_mask(mm.causal, None, None, T, T + 1, BLOCK_SIZE=BLOCK)
    with pytest.raises(ValueError, match="block_mask of shape"):
        layer(x, memory, tgt_block_mask=wrong)
