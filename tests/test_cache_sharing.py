"""When two calls share a trace, and when they must not. Each call must give what
the undecorated function gives (nested, in the same outer `jax.jit`; at the top
level, what `jax.jit` with the static leaves as static arguments gives), and run
the function no more often than it must:

- calls that differ only in traced values share one trace: at the top level, nested
  (ten identical calls, one inner jaxpr), with defaults bound, through a
  `filter_jit` of a `filter_jit`, and in `custom_vjp` rules where `jax.jit` shares;
- static values are keyed by type and exact value (`1`, `1.0` and `True`; `0.0` and
  `-0.0`), and static inputs that alias get their own objects back;
- a cache hit reads again, or tells apart, what may have changed: a Module (or a
  Module default) changed in place, a NumPy array mutated in place, callables
  bound to other receivers, frozensets of equal numbers of other types; and the
  table of call structures stays bounded;
- a call is keyed by everything its callable binds, and runs once: partials,
  method-like objects, defaults as they are now, static inputs that alias, values
  equal by `==` that trace differently, and a trace that one level made serving
  the other. These tests run on both paths (`on_each_path`: the fast path, and the
  reference path alone) and, where it applies, at the top level and nested.

The same as properties: test_cache_sharing_properties.py; calls interleaved with
cleared caches, new wrappers and dropped objects: test_state_machine.py.
"""

import dataclasses
import functools as ft
import gc
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import differential
import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from differential import assert_tree_allclose
from helpers import (
    both_paths,  # noqa: F401 - the `path` fixture of the tests on_each_path
    jit_equation_count,
    on_each_path,
    TraceCounter,
    ValueBox,
)

import filterjit
from filterjit import _dispatch, filter_jit


# -------------------------------- one trace for calls that differ only in traced values


def test_top_level_new_values_do_not_retrace():
    counter = TraceCounter(lambda x, y, n: x + y * n)
    f = filter_jit(counter)
    for i in range(4):
        out = f(jnp.full(3, i, jnp.float32), np.full(3, i, np.float32), 2.0)
        np.testing.assert_allclose(out, 3.0 * i)
    assert counter.count == 1
    # NumPy where jax arrays were, and the reverse: the same avals, no new trace.
    f(np.ones(3, np.float32), jnp.ones(3), 2.0)
    assert counter.count == 1
    f(jnp.ones(4), np.ones(4, np.float32), 2.0)  # new shape: one more trace
    assert counter.count == 2


def test_defaults_are_bound_before_keying():
    def g(x, n=3, *, scale=1.0):
        return x * n * scale

    counter = TraceCounter(g)
    counter.__signature__ = __import__("inspect").signature(g)  # pyright: ignore
    f = filter_jit(counter)
    x = jnp.ones(2)
    for out in (f(x), f(x, 3), f(x, n=3), f(x, 3, scale=1.0), f(n=3, x=x)):
        np.testing.assert_allclose(out, 3.0)
    assert counter.count == 1


def test_nested_calls_share_one_trace():
    counter = TraceCounter(lambda x, n, table: x * n + table.sum())
    f = filter_jit(counter)
    table = np.ones(3, np.float32)

    def outer(x):
        for _ in range(10):
            x = f(x, 2.0, table)
        return x

    closed = jax.make_jaxpr(outer)(jnp.float32(1))
    assert counter.count == 1
    assert jit_equation_count(closed) == 10
    inner = {id(eqn.params["jaxpr"]) for eqn in closed.jaxpr.eqns}
    assert len(inner) == 1


def test_filter_jit_of_filter_jit_traces_once():
    counter = TraceCounter(lambda x, n: x * n)
    f = filter_jit(filter_jit(counter))
    for i in range(3):
        assert f(jnp.float32(i), 2) == 2.0 * i
    assert counter.count == 1


def test_identical_calls_in_custom_vjp_rules_share_a_trace_where_jax_does():
    # The backward rule runs in the outer trace, under a context that JAX <= 0.11.1
    # keys its traces by (an empty abstract mesh); the nested call shares the
    # forward rule's trace exactly where a `jax.jit` of the function would.
    traces = {}
    for wrap in (filter_jit, jax.jit):
        counter = TraceCounter(lambda x: x)
        h = wrap(counter)

        @jax.custom_vjp
        def g(x):
            return h(x) * 2

        g.defvjp(lambda x: (h(x) * 2, None), lambda _, ct: (h(ct) * 2,))
        assert jax.jit(jax.grad(g))(jnp.float32(1.0)) == 2.0
        traces[wrap] = counter.count
    assert traces[filter_jit] == traces[jax.jit] >= 1


# ----------------------------------------- static values, keyed by type and exact value


def test_static_keys_are_type_aware():
    counter = TraceCounter(lambda x, n: (x, n))
    f = filter_jit(counter)
    x = jnp.ones(1)
    outs = [f(x, v)[1] for v in (1, 1.0, True)]
    assert [type(o) for o in outs] == [int, float, bool]
    assert counter.count == 3


def test_signed_zero_and_nan_keys():
    counter = TraceCounter(lambda x, s: x * s)
    f = filter_jit(counter)
    x = jnp.float32(1)
    assert jnp.signbit(f(x, 0.0)) == False  # noqa: E712
    assert jnp.signbit(f(x, -0.0)) == True  # noqa: E712
    assert counter.count == 2
    assert jnp.isnan(f(x, float("nan")))
    assert jnp.isnan(f(x, float("nan")))  # a different NaN object: same key
    assert counter.count == 3


def identity(tree: Any) -> Any:
    return tree


def test_aliased_statics_at_top_level() -> None:
    # The smallest case that test_top_level (test_leaf_kinds_properties.py) found:
    # a first call whose static leaves are one object must not make a later call
    # with equal, distinct objects get one of them back twice.
    # Which of two equal immutable values comes back is nothing a program can tell
    # (`is` aside): those are not keyed by aliasing, which would double the traces
    # (core v6, finding 9); a mutable value, compared by value, is.
    decorated = filterjit.filter_jit(identity)
    x = ValueBox(1000)
    decorated([x, x])
    a, b = ValueBox(1000), ValueBox(1000)
    out = decorated([a, b])
    assert out[0] is a and out[1] is b
    ints = [int("1000"), int("1000")]
    assert decorated([ints[0], ints[0]]) == decorated(ints) == ints


def _twice_and_pair(x: Any, pair: Any) -> Any:
    return x * 2.0, pair


_THROUGH = {
    "top": lambda f, x, pair: f(x, pair)[1],
    "grad": lambda f, x, pair: _through_grad(f, x, pair),
    "jit": lambda f, x, pair: _through_jit(f, x, pair),
}


def _through_grad(f: Any, x: Any, pair: Any) -> Any:
    seen = []
    jax.grad(lambda x: seen.append(f(x, pair)[1]) or f(x, pair)[0].sum())(x)
    return seen[0]


def _through_jit(f: Any, x: Any, pair: Any) -> Any:
    seen = []
    jax.jit(lambda x: seen.append(f(x, pair)[1]) or x)(x)
    return seen[0]


@on_each_path
@pytest.mark.parametrize("first", list(_THROUGH))
@pytest.mark.parametrize("then", list(_THROUGH))
def test_a_trace_that_saw_one_object_twice_serves_only_such_calls(first, then):
    # A trace of `(v, v)` handing the pair back cannot tell which place each object
    # came from: its program serves calls whose two places hold one object, at
    # every level that shares it, however it was reached (a hit's new trace, too).
    v, w = ValueBox(1), ValueBox(1)
    f = filter_jit(_twice_and_pair)
    x2, x3 = jnp.ones(2), jnp.ones(3)
    _THROUGH[first](f, x2, (v, w))
    aliased = _THROUGH[first](f, x3, (v, v))
    assert aliased[0] is v and aliased[1] is v
    for through in _THROUGH.values():
        for x in (x2, x3):
            distinct = through(f, x, (v, w))
            assert distinct[0] is v and distinct[1] is w
            one = through(f, x, (w, w))
            assert one[0] is w and one[1] is w


@on_each_path
def test_one_object_twice_traces_no_more_than_equinox_at_two_levels():
    v = ValueBox(1)
    counts = []
    for jit in (filter_jit, eqx.filter_jit):
        traces = []

        def f(x: Any, pair: Any) -> Any:
            traces.append(None)
            return x * 2.0, pair

        g = jit(f)
        for _ in range(2):
            assert g(jnp.ones(3), (v, v))[1] == (v, v)
            jax.grad(lambda x: g(x, (v, v))[0].sum())(jnp.ones(3))
        counts.append(len(traces))
    assert counts[0] <= counts[1], counts


def test_aliased_statics_inside_jit() -> None:
    decorated = filterjit.filter_jit(identity)
    a, b, c = np.zeros(2), np.zeros(2), np.zeros(2)
    outs: list[Any] = []

    def outer() -> None:
        decorated([a, a])
        outs.append(decorated([b, c]))

    jax.jit(outer)()
    ((out_b, out_c),) = outs
    assert out_b is b and out_c is c


# --------------------------------------- what a cache hit must read again or tell apart


def test_mutated_numpy_array_is_seen_with_its_new_value():
    add = lambda x, table: x + table  # noqa: E731
    f = filter_jit(add)
    for size in (3, 10_000):  # keyed by bytes, and by a digest of them
        table = np.zeros(size, np.float32)
        x = jnp.zeros(size)
        # Each jax.jit(lambda ...) is a fresh outer trace.
        np.testing.assert_allclose(jax.jit(lambda x: f(x, table))(x), 0.0)
        table[-1] = 5.0
        for g in (f, add):  # decorated, and the reference without the decorator
            assert jax.jit(lambda x: g(x, table))(x)[-1] == 5.0
            closed = jax.make_jaxpr(lambda x: g(x, table))(x)
            assert jax.extend.core.jaxpr_as_fun(closed)(x)[0][-1] == 5.0


# Guards: a NumPy array mutated in place is keyed by its new value, nested.
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


class Weighted(eqx.Module):
    w: jax.Array


def _at(where: str, fun, *args):
    """`fun(*args)` at the top level, or nested in a new outer trace that closes
    over `args` (so that they stay concrete there): the harness's contexts."""
    context = differential.contexts("top level" if where == "top" else "jit")[0]
    return context.apply(lambda _: fun(*args), jnp.zeros(()))


def _times_w(m, x):
    return m.w * x


# Guards: a Module's field set in place is read on the next hit.
@pytest.mark.parametrize("where", ["top", "nested"])
@pytest.mark.parametrize("how", ["object.__setattr__", "__dict__"])
def test_a_module_changed_in_place_is_read_again(where, how):
    x = jnp.ones(3)
    m = Weighted(jnp.ones(3))
    g = filter_jit(_times_w)
    for _ in range(2):  # the second call is a hit, on the fast path
        assert (_at(where, g, m, x) == _at(where, _times_w, m, x)).all()
    if how == "__dict__":
        vars(m)["w"] = 5 * jnp.ones(3)  # pyright: ignore[reportIndexIssue]
    else:
        object.__setattr__(m, "w", 5 * jnp.ones(3))
    expected = _at(where, _times_w, m, x)
    assert (expected == 5.0).all()
    assert (_at(where, g, m, x) == expected).all()


DEFAULT = Weighted(jnp.ones(3))


def _times_default(x, m=DEFAULT):
    return m.w * x


# Guards: a Module default's field set in place is read on the next hit.
@pytest.mark.parametrize("where", ["top", "nested"])
def test_a_module_default_changed_in_place_is_read_again(where):
    x = jnp.ones(3)
    g = filter_jit(_times_default)
    before = DEFAULT.w
    try:
        for _ in range(2):
            assert (_at(where, g, x) == 1.0).all()
        object.__setattr__(DEFAULT, "w", 3 * jnp.ones(3))
        expected = _at(where, _times_default, x)
        assert (expected == 3.0).all()
        assert (_at(where, g, x) == expected).all()
    finally:
        object.__setattr__(DEFAULT, "w", before)


class _MethodLike:
    """A method-like object that is not a `types.MethodType`."""

    def __init__(self, func: Callable[..., Any], receiver: Any):
        self.__func__ = func
        self.__self__ = receiver

    def __call__(self, *args: Any) -> Any:
        return self.__func__(self.__self__, *args)


class Scaler:
    def __init__(self, k: int):
        self.k = k


def _times_k(scaler: Scaler, x):
    return scaler.k * x


# Guards: a method-like callable's receiver is part of its call.
@pytest.mark.parametrize("where", ["top", "nested"])
def test_method_like_callables_with_other_receivers_are_other_functions(where):
    x = jnp.ones(2)
    for k in (2, 3, 4):
        bound = _MethodLike(_times_k, Scaler(k))
        assert (_at(where, filter_jit(bound), x) == _at(where, bound, x)).all()
        assert (_at(where, filter_jit(bound), x) == k).all()


def _first_tag(tags):
    (tag,) = tags
    return jnp.asarray(tag)


# Guards: frozensets are keyed by their elements' types too.
@pytest.mark.parametrize("where", ["top", "nested"])
def test_frozensets_of_equal_numbers_of_other_types_are_other_keys(where):
    g = filter_jit(_first_tag)

    def at(tags):
        if where == "top":
            return g(tags)
        return jax.jit(lambda: g(tags))()

    for tag in (1, 1.0, True, 1, 1.0):
        tags = frozenset({tag})
        assert at(tags).dtype == _first_tag(tags).dtype


class Tagged(eqx.Module):
    tags: frozenset = eqx.field(static=True)


# Guards: a Module's static frozenset is keyed by its elements' types.
def test_a_module_static_frozenset_is_keyed_by_its_elements_types():
    g = filter_jit(lambda m: _first_tag(m.tags))
    for tag in (1, 1.0, 1):
        m = Tagged(frozenset({tag}))
        assert g(m).dtype == _first_tag(m.tags).dtype


# Guards: the table of call structures forgets, within its bound.
def test_the_table_of_call_structures_is_bounded(monkeypatch):
    monkeypatch.setattr(_dispatch, "TOP_MAXSIZE", 8)
    g = filter_jit(lambda x, d: x)
    x = jnp.ones(1)
    for n in range(20):
        g(x, {f"key{n}": 1})  # a structure of its own each time
    dispatcher = g._dispatcher
    assert len(dispatcher.routes[0]) <= 8
    assert len(dispatcher._programs) <= 8
    assert (g(x, {"key0": 1}) == x).all()  # forgotten, made again


# -------------------------------- what a call's callable binds, each test on both paths


def _levels() -> list[Callable[[Callable[..., Any]], Callable[..., Any]]]:
    """A call at the top level, and the same call nested in a `jax.jit` of a new
    function (which JAX traces anew: the nested call is made on every call)."""
    return [lambda call: call, lambda call: jax.jit(lambda *a, **k: call(*a, **k))]


LEVELS = pytest.mark.parametrize("level", _levels(), ids=["top", "nested"])


def _scale(x, k: Any = 1.0):
    return x * k


@on_each_path
@LEVELS
def test_partials_of_one_function_compute_with_their_own_keywords(level):
    x = jnp.ones(2)
    for k in (2.0, 3.0, 2.0, 5):
        for bind in (ft.partial, jtu.Partial):
            wrapped = filter_jit(bind(_scale, k=k))
            assert_tree_allclose(level(wrapped)(x), level(bind(_scale, k=k))(x))


@on_each_path
@LEVELS
def test_partials_binding_arrays_of_other_shapes_by_keyword(level):
    for n in (2, 3, 2):
        x, k = jnp.ones(n), jnp.arange(float(n))
        wrapped = filter_jit(ft.partial(_scale, k=k))
        assert_tree_allclose(level(wrapped)(x), x * k)


@on_each_path
def test_a_call_may_override_a_partials_keyword():
    x = jnp.ones(2)
    wrapped = filter_jit(ft.partial(_scale, k=2.0))
    assert_tree_allclose(wrapped(x), x * 2.0)
    assert_tree_allclose(wrapped(x, k=7.0), x * 7.0)
    assert_tree_allclose(filter_jit(ft.partial(_scale, k=3.0))(x), x * 3.0)


@on_each_path
def test_grad_through_a_partial_binding_its_tracer_again_and_again():
    x = jnp.arange(3.0)

    def loss(k):
        return filter_jit(jtu.Partial(_scale, k=k))(x).sum()

    for k in (2.0, 3.0, 4.0):
        assert jax.grad(loss)(k) == x.sum()
        assert jax.jit(jax.grad(loss))(k) == x.sum()


def _scale_by(x, k: Any = 1.0):  # partials of it made by one test alone
    return x * k


@on_each_path
def test_a_partials_keyword_array_dies_with_the_partial():
    def make() -> weakref.ref[Any]:
        k = jnp.arange(4.0)
        filter_jit(ft.partial(_scale_by, k=k))(jnp.ones(4))
        return weakref.ref(k)

    dead = make()
    gc.collect()
    assert dead() is None
    # A later partial of the function computes with its own keyword.
    x = jnp.ones(4)
    assert_tree_allclose(filter_jit(ft.partial(_scale_by, k=2.0))(x), 2 * x)


class _Bound:
    """A descriptor returning a new method-like object on every access."""

    def __init__(self, func: Callable[..., Any]):
        self.func = func

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return _MethodLike(self.func, instance)


class _Scaler:
    def __init__(self, factor: float):
        self.factor = factor

    def _scale(self, x):
        return x * self.factor

    scale = _Bound(_scale)


class _ScalerByValue(_Scaler):
    """A receiver compared by value: two equal ones are two objects."""

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.factor == self.factor  # pyright: ignore

    def __hash__(self) -> int:
        return hash(self.factor)


@on_each_path
@LEVELS
@pytest.mark.parametrize("kind", [_Scaler, _ScalerByValue])
def test_a_method_like_object_made_anew_on_each_access_calls_itself(level, kind):
    scaler = kind(2.0)
    for n in (2, 3, 2):
        x = jnp.ones(n)
        assert_tree_allclose(level(filter_jit(scaler.scale))(x), x * 2.0)
        gc.collect()  # the first method-like object is gone
    other = kind(2.0)  # equal receiver, another object
    other.factor = 5.0  # and now unequal: its own value is used
    assert_tree_allclose(level(filter_jit(other.scale))(jnp.ones(2)), jnp.ones(2) * 5.0)


def _counting(body: Callable[..., Any]) -> tuple[Callable[..., Any], list[None]]:
    """`body` with a host callback that counts its runs (not its traces)."""
    runs: list[None] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        jax.debug.callback(lambda: runs.append(None))
        return body(*args, **kwargs)

    return counted, runs


def _hand_back_first(x, a, b):
    return x * a, a


@on_each_path
def test_static_inputs_that_stop_aliasing_run_each_call_once():
    counted, runs = _counting(_hand_back_first)
    g = filter_jit(counted)
    x = jnp.ones(2)
    lr = float("0.1")
    a, b = float("0.1"), float("0.1")
    assert a is not b
    calls = [(lr, lr), (a, b), (a, b), (lr, lr), (b, a), (a, b)]
    for first, second in calls:
        y, back = g(x, first, second)
        assert back is first
        assert_tree_allclose(y, x * first)
    jax.effects_barrier()
    assert len(runs) == len(calls)


def _scale_tree_hand_back_first(tree, a, b):
    return jax.tree.map(lambda leaf: leaf * a, tree), a


@on_each_path
def test_after_aliased_statics_new_structures_are_keyed_by_alias_too():
    counted, runs = _counting(_scale_tree_hand_back_first)
    g = filter_jit(counted)
    lr = float("0.1")
    a, b = float("0.1"), float("0.1")
    g(jnp.ones(2), lr, lr)  # from here calls are keyed by which statics are one
    calls = 1
    for x in (jnp.ones(3), [jnp.ones(2)], {"x": jnp.ones(2)}):  # new structures
        for first, second in [(a, b), (lr, lr), (a, b), (b, b)]:
            _, back = g(x, first, second)
            assert back is first
            calls += 1
    jax.effects_barrier()
    assert len(runs) == calls


@on_each_path
def test_static_inputs_that_stop_aliasing_with_donation():
    g = filter_jit(_hand_back_first, donate="all")
    lr = float("0.5")
    a, b = float("0.5"), float("0.5")
    for first, second in [(lr, lr), (a, b), (a, b), (lr, lr)]:
        x = jnp.ones(3)
        y, back = g(x, first, second)
        assert back is first
        assert_tree_allclose(y, jnp.ones(3) * 0.5)


@on_each_path
def test_nested_static_inputs_that_stop_aliasing_bind_one_call():
    counted, runs = _counting(_hand_back_first)
    g = filter_jit(counted)
    lr = float("0.25")
    a, b = float("0.25"), float("0.25")

    def outer(x):
        y, back = g(x, lr, lr)
        assert back is lr
        z, back = g(y, a, b)
        assert back is a
        return z

    x = jnp.ones(2)
    assert_tree_allclose(jax.jit(outer)(x), x * 0.25 * 0.25)
    jax.effects_barrier()
    assert len(runs) == 2
    jaxpr = jax.make_jaxpr(outer)(x)
    assert sum(e.primitive.name in ("pjit", "jit") for e in jaxpr.eqns) == 2


_GLOBAL = jnp.arange(3.0)


def _with_a_global(x):
    return x + 1, _GLOBAL


@on_each_path
def test_a_nested_call_after_a_top_level_trace_binds_one_call():
    counted, runs = _counting(_with_a_global)
    g = filter_jit(counted)
    x = jnp.ones(3)
    top = g(x)  # the top-level trace
    jax.effects_barrier()
    runs.clear()

    def outer(x):
        first, constant = g(x)
        assert constant is _GLOBAL  # as undecorated: the global itself
        return first + g(x)[1]

    undecorated, undecorated_runs = _counting(_with_a_global)
    expected = jax.jit(lambda x: undecorated(x)[0] + undecorated(x)[1])(x)
    jax.effects_barrier()
    assert_tree_allclose(jax.jit(outer)(x), expected)
    jax.effects_barrier()
    assert len(runs) == len(undecorated_runs) == 2
    assert_tree_allclose(top, (x + 1, _GLOBAL))


@on_each_path
def test_a_numpy_constant_returned_nested_is_each_calls_own():
    g = filter_jit(lambda x: (x + 1, np.arange(3.0)))
    g(jnp.ones(3))  # a top-level trace, whose constant is an output of the jit

    def outer(x):
        _, first = g(x)
        _, second = g(x)
        assert type(first) is np.ndarray and first is not second
        first[0] = 10.0  # each call's own, as undecorated
        assert second[0] == 0.0
        return x

    jax.jit(outer)(jnp.ones(3))


def _with_default(x, n=2.0):
    return x * n


@on_each_path
def test_donation_with_defaults_takes_the_fast_path(path, monkeypatch):
    if path == "reference":
        pytest.skip("counts the fast path's calls left to the reference path")
    g = filter_jit(_with_default, donate="all")
    assert_tree_allclose(g(jnp.ones(2)), jnp.ones(2) * 2.0)
    reference_calls: list[None] = []
    dispatcher = g._dispatcher
    reference = dispatcher.call

    def counted(*args: Any) -> Any:
        reference_calls.append(None)
        return reference(*args)

    monkeypatch.setattr(dispatcher, "call", counted)
    for _ in range(10):
        x = jnp.ones(2)
        assert_tree_allclose(g(x), jnp.ones(2) * 2.0)
        assert x.is_deleted()
    assert not reference_calls


@on_each_path
@LEVELS
def test_calls_bind_the_defaults_as_they_are_now(level):
    def f(x, n=2.0):
        return x * n

    def h(x, *, n=2.0):
        return x * n

    x = jnp.ones(2)
    for fun in (f, h):
        g = filter_jit(fun)
        assert_tree_allclose(level(g)(x), x * 2.0)
        if fun is f:
            f.__defaults__ = (3.0,)
        else:
            h.__kwdefaults__ = {"n": 3.0}
        assert_tree_allclose(level(g)(x), x * 3.0)
        assert_tree_allclose(level(filter_jit(fun))(x), x * 3.0)  # wrapped again
        assert_tree_allclose(level(g)(x, n=4.0), x * 4.0)


@on_each_path
def test_each_path_has_dispatchers_of_its_own(path):
    g = filter_jit(_scale)
    assert g._dispatcher._fast is (path == "fast")


# Core v6, finding 1: values equal by `==` that trace differently.
@dataclasses.dataclass(frozen=True)
class _Loss:
    weight: Any

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * _weight(self)

    @filter_jit
    def method(self, x: jax.Array) -> jax.Array:
        return x / _weight(self)


def _weight(loss: _Loss) -> Any:
    # Inside a tuple or a namedtuple, or a dataclass in the dataclass.
    weight = loss.weight
    if isinstance(weight, _Loss):
        weight = weight.weight
    return weight[0] if isinstance(weight, tuple) else weight


class _Liar:
    """Equal to every other, and hashed alike; computes with its own value."""

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Liar)

    def __hash__(self) -> int:
        return 0


class _Pair(NamedTuple):
    first: Any
    second: Any


# Pairs equal by `==` (and hash) that a trace tells apart: a frozen dataclass
# holding another number type, or -0.0, or a namedtuple of another type, in tuples.
_CONFUSABLE = [
    (np.float32(2), 2.0),
    (2.0, np.float32(2)),
    (1, 1.0),
    (True, 1),
    (0.0, -0.0),
    ((np.float32(2),), (2.0,)),
    ((-0.0,), (0.0,)),
    (_Loss(np.float32(2)), _Loss(2.0)),
    (_Pair(2.0, 1), _Pair(np.float32(2), 1)),
]


def _as_callable(weight: Any) -> Callable[[jax.Array], jax.Array]:
    return filter_jit(_Loss(weight))


def _as_static(weight: Any) -> Callable[[jax.Array], jax.Array]:
    return lambda x: filter_jit(lambda y, loss: loss(y))(x, _Loss(weight))


def _as_receiver(weight: Any) -> Callable[[jax.Array], jax.Array]:
    return _Loss(weight).method


def _undecorated(weight: Any, how: Callable[..., Any]) -> Callable[..., Any]:
    if how is _as_receiver:
        return lambda x: x / _weight(_Loss(weight))
    return _Loss(weight)


@on_each_path
@LEVELS
@pytest.mark.parametrize("how", [_as_callable, _as_static, _as_receiver])
@pytest.mark.parametrize("pair", _CONFUSABLE, ids=repr)
def test_values_equal_by_eq_that_trace_differently_share_no_trace(level, how, pair):
    x = jnp.ones(2, jnp.float16)
    with jax.numpy_dtype_promotion("standard"):
        for weight in (*pair, *pair):
            expected = level(_undecorated(weight, how))(x)
            assert_tree_allclose(level(how(weight))(x), expected)


@on_each_path
def test_a_lying_eq_is_keyed_by_eq_at_every_level():
    # A type whose `__eq__` cannot be seen through is keyed as jax.jit keys a static
    # argument, by `==` and `hash`, nested as at the top level: inside a container,
    # a dataclass or a Module's static field alike.
    x = jnp.ones(2)
    theirs = jax.jit(lambda y, liar: y * liar.value, static_argnums=1)
    expected = [theirs(x, _Liar(value)) for value in (2.0, 3.0, 2.0)]
    g = filter_jit(lambda y, liar: y * liar.value)
    inside = filter_jit(lambda y, liars: y * liars[0].value)
    held = filter_jit(lambda y, loss: y * loss.weight.value)
    for value, want in zip((2.0, 3.0, 2.0), expected):
        assert_tree_allclose(jax.jit(lambda y: g(y, _Liar(value)))(x), want)
        assert_tree_allclose(jax.jit(lambda y: inside(y, (_Liar(value),)))(x), want)
        assert_tree_allclose(jax.jit(lambda y: held(y, _Loss(_Liar(value))))(x), want)
    top = filter_jit(lambda y, liar: y * liar.value)
    for value, want in zip((2.0, 3.0, 2.0), expected):
        assert_tree_allclose(top(x, _Liar(value)), want)


class _Model(eqx.Module):
    w: jax.Array

    def __call__(self, x: jax.Array, inference: bool = False) -> jax.Array:
        return jnp.sum(self.w * x) * (2.0 if inference else 1.0)


@on_each_path
def test_a_partial_of_a_module_is_differentiated_through_its_arrays():
    # Core v6, finding 2: the partial was rebuilt with the Module as auxiliary data,
    # compared with Equinox's `__eq__`: under eager grad, tracers of equal value
    # compared equal and a concrete trace was reused (a zero gradient).
    x = jnp.arange(3.0)
    model = _Model(jnp.ones(3))

    def loss(m: _Model, decorate: Callable[..., Any]) -> jax.Array:
        return decorate(ft.partial(m, inference=True))(x)

    expected = jax.grad(loss)(model, lambda f: f)
    loss(model, filter_jit)
    assert_tree_allclose(jax.grad(loss)(model, filter_jit), expected)
    assert_tree_allclose(
        jax.jit(jax.grad(loss), static_argnums=1)(model, filter_jit), expected
    )
    # Nested, with another model of the same structure: no equality of arrays asked.
    other = eqx.tree_at(lambda m: m.w, model, jnp.zeros(3))
    for m in (model, other, model):
        assert_tree_allclose(
            jax.jit(lambda: loss(m, filter_jit))(), loss(m, lambda f: f)
        )


class _Scaled(ft.partial):
    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        return 10 * super().__call__(*args, **kwargs)


@on_each_path
@LEVELS
def test_a_partial_subclass_keeps_its_own_call(level):
    # Core v6, finding 3: it was rebuilt as a `jtu.Partial`, its `__call__` lost.
    x = jnp.ones(2)
    assert_tree_allclose(level(filter_jit(_Scaled(_scale, k=2.0)))(x), x * 20.0)
    assert_tree_allclose(level(filter_jit(_Scaled(_scale, k=3.0)))(x), x * 30.0)


@on_each_path
@LEVELS
def test_defaults_changed_in_place_are_seen(level):
    # Core v6, finding 6: `__kwdefaults__` is a dict, changed in place.
    def f(x, *, n=3.0):
        return x * n

    wrapped = filter_jit(f)
    x = jnp.ones(2)
    kwdefaults = f.__kwdefaults__
    assert kwdefaults is not None
    for n in (5.0, 5, 3.0):
        assert_tree_allclose(level(wrapped)(x), level(f)(x))
        kwdefaults["n"] = n
        assert_tree_allclose(level(wrapped)(x), level(f)(x))


@on_each_path
def test_one_float_passed_twice_is_not_keyed_by_aliasing():
    # Core v6, finding 9: `g(x, 0.0, 0.0)` (one object twice) made every later value
    # trace twice; an immutable value's identity is nothing a program relies on.
    traces: list[None] = []

    def f(x, a, b):
        traces.append(None)
        return x * a * b, a

    g = filter_jit(f)
    x = jnp.ones(2)
    zero = float("0")
    g(x, zero, zero)
    for text in ("2", "3", "4"):
        one = float(text)
        for a, b in [(one, one), (float(text), float(text)), (one, one)]:
            y, back = g(x, a, b)
            assert back == a
            assert_tree_allclose(y, x * a * b)
    assert len(traces) == 4


@on_each_path
@LEVELS
def test_one_static_object_passed_twice_traces_once(level):
    # Core v6, finding 14: the entry the first call made was dropped when the
    # aliasing was noticed, and the same call traced again.
    for setting in (2, ValueBox(2.0)):
        traces: list[None] = []

        def inner(x, a, b):
            traces.append(None)
            return x * (a if isinstance(a, int) else a.value), b

        g = filter_jit(inner)
        for _ in range(2):
            y = level(lambda x: g(x, setting, setting)[0])(jnp.ones(2))
            assert_tree_allclose(y, jnp.ones(2) * 2)
        assert len(traces) == 1


@on_each_path
@LEVELS
def test_a_deeply_nested_argument_and_output(level):
    # Core v6, finding 11: a 600-level nested tuple raised RecursionError (the fast
    # path's reader and builder at the top level, the structure's walk nested),
    # where JAX, Equinox and the undecorated function run.
    tree: Any = jnp.ones(2)
    for _ in range(600):
        tree = (tree,)

    def innermost(t, n):
        while isinstance(t, tuple):
            t = t[0]
        return t * n, t

    def f(t, n):
        return innermost(t, n)[0], t

    wrapped = filter_jit(f)
    for n in (2, 3, 2):
        out, back = level(lambda t: wrapped(t, n))(tree)
        assert_tree_allclose(out, jnp.ones(2) * n)
        assert_tree_allclose(innermost(back, 1)[1], jnp.ones(2))


@on_each_path
def test_nested_containers_handed_back_are_the_callers():
    # Core v6, finding 10: nested, the containers a function hands back were
    # copies (`out is settings` False; undecorated returns the same object), dicts
    # in insertion order included, and a container inside another.
    settings = {"b": 1, "a": [2, 3]}
    options = (1, "z")

    def f(x, s, t):
        return x * 2, s, t, s["a"], {"new": s["b"]}

    wrapped = filter_jit(f)
    for decorate in (lambda g: g, lambda g: wrapped):
        seen = []
        for _ in range(3):  # the first traces; the others hit the cache

            def outer(x, decorate=decorate, seen=seen):
                y, s, t, a, new = decorate(f)(x, settings, options)
                seen.append((s is settings, t is options, a is settings["a"], new))
                return y

            assert_tree_allclose(jax.jit(outer)(jnp.float32(1)), jnp.float32(2))
        assert seen == [(True, True, True, {"new": 1})] * 3
