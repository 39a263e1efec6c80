"""What the caches keep alive."""

import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from differential import assert_tree_allclose
from helpers import evict_with_bound

from filterjit import filter_jit
from filterjit._cache import per_class
from filterjit._dispatch import STAGED_MAXBYTES


def _use(wrapped, x):
    wrapped(x)
    jax.jit(lambda x: wrapped(x))(x)  # a nested entry too
    jax.grad(lambda x: wrapped(x).sum())(x)  # and an eager one


def _trace_with(f, table):
    jax.make_jaxpr(lambda x: f(x, table))(jnp.float32(1))


def test_a_decorated_closure_is_freed_with_its_wrapper():
    def make():
        table = np.arange(3.0, dtype=np.float32)
        return lambda x: x + table.sum()

    fun = make()
    ref = weakref.ref(fun)
    wrapped = filter_jit(fun)
    _use(wrapped, jnp.ones(2))
    del fun, wrapped
    gc.collect()
    assert ref() is None


def test_a_functions_caches_are_freed_with_it_by_reference_counting():
    # Without the cycle collector: hits hold nothing that holds their dispatcher
    # (one whose output the dispatcher finishes, a static input handed back, too).
    def make():
        def fun(x, n, tag):
            return x * n, tag

        wrapped = filter_jit(fun)
        for n in (1, 2, 1, 2):
            wrapped(jnp.ones(2), n, "tag")
            jax.grad(lambda x: wrapped(x, n, "tag")[0].sum())(jnp.ones(2))
        return weakref.ref(wrapped._dispatcher)

    gc.collect()
    gc.disable()
    try:
        ref = make()
        assert ref() is None
    finally:
        gc.enable()


def test_the_nested_cache_is_bounded_in_bytes():
    f = filter_jit(lambda x, table: x + table.sum())
    tables = []
    for _ in range(40):
        table = np.random.default_rng(len(tables)).random(2**17)  # 1 MiB each
        tables.append(weakref.ref(table))
        _trace_with(f, table)
        del table
    staged_cache = f._dispatcher.entries[2]
    assert staged_cache._bytes <= STAGED_MAXBYTES
    assert len(staged_cache) <= STAGED_MAXBYTES // 2**20
    # Evicted entries free their arrays without waiting for the cycle collector.
    alive = sum(ref() is not None for ref in tables)
    assert alive <= len(staged_cache), (alive, len(staged_cache))


def _use_at_the_top_level(wrapped, x):
    wrapped(x)
    jax.grad(lambda x: wrapped(x).sum())(x)  # and an eager entry


def test_top_level_entries_keep_no_model_alive():
    # (Nested, a model's concrete arrays are compile-time constants: its entry
    # pins them, in a cache bounded in bytes.)
    import equinox as eqx

    for method in (False, True):
        model = eqx.nn.Linear(2, 2, key=jax.random.key(0))
        weight = weakref.ref(model.weight)
        _use_at_the_top_level(
            filter_jit(model.__call__ if method else model), jnp.ones(2)
        )
        del model
        gc.collect()
        assert weight() is None


def _make_callables():
    """Callables without a `__dict__` of their own, each holding (or being) an
    object to watch: a class used as the function, an instance with `__slots__`."""

    class AsFunction:
        def __new__(cls, x):
            return x + 1

    class Slotted:
        __slots__ = ("blob", "__weakref__")

        def __init__(self):
            self.blob = np.ones(16)

        def __call__(self, x):
            return x + self.blob.shape[0]

    return AsFunction, Slotted()


def test_callables_without_a_dict_are_freed_with_their_last_reference():
    refs = []
    for _ in range(3):
        as_function, slotted = _make_callables()
        for fun in (as_function, slotted):
            _use(filter_jit(fun), jnp.ones(2))
        refs += [weakref.ref(as_function), weakref.ref(slotted)]
        del as_function, slotted, fun
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)


def test_a_slotted_callable_without_weak_references_is_freed_with_its_wrapper():
    class Slotted:
        __slots__ = ("blob",)

        def __init__(self):
            self.blob = np.ones(16)

        def __call__(self, x):
            return x + self.blob.shape[0]

    slotted = Slotted()
    blob = weakref.ref(slotted.blob)
    wrapped = filter_jit(slotted)
    _use(wrapped, jnp.ones(2))
    assert wrapped(jnp.ones(2)).tolist() == [17.0, 17.0]
    del slotted, wrapped
    gc.collect()
    assert blob() is None


class _Tag:
    pass


def test_a_static_compared_by_identity_is_held_until_evicted_whether_or_not_returned():
    returned = filter_jit(lambda x, tag: (x + 1, tag))
    dropped = filter_jit(lambda x, tag: x + 1)
    refs = []
    for wrapped in (returned, dropped):
        for _ in range(4):
            tag = _Tag()
            refs.append(weakref.ref(tag))
            out = wrapped(jnp.ones(2), tag)
            if wrapped is returned:
                assert out[1] is tag
            seen = []

            def outer(x, wrapped=wrapped, tag=tag, seen=seen):
                out = wrapped(x, tag)
                seen.append(out[1] if wrapped is returned else tag)
                return out[0] if wrapped is returned else out

            jax.jit(outer)(jnp.ones(2))
            assert seen == [tag]
            del tag, out, seen, outer
    gc.collect()
    assert refs[-1]() is not None  # keyed by identity: held until evicted
    for wrapped in (returned, dropped):
        evict_with_bound(wrapped)
        wrapped(jnp.ones(2), _Tag())
        jax.jit(lambda x, wrapped=wrapped: wrapped(x, _Tag())[0])(jnp.ones(2))
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)
    # And a call with the same tag twice still hands back that tag.
    tag = _Tag()
    assert returned(jnp.ones(2), tag)[1] is tag
    assert returned(jnp.ones(2), tag)[1] is tag


class _Big(eqx.Module):
    weight: jax.Array

    @filter_jit
    def __call__(self, x: jax.Array) -> jax.Array:
        return x * self.weight.sum()


def test_a_models_weights_used_nested_are_freed_beyond_the_byte_bound():
    # Core v6, finding 4: the method's cache lives with the class, and a lone entry
    # was never evicted, whatever its bytes: 20 MB of weights stayed after the model
    # was dropped. (Below the bound they stay, counted, until evicted.)
    model = _Big(jnp.ones(5 * 2**20))  # 20 MiB, over STAGED_MAXBYTES
    weight = weakref.ref(model.weight)
    assert_tree_allclose(
        jax.jit(lambda x, m=model: m(x))(jnp.float32(1)), jnp.float32(5 * 2**20)
    )
    del model
    gc.collect()
    assert weight() is None


def test_a_numpy_view_counts_its_base():
    # Core v6, finding 4: a 3-element view of an 80 MB array pinned the whole base,
    # while its own 24 bytes were counted.
    f = filter_jit(lambda x, v: x * v.sum())
    base = np.ones(10 * 2**20)
    view = base[:3]
    freed = weakref.ref(base)
    assert_tree_allclose(
        jax.jit(lambda x, v=view: f(x, v))(jnp.float32(1)), jnp.float32(3)
    )
    del base, view
    gc.collect()
    assert freed() is None
    assert f._dispatcher.entries[2]._bytes <= STAGED_MAXBYTES


class _Owner:
    def apply(self, x: jax.Array) -> jax.Array:
        return x * 2


def test_a_jtu_partial_of_a_bound_method_holds_its_receiver_until_evicted():
    # Its receiver is a leaf of each call (its owner is the function, not
    # `types.MethodType`): held by the entries' keys until evicted.
    obj = _Owner()
    receiver = weakref.ref(obj)
    wrapped = filter_jit(jtu.Partial(obj.apply))
    _use(wrapped, jnp.ones(2))
    del obj
    evict_with_bound(wrapped)
    _use(filter_jit(jtu.Partial(_Owner().apply)), jnp.ones(2))
    del wrapped
    gc.collect()
    assert receiver() is None


def test_a_tuple_of_many_arrays_passed_again_is_not_kept():
    """A hit does not check again a tuple of scalars it checked before; a tuple of
    arrays it reads anew each call, and holds none of them after the call."""
    f = filter_jit(lambda t: sum(t))

    def call() -> list[weakref.ref]:
        t = tuple(jnp.full(2, float(i)) for i in range(6))
        assert_tree_allclose(f(t), f(t))
        return [weakref.ref(a) for a in t]

    refs = call() + call()
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_what_is_remembered_of_a_class_is_freed_with_it():
    """A per-class memo (a Module class's attributes, its instances' metadata)
    keeps neither the class nor its value past the class's life."""

    class Remembered:
        pass

    memo = per_class(lambda cls: Remembered())

    class Local:
        pass

    value = memo(Local)
    assert memo(Local) is value  # computed once
    cls, kept = weakref.ref(Local), weakref.ref(value)
    del Local, value
    gc.collect()
    assert cls() is None and kept() is None
