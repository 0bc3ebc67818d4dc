#!/usr/bin/env bash
# The core in a fresh venv with `pip install .` and no extras: it imports, runs attention on every CPU backend,
# and none of matplotlib, ipywidgets, tqdm, hypothesis is installed. Usage: scripts/check_core_install.sh [DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${1:-$(mktemp -d)/core-venv}"
SRC="$(mktemp -d)/src"  # a copy of what the package is built from: the build leaves nothing in the checkout
mkdir -p "$SRC" && cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/LICENSE" "$ROOT/attention_core" "$SRC/"
python3 -m venv "$DIR"
"$DIR/bin/python" -m pip install -q --upgrade pip
"$DIR/bin/python" -m pip install -q "torch==2.13.0" "$SRC"
cd "$DIR"  # not the repository: import the installed package
"$DIR/bin/python" - <<'PY'
import importlib.util, torch
import attention_core as ac
for pkg in ("matplotlib", "ipywidgets", "tqdm", "hypothesis"):
    assert importlib.util.find_spec(pkg) is None, f"{pkg} was installed with the core"
q = torch.randn(2, 3, 7, 8)
ref = ac.scaled_dot_product_attention(q, q, q, is_causal=True, backend="reference")
for name in ac.available_backends("cpu"):
    if name != "triton":
        torch.testing.assert_close(ac.scaled_dot_product_attention(q, q, q, is_causal=True, backend=name), ref)
try:
    import attention_core.booktools  # noqa: F401
except ImportError as e:
    assert "attention-core[book]" in str(e), e
    print("booktools without the extra:", e)
print("core install ok:", ac.__version__, "backends", ac.available_backends("cpu"))
PY
