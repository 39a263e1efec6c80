"""Dispatching a call: the caches of one function with one set of options, shared
by its wrappers with those options; a call tries the generated hits of its level
(`Dispatcher.hits`); where none reads it, the reference path (`Dispatcher.call`),
which makes the hits from what its runs learned (`Dispatcher._learn`)."""

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu

from . import _fastpath, _trace
from ._binding import Args, Kwargs, LeafParameter, Shape
from ._cache import BoundedCache
from ._diagnostics import Explanation, TraceLog
from ._entry import aval_key, Entry, EntryMaker, ForCall, make_entry, run_nested
from ._errors import (
    call_checked,
    check_traceable,
    key_error,
    name_failure,
    note_recursion,
    wait_checked,
)
from ._exact import exact_aux
from ._fastpath import chained, Hit, hit_caller, HitCall, HitPlan, miss
from ._function import Function
from ._level import ABSTRACT, EAGER, Level, LEVELS, STAGED, TOP
from ._multiprocess import check_statics_agree, spans_processes
from ._options import Options
from ._output import Carried, OutputSpec
from ._partition import Partition
from ._structure import PyTreeDef


# Bounds on one function's caches. A nested entry pins the concrete arrays it was
# traced with (a top-level one, static values only): their cache counts bytes too.
TOP_MAXSIZE = 4096
STAGED_MAXSIZE = 256
STAGED_MAXBYTES = 16 * 2**20

_flatten = jtu.default_registry.flatten

# Bounds on the shapes of call a route's hit reads, on the routes whose hits a
# level tries in turn, on the outputs a route's hit builds inline, and on the
# shapes whose defaulted parameters are kept.
_MAX_HIT_CALLS = 8
_MAX_LEARNED = 4
_MAX_HITS_PER_LEVEL = 4
_MAX_CALL_SHAPES = 64


def _in_jax_order(orders: tuple[tuple[Any, ...], ...]) -> bool:
    """Whether every dict of a call is in the order JAX rebuilds it in."""
    try:
        return all(list(keys) == sorted(keys) for keys in orders)
    except TypeError:
        return False


@dataclasses.dataclass(frozen=True, eq=False, slots=True)
class Route:
    """The dispatcher's record of one partition, replaced whole under its `key` in
    the dispatcher's routes, never changed: the lookup of its entries (`get`: the
    top level's where `shares_top`), the parameter of each leaf, the shapes of call
    its hit reads (`None`: one it cannot), the output specs whose outputs the hit
    builds inline, and the hit."""

    partition: Partition
    get: Callable[[Hashable], Entry | None]
    shares_top: bool
    key: tuple[Any, ...]
    leaf_parameters: list[LeafParameter]
    calls: Mapping[Shape, HitCall | None] = dataclasses.field(default_factory=dict)
    learned: tuple[OutputSpec, ...] = ()
    hit: Hit | None = None

    def labels(self) -> list[str]:
        return [p.label for p in self.leaf_parameters]


def _over_bound(cache: BoundedCache[Entry], nbytes: int, entry: Entry) -> object | None:
    """Where `entry` pins more bytes than `cache` may hold, or a copy JAX made of
    a NumPy constant of another dtype (a float64 one without x64: found by the
    array's identity while it lives, it would be read after the array is changed
    in place): the trace under way, for which alone the entry is kept (as the
    undecorated program's constants are). `None` where within the bound, or the
    trace cannot be found (then evicted)."""
    dtypes = [array.dtype for array, _ in entry.captured]
    copied = any(jax.dtypes.canonicalize_dtype(d) != d for d in dtypes)
    if not copied and (cache.maxbytes is None or nbytes <= cache.maxbytes):
        return None
    trace = _trace.current_trace()
    return trace if type(trace).__weakrefoffset__ else None


class Dispatcher:
    """The caches of one function with one set of options, per level: the routes
    by (structure, leaf types), the entries by key, the hit a wrapper calls first."""

    def __init__(self, fun: object, options: Options, fast: bool | None = None):
        # `fast`: whether generated hits read calls (unless FILTERJIT_FASTPATH=0).
        self._fast = _fastpath.ENABLED if fast is None else fast
        self.function = Function(fun)
        self.options = options
        self.trace_log = TraceLog(self.function.name, fun)
        self.routes = tuple(BoundedCache[Route](TOP_MAXSIZE) for _ in Level)
        # Indexed by level: TOP, EAGER, STAGED, ABSTRACT. The top level and eager
        # transforms differ only in donation, so without it they share entries.
        top = BoundedCache[Entry](TOP_MAXSIZE)
        eager = top if options.donate == "none" else BoundedCache(TOP_MAXSIZE)
        staged = BoundedCache[Entry](STAGED_MAXSIZE, STAGED_MAXBYTES)
        # Ahead-of-time stages share the top level's entries (see `abstract`).
        self.entries = (top, eager, staged, top)
        # Per level, the keys of the latest routes called, latest first, and their
        # hits chained (`miss` where there is none): changed in place, as wrappers
        # hold it.
        self._latest: list[list[tuple[Any, ...]]] = [[] for _ in Level]
        self.hits: list[Hit] = [miss] * LEVELS
        # Whether a nested call may use the top level's entries (see `_lookup`).
        self._shares_top = options.same_at_every_level
        # Partitions with one signature share a program, and so their entries.
        self._programs: BoundedCache[object] = BoundedCache(TOP_MAXSIZE)
        # Held only while a new entry is stored, never while the function runs.
        # Re-entrant: an eviction may run a finalizer that calls the function.
        self._lock = threading.RLock()
        self._defaulted_by_shape: dict[Shape, tuple[str, ...]] = {}
        _dispatchers.add(self)

    @property
    def _donates_by_call(self) -> bool:
        """Whether donation depends on which arguments a call passed."""
        return self.options.donate != "none" and self.function.has_defaults

    def call(self, level: Level, fun: object, args: Args, kwargs: Kwargs) -> Any:
        """The reference path, for a call no hit read. No lock is held while the
        function is traced, compiled or run: it may call itself from another thread
        (a callback)."""
        shape = (len(args), *kwargs)
        called = shape if self._donates_by_call and level == TOP else None
        tree, leaves, treedef = self._flattened(fun, args, kwargs)
        route, cache, key, entry = self._lookup(
            level, fun, tree, leaves, treedef, shape, called
        )
        made = entry is None
        if entry is None:
            entry = self._make(level, fun, route, leaves, called, cache, key)
        try:
            out, spec = self._run(level, route, entry, tree, leaves)
        except BaseException as error:
            # Raised as it was, once. An entry no trace completed is dropped: a call
            # raising on every trace leaves nothing behind (as under `jax.jit`).
            try:
                if made and not entry.traced_avals:
                    cache.discard(key, entry)
                if isinstance(error, RecursionError):
                    note_recursion(error, self.function.name)
            except RecursionError:
                pass  # no stack left for it here: a caller does it
            if isinstance(error, TypeError):  # a leaf JAX cannot trace, named
                self._check_traceable(route, leaves)
            raise
        self._learn(route, shape, spec)
        return out

    def _learn(self, route: Route, shape: Shape, spec: OutputSpec | None) -> None:
        """After a run on the reference path: where the call's `shape` is new to
        `route` (its hit reads it if it can), or `spec`, a top-level trace's, is a
        plain output's new to it (then built inline, the first `_MAX_LEARNED` of
        them), `route` is replaced by one with a hit made from their new plan. Hits
        and the code that builds outputs are made here alone: never while a hit
        runs, nor in a trace. The hit is made without the lock (it may run a user's
        `__eq__`); a route replaced meanwhile is left as it is (its next call learns
        again)."""
        if not self._fast:  # FILTERJIT_FASTPATH=0
            return
        calls, learned = route.calls, route.learned
        if shape not in calls and len(calls) < _MAX_HIT_CALLS:
            calls = {**calls, shape: self._hit_call(route, shape)}
        if spec is not None and spec.leaf_sources is not None:
            new = not route.partition.staged and spec not in learned
            if new and len(learned) < _MAX_LEARNED:
                learned = (*learned, spec)
        if calls is route.calls and learned is route.learned:
            return
        taught = dataclasses.replace(route, calls=calls, learned=learned)
        hit = hit_caller(self.plan_of(taught, taught.get))
        level = route.partition.level
        with self._lock:
            routes = self.routes[level]
            if routes.get(route.key) is route:
                routes.put(route.key, dataclasses.replace(taught, hit=hit))
                if any(key is route.key for key in self._latest[level]):
                    self._chain(level)

    def plan_of(self, route: Route, get: Callable[[Hashable], Entry | None]) -> HitPlan:
        """The plan of the hit of `route`'s calls, finding entries with `get`."""
        partition, function = route.partition, self.function
        labels = route.labels()
        level = partition.level
        return HitPlan(
            partition,
            tuple(call for call in route.calls.values() if call is not None),
            get,
            function.fun_is_leaf,
            function.name,
            functools.partial(
                name_failure, function.name, labels, partition.dynamic_positions
            ),
            _finisher(self, level),
            route.learned,
        )

    def _flattened(
        self, fun: object, args: Args, kwargs: Kwargs
    ) -> tuple[Any, list[Any], Any]:
        """The pytree of a call, bound, and its leaves and structure."""
        if self.function.defaults_changed():
            self._read_defaults_again(fun)
        tree = self.function.call_tree(fun, *self.function.bind(args, kwargs))
        return tree, *_flatten(tree)

    def _lookup(
        self,
        level: Level,
        fun: object,
        tree: object,
        leaves: list[object],
        treedef: PyTreeDef,
        shape: Shape | None,
        called: Shape | None = None,
    ) -> tuple[Route, BoundedCache[Entry], Any, Entry | None]:
        """The route of a flattened call (see `_route`), the cache it looks in, its
        key there and its entry (`None`: none, or a stale one). A nested call whose
        leaves of array types are all tracers, its dicts in JAX's order, is the
        program a top-level call is: it uses the top level's entries."""
        route = self._route(level, fun, leaves, treedef, shape)
        partition = route.partition
        shared = route.shares_top and (
            partition.orders is None or _in_jax_order(partition.orders(tree))
        )
        cache = self.entries[TOP if shared else level]
        key = self._key(partition, tree, leaves, shared, called)
        try:
            entry = cache.get(key)
            if entry is not None and not entry.serves(leaves):
                # Its trace saw one object where this call has several: the entry of
                # calls whose static leaves are one object as this call's are.
                key = self._key(partition, tree, leaves, shared, called, True)
                entry = cache.get(key)
        except Exception as e:
            raise key_error(self.function, fun, leaves, treedef, partition, e) from e
        if entry is not None and not entry.valid():
            entry = None
        return route, cache, key, entry

    def _key(
        self,
        partition: Partition,
        tree: object,
        leaves: list[object],
        shared: bool,
        called: Shape | None,
        aliases: bool = False,
    ) -> Any:
        """A call's cache key, made here and nowhere else: the partition's key of
        the leaves; nested, the insertion order of its dicts; `aliases`, which
        static leaves are one object (for a call an entry does not serve: see
        `Entry.serves`); `called`, the defaulted parameters where donation depends
        on them (`_defaulted`)."""
        key = partition.reference_key(leaves)
        if partition.orders is not None and not shared:
            key = (key, partition.orders(tree))
        if aliases:
            ids = [id(leaves[position]) for position in partition.static_positions]
            key = (key, tuple(map(ids.index, ids)))
        if called is not None:
            key = (key, self._defaulted(called))
        return key

    def _route(
        self,
        level: Level,
        fun: object,
        leaves: list[object],
        treedef: PyTreeDef,
        shape: Shape | None,
    ) -> Route:
        """The route of a structure and leaf types at `level`. Given a `shape`, the
        route is made if new and is the latest at its level; else (`None`) it is
        only looked at."""
        types = tuple(map(type, leaves))
        cache = self.routes[level]
        try:
            # Structures equal by `==` but not exactly (see `_exact`) have routes of
            # their own, found by their exact keys too.
            route = cache.get((treedef, types))
            if route is not None and not route.partition.exactly(treedef):
                route = cache.get((treedef, types, exact_aux(treedef)))
        except Exception as e:
            raise key_error(self.function, fun, leaves, treedef, None, e) from e
        if route is None:
            if shape is None:  # looked at
                program_of = lambda s: self._programs.get(s) or object()  # noqa: E731
                partition = Partition(treedef, types, level, program_of)
                parameters = self.function.leaf_parameters(treedef)
                return Route(partition, lambda _: None, False, (), parameters)
            program_of = lambda s: self._programs.setdefault(s, object())  # noqa: E731
            partition = Partition(treedef, types, level, program_of)
            # Nested, its calls use the top level's entries where the options allow
            # it and no leaf is a concrete array.
            shares = (
                partition.staged and self._shares_top and not partition.array_positions
            )
            key = (treedef, types)
            if cache.get(key) is not None:  # equal, not exactly
                key = (treedef, types, partition.exact)
            get = self.entries[TOP if shares else level].get
            parameters = self.function.leaf_parameters(treedef)
            route = Route(partition, get, shares, key, parameters)
            cache.put(key, route)
        elif shape is None:
            return route
        with self._lock:  # not a hit that `_forget_calls` dropped meanwhile
            latest = self._latest[level]
            if not latest or latest[0] is not route.key:
                routes = self._latest_routes(level)
                kept = [r.key for r in routes if r.key is not route.key]
                latest[:] = [route.key, *kept[: _MAX_HITS_PER_LEVEL - 1]]
                self._chain(level)
        return route

    def _latest_routes(self, level: Level) -> list[Route]:
        """The routes under `level`'s latest keys (under the lock), not those evicted
        since nor those made since under equal keys: what the cache dropped, hits
        drop."""
        keys = self._latest[level]
        found = map(self.routes[level].get, keys)
        return [r for r, key in zip(found, keys) if r is not None and r.key is key]

    def _chain(self, level: Level) -> None:
        """Has the hits of `level`'s latest routes serve it (under the lock)."""
        routes = self._latest_routes(level)
        self.hits[level] = chained([r.hit for r in routes if r.hit is not None])

    def _hit_call(self, route: Route, shape: Shape) -> HitCall | None:
        """How a hit reads calls of `shape` on `route`, or `None` where it cannot."""
        partition = route.partition
        if partition.staged and route.shares_top and partition.orders is not None:
            return None  # whether it shares the top level's entries: its dicts' order
        sources = self.function.bind.sources(shape)
        if not sources:
            return None
        top = partition.level == TOP
        suffix = self._defaulted(shape) if self._donates_by_call and top else None
        # A call that takes defaults is read while they are those read, if it can be.
        return HitCall(shape, sources, suffix, self.function.defaults_guard())

    def _defaulted(self, called: Shape) -> tuple[str, ...]:
        """The array parameters that calls of this shape leave to their defaults."""
        found = self._defaulted_by_shape.get(called)
        if found is None:
            found = self.function.defaulted(called)
            if len(self._defaulted_by_shape) < _MAX_CALL_SHAPES:
                self._defaulted_by_shape[called] = found
        return found

    def _run(
        self,
        level: Level,
        route: Route,
        entry: Entry,
        tree: object,
        leaves: list[object],
    ) -> tuple[Any, OutputSpec | None]:
        """Calls an entry's jitted function (which may trace) and finishes the
        output: nested, with the caller's pytree at hand for a trace; else in one
        checked call, so that a failed runtime check is raised at the call. With
        the output, the spec it was finished by (`None`: it needed none)."""
        dynamic = route.partition.take_dynamic(leaves)
        nodes = None
        if level == STAGED:
            out, nodes = run_nested(entry, tree, leaves, dynamic)
        else:
            name = self.function.name
            jitted = entry.jitted
            if route.partition.by_eq:
                # Static leaves equal by `==` may differ: a trace takes this call's.
                jitted = ForCall(entry, leaves)
            out = call_checked(jitted, dynamic, name, entry.awaited, entry.labels)
        if type(out) is Carried:
            finished = self._finish(level, out, leaves, True, tree, nodes)
            return finished, out.spec
        return out, None

    def _finish(
        self,
        level: Level,
        out: Carried,
        leaves: list[object],
        waited: bool = False,
        tree: object = None,
        nodes: list[object] | None = None,
    ) -> Any:
        """The user's output from a `Carried` one, by the trace's own spec (nested,
        with the call's containers). At the top level, a trace that holds a
        runtime check waits, to raise a failed check at the call."""
        spec = out.spec
        if level == STAGED:
            return spec.finish_nested(out.leaves, leaves, tree, nodes)
        if spec.runtime_check and not waited:
            wait_checked(spec.awaited(out.leaves), self.function.name)
        return spec.build(out.leaves, leaves)

    def _read_defaults_again(self, fun: object) -> None:
        """After the function's defaults were reassigned: calls bind to the new
        ones, and the hits that read the old ones are dropped."""
        with self._lock:
            self.function = Function(fun)
            self._defaulted_by_shape = {}
            self._forget_calls()

    def _forget_calls(self) -> None:
        """Drops every route's hit, until its calls record their shapes again."""
        self.hits[:] = [miss] * LEVELS
        for latest in self._latest:
            latest.clear()
        for routes in self.routes:
            for route in routes.values():
                routes.put(
                    route.key,
                    dataclasses.replace(route, calls={}, learned=(), hit=None),
                )

    def _make(
        self,
        level: Level,
        fun: object,
        route: Route,
        leaves: list[object],
        called: Shape | None,
        cache: BoundedCache[Entry],
        key: Hashable,
    ) -> Entry:
        """A new entry for a call at `level` (a top-level one in the top level's
        cache), stored in `cache` under `key`; or the one another thread stored."""
        partition = route.partition
        self._check_traceable(route, leaves)
        if level in (TOP, EAGER) and jax.process_count() > 1:
            self._check_processes_agree(route, leaves)
        defaulted = () if called is None else self._defaulted(called)
        top = level == ABSTRACT or (level == STAGED and cache is self.entries[TOP])
        entry = make_entry(
            EntryMaker(self.function, self.options, self.trace_log),
            fun,
            TOP if top else level,
            partition,
            route.leaf_parameters,
            leaves,
            defaulted,
        )
        nbytes = partition.captured_bytes(leaves)
        over_bound = _over_bound(cache, nbytes, entry)
        if over_bound is not None:
            nbytes = 0  # held for that trace alone, uncounted
        # What the entry must not outlive: the trace it is kept for, and the arrays
        # its key names by identity (the key of a dead one's id proves nothing).
        mortals = [leaves[p] for p in partition.identity_positions]
        if over_bound is not None:
            mortals.append(over_bound)
        with self._lock:
            found = cache.get(key)
            if found is not None and found.valid():
                return found
            cache.put(key, entry, nbytes)
            if mortals:
                entry.drop_with(mortals, cache, key)
        return entry

    def _check_traceable(self, route: Route, leaves: list[object]) -> None:
        name, dynamic = self.function.name, route.partition.dynamic_positions
        check_traceable(name, route.labels(), leaves, dynamic)

    def _check_processes_agree(self, route: Route, leaves: list[object]) -> None:
        """Before compiling a program that spans processes: that every process
        compiles it with the same static values (else a clear error, not a hang)."""
        partition = route.partition
        options, dynamic = self.options, partition.take_dynamic(leaves)
        if not spans_processes(dynamic, options.in_shardings, options.out_shardings):
            return
        labels = route.labels()
        statics = [(labels[p], leaves[p]) for p in partition.static_positions]
        statics.append(("(the structure of the arguments)", partition.treedef))
        check_statics_agree(self.function.name, statics)

    def explain(
        self, level: Level, fun: object, args: Args, kwargs: Kwargs
    ) -> Explanation:
        """What a call would do at `level`, changing nothing."""
        tree, leaves, treedef = self._flattened(fun, args, kwargs)
        route, _, _, entry = self._lookup(level, fun, tree, leaves, treedef, None)
        dynamic = route.partition.take_dynamic(leaves)
        hit = entry is not None and tuple(map(aval_key, dynamic)) in entry.traced_avals
        labels, roles = route.labels(), route.partition.roles()
        return self.trace_log.explanation(level, labels, roles, leaves, hit)

    def abstract(self, fun: object, args: Args, kwargs: Kwargs) -> "AheadOfTime":
        """The entry for an ahead-of-time call (arrays may be ShapeDtypeStructs),
        made if new: the one a top-level call with arrays of those shapes finds,
        so that JAX's caches keep one trace and one executable for both."""
        shape = (len(args), *kwargs)
        called = shape if self._donates_by_call else None  # as a top-level call
        tree, leaves, treedef = self._flattened(fun, args, kwargs)
        route, cache, key, entry = self._lookup(
            ABSTRACT, fun, tree, leaves, treedef, shape, called
        )
        if entry is None:
            entry = self._make(ABSTRACT, fun, route, leaves, called, cache, key)
        partition = route.partition
        return AheadOfTime(entry, partition, partition.take_dynamic(leaves), leaves)

    def clear(self) -> None:
        with self._lock:
            self._forget_calls()
        for cache in (*self.routes, *self.entries, self._programs):
            cache.clear()


def _finisher(
    dispatcher: Dispatcher, level: Level
) -> Callable[[Carried, list[Any], bool, object], Any]:
    """`dispatcher._finish` of outputs at `level`, for a hit: holding the
    dispatcher weakly, so that its hits make no cycle through it (it is freed with
    its function, as it would be without hits). A hit runs only from a wrapper,
    which holds the dispatcher."""
    held = weakref.ref(dispatcher)

    def finish(out: Carried, leaves: list[Any], waited: bool, tree: object) -> Any:
        found = held()
        assert found is not None, "a hit runs only from a wrapper holding it"
        return found._finish(level, out, leaves, waited, tree)

    return finish


class AheadOfTime(NamedTuple):
    """An ahead-of-time call (`Dispatcher.abstract`): its entry and partition, its
    traced leaves (arrays or `jax.ShapeDtypeStruct`s) and all its leaves."""

    entry: Entry
    partition: Partition
    dynamic: Sequence[Any]
    leaves: list[Any]


# Every live dispatcher, for `clear_caches`.
_dispatchers: "weakref.WeakSet[Dispatcher]" = weakref.WeakSet()


def clear_all() -> None:
    for dispatcher in list(_dispatchers):
        dispatcher.clear()
