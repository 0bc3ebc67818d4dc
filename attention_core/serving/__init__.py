"""Serving attention: the machinery of chapter 15, a wing beside the core (which never imports it).

- :mod:`~attention_core.serving.blocks`: a block allocator with reference counts and copy-on-write, and a paged
  KV cache that the chapter-11 model can run on (:class:`~attention_core.serving.blocks.PagedSequenceCache`);
- :mod:`~attention_core.serving.engine`: chapter 11's model decoding a batch of sequences from a paged cache,
  through paged attention, under static or continuous batching;
- :mod:`~attention_core.serving.scheduler`: static and continuous batching of a request trace, in model steps,
  a memory simulation (max-length preallocation vs paging) and a runner on the real model;
- :mod:`~attention_core.serving.speculative`: the speculative-sampling step (Leviathan et al., 2023; Chen et al.,
  2023) and speculative generation with a draft model.
"""
