"""Checkpoints and manifests past the checksum: a file with the right sha256 that is not a checkpoint, weights
that do not fit, damaged bytes, a broken manifest, and a write that fails half-way.

Each load either gives the model back or raises a ValueError/TypeError that names the file; never a bare
KeyError, RuntimeError or AttributeError from inside torch. A failed save leaves the previous file whole.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_core.models import language_model as lm
from attention_core.training import checkpoint as ck

CONFIG = {"vocab_size": 11, "d_model": 8, "num_layers": 1, "num_heads": 2, "context": 8, "max_positions": 16,
          "seed": 0}
MODEL = lm.build_language_model(CONFIG)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _state():
    return {k: v.clone() for k, v in MODEL.state_dict().items()}


def _write(path: Path, blob) -> str:
    torch.save(blob, path)
    return ck.file_sha256(path)


def _mutated_state(draw_kind: str, key: str):
    state = _state()
    if draw_kind == "missing":
        del state[key]
    elif draw_kind == "extra":
        state["extra.weight"] = torch.zeros(3)
    elif draw_kind == "shape":
        state[key] = torch.zeros(*(d + 1 for d in state[key].shape))
    return state


BLOBS = st.one_of(
    st.sampled_from([[1, 2], 3, "text", torch.zeros(2), None]),
    st.sampled_from(["format", "config", "state_dict"]).map(
        lambda drop: {k: v for k, v in {"format": 1, "config": CONFIG, "state_dict": _state()}.items() if k != drop}),
    st.sampled_from([0, 2, "1", None]).map(lambda f: {"format": f, "config": CONFIG, "state_dict": _state()}),
    st.sampled_from([[], "cfg", 5]).map(lambda c: {"format": 1, "config": c, "state_dict": _state()}),
    st.tuples(st.sampled_from(["missing", "extra", "shape"]), st.sampled_from(sorted(MODEL.state_dict()))).map(
        lambda t: {"format": 1, "config": CONFIG, "state_dict": _mutated_state(*t)}),
)


@FAST
@given(blob=BLOBS)
def test_a_file_with_the_right_checksum_that_is_not_a_checkpoint_is_refused_clearly(tmp_path, blob) -> None:
    path = tmp_path / "m.pt"
    sha = _write(path, blob)
    with pytest.raises((ValueError, TypeError)) as info:
        ck.load_checkpoint(path, sha, lm.build_language_model)
    assert "m.pt" in str(info.value) or "config" in str(info.value)


@FAST
@given(cut=st.integers(0, 4000), flips=st.lists(st.integers(0, 10**6), max_size=4))
def test_damaged_bytes_are_refused_even_with_their_own_checksum(tmp_path, cut, flips) -> None:
    path = tmp_path / "m.pt"
    ck.save_checkpoint(MODEL, path)
    data = bytearray(path.read_bytes())
    for i in flips:
        data[i % len(data)] ^= 0xFF
    data = data[: len(data) - cut] if cut else data
    path.write_bytes(bytes(data))
    try:
        model = ck.load_checkpoint(path, ck.file_sha256(path), lm.build_language_model)
    except (ValueError, TypeError) as err:
        assert "m.pt" in str(err) or "config" in str(err)
    else:  # a flip inside a weight's bytes still loads: a model of the right shape
        assert sorted(model.state_dict()) == sorted(MODEL.state_dict())
    clean = ck.save_checkpoint(MODEL, tmp_path / "clean.pt")
    if bytes(data) != (tmp_path / "clean.pt").read_bytes():  # the manifest's checksum catches any change
        with pytest.raises(ValueError, match="sha256"):
            ck.load_checkpoint(path, clean, lm.build_language_model)


MANIFESTS = st.one_of(
    st.text(max_size=40),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                 max_leaves=8).map(json.dumps),
)


@FAST
@given(text=MANIFESTS)
def test_a_broken_manifest_is_refused_with_its_name(tmp_path, text) -> None:
    (tmp_path / ck.MANIFEST).write_text(text)
    try:
        manifest = ck.read_manifest(tmp_path)
    except ValueError as err:
        assert ck.MANIFEST in str(err)
    else:
        assert isinstance(manifest, dict)
        for entry in manifest.values():
            assert isinstance(entry["file"], str) and isinstance(entry["recipe"], dict)


def test_a_save_that_fails_half_way_leaves_the_old_file(tmp_path, monkeypatch) -> None:
    path = tmp_path / "m.pt"
    sha = ck.save_checkpoint(MODEL, path)

    def broken_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ck.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        ck.save_checkpoint(MODEL, path)
    assert ck.file_sha256(path) == sha and sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
    monkeypatch.undo()
    assert ck.load_checkpoint(path, sha, lm.build_language_model) is not None


def test_the_manifest_is_replaced_whole(tmp_path) -> None:
    ck.record_in_manifest(tmp_path, "a", {"file": "a.pt", "sha256": None, "recipe": {}})
    ck.record_in_manifest(tmp_path, "b", {"file": "b.pt", "sha256": "00", "recipe": {"x": 1}})
    assert sorted(ck.read_manifest(tmp_path)) == ["a", "b"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [ck.MANIFEST]  # no temporary file left behind
    assert oct((tmp_path / ck.MANIFEST).stat().st_mode & 0o777) == oct(0o644)
