"""Which leaves are traced, and the cache key made from the others."""

import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from ._structure import compile_function, match_lines
from ._trace import STAGED


# Not a trace level: the level of `lower`, `trace` and `eval_shape`, which take
# ShapeDtypeStructs in place of arrays.
ABSTRACT = 3


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)

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
        filterjit.is_array(jnp.ones(3))    # True
        filterjit.is_array(np.float32(1))  # True
        filterjit.is_array(1.0)            # False
        ```
    """
    return isinstance(element, _ARRAY_TYPES)


# Static leaves are keyed by value, and the partition they belong to is keyed by
# their types, so `1`, `1.0` and `True` are told apart. Two kinds of value need
# more than `==`: floats (`0.0 == -0.0`, `nan != nan`) and, inside a staged trace,
# the concrete arrays that become constants of the nested program.


def _float_key(x: float) -> float | str:
    # Only the two cases `==` gets wrong need the (slower) exact key.
    return x.hex() if x == 0.0 or x != x else x


def _complex_key(x: complex) -> tuple[str, str]:
    return x.real.hex(), x.imag.hex()


def _ndarray_key(x: np.ndarray) -> tuple[Any, ...]:
    data = x.tobytes()
    if len(data) > _INLINE_BYTES:
        data = hashlib.blake2b(data, digest_size=20).digest()
    return x.shape, x.dtype, data


def _generic_key(x: np.generic) -> tuple[Any, ...]:
    return x.dtype, x.tobytes()


def _identity_key(x: jax.Array) -> int:
    # jax Arrays are immutable, and a cache entry holds its arrays alive, so the
    # id cannot be reused while the key exists. Keying by value would copy the
    # array to the host on every nested call.
    return id(x)


# `split(leaves)`: (traced leaves, cache key), or None if a leaf's type is not the
# partition's.
Split = Callable[[Sequence[Any]], tuple[Sequence[Any], tuple[Any, ...]] | None]
# `take(tree)`: (leaves, traced leaves, cache key), or None if the tree's structure
# or a leaf's type is not the partition's.
Take = Callable[[Any], tuple[list[Any], Sequence[Any], tuple[Any, ...]] | None]

# Up to this many leaves, `split` checks their types one by one in generated code;
# beyond, it compares a tuple of them, which is faster per leaf.
_INLINE_TYPES = 16
# Beyond this many runs of consecutive positions, a C-level itemgetter takes the
# leaves instead of generated code.
_INLINE_RUNS = 64


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive positions as (start, stop) ranges."""
    runs: list[tuple[int, int]] = []
    for position in positions:
        if runs and runs[-1][1] == position:
            runs[-1] = (runs[-1][0], position + 1)
        else:
            runs.append((position, position + 1))
    return runs


def _gather(runs: list[tuple[int, int]]) -> list[str]:
    """Expressions for the leaves at these runs: an index for a single leaf, an
    unpacked slice for several (a slice copies at C speed)."""
    return [
        f"l[{start}]" if stop - start == 1 else f"*l[{start}:{stop}]"
        for start, stop in runs
    ]


def _split_code(
    types: tuple[type, ...],
    dynamic_positions: Sequence[int],
    static_positions: Sequence[int],
    rekey: dict[int, Callable[[Any], Any]],
    key_owner: object,
    namespace: dict[str, Any],
) -> tuple[list[str], str]:
    """Generated code that returns None if the types of the leaves `l` are not
    `types`, and an expression for (traced leaves, cache key).

    It runs on every call, so it is straight-line code, such as

        a0, a1 = l
        if type(a0) is not t0 or type(a1) is not t1: return None

    and `(a0,), (owner, k1(a1))`, with no loop and no intermediate list. The key
    starts with `key_owner`, an object hashed by identity that stands for the
    partition's signature. What the code refers to goes in `namespace`.
    """
    namespace.update(owner=key_owner)
    for position, function in rekey.items():
        namespace[f"k{position}"] = function

    def key(position: int, leaf: str) -> str:
        if rekey.get(position) is _float_key and types[position] is float:
            # `_float_key` written out: most static floats need no call.
            return f"({leaf}.hex() if {leaf} == 0.0 or {leaf} != {leaf} else {leaf})"
        return f"k{position}({leaf})" if position in rekey else leaf

    if len(types) <= _INLINE_TYPES:
        # Few leaves: unpacked into locals, which is cheaper than indexing each.
        body = []
        if types:
            body.append("".join(f"a{p}, " for p in range(len(types))) + "= l")
            checks = [f"type(a{p}) is not t{p}" for p in range(len(types))]
            body.append(f"if {' or '.join(checks)}: return None")
            namespace.update({f"t{p}": kind for p, kind in enumerate(types)})
        dynamic = "".join(f"a{p}, " for p in dynamic_positions)
        statics = "".join(f"{key(p, f'a{p}')}, " for p in static_positions)
        return body, f"({dynamic}), (owner, {statics})"

    # Many leaves: their types compared as a tuple, and runs of consecutive leaves
    # taken as slices, both at C speed.
    namespace.update(
        types=types,
        take_dynamic=_take(dynamic_positions),
        take_static=_take(static_positions),
        rekeys=tuple((static_positions.index(p), k) for p, k in rekey.items()),
    )
    body = ["if tuple(map(type, l)) != types: return None"]
    dynamic_runs = _runs(dynamic_positions)
    if len(dynamic_runs) > _INLINE_RUNS:
        dynamic = "take_dynamic(l)"
    elif len(dynamic_runs) == 1:
        start, stop = dynamic_runs[0]
        dynamic = f"l[{start}:{stop}]"  # a list: the wrapper only unpacks it
    else:
        dynamic = "(" + "".join(f"{x}, " for x in _gather(dynamic_runs)) + ")"
    static_runs = _runs(static_positions)
    if len(static_runs) + len(rekey) > _INLINE_RUNS:
        body.append("keys = list(take_static(l))")
        if rekey:
            body.append("for i, k in rekeys: keys[i] = k(keys[i])")
        return body, f"{dynamic}, (owner, *keys)"
    statics = []
    for start, stop in static_runs:
        plain: list[int] = []
        for position in range(start, stop):
            if position in rekey:
                statics += _gather(_runs(plain))
                plain = []
                statics.append(key(position, f"l[{position}]"))
            else:
                plain.append(position)
        statics += _gather(_runs(plain))
    return body, f"{dynamic}, (owner, {''.join(f'{x}, ' for x in statics)})"


def _take(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    if len(positions) == 0:
        return lambda leaves: ()
    if len(positions) == 1:
        (position,) = positions
        return lambda leaves: (leaves[position],)
    return operator.itemgetter(*positions)


class Partition:
    """How to split the leaves of one pytree structure with one sequence of leaf
    types, at one trace level: which are traced, and how the others are keyed.

    Built once per (structure, types, level) and cached, so that a call costs one
    call of generated straight-line code instead of a Python loop over its leaves.
    Partitions with one signature (see below) share their `key_owner`, so that
    their cache keys are equal. Hashed by identity.
    """

    __slots__ = (
        "treedef",
        "signature",
        "static_types",
        "dynamic_positions",
        "static_positions",
        "array_positions",
        "key_owner",
        "split",
        "take",
    )

    def __init__(
        self,
        treedef: Any,
        types: tuple[type, ...],
        level: int,
        key_owner: object | None = None,
    ):
        staged = level == STAGED
        # Lowering ahead of time takes ShapeDtypeStructs in place of arrays.
        traced_types = (
            (Tracer,)
            if staged
            else (*_ARRAY_TYPES, Tracer, jax.ShapeDtypeStruct)
            if level == ABSTRACT
            else (*_ARRAY_TYPES, Tracer)
        )
        self.treedef = treedef
        self.static_types = tuple(t for t in types if not issubclass(t, traced_types))
        dynamic_positions = []
        static_positions = []
        array_positions = []
        rekey: dict[int, Callable[[Any], Any]] = {}
        for position, kind in enumerate(types):
            if issubclass(kind, traced_types):
                dynamic_positions.append(position)
                continue
            static_positions.append(position)
            if staged and issubclass(kind, _ARRAY_TYPES):
                array_positions.append(position)
            # np.generic before float: np.float64 subclasses float.
            if staged and issubclass(kind, np.ndarray):
                rekey[position] = _ndarray_key
            elif staged and issubclass(kind, np.generic):
                rekey[position] = _generic_key
            elif staged and issubclass(kind, jax.Array):
                rekey[position] = _identity_key
            elif issubclass(kind, float):
                rekey[position] = _float_key
            elif issubclass(kind, complex):
                rekey[position] = _complex_key
        self.dynamic_positions: tuple[int, ...] = tuple(dynamic_positions)
        self.static_positions: tuple[int, ...] = tuple(static_positions)
        self.array_positions: tuple[int, ...] = tuple(array_positions)
        # What the partition does, whatever the types of its traced leaves: two
        # partitions with one signature are interchangeable (a NumPy array where a
        # jax Array was must not make a new trace).
        self.signature = (treedef, self.dynamic_positions, self.static_types)
        self.key_owner = object() if key_owner is None else key_owner
        namespace: dict[str, Any] = {}
        lines, result = _split_code(
            types, dynamic_positions, static_positions, rekey, self.key_owner, namespace
        )
        # `split(leaves)` gives the traced leaves and the cache key: `key_owner`
        # and the keys of the static leaves. None if a leaf's type is not in
        # `types`, which it checks.
        self.split: Split = compile_function(
            "split", "l", [*lines, f"return {result}"], namespace
        )
        # `take(tree)` gives the leaves too, from the call's pytree, or None if
        # its structure is not `treedef` (see `match_lines`): the whole of the
        # latest-call path in one call.
        self.take: Take = compile_function(
            "take",
            "tree",
            [*match_lines(treedef, namespace), *lines, f"return l, {result}"],
            namespace,
        )

    def statics(self, leaves: Sequence[Any]) -> tuple[Any, ...]:
        """The keys of the static leaves (leaves of this partition's types)."""
        split = self.split(leaves)
        assert split is not None, "leaves of other types than the partition's"
        return split[1][1:]

    def alias_pattern(self, leaves: Sequence[Any]) -> tuple[int, ...]:
        """Which static leaves are one object: for each, the index of the first
        static leaf that is the same object."""
        ids = [id(leaves[position]) for position in self.static_positions]
        return tuple(map(ids.index, ids))

    def roles(self, count: int) -> list[str]:
        """What happens to each of `count` leaves: "traced", "concrete" (an array
        passed through unchanged inside a staged trace) or "static"."""
        roles = ["static"] * count
        for position in self.dynamic_positions:
            roles[position] = "traced"
        for position in self.array_positions:
            roles[position] = "concrete"
        return roles

    def captured_bytes(self, leaves: Sequence[Any]) -> int:
        """Bytes of the concrete arrays among the static leaves: what a cache
        entry for these leaves pins."""
        return sum(leaves[position].nbytes for position in self.array_positions)
