"""The four attention kinds of chapter 11 (MHA, GQA-2, MQA, MLA): same decoder, matched parameters and steps; the
shipped checkpoints load (sha256 checked) and match their recipes."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from attention_core.models.language_model import build_language_model
from attention_core.shakespeare import train as shakespeare_train
from attention_core.shakespeare.data import load_corpus
from attention_core.training.checkpoint import read_manifest

KINDS = shakespeare_train.ATTENTION_KINDS


def test_the_recipes_differ_only_in_the_attention_and_match_in_parameters() -> None:
    V = len(load_corpus().vocab)
    counts = {}
    for name, r in KINDS.items():
        model = build_language_model(r.config(V))
        counts[name] = sum(p.numel() for p in model.parameters())
        assert (model.attention == "latent") == (name == "MLA")
    assert max(counts.values()) / min(counts.values()) < 1.001, counts
    shared = {k: v for k, v in asdict(KINDS["MHA"]).items()
              if k not in ("name", "num_kv_heads", "dim_feedforward", "attention", "kv_latent_dim", "rope_dim")}
    for r in KINDS.values():
        assert {k: v for k, v in asdict(r).items() if k in shared} == shared
    per_token = {n: build_language_model(r.config(V)).cache_numbers_per_token() for n, r in KINDS.items()}
    assert per_token == {"MHA": 256, "GQA-2": 128, "MQA": 64, "MLA": 80}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_the_shipped_checkpoints_load_and_match_their_recipes(name: str) -> None:
    recipe = KINDS[name]
    entry = read_manifest(shakespeare_train.CHECKPOINT_DIR)[recipe.name]
    assert entry["recipe"] == asdict(recipe)
    assert (shakespeare_train.CHECKPOINT_DIR / entry["file"]).stat().st_size < 2 * 1024 * 1024
    model, loaded = shakespeare_train.load_or_train_language_model(recipe=recipe)
    assert loaded["sha256"] == entry["sha256"]
    assert sum(p.numel() for p in model.parameters()) == entry["parameters"]
    with torch.no_grad():
        text = load_corpus().val[:65]
        loss = torch.nn.functional.cross_entropy(model(text[None, :-1]).logits[0], text[1:])
    assert loss < 2.5  # trained: well below log(V) ~ 4.2
