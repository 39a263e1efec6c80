"""Which leaves are traced, and the cache key made from the others."""

import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from ._cache import AliasDispatch
from ._output import PendingOutput
from ._structure import compile_function, guarded, match_lines, to_list, to_locals
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
# `call(tree, get)`: the output of the cached jitted function for a call's pytree,
# or `MISS`.
Call = Callable[[Any, Callable[[Any], Any]], Any]

# What `Partition.call` returns when it cannot serve a call.
MISS: Any = type("Miss", (), {"__repr__": lambda self: "MISS"})()

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


def _gather(runs: list[tuple[int, int]]) -> str:
    """The leaves at these runs, as elements of a tuple display or of a call's
    arguments: an index for a single leaf, an unpacked slice for several (a slice
    copies at C speed)."""
    return "".join(
        f"l[{start}], " if stop - start == 1 else f"*l[{start}:{stop}], "
        for start, stop in runs
    )


def few_leaves(count: int) -> bool:
    """Whether the generated code of a partition with `count` leaves keeps them in
    locals `a0, a1, ...` rather than in a list `l`."""
    return count <= _INLINE_TYPES


def _split_code(
    types: tuple[type, ...],
    dynamic_positions: Sequence[int],
    static_positions: Sequence[int],
    rekey: dict[int, Callable[[Any], Any]],
    key_owner: object,
    namespace: dict[str, Any],
    miss: str,
) -> tuple[list[str], str, str]:
    """Generated code that returns `miss` if the types of the leaves are not
    `types`; the traced leaves, as elements of a tuple display or of a call's
    arguments; and an expression for the cache key.

    The leaves are in locals `a0, a1, ...` if `few_leaves`, and in a list `l`
    otherwise. The code runs on every call, so it is straight-line code, such as

        if type(a0) is not t0 or type(a1) is not t1: return miss

    with the traced leaves `a0, ` and the key `(owner, k1(a1), )`: no loop and no
    intermediate list. The key starts with `key_owner`, an object hashed by
    identity that stands for the partition's signature. What the code refers to
    goes in `namespace`.
    """
    namespace.update(owner=key_owner)
    for position, function in rekey.items():
        namespace[f"k{position}"] = function

    def key(position: int, leaf: str) -> str:
        if rekey.get(position) is _float_key and types[position] is float:
            # `_float_key` written out: most static floats need no call.
            return f"({leaf}.hex() if {leaf} == 0.0 or {leaf} != {leaf} else {leaf})"
        return f"k{position}({leaf})" if position in rekey else leaf

    if few_leaves(len(types)):
        guard = []
        if types:
            checks = [f"type(a{p}) is not t{p}" for p in range(len(types))]
            guard.append(f"if {' or '.join(checks)}: return {miss}")
            namespace.update({f"t{p}": kind for p, kind in enumerate(types)})
        dynamic = "".join(f"a{p}, " for p in dynamic_positions)
        statics = "".join(f"{key(p, f'a{p}')}, " for p in static_positions)
        return guard, dynamic, f"(owner, {statics})"

    # Many leaves: their types compared as a tuple, and runs of consecutive leaves
    # taken as slices, both at C speed.
    namespace.update(
        types=types,
        take_dynamic=_take(dynamic_positions),
        take_static=_take(static_positions),
        rekeys=tuple((static_positions.index(p), k) for p, k in rekey.items()),
    )
    guard = [f"if tuple(map(type, l)) != types: return {miss}"]
    dynamic_runs = _runs(dynamic_positions)
    if len(dynamic_runs) > _INLINE_RUNS:
        dynamic = "*take_dynamic(l), "
    else:
        dynamic = _gather(dynamic_runs)
    static_runs = _runs(static_positions)
    if len(static_runs) + len(rekey) > _INLINE_RUNS:
        guard.append("keys = list(take_static(l))")
        if rekey:
            guard.append("for i, k in rekeys: keys[i] = k(keys[i])")
        return guard, dynamic, "(owner, *keys)"
    statics = ""
    for start, stop in static_runs:
        plain: list[int] = []
        for position in range(start, stop):
            if position in rekey:
                statics += _gather(_runs(plain))
                plain = []
                statics += f"{key(position, f'l[{position}]')}, "
            else:
                plain.append(position)
        statics += _gather(_runs(plain))
    return guard, dynamic, f"(owner, {statics})"


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
        "call",
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
        count = len(types)
        namespace: dict[str, Any] = {"MISS": MISS}
        split_code = (types, dynamic_positions, static_positions, rekey)
        guard, dynamic, key = _split_code(
            *split_code, self.key_owner, namespace, "None"
        )
        unpack = [f"{''.join(f'a{p}, ' for p in range(count))}= l"]
        # `split(leaves)` gives the traced leaves and the cache key: `key_owner`
        # and the keys of the static leaves. None if a leaf's type is not in
        # `types`, which it checks.
        self.split: Split = compile_function(
            "split",
            "l",
            [
                *(unpack if few_leaves(count) and count else []),
                *guard,
                f"return ({dynamic}), {key}",
            ],
            namespace,
        )
        # `call(tree, get)` is the whole of a call that repeats the structure and
        # leaf types of the call this partition was made for: it takes the leaves
        # of the call's pytree (see `match_lines`), checks their types, looks the
        # jitted function up with `get` and calls it. `MISS` if any step fails.
        namespace.update(pending=PendingOutput, alias=AliasDispatch)
        checks, leaves = match_lines(treedef, namespace, "MISS")
        guard, dynamic, key = _split_code(
            *split_code, self.key_owner, namespace, "MISS"
        )
        if few_leaves(count):
            take = to_locals(leaves)
            inputs = f"[{''.join(f'a{p}, ' for p in range(count))}]"
        else:
            take, inputs = to_list(leaves), "l"
        body = [
            *guarded([*checks, *take], "MISS"),
            *guard,
            # An unhashable static value: the slow path says which.
            *guarded([f"jitted = get({key})"], "MISS"),
            "if jitted is None or type(jitted) is alias: return MISS",
            f"out = jitted({dynamic})",
            f"return out.resolve({inputs}) if type(out) is pending else out",
        ]
        self.call: Call = compile_function("call", "tree, get", body, namespace)

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
