"""Readers: the fast path's generated code that takes a pytree's leaves in JAX's
order without flattening it (checked against `jax.tree_util` by
`tests/test_readers.py`). A reader checks on every call all that JAX's flatten
and a comparison of structures would see; else it gives `None`:

- a leaf of the exact type recorded, and where that type may yet be registered
  as a pytree node (a user's class), a leaf still (`jax.tree_util.all_leaves`);
- an exact `list`, `tuple` or namedtuple of the recorded length, a `dict` with
  the recorded keys, each a `str`, `None`;
- an `eqx.Module` of the exact class recorded, read from its `__dict__` on every
  call (frozen is not immutable), holding exactly its fields, its static fields
  equal to the recorded ones, and of the same types (see `_exact`);
- any other node (an `eqx.nn.State`, a user's registered class) flattened by JAX,
  its structure exactly the recorded one;
- each bound argument where it comes from: an immutable default (a tuple of
  leaves) taken once, as constants; any other read on every call, as it may
  have been changed in place.
"""

import dataclasses
import functools
import itertools
import linecache
import operator
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax

from ._binding import DefaultsGuard, Keywords, same_kwdefaults, Source, Sources
from ._cache import per_class
from ._exact import ATOMS, exact_aux, key as exact_key, same_exact, unchanging
from ._leaves import is_leaf_type
from ._structure import aux_data, PyTreeDef, shape_of


# Generated code is filed under the package's directory (JAX leaves its frames out
# of tracebacks), each function under a name of its own in `linecache`.
_DIRECTORY = os.path.dirname(os.path.abspath(__file__))
_counter = itertools.count()


def compile_function(
    name: str, parameters: str, body: list[str], namespace: dict[str, object]
) -> Any:
    """The function `def name(parameters): body`, with globals `namespace` (a new
    dict of its own). The source holds no user data: values are in `namespace`."""
    source = f"def {name}({parameters}):\n" + "".join(f"    {line}\n" for line in body)
    filename = os.path.join(_DIRECTORY, f"<generated {name} {next(_counter)}>")
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(namespace)
    exec(compile(source, filename, "exec"), namespace)
    function = namespace[name]
    # The source lives as long as the function: caches dropped, code gone.
    weakref.finalize(function, linecache.cache.pop, filename, None)
    return function


class Writer:
    """Writes a reader as straight-line code: a check per node and a variable per
    value, the leaves gathered in one list at the end. (A reader made of one closure
    per node costs a call per node; for a `diffrax.diffeqsolve` call that was 8 µs
    of 10.)"""

    def __init__(self, miss: str = "return None") -> None:
        # What a failed check does: the reader gives `None`; `top` leaves its loop.
        self.miss = miss
        self.lines: list[str] = []
        self.namespace: dict[str, Any] = {
            "_count_of": operator.countOf,
            "_dict_of": object.__getattribute__,  # not a Module's own
            "_exact_key": exact_key,
            "_is": operator.is_,
            "_all_leaves": jax.tree_util.all_leaves,
            "_flatten": jax.tree_util.default_registry.flatten,
            "_same_exact": same_exact,
        }
        self.names = itertools.count()
        self.counts: dict[str, int] = {}  # how many leaves each `*values` has
        self.lists: set[str] = set()  # the values that are lists (the user's)
        self.held: set[str] = set()  # tuples of immutable scalars (see `values`)

    def constant(self, value: object) -> str:
        name = f"c{next(self.names)}"
        self.namespace[name] = value
        return name

    def starred(self, values: str, count: int) -> str:
        """The leaves of a sequence of `count` of them, `*values`."""
        self.counts[f"*{values}"] = count
        return f"*{values}"

    def variable(self) -> str:
        return f"v{next(self.names)}"

    def check(self, failed: str) -> None:
        self.lines.append(f"if {failed}: {self.miss}")

    def guard(self, defaults: DefaultsGuard) -> None:
        """Checks that the function's defaults are still those read."""
        path, read, read_kw, read_kw_values = defaults
        self.check(
            f"{path}.__defaults__ is not {self.constant(read)} or "
            f"{path}.__kwdefaults__ is not {self.constant(read_kw)}"
        )
        if read_kw is not None:  # a dict, which may be changed in place
            self.check(
                f"not {self.constant(same_kwdefaults)}({path}.__kwdefaults__, "
                f"{self.constant(read_kw_values)})"
            )

    def items(self, x: str, keys: Sequence[object]) -> str:
        """A variable holding the tuple of `x[key]` for `keys`."""
        values = self.variable()
        if len(keys) > 3:  # at C speed
            taken = f"{self.constant(operator.itemgetter(*keys))}({x})"
        else:
            taken = f"({''.join(f'{x}[{self.constant(key)}], ' for key in keys)})"
        self.lines.append(f"{values} = {taken}")
        return values

    def node(
        self, treedef: PyTreeDef, types: tuple[type, ...], x: str
    ) -> list[str] | None:
        """Checks the value `x` against `treedef`; the expressions of its leaves,
        or `None` where it has no reader."""
        if treedef.num_nodes == 1 and len(types) == 1:
            self.check(f"type({x}) is not {self.constant(types[0])}")
            if not is_leaf_type(types[0]):  # a leaf until its class is registered
                self.check(f"not _all_leaves(({x},))")
            return [x]
        kind, data = treedef.node_data()
        if kind is type(None):
            self.check(f"{x} is not None")
            return []
        if kind is list or kind is tuple or _is_namedtuple(kind):
            self.check(f"type({x}) is not {self.constant(kind)}")  # length: `values`
            if kind is list:
                self.lists.add(x)
            # A tuple of immutable scalars stays what it was checked to be.
            held = kind is tuple and set(types) <= ATOMS
            return self.values(treedef, types, x, held)
        if kind is dict and all(type(key) is str for key in data):
            # JAX takes the values in sorted key order: for string keys, one order
            # whatever they were inserted in. All there, no other (a missing raises),
            # each a `str` (a `str` enum member equals its value).
            count = len(treedef.children())
            self.check(f"type({x}) is not dict or len({x}) != {count}")
            if count:
                strings = self.constant(frozenset({str}))
                self.check(f"{{*map(type, {x})}} != {strings}")
            return self.values(treedef, types, self.items(x, data))
        if kind is Keywords:
            self.check(f"type({x}) is not {self.constant(Keywords)}")
            return self.values(treedef, types, f"({x}.args, {x}.kwargs)")
        if isinstance(kind, type) and issubclass(kind, eqx.Module):
            read = self.module(treedef, types, x)
            if read is not None:
                return read
        return self.flattened(treedef, types, x)

    def flattened(
        self, treedef: PyTreeDef, types: tuple[type, ...], x: str
    ) -> list[str]:
        """Any other node (an `eqx.nn.State`, a user's registered class): flattened
        by JAX on every call, its structure equal to `treedef` and exactly so (see
        `_exact.same_exact`), its leaves of `types`."""
        recorded = aux_data(treedef)
        known = recorded if unchanging(recorded) else None
        exact = exact_aux(treedef)
        leaves, structure = self.variable(), self.variable()
        self.lines.append(f"{leaves}, {structure} = _flatten({x})")
        same = (
            f"_same_exact({structure}, {self.constant(known)}, "
            f"{self.constant(exact)}, {self.constant(hash(exact))})"
        )
        root = treedef.node_data()
        if known is not None and len(known) == 1 and root[1] is known[0]:
            # Its one node's data (a State's keys): the same objects settle it.
            data = self.constant(root[1])
            if type(root[1]) is tuple:
                settled = f"all(map(_is, {structure}.node_data()[1], {data}))"
            else:
                settled = f"{structure}.node_data()[1] is {data}"
            same = f"{settled} or {same}"
        self.check(f"{structure} != {self.constant(treedef)} or not ({same})")
        self.check(f"tuple(map(type, {leaves})) != {self.constant(types)}")
        return [self.starred(leaves, len(types))]

    def module(
        self, treedef: PyTreeDef, types: tuple[type, ...], x: str
    ) -> list[str] | None:
        """An `eqx.Module`, read from its `__dict__` on every call."""
        kind, data = treedef.node_data()
        layout = _layout(kind)
        if (
            layout is None
            or len(treedef.children()) != len(layout.dynamic)
            or type(data) is not tuple
        ):
            return None
        if data[0] is layout.plain:
            static, recorded_values = layout.static, data[1:]
        elif (
            layout.wrapper is not None
            and type(data[0]) is tuple
            and not any(value is layout.plain for value in data[0])  # all there
        ):
            static = layout.static + layout.wrapper  # the wrapped function's metadata
            recorded_values = data[1:] + data[0]
        else:
            return None
        dynamic = layout.dynamic
        self.check(f"type({x}) is not {self.constant(kind)}")
        fields = self.variable()
        self.lines.append(f"{fields} = _dict_of({x}, '__dict__')")
        self.check(f"len({fields}) != {len(dynamic) + len(static)}")
        # Each the very object recorded, where that proves it the same (then `==` is
        # true), else equal, and exactly, by the key's hash recomputed too: `scale=1`
        # is not the `scale=1.0` recorded, and an object changed in place is not the
        # one recorded. Those that may change in place (a dict) are checked apart, so
        # that the others are settled by identity.
        fixed = [i for i, value in enumerate(recorded_values) if unchanging((value,))]
        changing = [i for i in range(len(static)) if i not in fixed]
        for group in (fixed, changing):
            if group:
                names = [static[i] for i in group]
                values = tuple(recorded_values[i] for i in group)
                self._statics(fields, names, values, group is fixed)
        return self.values(treedef, types, self.items(fields, dynamic))

    def _statics(
        self,
        fields: str,
        names: list[str],
        recorded_values: tuple[object, ...],
        by_identity: bool,
    ) -> None:
        """Checks a Module's static fields `names` (read of its `__dict__`, `fields`)
        against `recorded_values`: equal, and exactly; settled at once where each is
        the very object recorded, `by_identity` (the values are `unchanging`)."""
        recorded = self.constant(recorded_values)
        if len(names) <= 4:
            taken = [f"{fields}[{self.constant(name)}]" for name in names]
            same = " and ".join(
                f"{value} is {self.constant(known)}"
                for value, known in zip(taken, recorded_values)
            )
            statics = f"({''.join(f'{value}, ' for value in taken)})"
        else:
            statics = self.items(fields, names)
            same = f"all(map(_is, {statics}, {recorded}))"
        exact = exact_key(recorded_values)
        keyed, hashed = self.constant(exact), self.constant(hash(exact))
        found = self.variable()
        differs = (
            f"{statics} != {recorded}"
            f" or hash({found} := _exact_key({statics})) != {hashed}"
            f" or {found} != {keyed}"
        )
        if by_identity:
            differs = f"not ({same}) and ({differs})"
        self.check(differs)

    def call(
        self, treedef: PyTreeDef, types: tuple[type, ...], sources: Sources
    ) -> list[str] | None:
        """Checks a call `f, a, k` of shape `sources` against `treedef`, `(f,
        bound)` for a function that is a pytree (see `bound`)."""
        if _kind(treedef) is not tuple or len(treedef.children()) != 2:
            return None
        bound = functools.partial(self.bound, sources=sources)
        return self.parts(treedef, types, [functools.partial(self.node, x="f"), bound])

    def bound(
        self, treedef: PyTreeDef, types: tuple[type, ...], sources: Sources
    ) -> list[str] | None:
        """A bound call: the tuple of its positional arguments, or a `Keywords`
        with it and the dict of its keyword arguments."""
        args, kwargs = sources
        if not kwargs:
            return self.sourced(treedef, types, args)
        if _kind(treedef) is not Keywords:
            return None
        keyword = treedef.children()[1]
        kind, names = keyword.node_data() or (None, ())
        if kind is not dict or sorted(kwargs) != list(names):
            return None
        positional = functools.partial(self.sourced, sources=args)
        # JAX's order: sorted.
        reads = [functools.partial(self.source, source=kwargs[n]) for n in names]
        return self.parts(
            treedef, types, [positional, functools.partial(self.parts, reads=reads)]
        )

    def sourced(
        self, treedef: PyTreeDef, types: tuple[type, ...], sources: list[Source]
    ) -> list[str] | None:
        """A tuple of bound arguments, each read from where it comes from."""
        if _kind(treedef) is not tuple or len(treedef.children()) != len(sources):
            return None
        reads = [functools.partial(self.source, source=source) for source in sources]
        return self.parts(treedef, types, reads)

    def parts(
        self,
        treedef: PyTreeDef,
        types: tuple[type, ...],
        reads: Sequence[Callable[[PyTreeDef, tuple[type, ...]], list[str] | None]],
    ) -> list[str] | None:
        """The leaves of `treedef`'s children, each read by its item of `reads`
        (given the child and its leaves' types); `None` where one has no reader."""
        leaves: list[str] = []
        position = 0
        for child, read in zip(treedef.children(), reads):
            found = read(child, types[position : position + child.num_leaves])
            if found is None:
                return None
            leaves += found
            position += child.num_leaves
        return leaves

    def source(
        self, treedef: PyTreeDef, types: tuple[type, ...], source: Source
    ) -> list[str] | None:
        """Checks a bound argument, read from where it comes from."""
        kind, value = source
        if kind == "default":
            read = call_reader(treedef, types)
            taken = None if read is None else read(value)
            if taken is None:
                return None
            if not _immutable(treedef):  # a list, dict or Module: read every call
                return self.node(treedef, types, self.constant(value))
            # The same leaves every call.
            if len(taken) < 2:
                return list(map(self.constant, taken))
            return [self.starred(self.constant(tuple(taken)), len(taken))]
        x = self.variable()
        where = f"a[{value}]" if kind == "args" else f"k[{self.constant(value)}]"
        self.lines.append(f"{x} = {where}")
        return self.node(treedef, types, x)

    def values(
        self,
        treedef: PyTreeDef,
        types: tuple[type, ...],
        values: str,
        held: bool = False,
    ) -> list[str] | None:
        """Checks `values`, a sequence, against `treedef`'s children: as many, and
        each as its child. `held`: a tuple of immutable scalars, which the hit may
        hold (as a key holds a static value; never an array) to skip checking it
        again."""
        children = treedef.children()
        if treedef.num_nodes == len(types) + 1 and len(children) > 4:
            # Many children, every one a leaf: their types at C speed.
            if len(set(types)) == 1:  # as many, all of that type
                count, kind = len(children), self.constant(types[0])
                differs = (
                    f"len({values}) != {count} or "
                    f"_count_of(map(type, {values}), {kind}) != {count}"
                )
            else:
                differs = f"tuple(map(type, {values})) != {self.constant(types)}"
            if held:
                self.held.add(values)
                # A tuple checked before is checked still: its items cannot change.
                checked = self.constant([None])
                self.check(f"{values} is not {checked}[0] and ({differs})")
                self.lines.append(f"{checked}[0] = {values}")
            else:
                self.check(differs)
            if not all(map(is_leaf_type, types)):  # leaves until registered
                self.check(f"not _all_leaves({values})")
            return [self.starred(values, len(children))]
        if not children:
            self.check(f"len({values})")
            return []
        names = [self.variable() for _ in children]
        self.lines.append(f"{', '.join(names)}, = {values}")  # raises if not as many
        reads = [functools.partial(self.node, x=name) for name in names]
        return self.parts(treedef, types, reads)


def call_reader(
    treedef: PyTreeDef, types: tuple[type, ...]
) -> Callable[[object], list[Any] | None] | None:
    """The reader of pytrees flattened to `treedef` with leaves of `types`: their
    leaves, or `None` where a check fails; `None` where some part of it has no
    reader, or it is nested deeper than `MAX_DEPTH`."""
    writer = Writer()
    leaves = None if shape_of(treedef)[1] else writer.node(treedef, types, "tree")
    if leaves is None:
        return None
    body = [
        "try:",
        *(f"    {line}" for line in [*writer.lines, f"return [{', '.join(leaves)}]"]),
        # A missing field or key, or a static field that cannot compare.
        "except Exception:",
        "    return None",
    ]
    return compile_function("read", "tree", body, writer.namespace)


@per_class
def _is_namedtuple(cls: type) -> bool:
    """Whether JAX flattens `cls` as a namedtuple (its items, in order, with
    tuple's own iteration and length) rather than with a registration of its
    own, as the text of its structure says on a probe instance."""
    try:
        if not issubclass(cls, tuple) or any(
            getattr(cls, name) is not getattr(tuple, name)
            for name in ("__iter__", "__len__", "__getitem__")
        ):
            return False
        items = [object() for _ in cls._fields]  # pyright: ignore
        treedef = jax.tree_util.tree_structure(tuple.__new__(cls, items))
        stars = ", ".join(["*"] * len(items))
        text = f"PyTreeDef(CustomNode(namedtuple[{cls.__name__}], [{stars}]))"
        return str(treedef) == text
    except Exception:  # not a namedtuple
        return False


class ModuleLayout(NamedTuple):
    """How JAX flattens an `eqx.Module` class (see `_layout`): its fields that are
    children, in order, the others (static), what precedes their values in the
    node data of an instance holding its fields alone, and the function's metadata
    that a wrapper (`eqx.module_update_wrapper`) holds too, in node data order."""

    dynamic: tuple[str, ...]
    static: tuple[str, ...]
    plain: Any
    wrapper: tuple[str, ...] | None


# What `eqx.module_update_wrapper` copies from the function into a wrapper's
# `__dict__`, confirmed per class by `_layout`.
_WRAPPER_NAMES = tuple(
    "__module__ __name__ __qualname__ __doc__ __annotations__".split()
)


@per_class
def _layout(cls: type) -> ModuleLayout | None:
    """How JAX flattens an `eqx.Module` class whose `__dict__` holds its fields
    (and, for a wrapper, the function's metadata): as JAX's flatten of probe
    instances (a sentinel in each field) confirms it, else `None`."""
    try:
        fields = dataclasses.fields(cls)
        dynamic = tuple(f.name for f in fields if not f.metadata.get("static", False))
        static = tuple(f.name for f in fields if f.metadata.get("static", False))
        sentinels = {f.name: object() for f in fields}
        probe = object.__new__(cls)
        held = object.__getattribute__(probe, "__dict__")
        held.update(sentinels)
        leaves, treedef = jax.tree_util.default_registry.flatten(probe)
        kind, data = treedef.node_data()
        if not (
            kind is cls
            and treedef.num_nodes == len(dynamic) + 1
            and len(leaves) == len(dynamic)
            and all(map(operator.is_, leaves, map(sentinels.get, dynamic)))
            and type(data) is tuple
            and len(data) == len(static) + 1
            and all(map(operator.is_, data[1:], map(sentinels.get, static)))
        ):
            return None
        metadata = {name: object() for name in _WRAPPER_NAMES}
        held.update(metadata)
        _, wrapped = jax.tree_util.default_registry.flatten(probe)
        found = wrapped.node_data()[1][0]
        wrapper = _WRAPPER_NAMES if found == tuple(metadata.values()) else None
        return ModuleLayout(dynamic, static, data[0], wrapper)
    except Exception:  # an abstract class, a class that is not a dataclass
        return None


def _kind(treedef: PyTreeDef) -> type | None:
    """The kind of `treedef`'s root node; `None` for a leaf."""
    return (treedef.node_data() or (None,))[0]


def _immutable(treedef: PyTreeDef) -> bool:
    """Whether every node of `treedef` is of an immutable kind: a tuple, a
    namedtuple or `None`. Not a list or a dict, and not an `eqx.Module`: frozen is
    not immutable (`object.__setattr__`, a write to its `__dict__`)."""
    kind = _kind(treedef)
    return kind is None or (
        (kind is tuple or kind is type(None) or _is_namedtuple(kind))
        and all(map(_immutable, treedef.children()))
    )
