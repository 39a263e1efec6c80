"""A stateful property test of the caches: calls at the top level, under eager
transforms and nested, interleaved with x64 toggles, cleared caches, new wrappers
of the same and of equal-but-distinct callables, NumPy arrays mutated in place
(an argument, and one a partial called as itself binds), jax Arrays made anew
whose ids recur, options and ahead-of-time stages at new shapes with values equal
by `==` that compute differently, traced values stored where the caller reaches
them, and functions, classes, objects and the arrays of callables dropped. Each
call is compared with the undecorated function in the same context; each drop
checks what was freed; every step runs under `jax.checking_leaks()`.

`FILTERJIT_SOAK=N` runs N random examples (see `helpers.property_settings`)."""

import functools
import gc
import weakref
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import differential
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from differential import assert_tree_equal, outcome
from helpers import property_settings
from hypothesis import settings, strategies as st
from hypothesis.stateful import rule, RuleBasedStateMachine

import filterjit
from filterjit import filter_jit


def scaled(x, k, table):
    # A static output that depends on the configuration (x64), and a handed-back
    # static input whose type matters.
    y = x * k if type(k) is float else x + 1
    return y, k, (jnp.arange(2) + 1).dtype, -0.0 if x.shape[0] % 2 else 0.0


def with_table(x, k, table):
    # A NumPy table: traced at the top level, a constant when nested.
    return x + table[: x.shape[0]].sum(), table.sum() * 2


def checked(x, k, table):
    return eqx.error_if(x, x.sum() > 2.5, "too big"), "checked"


class Shift(eqx.Module):
    # A callable compared by structure: equal instances share caches.
    offset: float = eqx.field(static=True)

    def __call__(self, x, k, table):
        return x + self.offset, self.offset


class CalledAsItself(functools.partial):
    # A partial with a `__call__` of its own: no pytree, called as it is.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


def weighted(x, k, table, weights):
    return x * weights["w"].sum(), "weighted"


FUNCTIONS: dict[str, Callable[[], Callable[..., Any]]] = {
    "scaled": lambda: scaled,
    "with_table": lambda: with_table,
    "checked": lambda: checked,
    "shift": lambda: Shift(1.5),
    # A NumPy array it binds, changed in place by `mutate_bound`.
    "bound": lambda: CalledAsItself(weighted, weights={"w": np.ones(2, np.float32)}),
}


def shape_only(x, a):
    # Reads only the shape of `a`: a nested trace does not compile `a` in.
    return x + a.shape[0], len(a)


def signed(x, d):
    # `Decimal("-0") == Decimal("0")`, keyed alike by `==` as `jax.jit` keys them:
    # each trace must compute with its own call's.
    return x * (-1.0 if d.is_signed() else 1.0)


class Log:
    def __init__(self) -> None:
        self.items: list[Any] = []


def logged(x, log):
    log.items.append(x * 2)
    return x + 1


# The harness's contexts: at the top level, under eager transforms, and nested
# (with the static outputs a nested call hands to the code around it).
CONTEXTS = {
    c.name: c
    for c in differential.contexts("top level", "grad", "vmap", "jit", "jit(scan body)")
}


def _in(context: str, f: Any, x: Any, k: Any, table: Any) -> Any:
    return differential.run_in(CONTEXTS[context], lambda x: f(x, k, table), x)


def _leak_checked(thunk: Callable[[], Any]) -> Callable[[], Any]:
    """`thunk`, run under `jax.checking_leaks()`: no tracer outlives its trace
    (the undecorated reference runs without it: Equinox's runtime checks and
    JAX's leak checker do not agree)."""

    def run() -> Any:
        with jax.checking_leaks():
            return thunk()

    return run


def _made_and_used(kind: str) -> weakref.ref:
    """Makes a function, a class or an object, uses it through `filter_jit` in
    several contexts, and returns a weak reference to it."""
    x = jnp.ones(2)
    if kind == "function":

        def fun(x, itself):
            return x * 2

        wrapped = filter_jit(fun)
        for context in ("top level", "grad", "jit"):
            _in(context, lambda x, k, t: (wrapped(x, fun),), x, 0, None)
        return weakref.ref(fun)
    if kind == "class":

        class Local:
            @filter_jit
            def method(self, x):
                return (x * 3,)

        instance = Local()
        for context in ("top level", "grad", "jit"):
            _in(context, lambda x, k, t: instance.method(x), x, 0, None)
        return weakref.ref(Local)

    if kind in CALLABLES_HOLDING_ARRAYS:
        held, wrapped, array = CALLABLES_HOLDING_ARRAYS[kind]()
        for context in ("top level", "grad", "jit"):
            _in(context, lambda x, k, t: (wrapped(x),), x, 0, None)
        return weakref.ref(array)

    class Plain:
        pass

    obj = Plain()
    wrapped = filter_jit(lambda x, o: (x + 1,))
    for context in ("top level", "grad", "jit"):
        _in(context, lambda x, k, t: wrapped(x, obj), x, 0, None)
    return weakref.ref(obj)


class _Model(eqx.Module):
    weight: jax.Array

    def apply(self, x, k=1.0):
        return x * self.weight.sum() * k


def _module_method() -> tuple[Any, Any, Any]:
    model = _Model(jnp.ones(3))
    held = functools.partial(model.apply, k=2.0)
    return held, filter_jit(held), model.weight


def _tree_partial() -> tuple[Any, Any, Any]:
    array = np.ones(3, np.float32)
    held = jtu.Partial(lambda a, x: x + a.sum().astype(x.dtype), array)
    return held, filter_jit(held), array


def _partial_called_as_itself() -> tuple[Any, Any, Any]:
    array = np.ones(3, np.float32)
    held = CalledAsItself(lambda x, a: x + a.sum().astype(x.dtype), a=array)
    return held, filter_jit(held), array


# Callables that hold array data, made and used, then dropped with their wrapper:
# no cache may keep the array (`jax.jit` frees a function's, and so its arrays).
CALLABLES_HOLDING_ARRAYS = {
    "module method partial": _module_method,
    "tree partial": _tree_partial,
    "partial called as itself": _partial_called_as_itself,
}

# Wrappers with options, and the ahead-of-time stages, each tracing anew at a new
# shape (`signed`).
OPTIONED: dict[str, Callable[[Any], Any]] = {
    "inline": lambda f: filter_jit(f, inline=True),
    "donate": lambda f: filter_jit(f, donate="all"),
    "lower": filter_jit,
}


class Caches(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = np.arange(4, dtype=np.float32)
        self.callables = {name: make() for name, make in FUNCTIONS.items()}
        self.wrappers = {name: filter_jit(f) for name, f in self.callables.items()}
        self.shape_only = filter_jit(shape_only)
        self.logged = filter_jit(logged)

    @rule(
        name=st.sampled_from(sorted(FUNCTIONS)),
        context=st.sampled_from(sorted(CONTEXTS)),
        n=st.integers(1, 3),
        k=st.sampled_from([2, 2.0, True, 0.5]),
    )
    def call(self, name: str, context: str, n: int, k: Any) -> None:
        x = jnp.arange(n, dtype=jnp.float32)
        f, wrapped = self.callables[name], self.wrappers[name]
        # The reference: the undecorated function, given what a jit gives it. At
        # the top level and under eager transforms a NumPy array is traced.
        staged = CONTEXTS[context].staged
        table = self.table if staged else jnp.asarray(self.table)
        expected = outcome(lambda: _in(context, f, x, k, table))
        actual = outcome(_leak_checked(lambda: _in(context, wrapped, x, k, self.table)))
        if expected.error is not None:
            assert actual.error is not None, (expected, actual)
            if not staged:
                assert issubclass(actual.error, eqx.EquinoxRuntimeError), actual
            else:
                assert "too big" in actual.message, actual
        else:
            assert actual.error is None, actual
            assert_tree_equal(actual.value, expected.value)

    @rule()
    def toggle_x64(self) -> None:
        jax.config.update("jax_enable_x64", not jax.config.jax_enable_x64)  # pyright: ignore[reportAttributeAccessIssue]

    @rule()
    def clear_jax_caches(self) -> None:
        jax.clear_caches()

    @rule()
    def clear_filterjit_caches(self) -> None:
        filterjit.clear_caches()

    @rule(name=st.sampled_from(sorted(FUNCTIONS)), equal_but_distinct=st.booleans())
    def rewrap(self, name: str, equal_but_distinct: bool) -> None:
        if equal_but_distinct:  # a new Module instance, say, equal to the last
            self.callables[name] = FUNCTIONS[name]()
        self.wrappers[name] = filter_jit(self.callables[name])

    @rule(delta=st.sampled_from([1.0, -2.0]))
    def mutate_table(self, delta: float) -> None:
        self.table[0] += delta

    @rule(delta=st.sampled_from([1.0, -2.0]))
    def mutate_bound(self, delta: float) -> None:
        bound = self.callables["bound"]
        assert isinstance(bound, CalledAsItself)
        bound.keywords["weights"]["w"][0] += delta

    @rule(context=st.sampled_from(sorted(CONTEXTS)), m=st.integers(1, 4))
    def call_with_a_fresh_array(self, context: str, m: int) -> None:
        # A concrete jax Array made anew: nested, its id may be a dead one's.
        x = jnp.arange(2, dtype=jnp.float32)
        run = functools.partial(differential.run_in, CONTEXTS[context])
        made = jnp.zeros(m)
        expected = run(lambda x: shape_only(x, made), x)
        actual = _leak_checked(lambda: run(lambda x: self.shape_only(x, made), x))()
        assert_tree_equal(actual, expected)

    @rule(how=st.sampled_from(sorted(OPTIONED)), n=st.integers(1, 3))
    def trace_anew_with_options(self, how: str, n: int) -> None:
        # Two values equal by `==` share an entry (as `jax.jit` keys them); a new
        # trace of it, at a new shape, computes with its own call's.
        def fresh(x, d):  # a function of its own: caches of its own
            return signed(x, d)

        wrapped = OPTIONED[how](fresh)
        x = jnp.arange(1.0, n + 1)
        expected = signed(x, Decimal("-0"))
        assert_tree_equal(wrapped(x, Decimal("-0")), expected)
        d, x = Decimal("0"), jnp.arange(1.0, n + 2)
        expected = signed(x, d)
        if how == "lower":
            assert_tree_equal(wrapped.lower(x, d).compile()(x, d), expected)
        assert_tree_equal(wrapped(x, d), expected)
        # Nested, where the options mean nothing: the undecorated program.
        x = jnp.arange(1.0, n + 3)
        nested = _leak_checked(lambda: jax.jit(lambda y: wrapped(y, d))(x))()
        assert_tree_equal(nested, signed(x, d))

    @rule(context=st.sampled_from(["jit", "jit(scan body)"]))
    def store_a_traced_value_through_an_object(self, context: str) -> None:
        log = Log()
        x = jnp.arange(2, dtype=jnp.float32)
        found = outcome(
            _leak_checked(
                lambda: differential.run_in(
                    CONTEXTS[context], lambda y: self.logged(y, log), x
                )
            ),
            raises=[TypeError],
        )
        assert found.error is TypeError and "log.items[0]" in found.message, found

    @rule(
        kind=st.sampled_from(
            ["function", "class", "object", *sorted(CALLABLES_HOLDING_ARRAYS)]
        )
    )
    def drop(self, kind: str) -> None:
        ref = _made_and_used(kind)
        gc.collect()
        assert ref() is None, f"a dropped {kind} is still alive"

    def teardown(self) -> None:
        jax.config.update("jax_enable_x64", False)


def _machine_settings() -> settings:
    base = property_settings(compiled=True)
    # Each step traces and compiles: a few steps each, many examples in --full.
    return settings(
        base, max_examples=max(4, base.max_examples // 3), stateful_step_count=12
    )


TestCaches = Caches.TestCase
TestCaches.settings = _machine_settings()
