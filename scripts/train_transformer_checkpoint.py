"""Train the book's Transformer (chapter 8) and write its checkpoint with a sha256 manifest entry.

Usage: OMP_NUM_THREADS=1 python scripts/train_transformer_checkpoint.py [--out DIR]

Writes DIR/transformer.pt and DIR/transformer_manifest.json (default DIR: attention_core/checkpoints), using
attention_core.transformer_training.TRANSFORMER_RECIPE, the same training loop and batches as the RNN models
of chapters 3 and 4. Chapter 8 loads the file after checking the sha256 recorded in the manifest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from attention_core.transformer_training import (
    CHECKPOINT_DIR,
    TRANSFORMER_RECIPE,
    save_transformer_checkpoint,
    train_transformer,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=CHECKPOINT_DIR, help="folder for the checkpoint")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # runs repeat exactly on one thread
    model, log = train_transformer(TRANSFORMER_RECIPE)
    entry = save_transformer_checkpoint(model, log, args.out, TRANSFORMER_RECIPE)
    print(f"{entry['file']}: {entry['parameters']:,} parameters, {entry['train_seconds']} s, "
          f"final loss {entry['losses'][-1]}, sha256 {entry['sha256']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
