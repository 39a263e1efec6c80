"""Where in JAX's trace stack a call happens (the level reader, on every call's path)
and what the innermost staged trace holds so far; the partial a `jtu.Partial`
boxes; waiting for arrays. JAX's private objects come from `_private_jax`, each
with a public fallback here."""

import functools
import inspect
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend.core

from . import _private_jax as jax_private
from ._level import EAGER, Level, STAGED, TOP


class LevelReader(NamedTuple):
    """How a wrapper finds the level of a call in a step or two: `jit_disabled()`,
    whether inside `jax.disable_jit()`; `current()`, the innermost trace, whose
    type is `top_type` outside any trace and may be `staged_type` inside a staged
    one; `level_of(trace)` for any other."""

    jit_disabled: Callable[[], bool]
    current: Callable[[], object]
    top_type: type
    staged_type: type  # of `current()` in a staged trace (not the only one)
    level_of: Callable[[object], Level]


def _trace_level_public() -> Level:
    # Public, unstable, TOP under eager transforms; where missing, TOP (as Equinox).
    am_i_under_a_jit = getattr(
        jax.extend.core, "unsafe_am_i_under_a_jit_DO_NOT_USE", lambda: False
    )
    return STAGED if am_i_under_a_jit() else TOP


class _Outside:
    """The public reader's trace outside any staged trace."""


_OUTSIDE, _INSIDE = _Outside(), object()


def _unknown() -> Any:
    return None  # JAX's trace unknown: the caller assumes the worst


PUBLIC_READER = LevelReader(
    lambda: bool(jax.config.jax_disable_jit),  # pyright: ignore[reportAttributeAccessIssue]
    lambda: _INSIDE if _trace_level_public() == STAGED else _OUTSIDE,
    _Outside,
    object,
    lambda _: STAGED,
)


class _TraceAttribute:
    """jax 0.9's `trace_ctx.trace`, an attribute, as the state jax 0.10 has."""

    __slots__ = ()

    @property
    def value(self) -> object:
        return jax_private.trace_ctx.trace


def _getter(state: object) -> Any:
    # `state.value`'s getter, where `value` is a property: called directly, it
    # skips the property's own call (about 20 ns a read, two reads a call).
    found = inspect.getattr_static(type(state), "value", None)
    fget = found.fget if isinstance(found, property) else None
    return fget or operator.attrgetter("value")


def _walk(trace: object) -> Level:
    # Up the `parent_trace` chain, which ends at an `EvalTrace`.
    level = TOP
    while trace is not None:
        if isinstance(trace, jax_private.DynamicJaxprTrace):
            return STAGED
        if not isinstance(trace, jax_private.EvalTrace):
            level = EAGER
        trace = getattr(trace, "parent_trace", None)
    return level


def _trace_level_private() -> Level:
    return _walk(_current_trace.value)


def _current_equations_private() -> list[Any] | None:
    # What the innermost staged trace holds so far.
    frame = getattr(_current_trace.value, "frame", None)
    get_eqns = getattr(frame, "get_eqns", None)
    return None if get_eqns is None else list(get_eqns())


def _current_inputs_private() -> list[Any] | None:
    # The innermost staged trace's input variables, in the traced function's
    # order of arguments.
    invars = getattr(getattr(_current_trace.value, "frame", None), "invars", None)
    return None if invars is None else list(invars)


private_api_available = jax_private.EvalTrace is not None
if private_api_available:
    _current_trace = jax_private.trace_state_strong_ref or _TraceAttribute()
    _disable_jit_value = _getter(jax_private.disable_jit_state)
    _current_trace_value = _getter(_current_trace)
    trace_level = _trace_level_private
    current_equations = _current_equations_private
    current_inputs = _current_inputs_private
    # Each read a C call: the state's getter, bound to it.
    level_reader = LevelReader(
        functools.partial(_disable_jit_value, jax_private.disable_jit_state),
        functools.partial(_current_trace_value, _current_trace),
        jax_private.EvalTrace,
        jax_private.DynamicJaxprTrace,
        _walk,
    )
    # `current_trace()`: the innermost trace (transform or staging) a call is in.
    current_trace = level_reader.current
else:  # pragma: no cover - the tests simulate this by monkeypatching
    trace_level = _trace_level_public
    current_trace = current_equations = current_inputs = _unknown
    level_reader = PUBLIC_READER


def _block_leaves_public(arrays: list[jax.Array]) -> None:
    jax.block_until_ready(arrays)


# `block_leaves(arrays)`: waits for a list of `jax.Array`s, raising what one raised;
# JAX's batched wait, without `jax.block_until_ready`'s flatten and loop (3 µs of 6
# for eight arrays). Not tried here: importing filterjit must not start JAX's
# backends; tests/test_private_jax_api.py tries it.
block_leaves: Callable[[list[jax.Array]], object] = (
    jax_private.batched_block_until_ready
    if callable(jax_private.batched_block_until_ready)
    else _block_leaves_public
)


def _boxed_partial_public(func: object) -> Any:
    return None  # JAX's box unknown: a `jtu.Partial` of a partial is held as it is


def _boxed_partial_private(func: object) -> Any:
    if type(func) is not jax_private.PartialBox:
        return None
    boxed: Any = func  # the partial's `func`, `args` and `keywords`, copied
    return functools.partial(boxed.func, *boxed.args, **boxed.keywords)


# `boxed_partial(func)`: the `functools.partial` a `jtu.Partial`'s `func` boxes
# (`jtu.Partial(partial)` boxes the partial, so that its arguments are not merged,
# copying its `func`, `args` and `keywords` onto the box), else `None`.
boxed_partial = (
    _boxed_partial_public if jax_private.PartialBox is None else _boxed_partial_private
)
