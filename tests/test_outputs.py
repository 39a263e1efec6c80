"""Outputs: traced leaves leave the jitted function, everything else is known from
the trace, and a call whose output holds static leaves keeps JAX's fast path."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from helpers import cpp_cache_size, TraceCounter

from filterjit import filter_jit


def test_static_output_leaves_keep_the_cpp_fast_path():
    f = filter_jit(lambda x: (x + 1, 3, {"steps": 2, "name": "a"}))
    x = jnp.ones(3)
    f(x)
    y, three, info = f(x)
    assert three == 3 and info == {"steps": 2, "name": "a"}
    np.testing.assert_allclose(y, 2.0)
    assert cpp_cache_size(f) == 1


def test_a_returned_module_keeps_the_cpp_fast_path():
    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))

    @filter_jit
    def step(model, x):
        params, static = eqx.partition(model, eqx.is_array)
        params = jax.tree.map(lambda p: p - 0.1, params)
        return eqx.combine(params, static), model(x)

    step(model, jnp.ones(2))
    new_model, out = step(model, jnp.ones(2))
    assert new_model.activation is model.activation  # a static leaf, unchanged
    assert cpp_cache_size(step) == 1
    reference = eqx.filter_jit(step.__wrapped__)(model, jnp.ones(2))
    assert eqx.tree_equal(new_model, reference[0])


def test_static_outputs_that_depend_on_input_shapes():
    counter = TraceCounter(lambda x: (x * 2, x.shape[0], "even" * (x.size % 2 == 0)))
    f = filter_jit(counter)
    for n in (2, 3, 2, 3, 4):
        y, length, parity = f(jnp.ones(n))
        assert length == n and parity == "even" * (n % 2 == 0)
        assert y.shape == (n,)
    assert counter.count == 3


def test_returned_numpy_arrays_are_fresh_per_call_when_nested():
    f = filter_jit(lambda x: (x + 1, np.zeros(3)))
    seen = []

    def outer(x):
        _, table = f(x)
        seen.append(table)
        table[0] = 5.0  # editing one result must not change the next
        return x

    jax.jit(outer)(jnp.ones(2))
    jax.jit(lambda x: outer(x) * 2)(jnp.ones(2))
    first, second = seen
    assert type(second) is np.ndarray and second.tolist() == [5.0, 0.0, 0.0]
    assert second is not first


def test_inputs_handed_back_are_this_calls_objects():
    class Config:
        def __init__(self, n):
            self.n = n

        def __eq__(self, other):
            return isinstance(other, Config) and other.n == self.n

        def __hash__(self):
            return hash(self.n)

    f = filter_jit(lambda x, config: (x + 1, config))
    a, b = Config(1), Config(1)
    assert f(jnp.ones(1), a)[1] is a
    assert f(jnp.ones(1), b)[1] is b


def test_nested_returned_numpy_arrays_are_fresh_per_call():
    f = filter_jit(lambda x: (x + 1, np.arange(3)))
    tables = []

    def outer(x):
        for _ in range(2):  # the second call is served from the cache
            _, table = f(x)
            tables.append(table.copy())
            table[0] = 7  # mutates what this call got, as it could undecorated
        return x

    jax.make_jaxpr(outer)(jnp.float32(1))
    assert [t.tolist() for t in tables] == [[0, 1, 2], [0, 1, 2]]


_TABLE = np.linspace(0.0, 1.0, 4)  # float64
_GLOBAL = jnp.arange(3.0)


def test_top_level_array_outputs_are_jax_arrays_as_from_jax_jit():
    # Returned without being computed: as jax.jit and equinox.filter_jit return
    # them, new JAX arrays of the default dtypes.
    def f(x):
        return x + 1, _TABLE, np.float64(2.0), _GLOBAL

    ours = filter_jit(f)(jnp.ones(2))
    theirs = jax.jit(f)(jnp.ones(2))
    for mine, reference in zip(ours, theirs):
        assert isinstance(mine, jax.Array)
        assert mine.dtype == reference.dtype and mine.shape == reference.shape
        np.testing.assert_array_equal(mine, reference)
    assert ours[3] is not _GLOBAL
    assert eqx.filter_jit(f)(jnp.ones(2))[1].dtype == ours[1].dtype


def test_a_global_returned_is_not_deleted_by_a_later_donation():
    f = filter_jit(lambda x: (x + 1, _GLOBAL), donate="all")
    _, returned = f(jnp.ones(3))
    f(returned)  # donates `returned`
    np.testing.assert_array_equal(_GLOBAL, np.arange(3.0))


def test_nested_array_outputs_stay_what_the_function_returns():
    def f(x):
        return x + 1, _TABLE

    seen = []
    jax.jit(lambda x: seen.append(filter_jit(f)(x)[1]) or x)(jnp.ones(2))
    (table,) = seen
    assert type(table) is np.ndarray and table.dtype == np.float64
    np.testing.assert_array_equal(table, _TABLE)
