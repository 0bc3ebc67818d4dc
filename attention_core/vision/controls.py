"""The controls behind chapter 14's readings, repeated over seeds, and a learning-rate sweep for both arms.

:func:`run_controls` takes five seeds of each shipped recipe (seed 0 is the shipped checkpoint) and measures what
could explain the chapter's readings away: the ViT's accuracy with its position table zeroed or shuffled, the
layout of its learned positions against the same vectors on shuffled grids, its heads' mean attention distance;
the captioner's word-to-region hit rate on blank and on patch-shuffled images beside the real ones, and a
cell-swap intervention that says which cell decides each word. :func:`run_lr_sweep` trains the ViT and the
same-size CNN at two more learning rates, so neither arm of the comparison is judged only at the ViT recipe's.

Command line (one CPU thread; about 20 minutes for the controls, 15 for the sweep on a shared machine)::

    python -m attention_core.vision.controls                 # both, written next to the checkpoints
    python -m attention_core.vision.controls --only sweep    # one part: controls or sweep
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from attention_core.models.captioner import Captioner, greedy_caption
from attention_core.models.cnn import SmallCNN
from attention_core.models.vit import VisionTransformer, build_vit, patchify, unpatchify
from attention_core.training.modes import eval_mode
from attention_core.vision import analysis
from attention_core.vision.data import START, Digits, load_digits, make_caption_set, subset
from attention_core.vision.train import (
    CAPTION_RECIPE,
    CHECKPOINT_DIR,
    VIT_RECIPE,
    PathLike,
    _train_vit,
    accuracy,
    cnn_config_matching,
    load_or_train_captioner,
    load_or_train_vit,
    train_captioner,
    train_classifier,
)

__all__ = ["CONTROLS_FILE", "SWEEP_FILE", "load_controls", "load_lr_sweep", "main", "run_controls", "run_lr_sweep"]

#: File name of the recorded controls over seeds inside :data:`~attention_core.vision.train.CHECKPOINT_DIR`.
CONTROLS_FILE = "controls.json"
#: File name of the recorded learning-rate sweep.
SWEEP_FILE = "lr_sweep.json"


@torch.no_grad()
def _vit_controls(model: VisionTransformer, digits: Digits, shuffles: int, seed: int) -> Dict[str, Any]:
    x, y = digits.test_x, digits.test_y
    pos = model.pos_embed.detach()
    g = torch.Generator().manual_seed(seed)

    def acc(p: Optional[torch.Tensor]) -> float:
        with eval_mode(model):
            return round((model(x, positions=p).logits.argmax(-1) == y).double().mean().item(), 4)

    with eval_mode(model):
        att = model(x, need_weights=True).attentions
    mad = torch.stack([analysis.mean_attention_distance(a, model.patch_embed.grid, model.patch_embed.patch_size,
                                                        model.has_cls_token) for a in att])  # (layers, heads)
    null = analysis.layout_gap_null(pos, model.patch_embed.grid, draws=1000, seed=seed)
    gap = analysis.layout_gap(pos, model.patch_embed.grid)
    return {"test_accuracy": acc(None), "zeroed_positions": acc(torch.zeros_like(pos)),
            "shuffled_positions": [acc(pos[torch.randperm(len(pos), generator=g)]) for _ in range(shuffles)],
            "layout_gap": round(gap, 4), "layout_null_95": round(null.quantile(0.95).item(), 4),
            "layout_null_share_above": round((null >= gap).double().mean().item(), 4),
            "attention_distance_min": round(mad.min().item(), 4), "attention_distance_max": round(mad.max().item(), 4)}


@torch.no_grad()
def _captioner_controls(model: Captioner, digits: Digits, cells: int, seed: int) -> Dict[str, Any]:
    test = make_caption_set(digits.test_x, digits.test_y, 1000, cells, seed=7)
    donors = make_caption_set(digits.test_x, digits.test_y, 1000, cells, seed=8)
    p, grid = model.config["patch_size"], model.patch_embed.grid
    region = torch.arange(grid[0] * grid[1]) % grid[1] // (grid[1] // cells)  # (N,) the cell of each patch
    named = torch.arange(cells).expand(len(test.digits), cells)  # (B, T) word t names cell t
    g = torch.Generator().manual_seed(seed)
    shuffled = unpatchify(patchify(test.images, p)[:, torch.randperm(len(region), generator=g)], p,
                          tuple(test.images.shape[-2:]))
    out: Dict[str, Any] = {}
    for name, images in (("real", test.images), ("blank", torch.zeros_like(test.images)),
                         ("patch_shuffled", shuffled)):
        words, cross = greedy_caption(model, images, START, cells)
        mass = torch.stack([cross[:, t][:, region == t].sum(-1) for t in range(cells)], 1)  # (B, T)
        out[name] = {"hit_rate": round(analysis.word_region_accuracy(cross, region, named), 4),
                     "mass_on_named_cell": round(mass.mean().item(), 4)}
        if name == "real":
            out[name]["word_accuracy"] = round((words == test.digits).double().mean().item(), 4)
    changes = analysis.cell_swap_changes(model, test.images, test.tokens()[0], donors.images, 8)
    out["swap_changes"] = [[round(v, 4) for v in row] for row in changes.tolist()]
    out["swap_digit_differs"] = [round((test.digits[:, j] != donors.digits[:, j]).double().mean().item(), 4)
                                 for j in range(cells)]
    return out


def run_controls(seeds: Sequence[int] = (0, 1, 2, 3, 4), digits: Optional[Digits] = None,
                 directory: PathLike = CHECKPOINT_DIR, shuffles: int = 5) -> Dict[str, Any]:
    """The chapter's controls on ``seeds`` of each model: seed 0 is the shipped checkpoint, the others are trained
    from the shipped recipes with ``seed`` (weights) and ``data_seed`` changed (about 20 minutes on one thread).

    For each ViT: test accuracy with its own positions, zeroed ones and ``shuffles`` random reorderings; the
    layout gap of its learned positions against 1,000 shuffled grids; the range of its heads' mean attention
    distance. For each captioner: the word-to-region hit rate and the attention mass on the named cell on the
    test captions, on blank images and on images whose patches are shuffled; the cell-swap intervention."""
    digits = digits or load_digits()
    vits, caps = [], []
    for seed in seeds:
        if seed == 0:
            vit, _ = load_or_train_vit(directory)
            cap, _ = load_or_train_captioner(directory)
        else:
            vit, _ = _train_vit(replace(VIT_RECIPE, seed=seed, data_seed=seed), digits)
            cap, _ = train_captioner(replace(CAPTION_RECIPE, seed=seed, data_seed=CAPTION_RECIPE.data_seed + seed),
                                     digits)
        vits.append({"seed": seed, **_vit_controls(vit, digits, shuffles, seed)})
        caps.append({"seed": seed, **_captioner_controls(cap, digits, CAPTION_RECIPE.cells, seed)})
        print(f"controls: seed {seed} done", flush=True)
    return {"seeds": list(seeds), "vit": vits, "captioner": caps}


def load_controls(directory: PathLike = CHECKPOINT_DIR) -> Dict[str, Any]:
    """The controls the command line recorded (``controls.json``)."""
    return json.loads((Path(directory) / CONTROLS_FILE).read_text())


def run_lr_sweep(sizes: Sequence[int] = (100, 1437), lrs: Sequence[float] = (1e-3, 1e-2), seed: int = 0,
                 digits: Optional[Digits] = None) -> Dict[str, Any]:
    """Test accuracy of the ViT of :data:`~attention_core.vision.train.VIT_RECIPE` and of the CNN with as many
    parameters, each trained at every learning rate in ``lrs`` (steps, batch, warm-up, schedule and weight decay
    of the recipe; one ``seed``) on ``size`` training images. The comparison's rate, the ViT recipe's 3e-3, is not
    repeated: :func:`~attention_core.vision.train.run_comparison` holds it for the same seed, subset and order.
    Together they say whether either arm does better at another rate."""
    digits = digits or load_digits()
    vit_params = sum(p.numel() for p in build_vit(VIT_RECIPE.config()).parameters())
    cnn_cfg = cnn_config_matching(vit_params)
    rows: List[Dict[str, Any]] = []
    for size in sizes:
        x, y = subset(digits.train_x, digits.train_y, size, seed)
        for lr in lrs:
            for kind in ("vit", "cnn"):
                model = (build_vit(replace(VIT_RECIPE, seed=seed).config()) if kind == "vit"
                         else SmallCNN({**cnn_cfg, "seed": seed}))
                train_classifier(model, x, y, VIT_RECIPE.steps, VIT_RECIPE.batch_size, lr, VIT_RECIPE.warmup,
                                 VIT_RECIPE.weight_decay, seed)
                rows.append({"model": kind, "train_size": size, "lr": lr,
                             "test_accuracy": round(accuracy(model, digits.test_x, digits.test_y), 4)})
        print(f"sweep: {size} images done", flush=True)
    return {"seed": seed, "lrs": list(lrs), "runs": rows}


def load_lr_sweep(directory: PathLike = CHECKPOINT_DIR) -> Dict[str, Any]:
    """The learning-rate sweep the command line recorded (``lr_sweep.json``)."""
    return json.loads((Path(directory) / SWEEP_FILE).read_text())


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m attention_core.vision.controls [--only controls|sweep] [--out DIR]``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--only", choices=("controls", "sweep"), default=None)
    parser.add_argument("--out", default=str(CHECKPOINT_DIR), help="checkpoint folder (read and written)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    digits, out = load_digits(), Path(args.out)
    for part, run, name in (("controls", lambda: run_controls(digits=digits, directory=out), CONTROLS_FILE),
                            ("sweep", lambda: run_lr_sweep(digits=digits), SWEEP_FILE)):
        if args.only in (None, part):
            start = time.perf_counter()
            (out / name).write_text(json.dumps(run(), indent=1) + "\n")
            print(f"{part}: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()


