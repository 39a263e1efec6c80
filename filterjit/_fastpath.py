"""The fast path: shortcuts for repeated calls, each giving exactly what the
reference path gives (`Dispatcher._call`: bind with `inspect`, flatten with
`jax.tree_util`, find the partition, key with `Partition.reference_key`), and all
of them off when the environment sets `FILTERJIT_FASTPATH=0`. Each is one
generated function (`_compile`: the package's only `exec`):

- `hit_caller`: a whole call at one level of calls of the shapes recorded for
  one partition, read, keyed, looked up and run (the static output of the trace
  it learned built inline), calling nothing of its dispatcher's;
- `call_reader`: a pytree's leaves, which a hit reads a mutable default with,
  and which `tests/test_readers.py` checks against `jax.tree_util` (as it checks
  what hits read);
- `output_builder`: a static output built by one expression.

A reader checks, on every call, all that JAX's flatten and a comparison of
structures would see, and takes the leaves in JAX's order; else it gives `None`,
and the reference path:

- a leaf of the exact type recorded, and where that type may yet be registered
  as a pytree node (a user's class), a leaf still (`jax.tree_util.all_leaves`);
- an exact `list`, `tuple` or namedtuple of the recorded length, a `dict` with
  the recorded string keys, `None`;
- an `eqx.Module` of the exact class recorded, read from its `__dict__` on every
  call (frozen is not immutable), holding exactly its fields, its static fields
  equal to the recorded ones, and of the same types (see `_exact`);
- each bound argument where it comes from: an immutable default (a tuple of
  leaves) taken once, as constants; any other read on every call, as it may
  have been changed in place.

How Equinox flattens a class, and that JAX flattens a namedtuple class as a
namedtuple, are checked against JAX once per class, on a probe instance.
`tests/test_readers.py` checks the readers and hits against `jax.tree_util`, and
`tests/test_fastpath.py` runs generated sequences of calls through both paths.
"""

import dataclasses
import functools
import itertools
import linecache
import operator
import os
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax

from ._binding import (
    DefaultsGuard,
    Keywords,
    same_kwdefaults,
    Shape,
    Source,
    Sources,
)
from ._cache import per_class
from ._entry import CallUnderWay, TOP_CALL
from ._errors import call_checked
from ._exact import ATOMS, exact_values, float_key, key as exact_key, unchanging
from ._leaves import is_leaf_type
from ._output import Carried, OutputSpec
from ._partition import Partition, WRITTEN_KEYS
from ._structure import MAX_DEPTH, PyTreeDef, shape_of


# Read when a reader or builder is made: a test that changes it clears
# the caches (`filterjit.clear_caches()`) to drop those already made.
ENABLED = os.environ.get("FILTERJIT_FASTPATH", "1") != "0"


# Generated code is filed under the package's directory (JAX leaves its frames out
# of tracebacks), each function under a name of its own in `linecache`.
_DIRECTORY = os.path.dirname(os.path.abspath(__file__))
_counter = itertools.count()


def _compile(
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


def output_builder(
    treedef: PyTreeDef, sources: Sequence[tuple[str, object]]
) -> Callable[..., Any] | None:
    """`build(out, inputs)`, `treedef.unflatten` of an output's leaves as one
    expression, each leaf `("out", i)`, the traced leaf `out[i]`; `("input", p)`,
    the call's leaf `inputs[p]`; or `("constant", value)` (`inputs` optional
    without an input). For a structure of tuples, lists, `None` and dicts with
    string keys; else `None`."""
    if not ENABLED:
        return None
    writer = _Writer()
    built = writer.output(treedef, sources, "o")
    if built is None:
        return None
    reads_inputs = any(kind == "input" for kind, _ in sources)
    parameters = "o, i" if reads_inputs else "o, i=None"
    return _compile("build", parameters, [f"return {built}"], writer.namespace)


def call_reader(treedef: PyTreeDef, types: tuple[type, ...]) -> Any:
    """The reader of pytrees flattened to `treedef` with leaves of `types`: their
    leaves; `None` where some part of it has no reader."""
    if not ENABLED:
        return None
    writer = _Writer()
    leaves = writer.node(treedef, types, "tree")
    return writer.compile("read", "tree", leaves)


def takes_defaults(sources: Sources) -> bool:
    """Whether calls bound as `sources` say take a default."""
    args, kwargs = sources
    return any(kind == "default" for kind, _ in [*args, *kwargs.values()])


class HitCall(NamedTuple):
    """One shape of call that a generated hit reads (see `hit_caller`): the number
    of positional arguments, then the keyword names; where each bound argument
    comes from, what the key of such calls adds (`None`: nothing;
    see `Dispatcher._defaulted`), and the guard of the defaults it takes."""

    shape: Shape
    sources: Sources
    key_suffix: Any
    defaults: DefaultsGuard | None


class Unfinished:
    """What a generated hit returns where the dispatcher must do the rest: `MISS`,
    before anything ran (the call is then the reference path's); else a run whose
    `outcome` is the error it raised or a `Carried` output to finish with the
    call's `leaves` (and, nested, its pytree `tree`), for the partition of
    `route`. Never a user's value: a type the wrapper tells apart in one check."""

    __slots__ = ("outcome", "leaves", "waited", "tree", "route")

    def __init__(
        self, outcome: Any, leaves: list[object], waited: bool, tree: object, route: Any
    ):
        self.outcome = outcome
        self.leaves = leaves
        self.waited = waited  # at the top level, whether the run was waited for
        self.tree = tree
        self.route = route


MISS = Unfinished(None, [], False, None, None)

# `hit(fun, args, kwargs)`: a call's result, or an `Unfinished`.
Hit = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


def miss(
    fun: object, args: tuple[object, ...], kwargs: dict[str, object]
) -> Unfinished:
    """The hit of a level with no partition to read calls of: always `MISS`."""
    return MISS


def chained(hits: Sequence[Hit]) -> Hit:
    """The hit that tries each of `hits` in turn, `MISS` where all miss (as
    `jax.jit`'s cache holds every signature at once, so that calls alternating
    between partitions stay on the fast path)."""
    if not hits:
        return miss
    if len(hits) == 1:
        return hits[0]
    first, *rest = hits

    def hit(f: object, a: tuple[object, ...], k: dict[str, object]) -> Any:
        o = first(f, a, k)
        if o is MISS:
            for other in rest:
                o = other(f, a, k)
                if o is not MISS:
                    return o
        return o

    return hit


def hit_caller(
    route: object,
    partition: Partition,
    calls: Sequence[HitCall],
    get: Callable[[Hashable], object],
    fun_is_leaf: bool,
    name: str,
    learned: OutputSpec | None = None,
    takes_call: bool = False,
) -> Hit | None:
    """`hit(fun, args, kwargs)`: a whole call of `partition`'s structure at its
    level, of one of the shapes of `calls`, in one function that calls nothing of
    its dispatcher's: read and keyed as the reference path would (`get`, the
    partition's entries), its entry's jitted function run with the traced leaves,
    the output built by its spec where that is plain. It returns the call's result;
    `MISS` where it reads no shape of `calls` or finds no valid entry (nothing has
    run); else an `Unfinished` run for `route` (an error to name, an output to
    finish, the first output built from the traced leaves alone, which has the hit
    made again with that output's spec as `learned`, built inline). Nested, only
    calls of positional arguments, whose pytree is the call itself. `None` where
    it reads no call at all. `takes_call`: whether entries are called with a
    `CallUnderWay` first (`_entry.TOP_CALL` at the top level: see
    `Options.same_at_every_level`)."""
    if not ENABLED:
        return None
    staged = partition.staged
    writer = _Writer(miss="break")
    writer.namespace.update(
        _get=get,
        _carried=Carried,
        _unfinished=Unfinished,
        _route=route,
        _miss=MISS,
        _checked=call_checked,
        _name=name,
        _call_under_way=CallUnderWay,
        _partial=functools.partial,
        _top_call=TOP_CALL,
    )
    if learned is not None and not staged:
        sources = learned.leaf_sources  # traced leaves and constants (no input)
        built = sources and writer.output(sources[0], sources[1], "d")
    else:
        built = None
    body: list[str] = []
    read = [call for call in calls if not staged or _plain(call.sources)]
    for call in read:
        writer.lines = []
        # With calls of one shape alone, a plain call's length is checked by the
        # unpacking of its arguments (which raises, slowly, on another).
        branch = _branch(
            writer,
            partition,
            call,
            fun_is_leaf,
            learned,
            built,
            len(read) > 1,
            takes_call,
        )
        if branch is not None:
            body += branch
    if not body:
        return None
    return _compile("hit", "f, a, k", [*body, "return _miss"], writer.namespace)


def _plain(sources: Sources) -> bool:
    """Whether calls bound as `sources` say are their positional arguments."""
    args, kwargs = sources
    return not kwargs and args == [("args", i) for i in range(len(args))]


def _branch(
    writer: "_Writer",
    partition: Partition,
    call: HitCall,
    fun_is_leaf: bool,
    learned: OutputSpec | None,
    built: str | None,
    count_plain: bool,
    takes_call: bool,
) -> list[str] | None:
    """The lines of `hit_caller` for calls of one shape, `None` where there are
    none: `while` the call has that shape, read it (`break` on a miss), run."""
    treedef, types = partition.treedef, partition.types
    defaults = call.defaults
    sources = call.sources
    if defaults is None and takes_defaults(sources):
        return None
    if defaults is not None and takes_defaults(sources):
        writer.guard(defaults)
    args, kwargs = sources
    plain = _plain(sources)
    if plain:
        condition = f"not k and len(a) == {len(args)}" if count_plain else "not k"
        if fun_is_leaf:
            node = (treedef.node_data() or (None,))[0]
            leaves = writer.values(treedef, types, "a") if node is tuple else None
        else:
            writer.lines.append("t = (f, a)")
            leaves = writer.node(treedef, types, "t")
    else:
        count, *names = call.shape
        condition = f"len(a) == {count} and len(k) == {len(names)}"
        leaves = writer.call(treedef, types, fun_is_leaf, sources)
    if leaves is None:
        return None
    # Each leaf by itself (`v3`, or `v2[4]` of a sequence `*v2` of leaves), and the
    # traced ones as read: a sequence of them all as it is (not copied).
    items: list[str] = []
    arguments: list[str] = []
    dynamic = set(partition.dynamic_positions)
    for leaf in leaves:
        count = writer.counts.get(leaf)  # of a sequence `*values`
        group = [leaf] if count is None else [f"{leaf[1:]}[{i}]" for i in range(count)]
        traced = [p for p in range(len(items), len(items) + len(group)) if p in dynamic]
        items += group
        if count is not None and len(traced) == count:
            arguments.append(leaf)
        else:
            arguments += map(items.__getitem__, traced)
    # All the leaves, for the output and errors: a list's copied as they were read,
    # before the call (other sequences are tuples); nested, for a trace.
    whole = f"[{', '.join(leaves)}]"
    lists = any(leaf[1:] in writer.lists for leaf in leaves if leaf.startswith("*"))
    if lists or partition.staged:
        writer.lines.append(f"l = {whole}")
        whole = "l"
    tree = "a" if fun_is_leaf else "t"
    key = writer.key(partition, items.__getitem__, whole, call.key_suffix, tree)
    traced = ", ".join(arguments)
    read = [f"    {line}" for line in writer.lines]
    if partition.staged:
        return [
            f"while {condition}:",
            "    try:",
            *(f"    {line}" for line in read),
            f"        e = _get({key})",
            "        if e.captured and not e.valid():  # `None.captured`: no entry",
            "            break",
            "    except Exception:",
            "        break",
            # With the call's own pytree, for a trace (as `_entry.run_nested`).
            "    u = _call_under_way()",
            f"    u.under_way = ({tree}, l)",
            "    try:",
            f"        o = e.nested(u{', ' if traced else ''}{traced})",
            "    finally:",
            "        u.under_way = None",
            "    if type(o) is not _carried:",
            "        return o",
            "    s, d = o.args",
            "    if s.aliases:",
            f"        return _unfinished(o, l, False, {tree}, _route)",
            # The call's containers as a trace listed them before the function ran.
            f"    return s.finish_nested(d, l, {tree}, u.nodes)",
        ]
    if learned is None:  # the first from-traced output has the hit made again
        inline = []
        from_traced = f"_unfinished(o, {whole}, g, None, _route)"
    else:  # `s is learned`: the output that trace made, built inline
        constant = writer.constant(learned)
        inline = (
            [f"    if s is {constant}:", f"        return {built}"] if built else []
        )
        from_traced = "s.from_traced(d)"
    # Where static leaves equal by `==` may differ, a trace takes this call's own.
    current = takes_call and partition.by_eq
    under_way = "u" if current else "_top_call"
    checked = "_partial(e.with_call, u)" if current else "e.jitted"
    run = [
        "    if g:  # run and waited for in one checked call",
        f"        o = _checked({checked}, [{traced}], _name, e.awaited, e.labels)",
        "    else:",
        "        try:",
        f"            o = {f'e.with_call({under_way}, ' if takes_call else 'e.jitted('}"
        f"{traced})",
        "        except Exception as x:  # named in the user's terms",
        f"            return _unfinished(x, {whole}, False, None, _route)",
    ]
    if current:
        run = [
            "    u = _call_under_way()",
            f"    u.under_way = (None, {whole})",
            "    try:",
            *(f"    {line}" for line in run),
            "    finally:",
            "        u.under_way = None",
        ]
    return [
        f"while {condition}:",
        "    try:",
        *(f"    {line}" for line in read),
        f"        e = _get({key})",
        "        g = e.guarded  # `None.guarded`: no entry",
        "        if g and e.captured and not e.valid():  # a NumPy constant changed",
        "            break",
        "    except Exception:",
        "        break",
        *run,
        "    if type(o) is not _carried:",
        "        return o",
        "    s, d = o.args",
        *inline,
        "    if s.from_traced is not None:",
        f"        return {from_traced}",
        "    if s.plain:",
        f"        return s.build(d, {whole})",
        f"    return _unfinished(o, {whole}, g, None, _route)",
    ]


class _Writer:
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
        }
        self.names = itertools.count()
        self.counts: dict[str, int] = {}  # how many leaves each `*values` has
        self.lists: set[str] = set()  # the values that are lists (the user's)
        self.depth = 0  # of the node being read

    def compile(self, name: str, parameter: str, leaves: list[str] | None) -> Any:
        """`def name(parameter)` returning the list of `leaves`, or `None` where a
        check fails; `None` where there are no leaves to read."""
        if leaves is None:
            return None
        body = [
            "try:",
            *(f"    {line}" for line in [*self.lines, f"return [{', '.join(leaves)}]"]),
            # A missing field or key, or a static field that cannot compare.
            "except Exception:",
            "    return None",
        ]
        return _compile(name, parameter, body, self.namespace)

    def key(
        self,
        partition: Partition,
        at: Callable[[int], str],
        whole: str,
        suffix: object = None,
        tree: str | None = None,
    ) -> str:
        """A call's key as `Dispatcher._key` makes it, written out: the partition's
        key of the leaves (see `_reference_key`); nested, paired with the order of
        the dicts of the call's pytree `tree` (if given); then paired with
        `suffix`, what the key of calls of one shape adds, unless `None`."""
        key = self._reference_key(partition, at, whole)
        if tree is not None and partition.orders is not None:
            key = f"({key}, {self.constant(partition.orders)}({tree}))"
        if suffix is not None:
            key = f"({key}, {self.constant(suffix)})"
        return key

    def _reference_key(
        self, partition: Partition, at: Callable[[int], str], whole: str
    ) -> str:
        """`partition.reference_key(whole)` written out, such as `(program, l[0],
        k(v) if (v := l[3]) == 0.0 or v != v else v)`, the leaf at position `p`
        being `at(p)`."""
        static = partition.static_positions
        if not static:
            return self.constant(partition.program)
        if len(static) > WRITTEN_KEYS:
            return f"{self.constant(partition.reference_key)}({whole})"
        rekeys = dict(partition.rekeys)
        parts = [self.constant(partition.program)]
        for index, position in enumerate(static):
            rekey = rekeys.get(index)
            if rekey is None:
                parts.append(at(position))
            elif rekey is float_key and partition.types[position] is float:
                v = leaf = at(position)  # only -0.0 and nan need the slower key
                if not leaf.isidentifier():  # an item of `l`: taken once
                    v = self.variable()
                test = f"{v} == 0.0" if v is leaf else f"({v} := {leaf}) == 0.0"
                exact = self.constant(float_key)
                parts.append(f"{exact}({v}) if {test} or {v} != {v} else {v}")
            else:
                parts.append(f"{self.constant(rekey)}({at(position)})")
        return f"({', '.join(parts)},)"

    def output(
        self, treedef: PyTreeDef, sources: Sequence[tuple[str, object]], out: str
    ) -> str | None:
        """`treedef.unflatten` of an output's leaves as one expression (see
        `output_builder`), the traced leaf `i` being `{out}[i]`; `None` where a
        node is of another kind, or it is nested deeper than `MAX_DEPTH`."""
        if shape_of(treedef)[1]:
            return None
        leaves = iter(sources)

        def expression(node: PyTreeDef) -> str | None:
            if node.num_nodes == 1 and node.num_leaves == 1:
                kind, value = next(leaves)
                if kind == "out":
                    return f"{out}[{value}]"
                return f"i[{value}]" if kind == "input" else self.constant(value)
            kind, data = node.node_data()
            items = [expression(child) for child in node.children()]
            if None in items:
                return None
            if kind is type(None):
                return "None"
            if kind is tuple:
                return f"({''.join(f'{item}, ' for item in items)})"
            if kind is list:
                return f"[{', '.join(items)}]"  # pyright: ignore[reportCallIssue, reportArgumentType]
            if kind is dict and all(type(key) is str for key in data):
                pairs = zip(map(self.constant, data), items)
                return f"{{{', '.join(f'{key}: {item}' for key, item in pairs)}}}"
            return None

        return expression(treedef)

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
            self.lines.append(
                f"{values} = {self.constant(operator.itemgetter(*keys))}({x})"
            )
            return values
        taken = "".join(f"{x}[{self.constant(key)}], " for key in keys)
        self.lines.append(f"{values} = ({taken})")
        return values

    def node(
        self, treedef: PyTreeDef, types: tuple[type, ...], x: str
    ) -> list[str] | None:
        """Checks the value `x` against `treedef`; the expressions of its leaves,
        or `None` where it has no reader (nor for a structure nested deeper than
        `_structure.MAX_DEPTH`)."""
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                return None
            return self._node(treedef, types, x)
        finally:
            self.depth -= 1

    def _node(
        self, treedef: PyTreeDef, types: tuple[type, ...], x: str
    ) -> list[str] | None:
        if treedef.num_nodes == 1 and len(types) == 1:
            self.check(f"type({x}) is not {self.constant(types[0])}")
            if not is_leaf_type(types[0]):  # a leaf until its class is registered
                self.check(f"not _all_leaves(({x},))")
            return [x]
        kind, data = treedef.node_data()
        if kind is type(None):
            self.check(f"{x} is not None")
            return []
        count = len(treedef.children())
        if kind is list or kind is tuple or _is_namedtuple(kind):
            self.check(f"type({x}) is not {self.constant(kind)}")  # length: `values`
            if kind is list:
                self.lists.add(x)
            # A tuple of immutable scalars stays what it was checked to be.
            scalars = kind is tuple and set(types) <= ATOMS
            return self.values(treedef, types, x, immutable_scalars=scalars)
        if kind is dict and all(type(key) is str for key in data):
            # JAX takes the values in the order of the sorted keys; keys of one
            # type, strings, sort one way whatever order they were inserted in.
            # All of them there, and no other: a missing one raises.
            self.check(f"type({x}) is not dict or len({x}) != {count}")
            return self.values(treedef, types, self.items(x, data))
        if kind is Keywords:
            self.check(f"type({x}) is not {self.constant(Keywords)}")
            values = self.variable()
            self.lines.append(f"{values} = ({x}.args, {x}.kwargs)")
            return self.values(treedef, types, values)
        if isinstance(kind, type) and issubclass(kind, eqx.Module):
            return self.module(treedef, types, x, kind, data)
        return None

    def module(
        self,
        treedef: PyTreeDef,
        types: tuple[type, ...],
        x: str,
        kind: type,
        data: object,
    ) -> list[str] | None:
        """An `eqx.Module`, read from its `__dict__` on every call."""
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
        if static:
            # Each the very object recorded, where that proves them the same (then
            # `==` of the tuples is true), else equal, and exactly, by the key's
            # hash recomputed too: `scale=1` is not the `scale=1.0` recorded, and an
            # object changed in place is not the one recorded.
            recorded = self.constant(recorded_values)
            if len(static) <= 4:
                taken = [f"{fields}[{self.constant(key)}]" for key in static]
                same = " and ".join(
                    f"{value} is {self.constant(known)}"
                    for value, known in zip(taken, recorded_values)
                )
                statics = f"({''.join(f'{value}, ' for value in taken)})"
            else:
                statics = self.items(fields, static)
                same = f"all(map(_is, {statics}, {recorded}))"
            differs = f"{statics} != {recorded}"
            exact = exact_values(recorded_values)
            if exact is not None:
                keyed, hashed = self.constant(exact), self.constant(hash(exact))
                found = self.variable()
                differs += (
                    f" or hash({found} := _exact_key({statics})) != {hashed}"
                    f" or {found} != {keyed}"
                )
            if unchanging(recorded_values):
                differs = f"not ({same}) and ({differs})"
            self.check(differs)
        return self.values(treedef, types, self.items(fields, dynamic))

    def call(
        self,
        treedef: PyTreeDef,
        types: tuple[type, ...],
        fun_is_leaf: bool,
        sources: Sources,
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
        self, treedef: PyTreeDef, types: tuple[type, ...], sources: Sources
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
        self, treedef: PyTreeDef, types: tuple[type, ...], sources: list[Source]
    ) -> list[str] | None:
        data = treedef.node_data()
        if data is None or data[0] is not tuple:
            return None
        if len(treedef.children()) != len(sources):
            return None
        return self.children(treedef, types, sources)

    def children(
        self, treedef: PyTreeDef, types: tuple[type, ...], sources: list[Source]
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
        immutable_scalars: bool = False,
    ) -> list[str] | None:
        """Checks `values`, a sequence, against `treedef`'s children: as many, and
        each as its child. `immutable_scalars`: a tuple of immutable scalars, which the
        hit may hold (as a key holds a static value; never an array) to skip
        checking it again."""
        children = treedef.children()
        if treedef.num_nodes == len(types) + 1 and len(children) > 4:
            # Many children, every one a leaf: their types at C speed.
            if len(set(types)) == 1:  # as many, all of that type
                (kind,) = set(types)
                count, kind_name = len(children), self.constant(kind)
                differs = (
                    f"len({values}) != {count} or "
                    f"_count_of(map(type, {values}), {kind_name}) != {count}"
                )
            else:
                differs = f"tuple(map(type, {values})) != {self.constant(types)}"
            if immutable_scalars:
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
        return (
            str(treedef)
            == f"PyTreeDef(CustomNode(namedtuple[{cls.__name__}], [{stars}]))"
        )
    except Exception:  # not a namedtuple
        return False


class ModuleLayout(NamedTuple):
    """How JAX flattens an `eqx.Module` class (see `_layout`): the fields that are
    its children, in order, the others (static), what precedes their values in its
    node data for an instance holding its fields alone, and the names of the
    function's metadata that a wrapper (`eqx.module_update_wrapper`) also holds in
    its `__dict__`, in the order its node data gives their values (`None` where
    JAX does not flatten such a wrapper so)."""

    dynamic: tuple[str, ...]
    static: tuple[str, ...]
    plain: Any
    wrapper: tuple[str, ...] | None


# What `eqx.module_update_wrapper` copies from the function into a wrapper's
# `__dict__`, confirmed per class by `_layout`.
_WRAPPER_NAMES = (
    "__module__",
    "__name__",
    "__qualname__",
    "__doc__",
    "__annotations__",
)


def _probe(cls: type, values: dict[str, object]) -> tuple[list[Any], PyTreeDef]:
    """JAX's flatten of an instance of `cls` whose `__dict__` is `values`."""
    probe = object.__new__(cls)
    object.__getattribute__(probe, "__dict__").update(values)
    return jax.tree_util.default_registry.flatten(probe)


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
        leaves, treedef = _probe(cls, sentinels)
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
        _, wrapped = _probe(cls, sentinels | metadata)
        found = wrapped.node_data()[1][0]
        expected = tuple(metadata.values())
        wrapper = _WRAPPER_NAMES if found == expected else None
        return ModuleLayout(dynamic, static, data[0], wrapper)
    except Exception:  # an abstract class, a class that is not a dataclass
        return None


def _immutable(treedef: PyTreeDef) -> bool:
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
