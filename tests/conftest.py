"""Shared pytest setup: the Hypothesis profiles of the fuzz tests (tests/test_fuzz.py), and the fixtures several
test files share (``corpus``).

Two profiles, chosen with ``pytest --fuzz-profile=NAME`` or the environment variable ``AC_FUZZ_PROFILE``:

- ``fuzz`` (the default, inside ``make test``): derandomized, so every run and every machine tries the same
  examples; a few hundred per function;
- ``slow`` (``make fuzz``): 2,000 examples per function, fresh random ones on every run; a failure prints
  the blob that replays it (``@reproduce_failure``).

Only tests/test_fuzz.py reads them: the other property tests keep the settings they declare.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, settings

_QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
# No deadline inside `make test`: on a loaded CI machine one example can stall for seconds, and Hypothesis
# reports that as a flaky failure. The inputs are tiny, so a real hang shows as a stuck test all the same.
settings.register_profile("fuzz", max_examples=300, derandomize=True, database=None, deadline=None,
                          suppress_health_check=_QUIET)
# `make fuzz`: any example slower than 60 s (they take milliseconds) fails as a likely hang. 10 s was too short
# for a cold first call on a shared 2-core machine (18 s once, 3 ms when replayed: a flaky "failure").
settings.register_profile("slow", max_examples=2000, print_blob=True, deadline=timedelta(seconds=60),
                          suppress_health_check=_QUIET)


def pytest_addoption(parser):
    parser.addoption("--fuzz-profile", default=None, choices=["fuzz", "slow"],
                     help="Hypothesis profile of tests/test_fuzz.py (default: $AC_FUZZ_PROFILE or 'fuzz')")


def pytest_configure(config):
    chosen = config.getoption("--fuzz-profile")
    if chosen:  # read by tests/test_fuzz.py at import, in every xdist worker (each runs this hook)
        os.environ["AC_FUZZ_PROFILE"] = chosen


@pytest.fixture(scope="session")
def corpus():
    """The tiny-Shakespeare corpus of the language-model chapters (split, encoded), read once per session."""
    from attention_core.shakespeare.data import load_corpus

    return load_corpus()
