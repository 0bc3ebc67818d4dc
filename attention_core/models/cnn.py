"""A small convolutional classifier: the baseline a Vision Transformer is measured against.

Two 3x3 convolutions (padding 1) with ReLU, a 2x2 max-pool after each, then a linear head on the flattened
map. Its width ``channels`` sets the parameter count, so it can be matched to a ViT's
(:func:`cnn_parameters` counts without building).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import nn

from attention_core._checks import check_positive_int
from attention_core.models._inputs import check_config, check_images

__all__ = ["SmallCNN", "build_cnn", "cnn_parameters"]


class SmallCNN(nn.Module):
    """Config keys: ``image_size`` (H, W), ``in_channels``, ``num_classes``, ``channels`` (c1, c2), ``seed``."""

    def __init__(self, config: Dict[str, Any]) -> None:
        super().__init__()
        self.config = check_config(config, "config", ("image_size", "in_channels", "num_classes", "channels"),
                                   ("seed",))
        c = self.config
        if (not isinstance(c["image_size"], (list, tuple)) or len(c["image_size"]) != 2
                or not isinstance(c["channels"], (list, tuple)) or len(c["channels"]) != 2):
            raise ValueError(f"config['image_size'] and config['channels'] must be pairs of ints, got "
                             f"{c['image_size']!r:.40} and {c['channels']!r:.40}")
        for key, n in [("image_size", c["image_size"][0]), ("image_size", c["image_size"][1]),
                       ("in_channels", c["in_channels"]), ("num_classes", c["num_classes"]),
                       ("channels", c["channels"][0]), ("channels", c["channels"][1])]:
            check_positive_int(n, f"config['{key}']")
        check_positive_int(c.get("seed", 0), "config['seed']", allow_zero=True)
        self.image_size = tuple(c["image_size"])
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
        """(B, C, H, W) -> logits (B, num_classes), in the module's dtype (a float64 module takes float64 images)."""
        check_images(images, "images", self.config["in_channels"], self.image_size, self.head.weight)
        return self.head(self.features(images).flatten(1))  # (B, c2, H/4, W/4) -> (B, c2*H*W/16)


def cnn_parameters(image_size: Tuple[int, int], in_channels: int, num_classes: int, channels: Tuple[int, int]
                   ) -> int:
    """The parameter count of ``SmallCNN`` with these settings (weights and biases)."""
    (H, W), (c1, c2) = image_size, channels
    return (in_channels * 9 * c1 + c1) + (c1 * 9 * c2 + c2) + (c2 * (H // 4) * (W // 4) * num_classes + num_classes)


def build_cnn(config: Dict[str, Any]) -> SmallCNN:
    """The checkpoint builder: ``SmallCNN(config)``."""
    return SmallCNN(config)
