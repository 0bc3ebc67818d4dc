"""attention_core.booktools.glue: myst-nb's glue where it is installed, a plain display where it is not."""

from __future__ import annotations

import sys

import nbformat
import pytest

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
