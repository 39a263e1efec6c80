"""Dispatching a call: the caches of one function with one set of options, shared
by every wrapper of that function with those options.

A call is flattened by JAX itself (`jax.tree_util`), so its structure and leaves
are exactly what JAX sees. The structure and the leaves' types pick a `Partition`;
the partition splits the leaves into traced leaves and the key of the others; the
key picks an `Entry`, whose jitted function is called with the traced leaves.
"""

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.tree_util as jtu

from ._cache import BoundedCache, lifelines
from ._diagnostics import (
    check_traceable,
    Explanation,
    key_error,
    LEVEL_NAMES,
    row,
    TraceLog,
)
from ._entry import aval_key, Entry, make_entry
from ._errors import call_checked, check_failed, wait_checked
from ._exact import exact_aux
from ._function import Function, Keywords
from ._multiprocess import check_statics_agree, spans_processes
from ._options import Options
from ._output import Carried
from ._partition import ABSTRACT, Partition
from ._shallow import bound_call_reader, BoundCallReader
from ._trace import EAGER, STAGED, TOP


# Bounds on the caches of one function. A top-level entry pins only static Python
# values; a nested entry pins the concrete arrays it was traced with, so its cache
# is also bounded in bytes.
TOP_MAXSIZE = 4096
STAGED_MAXSIZE = 256
STAGED_MAXBYTES = 16 * 2**20

_flatten = jtu.default_registry.flatten

# Bound on the shapes of call (see `_binding`) read as made, per partition.
_MAX_CALL_READERS = 64
# What `_run` and `_finish` return for a call whose static inputs that were one
# object when traced are not one now: it is made again, keyed by alias.
_BY_ALIAS = object()
_UNMADE: Any = object()

# The partition of a structure that no call has (a `Keywords` node is made only for
# keyword arguments), so that the latest partition is never `None`.
_NO_CALL = Partition(_flatten(Keywords((), {}))[1], (), TOP, lambda _: object())


class Dispatcher:
    """The caches of one function with one set of options: per trace level, the
    partitions by (structure, leaf types) and the entries by key."""

    def __init__(self, fun: Any, options: Options):
        self.function = Function(fun)
        self.options = options
        self.trace_log = TraceLog(self.function.name, _module_of(fun))
        self.partitions = tuple(BoundedCache(TOP_MAXSIZE) for _ in range(4))
        # Indexed by level: TOP, EAGER, STAGED, ABSTRACT. The top level and eager
        # transforms differ only in donation, so without it they share entries.
        top = BoundedCache(TOP_MAXSIZE)
        eager = top if options.donate == "none" else BoundedCache(TOP_MAXSIZE)
        staged = BoundedCache(STAGED_MAXSIZE, STAGED_MAXBYTES)
        # Ahead-of-time stages share the top level's entries (see `abstract`).
        self.entries = (top, eager, staged, top)
        self._plain_arity = self.function.plain_arity
        self._fun_is_leaf = self.function.fun_is_leaf
        self._partition_gets = tuple(cache.get for cache in self.partitions)
        # The latest call's partition, per level: at first one that no call has.
        self._latest = [_NO_CALL] * 4
        self._entry_gets = tuple(cache.get for cache in self.entries)
        # Partitions with one signature share an owner, and so their entries.
        # Bounded as the partitions are: an owner forgotten only costs a partition
        # made afresh its own entries.
        self._owners: BoundedCache[object] = BoundedCache(TOP_MAXSIZE)
        # Held only while a new entry is stored (never while the function runs),
        # so that concurrent first calls of one key share one entry. Re-entrant:
        # an eviction may run a finalizer that calls the function.
        self._lock = threading.RLock()
        # Whether donation depends on which arguments a call passed, rather than
        # left to their defaults (see `_defaulted`).
        self._donates_by_call = options.donate != "none" and self.function.has_defaults
        self._defaulted_by_shape: dict[tuple[Any, ...], tuple[str, ...]] = {}
        # Weak references that drop this dispatcher from its owner's caches when
        # an object its key holds weakly dies (see `_owners`).
        self._lifelines: list[Any] = []
        _dispatchers.add(self)

    def drop_with(self, objects: list[Any], drop: Callable[[], None]) -> None:
        """Calls `drop()` when any of `objects` dies."""
        self._lifelines = lifelines(objects, drop)

    def call(
        self, level: int, fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Calls `fun(*args, **kwargs)` at trace level `level` (not DISABLED)."""
        # Most calls repeat the latest call's partition.
        partition = self._latest[level]
        leaves = None
        # The pytree of the call, flattened and partitioned; `None` until needed
        # where the call is read as it was made.
        tree: Any = None
        if kwargs or len(args) != self._plain_arity:
            if level != STAGED:
                read = partition.call_readers.get((len(args), *kwargs), _UNMADE)
                if read is _UNMADE:
                    read = self._call_reader(partition, args, kwargs)
                if read is not None:
                    leaves = read(fun, args, kwargs)
            if leaves is None:
                tree = self._call_tree(fun, None, args, kwargs)
        else:
            tree = args if self._fun_is_leaf else (fun, args)
        if leaves is None and partition.read_leaves is not None:
            # Checked against that partition without flattening.
            leaves = partition.read_leaves(tree)
        if leaves is not None:
            treedef = partition.treedef
            types = None
        else:
            leaves, treedef = _flatten(tree)
            types = tuple(map(type, leaves))
        # Where donation depends on which arguments the caller passed (not on the
        # defaults bound in their place), the shape of the call, else `None`.
        called = (
            (len(args), *kwargs) if self._donates_by_call and level == TOP else None
        )
        entry = None
        try:
            # Two comparisons, where a lookup would hash the structure.
            if types is not None and (
                partition.types != types
                or partition.treedef != treedef
                or (partition.exact is not None and not partition.exactly(treedef))
            ):
                found = self._find(level, treedef, types)
                if found is None:
                    raise LookupError  # a new partition: made by `_miss`
                self._latest[level] = partition = found
            key = partition.constant_key
            if key is None:
                key = partition.key(leaves)
            if partition.orders is not None:
                key = (key, partition.orders(tree))
            if called is not None:
                key = (key, self._defaulted(called))
            entry = self._entry_gets[level](key)
        except Exception:
            # A static value or structure that cannot be hashed or compared: the
            # full path says which. Only keying is in here: the function runs
            # below, once, and raises as it raised.
            entry = None
        if entry is None:
            tree = self._call_tree(fun, tree, args, kwargs)
            return self._miss(level, fun, tree, leaves, treedef, called)
        take = partition.take_dynamic
        dynamic = leaves if take is None else take(leaves)
        if entry.guarded:
            if level == TOP:  # where only runtime checks guard an entry
                out = self._run(level, fun, tree, leaves, treedef, entry, dynamic)
            else:
                out = self._guarded(
                    level, fun, tree, leaves, treedef, entry, dynamic, called
                )
            if out is not _BY_ALIAS:
                return out
            tree = self._call_tree(fun, tree, args, kwargs)
            return self._miss(level, fun, tree, leaves, treedef, called, True)
        try:
            out = entry.jitted(*dynamic)
        except Exception as e:
            # A leaf JAX cannot trace, or a runtime check that failed in a trace
            # made just now: said in the user's terms. Else raised as it is.
            self._failed(partition, leaves, e)
            raise
        if type(out) is Carried:
            spec = out.spec
            if spec.plain:
                return spec.build(out.leaves, leaves)
            out = self._finish(level, out, leaves)
            if out is not _BY_ALIAS:
                return out
            tree = self._call_tree(fun, tree, args, kwargs)
            return self._miss(level, fun, tree, leaves, treedef, called, True)
        return out

    def _defaulted(self, called: tuple[Any, ...]) -> tuple[str, ...]:
        """The parameters holding arrays that calls of this shape leave to their
        defaults (which are not donated: the caller did not pass them)."""
        found = self._defaulted_by_shape.get(called)
        if found is None:
            found = self.function.defaulted(called)
            if len(self._defaulted_by_shape) < _MAX_CALL_READERS:
                self._defaulted_by_shape[called] = found
        return found

    def _call_reader(
        self, partition: Partition, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> BoundCallReader | None:
        """The reader of calls shaped as this one that needs binding, read as it
        was made (see `bound_call_reader`), if calls of that shape can fit
        `partition`; made once the shape has been bound."""
        shape = (len(args), *kwargs)
        sources = self.function.bind.sources(shape)
        if sources is None:  # not bound yet: binding makes the sources
            return None
        read = bound_call_reader(
            partition.treedef, partition.types, self._fun_is_leaf, sources
        )
        if len(partition.call_readers) < _MAX_CALL_READERS:
            partition.call_readers[shape] = read
        return read

    def _call_tree(
        self, fun: Any, tree: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The pytree of a call: `tree` if made, else bound from the call."""
        if tree is not None:
            return tree
        args, kwargs = self.function.bind(args, kwargs)
        return self.function.call_tree(fun, args, kwargs)

    def _find(self, level: int, treedef: Any, types: tuple[type, ...]) -> Any:
        """The partition of a structure and leaf types, if recorded. Structures
        that are equal by `==` but not exactly (see `_exact`) have partitions of
        their own: the first recorded is found by (structure, types), the others
        also by their exact keys."""
        partition = self._partition_gets[level]((treedef, types))
        if (
            partition is not None
            and partition.exact is not None
            and not partition.exactly(treedef)
        ):
            partition = self._partition_gets[level](
                (treedef, types, exact_aux(treedef))
            )
        return partition

    def _failed(
        self, partition: Partition, leaves: list[Any], error: Exception
    ) -> None:
        if isinstance(error, TypeError):
            self._check_traceable(partition, leaves)
        check_failed(error, self.function.name)

    def _finish(self, level: int, out: Carried, leaves: list[Any]) -> Any:
        """The user's output from a `Carried` one: the trace's own spec finishes
        it with this call's leaves (`_BY_ALIAS` where the call must be keyed by
        alias). At the top level, a trace that holds a runtime check waits, to
        raise a failed check at the call."""
        spec = out.spec
        if spec.aliases and not spec.aliases_hold(leaves):
            return _BY_ALIAS
        if spec.runtime_check and level == TOP:
            wait_checked(spec.awaited(out.leaves), self.function.name)
        return spec.build(out.leaves, leaves)

    def _guarded(
        self,
        level: int,
        fun: Any,
        tree: Any,
        leaves: list[Any],
        treedef: Any,
        entry: Entry,
        dynamic: Sequence[Any],
        called: tuple[Any, ...] | None,
    ) -> Any:
        """A hit that needs more checks: nested, with NumPy arrays compiled in that
        may have been mutated since; or an entry whose traces hold runtime checks.
        (`tree` is `None` only where nothing is captured.)"""
        if entry.captured and not entry.valid():
            return self._miss(level, fun, tree, leaves, treedef, called)
        return self._run(level, fun, tree, leaves, treedef, entry, dynamic)

    def _run(
        self,
        level: int,
        fun: Any,
        tree: Any,
        leaves: list[Any],
        treedef: Any,
        entry: Entry,
        dynamic: Sequence[Any],
    ) -> Any:
        """Calls an entry's jitted function (which may trace) and finishes the
        output (`_BY_ALIAS` where the call must be keyed by alias); a failed
        runtime check is raised at the call. (`tree` is needed only nested.)"""
        if level == STAGED:  # nothing runs, so no check can fail
            with entry.called_from(tree, leaves):
                out = entry.jitted(*dynamic)
        else:
            # At the top level, run and waited for in one checked call.
            ready = entry.awaited if level == TOP else None
            out = call_checked(entry.jitted, dynamic, self.function.name, ready)
        if type(out) is Carried:
            spec = out.spec
            if spec.aliases and not spec.aliases_hold(leaves):
                return _BY_ALIAS
            return spec.build(out.leaves, leaves)
        return out

    def _miss(
        self,
        level: int,
        fun: Any,
        tree: Any,
        leaves: list[Any],
        treedef: Any,
        called: tuple[Any, ...] | None = None,
        by_alias: bool = False,
    ) -> Any:
        """A call whose entry is not cached: made, stored and called (which
        traces). `by_alias`: keyed also by which static inputs are one object (see
        `OutputSpec`); `called`: the call's shape, where donation depends on it.

        No lock is held while the function is traced, compiled or run: it may call
        itself from another thread (a host callback), and would wait forever for
        a lock its caller holds. Only storing the entry is locked, so concurrent
        first calls of one key share one entry, whose `jax.jit` they call: JAX's
        own cache then keeps one trace of it."""
        partition, dynamic, key, entry = self.lookup(
            level, fun, tree, leaves, treedef, True, by_alias, called
        )
        assert partition is not None
        self._latest[level] = partition
        made = entry is None
        if entry is None:
            owners = self.owners(partition)
            self._check_traceable(partition, leaves)
            if level in (TOP, EAGER) and jax.process_count() > 1:
                self._check_processes_agree(partition, owners, leaves, dynamic)
            entry = self._make_entry(level, fun, partition, leaves, called)
            entry = self._store(level, partition, leaves, key, entry)
        try:
            out = self._run(level, fun, tree, leaves, treedef, entry, dynamic)
        except BaseException:
            # An entry that no trace completed pins nothing useful: dropped, so
            # that a call raising on every trace leaves nothing behind. (Raised as
            # it was raised; the next call traces anew, as under `jax.jit`.)
            if made and not entry.traced_avals:
                self.entries[level].discard(key, entry)
            raise
        if out is _BY_ALIAS:
            return self._miss(level, fun, tree, leaves, treedef, called, True)
        return out

    def _make_entry(
        self,
        level: int,
        fun: Any,
        partition: Partition,
        leaves: list[Any],
        called: tuple[Any, ...] | None,
    ) -> Entry:
        defaulted = () if called is None else self._defaulted(called)
        return make_entry(
            self.function,
            fun,
            self.options,
            level,
            partition,
            self.owners(partition),
            leaves,
            self.trace_log,
            defaulted,
        )

    def _store(
        self,
        level: int,
        partition: Partition,
        leaves: list[Any],
        key: Any,
        entry: Entry,
    ) -> Entry:
        """Stores a new entry under `key`, to be dropped when an object it is
        keyed by weakly dies; or, where another thread stored one first, returns
        that one."""
        cache = self.entries[level]
        with self._lock:
            found = cache.get(key)
            if found is not None and not (found.captured and not found.valid()):
                return found
            cache.put(key, entry, partition.captured_bytes(leaves))
        weak = [leaves[p] for p in partition.weak_positions]
        if weak:
            cache_ref = weakref.ref(cache)

            def drop() -> None:
                cache = cache_ref()
                if cache is not None:
                    cache.discard(key, entry_ref())

            entry_ref = weakref.ref(entry)
            entry.drop_with(weak, drop)
        return entry

    def _check_traceable(self, partition: Partition, leaves: list[Any]) -> None:
        labels = [label for _, _, label in self.owners(partition)]
        positions = partition.dynamic_positions
        check_traceable(self.function.name, labels, leaves, positions)

    def _check_processes_agree(
        self,
        partition: Partition,
        owners: list[tuple[str, int | None, str]],
        leaves: list[Any],
        dynamic: Sequence[Any],
    ) -> None:
        """Before compiling a program that spans processes: that every process
        compiles it with the same static values (else a clear error, not a hang).
        A program on this process's devices alone waits for no other process."""
        options = self.options
        if not spans_processes(dynamic, options.in_shardings, options.out_shardings):
            return
        statics = [(owners[p][2], leaves[p]) for p in partition.static_positions]
        statics.append(("(the structure of the arguments)", partition.treedef))
        check_statics_agree(self.function.name, statics)

    def lookup(
        self,
        level: int,
        fun: Any,
        tree: Any,
        leaves: list[Any],
        treedef: Any,
        create: bool = False,
        by_alias: bool = False,
        called: tuple[Any, ...] | None = None,
    ) -> tuple[Partition | None, Sequence[Any], Any, Entry | None]:
        """The partition of a flattened call, its traced leaves, its key and its
        entry (`None` if there is none, or a stale one). A new partition is
        recorded when `create`, else only looked at. `called`: the call's shape,
        where donation depends on it (see `call`)."""
        types = tuple(map(type, leaves))
        try:
            partition = self._find(level, treedef, types)
        except Exception as e:
            raise key_error(self.function, fun, leaves, treedef, None, e) from e
        if partition is None:
            if create:
                owner_of = lambda signature: self._owners.setdefault(  # noqa: E731
                    signature, object()
                )
                partition = Partition(treedef, types, level, owner_of)
                cache = self.partitions[level]
                if cache.get((treedef, types)) is None:
                    cache.put((treedef, types), partition)
                else:  # equal by `==` to the one recorded, but not exactly
                    cache.put((treedef, types, partition.exact), partition)
            else:  # looked at, not recorded
                owner_of = lambda signature: self._owners.get(signature, object())  # noqa: E731
                partition = Partition(treedef, types, level, owner_of)
        dynamic, key = partition.split(leaves)
        if partition.orders is not None:
            key = (key, partition.orders(tree))
        if by_alias:
            ids = [id(leaves[position]) for position in partition.static_positions]
            key = (key, tuple(map(ids.index, ids)))
        if called is not None:
            key = (key, self._defaulted(called))
        try:
            entry = self.entries[level].get(key)
        except Exception as e:
            raise key_error(self.function, fun, leaves, treedef, partition, e) from e
        if entry is not None and entry.captured and not entry.valid():
            entry = None
        return partition, dynamic, key, entry

    def owners(self, partition: Partition) -> list[tuple[str, int | None, str]]:
        """Each leaf's parameter, position and label; made once per partition."""
        if partition.owners is None:
            partition.owners = self.function.leaf_owners(partition.treedef)
        return partition.owners

    def explain(
        self, level: int, fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Explanation:
        """What a call would do at `level`, changing nothing."""
        args, kwargs = self.function.bind(args, kwargs)
        tree = self.function.call_tree(fun, args, kwargs)
        leaves, treedef = _flatten(tree)
        partition, dynamic, _, entry = self.lookup(level, fun, tree, leaves, treedef)
        assert partition is not None
        cache_hit = (
            entry is not None and tuple(map(aval_key, dynamic)) in entry.traced_avals
        )
        owners = self.function.leaf_owners(treedef)
        labels = [label for _, _, label in owners]
        rows = list(map(row, labels, partition.roles(), leaves))
        return Explanation(self.function.name, LEVEL_NAMES[level], rows, cache_hit)

    def abstract(
        self, fun: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Entry, Partition, Sequence[Any], list[Any]]:
        """The entry for an ahead-of-time call (arrays may be ShapeDtypeStructs),
        made if new: with its partition, traced leaves and leaves.

        It is the entry that a top-level call with arrays of those shapes finds
        (their partitions share an owner, and so their keys), so `lower`, `trace`
        and `eval_shape` use the very `jax.jit` that calls do, and JAX's caches
        keep one trace and one executable for both, as for a `jax.jit`."""
        # As a top-level call is keyed (see `call`).
        called = (len(args), *kwargs) if self._donates_by_call else None
        args, kwargs = self.function.bind(args, kwargs)
        tree = self.function.call_tree(fun, args, kwargs)
        leaves, treedef = _flatten(tree)
        partition, dynamic, key, entry = self.lookup(
            ABSTRACT, fun, tree, leaves, treedef, True, False, called
        )
        assert partition is not None
        if entry is None:
            self._check_traceable(partition, leaves)
            # Made as a top-level call makes it (donation, shardings, the trace
            # log), and stored where such a call looks.
            entry = self._make_entry(TOP, fun, partition, leaves, called)
            entry = self._store(ABSTRACT, partition, leaves, key, entry)
        return entry, partition, dynamic, leaves

    def clear(self) -> None:
        self._latest = [_NO_CALL] * 4
        for cache in (*self.partitions, *self.entries):
            cache.clear()
        self._owners.clear()


# Every live dispatcher, for `clear_caches`.
_dispatchers: "weakref.WeakSet[Dispatcher]" = weakref.WeakSet()


def clear_all() -> None:
    for dispatcher in list(_dispatchers):
        dispatcher.clear()


def _module_of(fun: Any) -> str:
    fun = getattr(fun, "func", getattr(fun, "__func__", fun))  # jtu.Partial, methods
    module = getattr(fun, "__module__", None)
    if not isinstance(module, str):  # a callable object: its class's module
        module = type(fun).__module__
    return module
