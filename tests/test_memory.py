"""What the caches keep alive."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from filterjit import filter_jit
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
