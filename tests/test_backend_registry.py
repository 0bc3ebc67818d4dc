"""One backend signature: each backend module has ``supports(inputs)`` and ``run(inputs) -> (out, weights|None)``
side by side, the registry names them as functions (no module strings for the built-in entries), and the
inputs are validated once, by ``scaled_dot_product_attention``, never again inside a backend."""

from __future__ import annotations

import importlib

import pytest
import torch

import attention_core as ac
from attention_core.backends import AttentionInputs, chunked, get_backend

LIGHT = {"reference": "attention_core.backends.reference", "numpy": "attention_core.backends.numpy_backend",
         "torch": "attention_core.backends.torch_backend", "chunked": "attention_core.backends.chunked"}


@pytest.mark.parametrize("name, module", sorted(LIGHT.items()))
def test_a_light_backend_is_named_by_its_own_functions(name, module) -> None:
    entry, mod = get_backend(name), importlib.import_module(module)
    assert entry.implementation is mod.run and entry.supports is mod.supports


@pytest.mark.parametrize("name, module", [("triton", "attention_core.backends.triton_flash"),
                                          ("cuda", "attention_core.backends.cuda_flash")])
def test_a_heavy_backend_is_reached_through_a_named_function(name, module) -> None:
    entry = get_backend(name)
    assert callable(entry.implementation) and entry.implementation.__name__ == f"_run_{name}"
    assert entry.supports.__module__ == "attention_core.backends.fused_checks"
    src = importlib.util.find_spec(module)
    assert src is not None and "def run(inputs: AttentionInputs)" in open(src.origin).read()


def _inputs(need_weights=False) -> AttentionInputs:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(3))
    return AttentionInputs(q, k, v, None, 0.0, True, 0.5, False, need_weights)


@pytest.mark.parametrize("name", sorted(LIGHT))
def test_run_returns_the_output_and_weights_only_when_asked(name) -> None:
    entry = get_backend(name)
    out, weights = entry.run(_inputs())
    assert out.shape == (2, 3, 5, 4) and weights is None
    if name == "reference":
        out, weights = entry.run(_inputs(need_weights=True))
        assert weights.shape == (2, 3, 5, 5)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 3, 5))
    else:
        assert "weights" in entry.supports(_inputs(need_weights=True))


def test_the_registry_path_validates_once(monkeypatch) -> None:
    """chunked's own argument checks do not run on the registry path (sdpa has validated the inputs)."""
    def refuse(*args, **kwargs):
        raise AssertionError("validated a second time")

    monkeypatch.setattr(chunked, "check_int", refuse)
    q = torch.randn(1, 2, 6, 4)
    torch.testing.assert_close(ac.scaled_dot_product_attention(q, q, q, is_causal=True, backend="chunked"),
                               ac.scaled_dot_product_attention(q, q, q, is_causal=True, backend="reference"))
    with pytest.raises(AssertionError, match="second time"):
        chunked.chunked_attention(q, q, q)  # the public function of the module does check its arguments


def test_weights_come_from_one_path() -> None:
    from attention_core.functional import attention

    q = torch.randn(1, 2, 6, 4)
    out, w = attention(q, q, q, is_causal=True, need_weights=True)
    torch.testing.assert_close(out, ac.scaled_dot_product_attention(q, q, q, is_causal=True))
    torch.testing.assert_close(w, ac.attention_weights(q, q, is_causal=True))
    with ac.use_backend("chunked"):  # weights always come from the reference, whatever the default
        assert attention(q, q, q, need_weights=True)[1] is not None
        assert attention(q, q, q)[1] is None
    with pytest.raises(ValueError, match="need_weights=True runs the 'reference' backend, got backend='torch'"):
        attention(q, q, q, need_weights=True, backend="torch")


def test_available_backends_refuses_a_device_it_cannot_read() -> None:
    with pytest.raises(ValueError, match=r"device must be a torch.device or a device string.*'tpu'"):
        ac.available_backends("tpu")
    assert ac.available_backends("cpu") == ac.available_backends(torch.device("cpu"))


def test_use_backend_docstring_example_runs():
    """The example on the API page runs as written and prints what it shows."""
    import doctest

    from attention_core.backends import use_backend

    tests = doctest.DocTestFinder().find(use_backend, "use_backend", globs={})
    assert tests and tests[0].examples
    runner = doctest.DocTestRunner()
    for t in tests:
        runner.run(t)
    assert runner.summarize(verbose=False).failed == 0
    assert not any("+SKIP" in ex.source for t in tests for ex in t.examples)
