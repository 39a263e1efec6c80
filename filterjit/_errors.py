"""Runtime checks (`eqx.error_if`, `eqx.branched_error_if`): a failed check raises
`equinox.EquinoxRuntimeError` at the call, worded as inside `equinox.filter_jit`;
only calls whose trace holds a check block until their result is ready. The only
module that reads Equinox's private state (the latest failed check's message and
frames, its error's wording), with a fallback to JAX's error."""

import contextlib
import inspect
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax.extend.core
from jax.core import Tracer
from jax.errors import (
    ConcretizationTypeError,
    JaxRuntimeError,
    TracerArrayConversionError,
    TracerBoolConversionError,
    TracerIntegerConversionError,
)

from . import _trace
from ._donated import check_not_deleted
from ._leaves import is_array, NUMPY_TYPES


# Equinox's callback raises an exception of this name; JAX's error quotes it.
_MARKER = "_EquinoxRuntimeError: "


def traced_a_check() -> bool:
    """Called at the end of a function's trace: whether it traced a runtime check, a
    `pure_callback` into Equinox, at any depth (`True` where that cannot be known,
    so that errors are never lost)."""
    if (stack := _trace.current_equations()) is None:  # its own list, emptied here
        return True
    while stack:
        eqn = stack.pop()
        if eqn.primitive.name == "pure_callback":
            callback = eqn.params.get("callback")
            function = getattr(callback, "callback_func", callback)
            if getattr(function, "__module__", "").startswith("equinox"):
                return True
        values = list(eqn.params.values())  # jaxprs, in tuples and lists at any depth
        while values:
            value = values.pop()
            if isinstance(value, tuple | list):
                values.extend(value)
            elif isinstance(value, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                stack.extend(value.eqns)
    return False


# One item per checked call under way (in any thread): `append`, `pop` are atomic.
_checked_calls: list[None] = []


def _quiet(record: logging.LogRecord) -> bool:
    """Quiets JAX's log of a failed callback while a checked call is under way: the
    error raised at the call says all of it."""
    return not (
        _checked_calls
        and record.name == "jax._src.callback"
        and record.getMessage() == "jax.pure_callback failed"
    )


logging.getLogger("jax._src.callback").addFilter(_quiet)


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
    labels: Sequence[str] | None = None,
) -> Any:
    """`jitted(*dynamic)`, with a failed runtime check raised as
    `equinox.EquinoxRuntimeError`. `ready(out)`: the arrays of the output to wait
    for before returning (empty or `None` for none), so that a check that fails
    while it runs is raised here too. `labels`: the traced arguments' names, for
    errors in the user's terms (see `explain_failure`)."""
    # Not a context manager: one costs microseconds, on every checked call.
    _checked_calls.append(None)
    try:
        out = jitted(*dynamic)
        if ready is not None and (arrays := ready(out)):
            _trace.block_leaves(arrays)
        return out
    except Exception as e:
        check_failed(e, name)
        explain_failure(e, name, _labels(jitted, dynamic, labels), dynamic)
        raise
    finally:
        _checked_calls.pop()


def _labels(
    jitted: Callable[..., Any], dynamic: Sequence[Any], labels: Sequence[str] | None
) -> Sequence[str]:
    """The traced arguments' names: `labels`, else `jitted`'s parameters'."""
    if labels is not None and len(labels) == len(dynamic):
        return labels
    try:
        return list(inspect.signature(jitted).parameters)
    except (TypeError, ValueError):
        return [f"<traced leaf {i}>" for i in range(len(dynamic))]


def explain_failure(
    error: Exception, name: str, labels: Sequence[str], dynamic: Sequence[Any]
) -> None:
    """Puts the error of a top-level call of `name` (traced leaves `dynamic`, named
    `labels`) in the user's terms: an array donated before raises an error that
    names it and the call that donated it; an error that a traced NumPy or JAX
    scalar caused gets a note saying to pass a Python scalar."""
    check_not_deleted(error, name, labels, dynamic)
    if _needs_a_concrete_value(error):
        _note_traced_scalars(error, name, labels, dynamic)


# JAX's errors for Python needing a traced value; and the words of those it raises
# as plain TypeError, IndexError or ValueError (a shape, a slice, an index).
_CONCRETIZATION_ERRORS = (
    ConcretizationTypeError,
    TracerArrayConversionError,
    TracerBoolConversionError,
    TracerIntegerConversionError,
)
_NEEDS_CONCRETE = re.compile(r"concrete|must be static|static integers")
# JAX's advice that `filter_jit` has no use for: it takes no `static_argnums`.
_STATIC_ARGNUMS_ADVICE = re.compile(r"^.*static_argnums.*$\n?", re.MULTILINE)


def _needs_a_concrete_value(error: Exception) -> bool:
    if isinstance(error, _CONCRETIZATION_ERRORS):
        return True
    is_plain = isinstance(error, TypeError | IndexError | ValueError)
    return is_plain and bool(_NEEDS_CONCRETE.search(str(error)))


def _note_traced_scalars(
    error: Exception, name: str, labels: Sequence[str], dynamic: Sequence[Any]
) -> None:
    """Adds to `error` (Python needed the value of a traced one: a shape, `range(n)`,
    `if n`, an index) which traced arguments were NumPy or JAX integer or bool
    scalars, which a Python int or bool in their place keeps static; and takes out
    JAX's advice to use `static_argnums`."""
    scalars = [
        (label, "NumPy" if isinstance(leaf, NUMPY_TYPES) else "JAX", leaf)
        for label, leaf in zip(labels, dynamic)
        if is_array(leaf)
        and not isinstance(leaf, Tracer)
        and leaf.shape == ()
        and leaf.dtype.kind in "biu"
    ]
    # JAX names the argument the failing value depends on (its parameter name in
    # the jitted function: the label made an identifier).
    named = re.findall(r"depends on the value of the argument (\w+)", str(error))
    if named:
        scalars = [s for s in scalars if _identifier(s[0]) in named] or scalars
    if not scalars:
        return
    message = error.args[0] if error.args else None
    if isinstance(message, str) and _STATIC_ARGNUMS_ADVICE.search(message):
        error.args = (_STATIC_ARGNUMS_ADVICE.sub("", message), *error.args[1:])
    listed = "; ".join(f"`{label}`, a {kind} {x.dtype}" for label, kind, x in scalars)
    first = scalars[0][0]
    python = "bool" if scalars[0][2].dtype.kind == "b" else "int"
    error.add_note(
        f"filter_jit: `{name}` traces NumPy and JAX scalars as it traces arrays "
        f"(here {listed}), and Python cannot use the value of a traced scalar (as a "
        f"shape, in `range(n)`, `if n` or an index). Pass a Python int or bool "
        f"instead (`{python}({first})`): it is static, and each new value traces "
        "anew (filter_jit has no `static_argnums`: every Python scalar is static). "
        "For a loop over a traced count, use `jax.lax.fori_loop`."
    )


def _identifier(label: str) -> str:
    """`label` as the jitted function's parameter (see `_entry._signature`)."""
    return re.sub(r"\W+", "_", label, flags=re.ASCII).strip("_")


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
