"""Values equal by `==` that exact keys must tell apart, values keyed by `==` alike
at every level (as `jax.jit` keys a static argument), caches that hold what a key
names until their bound on entries evicts it, and keys that must stay cheap.

Every test fails on both paths (`FILTERJIT_FASTPATH=0` too). References: nested,
the undecorated function under the same outer `jax.jit`; at the top level,
`jax.jit` with the static values as static arguments (or the module's own
documented intent where the two differ, said in the test)."""

import dataclasses
import decimal
import functools as ft
import gc
import math
import time
import weakref
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from differential import assert_tree_allclose
from helpers import evict_with_bound

from filterjit import _fastpath, filter_jit
from filterjit._level import STAGED


X = jnp.ones(3, jnp.float32)


def nested(fun: Any, *args: Any) -> Any:
    """`fun(X, *args)` inside an outer `jax.jit`, its first output as a float."""
    out = jax.jit(lambda x: fun(x, *args))(X)
    return float(out[0])


# --- 1. Keys that do not prove sameness ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Labelled:
    name: str
    mode: str = dataclasses.field(compare=False)


def _by_mode(x: Any, cfg: Labelled) -> Any:
    return x * (2.0 if cfg.mode == "double" else 3.0)


def test_compare_false_field_of_plain_values_is_keyed_nested() -> None:
    g = filter_jit(_by_mode)
    first = nested(g, Labelled("a", "double"))
    second = nested(g, Labelled("a", "triple"))
    assert (first, second) == (
        nested(_by_mode, Labelled("a", "double")),
        nested(_by_mode, Labelled("a", "triple")),
    )
    assert second == 3.0


@dataclasses.dataclass(frozen=True)
class Counted:
    name: str
    times: int = dataclasses.field(compare=False)


def test_compare_false_field_keyed_alike_whatever_its_type_top() -> None:
    # With an int field the key sees it (the documented intent of `_fields_key`):
    h = filter_jit(lambda x, c: x * float(c.times))
    assert float(h(X, Counted("a", 2))[0]) == 2.0
    assert float(h(X, Counted("a", 3))[0]) == 3.0
    # With str fields alone it does not.
    g = filter_jit(_by_mode)
    assert float(g(X, Labelled("a", "double"))[0]) == 2.0
    assert float(g(X, Labelled("a", "triple"))[0]) == 3.0


def _reciprocal_sign(x: Any, d: Any) -> Any:
    return x * float(np.copysign(1.0, float(d)))


def _as_jax_jit(fun: Any, *values: Any) -> list[float]:
    """`fun(X, value)` for each value in turn under `jax.jit` with the value a
    static argument: the rule for a type with an `__eq__` of its own."""
    jitted = jax.jit(fun, static_argnums=1)
    return [float(jitted(X, value)[0]) for value in values]


def test_decimal_is_keyed_by_eq_at_every_level() -> None:
    # A type with its own `==` is keyed by it, nested as at the top level, as
    # `jax.jit` keys a static argument: `Decimal("-0")` finds `Decimal("0")`'s trace.
    values = decimal.Decimal("0"), decimal.Decimal("-0")
    g = filter_jit(_reciprocal_sign)
    assert [nested(g, v) for v in values] == _as_jax_jit(_reciprocal_sign, *values)


NAN = float("nan")


def _sign(x: Any, v: Any) -> Any:
    return x * math.copysign(1.0, v)


@pytest.mark.parametrize("level", ["top", "nested", "aot"])
def test_nan_sign_keyed(level: str) -> None:
    g = filter_jit(_sign)
    if level == "aot":
        compiled = g.lower(X, NAN).compile()
        assert float(compiled(X, NAN)[0]) == 1.0
        with pytest.raises(ValueError):
            compiled(X, -NAN)  # as it refuses -0.0 after 0.0
        return
    if level == "top":
        first, second = float(g(X, NAN)[0]), float(g(X, -NAN)[0])
        reference = float(jax.jit(_sign, static_argnums=1)(X, -NAN)[0])
    else:
        first, second = nested(g, NAN), nested(g, -NAN)
        reference = nested(_sign, -NAN)
    assert first == 1.0
    assert second == reference == -1.0


class Metres(float):
    """A float that carries a unit in its `__dict__`."""


class Count(int):
    """An int that carries a unit in its `__dict__`."""


def _by_unit(x: Any, value: Any) -> Any:
    return x * (100.0 if value.unit == "cm" else 1.0)


@pytest.mark.parametrize("kind", [Metres, Count])
def test_number_subclass_is_keyed_by_eq_at_every_level(kind: type) -> None:
    m, cm = kind(1), kind(1)
    m.unit, cm.unit = "m", "cm"
    g = filter_jit(_by_unit)
    assert [nested(g, m), nested(g, cm)] == _as_jax_jit(_by_unit, m, cm)


class Agreeable(tuple):
    """A tuple subclass (a leaf to JAX) whose `==` says yes to everything."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 0


def _first_length(x: Any, t: Any) -> Any:
    return x * float(len(t[0]))


def test_lying_tuple_subclass_is_keyed_by_eq_at_every_level() -> None:
    values = Agreeable(("a",)), Agreeable(("abc",))
    g = filter_jit(_first_length)
    assert [nested(g, v) for v in values] == _as_jax_jit(_first_length, *values)


class Signed:
    def __init__(self, sign: float, child: Any):
        self.sign, self.child = sign, child


jtu.register_pytree_node(
    Signed, lambda n: ((n.child,), n.sign), lambda sign, c: Signed(sign, c[0])
)


def _by_treedef(x: Any, treedef: Any) -> Any:
    node = jtu.tree_unflatten(treedef, [0])
    return x * float(np.copysign(1.0, node.sign))


def test_static_treedef_signed_zero_aux_nested() -> None:
    plus = jtu.tree_structure(Signed(0.0, 1))
    minus = jtu.tree_structure(Signed(-0.0, 1))
    g = filter_jit(_by_treedef)
    assert nested(g, plus) == 1.0
    assert nested(g, minus) == nested(_by_treedef, minus) == -1.0


# --- 2. Caches hold what a key names until their bound evicts it -----------------


class Payload:
    pass


@dataclasses.dataclass(frozen=True)
class Holder:
    value: Any


def _plus_one(x: Any, holder: Any) -> Any:
    return x + 1


def test_frozen_dataclass_field_object_held_until_evicted_nested() -> None:
    g = filter_jit(_plus_one)
    payload = Payload()
    ref = weakref.ref(payload)
    nested(g, Holder(payload))
    del payload
    gc.collect()
    assert ref() is not None  # its key names it: held, as jax.jit holds it
    evict_with_bound(g)
    nested(g, Holder(Payload()))
    gc.collect()
    assert ref() is None


def test_objects_inside_a_static_value_are_keyed_by_identity_nested() -> None:
    # A frozen dataclass made anew on each call, holding the same object: one
    # trace; another object: a trace of its own, held until evicted.
    runs = []

    def f(x: Any, holder: Any) -> Any:
        runs.append(holder.value)
        return x + 1

    g = filter_jit(f)
    dispatcher: Any = g._dispatcher  # pyright: ignore[reportAttributeAccessIssue]
    caches = {id(cache): cache for cache in dispatcher.entries}.values()
    payload = Payload()
    for _ in range(3):
        assert nested(g, Holder(payload)) == 2.0
    assert len(runs) == 1 and runs[0] is payload
    other = Payload()
    assert nested(g, Holder(other)) == 2.0
    assert len(runs) == 2 and runs[1] is other
    assert sum(map(len, caches)) == 2
    nested(g, Holder(payload))
    assert len(runs) == 2


class Receiver:
    """A callable object with a method: data, whose bound method a call may be
    given."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, x: Any) -> Any:
        return x * self.scale

    def method(self, x: Any) -> Any:
        return x * self.scale


def test_a_bound_method_inside_a_static_value_is_keyed_by_its_receiver_nested() -> None:
    # Its receiver compared by identity, whatever its type: the same receiver, one
    # trace; another, a trace of its own; held until evicted.
    runs = []

    def f(x: Any, holder: Any) -> Any:
        runs.append(None)
        return holder.value(x)

    g = filter_jit(f)
    receiver = Receiver(2.0)
    for _ in range(3):
        assert nested(g, Holder(receiver.method)) == 2.0
    assert len(runs) == 1
    assert nested(g, Holder(Receiver(3.0).method)) == 3.0
    assert len(runs) == 2
    ref = weakref.ref(receiver)
    del receiver
    evict_with_bound(g)
    assert nested(g, Holder(Receiver(4.0).method)) == 4.0
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize(
    "make, held",
    [
        (lambda r: jtu.Partial(r.method), lambda: Receiver(2.0)),
        (lambda r: Settings(r), Payload),
    ],
    ids=["a jtu.Partial of a method", "a Module holding an object"],
)
def test_a_structure_holding_an_object_traces_once_nested(make: Any, held: Any) -> None:
    # Its auxiliary data holds the object, keyed by identity: the calls of every
    # outer trace share one trace (as Equinox's), held until evicted.
    runs = []

    def f(fun: Any, x: Any) -> Any:
        runs.append(None)
        return fun(x) if isinstance(fun, jtu.Partial) else x * 2

    def twice(fun: Any, obj: Any) -> Any:
        return jax.jit(lambda x: fun(make(obj), x) + fun(make(obj), x))(X)

    receiver = held()
    expected = twice(f, receiver)
    assert len(runs) == 2
    g = filter_jit(f)
    assert_tree_allclose(twice(g, receiver), expected)
    assert_tree_allclose(twice(g, receiver), expected)
    assert len(runs) == 3
    ref = weakref.ref(receiver)
    del receiver
    evict_with_bound(g)
    twice(g, held())
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize(
    "make", [lambda f: f, Holder], ids=["a function", "a dataclass holding one"]
)
def test_a_static_keyed_weakly_nested_then_at_the_top_level(make: Any) -> None:
    # Nested first, then at the top level with arrays of another shape, which
    # traces again: a function is keyed alike at both levels (the entry the nested
    # call made is found, and traces with the leaves it keeps); a dataclass holding
    # one is not (the top level makes an entry of its own).
    def apply(x: Any, fun: Any) -> Any:
        return (fun if callable(fun) else fun.value)(x)

    g = filter_jit(apply)
    static = make(jnp.sin)
    assert_tree_allclose(jax.jit(lambda x: g(x, static))(X), jnp.sin(X))
    wide = jnp.arange(5.0)
    assert_tree_allclose(g(wide, static), jnp.sin(wide))
    assert_tree_allclose(g(X, static), jnp.sin(X))


def test_frozen_dataclass_field_array_held_until_evicted_nested() -> None:
    # Keyed by its value; a constant of the nested trace, which holds it until
    # its entry is evicted.
    g = filter_jit(_plus_one)
    array = jnp.arange(1000.0)
    ref = weakref.ref(array)
    nested(g, Holder(array))
    del array
    evict_with_bound(g)
    nested(g, Holder(jnp.zeros(3)))
    gc.collect()
    assert ref() is None


def test_frozen_dataclass_holding_an_array_nested_traces_once_by_its_value() -> None:
    # Keyed by the array's value: the calls of a program share a trace, and an
    # array of other values gets a trace of its own.
    runs = []

    def f(x: Any, holder: Any) -> Any:
        runs.append(None)
        return x * holder.value

    g = filter_jit(f)
    holder = Holder(jnp.arange(3.0))

    def outer(h: Any) -> Any:
        return lambda x: h(x, holder) + h(x, holder)

    expected = jax.jit(outer(f))(X)
    assert len(runs) == 2
    assert_tree_allclose(jax.jit(outer(g))(X), expected)
    assert len(runs) == 3
    assert_tree_allclose(jax.jit(lambda x: g(x, Holder(jnp.ones(3))))(X), X)
    assert len(runs) == 4


class Settings(eqx.Module):
    """A callable Module whose static field is any object."""

    extra: Any = eqx.field(static=True)

    def __call__(self, x: Any) -> Any:
        return x + 1


def _called_at(level: str, fun: Any) -> Any:
    """`fun(X)` at the top level, or nested in a `jax.jit` made anew."""
    return fun(X) if level == "top" else jax.jit(lambda x: fun(x))(X)


@pytest.mark.parametrize("level", ["top", "nested"])
def test_module_static_field_held_until_evicted(level: str) -> None:
    # A callable Module's class owns its caches, and each call keys its static
    # fields as it keys static arguments: held until the bound on entries evicts
    # them, one Module per wrapper made anew each time.
    payload = Payload()
    ref = weakref.ref(payload)
    wrapper = filter_jit(Settings(payload))
    assert_tree_allclose(_called_at(level, wrapper), X + 1)
    del payload
    gc.collect()
    assert ref() is not None
    evict_with_bound(wrapper)
    assert_tree_allclose(_called_at(level, filter_jit(Settings(Payload()))), X + 1)
    del wrapper
    gc.collect()
    assert ref() is None


def test_module_instances_share_their_class_caches() -> None:
    # Wrappers of Modules made anew find one dispatcher, whatever their static
    # fields hold; a Module wrapping a function (`eqx.filter_vmap`) one per function.
    assert filter_jit(Settings(1))._dispatcher is filter_jit(Settings("a"))._dispatcher

    def g(x: Any) -> Any:
        return x * 2

    vmapped = filter_jit(eqx.filter_vmap(g))._dispatcher
    assert filter_jit(eqx.filter_vmap(g))._dispatcher is vmapped
    assert filter_jit(eqx.filter_vmap(_plus_one))._dispatcher is not vmapped


ACTIVATED_TRACES: list[None] = []


class Activated(eqx.Module):
    """A callable Module whose static field is code or a value."""

    activation: Any = eqx.field(static=True)
    weight: jax.Array

    def __call__(self, x: Any) -> Any:
        ACTIVATED_TRACES.append(None)
        return self.activation(x * self.weight)


@pytest.mark.parametrize(
    "activation",
    [jnp.sin, jax.nn.relu, ft.partial(jnp.clip, max=0.5)],
    ids=["jnp.sin", "jax.nn.relu", "a partial of jnp.clip"],
)
def test_modules_made_anew_share_a_trace_where_static_fields_hold_no_data(
    activation: Any,
) -> None:
    # Modules made anew (a model per step) are one program, traced once.
    ACTIVATED_TRACES.clear()
    for _ in range(3):
        module = Activated(activation, jnp.ones(3))
        assert_tree_allclose(filter_jit(module)(X), activation(X))
    assert len(ACTIVATED_TRACES) == 1


class _Tag:
    """A tag, compared by identity, whose instances are globals of this module."""


SYMMETRIC = _Tag()


class Tagged(eqx.Module):
    """An operator-like Module whose static field holds global tags (as Lineax's
    operators do)."""

    matrix: jax.Array
    tags: frozenset[Any] = eqx.field(static=True)

    def __call__(self, x: Any) -> Any:
        TAGGED_TRACES.append(None)
        return self.matrix @ x


TAGGED_TRACES: list[None] = []


def test_structures_holding_global_tags_share_a_trace() -> None:
    # A global of its class's module lives as long as the module: a key holding it
    # pins nothing. Nested, the structure is recorded (one trace for calls with
    # operators made anew, in outer traces made anew); a callable one made anew
    # shares its class's caches.
    runs = []

    def apply(operator: Any, x: Any) -> Any:
        runs.append(None)
        return operator(x)

    g = filter_jit(apply)
    for _ in range(3):
        operator = Tagged(jnp.eye(3), frozenset({SYMMETRIC}))
        assert_tree_allclose(jax.jit(lambda o, x: g(o, x))(operator, X), X)
    assert len(runs) == 1
    TAGGED_TRACES.clear()
    for _ in range(3):
        assert_tree_allclose(
            filter_jit(Tagged(jnp.eye(3), frozenset({SYMMETRIC})))(X), X
        )
    assert len(TAGGED_TRACES) == 1


def test_a_lineax_operator_nested_shares_a_trace() -> None:
    lineax = pytest.importorskip("lineax")
    runs = []

    def mv(operator: Any, x: Any) -> Any:
        runs.append(None)
        return operator.mv(x)

    g = filter_jit(mv)
    for _ in range(3):
        operator = lineax.MatrixLinearOperator(jnp.eye(3), lineax.symmetric_tag)
        assert_tree_allclose(jax.jit(lambda o, x: g(o, x))(operator, X), X)
    assert len(runs) == 1


def _take_holder(holder: Any, x: Any) -> Any:
    return x + 1


def test_partial_over_frozen_dataclass_held_until_evicted_top() -> None:
    payload = Payload()
    ref = weakref.ref(payload)
    g = filter_jit(ft.partial(_take_holder, Holder(payload)))
    g(X)
    del payload
    gc.collect()
    assert ref() is not None
    evict_with_bound(g)
    del g
    filter_jit(ft.partial(_take_holder, Holder(Payload())))(X)
    gc.collect()
    assert ref() is None


def test_partials_over_a_frozen_dataclass_share_their_functions_caches() -> None:
    # Wrappers made anew: partials binding equal values share their function's
    # caches; one holding the same object by identity too.
    runs = []

    def take(holder: Any, x: Any) -> Any:
        runs.append(None)
        return x * 2

    for _ in range(3):
        assert_tree_allclose(filter_jit(ft.partial(take, Holder(2.0)))(X), X * 2)
    assert len(runs) == 1
    payload = Payload()
    for _ in range(2):
        assert_tree_allclose(filter_jit(ft.partial(take, Holder(payload)))(X), X * 2)
    assert len(runs) == 2


class Unreferenceable:
    """Compared by identity, and no weak reference to it can be taken."""

    __slots__ = ("payload",)

    def __init__(self, payload: Any):
        self.payload = payload


class UnreferenceableByValue(Unreferenceable):
    """Compared by value with an `__eq__` that cannot be seen through, and no weak
    reference to it can be taken."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.payload is self.payload

    def __hash__(self) -> int:
        return id(self.payload)


@pytest.mark.parametrize(
    "make",
    [
        Unreferenceable,
        UnreferenceableByValue,
        lambda payload: Holder(Unreferenceable(payload)),
        lambda payload: Holder(UnreferenceableByValue(payload)),
    ],
    ids=["identity", "by value", "identity in a dataclass", "by value in a dataclass"],
)
def test_unweakrefable_static_held_until_evicted_nested(make: Any) -> None:
    g = filter_jit(_plus_one)
    payload = Payload()
    ref = weakref.ref(payload)
    nested(g, make(payload))
    del payload
    gc.collect()
    assert ref() is not None
    evict_with_bound(g)
    nested(g, make(Payload()))
    gc.collect()
    assert ref() is None


def test_unweakrefable_static_nested_traces_once() -> None:
    runs = []

    def f(x: Any, holder: Any) -> Any:
        runs.append(holder)
        return x * len(holder.payload), holder

    g = filter_jit(f)
    holder = Unreferenceable([1, 2, 3])

    def outer(h: Any) -> Any:
        return lambda x: h(x, holder)[0] + h(x, holder)[0]

    assert_tree_allclose(jax.jit(outer(g))(X), jax.jit(outer(f))(X))
    assert len(runs) == 3  # twice undecorated, once decorated
    same = []
    jax.make_jaxpr(lambda x: same.append(g(x, holder)[1] is holder))(X)
    assert same == [True]


# --- 3. Slowdowns ----------------------------------------------------------------


def _shared_dag(depth: int) -> list[Any]:
    node: list[Any] = [0.5]
    for _ in range(depth):
        node = [node, node]  # one object twice: 2**depth paths, depth+1 objects
    return node


def test_shared_substructure_keyed_in_linear_time_nested() -> None:
    holder = Holder(_shared_dag(15))
    g = filter_jit(_plus_one)
    start = time.perf_counter()
    nested(g, holder)
    took = time.perf_counter() - start
    start = time.perf_counter()
    nested(_plus_one, holder)
    reference = time.perf_counter() - start
    assert took < 0.1 + 5 * reference


def test_identical_nested_calls_with_large_array_trace_once_and_free_it() -> None:
    # An entry over the byte bound is kept for the trace it was made in alone: the
    # calls in that trace share it, and the array is freed once the trace ends.
    from filterjit import _dispatch

    runs = []

    def f(x: Any, w: Any) -> Any:
        runs.append(None)
        return x + float(w[0])

    g = filter_jit(f)
    box = [np.ones(_dispatch.STAGED_MAXBYTES // 8 + 16)]
    freed = weakref.ref(box[0])

    def outer(x: Any, h: Any = g) -> Any:
        for _ in range(10):
            x = h(x, box[0])
        return x

    expected = jax.jit(ft.partial(outer, h=f))(X)  # undecorated
    runs.clear()
    assert_tree_allclose(jax.jit(outer)(X), expected)
    assert len(runs) == 1
    jax.make_jaxpr(lambda x: outer(x))(X)  # a trace of its own: traced once more
    assert len(runs) == 2
    box.clear()
    gc.collect()
    assert freed() is None
    assert len(g._dispatcher.entries[STAGED]) == 0  # pyright: ignore[reportAttributeAccessIssue]


class ByValue:
    """A static setting compared by value (its own `__eq__` and `__hash__`)."""

    def __init__(self, n: int):
        self.n = n

    def __eq__(self, other: object) -> bool:
        return type(other) is ByValue and other.n == self.n

    def __hash__(self) -> int:
        return hash(self.n)


class Scaled(eqx.Module):
    w: jax.Array
    setting: Any = eqx.field(static=True)

    def __call__(self, x: Any) -> Any:
        return x * self.w


@pytest.mark.skipif(
    not _fastpath.ENABLED, reason="the fast path's own (FILTERJIT_FASTPATH=0)"
)
def test_module_with_value_compared_static_field_dispatch_top(monkeypatch) -> None:
    # Top level, a Module rebuilt per call whose static field is an equal new
    # object of a type with its own `__eq__`: keyed by `==` at the top level, as
    # jax.jit keys it, so the hit reads it (the reference path was ~10x the
    # dispatch of a float static field).
    w = jnp.ones(3)
    g = filter_jit(lambda m, x: m(x))
    for _ in range(3):
        g(Scaled(w, ByValue(2)), X)
    dispatcher = g._dispatcher
    reference = dispatcher.call
    taken: list[None] = []

    def counted(*args: Any) -> Any:
        taken.append(None)
        return reference(*args)

    monkeypatch.setattr(dispatcher, "call", counted)
    for _ in range(5):
        assert_tree_allclose(g(Scaled(w, ByValue(2)), X), X * w)
    assert not taken
    g(Scaled(w, ByValue(3)), X)  # another value: another key, the reference path
    assert len(taken) == 1


# --- 4. Containers handed back ---------------------------------------------------


def _second(x: Any, a: Any, b: Any) -> Any:
    return x + 1, b


def test_handed_back_container_after_aliased_trace_nested() -> None:
    g = filter_jit(_second)
    seen: dict[str, Any] = {}
    shared = {"k": "v"}
    jax.jit(lambda x: seen.setdefault("one", g(x, shared, shared))[0])(X)
    first, second = {"k": "v"}, {"k": "v"}
    jax.jit(lambda x: seen.setdefault("two", g(x, first, second))[0])(X)
    # A container passed at two places is not handed back (which one, only a trace
    # could say): the function's value, rebuilt; never the other argument.
    assert seen["two"][1] is not first and seen["two"][1] == second
