"""Shared test utilities."""

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings


class TraceCounter:
    """Wraps a function and counts how often its Python body runs."""

    def __init__(self, fun: Callable[..., Any]):
        self.fun = fun
        self.count = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.count += 1
        return self.fun(*args, **kwargs)


def assert_tree_equal(a: Any, b: Any) -> None:
    """Same structure, same leaf types, equal values and dtypes."""
    a_leaves, a_def = jax.tree_util.tree_flatten(a)
    b_leaves, b_def = jax.tree_util.tree_flatten(b)
    assert a_def == b_def, (a_def, b_def)
    for x, y in zip(a_leaves, b_leaves):
        if isinstance(x, jax.Array | np.ndarray | np.generic):
            assert isinstance(y, jax.Array | np.ndarray | np.generic), (x, y)
            assert jnp.result_type(x) == jnp.result_type(y), (x, y)
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
        else:
            assert type(x) is type(y), (x, y)
            assert x == y or (x != x and y != y), (x, y)


def jit_equation_count(jaxpr: Any) -> int:
    """Number of top-level `jit` equations in a (closed) jaxpr."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    return sum(eqn.primitive.name == "jit" for eqn in jaxpr.eqns)


def cpp_cache_size(wrapped: Any) -> int:
    """Executables in JAX's C++ dispatch cache over all entries of a `filter_jit`
    wrapper's top level: a call that leaves the C++ fast path adds none. (Reads
    JAX's private `_cache_size`; tests only.)"""
    entries = wrapped._dispatcher.entries[0]._values.values()
    return sum(entry.jitted._cache_size() for entry in entries)


def property_settings() -> settings:
    """Settings for the differential property tests: the active profile's examples
    (tests/conftest.py: 25 in the default tier, 200 with --full), derandomized; or
    a random soak of FILTERJIT_SOAK examples."""
    soak = int(os.environ.get("FILTERJIT_SOAK", "0"))
    return settings(
        max_examples=soak or settings().max_examples,
        derandomize=not soak,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
