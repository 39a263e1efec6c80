"""The fast path, off when the environment sets `FILTERJIT_FASTPATH=0`: generated
hits (`hit_caller`) that read a call as `_readers` does, without binding or
flattening it, key it, look it up, run it and build its output, calling nothing of
the dispatcher's but what their plan hands them; each gives exactly what the
reference path (`Dispatcher.call`) gives, as `tests/test_fastpath.py` checks.
"""

import functools
import os
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

from ._binding import DefaultsGuard, Shape, Sources
from ._entry import CallUnderWay, TOP_CALL
from ._errors import call_checked
from ._exact import float_key
from ._output import Carried, OutputSpec
from ._partition import Partition, WRITTEN_KEYS
from ._readers import compile_function, Writer
from ._structure import PyTreeDef, shape_of


# Read when a hit is made: a test that changes it clears the caches
# (`filterjit.clear_caches()`) to drop those already made.
ENABLED = os.environ.get("FILTERJIT_FASTPATH", "1") != "0"


def takes_defaults(sources: Sources) -> bool:
    """Whether calls bound as `sources` say take a default."""
    return any(kind == "default" for kind, _ in [*sources[0], *sources[1].values()])


class HitCall(NamedTuple):
    """One shape of call a hit reads (`len(args), *kwargs`); where each bound
    argument comes from, what the key of such calls adds (`None`: nothing; see
    `Dispatcher._defaulted`), and the guard of the defaults it takes."""

    shape: Shape
    sources: Sources
    key_suffix: Any
    defaults: DefaultsGuard | None


class Miss:
    """The type of `MISS`, what a hit returns where it ran nothing: never a
    user's value."""

    __slots__ = ()


MISS = Miss()

# `hit(fun, args, kwargs)`: a call's result, or `MISS`.
Hit = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


def miss(f: object, a: tuple[object, ...], k: dict[str, object]) -> Miss:
    """The hit of a level with no partition to read calls of: always `MISS`."""
    return MISS


class HitPlan(NamedTuple):
    """What a hit is made from, frozen once the reference path has run a call of
    the partition: the shapes of call it reads, the lookup of entries (`get`),
    whether the function is a leaf of the call, its name, and what finishes a run:
    `failed(leaves, error)` names an error in the user's terms (or returns, and the
    hit raises it as it was); `finish(out, leaves, waited, tree)`, an output that
    needs more than its spec (the dispatcher's: see `Dispatcher._finish`);
    `learned`, the specs of plain outputs of the partition's traces, whose outputs
    it builds inline."""

    partition: Partition
    calls: tuple[HitCall, ...]
    get: Callable[[Hashable], Any]
    fun_is_leaf: bool
    name: str
    failed: Callable[[list[Any], Exception], None]
    finish: Callable[[Carried, list[Any], bool, object], Any]
    learned: tuple[OutputSpec, ...] = ()


def chained(hits: Sequence[Hit]) -> Hit:
    """The hit that tries each of `hits` in turn, `MISS` where all miss: calls
    alternating between partitions stay on the fast path, as in `jax.jit`'s."""
    if len(hits) < 2:
        return hits[0] if hits else miss
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


def hit_caller(plan: HitPlan) -> Hit | None:
    """`hit(fun, args, kwargs)`: a whole call of `plan`'s partition at its level, of
    one of the shapes of `plan.calls`, read and keyed as the reference path would,
    its entry run and its output finished. It returns the call's result, or `MISS`
    where it reads no shape of the calls or finds no valid entry (nothing has run).
    Nested, only calls of positional arguments. `None` where it reads no call, or
    the structure is deeper than `MAX_DEPTH`."""
    partition = plan.partition
    if not ENABLED or partition.deep:
        return None
    writer = Writer(miss="break")
    writer.namespace.update(
        _get=plan.get,
        _carried=Carried,
        _failed=plan.failed,
        _finish=plan.finish,
        _miss=MISS,
        _checked=call_checked,
        _name=plan.name,
        _call_under_way=CallUnderWay,
        _partial=functools.partial,
        _top_call=TOP_CALL,
    )
    body: list[str] = []
    read = [call for call in plan.calls if not partition.staged or _plain(call.sources)]
    # With calls of one shape alone, a plain call's length is checked by the
    # unpacking of its arguments (which raises, slowly, on another).
    counted = len(read) > 1
    for call in read:
        writer.lines = []
        body += _branch(writer, plan, call, counted) or []
    if not body:
        return None
    return compile_function("hit", "f, a, k", [*body, "return _miss"], writer.namespace)


def _plain(sources: Sources) -> bool:
    """Whether calls bound as `sources` say are their positional arguments."""
    args, kwargs = sources
    return not kwargs and args == [("args", i) for i in range(len(args))]


def _branch(
    writer: Writer, plan: HitPlan, call: HitCall, counted: bool
) -> list[str] | None:
    """The lines of `hit_caller` for calls of one shape, `None` where there are
    none: `while` the call has that shape, read it (`break` on a miss), run."""
    partition, fun_is_leaf = plan.partition, plan.fun_is_leaf
    treedef, types = partition.treedef, partition.types
    sources = call.sources
    if takes_defaults(sources):
        if call.defaults is None:
            return None
        writer.guard(call.defaults)
    if _plain(sources):
        condition = f"not k and len(a) == {len(sources[0])}" if counted else "not k"
        if fun_is_leaf:
            node = (treedef.node_data() or (None,))[0]
            leaves = writer.values(treedef, types, "a") if node is tuple else None
        else:
            writer.lines.append("t = (f, a)")
            leaves = writer.node(treedef, types, "t")
    else:
        count, *names = call.shape
        condition = f"len(a) == {count} and len(k) == {len(names)}"
        read = writer.bound if fun_is_leaf else writer.call
        leaves = read(treedef, types, sources)
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
    key = _key(writer, partition, items.__getitem__, whole, call.key_suffix, tree)
    if partition.orders is None and (held := _static_tuple(writer, partition, leaves)):
        # Its key, kept with it in one slot read once (threads agree on the pair).
        slot, last, found = writer.constant([(None, None)]), writer.variable(), "y"
        writer.lines += [
            f"{last} = {slot}[0]",
            f"if {last}[0] is {held}:",
            f"    {found} = {last}[1]",
            "else:",
            f"    {found} = {key}",
            f"    {slot}[0] = ({held}, {found})",
        ]
        key = found
    traced = ", ".join(arguments)
    if partition.staged:
        # `None.captured`: no entry. One whose trace handed back an object that was
        # at several places: the dispatcher's (see `Entry.aliases`).
        found = ["        if e.aliases or e.captured and not e.valid():"]
        # With the call's own pytree, for a trace (as `_entry.run_nested`).
        nested = f"    o = e.nested(u{', ' if traced else ''}{traced})"
        run = _under_way(f"({tree}, l)", [nested])
        # The call's containers as a trace listed them before the function ran.
        finish = [f"    return s.finish_nested(d, l, {tree}, n)"]
    else:
        found = [
            "        g = e.guarded  # `None.guarded`: no entry",
            # A NumPy constant changed, or a trace handed back an object that was at
            # several places (see `Entry.aliases`): the dispatcher's.
            "        if g and (e.aliases or e.captured and not e.valid()):",
        ]
        # Where static leaves equal by `==` may differ, a trace takes this call's own.
        current = partition.by_eq
        under_way = "u" if current else "_top_call"
        checked = "_partial(e.with_call, u)" if current else "e.jitted"
        jitted = f"e.with_call({under_way}, "
        run = [
            "    if g:  # run and waited for in one checked call",
            f"        o = _checked({checked}, [{traced}], _name, e.awaited, e.labels)",
            "    else:",
            "        try:",
            f"            o = {jitted}{traced})",
            "        except Exception as x:  # named in the user's terms, or as it was",
            f"            _failed({whole}, x)",
            "            raise",
        ]
        if current:
            run = _under_way(f"(None, {whole})", run)
        # The outputs of the traces the plan learned, built inline (`s is` a spec),
        # the call's leaves `i` where one hands an input back.
        inline: list[str] = []
        for spec in plan.learned:
            if spec.leaf_sources is None:
                continue
            output, sources = spec.leaf_sources
            built = _output(writer, output, sources, "d")
            if built is not None:
                inline.append(f"    if s is {writer.constant(spec)}:")
                if any(kind == "input" for kind, _ in sources):
                    inline.append(f"        i = {whole}")
                inline.append(f"        return {built}")
        finish = [
            *inline,
            "    if s.plain:",
            f"        return s.build(d, {whole})",
            f"    return _finish(o, {whole}, g, None)",
        ]
    return [
        f"while {condition}:",
        "    try:",  # read and looked up: `break` on a failed read or no valid entry
        *(f"        {line}" for line in writer.lines),
        f"        e = _get({key})",
        *found,
        "            break",
        "    except Exception:",
        "        break",
        *run,
        "    if type(o) is not _carried:",
        "        return o",
        "    s, d = o.args",
        *finish,
    ]


def _static_tuple(writer: Writer, partition: Partition, leaves: list[str]) -> str:
    """The tuple of immutable scalars (see `Writer.values`) whose items are a call's
    static leaves, all of them, as the hit reads it; else `""`."""
    start = 0
    for leaf in leaves:
        count = writer.counts.get(leaf, 1)
        if leaf[1:] in writer.held:
            held = tuple(range(start, start + count))
            return leaf[1:] if partition.static_positions == held else ""
        start += count
    return ""


def _under_way(call: str, run: list[str]) -> list[str]:
    """The lines `run` with a new `CallUnderWay` `u` holding `call` meanwhile, and
    then emptied (JAX may keep it in its cache key), the containers a trace
    listed in it kept as `n`."""
    return [
        "    u = _call_under_way()",
        f"    u.under_way = {call}",
        "    try:",
        *(f"    {line}" for line in run),
        "    finally:",
        "        n = u.nodes",
        "        u.under_way = u.nodes = None",
    ]


def _key(
    writer: Writer,
    partition: Partition,
    at: Callable[[int], str],
    whole: str,
    suffix: object,
    tree: str,
) -> str:
    """A call's key as `Dispatcher._key` makes it, written out: the partition's
    key of the leaves `whole`, such as `(program, l[0], k(v) if (v := l[3]) == 0.0
    or v != v else v)` (the leaf at position `p` being `at(p)`), paired with the
    order of its pytree `tree`'s dicts where kept, and with `suffix` unless `None`."""
    static = partition.static_positions
    if not static:
        key = writer.constant(partition.program)
    elif len(static) > WRITTEN_KEYS:
        key = f"{writer.constant(partition.reference_key)}({whole})"
    else:
        rekeys = dict(partition.rekeys)
        parts = [writer.constant(partition.program)]
        for index, position in enumerate(static):
            rekey = rekeys.get(index)
            if rekey is None:
                parts.append(at(position))
            elif rekey is float_key and partition.types[position] is float:
                v = leaf = at(position)  # only -0.0 and nan need the slower key
                if not leaf.isidentifier():  # an item of `l`: taken once
                    v = writer.variable()
                test = f"{v} == 0.0" if v is leaf else f"({v} := {leaf}) == 0.0"
                exact = writer.constant(float_key)
                parts.append(f"{exact}({v}) if {test} or {v} != {v} else {v}")
            else:
                parts.append(f"{writer.constant(rekey)}({at(position)})")
        key = f"({', '.join(parts)},)"
    if partition.orders is not None:
        key = f"({key}, {writer.constant(partition.orders)}({tree}))"
    if suffix is not None:
        key = f"({key}, {writer.constant(suffix)})"
    return key


def _output(
    writer: Writer, treedef: PyTreeDef, sources: Sequence[tuple[str, object]], out: str
) -> str | None:
    """`treedef.unflatten` of an output's leaves as one expression, each leaf
    `("out", i)`, the traced leaf `{out}[i]`; `("input", p)`, the call's leaf
    `i[p]`; or `("constant", value)`. For a structure of tuples, lists, `None` and
    dicts with string keys; else `None`, as where it is nested deeper than
    `MAX_DEPTH`."""
    if shape_of(treedef)[1]:
        return None
    leaves = iter(sources)

    def expression(node: PyTreeDef) -> str | None:
        if node.num_nodes == 1 and node.num_leaves == 1:
            kind, value = next(leaves)
            if kind == "out":
                return f"{out}[{value}]"
            return f"i[{value}]" if kind == "input" else writer.constant(value)
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
            pairs = zip(map(writer.constant, data), items)
            return f"{{{', '.join(f'{key}: {item}' for key, item in pairs)}}}"
        return None

    return expression(treedef)
