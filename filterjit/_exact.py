"""Keys that tell apart values that `==` takes for one: `1`, `1.0` and `True`;
`0.0` and `-0.0`; `nan` and itself; a NumPy array and its bytes; and the same
inside tuples, lists, dicts and frozensets. Static leaves are keyed by them, and a
structure by `exact_aux` of its nodes' auxiliary data (which it compares by `==`
alone): a Module built with `scale=1` and one with `scale=1.0` are two programs."""

import hashlib
import numbers
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from ._trace import aux_data


# NumPy arrays up to this size are keyed by their bytes; larger ones by a digest.
_INLINE_BYTES = 256


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


def _sequence_key(value: Any) -> Any:
    keys = tuple(map(exact_key, value))
    return None if keys.count(None) == len(keys) else (type(value), keys)


def _dict_key(value: Any) -> Any:
    keys = (_sequence_key(tuple(value)), _sequence_key(tuple(value.values())))
    return None if keys == (None, None) else (dict, keys)


def set_key(value: Any) -> Any:
    """What `==` does not see of a frozenset (or set): its elements' types and keys."""
    keys = [exact_key(element) for element in value]
    if keys.count(None) == len(keys):
        return None
    return type(value), frozenset(zip(map(type, value), keys))


def _key_of(kind: type) -> Callable[[Any], Any]:
    if kind is tuple or kind is list:
        return _sequence_key
    if kind is dict:
        return _dict_key
    if issubclass(kind, (frozenset, set)):
        return set_key
    for base, key in (
        (np.generic, generic_key),
        (np.ndarray, ndarray_key),
        (float, float_key),
        (complex, complex_key),
        (numbers.Number, lambda value: value),
    ):
        if issubclass(kind, base):
            return lambda value: (kind, key(value))
    return lambda value: None


# Most auxiliary data's types, looked up first (caching others would keep them alive).
_KEYS_OF = {
    kind: _key_of(kind)
    for kind in (int, bool, float, complex, tuple, list, dict, str, type(None))
}


def exact_key(value: Any) -> Any:
    """What `==` does not see of `value` (numbers' and NumPy arrays' types and exact
    keys, through containers); `None` where there is nothing of the kind."""
    kind = type(value)
    return (_KEYS_OF.get(kind) or _key_of(kind))(value)


def exact_aux(treedef: Any) -> Any:
    """`exact_key` of `treedef`'s nodes' auxiliary data (`None`: no number)."""
    return exact_key(aux_data(treedef))


def same_exact(treedef: Any, recorded: list[Any], recorded_key: Any) -> bool:
    """Whether a structure equal (by `==`) to one whose auxiliary data was
    `recorded`, with `exact_key` `recorded_key`, is exactly equal to it. Most often
    its data holds the very same objects, which settles it at once."""
    data = aux_data(treedef)
    for value, known in zip(data, recorded):
        if value is not known and not (
            type(value) is type(known) is tuple and all(map(operator.is_, value, known))
        ):
            return exact_key(data) == recorded_key
    return True
