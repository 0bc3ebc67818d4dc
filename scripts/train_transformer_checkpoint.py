"""Train the book's Transformer (chapter 8) and write its checkpoint with a sha256 manifest entry.

Usage: OMP_NUM_THREADS=1 python scripts/train_transformer_checkpoint.py [NAME ...] [--out DIR]

For each NAME (default: every recipe of attention_core.transformer_training.TRANSFORMER_RECIPES, i.e.
"transformer" and "transformer_x2") writes DIR/NAME.pt and its entry in DIR/transformer_manifest.json
(default DIR: attention_core/checkpoints). Training uses the loop and batches of the RNN models of chapters 3
and 4. Chapter 8 loads the files after checking the sha256 recorded in the manifest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from attention_core.transformer_training import (
    CHECKPOINT_DIR,
    TRANSFORMER_RECIPES,
    save_transformer_checkpoint,
    train_transformer,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=list(TRANSFORMER_RECIPES), help="recipes to train")
    parser.add_argument("--out", type=Path, default=CHECKPOINT_DIR, help="folder for the checkpoints")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in TRANSFORMER_RECIPES]
    if unknown:
        parser.error(f"unknown recipes {unknown}; choose from {sorted(TRANSFORMER_RECIPES)}")
    torch.set_num_threads(1)  # runs repeat exactly on one thread
    for name in args.names:
        recipe = TRANSFORMER_RECIPES[name]
        model, log = train_transformer(recipe)
        entry = save_transformer_checkpoint(model, log, args.out, recipe)
        print(f"{entry['file']}: {entry['parameters']:,} parameters, {entry['train_seconds']} s, "
              f"final loss {entry['losses'][-1]}, sha256 {entry['sha256']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
