"""The one rule for when two calls are the same, at every level and in every role:
values keyed by type and bits, containers walked (every dict key and value, a
frozenset in its iteration order), other types with their own `==` by `==` and a
`hash` recomputed on every call, everything else by identity and held until
evicted. Each test runs on both paths; references: nested, the undecorated
function; at the top level, `jax.jit` with the value static, or Equinox's count
of traces."""

import dataclasses
import decimal
import enum
import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import assert_tree_allclose
from helpers import (
    each_path,  # noqa: F401 - every test on both paths
    Knob,
)
from jax.sharding import PartitionSpec

from filterjit import filter_jit


X = jnp.ones(3, jnp.float32)


def _nested(fun: Any, *args: Any) -> Any:
    return jax.jit(lambda x: fun(x, *args))(X)


def _at(level: str, fun: Any, *args: Any) -> Any:
    return fun(X, *args) if level == "top" else _nested(fun, *args)


LEVELS = pytest.mark.parametrize("level", ["top", "nested"])


@dataclasses.dataclass(frozen=True)
class Table:
    table: dict[Any, Any]


def _by_table(x: Any, s: Table) -> Any:
    factor = {"relu": 1.0, "tanh": 2.0, "encoder": 3.0, "decoder": 4.0}
    return x * sum(factor.get(k, 0.0) + factor.get(v, 0.0) for k, v in s.table.items())


@LEVELS
@pytest.mark.parametrize(
    "tables",
    [({0: "relu"}, {0: "tanh"}), ({"encoder": 2}, {"decoder": 2})],
    ids=["values", "keys"],
)
def test_a_dict_in_a_frozen_dataclass_is_keyed_by_its_keys_and_values(level, tables):
    g = filter_jit(_by_table)
    for table in (*tables, *tables):
        assert_tree_allclose(
            _at(level, g, Table(table)), _at(level, _by_table, Table(table))
        )


def _by_knob(x: Any, knob: Knob) -> Any:
    return x * knob.k


@LEVELS
@pytest.mark.parametrize(
    "where", ["alone", "in a tuple", "in a Module", "in a Module's frozenset"]
)
def test_a_value_type_changed_in_place_is_seen(level, where):
    class Holding(eqx.Module):
        knob: Any = eqx.field(static=True)

    wrap = {
        "alone": lambda knob: knob,
        "in a tuple": lambda knob: (knob,),
        "in a Module": Holding,
        "in a Module's frozenset": lambda knob: Holding(frozenset([knob])),
    }[where]

    def f(x: Any, held: Any) -> Any:
        if where == "alone":
            knob = held
        elif where == "in a tuple":
            knob = held[0]
        elif where == "in a Module":
            knob = held.knob
        else:
            (knob,) = held.knob
        return x * knob.k

    g = filter_jit(f)
    knob = Knob(3)
    held = wrap(knob)
    assert_tree_allclose(_at(level, g, held), X * 3)
    knob.k = 5
    assert_tree_allclose(_at(level, g, held), X * 5)
    assert_tree_allclose(_at(level, g, held), X * 5)


def _first(x: Any, values: frozenset[int]) -> Any:
    return x * next(iter(values))


@LEVELS
def test_equal_frozensets_iterating_differently_share_no_trace(level):
    a, b = frozenset([1, 9]), frozenset([9, 1])
    assert a == b and list(a) != list(b)
    g = filter_jit(_first)
    for value in (a, b, a):
        assert_tree_allclose(_at(level, g, value), _at(level, _first, value))


def test_a_new_top_level_trace_takes_the_current_calls_object():
    # As jax.jit: `Decimal("0")` finds `Decimal("-0")`'s key, and a new shape
    # traces again, with the current call's object.
    def sign(x: Any, d: Any) -> Any:
        return x * float(np.copysign(1.0, float(d)))

    theirs = jax.jit(sign, static_argnums=1)
    g = filter_jit(sign)
    for x, d in [(X, "-0"), (jnp.ones(2), "0"), (jnp.ones(4), "-0")]:
        assert_tree_allclose(g(x, decimal.Decimal(d)), theirs(x, decimal.Decimal(d)))


class Call(ft.partial):
    """A partial subclass with a `__call__` of its own."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*self.args, *args, **{**self.keywords, **kwargs})


@LEVELS
def test_a_partial_subclass_sees_its_functions_defaults_changed(level):
    def f(x: Any, n: float = 2.0, *, m: float = 3.0) -> Any:
        return x * n * m

    g = filter_jit(Call(f))
    assert_tree_allclose(_at(level, lambda x: g(x)), X * 6)
    f.__defaults__ = (5.0,)
    assert_tree_allclose(_at(level, lambda x: g(x)), X * 15)
    assert f.__kwdefaults__ is not None
    f.__kwdefaults__["m"] = 7.0
    assert_tree_allclose(_at(level, lambda x: g(x)), X * 35)


# --- The same call traces once, as Equinox's does ---------------------------------


class Layer(eqx.Module):
    weight: jax.Array
    note: Any = eqx.field(static=True, default=None)

    def __call__(self, x: Any) -> Any:
        TRACES.append(None)
        return x * self.weight

    def method(self, x: Any) -> Any:
        TRACES.append(None)
        return x * self.weight


TRACES: list[None] = []


def test_a_module_with_a_none_static_field_wrapped_each_step_traces_once():
    model = Layer(jnp.ones(3))
    TRACES.clear()
    for step in range(4):
        model = eqx.tree_at(lambda m: m.weight, model, model.weight + step)
        wrapped: Any = filter_jit(model)
        assert_tree_allclose(wrapped(X), X * model.weight)
    assert len(TRACES) == 1


class _Marker:
    pass


@LEVELS
def test_a_module_holding_an_object_traces_once(level):
    model = Layer(jnp.ones(3), note=_Marker())
    TRACES.clear()
    for _ in range(3):
        assert_tree_allclose(_at(level, lambda x: filter_jit(model.method)(x)), X)
        assert_tree_allclose(_at(level, lambda x: filter_jit(model)(x)), X)
    assert len(TRACES) == 2


class _Mode(enum.StrEnum):
    DOUBLE = "double"


class _Liar:
    """Says it equals anything."""

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


def _tenfold_if_odd(x: Any, value: Any) -> Any:
    return x * (10.0 if type(value) in (_Mode, _Liar) else 2.0)


class _Noted(eqx.Module):
    value: Any = eqx.field(static=True)

    def __call__(self, x: Any) -> Any:
        return _tenfold_if_odd(x, self.value)


def _call_noted(x: Any, noted: _Noted) -> Any:
    return noted(x)


def _by_key(x: Any, table: dict[Any, Any]) -> Any:
    return _tenfold_if_odd(x * sum(table.values()), *table)


# Per role: the undecorated function, its decoration, and the argument made of the
# value.
_ROLES = {
    "a Module's static field": (_call_noted, filter_jit, _Noted),
    "a dict's key": (_by_key, filter_jit, lambda v: {v: jnp.ones(())}),
    "the callable": (
        _call_noted,
        lambda _: lambda x, noted: filter_jit(noted)(x),
        _Noted,
    ),
}


@LEVELS
@pytest.mark.parametrize("role", list(_ROLES))
@pytest.mark.parametrize(
    "values", [("double", _Mode.DOUBLE), (_Marker(), _Liar())], ids=["str", "liar"]
)
def test_values_equal_by_eq_but_of_other_types_are_keyed_apart(level, role, values):
    # `==` of structures calls a string and the `str` enum member equal to it the
    # same, and an object and one that says it equals anything; the rule keys each
    # with its type.
    fun, decorate, make = _ROLES[role]
    decorated = decorate(fun)
    for value in [*values, *values]:
        assert_tree_allclose(_at(level, decorated, make(value)), fun(X, make(value)))


def test_a_wrapper_of_an_equinox_transform_made_anew_traces_once():
    # Equinox's wrapper carries `__doc__=None` and `__annotations__={}`.
    def f(x: Any) -> Any:
        TRACES.append(None)
        return jnp.sum(x**2)

    f.__doc__ = None
    TRACES.clear()
    for _ in range(3):
        assert_tree_allclose(filter_jit(eqx.filter_grad(f))(X), 2 * X)
        assert_tree_allclose(
            filter_jit(eqx.filter_vmap(f))(jnp.ones((2, 3))), jnp.full(2, 3.0)
        )
    assert len(TRACES) == 2


def test_a_partition_spec_made_at_each_call_traces_once():
    runs = []

    def f(x: Any, spec: Any) -> Any:
        runs.append(None)
        return x + len(spec)

    g = filter_jit(f)
    for _ in range(3):
        assert_tree_allclose(g(X, PartitionSpec("a", None)), X + 2)
    assert len(runs) == 1


@pytest.mark.parametrize("x64", [False, True], ids=["x32", "x64"])
@pytest.mark.parametrize("dtype", [np.float64, np.int64])
def test_a_numpy_array_changed_after_a_nested_call_is_read_anew_everywhere(x64, dtype):
    # JAX finds its copy of a NumPy constant of another dtype by the array's
    # identity while that copy lives: no cache keeps it past its outer trace.
    with jax.enable_x64(x64):  # pyright: ignore[reportCallIssue]
        g = filter_jit(lambda x, a: x + jnp.asarray(a).sum().astype(jnp.float32))
        a = np.ones(3, dtype)
        x = jnp.ones(3, jnp.float32)
        assert_tree_allclose(jax.jit(lambda x: g(x, a))(x), x + 3)
        a[:] = 5
        assert_tree_allclose(jax.jit(lambda x: g(x, a))(x), x + 15)
        assert_tree_allclose(g(x, a), x + 15)
        assert float(jnp.asarray(a).sum()) == 15


def _last_of(x: Any, table: tuple[Any, ...]) -> Any:
    return x * table[-1] + table[0]


@LEVELS
def test_a_large_static_tuple_of_floats_is_keyed_by_every_floats_bits(level):
    """Beyond the statics a hit writes out, floats are keyed in one bytes object:
    still by every float's bits (a zero's sign, a NaN's payload), and a tuple
    equal to one seen before, or the very same again, traces no more."""
    g = filter_jit(_last_of)
    traces = []

    def counted(x: Any, table: tuple[Any, ...]) -> Any:
        traces.append(table)
        return _last_of(x, table)

    h = filter_jit(counted)
    ones = (1.0,) * 100
    payload = np.array([0x7FF8000000000001], np.uint64).view(np.float64)
    for table in [
        ones + (0.0,),
        ones + (-0.0,),
        ones + (float("nan"),),
        ones + (float(payload[0]),),  # a NaN with another payload
        ones + (1,),  # an int: another partition
    ]:
        for _ in range(2):
            assert_tree_allclose(_at(level, g, table), _last_of(X, table))
        want = jnp.signbit(_last_of(X, table))
        assert bool(jnp.all(jnp.signbit(_at(level, g, table)) == want))
    before = len(traces)
    for table in [ones + (2.0,), tuple([*ones, 2.0]), ones + (2.0,)]:
        assert_tree_allclose(_at(level, h, table), _last_of(X, table))
    assert len(traces) - before == 1  # the three equal tuples share one trace
