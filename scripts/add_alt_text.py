"""Give a notebook's figures alt text for the site, without re-running it.

myst-nb writes a figure output as <img alt="../_images/<hash>.png"> unless the cell's metadata says
otherwise; the browser test (tests/browser) rejects that. This sets ``{"mystnb": {"image": {"alt": ...}}}``
on the named cells, which changes no output (nbval and the canonical run are unaffected).

    python scripts/add_alt_text.py book/07_positional_information.ipynb cell-008 "Heatmaps of ..." [ID ALT ...]

A cell id that is missing, or a cell without an image output, is an error.
"""

from __future__ import annotations

import sys

import nbformat


def main(argv: list[str]) -> int:
    if len(argv) < 3 or len(argv) % 2 == 0:
        print(__doc__, file=sys.stderr)
        return 2
    path, pairs = argv[0], dict(zip(argv[1::2], argv[2::2]))
    nb = nbformat.read(path, as_version=4)
    cells = {cell.get("id"): cell for cell in nb.cells}
    for cell_id, alt in pairs.items():
        cell = cells.get(cell_id)
        if cell is None:
            raise SystemExit(f"{path}: no cell with id {cell_id!r}")
        if not any(k.startswith("image/") for o in cell.get("outputs", []) for k in o.get("data", {})):
            raise SystemExit(f"{path}: cell {cell_id!r} has no image output")
        cell.metadata.setdefault("mystnb", {}).setdefault("image", {})["alt"] = alt.strip()
    nbformat.write(nb, path)
    print(f"{path}: alt text on {len(pairs)} cell(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
