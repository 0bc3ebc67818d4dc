"""A small Vision Transformer (Dosovitskiy et al., 2021): an image read as a sequence of patches.

The image is cut into non-overlapping ``p x p`` patches (:func:`patchify`), each flattened patch is mapped to
``d_model`` by one linear layer (:class:`PatchEmbedding`, the same function as a convolution with kernel and
stride ``p``), a position embedding is added (learned, or the fixed 2-D sine-cosine table of
:func:`sincos_2d_positions`), and the sequence goes through the library's
:class:`~attention_core.models.transformer.TransformerEncoder` (pre-LN,
:class:`~attention_core.multihead.MultiHeadAttention` inside). The image is summarised by a class token
prepended to the patches (``pool="cls"``, as in the paper) or by the mean of the patch states (``pool="mean"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from attention_core._checks import check_dropout, check_positive_int, check_tensor, fmt_shape
from attention_core.models._inputs import check_config, check_images
from attention_core.models.transformer import TransformerEncoder, TransformerEncoderLayer
from attention_core.positional import sinusoidal_encoding

__all__ = [
    "PatchEmbedding",
    "ViTOutput",
    "VisionTransformer",
    "build_vit",
    "patch_grid",
    "patchify",
    "sincos_2d_positions",
    "unpatchify",
]


def patch_grid(image_size: Tuple[int, int], patch_size: int) -> Tuple[int, int]:
    """Rows and columns of patches of an image of ``image_size = (H, W)`` cut into ``patch_size`` squares."""
    if (not isinstance(image_size, (tuple, list)) or len(image_size) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in image_size)):
        raise ValueError(f"image_size must be (H, W), two positive ints, got {image_size!r:.60}")
    H, W = image_size
    if not isinstance(patch_size, int) or isinstance(patch_size, bool) or patch_size < 1:
        raise ValueError(f"patch_size must be a positive int, got {patch_size!r}")
    if H % patch_size or W % patch_size:
        raise ValueError(f"image size {H}x{W} must be a multiple of patch_size={patch_size}")
    return H // patch_size, W // patch_size


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Cut images into flattened patches, row by row (reading order).

    Args:
        images: (B, C, H, W); H and W multiples of ``patch_size``.
        patch_size: side p of a square patch.

    Returns:
        (B, N, C*p*p) with ``N = (H/p) * (W/p)``; patch ``n = r * (W/p) + c`` holds rows ``r*p .. r*p+p-1`` and
        columns ``c*p .. c*p+p-1``, flattened channel-first then row-major.
    """
    check_tensor(images, "images")
    if images.dim() != 4:
        raise ValueError(f"images must be a (B, C, H, W) tensor, got shape {fmt_shape(images.shape)}")
    B, C, H, W = images.shape
    gh, gw = patch_grid((H, W), patch_size)
    p = patch_size
    x = images.reshape(B, C, gh, p, gw, p)  # (B, C, H, W) -> (B, C, gh, p, gw, p)
    x = x.permute(0, 2, 4, 1, 3, 5)  # -> (B, gh, gw, C, p, p)
    return x.reshape(B, gh * gw, C * p * p)  # -> (B, N, C*p*p)


def unpatchify(patches: torch.Tensor, patch_size: int, image_size: Tuple[int, int]) -> torch.Tensor:
    """The inverse of :func:`patchify`: (B, N, C*p*p) -> (B, C, H, W) for ``image_size = (H, W)``."""
    check_tensor(patches, "patches")
    if patches.dim() != 3:
        raise ValueError(f"patches must be a (B, N, C*p*p) tensor, got shape {fmt_shape(patches.shape)}")
    B, N, F = patches.shape
    gh, gw = patch_grid(image_size, patch_size)
    p = patch_size
    if N != gh * gw or F % (p * p):
        raise ValueError(f"patches {tuple(patches.shape)} do not tile a {image_size} image with patch_size={p}")
    C = F // (p * p)
    x = patches.reshape(B, gh, gw, C, p, p)  # (B, N, C*p*p) -> (B, gh, gw, C, p, p)
    x = x.permute(0, 3, 1, 4, 2, 5)  # -> (B, C, gh, p, gw, p)
    return x.reshape(B, C, gh * p, gw * p)  # -> (B, C, H, W)


def sincos_2d_positions(grid_h: int, grid_w: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Fixed 2-D sine-cosine positions: (grid_h * grid_w, dim), patches in reading order.

    The first ``dim/2`` columns are the 1-D table of :func:`~attention_core.positional.sinusoidal_encoding` at the
    patch's row, the last ``dim/2`` the same table at its column (``dim`` a multiple of 4), so two patches in the
    same row share the first half exactly.
    """
    if not isinstance(dim, int) or dim % 4:
        raise ValueError(f"dim must be a multiple of 4 (two halves, each sin/cos pairs), got {dim!r}")
    rows = sinusoidal_encoding(grid_h, dim // 2, base)  # (gh, D/2)
    cols = sinusoidal_encoding(grid_w, dim // 2, base)  # (gw, D/2)
    r = rows[:, None, :].expand(grid_h, grid_w, dim // 2)  # (gh, D/2) -> (gh, gw, D/2)
    c = cols[None, :, :].expand(grid_h, grid_w, dim // 2)  # (gw, D/2) -> (gh, gw, D/2)
    return torch.cat([r, c], dim=-1).reshape(grid_h * grid_w, dim)  # (gh, gw, D) -> (N, D)


class PatchEmbedding(nn.Module):
    """Patches -> vectors: :func:`patchify`, then one ``nn.Linear(C*p*p, d_model)``.

    Args:
        image_size: (H, W).
        patch_size: p.
        in_channels: C.
        d_model: width D of each patch vector.
    """

    def __init__(self, image_size: Tuple[int, int], patch_size: int, in_channels: int, d_model: int) -> None:
        super().__init__()
        self.grid = patch_grid(tuple(image_size) if isinstance(image_size, (tuple, list)) else image_size,
                               patch_size)
        check_positive_int(in_channels, "in_channels")
        check_positive_int(d_model, "d_model")
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.proj = nn.Linear(in_channels * patch_size * patch_size, d_model)

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, N, D), in the dtype of the projection (a float64 module keeps float64)."""
        p = self.patch_size
        check_images(images, "images", self.in_channels, (self.grid[0] * p, self.grid[1] * p), self.proj.weight)
        return self.proj(patchify(images, self.patch_size))  # (B, N, C*p*p) -> (B, N, D)


@dataclass
class ViTOutput:
    """What :class:`VisionTransformer` returns.

    Attributes:
        logits: (B, num_classes).
        attentions: one (B, H, T, T) tensor per layer when asked for (T = patches, + 1 with a class token).
    """

    logits: torch.Tensor
    attentions: Optional[Tuple[torch.Tensor, ...]] = None


#: The keys a :class:`VisionTransformer` config must have (``dropout`` and ``seed`` are optional).
VIT_KEYS = ("image_size", "patch_size", "in_channels", "num_classes", "d_model", "num_layers", "num_heads",
            "dim_feedforward", "pos", "pool")


class VisionTransformer(nn.Module):
    """A small ViT built from a plain config dict (so it checkpoints with :mod:`attention_core.training.checkpoint`).

    Config keys: ``image_size`` (H, W), ``patch_size``, ``in_channels``, ``num_classes``, ``d_model``,
    ``num_layers``, ``num_heads``, ``dim_feedforward``, ``pos`` (``"learned"`` or ``"sincos"``), ``pool``
    (``"cls"`` or ``"mean"``), ``dropout`` (default 0), ``seed`` (weights' seed, default 0).
    """

    def __init__(self, config: Dict[str, Any]) -> None:
        super().__init__()
        self.config = check_config(config, "config", VIT_KEYS, ("dropout", "seed"))
        c = self.config
        for key in ("in_channels", "num_classes", "d_model", "num_layers", "num_heads", "dim_feedforward"):
            check_positive_int(c[key], f"config['{key}']")
        check_dropout(c.get("dropout", 0.0), "config['dropout']")
        check_positive_int(c.get("seed", 0), "config['seed']", allow_zero=True)
        if c["pos"] not in ("learned", "sincos"):
            raise ValueError(f"pos must be 'learned' or 'sincos', got {c['pos']!r}")
        if c["pool"] not in ("cls", "mean"):
            raise ValueError(f"pool must be 'cls' or 'mean', got {c['pool']!r}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(c.get("seed", 0)))
            D = c["d_model"]
            self.patch_embed = PatchEmbedding(c["image_size"], c["patch_size"], c["in_channels"], D)
            N = self.patch_embed.num_patches
            if c["pos"] == "learned":
                self.pos_embed = nn.Parameter(torch.randn(N, D) * 0.02)
            else:
                self.register_buffer("pos_embed", sincos_2d_positions(*self.patch_embed.grid, D), persistent=False)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, D)) if c["pool"] == "cls" else None
            self.encoder = TransformerEncoder(
                lambda: TransformerEncoderLayer(D, c["num_heads"], c["dim_feedforward"],
                                                dropout=float(c.get("dropout", 0.0)), norm_first=True),
                c["num_layers"], norm=nn.LayerNorm(D))
            self.head = nn.Linear(D, c["num_classes"])

    @property
    def has_cls_token(self) -> bool:
        return self.cls_token is not None

    def embed(self, images: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Patch vectors plus positions, with the class token first when there is one: (B, T, D).

        ``positions`` (N, D) replaces the model's own table for this call (an ablation: shuffled or zeroed
        positions); the model itself is not changed."""
        pos = self.pos_embed
        if positions is not None:
            check_tensor(positions, "positions")
            if positions.shape != pos.shape or positions.dtype != pos.dtype or positions.device != pos.device:
                raise ValueError(f"positions must be {fmt_shape(pos.shape)} {pos.dtype} on {pos.device} like the "
                                 f"model's table, got {fmt_shape(positions.shape)} {positions.dtype} on "
                                 f"{positions.device}")
            pos = positions
        x = self.patch_embed(images) + pos  # (B, N, D) + (N, D)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # -> (B, 1 + N, D)
        return x

    def forward(self, images: torch.Tensor, need_weights: bool = False,
                positions: Optional[torch.Tensor] = None) -> ViTOutput:
        """(B, C, H, W) -> :class:`ViTOutput` (attentions per layer when ``need_weights``); ``positions`` (N, D),
        if given, stands in for the position table in this call (see :meth:`embed`)."""
        out = self.encoder(self.embed(images, positions), need_weights=need_weights)
        h = out.last_hidden_state  # (B, T, D)
        pooled = h[:, 0] if self.cls_token is not None else h.mean(dim=1)  # (B, T, D) -> (B, D)
        return ViTOutput(self.head(pooled), out.attentions)


def build_vit(config: Dict[str, Any]) -> VisionTransformer:
    """The builder :func:`~attention_core.training.checkpoint.load_checkpoint` calls: ``VisionTransformer(config)``."""
    return VisionTransformer(config)

