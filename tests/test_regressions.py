"""Bugs found in the first call path (at abf791e), each reproduced as it was
reported: every one of these failed there."""

import collections
import threading

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import TraceCounter

import filterjit
from filterjit import filter_jit


def _scaled_sum(coeffs, k):
    return jnp.asarray(sum(coeffs) * k)


@pytest.mark.parametrize("where", ["top", "nested", "aot"])
def test_a_long_static_sequence_followed_by_other_leaves(where):
    f = filter_jit(_scaled_sum)
    g = filter_jit(lambda coeffs, x, k: x * sum(coeffs) * k)
    call = {
        "top": lambda fun, *args: fun(*args),
        "nested": lambda fun, *args: jax.jit(lambda: fun(*args))(),
        "aot": lambda fun, *args: fun.lower(*args).compile()(*args),
    }[where]
    coeffs = [0.5] * 17
    assert float(call(f, coeffs, 1)) == 8.5
    assert float(call(f, coeffs, 2)) == 17.0
    # An array after the long list.
    assert float(call(g, coeffs, jnp.float32(2), 1)) == 17.0
    assert float(call(g, coeffs, jnp.float32(2), 3)) == 51.0


class Reordered(collections.namedtuple("Reordered", "first second")):
    """A NamedTuple subclass registered with children in the other order."""


jtu.register_pytree_node(
    Reordered,
    lambda r: ((r.second, r.first), None),
    lambda _, children: Reordered(children[1], children[0]),
)


def test_a_namedtuple_subclass_with_its_own_flatten():
    f = filter_jit(lambda r, k: (r.first - r.second) * k)
    for i in range(3):  # the first call and repeats of it
        assert float(f(Reordered(jnp.float32(10 + i), jnp.float32(3)), 1)) == 7.0 + i
        assert float(f(Reordered(jnp.float32(1), 4.0 + i), 2)) == -6.0 - 2 * i


def test_a_mutated_numpy_array_never_serves_another_arrays_value():
    f = filter_jit(lambda x, table: x * table)

    def program(table):
        return jax.jit(lambda x: f(x, table))(jnp.ones(3, np.int32))

    first = np.ones(3, np.int32)
    assert program(first).tolist() == [1, 1, 1]
    first[:] = 5  # mutated in place
    assert program(first).tolist() == [5, 5, 5]
    other = np.ones(3, np.int32)  # equal to the first one's old contents
    assert program(other).tolist() == [1, 1, 1]  # undecorated: [1, 1, 1]


def test_dict_keys_that_are_not_identifiers():
    f = filter_jit(lambda d: d["x²"] + d["1 a"] + d["ü"])
    out = f({"x²": jnp.float32(1), "1 a": jnp.float32(2), "ü": jnp.float32(3)})
    assert float(out) == 6.0


def test_a_trace_that_raises_leaves_no_trace():
    def fails_on_three(x, n):
        if n == 3:
            raise ValueError("three")
        return x * n

    f = filter_jit(fails_on_three)
    f(jnp.ones(1), 1)
    for _ in range(2):
        with pytest.raises(ValueError, match="three"):
            f(jnp.ones(1), 3)
    assert filterjit.num_traces(f) == 1
    assert not filterjit.explain(f, jnp.ones(1), 3).cache_hit


def test_explain_changes_nothing():
    counter = TraceCounter(lambda x, n: x * n)
    f = filter_jit(counter)
    for n in (1, 2):
        assert not filterjit.explain(f, jnp.ones(1), n).cache_hit
    assert counter.count == 0 and filterjit.num_traces(f) == 0
    assert not any(f._dispatcher.partitions) and not any(f._dispatcher.entries)
    f(jnp.ones(1), 1)
    assert filterjit.explain(f, jnp.ones(1), 1).cache_hit
    assert not filterjit.explain(f, jnp.ones(1), 2).cache_hit
    assert counter.count == 1


def test_concurrent_first_calls_trace_once():
    counter = TraceCounter(lambda x: x + 1)
    f = filter_jit(counter)
    start = threading.Barrier(8)
    errors = []

    def call():
        try:
            start.wait()
            f(jnp.ones(3))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert counter.count == 1
