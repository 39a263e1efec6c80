"""The leaves of a call taken without flattening it, when its arguments have the
structure and leaf types of the latest call's partition.

Flattening is most of filterjit's own cost on a repeated call: a list of 100 arrays
takes about 2.7 µs to flatten, 1.1 µs to list the leaves' types and 0.8 µs to
compare them and the structure with the latest call's, against about 1.4 µs here;
an `eqx.Module` with ten array fields takes about 2.1 µs through Equinox's flatten,
against 0.5 µs here.

A reader is made once per partition from its structure (read with `node_data()` and
`children()`) and leaf types. It accepts only what JAX's flatten would turn into
that structure and those leaf types, and takes the leaves in JAX's order:

- a leaf of the exact type recorded, where that type is always a pytree leaf;
- an exact `list`, `tuple` or namedtuple of the recorded length, item by item (all
  at once where every item is a leaf), a `dict` with the recorded string keys, or
  `None`;
- an `eqx.Module` of the exact class recorded, whose `__dict__` holds exactly its
  fields, whose static fields equal the recorded ones (as the structures'
  comparison has it, and of the same types: see `_exact`) and whose other fields
  are read as above.

A reader is straight-line generated code. A call that needs binding (keyword
arguments, defaults) is read as it was made (`bound_call_reader`): each bound
argument where it comes from, an immutable default's leaves (a tuple of
scalars, say) taken once, as constants.

How Equinox flattens a class, and that JAX flattens a namedtuple class as a
namedtuple, are checked against JAX once per class, on a probe instance.

Anything else (dicts with other keys, other registered nodes, namedtuples that
have a registration of their own, other leaf types) makes no reader, and every
call takes the full path. `tests/test_shallow.py` checks this against
`jax.tree_util` on generated calls.
"""

import dataclasses
import itertools
import operator
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.core import Tracer

from ._binding import Source, Sources
from ._codegen import compile_function
from ._exact import exact_key
from ._function import Keywords


# Types whose instances are always pytree leaves: no program registers them as
# pytree nodes.
_LEAF_BASES = (jax.Array, Tracer, np.ndarray, np.generic)
_LEAF_TYPES = frozenset(
    {
        float,
        int,
        bool,
        complex,
        str,
        bytes,
        frozenset,  # optimistix's `tags`
        # What a Module's activation fields hold.
        types.FunctionType,
        types.BuiltinFunctionType,
        jax.custom_jvp,
        jax.custom_vjp,
        type(jax.jit(lambda: None)),
    }
)

# `read(tree)`: the leaves of a call's pytree (its positional arguments, or a
# `Keywords` for a call with keyword arguments), or `None`.
CallReader = Callable[[Any], list[Any] | None]
# `read(fun, args, kwargs)`: the same, of a call as it was made.
BoundCallReader = Callable[[Any, tuple[Any, ...], dict[str, Any]], list[Any] | None]

_count_of = operator.countOf
_dict_of = object.__getattribute__  # not a Module's own `__getattribute__`


def is_leaf_type(kind: type) -> bool:
    """Whether instances of `kind` are always pytree leaves."""
    return kind in _LEAF_TYPES or issubclass(kind, _LEAF_BASES)


def call_reader(treedef: Any, types: tuple[type, ...]) -> CallReader | None:
    """The reader of calls flattened to `treedef` (the tuple of a call's positional
    arguments) with leaves of `types`; `None` where some part of it has none."""
    node = treedef.node_data()
    if node is None:
        return None
    if (
        node[0] is tuple
        and treedef.num_nodes == len(types) + 1
        and all(map(is_leaf_type, types))
    ):
        # Every argument a leaf: one comparison of their types.
        def read_leaves(args: Any) -> list[Any] | None:
            if type(args) is not tuple or tuple(map(type, args)) != types:
                return None
            return list(args)

        return read_leaves
    return _Writer().reader("read", "tree", treedef, types)


def bound_call_reader(
    treedef: Any, types: tuple[type, ...], fun_is_leaf: bool, sources: Sources
) -> BoundCallReader | None:
    """The reader of calls of one shape (see `_binding`) as `call_reader` reads them
    bound, but from the call itself, `read(fun, args, kwargs)`, without binding
    it: each bound argument is read where it comes from. A default, the same
    object every call, is read once, here where it is immutable (a tuple of
    leaves): its leaves are constants; a list, dict or Module default is read
    on every call, since it may have been changed in place."""
    writer = _Writer()
    leaves = writer.call(treedef, types, fun_is_leaf, sources)
    return writer.compile("read_call", "f, a, k", leaves)


class _Writer:
    """Writes a reader as straight-line code: a check per node and a variable per
    value, the leaves gathered in one list at the end. (A reader made of one closure
    per node costs a call per node; for a `diffrax.diffeqsolve` call that was 8 µs
    of 10.)"""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.namespace: dict[str, Any] = {"_count_of": _count_of}
        self.names = itertools.count()

    def reader(
        self, name: str, parameter: str, treedef: Any, types: tuple[type, ...]
    ) -> Any:
        """The function `name(parameter)` that reads a value flattened to
        `treedef`: its leaves, or `None` (also where it raises, for a missing
        field or a static field that cannot compare)."""
        leaves = self.node(treedef, types, parameter)
        return self.compile(name, parameter, leaves)

    def fields_reader(self, treedef: Any, types: tuple[type, ...]) -> Any:
        """The function that reads the tuple of the values of `treedef`'s
        children (a Module's dynamic fields)."""
        leaves = self.values(treedef, types, "values")
        return self.compile("read_fields", "values", leaves)

    def compile(self, name: str, parameter: str, leaves: list[str] | None) -> Any:
        if leaves is None:
            return None
        body = [
            "try:",
            *(f"    {line}" for line in self.lines),
            f"    return [{', '.join(leaves)}]",
            "except Exception:",
            "    return None",
        ]
        return compile_function(name, parameter, body, self.namespace)

    def constant(self, value: Any) -> str:
        name = f"c{next(self.names)}"
        self.namespace[name] = value
        return name

    def variable(self) -> str:
        return f"v{next(self.names)}"

    def check(self, failed: str) -> None:
        self.lines.append(f"if {failed}: return None")

    def node(self, treedef: Any, types: tuple[type, ...], x: str) -> list[str] | None:
        """Checks the value `x` against `treedef`; the expressions of its leaves,
        or `None` where it has no reader."""
        if treedef.num_nodes == 1 and len(types) == 1:
            if not is_leaf_type(types[0]):
                return None
            self.check(f"type({x}) is not {self.constant(types[0])}")
            return [x]
        kind, data = treedef.node_data()
        if kind is type(None):
            self.check(f"{x} is not None")
            return []
        count = len(treedef.children())
        if kind is list or kind is tuple or _is_namedtuple(kind):
            self.check(f"type({x}) is not {self.constant(kind)} or len({x}) != {count}")
            return self.values(treedef, types, x)
        if kind is dict and all(type(key) is str for key in data):
            # JAX takes the values in the order of the sorted keys; keys of one
            # type, strings, sort one way whatever order they were inserted in.
            # All of them there, and no other: a missing one raises.
            self.check(f"type({x}) is not dict or len({x}) != {count}")
            values, get = self.variable(), self.constant(items_getter(tuple(data)))
            self.lines.append(f"{values} = {get}({x})")
            return self.values(treedef, types, values)
        if kind is Keywords:
            self.check(f"type({x}) is not {self.constant(Keywords)}")
            values = self.variable()
            self.lines.append(f"{values} = ({x}.args, {x}.kwargs)")
            return self.values(treedef, types, values)
        if isinstance(kind, type) and issubclass(kind, eqx.Module):
            read_module = _module_reader(treedef, kind, data, types)
            if read_module is None:
                return None
            leaves = self.variable()
            self.lines.append(f"{leaves} = {self.constant(read_module)}({x})")
            self.check(f"{leaves} is None")
            return [f"*{leaves}"]
        return None

    def call(
        self, treedef: Any, types: tuple[type, ...], fun_is_leaf: bool, sources: Sources
    ) -> list[str] | None:
        """Checks a call `f, a, k` of shape `sources` against `treedef`: `(f,
        bound)` where the function is a pytree, else the bound call."""
        if fun_is_leaf:
            return self.bound(treedef, types, sources)
        data = treedef.node_data()
        if data is None or data[0] is not tuple or len(treedef.children()) != 2:
            return None
        fun, bound = treedef.children()
        found = self.node(fun, types[: fun.num_leaves], "f")
        rest = self.bound(bound, types[fun.num_leaves :], sources)
        return None if found is None or rest is None else found + rest

    def bound(
        self, treedef: Any, types: tuple[type, ...], sources: Sources
    ) -> list[str] | None:
        """A bound call: the tuple of its positional arguments, or a `Keywords`
        with it and the dict of its keyword arguments."""
        args, kwargs = sources
        data = treedef.node_data()
        if not kwargs:
            return self.sourced(treedef, types, args)
        if data is None or data[0] is not Keywords:
            return None
        positional, keyword = treedef.children()
        kind, names = keyword.node_data() or (None, ())
        if kind is not dict or sorted(kwargs) != list(names):
            return None
        found = self.sourced(positional, types[: positional.num_leaves], args)
        rest = self.children(
            keyword,
            types[positional.num_leaves :],
            [kwargs[name] for name in names],  # JAX's order: sorted
        )
        return None if found is None or rest is None else found + rest

    def sourced(
        self, treedef: Any, types: tuple[type, ...], sources: list[Source]
    ) -> list[str] | None:
        data = treedef.node_data()
        if data is None or data[0] is not tuple:
            return None
        if len(treedef.children()) != len(sources):
            return None
        return self.children(treedef, types, sources)

    def children(
        self, treedef: Any, types: tuple[type, ...], sources: list[Source]
    ) -> list[str] | None:
        leaves: list[str] = []
        position = 0
        for child, source in zip(treedef.children(), sources):
            end = position + child.num_leaves
            found = self.source(child, types[position:end], source)
            if found is None:
                return None
            leaves += found
            position = end
        return leaves

    def source(
        self, treedef: Any, types: tuple[type, ...], source: Source
    ) -> list[str] | None:
        """Checks a bound argument, read from where it comes from."""
        kind, value = source
        if kind == "default":
            read = _Writer().reader("read", "tree", treedef, types)
            taken = None if read is None else read(value)
            if taken is None:
                return None
            if not _immutable(treedef):  # a list, dict or Module: read every call
                return self.node(treedef, types, self.constant(value))
            # The same leaves every call.
            if len(taken) == 1:
                return [self.constant(taken[0])]
            return [f"*{self.constant(tuple(taken))}"] if taken else []
        x = self.variable()
        if kind == "args":
            self.lines.append(f"{x} = a[{value}]")
        else:
            self.lines.append(f"{x} = k[{self.constant(value)}]")
        return self.node(treedef, types, x)

    def values(
        self, treedef: Any, types: tuple[type, ...], values: str
    ) -> list[str] | None:
        """Checks `values`, a sequence as long as `treedef`'s children, against
        them."""
        children = treedef.children()
        if treedef.num_nodes == len(types) + 1:  # every child a leaf
            if not all(map(is_leaf_type, types)):
                return None
            if len(set(types)) == 1:  # of one type: counted at C speed
                (kind,) = set(types)
                count = len(children)
                self.check(
                    f"_count_of(map(type, {values}), {self.constant(kind)}) != {count}"
                )
            else:
                self.check(f"tuple(map(type, {values})) != {self.constant(types)}")
            return [f"*{values}"]
        names = [self.variable() for _ in children]
        if names:
            self.lines.append(f"{', '.join(names)}, = {values}")
        leaves: list[str] = []
        position = 0
        for child, name in zip(children, names):
            found = self.node(
                child, types[position : position + child.num_leaves], name
            )
            if found is None:
                return None
            leaves += found
            position += child.num_leaves
        return leaves


_namedtuples: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def _is_namedtuple(cls: type) -> bool:
    """Whether JAX flattens `cls` as a namedtuple (its items, in order) rather than
    with a registration of its own, as the text of its structure says on a probe
    instance."""
    try:
        return _namedtuples[cls]
    except KeyError:
        pass
    found = False
    try:
        # Read as a tuple: its items, with tuple's own iteration and length.
        if issubclass(cls, tuple) and all(
            getattr(cls, name) is getattr(tuple, name)
            for name in ("__iter__", "__len__", "__getitem__")
        ):
            items = [object() for _ in cls._fields]  # pyright: ignore
            treedef = jax.tree_util.tree_structure(tuple.__new__(cls, items))
            stars = ", ".join(["*"] * len(items))
            found = (
                str(treedef)
                == f"PyTreeDef(CustomNode(namedtuple[{cls.__name__}], [{stars}]))"
            )
    except Exception:  # not a namedtuple
        found = False
    _namedtuples[cls] = found
    return found


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How JAX flattens instances of an `eqx.Module` class whose `__dict__` holds
    exactly its fields: the fields that are its children, in order, and the others,
    whose values follow `head` in its node data."""

    dynamic: tuple[str, ...]
    static: tuple[str, ...]
    head: Any


_layouts: "weakref.WeakKeyDictionary[type, _Layout | None]" = (
    weakref.WeakKeyDictionary()
)


def _layout(cls: type) -> _Layout | None:
    """Equinox's layout of `cls`, as JAX's flatten of a probe instance (a sentinel
    in each field) confirms it; `None` if it does not."""
    try:
        return _layouts[cls]
    except KeyError:
        pass
    layout = None
    try:
        fields = dataclasses.fields(cls)
        dynamic = tuple(f.name for f in fields if not f.metadata.get("static", False))
        static = tuple(f.name for f in fields if f.metadata.get("static", False))
        probe = object.__new__(cls)
        sentinels = {f.name: object() for f in fields}
        _dict_of(probe, "__dict__").update(sentinels)
        leaves, treedef = jax.tree_util.default_registry.flatten(probe)
        kind, data = treedef.node_data()
        if (
            kind is cls
            and treedef.num_nodes == len(dynamic) + 1
            and len(leaves) == len(dynamic)
            and all(map(operator.is_, leaves, map(sentinels.get, dynamic)))
            and type(data) is tuple
            and len(data) == len(static) + 1
            and all(map(operator.is_, data[1:], map(sentinels.get, static)))
        ):
            layout = _Layout(dynamic, static, data[0])
    except Exception:  # an abstract class, a class that is not a dataclass
        layout = None
    _layouts[cls] = layout
    return layout


def items_getter(keys: Sequence[Any]) -> Callable[[Any], tuple[Any, ...]]:
    """`get(x)`: the tuple of `x[key]` for `keys`, at C speed where there are two
    or more."""
    if len(keys) > 1:
        return operator.itemgetter(*keys)
    if keys:
        (key,) = keys
        return lambda x: (x[key],)
    return lambda x: ()


def _module_reader(
    treedef: Any, cls: type, data: Any, types: tuple[type, ...]
) -> Callable[[Any], list[Any] | None] | None:
    """`read(obj)`: the leaves of a Module of class `cls` flattened to `treedef`,
    or `None`."""
    layout = _layout(cls)
    if (
        layout is None
        or len(treedef.children()) != len(layout.dynamic)
        or type(data) is not tuple
        or data[0] is not layout.head  # fields beyond its own (a wrapper's metadata)
    ):
        return None
    read_fields = _Writer().fields_reader(treedef, types)
    if read_fields is None:
        return None
    statics = data[1:]
    # What `==` does not see of them: `scale=1` where `scale=1.0` was recorded.
    exact = exact_key(statics)
    field_count = len(layout.dynamic) + len(layout.static)
    get_statics = items_getter(layout.static)
    get_dynamic = items_getter(layout.dynamic)

    def read(obj: Any) -> list[Any] | None:
        if type(obj) is not cls:
            return None
        fields = _dict_of(obj, "__dict__")
        if len(fields) != field_count:
            return None
        values = get_statics(fields)
        if values != statics or not (
            exact is None
            or all(map(operator.is_, values, statics))
            or exact_key(values) == exact
        ):
            return None
        return read_fields(get_dynamic(fields))

    return read


def _immutable(treedef: Any) -> bool:
    """Whether every node of `treedef` is of an immutable kind: a tuple, a
    namedtuple or `None`. Not a list or a dict, and not an `eqx.Module`: frozen is
    not immutable (`object.__setattr__`, a write to its `__dict__`)."""
    data = treedef.node_data()
    if data is None:
        return True
    kind = data[0]
    if not (kind is tuple or kind is type(None) or _is_namedtuple(kind)):
        return False
    return all(map(_immutable, treedef.children()))
