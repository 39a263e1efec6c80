"""What filter_jit did with each argument, and why it traced again."""

import collections
import dataclasses
import logging
import os
import reprlib
import sys
import types
import warnings
import weakref
from collections.abc import Collection
from typing import Any, NamedTuple

import jax

from ._donated import user_frame
from ._function import is_partial, is_partial_type, opened, unwrapped
from ._leaves import is_array, weakly_keyed
from ._level import Level, STAGED


logger = logging.getLogger("filterjit")

_short_repr = reprlib.Repr()
_short_repr.maxstring = _short_repr.maxother = 40
_short_repr.maxlist = _short_repr.maxtuple = _short_repr.maxdict = 6

# Retrace-warning thresholds by module (and submodules); `None`'s for all others.
_thresholds: dict[str | None, int | None] = {
    None: int(os.environ.get("FILTERJIT_RETRACE_WARNING_THRESHOLD", "10"))
}


class RetraceWarning(UserWarning):
    """Emitted once per decorated function traced again more times in a row than
    the threshold of `filterjit.set_retrace_warning_threshold` (10 unless changed)
    only because a Python scalar, or a function made anew by the same code (a
    lambda or closure made on every call), took a new value; it names that argument.
    Also emitted, once per piece of code, where more functions than the threshold
    made anew by that code in one loop were each traced by a wrapper of its own
    (`for c in cs: filter_jit(lambda x: x + c)(x)`); it names what they close over.

    Not emitted for the wrappers of [`filterjit.patch_equinox`][] (Equinox's give
    none). Traces for new shapes, dtypes, structures, strings or other functions do
    not count, and end a run of avoidable retraces."""


def set_retrace_warning_threshold(
    threshold: int | None, *, module: str | None = None
) -> None:
    """Sets after how many avoidable retraces a function emits a `RetraceWarning`.

    **Arguments:**

    - `threshold`: a function traced again more than this many times in a row
        only because a Python scalar or a re-made function took a new value warns,
        once; `None` disables the warning. The default is 10, or the environment
        variable `FILTERJIT_RETRACE_WARNING_THRESHOLD`.
    - `module`: if given, the threshold of the functions defined in this module
        or its submodules alone (`"optimistix"`, say), over the global one.

    !!! example

        ```python
        filterjit.set_retrace_warning_threshold(None, module="mylibrary")
        ```
    """
    if threshold is not None and (not isinstance(threshold, int) or threshold < 1):
        raise ValueError(
            f"set_retrace_warning_threshold: expected a positive int or None, but "
            f"got {threshold!r}."
        )
    _thresholds[module] = threshold


class Row(NamedTuple):
    """One leaf of a call: its path, its role, its aval (traced) or its value."""

    path: str
    role: str  # "traced", "static" or "concrete"
    value: str
    kind: type
    code: Any = None  # a static function's code: one re-made by it is the trap
    ref: Any = None  # a weakref to a static leaf keyed by identity (text may repeat)


Change = tuple[str, Row | None, Row | None]  # a leaf's path, its rows before and after


def qualified_name(value: Any) -> str | None:
    """`module.qualname` of a function or class, or `None` for other values."""
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    if not (callable(value) and isinstance(qualname, str)):
        return None
    return f"{module}.{qualname}" if isinstance(module, str) else qualname


def _function_text(value: Any) -> str | None:
    """A static function as a table shows it: its whole qualified name (a partial's
    and a bound method's, with what they bind shortened); `None` for other values."""
    pieces = opened(value)
    if pieces is None:
        return qualified_name(value)
    if is_partial(value):
        inner = _function_text(pieces.inside) or _short_repr.repr(pieces.inside)
        bound = [_short_repr.repr(a) for a in pieces.args]
        bound += [f"{k}={_short_repr.repr(v)}" for k, v in pieces.keywords.items()]
        return f"functools.partial({', '.join([inner, *bound])})"
    name = qualified_name(pieces.inside)
    if name is None:
        return qualified_name(value)
    return f"{name} of {_short_repr.repr(pieces.args[0])}"


def _array_type(array: Any) -> str:
    """An array's dtype and shape, as JAX writes them (`f64[8,2]`): its own, as the
    function sees an array passed on (JAX's view of a NumPy array, x64 off, is
    32-bit; and JAX has none of a NumPy array of objects or strings)."""
    # JAX's short names of dtypes (`f32`, `u8`, `bf16`), for any NumPy dtype.
    name = array.dtype.name.replace("float", "f").replace("uint", "u")
    name = name.replace("int", "i").replace("complex", "c")
    return f"{name}[{','.join(map(str, array.shape))}]"


def row(path: str, role: str, leaf: Any) -> Row:
    if role == "traced":
        aval = jax.typeof(leaf)
        text = aval.str_short(short_dtypes=True)
        text = f"weak {text}" if getattr(aval, "weak_type", False) else text
    elif is_array(leaf) and leaf.size > 6:
        text = f"{type(leaf).__name__}({_array_type(leaf)})"
    else:
        text = _function_text(leaf) or _short_repr.repr(leaf)
    code = ref = None
    if role == "static":
        # A functools.partial compares by identity: one re-made is a trap too.
        code = getattr(unwrapped(leaf), "__code__", None)
        ref = weakref.ref(leaf) if weakly_keyed(type(leaf)) else None
    return Row(path, role, text, type(leaf), code, ref)


def _avoidable(before: Row | None, after: Row | None, seen: Collection[str]) -> bool:
    """Whether a change is the trap: a Python scalar taking a value not `seen`
    before, or a function re-made by the same code."""
    if before is None or after is None:
        return False
    if not before.role == after.role == "static" or before.kind is not after.kind:
        return False
    if before.code is not None and before.code is after.code:
        return True
    return before.kind in (bool, int, float, complex) and after.value not in seen


def _hint(old: Row | None, new: Row | None) -> str:
    if old is None:
        return "a new argument: the structure of the arguments changed"
    if new is None:
        return "no longer passed: the structure of the arguments changed"
    if old.role != new.role:
        return f"was {old.role}, now {new.role}"
    if new.role == "traced":
        return "traced: every new shape, dtype or weak type is traced anew"
    kind = new.kind.__name__
    if new.code is not None and new.code is old.code:
        if is_partial_type(new.kind):
            return (
                "a functools.partial compares by identity, so one made anew on "
                "every call is a new static value: make it once, or pass "
                "jax.tree_util.Partial(function, jnp.asarray(value)) so that the "
                "values it binds are traced"
            )
        return (
            "a function made anew by the same code (a lambda or closure inside a "
            "loop?) is a new static value: define it once, or pass its arrays as "
            "arguments"
        )
    # A Python scalar: traced where it is only a number, static where it decides
    # the program.
    path = new.path
    if new.kind is int:
        return (
            "a Python int is static, and each new value traces anew. Where it is a "
            f"count, a shape or an index (`range({path})`, a `lax.fori_loop` bound, "
            f"`jnp.zeros({path})`), keep it static: traced, `range` and shapes "
            "raise, and `fori_loop` becomes a `while_loop`, which reverse mode "
            "cannot differentiate. Where it is only a number in arithmetic, pass "
            f"jnp.asarray({path}) to trace it"
        )
    if new.kind is bool:
        return (
            "a Python bool is static: each of its two values traces once. Where "
            f"Python branches on it (`if {path}:`) it must stay static; trace it "
            f"(jnp.asarray({path})) only where it is used through `lax.cond` or "
            "`jnp.where`"
        )
    if new.kind in (float, complex):
        return (
            f"a Python {kind} is static, and each new value traces anew; "
            f"pass jnp.asarray({path}) to trace it, unless Python branches on it: "
            f"`if {path} > 0:` needs it static"
        )
    if new.role == "concrete":
        return (
            f"a concrete {kind} inside a staged trace is a compile-time constant, "
            "keyed by value"
        )
    return f"a {kind} is static: every new value is traced anew"


def describe_change(change: Change) -> str:
    """`path: old -> new (why that traces)`."""
    path, before, after = change
    old = "<absent>" if before is None else before.value
    new = "<absent>" if after is None else after.value
    return f"{path}: {old} -> {new} ({_hint(before, after)})"


def _changes(old: dict[str, Row], new: dict[str, Row]) -> list[Change]:
    compared = lambda row: row and (row.role, row.value, row.ref)  # noqa: E731
    pairs = [(p, old.get(p), new.get(p)) for p in dict.fromkeys([*old, *new])]
    return [(path, a, b) for path, a, b in pairs if compared(a) != compared(b)]


def _threshold(module: str) -> float:
    """The threshold of `module`, its package's, or the global one (or infinite)."""
    while module and module not in _thresholds:
        module = module.rpartition(".")[0]
    threshold = _thresholds[module or None]
    return float("inf") if threshold is None else float(threshold)


def _warn(message: str) -> None:
    """Emits a `RetraceWarning` at the user's call that traced."""
    warnings.warn(message, RetraceWarning, stacklevel=user_frame(sys._getframe())[1])


@dataclasses.dataclass(slots=True)
class _Run:
    """The functions made anew in one loop by one code object traced so far: the
    ids of the latest's closure cells (a cell is not weakly referable, and holding
    it would keep what the closure holds alive), the cells themselves where they
    hold only atoms (so that no later cell takes a freed one's id), how many were
    traced before it, and the functions counted (one wrapped again is no new one)."""

    cells: tuple[int, ...]
    kept: tuple[Any, ...]
    before: int = 0
    functions: "weakref.WeakSet[types.FunctionType]" = dataclasses.field(
        default_factory=weakref.WeakSet
    )


# By code object: the latest run of functions it made anew and traced.
_runs: "weakref.WeakKeyDictionary[types.CodeType, _Run]" = weakref.WeakKeyDictionary()
_warned_codes: "weakref.WeakSet[types.CodeType]" = weakref.WeakSet()


_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None)})


def _holds_an_atom(cell: Any) -> bool:
    try:
        return type(cell.cell_contents) in _ATOMS
    except ValueError:  # an empty cell
        return True


def _remade_run(log: "TraceLog") -> int:
    """On the first trace of `log`'s function, how many functions made by the same
    code in one run of it (a loop) were traced before it, each for the first time;
    0 for any other trace, and for a function made otherwise (it starts a new run).

    Functions made in one run are made by a module's code (a script, a notebook
    cell, the REPL), or share closure cells, which belong to the one call that made
    them; functions made by separate calls (a parametrized test) are not counted."""
    code = log.code
    function = None if log.function is None else log.function()
    if log.count != 1 or code is None or function is None:
        return 0
    cells = tuple(map(id, log.cells))
    run = _runs.get(code)
    if run is not None and function in run.functions:
        return 0
    if run is not None and (cells == run.cells if cells else log.module_level):
        run.before += 1
    else:
        kept = log.cells if all(map(_holds_an_atom, log.cells)) else ()
        run = _runs[code] = _Run(cells, kept)
    run.functions.add(function)
    return run.before


_LOG_OR_SILENCE = (
    "Set FILTERJIT_EXPLAIN_RETRACES=1 (or jax_explain_cache_misses) to log every "
    "retrace to the 'filterjit' logger; "
    "filterjit.set_retrace_warning_threshold(None, module=...) silences this "
    "warning for one library."
)
_MAX_SEEN = 64  # values remembered per static argument, for the RetraceWarning
# Cached traces compared with a new one (the latest), to find the nearest.
_MAX_COMPARED = 1024


class Nearest(NamedTuple):
    """The cached trace nearest a call: its number, and what differs from it."""

    number: int
    changes: list[Change]
    cached: bool = True  # False: no trace is cached, and this is the latest


class Traces:
    """The rows of the traces a cache entry holds (`Entry.traces`): dropped with it."""

    __slots__ = ("rows", "__weakref__")

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Row]]] = []  # (trace number, rows)


class TraceLog:
    """The top-level traces of one function, and what changed between them."""

    def __init__(self, name: str, fun: object):
        self.name = name
        inner = unwrapped(fun)  # a callable object: its class's module
        module = getattr(inner, "__module__", None)
        self.module = module if isinstance(module, str) else type(inner).__module__
        self.count = 0
        self.in_a_row = 0  # avoidable retraces since the last that was not one
        # The traces still cached (held by their entries), and the latest.
        self._cached: weakref.WeakSet[Traces] = weakref.WeakSet()
        self._latest: tuple[int, dict[str, Row]] | None = None
        # The values each static argument has had: one seen before is no trap.
        self._seen: dict[str, set[str]] = collections.defaultdict(set)
        self._change_counts: collections.Counter[str] = collections.Counter()
        self._hints: dict[str, str] = {}
        self._warned = False
        self.warns = True  # False for `patch_equinox()`'s wrappers (logged only)
        # A Python function's own (see `made_for`).
        self.code: types.CodeType | None = None
        self.cells: tuple[Any, ...] = ()
        self.module_level = False  # made by a module's code (a script, a notebook)
        self.function: weakref.ref[types.FunctionType] | None = None

    def made_for(self, fun: Any) -> None:
        """For a Python function (one made anew has caches of its own), what tells
        one made anew in a loop (see `_remade_run`)."""
        if self.code is None and type(fun) is types.FunctionType:
            self.code = fun.__code__
            self.cells = fun.__closure__ or ()
            self.module_level = "<locals>" not in fun.__qualname__
            self.function = weakref.ref(fun)

    def nearest(self, rows: list[Row]) -> "Nearest | None":
        """The cached trace nearest `rows` (the one with fewest leaves that differ;
        of those, the latest) and what differs; where none is cached, the latest
        trace (`cached` false); `None` before the first."""
        current = {row.path: row for row in rows}
        traces = [item for held in list(self._cached) for item in held.rows]
        traces.sort(key=lambda item: -item[0])  # the latest first
        best: Nearest | None = None
        for number, old in traces[:_MAX_COMPARED]:
            changes = _changes(old, current)
            if best is None or len(changes) < len(best.changes):
                best = Nearest(number, changes)
            if not best.changes:
                break
        if best is None and self._latest is not None:
            number, old = self._latest
            best = Nearest(number, _changes(old, current), cached=False)
        return best

    def record(
        self, paths: list[str], roles: list[str], leaves: list[Any], held: Traces | None
    ) -> None:
        """Called on each top-level or eager trace, with its leaves' paths (their
        labels) and roles, the leaves it traced with and its entry's `Traces`."""
        self.count += 1
        rows = list(map(row, paths, roles, leaves))
        current = {row.path: row for row in rows}
        explain = os.environ.get("FILTERJIT_EXPLAIN_RETRACES") == "1"
        explain = explain or bool(getattr(jax.config, "jax_explain_cache_misses"))
        remade = _remade_run(self)
        if remade and explain:
            logger.warning(self._remade_message(remade, warning=False))
        if remade > _threshold(self.module) and self.warns and self.code is not None:
            if self.code not in _warned_codes:
                _warned_codes.add(self.code)
                _warn(self._remade_message(remade, warning=True))
        if self.count > 1:
            nearest = self.nearest(rows)
            changes = [] if nearest is None else nearest.changes
            if changes and all(
                _avoidable(b, a, self._seen.get(path, ())) for path, b, a in changes
            ):
                self.in_a_row += 1
                for path, before, after in changes:
                    self._change_counts[path] += 1
                    self._hints[path] = _hint(before, after)
            else:
                self.in_a_row = 0
                self._change_counts.clear()
            if explain:
                logger.warning(self._retrace_message(nearest))
        if held is not None:
            held.rows.append((self.count, current))
            self._cached.add(held)
        self._latest = (self.count, current)
        for path, now in current.items():
            if now.role == "static" and len(self._seen[path]) <= _MAX_SEEN:
                self._seen[path].add(now.value)
        if not self._warned and self.warns and self.in_a_row > _threshold(self.module):
            self._warned = True
            path, times = self._change_counts.most_common(1)[0]
            _warn(
                f"filter_jit: {self.name} has been traced {self.count} times, the "
                f"last {self.in_a_row} only because a static value took a new value; "
                f"`{path}` changed in {times} of them ({self._hints[path]}). "
                f"{_LOG_OR_SILENCE}"
            )

    def explanation(
        self,
        level: Level,
        paths: list[str],
        roles: list[str],
        leaves: list[Any],
        hit: bool,
    ) -> "Explanation":
        """What a call with these leaves would do at `level`, `hit` saying whether
        it would hit the cache; where not, and not nested, its nearest trace."""
        rows = list(map(row, paths, roles, leaves))
        nearest = None if hit or level == STAGED else self.nearest(rows)
        where = Level(level).description
        return Explanation(self.name, where, rows, hit, nearest=nearest)

    def _retrace_message(self, nearest: "Nearest | None") -> str:
        assert nearest is not None  # called from the second trace on
        against = f"trace {nearest.number}, the nearest cached"
        if not nearest.cached:
            against = (
                f"trace {nearest.number}, the latest: no trace is cached (the caches "
                "were cleared, or the traces evicted or dropped with an object they "
                "were keyed by)"
            )
        if not nearest.changes:
            why = (
                "JAX keyed on something else (sharding, committed device, a "
                "jax.config setting)."
                if nearest.cached
                else "it traced them anew."
            )
            return (
                f"filter_jit: {self.name} traced again (trace {self.count}) with "
                f"arguments like those of {against}: {why}"
            )
        parts = [describe_change(change) for change in nearest.changes]
        return (
            f"filter_jit: {self.name} traced again (trace {self.count}) because "
            + "; ".join(parts)
            + f" (against {against})"
        )

    def _remade_message(self, in_a_row: int, warning: bool) -> str:
        """The warning, or the retrace log's line, for a function made anew."""
        code = self.code
        assert code is not None  # `_remade_run` counts only functions with one
        where = f"{code.co_filename}:{code.co_firstlineno}"
        closes = ", ".join(f"`{name}`" for name in code.co_freevars)
        passed = f"what it closes over ({closes})" if closes else "what changes"
        advice = (
            f"define it once, outside the loop, and pass {passed} as arguments, as "
            "arrays where they are numbers that change (`jnp.asarray(value)`: a "
            "Python scalar is static, and each new value traces anew; one that is "
            "a count, a shape or a loop bound must stay static)"
        )
        said = (
            f"filter_jit: {in_a_row + 1} functions `{self.name}` made anew by the "
            f"same code ({where}) were traced one after another"
            if warning
            else f"filter_jit: `{self.name}` traced, a function made anew by the "
            f"same code ({where}) as the {in_a_row} traced just before it"
        )
        message = (
            f"{said}: a function made anew (a lambda or closure inside a loop) is a "
            "new function, with caches of its own, and is traced anew. To trace it "
            f"once, {advice}."
        )
        return f"{message} {_LOG_OR_SILENCE}" if warning else message


@dataclasses.dataclass(eq=False)
class Explanation:
    """What a `filter_jit` call would do (see `filterjit.explain`): one row per
    leaf, whether it would hit the cache, and for a call that would trace, the
    cached trace nearest it and what differs. `str()` gives a table."""

    name: str
    level: str
    rows: list[Row]
    cache_hit: bool | None  # None: jax.jit's own cache decides, unseen
    decorator: str = "filter_jit"
    nearest: Nearest | None = None

    @property
    def misses(self) -> list[str]:
        """The paths of the leaves that differ from the nearest cached trace (why
        the call would trace); empty where it would hit, or nothing is cached."""
        if self.cache_hit is not False or not (self.nearest and self.nearest.cached):
            return []
        return [path for path, _, _ in self.nearest.changes]

    def __str__(self) -> str:
        hit = "would hit the cache" if self.cache_hit else "would trace"
        if self.cache_hit is None:
            hit = "jax.jit's cache decides whether it traces"
        cells = [("argument", "role", "value"), *(row[:3] for row in self.rows)]
        notes: list[str] = []
        if misses := self.misses:
            assert self.nearest is not None
            number, changes = self.nearest.number, self.nearest.changes
            listed = ", ".join(f"`{path}`" for path in misses)
            verb = "differs" if len(misses) == 1 else "differ"
            hit += f": {listed} {verb} from the nearest cached trace (trace {number})"
            cached = {path: before for path, before, _ in changes}
            # A marked column: the nearest trace's value where this call's differs.
            cells = [(*cells[0], f"in trace {number}")]
            for current in self.rows:
                mark = ""
                if current.path in cached:
                    before = cached.pop(current.path)
                    mark = f"<- {'<absent>' if before is None else before.value}"
                cells.append((*current[:3], mark))
            for path, before in cached.items():  # in that trace, not in this call
                assert before is not None
                cells.append((path, "", "<absent>", f"<- {before.value}"))
            notes = [f"  {describe_change(change)}" for change in changes]
        elif self.cache_hit is False and self.nearest is not None:
            hit += ": no trace of it is cached"
        widths = [max(map(len, column)) for column in zip(*cells)]
        lines = ["  ".join(map(str.ljust, line, widths)).rstrip() for line in cells]
        lines.insert(1, "  ".join("-" * w for w in widths))
        title = f"{self.decorator}({self.name}), called {self.level}: {hit}"
        return "\n".join([title, *lines, *(["why:", *notes] if notes else [])])

    __repr__ = __str__
