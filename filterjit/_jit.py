"""The `filter_jit` wrapper and its caches."""

import functools as ft
import inspect
import re
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import (
    Any,
    Concatenate,
    Generic,
    Literal,
    overload,
    ParamSpec,
    TypeVar,
)

import jax
import jax.tree_util as jtu

from . import _trace
from ._aot import Lowered, resolve, Specialisation, Traced
from ._binding import Binder
from ._cache import AliasDispatch, BoundedCache
from ._diagnostics import (
    describe,
    Explanation,
    find_static_array_field,
    Row,
    TraceLog,
)
from ._output import pack_output, pack_output_in_place
from ._partition import ABSTRACT, MISS, Partition
from ._structure import Keywords
from ._trace import DISABLED, EAGER, STAGED, TOP


_P = ParamSpec("_P")
_Q = ParamSpec("_Q")
_R = TypeVar("_R")
_S = TypeVar("_S")

DonateOption = (
    Literal["none", "all", "all-except-first", "warn", "warn-except-first"]
    | tuple[str, ...]
)
_DONATE_STRINGS = ("none", "all", "all-except-first", "warn", "warn-except-first")

# jax.jit options that filter_jit replaces, and what to use instead.
_REJECTED_JIT_KWARGS = {
    "static_argnums": "filter_jit makes every non-array leaf static already; pass "
    "the value as a Python object, or wrap it in an array to trace it",
    "static_argnames": "filter_jit makes every non-array leaf static already; pass "
    "the value as a Python object, or wrap it in an array to trace it",
    "donate_argnums": "use filter_jit(..., donate='all'), 'all-except-first', or a "
    "tuple of parameter names such as donate=('state',)",
    "donate_argnames": "use filter_jit(..., donate=('name', ...)) with the "
    "parameter names",
}

# Bounds on the caches of one wrapper. A top-level entry pins only static Python
# values; a nested entry pins the concrete arrays it was traced with, so its
# cache is also bounded in bytes.
_TOP_MAXSIZE = 4096
_STAGED_MAXSIZE = 256
_STAGED_MAXBYTES = 16 * 2**20

_UNUSED_DONATION = "Some donated buffers were not usable"

_UNSPECIFIED: Any = object()

# Every live wrapper, for `clear_caches`.
_wrappers: "weakref.WeakSet[FilterJitWrapper[..., Any]]" = weakref.WeakSet()


@ft.cache
def _jit_parameters() -> frozenset[str]:
    return frozenset(inspect.signature(jax.jit).parameters) - {"fun"}


def _signature_of(fun: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fun)
    except (TypeError, ValueError):  # builtins and other callables without one
        return None


def _globals_of(fun: Any) -> dict[str, Any]:
    while isinstance(fun, ft.partial):
        fun = fun.func
    namespace = getattr(fun, "__globals__", None)
    if namespace is None:
        module = sys.modules.get(getattr(type(fun), "__module__", ""), None)
        namespace = vars(module) if module is not None else {}
    return namespace


def _name_of(fun: Any) -> str:
    while isinstance(fun, ft.partial):
        fun = fun.func
    return getattr(fun, "__qualname__", None) or type(fun).__qualname__


def _parameter_names(labels: list[str]) -> list[str]:
    """Identifiers from argument paths (`params['w']` -> `params_w`), unique, so
    that JAX's own messages about the jitted function name the user's arguments."""
    names: list[str] = []
    for label in labels:
        name = re.sub(r"\W+", "_", label).strip("_") or "arg"
        if name[0].isdigit():
            name = f"_{name}"
        while name in names:
            name += "_"
        names.append(name)
    return names


_flatten = jtu.default_registry.flatten


def _split_call(
    fun: Any, fun_is_leaf: bool, call: Any
) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """(fun, args, kwargs) from the pytree of a call (see `_call_tree`)."""
    if not fun_is_leaf:
        fun, call = call
    if type(call) is Keywords:
        return fun, call.args, call.kwargs
    return fun, call, {}


class FilterJitWrapper(Generic[_P, _R]):
    """A function compiled with `filter_jit`. See `filterjit.filter_jit`."""

    def __init__(
        self,
        fun: Callable[_P, _R],
        donate: DonateOption,
        inline: bool,
        jitkwargs: dict[str, Any],
    ):
        if isinstance(fun, ft.partial) and not isinstance(fun, jtu.Partial):
            # functools.partial is not a pytree; jtu.Partial is, so the arrays
            # bound in it are traced like any other argument.
            fun = jtu.Partial(fun.func, *fun.args, **fun.keywords)
        elif isinstance(fun, types.MethodType):
            # Likewise a bound method: its `self` is partitioned, not hashed.
            fun = jtu.Partial(fun.__func__, fun.__self__)
        self._fun = fun
        # A plain function is one static leaf: leave it out of the flattened call
        # rather than flatten, key and compare it on every call.
        self._fun_is_leaf = jtu.treedef_is_leaf(jtu.tree_structure(fun))
        self._signature = _signature_of(fun)
        self._parameters = (
            ()
            if self._signature is None
            else tuple(self._signature.parameters.values())
        )
        # Calls with this many positional arguments and no keywords need no
        # binding, and their pytree is their arguments; -1 if none.
        self._plain_arity = _fast_arity(self._signature) if self._fun_is_leaf else -1
        self._bind = Binder(self._signature, _name_of(fun))
        self._donate = donate
        self._silence_donation = donate in ("all", "all-except-first")
        self._inline = inline
        jitkwargs = dict(jitkwargs)
        # Given in the user's terms (prefixes of the positional arguments and of the
        # output), so not passed to jax.jit as they are.
        self._in_shardings = jitkwargs.pop("in_shardings", _UNSPECIFIED)
        self._out_shardings = jitkwargs.pop("out_shardings", _UNSPECIFIED)
        self._jitkwargs = jitkwargs
        # One cache per trace level. The top level and eager transforms differ
        # only in donation, so without it they share.
        top_cache = BoundedCache(_TOP_MAXSIZE)
        eager_cache = top_cache if donate == "none" else BoundedCache(_TOP_MAXSIZE)
        staged_cache = BoundedCache(_STAGED_MAXSIZE, _STAGED_MAXBYTES)
        # Indexed by level: TOP, EAGER, STAGED, ABSTRACT.
        self._caches: tuple[BoundedCache[Any], ...] = (
            top_cache,
            eager_cache,
            staged_cache,
            BoundedCache(_TOP_MAXSIZE),
        )
        self._cache_gets = tuple(cache.get for cache in self._caches)
        top_partitions = BoundedCache(_TOP_MAXSIZE)
        self._partitions: tuple[BoundedCache[Partition], ...] = (
            top_partitions,
            top_partitions,
            BoundedCache(_TOP_MAXSIZE),
            BoundedCache(_TOP_MAXSIZE),
        )
        self._trace_log = TraceLog(_name_of(fun))
        # (level, partition) of the latest call, which most calls repeat; level
        # -1 matches none.
        self._last_partition: tuple[int, Any] = (-1, None)
        _wrappers.add(self)
        self.__wrapped__ = fun
        self.__name__ = getattr(fun, "__name__", _name_of(fun))
        self.__qualname__ = _name_of(fun)
        self.__doc__ = getattr(fun, "__doc__", None)
        self.__module__ = getattr(fun, "__module__", None) or __name__
        self.__annotations__ = getattr(fun, "__annotations__", {})
        # Where the annotations' names resolve: decorators that read a function's
        # globals (jaxtyping's `jaxtyped`) work on the wrapper too.
        self.__globals__ = _globals_of(fun)

    def __repr__(self) -> str:
        return f"<filter_jit-wrapped {self.__qualname__} at {id(self):#x}>"

    def _clear(self) -> None:
        for cache in (*self._caches, *self._partitions):
            cache.clear()
        self._last_partition = (-1, None)

    @overload
    def __get__(
        self, instance: None, owner: Any = None
    ) -> "FilterJitWrapper[_P, _R]": ...

    @overload
    def __get__(
        self: "FilterJitWrapper[Concatenate[_S, _Q], _R]",
        instance: _S,
        owner: Any = None,
    ) -> Callable[_Q, _R]: ...

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        # Called as `self(instance, ...)`, so `instance` is partitioned like any
        # other argument. (filter_jit of the bound method makes it a jtu.Partial.)
        return types.MethodType(self, instance)

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        __tracebackhide__ = True  # noqa: F841 - pytest hides this frame
        level = _trace.call_level()
        if level == DISABLED:
            return self._fun(*args, **kwargs)
        if kwargs or len(args) != self._plain_arity:
            args, kwargs = self._bind(args, kwargs)  # pyright: ignore[reportAssignmentType]
            tree = self._call_tree(args, kwargs)
        else:
            tree = args
        # Most calls repeat the latest call's structure and leaf types: its
        # partition serves them in one generated function, without flattening
        # anew or hashing a structure.
        last_level, partition = self._last_partition
        if last_level == level:
            out = partition.call(tree, self._cache_gets[level])
            if out is not MISS:
                return out
        return self._call(level, args, kwargs)

    def _call(self, level: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call, the whole way: flattened, partitioned, looked up, compiled if
        new."""
        leaves, partition, dynamic, jitted = self._lookup(args, kwargs, level)
        if jitted is None:
            jitted = self._compile(level, partition, leaves)
        if self._silence_donation and level == TOP:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_UNUSED_DONATION)
                out = jitted(*dynamic)
        else:
            out = jitted(*dynamic)
        return resolve(out, leaves)

    def _lookup(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], level: int
    ) -> tuple[list[Any], Partition, Sequence[Any], Any]:
        """Flattens and partitions a bound call at `level`. Returns its leaves, their
        partition, the traced leaves, and the cached jitted function, or `None`."""
        leaves, treedef = _flatten(self._call_tree(args, kwargs))
        partition = self._partition(args, kwargs, level, treedef, leaves)
        dynamic, key = partition.split(leaves)  # pyright: ignore[reportGeneralTypeIssues]
        try:
            jitted = self._caches[level].get(key)
        except Exception as e:
            raise self._key_error(args, kwargs, partition, e) from e
        if type(jitted) is AliasDispatch:
            jitted = self._select(jitted, level, partition, leaves)
        return leaves, partition, dynamic, jitted

    def _call_tree(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The pytree of a call that is flattened and partitioned: the positional
        arguments, with the keyword arguments if any, with the function if it is
        a pytree with leaves."""
        call = Keywords(args, kwargs) if kwargs else args
        return call if self._fun_is_leaf else (self._fun, call)

    def _split_call(self, call: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
        """(fun, args, kwargs) from the pytree of a call."""
        return _split_call(self._fun, self._fun_is_leaf, call)

    def _partition(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        level: int,
        treedef: Any,
        leaves: list[Any],
    ) -> Partition:
        """The partition for this structure and these leaves' types, made if new,
        and from now on the latest call's. (`__call__` has tried that one.)"""
        partitions = self._partitions[level]
        types = tuple(map(type, leaves))
        try:
            found = partitions.get((treedef, types))
        except Exception as e:
            raise self._key_error(args, kwargs, None, e) from e
        if found is None:
            found = Partition(treedef, types, level)
            # Calls differing only in the types of their traced leaves share the
            # jitted function and its traces: the first partition made for a
            # signature (keyed in the same cache by a 3-tuple) owns their keys.
            owner = partitions.setdefault(found.signature, found)
            if owner is not found:
                found = Partition(treedef, types, level, owner.key_owner)
            partitions.put((treedef, types), found)
        # The latest call's path serves no call that must silence JAX's warnings.
        fast = not (self._silence_donation and level == TOP)
        self._last_partition = (level if fast else -1, found)
        return found

    def _select(
        self,
        dispatch: AliasDispatch,
        level: int,
        partition: Partition,
        leaves: list[Any],
    ) -> Any:
        """The jitted function for these leaves' alias pattern, made if new."""
        pattern = partition.alias_pattern(leaves)
        jitted = dispatch.by_pattern.get(pattern)
        if jitted is None:
            jitted = dispatch.by_pattern[pattern] = self._jit(level, partition, leaves)
        return jitted

    def _compile(self, level: int, partition: Partition, leaves: list[Any]) -> Any:
        jitted = self._jit(level, partition, leaves)
        _, key = partition.split(leaves)  # pyright: ignore[reportGeneralTypeIssues]
        self._caches[level].put(key, jitted, partition.captured_bytes(leaves))
        return jitted

    def _jit(
        self, level: int, partition: Partition, leaves: list[Any]
    ) -> Callable[..., Any]:
        treedef = partition.treedef
        dynamic_positions = partition.dynamic_positions
        # The traced leaves' values are not part of the trace; keep none alive.
        template = list(leaves)
        for position in dynamic_positions:
            template[position] = None
        labels = [label for _, _, label in self._leaf_owners(treedef, leaves)]
        roles = partition.roles(len(leaves))
        trace_log = self._trace_log if level in (TOP, EAGER) else None
        # Shardings, like donation, are for the top level; a nested call changes
        # nothing.
        sharded_output = level != STAGED and self._out_shardings is not _UNSPECIFIED
        traced_avals: set[tuple[Any, ...]] = set()
        # Weak references: the cache holds the jitted function, which holds `run`;
        # a strong cycle would keep evicted entries (and their constants) alive
        # until the cycle collector runs.
        cache_ref = weakref.ref(self._caches[level])
        _, key = partition.split(leaves)  # pyright: ignore[reportGeneralTypeIssues]
        nbytes = partition.captured_bytes(leaves)
        this: list[weakref.ref[Any]] = []  # the jitted function, once made

        def on_ambiguous_output(inputs: list[Any]) -> None:
            # From now on, calls with this key are told apart by alias pattern;
            # this function serves the pattern it was traced with.
            cache, jitted = cache_ref(), this[0]()
            if cache is None or jitted is None:
                return
            entry = cache.get(key)
            if type(entry) is not AliasDispatch:
                entry = AliasDispatch()
                cache.put(key, entry, nbytes)
            entry.by_pattern[partition.alias_pattern(inputs)] = jitted

        # Not the bound method `self._split_call`: `run` must not hold the wrapper.
        split_call = ft.partial(_split_call, self._fun, self._fun_is_leaf)

        def run(*dynamic: Any) -> Any:
            inputs = list(template)
            for position, leaf in zip(dynamic_positions, dynamic):
                inputs[position] = leaf
            traced_avals.add(tuple(map(jax.typeof, dynamic)))
            if trace_log is not None:
                trace_log.record(
                    [
                        Row(label, role, describe(leaf, role), type(leaf))
                        for label, role, leaf in zip(labels, roles, inputs)
                    ]
                )
            fun, args, kwargs = split_call(jtu.tree_unflatten(treedef, inputs))
            output = fun(*args, **kwargs)
            if sharded_output:
                return pack_output_in_place(output)
            packed, ambiguous = pack_output(output, inputs)
            if ambiguous:
                on_ambiguous_output(inputs)
            return packed

        # So that JAX's own messages (jax_explain_cache_misses, errors) point at
        # the user's function and name the user's arguments, not at this closure.
        run.__name__ = self.__name__
        run.__qualname__ = self.__qualname__
        run.__wrapped__ = self._fun  # pyright: ignore[reportFunctionMemberAccess]
        run.__signature__ = inspect.Signature(  # pyright: ignore[reportFunctionMemberAccess]
            [
                inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY)
                for name in _parameter_names([labels[i] for i in dynamic_positions])
            ]
        )
        run.traced_avals = traced_avals  # pyright: ignore[reportFunctionMemberAccess]
        jitkwargs = dict(self._jitkwargs)
        if level == STAGED:
            jitkwargs["inline"] = self._inline
        else:
            if sharded_output:
                jitkwargs["out_shardings"] = self._out_shardings
            if self._in_shardings is not _UNSPECIFIED:
                jitkwargs["in_shardings"] = self._leaf_shardings(
                    treedef, leaves, dynamic_positions
                )
            if level in (TOP, ABSTRACT):
                donated = self._donated_positions(treedef, leaves, dynamic_positions)
                if donated:
                    jitkwargs["donate_argnums"] = donated
        jitted = jax.jit(run, **jitkwargs)
        this.append(weakref.ref(jitted))
        return jitted

    def _leaf_shardings(
        self, treedef: Any, leaves: list[Any], dynamic_positions: tuple[int, ...]
    ) -> tuple[Any, ...]:
        """`in_shardings`, a prefix of the positional arguments, for each traced
        leaf."""
        fun, args, kwargs = self._split_call(jtu.tree_unflatten(treedef, leaves))
        try:
            per_arg = jax.tree.broadcast(
                self._in_shardings, args, is_leaf=lambda x: x is None
            )
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"{self.__qualname__}: in_shardings must be a pytree prefix of the "
                f"positional arguments (a tuple with one entry per argument, each "
                f"a sharding, None, or a pytree of them), but: {e}"
            ) from None
        per_leaf = [
            *([None] * (0 if self._fun_is_leaf else len(jtu.tree_leaves(fun)))),
            *jtu.tree_leaves(per_arg, is_leaf=lambda x: x is None),
            *([None] * len(jtu.tree_leaves(kwargs))),
        ]
        return tuple(per_leaf[position] for position in dynamic_positions)

    def _prepare_abstract(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[list[Any], Partition, Sequence[Any]]:
        args, kwargs = self._bind(args, kwargs)
        leaves, partition, dynamic, _ = self._lookup(args, kwargs, ABSTRACT)
        return leaves, partition, dynamic

    def _abstract(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Specialisation, Sequence[Any]]:
        args, kwargs = self._bind(args, kwargs)
        leaves, partition, dynamic, jitted = self._lookup(args, kwargs, ABSTRACT)
        if jitted is None:
            jitted = self._compile(ABSTRACT, partition, leaves)
        labels = lambda treedef, leaves: [  # noqa: E731
            label for _, _, label in self._leaf_owners(treedef, leaves)
        ]
        specialisation = Specialisation(self.__qualname__, partition, leaves, labels)
        return jitted, specialisation, dynamic

    def lower(self, *args: _P.args, **kwargs: _P.kwargs) -> Lowered:
        """Lowers the function for these arguments, as `jax.jit(...).lower`.

        Arrays may be given as `jax.ShapeDtypeStruct`s. Every other leaf is static
        and compiled in: the `Compiled` object raises if called with different
        static values.

        **Returns:**

        A `Lowered`, with `.as_text()` and `.compile()`.
        """
        jitted, specialisation, dynamic = self._abstract(args, kwargs)
        return Lowered(jitted.lower(*dynamic), specialisation, self._prepare_abstract)

    def trace(self, *args: _P.args, **kwargs: _P.kwargs) -> Traced:
        """Traces the function for these arguments, as `jax.jit(...).trace`.

        **Returns:**

        A `Traced`, with `.jaxpr`, `.out_info` and `.lower()`.
        """
        jitted, specialisation, dynamic = self._abstract(args, kwargs)
        return Traced(jitted.trace(*dynamic), specialisation, self._prepare_abstract)

    def eval_shape(self, *args: _P.args, **kwargs: _P.kwargs) -> Any:
        """The output's shapes and dtypes, as `jax.eval_shape`: traced output
        leaves as `jax.ShapeDtypeStruct`s, every other leaf unchanged."""
        jitted, specialisation, dynamic = self._abstract(args, kwargs)
        return resolve(jitted.eval_shape(*dynamic), specialisation.leaves)

    def _explain(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Explanation:
        args, kwargs = self._bind(args, kwargs)
        level = _trace.trace_level()
        leaves, partition, dynamic, jitted = self._lookup(args, kwargs, level)
        cache_hit = (
            jitted is not None
            and tuple(map(jax.typeof, dynamic)) in jitted.__wrapped__.traced_avals
        )
        roles = partition.roles(len(leaves))
        rows = [
            Row(label, role, describe(leaf, role), type(leaf))
            for (_, _, label), role, leaf in zip(
                self._leaf_owners(partition.treedef, leaves), roles, leaves
            )
        ]
        where = {
            TOP: "at the top level",
            EAGER: "under eager transforms",
            STAGED: "inside a staged trace",
        }
        return Explanation(self.__qualname__, where[level], rows, cache_hit)

    def _donated_positions(
        self,
        treedef: Any,  # a PyTreeDef
        leaves: list[Any],
        dynamic_positions: tuple[int, ...],
    ) -> tuple[int, ...]:
        if self._donate == "none":
            return ()
        owners = self._leaf_owners(treedef, leaves)
        if isinstance(self._donate, tuple):
            donated_names = set(self._donate)
            return tuple(
                i
                for i, position in enumerate(dynamic_positions)
                if owners[position][0] in donated_names
            )
        spare_first = self._donate.endswith("except-first")
        return tuple(
            i
            for i, position in enumerate(dynamic_positions)
            if not (spare_first and owners[position][1] == 0)
        )

    def _label(self, where: int | str) -> tuple[str, str]:
        """The parameter that receives positional argument `where` (an int) or
        keyword argument `where` (a str), and how to name the argument to a user."""
        if isinstance(where, str):
            return where, where
        positional = [
            p.name
            for p in self._parameters
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        if where < len(positional):
            return positional[where], positional[where]
        for p in self._parameters:
            if p.kind is p.VAR_POSITIONAL:
                return p.name, f"{p.name}[{where - len(positional)}]"
        return f"<argument {where}>", f"<argument {where}>"

    def _leaf_owners(
        self, treedef: Any, leaves: list[Any]
    ) -> list[tuple[str, int | None, str]]:
        """For each leaf of a call: the parameter it belongs to, its position if
        passed positionally, and the path to it in the user's terms."""
        fun, args, kwargs = self._split_call(jtu.tree_unflatten(treedef, leaves))
        owners = []
        if not self._fun_is_leaf:
            for path, _ in jtu.tree_flatten_with_path(fun)[0]:
                label = f"{self.__qualname__}{jtu.keystr(path)}"
                owners.append(("<function>", None, label))
        for path, _ in jtu.tree_flatten_with_path((args, kwargs))[0]:
            (_, top), rest = path[:2], path[2:]
            if isinstance(top, jtu.SequenceKey):
                name, label = self._label(top.idx)
                owners.append((name, top.idx, label + jtu.keystr(rest)))
            else:
                assert isinstance(top, jtu.DictKey)
                name, label = self._label(str(top.key))
                owners.append((name, None, label + jtu.keystr(rest)))
        return owners

    def _key_error(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        partition: Partition | None,
        error: Exception,
    ) -> TypeError:
        """The error for a cache lookup that failed: it names the argument whose
        hash or `==` failed."""
        leaves, treedef = _flatten(self._call_tree(args, kwargs))
        if partition is None:
            # The structure itself failed: auxiliary data of a pytree node, such
            # as a static field of an eqx.Module, holds a value that cannot be
            # hashed or compared.
            named = [*enumerate(args), *kwargs.items()]
            for where, value in [(None, self._fun), *named]:
                label = self.__qualname__ if where is None else self._label(where)[1]
                field = find_static_array_field(value, label)
                if field is not None:
                    return TypeError(
                        f"{self.__qualname__}(): `{field}` is a static field "
                        "(`eqx.field(static=True)`) holding an array. Static "
                        "fields are compared with `==` to find cached traces, and "
                        "arrays cannot be. Make it a regular field so that it is "
                        "traced, or hold a hashable value (a tuple, say)."
                    )
                if _hash_and_eq_fail(jtu.tree_structure(value)):
                    return TypeError(
                        f"{self.__qualname__}(): the pytree structure of argument "
                        f"`{label}` cannot be hashed or compared ({error}). A "
                        "static field (`eqx.field(static=True)`) or other pytree "
                        "auxiliary data holds such a value. Make it hashable (a "
                        "tuple rather than a list, say), or make it a regular "
                        "field so that it is traced."
                    )
        else:
            statics = partition.statics(leaves)
            for position, key in zip(partition.static_positions, statics):
                if _hash_and_eq_fail(key):
                    label = self._leaf_owners(treedef, leaves)[position][2]
                    kind = type(leaves[position]).__qualname__
                    return TypeError(
                        f"{self.__qualname__}(): argument `{label}` is a static "
                        f"value of type `{kind}` that cannot be hashed or compared "
                        f"({type(error).__name__}: {error}). filter_jit keys its "
                        "cache on every non-array leaf, so static values must be "
                        "hashable and `==` must return a bool. Pass such a value "
                        "instead (a tuple rather than a list, say), or make it an "
                        "array (`jnp.asarray(...)`) so that it is traced."
                    )
        return TypeError(
            f"{self.__qualname__}(): looking up the cache for this call failed "
            f"({type(error).__name__}: {error})."
        )


def _hash_and_eq_fail(key: Any) -> bool:
    try:
        hash(key)
        return not isinstance(key == key, bool)
    except Exception:
        return True


def _fast_arity(signature: inspect.Signature | None) -> int:
    """The number of positional arguments for which a call needs no binding
    (nothing to default, nothing passed by keyword), or -1 if there is none."""
    if signature is None:
        return -1
    count = 0
    for parameter in signature.parameters.values():
        if parameter.kind in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        ):
            count += 1
        elif parameter.kind is not inspect.Parameter.VAR_KEYWORD:
            return -1
    return count


@overload
def filter_jit(
    fun: Callable[_P, _R],
    /,
    *,
    donate: DonateOption = "none",
    inline: bool = False,
    **jitkwargs: Any,
) -> FilterJitWrapper[_P, _R]: ...


@overload
def filter_jit(
    fun: None = None,
    /,
    *,
    donate: DonateOption = "none",
    inline: bool = False,
    **jitkwargs: Any,
) -> Callable[[Callable[_P, _R]], FilterJitWrapper[_P, _R]]: ...


def filter_jit(
    # Checked below with messages that say what to do; a runtime type checker
    # (jaxtyping's import hook, say) must not pre-empt them.
    fun: Any = None,
    /,
    *,
    donate: Any = "none",
    inline: bool = False,
    **jitkwargs: Any,
) -> Any:
    """Compiles `fun` like `jax.jit`, tracing its array leaves and keeping every
    other leaf static; and when called inside another trace, changes nothing.

    At the top level (and under eager `grad`/`vjp`/`jvp`/`vmap`), JAX arrays,
    NumPy arrays and NumPy scalars anywhere in the arguments are traced, and every
    other leaf (Python `bool`/`int`/`float`/`complex` included) is static. A call
    inside a staged computation (an outer `jax.jit`, a `lax.scan` body,
    `jax.checkpoint`, `make_jaxpr`, ...) traces only the leaves that are already
    tracers: concrete arrays and Python values reach `fun` unchanged, exactly as
    they would without the decorator, so decorating a function never changes what
    a program computes, whether it can be differentiated, or what is known at
    trace time.

    Outputs that are traced come back as arrays; anything else `fun` returns comes
    back unchanged.

    **Arguments:**

    - `fun`: the function to compile. It may be a pytree (an `eqx.Module`, a
        `jax.tree_util.Partial`), whose leaves are partitioned like arguments.
        Omit it to use `filter_jit(...)` as a decorator factory.
    - `donate`: which argument buffers to donate at the top level: `"none"`,
        `"all"`, `"all-except-first"` (these two silence JAX's warning about
        unusable donations), `"warn"`, `"warn-except-first"` (the same, warning),
        or a tuple of parameter names. Ignored when nested.
    - `inline`: inline a nested call into the outer jaxpr rather than emitting a
        `jit` equation. Changes structure only, never results.
    - `jitkwargs`: passed on to `jax.jit` (`keep_unused`, `compiler_options`,
        `device`, `backend`), except `in_shardings`, a pytree prefix of the
        positional arguments whose entries on static leaves are ignored, and
        `out_shardings`, a prefix of the output; both apply at the top level only.
        `static_argnums`, `static_argnames`, `donate_argnums` and
        `donate_argnames` are rejected, with what to use instead.

    **Returns:**

    A wrapper with the signature of `fun`, usable as a method.

    !!! example

        ```python
        @filterjit.filter_jit
        def f(init, lower):
            return jax.lax.fori_loop(lower, 1, lambda _, y: y + 1, init)

        jax.jit(lambda: jax.grad(f)(0.0, np.int32(0)))()  # 1.0
        ```
    """
    if not isinstance(donate, tuple) and donate not in _DONATE_STRINGS:
        raise ValueError(
            f"filter_jit: donate={donate!r} is not an option. Use one of "
            f"{', '.join(repr(s) for s in _DONATE_STRINGS)}, or a tuple of "
            "parameter names such as donate=('state',)."
        )
    for name in jitkwargs:
        if name in _REJECTED_JIT_KWARGS:
            raise ValueError(
                f"filter_jit does not take `{name}`: {_REJECTED_JIT_KWARGS[name]}."
            )
        if name not in _jit_parameters():
            raise TypeError(f"filter_jit() got an unexpected keyword argument {name!r}")
    if fun is None:
        return ft.partial(filter_jit, donate=donate, inline=inline, **jitkwargs)  # pyright: ignore[reportReturnType]
    if not callable(fun):
        raise TypeError(
            f"filter_jit expects a callable, but got {fun!r} of type "
            f"`{type(fun).__qualname__}`. Use it as `@filter_jit` or "
            "`filter_jit(function)`."
        )
    if isinstance(donate, tuple):
        _check_donated_names(fun, donate)
    return FilterJitWrapper(fun, donate, inline, jitkwargs)


def _check_donated_names(fun: Callable[..., Any], names: tuple[str, ...]) -> None:
    signature = _signature_of(fun)
    known = set() if signature is None else set(signature.parameters)
    for name in names:
        if not isinstance(name, str) or name not in known:
            raise ValueError(
                f"filter_jit: donate={names!r} names {name!r}, which is not a "
                f"parameter of {_name_of(fun)} (parameters: {sorted(known)})."
            )
