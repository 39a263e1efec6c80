"""Arrays that a call donated: a weak record of each (made only by calls that
donate, read only when JAX refused a deleted buffer), so that passing one again
raises an error naming the parameter and the call that donated it."""

import itertools
import os
import sys
import types
import weakref
from collections.abc import Sequence
from typing import Any

import jax


# The donated arrays, by `id`: a weak reference to each (checked on reading: an id
# may be reused), the parameter, and the call's (function, where). Nothing in it
# keeps an array alive; the oldest records go past `_MAX_RECORDS`.
_records: dict[int, tuple[Any, str, tuple[str, str]]] = {}
_MAX_RECORDS = 1 << 16
_ref = weakref.ref


# Frames that are not the user's: filterjit's, JAX's, and the wrappers that runtime
# type checkers (jaxtyping's import hook, beartype) put around functions.
_INTERNAL = (*map(os.path.dirname, (__file__, jax.__file__)), "<@")
_CHECKERS = ("jaxtyping", "beartype")


def user_frame(frame: types.FrameType) -> tuple[types.FrameType, int]:
    """The first frame from `frame` outwards that is the user's, and the
    `stacklevel` that points a warning raised in `frame` at it."""
    level = 1
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(_INTERNAL)
        or str(frame.f_globals.get("__name__", "")).startswith(_CHECKERS)
    ):
        frame, level = frame.f_back, level + 1
    return frame, level


def record(arrays: Sequence[Any], function: str, labels: Sequence[str]) -> None:
    """Notes that a call of `function` donated `arrays`, passed as `labels`."""
    frame, _ = user_frame(sys._getframe())
    call = (function, f"{frame.f_code.co_filename}:{frame.f_lineno}")
    records = _records
    for array, label in zip(arrays, labels):
        records[id(array)] = (_ref(array), label, call)
    if len(records) > _MAX_RECORDS + 1024:  # the oldest, a batch at a time
        for key in list(itertools.islice(records, len(records) - _MAX_RECORDS)):
            del records[key]


def check_not_deleted(
    error: BaseException, name: str, labels: Sequence[str], dynamic: Sequence[Any]
) -> None:
    """Raises, naming the argument, where `error` is JAX refusing a buffer and one
    of the traced leaves `dynamic` is deleted (JAX's words differ by backend)."""
    if not isinstance(error, ValueError | RuntimeError):
        return
    for label, leaf in zip(labels, dynamic):
        try:
            if not (isinstance(leaf, jax.Array) and leaf.is_deleted()):
                continue
        except Exception:  # a tracer, or an array that cannot say
            continue
        found = _records.get(id(leaf))
        if found is None or found[0]() is not leaf:  # not donated by filter_jit
            cause = (
                "was deleted or donated (`.delete()`, or a `jax.jit` with "
                "`donate_argnums`, say)"
            )
        else:
            _, parameter, (function, where) = found
            cause = (
                f"was donated by an earlier call of `{function}` at {where}, "
                f"through its parameter `{parameter}`"
            )
        raise ValueError(
            f"{name}(): argument `{label}` is an array that {cause}: its buffer now "
            "belongs to that call's output and it cannot be used again. Pass the "
            "array that call returned in its place, or keep the argument from being "
            "donated (filter_jit's `donate=`)."
        ) from None
