"""The leaves of a call whose arguments are leaves, or lists and tuples of leaves of
one type, taken without flattening it.

Flattening is most of filterjit's own cost on a call with many leaves (a list of
100 arrays: about 2.7 µs to flatten, 1.1 µs to list the leaves' types and 0.8 µs to
compare them and the structure with the latest call's, against about 1.4 µs here).
This path only ever accepts what JAX's flatten would turn into the structure and
leaf types of the latest call's partition: each argument of the exact
type recorded, each sequence an exact `list` or `tuple` of the recorded length whose
items are all of the recorded exact type, and only types that are always pytree
leaves. Anything else takes the full path. `tests/test_shallow.py` checks this
against `jax.tree_util` on generated calls.
"""

import operator
from typing import Any

import jax
import numpy as np
from jax.core import Tracer


# Types whose instances are always pytree leaves: no program registers them as
# pytree nodes.
_LEAF_BASES = (jax.Array, Tracer, np.ndarray, np.generic)
_LEAF_TYPES = (float, int, bool, complex, str)

# One argument: (its type, the type of its items or None for a leaf, its length).
Kind = tuple[type, type | None, int]


def _is_leaf_type(kind: type) -> bool:
    return kind in _LEAF_TYPES or issubclass(kind, _LEAF_BASES)


def argument_kinds(treedef: Any, types: tuple[type, ...]) -> tuple[Kind, ...] | None:
    """The kind of each argument of a call flattened to `treedef` and leaves of
    `types`, where `treedef` is the tuple of the call's positional arguments; `None`
    unless every argument is a leaf of a leaf type or a list or tuple of leaves of
    one leaf type."""
    node = treedef.node_data()
    if node is None or node[0] is not tuple:
        return None
    kinds: list[Kind] = []
    position = 0
    for child in treedef.children():
        count = child.num_leaves
        if child.num_nodes == 1 and count == 1:  # a leaf
            kind = types[position]
            if not _is_leaf_type(kind):
                return None
            kinds.append((kind, None, 1))
        else:
            node = child.node_data()
            item_types = set(types[position : position + count])
            if (
                node is None
                or node[0] not in (list, tuple)
                or child.num_nodes != count + 1  # items that are not leaves
                or len(item_types) > 1
            ):
                return None
            item = item_types.pop() if item_types else float  # empty: any type
            if not _is_leaf_type(item):
                return None
            kinds.append((node[0], item, count))
        position += count
    return tuple(kinds)


_count_of = operator.countOf


def leaves_of(args: tuple[Any, ...], kinds: tuple[Kind, ...]) -> list[Any] | None:
    """The leaves of `args`, in JAX's order, if its arguments have these `kinds`;
    else `None`."""
    if len(args) != len(kinds):
        return None
    leaves: list[Any] = []
    for arg, (kind, item, length) in zip(args, kinds):
        if type(arg) is not kind:
            return None
        if item is None:
            leaves.append(arg)
        elif len(arg) == length and _count_of(map(type, arg), item) == length:
            leaves += arg
        else:
            return None
    return leaves
