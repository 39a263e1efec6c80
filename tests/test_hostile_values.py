"""Hostile values: a static leaf whose `__eq__` raises or returns an array, NaN
and signed zeros as static values, a static tuple of 10,000 items (100,000 in the
slow tier), an array in a static field, a leaked tracer, recursion on a static
depth. Each gets correct behaviour or a clear error naming the user's argument."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TraceCounter

from filterjit import filter_jit


def test_array_in_a_static_field():
    class Model(eqx.Module):
        table: jax.Array = eqx.field(static=True)

        @filter_jit
        def __call__(self, x):
            return x + self.table

    with warnings.catch_warnings():  # equinox warns about the static array itself
        warnings.simplefilter("ignore")
        first = Model(jnp.ones(2))
        second = Model(2 * jnp.ones(2))
    assert first(jnp.ones(2)).tolist() == [2.0, 2.0]
    with pytest.raises(TypeError, match=r"`self\.table` is a static field"):
        second(jnp.ones(2))


# A trace records each static leaf, each record checked by the test run's type
# checking (tests/conftest.py): 100,000 of them take seconds.
@pytest.mark.parametrize(
    "size", [10_000, pytest.param(100_000, marks=pytest.mark.slow)]
)
def test_large_static_tuple(size):
    counter = TraceCounter(lambda x, table: x + len(table))
    f = filter_jit(counter)
    table = tuple(range(size))
    assert f(jnp.zeros(1), table).tolist() == [float(size)]
    assert f(jnp.zeros(1), table).tolist() == [float(size)]
    assert counter.count == 1


def test_recursion_on_a_static_depth():
    @filter_jit
    def power(x, depth):
        return x if depth == 0 else power(x * 2, depth - 1)

    assert power(jnp.float32(1), 5) == 32.0
    assert jax.jit(lambda x: power(x, 3))(jnp.float32(1)) == 8.0
    assert jax.grad(lambda x: power(x, 3))(jnp.float32(1)) == 8.0


def test_leaked_tracer_raises_jax_leak_error():
    leaked = []

    @filter_jit
    def leak(x):
        leaked.append(x)
        return x

    leak(jnp.ones(1))
    with pytest.raises(jax.errors.UnexpectedTracerError):
        leak(leaked[0])
    with pytest.raises(jax.errors.UnexpectedTracerError):
        jax.jit(lambda y: leak(leaked[0]) + y)(jnp.ones(1))


class _RaisingEq:
    def __hash__(self):
        return 1

    def __eq__(self, other):
        raise RuntimeError("no comparison")


class _ArrayEq:
    def __hash__(self):
        return 1

    def __eq__(self, other):  # pyright: ignore[reportIncompatibleMethodOverride]
        return np.array([True, False])


@pytest.mark.parametrize("make", [_RaisingEq, _ArrayEq])
def test_static_leaf_with_broken_eq_is_named(make):
    f = filter_jit(lambda x, options: x)
    f(jnp.ones(1), {"strategy": make()})
    with pytest.raises(TypeError, match=r"argument `options\['strategy'\]`"):
        f(jnp.ones(1), {"strategy": make()})
    # Nested, keyed by the same rule: named alike.
    nested = jax.jit(lambda x: f(f(x, {"strategy": make()}), {"strategy": make()}))
    with pytest.raises(TypeError, match=r"argument `options\['strategy'\]`"):
        nested(jnp.ones(1))


def test_nan_static_hits_the_cache_and_signed_zero_does_not():
    counter = TraceCounter(lambda x, s: jnp.copysign(x, s))
    f = filter_jit(counter)
    x = jnp.float32(1)
    assert f(x, 0.0) == 1.0 and f(x, -0.0) == -1.0
    f(x, float("nan"))
    f(x, float("nan"))
    assert counter.count == 3
