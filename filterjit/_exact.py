"""The one rule for when two static values are the same to a trace, at every level
and in every role (a static argument, a partial's bound values, a receiver, a
Module's static field, the callable itself): `key(value)`, compared by `==`, as
docs/contract.md's table "When two calls are the same" writes it. Containers are
walked in order, each element keyed by this same rule with its type; other types
are their own key (`==` and `hash`, or identity). A key holds what it names,
strongly: a cache holds it until its bound on entries evicts it."""

import dataclasses
import enum
import hashlib
import operator
import struct
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer

from ._cache import per_class
from ._structure import aux_data, PyTreeDef


# NumPy arrays up to this size are keyed by their bytes; larger ones by a digest.
_INLINE_BYTES = 256

# Containers nested deeper than this are keyed by identity (where `==` would
# recurse as deep, and a key need not).
_MAX_DEPTH = 64


class Identity:
    """A key part that is its object's identity: equal only to another for the
    very same object, which it holds."""

    __slots__ = ("value",)

    def __init__(self, value: object):
        self.value = value

    def __hash__(self) -> int:
        return id(self.value)

    def __eq__(self, other: object) -> bool:
        return type(other) is Identity and other.value is self.value


def float_key(x: float) -> float | str | bytes:
    # Only the two cases that `==` gets wrong need the (slower) exact key: a zero's
    # sign, and a NaN's sign and payload (its bits).
    if x == 0.0:
        return x.hex()
    return struct.pack("<d", x) if x != x else x


def floats_key(values: Sequence[float]) -> bytes:
    """The key of many floats at once: every bit of each (zeros' signs and NaNs'
    included), at C speed."""
    return struct.pack(f"<{len(values)}d", *values)


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


# Types whose values are their own exact key (their type keyed beside them): `==`
# is exact between two values of one of them.
_ITSELF = frozenset(
    {int, bool, str, bytes, type(None), type(...), type(NotImplemented)}
)


# Immutable scalars, keyed without a memo: those above, and floats by bits.
ATOMS = _ITSELF | {float}


class _Memo(dict[int, Any]):
    """The keys of the containers met so far in one key's computation, by id (a
    value holding one object at many places is keyed in time linear in its size),
    and the depth reached."""

    depth = 0


def _sequence(values: Sequence[Any], memo: _Memo) -> tuple[Any, Any]:
    """The key of a sequence's elements: their types, then their keys."""
    kinds = tuple(map(type, values))
    found = set(kinds)
    if found <= _ITSELF:  # at C speed
        return kinds, tuple(values)
    if found == {float}:  # every bit, zeros' signs and NaNs' included
        return float, floats_key(values)
    if found <= ATOMS:
        return kinds, tuple(float_key(v) if type(v) is float else v for v in values)
    if all((_KEYS_OF.get(kind) or _key_of_class(kind)) is _itself for kind in found):
        return kinds, tuple(values)  # each its own key (see `_key`): classes, say
    return kinds, tuple(_key(value, memo) for value in values)


def _dict(value: dict[Any, Any], memo: _Memo) -> Any:
    # Every key and every value, in insertion order: the function may iterate it.
    return _sequence(tuple(value), memo), _sequence(tuple(value.values()), memo)


def _fields(value: Any, memo: _Memo) -> Any:
    # Every attribute, not only those `__eq__` compares (`compare=False` fields, what
    # `__post_init__` set): the function may read any.
    try:
        found = vars(value)
    except TypeError:  # slots
        found = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return _dict(found, memo)


def _treedef(value: PyTreeDef, memo: _Memo) -> Any:
    # A structure compares its nodes' data by `==`: their keys beside it.
    return value, _sequence(aux_data(value), memo)


def _jax_array(value: jax.Array, memo: _Memo) -> Any:
    # By its value, as a NumPy array's (a key holds no array); a tracer by identity.
    if isinstance(value, Tracer):
        return Identity(value)
    return ndarray_key(np.asarray(value))


def _itself(value: object, memo: _Memo) -> Any:
    return value


def _is_namedtuple(kind: type) -> bool:
    return issubclass(kind, tuple) and hasattr(kind, "_fields")


def _key_of(kind: type) -> Callable[[Any, _Memo], Any]:
    """How a value of type `kind` is keyed (see `key`). Subclasses of containers
    and numbers with an `__eq__` or attributes of their own, and number types other
    than Python's and NumPy's (`Decimal("-0") == Decimal("0")`), are not seen
    through: compared by `==`."""
    if kind in _ITSELF:
        return _itself
    if kind is tuple or kind is list or _is_namedtuple(kind):
        return _sequence
    if kind is dict:
        return _dict
    if kind is frozenset or kind is set:
        # In iteration order: equal sets may iterate differently, and the function
        # may iterate it.
        return lambda value, memo: _sequence(tuple(value), memo)
    if issubclass(kind, np.generic):  # before float: np.float64 subclasses it
        return lambda value, memo: generic_key(value)
    if issubclass(kind, np.ndarray):
        return lambda value, memo: ndarray_key(value)
    if kind is float:
        return lambda value, memo: float_key(value)
    if kind is complex:
        return lambda value, memo: (float_key(value.real), float_key(value.imag))
    if issubclass(kind, (jax.Array, Tracer)):  # `==` is elementwise
        return _jax_array
    if issubclass(kind, jtu.PyTreeDef):
        return _treedef
    if sees_through(kind):
        return _fields
    return _itself  # `==` and `hash`: its own, or identity


# Most static values' types, looked up first; others remembered while they live.
_KEYS_OF = {
    kind: _key_of(kind)
    for kind in (int, bool, float, complex, tuple, list, dict, str, type(None))
}
_key_of_class = per_class(_key_of)


def _key(value: Any, memo: _Memo) -> Any:
    """`value`'s key, its type apart (see `key`)."""
    key_of = _KEYS_OF.get(type(value)) or _key_of_class(type(value))
    if key_of is _itself:
        return value
    if memo.depth > _MAX_DEPTH:
        return Identity(value)
    found = memo.get(id(value), memo)
    if found is not memo:
        return found
    memo.depth += 1
    try:
        keyed = key_of(value, memo)
    finally:
        memo.depth -= 1
    memo[id(value)] = keyed  # `value` is alive while the computation runs
    return keyed


def key(value: object) -> Any:
    """What proves `value` the same as another value to a trace: equal (by `==`)
    for two values only if they trace alike, at every level (see the module):
    its type and what `_key_of` makes of it. It holds `value`'s parts that are
    compared by `==` or by identity."""
    return type(value), _key(value, _Memo())


def static_key_function(kind: type) -> Callable[[Any], Any] | None:
    """How a static leaf of type `kind` is keyed (its type is keyed apart, see
    `_partition`); `None`: by itself, `==` and `hash` being its key."""
    if kind is float:  # the fast path writes this one out
        return float_key
    key_of = _KEYS_OF.get(kind) or _key_of_class(kind)
    if key_of is _itself:
        return None
    if kind is set:
        return None  # mutable and unhashable: refused, as jax.jit refuses it
    return lambda value: key_of(value, _Memo())


# Types whose `==` is identity, though not `object`'s.
_BY_IDENTITY = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def exact_aux(treedef: PyTreeDef) -> Any:
    """The key of `treedef`'s nodes' auxiliary data (a Module's static fields, a
    `jtu.Partial`'s function, a dict's keys), which `==` of structures compares
    alone: a string equals a `str` enum member, and a recorded object whatever
    claims to equal it, so no structure is exact by `==` alone."""
    return key(aux_data(treedef))


def determined(kind: type) -> bool:
    """Whether a value of type `kind` is determined by its key: an immutable
    number or string, or an object compared by identity."""
    return (
        kind in _ITSELF
        or kind is float
        or kind is complex
        or issubclass(kind, (np.generic, np.dtype, enum.Enum, *_BY_IDENTITY))
        or (kind.__eq__ is object.__eq__ and kind.__hash__ is object.__hash__)
    )


def unchanging(data: Iterable[Any]) -> bool:
    """Whether values that are the very objects of `data` have its key: each is
    compared by identity, or immutable and not a container (through tuples and
    frozensets, which cannot change, and the same one iterates alike)."""
    for value in data:
        kind = type(value)
        if kind is tuple or kind is frozenset:
            if not unchanging(value):
                return False
        elif not determined(kind):
            return False
    return True


def same_exact(
    treedef: PyTreeDef,
    recorded: Sequence[object] | None,
    recorded_key: object,
    hashed: int,
) -> bool:
    """Whether a structure equal (by `==`) to one with `exact_aux` `recorded_key`,
    whose hash was `hashed`, is exactly equal to it: the hash recomputed, as a
    dict does (an object changed in place equals itself). Where its data holds the
    very objects `recorded` (the recorded data, if `unchanging`), that settles it
    at once."""
    data = aux_data(treedef)
    if recorded is not None and all(map(_same, data, recorded)):
        return True
    found = key(data)
    return hash(found) == hashed and found == recorded_key


def _same(value: Any, known: Any) -> bool:
    return value is known or (
        type(value) is type(known) is tuple and all(map(operator.is_, value, known))
    )
