"""Dispatching a call: the caches of one function with one set of options, shared
by every wrapper of that function with those options, and the two paths a call
takes through them (see `Dispatcher.call` and `Dispatcher._call`)."""

import functools as ft
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu

from . import _fastpath
from ._binding import Args, Keywords, Kwargs, LeafParameter, Shape
from ._cache import BoundedCache, lifelines
from ._diagnostics import (
    check_traceable,
    Explanation,
    key_error,
    row,
    TraceLog,
)
from ._entry import aval_key, Entry, EntryMaker, make_entry, pending
from ._errors import (
    call_checked,
    check_failed,
    explain_failure,
    note_recursion,
    wait_checked,
)
from ._exact import exact_aux
from ._fastpath import bound_call_reader, takes_defaults, top_caller, TopHooks
from ._function import Function, unwrapped
from ._level import ABSTRACT, EAGER, Level, LEVELS, STAGED, TOP
from ._multiprocess import check_statics_agree, spans_processes
from ._options import Options, UNSPECIFIED
from ._output import Carried, OutputSpec
from ._partition import KeyedCallReader, Partition, TopCaller


# Bounds on one function's caches. A nested entry pins the concrete arrays it was
# traced with (a top-level one, static values only): their cache counts bytes too.
TOP_MAXSIZE = 4096
STAGED_MAXSIZE = 256
STAGED_MAXBYTES = 16 * 2**20

_flatten = jtu.default_registry.flatten

# Bound on the shapes of call (see `_binding`) read as made, per partition.
_MAX_CALL_READERS = 64

# The partition of a structure that no call has (a `Keywords` node is made only for
# keyword arguments), so that the latest partition is never `None`.
_NO_CALL = Partition(_flatten(Keywords((), {}))[1], (), TOP, lambda _: object())


def _in_jax_order(orders: tuple[tuple[Any, ...], ...]) -> bool:
    """Whether every dict of a call is in the order JAX rebuilds it in."""
    try:
        return all(list(keys) == sorted(keys) for keys in orders)
    except TypeError:
        return False


class Dispatcher:
    """The caches of one function with one set of options: per trace level, the
    partitions by (structure, leaf types) and the entries by key."""

    def __init__(self, fun: Any, options: Options, fast: bool | None = None):
        # `fast`: whether calls take the fast path (unless FILTERJIT_FASTPATH=0).
        self._fast = _fastpath.ENABLED if fast is None else fast
        if not self._fast:
            self.call = self._call
            self.nested = ft.partial(self._call, STAGED)
        self.function = Function(fun)
        self.options = options
        self.trace_log = TraceLog(self.function.name, _module_of(fun))
        self.partitions = tuple(BoundedCache(TOP_MAXSIZE) for _ in Level)
        # Indexed by level: TOP, EAGER, STAGED, ABSTRACT. The top level and eager
        # transforms differ only in donation, so without it they share entries.
        top = BoundedCache(TOP_MAXSIZE)
        eager = top if options.donate == "none" else BoundedCache(TOP_MAXSIZE)
        staged = BoundedCache(STAGED_MAXSIZE, STAGED_MAXBYTES)
        # Ahead-of-time stages share the top level's entries (see `abstract`).
        self.entries = (top, eager, staged, top)
        self._plain_arity = self.function.plain_arity
        # Where a call of `_plain_arity` positional arguments binds them: in place.
        self._plain_sources = ([("args", i) for i in range(self._plain_arity)], {})
        self._fun_is_leaf = self.function.fun_is_leaf
        self._latest = [_NO_CALL] * LEVELS  # the latest call's partition, per level
        # A top-level call without a `top`: this dispatcher's `call`.
        self._declined: TopCaller = ft.partial(self.call, TOP)
        # The wrapper's top-level `__call__`: the latest top-level partition's `top`.
        self.top = self._declined
        # What the `top`s it makes call of its own (see `_fastpath.top_caller`).
        self._top_hooks = TopHooks(
            self.call, self._finish, self._failed, self._specialise
        )
        # Partitions with one signature share a program, and so their entries. Bounded
        # as partitions are: a program forgotten costs a new partition its own entries.
        self._programs: BoundedCache[object] = BoundedCache(TOP_MAXSIZE)
        # Whether a nested call may use the top level's entries: where the options
        # mean the same at every level (see `_lookup`).
        self._shares_top = (
            options.donate == "none"
            and options.inline is False
            and options.in_shardings is UNSPECIFIED
            and options.out_shardings is UNSPECIFIED
            and "compiler_options" not in dict(options.jitkwargs)
        )
        # Held only while a new entry is stored (never while the function runs),
        # so that concurrent first calls of one key share one entry. Re-entrant:
        # an eviction may run a finalizer that calls the function.
        self._lock = threading.RLock()
        # Whether donation depends on which arguments a call passed (see `_defaulted`).
        self._donates_by_call = options.donate != "none" and self.function.has_defaults
        # Whether keys say which static leaves are one object: from the first trace
        # that handed back one of several static inputs that were one object (see
        # `OutputSpec.aliases`), decided before each call runs; the fast path off.
        self._keys_aliases = False
        self._defaulted_by_shape: dict[Shape, tuple[str, ...]] = {}
        # Drop it from its owner's caches when its key's weak objects die (`_owners`).
        self._lifelines: list[Any] = []
        _dispatchers.add(self)

    def drop_with(self, objects: list[Any], drop: Callable[[], None]) -> None:
        """Calls `drop()` when any of `objects` dies."""
        self._lifelines = lifelines(objects, drop)

    def call(self, level: Level, fun: Any, args: Args, kwargs: Kwargs) -> Any:
        """Calls `fun(*args, **kwargs)` at trace level `level` on the fast path: a
        call that the latest partition at its level reads and keys (see
        `_fastpath`), whose entry is cached (its NumPy constants as they were),
        runs as `_call` would run it. Any other takes `_call` from the start. In a
        staged trace: `nested`."""
        if level == STAGED:
            return self.nested(fun, args, kwargs)
        partition = self._latest[level]
        read = partition.call_readers.get((len(args), *kwargs))
        found = None if read is None else read(fun, args, kwargs)
        if found is None:
            return self._call(level, fun, args, kwargs)
        leaves, key, dynamic = found
        entry = partition.get(key)
        if entry is None:
            return self._call(level, fun, args, kwargs)
        if entry.guarded:
            if entry.captured and not entry.valid():  # a NumPy constant changed
                return self._call(level, fun, args, kwargs)
            return self._run(level, entry, None, leaves, dynamic)
        try:
            out = entry.jitted(*dynamic)
        except Exception as e:  # in the user's terms where it can be
            self._failed(partition, leaves, e)
            raise
        if type(out) is not Carried:
            return out
        return self._finish(level, out, leaves)

    def nested(self, fun: Any, args: Args, kwargs: Kwargs) -> Any:
        """`call` in a staged trace, its steps written out (every nested helper of a
        library calls it, on every trace of the outer function): a call the latest
        nested partition reads, whose entry is cached (its NumPy constants as they
        were), runs with the call's pytree at hand for a trace (see `_run`)."""
        partition = self._latest[STAGED]
        read = partition.call_readers.get((len(args), *kwargs))
        found = None if read is None else read(fun, args, kwargs)
        if found is None:
            return self._call(STAGED, fun, args, kwargs)
        leaves, key, dynamic = found
        # Read nested only without keywords (see `_partition`): `args` is the call.
        tree = args if self._fun_is_leaf else (fun, args)
        if partition.orders is not None:
            key = (key, partition.orders(tree))
        entry = partition.get(key)
        if entry is None or (entry.captured and not entry.valid()):
            return self._call(STAGED, fun, args, kwargs)
        previous = pending.call
        pending.call = (entry, tree, leaves)
        try:
            out = entry.jitted(*dynamic)
        finally:
            pending.call = previous
        if type(out) is Carried:
            return self._finish(STAGED, out, leaves, tree=tree)
        return out

    def _call(self, level: Level, fun: Any, args: Args, kwargs: Kwargs) -> Any:
        """The reference path: binds, flattens with `jax.tree_util`, looks up (see
        `_lookup`), makes the entry if there is none, runs it, finishes its output.
        No lock is held while the function is traced, compiled or run: it may call
        itself from another thread (a host callback)."""
        shape = (len(args), *kwargs)
        called = shape if self._donates_by_call and level == TOP else None
        tree, leaves, treedef = self._flattened(fun, args, kwargs)
        partition, cache, key, entry = self._lookup(
            level, fun, tree, leaves, treedef, shape, called
        )
        dynamic = partition.take_dynamic(leaves)
        made = entry is None
        if entry is None:
            entry = self._make(level, fun, partition, leaves, called, cache, key)
        keyed_aliases = self._keys_aliases
        try:
            out = self._run(level, entry, tree, leaves, dynamic)
        except BaseException as error:
            # Raised as it was raised, once. An entry that no trace completed pins
            # nothing useful: dropped, so that a call raising on every trace leaves
            # nothing behind (the next call traces anew, as under `jax.jit`).
            try:
                if made and not entry.traced_avals:
                    cache.discard(key, entry)
                if isinstance(error, RecursionError):
                    note_recursion(error, self.function.name)
            except RecursionError:
                pass  # no stack left for it here: a caller does it
            if isinstance(error, TypeError):  # a leaf JAX cannot trace, named
                self._check_traceable(partition, leaves)
            raise
        if self._keys_aliases and not keyed_aliases:
            # Its trace made keys say which static leaves are one object: the entry
            # serves calls whose leaves are one object as this call's were.
            shared = cache is not self.entries[level]
            aliased = self._key(partition, tree, leaves, shared, called, True)
            cache.put(aliased, entry, partition.captured_bytes(leaves))
        return out

    def _specialise(self, partition: Partition, spec: OutputSpec) -> None:
        """Makes `partition`'s `top` again, once, building the static output of
        `spec` (an `OutputSpec` with `from_traced`) inline (see `top_caller`)."""
        if not self._reads_calls():
            return
        top = top_caller(partition, self._fun_is_leaf, self._top_hooks, spec)
        if self.top is partition.top:
            self.top = top or self._declined
        partition.top = top

    def _flattened(
        self, fun: Any, args: Args, kwargs: Kwargs
    ) -> tuple[Any, list[Any], Any]:
        """The pytree of a call, bound, and its leaves and structure."""
        if self.function.defaults_changed():
            self._read_defaults_again(fun)
        tree = self.function.call_tree(fun, *self.function.bind(args, kwargs))
        return tree, *_flatten(tree)

    def _lookup(
        self,
        level: Level,
        fun: Any,
        tree: Any,
        leaves: list[Any],
        treedef: Any,
        shape: Shape | None,
        called: Shape | None = None,
    ) -> tuple[Partition, BoundedCache[Entry], Any, Entry | None]:
        """The partition of a flattened call, the cache it looks in, its key there
        and its entry (`None` where there is none, or a stale one). The key is made
        here and nowhere else: the partition's key of the leaves; nested, the
        insertion order of the call's dicts; which static leaves are one object,
        once a trace has needed it (see `OutputSpec.aliases`); `called`, the
        call's shape, where donation depends on it (see `_defaulted`). A nested
        call whose leaves of array types are all tracers, its dicts in JAX's order,
        is the program a top-level call is: it uses the top level's entries.
        `shape` records the partition as the latest at its level (`None`: looked
        at)."""
        partition = self._partition(level, fun, leaves, treedef, shape)
        shared = partition.shares_top and (
            partition.orders is None or _in_jax_order(partition.orders(tree))
        )
        key = self._key(partition, tree, leaves, shared, called, self._keys_aliases)
        cache = self.entries[TOP if shared else level]
        try:
            entry = cache.get(key)
        except Exception as e:
            raise key_error(self.function, fun, leaves, treedef, partition, e) from e
        if entry is not None and entry.captured and not entry.valid():
            entry = None
        return partition, cache, key, entry

    def _key(
        self,
        partition: Partition,
        tree: Any,
        leaves: list[Any],
        shared: bool,
        called: Shape | None,
        aliases: bool,
    ) -> Any:
        """A call's cache key (see `_lookup`); `aliases`: with which static leaves
        are one object."""
        key = partition.reference_key(leaves)
        if partition.orders is not None and not shared:
            key = (key, partition.orders(tree))
        if aliases:
            ids = [id(leaves[position]) for position in partition.static_positions]
            key = (key, tuple(map(ids.index, ids)))
        if called is not None:
            key = (key, self._defaulted(called))
        return key

    def _partition(
        self,
        level: Level,
        fun: Any,
        leaves: list[Any],
        treedef: Any,
        shape: Shape | None,
    ) -> Partition:
        """The partition of a structure and leaf types at `level`. Where `shape` is
        given, it is recorded (made if new) as the latest at its level, with a
        reader of calls of that shape; else only looked at."""
        types = tuple(map(type, leaves))
        cache = self.partitions[level]
        try:
            # Structures equal by `==` but not exactly (see `_exact`) have partitions
            # of their own: the first recorded is found by (structure, types), the
            # others also by their exact keys.
            partition = cache.get((treedef, types))
            if partition is not None and partition.exact is not None:
                if not partition.exactly(treedef):
                    partition = cache.get(
                        (treedef, types, exact_aux(treedef, level == STAGED))
                    )
        except Exception as e:
            raise key_error(self.function, fun, leaves, treedef, None, e) from e
        if partition is None:
            if shape is None:  # looked at, not recorded
                program_of = lambda s: self._programs.get(s) or object()  # noqa: E731
                return Partition(treedef, types, level, program_of)
            partition = Partition(
                treedef, types, level, lambda s: self._programs.setdefault(s, object())
            )
            partition.shares_top = (
                level == STAGED and self._shares_top and not partition.array_positions
            )
            partition.get = self.entries[TOP if partition.shares_top else level].get
            if level == TOP and self._reads_calls() and not self._donates_by_call:
                partition.top = top_caller(
                    partition, self._fun_is_leaf, self._top_hooks
                )
            if cache.get((treedef, types)) is None:
                cache.put((treedef, types), partition)
            else:  # equal by `==` to the one recorded, but not exactly
                cache.put((treedef, types, partition.exact), partition)
        elif shape is None:
            return partition
        readers = partition.call_readers
        plain = shape == (self._plain_arity,)
        if (
            self._reads_calls()
            and (plain or level != STAGED)  # nested, `_run` wants the call's tree
            and shape not in readers
            and len(readers) < _MAX_CALL_READERS
            # Whether it shares the top level's entries depends on its dicts' order.
            and not (partition.shares_top and partition.orders is not None)
        ):
            readers[shape] = self._call_reader(level, partition, shape)
        self._latest[level] = partition
        if level == TOP:
            self.top = partition.top or self._declined
        return partition

    def _reads_calls(self) -> bool:
        """Whether new partitions get readers and `top`s: the fast path is on, and
        keys need not say which static leaves are one object."""
        return self._fast and not self._keys_aliases

    def _call_reader(
        self, level: Level, partition: Partition, shape: Shape
    ) -> KeyedCallReader | None:
        """The fast path's reader of calls of `shape` at `level` (see `_fastpath`),
        or `None` where calls of that shape are not read."""
        plain = shape == (self._plain_arity,)
        sources = self._plain_sources if plain else self.function.bind.sources(shape)
        if not sources:
            return None
        # A call that takes defaults is read while they are those read, if it can be.
        guard = self.function.defaults_guard()
        if guard is None and takes_defaults(sources):
            return None
        # Where donation depends on the call's shape, so does its key.
        suffix = (
            self._defaulted(shape) if self._donates_by_call and level == TOP else None
        )
        return bound_call_reader(
            partition.treedef,
            partition.types,
            self._fun_is_leaf,
            sources,
            partition,
            suffix,
            guard,
        )

    def _defaulted(self, called: Shape) -> tuple[str, ...]:
        """The parameters holding arrays that calls of this shape leave to their
        defaults (which are not donated: the caller did not pass them)."""
        found = self._defaulted_by_shape.get(called)
        if found is None:
            found = self.function.defaulted(called)
            if len(self._defaulted_by_shape) < _MAX_CALL_READERS:
                self._defaulted_by_shape[called] = found
        return found

    def _run(
        self,
        level: Level,
        entry: Entry,
        tree: Any,
        leaves: list[Any],
        dynamic: Sequence[Any],
    ) -> Any:
        """Calls an entry's jitted function (which may trace) and finishes the
        output. Nested, with the caller's pytree `tree` at hand for a trace (see
        `_entry.pending`); at the top level, run and waited for in one checked
        call, so that a failed runtime check is raised at the call."""
        if level == STAGED:
            previous = pending.call
            pending.call = (entry, tree, leaves)
            try:
                out = entry.jitted(*dynamic)
            finally:
                pending.call = previous
        else:
            ready = entry.awaited if level == TOP else None
            name = self.function.name
            out = call_checked(entry.jitted, dynamic, name, ready, entry.labels)
        if type(out) is Carried:
            return self._finish(level, out, leaves, waited=True, tree=tree)
        return out

    def _finish(
        self,
        level: Level,
        out: Carried,
        leaves: list[Any],
        waited: bool = False,
        tree: Any = None,
    ) -> Any:
        """The user's output from a `Carried` one: the trace's own spec finishes
        it with this call's leaves. At the top level, a trace that holds a runtime
        check waits, to raise a failed check at the call."""
        spec = out.spec
        if spec.aliases and not self._keys_aliases:
            self._key_aliases()
        if level == STAGED:
            return spec.finish_nested(out.leaves, leaves, tree)
        if spec.runtime_check and level == TOP and not waited:
            wait_checked(spec.awaited(out.leaves), self.function.name)
        return spec.build(out.leaves, leaves)

    def _read_defaults_again(self, fun: Any) -> None:
        """After the function's defaults were reassigned: calls bind to the new
        ones (a call's defaults are leaves of its pytree, and so of its key), and
        the readers of the old ones are dropped."""
        with self._lock:
            self.function = Function(fun)
            has_defaults = self.function.has_defaults
            self._donates_by_call = self.options.donate != "none" and has_defaults
            self._defaulted_by_shape = {}
            for partitions in self.partitions:
                for partition in partitions.values():
                    partition.call_readers.clear()

    def _key_aliases(self) -> None:
        """Keys calls by which static leaves are one object from now on: a trace
        handed back one of several that were one object, and so the same program
        serves only calls in which they are one object again. This call's were
        (its trace saw them: at the top level an entry is traced with the leaves
        of the call that made it, nested with the call's own). The fast path,
        whose keys do not say it, is turned off for this function."""
        with self._lock:
            self._keys_aliases = True
            self.top = self._declined
            for partitions in self.partitions:
                for partition in partitions.values():
                    partition.call_readers.clear()
                    partition.top = None

    def _failed(
        self, partition: Partition, leaves: list[Any], error: Exception
    ) -> None:
        """Names a leaf JAX cannot trace, or raises a runtime check that failed in a
        trace made just now in the user's terms; else `error` is raised as it is."""
        if isinstance(error, TypeError):
            self._check_traceable(partition, leaves)
        check_failed(error, self.function.name)
        labels = [p.label for p in self.leaf_parameters(partition)]
        dynamic_labels = partition.take_dynamic(labels)
        explain_failure(
            error, self.function.name, dynamic_labels, partition.take_dynamic(leaves)
        )

    def _make(
        self,
        level: Level,
        fun: Any,
        partition: Partition,
        leaves: list[Any],
        called: Shape | None,
        cache: BoundedCache[Entry],
        key: Any,
    ) -> Entry:
        """A new entry for a call at `level` (a top-level one in the top level's
        cache, so that either level may trace it), stored in `cache` under `key`
        and dropped when an object it is keyed by weakly dies; or the one another
        thread stored first."""
        self._check_traceable(partition, leaves)
        if level in (TOP, EAGER) and jax.process_count() > 1:
            self._check_processes_agree(partition, leaves)
        defaulted = () if called is None else self._defaulted(called)
        top = level == ABSTRACT or (level == STAGED and cache is self.entries[TOP])
        entry = make_entry(
            self._entry_maker(),
            fun,
            TOP if top else level,
            partition,
            self.leaf_parameters(partition),
            leaves,
            defaulted,
        )
        with self._lock:
            found = cache.get(key)
            if found is not None and not (found.captured and not found.valid()):
                return found
            cache.put(key, entry, partition.captured_bytes(leaves))
        if weak := [leaves[p] for p in partition.weak_positions]:
            cache_ref, entry_ref = weakref.ref(cache), weakref.ref(entry)

            def drop() -> None:  # `discard` ignores an entry that died first
                if (alive := cache_ref()) is not None:
                    alive.discard(key, entry_ref())

            entry.drop_with(weak, drop)
        return entry

    def _entry_maker(self) -> EntryMaker:
        compile_build = _fastpath.output_builder if self._fast else None
        return EntryMaker(self.function, self.options, self.trace_log, compile_build)

    def _check_traceable(self, partition: Partition, leaves: list[Any]) -> None:
        labels = [p.label for p in self.leaf_parameters(partition)]
        check_traceable(self.function.name, labels, leaves, partition.dynamic_positions)

    def _check_processes_agree(self, partition: Partition, leaves: list[Any]) -> None:
        """Before compiling a program that spans processes: that every process
        compiles it with the same static values (else a clear error, not a hang).
        A program on this process's devices alone waits for no other process."""
        options, dynamic = self.options, partition.take_dynamic(leaves)
        if not spans_processes(dynamic, options.in_shardings, options.out_shardings):
            return
        labels = [p.label for p in self.leaf_parameters(partition)]
        statics = [(labels[p], leaves[p]) for p in partition.static_positions]
        statics.append(("(the structure of the arguments)", partition.treedef))
        check_statics_agree(self.function.name, statics)

    def leaf_parameters(self, partition: Partition) -> list[LeafParameter]:
        """Each leaf's parameter, position and label; made once per partition."""
        if partition.leaf_parameters is None:
            partition.leaf_parameters = self.function.leaf_parameters(partition.treedef)
        return partition.leaf_parameters

    def explain(
        self, level: Level, fun: Any, args: Args, kwargs: Kwargs
    ) -> Explanation:
        """What a call would do at `level`, changing nothing."""
        tree, leaves, treedef = self._flattened(fun, args, kwargs)
        partition, _, _, entry = self._lookup(level, fun, tree, leaves, treedef, None)
        dynamic = partition.take_dynamic(leaves)
        hit = entry is not None and tuple(map(aval_key, dynamic)) in entry.traced_avals
        labels = [p.label for p in self.function.leaf_parameters(treedef)]
        rows = list(map(row, labels, partition.roles(), leaves))
        nearest = None if hit or level == STAGED else self.trace_log.nearest(rows)
        name, level_name = self.function.name, Level(level).description
        return Explanation(name, level_name, rows, hit, nearest=nearest)

    def abstract(self, fun: Any, args: Args, kwargs: Kwargs) -> "AheadOfTime":
        """The entry for an ahead-of-time call (arrays may be ShapeDtypeStructs),
        made if new: with its partition, traced leaves and leaves.

        It is the entry that a top-level call with arrays of those shapes finds
        (their partitions share a program, and so their keys), so `lower`, `trace`
        and `eval_shape` use the very `jax.jit` that calls do, and JAX's caches
        keep one trace and one executable for both, as for a `jax.jit`."""
        shape = (len(args), *kwargs)
        called = shape if self._donates_by_call else None  # as a top-level call
        tree, leaves, treedef = self._flattened(fun, args, kwargs)
        partition, cache, key, entry = self._lookup(
            ABSTRACT, fun, tree, leaves, treedef, shape, called
        )
        if entry is None:
            entry = self._make(ABSTRACT, fun, partition, leaves, called, cache, key)
        return AheadOfTime(entry, partition, partition.take_dynamic(leaves), leaves)

    def clear(self) -> None:
        self._latest = [_NO_CALL] * LEVELS
        self.top = self._declined
        self._keys_aliases = False  # no entry is left that a key must tell apart
        for cache in (*self.partitions, *self.entries, self._programs):
            cache.clear()


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


def _module_of(fun: Any) -> str:
    fun = unwrapped(fun)
    module = getattr(fun, "__module__", None)  # else a callable object: its class's
    return module if isinstance(module, str) else type(fun).__module__
