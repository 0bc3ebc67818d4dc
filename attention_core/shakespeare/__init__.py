"""The language-modelling task of chapter 11: tiny Shakespeare, character by character.

A wing of its own, beside the attention core (which never imports it):

- :mod:`~attention_core.shakespeare.data`: the text shipped in the package (gzip, sha256 checked on load), its
  character vocabulary, the split by position, training batches, and the unigram and bigram baselines;
- :mod:`~attention_core.shakespeare.train`: the recipe, the training loop, the evaluation, the shipped checkpoint
  and the command line that made it (``python -m attention_core.shakespeare.train``).

The model itself is the core's :class:`attention_core.models.language_model.DecoderLM`.
"""
