"""Run in a subprocess with 8 CPU devices by tests/test_sharding.py (which sets
JAX_PLATFORMS=cpu and XLA_FLAGS; set here too, for a run by hand)."""

import os
from typing import Any


os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import filterjit  # noqa: E402
from filterjit import filter_jit  # noqa: E402


jax.config.update("jax_numpy_dtype_promotion", "strict")
assert jax.device_count() == 8 and jax.default_backend() == "cpu", jax.devices()
mesh = jax.make_mesh((4, 2), ("data", "model"))
replicated = NamedSharding(mesh, P())
by_data = NamedSharding(mesh, P("data"))
by_model = NamedSharding(mesh, P(None, "model"))


def check_in_shardings_prefix_skips_statics():
    @filter_jit(in_shardings=({"w": replicated, "b": None}, by_data, replicated))
    def f(params, batch, n):
        return batch @ params["w"] * n + params["b"]

    params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
    batch = jnp.arange(32.0).reshape(8, 4)
    out = f(params, batch, 3.0)  # `n` is static: its sharding is skipped
    np.testing.assert_allclose(out, batch @ params["w"] * 3.0)
    assert out.sharding.spec == P("data"), out.sharding


def check_in_shardings_prefix_over_an_argument_holding_none():
    # eqx.partition's output and optax states hold None: a prefix entry covers
    # the arrays beside it, and the None is no leaf.
    @filter_jit(in_shardings=((replicated, by_data), by_data))
    def f(pair, batch):
        weights, _ = pair
        return batch * weights.sum()

    pair = (jnp.ones(8), None)
    batch = jnp.arange(8.0)
    out = f((pair[0], None), batch)
    np.testing.assert_allclose(out, batch * 8.0)
    assert out.sharding.spec == P("data"), out.sharding


def check_outputs_keep_input_shardings():
    f = filter_jit(lambda x, k: (x * k, k))
    x = jax.device_put(jnp.arange(16.0).reshape(8, 2), by_data)
    y, k = f(x, 2.0)
    assert k == 2.0
    assert y.sharding.is_equivalent_to(x.sharding, 2), y.sharding


_CONSTANT = jnp.arange(2.0)


def _with_a_constant(x):
    return x + 1, _CONSTANT


def check_a_constant_output_is_placed_as_jax_jit_places_it_after_a_nested_call():
    g = filter_jit(_with_a_constant)
    x = jax.device_put(jnp.ones(2), jax.devices()[1])
    jax.jit(lambda x: g(x)[0])(x)  # the trace is made nested
    _, constant = g(x)
    _, expected = jax.jit(_with_a_constant)(x)
    assert constant.committed == expected.committed, constant
    assert constant.devices() == expected.devices() == {jax.devices()[1]}, constant


def check_out_shardings_prefix():
    f = filter_jit(
        lambda x: {"a": x * 2, "b": x + 1, "tag": "t"},
        out_shardings={"a": by_data, "b": by_model, "tag": None},
    )
    out = f(jnp.ones((8, 2)))
    assert out["tag"] == "t"
    assert out["a"].sharding.spec == P("data"), out["a"].sharding
    assert out["b"].sharding.spec == P(None, "model"), out["b"].sharding


def check_nested_in_shard_map_and_in_a_jit_over_a_mesh():
    @filter_jit
    def scale(x, table):
        return x * float(np.sum(table))  # needs `table` concrete

    table = np.array([1.0, 2.0], np.float32)
    body = jax.shard_map(
        lambda x: scale(x, table), mesh=mesh, in_specs=P("data"), out_specs=P("data")
    )
    x = jax.device_put(jnp.arange(16.0).reshape(8, 2), by_data)
    np.testing.assert_allclose(jax.jit(body)(x), x * 3.0)
    # Eager shard_map is an eager transform: arrays are traced, Python scalars
    # stay static.
    eager = jax.shard_map(
        lambda x: filter_jit(lambda x, k: x * k)(x, 3.0),
        mesh=mesh,
        in_specs=P("data"),
        out_specs=P("data"),
    )
    np.testing.assert_allclose(eager(x), x * 3.0)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x: scale(x, table) + 1)(x)
    np.testing.assert_allclose(out, x * 3.0 + 1)


def check_jit_shardings_are_jax_jits():
    # filterjit.jit at the top level is jax.jit: the same shardings in and out.
    def f(x, k):
        return x * k, x.sum(axis=1)

    x = jnp.arange(16.0).reshape(8, 2)
    options: dict[str, Any] = dict(
        static_argnums=1, in_shardings=(by_data,), out_shardings=(by_model, by_data)
    )
    ours = filterjit.jit(f, **options)(x, 2.0)
    theirs = jax.jit(f, **options)(x, 2.0)
    for a, b in zip(ours, theirs):
        assert a.sharding == b.sharding, (a.sharding, b.sharding)
        np.testing.assert_array_equal(a, b)
    # Nested, the shardings are the outer program's, and a concrete `k` stays
    # concrete.
    g = filterjit.jit(lambda x, k: x * float(np.sum(k)), **options)
    table = np.array([1.0, 2.0], np.float32)
    out = jax.jit(lambda x: g(x, table), out_shardings=by_data)(x)
    assert out.sharding == by_data
    np.testing.assert_allclose(out, x * 3.0)


def check_one_in_sharding_for_all_arguments():
    # As in jax.jit: one sharding (or None) for every positional argument.
    def f(x, y):
        return x * y, x + y

    x = jnp.arange(16.0).reshape(8, 2)
    for in_shardings in (by_data, None):
        ours = filter_jit(f, in_shardings=in_shardings)
        theirs = jax.jit(f, in_shardings=in_shardings)
        for a, b in zip(ours(x, x), theirs(x, x)):
            assert a.sharding == b.sharding, (a.sharding, b.sharding)
            np.testing.assert_array_equal(a, b)
        lowered, expected = ours.lower(x, x).as_text(), theirs.lower(x, x).as_text()
        assert lowered.count("mhlo.sharding") == expected.count("mhlo.sharding")
    # Its entry for a static argument is skipped.
    out = filter_jit(lambda x, k: x * k, in_shardings=by_data)(x, 2.0)
    assert out.sharding.spec == P("data"), out.sharding


class MLP(eqx.Module):
    layers: tuple[eqx.nn.Linear, ...]

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = (eqx.nn.Linear(4, 16, key=k1), eqx.nn.Linear(16, 1, key=k2))

    def __call__(self, x):
        return self.layers[1](jax.nn.tanh(self.layers[0](x)))[0]


def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def step(model, x, y, learning_rate):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    model = jax.tree.map(lambda p, g: p - learning_rate * g, model, grads)
    return model, loss


def check_data_parallel_training_matches_single_device():
    model = MLP(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (32, 4))
    y = jnp.sin(x.sum(axis=1))
    params, static = eqx.partition(model, eqx.is_array)

    def sharded_step(params, x, y):
        return step(eqx.combine(params, static), x, y, 0.1)

    parallel = filter_jit(sharded_step, in_shardings=(replicated, by_data, by_data))
    assert "num_partitions = 8" in parallel.lower(params, x, y).as_text()
    single = filter_jit(step)
    m_parallel, m_single = params, model
    loss_parallel = loss_single = None
    for _ in range(3):
        m_parallel, loss_parallel = parallel(m_parallel, x, y)
        m_parallel = eqx.filter(m_parallel, eqx.is_array)
        m_single, loss_single = single(m_single, x, y, 0.1)
        np.testing.assert_allclose(loss_parallel, loss_single, rtol=1e-5)
    print("losses", loss_single, loss_parallel)


if __name__ == "__main__":
    for name, check in list(globals().items()):
        if name.startswith("check_"):
            check()
            print("passed", name)
