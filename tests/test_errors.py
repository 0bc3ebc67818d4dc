"""Bad inputs fail early, with the right exception and a message naming the argument and what was seen."""

from __future__ import annotations

import pytest
import torch
from _raises import raises_as_listed

import attention_core as ac
from attention_core import masks, scoring
from attention_core.backends import Backend, register_backend


def qkv(B=2, Hq=4, H=4, L=5, S=6, E=8, Ev=3, dtype=torch.float32, grad=False):
    q = torch.randn(B, Hq, L, E, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, H, S, E, dtype=dtype, requires_grad=grad)
    v = torch.randn(B, H, S, Ev, dtype=dtype, requires_grad=grad)
    return q, k, v


def sdpa(**overrides):
    """A call of ac.scaled_dot_product_attention with one argument replaced."""
    q, k, v = qkv()
    kwargs = dict(query=q, key=k, value=v)
    kwargs.update(overrides)
    return lambda: ac.scaled_dot_product_attention(**kwargs)


q0, k0, v0 = qkv()
q_grad, k_grad, v_grad = qkv(grad=True)

CASES = {
    # types and dtypes
    "query not a tensor": (sdpa(query=[[1.0]]), TypeError, r"query must be a torch.Tensor, got list"),
    "value not a tensor": (sdpa(value=3.0), TypeError, r"value must be a torch.Tensor, got float"),
    "integer query": (sdpa(query=q0.long(), key=k0.long(), value=v0.long()), TypeError,
                      r"query must have a floating-point dtype, got torch.int64"),
    "dtype mismatch": (sdpa(key=k0.double()), TypeError, r"key must have the dtype of query \(torch.float32\)"
                       r".*key.dtype=torch.float64"),
    # ranks and sizes
    "query 1-D": (sdpa(query=torch.randn(8)), ValueError, r"query must have at least 2 dims.*got shape \(8,\)"),
    "gqa needs heads": (sdpa(query=torch.randn(5, 8), key=torch.randn(6, 8), value=torch.randn(6, 3),
                             enable_gqa=True), ValueError, r"query must have at least 3 dims.*\(5, 8\)"),
    "E mismatch": (sdpa(key=torch.randn(2, 4, 6, 7)), ValueError,
                   r"key's last dim must equal query's \(E=8\).*key \(2, 4, 6, 7\)"),
    "S mismatch": (sdpa(value=torch.randn(2, 4, 9, 3)), ValueError,
                   r"value must have as many positions as key \(S=6\).*value \(2, 4, 9, 3\)"),
    "batch mismatch": (sdpa(key=torch.randn(3, 4, 6, 8), value=torch.randn(3, 4, 6, 3)), ValueError,
                       r"leading dims .* do not broadcast: query \(2, 4, 5, 8\), key \(3, 4, 6, 8\)"),
    "k/v heads differ": (sdpa(value=torch.randn(2, 2, 6, 3)), ValueError,
                         r"key and value must have the same number of heads.*value \(2, 2, 6, 3\)"),
    "gqa k/v heads differ": (sdpa(key=torch.randn(2, 2, 6, 8), value=torch.randn(2, 1, 6, 3), enable_gqa=True),
                             ValueError, r"key and value must have the same number of heads"),
    "Hq != H without gqa": (sdpa(key=torch.randn(2, 2, 6, 8), value=torch.randn(2, 2, 6, 3)), ValueError,
                            r"query has Hq=4 heads but key has H=2.*pass enable_gqa=True"),
    "Hq not a multiple of H": (sdpa(key=torch.randn(2, 3, 6, 8), value=torch.randn(2, 3, 6, 3), enable_gqa=True),
                               ValueError, r"query heads \(Hq=4\) must be a multiple of the key/value heads \(H=3\)"),
    # masks
    "mask does not broadcast": (sdpa(attn_mask=torch.ones(4, 6, dtype=torch.bool)), ValueError,
                                r"attn_mask of shape \(4, 6\) does not broadcast to .*\(\.\.\., Hq, L, S\) = "
                                r"\(2, 4, 5, 6\)"),
    "mask too many dims": (sdpa(attn_mask=torch.ones(3, 2, 4, 5, 6, dtype=torch.bool)), ValueError,
                           r"attn_mask of shape \(3, 2, 4, 5, 6\) does not broadcast"),
    "mask 1-D": (sdpa(attn_mask=torch.ones(6, dtype=torch.bool)), ValueError,
                 r"attn_mask must have at least 2 dims.*got shape \(6,\)"),
    "mask integer dtype": (sdpa(attn_mask=torch.ones(5, 6, dtype=torch.int64)), TypeError,
                           r"attn_mask must be bool .* or floating .*got dtype torch.int64"),
    "float mask dtype": (sdpa(attn_mask=torch.zeros(5, 6, dtype=torch.float64)), TypeError,
                         r"float attn_mask must be float32 or the query's dtype .*got torch.float64"),
    "mask not a tensor": (sdpa(attn_mask=[[True]]), TypeError, r"attn_mask must be a torch.Tensor, got list"),
    "mask and causal": (sdpa(attn_mask=torch.ones(5, 6, dtype=torch.bool), is_causal=True), ValueError,
                        r"attn_mask and is_causal=True were both given"),
    # options
    # (dropout_p = 1, scale = 0 and a negative scale are accepted, as torch accepts them: test_fuzz_regressions)
    "dropout above 1": (sdpa(dropout_p=1.5), ValueError, r"dropout_p must be in \[0, 1\], got 1.5"),
    "dropout negative": (sdpa(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\], got -0.1"),
    "dropout string": (sdpa(dropout_p="0.1"), TypeError, r"dropout_p must be a float in \[0, 1\], got str"),
    "scale nan": (sdpa(scale=float("nan")), ValueError, r"scale must be a finite float or None.*got nan"),
    "scale inf": (sdpa(scale=float("inf")), ValueError, r"scale must be a finite float or None.*got inf"),
    "is_causal not bool": (sdpa(is_causal=1), TypeError, r"is_causal must be a bool, got int 1"),
    "enable_gqa not bool": (sdpa(enable_gqa="yes"), TypeError, r"enable_gqa must be a bool, got str 'yes'"),
    "device mismatch": (sdpa(key=k0.to("meta")), ValueError, r"key must be on the device of query \(cpu\).*meta"),
    # backends
    "unknown backend": (sdpa(backend="fast"), ValueError,
                        r"unknown backend 'fast'; known backends: \[.*'chunked'.*'numpy'.*'reference'.*'torch'"),
    "planned backend": (sdpa(backend="triton"), ValueError, r"backend 'triton'"),
    "backend not a str": (sdpa(backend=3), TypeError, r"backend must be a str or None, got int 3"),
    "numpy with grad": (sdpa(query=q_grad, key=k_grad, value=v_grad, backend="numpy"), ValueError,
                        r"backend 'numpy' cannot handle these inputs: it has no autograd.*backends that can: "
                        r"\[.*'torch'"),
    "numpy with dropout": (sdpa(dropout_p=0.1, backend="numpy"), ValueError,
                           r"backend 'numpy' cannot handle these inputs: it has no dropout \(dropout_p=0.1\)"),
    "chunked with dropout": (sdpa(dropout_p=0.2, backend="chunked"), ValueError,
                             r"backend 'chunked' cannot handle these inputs: it has no dropout \(dropout_p=0.2\)"),
    "chunked with mask grad": (sdpa(attn_mask=torch.zeros(5, 6, requires_grad=True), backend="chunked"),
                               ValueError, r"'chunked' cannot handle .*gradient for a float attn_mask"),
    "use_backend unknown": (lambda: ac.use_backend("nope").__enter__(), ValueError, r"unknown backend 'nope'"),
    # attention_weights and masked_softmax share the checks
    "weights E mismatch": (lambda: ac.attention_weights(q0, torch.randn(2, 4, 6, 5)), ValueError,
                           r"key's last dim must equal query's \(E=8\)"),
    "masked_softmax scores": (lambda: ac.masked_softmax([1.0, 2.0]), TypeError,
                              r"scores must be a torch.Tensor, got list"),
    "masked_softmax mask shape": (lambda: ac.masked_softmax(torch.randn(3, 4), torch.ones(3, 5, dtype=torch.bool)),
                                  ValueError, r"mask of shape \(3, 5\) does not broadcast .*\(3, 4\)"),
    "masked_softmax dim": (lambda: ac.masked_softmax(torch.randn(3, 4), dim=2), ValueError,
                           r"dim must be an int in \[-2, 2\), got 2"),
    "masked_softmax int mask": (lambda: ac.masked_softmax(torch.randn(3, 4), torch.ones(3, 4, dtype=torch.int32)),
                                TypeError, r"mask must be bool .*got dtype torch.int32"),
    # masks.py
    "padding too long": (lambda: ac.padding_mask([2, 7], 5), ValueError,
                         r"valid_lens must lie in \[0, max_len=5\], got \[2, 7\]"),
    "padding negative": (lambda: ac.padding_mask(torch.tensor([-1, 2]), 5), ValueError,
                         r"valid_lens must lie in \[0, max_len=5\], got \[-1, 2\]"),
    "padding float lens": (lambda: ac.padding_mask(torch.tensor([1.5]), 5), ValueError,
                           r"valid_lens must be a 1-D integer tensor .*torch.float32"),
    "padding list of str": (lambda: ac.padding_mask(["a"], 5), TypeError, r"valid_lens must be a list of ints"),
    "causal negative L": (lambda: ac.causal_mask(-1), ValueError, r"^L must be .*, got -1$"),
    "window zero": (lambda: masks.sliding_window_mask(4, 0), ValueError, r"^window must be .*, got 0$"),
    "to_bool of a bias": (lambda: ac.to_bool_mask(torch.tensor([0.0, -1e9])), ValueError,
                          r"mask must hold only 0 and -inf.*-1000000000.0"),
    "to_additive int mask": (lambda: ac.to_additive_mask(torch.ones(2, dtype=torch.int64)), TypeError,
                             r"mask must be bool or floating, got dtype torch.int64"),
    "to_torch_mha not tensor": (lambda: ac.to_torch_mha_mask(None), TypeError, r"mask must be a torch.Tensor"),
    # scoring.py
    "dot dims differ": (lambda: scoring.dot_score(torch.randn(2, 3, 4), torch.randn(2, 5, 6)), ValueError,
                        r"query and key must have the same last dim.*query \(2, 3, 4\), key \(2, 5, 6\)"),
    "unknown score": (lambda: scoring.make_score("bilinear"), ValueError,
                      r"unknown score name 'bilinear'; known scores: \['additive'"),
    "score missing dims": (lambda: scoring.make_score("additive", query_dim=4, key_dim=5), ValueError,
                           r"score 'additive' needs query_dim, key_dim, hidden_dim; missing: hidden_dim"),
    "scaled_dot dims": (lambda: scoring.make_score("scaled_dot", query_dim=4, key_dim=5), ValueError,
                        r"query_dim must equal key_dim, got 4 and 5"),
    "general wrong key dim": (lambda: scoring.GeneralScore(4, 5)(torch.randn(3, 4), torch.randn(6, 7)), ValueError,
                              r"key must have last dim 5, got shape \(6, 7\)"),
    # modules.py
    "embed_dim % num_heads": (lambda: ac.MultiHeadAttention(10, 3), ValueError,
                              r"embed_dim \(10\) must be divisible by num_heads \(3\)"),
    "num_heads % num_kv_heads": (lambda: ac.MultiHeadAttention(12, 4, num_kv_heads=3), ValueError,
                                 r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"),
    "mha input rank": (lambda: ac.MultiHeadAttention(8, 2)(torch.randn(5, 8)), ValueError,
                       r"query must be \(B, N, 8\) \(batch-first\), got shape \(5, 8\)"),
    "mha last dim": (lambda: ac.MultiHeadAttention(8, 2)(torch.randn(2, 5, 6)), ValueError,
                     r"query must have last dim 8, got shape \(2, 5, 6\)"),
    "mha key padding shape": (lambda: ac.MultiHeadAttention(8, 2)(torch.randn(2, 5, 8),
                                                                  key_padding_mask=torch.ones(2, 4, dtype=torch.bool)),
                              ValueError, r"key_padding_mask must have shape \(B, S\) = \(2, 5\), got \(2, 4\)"),
    "mha weights with backend": (lambda: ac.MultiHeadAttention(8, 2)(torch.randn(2, 5, 8), need_weights=True,
                                                                     backend="torch"),
                                 ValueError, r"need_weights=True runs the 'reference' backend, got backend='torch'"),
    "from_torch bias_kv": (lambda: ac.MultiHeadAttention.from_torch(
                               torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)),
                           ValueError, r"add_bias_kv=True"),
    "from_torch zero_attn": (lambda: ac.MultiHeadAttention.from_torch(
        torch.nn.MultiheadAttention(8, 2, add_zero_attn=True)), ValueError, r"add_zero_attn=True"),
    "from_torch wrong type": (lambda: ac.MultiHeadAttention.from_torch(torch.nn.Linear(2, 2)), TypeError,
                              r"m must be a torch.nn.MultiheadAttention, got Linear"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_a_clear_error(name):
    raises_as_listed(CASES[name])


def test_enough_cases():
    assert len(CASES) >= 25


def test_unavailable_backend_says_why_and_what_is_available():
    backend = Backend(
        "test-unavailable", "a backend that needs hardware this machine lacks", "attention_core.backends.reference",
        lambda: (False, "needs a CUDA device"), lambda inputs: None,
    )
    register_backend(backend)
    try:
        assert "test-unavailable" not in ac.available_backends()
        with pytest.raises(ValueError, match=r"'test-unavailable' cannot run on this machine: needs a CUDA device; "
                                             r"available here: \[.*'reference'"):
            sdpa(backend="test-unavailable")()
        with pytest.raises(ValueError, match=r"cannot run on this machine"):
            with ac.use_backend("test-unavailable"):
                pass
    finally:
        from attention_core.backends import _REGISTRY

        del _REGISTRY["test-unavailable"]


def test_errors_come_before_any_arithmetic():
    """A bad mask is reported by name, never as torch's broadcast error from inside a kernel."""
    q, k, v = qkv()
    for backend in ac.available_backends("cpu"):
        with pytest.raises(ValueError, match="attn_mask of shape"):
            ac.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, 6, dtype=torch.bool), backend=backend)


# ------------------------------------------------------------------------------------------------------------
# The primitives' own functions that the page names (book/api.md, "Bad input"): each refusal names the argument,
# the value seen and what was expected, and comes before any state changes.


def _primitive_cases():
    from attention_core import kernel_regression as KR
    from attention_core import linear_attention as LA
    from attention_core import mask_mods as MM
    from attention_core.backends import choose_backend
    from attention_core.backends import chunked as C
    from attention_core.backends.cuda_on_cpu import run_on_cpu
    from attention_core.backends.fused_checks import tensor_core_kernel
    from attention_core.distributed import layout as LY
    from attention_core.distributed import ring as R
    from attention_core.distributed import ulysses as U
    from attention_core.paged_attention import gather_paged_kv

    cache = torch.randn(4, 2, 3, 5)  # (N_blocks, H, bs, E): a row of two blocks holds 6 slots
    row = torch.tensor([0, 1])
    x = torch.randn(1, 2, 5, 4)
    return {
        "gather seq_len beyond the slots": (lambda: gather_paged_kv(cache, row, 9), ValueError,
                                            r"^seq_len must be an int in \[0, 6\], got 9$"),
        "gather seq_len negative": (lambda: gather_paged_kv(cache, row, -1), ValueError,
                                    r"^seq_len must be an int in \[0, 6\], got -1$"),
        "gather seq_len float": (lambda: gather_paged_kv(cache, row, 3.0), TypeError,
                                 r"^seq_len must be an int in \[0, 6\], got float 3.0$"),
        "gather float table": (lambda: gather_paged_kv(cache, torch.tensor([0.0, 1.0]), 6), TypeError,
                               r"^block_table_row must be an int32 or int64 tensor, got torch.float32$"),
        "gather block id out of range": (lambda: gather_paged_kv(cache, torch.tensor([0, 7]), 6), ValueError,
                                         r"^block_table_row lists blocks outside \[0, N_blocks = 4\).*max 7$"),
        "gather 2-D table": (lambda: gather_paged_kv(cache, row[None], 6), ValueError,
                             r"^block_table_row must be one sequence's row \(max_blocks,\), got shape \(1, 2\)$"),
        "gather cache 3-D": (lambda: gather_paged_kv(cache[0], row, 3), ValueError,
                             r"^cache must be \(N_blocks, H, block_size, E\), got shape \(2, 3, 5\)$"),
        "local_lengths world_size 0": (lambda: LY.local_lengths(8, 0, "contiguous"), ValueError,
                                       r"^world_size must be an int >= 1, got 0$"),
        "ring_tiles world_size 0": (lambda: R.ring_tiles(8, 0, "contiguous"), ValueError,
                                    r"^world_size must be an int >= 1, got 0$"),
        "ring_bytes negative length": (lambda: R.ring_bytes([-4, 4], 1, 2, 8, 8, 4), ValueError,
                                       r"^lengths\[0\] must be an int >= 0 \(the rows rank 0 holds\), got -4$"),
        "ring_bytes str length": (lambda: R.ring_bytes(["a"], 1, 2, 8, 8, 4), TypeError,
                                  r"^lengths\[0\] must be an int >= 0 .*got str 'a'$"),
        "ring_bytes no ranks": (lambda: R.ring_bytes([], 1, 2, 8, 8, 4), ValueError,
                                r"^lengths must hold one int >= 0 per rank, got an empty sequence$"),
        "ring_bytes itemsize 0": (lambda: R.ring_bytes([4, 4], 1, 2, 8, 8, 0), ValueError,
                                  r"^itemsize must be an int >= 1, got 0$"),
        "ulysses_bytes negative length": (lambda: U.ulysses_bytes([4, -1], 1, 2, 2, 8, 8, 4), ValueError,
                                          r"^lengths\[1\] must be an int >= 0"),
        "tensor_core_kernel unknown device": (lambda: tensor_core_kernel("tpu"), ValueError,
                                              r"^device must be a torch.device or a device string.*got 'tpu'"),
        "tensor_core_kernel int": (lambda: tensor_core_kernel(3), TypeError,
                                   r"^device must be a torch.device or a device string.*got int 3$"),
        "available_backends int": (lambda: ac.available_backends(3), TypeError,
                                   r"^device must be a torch.device or a device string.*got int 3$"),
        "chunked Hq not a multiple of H": (lambda: C.chunked_attention(torch.randn(1, 3, 5, 4), x, x), ValueError,
                                           r"^query heads \(Hq=3\) must be a multiple of the key/value heads"),
        "chunked E mismatch": (lambda: C.chunked_attention(x, torch.randn(1, 2, 5, 3), x), ValueError,
                               r"^query and key must have the same feature size E >= 1"),
        "chunked S mismatch": (lambda: C.chunked_attention(x, x, torch.randn(1, 2, 6, 4)), ValueError,
                               r"^key and value must agree in \(B, H, S\)"),
        "chunked integer query": (lambda: C.chunked_attention(x.long(), x.long(), x.long()), TypeError,
                                  r"^query must have a floating-point dtype, got torch.int64$"),
        "chunked list": (lambda: C.chunked_attention([1.0], x, x), TypeError,
                         r"^query must be a torch.Tensor, got list$"),
        "chunked mask does not broadcast": (lambda: C.chunked_attention(x, x, x, torch.ones(1, 1, 4, 5).bool()),
                                            ValueError, r"^attn_mask of shape \(1, 1, 4, 5\) does not broadcast"),
        "forward_with_lse 3-D": (lambda: C.forward_with_lse(x[0], x[0], x[0], False, 0.5), ValueError,
                                 r"^forward_with_lse takes canonical 4-D inputs"),
        "forward_with_lse E mismatch": (lambda: C.forward_with_lse(x, torch.randn(1, 2, 5, 3), x, False, 0.5),
                                        ValueError, r"^query and key must have the same feature size"),
        "forward_with_lse scale inf": (lambda: C.forward_with_lse(x, x, x, False, float("inf")), ValueError,
                                       r"^scale must be a finite float or None, got inf$"),
        "merge_partials shapes": (lambda: C.merge_partials(torch.zeros(1, 3, 2), torch.zeros(1, 3, 1),
                                                           torch.zeros(1, 4, 2), torch.zeros(1, 4, 1)),
                                  ValueError, r"^out_a and out_b must have one shape.*\(1, 3, 2\) and \(1, 4, 2\)$"),
        "merge_partials lse shape": (lambda: C.merge_partials(torch.zeros(1, 3, 2), torch.zeros(1, 3),
                                                              torch.zeros(1, 3, 2), torch.zeros(1, 3, 1)),
                                     ValueError, r"^lse_a must have out_a's shape with a 1 in the last dim"),
        "merge_partials list": (lambda: C.merge_partials([0.0], [0.0], [0.0], [0.0]), TypeError,
                                r"^out_a must be a torch.Tensor, got list$"),
        "run_on_cpu list": (lambda: run_on_cpu([1.0], x, x), TypeError, r"^query must be a torch.Tensor, got list$"),
        "positions float L": (lambda: LY.positions(8.0, 2, 0, "contiguous"), TypeError,
                              r"^L must be an int >= 0, got float 8.0$"),
        "positions str rank": (lambda: LY.positions(8, 2, "0", "contiguous"), TypeError,
                               r"^rank must be an int in \[0, world_size\) = \[0, 2\), got str '0'$"),
        "alibi list": (lambda: MM.alibi([0.5]), TypeError, r"^slopes must be a \(H,\) float tensor, got list"),
        "alibi 2-D": (lambda: MM.alibi(torch.ones(2, 2)), ValueError, r"^slopes must be .*got shape \(2, 2\)$"),
        "document list": (lambda: MM.document([0, 0, 1]), TypeError,
                          r"^document_ids must be a \(N,\) or \(B, N\) integer tensor, got list"),
        "key_padding str": (lambda: MM.key_padding("ab"), TypeError, r"^kv_lens must be B integer lengths"),
        "key_padding float tensor": (lambda: MM.key_padding(torch.ones(2)), TypeError,
                                     r"^kv_lens must be B integer lengths >= 0, got a torch.float32 tensor$"),
        "create_block_mask float BLOCK_SIZE": (
            lambda: ac.create_block_mask(MM.causal, None, None, 4, 4, BLOCK_SIZE=2.0), TypeError,
            r"^BLOCK_SIZE must be a positive int or a pair of them, got float"),
        "choose_backend not inputs": (lambda: choose_backend(3), TypeError,
                                      r"^inputs must be an AttentionInputs .*got int$"),
        "dense_mask negative L": (lambda: MM.dense_mask(MM.causal, 1, 1, -1, 3), ValueError,
                                  r"^L must be an int in \[0, \d+\], got -1$"),
        "dense_mask not a mod": (lambda: MM.dense_mask(3, 1, 1, 2, 3), TypeError, r"^mask_mod must be a function"),
        "index_grids negative B": (lambda: MM.index_grids(-1, 1, 2, 2), ValueError,
                                   r"^B must be an int in \[0, \d+\], got -1$"),
        "index_grids unknown device": (lambda: MM.index_grids(1, 1, 2, 2, device="tpu"), ValueError,
                                       r"^device 'tpu' cannot be used on this machine"),
        "dense_scores list": (lambda: MM.dense_scores(MM.noop_score, [1.0]), TypeError,
                              r"^scores must be a torch.Tensor, got list$"),
        "dense_scores 3-D": (lambda: MM.dense_scores(MM.noop_score, torch.zeros(1, 2, 3)), ValueError,
                             r"^scores must be \(B, H, L, S\), got shape \(1, 2, 3\)"),
        "leave_one_out_mask negative": (lambda: KR.leave_one_out_mask(-1), ValueError,
                                        r"^n must be an int in \[0, \d+\], got -1$"),
        "gaussian list": (lambda: KR.gaussian([1.0]), TypeError, r"^u must be a torch.Tensor, got list$"),
        "epanechnikov integer": (lambda: KR.epanechnikov(torch.ones(3, dtype=torch.long)), TypeError,
                                 r"^u must have a floating-point dtype, got torch.int64$"),
        "elu_feature_map list": (lambda: LA.elu_feature_map([1.0]), TypeError, r"^x must be a torch.Tensor, got list$"),
    }


PRIMITIVE_CASES = _primitive_cases()


@pytest.mark.parametrize("name", list(PRIMITIVE_CASES))
def test_primitives_refuse_by_name(name):
    raises_as_listed(PRIMITIVE_CASES[name])


def test_delta_rule_with_no_token_gives_the_empty_answer_and_the_state():
    from attention_core.linear_attention import delta_rule

    q = torch.randn(2, 3, 0, 4)
    v = torch.randn(2, 3, 0, 5)
    out, state = delta_rule(q, q, v)
    assert out.shape == (2, 3, 0, 5) and torch.equal(state, torch.zeros(2, 3, 5, 4))
    given = torch.randn(2, 3, 5, 4)
    out, state = delta_rule(q, q, v, state=given)
    assert out.shape == (2, 3, 0, 5) and torch.equal(state, given) and state is not given


def test_gather_refusal_leaves_the_cache_alone_and_a_good_call_matches():
    from attention_core.paged_attention import gather_paged_kv

    cache = torch.randn(4, 2, 3, 5)
    before = cache.clone()
    with pytest.raises(ValueError):
        gather_paged_kv(cache, torch.tensor([0, 7]), 6)
    assert torch.equal(cache, before)
    got = gather_paged_kv(cache, torch.tensor([2, 0, 9]), 5)  # the unused third entry may hold anything
    assert torch.equal(got, torch.cat([cache[2], cache[0]], dim=1)[:, :5])


def test_leave_one_out_mse_refuses_a_list_by_name():
    """A referee's probe: a list for x gave AttributeError ('list' has no .shape) instead of naming x."""
    from attention_core import kernel_regression as kr

    with pytest.raises(TypeError, match="x"):
        kr.leave_one_out_mse([1.0, 2.0, 3.0], torch.ones(3))


# ------------------------------------------------------------------ sizes that cannot fit, refused by name

HUGE = 2**31  # an (HUGE, HUGE) anything holds 2**62 entries: more than any machine's memory
HUGE_S = "2147483648"


def _wide(*shape, dtype=torch.float32):
    """A zero-stride view of one element with shape ``shape``: it costs nothing to make, whatever its size."""
    return torch.zeros((1,) * len(shape), dtype=dtype).expand(*shape)


def _size_refusals():
    from attention_core import functional as F
    from attention_core import indexer, linear_attention, positional
    from attention_core import sparse_patterns as sp
    from attention_core.paged_attention import gather_paged_kv
    from attention_core.serving.blocks import BlockAllocator

    square = rf"\({HUGE_S}, {HUGE_S}\)"
    wide_bool = _wide(HUGE, HUGE, dtype=torch.bool)
    long = _wide(1, 1, 2**24, 8)  # 512 MiB as read: it fits, its (L, S) = (2**24, 2**24) products do not
    ls = r"\(1, 1, 16777216, 16777216\)"
    return {  # name: (call, what the message must say: the argument and its size)
        "attention": (lambda: F.attention(_wide(1, 1, HUGE, 8), long, long),
                      rf"attention's query of shape \(1, 1, {HUGE_S}, 8\)"),
        "attention_with_weights": (lambda: F.attention_with_weights(long, long, long),
                                   rf"\(B, Hq, L, S\) = {ls} scores and weights would take"),
        "nadaraya_watson_weights": (lambda: ac.nadaraya_watson_weights(_wide(2**24, 1), _wide(2**24, 1)),
                                    r"nadaraya_watson's \(L, S, d\) = \(16777216, 16777216, 1\) differences"),
        "linear_attention kernel matrix": (lambda: linear_attention.linear_attention(long, long, long),
                                           rf"linear_attention's \(\.\.\., L, S\) = {ls} kernel matrix"),
        "sliding_window_mask": (lambda: masks.sliding_window_mask(HUGE, 4),
                                rf"sliding_window_mask's \(L, S\) = {square} bool mask would take"),
        "padding_mask": (lambda: masks.padding_mask(_wide(HUGE, dtype=torch.long), HUGE),
                         rf"padding_mask's \(len\(valid_lens\), max_len\) = {square} bool mask would take"),
        "fixed_mask": (lambda: sp.fixed_mask(HUGE, 4), rf"fixed_mask's dense \(L, S\) = {square} mask"),
        "longformer_mask": (lambda: sp.longformer_mask(HUGE, 4), rf"longformer_mask's dense \(L, S\) = {square}"),
        "longformer_mod": (lambda: sp.longformer_mod(4, max_len=2**62),
                           rf"longformer_mod's \(max_len,\) = \({2**62},\) table of global tokens"),
        "bigbird_mask": (lambda: sp.bigbird_mask(HUGE, 4), rf"bigbird_mod's dense \(L, S\) = {square}"),
        "bigbird_mod": (lambda: sp.bigbird_mod(HUGE, 4), rf"bigbird_mod's dense \(L, S\) = {square}"),
        "two_hop_reach": (lambda: sp.two_hop_reach(wide_bool), rf"two_hop_reach's .* of mask {square}"),
        "reaches_every_pair": (lambda: sp.reaches_every_pair(wide_bool), rf"two_hop_reach's .* of mask {square}"),
        "tiles_visited": (lambda: sp.tiles_visited(wide_bool), rf"tiles_visited's padded mask of {square}"),
        "draw_omega": (lambda: linear_attention.draw_omega(HUGE, HUGE),
                       rf"draw_omega's \(num_features, dim\) = {square}"),
        "BlockAllocator": (lambda: BlockAllocator(2**50), rf"num_blocks = {2**50} blocks would take"),
        "weights_entropy": (lambda: ac.weights_entropy(_wide(HUGE, HUGE)),
                            rf"weights_entropy's weights of shape {square}"),
        "causal_allowed": (lambda: indexer.causal_allowed(HUGE, HUGE), rf"causal_allowed's \(L, S\) = {square}"),
        "causal_topk_mask": (lambda: indexer.causal_topk_mask(_wide(HUGE, HUGE), 4),
                             rf"causal_topk_mask's sort of scores {square}"),
        "indexer_kl_loss": (lambda: indexer.indexer_kl_loss(_wide(HUGE, HUGE), _wide(1, HUGE, HUGE), wide_bool),
                            rf"indexer_kl_loss's attn_weights \(1, {HUGE_S}, {HUGE_S}\) and scores {square}"),
        "gather_paged_kv": (lambda: gather_paged_kv(_wide(1, 1024, 16, 1024), torch.zeros(2**16, dtype=torch.long),
                                                    2**20), r"gather_paged_kv's copy of seq_len = 1048576 slots"),
        # the positional tables, beyond what a tensor can index (below it, torch's allocator answers)
        "sinusoidal_encoding": (lambda: positional.sinusoidal_encoding(2**62, 16),
                                rf"num_positions \* d_model = {2**62} \* 16 is more than a tensor can hold"),
        "SinusoidalPositionalEncoding": (lambda: positional.SinusoidalPositionalEncoding(16, 2**62),
                                         rf"num_positions \* d_model = {2**62} \* 16 is more than a tensor can hold"),
        "LearnedPositionalEmbedding": (lambda: positional.LearnedPositionalEmbedding(2**62, 16),
                                       rf"max_len \* d_model = {2**62} \* 16 is more than a tensor can hold"),
        "RotaryEmbedding": (lambda: positional.RotaryEmbedding(16, 2**62),
                            rf"max_len \* head_dim = {2**62} \* 16 is more than a tensor can hold"),
    }


SIZE_REFUSALS = _size_refusals()
POSITIONAL = {"sinusoidal_encoding", "SinusoidalPositionalEncoding", "LearnedPositionalEmbedding", "RotaryEmbedding"}


@pytest.mark.parametrize("name", sorted(SIZE_REFUSALS))
def test_a_size_that_cannot_fit_is_refused_by_name_before_allocating(name):
    """Each refusal the API page names, from sizes alone or zero-stride views (nothing large is allocated): a
    TooLargeError (a ValueError and a MemoryError) naming the argument and its size; the positional tables,
    past what a tensor can index, a ValueError saying so."""
    from attention_core._checks import TooLargeError

    call, message = SIZE_REFUSALS[name]
    expected = ValueError if name in POSITIONAL else TooLargeError
    with pytest.raises(expected, match=message) as info:
        call()
    if expected is TooLargeError:
        assert isinstance(info.value, MemoryError) and "GiB" in str(info.value)


def test_gather_from_an_empty_cache_checks_its_size_without_indexing_a_block():
    """The size check multiplies the cache's per-block shape: a cache of 0 blocks (nothing to index) still answers."""
    from attention_core.paged_attention import gather_paged_kv

    assert gather_paged_kv(torch.zeros(0, 2, 4, 3), torch.zeros(2, dtype=torch.long), 0).shape == (2, 0, 3)
    with pytest.raises(ValueError, match="N_blocks = 0"):
        gather_paged_kv(torch.zeros(0, 2, 4, 3), torch.zeros(2, dtype=torch.long), 3)
