"""Settings for the whole suite, and its two tiers.

`python -m pytest` runs the default tier: every contract point, with a few
Hypothesis examples per property (25, or 10 where each example compiles:
`helpers.property_settings`). `python -m pytest --full` also runs the tests
marked `slow` (the code on the docs pages, the slow examples) and the properties
with 200 examples; `.ci/run` runs that. Both spread the test files over xdist
workers (pyproject.toml's addopts).
"""

import hypothesis
import jax
import pytest


# Strict promotion catches silent dtype changes that a wrapper could introduce.
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Examples per property test, where the test does not set its own.
hypothesis.settings.register_profile("filterjit-default", max_examples=25)
hypothesis.settings.register_profile("filterjit-full", max_examples=200)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the slow tier (tests marked slow), and the property tests "
        "with many examples",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Before collection, so that the settings the test modules build see it. An
    # explicit --hypothesis-profile wins.
    if config.getoption("hypothesis_profile", None) is None:
        full = config.getoption("--full")
        hypothesis.settings.load_profile(
            "filterjit-full" if full else "filterjit-default"
        )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="in the slow tier: run with --full")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
