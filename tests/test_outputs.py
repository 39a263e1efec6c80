"""Outputs: traced leaves leave the jitted function, everything else is known from
the trace (a static output is this call's own object; nested, concrete outputs stay
concrete), a top-level call returns before its result is computed, and a call whose
output holds static leaves keeps JAX's fast path."""

import collections
import operator
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from differential import needs_fast_path
from helpers import cpp_cache_size, property_settings, TraceCounter
from hypothesis import given, strategies as st
from jax import lax
from jax.core import Tracer

from filterjit import filter_jit
from filterjit._fastpath import _output as written_output
from filterjit._level import TOP
from filterjit._readers import compile_function, Writer


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


# Which output leaves come back how, at the top level and nested
# (docs/contract.md, Outputs).


def test_outputs_top_level():
    table = np.arange(3)
    marker = object()

    @filter_jit
    def f(x, n, obj, s):
        return {
            "y": x * 2,
            "n": n + 1,
            "obj": obj,
            "s": s,
            "np": np.arange(n),
            "none": None,
        }

    out = f(jnp.ones(2), 3, marker, "name")
    assert isinstance(out["y"], jax.Array)
    assert out["n"] == 4 and type(out["n"]) is int
    assert out["obj"] is marker
    assert out["s"] == "name"
    # An array returned without being computed is an output of the jit, as in
    # jax.jit: a JAX array.
    assert isinstance(out["np"], jax.Array)
    np.testing.assert_array_equal(out["np"], np.arange(3))
    assert out["none"] is None
    del table


def test_static_outputs_hand_back_this_calls_objects():
    @filter_jit
    def f(x, s):
        return x, s

    first = "".join(["na", "me"])
    second = "".join(["nam", "e"])
    assert first == second and first is not second
    assert f(jnp.ones(1), first)[1] is first
    assert f(jnp.ones(1), second)[1] is second


def test_nested_concrete_outputs_stay_concrete():
    @filter_jit
    def sizes(x, n, table):
        return x * 2, n + 1, table, table.shape[0] * 2

    table = np.arange(4)

    def outer(x):
        y, m, t, k = sizes(x, np.int32(2), table)
        assert t is table
        assert not isinstance(m, Tracer)
        # Usable as shapes and loop bounds.
        return (
            y.sum()
            + jnp.ones(int(m)).sum()
            + lax.fori_loop(0, k, lambda i, c: c + 1.0, 0.0)
        )

    ref = jnp.float32(2 * 3 + 3 + 8)
    assert jax.jit(outer)(jnp.ones(3)) == ref
    assert jax.jit(jax.grad(outer))(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]


def test_nested_concrete_jax_array_handed_back_is_the_same_object():
    a = jnp.arange(3.0)
    f = filter_jit(lambda x, c: (x, c))

    def outer(x):
        _, c = f(x, a)
        assert c is a
        return x

    jax.jit(outer)(jnp.float32(1))


# A top-level call returns before its result is computed (docs/contract.md, Other
# guarantees), as jax.jit's does.
def test_top_level_call_does_not_block():
    @filter_jit
    def heavy(x):
        for _ in range(8):
            x = jnp.tanh(x @ x)
        return x

    x = jnp.ones((600, 600), jnp.float32) / 600
    heavy(x).block_until_ready()
    ratios = []
    for _ in range(5):
        start = time.perf_counter()
        out = heavy(x)
        returned = time.perf_counter() - start
        out.block_until_ready()
        ready = time.perf_counter() - start
        ratios.append(returned / ready)
    # Not a timing target, only "does not wait for the result": a blocking call
    # returns at ratio ~1.
    assert min(ratios) < 0.5, ratios


Point = collections.namedtuple("Point", "x y")


class Holder(eqx.Module):
    a: Any
    b: Any


_output_leaves = st.sampled_from(
    [jnp.ones(2), np.ones(1), 1, 1.0, True, "s", (1, 2), frozenset({1}), None]
)
_outputs = st.recursive(
    _output_leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("ba"), inner, max_size=2),
        st.dictionaries(st.sampled_from([2, 1]), inner, max_size=2),
        st.tuples(inner, inner).map(lambda t: Point(*t)),
        st.tuples(inner, inner).map(lambda t: Holder(*t)),
    ),
    max_leaves=8,
)


@needs_fast_path
@property_settings()
@given(_outputs, st.data())
def test_output_builders_rebuild_what_jax_unflattens(output, data):
    # A hit writes `treedef.unflatten` out as one expression: where it writes
    # one, it must give JAX's output, leaf for leaf, from wherever each leaf comes
    # (a traced leaf, an input handed back, a constant).
    leaves, treedef = jtu.tree_flatten(output)
    kinds = data.draw(
        st.lists(
            st.sampled_from(["out", "input", "constant"]),
            min_size=len(leaves),
            max_size=len(leaves),
        )
    )
    out, inputs, sources = [], [object()], []
    for kind, leaf in zip(kinds, leaves):
        if kind == "out":
            sources.append(("out", len(out)))
            out.append(leaf)
        elif kind == "input":
            sources.append(("input", len(inputs)))
            inputs.append(leaf)
        else:
            sources.append(("constant", leaf))
    writer = Writer()
    expression = written_output(writer, treedef, sources, "o")
    build = None
    if expression is not None:
        lines = [f"return {expression}"]
        build = compile_function("build", "o, i=None", lines, writer.namespace)
    written = {tuple, list, type(None), dict}
    nodes = _node_types(treedef)
    string_keys = all(
        all(type(key) is str for key in data_)
        for kind, data_ in _node_data(treedef)
        if kind is dict
    )
    assert (build is None) == (not nodes <= written or not string_keys)
    if build is None:
        return
    built = build(tuple(out), inputs)
    assert jtu.tree_structure(built) == treedef
    assert all(map(operator.is_, jtu.tree_leaves(built), leaves))
    if "input" not in kinds:  # then the inputs may be left out
        again = build(tuple(out))
        assert all(map(operator.is_, jtu.tree_leaves(again), leaves))


def _node_data(treedef: Any) -> list[Any]:
    data = treedef.node_data()
    if data is None:
        return []
    return [data, *(d for child in treedef.children() for d in _node_data(child))]


def _node_types(treedef: Any) -> set[type]:
    return {kind for kind, _ in _node_data(treedef)}


@pytest.mark.parametrize(
    "output",
    [
        lambda x: (x + 1, 3),
        lambda x: {"a": 3, "b": [x, None]},
        lambda x: Point(2, x),
        lambda x: (x, 3, x),  # one traced leaf twice
        lambda x: (x, "s", 1.0),
    ],
)
def test_a_top_level_call_builds_its_static_output_from_the_traced_leaves(
    output: Callable[[jax.Array], Any],
):
    # An output that takes nothing from the call's leaves is built from the traced
    # leaves alone at the top level (`OutputSpec.leaf_sources` says where from), as
    # `build` builds it given the call's leaves.
    f = filter_jit(output)
    x = jnp.ones(2)
    expected = output(x)
    for _ in range(3):
        got = f(x)
        assert jtu.tree_structure(got) == jtu.tree_structure(expected)
        for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(expected)):
            assert type(a) is type(b)
            np.testing.assert_array_equal(a, b)
    (entry,) = _entries(f)
    carried = entry.jitted(x)
    spec, traced = carried.spec, carried.leaves
    assert spec.leaf_sources is not None  # (a hit builds it inline)
    by_itself, built = spec.build(traced), spec.build(traced, [x])
    assert jtu.tree_structure(by_itself) == jtu.tree_structure(built)
    assert all(map(operator.is_, jtu.tree_leaves(by_itself), jtu.tree_leaves(built)))


@pytest.mark.parametrize(
    "tags",
    [
        (object(), object()),  # keyed by identity
        (Decimal("1.0"), Decimal("1.00")),  # equal by `==`, apart by their digits
        (frozenset([1, 9]), frozenset([9, 1])),
    ],
    ids=["objects", "decimals", "frozensets"],
)
def test_an_output_handed_back_is_the_calls_own_object(tags):
    # On a miss and on every hit, from the call's leaves (`("input", p)`), never
    # the traced call's nor an earlier one's.
    f = filter_jit(lambda x, tag: (x + 1, tag))
    for _ in range(3):
        for tag in tags:
            assert f(jnp.ones(2), tag)[1] is tag
    for entry in _entries(f):
        (output, sources) = entry.jitted(jnp.ones(2)).spec.leaf_sources
        assert ("input", 1) in sources


def _entries(wrapper: Any) -> list[Any]:
    return list(wrapper._dispatcher.entries[TOP]._values.values())
