"""The translation wing's recorded studies: runs trained and scored once, kept in a JSON file.

Chapter 3's bottleneck runs (:mod:`~attention_core.translation.bottleneck`), chapter 8's sweep
(:mod:`~attention_core.translation.sweep`) and chapter 4's Luong seeds (``scripts/luong_seeds.py``) each record a
list of runs, one dict per run, in ``{**meta, "runs": [...]}``. :class:`RecordedRuns` rewrites the file after
every new run and skips a run that is already there, so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch

from attention_core._checks import short_repr

__all__ = ["RecordedRuns", "read_runs", "study_main"]

PathLike = Union[str, Path]


def read_runs(path: PathLike) -> List[Dict[str, Any]]:
    """The runs recorded in ``path`` (its ``"runs"`` list), or an empty list when the file is missing."""
    path = Path(path)
    return json.loads(path.read_text())["runs"] if path.is_file() else []


class RecordedRuns:
    """The runs of one study, read from ``path`` (none when the file is missing); ``meta`` is written beside them.

    Attributes:
        path: the study's file.
        runs: the recorded runs, in the order they were made (a list of dicts).
    """

    def __init__(self, path: PathLike, meta: Mapping[str, Any]) -> None:
        self.path, self.meta = Path(path), dict(meta)
        self.runs = read_runs(self.path)

    def ensure(self, settings: Mapping[str, Any], run: Callable[[], Dict[str, Any]],
               describe: Callable[[Dict[str, Any]], str]) -> Dict[str, Any]:
        """The recorded run whose fields equal ``settings``; when there is none, ``run()``'s row, appended and
        written to the file at once, and ``describe(row)`` printed with the seconds the run took."""
        for r in self.runs:
            if all(r[k] == v for k, v in settings.items()):
                return r
        start = time.perf_counter()
        row = run()
        self.runs.append(row)
        self.path.write_text(json.dumps({**self.meta, "runs": self.runs}, indent=1) + "\n")
        print(f"{describe(row)} ({time.perf_counter() - start:.0f} s)", flush=True)
        return row


def study_main(argv: Optional[Sequence[str]], description: str, default_out: Path, meta: Mapping[str, Any]
               ) -> RecordedRuns:
    """The command line of a study module, ``[--out FILE]``: parse it, train on one CPU thread (so that every run
    repeats exactly) and return the study recorded in ``--out`` (default ``default_out``)."""
    if argv is not None and (not isinstance(argv, (list, tuple)) or not all(isinstance(a, str) for a in argv)):
        raise TypeError(f"argv must be None or a list of str, got {short_repr(argv)}")
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    return RecordedRuns(args.out, meta)
