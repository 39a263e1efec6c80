"""Differential property tests against JAX itself, over every kind of pytree node.

filter_jit flattens calls with `jax.tree_util`, so it must see every container
exactly as JAX does: tuples, lists, dicts, `None`, namedtuples, a namedtuple
subclass registered with its children in another order, dataclasses registered
with `register_dataclass`, a class registered with `register_pytree_with_keys`,
`jtu.Partial`, and `eqx.Module`s with static fields; long sequences (up to 40
leaves) with traced and static leaves mixed in every position.

Each example is run undecorated and decorated, at the top level, nested in
`jax.jit` and in a `lax.scan` body, and ahead of time (`.lower(...).compile()`),
then again with every static leaf changed, then as first: the results must agree
each time. The function weighs each numeric leaf by its position in JAX's own
flattening, so a leaf read from the wrong place changes the result.
"""

import collections
import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from differential import assert_tree_equal
from helpers import property_settings
from hypothesis import given, strategies as st
from jax import lax

import filterjit


# ------------------------------------------------------------------ node kinds

Pair = collections.namedtuple("Pair", "first second")


class Swapped(collections.namedtuple("Swapped", "first second")):
    """A namedtuple subclass registered with its children in the other order."""


jtu.register_pytree_node(
    Swapped,
    lambda s: ((s.second, s.first), "swapped"),
    lambda _, children: Swapped(children[1], children[0]),
)


@dataclasses.dataclass
class Registered:
    """Registered with `register_dataclass`: one data field, one meta field."""

    data: Any
    meta: int


jtu.register_dataclass(Registered, data_fields=["data"], meta_fields=["meta"])


class Keyed:
    """Registered with `register_pytree_with_keys`: children in reverse order."""

    def __init__(self, items: list[Any]):
        self.items = items

    def __repr__(self) -> str:
        return f"Keyed({self.items!r})"


jtu.register_pytree_with_keys(
    Keyed,
    lambda k: (
        [(jtu.SequenceKey(i), x) for i, x in reversed(list(enumerate(k.items)))],
        len(k.items),
    ),
    lambda n, children: Keyed(list(reversed(list(children)))),
)


class Tagged(eqx.Module):
    value: Any
    tag: str = eqx.field(static=True)


def _combine(*children: Any) -> Any:
    return children


def _partial(children: list[Any]) -> jtu.Partial:
    return jtu.Partial(_combine, *children)


# ---------------------------------------------------------------------- leaves

# Multiples of 1/8 (and -0.0): every weighted sum below is exact in float32, so
# the results agree whatever order XLA sums in, and any misplaced leaf shows.
_floats = st.one_of(st.integers(-32, 32).map(lambda i: i / 8), st.just(-0.0))
leaves = st.one_of(
    _floats.map(jnp.float32),
    _floats.map(lambda v: jnp.asarray(v)),  # weakly typed
    _floats.map(np.float32),
    st.lists(_floats, min_size=2, max_size=2).map(lambda v: np.asarray(v, np.float32)),
    st.integers(-3, 3),
    _floats,
    st.booleans(),
    st.text("ab", max_size=2),
    st.none(),
)


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    lists = st.lists(children, max_size=4)
    return st.one_of(
        lists,
        lists.map(tuple),
        st.dictionaries(st.text("xy²", min_size=1, max_size=2), children, max_size=3),
        st.builds(Pair, children, children),
        st.builds(Swapped, children, children),
        st.builds(Registered, children, st.integers(0, 2)),
        lists.map(Keyed),
        lists.map(_partial),
        st.builds(Tagged, children, st.text("pq", max_size=1)),
    )


# Long flat sequences too: statics and arrays in every position.
trees = st.one_of(
    st.recursive(leaves, _extend, max_leaves=8),
    st.lists(leaves, max_size=40),
    st.lists(leaves, max_size=40).map(tuple),
)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def weigh(tree: Any, k: Any) -> Any:
    """Each numeric leaf weighted by its position in JAX's flattening; the other
    leaves, and the tree, handed back."""
    total = jnp.zeros((), jnp.float32)
    others = []
    for position, leaf in enumerate(jtu.tree_leaves(tree)):
        if _is_array(leaf):
            total = total + jnp.sum(jnp.asarray(leaf, jnp.float32)) * (position + 1)
        elif type(leaf) in (int, float, bool):
            total = total + float(leaf) * (position + 1)
        else:
            others.append(leaf)
    return total * k, others, tree


def changed(tree: Any) -> Any:
    """The tree with every static leaf changed (types kept)."""

    def change(leaf: Any) -> Any:
        if _is_array(leaf):
            return leaf
        if type(leaf) is bool:
            return not leaf
        if type(leaf) in (int, float):
            return leaf + 1
        return leaf + "c"

    return jtu.tree_map(change, tree)


# -------------------------------------------------------------------- checking


def _check(actual: Any, expected: Any, traced_arrays: bool) -> None:
    """Same structure; arrays equal (JAX arrays where traced), statics equal and
    of the same type. (XLA may fold `0.0 + x` to `x`: the sign of a zero sum is
    the compiler's.)"""
    assert_tree_equal(actual, expected, traced=traced_arrays, signed_zeros=False)


def _run_top(fun: Any, tree: Any) -> Any:
    return fun(tree, 2.0)


def _run_aot(fun: Any, tree: Any) -> Any:
    if hasattr(fun, "lower"):  # decorated
        return fun.lower(tree, 2.0).compile()(tree, 2.0)
    return fun(tree, 2.0)


def _run_jit(fun: Any, tree: Any) -> Any:
    seen: list[Any] = []

    def program() -> jax.Array:
        total, others, back = fun(tree, 2.0)
        seen.append((others, back))
        return total

    total = jax.jit(program)()
    (others, back), *_ = seen
    # Inside the trace, non-tracer leaves come back as the very objects passed in.
    for a, e in zip(jtu.tree_leaves(back), jtu.tree_leaves(tree)):
        assert a is e, (a, e)
    return total, others, jtu.tree_map(lambda x: x, back)


def _run_scan(fun: Any, tree: Any) -> Any:
    seen: list[Any] = []

    def body(carry: jax.Array, _: None) -> tuple[jax.Array, None]:
        total, others, back = fun(tree, carry)
        seen.append((others, back))
        return total, None

    total, _ = lax.scan(body, jnp.float32(2.0), None, length=2)
    (others, back), *_ = seen
    for a, e in zip(jtu.tree_leaves(back), jtu.tree_leaves(tree)):
        assert a is e, (a, e)
    return total, others, back


_CONTEXTS = {"top": _run_top, "jit": _run_jit, "scan": _run_scan, "aot": _run_aot}


@pytest.fixture(autouse=True)
def _no_retrace_warning():
    # One function, traced for every example's statics.
    filterjit.set_retrace_warning_threshold(None, module=__name__)
    yield
    filterjit.set_retrace_warning_threshold(10, module=__name__)


@pytest.mark.parametrize("context", list(_CONTEXTS))
@property_settings(compiled=True)
@given(tree=trees)
def test_agrees_with_the_undecorated_function(context: str, tree: Any) -> None:
    run = _CONTEXTS[context]
    decorated = filterjit.filter_jit(weigh)
    top = context in ("top", "aot")
    for call in (tree, changed(tree), tree):
        expected = run(weigh, call)
        actual = run(decorated, call)
        _check(actual, expected, traced_arrays=top)


def test_flattening_matches_jax_on_each_node_kind() -> None:
    """One example of each kind, checked against `jax.tree_util` directly."""
    a = jnp.float32(1.0)
    examples = [
        Swapped(a, 2.0),
        Registered(a, 1),
        Keyed([a, 2, "s"]),
        _partial([a, 3.0]),
        Tagged(a, "p"),
        [0.5] * 17 + [a, 2],
    ]
    for tree in examples:
        for run in _CONTEXTS.values():
            _check(
                run(filterjit.filter_jit(weigh), tree),
                run(weigh, tree),
                traced_arrays=run in (_run_top, _run_aot),
            )
