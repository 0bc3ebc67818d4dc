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


# ------------------------------------------------------------------------------------------------ issue 37


def test_a_manifest_that_is_not_utf8_is_refused_with_its_name(tmp_path) -> None:
    (tmp_path / ck.MANIFEST).write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=r"manifest .*manifest\.json is not valid JSON"):
        ck.read_manifest(tmp_path)


@pytest.mark.parametrize("text,pattern", [
    ('{"a": {"file": "a.pt"', "is not valid JSON"),
    ('{"a": {"file": "a.pt"}}', r"entry 'a' lacks 'recipe'"),
    ('{"a": {"recipe": {}, "sha256": null}}', r"entry 'a' lacks 'file'"),
    ('{"a": {"file": "a.pt", "recipe": {}, "sha256": 5}}', r"entry 'a' has 'sha256' = 5"),
    ('{"a": {"file": 3, "recipe": {}}}', r"entry 'a' has 'file' = 3"),
    ('{"a": 3}', r"entry 'a' is a JSON int"),
    ("[1, 2]", "must be a JSON object of entries, got a JSON list"),
])
def test_a_corrupt_manifest_names_the_entry_and_what_is_wrong(tmp_path, text, pattern) -> None:
    (tmp_path / ck.MANIFEST).write_text(text)
    with pytest.raises(ValueError, match=pattern):
        ck.read_manifest(tmp_path)


@pytest.mark.parametrize("sha,err,pattern", [
    (None, TypeError, "sha256 must be a str of 64 hex digits, got NoneType"),
    (b"00", TypeError, "sha256 must be a str of 64 hex digits, got bytes"),
    ("abc", ValueError, "sha256 must be 64 hex digits"),
    ("z" * 64, ValueError, "sha256 must be 64 hex digits"),
])
def test_a_checksum_that_is_not_a_sha256_is_refused_by_name(tmp_path, sha, err, pattern) -> None:
    path = tmp_path / "m.pt"
    ck.save_checkpoint(MODEL, path)
    with pytest.raises(err, match=pattern):
        ck.load_checkpoint(path, sha, lm.build_language_model)


def test_load_checkpoint_checks_build_and_device(tmp_path) -> None:
    path = tmp_path / "m.pt"
    sha = ck.save_checkpoint(MODEL, path)
    with pytest.raises(TypeError, match="build must be a callable"):
        ck.load_checkpoint(path, sha, 3)
    with pytest.raises(ValueError, match="device 'nope' cannot be used on this machine"):
        ck.load_checkpoint(path, sha, lm.build_language_model, device="nope")
    with pytest.raises(TypeError, match="build must return a torch.nn.Module, got dict"):
        ck.load_checkpoint(path, sha, lambda c: c)


def test_a_builder_that_reads_a_missing_key_gives_a_value_error_naming_the_file(tmp_path) -> None:
    path = tmp_path / "m.pt"
    sha = ck.save_checkpoint(MODEL, path)
    with pytest.raises(ValueError, match=r"m\.pt: its config does not build a model \(KeyError"):
        ck.load_checkpoint(path, sha, lambda c: torch.nn.Linear(c["in"], 2))


def test_tensors_of_another_dtype_than_the_model_are_refused_not_cast(tmp_path) -> None:
    state = _state()
    key = "embed.weight"
    state[key] = state[key].double()
    path = tmp_path / "m.pt"
    sha = _write(path, {"format": 1, "config": CONFIG, "state_dict": state})
    with pytest.raises(ValueError, match=r"m\.pt: its weights do not fit.*'embed\.weight' is torch\.float64"):
        ck.load_checkpoint(path, sha, lm.build_language_model)


def test_a_manifest_entry_whose_weights_do_not_fit_its_recipe_is_refused(tmp_path) -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Recipe:
        name: str = "m"

    path = tmp_path / "m.pt"
    sha = ck.save_checkpoint(MODEL, path)
    count = sum(p.numel() for p in MODEL.parameters())
    entry = {"file": "m.pt", "sha256": sha, "parameters": count + 1, "recipe": {"name": "m"}}
    ck.record_in_manifest(tmp_path, "m", entry)
    with pytest.raises(ValueError, match=rf"builds a model of {count} parameters but the manifest records {count + 1}"):
        ck.load_or_train_recipe(Recipe(), tmp_path, lm.build_language_model, train=None)
    ck.record_in_manifest(tmp_path, "m", {**entry, "sha256": None})
    with pytest.raises(ValueError, match="the manifest records no sha256 for 'm'"):
        ck.load_or_train_recipe(Recipe(), tmp_path, lm.build_language_model, train=None)
    ck.record_in_manifest(tmp_path, "m", {**entry, "sha256": "0" * 64})
    with pytest.raises(ValueError, match="has sha256 .* expected 0000"):
        ck.load_or_train_recipe(Recipe(), tmp_path, lm.build_language_model, train=None)
    ck.record_in_manifest(tmp_path, "m", {**entry, "parameters": count})
    model, _ = ck.load_or_train_recipe(Recipe(), tmp_path, lm.build_language_model, train=None)
    assert not model.training


def test_save_checkpoint_refuses_what_is_not_a_module(tmp_path) -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got int"):
        ck.save_checkpoint(3, tmp_path / "m.pt")
