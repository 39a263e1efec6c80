"""What a trace learned comes with the executable JAX runs, whichever trace made it
and whatever JAX keyed it on: its static (non-array) outputs are never another
trace's (under another x64 flag, at other shapes), inputs handed back are the
caller's own and NumPy outputs are fresh per call; and its runtime checks
(`eqx.error_if`) raise at every eager level, and nested, as the outer program's."""

import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from filterjit import filter_jit


def _dtype_of_sum(x):
    y = jnp.arange(3) + x.astype(int)
    return y, y.dtype


def _x64_flag(x):
    return x + 1, bool(jax.config.jax_enable_x64)  # pyright: ignore[reportAttributeAccessIssue]


@pytest.fixture
def x64_restored():
    before = jax.config.jax_enable_x64  # pyright: ignore[reportAttributeAccessIssue]
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.mark.parametrize("fun", [_dtype_of_sum, _x64_flag])
def test_static_outputs_follow_the_executable_across_x64(
    fun: Callable[[jax.Array], tuple[jax.Array, Any]], x64_restored: None
):
    wrapped = filter_jit(fun)
    for x64 in (False, True, False, True):
        jax.config.update("jax_enable_x64", x64)
        x = jnp.ones(3, jnp.float32)
        y, static = wrapped(x)
        expected_y, expected_static = fun(x)
        assert y.dtype == expected_y.dtype
        assert static == expected_static and type(static) is type(expected_static)
        # Nested in a fresh outer jit: the static output is the inner trace's.
        out = jax.jit(lambda x: wrapped(x)[0])(x)
        assert out.dtype == expected_y.dtype


def test_static_outputs_of_traces_at_other_shapes_are_not_merged():
    wrapped = filter_jit(lambda x: (x + 1, -0.0 if x.shape[0] % 2 else 0.0, 1))
    other = filter_jit(lambda x: (x + 1, True if x.shape[0] % 2 else 1))
    for n in (2, 3, 2, 3):
        _, zero, _ = wrapped(jnp.ones(n))
        assert math.copysign(1.0, zero) == (-1.0 if n % 2 else 1.0)
        _, flag = other(jnp.ones(n))
        assert type(flag) is (bool if n % 2 else int)


def _positive(x):
    return eqx.error_if(x, x > 0, "x must not be positive")


@pytest.mark.parametrize(
    "call",
    [
        lambda g, x: g(x),
        lambda g, x: jax.grad(lambda x: g(x).sum())(x),
        lambda g, x: jax.vmap(g)(x),
        lambda g, x: jax.jvp(g, (x,), (x,)),
    ],
    ids=["top", "grad", "vmap", "jvp"],
)
def test_a_failed_check_raises_equinox_error_at_every_eager_level(call):
    wrapped = filter_jit(_positive)
    call(wrapped, -jnp.ones(2))  # traced, passes
    with pytest.raises(eqx.EquinoxRuntimeError, match="x must not be positive"):
        jax.block_until_ready(call(wrapped, jnp.ones(2)))
    # As under equinox.filter_jit, the reference.
    with pytest.raises(eqx.EquinoxRuntimeError, match="x must not be positive"):
        jax.block_until_ready(call(eqx.filter_jit(_positive), jnp.ones(2)))


def test_a_check_first_traced_under_grad_waits_at_the_top_level():
    wrapped = filter_jit(_positive)
    jax.grad(lambda x: wrapped(x).sum())(-jnp.ones(2))  # the first trace
    with pytest.raises(eqx.EquinoxRuntimeError, match="x must not be positive"):
        wrapped(jnp.ones(2))  # raised at the call, not at a later use
    assert wrapped(-jnp.ones(2)).tolist() == [-1.0, -1.0]


def test_a_nested_check_is_the_outer_programs():
    wrapped = filter_jit(_positive)
    outer = jax.jit(lambda x: lax.scan(lambda c, _: (wrapped(c), None), x, None, 2)[0])
    assert outer(-jnp.ones(2)).tolist() == [-1.0, -1.0]
    with pytest.raises(Exception, match="x must not be positive"):
        jax.block_until_ready(outer(jnp.ones(2)))


def test_inputs_handed_back_and_numpy_outputs_per_call():
    marker = object()
    wrapped = filter_jit(lambda x, m, t: (x * 2, m, t, np.arange(2)))
    tables = []
    for name in ("a", "b", "a"):

        def outer(x):
            _, m, t_back, table = wrapped(x, marker, name)  # noqa: B023
            assert m is marker and t_back is name  # noqa: B023
            tables.append(table.tolist())
            table[0] = 7  # each call its own array
            return x

        jax.jit(outer)(jnp.ones(1))
    assert tables == [[0, 1]] * 3
    # At the top level, a JAX array, as from jax.jit.
    assert isinstance(wrapped(jnp.ones(1), marker, "a")[3], jax.Array)
