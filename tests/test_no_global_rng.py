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


# ------------------------------------------------------------------------------------------ generation and sampling


def _generation_calls():
    from attention_core.explain import adversarial_attention, intervene, permute_weights
    from attention_core.models.captioner import build_captioner, greedy_caption
    from attention_core.models.classifier import build_classifier
    from attention_core.models.cnn import build_cnn
    from attention_core.models.hybrid_lm import build_hybrid_lm
    from attention_core.models.vit import build_vit
    from attention_core.shakespeare import heads

    with torch.random.fork_rng(devices=[]):
        model = lm.build_language_model({"vocab_size": 9, "d_model": 8, "num_layers": 1, "num_heads": 2, "seed": 0})
        cap = build_captioner({"image_size": [4, 8], "patch_size": 4, "in_channels": 1, "vocab_size": 5,
                               "max_len": 2, "d_model": 8, "num_heads": 2, "dim_feedforward": 8, "encoder_layers": 0,
                               "decoder_layers": 1})
        clf = build_classifier({"vocab_size": 7})
    prompt = torch.tensor([[1, 2, 3]])
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(0))
    images = torch.rand(2, 1, 4, 8, generator=torch.Generator().manual_seed(0))
    ids, lens = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([3, 2])

    def gen():
        return torch.Generator().manual_seed(1)

    def adversary():
        return adversarial_attention(lambda: clf(ids, lens).logits.softmax(-1), clf.attention, steps=2)

    def permuted():
        with intervene(clf.attention, permute_weights(gen())):
            return clf(ids, lens)

    return {
        "sample greedy (temperature 0)": lambda: lm.sample_next_token(logits, 0.0),
        "sample top_k=1": lambda: lm.sample_next_token(logits, 0.8, top_k=1),
        "sample with a generator": lambda: lm.sample_next_token(logits, 0.8, top_k=3, top_p=0.9, generator=gen()),
        "generate greedy (temperature 0)": lambda: lm.generate(model, prompt, 4, temperature=0.0),
        "generate top_k=1": lambda: lm.generate(model, prompt, 4, top_k=1),
        "generate greedy without a cache": lambda: lm.generate(model, prompt, 3, temperature=0.0, use_cache=False),
        "generate with a generator": lambda: lm.generate(model, prompt, 4, top_p=0.9, generator=gen()),
        "greedy_caption": lambda: greedy_caption(cap, images, 0, 2),
        "probe_copying": lambda: heads.probe_copying(model, torch.tensor([[1, 2, 3, 1, 2, 3]]), 3),
        "distinct_repeated with a generator": lambda: heads.distinct_repeated(2, 3, torch.arange(5), gen()),
        "permute_weights with a generator": permuted,
        "adversarial_attention": adversary,
        "build_vit": lambda: build_vit({"image_size": [4, 4], "patch_size": 2, "in_channels": 1, "num_classes": 2,
                                        "d_model": 8, "num_layers": 1, "num_heads": 2, "dim_feedforward": 8,
                                        "pos": "learned", "pool": "cls"}),
        "build_cnn": lambda: build_cnn({"image_size": [4, 4], "in_channels": 1, "num_classes": 2,
                                        "channels": [2, 2]}),
        "build_hybrid_lm": lambda: build_hybrid_lm({"vocab_size": 5, "d_model": 8, "num_heads": 2}),
        "build_classifier": lambda: build_classifier({"vocab_size": 5}),
    }


@pytest.mark.parametrize("name", sorted(_generation_calls()))
def test_greedy_and_seeded_calls_leave_the_global_rng_alone(name: str) -> None:
    _untouched(_generation_calls()[name])


def test_sampling_without_a_generator_draws_from_the_global_one() -> None:
    """The rule's other side: a sampled draw with no generator of its own uses (and advances) torch's."""
    logits = torch.zeros(2, 9)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    lm.sample_next_token(logits, 1.0)
    assert not torch.equal(torch.get_rng_state(), before)
