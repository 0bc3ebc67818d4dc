"""Models built from the attention primitives: task-free, they import no task wing.

- :mod:`~attention_core.models.rnn_attention`: Bahdanau's additive and Luong's attention over RNN states;
- :mod:`~attention_core.models.transformer`: encoder and decoder layers and stacks (chapter 8);
- :mod:`~attention_core.models.bert`: a BERT encoder with pooling heads (chapter 10);
- :mod:`~attention_core.models.language_model`: the decoder-only language model (MHA, GQA, MQA or MLA
  attention), windows and sinks (chapter 11); it re-exports :mod:`~attention_core.models.sampling` (greedy,
  temperature, top-k, top-p) and :mod:`~attention_core.models.generation` (prefill and decode);
- :mod:`~attention_core.models.kv_cache`: its key/value cache (preallocated, rotated keys, left padding) and
  the decode masks built from the mask mods;
- :mod:`~attention_core.models.latent_attention`: DeepSeek-style multi-head latent attention and its cache;
- :mod:`~attention_core.models.attention_variants`: the language model's options from recent models (output gate,
  learned sink logits, QK-norm, cross-layer key/value sharing, local/global layers);
- :mod:`~attention_core.models.long_context`: a rotary decoder run with every key kept and the offsets clamped.
- :mod:`~attention_core.models.gated_delta`: the Gated DeltaNet token mixer (the gated delta rule as a layer, with a
  fixed-size decoding state);
- :mod:`~attention_core.models.indexed_attention`: attention over the top-k keys of a lightning indexer (DeepSeek
  Sparse Attention at small scale), with its key/value and indexer-key cache.

A new model goes here as one module; its data and training recipe go in a task wing
(``attention_core/<task>/``).
"""
