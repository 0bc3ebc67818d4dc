"""Training the models of chapter 14, the checkpoints it loads, and the ViT-vs-CNN comparison it reports.

Recipes: :data:`VIT_RECIPE` (a ViT on the 8x8 digits, learned positions and a class token),
:data:`CAPTION_RECIPE` (a captioner on rows of three digits). :func:`cnn_config_matching` sizes the CNN baseline
to the ViT's parameter count; :func:`run_comparison` trains both at several training-set sizes and seeds (and
the ViT's position / pooling variants on all the data) and writes ``checkpoints/comparison.json``.

Command line (one CPU thread; writes the checkpoints, their manifest and the comparison)::

    python -m attention_core.vision.train                 # everything (a few minutes)
    python -m attention_core.vision.train --only vit      # one part: vit, captioner or comparison
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from attention_core._checks import check_instance, check_int, check_positive_int, check_tensor
from attention_core.models.captioner import Captioner, build_captioner
from attention_core.models.cnn import SmallCNN, cnn_parameters
from attention_core.models.vit import VisionTransformer, build_vit
from attention_core.training.checkpoint import TrainLog, load_or_train_recipe, save_recipe_checkpoint
from attention_core.training.loop import TrainRecipe, fit
from attention_core.training.modes import eval_mode
from attention_core.vision.data import WORDS, Digits, load_digits, make_caption_set, subset

__all__ = [
    "CAPTION_RECIPE",
    "CHECKPOINT_DIR",
    "COMPARISON_FILE",
    "CaptionRecipe",
    "VIT_RECIPE",
    "ViTRecipe",
    "accuracy",
    "cnn_config_matching",
    "load_comparison",
    "load_or_train_captioner",
    "load_or_train_vit",
    "main",
    "run_comparison",
    "train_captioner",
    "train_classifier",
]

PathLike = Union[str, Path]
#: Folder of the shipped checkpoints, their manifest and the comparison (package data).
CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoints"
#: File name of the recorded ViT-vs-CNN comparison inside :data:`CHECKPOINT_DIR`.
COMPARISON_FILE = "comparison.json"


@dataclass(frozen=True)
class _VisionRecipe(TrainRecipe, batch_size=64, warmup=100, weight_decay=0.05):
    """The training the vision recipes share: AdamW (weight decay on the matrices), learning rate warmed up over
    ``warmup`` steps, then a half cosine over ``steps - warmup`` steps towards zero (the last step is one short of
    it; ``min_lr_ratio`` must stay 0). Both recipes draw batches of 64 and warm up over 100 steps, with weight
    decay 0.05."""

    OPTIMIZER: ClassVar[str] = "adamw"

    def lr_at(self, step: int) -> float:
        # written as the shipped checkpoints were trained (the angle rounded as pi * k / n), so they reproduce
        if self.min_lr_ratio != 0:
            raise ValueError(f"the vision recipes decay to zero: min_lr_ratio must be 0, got {self.min_lr_ratio!r}")
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        return self.lr * 0.5 * (1 + math.cos(math.pi * (step - self.warmup) / max(self.steps - self.warmup, 1)))


@dataclass(frozen=True)
class ViTRecipe(_VisionRecipe, steps=800, lr=3e-3, data_seed=0):
    """A ViT on the digits: patches of ``patch_size`` pixels, ``num_layers`` pre-LN blocks of width ``d_model``;
    ``steps`` AdamW steps of ``batch_size`` images drawn (seeded by ``data_seed``) from ``train_size`` training
    images, learning rate warmed up over ``warmup`` steps then cosine-decayed to zero; no augmentation."""

    name: str = "vit_digits"
    patch_size: int = 2
    d_model: int = 32
    num_layers: int = 3
    num_heads: int = 4
    dim_feedforward: int = 64
    pos: str = "learned"
    pool: str = "cls"
    train_size: int = 1437

    def config(self) -> Dict[str, Any]:
        """The config dict of :func:`~attention_core.models.vit.build_vit`."""
        return {"image_size": [8, 8], "patch_size": self.patch_size, "in_channels": 1, "num_classes": 10,
                "d_model": self.d_model, "num_layers": self.num_layers, "num_heads": self.num_heads,
                "dim_feedforward": self.dim_feedforward, "pos": self.pos, "pool": self.pool, "seed": self.seed}


@dataclass(frozen=True)
class CaptionRecipe(_VisionRecipe, steps=1000, lr=2e-3):
    """A captioner on ``cells`` digits side by side (patches of ``patch_size``): ``train_images`` generated
    captions from the training digits, ``steps`` AdamW steps, cosine schedule after ``warmup``."""

    name: str = "captioner_digits"
    cells: int = 3
    patch_size: int = 4
    d_model: int = 64
    num_heads: int = 4
    dim_feedforward: int = 128
    encoder_layers: int = 0
    decoder_layers: int = 2
    train_images: int = 8000

    def config(self) -> Dict[str, Any]:
        """The config dict of :func:`~attention_core.models.captioner.build_captioner`."""
        return {"image_size": [8, 8 * self.cells], "patch_size": self.patch_size, "in_channels": 1,
                "vocab_size": len(WORDS), "max_len": self.cells, "d_model": self.d_model,
                "num_heads": self.num_heads, "dim_feedforward": self.dim_feedforward,
                "encoder_layers": self.encoder_layers, "decoder_layers": self.decoder_layers, "seed": self.seed}


#: The recipe of the shipped ViT (about three minutes on one CPU thread).
VIT_RECIPE = ViTRecipe()
#: The recipe of the shipped captioner (about two minutes on one CPU thread).
CAPTION_RECIPE = CaptionRecipe()


def _logits(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def train_classifier(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, batch_size: int, lr: float,
                     warmup: int, weight_decay: float, data_seed: int) -> TrainLog:
    """Train ``model`` (a ViT or a CNN) on ``x, y`` with AdamW and a cosine schedule (as the vision recipes);
    returns the log.

    The model trains in train mode; every submodule's mode is given back afterwards (also on error)."""
    check_instance(model, nn.Module, "model", "a ViT or a CNN (an nn.Module)")
    check_tensor(x, "x")
    check_tensor(y, "y")
    loop = _VisionRecipe("classifier", steps=steps, batch_size=batch_size, lr=lr, warmup=warmup,
                         weight_decay=weight_decay, data_seed=data_seed)
    g = torch.Generator().manual_seed(data_seed)

    def next_batch(step: int) -> torch.Tensor:
        return torch.randint(len(y), (min(batch_size, len(y)),), generator=g)  # the batch's image indices

    return fit(model, loop, next_batch, lambda m, idx: F.cross_entropy(_logits(m(x[idx])), y[idx]),
               show_progress=False)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Share of ``x`` classified as ``y`` (in eval mode; the model's modes are given back afterwards)."""
    with eval_mode(model):
        return (_logits(model(x)).argmax(-1) == y).double().mean().item()


def _train_vit(recipe: ViTRecipe, digits: Digits) -> Tuple[VisionTransformer, TrainLog]:
    x, y = subset(digits.train_x, digits.train_y, recipe.train_size, recipe.data_seed)
    model = build_vit(recipe.config())
    log = train_classifier(model, x, y, recipe.steps, recipe.batch_size, recipe.lr, recipe.warmup,
                           recipe.weight_decay, recipe.data_seed)
    model.eval()  # its own model, returned ready to evaluate
    return model, log


def cnn_config_matching(parameters: int, seed: int = 0) -> Dict[str, Any]:
    """The SmallCNN config (first conv 16 channels) whose parameter count is closest to ``parameters``."""
    check_positive_int(parameters, "parameters")
    check_int(seed, "seed")
    best = min(range(1, 512), key=lambda c2: abs(cnn_parameters((8, 8), 1, 10, (16, c2)) - parameters))
    return {"image_size": [8, 8], "in_channels": 1, "num_classes": 10, "channels": [16, best], "seed": seed}


def train_captioner(recipe: CaptionRecipe = CAPTION_RECIPE, digits: Optional[Digits] = None
                    ) -> Tuple[Captioner, TrainLog]:
    """Build the captioner of ``recipe`` and train it on generated captions (teacher forcing)."""
    digits = digits or load_digits()
    data = make_caption_set(digits.train_x, digits.train_y, recipe.train_images, recipe.cells, recipe.data_seed)
    inputs, targets = data.tokens()
    model = build_captioner(recipe.config())
    g = torch.Generator().manual_seed(recipe.data_seed)

    def next_batch(step: int) -> torch.Tensor:
        return torch.randint(len(targets), (recipe.batch_size,), generator=g)  # the batch's caption indices

    def loss_of(m: Captioner, idx: torch.Tensor) -> torch.Tensor:
        logits = m(data.images[idx], inputs[idx]).logits  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets[idx].flatten())  # (B*T, V), (B*T,)

    log = fit(model, recipe, next_batch, loss_of)
    return model.eval(), log


def load_or_train_vit(directory: PathLike = CHECKPOINT_DIR, retrain: bool = False, recipe: ViTRecipe = VIT_RECIPE
                      ) -> Tuple[VisionTransformer, Dict[str, Any]]:
    """The chapter's ViT: the shipped checkpoint (sha256 verified), or trained here from ``recipe``."""
    return load_or_train_recipe(recipe, directory, build_vit, lambda: _train_vit(recipe, load_digits()), retrain,
                                None, "python -m attention_core.vision.train --only vit")


def load_or_train_captioner(directory: PathLike = CHECKPOINT_DIR, retrain: bool = False,
                            recipe: CaptionRecipe = CAPTION_RECIPE) -> Tuple[Captioner, Dict[str, Any]]:
    """The chapter's captioner: the shipped checkpoint (sha256 verified), or trained here from ``recipe``."""
    return load_or_train_recipe(recipe, directory, build_captioner, lambda: train_captioner(recipe), retrain,
                                None, "python -m attention_core.vision.train --only captioner")


def run_comparison(sizes: Sequence[int] = (100, 300, 1437), seeds: Sequence[int] = (0, 1, 2),
                   recipe: ViTRecipe = VIT_RECIPE, digits: Optional[Digits] = None) -> Dict[str, Any]:
    """Test accuracy of the ViT of ``recipe`` and of a CNN with as many parameters (within 1%), trained the same
    way (steps, batch, schedule) on ``size`` training images for each size and seed; plus the ViT's variants
    (2-D sine-cosine positions, mean pooling) on all the images."""
    digits = digits or load_digits()
    vit_params = sum(p.numel() for p in build_vit(recipe.config()).parameters())
    cnn_cfg = cnn_config_matching(vit_params)
    rows: List[Dict[str, Any]] = []
    for size in sizes:
        for seed in seeds:
            x, y = subset(digits.train_x, digits.train_y, size, seed)
            for kind in ("vit", "cnn"):
                model = (build_vit(replace(recipe, seed=seed).config()) if kind == "vit"
                         else SmallCNN({**cnn_cfg, "seed": seed}))
                log = train_classifier(model, x, y, recipe.steps, recipe.batch_size, recipe.lr, recipe.warmup,
                                       recipe.weight_decay, seed)
                rows.append({"model": kind, "train_size": size, "seed": seed,
                             "test_accuracy": round(accuracy(model, digits.test_x, digits.test_y), 4),
                             "train_seconds": round(log.seconds, 1)})
    variants = []
    for pos, pool in (("learned", "cls"), ("sincos", "cls"), ("learned", "mean"), ("sincos", "mean")):
        r = replace(recipe, pos=pos, pool=pool)
        model, _ = _train_vit(r, digits)
        variants.append({"pos": pos, "pool": pool,
                         "test_accuracy": round(accuracy(model, digits.test_x, digits.test_y), 4)})
    cnn_params = sum(p.numel() for p in SmallCNN(cnn_cfg).parameters())
    return {"vit_parameters": vit_params, "cnn_parameters": cnn_params, "cnn_channels": cnn_cfg["channels"],
            "test_images": len(digits.test_y), "recipe": asdict(recipe), "runs": rows, "variants": variants}


def load_comparison(directory: PathLike = CHECKPOINT_DIR) -> Dict[str, Any]:
    """The comparison the training CLI recorded (``comparison.json``)."""
    return json.loads((Path(directory) / COMPARISON_FILE).read_text())


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m attention_core.vision.train [--only vit|captioner|comparison] [--out DIR]``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--only", choices=("vit", "captioner", "comparison"), default=None)
    parser.add_argument("--out", default=str(CHECKPOINT_DIR), help="checkpoint folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    digits = load_digits()
    out = Path(args.out)
    if args.only in (None, "vit"):
        model, log = _train_vit(VIT_RECIPE, digits)
        acc = accuracy(model, digits.test_x, digits.test_y)
        save_recipe_checkpoint(model, log, VIT_RECIPE, out, every=100, extra={"test_accuracy": round(acc, 4)})
        print(f"{VIT_RECIPE.name}: {log.seconds:.0f} s, test accuracy {acc:.4f}", flush=True)
    if args.only in (None, "captioner"):
        model, log = train_captioner(CAPTION_RECIPE, digits)
        save_recipe_checkpoint(model, log, CAPTION_RECIPE, out, every=100)
        print(f"{CAPTION_RECIPE.name}: {log.seconds:.0f} s, final loss {log.losses[-1]:.4f}", flush=True)
    if args.only in (None, "comparison"):
        start = time.perf_counter()
        result = run_comparison(digits=digits)
        (out / COMPARISON_FILE).write_text(json.dumps(result, indent=1) + "\n")
        print(f"comparison: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
