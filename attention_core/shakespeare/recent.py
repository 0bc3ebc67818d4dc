"""The controlled comparison of issue 42: what recent models changed in attention, trained side by side.

Eight variants of one small decoder (:data:`VARIANTS`): the baseline, an output gate (Qiu et al. 2025), learned
sink logits (gpt-oss), QK-norm (Qwen3's order), a gated-delta hybrid (``"DG"``: a Gated DeltaNet layer under a
global attention layer), DSA's indexed top-k attention (``index_topk``, its indexer trained by its KL loss after a
dense warm-up), cross-layer KV sharing (two layers, one key/value group) and local/global layers (``"LG"``).
Everything else is equal: the data (the Shakespeare characters with the ``sink`` recipe's start token at the
head of every crop and its repeated random rows, so that sinks can emerge), the steps, the seeds (``s`` for the
weights, ``s + 1`` for the batches, the same for every variant) and the parameter budget: each variant's
feed-forward width is :func:`~attention_core.models.language_model.feedforward_for_budget` of the baseline's
count (within 1%).

The scale is this machine's, not the sink recipe's: width 64, 2 layers, 4 heads, crops of ``context = 64``
characters, batches of 16, :data:`STEPS` steps (the ``sink`` recipe trains 2000 steps of 32 crops of 128; here
every variant and seed shares two CPU cores with other work, and the whole comparison, 48 runs plus the
learning-rate study, must finish within about an hour). Models this small and this short trained say what holds
at this scale only.

Measured per variant and seed (:func:`measure`): validation loss (the first :data:`VAL_BLOCKS` blocks of the
validation split, read after the start token, as training reads); the attention mass on the first token (the
start token; mean over attention layers, heads and queries after the first, and the largest head's mean); the
largest hidden activation (the residual stream's largest absolute value after each block, at the first position
and elsewhere);
KV bytes per token (what the cache holds after ``context`` tokens, divided by ``context``, and what each further
token adds; a gated delta layer's fixed state counts in the first); decode time per token (greedy, with the
cache, one sequence, one CPU thread: **noisy**, the machine is shared); the loss past the training length
(blocks of ``2 context``: the mean over positions ``>= context``, beside the mean over the first ``context`` of
the same blocks). The floors: bigram and trigram count tables of the training split on the same validation
blocks (:func:`~attention_core.shakespeare.data.ngram_loss`, add-one). For QK-norm: the largest attention logit
(``q . k / sqrt(E)`` over the validation batch), and training at a high learning rate: a sweep finds the
smallest rate of :data:`HIGH_LRS` at which the baseline (seed 0, the full steps) diverges (its validation loss
worse than the unigram table's, or not finite), then the baseline and QK-norm train there with every seed (at
the last rate of the sweep when none diverges; ``results.json`` says which).

Command line (one process; set ``OMP_NUM_THREADS=1``)::

    python -m attention_core.shakespeare.recent                     # the comparison; writes checkpoints/recent/
    python -m attention_core.shakespeare.recent --smoke --out /tmp/r   # a seconds-long run of every step
    python -m attention_core.shakespeare.recent --high-lr-only      # the high-rate study alone, into results.json
    python -m attention_core.shakespeare.recent --sink-scale        # the sink study; writes checkpoints/recent_sink/

The sink study (``--sink-scale``) trains only the variants whose papers speak of attention sinks
(``SINK_VARIANTS``: the baseline, the output gate, learned sink logits) at the ``sink`` recipe's own scale
(``SINK_BASE``: 2000 steps of 32 crops of 128 after the start token, width 64, 2 layers: the scale at which
chapter 11's ``sink_bos`` model forms a sink), three seeds each, with every measure above and no high-rate study.

It writes ``<out>/<variant>_s<seed>.pt`` with their sha256 and recipe in ``<out>/manifest.json``, and
``<out>/results.json`` (every measure per run, mean and min-max per variant, the floors, the high-rate study);
and prints a table of mean (min-max) per variant and measure.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F

from attention_core._checks import check_instance, check_tensor, fmt_shape
from attention_core.models.gated_delta import GatedDeltaLayer
from attention_core.models.language_model import (
    DecoderLM,
    build_language_model,
    feedforward_for_budget,
    parameter_count,
)
from attention_core.shakespeare.data import (
    Corpus,
    load_corpus,
    ngram_loss,
    random_batch,
    repeat_random_tokens,
    unigram_loss,
)
from attention_core.shakespeare.train import CHECKPOINT_DIR, ExperimentRecipe
from attention_core.training.checkpoint import TrainLog, read_manifest, save_recipe_checkpoint
from attention_core.training.loop import fit
from attention_core.training.modes import eval_mode

__all__ = ["BASE", "HIGH_LRS", "RECENT_DIR", "SEEDS", "SINK_SEEDS", "STEPS", "VAL_BLOCKS", "VARIANTS", "RecentRecipe",
           "attention_logits", "main", "max_attention_logit",
           "measure", "recipe_for", "train_recent"]

PathLike = Union[str, Path]
#: Where the comparison's checkpoints, manifest and results live.
RECENT_DIR = CHECKPOINT_DIR / "recent"
#: Optimiser steps of every run of the comparison.
STEPS = 400
#: Learning rates the divergence sweep tries, in order (the comparison's own rate is the recipe's, 2e-3).
HIGH_LRS = (1e-2, 3e-2, 1e-1, 3e-1, 1.0)
#: Validation blocks every loss is measured on (of ``context``, or ``2 context`` past the training length).
VAL_BLOCKS = 64
#: The seeds of every variant (weights ``s``, batches ``s + 1``): six, first recorded as three and extended with
#: ``--seeds 0 1 2 3 4 5 --reuse`` (the first three runs kept as recorded).
SEEDS = (0, 1, 2, 3, 4, 5)
#: The seeds of the sink study (each run takes minutes at its scale).
SINK_SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class RecentRecipe(ExperimentRecipe):
    """The ``sink`` recipe's data (start token, repeated random rows) at the comparison's scale, with one variant's
    options (the fields of :class:`~attention_core.models.language_model.LMConfig`, ``None`` = off).

    ``index_warmup``: with ``index_topk``, the first steps attend densely and train the indexer on eq. (3)'s
    KL (the main weights train on the language-model loss meanwhile: this model starts from scratch, not from a
    trained dense one as DeepSeek-V3.2 does); later steps attend to the top-k and the indexer follows eq. (4).
    """

    variant: str = "baseline"
    output_gate: Optional[bool] = None
    sink_logits: Optional[bool] = None
    qk_norm: Optional[bool] = None
    kv_share: Optional[int] = None
    layer_pattern: Optional[str] = None
    local_window: Optional[int] = None
    index_topk: Optional[int] = None
    index_heads: Optional[int] = None
    index_dim: Optional[int] = None
    index_warmup: int = 0

    def options(self) -> Dict[str, Any]:
        names = ("output_gate", "sink_logits", "qk_norm", "kv_share", "layer_pattern", "local_window", "index_topk",
                 "index_heads", "index_dim")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def config(self, vocab_size: int) -> Dict[str, Any]:
        return {**super().config(vocab_size), **self.options()}


#: The baseline (width 64, 2 layers, 4 heads, feed-forward 256, crops of 64 after the start token).
BASE = RecentRecipe("recent_baseline", d_model=64, num_layers=2, num_heads=4, num_kv_heads=4, dim_feedforward=256,
                    context=64, steps=STEPS, batch_size=16, lr=2e-3, warmup=40, repeat_fraction=0.5,
                    repeat_random=True, bos=True)

#: The sink study's recipe: :data:`BASE` at the ``sink`` recipe's scale (its steps, batch, crop length and warm-up).
SINK_BASE = replace(BASE, name="recent_sink_baseline", steps=2000, batch_size=32, context=128, warmup=100)
#: The variants of the sink study: those whose papers claim an effect on attention sinks.
SINK_VARIANTS = ("baseline", "output_gate", "sink_logits")
#: Where the sink study writes its checkpoints, manifest and results.
RECENT_SINK_DIR = CHECKPOINT_DIR / "recent_sink"

#: Each variant's options (the rest is :data:`BASE`).
VARIANTS: Dict[str, Dict[str, Any]] = {
    "baseline": {},
    "output_gate": {"output_gate": True},
    "sink_logits": {"sink_logits": True},
    "qk_norm": {"qk_norm": True},
    "gated_delta": {"layer_pattern": "DG"},
    "indexed": {"index_topk": 16, "index_heads": 4, "index_dim": 16, "index_warmup": STEPS // 5},
    "kv_share": {"kv_share": 2},
    "local_global": {"layer_pattern": "LG", "local_window": 16},
}


def recipe_for(variant: str, seed: int, base: RecentRecipe = BASE, vocab_size: int = 65, **changes: Any
               ) -> RecentRecipe:
    """The recipe of ``variant`` with ``seed`` (weights ``seed``, batches ``seed + 1``), its feed-forward width
    matched to the baseline's parameter count (``vocab_size``: the characters; the start token adds one id)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}, got {variant!r}")
    options = dict(VARIANTS[variant])
    if "index_warmup" in options:
        options["index_warmup"] = max(1, base.steps // 5) if base.steps > 1 else 0
    r = replace(base, name=f"recent_{variant}_s{seed}", variant=variant, seed=seed, data_seed=seed + 1, **options,
                **changes)
    budget = parameter_count(base.config(vocab_size))
    return replace(r, dim_feedforward=feedforward_for_budget(r.config(vocab_size), budget))


# ------------------------------------------------------------------------------------------------ training


def train_recent(recipe: RecentRecipe, corpus: Corpus, show_progress: bool = False) -> Tuple[DecoderLM, TrainLog]:
    """Train ``recipe``'s model from scratch (one CPU thread repeats exactly); returns ``(model in eval mode, log)``.

    The loss is the next-character cross-entropy, plus, with an indexer, its KL loss (which reaches the indexer
    only: its input and its target are detached)."""
    check_instance(recipe, RecentRecipe, "recipe", "a RecentRecipe")
    check_instance(corpus, Corpus, "corpus", "a Corpus")
    V = len(corpus.vocab)
    model = build_language_model(recipe.config(V))
    g = torch.Generator().manual_seed(recipe.data_seed)
    indexed = recipe.index_topk is not None

    def next_batch(step: int) -> Tuple[int, torch.Tensor, torch.Tensor]:
        x, y = random_batch(corpus.train, recipe.batch_size, recipe.context, g)
        x, y = repeat_random_tokens(x, y, V, recipe.repeat_fraction, (recipe.repeat_min, recipe.repeat_max), g)
        x, y = torch.cat([torch.full_like(x[:, :1], V), x[:, :-1]], dim=1), x  # the start token, then the crop
        return step, x, y

    def loss_of(model: DecoderLM, batch: Tuple[int, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        step, x, y = batch
        if not indexed:
            return F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        out = model(x, need_index_loss=True, index_dense=step < recipe.index_warmup)
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten()) + out.index_loss

    log = fit(model, recipe, next_batch, loss_of, show_progress=show_progress)
    return model.eval(), log


# ------------------------------------------------------------------------------------------------ measures


def _val_blocks(corpus: Corpus, length: int, blocks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first ``blocks`` consecutive blocks of ``length`` validation characters, read after the start token:
    inputs (N, length) and targets (N, length)."""
    V = len(corpus.vocab)
    n = min(blocks, (len(corpus.val) - 1) // length)
    y = corpus.val[: n * length].view(n, length)  # (n, length)
    return torch.cat([torch.full_like(y[:, :1], V), y[:, :-1]], dim=1), y


@torch.no_grad()
def attention_logits(model: DecoderLM, x: torch.Tensor) -> List[Optional[torch.Tensor]]:
    """Every layer's scaled attention logits ``q . k / sqrt(E)`` on x (B, L), (B, Hq, L, L) with ``-inf`` where the
    layer may not look (causal; a local layer's window), recomputed from its weights (queries and keys after
    QK-norm and RoPE); ``None`` for gated delta layers and for layers that read another layer's keys."""
    check_instance(model, DecoderLM, "model", "a DecoderLM")
    check_tensor(x, "x")
    if x.dim() != 2:
        raise ValueError(f"x must be (B, L) token ids, got shape {fmt_shape(x.shape)}")
    B, L = x.shape
    h, found = model.embed(x), []
    plan = model._plan(L, None, None, None, None, x.device)
    for i, block in enumerate(model.blocks):
        a = block.attn
        if isinstance(a, GatedDeltaLayer) or getattr(a, "k_proj", None) is None:
            found.append(None)
        else:
            allowed = torch.ones(L, L, dtype=torch.bool).tril()
            if model.local_layers[i]:
                allowed &= ~torch.ones(L, L, dtype=torch.bool).tril(-model.options.local_window)
            z = block.norm1(h)
            Hq, H, E = a.num_heads, a.num_kv_heads, a.head_dim
            q = a.q_proj(z).view(B, L, Hq, E).transpose(1, 2)  # (B, L, D) -> (B, Hq, L, E)
            k = a.k_proj(z).view(B, L, H, E).transpose(1, 2)  # (B, L, D) -> (B, H, L, E)
            if getattr(a, "q_norm", None) is not None:
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = model.rotary.rotate(q, 0), model.rotary.rotate(k, 0)
            k = k.repeat_interleave(Hq // H, dim=1)  # (B, H, L, E) -> (B, Hq, L, E)
            logits = (q @ k.transpose(-2, -1)) / math.sqrt(E)  # (B, Hq, L, L)
            found.append(logits.masked_fill(~allowed, -math.inf))
        h, _ = block(h, model.rotary, None, i, plan.local.get(i, plan))
    return found


def max_attention_logit(model: DecoderLM, x: torch.Tensor) -> float:
    """The largest of :func:`attention_logits` over layers, heads and allowed pairs."""
    check_instance(model, DecoderLM, "model", "a DecoderLM")
    return max(float(t.max()) for t in attention_logits(model, x) if t is not None)


@torch.no_grad()
def _losses_past_training_length(model: DecoderLM, corpus: Corpus, context: int, blocks: int) -> Tuple[float, float]:
    x, y = _val_blocks(corpus, 2 * context, blocks)
    ce = F.cross_entropy(model(x).logits.transpose(1, 2), y, reduction="none")  # (N, 2 context)
    return float(ce[:, :context].mean()), float(ce[:, context:].mean())


@torch.no_grad()
def _decode_seconds_per_token(model: DecoderLM, V: int, tokens: int, rounds: int = 3) -> float:
    """Median over ``rounds`` of the wall time per token of greedy decoding with the cache after the start
    token (one sequence)."""
    times = []
    for _ in range(rounds):
        cache, nxt = model.new_cache(), torch.tensor([[V]])
        start = time.perf_counter()
        for _ in range(tokens):
            nxt = model(nxt, cache).logits[:, -1:].argmax(-1)  # (1, 1)
        times.append((time.perf_counter() - start) / tokens)
    return statistics.median(times)


@torch.no_grad()
def measure(model: DecoderLM, corpus: Corpus, context: int, val_blocks: int = VAL_BLOCKS,
            decode_tokens: int = 64) -> Dict[str, float]:
    """Every measure of the comparison for one trained model (see the module's docstring)."""
    check_instance(model, DecoderLM, "model", "a DecoderLM")
    check_instance(corpus, Corpus, "corpus", "a Corpus")
    V = len(corpus.vocab)
    with eval_mode(model):
        x, y = _val_blocks(corpus, context, val_blocks)
        acts: List[torch.Tensor] = []
        hooks = [b.register_forward_hook(lambda m, i, o: acts.append(o[0].abs().amax(dim=(0, 2))))
                 for b in model.blocks]  # per block: (L,) the largest |x| at each position
        try:
            out = model(x, need_weights=True)
        finally:
            for hk in hooks:
                hk.remove()
        val = float(F.cross_entropy(out.logits.flatten(0, 1), y.flatten()))
        per_pos = torch.stack(acts).amax(0)  # (L,)
        first = [w[:, :, 1:, 0].mean(dim=(0, 2)) for w in out.weights if w is not None]  # per layer: (H,)
        mass = torch.stack(first)  # (attention layers, H)
        within, past = _losses_past_training_length(model, corpus, context, val_blocks // 2)
        held, doubled = model.cache_bytes(context), model.cache_bytes(2 * context)
        return {
            "val_loss": val,
            "first_token_mass": float(mass.mean()),
            "first_token_mass_max_head": float(mass.max()),
            "max_activation": float(per_pos.max()),
            "max_activation_first": float(per_pos[0]),
            "max_activation_rest": float(per_pos[1:].max()),
            "max_attention_logit": max_attention_logit(model, x[:16]),
            "kv_bytes_per_token": held / context,
            "kv_bytes_per_further_token": (doubled - held) / context,
            "decode_ms_per_token": 1000 * _decode_seconds_per_token(model, V, decode_tokens),
            "loss_within_context": within,
            "loss_past_context": past,
        }


def _diverged(val_loss: float, floor: float) -> bool:
    """Diverged: the validation loss after training is not finite or worse than the unigram table's. (Not the
    training loss: half of the training rows are random characters, whose first copy no model can predict, so
    a healthy run ends near 3.2 nats there, near the unigram floor of natural text.)"""
    return not math.isfinite(val_loss) or val_loss > floor


@torch.no_grad()
def _val_loss(model: DecoderLM, corpus: Corpus, context: int, val_blocks: int) -> float:
    x, y = _val_blocks(corpus, context, val_blocks)
    return float(F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()))


def _summary(runs: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seed"]
    return {k: {"mean": statistics.fmean(r[k] for r in runs), "min": min(r[k] for r in runs),
                "max": max(r[k] for r in runs)} for k in keys}


def _fmt(s: Dict[str, float]) -> str:
    digits = 4 if abs(s["mean"]) < 100 else 0
    return f"{s['mean']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


# ------------------------------------------------------------------------------------------------ the command


def run_comparison(out: Path, base: RecentRecipe = BASE, seeds: Sequence[int] = SEEDS,
                   variants: Sequence[str] = tuple(VARIANTS), high_lrs: Sequence[float] = HIGH_LRS,
                   sweep_steps: Optional[int] = None, val_blocks: int = VAL_BLOCKS, decode_tokens: int = 64,
                   command: str = "", show_progress: bool = False, reuse: bool = False) -> Dict[str, Any]:
    """Train and measure every variant and seed, the floors and the high-rate study (none when ``high_lrs`` is
    empty); write checkpoints, the manifest and ``results.json`` in ``out``; return the results.

    ``reuse``: the runs ``out/results.json`` already records with the same base recipe (and, in its high-rate
    study, the same sweep) are kept as recorded, checkpoint and measures, and only the other seeds are trained:
    how a recorded comparison is extended to more seeds."""
    check_instance(out, Path, "out", "a pathlib.Path (the results' directory)")
    check_instance(base, RecentRecipe, "base", "a RecentRecipe")
    corpus = load_corpus()
    V = len(corpus.vocab)
    out.mkdir(parents=True, exist_ok=True)
    budget = parameter_count(base.config(V))
    started = time.perf_counter()
    results: Dict[str, Any] = {
        "command": command, "base_recipe": asdict(base), "seeds": list(seeds), "parameter_budget": budget,
        "machine": "CPU, one thread (OMP_NUM_THREADS=1), shared with other work: times are noisy",
        "runs": {}, "summary": {},
    }
    recorded, before = _recorded(out, base) if reuse else ({}, None)
    for variant in variants:
        runs = []
        for seed in seeds:
            if (variant, seed) in recorded:  # trained and measured by an earlier run of the same recipe
                runs.append(recorded[variant, seed])
                continue
            recipe = recipe_for(variant, seed, base, V)
            cpu = time.process_time()
            model, log = train_recent(recipe, corpus, show_progress)
            cpu = time.process_time() - cpu
            m = measure(model, corpus, base.context, val_blocks, decode_tokens)
            params = sum(p.numel() for p in model.parameters())
            entry = save_recipe_checkpoint(model, log, recipe, out, every=max(1, recipe.steps // 20),
                                           extra={"val_loss": round(m["val_loss"], 4),
                                                  "train_cpu_seconds": round(cpu, 1)})
            runs.append({"seed": seed, **m, "parameters": params, "budget_gap": (params - budget) / budget,
                         "dim_feedforward": recipe.dim_feedforward, "train_cpu_seconds": cpu,
                         "final_train_loss": statistics.fmean(log.losses[-max(1, len(log.losses) // 10):]),
                         "sha256": entry["sha256"]})
            print(f"{recipe.name}: val {m['val_loss']:.4f}, first-token mass {m['first_token_mass']:.3f}, "
                  f"{cpu:.0f} s CPU, {time.perf_counter() - started:.0f} s so far", flush=True)
        results["runs"][variant] = runs
        results["summary"][variant] = _summary(runs)
        _write(out, results)  # what is done so far, should a later run be stopped
    x, _ = _val_blocks(corpus, base.context, val_blocks)
    rows = corpus.val[: x.shape[0] * base.context].view(-1, base.context)
    unigram = unigram_loss(corpus.train, corpus.val, V)
    results["floors"] = {"unigram": unigram,
                         "bigram": ngram_loss(corpus.train, rows, V, 2),
                         "trigram": ngram_loss(corpus.train, rows, V, 3),
                         "note": "add-one count tables of the training split on the same validation blocks (each "
                                 "row's first character is not predicted; the models predict it after the start "
                                 "token); unigram on the whole validation split"}
    if high_lrs:
        results["high_lr"] = _high_lr_study(base, corpus, seeds, high_lrs, sweep_steps or base.steps, unigram,
                                            val_blocks, show_progress, before)
    results["wall_seconds"] = time.perf_counter() - started
    _write(out, results)
    return results


def _recorded(out: Path, base: RecentRecipe) -> Tuple[Dict[Tuple[str, int], Dict[str, Any]], Optional[Dict[str, Any]]]:
    """What ``out/results.json`` records for ``base`` (read once, before a run rewrites it): (variant, seed) -> the
    run, for each run whose checkpoint is still the one the manifest names (sha256), and the high-rate study (or
    None); nothing when there is no such file or it was made from another recipe."""
    path = out / "results.json"
    if not path.is_file():
        return {}, None
    old = json.loads(path.read_text(encoding="utf-8"))
    if old.get("base_recipe") != asdict(base):
        return {}, None
    manifest = read_manifest(out)
    runs = {(variant, r["seed"]): r for variant, rs in old.get("runs", {}).items() for r in rs
            if manifest.get(f"recent_{variant}_s{r['seed']}", {}).get("sha256") == r.get("sha256")}
    return runs, old.get("high_lr")


def _write(out: Path, results: Dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


def _high_lr_study(base: RecentRecipe, corpus: Corpus, seeds: Sequence[int], lrs: Sequence[float],
                   sweep_steps: int, floor: float, val_blocks: int, show_progress: bool,
                   before: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The sweep (baseline, seed 0, ``sweep_steps`` steps, each rate of ``lrs`` until one diverges), then the
    baseline and QK-norm at that rate with every seed and the full steps. ``before``: a study recorded with the
    same sweep, whose sweep and runs are kept (only the seeds it lacks are trained)."""
    V = len(corpus.vocab)
    same = before is not None and [s["lr"] for s in before["sweep"]] == list(lrs[: len(before["sweep"])]) and \
        all(s["steps"] == sweep_steps for s in before["sweep"])
    last = lrs[-1]
    if same:
        sweep, chosen = before["sweep"], (before["lr"] if before["baseline_diverged_in_sweep"] else None)
        lrs = ()
    else:
        sweep, chosen = [], None
    for lr in lrs:
        recipe = recipe_for("baseline", seeds[0], base, V, lr=lr, steps=sweep_steps)
        model, log = train_recent(recipe, corpus, show_progress)
        val = _val_loss(model, corpus, base.context, val_blocks)
        sweep.append({"lr": lr, "steps": sweep_steps, "val_loss": val, "diverged": _diverged(val, floor)})
        print(f"sweep lr {lr:g}: val {val:.4f}, diverged {sweep[-1]['diverged']}", flush=True)
        if sweep[-1]["diverged"]:
            chosen = lr
            break
    study: Dict[str, Any] = {"divergence_floor": floor, "sweep": sweep,
                             "rule": "diverged: validation loss after training not finite or above the unigram "
                                     "floor", "lr": chosen if chosen is not None else last,
                             "baseline_diverged_in_sweep": chosen is not None, "runs": {}}
    for variant in ("baseline", "qk_norm"):
        runs = []
        kept = {r["seed"]: r for r in before["runs"][variant]} if same and before["lr"] == study["lr"] else {}
        for seed in seeds:
            if seed in kept:
                runs.append(kept[seed])
                continue
            recipe = recipe_for(variant, seed, base, V, lr=study["lr"])
            model, log = train_recent(recipe, corpus, show_progress)
            x, _ = _val_blocks(corpus, base.context, val_blocks)
            val = _val_loss(model, corpus, base.context, val_blocks)
            runs.append({"seed": seed, "diverged": _diverged(val, floor), "val_loss": val,
                         "final_train_loss": statistics.fmean(log.losses[-max(1, len(log.losses) // 10):]),
                         "max_attention_logit": max_attention_logit(model, x[:16])})
            print(f"high lr {study['lr']:g} {variant} s{seed}: diverged {runs[-1]['diverged']}, val {val:.4f}",
                  flush=True)
        study["runs"][variant] = runs
    return study


def print_table(results: Dict[str, Any]) -> None:
    measures = ["val_loss", "first_token_mass", "first_token_mass_max_head", "max_activation",
                "max_activation_first", "max_attention_logit", "kv_bytes_per_token", "kv_bytes_per_further_token",
                "decode_ms_per_token", "loss_within_context", "loss_past_context", "parameters"]
    for m in measures:
        print(f"\n{m} (mean (min-max) over seeds {results['seeds']})")
        for variant, s in results["summary"].items():
            print(f"  {variant:14s} {_fmt(s[m])}")
    f = results["floors"]
    print(f"\nfloors: unigram {f['unigram']:.4f}, bigram {f['bigram']:.4f}, trigram {f['trigram']:.4f}")
    uniform = statistics.fmean(1 / (t + 1) for t in range(1, results["base_recipe"]["context"]))
    print(f"(uniform attention would put {uniform:.3f} on the first token, mean over queries t >= 1)")
    h = results.get("high_lr")
    if h is None:
        return
    print(f"high learning rate {h['lr']:g} (sweep: {[(s['lr'], s['diverged']) for s in h['sweep']]}):")
    for variant, runs in h["runs"].items():
        logits = [round(r["max_attention_logit"], 1) for r in runs]
        print(f"  {variant:10s} diverged {sum(r['diverged'] for r in runs)}/{len(runs)}, val "
              f"{[round(r['val_loss'], 3) for r in runs]}, max logit {logits}")


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """``python -m attention_core.shakespeare.recent [--smoke] [--out DIR]``: train, measure, write, print."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--out", default=None,
                        help="folder of the checkpoints, manifest and results (default: recent/, or recent_sink/)")
    parser.add_argument("--smoke", action="store_true", help="every step in seconds (3 steps, 1 seed): a test")
    parser.add_argument("--progress", action="store_true", help="progress bars")
    parser.add_argument("--high-lr-only", action="store_true",
                        help="rerun only the high learning-rate study, replacing it in <out>/results.json")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                        help="the seeds of every variant (default: 0 1 2 3 4 5)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep the runs <out>/results.json records for the same recipe; train only new seeds")
    parser.add_argument("--sink-scale", action="store_true",
                        help="the sink study: SINK_VARIANTS at the sink recipe's scale (default out: recent_sink/)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out is not None else (RECENT_SINK_DIR if args.sink_scale else RECENT_DIR)
    if args.sink_scale and args.high_lr_only:
        parser.error("--sink-scale has no high learning-rate study; drop --high-lr-only")
    torch.set_num_threads(1)
    command = "OMP_NUM_THREADS=1 python -m attention_core.shakespeare.recent" + (" --smoke" if args.smoke else "")
    if args.high_lr_only:
        results = json.loads((out / "results.json").read_text(encoding="utf-8"))
        corpus = load_corpus()
        base = replace(BASE, steps=3, warmup=1) if args.smoke else BASE
        lrs, blocks = ((1e-2, 3.0), 4) if args.smoke else (HIGH_LRS, VAL_BLOCKS)
        results["high_lr"] = _high_lr_study(base, corpus, results["seeds"], lrs, base.steps,
                                            results["floors"]["unigram"], blocks, args.progress)
        results["high_lr"]["command"] = command + " --high-lr-only"
        _write(out, results)
        print_table(results)
        return results
    if args.sink_scale:
        base = replace(SINK_BASE, steps=3, warmup=1) if args.smoke else SINK_BASE
        results = run_comparison(out, base, seeds=(0,) if args.smoke else SINK_SEEDS, variants=SINK_VARIANTS,
                                 high_lrs=(), val_blocks=4 if args.smoke else VAL_BLOCKS,
                                 decode_tokens=2 if args.smoke else 64, command=command + " --sink-scale",
                                 show_progress=args.progress)
    elif args.smoke:
        results = run_comparison(out, replace(BASE, steps=3, warmup=1), seeds=(0,), high_lrs=(1e-2, 3.0),
                                 val_blocks=4, decode_tokens=2, command=command)
    else:
        if args.seeds != list(SEEDS) or args.reuse:
            command += " --seeds " + " ".join(map(str, args.seeds)) + (" --reuse" if args.reuse else "")
        results = run_comparison(out, seeds=tuple(args.seeds), command=command,
                                 show_progress=args.progress, reuse=args.reuse)
    print_table(results)
    return results


if __name__ == "__main__":
    main()
