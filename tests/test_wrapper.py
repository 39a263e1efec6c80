"""The wrapper object: decorator forms, metadata, repr, thread safety, shared
caches, and the wrapper as a value (a pytree, copyable, picklable)."""

import copy
import functools as ft
import inspect
import pickle
import threading
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TraceCounter

import filterjit
from filterjit import filter_jit


def scale(x, n: int = 2):
    """Multiplies by n."""
    return x * n


def test_decorator_forms_return_a_wrapper_instance():
    plain = filter_jit(scale)
    configured = filter_jit(inline=True)(scale)
    by_keyword = filter_jit(fun=scale, donate="none")  # as eqx.filter_jit(fun=f)
    for wrapped in (plain, configured, by_keyword):
        assert not hasattr(wrapped, "__code__")  # a class instance, not a closure
        assert wrapped(jnp.float32(3)) == 6.0
    assert type(plain) is type(configured) is type(by_keyword)


def test_metadata():
    wrapped = filter_jit(scale)
    assert wrapped.__wrapped__ is scale
    assert wrapped.__name__ == "scale"
    assert wrapped.__qualname__ == "scale"
    assert wrapped.__doc__ == "Multiplies by n."
    assert wrapped.__module__ == scale.__module__
    assert wrapped.__annotations__ == {"n": int}
    assert "scale" in repr(wrapped) and "filter_jit" in repr(wrapped)


def test_thread_safety_with_different_statics():
    f = filter_jit(lambda x, n, s: (x * n, s * int(n)))
    x = jnp.arange(3.0)
    errors = []

    def work(i: int):
        try:
            for j in range(20):
                n = (i + j) % 5
                y, s = f(x, n, "ab")
                np.testing.assert_allclose(y, np.arange(3.0) * n)
                assert s == "ab" * n
                z = jax.jit(lambda x: f(x, np.float32(n), "c")[0])(x)
                np.testing.assert_allclose(z, np.arange(3.0) * n)
        except Exception as e:  # collected and re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


# -- Wrappers share caches, and are values


def _double_n(x, n):
    return x * n


def test_fresh_wrappers_share_traces():
    counter = TraceCounter(_double_n)
    for _ in range(5):
        filter_jit(counter)(jnp.ones(3), 20)
    assert counter.count == 1
    assert filterjit.num_traces(filter_jit(counter)) == 1
    # Other options: other caches.
    filter_jit(counter, donate="all")(jnp.ones(3), 20)
    assert counter.count == 2


def test_fresh_wrappers_of_methods_share_traces():
    class Model(eqx.Module):
        weight: jax.Array

        def apply(self, x):
            return self.weight * x

    counter = TraceCounter(lambda: None)

    def count(model, x):
        counter()
        return model.apply(x)

    model = Model(jnp.ones(3))
    for i in range(3):
        out = filter_jit(Model(jnp.full(3, i, jnp.float32)).apply)(jnp.ones(3))
        assert out.tolist() == [i] * 3
        filter_jit(count)(model, jnp.ones(3))
    assert counter.count == 1


def test_the_wrapper_of_a_pytree_is_a_pytree():
    model = eqx.nn.Linear(2, 3, key=jax.random.key(0))
    wrapped = filter_jit(model)
    assert len(jax.tree.leaves(wrapped)) == 2
    grads = eqx.filter_grad(lambda w, x: w(x).sum())(wrapped, jnp.ones(2))
    expected = eqx.filter_grad(lambda m, x: m(x).sum())(model, jnp.ones(2))
    assert isinstance(grads, type(wrapped))
    assert eqx.tree_equal(grads.__wrapped__, expected)
    doubled = jax.tree.map(lambda p: 2 * p, wrapped)
    assert jnp.allclose(doubled(jnp.ones(2)), 2 * model(jnp.ones(2)))


def test_a_wrapper_inside_a_module_is_traced_through():
    class Holder(eqx.Module):
        layer: Any

    holder = Holder(filter_jit(eqx.nn.Linear(2, 2, key=jax.random.key(1))))
    grads = eqx.filter_grad(lambda h, x: h.layer(x).sum())(holder, jnp.ones(2))
    assert grads.layer.__wrapped__.weight.shape == (2, 2)


@pytest.mark.parametrize("copier", ["deepcopy", "pickle", "cloudpickle"])
def test_wrappers_copy_and_pickle(copier):
    import cloudpickle

    copy_of = {
        "deepcopy": copy.deepcopy,
        "pickle": lambda w: pickle.loads(pickle.dumps(w)),
        "cloudpickle": lambda w: cloudpickle.loads(cloudpickle.dumps(w)),
    }[copier]
    wrapped = filter_jit(_double_n, donate="warn")
    wrapped(jnp.ones(2), 3)
    copied = copy_of(wrapped)
    assert copied(jnp.ones(2), 3).tolist() == [3.0, 3.0]
    assert copied._options == wrapped._options
    module = filter_jit(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    assert jnp.allclose(copy_of(module)(jnp.ones(2)), module(jnp.ones(2)))
    if copier == "cloudpickle":  # by value: a lambda defined here
        scale = 4.0
        local = filter_jit(lambda x: x * scale)
        assert copy_of(local)(jnp.ones(1)).tolist() == [4.0]


class _Scaler:
    def scale(self, x):
        return x * 2


def test_wrapped_is_the_callable_as_given():
    # A partial and a bound method are held as pytrees of their pieces; what
    # `__wrapped__` names is what the user wrapped, as `functools.wraps` names it.
    given: list[Callable[..., Any]] = [
        ft.partial(scale, n=3),
        jax.tree_util.Partial(scale, n=3),
        _Scaler().scale,
        eqx.filter_vmap(scale),
    ]
    for fun in given:
        wrapped = filter_jit(fun)
        assert wrapped.__wrapped__ is fun
        assert inspect.signature(wrapped) == inspect.signature(fun)


def test_the_held_callable_is_the_one_as_held_makes():
    """The wrapper skips `as_held` for a Module whose record is its class's; for
    every kind of callable, what it holds is what `as_held` makes."""
    from filterjit._function import as_held

    own = _Documented(jnp.array(3.0))
    object.__setattr__(own, "__doc__", "Its own.")
    module = _Documented(jnp.array(1.0))
    given: list[Callable[..., Any]] = [
        scale,
        module,
        own,
        module.__call__,  # Equinox's bound method: a Module holding `__func__`
        ft.partial(module, jnp.array(2.0)),
        jax.tree_util.Partial(scale, n=3),
        _Scaler().scale,
        eqx.filter_vmap(scale),
    ]
    for fun in given:
        held, expected = filter_jit(fun)._fun, as_held(fun)
        assert type(held) is type(expected)
        assert jax.tree_util.tree_structure(held) == jax.tree_util.tree_structure(
            expected
        )
        assert (held is fun) == (expected is fun)


def test_a_wrapper_unflattened_by_jax_keeps_its_metadata():
    wrapped = filter_jit(scale)
    seen = []

    @filter_jit
    def g(w):
        seen.append((w.__name__, w.__doc__, w.__qualname__, w.__annotations__))

    g(wrapped)
    assert seen == [("scale", "Multiplies by n.", "scale", {"n": int})]


def test_the_default_options_are_the_checked_ones():
    """`filter_jit(f)` takes options checked once; they are what checking gives."""
    from filterjit._options import make_options

    def f(x):
        return x

    checked = make_options(donate="none", inline=False)
    assert filter_jit(f)._options == checked
    assert filter_jit()(f)._options == checked
    # Anything else is checked on the call: `donate` of another type included.
    assert filter_jit(f, donate=("x",))._options.donate == ("x",)
    with pytest.raises(ValueError, match="inline=0 is not an option"):
        filter_jit(f, inline=0)


def test_signature_is_the_functions_whether_or_not_wrapped_is_followed():
    # As jax.jit's object gives it: the wrapper is a descriptor (`__get__`), which
    # `inspect` would take for a builtin without a signature of its own.
    def f(x, n=1):
        return x * n

    wrapped = filter_jit(f)
    for follow_wrapped in (True, False):
        expected = inspect.signature(jax.jit(f), follow_wrapped=follow_wrapped)
        assert inspect.signature(wrapped, follow_wrapped=follow_wrapped) == expected
    assert str(inspect.signature(wrapped, follow_wrapped=False)) == "(x, n=1)"


# Guards: a trace that raises is not counted or kept.
def test_a_trace_that_raises_leaves_no_trace():
    def fails_on_three(x, n):
        if n == 3:
            raise ValueError("three")
        return x * n

    f = filter_jit(fails_on_three)
    f(jnp.ones(1), 1)
    for _ in range(2):
        with pytest.raises(ValueError, match="three"):
            f(jnp.ones(1), 3)
    assert filterjit.num_traces(f) == 1
    assert not filterjit.explain(f, jnp.ones(1), 3).cache_hit


# Guards: explain traces nothing and stores nothing.
def test_explain_changes_nothing():
    counter = TraceCounter(lambda x, n: x * n)
    f = filter_jit(counter)
    for n in (1, 2):
        assert not filterjit.explain(f, jnp.ones(1), n).cache_hit
    assert counter.count == 0 and filterjit.num_traces(f) == 0
    assert not any(f._dispatcher.routes) and not any(f._dispatcher.entries)
    f(jnp.ones(1), 1)
    assert filterjit.explain(f, jnp.ones(1), 1).cache_hit
    assert not filterjit.explain(f, jnp.ones(1), 2).cache_hit
    assert counter.count == 1


class _Documented(eqx.Module):
    """A documented layer."""

    weight: jax.Array

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * self.weight


class _Named(eqx.Module):
    """Named by its field."""

    label: str = eqx.field(static=True)

    @property
    def __name__(self) -> str:  # pyright: ignore[reportIncompatibleVariableOverride]
        return self.label

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


class _Described(eqx.Module):
    """Documented by its class."""

    text: str = eqx.field(static=True)

    def __getattribute__(self, name: str) -> Any:
        if name == "__doc__":
            return object.__getattribute__(self, "text")
        return super().__getattribute__(name)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


def _wraps_metadata(fun: Any) -> tuple[Any, ...]:
    names = ("__name__", "__qualname__", "__doc__", "__module__", "__annotations__")
    return tuple(getattr(fun, name, None) for name in names)


def test_a_module_wrapped_anew_has_the_metadata_of_each_instance():
    """Modules made anew at every step are wrapped with their class's metadata (read
    past the Module's `__getattribute__`); where an instance's metadata may differ
    from its class's (a property, metadata of its own as Equinox's wrappers hold),
    each its own."""
    for weight in (1.0, 2.0):
        wrapped = filter_jit(_Documented(jnp.array(weight)))
        assert wrapped.__doc__ == "A documented layer."
        assert wrapped.__qualname__ == _Documented.__qualname__
        assert wrapped.__module__ == __name__
        assert wrapped.__globals__ is globals()
    # One instance of the class with metadata of its own, between two without.
    own = _Documented(jnp.array(3.0))
    object.__setattr__(own, "__doc__", "Its own.")
    docs = [
        filter_jit(m).__doc__
        for m in (_Documented(jnp.array(1.0)), own, _Documented(jnp.array(2.0)))
    ]
    assert docs == ["A documented layer.", "Its own.", "A documented layer."]
    for label in ("encoder", "decoder"):
        assert filter_jit(_Named(label)).__name__ == label
        assert filter_jit(_Described(label)).__doc__ == label
    for fun in (jnp.tanh, jnp.sin):
        vmapped = eqx.filter_vmap(fun)
        assert _wraps_metadata(filter_jit(vmapped))[:4] == _wraps_metadata(vmapped)[:4]
