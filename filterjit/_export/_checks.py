"""A call of an export checked against what it saved: its arguments' structure and
static values, its arrays' shapes and dtypes, and its symbolic sizes."""

import dataclasses
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
from jax.core import ShapedArray, Tracer

from .._leaves import is_array
from .._partition import static_key
from . import _dims as dims
from ._names import (
    fields_of,
    is_named,
    is_namedtuple_type,
    is_state_type,
    resolve_reference,
    type_name,
)
from ._values import describe, encode, Encoding, SCALAR_TAGS, Unsavable


def is_traced(leaf: Any) -> bool:
    return is_array(leaf) or isinstance(leaf, Tracer)


# -- An argument: checked against its saved data, which names classes, not holds them.


class Difference(NamedTuple):
    """Where an argument first differs from what the export saved: `static` if in a
    static value, else in its structure; `advice`, a sentence on how to fix it."""

    where: str
    then: str  # as an error names it
    now: Any
    static: bool
    advice: str = ""


def shape_of(node: Any) -> str:
    """A node as a structure error names it: its type, and its length or keys."""
    kind = type(node).__qualname__
    if type(node) is dict:
        return f"a dict with keys {sorted(map(repr, node))}"
    if type(node) in (tuple, list):
        return f"a {kind} of length {len(node)}"
    return "an array" if is_traced(node) else f"a `{kind}`"


def _is_leaf(value: Any) -> bool:
    return value is not None and jtu.treedef_is_leaf(jtu.tree_structure(value))


def _static_data(value: Any) -> Any:
    try:
        return encode(value, "", Encoding())
    except Unsavable:
        return None


def _leaf_difference(
    then: Any, now: Any, where: str, opaque: Sequence[Any]
) -> Difference | None:
    """The difference of a static leaf `now` from the saved leaf `then`."""
    tag = then[0]
    if tag == "opaque":
        saved = opaque[then[1]]
        try:
            same = type(now) is type(saved) and static_key(now) == static_key(saved)
            same = bool(same)
        except Exception:  # an `==` that does not answer a bool: not the same
            same = False
        return None if same else Difference(where, repr(saved), now, True)
    if tag == "ref":
        if resolve_reference(then[1]) is now:
            return None
    elif _static_data(now) == then:
        return None
    structure = not _is_leaf(now) and tag in SCALAR_TAGS and tag != "none"
    return Difference(where, describe(then), now, not structure)


def difference(
    then: Any, now: Any, where: str, opaque: Sequence[Any]
) -> Difference | None:
    """The first difference of a value `now` from the saved data `then`."""
    tag = then[0]
    if tag == "static":  # held as it is, arrays included: compared as a whole
        return _leaf_difference(then[1], now, where, opaque)
    if tag == "traced" or is_traced(now):
        if tag == "traced" and is_traced(now):
            return None  # arrays are checked leaf by leaf
        leaf_then = tag not in ("tuple", "list", "dict", "node", "state")
        static = _is_leaf(now) if tag == "traced" else leaf_then
        return Difference(where, describe(then), now, static)
    children: list[tuple[str, Any, Any]] = []
    if tag in ("tuple", "list"):
        if type(now) is not {"tuple": tuple, "list": list}[tag] or len(now) != len(
            then[1]
        ):
            return Difference(where, describe(then), now, False)
        children = [(f"[{i}]", a, b) for i, (a, b) in enumerate(zip(then[1], now))]
    elif tag == "dict":
        if type(now) is not dict:
            return Difference(where, describe(then), now, False)
        saved = {json.dumps(k): (k, v) for k, v in then[1]}
        found = {json.dumps(_static_data(k)): k for k in now}
        if set(saved) != set(found):
            return Difference(where, describe(then), now, False)
        children = [
            (f"[{found[k]!r}]", saved[k][1], now[found[k]]) for k in sorted(saved)
        ]
    elif tag == "node":
        kind = type(now)
        is_node = is_namedtuple_type(kind) or (
            dataclasses.is_dataclass(now) and not isinstance(now, type)
        )
        fields = [field for field, _ in then[2]]
        if is_node and not is_named(kind, then[1]) and _short(kind) == _short(then[1]):
            return _other_module(where, then[1], now)
        if not is_node or not is_named(kind, then[1]) or fields_of(kind) != fields:
            return Difference(where, describe(then), now, False)
        children = [(f".{f}", item, getattr(now, f)) for f, item in then[2]]
    elif tag == "state":
        if not is_state_type(type(now)):
            return Difference(where, "an `eqx.nn.State`", now, False)
        values, keys = now.tree_flatten()
        if _static_data(keys) != then[1] or len(values) != len(then[2]):
            return Difference(where, "another `eqx.nn.State`", now, False)
        children = [(f"[{i}]", a, b) for i, (a, b) in enumerate(zip(then[2], values))]
    else:
        return _leaf_difference(then, now, where, opaque)
    for step, a, b in children:
        if (found_difference := difference(a, b, where + step, opaque)) is not None:
            return found_difference
    return None


def _short(kind: type | str) -> str:
    return (kind if isinstance(kind, str) else type_name(kind)).rpartition(".")[2]


def _other_module(where: str, saved: str, now: Any) -> Difference:
    """A class of the saved class's name from another module (a class saved from
    a script, `__main__.Net`, called with `mypkg.Net`)."""
    name, short = type_name(type(now)), _short(saved)
    advice = (
        f" The export saved a `{saved}`, and `{where}` is a `{name}`: if they are "
        "one class, moved to another module, register it under the saved name "
        f"before calling: `filterjit.register_serializable({short}, "
        f"name={saved!r})`."
    )
    return Difference(where, f"a `{saved}`", now, False, advice)


# -- Arrays: their shapes and dtypes, and the symbolic sizes they give.


def check_aval(
    fun_name: str,
    label: str,
    leaf: Any,
    aval: ShapedArray,
    sizes: list[tuple[str, int, Any]],
) -> None:
    found = jax.typeof(leaf)
    shape, dtype = found.shape, found.dtype  # pyright: ignore[reportAttributeAccessIssue]
    fits = len(shape) == len(aval.shape) and all(
        not isinstance(expected, int) or size == expected
        for size, expected in zip(shape, aval.shape)
    )
    if not fits or dtype != aval.dtype:
        raise TypeError(
            f"{fun_name}: argument `{label}` is an array of {dtype}{list(shape)}, but "
            f"the export was made for {aval.str_short()}. Pass an array of that "
            "shape and dtype, or export again."
        )
    for axis, (size, expected) in enumerate(zip(shape, aval.shape)):
        # A symbolic size (the loaded export exported again) is JAX's to check.
        if not isinstance(expected, int) and isinstance(size, int):
            sizes.append((f"{label}.shape[{axis}]", size, expected))


def check_sizes(fun_name: str, sizes: list[tuple[str, int, Any]]) -> None:
    """Raises, naming the arguments, unless a call's sizes give each symbolic
    dimension one value: the dimensions' values are read where the export has a
    dimension alone (`b`), or solved where an expression holds one unknown
    (`2*b`); then every expression must give the size it stands for."""
    values: dict[str, tuple[int, str]] = {}  # each dimension's value, and where
    expressions: list[tuple[str, int, str, dims.Dimension]] = []
    for where, size, expected in sizes:
        text = str(expected)
        try:
            tree = dims.parse(text)
        except dims.DimensionError:
            continue  # a form this reader does not know: JAX's check names it
        if tree[0] == "sum" and len(tree[1]) == 1 and tree[1][0][0] == 1:
            ((_, product),) = tree[1]
            if len(product[1]) == 1 and product[1][0][0] == "name":
                text = product[1][0][1]
                first = values.setdefault(text, (size, where))
                if first[0] != size:
                    raise TypeError(
                        f"{fun_name}: `{where}` is {size}, but `{first[1]}` is "
                        f"{first[0]}, and the export has `{text}` for both. Pass "
                        "arrays whose sizes agree."
                    )
                continue
        expressions.append((where, size, text, tree))
    for where, size, text, tree in expressions:
        unknown = sorted(dims.names(tree) - set(values))
        if len(unknown) == 1 and not _solve(tree, unknown[0], size, values, where):
            raise TypeError(
                f"{fun_name}: `{where}` is {size}, but the export has `{text}` "
                f"there, which is {size} for no size `{unknown[0]}` (an integer, at "
                "least 1). Pass arrays whose sizes agree."
            )
    for where, size, text, tree in expressions:
        env = {name: value for name, (value, _) in values.items()}
        if not dims.names(tree) <= set(env):
            continue  # dimensions no size determines: JAX's own check names them
        try:
            found = dims.evaluate(tree, env)
        except ZeroDivisionError:
            continue  # JAX's own check names it
        if found != size:
            given = ", ".join(
                f"`{name}` = {values[name][0]} (from `{values[name][1]}`)"
                for name in sorted(dims.names(tree))
            )
            raise TypeError(
                f"{fun_name}: `{where}` is {size}, but the export has `{text}` "
                f"there, which is {found} with {given}. Pass arrays whose sizes "
                "agree."
            )


def _solve(
    tree: dims.Dimension,
    name: str,
    size: int,
    values: dict[str, tuple[int, str]],
    where: str,
) -> bool:
    """Records `name`, the one unknown of the expression at `where`, where it is
    linear in it (`2*b + 1`): `False` if no value gives `size`; `True` else."""
    env = {known: value for known, (value, _) in values.items()}
    try:
        at_0 = dims.evaluate(tree, {**env, name: 0})
        slope = dims.evaluate(tree, {**env, name: 1}) - at_0
        linear = dims.evaluate(tree, {**env, name: 2}) - at_0 == 2 * slope
    except ZeroDivisionError:
        return True
    if slope == 0 or not linear:
        return True
    value = (size - at_0) // slope
    if (size - at_0) % slope != 0 or value < 1:
        return False
    try:
        if dims.evaluate(tree, {**env, name: value}) == size:
            values[name] = (value, where)
    except ZeroDivisionError:
        pass
    return True
