"""Property tests: decorating a function changes nothing, whatever leaves and
whatever pytree nodes it is given, in each context (docs/contract.md). The reference
is the undecorated function, run in the same context.

Leaf kinds. Hypothesis generates pytrees mixing JAX arrays (weak-typed ones
included), NumPy arrays and scalars of several dtypes, Python scalars, strings,
`None`, functions, enums, nested dicts/lists/tuples and `eqx.Module`s with static
fields. An identity and an arithmetic function are run undecorated and decorated
with `filterjit.filter_jit`, and the results must agree:

- at the top level, array leaves come back as JAX arrays with the same values,
  shapes, dtypes and weak types, and every other leaf comes back as the same object
  (`is`) from the identity, and as an equal object of the same type from the
  arithmetic function;
- inside `jax.jit` and a `lax.scan` body, only tracers are traced: NumPy values,
  concrete JAX arrays and Python values reach the function unchanged, so the
  decorated identity hands back the very objects it was given and the decorated
  arithmetic function returns what the undecorated one returns (NumPy stays
  NumPy);
- under an un-jitted `jax.vmap` (an eager transform), concrete arrays are traced as
  at the top level, so array outputs are compared by value and dtype and statics
  by identity.

Every example uses a fresh wrapper, so that no wrapper is traced often enough to
emit a `RetraceWarning` (warnings are errors in this test suite). All dtypes exist
without x64, so tracing at the top level changes none of them.

Every kind of pytree node. filter_jit flattens calls with `jax.tree_util`, so it
must see every container exactly as JAX does: tuples, lists, dicts, `None`,
namedtuples, a namedtuple subclass registered with its children in another order,
dataclasses registered with `register_dataclass`, a class registered with
`register_pytree_with_keys`, `jtu.Partial`, and `eqx.Module`s with static fields;
long sequences (up to 40 leaves) with traced and static leaves mixed in every
position. Each example is run undecorated and decorated, at the top level, nested
in `jax.jit` and in a `lax.scan` body, and ahead of time
(`.lower(...).compile()`), then again with every static leaf changed, then as
first: the results must agree each time. The function weighs each numeric leaf by
its position in JAX's own flattening, so a leaf read from the wrong place changes
the result.

Examples, and the no-op matrix: test_leaf_kinds.py.
"""

import collections
import dataclasses
import enum
import math
from collections.abc import Callable, Hashable
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
from jax.core import Tracer

import filterjit


# ------------------------------------------------------------------- leaf kinds: leaves


class Colour(enum.Enum):
    RED = 1
    GREEN = 2


class Level(enum.IntEnum):
    LOW = 0
    HIGH = 1


def _square(x: Any) -> Any:
    return x * x


def _negate(x: Any) -> Any:
    return -x


_lambda = lambda x: x  # noqa: E731 - a lambda leaf, on purpose


class Box(eqx.Module):
    """A module with a dynamic field (any subtree) and a static field."""

    value: Any
    tag: Hashable = eqx.field(static=True)


DTYPES = [
    np.dtype(np.float32),
    np.dtype(np.float16),
    np.dtype(jnp.bfloat16),
    np.dtype(np.int32),
    np.dtype(np.uint8),
    np.dtype(np.bool_),
    np.dtype(np.complex64),
]

SHAPES: list[tuple[int, ...]] = [(), (1,), (2,), (3,), (0,)]

# Exactly representable in every floating dtype above, so that building an array
# does not round; and small, so that `x + x` neither overflows nor warns.
_FLOATS = [0.0, -0.0, 0.5, -1.5, 2.0, 2.5, math.inf, -math.inf, math.nan]
_SMALL_FLOATS = [0.0, -0.0, 0.5, -1.5, 2.0, 2.5]


def _elements(dtype: np.dtype[Any]) -> st.SearchStrategy[Any]:
    if dtype == np.bool_:
        return st.booleans()
    if dtype == np.uint8:
        return st.integers(0, 5)
    if dtype == np.int32:
        return st.integers(-5, 5)
    if dtype == np.complex64:
        small = st.sampled_from(_SMALL_FLOATS)
        return st.builds(complex, small, small)
    return st.sampled_from(_FLOATS)


@st.composite
def numpy_arrays(draw: st.DrawFn, shapes: list[tuple[int, ...]] = SHAPES) -> Any:
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.sampled_from(shapes))
    size = math.prod(shape)
    values = draw(st.lists(_elements(dtype), min_size=size, max_size=size))
    return np.array(values, dtype=dtype).reshape(shape)


# `array[()]` of a 0-d array is a NumPy scalar (`np.float32`, `ml_dtypes.bfloat16`).
numpy_scalars = numpy_arrays(shapes=[()]).map(lambda array: array[()])

jax_arrays = numpy_arrays().map(jnp.asarray)


@st.composite
def weak_jax_arrays(draw: st.DrawFn) -> jax.Array:
    # `jnp.asarray` of a Python scalar is weakly typed; broadcasting keeps it so.
    scalar = draw(
        st.one_of(
            st.sampled_from(_FLOATS),
            st.integers(-5, 5),
            st.builds(
                complex,
                st.sampled_from(_SMALL_FLOATS),
                st.sampled_from(_SMALL_FLOATS),
            ),
        )
    )
    shape = draw(st.sampled_from(SHAPES))
    array = jnp.broadcast_to(jnp.asarray(scalar), shape)
    assert jax.typeof(array).weak_type
    return array


functions = st.sampled_from([_square, _negate, _lambda, abs, len, jnp.sin])

python_scalars = st.one_of(
    st.booleans(),
    st.integers(),
    st.floats(),  # nan, inf and -0.0 included
    st.complex_numbers(allow_nan=False, allow_infinity=False, max_magnitude=1e6),
)

# Hashable and equal to themselves (no floats: nan != nan would make a tree
# structure unequal to itself), for eqx static fields.
tags = st.recursive(
    st.one_of(
        st.none(),
        st.integers(-3, 3),
        st.text("xyz", max_size=2),
        st.sampled_from(Colour),
        st.sampled_from(Level),
        functions,
    ),
    lambda children: st.tuples(children, children),
    max_leaves=3,
)

leaves = st.one_of(
    jax_arrays,
    weak_jax_arrays(),
    numpy_arrays(),
    numpy_scalars,
    python_scalars,
    st.text(max_size=4),
    st.none(),  # an empty pytree node, not a leaf
    functions,
    st.sampled_from(Colour),
    st.sampled_from(Level),
)


def _extend(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text("abc", max_size=2), children, max_size=3),
        st.builds(Box, children, tags),
    )


# A single recursive draw is most often a leaf or two; a list of them makes
# wider trees.
subtrees = st.recursive(leaves, _extend, max_leaves=6)
trees = st.one_of(subtrees, st.lists(subtrees, min_size=2, max_size=4))


# ---------------------------------------------------------------- leaf kinds: functions


def identity(tree: Any) -> Any:
    return tree


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def _double(leaf: Any) -> Any:
    # Same-dtype arithmetic only (strict promotion); `+` on bools is logical or in
    # NumPy and JAX alike.
    if _is_array(leaf):
        return leaf + leaf
    if type(leaf) is bool:
        return not leaf
    if type(leaf) in (int, float, complex):
        return leaf * 2
    if type(leaf) is str:
        return leaf + leaf
    return leaf


def arithmetic(tree: Any) -> Any:
    return jtu.tree_map(_double, tree)


FUNCTIONS = [identity, arithmetic]


# ----------------------------------------------------------------- leaf kinds: checking


def _is_tracer(leaf: Any) -> bool:
    return isinstance(leaf, Tracer)


def assert_arrays_agree(actual: Any, expected: Any) -> None:
    """Trees of arrays: same structure, and every leaf of the same kind, shape,
    dtype, weak type and values (nan equal to nan, -0.0 not equal to 0.0)."""
    assert_tree_equal(actual, expected)


def assert_statics_agree(actual: Any, expected: Any, identical: bool) -> None:
    """Trees of values that were not traced: same structure, and every leaf the same
    object when `identical`, else of the same type and equal (NumPy values stay
    NumPy, with equal dtypes and values)."""
    assert_tree_equal(actual, expected, identical=identical)


def _fresh(leaf: Any) -> Any:
    """An equal leaf, a new object where Python allows one. A call with it hits the
    cache of a call with `leaf`, and must still get its own objects back."""
    if type(leaf) is float:
        return float.fromhex(leaf.hex())
    if type(leaf) is complex:
        return complex(leaf.real, leaf.imag)
    if type(leaf) is int:
        return int(str(leaf))
    if type(leaf) is str:
        return "".join(list(leaf))
    if isinstance(leaf, jax.Array | np.ndarray | np.generic):
        return leaf.copy()  # keeps dtype and weak type
    return leaf


def _confusable(leaf: Any) -> Any:
    """A leaf equal to `leaf` (or with the same bytes) that must be keyed apart
    from it: `True`/`1`/`1.0`, `0.0`/`-0.0`, `Level.HIGH`/`1`, a float32 NumPy
    array and its int32 view."""
    if type(leaf) is bool or isinstance(leaf, enum.IntEnum):
        return int(leaf)
    if type(leaf) is int:
        return float(leaf) if abs(leaf) < 2**53 else leaf
    if type(leaf) is float:
        if leaf == 0:
            return -leaf
        return int(leaf) if leaf.is_integer() else leaf
    if type(leaf) is complex and leaf.imag == 0:
        return leaf.real
    if isinstance(leaf, np.ndarray) and leaf.dtype == np.float32:
        # Arrays only: `x + x` may overflow int32, which NumPy scalars warn about.
        return leaf.view(np.int32)
    return leaf


def _variants(tree: Any) -> list[Any]:
    """`tree`, an equal tree of new objects, and a tree of confusable leaves: the
    function is called on each in turn, with one wrapper."""
    return [tree, jtu.tree_map(_fresh, tree), jtu.tree_map(_confusable, tree)]


def _split(tree: Any, traced: list[bool]) -> tuple[Any, Any]:
    """The JAX arrays of `tree` that `traced` selects, to be passed into a trace,
    and everything else, to be closed over."""
    flat, treedef = jtu.tree_flatten(tree)
    spec = jtu.tree_unflatten(
        treedef,
        [isinstance(leaf, jax.Array) and t for leaf, t in zip(flat, traced)],
    )
    return eqx.partition(tree, spec)


def _draw_traced(data: st.DataObject, tree: Any) -> list[bool]:
    # Each JAX array is traced or closed over (a concrete array inside the trace).
    count = len(jtu.tree_leaves(tree))
    return data.draw(st.lists(st.booleans(), min_size=count, max_size=count))


# ---------------------------------------------------------------- leaf kinds: top level


@pytest.mark.parametrize("fun", FUNCTIONS)
@property_settings(compiled=True)
@given(tree=trees)
def test_top_level(fun: Callable[[Any], Any], tree: Any) -> None:
    decorated = filterjit.filter_jit(fun)
    for variant in _variants(tree):
        expected = fun(variant)
        actual = decorated(variant)
        _check_top_level(actual, expected, fun is identity)


def _check_top_level(actual: Any, expected: Any, identical: bool) -> None:
    # Arrays traced: back as JAX arrays, like jax.jit returns them.
    assert_tree_equal(actual, expected, traced=True, identical=identical)


# ----------------------------------------------------------- leaf kinds: inside jax.jit

# In each context the function is called on each of `_variants` of the closed-over
# part, in one trace, with one wrapper.


def _run_in_jit(fun: Callable[[Any], Any], traced: Any, closed: list[Any]) -> Any:
    statics: list[Any] = []

    def outer(traced: Any) -> Any:
        outs_traced = []
        for c in closed:
            out = fun(eqx.combine(traced, c))
            out_traced, out_static = eqx.partition(out, _is_tracer)
            outs_traced.append(out_traced)
            statics.append(out_static)
        return outs_traced

    outs_traced = jax.jit(outer)(traced)
    return outs_traced, statics


@pytest.mark.parametrize("fun", FUNCTIONS)
@property_settings(0.75, compiled=True)
@given(tree=trees, data=st.data())
def test_inside_jit(fun: Callable[[Any], Any], tree: Any, data: st.DataObject) -> None:
    traced, closed = _split(tree, _draw_traced(data, tree))
    closed = _variants(closed)
    expected_traced, expected_static = _run_in_jit(fun, traced, closed)
    actual_traced, actual_static = _run_in_jit(
        filterjit.filter_jit(fun), traced, closed
    )
    assert_arrays_agree(actual_traced, expected_traced)
    assert_statics_agree(actual_static, expected_static, fun is identity)


# --------------------------------------------------- leaf kinds: inside a lax.scan body


def _run_in_scan(
    fun: Callable[[Any], Any], traced: Any, closed: list[Any], carry_through: bool
) -> Any:
    statics: list[Any] = []

    def body(carry: Any, _: None) -> tuple[Any, Any]:
        outs_traced = []
        statics.clear()  # keep the last trace of the body only
        for c in closed:
            out = fun(eqx.combine(carry, c))
            out_traced, out_static = eqx.partition(out, _is_tracer)
            outs_traced.append(out_traced)
            statics.append(out_static)
        # The identity's traced output is the carry, structure and types alike;
        # the arithmetic function's leaves the scan as `ys`.
        return (outs_traced[-1] if carry_through else carry), outs_traced

    carry, ys = lax.scan(body, traced, length=2)
    return carry, ys, statics


@pytest.mark.parametrize("fun", FUNCTIONS)
@property_settings(0.75, compiled=True)
@given(tree=trees, data=st.data())
def test_inside_scan(fun: Callable[[Any], Any], tree: Any, data: st.DataObject) -> None:
    traced, closed = _split(tree, _draw_traced(data, tree))
    closed = _variants(closed)
    expected_carry, expected_ys, expected_static = _run_in_scan(
        fun, traced, closed, fun is identity
    )
    actual_carry, actual_ys, actual_static = _run_in_scan(
        filterjit.filter_jit(fun), traced, closed, fun is identity
    )
    assert_arrays_agree(actual_carry, expected_carry)
    assert_arrays_agree(actual_ys, expected_ys)
    assert_statics_agree(actual_static, expected_static, fun is identity)


# ---------------------------------------------------------- leaf kinds: inside jax.vmap


_BATCH = 2


def _batch(x: jax.Array) -> jax.Array:
    # Two different entries; `zeros_like` keeps the weak type.
    return jnp.stack([x, jnp.zeros_like(x)])


def _run_in_vmap(
    fun: Callable[[Any], Any], traced: Any, closed: list[Any], decorated: bool
) -> Any:
    statics: list[Any] = []

    def body(traced: Any, index: jax.Array) -> Any:
        del index
        outs_arrays = []
        for c in closed:
            out = fun(eqx.combine(traced, c))
            out_arrays, out_static = eqx.partition(out, _is_array)
            if decorated:
                # An eager transform: NumPy values and concrete JAX arrays are
                # traced, so every array comes back as a JAX array.
                for leaf in jtu.tree_leaves(out_arrays):
                    assert isinstance(leaf, jax.Array), leaf
            outs_arrays.append(out_arrays)
            statics.append(out_static)
        return outs_arrays

    # The batch index makes sure vmap has something to map over.
    batched = jtu.tree_map(_batch, traced)
    outs_arrays = jax.vmap(body)(batched, jnp.arange(_BATCH))
    return outs_arrays, statics


@pytest.mark.parametrize("fun", FUNCTIONS)
@property_settings(0.75, compiled=True)
@given(tree=trees, data=st.data())
def test_inside_vmap(fun: Callable[[Any], Any], tree: Any, data: st.DataObject) -> None:
    traced, closed = _split(tree, _draw_traced(data, tree))
    closed = _variants(closed)
    expected_arrays, expected_static = _run_in_vmap(fun, traced, closed, False)
    actual_arrays, actual_static = _run_in_vmap(
        filterjit.filter_jit(fun), traced, closed, True
    )
    assert_arrays_agree(actual_arrays, expected_arrays)
    assert_statics_agree(actual_static, expected_static, fun is identity)


# ------------------------------------------------ every kind of pytree node: node kinds

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


# ---------------------------------------------------- every kind of pytree node: leaves

# Multiples of 1/8 (and -0.0): every weighted sum below is exact in float32, so
# the results agree whatever order XLA sums in, and any misplaced leaf shows.
_floats = st.one_of(st.integers(-32, 32).map(lambda i: i / 8), st.just(-0.0))
node_leaves = st.one_of(
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


def _extend_nodes(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
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
node_trees = st.one_of(
    st.recursive(node_leaves, _extend_nodes, max_leaves=8),
    st.lists(node_leaves, max_size=40),
    st.lists(node_leaves, max_size=40).map(tuple),
)


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


# -------------------------------------------------- every kind of pytree node: checking


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


@pytest.fixture
def _no_retrace_warning():
    # One function, traced for every example's statics.
    filterjit.set_retrace_warning_threshold(None, module=__name__)
    yield
    filterjit.set_retrace_warning_threshold(10, module=__name__)


@pytest.mark.usefixtures("_no_retrace_warning")
@pytest.mark.parametrize("context", list(_CONTEXTS))
@property_settings(compiled=True)
@given(tree=node_trees)
def test_trees_of_every_node_kind_agree_with_the_undecorated_function(
    context: str, tree: Any
) -> None:
    run = _CONTEXTS[context]
    decorated = filterjit.filter_jit(weigh)
    top = context in ("top", "aot")
    for call in (tree, changed(tree), tree):
        expected = run(weigh, call)
        actual = run(decorated, call)
        _check(actual, expected, traced_arrays=top)


@pytest.mark.usefixtures("_no_retrace_warning")
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
