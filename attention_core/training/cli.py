"""The command line every recipe-based training module shares: ``python -m <wing>.train NAME [NAME ...]``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

__all__ = ["recipes_main"]


def recipes_main(argv: Optional[Sequence[str]], description: str, recipes: Mapping[str, object],
                 default_out: Path, train_and_save: Callable[[Iterable[str], str], object]) -> None:
    """Parse ``NAME [NAME ...] | --all [--out DIR]`` and call ``train_and_save(names, out)``.

    Unknown or missing names end the program with argparse's usage error (exit status 2), listing the recipes.
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("names", nargs="*", help=f"recipes to train, from {sorted(recipes)}")
    parser.add_argument("--all", action="store_true", help="train every recipe")
    parser.add_argument("--out", default=str(default_out), help="checkpoint folder")
    args = parser.parse_args(argv)
    names = sorted(recipes) if args.all else args.names
    unknown = [n for n in names if n not in recipes]
    if unknown or not names:
        parser.error(f"give recipe names from {sorted(recipes)} or --all (got {names})")
    train_and_save(names, args.out)
