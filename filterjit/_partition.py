"""Which leaves are traced, and the cache key made from the others."""

import hashlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

from ._cache import AliasDispatch
from ._codegen import compile_function
from ._output import PendingOutput
from ._structure import guarded, Leaves, match_lines
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

# A sequence of more than this many leaves is checked and split by C-level calls
# on the whole sequence; shorter ones are unpacked into locals, which is cheaper.
_UNPACKED = 16


def _take(positions: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    if len(positions) == 0:
        return lambda leaves: ()
    if len(positions) == 1:
        (position,) = positions
        return lambda leaves: (leaves[position],)
    return operator.itemgetter(*positions)


def _keys_of(
    positions: Sequence[int], rekey: Sequence[Callable[[Any], Any] | None]
) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """A function from a sequence of leaves to the keys of those at `positions`,
    `rekey[i]` applied to the i-th where given."""
    take = _take(positions)
    rekeys = [(i, k) for i, k in enumerate(rekey) if k is not None]
    if not rekeys:
        return take

    def keys(leaves: Sequence[Any]) -> list[Any]:
        found = list(take(leaves))
        for i, k in rekeys:
            found[i] = k(found[i])
        return found

    return keys


def _leaf_code(
    leaves: Leaves,
    types: tuple[type, ...],
    dynamic: frozenset[int],
    rekey: dict[int, Callable[[Any], Any]],
    namespace: dict[str, Any],
    miss: str,
) -> tuple[list[str], list[str], str, str, str]:
    """Generated code for the leaves given by `leaves` (expressions, as from
    `match_lines`): code that takes them, to run guarded; code that returns `miss`
    unless their types are `types`; and expressions for the traced leaves (as a
    call's arguments), for the cache key, and for the list of all leaves.

    It runs on every call, so it is straight-line code, such as

        a0, a1 = n1
        if type(a0) is not t0 or type(a1) is not t1: return miss

    with the traced leaves `a0, ` and the key `(owner, k1(a1), )`. A long sequence
    is checked and split whole, by C-level calls. The key starts with `owner`, an
    object hashed by identity that stands for the partition's signature.
    """

    def key(position: int, leaf: str) -> str:
        if rekey.get(position) is _float_key and types[position] is float:
            # `_float_key` written out: most static floats need no call.
            return f"({leaf}.hex() if {leaf} == 0.0 or {leaf} != {leaf} else {leaf})"
        if position in rekey:
            namespace[f"k{position}"] = rekey[position]
            return f"k{position}({leaf})"
        return leaf

    take: list[str] = []
    checks: list[str] = []
    guard: list[str] = []
    traced: list[str] = []
    keys: list[str] = []
    inputs: list[str] = []
    start = 0
    for index, (expression, count) in enumerate(leaves):
        if count == 0:
            continue
        span = range(start, start + count)
        if expression.startswith("*") and count > _UNPACKED:
            sequence = f"s{index}"
            take.append(f"{sequence} = {expression[1:]}")
            span_types = types[start : start + count]
            if len(set(span_types)) == 1:
                namespace[f"{sequence}_type"] = span_types[0]
                guard.append(
                    f"if countOf(map(type, {sequence}), {sequence}_type) != {count}: "
                    f"return {miss}"
                )
            else:
                namespace[f"{sequence}_types"] = span_types
                guard.append(
                    f"if tuple(map(type, {sequence})) != {sequence}_types: "
                    f"return {miss}"
                )
            inside = [p - start for p in span if p in dynamic]
            if len(inside) == count:
                traced.append(f"*{sequence}")
            elif inside:
                namespace[f"{sequence}_traced"] = _take(inside)
                traced.append(f"*{sequence}_traced({sequence})")
            outside = [p - start for p in span if p not in dynamic]
            if len(outside) == count and not any(p in rekey for p in span):
                keys.append(f"*{sequence}")
            elif outside:
                rekeys = [rekey.get(start + p) for p in outside]
                namespace[f"{sequence}_keys"] = _keys_of(outside, rekeys)
                keys.append(f"*{sequence}_keys({sequence})")
            inputs.append(f"*{sequence}")
        else:
            if expression.startswith("*"):
                names = "".join(f"a{p}, " for p in span)
                take.append(f"{names}= {expression[1:]}")
            else:
                take.append(f"a{start} = {expression}")
            for p in span:
                namespace[f"t{p}"] = types[p]
                checks.append(f"type(a{p}) is not t{p}")
                (traced if p in dynamic else keys).append(
                    f"a{p}" if p in dynamic else key(p, f"a{p}")
                )
                inputs.append(f"a{p}")
        start += count
    if checks:
        guard.insert(0, f"if {' or '.join(checks)}: return {miss}")
    return (
        take,
        guard,
        ", ".join(traced),
        f"(owner, {''.join(f'{k}, ' for k in keys)})",
        f"[{', '.join(inputs)}]",
    )


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
        # What the generated code refers to.
        namespace: dict[str, Any] = {
            "owner": self.key_owner,
            "countOf": operator.countOf,
            "MISS": MISS,
            "pending": PendingOutput,
            "alias": AliasDispatch,
        }
        dynamic = frozenset(dynamic_positions)
        # `split(leaves)` gives the traced leaves and the cache key: `key_owner`
        # and the keys of the static leaves. None if a leaf's type is not in
        # `types`, which it checks.
        take, guard, traced, key, _ = _leaf_code(
            [("*l", len(types))], types, dynamic, rekey, namespace, "None"
        )
        body = [*take, *guard, f"return ({traced}{',' if traced else ''}), {key}"]
        self.split: Split = compile_function("split", "l", body, namespace)
        # `call(tree, get)` is the whole of a call that repeats the structure and
        # leaf types of the call this partition was made for: it takes the leaves
        # of the call's pytree (see `match_lines`), checks their types, looks the
        # jitted function up with `get` and calls it. `MISS` if any step fails.
        checks, leaves = match_lines(treedef, namespace, "MISS")
        take, guard, traced, key, inputs = _leaf_code(
            leaves, types, dynamic, rekey, namespace, "MISS"
        )
        body = [
            *guarded([*checks, *take], "MISS"),
            *guard,
            # An unhashable static value: the slow path says which.
            *guarded([f"jitted = get({key})"], "MISS"),
            "if jitted is None or type(jitted) is alias: return MISS",
            f"out = jitted({traced})",
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
