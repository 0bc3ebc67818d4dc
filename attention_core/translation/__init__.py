"""The translation task of chapters 3, 4 and 8: number words to digits.

A wing of its own, beside the attention core (which never imports it):

- :mod:`~attention_core.translation.data`: the task (generated, seeded), vocabularies, padded batches;
- :mod:`~attention_core.translation.rnn`: the RNN encoder-decoders (no attention, Bahdanau, Luong);
- :mod:`~attention_core.translation.transformer`: the encoder-decoder Transformer built from the core's blocks;
- :mod:`~attention_core.translation.metrics`: exact match, token accuracy, scores by source length;
- :mod:`~attention_core.translation.train`: one training loop, one recipe type, the shipped checkpoints and the
  command line that made them (``python -m attention_core.translation.train NAME | --all``);
- :mod:`~attention_core.translation.sweep`: chapter 8's learning-rate sweep and seeds for the Transformer and
  Bahdanau's model, recorded in ``checkpoints/lr_sweep.json`` (``python -m attention_core.translation.sweep``);
- :mod:`~attention_core.translation.studies`: the recorded studies' file of runs, each made once and resumable
  (chapter 3's bottleneck runs, chapter 8's sweep, chapter 4's Luong seeds);
- :class:`EncoderDecoder`: the interface all models speak.
"""

from attention_core.translation.protocol import EncoderDecoder, StepDecoder

__all__ = ["EncoderDecoder", "StepDecoder"]
