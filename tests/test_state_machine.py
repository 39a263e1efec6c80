"""A stateful property test of the caches: calls at the top level, under eager
transforms and nested, interleaved with x64 toggles, cleared caches, new wrappers
of the same and of equal-but-distinct callables, NumPy arrays mutated in place,
and functions, classes and objects dropped. Each call is compared with the
undecorated function in the same context; each drop checks what was freed.

`FILTERJIT_SOAK=N` runs N random examples (see `helpers.property_settings`)."""

import gc
import weakref
from collections.abc import Callable
from typing import Any

import differential
import equinox as eqx
import jax
import jax.numpy as jnp
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


FUNCTIONS: dict[str, Callable[[], Callable[..., Any]]] = {
    "scaled": lambda: scaled,
    "with_table": lambda: with_table,
    "checked": lambda: checked,
    "shift": lambda: Shift(1.5),
}


# The harness's contexts: at the top level, under eager transforms, and nested
# (with the static outputs a nested call hands to the code around it).
CONTEXTS = {
    c.name: c
    for c in differential.contexts("top level", "grad", "vmap", "jit", "jit(scan body)")
}


def _in(context: str, f: Any, x: Any, k: Any, table: Any) -> Any:
    return differential.run_in(CONTEXTS[context], lambda x: f(x, k, table), x)


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

    class Plain:
        pass

    obj = Plain()
    wrapped = filter_jit(lambda x, o: (x + 1,))
    for context in ("top level", "grad", "jit"):
        _in(context, lambda x, k, t: wrapped(x, obj), x, 0, None)
    return weakref.ref(obj)


class Caches(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = np.arange(4, dtype=np.float32)
        self.callables = {name: make() for name, make in FUNCTIONS.items()}
        self.wrappers = {name: filter_jit(f) for name, f in self.callables.items()}

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
        actual = outcome(lambda: _in(context, wrapped, x, k, self.table))
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

    @rule(kind=st.sampled_from(["function", "class", "object"]))
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
