"""What only the book's chapters use: a wing of its own, beside the attention core (which never imports it).

- :mod:`~attention_core.booktools.session`: ``setup`` (seeds, print and plot defaults, the device);
- :mod:`~attention_core.booktools.plots` and :mod:`~attention_core.booktools.seq2seq_plots`: one look for
  every figure;
- :mod:`~attention_core.booktools.widgets`: the interactive figures, each with a kernel-free twin;
- :mod:`~attention_core.booktools.static`: the HTML twins themselves (frame sliders, quizzes, answer boxes);
- :mod:`~attention_core.booktools.exercises`: self-checks and code exercises;
- :mod:`~attention_core.booktools.glue`: a computed number into the prose (myst-nb's glue, or a plain display).
"""

import importlib.util as _util

#: what the chapters' tools need beyond the core (the ``book`` extra of pyproject.toml): import name -> package
BOOK_REQUIREMENTS = {"matplotlib": "matplotlib", "ipywidgets": "ipywidgets", "tqdm": "tqdm",
                     "hypothesis": "hypothesis"}

_missing = [pkg for mod, pkg in BOOK_REQUIREMENTS.items() if _util.find_spec(mod) is None]
if _missing:
    raise ImportError(
        f"attention_core.booktools (the chapters' plots, widgets and exercises) needs {', '.join(_missing)}, "
        "which the core does not install: pip install 'attention-core[book]'"
    )
