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


def reference_twin(wrapper: Any) -> Any:
    """A copy of a `filter_jit` wrapper whose calls all take the reference path:
    a dispatcher of its own, made with the fast path off."""
    from filterjit._dispatch import Dispatcher
    from filterjit._jit import FilterJitWrapper

    twin = object.__new__(FilterJitWrapper)
    twin.__dict__.update(wrapper.__dict__)
    twin._dispatcher = Dispatcher(wrapper._fun, wrapper._options, fast=False)
    twin._call = twin._dispatcher.call
    return twin


def fast_read(dispatcher: Any, level: int, fun: Any, args: Any, kwargs: Any) -> Any:
    """The leaves and key that the fast path reads of a call (as the first lines
    of `Dispatcher.call` do), or `None` where it leaves the call to the reference
    path; `test_fastpath.py` checks that `call` does as this says."""
    partition = dispatcher._latest[level]
    read = partition.call_readers.get((len(args), *kwargs))
    found = None if read is None else read(fun, args, kwargs)
    if found is None:
        return None
    leaves, key, dynamic = found
    expected = partition.take_dynamic(leaves)
    assert len(dynamic) == len(expected)
    assert all(a is b for a, b in zip(dynamic, expected))
    if partition.orders is not None:  # nested, a call without keywords
        tree = args if dispatcher._fun_is_leaf else (fun, args)
        key = (key, partition.orders(tree))
    return partition, leaves, key


def reference_read(
    dispatcher: Any, level: int, fun: Any, args: Any, kwargs: Any
) -> Any:
    """The partition, leaves and key that the reference path makes of a call,
    changing nothing."""
    function = dispatcher.function
    tree = function.call_tree(fun, *function.bind(args, kwargs))
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    partition, _, key, _ = dispatcher._lookup(level, fun, tree, leaves, treedef, None)
    return partition, leaves, key
