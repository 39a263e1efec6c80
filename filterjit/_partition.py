"""Which leaves are traced, and the cache key made from the others."""

import hashlib
from typing import Any

import jax
import numpy as np
from jax.core import Tracer


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)

# Stands in a cache key for a leaf that is traced: its aval is jax.jit's business.
DYNAMIC = object()

# NumPy arrays up to this size are keyed by their bytes; larger ones by a digest.
_INLINE_BYTES = 256


def is_array(element: Any) -> bool:
    """Whether `filter_jit` traces `element` when called outside any staged trace.

    This is the leaf predicate of the top level (and of eager transforms): JAX
    arrays, NumPy arrays and NumPy scalars are traced; everything else, Python
    scalars included, is static.

    **Arguments:**

    - `element`: any Python object.

    **Returns:**

    `True` if `element` is a `jax.Array` (tracers included), a `np.ndarray` or a
    `np.generic`, and `False` otherwise.

    !!! example

        ```python
        filterjit.is_array(jnp.ones(3))   # True
        filterjit.is_array(np.float32(1)) # True
        filterjit.is_array(1.0)           # False
        ```
    """
    return isinstance(element, _ARRAY_TYPES)


def static_key(leaf: Any) -> Any:
    """A key for a static leaf that tells apart what `==` conflates.

    `1`, `1.0` and `True` compare equal but give different programs; so do `0.0`
    and `-0.0`. And `nan != nan` would make every call with a NaN a cache miss.
    """
    if isinstance(leaf, float):
        return (type(leaf), leaf.hex())
    if isinstance(leaf, complex):
        return (type(leaf), leaf.real.hex(), leaf.imag.hex())
    return (type(leaf), leaf)


def _concrete_key(leaf: Any) -> Any:
    # A concrete leaf inside a staged trace becomes a constant of the nested
    # program, so the key must pin its value.
    if isinstance(leaf, np.ndarray):
        data = leaf.tobytes()
        if len(data) > _INLINE_BYTES:
            data = hashlib.blake2b(data, digest_size=20).digest()
        return (type(leaf), leaf.shape, leaf.dtype, data)
    if isinstance(leaf, np.generic):
        return (type(leaf), leaf.dtype, leaf.tobytes())
    if isinstance(leaf, jax.Array):
        # jax Arrays are immutable, and the cache entry holds this one alive, so
        # its id cannot be reused while the key exists. Reading its value would
        # copy it to the host on every nested call.
        return (jax.Array, id(leaf))
    return static_key(leaf)


def partition_top(leaves: list[Any]) -> tuple[list[Any], tuple[Any, ...]]:
    """Split leaves at the top level: arrays are traced, the rest are static.

    **Returns:**

    The traced leaves, and a key with `DYNAMIC` in their places and a static key
    for every other leaf.
    """
    dynamic = []
    key = []
    for leaf in leaves:
        if isinstance(leaf, _ARRAY_TYPES):
            dynamic.append(leaf)
            key.append(DYNAMIC)
        else:
            key.append(static_key(leaf))
    return dynamic, tuple(key)


def partition_staged(leaves: list[Any]) -> tuple[list[Any], tuple[Any, ...]]:
    """Split leaves inside a staged trace: only tracers are traced.

    Concrete arrays reach the function unchanged and are keyed by value, so that a
    trace is never reused for different constants.
    """
    dynamic = []
    key = []
    for leaf in leaves:
        if isinstance(leaf, Tracer):
            dynamic.append(leaf)
            key.append(DYNAMIC)
        else:
            key.append(_concrete_key(leaf))
    return dynamic, tuple(key)


def captured_bytes(leaves: list[Any], key: tuple[Any, ...]) -> int:
    """Bytes of the concrete arrays among the static leaves: what a cache entry pins."""
    return sum(
        leaf.nbytes
        for leaf, leaf_key in zip(leaves, key)
        if leaf_key is not DYNAMIC and isinstance(leaf, _ARRAY_TYPES)
    )
