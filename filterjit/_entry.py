"""One cache entry: the `jax.jit` of a closure whose only inputs are a call's traced
leaves (the others captured), so that JAX's cache holds one trace per set of avals."""

import functools as ft
import inspect
import types
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer

from ._binding import FUNCTION, LeafParameter, positional_names
from ._cache import BoundedCache
from ._diagnostics import TraceLog, Traces
from ._donated import record
from ._errors import identifier, integer_scalars, note_loop_in_trace, traced_a_check
from ._exact import ndarray_key
from ._function import bound_arrays, Function, python_function
from ._level import ABSTRACT, EAGER, Level, STAGED, TOP
from ._nested import nested_caller
from ._options import Options, UNSPECIFIED
from ._output import (
    Carried,
    container_index,
    FilledContainers,
    jit_output,
)
from ._partition import Partition
from ._structure import replace_leaves


# `inline=True`: inlined while tracing (jax >= 0.11.2 reads `True` as `JAX_LATE`).
_INLINE: Any = getattr(getattr(jax, "Inline", None), "JAX_EARLY", True)


def aval_key(x: object) -> tuple[Any, ...]:
    """What a trace of the jitted function sees of a traced leaf."""
    aval = jax.typeof(x)
    return aval.shape, aval.dtype, aval.weak_type  # pyright: ignore[reportAttributeAccessIssue]


class Entry:
    """A jitted function for one cache key, and what routes a call to it (what a
    trace learned of its output is kept in that output: see `_output`)."""

    __slots__ = (
        "jitted",
        "labels",
        "captured",
        "has_checks",
        "traced_avals",
        "traces",
        "guarded",
        "aliases",
        "with_call",
        "nested",
        "_dropped_with",
        "__weakref__",
    )

    def __init__(
        self,
        with_call: Callable[..., object],
        captured: Sequence[tuple[np.ndarray, object]],
        staged: bool,
        labels: list[str] | None = None,
    ):
        # The jitted function, called with a `CallUnderWay` first, the call a trace
        # sees (see `run_nested` and `ForCall`), then the traced leaves; what calls
        # it nested; and what calls it with `TOP_CALL`, a trace then seeing the
        # leaves of the call that made the entry (at C speed: a call whose static
        # leaves its key proves the same).
        self.with_call = with_call
        self.nested = nested_caller(with_call)
        self.jitted = ft.partial(with_call, TOP_CALL)
        self.labels = labels or []  # of the traced leaves, for errors
        # Nested: the NumPy arrays compiled in, with their keys when captured.
        self.captured = captured
        self.has_checks = False  # whether some trace held a runtime check (`awaited`)
        self.traced_avals: set[tuple[Any, ...]] = set()  # for `explain`
        self.traces = Traces()  # the rows of its traces, for the retrace log
        # Whether calls take the checked path (`Dispatcher._run`); nested, always.
        self.guarded = bool(captured) or staged
        # Groups of input positions that held one object in a trace that handed one
        # back (`OutputSpec.aliases`): it serves only calls in which each group holds
        # one object again (`serves`), and hits leave every call to the dispatcher.
        self.aliases: tuple[tuple[int, ...], ...] = ()
        self._dropped_with: Any = None

    def serves(self, leaves: Sequence[object]) -> bool:
        """Whether each of `aliases` holds one object in a call's `leaves`."""
        return all(all(leaves[p] is leaves[g[0]] for p in g) for g in self.aliases)

    def valid(self) -> bool:
        """Whether no NumPy array compiled in has been changed since it was keyed."""
        return all(ndarray_key(array) == key for array, key in self.captured)

    def awaited(self, out: object) -> Any:
        """What a call outside staged traces waits for, to raise a failed runtime
        check at the call (see `OutputSpec.awaited`); `None` for nothing."""
        if type(out) is Carried:
            return out.spec.awaited(out.leaves)
        # A boxed output (`out_shardings`, top level only) waits if any trace of the
        # entry checked.
        if not self.has_checks:
            return None
        return [
            leaf
            for leaf in jtu.tree_leaves(out)
            if isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer)
        ]

    def drop_with(
        self, mortals: Sequence[object], cache: "BoundedCache[Entry]", key: Hashable
    ) -> None:
        """Drops this entry from `cache` when the first of `mortals` dies (a trace
        ends, an array keyed by its `id` is freed)."""
        cache_ref, entry_ref = weakref.ref(cache), weakref.ref(self)

        def drop(_: object) -> None:  # `discard` ignores an entry that died first
            if (alive := cache_ref()) is not None:
                alive.discard(key, entry_ref())

        self._dropped_with = [weakref.ref(mortal, drop) for mortal in mortals]


class CallUnderWay(int):
    """A nested call's own pytree and leaves (`under_way`; a top-level call's
    leaves, with `None` for its pytree), handed to its entry's jitted function as
    its first argument, a static one: every one equal to and hashed as 0, so that
    every call of the entry (at the top level, one that holds no call) finds JAX's
    traces of it, and emptied when the call returns, so that the one JAX keeps in
    its cache key holds nothing of the call's."""

    under_way: tuple[Any, list[Any]] | None = None
    # The containers of the call's pytree, listed by a trace before the function
    # ran (see `_output.container_index`).
    nodes: list[Any] | None = None


# The `CallUnderWay` of every top-level call: it holds no call.
TOP_CALL = CallUnderWay()


def _run_under_way(
    run: Callable[..., Any], under_way: tuple[Any, list[Any]], dynamic: Any
) -> tuple[Any, list[Any] | None]:
    """`run(call, *dynamic)` with a new `CallUnderWay` holding `under_way`, emptied
    when it returns (JAX keeps it in its cache key); and the containers a trace
    listed in it before the function ran (`None`: no trace ran)."""
    call = CallUnderWay()
    call.under_way = under_way
    try:
        return run(call, *dynamic), call.nodes
    finally:
        call.under_way = call.nodes = None


def run_nested(
    entry: Entry, tree: object, leaves: list[object], dynamic: Iterable[object]
) -> tuple[Any, list[Any] | None]:
    """Calls an entry's jitted function nested, with the call's traced leaves
    `dynamic`, its pytree `tree` and all its `leaves` at hand for a trace; and the
    containers of `tree` as a trace listed them before the function ran (`None`:
    no trace ran)."""
    return _run_under_way(entry.nested, (tree, leaves), dynamic)


class ForCall:
    """An entry's jitted function for one top-level or ahead-of-time call, whose
    traces see that call's `leaves` (its static leaves, not those of the call that
    made the entry: equal by `==`, they may differ): called, lowered, traced or
    shape-evaluated with the traced leaves alone (see `_run_under_way`)."""

    __slots__ = ("_with_call", "_leaves")

    def __init__(self, entry: Entry, leaves: list[object]):
        self._with_call = entry.with_call
        self._leaves = leaves

    def _run(self, stage: str | None, dynamic: Sequence[object]) -> Any:
        run = self._with_call if stage is None else getattr(self._with_call, stage)
        return _run_under_way(run, (None, self._leaves), dynamic)[0]

    def __call__(self, *dynamic: object) -> Any:
        return self._run(None, dynamic)

    def lower(self, *dynamic: object) -> Any:
        return self._run("lower", dynamic)

    def trace(self, *dynamic: object) -> Any:
        return self._run("trace", dynamic)

    def eval_shape(self, *dynamic: object) -> Any:
        return self._run("eval_shape", dynamic)


def _signature(labels: list[str]) -> inspect.Signature:
    """Positional parameters named after argument paths, each a unique identifier,
    for JAX's messages."""
    names: list[str] = []
    for label in labels:
        name = identifier(label)
        while name in names:
            name += "_"
        names.append(name)
    kind = inspect.Parameter.POSITIONAL_ONLY
    return inspect.Signature([inspect.Parameter(name, kind) for name in names])


class EntryMaker(NamedTuple):
    """What every entry of one dispatcher is made with: the function, its options
    and its trace log."""

    function: Function
    options: Options
    trace_log: TraceLog


def make_entry(
    maker: EntryMaker,
    fun: object,
    level: Level,
    partition: Partition,
    leaf_parameters: list[LeafParameter],
    leaves: Sequence[object],
    defaulted: tuple[str, ...] = (),
) -> Entry:
    """The entry for a call with these leaves, not yet traced. `defaulted`: the
    parameters the call left to their defaults (not donated)."""
    function, options, trace_log = maker
    treedef, dynamic_positions = partition.treedef, partition.dynamic_positions
    labels = [p.label for p in leaf_parameters]
    # The call's static leaves, kept for the traces of calls that hand over none
    # (`TOP_CALL`): at the top level, where the key proves them the same. Every
    # other call hands over its own (`ForCall`, `run_nested`), and nothing else is
    # kept: no array, nor a value that may hold one.
    keeps_call = level != STAGED and not partition.by_eq
    template: list[Any] = list(leaves) if keeps_call else [None] * len(leaves)
    for position in dynamic_positions:
        template[position] = None
    roles = partition.roles()
    log = trace_log if level in (TOP, EAGER) else None
    staged = level == STAGED
    deep = partition.deep
    boxed = not staged and options.out_shardings is not UNSPECIFIED
    # The NumPy arrays its traces may compile in: checked for changes before use.
    arrays = [leaves[p] for p in partition.array_positions] + bound_arrays(fun)
    captured = [(a, ndarray_key(a)) for a in arrays if isinstance(a, np.ndarray)]
    # `run` keeps alive neither its entry (a cycle) nor a function (its caches').
    entry_ref: Callable[[], Entry | None]
    fun_ref: Callable[[], Any]
    try:
        fun_ref = weakref.ref(fun) if function.fun_is_leaf else lambda: None
    except TypeError:
        fun_ref = lambda: fun  # noqa: E731

    traced_labels = [labels[p] for p in dynamic_positions]
    traced_types = [partition.types[p] for p in dynamic_positions]

    def trace(taken: CallUnderWay, dynamic: Sequence[object]) -> Any:
        """The function called with a call's traced leaves `dynamic`: in the
        call's own pytree and leaves `taken.under_way` (at the top level, its
        leaves alone), else in a copy of those of the call that made the entry."""
        under_way = taken.under_way
        entry = entry_ref()
        assert keeps_call or under_way is not None  # see `keeps_call`
        inputs = list(template if under_way is None else under_way[1])
        for position, leaf in zip(dynamic_positions, dynamic):
            inputs[position] = leaf
        # Nested: the caller's own pytree handed over (at the top level, none).
        tree = None if under_way is None else under_way[0]
        nested = tree is not None
        if tree is None or deep:  # deep: JAX's rebuild (`_structure`)
            call = jtu.tree_unflatten(treedef, inputs)
        else:  # the caller's own arguments, traced leaves replaced
            call = replace_leaves(tree, lambda position, _: inputs[position])
        # The containers it may hand back, found before it runs (it may change them:
        # pop a key, or mark an `eqx.nn.State` used); nested, for every call of
        # the trace to find its own by the same indexes.
        containers = None if deep or boxed else container_index(call)
        if nested:
            taken.nodes = None if containers is None else containers.nodes
        f, args, kwargs = function.split_call(fun_ref(), call)
        filled = None
        if nested:
            named = [(function.label(i), a) for i, a in enumerate(args)]
            named += [(function.label(k), v) for k, v in kwargs.items()]
            filled = FilledContainers(named)
        try:
            output = f(*args, **kwargs)
        except ValueError as error:  # noted, raised as it is
            if not staged:  # its NumPy and JAX integer scalars traced here
                scalars = integer_scalars(traced_labels, traced_types, dynamic)
                note_loop_in_trace(error, function.name, scalars)
            raise
        if filled is not None:
            filled.check(function.name)
        # Whether a failed check is raised at the call (never nested), which waits.
        runtime_check = not staged and traced_a_check()
        if entry is not None:
            if runtime_check:
                entry.has_checks = entry.guarded = True
            entry.traced_avals.add(tuple(map(aval_key, dynamic)))
        if log is not None and not nested:
            log.record(labels, roles, inputs, None if entry is None else entry.traces)
        out = jit_output(output, inputs, runtime_check, boxed, containers)
        if entry is not None and type(out) is Carried and out.spec.aliases:
            entry.aliases = (*entry.aliases, *out.spec.aliases)
            entry.guarded = True
        return out

    def run(call: CallUnderWay, *dynamic: object) -> Any:
        return trace(call, dynamic)

    # So that JAX's messages point at the user's function and name its arguments.
    run.__name__ = function.name.rpartition(".")[2]
    run.__qualname__ = function.name
    run.__signature__ = _signature(["(call)", *traced_labels])  # pyright: ignore[reportFunctionMemberAccess]
    # JAX follows `__wrapped__` to a `__code__` (the function and its `self` unkept).
    if (found := python_function(fun)) is not None:
        code = found[0].__code__
        source = types.SimpleNamespace(__name__=found[0].__name__, __code__=code)
        run.__wrapped__ = source  # pyright: ignore[reportFunctionMemberAccess]
    jitkwargs = dict(options.jitkwargs)
    if staged:
        jitkwargs["inline"] = _INLINE if options.inline is True else options.inline
        # The outer program is compiled with its own options (jax.jit refuses them
        # nested, where the undecorated function runs).
        jitkwargs.pop("compiler_options", None)
    if boxed:  # never staged
        jitkwargs["out_shardings"] = options.out_shardings
    if options.in_shardings is not UNSPECIFIED and not staged:
        jitkwargs["in_shardings"] = _leaf_shardings(
            function, options.in_shardings, partition, leaves
        )
    donated: tuple[int, ...] = ()
    if level in (TOP, ABSTRACT) and options.donate != "none":
        donated = _donated(options, function, leaf_parameters, partition, defaulted)
        # Counted among the positional arguments, the `CallUnderWay` first.
        jitkwargs["donate_argnums"] = tuple(i + 1 for i in donated)
    # Every trace takes a `CallUnderWay` first, the call it is made for.
    jitkwargs["static_argnums"] = 0
    with_call = jax.jit(run, **jitkwargs)
    if options.donate in ("all", "all-except-first") and level == TOP:
        with_call = _silencing(with_call)
    if donated:
        with_call = _recording(with_call, donated, function.name, traced_labels)
    entry = Entry(with_call, captured, staged, traced_labels)
    entry_ref = weakref.ref(entry)
    return entry


def _recording(
    jitted: Callable[..., object],
    donated: tuple[int, ...],
    name: str,
    labels: list[str],
) -> Any:
    """`jitted` (which takes a `CallUnderWay` first), noting (weakly) which arrays
    each call donated, for the error that passing one again raises (see
    `_donated`)."""
    donated_labels = [labels[i] for i in donated]
    every = donated == tuple(range(len(labels)))

    def call(taken: CallUnderWay, *dynamic: object) -> Any:
        out = jitted(taken, *dynamic)
        arrays = dynamic if every else [dynamic[i] for i in donated]
        record(arrays, name, donated_labels)
        return out

    for method in ("lower", "trace", "eval_shape"):
        setattr(call, method, getattr(jitted, method))
    return call


def _silencing(jitted: Callable[..., object]) -> Any:
    """`jitted`, called with JAX's warning about unusable donations silenced."""

    def call(*args: object) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return jitted(*args)

    for method in ("lower", "trace", "eval_shape"):
        setattr(call, method, getattr(jitted, method))
    return call


def _donated(
    options: Options,
    function: Function,
    leaf_parameters: list[LeafParameter],
    partition: Partition,
    defaulted: tuple[str, ...],
) -> tuple[int, ...]:
    """Which traced leaves (as indices among them) are donated: those of arguments
    the caller passed, by name (`**kwargs` by keyword, as `donate_argnames`); never
    a default. A method's receiver is its first argument and what a partial binds
    is none; or (`receiver_is_argument` off) the function's own traced leaves are
    no argument, donated alike under every string option where `donate_function`
    says, and "first" is the call's first argument."""
    donate = options.donate
    spare_first = isinstance(donate, str) and donate.endswith("except-first")
    names = set(donate) if isinstance(donate, tuple) else None
    own_leaves = not options.receiver_is_argument
    receiver = None if own_leaves else function.receiver
    donated = []
    for i, position in enumerate(partition.dynamic_positions):
        parameter, index, _ = leaf_parameters[position]
        if parameter == FUNCTION and own_leaves:
            if options.donate_function:
                donated.append(i)
            continue
        if parameter == FUNCTION:
            if receiver is None:  # bound in a partial: not an argument
                continue
            parameter, index = receiver, 0
        elif receiver is not None and index is not None:
            index += 1
        donatable = parameter not in defaulted and not (spare_first and index == 0)
        if donatable and (names is None or parameter in names):
            donated.append(i)
    return tuple(donated)


def _leaf_shardings(
    function: Function,
    in_shardings: object,
    partition: Partition,
    leaves: Sequence[object],
) -> tuple[Any, ...]:
    """`in_shardings`, a prefix of the positional arguments (one sharding or `None`
    for all of them, as in `jax.jit`), for each traced leaf."""
    call = jtu.tree_unflatten(partition.treedef, leaves)
    _, args, kwargs = function.split_call(None, call)
    if in_shardings is None or isinstance(in_shardings, jax.sharding.Sharding):
        in_shardings = (in_shardings,) * len(args)  # one for every argument
    elif isinstance(in_shardings, tuple) and len(in_shardings) < len(args):
        # As in `jax.jit`, a prefix may leave out arguments left to defaults.
        skipped = function.parameters[len(in_shardings) : len(args)]
        if len(positional_names(skipped)) == len(args) - len(in_shardings) and all(
            p.default is not p.empty for p in skipped
        ):
            in_shardings += (None,) * len(skipped)
    if not isinstance(in_shardings, tuple) or len(in_shardings) != len(args):
        raise ValueError(
            f"{function.name}: in_shardings must be one sharding (or None) for "
            f"all positional arguments, or a tuple with one entry per positional "
            f"argument ({len(args)} in this call), each a sharding, None, or a "
            f"pytree of them that is a prefix of the argument; got {in_shardings!r}."
        )
    per_leaf: list[Any] = []
    for index, (sharding, arg) in enumerate(zip(in_shardings, args)):
        # None is a sharding here.
        shardings, prefix = jtu.tree_flatten(sharding, is_leaf=lambda x: x is None)
        try:
            # Not jax.tree.broadcast, which takes a None in the argument for a leaf.
            subtrees = prefix.flatten_up_to(arg)
        except (ValueError, TypeError):
            raise ValueError(
                f"{function.name}: in_shardings[{index}] is not a pytree prefix of "
                f"argument `{function.label(index)}`: its structure is "
                f"{prefix}, and the argument's is {jtu.tree_structure(arg)}. Give "
                "one sharding (or None) for the whole argument, or a pytree of them "
                "with the argument's structure."
            ) from None
        for leaf_sharding, subtree in zip(shardings, subtrees):
            per_leaf += [leaf_sharding] * len(jtu.tree_leaves(subtree))
    per_leaf += [None] * len(jtu.tree_leaves(kwargs))
    per_leaf[:0] = [None] * (len(leaves) - len(per_leaf))  # the function's own
    return tuple(per_leaf[position] for position in partition.dynamic_positions)
