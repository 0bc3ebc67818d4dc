"""The designed sentence-classification task of the chapter on attention as explanation.

A wing of its own, beside the attention core (which never imports it):

- :mod:`~attention_core.sentences.data`: the task, generated and seeded: sentences of neutral filler words with
  exactly one planted cue word whose polarity is the label, so the token that decides the label is *known*;
- :mod:`~attention_core.sentences.train`: the recipes, the training loop, the shipped checkpoints and the command
  line that made them (``python -m attention_core.sentences.train NAME | --all``).

The model itself is the core's :class:`attention_core.models.classifier.AttentionClassifier`.
"""
