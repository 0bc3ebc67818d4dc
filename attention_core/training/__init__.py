"""What every task wing's training shares: the loop and its recipe base, checkpoints with a sha256 manifest,
progress bars, schedules.

- :mod:`~attention_core.training.loop`: :class:`~attention_core.training.loop.TrainRecipe` (the fields every
  recipe has) and :func:`~attention_core.training.loop.fit`, the training loop of every wing;
- :mod:`~attention_core.training.checkpoint`: save and load a model with its recipe, checksums, manifest;
- :mod:`~attention_core.training.progress`: one progress bar (tqdm where installed, silent otherwise);
- :mod:`~attention_core.training.schedules`: the learning-rate schedules of the recipes;
- :mod:`~attention_core.training.cli`: the `NAME ... | --all [--out DIR]` command line of the recipe trainers.

It imports nothing else from the package, so any room may use it.
"""
