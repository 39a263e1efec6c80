"""Checks of `filter_jit` in a multi-process JAX program, run in every process by
`tests/test_multiprocess.py` through `tests/_multiprocess.py`:

    python tests/multiprocess/checks.py [check_name ...]

Every check runs the same code on every process (one SPMD program over a mesh of
all devices of all processes), returns what the test compares across processes
or against a single-process run, and raises if something is wrong here.
"""

import os
import sys
from collections.abc import Callable


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from worker import initialize, run_checks  # noqa: E402


PROCESS_ID, NUM_PROCESSES = initialize()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import filterjit  # noqa: E402
from filterjit import filter_jit  # noqa: E402
from filterjit._multiprocess import check_statics_agree  # noqa: E402


mesh = jax.make_mesh((jax.device_count(),), ("data",))
replicated = NamedSharding(mesh, P())
by_data = NamedSharding(mesh, P("data"))


def global_batch(data: np.ndarray) -> jax.Array:
    """The global array whose rows are `data`'s, sharded over every device of every
    process: each process contributes only its own block of rows."""
    rows = len(data) // NUM_PROCESSES
    local = data[PROCESS_ID * rows : (PROCESS_ID + 1) * rows]
    return jax.make_array_from_process_local_data(by_data, local, data.shape)


def replicate(tree):
    """Every array leaf of `tree`, equal on every process, replicated on all
    devices."""
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(replicated, np.asarray(x)),
        tree,
    )


def to_host(x) -> np.ndarray:
    """The whole value of a (possibly not fully addressable) global array."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# -- A data-parallel training step


class MLP(eqx.Module):
    layers: tuple[eqx.nn.Linear, ...]
    activation: Callable[[jax.Array], jax.Array] = eqx.field(static=True)

    def __init__(
        self, key: jax.Array, activation: Callable[[jax.Array], jax.Array] = jax.nn.tanh
    ):
        k1, k2 = jax.random.split(key)
        self.layers = (eqx.nn.Linear(4, 32, key=k1), eqx.nn.Linear(32, 1, key=k2))
        self.activation = activation

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layers[1](self.activation(self.layers[0](x)))[0]


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def check_training() -> dict:
    """Six Adam steps on a batch of 64 rows sharded over every device of every
    process, parameters replicated; the losses go back to the test, which compares
    them with a run of this same code in a single process on a single device."""
    optimiser = optax.adam(1e-2)

    @filter_jit(
        donate=("model", "opt_state"),
        in_shardings=(replicated, replicated, by_data, by_data, None),
        out_shardings=replicated,
    )
    def step(model, opt_state, x, y, optimiser):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimiser.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    rng = np.random.default_rng(0)
    x_all = rng.standard_normal((64, 4)).astype(np.float32)
    y_all = np.sin(x_all.sum(axis=1)).astype(np.float32)
    x, y = global_batch(x_all), global_batch(y_all)
    model = MLP(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    model = eqx.combine(replicate(params), static)
    opt_state = replicate(optimiser.init(eqx.filter(model, eqx.is_array)))
    losses = []
    for _ in range(6):
        old_weight = model.layers[0].weight
        model, opt_state, loss = step(model, opt_state, x, y, optimiser)
        assert old_weight.is_deleted(), "the model was not donated"
        assert loss.sharding.is_fully_replicated, loss.sharding
        losses.append(float(loss))
    assert filterjit.num_traces(step) == 1, filterjit.num_traces(step)
    assert model.layers[0].weight.sharding.is_equivalent_to(replicated, 2)
    assert losses[-1] < losses[0], losses
    return {
        "losses": losses,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
    }


# -- Shardings as prefixes of the arguments and of the output


def check_shardings_prefix() -> dict:
    @filter_jit(
        in_shardings=({"w": replicated, "b": None}, by_data, None),
        out_shardings={"y": by_data, "total": replicated, "tag": None},
    )
    def predict(params, batch, scale):
        y = batch @ params["w"] * scale + params["b"]
        return {"y": y, "total": jnp.sum(y), "tag": f"scaled by {scale}"}

    w = np.arange(8.0, dtype=np.float32).reshape(4, 2)
    b = np.ones(2, np.float32)
    data = np.arange(64.0, dtype=np.float32).reshape(16, 4)
    params = {"w": replicate(w), "b": replicate(b)}
    out = predict(params, global_batch(data), 3.0)  # `scale` is static
    assert out["tag"] == "scaled by 3.0", out["tag"]
    assert out["y"].sharding.spec == P("data"), out["y"].sharding
    assert not out["y"].is_fully_addressable
    assert out["total"].sharding.is_fully_replicated, out["total"].sharding
    expected = data @ w * 3.0 + b
    np.testing.assert_allclose(to_host(out["y"]), expected, rtol=1e-6)
    np.testing.assert_allclose(float(out["total"]), expected.sum(), rtol=1e-6)
    # Only this process's rows live here.
    for shard in out["y"].addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), expected[shard.index])
    return {"total": float(out["total"])}


def check_shardings_prefix_over_none() -> dict:
    """A prefix entry over an argument that holds `None` (as `eqx.partition`'s
    arrays and optax's state for an `eqx.nn.MLP` do): `None` is an empty subtree,
    with no leaf, so it takes no sharding, as in `jax.jit`."""
    params = {"unused": None, "w": replicate(np.ones(4, np.float32))}
    data = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    x = global_batch(data)

    def total(params, x):
        return jnp.sum(x @ params["w"])

    shardings = (replicated, by_data)
    expected = jax.jit(total, in_shardings=shardings)(params, x)
    out = filter_jit(total, in_shardings=shardings)(params, x)
    assert float(out) == float(expected) == float(data.sum()), (out, expected)
    return {"total": float(out)}


# -- Donation


def check_donate() -> dict:
    def update(state, batch):
        return {"w": state["w"] + jnp.sum(batch)}, batch * 2

    data = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    results = {}
    for donate in ("none", "all", ("batch",)):
        f = filter_jit(update, donate=donate)
        state = {"w": replicate(np.ones(3, np.float32))}
        batch = global_batch(data)
        new_state, doubled = f(state, batch)
        np.testing.assert_allclose(to_host(new_state["w"]), 1 + data.sum())
        np.testing.assert_allclose(to_host(doubled), data * 2)
        expected = (donate == "all", donate != "none")
        deleted = (state["w"].is_deleted(), batch.is_deleted())
        assert deleted == expected, (donate, deleted)
        results[str(donate)] = deleted
    return results


# -- Static arguments: one program for equal values


def check_statics_share_one_program() -> dict:
    @filter_jit
    def power_sum(x, n: int, mode: str):
        y = x
        for _ in range(n - 1):  # needs `n` static
            y = y * x
        return jnp.sum(y) if mode == "sum" else jnp.max(y)

    data = np.arange(16.0, dtype=np.float32).reshape(8, 2) / 8
    x, x2 = global_batch(data), global_batch(data + 1)
    outs = [power_sum(x, 3, "sum"), power_sum(x2, 3, "sum"), power_sum(x, 3, "sum")]
    assert filterjit.num_traces(power_sum) == 1, filterjit.num_traces(power_sum)
    np.testing.assert_allclose(float(outs[0]), (data**3).sum(), rtol=1e-5)
    np.testing.assert_allclose(float(outs[1]), ((data + 1) ** 3).sum(), rtol=1e-5)
    power_sum(x, 2, "sum")
    power_sum(x, 2, "max")
    assert filterjit.num_traces(power_sum) == 3, filterjit.num_traces(power_sum)
    return {"traces": filterjit.num_traces(power_sum)}


def check_statics_agree_direct() -> dict:
    """`check_statics_agree` itself: silent when the statics agree (whatever they
    are), a ValueError on every process naming the argument when they do not."""
    import timeit

    class Opaque:  # default repr: an address that differs between processes
        pass

    class Unrepresentable:
        def __repr__(self):
            raise RuntimeError("no repr")

    agreeing = [
        ("n", 3),
        ("mode", "sum"),
        ("activation", jax.nn.relu),
        ("fn", lambda x: x),
        ("opaque", Opaque()),
        ("broken", Unrepresentable()),
        ("unhashable", [1, {"a": 2.0}]),
        ("set", frozenset({"a", "b", "c", "d"})),
        ("nan", float("nan")),
        ("treedef", jax.tree.structure(MLP(jax.random.key(0)))),
    ]
    check_statics_agree("agreeing", agreeing)
    # Under an eager transform (a decorated function's top-level compilation can
    # happen there), and inside a mesh context.
    grad = jax.grad(lambda x: check_statics_agree("g", agreeing) or x * 2.0)(1.0)
    assert float(grad) == 2.0, grad
    with jax.set_mesh(mesh):
        check_statics_agree("in_mesh", agreeing)
    check_statics_agree("empty", [])
    seconds = min(
        timeit.repeat(lambda: check_statics_agree("f", agreeing), number=1, repeat=5)
    )
    p = PROCESS_ID
    disagreeing = {
        "n": ([("x", None), ("n", p)], "processes: 0 (int) on process 0; 1 (int) on"),
        "int_float": ([("n", [1, 1.0][p])], "1 (int) on process 0; 1.0 (float) on "),
        "int_bool": ([("flag", [1, True][p])], "1 (int) on process 0; True (bool)"),
        "zeros": ([("eps", [0.0, -0.0][p])], "0.0 (float) on process 0; -0.0 (float)"),
        "broken": (
            [("b", Unrepresentable()), ("k", p)],
            "argument `k` that differs",
        ),
        "count": (
            [("a", 1), ("b", 2)][: 1 + p],
            "`b` that differs between processes: nothing on process 0",
        ),
        "function": ([("f", [jnp.sin, jnp.cos][p])], "argument `f` that differs"),
    }
    messages = {}
    for case, (statics, expected) in disagreeing.items():
        try:
            check_statics_agree("my_step", statics)
        except ValueError as error:
            message = str(error)
            assert expected in message, (case, message)
            assert "`my_step`" in message and "an equal value" in message, message
            suggests_array = "pass `jnp.asarray(" in message
            assert suggests_array == (case != "function"), message
            messages[case] = message
        else:
            raise AssertionError(f"{case}: no error for {statics}")
    try:
        check_statics_agree(["f", "g"][p], [("n", 1)])
    except ValueError as error:
        assert "process 0: `f`; process 1: `g`" in str(error), str(error)
        messages["name"] = str(error)
    else:
        raise AssertionError("no error for different functions")
    return {"seconds_when_equal": seconds, "messages": messages}


def check_mismatched_static_through_filter_jit() -> dict:
    """A static argument that differs between processes: every process raises a
    ValueError naming it, instead of running two different programs."""

    @filter_jit
    def scaled_total(x, n_steps):
        return jnp.sum(x) * n_steps

    x = global_batch(np.ones((8, 2), np.float32))
    assert float(scaled_total(x, 2)) == 32.0  # equal on every process: fine
    try:
        out = scaled_total(x, 3 + PROCESS_ID)
    except ValueError as error:
        message = str(error)
        assert "`n_steps`" in message, message
        assert "3 (int) on process 0; 4 (int) on process 1" in message, message
        return {"message": message}
    raise AssertionError(
        f"no error for a static that differs between processes; got {to_host(out)}"
    )


def check_mismatched_statics_elsewhere() -> dict:
    """The same through a static field of an `eqx.Module` (part of the pytree
    structure, not a leaf), and at the top level under an eager `jax.grad`."""
    x = global_batch(np.ones((8, 4), np.float32))

    @filter_jit
    def apply(model, x):
        return jnp.sum(jax.vmap(model)(x))

    # Equal on every process: fine.
    assert np.isfinite(float(apply(MLP(jax.random.key(0), jax.nn.sigmoid), x)))
    messages = {}
    # Each process compiles anew (were one of them to find its value compiled
    # already, it would not check: see docs/how-to/multi-process.md).
    activation = [jax.nn.tanh, jax.nn.relu][PROCESS_ID]
    try:
        apply(MLP(jax.random.key(0), activation), x)
    except ValueError as error:
        assert "differs between processes" in str(error), error
        assert "tanh" in str(error), error
        messages["static_field"] = str(error)
    else:
        raise AssertionError("no error for a static field that differs")

    @filter_jit
    def power(x, n):
        return jnp.sum(x**n)

    try:
        jax.grad(power)(x, 2 + PROCESS_ID)
    except ValueError as error:
        assert "`n`" in str(error), error
        messages["eager_grad"] = str(error)
    else:
        raise AssertionError("no error under jax.grad for a static that differs")
    return {"messages": messages}


# -- Nested calls stay no-ops


def _fori_sum(init, lower):
    # Differentiable only while `lower` is concrete (fori_loop becomes a scan).
    return lax.fori_loop(lower, 4, lambda i, y: y + y * 0.5, init)


def _rescale(x, table):
    return x * float(np.sum(table))  # needs `table` concrete


def check_nested_in_jit() -> dict:
    data = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    x = global_batch(data)
    table = np.array([1.0, 2.0], np.float32)
    lower = np.int32(1)

    def outer(rescale, fori_sum):
        def body(x):
            grad = jax.grad(lambda x: jnp.sum(fori_sum(x, lower)))(x)
            return rescale(x, table) + grad

        return body

    undecorated = jax.jit(outer(_rescale, _fori_sum))(x)
    decorated = jax.jit(outer(filter_jit(_rescale), filter_jit(_fori_sum)))(x)
    np.testing.assert_array_equal(to_host(decorated), to_host(undecorated))
    assert decorated.sharding.is_equivalent_to(undecorated.sharding, 2)
    try:  # what the decorator saves the user from
        jax.jit(outer(_rescale, jax.jit(_fori_sum)))(x)
    except ValueError as error:
        assert "Reverse-mode differentiation does not work" in str(error), error
    else:
        raise AssertionError("a nested jax.jit did not break the gradient")
    with jax.set_mesh(mesh):
        inside_mesh = jax.jit(lambda x: filter_jit(_rescale)(x, table) + 1)(x)
    np.testing.assert_array_equal(to_host(inside_mesh), data * 3 + 1)
    return {"max": float(to_host(decorated).max())}


def check_nested_in_shard_map() -> dict:
    data = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    x = global_batch(data)
    table = np.array([1.0, 2.0], np.float32)

    def per_shard(rescale, fori_sum):
        def body(x):
            grad = jax.grad(lambda x: jnp.sum(fori_sum(x, np.int32(1))))(x)
            return lax.psum(jnp.sum(rescale(x, table) + grad), "data")

        return jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P())
        )

    undecorated = per_shard(_rescale, _fori_sum)(x)
    decorated = per_shard(filter_jit(_rescale), filter_jit(_fori_sum))(x)
    assert float(decorated) == float(undecorated), (decorated, undecorated)
    expected = 3 * data.sum() + 3.375 * data.size
    np.testing.assert_allclose(float(decorated), expected, rtol=1e-6)
    return {"total": float(decorated)}


# -- Ahead of time, from shapes with a global sharding


def check_lower_with_global_shardings() -> dict:
    @filter_jit
    def affine(x, w, scale: float):
        return x @ w * scale

    x_spec = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=by_data)
    w_spec = jax.ShapeDtypeStruct((4, 2), jnp.float32, sharding=replicated)
    lowered = affine.lower(x_spec, w_spec, 2.0)
    text = lowered.as_text()
    devices = jax.device_count()
    assert f"num_partitions = {devices}" in text, text[:2000]
    compiled = lowered.compile()
    data = np.arange(64.0, dtype=np.float32).reshape(16, 4)
    w = np.ones((4, 2), np.float32)
    out = compiled(global_batch(data), replicate(w), 2.0)
    assert out.sharding.is_equivalent_to(by_data, 2), out.sharding
    np.testing.assert_allclose(to_host(out), data @ w * 2.0)
    try:
        compiled(global_batch(data), replicate(w), 3.0)
    except Exception as error:
        assert "scale" in str(error), error
    else:
        raise AssertionError("the compiled function took another static value")
    return {"partitions": devices}


def check_process_local_call() -> dict:
    """A call on one process only, on its own devices' data (logging, evaluation on
    process 0): a local program, which must not wait for the other processes."""

    @filter_jit
    def local_mean(x, scale):
        return jnp.mean(x) * scale

    out = None
    if PROCESS_ID == 0:
        out = float(local_mean(jnp.arange(4.0), 2.0))
        assert out == 3.0, out
    return {"out": out}


if __name__ == "__main__":
    run_checks(
        {
            name: f
            for name, f in list(globals().items())
            if name.startswith("check_") and getattr(f, "__module__", "") == __name__
        }
    )
