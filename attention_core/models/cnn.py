"""A small convolutional classifier: the baseline a Vision Transformer is measured against.

Two 3x3 convolutions (padding 1) with ReLU, a 2x2 max-pool after each, then a linear head on the flattened
map. Its width ``channels`` sets the parameter count, so it can be matched to a ViT's
(:func:`cnn_parameters` counts without building).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import nn

__all__ = ["SmallCNN", "build_cnn", "cnn_parameters"]


class SmallCNN(nn.Module):
    """Config keys: ``image_size`` (H, W), ``in_channels``, ``num_classes``, ``channels`` (c1, c2), ``seed``."""

    def __init__(self, config: Dict[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        c = self.config
        H, W = c["image_size"]
        if H % 4 or W % 4:
            raise ValueError(f"image_size must be multiples of 4 (two 2x2 pools), got {H}x{W}")
        c1, c2 = c["channels"]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(c.get("seed", 0)))
            self.features = nn.Sequential(
                nn.Conv2d(c["in_channels"], c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            )
            self.head = nn.Linear(c2 * (H // 4) * (W // 4), c["num_classes"])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> logits (B, num_classes)."""
        return self.head(self.features(images).flatten(1))  # (B, c2, H/4, W/4) -> (B, c2*H*W/16)


def cnn_parameters(image_size: Tuple[int, int], in_channels: int, num_classes: int, channels: Tuple[int, int]
                   ) -> int:
    """The parameter count of ``SmallCNN`` with these settings (weights and biases)."""
    (H, W), (c1, c2) = image_size, channels
    return (in_channels * 9 * c1 + c1) + (c1 * 9 * c2 + c2) + (c2 * (H // 4) * (W // 4) * num_classes + num_classes)


def build_cnn(config: Dict[str, Any]) -> SmallCNN:
    """The checkpoint builder: ``SmallCNN(config)``."""
    return SmallCNN(config)
