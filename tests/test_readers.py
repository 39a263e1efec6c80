"""The path that takes the leaves of a call without flattening it (the readers
of `filterjit/_readers.py`, in the hits of `filterjit/_fastpath.py`), checked
against `jax.tree_util` itself.

Whenever the reader made from one call's structure and leaf types accepts another
call, JAX's own flatten of that call must give the recorded structure and leaf
types, and the same leaves in the same order. Calls are generated in pairs, the
second often a near miss of the first (an item of another type, another length, a
list for a tuple, a list subclass, a namedtuple, `None`, a nested sequence, a NumPy
array where a jax Array was, `True` where `1` was; for an `eqx.Module`, another
static value, a subclass, a field missing, a field too many).
"""

import collections
import dataclasses
import gc
import inspect
import operator
import types
import weakref
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from differential import needs_fast_path
from helpers import property_settings
from hypothesis import assume, given, strategies as st
from jax.core import Tracer

import filterjit
from filterjit import _dispatch, _fastpath, _readers
from filterjit._binding import Binder, DefaultsGuard, Keywords, kwdefault_values
from filterjit._exact import exact_aux
from filterjit._fastpath import hit_caller, HitCall, HitPlan, MISS, takes_defaults
from filterjit._function import defaults_source
from filterjit._output import Carried
from filterjit._partition import Partition
from filterjit._readers import call_reader
from filterjit._trace import TOP


# The readers are the fast path's: no hit makes one with FILTERJIT_FASTPATH=0.
needs_readers = needs_fast_path

Pair = collections.namedtuple("Pair", "first second")


class Triple(NamedTuple):
    a: Any
    b: Any
    c: Any = None


class SubTriple(Triple):
    pass


class Backwards(Triple):
    """Iterates backwards; JAX flattens it by its items, in order."""

    def __iter__(self):
        return reversed(tuple(self[i] for i in range(len(self))))


class Swapped(NamedTuple):
    """A namedtuple registered with its own flatten: its items in another order."""

    a: Any
    b: Any


jtu.register_pytree_node(
    Swapped, lambda s: ((s.b, s.a), None), lambda _, c: Swapped(c[1], c[0])
)


class Keyed(NamedTuple):
    """A namedtuple registered with its own flatten: its items in order, and
    whether the first is positive in its node data."""

    a: Any
    b: Any


jtu.register_pytree_node(
    Keyed, lambda k: ((k.a, k.b), bool(k.a > 0)), lambda _, c: Keyed(*c)
)


class MyList(list):
    pass


_leaves = st.sampled_from(
    [
        jnp.ones(2),
        jnp.zeros((), dtype=jnp.int32),
        np.ones(2, dtype=np.float32),
        np.float32(1.0),
        1.0,
        -0.0,
        2,
        True,
        1j,
        "a",
        b"b",
        frozenset({1, 2}),
        frozenset(),
        None,
    ]
)
_same_type_items = st.sampled_from([jnp.ones(2), 1.0, 3, np.ones(1), "s"]).flatmap(
    lambda leaf: st.lists(st.just(leaf), max_size=40)
)


def _double(x: Any) -> Any:
    return 2 * x


class Flat(eqx.Module):
    a: Any
    b: Any
    scale: Any = eqx.field(static=True)


class SubFlat(Flat):
    pass


class Bare(eqx.Module):
    x: Any


class SubBare(Bare):
    pass


class Outer(eqx.Module):
    inner: Any
    items: Any
    name: str = eqx.field(static=True)


class SubOuter(Outer):
    pass


# Each class's twin: a subclass, or the class it subclasses.
_TWIN_CLASS = {Flat: SubFlat, Bare: SubBare, Outer: SubOuter}
_TWIN_CLASS.update({v: k for k, v in _TWIN_CLASS.items()})


_statics = st.sampled_from([0.5, 1, 1.0, True, "s", (1, 2), None])
# Functions are leaves too: a Module's activation fields hold them.
_functions = st.sampled_from([jax.nn.relu, jnp.tanh, _double, len])


def _modules(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(Flat, children, children, _statics),
        st.builds(SubFlat, children, children, _statics),
        st.builds(Bare, children),
        st.builds(SubBare, children),
        st.builds(
            lambda cls, *fields: cls(*fields),
            st.sampled_from([Outer, SubOuter]),
            children,
            st.lists(children, max_size=3).map(tuple),
            st.sampled_from(["n", "m"]),
        ),
    )


_module_trees = _modules(
    st.recursive(
        st.one_of(_leaves, _functions),
        lambda inner: st.one_of(
            _modules(inner),
            st.lists(inner, max_size=3),
            st.tuples(inner, inner),
            st.tuples(inner, inner).map(lambda t: Pair(*t)),
            st.tuples(inner, inner).map(lambda t: SubTriple(*t)),
            st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
        ),
        max_leaves=8,
    )
)


def _arguments(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    items = st.one_of(_same_type_items, st.lists(leaves, max_size=5))
    return st.one_of(
        leaves,
        items,
        items.map(tuple),
        items.map(MyList),
        st.tuples(leaves, leaves).map(lambda t: Pair(*t)),
        st.tuples(leaves, leaves, leaves).map(lambda t: Triple(*t)),
        st.tuples(leaves, leaves).map(lambda t: Swapped(*t)),
        st.lists(st.lists(leaves, max_size=2), max_size=2),
        st.dictionaries(st.sampled_from("ab"), leaves, max_size=2),
        _module_trees,
    )


_calls = st.lists(_arguments(_leaves), max_size=4).map(tuple)

# Calls whose arguments are all leaves or sequences of leaves of one type.
_flat_leaves = _leaves.filter(lambda leaf: leaf is not None)
_flat_calls = st.lists(
    st.one_of(_flat_leaves, _same_type_items, _same_type_items.map(tuple)),
    max_size=4,
).map(tuple)

# A leaf of a type close to a given one's: what an `isinstance` check would let by.
_CLOSE = {int: True, float: np.float64(1.0), bool: 1}


_SEQUENCES = (list, tuple, Pair, Triple, SubTriple, Swapped)
# Each namedtuple's twin: of another class, with the same items.
_TWIN_TUPLE = {Triple: SubTriple, SubTriple: Triple, Pair: Swapped, Swapped: Pair}


def _remade(kind: type, items: list[Any]) -> Any:
    """A sequence of type `kind` holding `items` (of any length)."""
    if kind in (list, tuple):
        return kind(items)
    if kind is Swapped and len(items) != 2:  # its flatten needs two
        return tuple(items)
    return tuple.__new__(kind, items)


def _twin(arg: Any) -> Any:
    """A container that holds what `arg` holds but flattens otherwise."""
    if type(arg) is list:
        return MyList(arg)
    if type(arg) in _TWIN_TUPLE:
        return _remade(_TWIN_TUPLE[type(arg)], list(arg))
    if len(arg) == 2:
        return Pair(*arg)
    return list(arg)


def _rebuilt(module: Any, cls: type | None = None, drop: str = "", **fields: Any):
    """A copy of `module` of class `cls`, with `fields` changed and `drop` missing,
    made without `__init__` (as JAX's unflatten makes Modules)."""
    new = object.__new__(cls or type(module))
    values = dict(vars(module), **fields)
    values.pop(drop, None)
    object.__getattribute__(new, "__dict__").update(values)
    return new


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module)


def _is_plain_dict(x: Any) -> bool:
    return type(x) is dict


def _module_near_misses(module: Any, replacements: list[Any]):
    """One-place changes of an `eqx.Module`."""
    names = [f.name for f in dataclasses.fields(module)]
    for name in names:
        yield _rebuilt(module, drop=name)
        for value in replacements:
            yield _rebuilt(module, **{name: value})
    yield _rebuilt(module, __doc__="a wrapper's metadata")
    yield _rebuilt(module, extra=1)
    yield _rebuilt(module, cls=_TWIN_CLASS.get(type(module), Flat))
    if isinstance(module, Flat):  # a static value that compares equal, or not
        for scale in (vars(module).get("scale"), 1, 1.0, True, "s", np.ones(2), (1, 2)):
            yield _rebuilt(module, scale=scale)


def _dict_near_misses(d: dict[Any, Any], replacements: list[Any]):
    """One-place changes of a dict."""
    for key in d:
        yield {k: v for k, v in d.items() if k != key}
        yield {(f"{k}x" if k == key else k): v for k, v in d.items()}
        for value in replacements:
            yield {**d, key: value}
    yield dict(reversed(d.items()))  # inserted in another order: the same
    yield {**d, "z": 1.0}
    yield {**d, 1: 1.0}
    yield collections.OrderedDict(d)
    yield collections.defaultdict(int, d)


def _near_miss(args: tuple[Any, ...], data: st.DataObject) -> tuple[Any, ...]:
    """`args` changed in one place."""
    if not args:
        return (data.draw(_arguments(_leaves)),)
    index = data.draw(st.integers(0, len(args) - 1))
    arg = args[index]
    sequence = type(arg) in _SEQUENCES
    changes = ["argument", "item", "twin", "close", "drop", "extend"]
    change = data.draw(st.sampled_from(changes))
    if _is_module(arg) and change != "argument":
        misses = list(_module_near_misses(arg, [data.draw(_leaves), None]))
        new = misses[data.draw(st.integers(0, len(misses) - 1))]
    elif _is_plain_dict(arg) and change != "argument":
        misses = list(_dict_near_misses(arg, [data.draw(_leaves), None]))
        new = misses[data.draw(st.integers(0, len(misses) - 1))]
    elif change == "item" and sequence and arg:
        items = list(arg)
        items[data.draw(st.integers(0, len(arg) - 1))] = data.draw(_leaves)
        new = _remade(type(arg), items)
    elif change == "twin" and sequence:
        new = _twin(arg)
    elif change == "close" and type(arg) in _CLOSE:
        new = _CLOSE[type(arg)]
    elif change == "close" and sequence and arg and type(arg[0]) in _CLOSE:
        new = _remade(type(arg), [_CLOSE[type(arg[0])], *arg[1:]])
    elif change == "drop" and sequence and arg:
        new = arg[:-1]
    elif change == "extend" and sequence:
        new = _remade(type(arg), [*arg, data.draw(_leaves)])
    elif change == "drop":
        return args[:index] + args[index + 1 :]
    else:
        new = data.draw(_arguments(_leaves))
    return (*args[:index], new, *args[index + 1 :])


def _reader(*args: Any):
    leaves, treedef = jtu.default_registry.flatten(args)
    return call_reader(treedef, tuple(map(type, leaves)))


def _check(recorded: Any, call: Any) -> bool:
    """Whether the reader made from `recorded` exists (then checked against JAX
    on `recorded` and `call`): a structure with a part no reader reads has none,
    and with the fast path off, no hit makes one."""
    leaves, treedef = jtu.default_registry.flatten(recorded)
    types = tuple(map(type, leaves))
    read = call_reader(treedef, types)
    if read is None or not _fastpath.ENABLED:
        return False
    # The recorded call itself is always accepted, with JAX's leaves.
    own = read(recorded)
    assert own is not None
    assert len(own) == len(leaves) and all(map(lambda a, b: a is b, own, leaves))
    taken = read(call)
    if taken is None:
        return True
    jax_leaves, jax_treedef = jtu.default_registry.flatten(call)
    assert jax_treedef == treedef
    # Exactly: a Module's static fields of the recorded types too (`1` is not `1.0`).
    assert exact_aux(jax_treedef) == exact_aux(treedef)
    assert tuple(map(type, jax_leaves)) == types
    assert len(taken) == len(jax_leaves)
    assert all(map(lambda a, b: a is b, taken, jax_leaves))
    _check_top(recorded, call)
    return True


def _plain_hit(partition: Partition, count: int, get: Any) -> Any:
    """The hit of calls of `count` positional arguments on `partition`, finding
    entries with `get`."""
    plain = ([("args", i) for i in range(count)], {})
    call = HitCall((count,), plain, None, None)
    return hit_caller(_plan(partition, call, get, True))


def _plan(partition: Partition, call: HitCall, get: Any, fun_is_leaf: bool) -> HitPlan:
    """The plan of a hit of `call`s on `partition`: an error raised as it was, an
    output finished by its spec alone (one that needs more fails the test)."""

    def finish(*unfinished: Any) -> None:
        raise AssertionError(f"finished by the dispatcher: {unfinished}")

    failed = lambda leaves, error: None  # noqa: E731
    return HitPlan(partition, (call,), get, fun_is_leaf, "f", failed, finish)


def _check_top(recorded: Any, call: Any) -> None:
    """A partition's hit of calls without keywords reads and keys a call as the
    reference path does (`call`, read by `_check` as JAX flattens it), and calls
    the entry with the traced leaves; else it misses, as for keyword arguments,
    before any lookup."""
    if type(recorded) is not tuple:  # a `Keywords`: the call of a hit is a tuple
        return
    leaves, treedef = jtu.default_registry.flatten(recorded)
    partition = Partition(treedef, tuple(map(type, leaves)), TOP, lambda _: object())
    keys = []
    entry = types.SimpleNamespace(guarded=False, with_call=lambda _, *traced: traced)
    hit = _plain_hit(partition, len(recorded), lambda key: keys.append(key) or entry)
    assert hit is not None
    assert hit(None, recorded, {"x": 1}) is MISS and not keys
    out = hit(None, call, {})
    if len(call) != len(recorded):
        assert out is MISS and not keys
        return
    read = jtu.default_registry.flatten(call)[0]
    key = partition.reference_key(read)
    if partition.orders is not None:
        key = (key, partition.orders(call))
    assert keys == [key]
    dynamic = partition.take_dynamic(read)
    assert len(out) == len(dynamic) and all(map(operator.is_, out, dynamic))


class _Ran(Exception):
    """Raised by the entry `_hit_reader`'s hit finds: the call was read."""


def _hit_reader(
    treedef: Any,
    types_: tuple[type, ...],
    fun_is_leaf: bool,
    sources: Any,
    shape: tuple[Any, ...],
    defaults: DefaultsGuard | None = None,
) -> Any:
    """`read(fun, args, kwargs)`: the leaves that a top-level hit of calls of one
    `shape`, bound as `sources`, reads of a call (`None` where it misses), found
    by an entry that raises as it runs; `None` where no hit reads such calls."""
    partition = Partition(treedef, types_, TOP, lambda _: object())

    def jitted(call: Any, *traced: Any) -> Any:
        raise _Ran

    entry = types.SimpleNamespace(guarded=False, with_call=jitted)
    call = HitCall(shape, sources, None, defaults)
    ran: list[list[Any]] = []  # the leaves of the run
    plan = _plan(partition, call, lambda _: entry, fun_is_leaf)
    hit = hit_caller(plan._replace(failed=lambda leaves, _: ran.append(leaves)))
    if hit is None:
        return None

    def read(fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ran.clear()
        try:
            out = hit(fun, args, kwargs)
        except _Ran:
            (leaves,) = ran
            return leaves
        assert out is MISS, out
        return None

    return read


@needs_readers
@pytest.mark.parametrize("sequence", [list, tuple])
def test_top_finishes_the_output_with_the_leaves_the_call_was_read_with(sequence):
    # The leaves a hit gives the output's spec are those read before the call: a
    # list (which the call could change, a host callback say) is copied first.
    x = jnp.ones(2)
    recorded = (sequence([x, x, x, x, x, "tag"]), 2.0)
    leaves, treedef = jtu.default_registry.flatten(recorded)
    partition = Partition(treedef, tuple(map(type, leaves)), TOP, lambda _: object())
    spec = types.SimpleNamespace(plain=True)
    spec.build = lambda traced, inputs: (traced, inputs)

    def jitted(call, *traced):
        if sequence is list:
            recorded[0].insert(0, "changed")
        return Carried(spec, traced)

    entry = types.SimpleNamespace(guarded=False, with_call=jitted)
    hit = _plain_hit(partition, len(recorded), lambda key: entry)
    assert hit is not None
    traced, inputs = hit(None, recorded, {})
    assert all(map(operator.is_, traced, leaves[:5]))
    assert len(inputs) == len(leaves) and all(map(operator.is_, inputs, leaves))


@needs_readers
@property_settings()
@given(_calls, _calls)
def test_accepts_only_what_jax_flattens_alike(recorded, call):
    assume(_check(recorded, call))


@needs_readers
@property_settings()
@given(st.one_of(_flat_calls, _calls), st.data())
def test_near_misses(recorded, data):
    assume(_check(recorded, recorded))
    call = recorded
    for _ in range(3):
        call = _near_miss(call, data)
        _check(recorded, call)


_names = st.lists(st.sampled_from(["a", "b", "c", "d"]), unique=True, max_size=3)


@needs_readers
@property_settings()
@given(_calls, _calls, _names, st.data())
def test_keyword_calls_accept_only_what_jax_flattens_alike(
    positional, keyword, names, data
):
    # A call with keyword arguments: `Keywords(args, kwargs)`.
    kwargs = dict(zip(names, keyword))
    recorded = Keywords(positional, kwargs)
    checked = _check(recorded, recorded)
    _check(recorded, Keywords(_near_miss(positional, data), kwargs))
    changed = _near_miss(tuple(kwargs.values()), data)
    _check(recorded, Keywords(positional, dict(zip(names, changed))))
    _check(recorded, Keywords(positional, dict(zip(["e", *names[1:]], keyword))))
    _check(recorded, Keywords(positional, dict(reversed(kwargs.items()))))
    _check(recorded, positional)
    _check(recorded, (positional, kwargs))
    # And the other way round: a reader of positional calls given keywords.
    assume(_check(positional, recorded) or checked)


def _same_leaves(got: list[Any] | None, expected: list[Any] | None) -> bool:
    if got is None or expected is None:
        return got is expected
    return len(got) == len(expected) and all(map(operator.is_, got, expected))


class Called(eqx.Module):
    """A callable pytree, whose `__call__` holds its defaults."""

    x: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return args, kwargs


def _free(*args: Any, **kwargs: Any) -> Any:
    """A function that is no pytree, whose defaults a hit guards."""
    return args, kwargs


def _guard(fun: Any) -> DefaultsGuard:
    """What a hit of calls of `fun` that take defaults checks (see `Function`)."""
    source = defaults_source(fun)
    assert source is not None
    holder = source.holder()
    assert holder is not None
    kwdefaults = holder.__kwdefaults__
    values = kwdefault_values(kwdefaults)
    return DefaultsGuard(source.path, holder.__defaults__, kwdefaults, values)


_functions_as_pytrees = st.sampled_from([None, Called(jnp.ones(2)), Called(1.0)])


@needs_readers
@property_settings()
@given(
    st.lists(_arguments(_leaves), max_size=3),
    st.lists(_arguments(_leaves), max_size=3),
    _functions_as_pytrees,
    st.data(),
)
def test_calls_read_as_made_are_read_as_bound(passed, defaults, fun, data):
    # A call that needs binding is read as it was made, each bound argument where
    # it comes from (a hit's reading): exactly as the call bound and then read
    # (`call_reader`, itself checked against JAX above), for calls of one shape.
    parameters = [
        inspect.Parameter(f"p{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        for i in range(len(passed))
    ]
    parameters += [
        inspect.Parameter(f"d{i}", inspect.Parameter.KEYWORD_ONLY, default=value)
        for i, value in enumerate(defaults)
    ]
    binder = Binder(inspect.Signature(parameters), "f")
    by_keyword = data.draw(st.integers(0, len(passed)))
    overridden = []
    if defaults:
        indices = st.integers(0, len(defaults) - 1)
        overridden = data.draw(st.lists(indices, unique=True))

    def made(values: tuple[Any, ...], overrides: tuple[Any, ...]):
        count = len(values) - by_keyword
        kwargs = {f"p{i}": values[i] for i in range(count, len(values))}
        kwargs.update({f"d{i}": value for i, value in zip(overridden, overrides)})
        return tuple(values[:count]), kwargs

    def bound_tree(fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args, kwargs = binder(args, kwargs)
        tree = Keywords(args, kwargs) if kwargs else args
        return tree if fun is None else (fun, tree)

    overrides = tuple(data.draw(_arguments(_leaves)) for _ in overridden)
    args, kwargs = made(tuple(passed), overrides)
    leaves, treedef = jtu.default_registry.flatten(bound_tree(fun, args, kwargs))
    types = tuple(map(type, leaves))
    sources = binder.sources((len(args), *kwargs))
    assert sources is not None
    shape = (len(args), *kwargs)
    # Called with `_free` where the function is no pytree: it holds the defaults.
    called = _free if fun is None else fun
    guard = _guard(called) if takes_defaults(sources) else None
    read_call = _hit_reader(treedef, types, fun is None, sources, shape, guard)
    read = call_reader(treedef, types)
    if kwargs or len(args) != len(passed):  # else never read as made
        assert (read_call is None) == (read is None)
    if read_call is None or read is None:
        assume(False)  # a call shape with no reader: nothing to compare
        return
    assert _same_leaves(read_call(called, args, kwargs), leaves)
    for _ in range(4):
        values = _near_miss((*passed, *overrides), data)
        if len(values) != len(passed) + len(overrides):
            continue  # another shape of call
        other = data.draw(_functions_as_pytrees) if fun is not None else None
        args, kwargs = made(values[: len(passed)], values[len(passed) :])
        expected = read(bound_tree(other, args, kwargs))
        called = _free if other is None else other
        assert _same_leaves(read_call(called, args, kwargs), expected)


@needs_readers
def test_mutable_defaults_are_read_every_call():
    # A frozen default's leaves are read once; a list or dict default is read
    # every call, so that one changed in place is seen.
    items = [1.0, jnp.ones(2)]
    table: dict[str, Any] = {"a": 1}
    module = Flat(jnp.ones(2), 1.0, 0.5)

    def f(x, *, items=items, table=table, module=module):
        return x

    binder = Binder(inspect.signature(f), "f")
    args, kwargs = (jnp.ones(2),), {"items": items}
    bound, bound_kwargs = binder(args, kwargs)
    leaves, treedef = jtu.default_registry.flatten(Keywords(bound, bound_kwargs))
    sources = binder.sources((1, "items"))
    assert sources is not None
    shape = (1, "items")
    read = _hit_reader(
        treedef, tuple(map(type, leaves)), True, sources, shape, _guard(f)
    )
    assert read is not None
    assert _same_leaves(read(f, args, kwargs), leaves)
    table["a"] = 2.0
    assert read(f, args, kwargs) is None
    table["a"] = 1
    assert _same_leaves(read(f, args, kwargs), leaves)
    table["b"] = 1
    assert read(f, args, kwargs) is None


@needs_readers
def test_a_reader_of_calls_taking_defaults_checks_they_are_those_read():
    # Defaults may be reassigned (`f.__defaults__ = ...`): a reader given the
    # objects read gives `None` once they are others.
    def f(x, n=2.0, *, m=3.0):
        return x

    binder = Binder(inspect.signature(f), "f")
    args: tuple[Any, ...] = (jnp.ones(2),)
    bound, bound_kwargs = binder(args, {})
    leaves, treedef = jtu.default_registry.flatten(Keywords(bound, bound_kwargs))
    sources = binder.sources((1,))
    assert sources is not None and takes_defaults(sources)
    kwdefaults = f.__kwdefaults__
    assert kwdefaults is not None
    guard = DefaultsGuard("f", f.__defaults__, kwdefaults, (*kwdefaults.values(),))
    read = _hit_reader(treedef, tuple(map(type, leaves)), True, sources, (1,), guard)
    assert read is not None
    assert _same_leaves(read(f, args, {}), leaves)
    f.__kwdefaults__ = {"m": 3.0}  # equal, another object
    assert read(f, args, {}) is None
    f.__kwdefaults__ = guard.kwdefaults
    f.__defaults__ = tuple([2.0])  # equal, another object
    assert read(f, args, {}) is None
    f.__defaults__ = guard.defaults
    assert read(f, args, {}) is not None
    kwdefaults["m"] = 4.0  # changed in place (core v6, finding 6)
    assert read(f, args, {}) is None


def test_calls_with_defaults_match_the_undecorated_function():
    table = {"scale": 2.0}

    def f(x, n=2, *, table=table, shift=None):
        out = x * table["scale"] + n
        return out if shift is None else out + shift

    jitted = filterjit.filter_jit(f)
    x = jnp.arange(3.0)
    for _ in range(3):
        for kwargs in [{}, {"n": 3}, {"shift": 1.0}, {"n": 1.0, "shift": x}]:
            np.testing.assert_array_equal(jitted(x, **kwargs), f(x, **kwargs))
            np.testing.assert_array_equal(jitted(x=x, **kwargs), f(x=x, **kwargs))
        table["scale"] += 1.0  # a static default changed in place: a new trace


def _all_near_misses(args: tuple[Any, ...]):
    """Every one-place change of `args` that `_near_miss` can make, but drawing
    replacements from a fixed list."""
    replacements = [jnp.ones(2), np.ones(2, dtype=np.float32), 1.0, 1, True, None]
    for index, arg in enumerate(args):
        around = (args[:index], args[index + 1 :])
        yield around[0] + around[1]
        news = list(replacements)
        if type(arg) in _CLOSE:
            news.append(_CLOSE[type(arg)])
        if type(arg) in _SEQUENCES:
            kind = type(arg)
            news += [_twin(arg), list(arg), tuple(arg), arg[:-1]]
            news.append(_remade(kind, [*arg, 1]))
            for item in range(len(arg)):
                before, after = arg[:item], arg[item + 1 :]
                for leaf in replacements:
                    news.append(_remade(kind, [*before, leaf, *after]))
                if type(arg[item]) in _CLOSE:
                    close = _CLOSE[type(arg[item])]
                    news.append(_remade(kind, [*before, close, *after]))
        if _is_module(arg):
            news += list(_module_near_misses(arg, replacements))
        if _is_plain_dict(arg):
            news += list(_dict_near_misses(arg, replacements))
        for new in news:
            yield (*around[0], new, *around[1])


@pytest.mark.parametrize(
    "recorded",
    [
        ([jnp.ones(2)] * 3, 1.0),
        ((1, 2, 3), "s", np.float32(1.0)),
        ([1.0, 2.0], [True, False], 2),
        ((jnp.ones(2), jnp.ones(3)), []),
        (np.ones(2), 1j, ()),
        (jnp.ones(2), 1.0, "s", np.float32(1.0), True),
        ([jnp.ones(2), 1.0], (None, 2), [[1.0], ()]),
        (Pair(jnp.ones(2), 1.0), Triple(1, 2, 3), Swapped(1.0, 2.0)),
        (Flat(jnp.ones(2), 1.0, 0.5), jnp.ones(2)),
        ({"w": jnp.ones(2), "b": [1.0, 2]}, {"a": None}, {}),
        (Outer(Bare(1.0), ((jnp.ones(2), 1), None), "n"), 2),
        (Outer(Flat(jnp.ones(2), jax.nn.relu, "s"), (1, None), "n"), 2),
        (Bare([jnp.ones(2), np.float32(1)]), Bare(None)),
        (eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0)),),
    ],
)
@needs_readers
def test_every_near_miss_of_a_fixed_call(recorded):
    # Each has a reader but the one holding a namedtuple with its own flatten.
    assert _check(recorded, recorded) == _fastpath.ENABLED
    for call in _all_near_misses(recorded):
        _check(recorded, call)


class _Opaque:
    pass


@needs_readers
def test_a_leaf_whose_class_is_registered_later_is_read_as_a_node():
    # A user's class is a leaf until registered as a pytree node: a reader made
    # while it was a leaf reads none of its instances after.
    class Later:
        def __init__(self, x: Any):
            self.x = x

    value = Later(jnp.ones(2))
    read = _reader(value, 1.0)
    assert read is not None
    assert _same_leaves(read((value, 1.0)), [value, 1.0])
    jtu.register_pytree_node(Later, lambda v: ((v.x,), None), lambda _, c: Later(*c))
    assert read((value, 1.0)) is None


def test_a_static_whose_class_is_registered_later_is_flattened_from_then():
    # The hit that read it as a static leaf reads it no more: its array is traced.
    class Box:
        def __init__(self, x: Any):
            self.x = x

    g = filterjit.filter_jit(lambda x, box: (x + 1, isinstance(box.x, Tracer)))
    box = Box(jnp.ones(2))
    for _ in range(3):
        assert g(jnp.ones(2), box)[1] is False
    jtu.register_pytree_node(Box, lambda b: ((b.x,), None), lambda _, c: Box(*c))
    for _ in range(3):
        assert g(jnp.ones(2), box)[1] is True


@needs_readers
def test_every_structure_has_a_reader_that_reads_as_jax_flattens():
    array = jnp.ones(2)
    mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    for args in [
        ([array] * 3, 1.0),
        ((1, 2), "s", np.float32(1)),
        ([],),
        (),
        ([array, 1.0],),
        ([[array]],),
        (None, (array, None)),
        (Flat(array, 1.0, 0.5), array),
        (Outer(Bare(array), (Flat(1, 2, None),), "n"),),
        (mlp, array),  # its activations are functions
        ({"b": array, "a": [1.0, None]},),
        (Pair(1, 2), SubTriple(array, (), None)),
        (Bare({"a": array}),),
        (object(),),  # a sentinel: no program registers `object` as a node
        (MyList([1]),),  # leaves, as long as their classes are not registered
        (_Opaque(),),
        # Nodes without a straight-line reader, flattened by JAX.
        ({1: array},),  # keys that are not strings
        (collections.OrderedDict(a=array),),
        (Swapped(1, 2),),  # namedtuples with a registration of their own
        (Keyed(1.0, 2.0),),
        (Backwards(1.0, 2.0, 3.0),),  # read by its items, not by iterating
        (Bare(jtu.Partial(_double, array)),),
        (_rebuilt(Flat(array, 1.0, 0.5), extra=1),),  # more than its fields
        (_rebuilt(Flat(array, 1.0, 0.5), drop="b"),),  # a field missing
        (_rebuilt(Flat(array, 1.0, 0.5), __doc__="a wrapper's metadata"),),
    ]:
        assert _reader(*args) is not None, args
        assert _check(args, args) == _fastpath.ENABLED
    # Calls with keyword arguments, and a wrapped Module's calls, `(fun, call)`.
    for tree in [
        Keywords((array,), {"model": mlp, "n": 3}),
        Keywords((), {"b": array, "a": Flat(array, 1.0, 0.5)}),
        (mlp, Keywords((array,), {"key": None})),
    ]:
        leaves, treedef = jtu.default_registry.flatten(tree)
        reader = call_reader(treedef, tuple(map(type, leaves)))
        assert reader is not None, tree
        taken = reader(tree)
        assert taken is not None and all(map(lambda a, b: a is b, taken, leaves))


def test_leaf_types_are_leaves_to_jax():
    # The reader takes instances of these types as leaves without asking JAX: if
    # JAX ever flattens one of them as a node, this fails.
    from filterjit._leaves import _LEAF_TYPES

    samples = {
        float: 1.0, int: 1, bool: True, complex: 1j, str: "s", bytes: b"b",
        frozenset: frozenset({1}), types.FunctionType: _double,
        types.BuiltinFunctionType: len, jax.custom_jvp: jax.nn.relu,
        jax.custom_vjp: jax.custom_vjp(_double),
        type(jax.jit(_double)): jax.jit(_double), object: object(),
    }  # fmt: skip
    assert set(samples) == _LEAF_TYPES
    for kind, sample in samples.items():
        assert type(sample) is kind
        leaves, treedef = jtu.default_registry.flatten(sample)
        assert leaves == [sample] and treedef.num_nodes == 1, kind


def test_module_layouts_are_confirmed_by_jax():
    # Equinox's layout of a Module class is checked against JAX's flatten of a
    # probe: if Equinox changes how it flattens, Modules lose the fast path, and
    # this says so.
    for cls in (Flat, SubFlat, Bare, Outer, eqx.nn.Linear, eqx.nn.MLP):
        layout = _readers._layout(cls)
        assert layout is not None, cls
    layout = _readers._layout(Flat)
    assert layout is not None
    assert layout.static == ("scale",) and layout.dynamic == ("a", "b")
    # A wrapper made by `eqx.module_update_wrapper` holds the function's metadata
    # too, and is read with it.
    wrapper = _readers._layout(type(eqx.filter_vmap(jnp.tanh)))
    assert wrapper is not None and wrapper.wrapper is not None


def test_namedtuple_classes_are_confirmed_by_jax():
    # A namedtuple class is read only where the text of JAX's structure of a probe
    # says JAX flattens it as a namedtuple: if that text changes, namedtuples lose
    # the fast path, and this says so.
    state: Any = optax.adam(1e-3).init(jnp.ones(2))
    for cls in (Pair, Triple, SubTriple, type(state[0]), type(state[1])):
        assert _readers._is_namedtuple(cls), cls
    for cls in (Swapped, Keyed, Backwards, tuple, MyList, dict):
        assert not _readers._is_namedtuple(cls), cls


@dataclasses.dataclass
class Reversed:
    a: Any
    b: Any


jtu.register_pytree_node(
    Reversed, lambda r: ((r.b, r.a), (None,)), lambda _, c: Reversed(c[1], c[0])
)


@dataclasses.dataclass
class Registered:
    a: Any
    b: Any = dataclasses.field(metadata={"static": True})


jtu.register_dataclass(Registered, data_fields=["a"], meta_fields=["b"])


def test_classes_not_flattened_as_equinox_does_have_no_layout():
    # The probe must see JAX flatten the fields that are children in field order,
    # with the static ones after a head in the node data; else no layout.
    assert _readers._layout(Reversed) is None
    assert _readers._layout(Registered) is None


@needs_readers
def test_repeated_flat_calls_are_not_flattened(monkeypatch):
    f = filterjit.filter_jit(lambda xs, k: [x * k for x in xs])
    xs = [jnp.ones(2), jnp.full(2, 2.0)]
    f(xs, 3.0)
    flattened = []
    flatten = _dispatch._flatten
    monkeypatch.setattr(
        _dispatch, "_flatten", lambda tree: flattened.append(1) or flatten(tree)
    )
    out = f(xs, 3.0)
    assert flattened == []
    assert [float(o[1]) for o in out] == [3.0, 6.0]
    # A near miss takes the full path, and is right.
    out = f([*xs, np.ones(2, dtype=np.float32)], 3.0)
    assert flattened == [1]
    assert [float(o[1]) for o in out] == [3.0, 6.0, 3.0]


class Scaled(eqx.Module):
    weight: Any
    activation: Any
    scale: float = eqx.field(static=True)

    @filterjit.filter_jit
    def __call__(self, x: jax.Array) -> jax.Array:
        return self.activation(x * self.weight) * self.scale

    def undecorated(self, x: jax.Array) -> jax.Array:
        return self.activation(x * self.weight) * self.scale


class Apply(eqx.Module):
    fn: Any

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fn(x)


@needs_readers
def test_repeated_module_calls_are_not_flattened(monkeypatch):
    model = Scaled(jnp.full(2, 2.0), jnp.tanh, 0.5)
    as_function = filterjit.filter_jit(Apply(jnp.sin))  # a Module as the function
    x = jnp.ones(2)
    model(x)
    as_function(x)
    flattened = []
    flatten = _dispatch._flatten
    monkeypatch.setattr(
        _dispatch, "_flatten", lambda tree: flattened.append(1) or flatten(tree)
    )
    np.testing.assert_allclose(model(x), jnp.tanh(2.0) * 0.5)
    np.testing.assert_allclose(as_function(x), jnp.sin(x))
    assert flattened == []
    # Another static value, another activation, another class: the full path.
    np.testing.assert_allclose(
        Scaled(jnp.full(2, 2.0), jnp.tanh, 2.0)(x), jnp.tanh(2.0) * 2.0
    )
    np.testing.assert_allclose(Scaled(model.weight, jnp.sin, 0.5)(x), jnp.sin(2.0) / 2)
    assert len(flattened) == 2


@pytest.mark.parametrize("nested", [False, True])
def test_alternating_near_misses_match_the_undecorated_function(nested):
    def fun(xs, k):
        total = sum(
            jnp.sum(jnp.asarray(x, dtype=jnp.float32)) * (i + 1)
            for i, x in enumerate(xs)
        )
        return total * k

    f = filterjit.filter_jit(fun)
    a, b = jnp.ones(2), jnp.full(2, 3.0)
    calls = [
        ([a, b], 2.0),
        ([a, b], 3),
        ((a, b), 2.0),
        ([a, b, a], 2.0),
        ([a, np.full(2, 3.0, dtype=np.float32)], 2.0),
        ([1.0, 2.0], 2.0),
        ([1.0, 5.0], 2.0),
        ([1, 2], 2.0),
        ([True, False], 2.0),
        (Pair(a, b), 2.0),
        ([b, a], 2.0),
    ]
    for args in calls * 2:
        _check(calls[0], args)
        if nested:
            got = jax.jit(lambda: f(*args))()
        else:
            got = f(*args)
        np.testing.assert_allclose(got, fun(*args))


@pytest.mark.parametrize("nested", [False, True])
def test_alternating_module_calls_match_the_undecorated_method(nested):
    w = jnp.full(2, 2.0)
    models = [
        Scaled(w, jnp.tanh, 0.5),
        Scaled(w, jnp.tanh, 0.5),  # another object, equal
        Scaled(w, jnp.tanh, 1.0),
        Scaled(w, jnp.tanh, 1),  # equal to 1.0: the same structure
        Scaled(w, jnp.sin, 0.5),
        Scaled(np.full(2, 3.0, dtype=np.float32), jnp.tanh, 0.5),
        Scaled(w.astype(jnp.bfloat16), jnp.tanh, 0.5),
        _rebuilt(Scaled(w, jnp.tanh, 0.5), weight=jnp.full(2, 5.0)),
        _rebuilt(Scaled(w, jnp.tanh, 0.5), __doc__="wrapped"),
    ]
    x = 1.5  # weakly typed
    for model in models * 2:
        _check((models[0], x), (model, x))
        if nested:
            got = jax.jit(lambda: model(x))()
        else:
            got = model(x)
        want = model.undecorated(x)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got, want, rtol=1e-2)


@needs_readers
def test_a_module_read_again_gives_its_leaves_and_keeps_nothing_alive():
    # The Module read last is remembered while it lives: read again, it gives its
    # leaves at once; dead, nothing of it is kept.
    inner = Flat(jnp.ones(2), Bare(np.ones(3)), 0.5)
    recorded = (Outer(inner, (jnp.zeros(1), None), "n"),)
    leaves, treedef = jtu.default_registry.flatten(recorded)
    read = call_reader(treedef, tuple(map(type, leaves)))
    assert read is not None
    for _ in range(3):
        taken = read(recorded)
        assert taken is not None and all(map(lambda a, b: a is b, taken, leaves))
    fresh = Flat(jnp.ones(2), Bare(np.ones(3)), 0.5)
    other = (Outer(fresh, (jnp.zeros(1), None), "n"),)
    taken = read(other)
    assert taken is not None
    assert all(map(lambda a, b: a is b, taken, jtu.tree_leaves(other)))
    array_ref = weakref.ref(fresh.b.x)
    del other, fresh, taken
    gc.collect()
    assert array_ref() is None


@needs_readers
def test_a_remembered_module_is_never_taken_for_none():
    # Found by test_leaf_kinds_properties: once the Module remembered has died, its dead
    # reference gives `None`, and a call with `None` in its place must not match.
    recorded = ([Flat(1.0, 2.0, 0.5), None],)
    leaves, treedef = jtu.default_registry.flatten(recorded)
    read = call_reader(treedef, tuple(map(type, leaves)))
    assert read is not None
    assert read(([Flat(1.0, 2.0, 0.5), None],)) is not None  # remembered, then dead
    gc.collect()
    assert read(([None, None],)) is None
    assert read(([Flat(1.0, 2.0, 0.5), None],)) is not None


def test_a_module_holding_a_list_is_read_afresh():
    # A list below a Module can change between calls: never remembered.
    model = Bare([jnp.ones(2)])
    wrapped = filterjit.filter_jit(lambda m: jnp.sum(jnp.stack(m.x), axis=0))
    assert wrapped(model).tolist() == [1.0, 1.0]
    model.x.append(jnp.ones(2))
    assert wrapped(model).tolist() == [2.0, 2.0]
    model.x[0] = jnp.zeros(2)
    assert wrapped(model).tolist() == [1.0, 1.0]
