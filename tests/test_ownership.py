"""Who owns a function's caches: the function itself (by identity), the function
under a bound method or partial, or a callable's structure; and what dropping the
last reference to a function, a class or an object frees."""

import dataclasses
import functools as ft
import gc
import linecache
import pickle
import weakref
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from helpers import evict_with_bound

import filterjit
from filterjit import filter_jit


class Relu(eqx.Module):
    def __call__(self, x):
        return jax.nn.relu(x)


@dataclasses.dataclass(frozen=True)
class Scale:
    k: int = 2

    def __call__(self, x):
        return x * self.k


MakeCallable = Callable[[], Callable[[jax.Array], jax.Array]]


@pytest.mark.parametrize("make", [Relu, Scale], ids=["module", "dataclass"])
def test_equal_callables_each_call_their_own_instance(make: MakeCallable):
    first, second = filter_jit(make()), filter_jit(make())
    first(jnp.ones(2))
    del first
    gc.collect()
    assert second(jnp.ones(3)).tolist() == make()(jnp.ones(3)).tolist()


@pytest.mark.parametrize("make", [Relu, Scale], ids=["module", "dataclass"])
def test_a_callable_rewrapped_per_call_traces_once(make: MakeCallable):
    before = filterjit.num_traces(filter_jit(make()))
    for _ in range(5):
        filter_jit(make())(jnp.ones(17))  # as libraries write it
    assert filterjit.num_traces(filter_jit(make())) == before + 1


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_equal_structure_other_static_leaves_do_not_share():
    # Equinox's filter_vmap wrappers are one class; what they wrap is a leaf.
    def step_a(state, batch):
        return state + batch.sum(), batch

    def step_b(batch, state):
        return state + batch.sum(), batch

    fa = filter_jit(eqx.filter_vmap(step_a, in_axes=(None, 0)), donate=("state",))
    fb = filter_jit(eqx.filter_vmap(step_b, in_axes=(0, None)), donate=("state",))
    fa(jnp.float32(0), jnp.ones((2, 3)))
    batch = jnp.ones((2, 3))
    fb(batch, jnp.float32(0))
    assert batch.sum() == 6.0  # the batch was not donated
    assert filterjit.num_traces(fa) == filterjit.num_traces(fb) == 1
    assert "step_b" in str(filterjit.explain(fb, batch, jnp.float32(0)))


def test_equal_functions_by_identity_never_by_eq():
    class Same:
        def __eq__(self, other):
            return isinstance(other, Same)

        def __hash__(self):
            return 0

        def __call__(self, x):
            return x + id(self) % 7

    a, b = Same(), Same()
    assert filter_jit(a)(jnp.zeros(())) == a(jnp.zeros(()))
    # Equal, so keyed as one static value, as equinox.filter_jit does: b's call
    # runs a trace of an equal callable.
    assert filter_jit(b)(jnp.zeros(())) in (a(jnp.zeros(())), b(jnp.zeros(())))

    def f(x):
        return x + 1

    g = ft.wraps(f)(lambda x: x + 2)  # copies f's __dict__, caches included
    filter_jit(f)(jnp.zeros(()))
    assert filter_jit(g)(jnp.zeros(())) == 2.0


def _collected(ref):
    gc.collect()
    return ref() is None


def _use_everywhere(wrapped, *extra):
    x = jnp.ones(2)
    wrapped(x, *extra)
    jax.jit(lambda x: wrapped(x, *extra))(x)
    jax.grad(lambda x: wrapped(x, *extra).sum())(x)


def test_a_function_passed_to_its_own_wrapper_is_freed():
    def f(x, g):
        return x + 1

    ref = weakref.ref(f)
    _use_everywhere(filter_jit(f), f)
    del f
    assert _collected(ref)


def test_classes_with_decorated_methods_are_freed_with_their_instances():
    refs = []
    for _ in range(5):

        class Holder:
            def __init__(self):
                self.blob = bytearray(200_000)

            @filter_jit
            def method(self, x):
                return x * 2

        instance = Holder()
        _use_everywhere(instance.method)
        refs.append((weakref.ref(Holder), weakref.ref(instance)))
        del Holder, instance
    gc.collect()
    assert [(c(), i()) for c, i in refs] == [(None, None)] * 5


def test_a_partial_of_a_bound_method_holds_its_receiver_until_evicted():
    class Obj:
        def method(self, x, k):
            return x * k

    refs = []
    dispatchers = set()
    for _ in range(3):
        obj = Obj()
        wrapped = filter_jit(ft.partial(obj.method, k=2))
        _use_everywhere(wrapped)
        dispatchers.add(id(wrapped._dispatcher))
        refs.append(weakref.ref(obj))
        del obj, wrapped
    gc.collect()
    assert len(dispatchers) == 1  # one function, one dispatcher
    # Each receiver a static leaf of its calls, held by their keys until evicted.
    assert refs[-1]() is not None
    wrapped = filter_jit(ft.partial(Obj().method, k=2))
    evict_with_bound(wrapped)
    _use_everywhere(wrapped)
    gc.collect()
    assert [ref() for ref in refs] == [None] * 3


def test_static_objects_are_held_by_entries_until_evicted():
    class Config:
        pass

    f = filter_jit(lambda x, config: x + 1)
    refs = []
    for _ in range(3):
        config = Config()
        _use_everywhere(f, config)
        refs.append(weakref.ref(config))
        del config
    gc.collect()
    assert [ref() is not None for ref in refs] == [True] * 3
    evict_with_bound(f)
    _use_everywhere(f, Config())
    gc.collect()
    assert [ref() for ref in refs] == [None] * 3
    assert len(f._dispatcher.entries[0]) == 1


def test_generated_code_is_freed_with_its_caches():
    before = len(linecache.cache)
    for n in range(50):
        filter_jit(lambda x, n: x * n)(jnp.ones(2), n)
    filterjit.clear_caches()
    jax.clear_caches()
    gc.collect()
    assert len(linecache.cache) <= before


def test_caches_are_neither_copied_nor_pickled_with_a_function():
    import cloudpickle

    def f(x):
        return x + 1

    filter_jit(f)(jnp.ones(2))
    assert any("filterjit" in name for name in vars(f))
    clone: Callable[[jax.Array], jax.Array] = cloudpickle.loads(cloudpickle.dumps(f))
    assert filter_jit(clone)(jnp.ones(2)).tolist() == [2.0, 2.0]
    assert filterjit.num_traces(filter_jit(clone)) == 1
    wrapper: Callable[[jax.Array], jax.Array] = pickle.loads(
        pickle.dumps(filter_jit(Scale(3)))
    )
    assert wrapper(jnp.ones(1)).tolist() == [3.0]
