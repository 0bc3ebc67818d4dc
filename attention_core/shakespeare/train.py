"""Training the character-level Shakespeare language model, and the checkpoint chapter 11 loads.

:data:`RECIPE` says how the shipped model is built and trained; :func:`train_language_model` trains it (AdamW,
linear warm-up then cosine decay, gradient clipping, a progress bar), :func:`save_lm_checkpoint` writes
``<name>.pt`` with its entry (sha256, parameters, training time, loss curve, validation loss, recipe) in
``checkpoints/manifest.json`` beside it, and :func:`load_or_train_language_model` loads that file after checking
its sha256, or trains from the recipe when asked or when the file is missing.

Command line (trains on one CPU thread and writes the checkpoint)::

    python -m attention_core.shakespeare.train            # the shipped recipe
    python -m attention_core.shakespeare.train --steps 50 --out /tmp/ckpt   # a quick try elsewhere
    python -m attention_core.shakespeare.train --recipe draft   # the one-layer draft of chapter 15
    python -m attention_core.shakespeare.train --recipe kinds   # MHA, GQA, MQA and MLA, one after the other
    python -m attention_core.shakespeare.train --recipe induction_curriculum   # and induction_plain, sink
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from attention_core._checks import check_instance
from attention_core.models.language_model import DecoderLM, build_language_model
from attention_core.shakespeare.data import CharVocab, Corpus, load_corpus, random_batch, repeat_random_tokens
from attention_core.shakespeare.heads import distinct_repeated, probe_copying
from attention_core.training.checkpoint import TrainLog, load_or_train_recipe, save_recipe_checkpoint
from attention_core.training.loop import TrainRecipe, fit
from attention_core.training.modes import eval_mode

__all__ = [
    "ATTENTION_KINDS",
    "AttentionKindRecipe",
    "CHECKPOINT_DIR",
    "DRAFT_RECIPE",
    "INDUCTION_CURRICULUM",
    "INDUCTION_PLAIN",
    "PROBE_LENGTH",
    "SINK_PLAIN_RECIPE",
    "SINK_RECIPE",
    "ExperimentRecipe",
    "probe_sequences",
    "RECIPE",
    "RECIPES",
    "LMRecipe",
    "evaluate_loss",
    "load_or_train_language_model",
    "main",
    "save_lm_checkpoint",
    "train_language_model",
]

PathLike = Union[str, Path]
#: Folder of the shipped checkpoint (package data) and its manifest.
CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoints"


@dataclass(frozen=True)
class _CharLMTraining(TrainRecipe, min_lr_ratio=0.1, weight_decay=0.1, clip=1.0):
    """The training every character model of this wing shares (:class:`LMRecipe` and
    :class:`~attention_core.shakespeare.hybrid.HybridRecipe`): AdamW with betas (0.9, 0.99) and weight decay 0.1
    on the matrices, gradient norm clipped at 1, the learning rate decayed to a tenth of its peak."""

    OPTIMIZER: ClassVar[str] = "adamw"
    BETAS: ClassVar[Tuple[float, float]] = (0.9, 0.99)


@dataclass(frozen=True)
class LMRecipe(_CharLMTraining, steps=2500, batch_size=32, lr=2e-3, warmup=100):
    """How the Shakespeare model is built and trained (the training fields are those of
    :class:`~attention_core.training.loop.TrainRecipe`; AdamW with betas (0.9, 0.99)).

    Model: ``num_layers`` pre-LN blocks of width ``d_model`` with ``num_heads`` heads (``num_kv_heads`` key/value
    heads), trained on crops of ``context`` characters. Training: ``steps`` AdamW steps on ``batch_size`` random
    crops from the training split (``data_seed``), of which a share ``repeat_fraction`` are repeated crops (a
    stretch of ``repeat_min`` to ``repeat_max`` characters written again and again, see
    :func:`~attention_core.shakespeare.data.random_batch`: the copying signal that makes induction heads form
    within this small budget), learning rate warmed up linearly over ``warmup`` steps to
    ``lr`` then decayed on a cosine to ``min_lr_ratio * lr``, weight decay on the matrices, gradient norm clipped
    at ``clip``. No dropout.
    """

    name: str = "shakespeare_char"
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4
    dim_feedforward: int = 512
    context: int = 128
    repeat_fraction: float = 0.5
    repeat_min: int = 8
    repeat_max: int = 40

    def config(self, vocab_size: int) -> Dict[str, Any]:
        """The config dict of :func:`~attention_core.models.language_model.build_language_model`."""
        return {"vocab_size": vocab_size, "d_model": self.d_model, "num_layers": self.num_layers,
                "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "dim_feedforward": self.dim_feedforward, "context": self.context, "seed": self.seed}


#: The recipe of the shipped checkpoint (about 9 minutes on one CPU thread).
RECIPE = LMRecipe()

#: The recipe of the draft model of speculative decoding in chapter 15 (one narrow layer, a few minutes).
DRAFT_RECIPE = LMRecipe(name="shakespeare_draft", d_model=64, num_layers=1, num_heads=4, num_kv_heads=4,
                        dim_feedforward=256, steps=1500)



@dataclass(frozen=True)
class AttentionKindRecipe(LMRecipe):
    """An :class:`LMRecipe` whose attention may be multi-head latent attention (``attention="latent"``).

    The four recipes of :data:`ATTENTION_KINDS` share everything (width, depth, heads, steps, data, seeds) but the
    attention; the feed-forward width of each is set so that all four have the same parameter count (within
    0.1%), so that a difference in validation loss is the attention's, not the size's. Plain text only
    (``repeat_fraction=0``).
    """

    attention: str = "standard"
    kv_latent_dim: Optional[int] = None
    rope_dim: Optional[int] = None

    def config(self, vocab_size: int) -> Dict[str, Any]:
        cfg = super().config(vocab_size)
        if self.attention == "latent":
            del cfg["num_kv_heads"]
            cfg.update(attention="latent", kv_latent_dim=self.kv_latent_dim, rope_dim=self.rope_dim)
        return cfg


_KIND = dict(d_model=128, num_layers=2, num_heads=4, context=128, steps=800, repeat_fraction=0.0)
#: MHA, GQA (2 key/value heads), MQA (1) and MLA (d_c = 64, d_r = 16) at matched parameters and steps.
ATTENTION_KINDS: Dict[str, AttentionKindRecipe] = {
    "MHA": AttentionKindRecipe(name="kind_mha", num_kv_heads=4, dim_feedforward=512, **_KIND),
    "GQA-2": AttentionKindRecipe(name="kind_gqa", num_kv_heads=2, dim_feedforward=576, **_KIND),
    "MQA": AttentionKindRecipe(name="kind_mqa", num_kv_heads=1, dim_feedforward=608, **_KIND),
    "MLA": AttentionKindRecipe(name="kind_mla", dim_feedforward=504, attention="latent", kv_latent_dim=64,
                               rope_dim=16, **_KIND),
}

@dataclass(frozen=True)
class ExperimentRecipe(LMRecipe):
    """A :class:`LMRecipe` with what chapter 11's experiments add.

    ``bos``: every training crop starts with one extra token, id ``V`` (the vocabulary has ``V + 1`` ids), as the
    models of StreamingLLM (Xiao et al., 2023) see the same start token at the head of every sequence.
    ``probe_every``: every this many steps (and after the last), :func:`probe_copying` runs on
    :func:`probe_sequences` and its scores go into the training log (``TrainLog.probes``).
    ``repeat_random``: the repeated rows (a share ``repeat_fraction``) are random characters written again and
    again (:func:`~attention_core.shakespeare.data.repeat_random_tokens`) instead of a stretch of the text.
    """

    bos: bool = False
    probe_every: int = 0
    repeat_random: bool = False

    def config(self, vocab_size: int) -> Dict[str, Any]:
        """As :meth:`LMRecipe.config`, with one more id for the start token when ``bos``."""
        return {**super().config(vocab_size), "vocab_size": vocab_size + int(self.bos)}


#: Length N of the distinct-token sequences the probes write twice.
PROBE_LENGTH = 32

#: Two small models that differ in one thing, the repeated crops, with their heads probed every 50 steps.
INDUCTION_CURRICULUM = ExperimentRecipe(name="induction_curriculum", d_model=64, num_layers=2, num_heads=4,
                                        num_kv_heads=4, dim_feedforward=256, steps=2000, repeat_fraction=0.5,
                                        probe_every=50, repeat_random=True)
INDUCTION_PLAIN = replace(INDUCTION_CURRICULUM, name="induction_plain", repeat_fraction=0.0, repeat_random=False)
#: The curriculum model again, with every crop starting with one start token (StreamingLLM's setting).
SINK_RECIPE = replace(INDUCTION_CURRICULUM, name="sink_bos", bos=True)
#: The plain model with a start token.
SINK_PLAIN_RECIPE = replace(INDUCTION_PLAIN, name="sink_bos_plain", bos=True)

#: The recipes the command line knows, by ``--recipe`` name (``kinds`` trains the four of ATTENTION_KINDS).
RECIPES: Dict[str, LMRecipe] = {"main": RECIPE, "draft": DRAFT_RECIPE, "induction_curriculum": INDUCTION_CURRICULUM,
                                "induction_plain": INDUCTION_PLAIN, "sink": SINK_RECIPE,
                                "sink_plain": SINK_PLAIN_RECIPE, **{r.name: r for r in ATTENTION_KINDS.values()}}


def probe_sequences(vocab: CharVocab, num_sequences: int = 16, length: int = PROBE_LENGTH, seed: int = 0
                    ) -> torch.Tensor:
    """(num_sequences, 2 * length): ``length`` distinct letters (of the 52 upper- and lower-case ones) written
    twice, drawn with ``seed``: the probe text of the copying measurements."""
    check_instance(vocab, CharVocab, "vocab", "a CharVocab")
    letters = vocab.encode("".join(c for c in vocab.chars if c.isalpha()))  # (52,)
    return distinct_repeated(num_sequences, length, letters, torch.Generator().manual_seed(seed))


def _probe_record(step: int, model: DecoderLM, sequences: torch.Tensor) -> Dict[str, Any]:
    found = probe_copying(model, sequences, sequences.shape[1] // 2)
    return {"step": step, "copy_accuracy": round(found["copy_accuracy"], 4),
            "loss_second": round(found["loss_second"], 4),
            "previous": [[round(v, 4) for v in row] for row in found["previous"].tolist()],
            "induction": [[round(v, 4) for v in row] for row in found["induction"].tolist()]}


def train_language_model(recipe: LMRecipe = RECIPE, corpus: Optional[Corpus] = None,
                         device: Optional[torch.device] = None, show_progress: bool = True
                         ) -> Tuple[DecoderLM, TrainLog]:
    """Build the model of ``recipe`` and train it from scratch; returns ``(model in eval mode, log)``.

    Runs repeat exactly on one CPU thread for the same recipe (the batches come from a seeded generator). An
    :class:`ExperimentRecipe` may add a start token to every crop and probe the heads as it trains (the records
    go to ``log.probes``, a list of dicts).
    """
    if not isinstance(recipe, LMRecipe):
        raise TypeError(f"recipe must be an LMRecipe, got {type(recipe).__name__}")
    corpus = corpus or load_corpus()
    device = device or torch.device("cpu")
    model = build_language_model(recipe.config(len(corpus.vocab))).to(device)
    g = torch.Generator().manual_seed(recipe.data_seed)
    bos = getattr(recipe, "bos", False)
    repeat_random = getattr(recipe, "repeat_random", False)
    probe_every = getattr(recipe, "probe_every", 0)

    def next_batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if repeat_random:
            x, y = random_batch(corpus.train, recipe.batch_size, recipe.context, g)
            x, y = repeat_random_tokens(x, y, len(corpus.vocab), recipe.repeat_fraction,
                                        (recipe.repeat_min, recipe.repeat_max), g)
        else:
            x, y = random_batch(corpus.train, recipe.batch_size, recipe.context, g, recipe.repeat_fraction,
                                (recipe.repeat_min, recipe.repeat_max))
        if bos:  # the start token, then the crop: it predicts the crop's first character too
            x, y = torch.cat([torch.full_like(x[:, :1], len(corpus.vocab)), x[:, :-1]], dim=1), x  # (B, context)
        return x.to(device), y.to(device)

    probes: List[Dict[str, Any]] = []
    on_step = None
    if probe_every:
        sequences = probe_sequences(corpus.vocab).to(device)
        probes.append(_probe_record(0, model, sequences))

        def on_step(step: int, model: DecoderLM) -> None:
            if (step + 1) % probe_every == 0 or step + 1 == recipe.steps:
                probes.append(_probe_record(step + 1, model, sequences))

    log = fit(model, recipe, next_batch, _next_char_loss, on_step=on_step, show_progress=show_progress)
    log.probes = probes  # type: ignore[attr-defined]
    return model.eval(), log


def _next_char_loss(model: DecoderLM, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())  # (B*L, V), (B*L,)


@torch.no_grad()
def evaluate_loss(model: DecoderLM, ids: torch.Tensor, context: int, max_blocks: Optional[int] = None,
                  batch_size: int = 64, bos: Optional[int] = None) -> float:
    """Mean cross-entropy (nats per character) over consecutive blocks of ``context + 1`` ids of ``ids``.

    Each block is read from its start, as in training; ``max_blocks`` keeps only the first blocks. With ``bos``
    (a model trained with a start token), each block of ``context`` ids is read after that token instead.
    """
    n = (len(ids) - 1) // context
    n = n if max_blocks is None else min(n, max_blocks)
    if n < 1:
        raise ValueError(f"ids (length {len(ids)}) must be longer than context={context}")
    blocks = ids[: n * context + 1]
    x = blocks[:-1].view(n, context)  # (N,) -> (n, context)
    y = blocks[1:].view(n, context)
    if bos is not None:  # [bos, c_0 .. c_{context-2}] predicts c_0 .. c_{context-1}
        x, y = torch.cat([torch.full_like(x[:, :1], bos), x[:, :-1]], dim=1), x
    total = 0.0
    with eval_mode(model):  # the caller's modes come back afterwards, also on error
        for i in range(0, n, batch_size):
            logits = model(x[i : i + batch_size]).logits
            total += F.cross_entropy(logits.flatten(0, 1), y[i : i + batch_size].flatten(), reduction="sum").item()
    return total / (n * context)


def save_lm_checkpoint(model: DecoderLM, log: TrainLog, recipe: LMRecipe = RECIPE,
                       directory: PathLike = CHECKPOINT_DIR, extra: Optional[Dict[str, Any]] = None
                       ) -> Dict[str, Any]:
    """Write ``<recipe.name>.pt`` (config + weights) and its manifest entry (with ``extra`` fields, and the probe
    records of an experiment recipe)."""
    probes = {"probes": log.probes} if getattr(log, "probes", None) else {}
    return save_recipe_checkpoint(model, log, recipe, directory, every=50, extra={**(extra or {}), **probes})


def load_or_train_language_model(directory: PathLike = CHECKPOINT_DIR, retrain: bool = False,
                                 recipe: LMRecipe = RECIPE, device: Optional[torch.device] = None
                                 ) -> Tuple[DecoderLM, Dict[str, Any]]:
    """The Shakespeare model: loaded from ``directory`` (sha256 verified) or trained here from ``recipe``.

    Trains when ``retrain`` is true or when the manifest has no entry or file for ``recipe.name`` (the trained
    model is not written to disk). A checkpoint made with a different recipe is refused.

    Returns:
        ``(model, entry)``: the model in eval mode and its manifest entry (``"sha256": None`` for a fresh run).
    """
    return load_or_train_recipe(recipe, directory, build_language_model,
                                lambda: train_language_model(recipe, device=device), retrain, device,
                                "python -m attention_core.shakespeare.train")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m attention_core.shakespeare.train [--recipe NAME] [--steps N] [--out DIR]``: train, save."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--recipe", choices=sorted(RECIPES) + ["kinds"], default="main",
                        help="which recipe (default: main; kinds: the four attention kinds)")
    parser.add_argument("--probe-every", type=int, default=None, help="probe interval (experiment recipes only)")
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps (default: the recipe's)")
    parser.add_argument("--out", default=str(CHECKPOINT_DIR), help="checkpoint folder")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.recipe == "kinds":
        for r in ATTENTION_KINDS.values():
            main(["--recipe", r.name, "--out", args.out] + ([] if args.steps is None else ["--steps", str(args.steps)]))
        return
    base = RECIPES[args.recipe]
    recipe = replace(base, steps=base.steps if args.steps is None else args.steps)
    if args.probe_every is not None and isinstance(recipe, ExperimentRecipe):
        recipe = replace(recipe, probe_every=args.probe_every)
    corpus = load_corpus()
    cpu_start = time.process_time()
    model, log = train_language_model(recipe, corpus)
    cpu_seconds = time.process_time() - cpu_start
    val = evaluate_loss(model, corpus.val, recipe.context,
                        bos=len(corpus.vocab) if getattr(recipe, "bos", False) else None)
    entry = save_lm_checkpoint(model, log, recipe, args.out,
                               extra={"val_loss": round(val, 4), "train_cpu_seconds": round(cpu_seconds, 1)})
    print(f"{recipe.name}: {entry['parameters']} parameters, {log.seconds:.0f} s ({cpu_seconds:.0f} s CPU), "
          f"final training loss {sum(log.losses[-50:]) / len(log.losses[-50:]):.4f}, validation loss {val:.4f}, "
          f"sha256 {entry['sha256'][:12]}...", flush=True)


if __name__ == "__main__":
    main()
