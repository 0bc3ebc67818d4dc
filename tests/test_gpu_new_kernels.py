"""The Triton flex and paged kernels on a real GPU against the dense and contiguous references (skipped without
CUDA; under the CPU interpreter the same kernels are checked in test_flex_attention.py and
test_paged_attention.py)."""

from __future__ import annotations

import pytest
import torch

from attention_core import mask_mods as mm
from attention_core.flex_attention import create_block_mask, flex_attention
from attention_core.paged_attention import paged_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODS = {
    "causal": lambda L, S: mm.causal,
    "sliding_window_64": lambda L, S: mm.sliding_window(64),
    "sinks_4_window_64": lambda L, S: mm.sinks_and_window(4, 64),
    "document": lambda L, S: mm.document(torch.arange(S, device="cuda") // 100),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("name", sorted(MODS))
@pytest.mark.parametrize("L", [256, 333])
def test_triton_flex_matches_the_dense_reference_on_the_gpu(name, dtype, L) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, L, 64, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    from attention_core.backends.triton_flex import GPU_TILES

    block = create_block_mask(MODS[name](L, L), 2, 4, L, L, device="cuda", BLOCK_SIZE=GPU_TILES[dtype])
    got = flex_attention(q, k, v, block_mask=block, backend="triton")
    want = flex_attention(q.double(), k.double(), v.double(), block_mask=block, backend="reference")
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_paged_matches_contiguous_on_the_gpu(dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    B, Hq, H, E, bs, n_blocks = 3, 8, 2, 64, 16, 40
    seq_lens = torch.tensor([37, 128, 5], device="cuda")
    kc = torch.randn(n_blocks, H, bs, E, device="cuda", dtype=dtype, generator=g)
    vc = torch.randn(n_blocks, H, bs, E, device="cuda", dtype=dtype, generator=g)
    table = torch.randperm(n_blocks, device="cuda", generator=g)[: B * 8].view(B, 8)
    q = torch.randn(B, Hq, 1, E, device="cuda", dtype=dtype, generator=g)
    got = paged_attention(q, kc, vc, table, seq_lens, path="triton")
    want = paged_attention(q.double(), kc.double(), vc.double(), table, seq_lens, path="gather")
    tol = 2e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
