"""`filterjit.jit`: `jax.jit` itself outside staged traces (compared with `jax.jit`
given the same function and keywords), and `filter_jit`'s nested no-op inside one
(compared with the undecorated function). The no-op matrix with `filterjit.jit` is
in test_noop_matrix.py; JAX's own jit tests run against it in benchmarks/peers.py.
"""

import gc
import inspect
import re
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_equal, jit_equation_count, TraceCounter
from jax import lax

import filterjit


def _loop(x: jax.Array, n: Any) -> jax.Array:
    """`x` multiplied by itself `n` times: reverse-differentiable only where `n`
    is known at trace time."""
    return lax.fori_loop(0, n, lambda _, y: y * x, jnp.ones_like(x))


def _pair(jit_kwargs: dict[str, Any], fun: Callable[..., Any] = _loop) -> Any:
    """`filterjit.jit` and `jax.jit` of one function with one set of keywords,
    each counting its traces."""
    ours, theirs = TraceCounter(fun), TraceCounter(fun)
    return (
        (filterjit.jit(ours, **jit_kwargs), ours),
        (jax.jit(theirs, **jit_kwargs), theirs),
    )


def _outcome(thunk: Callable[[], Any]) -> Any:
    try:
        return ("returns", jax.tree.map(np.asarray, thunk()))
    except Exception as e:
        # Two functions of one kind differ in their ids only.
        return ("raises", type(e), re.sub("0x[0-9a-f]+", "0x…", str(e)))


def _same_outcome(a: Any, b: Any) -> None:
    assert a[0] == b[0], (a, b)
    if a[0] == "returns":
        assert_tree_equal(a[1], b[1])
    else:
        assert a[1:] == b[1:]


@pytest.mark.parametrize(
    "jit_kwargs", [{}, {"static_argnums": 1}, {"static_argnames": "n"}]
)
def test_top_level_calls_are_jax_jit_calls(jit_kwargs):
    (ours, our_count), (theirs, their_count) = _pair(jit_kwargs)
    x = jnp.float32(1.5)
    calls = [
        lambda f: f(x, 3),
        lambda f: f(x, 3),
        lambda f: f(x, n=4),
        lambda f: f(2.0, 3),  # a Python float: traced, weakly typed
        lambda f: f(jnp.ones(2), np.int32(2)),
        lambda f: f(x, jnp.int32(2)),  # unhashable where static
        lambda f: f(x, [2]),
        lambda f: f("x", 2),  # not a JAX type
    ]
    for call in calls:
        _same_outcome(_outcome(lambda: call(ours)), _outcome(lambda: call(theirs)))
        # The same traces, in the same cache.
        assert our_count.count == their_count.count
        assert ours._cache_size() == theirs._cache_size()  # pyright: ignore


def test_eager_transforms_see_jax_jit():
    (ours, _), (theirs, _) = _pair({})
    for transform in (
        lambda f: jax.grad(lambda x: f(x, 3))(2.0),
        lambda f: jax.vmap(lambda x: f(x, 3))(jnp.arange(3.0)),
        lambda f: jax.jvp(lambda x: f(x, 2), (2.0,), (1.0,)),
        # jax.jit traces `n` under grad, and so the loop cannot be reversed.
        lambda f: jax.grad(f)(2.0, 3),
    ):
        _same_outcome(
            _outcome(lambda: transform(ours)), _outcome(lambda: transform(theirs))
        )
    assert _outcome(lambda: jax.grad(ours)(2.0, 3))[0] == "raises"


def test_construction_errors_are_jax_jits():
    def f(x, n):
        return x * n

    for make in (
        lambda jit: jit(f, static_argnums="x"),
        lambda jit: jit(f, static_argnames=3),
        lambda jit: jit(f, donate_argnames="nope"),
        lambda jit: jit(f, static_argnums=0, donate_argnums=0),
        lambda jit: jit(f, no_such_option=1),
        lambda jit: jit(1),
        lambda jit: jit(staticmethod(f)),
    ):
        ours, theirs = (
            _outcome(lambda: make(filterjit.jit)),
            _outcome(lambda: make(jax.jit)),
        )
        assert theirs[0] == "raises"
        assert ours[1:] == theirs[1:]


def test_metadata_and_ahead_of_time_are_jax_jits():
    def f(x: jax.Array, n: int = 2) -> jax.Array:
        """Docstring of f."""
        return x * n

    f.custom = 4  # pyright: ignore[reportFunctionMemberAccess]
    ours, theirs = filterjit.jit(f, static_argnums=1), jax.jit(f, static_argnums=1)
    for name in ("__name__", "__qualname__", "__doc__", "__module__", "__wrapped__"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.__annotations__ == theirs.__annotations__
    assert ours.custom == 4  # pyright: ignore
    assert inspect.signature(ours) == inspect.signature(f)
    assert ours.__getstate__()["function_name"] == "f"  # pyright: ignore
    assert {name for name in dir(theirs) if not name.startswith("__")} <= set(dir(ours))
    x = jnp.ones(3)
    assert ours.lower(x, 3).as_text() == theirs.lower(x, 3).as_text()  # pyright: ignore
    assert str(ours.trace(x, 3).jaxpr) == str(theirs.trace(x, 3).jaxpr)  # pyright: ignore
    assert ours.eval_shape(x, 3) == theirs.eval_shape(x, 3)  # pyright: ignore
    compiled = ours.lower(x, 3).compile()  # pyright: ignore
    assert_tree_equal(compiled(x), theirs(x, 3))


def test_methods_and_decorator_factories():
    class Scaled:
        def __init__(self, factor: float):
            self.factor = factor

        @filterjit.jit(static_argnums=0)
        def apply(self, x: jax.Array) -> jax.Array:
            return x * self.factor

        def __hash__(self) -> int:
            return hash(self.factor)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Scaled) and other.factor == self.factor

    x = jnp.arange(3.0)
    assert_tree_equal(Scaled(2.0).apply(x), x * 2.0)
    assert_tree_equal(jax.jit(lambda y: Scaled(3.0).apply(y))(x), x * 3.0)
    decorate = filterjit.jit(static_argnums=1)
    x = jnp.float32(2)
    assert decorate(_loop)(x, 3) == jax.jit(_loop, static_argnums=1)(x, 3)
    with pytest.raises(TypeError, match="Expected a callable value, got None"):
        filterjit.jit(None)  # pyright: ignore[reportCallIssue, reportArgumentType]


def test_top_level_donation_is_jax_jits():
    def step(state: jax.Array, grad: jax.Array) -> jax.Array:
        return state - grad

    deleted = []
    for jit in (filterjit.jit, jax.jit):
        state, grad = jnp.ones(4), jnp.ones(4)
        jit(step, donate_argnums=0)(state, grad)
        deleted.append((state.is_deleted(), grad.is_deleted()))
    assert deleted[0] == deleted[1] == (True, False)


@pytest.mark.parametrize(
    "jit_kwargs",
    [{}, {"static_argnums": 1}, {"donate_argnums": (0, 1)}, {"inline": True}],
)
def test_nested_calls_change_nothing(jit_kwargs):
    seen = []

    def inner(x, c):
        seen.append(type(c))
        return _loop(x, c)

    f = filterjit.jit(inner, **jit_kwargs)
    x = jnp.float32(1.5)
    for c in (3, np.int32(3), np.array(3), jnp.asarray(3)):
        # Reverse mode through the loop, where `c` is known at trace time; a jit
        # of the undecorated function is the reference.
        got = jax.jit(jax.grad(lambda y: f(y, c)))(x)
        expected = jax.jit(jax.grad(lambda y: inner(y, c)))(x)
        assert_tree_equal(got, expected)
        assert seen[-1] is seen[-2] is type(c)  # reached `inner` as it was


def test_nested_calls_trace_tracers_only_and_once():
    counter = TraceCounter(lambda x, c: x * c)
    f = filterjit.jit(counter, static_argnums=1)

    def outer(x):
        return f(x, 2.0) + f(x, 2.0)

    jaxpr = jax.make_jaxpr(outer)(1.0)
    assert jit_equation_count(jaxpr) == 2
    assert counter.count == 1  # the second call reused the first's trace
    inline = filterjit.jit(counter, inline=True)
    assert jit_equation_count(jax.make_jaxpr(lambda x: inline(x, 2.0))(1.0)) == 0
    keep = filterjit.jit(lambda x, unused: x, keep_unused=True)
    (equation,) = jax.make_jaxpr(lambda x, y: keep(x, y))(1.0, 2.0).eqns
    assert equation.params["keep_unused"] and len(equation.invars) == 2


def test_nested_calls_share_filter_jits_caches():
    counter = TraceCounter(lambda x, c: x * c)
    ours, filtered = filterjit.jit(counter), filterjit.filter_jit(counter)
    jax.jit(lambda x: ours(x, 2.0) + filtered(x, 2.0))(1.0)
    assert counter.count == 1
    # clear_cache clears the nested cache too.
    ours.clear_cache()  # pyright: ignore[reportFunctionMemberAccess]
    jax.jit(lambda x: ours(x, 2.0))(3.0)
    assert counter.count == 2


def test_nested_keywords_and_argument_errors():
    def f(x: Any, *, scale: Any, shift: Any = 0.0) -> Any:
        return x * scale + shift

    ours = filterjit.jit(f, static_argnames="scale")
    got = jax.jit(lambda x: ours(x, scale=2.0, shift=np.float32(1)))(jnp.float32(1))
    assert_tree_equal(got, jnp.float32(3))
    with pytest.raises(TypeError, match="scale"):
        jax.jit(lambda x: ours(x))(1.0)  # pyright: ignore[reportCallIssue]


def test_disable_jit_calls_the_function():
    seen = []
    f = filterjit.jit(lambda x: seen.append(type(x)) or x)
    with jax.disable_jit():
        f(np.float32(1))
        jax.jit(lambda: f(np.float32(1)))()
    assert seen == [np.float32, np.float32]


def _call_nested(f: Callable[[float], Any]) -> None:
    jax.jit(lambda y: f(y))(1.0)


def test_the_wrapper_keeps_its_function_alive_and_no_more():
    x = jnp.ones(3)
    fun = (lambda x: lambda y: x + y)(x)  # holds `x` in its closure
    wrapper = filterjit.jit(fun)
    x_ref, fun_ref = weakref.ref(x), weakref.ref(fun)
    del x, fun
    wrapper(1.0)
    _call_nested(wrapper)  # the nested caches too
    assert fun_ref() is not None
    del wrapper
    gc.collect()
    assert fun_ref() is None and x_ref() is None
