"""The argument-check helpers every public function uses: TypeError for a wrong type, ValueError for a wrong
value, the message naming the argument, what was seen and what was expected."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attention_core._checks import MAX_SIZE, check_int, check_positive_int, check_real


@pytest.mark.parametrize("x", [1.0, "3", None, True, False, np.float64(2.0)])
def test_check_int_refuses_other_types_with_a_type_error(x) -> None:
    with pytest.raises(TypeError, match=r"^n must be an int >= 1, got "):
        check_int(x, "n", low=1)


@pytest.mark.parametrize("x, kw, text", [
    (0, dict(low=1), "n must be an int >= 1, got 0"),
    (5, dict(low=0, high=5, high_open=True), r"n must be an int in \[0, 5\), got 5"),
    (6, dict(low=1, high=5), r"n must be an int in \[1, 5\], got 6"),
    (-1, dict(low=0, note="(the half-width D)"), r"n must be an int >= 0 \(the half-width D\), got -1"),
])
def test_check_int_range(x, kw, text) -> None:
    with pytest.raises(ValueError, match=text):
        check_int(x, "n", **kw)


def test_check_int_accepts_the_bounds() -> None:
    assert check_int(1, "n", low=1, high=1) == 1
    assert check_int(4, "n", low=0, high=5, high_open=True) == 4
    assert check_int(-7, "n") == -7


@pytest.mark.parametrize("x", ["0.5", None, True, [0.5]])
def test_check_real_refuses_other_types_with_a_type_error(x) -> None:
    with pytest.raises(TypeError, match=r"^p must be a float in \(0, 1\], got "):
        check_real(x, "p", low=0, high=1, low_open=True)


@pytest.mark.parametrize("x", [0, 0.0, 1.5, math.nan, math.inf, -math.inf])
def test_check_real_range_and_finiteness(x) -> None:
    with pytest.raises(ValueError, match=r"^p must be a float in \(0, 1\], got "):
        check_real(x, "p", low=0, high=1, low_open=True)


def test_check_real_accepts_numbers_of_every_kind() -> None:
    assert check_real(1, "p", low=0, high=1, low_open=True) == 1.0
    assert check_real(np.float32(0.5), "p", low=0, high=1) == 0.5
    assert check_real(0, "t", low=0) == 0.0
    with pytest.raises(ValueError, match="t must be a finite float >= 0, got inf"):
        check_real(math.inf, "t", low=0)
    with pytest.raises(ValueError, match="big must be a finite float"):
        check_real(10**400, "big")


@pytest.mark.parametrize("x, allow_zero, exc", [
    (0, False, ValueError), (-1, False, ValueError), (-1, True, ValueError),
    (1.5, False, TypeError), (True, False, TypeError), ("3", True, TypeError), (None, False, TypeError),
])
def test_check_positive_int_speaks_check_ints_one_form(x, allow_zero, exc) -> None:
    """check_positive_int is check_int with low=1 (low=0 with allow_zero): the same message, naming the
    argument, the value seen and the bound, for a wrong type as for a wrong value."""
    with pytest.raises(exc) as got:
        check_positive_int(x, "n", allow_zero=allow_zero)
    with pytest.raises(exc) as want:
        check_int(x, "n", low=0 if allow_zero else 1)
    assert str(got.value) == str(want.value), (str(got.value), str(want.value))
    assert str(got.value).startswith(f"n must be an int >= {0 if allow_zero else 1}, got ")


def test_check_positive_int_bounds_and_the_largest_tensor_size() -> None:
    assert check_positive_int(1, "n") == 1 and check_positive_int(0, "n", allow_zero=True) == 0
    assert check_positive_int(MAX_SIZE, "n") == MAX_SIZE
    with pytest.raises(ValueError, match=r"^n must be an int in \[1, \d+\] \(2\*\*63 - 1, the largest tensor size\), "
                                         r"got 9223372036854775808$"):
        check_positive_int(MAX_SIZE + 1, "n")


def test_check_int_and_check_real_have_no_per_call_site_text() -> None:
    """One message form: no call site replaces what the message says was expected."""
    import inspect

    for fn in (check_int, check_real):
        assert not {"type_text", "value_text"} & set(inspect.signature(fn).parameters), fn.__name__


def _call_sites():
    from attention_core.models.rnn_attention import AdditiveAttention, LuongAttention
    from attention_core.positional import sinusoidal_encoding
    from attention_core.translation.data import NumberWords, number_to_words

    return {  # the call sites that had their own text: (call with a bad type, call with a bad value, name)
        "window": (lambda w: LuongAttention(4, 6, "general", mode="local-p", window=w), 1.5, -1),
        "query_dim": (lambda d: AdditiveAttention(d, 6, 5), 2.0, 0),
        "n": (number_to_words, 1.5, -1),
        "max_digits": (lambda d: NumberWords(max_digits=d), "3", 13),
        "base": (lambda b: sinusoidal_encoding(4, 8, base=b), "2", 1.0),
    }


@pytest.mark.parametrize("name", sorted(_call_sites()))
def test_the_former_special_cases_say_the_same_in_both_errors(name) -> None:
    """The TypeError and the ValueError of one argument expect the same thing, in the shared form."""
    call, bad_type, bad_value = _call_sites()[name]
    with pytest.raises(TypeError, match=rf"^{name} must be ") as type_error:
        call(bad_type)
    with pytest.raises(ValueError, match=rf"^{name} must be ") as value_error:
        call(bad_value)
    want_type = str(type_error.value).split(", got ")[0]
    want_value = str(value_error.value).split(", got ")[0]
    assert want_type == want_value, (want_type, want_value)
    assert str(value_error.value).endswith(f", got {bad_value!r}")
