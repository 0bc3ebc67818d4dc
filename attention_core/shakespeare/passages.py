"""Chapter 11's long-context experiments repeated on several validation passages (the chapter runs one live).

:func:`passage_study` runs, on each passage of ``length`` characters starting at ``starts``:

- the chapter's model in six ways: full attention; a sliding window of 128; 4 sinks + a window of 124; every key
  with the offsets capped at 127; and, to remove the two causes of the breakdown in the other order, 128 keys
  per query (the 64 most recent and 64 spread over the older ones, :func:`recent_and_spread_mask`) with their
  true offsets, and the same keys with the offsets capped. Each row holds the mean loss on positions 512 and up;
- the start-token model and its control with a window of 128 and with 4 sinks + 124: the margin (window minus
  sinks) on positions 128-511 and 512 and up, and the largest mean weight a head puts on the first token
  (queries 32-127); the chapter's model's largest such weight too.

Command line (one CPU thread, a few minutes; writes ``checkpoints/passage_study.json``, :data:`STUDY_FILE`)::

    python -m attention_core.shakespeare.passages
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from attention_core._checks import check_instance
from attention_core.models.long_context import forward_clamped_offsets, recent_and_spread_mask
from attention_core.shakespeare.data import Corpus, load_corpus
from attention_core.shakespeare.heads import first_token_weight
from attention_core.shakespeare.train import (
    CHECKPOINT_DIR,
    INDUCTION_CURRICULUM,
    SINK_RECIPE,
    load_or_train_language_model,
)

__all__ = ["STARTS", "STUDY_FILE", "load_passage_study", "main", "passage_study"]

PathLike = Union[str, Path]
#: Where the recorded study lives.
STUDY_FILE = CHECKPOINT_DIR / "passage_study.json"
#: The passages' first characters in the validation text (the chapter's passage, 0, and seven more, spread out).
STARTS = tuple(13_800 * i for i in range(8))


def _mean(losses: torch.Tensor, a: int, b: Optional[int] = None) -> float:
    return round(float(losses[a:b].mean()), 4)


@torch.no_grad()
def passage_study(corpus: Corpus, starts: Sequence[int] = STARTS, length: int = 2048,
                  directory: PathLike = CHECKPOINT_DIR) -> Dict[str, Any]:
    """The record described in the module's docstring: ``{"starts", "length", "main": [...], "sink": [...]}``,
    one row per passage in each list."""
    check_instance(corpus, Corpus, "corpus", "a Corpus")
    model, _ = load_or_train_language_model(directory)
    sink_model, _ = load_or_train_language_model(directory, recipe=SINK_RECIPE)
    control, _ = load_or_train_language_model(directory, recipe=INDUCTION_CURRICULUM)
    V = len(corpus.vocab)
    few = recent_and_spread_mask(length, 64, 64)  # (length, length): at most 128 keys per query
    record: Dict[str, Any] = {"starts": list(starts), "length": length, "main": [], "sink": []}
    for s in starts:
        if s < 0 or s + length + 1 > len(corpus.val):
            raise ValueError(f"starts: passage {s} .. {s + length} does not fit in the validation text "
                             f"({len(corpus.val)} characters)")
        text = corpus.val[None, s : s + length + 1]  # (1, length + 1)
        x, y = text[:, :-1], text[0, 1:]
        logits = {"full": model(x).logits, "window 128": model(x, model.new_cache(window=128)).logits,
                  "4 sinks + window 124": model(x, model.new_cache(window=124, sinks=4)).logits,
                  "every key, offsets <= 127": forward_clamped_offsets(model, x, 127),
                  "128 keys, true offsets": forward_clamped_offsets(model, x, length, few),
                  "128 keys, offsets <= 127": forward_clamped_offsets(model, x, 127, few)}
        row = {name: _mean(F.cross_entropy(lg[0], y, reduction="none"), 512) for name, lg in logits.items()}
        weights = model(text[:, :128], need_weights=True).weights
        row["first token weight"] = round(float(first_token_weight(weights, start=32).max()), 4)
        record["main"].append(row)
        start = torch.tensor([[V]])
        runs = {"start token": (sink_model, torch.cat([start, text[:, :-1]], dim=1)), "no start token": (control, text)}
        sink_row: Dict[str, Any] = {}
        for name, (m, t) in runs.items():
            loss = {how: F.cross_entropy(m(t[:, :-1], cache).logits[0], t[0, 1:], reduction="none")
                    for how, cache in (("window", m.new_cache(window=128)),
                                       ("sinks", m.new_cache(window=124, sinks=4)))}
            parked = first_token_weight(m(t[:, :128], need_weights=True).weights, start=32)
            sink_row[name] = {
                "margin 128-511": round(_mean(loss["window"], 128, 512) - _mean(loss["sinks"], 128, 512), 4),
                "margin 512-": round(_mean(loss["window"], 512) - _mean(loss["sinks"], 512), 4),
                "first token weight": round(float(parked.max()), 4)}
        record["sink"].append(sink_row)
    return record


def load_passage_study(path: PathLike = STUDY_FILE) -> Dict[str, Any]:
    """The recorded study (see the module's docstring), checked for one row per passage."""
    record = json.loads(Path(path).read_text())
    for key in ("main", "sink"):
        if len(record[key]) != len(record["starts"]):
            raise ValueError(f"{path}: {key!r} has {len(record[key])} rows for {len(record['starts'])} passages")
    return record


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m attention_core.shakespeare.passages [--out DIR]``: run the study, write passage_study.json."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", default=str(CHECKPOINT_DIR), help="folder of passage_study.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    record = passage_study(load_corpus())
    out = Path(args.out) / STUDY_FILE.name
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(record['starts'])} passages: {out}")


if __name__ == "__main__":
    main()
