"""Keys that prove two static values the same to a trace, where `==` only guesses:
`1`, `1.0` and `True`; `0.0` and `-0.0`; `nan` and itself; a NumPy array and its
bytes; a frozen dataclass holding `np.float32(2)` and one holding `2.0`; and the
same through tuples, namedtuples, lists, dicts, frozensets, frozen dataclasses and
`eqx.Module`s. A type with an `__eq__` of its own that cannot be seen through is
compared as `jax.jit` compares a static argument (`==` and `hash`) at the top level,
and by identity inside a staged trace, where the undecorated program would trace it
anew on every call. Static leaves are keyed by them (see `_partition`), and a
structure by `exact_aux` of its nodes' auxiliary data (which it compares by `==`
alone): a Module built with `scale=1` and one with `scale=1.0` are two programs."""

import dataclasses
import enum
import hashlib
import numbers
import operator
import types
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from ._trace import aux_data


# NumPy arrays up to this size are keyed by their bytes; larger ones by a digest.
_INLINE_BYTES = 256

# Containers nested deeper than this are keyed by identity (where `==` would
# recurse as deep, and a key need not).
_MAX_DEPTH = 64

# Types between whose values `==` is exact, across these types too.
_PLAIN = frozenset({str, bytes, type(None)})

# Types compared by `==` that is exact for values of one type (the type is keyed
# apart): identity, or a value with no hidden part.
_EXACT_BY_EQ = (
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    np.dtype,
    enum.Enum,
    jtu.PyTreeDef,
)


class Identity:
    """A key part that is its object's identity: equal only to another for the
    very same object, which it holds (strongly: see `WeakIdentity`)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return type(other) is Identity and other.value is self.value


class WeakIdentity:
    """A static leaf's identity, held weakly: a cache entry keyed by it is dropped
    when its object dies (see `Partition.weak_positions`), so its id is never
    reused while keyed. Unlike `weakref.ref`, never compared with `==`."""

    __slots__ = ("ref", "_id")

    def __init__(self, value: Any):
        self.ref = weakref.ref(value)
        self._id = id(value)

    def __hash__(self) -> int:
        return self._id

    def __eq__(self, other: object) -> bool:
        if type(other) is not WeakIdentity or other._id != self._id:
            return False
        found = self.ref()
        return found is not None and found is other.ref()


def float_key(x: float) -> float | str:
    # Only the two cases that `==` gets wrong need the (slower) exact key.
    return x.hex() if x == 0.0 or x != x else x


def complex_key(x: complex) -> tuple[str, str]:
    return x.real.hex(), x.imag.hex()


def ndarray_key(x: np.ndarray) -> tuple[Any, ...]:
    data = x.tobytes()
    if len(data) > _INLINE_BYTES:
        data = hashlib.blake2b(data, digest_size=20).digest()
    return x.shape, x.dtype, data


def generic_key(x: np.generic) -> tuple[Any, ...]:
    return x.dtype, x.tobytes()


def sees_through(kind: type) -> bool:
    """Whether values of `kind` are keyed by their contents: an `eqx.Module`, or a
    frozen dataclass whose `__eq__` is the one `dataclasses` wrote (comparing the
    fields' tuples), not one of its own."""
    if issubclass(kind, eqx.Module):
        return True
    params = getattr(kind, "__dataclass_params__", None)
    if params is None or not params.frozen or not params.eq:
        return False
    code = getattr(kind.__eq__, "__code__", None)
    return code is not None and code.co_filename == "<string>"


def _element(value: Any, staged: bool, depth: int) -> tuple[type, Any]:
    key = _exact(value, staged, depth)
    if key is not None:
        return type(value), key
    # `==` is exact for it; a container of plain values, hashable as a tuple.
    if isinstance(value, list):
        return list, tuple(value)
    if isinstance(value, dict):
        return type(value), tuple(value.items())
    if isinstance(value, set):
        return type(value), frozenset(value)
    return type(value), value


def _sequence_key(value: Any, staged: bool, depth: int) -> Any:
    if all(type(element) in _PLAIN for element in value):
        return None
    return tuple(_element(element, staged, depth) for element in value)


def _dict_key(value: Any, staged: bool, depth: int) -> Any:
    # In insertion order: the function may iterate it.
    keys, values = tuple(value), tuple(value.values())
    if all(type(element) in _PLAIN for element in (*keys, *values)):
        return None
    return _sequence_key(keys, staged, depth), _sequence_key(values, staged, depth)


def _set_key(value: Any, staged: bool, depth: int) -> Any:
    if all(type(element) in _PLAIN for element in value):
        return None
    return frozenset(_element(element, staged, depth) for element in value)


def _fields_key(value: Any, staged: bool, depth: int) -> Any:
    # Every attribute, not only those `__eq__` compares (`compare=False` fields, what
    # `__post_init__` set): the function may read any.
    try:
        found = vars(value)
    except TypeError:  # slots
        found = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return _dict_key(found, staged, depth)


def _opaque_key(value: Any, staged: bool, depth: int) -> Any:
    # Top level: `==` and `hash`, as jax.jit keys a static argument. Nested: identity,
    # as the undecorated program traces it anew on every call.
    return Identity(value) if staged else None


def _by_eq(value: Any, staged: bool, depth: int) -> None:
    return None


def _number_key(value: Any, staged: bool, depth: int) -> Any:
    return value


def _key_of(kind: type) -> Callable[[Any, bool, int], Any]:
    """How a value of type `kind` is keyed (see `exact_key`)."""
    if kind in _PLAIN or kind is int or kind is bool:
        return _by_eq
    if issubclass(kind, tuple | list):
        return _sequence_key
    if issubclass(kind, dict):
        return _dict_key
    if issubclass(kind, frozenset | set):
        return _set_key
    for base, key in (
        (np.generic, generic_key),
        (np.ndarray, ndarray_key),
        (float, float_key),
        (complex, complex_key),
    ):
        if issubclass(kind, base):
            return lambda value, staged, depth, key=key: key(value)
    if issubclass(kind, jax.Array):  # `==` is elementwise: identity at every level
        return lambda value, staged, depth: Identity(value)
    if issubclass(kind, numbers.Number):
        return _number_key
    if sees_through(kind):
        return _fields_key
    if issubclass(kind, _EXACT_BY_EQ) or (
        kind.__eq__ is object.__eq__ and kind.__hash__ is object.__hash__
    ):
        return _by_eq
    return _opaque_key


# Most static values' types, looked up first (caching others would keep them alive).
_KEYS_OF = {
    kind: _key_of(kind)
    for kind in (int, bool, float, complex, tuple, list, dict, str, type(None))
}


def _exact(value: Any, staged: bool, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        return Identity(value)
    kind = type(value)
    return (_KEYS_OF.get(kind) or _key_of(kind))(value, staged, depth + 1)


def exact_key(value: Any, staged: bool = False) -> Any:
    """What proves `value` the same as another value of its type to a trace, where
    `==` does not: `None` where `==` between values of its type does; else a key,
    equal for two values only if they trace alike (numbers by type and bits, NumPy
    arrays by bytes, containers, frozen dataclasses and Modules by each element's
    type and key, in order). `staged`: a type whose `__eq__` cannot be seen through
    is keyed by identity (else left to `==`, as `jax.jit` leaves it)."""
    return _exact(value, staged, 0)


def static_key_function(kind: type, staged: bool) -> Callable[[Any], Any] | None:
    """How a static leaf of type `kind` is keyed (its type is keyed apart, see
    `_partition`); `None`: by itself, `==` and `hash` being exact for it. Objects
    compared by identity, and nested those whose `__eq__` cannot be seen through,
    are keyed by `WeakIdentity` where they take a weak reference."""
    if issubclass(kind, float):  # the fast path writes this one out
        return float_key
    if issubclass(kind, complex):
        return complex_key
    key_of = _KEYS_OF.get(kind) or _key_of(kind)
    weakly = WeakIdentity if kind.__weakrefoffset__ != 0 else None
    if key_of is _opaque_key:
        return (weakly or Identity) if staged else None
    if key_of is _by_eq:
        identity = kind.__eq__ is object.__eq__ and kind.__hash__ is object.__hash__
        return weakly if identity else None
    if key_of is _number_key or kind is set:
        return None  # a set: mutable and unhashable, refused as jax.jit refuses it

    def key(value: Any) -> Hashable:
        found = key_of(value, staged, 0)
        return value if found is None else found

    return key


def exact_aux(treedef: Any, staged: bool = False) -> Any:
    """`exact_key` of `treedef`'s nodes' auxiliary data (`None`: `==` is exact)."""
    return exact_key(aux_data(treedef), staged)


def same_exact(
    treedef: Any, recorded: list[Any], recorded_key: Any, staged: bool = False
) -> bool:
    """Whether a structure equal (by `==`) to one whose auxiliary data was
    `recorded`, with `exact_key` `recorded_key`, is exactly equal to it. Most often
    its data holds the very same objects, which settles it at once."""
    data = aux_data(treedef)
    for value, known in zip(data, recorded):
        if value is not known and not (
            type(value) is type(known) is tuple and all(map(operator.is_, value, known))
        ):
            return exact_key(data, staged) == recorded_key
    return True
