"""A nested call's function sees the caller's own arguments (`filterjit/_structure.py`):
the helpers checked against `jax.tree_util` on generated pytrees of every kind,
then the contract on the calls that need them: dicts and `**kwargs` in insertion
order, and side effects on the caller's own containers.
"""

import collections
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from differential import assert_agree, assert_tree_allclose, CONTEXTS, outcome
from helpers import property_settings
from hypothesis import given, strategies as st
from jax import lax

from filterjit import filter_jit
from filterjit._binding import Keywords
from filterjit._structure import (
    dict_orders,
    replace_leaves,
    restore_orders,
    shape_of,
)


# The repr of a recursive strategy of this many kinds is long; it is never shown.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")


class Point(NamedTuple):
    x: Any
    y: Any


class Box(eqx.Module):
    value: Any
    label: Any = eqx.field(static=True)


_LEAVES = [jnp.ones(2), np.float32(1.0), np.ones(2), 1, 1.0, True, "s", None, len]
# Drawn by index: a strategy's repr holding arrays is too long for Hypothesis.


def _leaf(index: int) -> Any:
    return _LEAVES[index]


_leaf_values = st.integers(0, len(_LEAVES) - 1).map(_leaf)
_keys = st.sampled_from(["a", "b", "c", "d", "e"])


def _dict_of(kind: Any) -> Any:
    def make(items: list[tuple[Any, Any]]) -> Any:
        d = dict(items)
        if kind is collections.defaultdict:
            return collections.defaultdict(int, d)
        return kind(d)

    return make


def _containers(children: Any) -> Any:
    items = st.lists(st.tuples(_keys, children), max_size=5, unique_by=lambda i: i[0])
    return st.one_of(
        st.lists(children, max_size=5),
        st.lists(children, max_size=5).map(tuple),
        st.tuples(children, children).map(lambda t: Point(*t)),
        items.map(_dict_of(dict)),
        items.map(_dict_of(collections.defaultdict)),
        items.map(_dict_of(collections.OrderedDict)),
        # dicts with int keys, which sort another way than they are inserted
        st.lists(
            st.tuples(st.integers(-3, 3), children),
            max_size=4,
            unique_by=lambda i: i[0],
        ).map(dict),
        st.tuples(children, st.sampled_from([1, 1.0, "s"])).map(lambda t: Box(*t)),
        st.tuples(st.lists(children, max_size=2).map(tuple), items.map(dict)).map(
            lambda t: Keywords(*t)
        ),
        st.lists(children, max_size=3).map(lambda xs: jtu.Partial(len, *xs)),
    )


_trees = st.recursive(_leaf_values, _containers, max_leaves=20)


def _is(a: Any, b: Any) -> bool:
    return a is b


@property_settings()
@given(_trees)
def test_replacing_nothing_gives_the_tree_itself(tree):
    assert replace_leaves(tree, lambda position, leaf: leaf) is tree


@property_settings()
@given(_trees, st.data())
def test_replace_leaves_matches_jax(tree, data):
    leaves, treedef = jtu.tree_flatten(tree)
    chosen = data.draw(st.sets(st.integers(0, max(len(leaves) - 1, 0))))
    markers = {position: object() for position in chosen if position < len(leaves)}
    seen: list[Any] = []

    def replace(position: int, leaf: Any) -> Any:
        seen.append(leaf)
        return markers.get(position, leaf)

    new = replace_leaves(tree, replace)
    # Every leaf visited once, in JAX's order.
    assert len(seen) == len(leaves) and all(map(_is, seen, leaves))
    # The same structure as JAX's, with just those leaves replaced.
    new_leaves, new_treedef = jtu.tree_flatten(new)
    assert new_treedef == treedef
    expected = [markers.get(p, leaf) for p, leaf in enumerate(leaves)]
    assert all(map(_is, new_leaves, expected))
    # Every dict in its insertion order.
    assert dict_orders(new) == dict_orders(tree)
    # And only what holds a replaced leaf is new.
    if not markers:
        assert new is tree


def _subtrees(tree: Any) -> list[Any]:
    """The children of each node, as JAX flattens them, depth first; not those of
    a `jtu.Partial`, whose own unflatten copies its keywords."""
    if isinstance(tree, jtu.Partial):
        return []
    children = jtu.tree_flatten(tree, is_leaf=lambda child: child is not tree)[0]
    if len(children) == 1 and children[0] is tree:
        return []
    found = list(children)
    for child in children:
        if child is not None:
            found += _subtrees(child)
    return found


@property_settings()
@given(_trees)
def test_untouched_subtrees_are_the_callers_own(tree):
    # Replacing only the last leaf: every subtree that does not hold it is the
    # caller's object.
    leaves = jtu.tree_leaves(tree)
    if not leaves:
        return
    last = len(leaves) - 1
    new = replace_leaves(tree, lambda p, leaf: object() if p == last else leaf)
    old_subtrees = _subtrees(tree)
    new_subtrees = _subtrees(new)
    assert len(old_subtrees) == len(new_subtrees)
    for old, fresh in zip(old_subtrees, new_subtrees):
        holds_last = any(leaf is leaves[last] for leaf in jtu.tree_leaves(old))
        if not holds_last and old is not None:
            assert fresh is old


@property_settings()
@given(_trees)
def test_restore_orders_undoes_jaxs_sorting(tree):
    leaves, treedef = jtu.tree_flatten(tree)
    rebuilt = jtu.tree_unflatten(treedef, leaves)  # dicts in sorted key order
    restored = restore_orders(rebuilt, dict_orders(tree))
    assert dict_orders(restored) == dict_orders(tree)
    restored_leaves, restored_treedef = jtu.tree_flatten(restored)
    assert restored_treedef == treedef
    assert all(map(_is, restored_leaves, leaves))


@property_settings()
@given(st.lists(st.tuples(_keys, _leaf_values), max_size=5, unique_by=lambda i: i[0]))
def test_dict_orders_tell_insertion_orders_apart(items):
    forward, backward = dict(items), dict(reversed(items))
    assert jtu.tree_structure(forward) == jtu.tree_structure(backward)
    assert (dict_orders([forward]) == dict_orders([backward])) == (len(items) < 2)
    assert dict_orders(Keywords((), forward)) == (tuple(forward),)


@property_settings()
@given(_trees)
def test_shape_of_finds_sorted_dicts_as_dict_orders_does(tree):
    # dict_orders lists one entry per dict or defaultdict.
    assert shape_of(jtu.tree_structure(tree))[0] == bool(dict_orders(tree))


# ------------------------------------------------------------- the contract


def _stack_values(d: dict[str, Any]) -> jax.Array:
    return jnp.stack(list(d.values()))


def _stack_kwargs(**kwargs: Any) -> jax.Array:
    return jnp.stack(list(kwargs.values()))


X, Y = jnp.array(1.0), jnp.array(2.0)


@pytest.mark.parametrize("first", [("b", "a"), ("a", "b")])
def test_nested_dicts_keep_their_insertion_order(first):
    decorated = filter_jit(_stack_values)

    def program(undecorated: bool) -> Any:
        f = _stack_values if undecorated else decorated

        def outer(x: jax.Array, y: jax.Array) -> Any:
            values = dict(zip(first, (x, y)))
            flipped = dict(zip(reversed(first), (y, x)))
            return f(values), f(flipped), f({**values, "c": 3.0 * x})

        return jax.jit(outer)(X, Y)

    assert_tree_allclose(program(False), program(True))


@pytest.mark.parametrize("order", [("b", "a"), ("a", "b")])
def test_nested_kwargs_keep_their_order(order):
    decorated = filter_jit(_stack_kwargs)

    def outer(f: Any) -> Any:
        def run(x: jax.Array, y: jax.Array) -> Any:
            kwargs = dict(zip(order, (x, y)))
            reverse = dict(zip(reversed(order), (x, y)))
            return f(**kwargs), f(**reverse)

        return jax.jit(run)(X, Y)

    assert_tree_allclose(outer(decorated), outer(_stack_kwargs))


def test_nested_order_in_every_staged_context():
    # A dict whose order the function sees, in scan, while, cond and checkpoint.
    decorated = filter_jit(_stack_values)

    def body(f: Any, x: jax.Array) -> jax.Array:
        return jnp.sum(f({"b": x, "a": 2 * x}) * jnp.array([1.0, 10.0]))

    def contexts(f: Any) -> list[Any]:
        g = lambda x: body(f, x)  # noqa: E731
        return [
            lax.scan(lambda c, _: (g(c), None), X, None, length=2)[0],
            lax.while_loop(lambda c: c < 100.0, g, X),
            jax.jit(lambda x: lax.cond(x > 0, g, lambda y: -y, x))(X),
            jax.jit(jax.grad(jax.checkpoint(g)))(X),
            jax.jit(jax.vmap(g))(jnp.stack([X, Y])),
        ]

    assert_tree_allclose(contexts(decorated), contexts(_stack_values))


def test_defaultdict_order_and_factory_reach_the_function():
    seen = []

    @filter_jit
    def f(d: Any) -> Any:
        seen.append((list(d), d.default_factory))
        return jnp.stack(list(d.values()))

    d = collections.defaultdict(list, {"b": X, "a": Y})
    out = jax.jit(lambda x: f(collections.defaultdict(list, {"b": x, "a": Y})))(X)
    assert seen == [(["b", "a"], list)]
    np.testing.assert_array_equal(out, _stack_values(d))


def test_nested_outputs_keep_their_dicts_order():
    def f(x: jax.Array) -> Any:
        return {"b": x, "a": 2 * x, "n": {"z": 1, "y": x}}, [{"d": 1.0, "c": x}]

    def orders(g: Any) -> Any:
        seen = []
        jax.jit(lambda x: seen.append(dict_orders(g(x))) or x)(X)
        return seen

    assert (
        orders(filter_jit(f))
        == orders(f)
        == [(("b", "a", "n"), ("z", "y"), ("d", "c"))]
    )


def _log_into(x: jax.Array, sink: list[Any]) -> jax.Array:
    sink.append((x * 2).shape)  # what the trace knows; a traced value is refused
    return x


def test_nested_side_effects_reach_the_callers_containers():
    # A container holding no traced leaf is the caller's own object: appended to
    # when the function is traced, as without the decorator.
    logged = filter_jit(_log_into)
    sink: list[Any] = []
    reference: list[Any] = []
    jax.jit(lambda x: logged(x, sink))(X)
    jax.jit(lambda x: _log_into(x, reference))(X)
    assert sink == reference == [X.shape]


def test_nested_containers_are_the_callers_own():
    seen = []

    @filter_jit
    def f(x: jax.Array, config: dict[str, Any], items: list[Any]) -> jax.Array:
        seen.append((config, items))
        return x * config["scale"]

    config, items = {"scale": 2.0, "name": "n"}, [np.ones(2), 1]
    jax.jit(lambda x: f(x, config, items))(X)
    assert seen[0][0] is config and seen[0][1] is items


@pytest.mark.leaks_unchecked  # it keeps the tracers its function sees, on purpose
def test_a_container_holding_a_traced_leaf_is_a_copy_in_order():
    seen = []

    @filter_jit
    def f(d: dict[str, Any]) -> jax.Array:
        seen.append(d)
        return d["x"] * d["scale"]

    d_outer: list[Any] = []

    def outer(x: jax.Array) -> jax.Array:
        d = {"x": x, "scale": 2.0, "names": ["a"]}
        d_outer.append(d)
        return f(d)

    jax.jit(outer)(X)
    (d,) = seen
    assert d is not d_outer[0]  # its traced leaf is the inner trace's
    assert list(d) == ["x", "scale", "names"]
    assert d["names"] is d_outer[0]["names"]  # holds no traced leaf


def test_side_effects_run_once_per_key_as_in_any_jit():
    # The contract: Python side effects of a nested call run when its function is
    # traced, once per cache key; a later call with an equal key reuses the trace.
    @filter_jit
    def logged(x: jax.Array, sink: list[Any]) -> jax.Array:
        sink.append(x.dtype)
        return x

    first: list[Any] = []
    second: list[Any] = []
    jax.jit(lambda x: logged(x, first))(X)
    jax.jit(lambda x: logged(x, second) * 3)(X)
    assert len(first) == 1 and second == []


# ------------------------------------------- generated calls, every staged context


class Scaled(eqx.Module):
    weight: jax.Array
    scale: Any = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = jnp.asarray(self.scale)
        product = (x * self.weight).astype(scale.dtype) * scale
        return product.astype(x.dtype) + 1 / scale.astype(x.dtype)


_STATICS = [1, 1.0, True, 2, 2.0, -0.0, 0.0, False]


def _apply(model: Scaled, d: dict[str, Any], **kwargs: Any) -> jax.Array:
    # Sees the static field's type and value, the dict's order and the keywords'.
    values = jnp.stack([*d.values(), *kwargs.values()])
    weights = jnp.arange(1.0, len(values) + 1.0).reshape(-1, *[1] * (values.ndim - 1))
    return model(jnp.sum(values * weights, axis=0))


_STAGED = [context for context in CONTEXTS if context.staged]


@property_settings()
@given(
    st.lists(
        st.tuples(
            st.integers(0, len(_STATICS) - 1),
            st.permutations(["a", "b", "c"]),
            st.permutations(["p", "q"]),
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(0, len(_STAGED) - 1),
)
def test_generated_nested_calls_match_the_undecorated_function(calls, context_index):
    # Calls in one trace share the decorated function's caches: each must still
    # see its own static field, dict order and keyword order.
    context = _STAGED[context_index]
    decorated = filter_jit(_apply)

    def body(f: Any) -> Any:
        def g(x: jax.Array) -> jax.Array:
            outs = []
            for static, order, keywords in calls:
                model = Scaled(jnp.full(x.shape, 0.5, x.dtype), _STATICS[static])
                d = {key: x * (i + 1) for i, key in enumerate(order)}
                kwargs = {key: x - i for i, key in enumerate(keywords)}
                outs.append(f(model, d, **kwargs))
            total = jnp.zeros_like(x)
            for i, out in enumerate(outs):
                total = total + (i + 1) * out.astype(x.dtype)
            return total

        return g

    x = jnp.asarray(np.array([0.5, -1.0, 2.0], dtype=np.float32))
    expected = outcome(lambda: context.apply(body(_apply), x))
    actual = outcome(lambda: context.apply(body(decorated), x))
    assert expected.error is None, expected
    assert_agree(actual, expected, rtol=1e-5, atol=1e-6)


def _scaled_sum(coeffs, k):
    return jnp.asarray(sum(coeffs) * k)


# Guards: a long sequence of statics, then other leaves, read in the right places
# (top level, nested and ahead of time).
@pytest.mark.parametrize("where", ["top", "nested", "aot"])
def test_a_long_static_sequence_followed_by_other_leaves(where):
    f = filter_jit(_scaled_sum)
    g = filter_jit(lambda coeffs, x, k: x * sum(coeffs) * k)
    call = {
        "top": lambda fun, *args: fun(*args),
        "nested": lambda fun, *args: jax.jit(lambda: fun(*args))(),
        "aot": lambda fun, *args: fun.lower(*args).compile()(*args),
    }[where]
    coeffs = [0.5] * 17
    assert float(call(f, coeffs, 1)) == 8.5
    assert float(call(f, coeffs, 2)) == 17.0
    # An array after the long list.
    assert float(call(g, coeffs, jnp.float32(2), 1)) == 17.0
    assert float(call(g, coeffs, jnp.float32(2), 3)) == 51.0


class Reordered(collections.namedtuple("Reordered", "first second")):
    """A NamedTuple subclass registered with children in the other order."""


jtu.register_pytree_node(
    Reordered,
    lambda r: ((r.second, r.first), None),
    lambda _, children: Reordered(children[1], children[0]),
)


# Guards: a namedtuple subclass flattened by its own registration, not as a tuple.
def test_a_namedtuple_subclass_with_its_own_flatten():
    f = filter_jit(lambda r, k: (r.first - r.second) * k)
    for i in range(3):  # the first call and repeats of it
        assert float(f(Reordered(jnp.float32(10 + i), jnp.float32(3)), 1)) == 7.0 + i
        assert float(f(Reordered(jnp.float32(1), 4.0 + i), 2)) == -6.0 - 2 * i


# Guards: dict keys that are no Python identifiers, in generated code.
def test_dict_keys_that_are_not_identifiers():
    f = filter_jit(lambda d: d["x²"] + d["1 a"] + d["ü"])
    out = f({"x²": jnp.float32(1), "1 a": jnp.float32(2), "ü": jnp.float32(3)})
    assert float(out) == 6.0
