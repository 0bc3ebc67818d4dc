"""Every hole tests/test_fuzz.py found (and a few found probing by hand while fixing them), kept as plain tests.

Each entry is the shrunk example, what it did before the fix (in the comment), and what it must do now: raise
ValueError/TypeError naming the argument, or answer with the documented shape, dtype and values.
"""

from __future__ import annotations

import math

import pytest
import torch
from _raises import raises_as_listed

import attention_core as ac
from attention_core import masks, positional, scoring
from attention_core.kernel_regression import nadaraya_watson_weights

NAN = float("nan")
BIG = 2**63  # one past the largest int64: no tensor has a dimension this long
HUGE = 10**400  # beyond float's range


def mha(*args, **kw):
    torch.manual_seed(0)
    return ac.MultiHeadAttention(*args, **kw)


def e(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


RAISES = {
    # ------------------------------------------------------------------ scaled_dot_product_attention & co
    # E = 0 (issue 18): ZeroDivisionError: float division by zero, in every backend
    "sdpa E=0": (lambda: ac.scaled_dot_product_attention(e(1, 0, 0), e(1, 0, 0), e(1, 0, 1)), ValueError,
                 r"query and key must have at least one feature \(E >= 1"),
    "sdpa E=0, issue's shape": (lambda: ac.scaled_dot_product_attention(e(2, 3, 0), e(2, 4, 0), e(2, 4, 5),
                                                                        backend="numpy"),
                                ValueError, r"at least one feature \(E >= 1 in dim -1\).*query \(2, 3, 0\)"),
    "attention_weights E=0": (lambda: ac.attention_weights(e(1, 0, 0), e(1, 0, 0)), ValueError,
                              r"query and key must have at least one feature"),
    # value=None went through as if attention_weights had been called: AttributeError inside the backend
    "sdpa value None": (lambda: ac.scaled_dot_product_attention(e(1, 0, 1), e(1, 0, 1), None, backend="chunked"),
                        TypeError, r"value must be a torch.Tensor, got NoneType"),
    # GQA with no key/value head but query heads: ZeroDivisionError (integer modulo by zero)
    "gqa H=0": (lambda: ac.scaled_dot_product_attention(e(1, 2, 3, 4), e(1, 0, 3, 4), e(1, 0, 3, 4),
                                                        enable_gqa=True),
                ValueError, r"query heads \(Hq=2\) must be a multiple of the key/value heads \(H=0\)"),
    # meta tensors into the numpy backend: NotImplementedError: Cannot copy out of meta tensor
    "numpy on meta": (lambda: ac.scaled_dot_product_attention(*(torch.empty(1, 2, 3, device="meta"),) * 3,
                                                              backend="numpy"),
                      ValueError, r"backend 'numpy' cannot handle these inputs: .*meta"),
    # OverflowError: int too large to convert to float
    "scale beyond float": (lambda: ac.attention_weights(e(1, 2, 3), e(1, 2, 3), scale=HUGE), ValueError,
                           r"scale must be a finite float or None, got 1000"),
    # IndexError: tuple index out of range
    "masked_softmax 0-d": (lambda: ac.masked_softmax(torch.tensor(1.5410), dim=0), ValueError,
                           r"scores must have at least 1 dim"),
    # ------------------------------------------------------------------------------------------- masks
    # TypeError from torch.ones naming no argument ("argument 'size' failed to unpack")
    "causal_mask L beyond int64": (lambda: masks.causal_mask(BIG), ValueError,
                                   r"^L must be .*the largest tensor size"),
    # RuntimeError: value cannot be converted to type int64_t without overflow
    "sliding_window L beyond int64": (lambda: masks.sliding_window_mask(BIG, 1), ValueError,
                                      r"L must be .*the largest tensor size"),
    # RuntimeError: value cannot be converted to type int64_t without overflow / OverflowError
    "padding_mask max_len beyond int64": (lambda: masks.padding_mask([], BIG), ValueError,
                                          r"max_len must be .*the largest tensor size"),
    "padding_mask max_len beyond float": (lambda: masks.padding_mask([], HUGE), ValueError,
                                          r"max_len must be .*the largest tensor size"),
    # NotImplementedError: "min_all" not implemented for 'ComplexFloat' (found at 300 examples per function)
    "padding_mask complex lens": (lambda: masks.padding_mask(torch.tensor([1.0896 - 0.2075j]), 0), ValueError,
                                  r"valid_lens must be a 1-D integer tensor \(B,\), got shape \(1,\) and dtype "
                                  r"torch.complex64"),
    # RuntimeError: Expected one of cpu, cuda, ... device type at start of device string: nope
    "padding_mask unknown device": (lambda: masks.padding_mask([], 0, device="nope"), ValueError,
                                    r"device 'nope' cannot be used on this machine"),
    # NotImplementedError: Could not run 'aten::empty.memory_format' with arguments from the 'XLA' backend
    # (and "cuda" on a machine without CUDA: AssertionError: Torch not compiled with CUDA enabled)
    "causal_mask device without it": (lambda: masks.causal_mask(2, device="xla"), ValueError,
                                      r"device 'xla' cannot be used on this machine"),
    # RuntimeError: Cannot access accelerator device when none is available (an int is an accelerator index;
    # on a GPU machine: invalid device ordinal)
    "causal_mask device int": (lambda: masks.causal_mask(2, device=99), ValueError,
                               r"device 99 cannot be used on this machine"),
    # AttributeError: 'NoneType' object has no attribute 'is_floating_point'
    "to_additive dtype None": (lambda: masks.to_additive_mask(torch.tensor(0.0), dtype=None), TypeError,
                               r"dtype must be a floating torch.dtype"),
    # NotImplementedError: "bitwise_and_cpu" not implemented for 'ComplexFloat'
    "combine complex": (lambda: masks.combine_masks(torch.tensor(True), torch.tensor(1.0 - 0.2j)), TypeError,
                        r"masks\[1\] must be bool \(True = attend\) or floating \(added\), got dtype torch.complex64"),
    # TypeError naming "mask", an argument of to_additive_mask, not of combine_masks
    "combine uint8": (lambda: masks.combine_masks(torch.tensor(0, dtype=torch.uint8), torch.tensor(0.0)), TypeError,
                      r"masks\[0\] must be bool"),
    # RuntimeError: The size of tensor a (3) must match the size of tensor b (4)
    "combine shapes": (lambda: masks.combine_masks(torch.ones(3, dtype=torch.bool), torch.ones(4, dtype=torch.bool)),
                       ValueError, r"masks must broadcast to one shape, got masks\[0\] \(3,\) on cpu, masks\[1\]"),
    # -------------------------------------------------------------------------------- MultiHeadAttention
    # NotImplementedError: Could not run 'aten::empty.memory_format' with arguments from the 'XLA' backend
    "mha device without it": (lambda: mha(1, 1, device="xla"), ValueError, r"device 'xla' cannot be used"),
    # TypeError from torch.empty naming no argument
    "mha embed_dim beyond int64": (lambda: mha(BIG, 1), ValueError, r"embed_dim must be .*the largest tensor size"),
    # RuntimeError: Only Tensors of floating point and complex dtype can require gradients (probed by hand)
    "mha integer dtype": (lambda: mha(8, 2, dtype=torch.long), TypeError,
                          r"dtype must be a floating torch.dtype .*got torch.int64"),
    # float64 input into a float32 module (issue 18): RuntimeError: mat1 and mat2 must have the same dtype
    "mha float64 input": (lambda: mha(8, 2)(torch.randn(2, 3, 8, dtype=torch.float64)), TypeError,
                          r"query has dtype torch.float64 but the module's parameters are torch.float32; convert"),
    "mha float16 input": (lambda: mha(1, 1)(e(0, 0, 1, dtype=torch.float16)), TypeError,
                          r"query has dtype torch.float16 but the module's parameters are torch.float32"),
    # RuntimeError: The size of tensor a (0) must match the size of tensor b (2) (combining with the causal mask)
    "mha mask shape with causal": (lambda: mha(1, 1)(e(0, 0, 1), e(0, 2, 1), attn_mask=e(0, 0, dtype=torch.bool),
                                                     is_causal=True),
                                   ValueError, r"attn_mask of shape \(0, 0\) does not broadcast .*\(0, 1, 0, 2\)"),
    # NotImplementedError: "bitwise_and_cpu" not implemented for 'ComplexFloat'
    "mha complex mask": (lambda: mha(1, 1)(e(0, 0, 1), attn_mask=e(0, 0, dtype=torch.complex64), is_causal=True),
                         TypeError, r"attn_mask must be bool .*got dtype torch.complex64"),
    # RuntimeError: Tensor on device cpu is not on the expected device meta!
    "mha meta mask": (lambda: mha(1, 1)(e(0, 0, 1), attn_mask=torch.empty(0, 0, device="meta"), is_causal=True),
                      ValueError, r"attn_mask must be on the device of query \(cpu\), got meta"),
    # TypeError naming attn_mask, which the caller had not passed (probed by hand)
    "mha float64 key_padding_mask": (lambda: mha(8, 2)(torch.randn(2, 3, 8), key_padding_mask=e(2, 3,
                                                                                              dtype=torch.float64)),
                                     TypeError, r"key_padding_mask must be bool .*got dtype torch.float64"),
    # ----------------------------------------------------------------------------------------------- scoring
    # ZeroDivisionError: float division by zero
    "scaled_dot_score D=0": (lambda: scoring.scaled_dot_score(e(0, 0), e(0, 0)), ValueError,
                             r"query and key must have at least one feature \(D >= 1"),
    # TypeError: unsupported operand type(s) for /: 'Tensor' and 'NoneType'
    "cosine temperature None": (lambda: scoring.cosine_score(e(0, 0), e(0, 0), temperature=None), TypeError,
                                r"temperature must be a finite float > 0, got NoneType None"),
    # TypeError: clamp_min() received an invalid combination of arguments
    "cosine eps None": (lambda: scoring.cosine_score(e(0, 1), e(0, 1), eps=None), TypeError,
                        r"eps must be a finite float > 0"),
    # OverflowError: int too large to convert to float
    "cosine temperature beyond float": (lambda: scoring.cosine_score(e(0, 1), e(0, 1), temperature=HUGE),
                                        ValueError, r"temperature must be a finite float > 0, got 1000"),
    # RuntimeError: expected m1 and m2 to have the same dtype, but got: c10::Half != float
    "general float16 input": (lambda: scoring.GeneralScore(1, 1)(e(0, 1, dtype=torch.float16),
                                                                e(0, 1, dtype=torch.float16)),
                              TypeError, r"query has dtype torch.float16 but the module's parameters"),
    "concat float64 input": (lambda: scoring.ConcatScore(1, 1, 1)(e(0, 1, dtype=torch.float64),
                                                                 e(0, 1, dtype=torch.float64)),
                             TypeError, r"query has dtype torch.float64 but the module's parameters"),
    # TypeError from torch.empty naming no argument
    "additive hidden_dim beyond int64": (lambda: scoring.AdditiveScore(1, 1, BIG), ValueError,
                                         r"hidden_dim must be .*the largest tensor size"),
    "general key_dim beyond int64": (lambda: scoring.GeneralScore(1, BIG), ValueError,
                                     r"key_dim must be .*the largest tensor size"),
    # ValueError "unknown score None" naming no argument
    "make_score None": (lambda: scoring.make_score(None), TypeError, r"name must be a str"),
    # ---------------------------------------------------------------------------------- kernel regression
    # IndexError: tuple index out of range (values checked against 0-d keys before the keys were checked)
    "nadaraya_watson 0-d": (lambda: ac.nadaraya_watson(torch.tensor(1.0), torch.tensor(1.0), e(0)), ValueError,
                            r"queries must be 1-D \(L,\) or 2-D \(L, d\), got shape \(\)"),
    # RuntimeError: Tensor.item() cannot be called on meta tensors (probed by hand)
    "nadaraya_watson meta bandwidth": (lambda: ac.nadaraya_watson(e(3), e(4), e(4),
                                                                  bandwidth=torch.tensor(1.0, device="meta")),
                                       ValueError, r"bandwidth is on the meta device"),
    # ValueError naming "mask" and "scores", names internal to masked_softmax (probed by hand)
    "nadaraya_watson meta mask": (lambda: nadaraya_watson_weights(e(3), e(4), attn_mask=torch.ones(
        3, 4, dtype=torch.bool, device="meta")), ValueError, r"attn_mask must be on the device of queries"),
    # OverflowError: int too large to convert to float
    "bandwidth beyond float": (lambda: ac.nadaraya_watson(e(3), e(4), e(4), bandwidth=HUGE), ValueError,
                               r"bandwidth must be positive and finite"),
    # -------------------------------------------------------------------------------------------- positional
    # AttributeError: 'NoneType' object has no attribute 'is_floating_point'
    "sinusoidal dtype None": (lambda: positional.sinusoidal_encoding(0, 2, dtype=None), TypeError,
                              r"dtype must be a floating torch.dtype"),
    # RuntimeError: Storage size calculation overflowed / IntArrayRef ... cannot be represented as a SymInt
    "sinusoidal d_model beyond int64": (lambda: positional.sinusoidal_encoding(0, BIG), ValueError,
                                        r"d_model must be .*the largest tensor size"),
    # OverflowError: int too big to convert
    "sinusoidal num_positions beyond float": (lambda: positional.sinusoidal_encoding(HUGE, 2), ValueError,
                                              r"num_positions must be .*the largest tensor size"),
    # RuntimeError: normal expects std >= 0.0, but found std -1
    "learned init_std negative": (lambda: positional.LearnedPositionalEmbedding(1, 1, init_std=-1), ValueError,
                                  r"init_std must be a finite float >= 0, got -1"),
    # TypeError: normal_(): argument 'std' (position 2) must be float, not NoneType
    "learned init_std None": (lambda: positional.LearnedPositionalEmbedding(1, 1, init_std=None), TypeError,
                              r"init_std must be a finite float >= 0"),
    # TypeError from torch.empty naming no argument
    "learned max_len beyond int64": (lambda: positional.LearnedPositionalEmbedding(BIG, 1), ValueError,
                                     r"max_len must be .*the largest tensor size"),
    # ValueError naming head_dim, an argument of rotary_angles, not of apply_rotary
    "apply_rotary E=0": (lambda: positional.apply_rotary(e(0, 0)), ValueError,
                         r"x must have an even last dim E >= 2 \(RoPE rotates features in pairs\), got shape \(0, 0\)"),
    # silently accepted: any truthy value meant interleaved (probed by hand)
    "apply_rotary interleaved str": (lambda: positional.apply_rotary(e(2, 4), interleaved="yes"), TypeError,
                                     r"interleaved must be a bool, got str 'yes'"),
    # an answer, after a UserWarning "Casting complex values to real discards the imaginary part" (by hand)
    "rotary_angles complex positions": (lambda: positional.rotary_angles(torch.zeros(3, dtype=torch.complex64), 4),
                                        TypeError, r"positions must be integer or floating, got dtype torch.complex64"),
    # ValueError naming "offset" for a bad key_offset (probed by hand)
    "rotary key_offset": (lambda: positional.RotaryEmbedding(4)(e(2, 4), e(2, 4), key_offset=-1), ValueError,
                          r"key_offset must be .*, got -1$"),
    # RuntimeError: Tensor on device meta is not on the expected device cpu! (probed by hand)
    "sinusoidal layer meta input": (lambda: positional.SinusoidalPositionalEncoding(4)(
        torch.empty(1, 2, 4, device="meta")), ValueError, r"x is on meta but the sinusoidal table is on cpu"),
    # rotate_half had no checks: a wrong answer for an odd E, RuntimeError for bool or 0-d, AttributeError for
    # None, ValueError "not enough values to unpack" for E = 1
    "rotate_half odd E": (lambda: positional.rotate_half(torch.tensor([NAN, -0.2934, -2.1788])), ValueError,
                          r"x must have an even last dim E >= 2.*got shape \(3,\)"),
    "rotate_half E=1": (lambda: positional.rotate_half(torch.tensor([1.0])), ValueError,
                        r"x must have an even last dim"),
    "rotate_half bool": (lambda: positional.rotate_half(e(0, 2, dtype=torch.bool)), TypeError,
                         r"x must have a floating-point dtype, got torch.bool"),
    "rotate_half 0-d": (lambda: positional.rotate_half(torch.tensor(0.0)), ValueError,
                        r"x must have at least 1 dims \(\.\.\., E\), got shape \(\)"),
    "rotate_half None": (lambda: positional.rotate_half(None), TypeError, r"x must be a torch.Tensor, got NoneType"),
}


@pytest.mark.parametrize("name", list(RAISES))
def test_raises_naming_the_argument(name):
    raises_as_listed(RAISES[name])


# ------------------------------------------------------------------------------------ answers, not errors


def test_empty_batch_in_every_backend():
    """Query/key/value (0, 0, 1): ZeroDivisionError in chunked (and in all backends with GQA); now empty."""
    for backend in ac.available_backends("cpu"):
        for gqa in (False, True):
            out = ac.scaled_dot_product_attention(e(0, 0, 1), e(0, 0, 1), e(0, 0, 1), enable_gqa=gqa,
                                                  backend=backend)
            assert out.shape == (0, 0, 1) and out.dtype == torch.float32


def test_empty_output_keeps_autograd():
    q, k, v = (e(0, 2, 3).requires_grad_() for _ in range(3))
    out = ac.scaled_dot_product_attention(q, k, v)
    out.sum().backward()
    assert out.requires_grad and all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


def test_torch_backend_nan_query_row():
    """query [[[nan]]]: the torch backend (torch's fused CPU kernel) returned 0; the policy says NaN."""
    out = ac.scaled_dot_product_attention(torch.tensor([[[NAN]]]), torch.tensor([[[1.5410]]]),
                                          torch.tensor([[[1.5410]]]), backend="torch")
    assert torch.isnan(out).all()


def test_torch_backend_nan_query_without_keys():
    """query [[[nan]]] and no keys (S = 0): torch's kernel returned NaN; a row that reads nothing is zeros."""
    out = ac.scaled_dot_product_attention(torch.tensor([[[NAN]]]), e(1, 0, 1), e(1, 0, 1), backend="torch")
    assert out.shape == (1, 1, 1) and (out == 0).all()


@pytest.mark.parametrize("backend", ["reference", "numpy", "chunked"])
def test_nan_value_entry_poisons_the_whole_row(backend):
    """value [[[nan, -0.29, -2.18]]]: only the first feature was NaN; the policy makes the row NaN."""
    out = ac.scaled_dot_product_attention(torch.tensor([[[1.5410]]]), torch.tensor([[[1.5410]]]),
                                          torch.tensor([[[NAN, -0.2934, -2.1788]]]), backend=backend)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("backend", ["reference", "chunked", "torch"])
def test_no_keys_under_a_one_column_mask(backend):
    """query [[[nan]]], no keys (S = 0), mask [[[True]]] (one column, broadcast over S): NaN after the first
    version of the policy looked at the mask's own width; the row reads nothing, so zeros (2,000 examples)."""
    out = ac.scaled_dot_product_attention(torch.tensor([[[NAN]]]), e(1, 0, 1), e(1, 0, 1),
                                          attn_mask=torch.tensor([[[True]]]), backend=backend)
    assert out.shape == (1, 1, 1) and (out == 0).all()


def test_cosine_eps_beyond_half_range():
    """eps = 2**63 with float16 inputs: RuntimeError "value cannot be converted to type c10::Half without
    overflow" (2,000 examples); an eps beyond the dtype's range now acts as its largest value."""
    out = scoring.cosine_score(torch.ones(1, 2, dtype=torch.float16), torch.ones(1, 2, dtype=torch.float16),
                               eps=BIG)
    assert out.dtype == torch.float16 and (out == 0).all()


def test_meta_tensors_have_no_values_to_check():
    """Value checks on meta tensors: RuntimeError "Tensor.item() cannot be called on meta tensors"."""
    lens = torch.empty(1, dtype=torch.long, device="meta")
    assert masks.padding_mask(lens, 0).shape == (1, 0)
    assert masks.to_bool_mask(torch.empty((), device="meta", dtype=torch.float16)).device.type == "meta"


def test_learned_positions_follow_the_input_dtype():
    """A float16 input came back float32 (the float32 table promoted it); the table now follows x's dtype,
    as the sinusoidal one does."""
    layer = positional.LearnedPositionalEmbedding(4, 2)
    x = torch.randn(1, 3, 2, dtype=torch.float16)
    out = layer(x)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, x + layer.weight[:3].detach().half())


def test_numpy_scalars_are_numbers():
    """np.float32(0.5) as a scale was a TypeError; a NumPy scalar is a number (probed by hand)."""
    import numpy as np

    q = torch.randn(1, 2, 4)
    torch.testing.assert_close(ac.scaled_dot_product_attention(q, q, q, scale=np.float32(0.5)),
                               ac.scaled_dot_product_attention(q, q, q, scale=0.5))


# ------------------------------------------------------------------------------------------------ issue 24
# The edges the fuzzer did not reach: each reproducer of the issue, what it did before, what it must do now.

ISSUE24_BACKENDS = ["reference", "torch", "chunked", "numpy"]


def _qkv24(dtype, B=1, H=2, L=6, S=6, E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, E, generator=g).to(dtype) for n in (L, S, S))


@pytest.mark.parametrize("backend", ISSUE24_BACKENDS)
def test_issue24_fp16_with_a_float32_mask_of_7e4_gives_no_nan(backend):
    # was: the mask was cast to float16 first, 7e4 became inf, and the row NaN (torch: no NaN)
    q, k, v = _qkv24(torch.float16)
    mask = torch.zeros(6, 6)
    mask[0, 1] = 7e4
    got = ac.scaled_dot_product_attention(q, k, v, mask, backend=backend)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
    assert not got.isnan().any() and not want.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_issue24_masked_softmax_adds_a_float32_mask_to_half_scores_in_float32():
    # was: NaN in the row holding 7e4 (cast to float16: inf); inf - inf in the softmax
    scores = torch.randn(3, 4, generator=torch.Generator().manual_seed(0)).half()
    mask = torch.zeros(3, 4)
    mask[0, 1] = 7e4
    w = ac.masked_softmax(scores, mask)
    assert w.dtype == torch.float16 and not w.isnan().any()
    assert w[0, 1] == 1 and w[0].sum() == 1


@pytest.mark.parametrize("backend", ISSUE24_BACKENDS)
def test_issue24_bf16_keeps_a_float32_masks_precision(backend):
    # was: error 0.54 against a float64 oracle (the mask rounded to bfloat16), torch's 0.004
    q, k, v = _qkv24(torch.bfloat16, B=2, L=16, S=16)
    mask = 256 + torch.rand(2, 2, 16, 16, generator=torch.Generator().manual_seed(1)) * 3
    oracle = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), mask.double())
    torch_err = (torch.nn.functional.scaled_dot_product_attention(q, k, v, mask).double() - oracle).abs().max()
    err = (ac.scaled_dot_product_attention(q, k, v, mask, backend=backend).double() - oracle).abs().max()
    assert err <= max(2 * torch_err, 8e-3), (float(err), float(torch_err))


@pytest.mark.parametrize("fill", ["one column", "whole rows", "everything"])
def test_issue24_chunked_takes_finfo_min_like_the_reference(fill):
    # was: chunked scaled the mask by log2(e), finfo(float32).min overflowed to -inf, and rows of it became
    # zeros where every other backend (and torch) gives uniform weights
    q, k, v = _qkv24(torch.float32, L=5, S=7)
    mask = torch.zeros(5, 7)
    low = torch.finfo(torch.float32).min
    if fill == "one column":
        mask[:, 2] = low
    elif fill == "whole rows":
        mask[1:3] = low
    else:
        mask[:] = low
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
    for backend in ("reference", "chunked", "torch"):
        torch.testing.assert_close(ac.scaled_dot_product_attention(q, k, v, mask, backend=backend), want,
                                   atol=1e-6, rtol=1e-6)


def _lm24():
    from attention_core.models.language_model import build_language_model

    return build_language_model({"vocab_size": 11, "d_model": 16, "num_layers": 3, "num_heads": 2,
                                 "max_positions": 10, "seed": 0}).eval()


def test_issue24_a_refused_call_leaves_the_kv_cache_as_it_was():
    # was: layers before the refusing one had appended; the next call returned silently wrong logits
    from attention_core.backends import Backend, register_backend

    count = {"n": 0}

    def refuse_second(inputs):
        count["n"] += 1
        return "refused on purpose" if count["n"] == 2 else None

    register_backend(Backend("issue24_refuses_second", "test only", "attention_core.backends.reference",
                             lambda: (True, ""), refuse_second), replace=True)
    model, text = _lm24(), torch.tensor([[1, 2, 3, 4]])
    cache = model.new_cache()
    with torch.no_grad():
        model(text[:, :3], cache)
        with pytest.raises(ValueError, match="refused on purpose"), ac.use_backend("issue24_refuses_second"):
            model(text[:, 3:], cache)  # layer 0 appends, layer 1 refuses
        assert [k.shape[2] for k in cache.keys] == [3, 3, 3] and cache.seen == 3
        with pytest.raises(ValueError, match="max_positions = 10"):
            model(torch.ones(1, 8, dtype=torch.long), cache)  # past the rotary table: refused up front
        got = model(text[:, 3:], cache).logits[:, -1]
        torch.testing.assert_close(got, model(text).logits[:, -1], atol=1e-5, rtol=1e-5)


def test_issue24_loading_a_model_does_not_reseed_the_global_generator():
    # was: build_language_model called torch.manual_seed(config["seed"]): two notebooks seeded differently drew
    # the same numbers after a load
    torch.manual_seed(1)
    _lm24()
    a = torch.rand(3)
    torch.manual_seed(2)
    _lm24()
    assert not torch.equal(a, torch.rand(3))


@pytest.mark.parametrize("backend", ["reference", "torch", "chunked"])
def test_issue24_vmap_and_compile_fullgraph(backend):
    # was: bool(tensor) in the non-finite check: vmap failed in every backend, compile(fullgraph=True) too
    q, k, v = _qkv24(torch.float32)
    f = lambda q: ac.scaled_dot_product_attention(q, k, v, backend=backend)  # noqa: E731
    torch.testing.assert_close(torch.func.vmap(f)(q[None].expand(2, -1, -1, -1, -1)), f(q)[None].expand(2, -1, -1,
                                                                                                       -1, -1))
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(q), f(q))


@pytest.mark.parametrize("kw", [{"scale": 0.0}, {"scale": -1.5}, {"dropout_p": 1.0}])
def test_issue24_sdpa_takes_torchs_argument_ranges(kw):
    # was: ValueError for scale = 0, a negative scale and dropout_p = 1, which torch's SDPA accepts
    q, k, v = _qkv24(torch.float32)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    torch.testing.assert_close(ac.scaled_dot_product_attention(q, k, v, **kw), want)
    if "scale" in kw:
        for backend in ("reference", "chunked", "numpy"):
            torch.testing.assert_close(ac.scaled_dot_product_attention(q, k, v, backend=backend, **kw), want)


def _mla24(dtype=torch.float32):
    from attention_core.models.latent_attention import MultiHeadLatentAttention

    return MultiHeadLatentAttention(16, 2, 8, kv_latent_dim=8, rope_dim=4, max_positions=8).to(dtype).eval()


def _charvocab():
    from attention_core.shakespeare.data import CharVocab

    return CharVocab("abc")


def _issue24_contract_calls():
    from attention_core.models.language_model import sample_next_token
    from attention_core.models.latent_attention import LatentCache

    model = _lm24()
    full = model.new_cache()
    with torch.no_grad():
        model(torch.ones(2, 2, dtype=torch.long), full)
    mla, latent = _mla24(), LatentCache()
    with torch.no_grad():
        mla(torch.zeros(2, 3, 16), latent)
    big = torch.zeros(1, 1, 300_000, 4)
    return {
        # was: IndexError from the embedding
        "token id past the vocabulary": (lambda: model(torch.tensor([[3, 11]])), ValueError,
                                         r"tokens must be ids in \[0, 11\).*from 3 to 11"),
        "negative token id": (lambda: model(torch.tensor([[-1]])), ValueError, r"tokens must be ids in \[0, 11\)"),
        # was: RuntimeError from torch.cat, after nothing had been checked
        "cache of another batch size": (lambda: model(torch.ones(3, 1, dtype=torch.long), full), ValueError,
                                        r"batch size B = 3 but the cache holds B = 2"),
        "latent cache of another batch size": (lambda: mla(torch.zeros(1, 1, 16), latent), ValueError,
                                               r"x has batch size B = 1 but the cache holds B = 2"),
        # was: RuntimeError from a matmul of float32 by float16
        "half latent attention fed float32": (lambda: _mla24(torch.float16)(torch.zeros(1, 2, 16)), TypeError,
                                              r"x must have the module's dtype and device \(torch.float16"),
        "latent positions past the table": (lambda: _mla24()(torch.zeros(1, 9, 16)), ValueError,
                                            r"max_positions = 8"),
        # was: RuntimeError from multinomial
        "NaN logits": (lambda: sample_next_token(torch.tensor([[0.0, math.nan]])), ValueError,
                       r"logits must hold no NaN or \+inf \(rows \[0\]"),
        "all -inf logits": (lambda: sample_next_token(torch.full((1, 3), -math.inf)), ValueError,
                            r"every logit of rows \[0\] is -inf"),
        "infinite temperature": (lambda: sample_next_token(torch.zeros(1, 3), math.inf), ValueError,
                                 r"temperature must be a finite float >= 0, got inf"),
        # was: the library tried to allocate (hundreds of GiB)
        "scores that cannot fit": (lambda: ac.scaled_dot_product_attention(big, big, big, backend="reference"),
                                   MemoryError, r"\(1, 1, 300000, 300000\) scores and weights would take .* GiB"),
        "weights that cannot fit": (lambda: ac.attention_weights(big, big), ValueError,
                                    r"attention_weights's .* would take"),
        "a mask that cannot fit": (lambda: ac.causal_mask(10**6, 10**6), ValueError,
                                   r"\(L, S\) = \(1000000, 1000000\) bool mask would take"),
        # was: a negative id wrapped around to the vocabulary's last characters; a float id raised from a list index
        "negative id in CharVocab.decode": (lambda: _charvocab().decode(torch.tensor([0, -1])), ValueError,
                                            r"ids must be in \[0, 3\).*got \[-1\]"),
        "float ids in CharVocab.decode": (lambda: _charvocab().decode(torch.tensor([0.5])), TypeError,
                                          r"ids must be integers"),
        # was: TypeError: object of type 'bool' has no len() (found by tests/test_fuzz_modules.py)
        "latent attention given a non-cache": (lambda: _mla24()(torch.zeros(1, 2, 16), False), TypeError,
                                               r"cache must be a LatentCache or None, got bool"),
        # was: ZeroDivisionError in the message that explains a head mismatch
        "zero key heads": (lambda: ac.scaled_dot_product_attention(e(2, 0, 1), e(0, 0, 1), e(0, 0, 1)),
                           ValueError, r"query has Hq=2 heads but key has H=0"),
    }


@pytest.mark.parametrize("name", sorted(_issue24_contract_calls()))
def test_issue24_contract_of_the_newer_modules(name):
    call, exc, pattern = _issue24_contract_calls()[name]
    with pytest.raises(exc, match=pattern):
        call()


def test_issue24_tiny_temperature_tends_to_greedy():
    # was: logits / 1e-30 overflowed to inf, softmax gave NaN and multinomial raised
    from attention_core.models.language_model import sample_next_token

    logits = torch.tensor([[1.0, 5.0, 2.0], [3.0, 0.0, -1.0]])
    for t in (1e-30, 1e-300, 5e-45):
        assert sample_next_token(logits, t).tolist() == [1, 0]


# ---------------------------------------------------------------------------------------------------- issue 37
# Flex attention, the mask language, linear attention, sparse patterns, kernel regression and the core's edges.

from attention_core import linear_attention as la  # noqa: E402
from attention_core import mask_mods as mm  # noqa: E402
from attention_core import sparse_patterns as sp  # noqa: E402
from attention_core._checks import TooLargeError  # noqa: E402
from attention_core.flex_attention import create_block_mask, flex_attention  # noqa: E402

LINEAR_FORMS = {
    "parallel": lambda q, k, v: la.linear_attention(q, k, v, is_causal=True),
    "chunked-3": lambda q, k, v: la.linear_attention_chunked(q, k, v, chunk_size=3),
    "chunked-8": lambda q, k, v: la.linear_attention_chunked(q, k, v, chunk_size=8),
    "recurrent": lambda q, k, v: la.linear_attention_recurrent(q, k, v, is_causal=True)[0],
}


def _qkv37(shape=(2, 8, 4), dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g, dtype=dtype) for _ in range(3))


@pytest.mark.parametrize("where", ["key", "value", "query"])
@pytest.mark.parametrize("bad", [NAN, math.inf, -math.inf])
@pytest.mark.parametrize("form", sorted(LINEAR_FORMS))
def test_issue37_linear_attention_nonfinite_reaches_only_the_rows_that_read_it(form, bad, where):
    # was: a NaN in key 5 made rows 0..4 NaN in the parallel and chunked forms (0 * NaN in the causal mask's
    # product); the recurrent form was right. Now every form gives the recurrent form's rows.
    q, k, v = _qkv37()
    clean = LINEAR_FORMS[form](q, k, v)
    x = {"query": q, "key": k, "value": v}[where]
    x[1, 5, 2] = bad
    out = LINEAR_FORMS[form](q, k, v)
    recurrent = LINEAR_FORMS["recurrent"](q, k, v)
    # -inf in a key is 0 after elu + 1 (a finite feature): then nothing is poisoned
    poisoned = ~recurrent.isfinite().all(-1)  # (B, L)
    if where == "query":
        assert poisoned[1].tolist() == [i == 5 for i in range(8)] or bad == -math.inf
    elif not (where == "key" and bad == -math.inf):
        assert poisoned[1].tolist() == [i >= 5 for i in range(8)]
    assert torch.equal(~out.isfinite().all(-1), poisoned)
    torch.testing.assert_close(out[~poisoned], recurrent[~poisoned])
    if form != "recurrent":  # the sums of the recurrent form keep a value's NaN in its column (or give inf)
        assert out[poisoned].isnan().all()
    torch.testing.assert_close(out[0], clean[0])  # the other sequence is untouched


def test_issue37_linear_attention_gradients_stay_finite_before_a_future_nan():
    q, k, v = (t.requires_grad_() for t in _qkv37())
    k.data[0, 6, 1] = NAN
    for form in ("parallel", "chunked-3"):
        q.grad = k.grad = v.grad = None
        LINEAR_FORMS[form](q, k, v)[:, :6].sum().backward()
        assert all(bool(t.grad.isfinite().all()) for t in (q, k, v)), form


def _flex_case(B=1, H=2, L=40, S=40, E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, n, E, generator=g, dtype=torch.float64) for n in (L, S, S))


@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize("mod", ["causal", "window", "document"])
def test_issue37_flex_a_masked_nan_reaches_no_row_forward_or_backward(backend, mod):
    # was (chunked): the rows of the tile holding a masked-out NaN key were NaN (score NaN + bias -inf = NaN),
    # and their gradients too; (reference): a masked NaN value gave NaN rows (0 * NaN) and every gradient of q
    # was NaN (0 * NaN through the masked_fill's backward)
    L = 40
    mask_mod = {"causal": mm.causal, "window": mm.sliding_window(6),
                "document": mm.and_masks(mm.causal, mm.document(torch.arange(L) // 17))}[mod]
    bm = create_block_mask(mask_mod, None, None, L, L, BLOCK_SIZE=16)
    q, k, v = _flex_case(L=L, S=L)
    keep = mm.dense_mask(mask_mod, 1, 2, L, L)  # (1, 2, L, S)
    j = 21
    reads = keep[..., j]  # (1, 2, L): the rows that read key j
    want = flex_attention(q, k, v, block_mask=bm, backend="reference")
    k2, v2 = k.clone(), v.clone()
    k2[0, 1, j, 3], v2[0, 0, j, 0] = NAN, math.inf
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k2, v2))
    out = flex_attention(q2, k2, v2, block_mask=bm, backend=backend)
    assert torch.equal(out.isnan().any(-1), reads), "NaN exactly in the rows that read the bad key or value"
    torch.testing.assert_close(out[~reads], want[~reads])
    out[~reads].sum().backward()
    for t in (q2, k2, v2):
        assert t.grad.isfinite().all(), "a masked NaN reached a gradient"
    # the gradients equal those of the clean inputs (with the bad key and value as zeros)
    qc, kc, vc = (t.detach().nan_to_num(0.0, 0.0, 0.0).requires_grad_() for t in (q2, k2, v2))
    flex_attention(qc, kc, vc, block_mask=bm, backend="reference")[~reads].sum().backward()
    torch.testing.assert_close(q2.grad, qc.grad)
    torch.testing.assert_close(k2.grad, kc.grad.masked_fill(~kc.isfinite() | ~k2.isfinite(), 0.0))


@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_issue37_flex_a_bad_query_row_reading_nothing_stays_zero(backend):
    L = 20
    bm = create_block_mask(mm.causal_bottom_right(L, 10), None, None, L, 10, BLOCK_SIZE=16)  # rows 0..9 read none
    q, k, v = _flex_case(L=L, S=10)
    q[0, 0, 3, 0], q[0, 0, 15, 0] = NAN, NAN
    out = flex_attention(q, k, v, block_mask=bm, backend=backend)
    assert (out[0, 0, 3] == 0).all() and out[0, 0, 15].isnan().all()
    assert out[0, 0, [i for i in range(L) if i != 15]].isfinite().all()


def test_issue37_flex_chunked_a_score_mod_nan_on_a_masked_pair_stays_there():
    # was: a captured bias table holding NaN at a distance only masked pairs have (the future) poisoned the
    # rows of the partial tiles: NaN + -inf = NaN
    L = 40
    table = torch.zeros(2, 2 * 3 + 1, dtype=torch.float64)
    table[:, 4:] = NAN  # kv_idx - q_idx > 0: the future, which the causal mask hides
    bm = create_block_mask(mm.causal, None, None, L, L, BLOCK_SIZE=16)
    q, k, v = _flex_case(L=L, S=L)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for backend in ("chunked", "reference"):
        out = flex_attention(q, k, v, score_mod=mm.relative_position_bias(table, 3), block_mask=bm, backend=backend)
        assert out.isfinite().all(), backend
        out.sum().backward()
        assert q.grad.isfinite().all() and k.grad.isfinite().all(), backend
        q.grad = k.grad = v.grad = None


@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize("mod", ["alibi", "relative_position_bias"])
def test_issue37_flex_refuses_a_captured_tensor_shorter_than_the_heads(backend, mod):
    # was (triton): slopes[h] read past the (1,) tensor for h = 1; (chunked, reference): an IndexError
    q, k, v = _flex_case(H=2)
    score_mod = mm.alibi(torch.ones(1)) if mod == "alibi" else mm.relative_position_bias(torch.zeros(1, 3), 1)
    with pytest.raises(ValueError, match=r"captured (slopes|table) of shape \(1,( 3)?\).*2 query heads"):
        flex_attention(q, k, v, score_mod=score_mod, backend=backend)


@pytest.mark.parametrize("call, exc, words", [
    (lambda q: flex_attention(q, q, q, scale=NAN), ValueError, "scale must be a finite float"),
    (lambda q: flex_attention(q, q, q, scale=math.inf), ValueError, "scale must be a finite float"),
    (lambda q: flex_attention(q, q, q, scale=True), TypeError, "scale"),
    (lambda q: flex_attention(q[..., :0], q[..., :0], q), ValueError, r"at least one feature \(E >= 1"),
    (lambda q: flex_attention(q, q.to("meta"), q), ValueError, "key must be on the device of query"),
    (lambda q: flex_attention(q, q, q, block_mask=create_block_mask(mm.causal, None, None, 40, 40, device="meta")),
     ValueError, "block_mask must be on the device of query"),
    (lambda q: flex_attention(q.int(), q.int(), q.int()), TypeError, "query must have a floating-point dtype"),
    (lambda q: flex_attention(q, q.float(), q), TypeError, "key must have the dtype of query"),
    (lambda q: flex_attention(q, q, q, enable_gqa=1), TypeError, "enable_gqa must be a bool"),
    (lambda q: flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: i - j), TypeError,
     "score_mod must return a floating tensor"),
    (lambda q: flex_attention(q, q, q, score_mod=lambda s, b, h, i, j: torch.zeros(3, dtype=s.dtype)), ValueError,
     r"score_mod <lambda> returned shape \(3,\)"),
    (lambda q: create_block_mask(lambda b, h, i, j: (i >= j).int(), None, None, 8, 8), TypeError,
     "mask_mod must return a bool tensor"),
    (lambda q: create_block_mask(mm.document(torch.zeros(4, dtype=torch.long)), None, None, 6, 6), ValueError,
     "mask_mod document failed on .* index 4 is out of bounds"),
    (lambda q: create_block_mask(mm.causal, None, None, 8, 8, BLOCK_SIZE=2**62), TooLargeError, "BLOCK_SIZE"),
    (lambda q: create_block_mask(mm.causal, None, None, 8, 8, device="cuda:7"), ValueError, "device"),
])
def test_issue37_flex_errors_name_the_argument(call, exc, words):
    # was: scale=nan answered NaN; E = 0 a ZeroDivisionError; a key or block mask on another device a cryptic
    # error from deep inside; int/complex a ValueError; a mod's bad answer a RuntimeError from expand
    q = _flex_case()[0]
    with pytest.raises(exc, match=words):
        call(q)


@pytest.mark.parametrize("backend", ["chunked", "reference"])
def test_issue37_flex_empty_meta_noncontiguous_and_float64(backend):
    q, k, v = _flex_case(L=9, S=11)
    for shape_q, shape_kv in (((0, 2, 9, 8), (0, 2, 11, 8)), ((1, 2, 0, 8), (1, 2, 11, 8))):
        out = flex_attention(torch.zeros(shape_q, dtype=torch.float64), torch.zeros(shape_kv, dtype=torch.float64),
                             torch.zeros(shape_kv, dtype=torch.float64), backend=backend)
        assert out.shape == (*shape_q[:3], 8) and out.dtype == torch.float64
    assert flex_attention(q, k[:, :, :0], v[:, :, :0], backend=backend).eq(0).all()  # S = 0: rows read nothing
    meta = flex_attention(*(t.to("meta") for t in (q, k, v)), backend=backend)
    assert meta.shape == (1, 2, 9, 8) and meta.device.type == "meta"
    strided = flex_attention(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, backend=backend)
    assert strided.dtype == torch.float64
    torch.testing.assert_close(strided, flex_attention(q, k, v, backend=backend), rtol=0, atol=1e-12)


STRIDE0 = torch.zeros(1, 1, 1, 8).expand(1, 1, 2**40, 8)  # 32 TiB as read, 32 bytes stored


@pytest.mark.parametrize("name", ["sdpa", "sdpa-one-query", "attention_weights", "masked_softmax", "flex",
                                  "flex-one-query", "linear", "linear_chunked", "linear_recurrent", "delta_rule",
                                  "nadaraya_watson", "strided_mask", "dense_from_mod", "create_block_mask"])
def test_issue37_inputs_too_large_are_refused_before_any_work(name):
    # was: the core spent hours (> 60 s seen) summing the 2**43 elements of a stride-0 view in its non-finite
    # check; the others too, or an allocation error
    x, one = STRIDE0, torch.zeros(1, 1, 1, 8)
    calls = {
        "sdpa": lambda: ac.scaled_dot_product_attention(x, x, x),
        "sdpa-one-query": lambda: ac.scaled_dot_product_attention(one, x, x),
        "attention_weights": lambda: ac.attention_weights(one, x),
        "masked_softmax": lambda: ac.masked_softmax(x),
        "flex": lambda: flex_attention(x, x, x),
        "flex-one-query": lambda: flex_attention(one, x, x),
        "linear": lambda: la.linear_attention(x, x, x),
        "linear_chunked": lambda: la.linear_attention_chunked(x, x, x),
        "linear_recurrent": lambda: la.linear_attention_recurrent(x, x, x),
        "delta_rule": lambda: la.delta_rule(x, x, x),
        "nadaraya_watson": lambda: ac.nadaraya_watson(x[0, 0], x[0, 0], x[0, 0, :, 0]),
        "strided_mask": lambda: sp.strided_mask(2**20, 4),
        "dense_from_mod": lambda: sp.dense_from_mod(sp.strided_mod(4), 2**20),
        "create_block_mask": lambda: create_block_mask(mm.causal, None, None, 2**40, 2**40),
    }
    with pytest.raises(TooLargeError, match="GiB"):
        calls[name]()


def test_issue37_compile_fullgraph_with_the_default_backend(monkeypatch):
    # was: torch.compile(fullgraph=True) failed on ContextVar.get (the use_backend default) unless backend= was
    # given; now it traces, and a use_backend block around the compiled call is obeyed (a guard recompiles)
    import attention_core.functional as functional

    q, k, v = _qkv24(torch.float32)
    f = lambda q: ac.scaled_dot_product_attention(q, k, v)  # noqa: E731
    seen, real = [], functional.resolve_backend

    def spy(name, inputs):  # runs while tracing: which backend each traced graph calls
        chosen = real(name, inputs)
        seen.append(chosen.name)
        return chosen

    monkeypatch.setattr(functional, "resolve_backend", spy)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q), f(q))
    with ac.use_backend("reference"):
        torch.testing.assert_close(compiled(q), f(q))
    assert seen[0] == "torch" and "reference" in seen, seen
    torch._dynamo.reset()


BANDWIDTHS = {  # bandwidth -> (float32 answer at queries 0, 1, 2.5 over keys 0..3 with values 1..4, or an error)
    1e-30: ([1.0, 2.0, 3.5], [1.0, 2.0, 0.0]),  # h -> 0: nearest keys (gaussian), exact hits only (compact)
    1e-45: ([1.0, 2.0, 3.5], [1.0, 2.0, 0.0]),  # a float32 denormal
    1e30: ([2.5] * 3, [2.5] * 3),  # h -> inf: the mean of the values
    1e300: ([2.5] * 3, [2.5] * 3),  # inf in float32: the same limit
}


@pytest.mark.parametrize("kernel", ["gaussian", "boxcar", "epanechnikov"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bandwidth", sorted(BANDWIDTHS))
def test_issue37_nadaraya_watson_at_extreme_bandwidths(bandwidth, dtype, kernel):
    # was: NaN for 1e-30 in float32 (h * h underflowed to 0: 0 / 0), zeros for 1e-200 in float64 (d^2 / h^2
    # overflowed to inf for every key, a row of -inf); now the limits
    q = torch.tensor([0.0, 1.0, 2.5], dtype=dtype)
    k = torch.tensor([0.0, 1.0, 2.0, 3.0], dtype=dtype)
    v = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=dtype)
    gaussian, compact = BANDWIDTHS[bandwidth]
    want = torch.tensor(gaussian if kernel == "gaussian" else compact, dtype=dtype)
    torch.testing.assert_close(ac.nadaraya_watson(q, k, v, kernel, bandwidth), want)
    if dtype == torch.float64:  # float64 also at 1e-200 and a float64 denormal
        for h in (1e-200, 5e-324):
            tiny = BANDWIDTHS[1e-30][kernel != "gaussian"]
            torch.testing.assert_close(ac.nadaraya_watson(q, k, v, kernel, h), torch.tensor(tiny, dtype=dtype))


@pytest.mark.parametrize("bandwidth, exc, words", [
    (0.0, ValueError, "bandwidth must be positive and finite"), (-1.0, ValueError, "positive"),
    (NAN, ValueError, "positive and finite"), (math.inf, ValueError, "positive and finite"),
    (1e-310, ValueError, r"bandwidth 1e-310 is 0 in the queries' dtype torch.float32"),
    (torch.tensor(1e-60, dtype=torch.float64), ValueError, "is 0 in the queries' dtype"),
    (1j, TypeError, "bandwidth"),
])
def test_issue37_nadaraya_watson_refuses_bandwidths_with_no_answer(bandwidth, exc, words):
    x = torch.tensor([0.0, 1.0])
    with pytest.raises(exc, match=words):
        ac.nadaraya_watson(x, x, x, bandwidth=bandwidth)


@pytest.mark.parametrize("call, exc, words", [
    (lambda x: la.linear_attention(x, x, x, feature_map=lambda t: t.int()), TypeError, "feature_map must return"),
    (lambda x: la.linear_attention(x, x, x, feature_map=lambda t: t[..., 0]), ValueError, "feature_map must map"),
    (lambda x: la.linear_attention_recurrent(x, x, x, state=la.LinearAttentionState(torch.zeros(3), torch.zeros(2))),
     ValueError, r"state.S must have shape \(2, 4, 4\)"),
    (lambda x: la.linear_attention_recurrent(x, x, x, state=la.LinearAttentionState(
        torch.zeros(2, 4, 4, dtype=torch.float64), torch.zeros(2, 4, dtype=torch.float64))), TypeError, "state.S"),
    (lambda x: la.delta_rule(x, x, x, beta=torch.full((2, 6), 5.0)), ValueError, r"beta must be in \[0, 2\]"),
    (lambda x: la.delta_rule(x, x, x, beta=torch.ones(2, 6, dtype=torch.long)), TypeError, "beta"),
    (lambda x: la.delta_rule(x, x, x, state=torch.zeros(2, 4, 4, dtype=torch.long)), TypeError, "state"),
    (lambda x: la.performer_variance(x, x[:, :3], 4), ValueError, "x and y must have one shape"),
    (lambda x: la.draw_omega(3, 4, dtype=torch.long), TypeError, "dtype"),
    (lambda x: la.draw_omega(3, 4, generator=3), TypeError, "generator"),
    (lambda x: sp.bigbird_mod(8, 2, generator=1), TypeError, "generator"),
    (lambda x: sp.dense_from_mod(sp.longformer_mod(2, (0,), max_len=4), 8), ValueError, "mask_mod .* failed"),
    (lambda x: sp.tiles_visited(torch.ones(4, 4, dtype=torch.bool, device="meta")), ValueError, "mask is on the meta"),
    (lambda x: sp.reaches_every_pair(torch.ones(4, 4, dtype=torch.bool, device="meta")), ValueError, "meta"),
])
def test_issue37_linear_and_sparse_errors_name_the_argument(call, exc, words):
    # was: RuntimeError/AttributeError/IndexError from inside (a feature map's answer, a state of another shape or
    # dtype, a generator that is not one), or no error at all (beta = 5 as a tensor)
    with pytest.raises(exc, match=words):
        call(torch.randn(2, 6, 4))


def test_issue37_linear_attention_chunked_takes_an_empty_sequence():
    # was: torch.cat of no chunks raised RuntimeError for L = 0
    x = torch.randn(2, 0, 4, dtype=torch.float64)
    out = la.linear_attention_chunked(x, x, x)
    assert out.shape == (2, 0, 4) and out.dtype == torch.float64


def test_issue37_fuzz_oracle_of_a_learned_table_in_float16():
    # was: `make fuzz` red: test_positional[LearnedPositionalEmbedding] drew init_std ~1e18 and a float16 x; the
    # module gives inf (the table cast to float16, as documented) and the float64 oracle expected 8.0e18. The
    # oracle now computes the documented float16 sum.
    import numpy as np
    from test_fuzz import positional_oracle

    def close(got, want, tol, rtol=0.0):
        np.testing.assert_allclose(got.detach().double().numpy(), want, atol=tol, rtol=rtol)

    torch.manual_seed(0)
    layer = positional.LearnedPositionalEmbedding(max_len=4, d_model=2, init_std=1e18).eval()
    for x in (torch.zeros(1, 3, 2, dtype=torch.float16), torch.full((2, 3, 2), 6e4, dtype=torch.float16)):
        out = layer(x, 1)
        want = positional_oracle(layer, x, 1)
        assert np.isinf(want).any()  # what float16 holds of 1e18
        close(out, want, 1e-3, 1e-3)
    x = torch.randn(2, 3, 2, dtype=torch.float64)  # float64 stays float64, the table's float32 digits exact
    close(layer(x, 0), x.numpy() + layer.weight.detach()[:3].double().numpy(), 0.0)


# ---------------------------------------------------------------------------------------------- full-strength fuzz
# `make fuzz` at full strength drew logits and temperatures at the edge of what the dtype holds.


@pytest.mark.parametrize("logits, t, want", [
    # float64 logits past float32's range: the sampler divided logits.float() (inf) and its overflow fallback
    # subtracted inf from inf (NaN); multinomial raised RuntimeError "probability tensor contains either inf, nan"
    (torch.tensor([[1e300, 0.0]], dtype=torch.float64), 1.0, [1.0, 0.0]),
    (torch.tensor([[-1e300, 1e300, -math.inf]], dtype=torch.float64), 0.5, [0.0, 1.0, 0.0]),
    (torch.tensor([[1.7e308, -1.7e308]], dtype=torch.float64), 1e-300, [1.0, 0.0]),
    # a -inf logit beside one that overflows at t: next_token_probs skipped the row-max shift (its logits were
    # not all finite) and softmax([-inf, inf]) gave NaN
    (torch.tensor([[-math.inf, 3e38]]), 0.5, [0.0, 1.0]),
    (torch.tensor([[-math.inf, 3e38, -3e38]]), 1e-30, [0.0, 1.0, 0.0]),
    # huge logits at a huge temperature stay exact (no shift needed): softmax([3, -3])
    (torch.tensor([[3e38, -3e38]]), 1e38, [0.997527376843365, 0.002472623156634775]),
])
def test_full_fuzz_sampler_and_next_token_probs_share_an_overflow_safe_softmax(logits, t, want):
    from attention_core.models.language_model import sample_next_token
    from attention_core.serving.speculative import next_token_probs

    p = next_token_probs(logits, t)
    assert p.dtype == logits.dtype
    torch.testing.assert_close(p.double(), torch.tensor([want], dtype=torch.float64), atol=1e-6, rtol=1e-6)
    g = torch.Generator().manual_seed(0)
    for kw in ({}, {"top_p": 0.5}, {"top_k": 2}):
        drawn = sample_next_token(logits, t, generator=g, **kw)
        assert p[0, drawn[0]] > 0, f"drew token {drawn.item()} of probability 0 ({kw})"


@pytest.mark.parametrize("logits, words", [
    (torch.tensor([[0.0, math.nan]]), r"logits must hold no NaN or \+inf \(rows \[0\]"),
    (torch.tensor([[0.0, 1.0], [math.inf, 0.0]]), r"logits must hold no NaN or \+inf \(rows \[1\]"),
    (torch.full((2, 3), -math.inf), r"every logit of rows \[0, 1\] is -inf in logits"),
])
def test_full_fuzz_next_token_probs_refuses_what_the_sampler_refuses(logits, words):
    # was: NaN probabilities handed on to the speculative loop (its multinomial raised RuntimeError)
    from attention_core.serving.speculative import next_token_probs

    with pytest.raises(ValueError, match=words):
        next_token_probs(logits, 1.0)


def _paged_lm():
    from attention_core.models.language_model import build_language_model
    from attention_core.serving.blocks import PagedKVCache

    model = build_language_model({"vocab_size": 13, "d_model": 16, "num_layers": 2, "num_heads": 2,
                                  "num_kv_heads": 1, "max_positions": 20, "seed": 0}).eval()
    pool = PagedKVCache(2, 4, 4, 1, 8)
    pool.add_sequence(0)
    return model, pool


def test_full_fuzz_a_refused_call_pins_no_block_whatever_holds_its_traceback():
    # was: the paged state machine flaky at full strength. The model's transaction snapshot stayed live while
    # the refused call's traceback (a reference cycle) lived; a later crop pinned blocks for it, and they went
    # back to the pool whenever the garbage collector ran -- during a compared call, say. The model now releases
    # its snapshot when the call ends, so the counts do not depend on the collector.
    import gc

    from attention_core.serving.blocks import OutOfBlocks

    model, pool = _paged_lm()
    view = pool.sequence_view(0)
    held, was = None, gc.isenabled()
    gc.disable()
    try:
        with torch.no_grad():
            model(torch.arange(1, 8)[None], view)  # 7 tokens: 2 of the 4 blocks
            try:
                model(torch.arange(1, 13)[None], view)  # 12 more need 3 blocks, 2 are free: refused mid-call
            except OutOfBlocks as e:
                held = e  # its traceback keeps the call's frame, and the frame its snapshot
        assert held is not None and len(pool._live.get(0, ())) == 0, "the refused call's snapshot is still live"
        view.crop(0)
        assert pool.allocator.num_free == 4, "blocks let go of stayed pinned for a dead call's snapshot"
    finally:
        if was:
            gc.enable()


def test_full_fuzz_paged_snapshots_are_released_explicitly():
    model, pool = _paged_lm()
    view = pool.sequence_view(0)
    with torch.no_grad():
        model(torch.arange(1, 8)[None], view)
        with view.snapshot() as snap:
            view.crop(1)
            assert pool.allocator.num_free == 2 and snap.pins  # the cut block is pinned for the snapshot
            kept = snap
        assert pool.allocator.num_free == 3 and not kept.pins and kept.released  # given back at the with's end
        with pytest.raises(ValueError, match="state was released"):
            view.restore(kept)
        snap = view.snapshot()
        view.crop(0)
        assert pool.allocator.num_free == 3
        snap.release()
        snap.release()  # idempotent
        assert pool.allocator.num_free == 4 and sorted(pool.allocator._free) == [0, 1, 2, 3]


def test_full_fuzz_a_released_dense_snapshot_cannot_be_restored():
    from attention_core.models.language_model import build_language_model

    model = build_language_model({"vocab_size": 13, "d_model": 16, "num_layers": 1, "num_heads": 2,
                                  "max_positions": 20, "seed": 0}).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.arange(1, 6)[None], cache)
    snap = cache.snapshot()
    snap.release()
    assert snap not in set(cache._live)
    with pytest.raises(ValueError, match="state was released"):
        cache.restore(snap)
    assert len(cache) == 5
