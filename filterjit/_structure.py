"""Taking the leaves of a call whose structure repeats an earlier call's, cheaply.

Most calls repeat the structure of the one before. Flattening anew and comparing
the new structure with the old costs a registry lookup per leaf and, for an
`eqx.Module`, a call of its Python flatten function, whose attribute accesses go
through `Module.__getattribute__`. For a known structure, generated code does
less: it checks each container's type and size and takes the leaves by indexing,
unpacking, and reading a Module's fields from its `__dict__`.

(`treedef.flatten_up_to` would be fast too, but where the structure differs its
error message holds the `repr` of the part that differs, and the `repr` of a jax
Array copies it to the host.)
"""

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from ._codegen import compile_function


class Keywords:
    """The pytree of a call with keyword arguments. A call without them is
    flattened as its positional arguments alone, which is cheaper; this node type
    keeps the two kinds of call from ever sharing a structure."""

    __slots__ = ("args", "kwargs")

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.args = args
        self.kwargs = kwargs


jtu.register_pytree_node(
    Keywords,
    lambda call: ((call.args, call.kwargs), None),
    lambda _, children: Keywords(*children),
)

# A function from a pytree to its leaves, or None if its structure is not the
# matcher's. Leaves are taken as they are: the caller checks their types.
Match = Callable[[Any], list[Any] | None]

_flatten = jtu.default_registry.flatten

# Beyond this many containers, checking them one by one in Python costs more than
# flattening the whole tree in C++.
_MAX_CHECKED_NODES = 256
# Beyond this many leaves taken one by one (not as part of a sequence of leaves),
# the generated code is long to compile and no faster than flattening.
_MAX_LEAF_EXPRESSIONS = 1024


# An expression for some of a tree's leaves, and how many: 1 for a leaf, or n
# for `*sequence`, the n leaves of a sequence unpacked.
Leaves = list[tuple[str, int]]


def match_lines(
    treedef: Any, namespace: dict[str, Any], miss: str, generic: bool = False
) -> tuple[list[str], Leaves]:
    """Generated code that returns `miss` unless `tree` has structure `treedef`,
    and expressions for the leaves of `tree` after it. The code may raise on a
    mismatch: run it inside `guarded`. What it refers to goes in `namespace`.

    Where every container in `treedef` is a tuple, list, dict, None, namedtuple,
    `Keywords`, `jax.tree_util.Partial` or `eqx.Module`, the code checks them one
    by one and the leaves are taken by indexing, unpacking and reading a Module's
    `__dict__`. Any other structure, or `generic=True`, gets code that flattens
    anew (to a list `l`) and compares the structures.
    """
    if not generic and treedef.num_nodes - treedef.num_leaves <= _MAX_CHECKED_NODES:
        checks: list[str] = []
        leaves = _leaves(treedef, "tree", checks, namespace, itertools.count(), miss)
        if leaves is not None and len(leaves) <= _MAX_LEAF_EXPRESSIONS:
            return checks, leaves
    namespace.update(flatten=_flatten, treedef=treedef)
    checks = ["l, found = flatten(tree)", f"if found != treedef: return {miss}"]
    return checks, [("*l", treedef.num_leaves)]


def guarded(lines: list[str], miss: str) -> list[str]:
    """`lines` in a `try` that returns `miss` on an exception: a static field's
    `==` may raise, as in comparing structures, and a Module's `__dict__` may lack
    a field."""
    return [
        "try:",
        *(f"    {line}" for line in lines),
        "except Exception:",
        f"    return {miss}",
    ]


def matcher(treedef: Any, generic: bool = False) -> Match:
    """A function from a pytree to its leaves, or None if its structure is not
    `treedef`: `match_lines` on its own. (`Partition.call` runs the same code.)"""
    namespace: dict[str, Any] = {}
    checks, leaves = match_lines(treedef, namespace, "None", generic)
    take = f"l = [{', '.join(expression for expression, _ in leaves)}]"
    body = [*guarded([*checks, take], "None"), "return l"]
    return compile_function("match", "tree", body, namespace)


def _leaves(
    treedef: Any,
    expression: str,
    checks: list[str],
    namespace: dict[str, Any],
    names: "itertools.count[int]",
    miss: str,
) -> Leaves | None:
    """Expressions for the leaves of the value of `expression`, after appending to
    `checks` the code that returns `miss` unless that value has the containers of
    `treedef`. None if a container cannot be checked in Python."""
    node = treedef.node_data()
    if node is None:  # a leaf: anything goes, the caller checks its type
        return [(expression, 1)]
    kind, auxiliary = node
    children = treedef.children()
    value = f"n{next(names)}"
    namespace[f"{value}_type"] = kind
    checks.append(f"{value} = {expression}")
    if kind is type(None):
        checks.append(f"if {value} is not None: return {miss}")
        return []
    if kind is tuple or kind is list:
        checks.append(
            f"if type({value}) is not {value}_type or len({value}) != "
            f"{len(children)}: return {miss}"
        )
        paths = [f"{value}[{i}]" for i in range(len(children))]
    elif issubclass(kind, tuple) and hasattr(kind, "_fields"):  # a namedtuple
        checks.append(f"if type({value}) is not {value}_type: return {miss}")
        paths = [f"{value}[{i}]" for i in range(len(children))]
    elif kind is dict:
        namespace[f"{value}_keys"] = frozenset(auxiliary)
        checks.append(
            f"if type({value}) is not {value}_type or {value}.keys() != "
            f"{value}_keys: return {miss}"
        )
        namespace.update({f"{value}_k{i}": key for i, key in enumerate(auxiliary)})
        paths = [f"{value}[{value}_k{i}]" for i in range(len(children))]
    elif kind is Keywords:
        checks.append(f"if type({value}) is not {value}_type: return {miss}")
        paths = [f"{value}.args", f"{value}.kwargs"]
    elif kind is jtu.Partial:
        # Its function is its auxiliary data, compared as the structure does.
        namespace[f"{value}_func"] = (auxiliary,)
        checks.append(
            f"if type({value}) is not {value}_type or ({value}.func,) != "
            f"{value}_func: return {miss}"
        )
        paths = [f"{value}.args", f"{value}.keywords"]
    else:
        layout = _module_layout(treedef)
        if layout is None:
            return None
        dynamic, static, static_values = layout
        namespace["get_dict"] = _get_dict
        namespace[f"{value}_statics"] = static_values
        checks.append(f"if type({value}) is not {value}_type: return {miss}")
        # With exactly its fields in `__dict__`, a Module has no wrapper fields
        # in its auxiliary data, which is then its static fields' values.
        checks.append(f"{value}_d = get_dict({value})")
        checks.append(
            f"if len({value}_d) != {len(dynamic) + len(static)}: return {miss}"
        )
        if static:
            fields = "".join(f"{value}_d[{name!r}], " for name in static)
            checks.append(f"if ({fields}) != {value}_statics: return {miss}")
        paths = [f"{value}_d[{name!r}]" for name in dynamic]
    sequence = issubclass(kind, tuple) or kind is list
    if sequence and children and all(c.node_data() is None for c in children):
        return [(f"*{value}", len(children))]  # leaves only: unpacked at C speed
    leaves: Leaves = []
    for child, path in zip(children, paths):
        found = _leaves(child, path, checks, namespace, names, miss)
        if found is None:
            return None
        leaves += found
    return leaves


def _get_dict(module: Any) -> dict[str, Any]:
    # Not `module.__dict__`: that goes through Module.__getattribute__.
    return object.__getattribute__(module, "__dict__")


def _module_layout(
    treedef: Any,
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[Any, ...]] | None:
    """For an `eqx.Module` node: the names of its dynamic fields (its children, in
    order), of its static fields, and the static fields' values. None for any
    other node, or a Module that Equinox does not flatten so.

    Checked on a Module rebuilt from `treedef` with placeholder leaves: its
    children must be its dynamic fields' values, and its auxiliary data those of
    its static fields after one entry for wrapper fields.
    """
    kind, auxiliary = treedef.node_data()
    if not (isinstance(kind, type) and issubclass(kind, eqx.Module)):
        return None
    try:
        fields = dataclasses.fields(kind)
        dynamic = tuple(f.name for f in fields if not f.metadata.get("static", False))
        static = tuple(f.name for f in fields if f.metadata.get("static", False))
        sample = treedef.unflatten([object() for _ in range(treedef.num_leaves)])
        values = _get_dict(sample)
        one_level = jtu.default_registry.flatten_one_level(sample)
        if one_level is None:
            return None
        children, sample_auxiliary = one_level
        static_values = tuple(values[name] for name in static)
        layout_holds = (
            len(values) == len(fields)
            and len(children) == len(dynamic)
            and all(c is values[name] for c, name in zip(children, dynamic))
            and type(auxiliary) is tuple
            and len(auxiliary) == 1 + len(static)
            and all(a is b for a, b in zip(auxiliary[1:], static_values))
            and sample_auxiliary[1:] == static_values
        )
    except Exception:  # not a dataclass, or rebuilt from placeholders
        return None
    return (dynamic, static, static_values) if layout_holds else None
