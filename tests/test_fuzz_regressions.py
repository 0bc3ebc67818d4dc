"""Every hole tests/test_fuzz.py found (and a few found probing by hand while fixing them), kept as plain tests.

Each entry is the shrunk example, what it did before the fix (in the comment), and what it must do now: raise
ValueError/TypeError naming the argument, or answer with the documented shape, dtype and values.
"""

from __future__ import annotations

import math

import pytest
import torch

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
                                   r"L must be at most 2\*\*63 - 1 \(the largest tensor size\)"),
    # RuntimeError: value cannot be converted to type int64_t without overflow
    "sliding_window L beyond int64": (lambda: masks.sliding_window_mask(BIG, 1), ValueError, r"L must be at most"),
    # RuntimeError: value cannot be converted to type int64_t without overflow / OverflowError
    "padding_mask max_len beyond int64": (lambda: masks.padding_mask([], BIG), ValueError, r"max_len must be at most"),
    "padding_mask max_len beyond float": (lambda: masks.padding_mask([], HUGE), ValueError,
                                          r"max_len must be at most"),
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
    "mha embed_dim beyond int64": (lambda: mha(BIG, 1), ValueError, r"embed_dim must be at most 2\*\*63 - 1"),
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
                                         r"hidden_dim must be at most"),
    "general key_dim beyond int64": (lambda: scoring.GeneralScore(1, BIG), ValueError, r"key_dim must be at most"),
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
                                        r"d_model must be at most"),
    # OverflowError: int too big to convert
    "sinusoidal num_positions beyond float": (lambda: positional.sinusoidal_encoding(HUGE, 2), ValueError,
                                              r"num_positions must be at most"),
    # RuntimeError: normal expects std >= 0.0, but found std -1
    "learned init_std negative": (lambda: positional.LearnedPositionalEmbedding(1, 1, init_std=-1), ValueError,
                                  r"init_std must be a finite float >= 0, got -1"),
    # TypeError: normal_(): argument 'std' (position 2) must be float, not NoneType
    "learned init_std None": (lambda: positional.LearnedPositionalEmbedding(1, 1, init_std=None), TypeError,
                              r"init_std must be a finite float >= 0"),
    # TypeError from torch.empty naming no argument
    "learned max_len beyond int64": (lambda: positional.LearnedPositionalEmbedding(BIG, 1), ValueError,
                                     r"max_len must be at most"),
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
                          r"key_offset must be >= 0, got -1"),
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
    call, exc, pattern = RAISES[name]
    with pytest.raises(exc, match=pattern):
        call()


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
