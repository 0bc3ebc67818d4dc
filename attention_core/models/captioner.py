"""A tiny image captioner whose words read image patches through cross-attention.

In the spirit of Show, Attend and Tell (Xu et al., 2015), with the Transformer's parts: the image is cut into
patches (:class:`~attention_core.models.vit.PatchEmbedding`) with fixed 2-D sine-cosine positions, optionally
mixed by encoder layers, and layer-normed into the *memory*; a causal
:class:`~attention_core.models.transformer.TransformerDecoder` reads the caption so far, and its cross-attention
(queries from the words, keys and values from the patches, :class:`~attention_core.multihead.MultiHeadAttention`)
says which patches each emitted word looked at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from attention_core._checks import check_bool_flag, check_int, check_positive_int, check_tensor
from attention_core.models._inputs import check_config, check_token_ids
from attention_core.models.transformer import (
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from attention_core.models.vit import PatchEmbedding, sincos_2d_positions
from attention_core.training.modes import eval_mode

__all__ = ["CAPTIONER_KEYS", "Captioner", "CaptionerOutput", "build_captioner", "greedy_caption"]

#: The keys a :class:`Captioner` config must have (``seed`` is optional).
CAPTIONER_KEYS = ("image_size", "patch_size", "in_channels", "vocab_size", "max_len", "d_model", "num_heads",
                  "dim_feedforward", "encoder_layers", "decoder_layers")


@dataclass
class CaptionerOutput:
    """logits (B, T, V); cross_attentions: one (B, H, T, N) tensor per decoder layer when asked for."""

    logits: torch.Tensor
    cross_attentions: Optional[Tuple[torch.Tensor, ...]] = None


class Captioner(nn.Module):
    """Config keys: ``image_size`` (H, W), ``patch_size``, ``in_channels``, ``vocab_size``, ``max_len``,
    ``d_model``, ``num_heads``, ``dim_feedforward``, ``encoder_layers`` (may be 0: each memory slot is then one
    patch and nothing else), ``decoder_layers``, ``seed``."""

    def __init__(self, config: Dict[str, Any]) -> None:
        super().__init__()
        self.config = check_config(config, "config", CAPTIONER_KEYS, ("seed",))
        c = self.config
        for key in ("in_channels", "vocab_size", "max_len", "d_model", "num_heads", "dim_feedforward",
                    "decoder_layers"):
            check_positive_int(c[key], f"config['{key}']")
        check_positive_int(c["encoder_layers"], "config['encoder_layers']", allow_zero=True)
        check_positive_int(c.get("seed", 0), "config['seed']", allow_zero=True)
        D, H = c["d_model"], c["num_heads"]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(c.get("seed", 0)))
            self.patch_embed = PatchEmbedding(c["image_size"], c["patch_size"], c["in_channels"], D)
            self.register_buffer("patch_pos", sincos_2d_positions(*self.patch_embed.grid, D), persistent=False)
            self.encoder = (TransformerEncoder(lambda: TransformerEncoderLayer(D, H, c["dim_feedforward"],
                                                                                norm_first=True),
                                               c["encoder_layers"]) if c["encoder_layers"] > 0 else None)
            self.memory_norm = nn.LayerNorm(D)
            self.tok_embed = nn.Embedding(c["vocab_size"], D)
            self.tok_pos = nn.Parameter(torch.randn(c["max_len"], D) * 0.02)
            self.decoder = TransformerDecoder(lambda: TransformerDecoderLayer(D, H, c["dim_feedforward"],
                                                                               norm_first=True),
                                              c["decoder_layers"], norm=nn.LayerNorm(D))
            self.head = nn.Linear(D, c["vocab_size"])

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> memory (B, N, D), one slot per patch in reading order."""
        x = self.patch_embed(images) + self.patch_pos  # (B, N, D)
        if self.encoder is not None:
            x = self.encoder(x).last_hidden_state
        return self.memory_norm(x)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor, need_weights: bool = False) -> CaptionerOutput:
        """images (B, C, H, W), tokens (B, T) long (the caption so far, from the start token) -> next-word logits.

        Raises:
            TypeError: images not floating or not of the model's dtype; tokens not int64 ids.
            ValueError: a shape, a batch size or a device that does not fit; an id outside ``[0, vocab_size)``;
                ``T > max_len``.
        """
        check_tensor(images, "images")
        check_token_ids(tokens, "tokens", self.config["vocab_size"], self.tok_embed.weight.device)
        check_bool_flag(need_weights, "need_weights")
        B, T = tokens.shape
        if T > self.config["max_len"]:
            raise ValueError(f"tokens has length {T}, more than max_len={self.config['max_len']}")
        if images.dim() >= 1 and images.shape[0] != B:
            raise ValueError(f"images (batch {images.shape[0]}) and tokens (batch {B}) must have one batch size")
        memory = self.encode(images)
        x = self.tok_embed(tokens) + self.tok_pos[:T]  # (B, T, D)
        out = self.decoder(x, memory, need_weights=need_weights, tgt_is_causal=True)
        return CaptionerOutput(self.head(out.last_hidden_state), out.cross_attentions)


@torch.no_grad()
def greedy_caption(model: Captioner, images: torch.Tensor, start: int, length: int
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Emit ``length`` words greedily after the ``start`` token.

    The model runs in eval mode and every submodule's mode is given back afterwards (also on error).

    Args:
        model: a :class:`Captioner`.
        images: (B, C, H, W), the model's dtype and device.
        start: the start token's id, in ``[0, vocab_size)``.
        length: words to emit, ``0 .. max_len``.

    Returns:
        ``(words, cross)``: words (B, length) long; cross (B, length, N), the last decoder layer's
        cross-attention (mean over heads) of the step that emitted each word.
    """
    if not isinstance(model, Captioner):
        raise TypeError(f"model must be a Captioner, got {type(model).__name__}")
    V, max_len = model.config["vocab_size"], model.config["max_len"]
    check_int(start, "start", low=0, high=V, high_open=True, note="(a token id)")
    check_int(length, "length", low=0, high=max_len, note=f"(words to emit; max_len = {max_len})")
    check_tensor(images, "images")
    if images.dim() != 4:
        raise ValueError(f"images must be (B, C, H, W), got shape {tuple(images.shape)}")
    with eval_mode(model):
        return _greedy(model, images, start, length)


def _greedy(model: Captioner, images: torch.Tensor, start: int, length: int) -> Tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.full((images.shape[0], 1), start, dtype=torch.long, device=model.tok_embed.weight.device)
    for _ in range(length):
        nxt = model(images, tokens).logits[:, -1].argmax(-1)  # (B, V) -> (B,)
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)  # (B, t) -> (B, t + 1)
    out = model(images, tokens[:, :-1], need_weights=True)
    cross = out.cross_attentions[-1].mean(dim=1)  # (B, H, T, N) -> (B, T, N)
    return tokens[:, 1:], cross


def build_captioner(config: Dict[str, Any]) -> Captioner:
    """The checkpoint builder: ``Captioner(config)``."""
    return Captioner(config)
