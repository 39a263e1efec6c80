"""Composition with transforms and control flow (contract point 11), and nesting
with `inline=True`: every result equals the same program without the decorator."""

import differential
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import assert_tree_allclose
from helpers import jit_equation_count
from jax import lax

from filterjit import filter_jit


TABLE = np.linspace(0.5, 1.5, 3, dtype=np.float32)
SHIFT = jnp.float32(0.25)  # a concrete jax Array made outside every trace


def body(x, n, table, shift):
    # Needs n concrete: fori_loop bounds (-> scan, so reverse-mode works) and a
    # shape. Under eager transforms `table` and `shift` are traced, as at the top
    # level, so this body uses them only through jnp.
    y = lax.fori_loop(0, n, lambda i, y: jnp.sin(y) * table + shift, x)
    return y + jnp.ones(n, jnp.float32).sum()


def numpy_body(x, n, table, shift):
    # Also needs `table` concrete: staged contexts pass it through unchanged.
    return body(x, n, table, shift) * float(np.sum(table))


# The harness's contexts that this file's bodies compose with.
CONTEXTS = differential.contexts(
    "jit(grad)",
    "jit(vmap)",
    "vmap(jit)",
    "jit(vmap(grad))",
    "scan body",
    "grad(scan body)",
    "while body",
    "cond branch",
    "jit(grad(checkpoint))",
    "jvp",
    "vjp",
    "hessian",
    "eval_shape",
    "jit in jit",
)


@pytest.mark.parametrize("context", CONTEXTS, ids=[c.name for c in CONTEXTS])
def test_equals_undecorated(context):
    x = jnp.array([0.1, 0.5, -0.3], jnp.float32)
    bodies = [body] if not context.staged else [body, numpy_body]
    for fun in bodies:
        decorated = filter_jit(fun)
        assert_tree_allclose(
            context.apply(lambda x: decorated(x, 2, TABLE, SHIFT), x),
            context.apply(lambda x: fun(x, 2, TABLE, SHIFT), x),  # noqa: B023
        )


def test_eager_grad_keeps_python_scalars_static():
    f = filter_jit(lambda x, n: jnp.sum(body(x, n, TABLE, SHIFT) ** 2))
    g = lambda x, n: jnp.sum(body(x, n, TABLE, SHIFT) ** 2)  # noqa: E731
    x = jnp.array([0.1, 0.5, -0.3], jnp.float32)
    assert_tree_allclose(jax.grad(f)(x, 2), jax.grad(g)(x, 2))


def test_custom_jvp_and_custom_vjp_rules_inside_are_respected():
    @jax.custom_jvp
    def clipped_grad(x):
        return jnp.sin(x)

    @clipped_grad.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        return jnp.sin(x), 0.1 * t

    @jax.custom_vjp
    def doubled_grad(x):
        return x

    doubled_grad.defvjp(lambda x: (x, None), lambda _, ct: (2 * ct,))

    def g(x, n):
        return clipped_grad(x) * n + doubled_grad(x)

    x = jnp.array([0.3, 0.7], jnp.float32)
    for run in (
        lambda g: jax.grad(lambda x: g(x, 3.0).sum())(x),
        lambda g: jax.jit(jax.grad(lambda x: g(x, 3.0).sum()))(x),
    ):
        assert_tree_allclose(run(filter_jit(g)), run(g))
    np.testing.assert_allclose(
        jax.grad(lambda x: filter_jit(g)(x, 3.0).sum())(x), 0.3 + 2.0
    )


# Nesting: a decorated function called in itself, inline (docs/composition.md).
def test_inline_gives_a_flat_jaxpr_and_equal_results():
    g = lambda x, n: jnp.sin(x) * n  # noqa: E731
    f = filter_jit(g, inline=True)
    closed = jax.make_jaxpr(lambda x: f(f(x, 2.0), 3.0))(jnp.float32(1))
    assert jit_equation_count(closed) == 0
    assert jax.jit(lambda x: f(f(x, 2.0), 3.0))(jnp.float32(1)) == g(
        g(jnp.float32(1), 2.0), 3.0
    )


class MLP(eqx.Module):
    layers: tuple[eqx.nn.Linear, ...]
    depth: int = eqx.field(static=True)

    def __init__(self, key):
        keys = jax.random.split(key, 2)
        self.layers = (
            eqx.nn.Linear(3, 4, key=keys[0]),
            eqx.nn.Linear(4, 1, key=keys[1]),
        )
        self.depth = 2

    def __call__(self, x):
        for layer in self.layers[: self.depth]:
            x = jnp.tanh(layer(x))
        return x


def loss(model, x, y, table):
    pred = jax.vmap(model)(x)[:, 0]
    return jnp.mean((pred - y) ** 2 * table[: x.shape[0]])


@pytest.mark.parametrize(
    "transform",
    [
        lambda f: eqx.filter_grad(f),
        lambda f: eqx.filter_value_and_grad(f),
        lambda f: eqx.filter_jit(eqx.filter_grad(f)),
        lambda f: eqx.filter_jit(eqx.filter_value_and_grad(f)),
    ],
)
def test_equinox_transforms_outside(transform):
    model = MLP(jax.random.key(0))
    x = jnp.linspace(-1, 1, 6, dtype=jnp.float32).reshape(3, 2)
    x = jnp.concatenate([x, x[:, :1]], axis=1)
    y = jnp.array([0.1, 0.2, 0.3], jnp.float32)
    table = np.ones(3, np.float32)
    assert_tree_allclose(
        transform(filter_jit(loss))(model, x, y, table),
        transform(loss)(model, x, y, table),
    )


def test_equinox_transforms_inside():
    model = MLP(jax.random.key(0))
    xs = jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(4, 3)

    def step(model, xs):
        grads = eqx.filter_grad(lambda m: jnp.sum(eqx.filter_vmap(m)(xs)))(model)
        value, _ = eqx.filter_value_and_grad(lambda m: jnp.sum(m(xs[0])))(model)
        return grads, value

    assert_tree_allclose(filter_jit(step)(model, xs), step(model, xs))
    assert_tree_allclose(
        jax.jit(lambda xs: filter_jit(step)(model, xs))(xs), step(model, xs)
    )
