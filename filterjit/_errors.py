"""Errors in the user's terms. Runtime checks (`eqx.error_if`,
`eqx.branched_error_if`): a failed check raises `equinox.EquinoxRuntimeError` at the
call, worded as inside `equinox.filter_jit`; only calls whose trace holds a check
block until their result is ready. The only module that reads Equinox's private
state (the latest failed check's message and frames), with a fallback to JAX's
error. Also: a failed cache lookup, an untraceable NumPy array, traced scalars Python
needed, a recursion, each naming the argument and the fix."""

import contextlib
import dataclasses
import logging
import re
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax.extend.core
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer
from jax.errors import (
    ConcretizationTypeError,
    JaxRuntimeError,
    TracerArrayConversionError,
    TracerBoolConversionError,
    TracerIntegerConversionError,
)
from jax.extend.core import Var
from jax.extend.core.primitives import while_p

from . import _trace, _tracebacks
from ._donated import check_not_deleted
from ._function import Function
from ._leaves import compares_elementwise, is_array, NUMPY_TYPES
from ._level import EAGER, Level, TOP
from ._partition import Partition
from ._structure import PyTreeDef


# Equinox's callback raises an exception of this name; JAX's error quotes it.
_MARKER = "_EquinoxRuntimeError: "


def traced_a_check() -> bool:
    """Whether the trace under way traced a runtime check, a `pure_callback` into
    Equinox, at any depth (`True` where that cannot be known: no error is lost)."""
    if (eqns := _trace.current_equations()) is None:
        return True
    return any(_is_check(inner) for eqn in eqns for inner in _within(eqn))


def _within(eqn: Any) -> Iterator[Any]:
    """`eqn`, and the equations of the jaxprs in its parameters at any depth."""
    stack = [eqn]
    while stack:
        eqn = stack.pop()
        yield eqn
        values = list(eqn.params.values())  # jaxprs, in tuples and lists too
        while values:
            value = values.pop()
            if isinstance(value, tuple | list):
                values.extend(value)
            elif isinstance(value, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                stack.extend(value.eqns)


def _is_check(eqn: Any) -> bool:
    """Whether `eqn` is a runtime check's `pure_callback` into Equinox."""
    if eqn.primitive.name != "pure_callback":
        return False
    callback = eqn.params.get("callback")
    function = getattr(callback, "callback_func", callback)
    return getattr(function, "__module__", "").startswith("equinox")


def _is_fori_loop(eqn: Any, made_at: tuple[str, int | None]) -> bool:
    """Whether `eqn` is the `while_loop` a `lax.fori_loop` with traced bounds binds,
    made at `made_at` (a file and line of the stack JAX recorded where it was bound)."""
    if eqn.primitive is not while_p:
        return False
    frames = _tracebacks.source_frames(eqn)
    lines = {(frame.file, frame.line) for frame in frames}
    return made_at in lines and any(f.function == "fori_loop" for f in frames)


# One item per checked call under way (in any thread): `append`, `pop` are atomic.
_checked_calls: list[None] = []


def _quiet(record: logging.LogRecord) -> bool:
    """Quiets JAX's log of a failed callback while a checked call is under way."""
    return not (
        _checked_calls
        and record.name == _tracebacks.CALLBACK_LOGGER
        and record.getMessage() == "jax.pure_callback failed"
    )


logging.getLogger(_tracebacks.CALLBACK_LOGGER).addFilter(_quiet)


def _message(error: Exception, name: str) -> str:
    """The failed check's message, as `equinox.filter_jit` words it if it can."""
    _jit = getattr(eqx, "_jit", None)
    info: Any = getattr(_jit, "last_error_info", None)
    template = getattr(_jit, "_on_error_msg", None)
    readable = isinstance(info, tuple) and len(info) == 2 and isinstance(info[0], str)
    if readable and isinstance(template, str):
        message, stack = info
        # Innermost frame last: Equinox records them outwards, non-str markers between.
        frames = "".join(reversed([piece for piece in stack if type(piece) is str]))
        with contextlib.suppress(KeyError, IndexError, ValueError):
            return template.format(msg=message, stack=frames)
    # Fallback: the check's message follows the marker in JAX's error.
    message = str(error).partition(_MARKER)[2].split("\n\n\n")[0].strip()
    return (
        f"{message}\n\n(A runtime check failed inside the filter_jit-compiled "
        f"function `{name}`. Setting EQX_ON_ERROR=breakpoint opens a debugger where "
        "the check failed; JAX_DISABLE_JIT=1 runs the program as plain Python.)"
    )


def check_failed(error: Exception, name: str) -> None:
    """Raises `error`, if a failed runtime check, as `equinox.EquinoxRuntimeError`."""
    if isinstance(error, JaxRuntimeError | ValueError) and _MARKER in str(error):
        raise eqx.EquinoxRuntimeError(_message(error, name)) from None


def call_checked(
    jitted: Callable[..., Any],
    dynamic: Sequence[Any],
    name: str,
    ready: Callable[[Any], Any] | None = None,
    labels: Sequence[str] = (),
) -> Any:
    """`jitted(*dynamic)`, with a failed runtime check raised as
    `equinox.EquinoxRuntimeError`; `ready(out)`: the arrays to wait for, so that a
    check that fails while it runs is raised here too; `labels`: the traced
    arguments' names, for errors in the user's terms (see `explain_failure`)."""
    # Not a context manager: one costs microseconds, on every checked call.
    _checked_calls.append(None)
    try:
        out = jitted(*dynamic)
        if ready is not None and (arrays := ready(out)):
            _trace.block_leaves(arrays)
        return out
    except Exception as e:
        check_failed(e, name)
        explain_failure(e, name, labels, dynamic)
        raise
    finally:
        _checked_calls.pop()


# JAX's errors for Python needing a traced value; and the words of those it raises
# as plain TypeError, IndexError or ValueError (a shape, a slice, an index).
_CONCRETIZATION_ERRORS = (
    ConcretizationTypeError,
    TracerArrayConversionError,
    TracerBoolConversionError,
    TracerIntegerConversionError,
)
_NEEDS_CONCRETE = re.compile(
    r"concrete|must be static|static integers|(integers?|hashable)\W.*Tracer\("
)
# JAX's advice that `filter_jit` has no use for: it takes no `static_argnums`.
_STATIC_ARGNUMS_ADVICE = re.compile(r"^.*static_argnums.*$\n?", re.MULTILINE)


class _Scalar(NamedTuple):
    """A traced leaf that is a NumPy or JAX integer or bool scalar."""

    position: int  # among the traced leaves
    label: str
    kind: str  # "NumPy" or "JAX"
    dtype: np.dtype[Any]


def integer_scalars(
    labels: Sequence[str], types: Sequence[type], values: Sequence[Any]
) -> list[_Scalar]:
    """The traced leaves of a top-level or eager call (of the types `types` in the
    call; `values`, they or a trace's tracers of them) that are NumPy or JAX integer
    or bool scalars: a Python int or bool in their place stays static. Not an outer
    transform's tracers (unknown outside too), nor PRNG keys (no NumPy dtype)."""
    return [
        _Scalar(i, label, "NumPy" if issubclass(kind, NUMPY_TYPES) else "JAX", dtype)
        for i, (label, kind, value) in enumerate(zip(labels, types, values))
        if is_array(value)
        and not issubclass(kind, Tracer)
        and value.shape == ()
        and isinstance(dtype := value.dtype, np.dtype)
        and dtype.kind in "biu"
    ]


# Where filter_jit traces NumPy and JAX scalars, by the level of the call.
_WHERE = {
    TOP: "was called at the top level, where filter_jit traces NumPy and JAX scalars "
    "as it traces arrays",
    EAGER: "was called under eager transforms (`jax.grad`, `jax.vmap` or another, "
    "with no `jax.jit` around the call), where filter_jit traces NumPy and JAX "
    "scalars as it traces arrays, as at the top level",
}
# Where the level is unknown: every place it does.
_WHERE_ANY = (
    "traces NumPy and JAX scalars as it traces arrays wherever no `jax.jit` encloses "
    "the call: at the top level, and under `jax.grad`, `jax.vmap` or another "
    "transform applied outside one"
)


def _traced_where(name: str, level: Level | None) -> str:
    """Why a call of `name` at `level` (`None`: unknown) traced its NumPy and JAX
    scalars: the notes' common first part."""
    where = _WHERE_ANY
    if level is not None and _trace.private_api_available:
        where = _WHERE.get(level, _WHERE_ANY)
    return f"`{name}` {where}"


def _scalar_fixes(label: str, python_type: str) -> str:
    """The two fixes for a traced scalar, `label`, whose value Python needed: the
    notes' common last part."""
    return (
        f"Pass a Python {python_type} instead (`{python_type}({label})`): every "
        "Python scalar is static (filter_jit has no `static_argnums`), and each new "
        "value traces anew. Or make the call inside a `jax.jit` (a training step's, "
        f"say) that holds `{label}` as a constant (closed over, not one of its "
        "arguments): inside it, filter_jit passes NumPy and concrete JAX values on "
        "as they are."
    )


def name_failure(
    name: str,
    labels: list[str],
    dynamic_positions: Sequence[int],
    leaves: list[Any],
    error: Exception,
) -> None:
    """Raises what a call of `name` raised, with leaves `leaves` labelled `labels`,
    in the user's terms where it can: a leaf JAX cannot trace named, a runtime check
    that failed in a trace made by the call; else notes what explains it
    (`explain_failure`) and returns, for the caller to raise it as it was."""
    if isinstance(error, TypeError):
        check_traceable(name, labels, leaves, dynamic_positions)
    check_failed(error, name)
    dynamic_labels = [labels[p] for p in dynamic_positions]
    explain_failure(error, name, dynamic_labels, [leaves[p] for p in dynamic_positions])


def explain_failure(
    error: Exception, name: str, labels: Sequence[str], dynamic: Sequence[Any]
) -> None:
    """Puts the error of a top-level or eager call of `name` in the user's terms: a
    donated array (`check_not_deleted`); where Python needed a traced value, a note
    of which traced arguments were NumPy or JAX integer or bool scalars, where the
    call traced them and the fixes, JAX's `static_argnums` advice taken out."""
    check_not_deleted(error, name, labels, dynamic)
    is_plain = isinstance(error, TypeError | IndexError | ValueError)
    if not isinstance(error, _CONCRETIZATION_ERRORS) and not (
        is_plain and _NEEDS_CONCRETE.search(str(error))
    ):
        return
    scalars = integer_scalars(labels, list(map(type, dynamic)), dynamic)
    # JAX names the argument the failing value depends on (its parameter name in
    # the jitted function: the label made an identifier).
    named = re.findall(r"depends on the value of the argument (\w+)", str(error))
    if named:
        scalars = [s for s in scalars if identifier(s.label) in named] or scalars
    if not scalars:
        return
    message = error.args[0] if error.args else None
    if isinstance(message, str) and _STATIC_ARGNUMS_ADVICE.search(message):
        error.args = (_STATIC_ARGNUMS_ADVICE.sub("", message), *error.args[1:])
    listed = "; ".join(f"`{s.label}`, a {s.kind} {s.dtype}" for s in scalars)
    first = scalars[0]
    python_type = "bool" if first.dtype.kind == "b" else "int"
    error.add_note(
        f"filter_jit: {_traced_where(name, _trace.trace_level())} (here {listed}). "
        "Python cannot use the value of a traced scalar (as a shape, in `range(n)`, "
        f"`int(n)`, `if n` or an index). {_scalar_fixes(first.label, python_type)} "
        "For a loop over a traced count, use `jax.lax.fori_loop` (reverse mode "
        "needs its bounds static)."
    )


_LOOP_ERROR = "Reverse-mode differentiation does not work for lax.while_loop"


def note_loop_in_trace(error: Exception, name: str, scalars: Sequence[_Scalar]) -> None:
    """Notes on JAX's error for a `while_loop` that reverse mode cannot go through,
    raised inside a top-level or eager trace of `name` (`jax.grad` inside the
    function), where it is a `lax.fori_loop` whose bounds depend on the traced
    integer `scalars`: which ones, and the fix. (Reverse mode around the call
    transposes the loop after it returned, unseen: that error stays JAX's.)"""
    if not scalars or not str(error).startswith(_LOOP_ERROR):
        return
    eqns = _trace.current_equations()
    inputs = _trace.current_inputs()
    # Where JAX says the failing loop was made (the stack it attaches as the cause).
    stack = traceback.extract_tb(getattr(error.__cause__, "__traceback__", None))
    if eqns is None or inputs is None or not stack:
        return  # unknown: no note
    made_at = (stack[-1].filename, stack[-1].lineno)
    # By variable, the positions of the trace's inputs it depends on.
    depends = {v: frozenset({i}) for i, v in enumerate(inputs)}
    on: set[int] = set()
    for eqn in eqns:
        eqn_on = frozenset().union(
            *(depends.get(v, ()) for v in eqn.invars if isinstance(v, Var))
        )
        for out in eqn.outvars:
            depends[out] = eqn_on
        if any(_is_fori_loop(e, made_at) for e in _within(eqn)):
            on |= eqn_on
    named = [s for s in scalars if s.position in on]
    if not named:
        return
    listed = "; ".join(f"`{s.label}`, a scalar of dtype {s.dtype}" for s in named)
    error.add_note(
        f"filter_jit: the `lax.fori_loop` here has bounds that `{name}` traced: "
        f"{_traced_where(name, None)} (here {listed}). A `fori_loop` whose start or "
        "stop is traced is a `lax.while_loop`, which reverse-mode differentiation "
        "cannot go through (with static bounds it is a `lax.scan`). "
        f"{_scalar_fixes(named[0].label, 'int')}"
    )


def identifier(label: str) -> str:
    """An argument's label as the jitted function's parameter, for JAX's messages
    (`params['w']` -> `params_w`)."""
    name = re.sub(r"\W+", "_", label, flags=re.ASCII).strip("_") or "arg"
    return f"_{name}" if name[0].isdigit() else name


_RECURSION_NOTE = "filter_jit: the recursion"  # begins the note, which is added once


def note_recursion(error: RecursionError, name: str) -> None:
    """Notes on a RecursionError through `name` how such a recursion ends."""
    if any(n.startswith(_RECURSION_NOTE) for n in getattr(error, "__notes__", ())):
        return
    error.add_note(
        f"{_RECURSION_NOTE} went through the filter_jit-compiled function `{name}`. "
        "A call of it inside a trace runs its Python again, as the undecorated "
        "function would, so a recursion through it ends only on a static condition "
        "(a Python int argument that reaches a base case, say). For a loop over a "
        "traced value, use `jax.lax.while_loop` or `jax.lax.fori_loop`."
    )


def wait_checked(arrays: list[Any], name: str) -> None:
    """Waits for `arrays`, a failed check raised as `equinox.EquinoxRuntimeError`."""
    call_checked(lambda: arrays, (), name, lambda _: arrays)


def find_static_array_field(value: Any, label: str) -> str | None:
    """The path to the first static field of an `eqx.Module` inside `value` that
    holds an array (the structure cannot compare: `==` gives arrays), or `None`."""
    is_module = lambda x: isinstance(x, eqx.Module)  # noqa: E731
    for path, module in jtu.tree_flatten_with_path(value, is_leaf=is_module)[0]:
        for field in dataclasses.fields(module) if is_module(module) else ():
            child = getattr(module, field.name, None)
            child_label = f"{label}{jtu.keystr(path)}.{field.name}"
            if field.metadata.get("static", False):
                leaves = jtu.tree_leaves(child)
                if any(map(compares_elementwise, leaves)):
                    return child_label
            elif found := find_static_array_field(child, child_label):
                return found
    return None


def _hash_and_eq_fail(key: Any) -> bool:
    try:
        hash(key)
        return not isinstance(key == key, bool)
    except Exception:
        return True


def key_error(
    function: Function,
    fun: Any,
    leaves: list[Any],
    treedef: PyTreeDef,
    partition: Partition | None,
    error: Exception,
) -> TypeError:
    """The error for a failed cache lookup: whose hash or `==` failed, what to do."""
    name = function.name
    if partition is None:
        # No leaf failed, but a node's auxiliary data (a static field, say).
        _, args, kwargs = function.split_call(fun, jtu.tree_unflatten(treedef, leaves))
        for where, value in [(None, fun), *enumerate(args), *kwargs.items()]:
            label = name if where is None else function.label(where)
            if (field := find_static_array_field(value, label)) is not None:
                return TypeError(
                    f"{name}(): `{field}` is a static field (`eqx.field(static=True)`) "
                    "holding an array. Static fields are compared with `==` to find "
                    "cached traces, and arrays cannot be. Make it a regular field so "
                    "that it is traced, or hold a hashable value (a tuple, say)."
                )
            if _hash_and_eq_fail(jtu.tree_structure(value)):
                return TypeError(
                    f"{name}(): the pytree structure of argument `{label}` cannot be "
                    f"hashed or compared ({error}). A static field "
                    "(`eqx.field(static=True)`) or other pytree auxiliary data holds "
                    "such a value. Make it hashable (a tuple rather than a list, "
                    "say), or make it a regular field so that it is traced."
                )
    else:
        for position, key in zip(partition.static_positions, partition.statics(leaves)):
            if _hash_and_eq_fail(key):
                label = function.leaf_parameters(treedef)[position].label
                kind = type(leaves[position]).__qualname__
                return TypeError(
                    f"{name}(): argument `{label}` is a static value of type `{kind}` "
                    f"that cannot be hashed or compared ({type(error).__name__}: "
                    f"{error}). filter_jit keys its cache on every non-array leaf, so "
                    "static values must be hashable and `==` must return a bool. Pass "
                    "such a value instead (a tuple rather than a list, say), or make "
                    "it an array (`jnp.asarray(...)`) so that it is traced."
                )
    return TypeError(
        f"{name}(): looking up the cache for this call failed "
        f"({type(error).__name__}: {error})."
    )


def check_traceable(
    name: str, labels: list[str], leaves: list[Any], positions: Iterable[int]
) -> None:
    """Raises, naming the argument, for a NumPy array to trace that JAX cannot."""
    for position in positions:
        leaf = leaves[position]
        # Objects, strings, dates, np.void (not ml_dtypes' kind "V": JAX traces it).
        if isinstance(leaf, NUMPY_TYPES) and (
            leaf.dtype.kind in "OSUMm" or leaf.dtype.type is np.void
        ):
            raise TypeError(
                f"{name}(): argument `{labels[position]}` is a NumPy array of dtype "
                f"{leaf.dtype}, which cannot be traced, and filter_jit traces every "
                "NumPy array. Pass its values as a tuple of Python values (static: "
                "each new value traces anew), or encode them as numbers (an array "
                "of indices, say) so that they are traced."
            )
