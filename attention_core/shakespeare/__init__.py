"""The language-modelling task of chapter 11: tiny Shakespeare, character by character.

A wing of its own, beside the attention core (which never imports it):

- :mod:`~attention_core.shakespeare.data`: the text shipped in the package (gzip, sha256 checked on load), its
  character vocabulary, the split by position, training batches, and the unigram and bigram baselines;
- :mod:`~attention_core.shakespeare.train`: the recipes, the training loop, the evaluation, the shipped checkpoints
  and the command line that made them (``python -m attention_core.shakespeare.train``);
- :mod:`~attention_core.shakespeare.heads`: copying measured on distinct tokens written twice, previous-token and
  induction scores, heads removed and put back, the weight on the first token (attention sinks);
- :mod:`~attention_core.shakespeare.passages`: chapter 11's long-context runs repeated on eight validation
  passages and recorded (``python -m attention_core.shakespeare.passages``).

The model itself is the core's :class:`attention_core.models.language_model.DecoderLM`.
"""
