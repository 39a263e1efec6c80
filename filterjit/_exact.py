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
import operator
import struct
import sys
import types
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from ._structure import PyTreeDef
from ._trace import aux_data


# NumPy arrays up to this size are keyed by their bytes; larger ones by a digest.
_INLINE_BYTES = 256

# Containers nested deeper than this are keyed by identity (where `==` would
# recurse as deep, and a key need not).
_MAX_DEPTH = 64

# Types between whose values `==` is exact, across these types too.
_PLAIN = frozenset({str, bytes, type(None)})


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
        if type(other) is not type(self) or other._id != self._id:
            return False
        found = self.ref()
        return found is not None and found is other.ref()


class WeakReceiver(WeakIdentity):
    """A bound method's receiver inside a static value, held weakly: data, whatever
    its type (a callable object too; see `holds_by_identity`)."""

    __slots__ = ()


class WouldPin(Exception):
    """Raised by the key of a static leaf inside a staged trace where the key would
    keep alive what the caller may drop: an object compared by identity that takes
    no weak reference, or a concrete jax Array inside a static value (a constant
    of the trace, which the entry would hold). Such a call runs as the undecorated
    function, which keeps nothing (see `Dispatcher._lookup`)."""


def float_key(x: float) -> float | str | bytes:
    # Only the two cases that `==` gets wrong need the (slower) exact key: a zero's
    # sign, and a NaN's sign and payload (its bits).
    if x == 0.0:
        return x.hex()
    return struct.pack("<d", x) if x != x else x


def complex_key(x: complex) -> tuple[Any, Any]:
    return float_key(x.real), float_key(x.imag)


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


# Exact-type numbers (floats apart), strings and the like: keyed in bulk, at C
# speed, where a container holds nothing else.
_SIMPLE = frozenset({int, bool, float, str, bytes, type(None)})


def _element(value: Any, staged: bool, memo: "_Memo") -> tuple[type, Any]:
    key = _exact(value, staged, memo)
    if key is not None:
        return type(value), key
    if staged and memo.of_static_leaf:
        if _by_identity(type(value)):
            return type(value), _weak_part(value)
        if type(value) is types.MethodType:  # compared by its receiver's identity
            receiver = _weak_part(value.__self__, WeakReceiver)
            return types.MethodType, (value.__func__, receiver)
    # `==` is exact for it; a container of plain values, hashable as a tuple.
    if isinstance(value, list):
        return list, tuple(value)
    if isinstance(value, dict):
        return type(value), tuple(value.items())
    if isinstance(value, set):
        return type(value), frozenset(value)
    return type(value), value


def _sequence_key(value: Sequence[Any], staged: bool, memo: "_Memo") -> Any:
    kinds = set(map(type, value))
    if kinds <= _PLAIN:
        return None
    if kinds == {float}:  # every bit, zeros' signs and NaNs' included
        return float, np.array(value, dtype=np.float64).tobytes()
    # `==` between floats is exact but for zeros' signs (a NaN equals nothing but
    # itself, as one object: a miss, never a wrong hit); a zero or a number equal
    # to one is keyed element by element.
    if kinds <= _SIMPLE and (float not in kinds or 0.0 not in value):
        return tuple(map(type, value)), tuple(value)
    return tuple(_element(element, staged, memo) for element in value)


def _dict_key(value: dict[Any, Any], staged: bool, memo: "_Memo") -> Any:
    # In insertion order: the function may iterate it.
    keys, values = tuple(value), tuple(value.values())
    if {*map(type, keys), *map(type, values)} <= _PLAIN:
        return None
    return _sequence_key(keys, staged, memo), _sequence_key(values, staged, memo)


def _set_key(value: set[Any] | frozenset[Any], staged: bool, memo: "_Memo") -> Any:
    if all(type(element) in _PLAIN for element in value):
        return None
    return frozenset(_element(element, staged, memo) for element in value)


def _fields_key(value: Any, staged: bool, memo: "_Memo") -> Any:
    # Every attribute, not only those `__eq__` compares (`compare=False` fields, what
    # `__post_init__` set): the function may read any. Never `None`: `==` would
    # leave out the fields it does not compare.
    try:
        found = vars(value)
    except TypeError:  # slots
        found = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return _dict_key(found, staged, memo) or tuple(found.items())


def _opaque_key(value: Any, staged: bool, memo: "_Memo") -> Any:
    # Top level: `==` and `hash`, as jax.jit keys a static argument. Nested: identity,
    # as the undecorated program traces it anew on every call.
    if not staged:
        return None
    return _weak_part(value) if memo.of_static_leaf else Identity(value)


def _by_eq(value: Any, staged: bool, memo: "_Memo") -> None:
    return None


def _treedef_key(value: PyTreeDef, staged: bool, memo: "_Memo") -> Any:
    # A structure compares its nodes' data by `==`.
    return value, exact_aux(value, staged)


def _is_namedtuple(kind: type) -> bool:
    return issubclass(kind, tuple) and hasattr(kind, "_fields")


# Callables and types compared by `==` that is exact for values of one type (the
# type is keyed apart): identity, or a value with no hidden part.
_EXACT_BY_EQ = (
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    np.dtype,
    enum.Enum,
)


def _key_of(kind: type) -> Callable[[Any, bool, "_Memo"], Any]:
    """How a value of type `kind` is keyed (see `exact_key`). Subclasses of
    containers and numbers with an `__eq__` or attributes of their own, and number
    types other than Python's and NumPy's (`Decimal("-0") == Decimal("0")`), are
    not seen through."""
    if kind in _PLAIN or kind is int or kind is bool:
        return _by_eq
    if kind is tuple or kind is list or _is_namedtuple(kind):
        return _sequence_key
    if kind is dict:
        return _dict_key
    if kind is frozenset or kind is set:
        return _set_key
    for base, key in (
        (np.generic, generic_key),
        (np.ndarray, ndarray_key),
    ):
        if issubclass(kind, base):
            return lambda value, staged, memo, key=key: key(value)
    if kind is float:
        return lambda value, staged, memo: float_key(value)
    if kind is complex:
        return lambda value, staged, memo: complex_key(value)
    if issubclass(kind, jax.Array):  # `==` is elementwise: identity at every level
        return _array_key
    if issubclass(kind, jtu.PyTreeDef):
        return _treedef_key
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


class _Memo(dict[int, Any]):
    """The keys of the containers met so far in one key's computation, by id (a
    value holding one object at many places is keyed in time linear in its size),
    the depth reached, and whether it is a static leaf's key (not a structure's
    auxiliary data), which in a staged trace holds objects compared by identity
    weakly and raises `WouldPin` where it cannot."""

    depth = 0
    of_static_leaf = False


def _array_key(value: Any, staged: bool, memo: _Memo) -> Identity:
    if staged and memo.of_static_leaf:
        raise WouldPin
    return Identity(value)


def _refuse_pin(value: Any) -> Any:
    raise WouldPin


def _exact(value: Any, staged: bool, memo: _Memo) -> Any:
    kind = type(value)
    key_of = _KEYS_OF.get(kind) or _key_of(kind)
    if key_of is _by_eq or key_of is _opaque_key:
        return key_of(value, staged, memo)
    if memo.depth > _MAX_DEPTH:
        return Identity(value)
    found = memo.get(id(value), memo)
    if found is not memo:
        return found
    memo.depth += 1
    try:
        key = key_of(value, staged, memo)
    finally:
        memo.depth -= 1
    memo[id(value)] = key  # `value` is alive while the computation runs
    return key


def exact_key(value: Any, staged: bool = False) -> Any:
    """What proves `value` the same as another value of its type to a trace, where
    `==` does not: `None` where `==` between values of its type does; else a key,
    equal for two values only if they trace alike (numbers by type and bits, NumPy
    arrays by bytes, containers, frozen dataclasses and Modules by each element's
    type and key, in order). `staged`: a type whose `__eq__` cannot be seen through
    is keyed by identity (else left to `==`, as `jax.jit` leaves it)."""
    return _exact(value, staged, _Memo())


def method_key(method: types.MethodType) -> Hashable:
    """A bound method's key, as `==` compares methods: its function, and its
    receiver's identity, held weakly where the receiver takes a weak reference (a
    cache keyed by it is dropped when the receiver dies: see `watched`), else the
    method itself."""
    try:
        return method.__func__, WeakIdentity(method.__self__)
    except TypeError:
        return method


def is_weak_key(key: Any) -> bool:
    """Whether `key`, a static leaf's, holds its object weakly (`WeakIdentity`, or
    `method_key`'s): it is equal to nothing once the object dies."""
    return type(key) is WeakIdentity or (
        type(key) is tuple and len(key) == 2 and type(key[1]) is WeakIdentity
    )


def watched(leaf: Any) -> Any:
    """What a cache keyed by a static leaf keyed weakly watches, to drop what it
    keyed when it dies: the leaf, or a bound method's receiver; `None` where the
    key holds it strongly (a receiver that takes no weak reference)."""
    if isinstance(leaf, types.MethodType):
        receiver = leaf.__self__
        return receiver if type(receiver).__weakrefoffset__ else None
    return leaf


def weak_reference(leaf: Any) -> Callable[[], Any]:
    """A reference to a static leaf keyed weakly, which gives it when called
    (`None` once it died): a bound method's made again from its function and
    receiver; the method itself where its key holds it strongly."""
    if isinstance(leaf, types.MethodType):
        if watched(leaf) is None:
            return lambda: leaf
        return weakref.WeakMethod(leaf)
    return weakref.ref(leaf)


def _by_identity(kind: type) -> bool:
    """Whether values of type `kind` are compared by identity (their `__eq__` and
    `__hash__` are `object`'s)."""
    return kind.__eq__ is object.__eq__ and kind.__hash__ is object.__hash__


def _weak_part(value: Any, kind: type[WeakIdentity] = WeakIdentity) -> WeakIdentity:
    """Inside a static value in a staged trace: an object keyed by its identity,
    held weakly (an entry keyed by it is dropped when it dies: see `weak_parts`), as
    a `kind` (a `WeakReceiver` for a bound method's receiver); `WouldPin` where it
    takes no weak reference."""
    if type(value).__weakrefoffset__ == 0:
        raise WouldPin
    return kind(value)


def holds_by_identity(value: Any) -> bool:
    """Whether a static value holds data compared by identity inside it (not
    itself, which a key holds weakly): an object that is neither callable nor a
    global of its class's module, a bound method's receiver, or a jax Array. Its
    key at the top level holds them strongly, as `jax.jit` keys a static argument.
    (Callables, functions above all, are code, as long-lived as what defines
    them.)"""
    memo = _Memo()
    memo.of_static_leaf = True
    try:
        key = _exact(value, True, memo)
    except WouldPin:
        return True
    if type(key) is WeakIdentity:
        return False
    return any(map(_is_data, _weak_identities(key)))


def _is_data(held: WeakIdentity) -> bool:
    """Whether an object a key holds weakly is data: a method's receiver, or an
    object compared by identity (not one with an `__eq__` of its own, which the top
    level keys by `==`) that is neither callable nor a global of its module."""
    part = held.ref()
    if part is None:
        return False
    if type(held) is WeakReceiver:
        return True
    return _by_identity(type(part)) and not callable(part) and not _is_global(part)


def _is_global(value: Any) -> bool:
    """Whether `value` is bound to a name in its class's module: a sentinel (the
    one Equinox puts in every Module's structure), a tag (Lineax's operator tags).
    The module holds it anyway, and a key holding it pins nothing."""
    module = sys.modules.get(type(value).__module__)
    namespace = getattr(module, "__dict__", None)
    return type(namespace) is dict and any(v is value for v in namespace.values())


def weak_parts(key: Any) -> list[Any]:
    """The live objects that `key` holds weakly (its `WeakIdentity`s, through
    tuples and frozensets)."""
    found: list[Any] = []
    for held in _weak_identities(key):
        part = held.ref()
        if part is not None:
            found.append(part)
    return found


def _weak_identities(key: Any) -> list[WeakIdentity]:
    """The `WeakIdentity`s in `key`, through tuples and frozensets."""
    found: list[WeakIdentity] = []
    stack = [key]
    while stack:
        part = stack.pop()
        if isinstance(part, WeakIdentity):
            found.append(part)
        elif isinstance(part, (tuple, frozenset)):
            stack.extend(part)
    return found


def static_key_function(kind: type, staged: bool) -> Callable[[Any], Any] | None:
    """How a static leaf of type `kind` is keyed (its type is keyed apart, see
    `_partition`); `None`: by itself, `==` and `hash` being exact for it. Objects
    compared by identity, and nested those whose `__eq__` cannot be seen through,
    are keyed by `WeakIdentity` where they take a weak reference."""
    if kind is float:  # the fast path writes this one out
        return float_key
    if kind is complex:
        return complex_key
    if kind is types.MethodType:  # its receiver held weakly, as undecorated
        return method_key
    key_of = _KEYS_OF.get(kind) or _key_of(kind)
    weakly = WeakIdentity if kind.__weakrefoffset__ != 0 else None
    if key_of is _opaque_key:
        return (weakly or _refuse_pin) if staged else None
    if key_of is _by_eq:
        identity = _by_identity(kind)
        if identity and weakly is None and staged:
            return _refuse_pin
        return weakly if identity else None
    if kind is set:
        return None  # mutable and unhashable: refused, as jax.jit refuses it

    def key(value: Any) -> Hashable:
        # As `_exact` keys it, the key function of its type already found.
        memo = _Memo()
        memo.depth = 1
        memo.of_static_leaf = True
        found = key_of(value, staged, memo)
        return value if found is None else found

    return key


def aux_holds_by_identity(treedef: PyTreeDef) -> bool:
    """Whether `treedef`'s nodes' auxiliary data (a Module's static fields), which a
    key of the structure holds as it is, holds data compared by identity (see
    `holds_by_identity`)."""
    return holds_by_identity(tuple(aux_data(treedef)))


def exact_aux(treedef: PyTreeDef, staged: bool = False) -> Any:
    """`exact_key` of `treedef`'s nodes' auxiliary data (`None`: `==` is exact)."""
    return exact_key(aux_data(treedef), staged)


def same_exact(
    treedef: PyTreeDef, recorded: list[Any], recorded_key: Any, staged: bool = False
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
