"""Leaf kinds: which leaves are arrays (traced outside staged traces), which are
traced at each level, which types are always pytree leaves, and which are keyed
by identity."""

import types

import jax
import numpy as np
from jax.core import Tracer

from ._level import ABSTRACT, Level, STAGED


ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
NUMPY_TYPES = (np.ndarray, np.generic)


def is_array(element: object) -> bool:
    """Whether `filter_jit` traces `element` when called outside any staged trace.

    This is the leaf predicate of the top level (and of eager transforms): every
    leaf it rejects, Python scalars included, is static.

    **Arguments:**

    - `element`: any Python object.

    **Returns:**

    `True` if `element` is a `jax.Array` (tracers included), a `np.ndarray` or a
    `np.generic`, and `False` otherwise.

    !!! example

        ```python
        filterjit.is_array(jnp.ones(3))    # True
        filterjit.is_array(np.float32(1))  # True
        filterjit.is_array(1.0)            # False
        ```
    """
    return isinstance(element, ARRAY_TYPES)


def compares_elementwise(element: object) -> bool:
    """Whether `==` of `element` gives an array, not a bool (a NumPy or JAX array;
    not a NumPy scalar): a structure holding it as static data cannot compare."""
    return isinstance(element, np.ndarray | jax.Array)


def traced_types(level: Level) -> tuple[type, ...]:
    """The types of the leaves a call at `level` traces."""
    if level == STAGED:
        return (Tracer,)
    if level == ABSTRACT:
        return (*ARRAY_TYPES, Tracer, jax.ShapeDtypeStruct)
    return (*ARRAY_TYPES, Tracer)


# Types whose instances are always pytree leaves: no program registers them as
# pytree nodes.
_LEAF_BASES = (*ARRAY_TYPES, Tracer)
_LEAF_TYPES = frozenset(
    {
        float,
        int,
        bool,
        complex,
        str,
        bytes,
        frozenset,  # optimistix's `tags`
        object,  # a sentinel, `object()` (lineax's defaults)
        # What a Module's activation fields hold.
        types.FunctionType,
        types.BuiltinFunctionType,
        jax.custom_jvp,
        jax.custom_vjp,
        type(jax.jit(lambda: None)),
    }
)


def is_leaf_type(kind: type) -> bool:
    """Whether instances of `kind` are always pytree leaves."""
    return kind in _LEAF_TYPES or issubclass(kind, _LEAF_BASES)


def weakly_keyed(kind: type) -> bool:
    """Whether static leaves of this type are compared by identity, and so keyed by
    weak references (so that a cache keyed by them keeps none alive)."""
    return (
        kind.__eq__ is object.__eq__
        and kind.__hash__ is object.__hash__
        and kind.__weakrefoffset__ != 0
    )


# Immutable values: which of two equal ones a function hands back is nothing it can
# tell (`is` aside), so calls need not be keyed by which are one object.
_IMMUTABLE = frozenset({int, float, complex, bool, str, bytes, type(None)})


def identity_is_moot(kind: type) -> bool:
    """Whether which object of type `kind` a static output is cannot matter: it is
    compared by identity (the key tells objects apart) or immutable."""
    return kind.__eq__ is object.__eq__ or kind in _IMMUTABLE
