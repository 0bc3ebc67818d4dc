"""Attention beyond text (chapter 14): images read as patches.

- :mod:`~attention_core.vision.data`: scikit-learn's bundled 8x8 digits (no download) with a fixed split, and a
  generated captioning set (rows of digits described in words) whose word-to-region map is known;
- :mod:`~attention_core.vision.analysis`: what a ViT's heads do (mean attention distance, attention rollout,
  position-embedding similarity) and where a captioner's words look (word-to-region accuracy);
- :mod:`~attention_core.vision.train`: the recipes, the training loops, the shipped checkpoints, the ViT-vs-CNN
  comparison and the command line that made them (``python -m attention_core.vision.train``);
- :mod:`~attention_core.vision.controls`: the controls behind the chapter's readings over five seeds (positions
  zeroed and shuffled, blank and patch-shuffled images, a cell swap) and a learning-rate sweep for both arms of
  the comparison (``python -m attention_core.vision.controls``).

The models are the core's :mod:`attention_core.models.vit`, :mod:`~attention_core.models.cnn` and
:mod:`~attention_core.models.captioner`.
"""
