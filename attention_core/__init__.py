"""attention_core: the library behind the attention book.

One API for the whole lineage of attention, from Nadaraya-Watson kernel regression to fused kernels.
The public names below are the contract; everything else is an implementation detail.
"""

from attention_core import mask_mods, scoring
from attention_core.backends import available_backends, get_backend, use_backend
from attention_core.flex_attention import BlockMask, create_block_mask, flex_attention
from attention_core.functional import attention_weights, masked_softmax, scaled_dot_product_attention, weights_entropy
from attention_core.kernel_regression import KERNELS, nadaraya_watson, nadaraya_watson_weights
from attention_core.mask_mods import and_masks, or_masks
from attention_core.masks import (
    causal_mask,
    from_torch_mha_mask,
    padding_mask,
    to_additive_mask,
    to_bool_mask,
    to_torch_mha_mask,
)
from attention_core.multihead import MultiHeadAttention, kv_cache_bytes

__version__ = "0.1.0"

__all__ = [
    "BlockMask",
    "KERNELS",
    "MultiHeadAttention",
    "and_masks",
    "attention_weights",
    "available_backends",
    "causal_mask",
    "create_block_mask",
    "flex_attention",
    "from_torch_mha_mask",
    "get_backend",
    "kv_cache_bytes",
    "mask_mods",
    "masked_softmax",
    "nadaraya_watson",
    "nadaraya_watson_weights",
    "or_masks",
    "padding_mask",
    "scaled_dot_product_attention",
    "scoring",
    "to_additive_mask",
    "to_bool_mask",
    "to_torch_mha_mask",
    "use_backend",
    "weights_entropy",
]
