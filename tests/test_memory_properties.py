"""Property: no cache holds an array the caller passed, and what a key names (a
static value, a callable, a receiver, a Module's static field) is held until the
bounds on entries evict it, as `jax.jit` holds it; the wrappers the caller kept
live on.

Hypothesis draws a few calls, each of one kind of input at one level (the top
level, nested in a `jax.jit` made anew, under an eager `jax.grad`): an object
compared by identity passed as a static argument (handed back or not), a callable
object or a `jtu.Partial` of a bound method passed as a static argument, the
receiver of a decorated method, a callable object, a bound method, a
`jtu.Partial(obj.method)`, a `functools.partial` binding an array or a callable
Module holding an object in a static field wrapped directly, a Module whose
arrays are traced, and objects, arrays and bound methods inside a static value.
Each input is made in a function of its own and watched through `weakref.ref`:
after `gc.collect()` every traced array must be dead at once, and every other
input once the caches' bounds have evicted what they hold. Every test runs on
both paths. A concrete array used nested is a compile-time constant, pinned up to
`filterjit._dispatch.STAGED_MAXBYTES` bytes per function: that bound is asserted,
and an entry pinning more than it is kept for the trace that made it alone (its
arrays die with that trace).
"""

import dataclasses
import functools as ft
import gc
import weakref
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from differential import assert_tree_allclose
from helpers import (
    each_path,  # noqa: F401 - autouse: each test on both paths
    evict_everything,
    property_settings,
)
from hypothesis import example, given, strategies as st

import filterjit
from filterjit._dispatch import STAGED_MAXBYTES


# Examples per test in the full tier: each example compiles a dozen programs, and
# the full tier's 200 would take minutes per test (a soak keeps its own count).
FULL_EXAMPLES = 40


SETTINGS = property_settings(compiled=True, most=FULL_EXAMPLES, fixtures=True)

# Each example calls the kept wrappers with new objects: a retrace each time.
pytestmark = pytest.mark.filterwarnings("ignore::filterjit.RetraceWarning")


class Tag:
    """Compared by identity."""


class Scale:
    """A callable compared by identity, holding an array."""

    def __init__(self) -> None:
        self.table = np.arange(3.0, dtype=np.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * 2

    def method(self, x: jax.Array) -> jax.Array:
        return x * 2


@dataclasses.dataclass(frozen=True)
class Holder:
    """A static value compared by value, holding anything."""

    value: Any


class Model(eqx.Module):
    weight: jax.Array
    bias: np.ndarray


class Configured(eqx.Module):
    """A callable Module whose static field holds an object."""

    tag: Any = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * 2


def _static(x: jax.Array, tag: Any) -> jax.Array:
    return x * 2


def _returned(x: jax.Array, tag: Any) -> tuple[jax.Array, Any]:
    return x * 2, tag


def _apply(fun: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    return fun(x)


def _model(model: Model, x: jax.Array) -> jax.Array:
    return x * model.weight.sum() + model.bias.sum()


def _scaled(table: jax.Array, x: jax.Array) -> jax.Array:
    return x * table.sum()


def _receiver_method(self: Any, x: jax.Array) -> jax.Array:
    return x * 2


class Kept:
    """The wrappers a test keeps for all its examples, made in the test (so, on its
    path): functions of static arguments, of callables, of a Module, and a class
    with a decorated method."""

    def __init__(self) -> None:
        self.static = filterjit.filter_jit(_static)
        self.returned = filterjit.filter_jit(_returned)
        self.apply = filterjit.filter_jit(_apply)
        self.model = filterjit.filter_jit(_model)
        # A class made here (on this test's path), its method decorated.
        self.receiver_class: Any = type(
            "Receiver", (), {"method": filterjit.filter_jit(_receiver_method)}
        )


X = jnp.arange(2.0)

Call = Callable[[jax.Array], Any]


def _at(level: str, call: Call) -> Any:
    """`call(X)` at `level`, its first array output."""

    def first(x: jax.Array) -> jax.Array:
        out = call(x)
        return out[0] if isinstance(out, tuple) else out

    if level == "top":
        return first(X)
    if level == "nested":
        return jax.jit(lambda x: first(x))(X)
    return jax.grad(lambda x: first(x).sum())(X)  # an eager transform


def _use(kept: Kept, kind: str, level: str) -> list[weakref.ref[Any]]:
    """Makes an input of `kind`, calls a wrapper with it at `level` (checking the
    result), and returns weak references to what the caller then drops."""
    expected = jnp.full(2, 2.0) if level == "eager grad" else X * 2
    if kind == "module arrays":
        model = Model(jnp.ones(3), np.ones(2, np.float32))
        expected = jnp.full(2, 3.0) if level == "eager grad" else X * 3 + 2
        assert_tree_allclose(_at(level, lambda x: kept.model(model, x)), expected)
        return [weakref.ref(model.weight), weakref.ref(model.bias)]
    if kind == "static object":
        tag = Tag()
        call = lambda x: kept.static(x, tag)  # noqa: E731
    elif kind == "returned static object":
        tag = Tag()
        seen: list[Any] = []

        def call(x: jax.Array) -> Any:
            out = kept.returned(x, tag)
            seen.append(out[1])
            return out

        assert_tree_allclose(_at(level, call), expected)
        assert seen == [tag] and seen[0] is tag
        return [weakref.ref(tag)]
    elif kind == "object in a static dataclass":
        tag = Tag()
        call = lambda x: kept.static(x, Holder(tag))  # noqa: E731
    elif kind == "array in a static dataclass":
        tag = jnp.ones(2)
        call = lambda x: kept.static(x, Holder(tag))  # noqa: E731
    elif kind == "bound method in a static dataclass":
        tag = Scale()
        call = lambda x: kept.static(x, Holder(tag.method))  # noqa: E731
    elif kind == "callable argument":
        tag = Scale()
        call = lambda x: kept.apply(tag, x)  # noqa: E731
    elif kind == "jtu.Partial argument":
        tag = Scale()
        call = lambda x: kept.apply(jtu.Partial(tag.method), x)  # noqa: E731
    elif kind == "bound method argument":
        tag = Scale()
        call = lambda x: kept.apply(tag.method, x)  # noqa: E731
    elif kind == "method receiver":
        tag = kept.receiver_class()
        call = lambda x: tag.method(x)  # noqa: E731
    elif kind == "wrapped callable":
        tag = Scale()
        call = filterjit.filter_jit(tag)
    elif kind == "wrapped bound method":
        tag = Scale()
        call = filterjit.filter_jit(tag.method)
    elif kind == "wrapped Module holding an object":
        tag = Tag()
        call = filterjit.filter_jit(Configured(tag))
    elif kind == "wrapped partial of an array":
        tag = jnp.full(3, 2 / 3)
        call = filterjit.filter_jit(ft.partial(_scaled, tag))
    else:
        assert kind == "wrapped jtu.Partial of a method"
        tag = Scale()
        call = filterjit.filter_jit(jtu.Partial(tag.method))
    assert_tree_allclose(_at(level, call), expected)
    return [weakref.ref(tag)]


KINDS = [
    "static object",
    "returned static object",
    "callable argument",
    "method receiver",
    "wrapped callable",
    "wrapped bound method",
    "wrapped jtu.Partial of a method",
    "wrapped partial of an array",
    "wrapped Module holding an object",
    "module arrays",
    "object in a static dataclass",
    "array in a static dataclass",
    "bound method in a static dataclass",
    "jtu.Partial argument",
]
# Kinds drawn inside a staged trace alone (values a static argument holds).
STAGED_ONLY = {
    "object in a static dataclass",
    "array in a static dataclass",
    "bound method in a static dataclass",
    "jtu.Partial argument",
}
# Kinds whose arrays are constants nested, pinned up to the bound: the next tests.
PINNED_NESTED = {"module arrays", "wrapped partial of an array"}
# Kinds whose input is an array traced at the top level and under eager
# transforms: never held by a cache, dead as soon as the caller drops it.
TRACED_ARRAYS = {"module arrays", "wrapped partial of an array"}
LEVELS = ["top", "nested", "eager grad"]


def _alive(refs: list[weakref.ref[Any]]) -> list[Any]:
    gc.collect()
    return [type(ref()).__name__ for ref in refs if ref() is not None]


@SETTINGS
@given(
    steps=st.lists(
        st.tuples(st.sampled_from(KINDS), st.sampled_from(LEVELS)),
        min_size=1,
        max_size=4,
    )
)
# Each kind at a level where it is asserted dead, whatever the draws.
@example(steps=[(kind, "nested") for kind in KINDS if kind not in PINNED_NESTED])
@example(steps=[(kind, "top") for kind in KINDS if kind not in STAGED_ONLY])
@example(steps=[(kind, "eager grad") for kind in KINDS if kind not in STAGED_ONLY])
def test_nothing_the_caller_dropped_stays_alive(steps: list[tuple[str, str]]) -> None:
    kept = Kept()
    refs, arrays = [], []
    for kind, level in steps:
        if kind in PINNED_NESTED and level == "nested":
            continue  # constants, pinned up to the bound: the next tests
        if kind in STAGED_ONLY and level != "nested":
            continue
        used = _use(kept, kind, level)
        refs.extend(used)
        if kind in TRACED_ARRAYS:
            arrays.extend(used)
    assert _alive(arrays) == [], steps  # no cache holds an array
    evict_everything()
    assert _alive(refs) == [], steps  # what a key names: held until evicted
    # The wrappers live on, and still work.
    assert_tree_allclose(kept.static(X, Tag()), X * 2)


@SETTINGS
@given(
    sizes=st.lists(st.sampled_from([1, 2**10, 2**18, 2**20]), min_size=1, max_size=5),
    numpy=st.booleans(),
)
def test_arrays_used_nested_are_pinned_within_the_byte_bound(
    sizes: list[int], numpy: bool
) -> None:
    # Tables of up to 4 MiB (float32): some entries kept, their bytes bounded.
    wrapped = filterjit.filter_jit(lambda x, table: x + table.sum())
    for size in sizes:
        table = np.ones(size, np.float32) if numpy else jnp.ones(size)
        out = jax.jit(lambda x, table=table: wrapped(x, table))(jnp.float32(1))
        assert_tree_allclose(out, jnp.float32(1 + size))
        del table
        cache = wrapped._dispatcher.entries[2]
        assert cache._bytes <= STAGED_MAXBYTES
    assert_tree_allclose(
        wrapped(jnp.float32(1), np.ones(2, np.float32)), jnp.float32(3)
    )


def _over_the_bound(kind: str) -> tuple[Model, list[weakref.ref[Any]]]:
    """A Model whose concrete arrays pin just over `STAGED_MAXBYTES` bytes (float32),
    and weak references to what they pin."""
    size = STAGED_MAXBYTES // 4 + 1024
    small = np.ones(2, np.float32)
    if kind == "numpy view":
        base = np.ones(size, np.float32)
        return Model(jnp.ones(1), base[:2]), [weakref.ref(base)]  # the base counts
    if kind == "numpy":
        big = np.ones(size, np.float32)
        return Model(jnp.ones(1), big), [weakref.ref(big)]
    weight = jnp.ones(size)
    return Model(weight, small), [weakref.ref(weight)]


@pytest.mark.parametrize("kind", ["numpy", "jax", "numpy view"])
def test_a_nested_entry_pinning_more_than_the_bound_is_not_kept(kind: str) -> None:
    wrapped = filterjit.filter_jit(_model)
    model, refs = _over_the_bound(kind)
    expected = jnp.float32(float(model.weight.sum()) + float(model.bias.sum()))
    out = jax.jit(lambda x, model=model: wrapped(model, x))(jnp.float32(1))
    assert_tree_allclose(out, expected)
    assert wrapped._dispatcher.entries[2]._bytes <= STAGED_MAXBYTES
    del model
    assert _alive(refs) == []
    # The function still works, nested, with a small model.
    small = Model(jnp.ones(1), np.ones(2, np.float32))
    out = jax.jit(lambda x: wrapped(small, x))(jnp.float32(1))
    assert_tree_allclose(out, jnp.float32(3))


@pytest.mark.parametrize(
    "kind, level",
    [
        ("bound method argument", "nested"),
        ("bound method argument", "top"),
        ("jtu.Partial argument", "nested"),
        ("jtu.Partial argument", "top"),
    ],
)
def test_a_bound_method_passed_as_an_argument_holds_its_receiver_until_evicted(
    kind: str, level: str
) -> None:
    # A bound method: keyed by its function and its receiver's identity, as `==`
    # compares methods; a jtu.Partial of one, by its structure, which holds the
    # method. Held, as `jax.jit` holds a static argument, until evicted.
    kept = Kept()
    refs = _use(kept, kind, level)
    evict_everything()
    assert _alive(refs) == []
