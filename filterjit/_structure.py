"""What a nested call's function sees of its arguments: the caller's own objects.
JAX sorts dicts' keys and rebuilds every container; undecorated, a function sees
dicts (and `**kwargs`) in insertion order and the caller's own containers. So a
nested call is keyed also by its dicts' orders (`dict_orders`), and its function
gets the caller's arguments, only traced leaves replaced (`replace_leaves`)."""

import collections
import itertools
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TYPE_CHECKING

import jax.tree_util as jtu

from ._leaves import is_leaf_type


if TYPE_CHECKING:
    # jaxlib ships no type stubs, so to pyright `jax.tree_util.PyTreeDef` is a
    # variable of unknown type, which no annotation may name. So pyright checks
    # these against what filterjit uses of it; at run time, and for readers, it is
    # JAX's class itself.
    class PyTreeDef(Protocol):
        @property
        def num_leaves(self) -> int: ...
        @property
        def num_nodes(self) -> int: ...
        def children(self) -> "list[PyTreeDef]": ...
        # `(type, data)`, or `None` for a leaf: `Any`, as callers that know a
        # node is no leaf unpack it as it is.
        def node_data(self) -> Any: ...
        def unflatten(self, leaves: Iterable[object], /) -> Any: ...
        def flatten_up_to(self, tree: object, /) -> list[Any]: ...
        def __getstate__(self) -> tuple[object, list[tuple[Any, ...]]]: ...
else:
    from jax.tree_util import PyTreeDef

# The dicts whose flatten sorts their keys (an `OrderedDict` keeps its order).
_SORTED_DICTS = (dict, collections.defaultdict)


def _children(node: object) -> tuple[list[Any], PyTreeDef] | None:
    """`node`'s children and the structure that rebuilds it, or `None` for a leaf."""
    children, structure = jtu.tree_flatten(node, is_leaf=lambda x: x is not node)
    if structure.num_nodes == 1 and structure.num_leaves == 1:
        return None
    return children, structure


def _like(node: Any, values: dict[object, object]) -> Any:
    """`values` as a dict of `node`'s type, a sorted dict."""
    if type(node) is dict:
        return values
    return collections.defaultdict(node.default_factory, values)


def _rebuilt(tree: Any, children: list[Any], new: list[Any], rebuild: PyTreeDef) -> Any:
    """`tree` with its children `children` replaced by `new`: itself where none
    changed; a dict keeps its order, which JAX's rebuild sorts."""
    if all(map(operator.is_, new, children)):
        return tree
    rebuilt = rebuild.unflatten(new)
    if type(tree) in _SORTED_DICTS:
        return _like(tree, {key: rebuilt[key] for key in tree})
    return rebuilt


# Structures nested deeper than this are walked by JAX alone (it takes any depth):
# what a nested call's function gets is JAX's rebuild, not the caller's containers.
MAX_DEPTH = 100


def shape_of(treedef: PyTreeDef) -> tuple[bool, bool]:
    """Whether a structure holds a dict whose flatten sorts its keys, and whether
    it is nested deeper than `MAX_DEPTH`; without recursion."""
    sorted_dicts = False
    pending = [(treedef, 0)]
    while pending:
        node, depth = pending.pop()
        if depth > MAX_DEPTH:
            return sorted_dicts, True
        data = node.node_data()  # `None` for a leaf, which has no children
        if data is not None and data[0] in _SORTED_DICTS:
            sorted_dicts = True
        pending += [(child, depth + 1) for child in node.children()]
    return sorted_dicts, False


def dict_orders(
    tree: Any, skip: frozenset[int] = frozenset()
) -> tuple[tuple[Any, ...], ...]:
    """The keys of each dict in `tree` in insertion order, dict by dict, depth first;
    not inside the nodes whose ids are in `skip`."""
    orders: list[tuple[Any, ...]] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        kind = type(node)
        if node is None or is_leaf_type(kind) or id(node) in skip:
            continue
        if kind in _SORTED_DICTS:
            orders.append(tuple(node))
            pending += reversed(node.values())
        elif kind is list or kind is tuple:
            pending += reversed(node)
        elif (found := _children(node)) is not None:
            pending += reversed(found[0])
    return tuple(orders)


def restore_orders(
    tree: Any, orders: Iterable[tuple[object, ...]], skip: frozenset[int] = frozenset()
) -> Any:
    """`tree`, rebuilt by JAX from one whose `dict_orders` (with `skip`) were
    `orders`, so ordered; the nodes whose ids are in `skip` as they are."""
    orders = iter(orders)  # one iterator through the recursion (`iter` of it is it)
    kind = type(tree)
    if tree is None or is_leaf_type(kind) or id(tree) in skip:
        return tree
    if kind in _SORTED_DICTS:
        keys = next(orders)
        return _like(
            tree, {key: restore_orders(tree[key], orders, skip) for key in keys}
        )
    if kind is list or kind is tuple:
        return kind(restore_orders(child, orders, skip) for child in tree)
    if (found := _children(tree)) is None:
        return tree
    children, structure = found
    return structure.unflatten(
        [restore_orders(child, orders, skip) for child in children]
    )


def replace_leaves(
    tree: Any,
    replace: Callable[[int, object], object],
    count: Iterator[int] | None = None,
) -> Any:
    """`tree` with each leaf replaced by `replace(position, leaf)`, in JAX's order:
    an unchanged node (`is`) is `tree`'s own; a changed dict keeps its order.
    (`count`: the positions, through the recursion.)"""
    count = itertools.count() if count is None else count
    if tree is None:
        return None
    if not is_leaf_type(type(tree)):  # else asked of JAX
        found = _children(tree)
        if found is not None:
            children, structure = found
            new = [replace_leaves(child, replace, count) for child in children]
            return _rebuilt(tree, children, new, structure)
    return replace(next(count), tree)


def container_nodes(tree: object) -> list[Any]:
    """`tree`'s nodes that are not leaves, depth first in JAX's order (its root
    first), without recursion: two trees of one structure list theirs alike."""
    found: list[Any] = []
    pending = [tree]
    while pending:
        node = pending.pop()
        if is_leaf_type(type(node)):
            continue
        children = _children(node)
        if children is None:
            continue
        found.append(node)
        pending += reversed(children[0])
    return found


def hand_back(
    output: object, view: PyTreeDef, handed: dict[int, int], nodes: Sequence[object]
) -> Any:
    """`output` with the subtrees at the leaves `handed` of the structure `view`
    (a prefix of `output`'s) replaced by `nodes[handed[position]]`: the caller's
    own containers, which the function handed back. Unchanged nodes are `output`'s
    own, and a changed dict keeps its order."""
    count = itertools.count()

    def walk(tree: Any, structure: PyTreeDef) -> Any:
        if structure.node_data() is None:  # a leaf of the view
            node = handed.get(next(count))
            return tree if node is None else nodes[node]
        found = _children(tree)
        if found is None:
            return tree
        children, rebuild = found
        new = [walk(c, s) for c, s in zip(children, structure.children())]
        return _rebuilt(tree, children, new, rebuild)

    return walk(output, view)


def _aux_data_public(treedef: PyTreeDef) -> list[Any]:
    found: list[Any] = []
    data = treedef.node_data()
    if data is not None:
        for child in treedef.children():
            found += _aux_data_public(child)
        if data[1] is not None:
            found.append(data[1])
    return found


def _aux_data_private(treedef: PyTreeDef) -> list[Any]:
    # The pickled state lists the nodes, children first, as (kind, arity, node
    # data, ...), in one call rather than two per node. Kinds 5 and 6 (dicts,
    # registered nodes) are the ones with data of the user's.
    nodes = treedef.__getstate__()[1]
    return [node[2] for node in nodes if node[0] >= 5 and node[2] is not None]


def _choose_aux_data() -> Callable[[PyTreeDef], list[Any]]:
    probe = jtu.tree_structure([{"a": 1, "b": (None, 2)}, jtu.Partial(len, 3), ()])
    try:
        if _aux_data_private(probe) == _aux_data_public(probe):
            return _aux_data_private
    except Exception:
        pass
    return _aux_data_public


# `aux_data(treedef)`: the auxiliary data of its nodes that have some, children first.
aux_data = _choose_aux_data()
