"""Chapter 10's wing: a real pretrained model (all-MiniLM-L6-v2) loaded into the library's BERT, and the
tools that inspect its attention.

- :mod:`~attention_core.pretrained.minilm`: tokenizer, weights, the comparison with the reference library;
- :mod:`~attention_core.pretrained.inspection`: per-layer attention statistics, head ablation.
"""

from attention_core.pretrained.minilm import *  # noqa: F403 (the loading API, as ``attention_core.pretrained``)
from attention_core.pretrained.minilm import __all__  # noqa: F401
