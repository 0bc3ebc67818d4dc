"""attention_core.booktools.glue: myst-nb's glue where it is installed, a plain display where it is not."""

from __future__ import annotations

import math
import sys

import nbformat
import pytest
import torch

from attention_core.booktools import glue as glue_mod


def test_with_myst_nb_the_value_is_stored_under_its_name(monkeypatch) -> None:
    pytest.importorskip("myst_nb")
    import myst_nb.ext.glue as myst_glue_mod

    calls = []
    monkeypatch.setattr(myst_glue_mod, "ipy_display", lambda data, raw, metadata: calls.append((data, metadata)))
    assert glue_mod.myst_nb_available()
    glue_mod.glue("acc", "0.468")
    glue_mod.glue("hidden", "0.024", display=False)
    (shown, shown_meta), (hidden, hidden_meta) = calls
    assert shown == {"text/plain": "'0.468'"} and shown_meta["scrapbook"] == {"name": "acc", "mime_prefix": ""}
    assert hidden_meta["scrapbook"]["name"] == "hidden"
    assert list(hidden) == [myst_glue_mod.GLUE_PREFIX + "text/plain"]  # stored, but no front end shows it


def test_without_myst_nb_the_value_is_only_displayed(monkeypatch) -> None:
    import IPython.display

    monkeypatch.setitem(sys.modules, "myst_nb", None)  # `from myst_nb import glue` now raises ImportError
    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda value: shown.append(value))
    assert not glue_mod.myst_nb_available()
    glue_mod.glue("acc", "0.468")
    glue_mod.glue("hidden", "0.024", display=False)
    assert shown == ["0.468"]


def test_without_ipython_it_prints(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "myst_nb", None)
    monkeypatch.setitem(sys.modules, "IPython.display", None)
    glue_mod.glue("n", 1024)
    assert capsys.readouterr().out == "1024\n"


@pytest.mark.parametrize("name,error", [(3, TypeError), ("", ValueError), ("two words", ValueError)])
def test_bad_names_are_refused(name, error) -> None:
    with pytest.raises(error, match="glue: name"):
        glue_mod.glue(name, 1.0)


def test_in_a_kernel_myst_nb_finds_the_glued_value(tmp_path) -> None:
    """End to end: a notebook that glues, executed by nbclient, carries what myst-nb's reader extracts."""
    pytest.importorskip("myst_nb")
    from myst_nb.ext.glue import extract_glue_data_cell
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from attention_core.booktools.glue import glue\nglue('acc', f'{0.46812:.3f}')"
    )]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    found = dict(extract_glue_data_cell(nb.cells[0]))
    assert "acc" in found and found["acc"]["data"]["text/plain"] == "'0.468'"


# --- between: bounds that CPU rounding noise cannot move ----------------------------------------------------


def test_between_gives_ladder_bounds_with_a_margin() -> None:
    from attention_core.booktools.glue import between

    assert between([3.8e-3, 3.9e-3]) == "3e-03 to 5e-03"
    assert between([0.035, 0.0911]) == "3e-02 to 1.5e-01"  # 0.0911 * 1.1 passes 0.1: the next step is 1.5
    assert between(torch.tensor([6.9e-6, 7.0e-6])) == "5e-06 to 1e-05"
    assert between([100.3, 97.3], margin=1.01) == "7e+01 to 1.5e+02"
    assert between([2.0]) == "1.5e+00 to 3e+00"  # 2.0 sits on a step: the margin moves both bounds off it


@pytest.mark.parametrize("scale", [1e-9, 3.4e-7, 1e-3, 0.42, 1.0, 5e4])
def test_between_is_unmoved_by_rounding_noise_and_brackets_the_values(scale: float) -> None:
    from attention_core.booktools.glue import between

    values = [scale * f for f in (1.0, 1.17, 1.31)]
    text = between(values)
    lo, hi = (float(t) for t in text.split(" to "))
    assert lo * 1.1 <= min(values) and max(values) * 1.1 <= hi * (1 + 1e-12)
    assert all(between([v * (1 + d) for v in values]) == text for d in (-3e-6, -1e-7, 1e-7, 3e-6))
    for bound in (lo, hi):  # every bound is 1, 1.5, 2, 3, 5 or 7 times a power of ten
        mantissa = bound / 10 ** math.floor(math.log10(bound) + 1e-9)
        assert min(abs(mantissa - m) for m in (1, 1.5, 2, 3, 5, 7)) < 1e-9


def test_between_refuses_what_it_cannot_bound() -> None:
    from attention_core.booktools.glue import between

    for bad in ([], [0.0], [-1e-3], [float("nan")], [float("inf")]):
        with pytest.raises(ValueError, match="between"):
            between(bad)
    with pytest.raises(ValueError, match="margin"):
        between([1.0], margin=1.0)
    with pytest.raises(TypeError, match="margin"):
        between([1.0], margin="1.1")
