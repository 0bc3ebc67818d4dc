"""The one training loop of every task wing, and the recipe base its recipes share.

A wing (translation, sentences, Shakespeare, vision) says what is its own — how a batch is drawn, how a model's
loss on it is computed, which model is built — and :func:`fit` does the rest, the same way for all of them: the
optimiser (:meth:`TrainRecipe.optimizer`), the learning rate at every step (:meth:`TrainRecipe.lr_at`), the
progress bar, gradient clipping, a hook every step (probes, evaluations at a cadence) and the log. Saving the
result with its recipe is :func:`~attention_core.training.checkpoint.save_recipe_checkpoint`.

A recipe is a frozen dataclass deriving from :class:`TrainRecipe`; its fields are what the manifest records, so
that a checkpoint traces back to the exact settings that made it::

    @dataclass(frozen=True)
    class MyRecipe(TrainRecipe, steps=400, batch_size=64):   # the wing's defaults of the training fields
        width: int = 32                      # the wing's own fields (the model, the data)

    recipe = MyRecipe("mine", lr=3e-3, warmup=30, min_lr_ratio=0.1)
    model = build(recipe)
    g = torch.Generator().manual_seed(recipe.data_seed)
    log = fit(model, recipe, lambda step: draw_batch(g), lambda m, b: F.cross_entropy(m(b.x), b.y))
"""

from __future__ import annotations

import time
from dataclasses import KW_ONLY, dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping, Optional, Tuple, Type, TypeVar, Union

import torch
from torch import nn

from attention_core.training.checkpoint import TrainLog
from attention_core.training.modes import train_mode
from attention_core.training.progress import progress
from attention_core.training.schedules import cosine_lr

__all__ = ["TrainRecipe", "fit", "make_optimizer", "recipe_named"]

@dataclass(frozen=True)
class TrainRecipe:
    """The settings every recipe has: a ``name`` (the checkpoint's file stem), then, by keyword,

    ``steps`` optimiser steps on batches of ``batch_size``; learning rate warmed up linearly over ``warmup`` steps
    to ``lr``, then a half cosine down to ``min_lr_ratio * lr`` at the last step (:meth:`lr_at`); weight decay
    ``weight_decay`` on the matrices only (:meth:`optimizer`); gradient norm clipped at ``clip`` (``None``: not
    clipped); initial weights drawn with ``seed`` and batches with ``data_seed``.

    Class attributes (not recorded in the manifest; one per wing): ``OPTIMIZER`` (``"adam"`` or ``"adamw"``) and
    ``BETAS``, Adam's two decay rates.

    A wing gives the training fields its own defaults as class keywords, without declaring them again::

        @dataclass(frozen=True)
        class MyRecipe(TrainRecipe, steps=400, batch_size=64, lr=3e-3):
            width: int = 32

    (``__init_subclass__``: each stays keyword-only, of the type declared here; an unknown name is refused).
    """

    name: str
    _: KW_ONLY
    steps: int = 1
    batch_size: int = 1
    lr: float = 1e-3
    warmup: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    clip: Optional[float] = None
    seed: int = 0
    data_seed: int = 1

    OPTIMIZER: ClassVar[str] = "adam"
    BETAS: ClassVar[Tuple[float, float]] = (0.9, 0.999)

    def __init_subclass__(cls, **defaults: Any) -> None:
        """Set the defaults of training fields named as class keywords (``class R(TrainRecipe, steps=400)``): each
        becomes a field of ``cls`` (keyword-only, the type :class:`TrainRecipe` declares) for ``@dataclass`` to
        read. A name that is no keyword-only field of :class:`TrainRecipe`, or that the class body declares too,
        is refused with a TypeError."""
        super().__init_subclass__()
        if not defaults:
            return
        training = {f.name: f for f in fields(TrainRecipe) if f.kw_only}
        own = dict(cls.__dict__.get("__annotations__", {}))
        unknown = sorted(set(defaults) - set(training))
        twice = sorted(set(defaults) & set(own))
        if unknown or twice:
            raise TypeError(f"{cls.__name__}: class keywords must be training fields of TrainRecipe "
                            f"({sorted(training)}) that the class body does not declare, got {sorted(defaults)}")
        for name, value in defaults.items():
            own[name] = training[name].type
            setattr(cls, name, field(default=value, kw_only=True))
        cls.__annotations__ = own

    def lr_at(self, step: int) -> float:
        """The learning rate at ``step`` (0-based): :func:`~attention_core.training.schedules.cosine_lr`."""
        return cosine_lr(step, lr=self.lr, steps=self.steps, warmup=self.warmup, min_lr_ratio=self.min_lr_ratio)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimiser of this recipe for ``model``'s parameters (:func:`make_optimizer`)."""
        return make_optimizer(model, self.OPTIMIZER, self.lr, self.weight_decay, self.BETAS)


R = TypeVar("R", bound=TrainRecipe)


def recipe_named(name: Union[str, R], recipes: Mapping[str, R], kind: Type[R]) -> R:
    """A wing's recipe by name: ``name`` itself when it is already a ``kind`` recipe, else ``recipes[name]``.

    Raises:
        ValueError: ``name`` is not a key of ``recipes`` (the message lists the keys).
    """
    if isinstance(name, kind):
        return name
    if name not in recipes:
        raise ValueError(f"name must be one of {sorted(recipes)}, got {name!r}")
    return recipes[name]


def make_optimizer(model: nn.Module, kind: str, lr: float, weight_decay: float = 0.0,
                   betas: Tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """Adam (``kind="adam"``, no weight decay) or AdamW (``"adamw"``) with ``weight_decay`` on the parameters of
    two or more dimensions (the matrices) and none on the vectors (biases, norms' gains)."""
    if kind == "adam":
        if weight_decay:
            raise ValueError(f"weight_decay must be 0 with kind='adam' (use 'adamw'), got {weight_decay!r}")
        return torch.optim.Adam(model.parameters(), lr=lr, betas=betas)
    if kind == "adamw":
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                  {"params": rest, "weight_decay": 0.0}], lr=lr, betas=betas)
    raise ValueError(f"kind must be 'adam' or 'adamw', got {kind!r}")


def fit(model: nn.Module, recipe: TrainRecipe, next_batch: Callable[[int], Any],
        loss_of: Callable[[nn.Module, Any], torch.Tensor], *, optimizer: Optional[torch.optim.Optimizer] = None,
        lr_at: Optional[Callable[[int], Optional[float]]] = None, on_step: Optional[Callable[[int, nn.Module], Any]]
        = None, desc: Optional[str] = None, show_progress: bool = True) -> TrainLog:
    """Train ``model`` in place for ``recipe.steps`` steps; returns the :class:`TrainLog` (every step's loss, the
    wall time).

    Each step: set the learning rate (``lr_at(step)``, default ``recipe.lr_at``; ``None`` leaves it), draw
    ``batch = next_batch(step)``, compute ``loss_of(model, batch)`` (a scalar), step the optimiser (default
    ``recipe.optimizer(model)``) after clipping the gradient norm at ``recipe.clip``, then call
    ``on_step(step, model)`` if given (a probe, an evaluation at some cadence). The model is in train mode during
    the loop; every submodule's mode is given back afterwards, also on error. A progress bar shows the mean loss of
    the last 50 steps (off when ``show_progress`` is false or ``AC_PROGRESS=0``).

    Runs repeat exactly on one CPU thread for the same model, recipe and batches: nothing here draws random numbers.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(recipe, TrainRecipe):
        raise TypeError(f"recipe must be a TrainRecipe, got {type(recipe).__name__}")
    if isinstance(recipe.steps, bool) or not isinstance(recipe.steps, int) or recipe.steps < 1:
        raise ValueError(f"recipe.steps must be an int >= 1, got {recipe.steps!r}")
    optimizer = recipe.optimizer(model) if optimizer is None else optimizer
    lr_at = recipe.lr_at if lr_at is None else lr_at
    log, start = TrainLog(), time.perf_counter()
    bar = progress(range(recipe.steps), desc=desc or recipe.name, **({} if show_progress else {"disable": True}))
    with train_mode(model):
        for step in bar:
            lr = lr_at(step)
            if lr is not None:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            loss = loss_of(model, next_batch(step))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if recipe.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
            optimizer.step()
            log.losses.append(loss.item())
            if on_step is not None:
                on_step(step, model)
            if hasattr(bar, "set_postfix") and (step + 1) % 50 == 0:
                bar.set_postfix(loss=f"{sum(log.losses[-50:]) / 50:.3f}")
    log.seconds = time.perf_counter() - start
    return log
