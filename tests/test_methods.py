"""Methods, modules and callables that are pytrees (contract point 10)."""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from helpers import TraceCounter

from filterjit import filter_jit


class Linear(eqx.Module):
    weight: jax.Array
    bias: jax.Array
    activation: str = eqx.field(static=True)

    @filter_jit
    def __call__(self, x):
        y = self.weight @ x + self.bias
        return jnp.tanh(y) if self.activation == "tanh" else y

    @filter_jit
    def scaled(self, x, factor):
        return self(x) * factor


def _linear(activation="tanh", seed=0):
    key = jax.random.key(seed)
    return Linear(jax.random.normal(key, (2, 3)), jnp.ones(2), activation)


def _reference(model, x):
    y = model.weight @ x + model.bias
    return jnp.tanh(y) if model.activation == "tanh" else y


def test_module_call_partitions_self():
    model = _linear()
    x = jnp.arange(3.0)
    np.testing.assert_allclose(model(x), _reference(model, x), rtol=1e-6)
    np.testing.assert_allclose(
        model.scaled(x, 2.0), 2 * _reference(model, x), rtol=1e-6
    )
    # Arrays in `self` are traced: a gradient flows to them.
    grads = jax.grad(lambda m: m(x).sum())(model)
    assert grads.weight.shape == (2, 3)


def test_instances_with_equal_static_fields_share_a_trace():
    seen = []

    class Counting(eqx.Module):
        w: jax.Array
        name: str = eqx.field(static=True)

        @filter_jit
        def __call__(self, x):
            seen.append(self.name)
            return self.w * x

    a = Counting(jnp.ones(2), "same")
    b = Counting(3 * jnp.ones(2), "same")
    c = Counting(jnp.ones(2), "other")
    assert a(jnp.float32(2)).tolist() == [2.0, 2.0]
    assert b(jnp.float32(2)).tolist() == [6.0, 6.0]
    assert len(seen) == 1
    c(jnp.float32(2))
    assert len(seen) == 2


def test_method_on_a_plain_class():
    class Scaler:
        def __init__(self, k):
            self.k = k

        @filter_jit
        def apply(self, x):
            return x * self.k

    assert Scaler(3.0).apply(jnp.float32(2)) == 6.0
    assert Scaler(4.0).apply(jnp.float32(2)) == 8.0
    assert Scaler.apply.__name__ == "apply"  # unbound access gives the wrapper


def test_filter_jit_of_a_module_instance_and_of_a_bound_method():
    model = _linear("none")
    x = jnp.arange(3.0)
    plain = eqx.nn.Linear(3, 2, key=jax.random.key(1))
    np.testing.assert_allclose(filter_jit(plain)(x), plain(x), rtol=1e-6)
    np.testing.assert_allclose(
        filter_jit(model.scaled)(x, 2.0), 2 * _reference(model, x), rtol=1e-6
    )

    class WithMethod(eqx.Module):
        w: jax.Array

        def apply(self, x):
            return self.w * x

    m = WithMethod(jnp.ones(2))
    assert filter_jit(m.apply)(jnp.float32(3)).tolist() == [3.0, 3.0]


def test_module_arrays_are_traced_so_new_values_do_not_retrace():
    counter = TraceCounter(lambda m, x: m.weight @ x)
    f = filter_jit(counter)
    x = jnp.ones(3)
    for seed in range(3):
        f(_linear(seed=seed), x)
    assert counter.count == 1


def test_partials():
    def g(a, x, n=2):
        return a * x * n

    a = jnp.arange(3.0)
    x = jnp.float32(2)
    ref = g(a, x)
    np.testing.assert_allclose(filter_jit(jax.tree_util.Partial(g, a))(x), ref)
    counter = TraceCounter(g)
    f = filter_jit(ft.partial(counter, a))
    np.testing.assert_allclose(f(x), ref)
    f2 = filter_jit(ft.partial(counter, a + 1))  # the bound array is traced
    np.testing.assert_allclose(f2(x), g(a + 1, x))
    np.testing.assert_allclose(filter_jit(ft.partial(g, n=3))(a, x), g(a, x, 3))


def test_hand_partitioned_pytrees():
    model = _linear()
    params, static = eqx.partition(model, eqx.is_array)
    x = jnp.arange(3.0)

    @filter_jit
    def apply(params, static, x):
        return eqx.combine(params, static)(x)

    np.testing.assert_allclose(
        apply(params, static, x), _reference(model, x), rtol=1e-6
    )
    grads = jax.grad(lambda p: apply(p, static, x).sum())(params)
    assert grads.weight.shape == (2, 3)
    # And nested inside a jitted step.
    step = jax.jit(lambda p: apply(p, static, x))
    np.testing.assert_allclose(step(params), _reference(model, x), rtol=1e-6)


def test_module_call_nested_keeps_concrete_fields():
    class Table(eqx.Module):
        table: np.ndarray

        @filter_jit
        def __call__(self, x):
            assert isinstance(self.table, np.ndarray)  # concrete when nested
            return x * self.table.sum()

    t = Table(np.arange(3, dtype=np.float32))
    assert jax.jit(lambda x: t(x))(jnp.float32(2)) == 6.0
