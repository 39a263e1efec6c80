"""Which leaves of a call are traced, and the cache key made from the others."""

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import _exact
from ._leaves import ARRAY_TYPES, traced_types
from ._level import Level, STAGED
from ._structure import aux_data, dict_orders, PyTreeDef, shape_of


def _key_function(kind: type, staged: bool) -> Callable[[Any], Any] | None:
    """How a static leaf of type `kind` is keyed, where `==` is not enough (the
    partition keys the types, so `1`, `1.0` and `True` differ); `None`: itself."""
    # np.generic before float: np.float64 subclasses float.
    if staged and issubclass(kind, np.ndarray):
        return _exact.ndarray_key
    if staged and issubclass(kind, np.generic):
        return _exact.generic_key
    if staged and issubclass(kind, jax.Array):
        # Immutable: its identity proves its value while it lives, and an entry so
        # keyed dies with it (`Partition.identity_positions`), before its id is reused.
        return id
    return _exact.static_key_function(kind)


def static_key(leaf: object) -> Any:
    """The key of a static leaf at the top level (its type is keyed apart)."""
    rekey = _key_function(type(leaf), staged=False)
    return leaf if rekey is None else rekey(leaf)


# Partitions with up to this many static leaves have their key written out by the
# fast path; beyond, `reference_key` makes it, the static floats' bits in one bytes
# object (at C speed, and hashed once a call).
WRITTEN_KEYS = 64


def _taker(positions: Sequence[int], count: int) -> Callable[[Sequence[Any]], Any]:
    """A function from a list of `count` leaves to those at `positions`."""
    if len(positions) == count:
        return lambda leaves: leaves
    if len(positions) == 0:
        return lambda leaves: ()
    first, last = positions[0], positions[-1]
    if last - first + 1 == len(positions):  # contiguous: a slice, at C speed
        return operator.itemgetter(slice(first, last + 1))
    return operator.itemgetter(*positions)


class Partition:
    """Which leaves of one structure and leaf types are traced at one level, and how
    the others are keyed. Partitions with one `signature` share a `program`, so that
    a NumPy array where a jax Array was finds the same cache entry."""

    __slots__ = (
        "treedef",
        "types",
        "signature",
        "program",
        "dynamic_positions",
        "static_positions",
        "array_positions",
        "identity_positions",
        "take_dynamic",
        "_take_static",
        "rekeys",
        "_keys_of_statics",
        "exact",
        "level",
        "staged",
        "_aux",
        "_hashed",
        "orders",
        "deep",
        "by_eq",
    )

    def __init__(
        self,
        treedef: PyTreeDef,
        types: tuple[type, ...],
        level: Level,
        program_of: Callable[[tuple[object, ...]], object],
    ):
        traced = traced_types(level)
        staged = level == STAGED
        dynamic = [p for p, kind in enumerate(types) if issubclass(kind, traced)]
        static = [p for p, kind in enumerate(types) if not issubclass(kind, traced)]
        keyed = [(i, _key_function(types[p], staged)) for i, p in enumerate(static)]
        rekeys = [(i, rekey) for i, rekey in keyed if rekey is not None]
        self.treedef = treedef
        self.types = types
        self.dynamic_positions = tuple(dynamic)
        self.static_positions = tuple(static)
        self.array_positions = tuple(
            p for p in static if staged and issubclass(types[p], ARRAY_TYPES)
        )
        # The leaves keyed by their `id`: an entry of such a key must not outlive them.
        self.identity_positions = tuple(static[i] for i, rekey in rekeys if rekey is id)
        # What `==` does not see of the auxiliary data (see `_exact`), and the data
        # itself where holding the very same objects proves a structure the same.
        aux = aux_data(treedef)
        self.level = level
        self.staged = staged
        self.exact = _exact.exact_aux(treedef)
        self._aux = aux if _exact.unchanging(aux) else None
        self._hashed = hash(self.exact)
        # Nested, `orders(tree)`: the order of the call's dicts, also keyed.
        sorted_dicts, self.deep = shape_of(treedef)
        self.orders = dict_orders if staged and sorted_dicts else None
        static_types = tuple(types[p] for p in static)
        self.signature = (treedef, self.dynamic_positions, static_types, self.exact)
        self.program = program_of(self.signature)
        self.take_dynamic = _taker(dynamic, len(types))
        self._take_static = _taker(static, len(types))
        # (index among the static leaves, its key function) where not the leaf.
        self.rekeys = tuple(rekeys)
        self._keys_of_statics = _keys_of_statics(static_types, self.rekeys)
        # Whether two calls of one key may hold static leaves that differ (equal by
        # `==`, containers), so that a trace must take the call's own.
        self.by_eq = not all(map(_exact.determined, static_types))

    def reference_key(self, leaves: Sequence[object]) -> Any:
        """The cache key of a call's leaves: the program, then its static keys."""
        if not self.static_positions:
            return self.program
        return (self.program, *self._keys_of_statics(self._take_static(leaves)))

    def exactly(self, treedef: PyTreeDef) -> bool:
        """Whether `treedef`, equal to this partition's by `==`, is exactly equal."""
        return _exact.same_exact(treedef, self._aux, self.exact, self._hashed)

    def statics(self, leaves: Sequence[object]) -> Sequence[Any]:
        """The keys of the static leaves, one each."""
        return _rekeyed(self._take_static(leaves), self.rekeys)

    def roles(self) -> list[str]:
        """What happens to each leaf: "traced", "concrete" (an array passed through
        unchanged inside a staged trace) or "static"."""
        dynamic, arrays = set(self.dynamic_positions), set(self.array_positions)
        return [
            "traced" if p in dynamic else "concrete" if p in arrays else "static"
            for p in range(len(self.types))
        ]

    def captured_bytes(self, leaves: Sequence[object]) -> int:
        """Bytes of the concrete arrays that an entry for these leaves pins (its
        program holds them as constants): a NumPy view pins its base."""
        return sum(_pinned_bytes(leaves[p]) for p in self.array_positions)


def _rekeyed(
    statics: Sequence[object], rekeys: Sequence[tuple[int, Callable[[object], object]]]
) -> Sequence[Any]:
    """`statics`, each at an index of `rekeys` keyed by its function."""
    if not rekeys:
        return statics
    keyed = list(statics)
    for index, rekey in rekeys:
        keyed[index] = rekey(keyed[index])
    return keyed


def _keys_of_statics(
    types: tuple[type, ...], rekeys: tuple[tuple[int, Callable[[object], object]], ...]
) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """The function from static leaves of `types` to their part of a call's key:
    each keyed (`rekeys`), or, beyond `WRITTEN_KEYS` of them, the floats' bits in
    one bytes object after the others' keys (a float's key is its bits)."""
    floats = [i for i, kind in enumerate(types) if kind is float]
    if len(types) <= WRITTEN_KEYS or len(floats) < 2:
        return lambda statics: _rekeyed(statics, rekeys)
    others = [i for i, kind in enumerate(types) if kind is not float]
    at = {index: place for place, index in enumerate(others)}
    other_rekeys = [(at[i], rekey) for i, rekey in rekeys if i in at]
    take_floats, take_others = _taker(floats, len(types)), _taker(others, len(types))

    def keys(statics: Sequence[object]) -> Sequence[Any]:
        keyed = _rekeyed(take_others(statics), other_rekeys)
        return (*keyed, _exact.floats_key(take_floats(statics)))

    return keys


def _pinned_bytes(array: Any) -> int:
    """The bytes that holding `array` keeps alive: a NumPy view's base's."""
    while isinstance(getattr(array, "base", None), np.ndarray):
        array = array.base
    return array.nbytes
