"""The trained comparison of chapter 12: softmax, sliding-window, linear and hybrid attention on tiny Shakespeare.

Four recipes (:data:`HYBRID_RECIPES`) differ only in the attention of their two layers; the models have the same
number of parameters, data, steps and seeds, and one learning rate, tuned for none of them (equal terms in size,
data and steps only). :func:`train_hybrid` trains one; the checkpoints (a few hundred KB each) live
in ``checkpoints/`` beside chapter 11's, with their sha256 and recipe in the same manifest.

Command line (one CPU thread; writes the four checkpoints, or the ones named)::

    python -m attention_core.shakespeare.hybrid                  # every recipe
    python -m attention_core.shakespeare.hybrid --only hybrid_linear_softmax --out /tmp/ckpt
    python -m attention_core.shakespeare.hybrid --seeds 1 2 3 4 5   # the seed study (no checkpoints)

The seed study (:func:`seed_study`) trains every recipe again with other seeds (initial weights ``s``, batches
``s + 1``; the shipped checkpoints used 0 and 1) and records each validation loss in
``checkpoints/hybrid_seeds.json`` (:data:`SEED_STUDY_FILE`): the spread the chapter sets its comparison against.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from attention_core.models.hybrid_lm import HybridLM, build_hybrid_lm
from attention_core.shakespeare.data import Corpus, load_corpus, random_batch
from attention_core.shakespeare.train import _CharLMTraining
from attention_core.training.checkpoint import TrainLog, load_or_train_recipe, save_recipe_checkpoint
from attention_core.training.loop import fit
from attention_core.training.modes import eval_mode

__all__ = ["HYBRID_RECIPES", "SEED_STUDY_FILE", "HybridRecipe", "evaluate_hybrid", "load_or_train_hybrid",
           "load_seed_study", "main", "seed_study", "train_hybrid", "with_seed"]

PathLike = Union[str, Path]
CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoints"
#: Where the recorded seed study lives (every recipe retrained with other seeds, and its validation loss).
SEED_STUDY_FILE = CHECKPOINT_DIR / "hybrid_seeds.json"


@dataclass(frozen=True)
class HybridRecipe(_CharLMTraining, steps=400, batch_size=16, lr=3e-3, warmup=30):
    """A :class:`~attention_core.models.hybrid_lm.HybridLM` whose layers are ``layers`` joined by ``+``, of width
    ``d_model`` with ``num_heads`` heads, trained for ``steps`` AdamW steps (betas 0.9, 0.99) on ``batch_size``
    random crops of ``context`` characters (``data_seed``), learning rate warmed up over ``warmup`` steps to
    ``lr`` then cosine-decayed to ``min_lr_ratio * lr``, weight decay on the matrices, gradient norm clipped at
    ``clip`` (the fields of :class:`~attention_core.training.loop.TrainRecipe`; the optimiser, weight decay,
    clipping and the rate's floor are those of the Shakespeare language model's recipe)."""

    name: str = "hybrid_softmax"
    layers: str = "softmax+softmax"
    d_model: int = 64
    num_heads: int = 4
    context: int = 128
    window: int = 16

    def config(self, vocab_size: int) -> Dict[str, Any]:
        """The config dict of :func:`~attention_core.models.hybrid_lm.build_hybrid_lm`."""
        return {"vocab_size": vocab_size, "layers": self.layers.split("+"), "d_model": self.d_model,
                "num_heads": self.num_heads, "context": self.context, "window": self.window}


#: The four models of the comparison, by name.
HYBRID_RECIPES: Dict[str, HybridRecipe] = {
    r.name: r for r in (
        HybridRecipe("hybrid_softmax", "softmax+softmax"),
        HybridRecipe("hybrid_window", "window+window"),
        HybridRecipe("hybrid_linear", "linear+linear"),
        HybridRecipe("hybrid_linear_softmax", "linear+softmax"),
    )
}


def train_hybrid(recipe: HybridRecipe, corpus: Optional[Corpus] = None, show_progress: bool = True
                 ) -> Tuple[HybridLM, TrainLog]:
    """Build ``recipe``'s model and train it on the CPU (a progress bar unless ``show_progress`` is false or
    ``AC_PROGRESS=0``); returns ``(model in eval mode, log)``."""
    if not isinstance(recipe, HybridRecipe):
        raise TypeError(f"recipe must be a HybridRecipe, got {type(recipe).__name__}")
    corpus = corpus or load_corpus()
    model = build_hybrid_lm(recipe.config(len(corpus.vocab)), seed=recipe.seed)
    g = torch.Generator().manual_seed(recipe.data_seed)
    log = fit(model, recipe, lambda step: random_batch(corpus.train, recipe.batch_size, recipe.context, g),
              _next_char_loss, show_progress=show_progress)
    return model.eval(), log


def _next_char_loss(model: HybridLM, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())  # (B*L, V), (B*L,)


@torch.no_grad()
def evaluate_hybrid(model: HybridLM, ids: torch.Tensor, context: int = 128, max_blocks: int = 64) -> float:
    """Mean cross-entropy (nats per character) over the first ``max_blocks`` consecutive blocks of ``ids``."""
    n = min((len(ids) - 1) // context, max_blocks)
    if n < 1:
        raise ValueError(f"ids (length {len(ids)}) must be longer than context={context}")
    x = ids[: n * context].view(n, context)  # (N,) -> (n, context)
    y = ids[1: n * context + 1].view(n, context)
    with eval_mode(model):
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


def load_or_train_hybrid(name: str, directory: PathLike = CHECKPOINT_DIR, retrain: bool = False
                         ) -> Tuple[HybridLM, Dict[str, Any]]:
    """The model of recipe ``name``: loaded (sha256 verified) or, when ``retrain`` or missing, trained here."""
    if name not in HYBRID_RECIPES:
        raise ValueError(f"name must be one of {sorted(HYBRID_RECIPES)}, got {name!r}")
    recipe = HYBRID_RECIPES[name]
    return load_or_train_recipe(recipe, directory, build_hybrid_lm, lambda: train_hybrid(recipe), retrain, None,
                                "python -m attention_core.shakespeare.hybrid")


def with_seed(recipe: HybridRecipe, seed: int) -> HybridRecipe:
    """``recipe`` with initial weights drawn with ``seed`` and batches with ``seed + 1`` (as the shipped 0 and 1)."""
    if not isinstance(recipe, HybridRecipe):
        raise TypeError(f"recipe must be a HybridRecipe, got {type(recipe).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    return dataclasses.replace(recipe, seed=seed, data_seed=seed + 1)


def seed_study(seeds: Sequence[int], names: Optional[Sequence[str]] = None, corpus: Optional[Corpus] = None,
               path: Optional[PathLike] = None) -> Dict[str, Any]:
    """Train each recipe of ``names`` (all by default) once per seed of ``seeds`` (:func:`with_seed`) and
    evaluate it as the shipped models are (:func:`evaluate_hybrid`). Returns ``{"seeds": [...], "recipes":
    {name: recipe without its seeds}, "val_loss": {name: [loss per seed]}}``; when ``path`` is given, the
    record is written there after every model (a study cut short keeps the seeds it finished for every
    recipe)."""
    names = list(HYBRID_RECIPES) if names is None else list(names)
    bad = [n for n in names if n not in HYBRID_RECIPES]
    if bad or not names:
        raise ValueError(f"names must be recipes of {sorted(HYBRID_RECIPES)}, got {names!r}")
    seeds = [with_seed(HYBRID_RECIPES[names[0]], s).seed for s in seeds]  # checks each seed
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must be distinct and non-empty, got {seeds!r}")
    corpus = corpus or load_corpus()
    record: Dict[str, Any] = {"seeds": [], "recipes": {}, "val_loss": {n: [] for n in names}}
    for n in names:
        record["recipes"][n] = {k: v for k, v in dataclasses.asdict(HYBRID_RECIPES[n]).items()
                                if k not in ("seed", "data_seed")}
    for s in seeds:
        for n in names:
            recipe = with_seed(HYBRID_RECIPES[n], s)
            model, _ = train_hybrid(recipe, corpus)
            record["val_loss"][n].append(round(evaluate_hybrid(model, corpus.val, recipe.context), 4))
        record["seeds"].append(s)
        if path is not None:
            Path(path).write_text(json.dumps(record, indent=1) + "\n")
    return record


def load_seed_study(path: PathLike = SEED_STUDY_FILE) -> Dict[str, Any]:
    """The recorded seed study, checked: every recipe as :data:`HYBRID_RECIPES` has it (seeds aside), and one
    loss per seed for each."""
    record = json.loads(Path(path).read_text())
    for n, fields in record["recipes"].items():
        expected = {k: v for k, v in dataclasses.asdict(HYBRID_RECIPES[n]).items() if k not in ("seed", "data_seed")}
        if fields != expected:
            raise ValueError(f"{path}: recipe {n!r} was {fields}, the library's is {expected}: rerun the study")
        if len(record["val_loss"][n]) != len(record["seeds"]):
            raise ValueError(f"{path}: {n!r} has {len(record['val_loss'][n])} losses for {len(record['seeds'])} seeds")
    return record


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m attention_core.shakespeare.hybrid [--only NAME ...] [--out DIR] [--seeds S ...]``: train and
    save the checkpoints, or (``--seeds``) run the seed study into ``hybrid_seeds.json`` in ``--out``."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--only", nargs="*", default=sorted(HYBRID_RECIPES), help="recipes to train")
    parser.add_argument("--out", default=str(CHECKPOINT_DIR), help="checkpoint folder")
    parser.add_argument("--seeds", nargs="*", type=int, default=None, help="run the seed study with these seeds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    corpus = load_corpus()
    if args.seeds is not None:
        names = [n for n in HYBRID_RECIPES if n in args.only]
        out = Path(args.out) / SEED_STUDY_FILE.name
        record = seed_study(args.seeds, names, corpus, out)
        print(f"seed study of {len(names)} recipes, seeds {record['seeds']}: {out}")
        return
    for name in args.only:
        recipe = HYBRID_RECIPES[name]
        model, log = train_hybrid(recipe, corpus)
        val = evaluate_hybrid(model, corpus.val, recipe.context)
        entry = save_recipe_checkpoint(model, log, recipe, args.out, extra={"val_loss": round(val, 4)})
        print(f"{name}: {entry['parameters']} parameters, {log.seconds:.0f} s, validation loss {val:.4f}")


if __name__ == "__main__":
    main()
