"""No hidden global state: building or loading a shipped model neither seeds nor consumes torch's global
random generator (a notebook's later draws depend on its own seed only, not on which models it loaded)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from attention_core.models import language_model as lm
from attention_core.shakespeare import train as shakespeare_train
from attention_core.translation import train as translation_train
from attention_core.translation.data import NumberWords


def _untouched(fn) -> None:
    torch.manual_seed(1234)
    torch.rand(3)  # a state that no seed() call reproduces
    before = torch.get_rng_state()
    fn()
    assert torch.equal(torch.get_rng_state(), before), "the global generator was seeded or consumed"


@pytest.mark.parametrize("name", sorted(translation_train.RECIPES))
def test_loading_a_translation_checkpoint_leaves_the_global_rng_alone(name: str) -> None:
    _untouched(lambda: translation_train.load_or_train(name))


def test_building_a_translation_model_leaves_the_global_rng_alone() -> None:
    for recipe in translation_train.RECIPES.values():
        _untouched(lambda r=recipe: translation_train.build_model(r.config(NumberWords())))


def test_loading_and_building_the_shakespeare_model_leave_the_global_rng_alone() -> None:
    _untouched(shakespeare_train.load_or_train_language_model)
    recipe = shakespeare_train.RECIPE
    _untouched(lambda: lm.build_language_model(recipe.config(65)))


def test_a_seeded_build_is_the_same_model_whatever_the_global_state() -> None:
    config = {"vocab_size": 11, "d_model": 16, "num_layers": 1, "num_heads": 2, "seed": 5}
    torch.manual_seed(0)
    a = lm.build_language_model(config)
    torch.manual_seed(1)
    b = lm.build_language_model(config)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_seed_that_is_not_an_int_is_refused() -> None:
    with pytest.raises(TypeError, match="seed"):
        lm.build_language_model({"vocab_size": 11, "d_model": 16, "num_layers": 1, "num_heads": 2, "seed": 1.5})


@pytest.mark.skipif(importlib.util.find_spec("safetensors") is None, reason="the book's extras are not installed")
def test_loading_minilm_leaves_the_global_rng_alone() -> None:
    from attention_core import pretrained

    try:
        pretrained.minilm_path()
    except Exception as err:  # the weights package is a book extra
        pytest.skip(f"MiniLM weights not installed: {err}")
    _untouched(pretrained.load_minilm)


def test_greedy_serving_and_speculative_decoding_leave_the_global_rng_alone() -> None:
    from attention_core.serving.engine import serve
    from attention_core.serving.scheduler import Request
    from attention_core.serving.speculative import speculative_generate

    config = {"vocab_size": 11, "d_model": 16, "num_layers": 1, "num_heads": 2, "max_positions": 40}
    target, draft = lm.build_language_model(config | {"seed": 0}), lm.build_language_model(config | {"seed": 1})
    _untouched(lambda: speculative_generate(target, draft, torch.tensor([[1, 2, 3]]), 10, gamma=3,
                                            temperature=0.0))
    _untouched(lambda: serve(target, [Request(0, 0, 3, 4), Request(1, 1, 2, 3)],
                             {0: torch.tensor([1, 2, 3]), 1: torch.tensor([4, 5])}, max_batch=2))
