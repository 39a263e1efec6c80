"""Flattening a call again with the structure of an earlier call, cheaply.

Most calls repeat the structure of the one before. `treedef.flatten_up_to(tree)`
takes the leaves of a tree of a known structure several times faster than
`tree_flatten` followed by comparing the new structure with the old, since it
builds no structure and looks no leaf type up in the registry. But where the
structure differs it raises an error whose message holds the `repr` of the part
that differs, and the `repr` of a jax Array copies it to the host (and keeps the
copy). So `matcher` checks every container it can in generated Python first, and
uses `flatten_up_to` only where a mismatch left over is one whose message is
cheap and copies nothing.
"""

import itertools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu


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


def match_lines(
    treedef: Any,
    namespace: dict[str, Any],
    on_mismatch: Callable[[], None],
    generic: bool = False,
) -> list[str]:
    """Generated code that sets `l` to the leaves of `tree` if it has structure
    `treedef`, and returns None otherwise. What it refers to goes in `namespace`.

    Where every container in `treedef` is a tuple, list, dict, None, namedtuple,
    `Keywords`, or an `eqx.Module` whose children are all leaves, the code checks
    the containers one by one and takes the leaves with `flatten_up_to`. The one
    mismatch left to `flatten_up_to` is then in a Module's static fields, whose
    message prints the Module as Equinox does, arrays as their shapes; the code
    calls `on_mismatch`, which should stop using it. Any other structure, or
    `generic=True`, gets code that flattens anew and compares the structures.
    """
    checks: list[str] = []
    if (
        not generic
        and treedef.num_nodes - treedef.num_leaves <= _MAX_CHECKED_NODES
        and _check(treedef, "tree", checks, namespace, itertools.count())
    ):
        namespace.update(flatten_up_to=treedef.flatten_up_to, on_mismatch=on_mismatch)
        return [
            *checks,
            "try:",
            "    l = flatten_up_to(tree)",
            "except Exception:",
            "    on_mismatch()",
            "    return None",
        ]
    namespace.update(flatten=_flatten, treedef=treedef)
    return [
        "l, found = flatten(tree)",
        "try:",
        "    if found != treedef: return None",
        "except Exception:  # auxiliary data that cannot be compared",
        "    return None",
    ]


def compile_function(
    name: str, parameter: str, body: list[str], namespace: dict[str, Any]
) -> Any:
    """The function `def name(parameter): body`, its globals `namespace`."""
    source = f"def {name}({parameter}):\n" + "".join(f"    {line}\n" for line in body)
    exec(source, namespace)
    return namespace[name]


def matcher(treedef: Any, on_mismatch: Callable[[], None]) -> Match:
    """A function from a pytree to its leaves, or None if its structure is not
    `treedef`; see `match_lines`."""
    namespace: dict[str, Any] = {}
    body = [*match_lines(treedef, namespace, on_mismatch), "return l"]
    return compile_function("match", "tree", body, namespace)


def generic_matcher(treedef: Any) -> Match:
    """`matcher` that flattens and compares the structures: right for every
    pytree, and slower."""
    namespace: dict[str, Any] = {}
    body = [*match_lines(treedef, namespace, lambda: None, generic=True), "return l"]
    return compile_function("match", "tree", body, namespace)


def _check(
    treedef: Any,
    expression: str,
    lines: list[str],
    namespace: dict[str, Any],
    names: "itertools.count[int]",
) -> bool:
    """Appends to `lines` the checks that the value of `expression` has the
    containers of `treedef`. False if one cannot be checked in Python."""
    node = treedef.node_data()
    if node is None:  # a leaf: anything goes, the caller checks its type
        return True
    kind, auxiliary = node
    name = f"n{next(names)}"
    namespace[name] = kind
    lines.append(f"{name}_ = {expression}")
    value = f"{name}_"
    children = treedef.children()
    if kind is type(None):
        lines.append(f"if {value} is not None: return None")
        return True
    if kind is tuple or kind is list:
        lines.append(
            f"if type({value}) is not {name} or len({value}) != {len(children)}: "
            "return None"
        )
        paths = [f"{value}[{i}]" for i in range(len(children))]
    elif issubclass(kind, tuple) and hasattr(kind, "_fields"):  # a namedtuple
        lines.append(f"if type({value}) is not {name}: return None")
        paths = [f"{value}[{i}]" for i in range(len(children))]
    elif kind is dict:
        keys = f"{name}_keys"
        namespace[keys] = frozenset(auxiliary)
        namespace.update({f"{name}_k{i}": key for i, key in enumerate(auxiliary)})
        lines.append(
            f"if type({value}) is not {name} or {value}.keys() != {keys}: return None"
        )
        paths = [f"{value}[{name}_k{i}]" for i in range(len(children))]
    elif kind is Keywords:
        lines.append(f"if type({value}) is not {name}: return None")
        paths = [f"{value}.args", f"{value}.kwargs"]
    elif issubclass(kind, eqx.Module) and all(
        child.node_data() is None for child in children
    ):
        lines.append(f"if type({value}) is not {name}: return None")
        return True
    else:
        return False
    return all(
        _check(child, path, lines, namespace, names)
        for child, path in zip(children, paths)
    )
