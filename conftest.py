"""Set, before any notebook kernel starts, the environment that makes the book's outputs repeat.

nbval starts one Jupyter kernel per notebook, and the kernel inherits this process's environment. So
``pytest --nbval book/`` from a clean shell runs the notebooks exactly as the canonical run that made their
stored outputs (``make execute``): one thread (summation order, hence rounding, does not depend on the core
count), progress bars off (they print timings), a fixed hash seed, the inline plotting backend. Values already
set in the environment win, so a deliberate override (e.g. ``ATEN_CPU_CAPABILITY=default``) still applies.
"""

import os

NOTEBOOK_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    "AC_PROGRESS": "0",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
}
for _name, _value in NOTEBOOK_ENV.items():
    os.environ.setdefault(_name, _value)
