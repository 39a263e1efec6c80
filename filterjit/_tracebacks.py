"""Which frames an error shows: filterjit's taken out of a traceback as JAX takes out
its own (`hide_frames`, `hiding_frames`), and the user's frames JAX recorded where
an equation was bound (`source_frames`)."""

import functools
import os
from collections.abc import Callable
from typing import NamedTuple, ParamSpec, TypeVar

import jax.extend.source_info_util

from . import _private_jax as jax_private


_P = ParamSpec("_P")
_R = TypeVar("_R")

# JAX attributes operations and cache misses to the user's frame, not filterjit's.
package_dir = os.path.dirname(os.path.abspath(__file__))
jax.extend.source_info_util.register_exclusion(package_dir)

# The logger of JAX's module that logs a failed host callback (named after the
# module, which is private: a rename leaves the log unfiltered, nothing else).
CALLBACK_LOGGER = "jax._src.callback"


def hide_frames_public(error: BaseException) -> None:
    pass  # JAX's filtering unknown: the traceback is left whole


def hide_frames_private(error: BaseException) -> None:
    # What `jax._src.traceback_util.api_boundary` does to an exception leaving
    # `jax.jit`'s wrapper, done where it leaves filterjit's (whose frames sit
    # above JAX's boundary, out of its reach): filterjit's and JAX's frames
    # removed, or marked `__tracebackhide__`, as JAX_TRACEBACK_FILTERING says.
    tb = jax_private
    mode = tb.filtering_mode()
    traceback = error.__traceback__
    if mode == "off" or traceback is None or tb.is_under_reraiser(error):
        return  # shown whole, or filtered by an enclosing JAX boundary
    if mode == "tracebackhide":
        tb.mark_hidden_frames(traceback)
        return
    if mode not in ("quiet_remove_frames", "remove_frames"):
        return  # JAX raises for an unknown mode itself
    error.with_traceback(tb.filter_traceback(traceback))
    if mode == "quiet_remove_frames":
        if _FILTERED_NOTE not in getattr(error, "__notes__", ()):
            error.add_note(_FILTERED_NOTE)
    elif not isinstance(error.__cause__, tb.UnfilteredStackTrace):
        # `jax.jit`'s boundary made none (the error is filterjit's own): one
        # with the whole stack, as JAX makes it.
        unfiltered = tb.UnfilteredStackTrace(tb.format_exception_only(error))
        unfiltered.with_traceback(tb.with_call_stack(traceback))
        unfiltered.__cause__ = error.__cause__
        unfiltered.__context__ = error.__context__
        unfiltered.__suppress_context__ = error.__suppress_context__
        error.__cause__ = unfiltered
        error.__context__ = None


_FILTERED_NOTE = f"--------------------\n{jax_private.FILTERED_NOTE_TEXT}"
traceback_filtering_available = jax_private.register_exclusion is not None
if jax_private.register_exclusion is not None:
    # Below `jax.jit`'s boundary, JAX hides filterjit's frames as it hides its own.
    jax_private.register_exclusion(package_dir)

# `hide_frames(error)`: filterjit's frames (generated code included: it is filed
# under the package's directory) taken out of `error`'s traceback, as JAX's own.
hide_frames = (
    hide_frames_private if traceback_filtering_available else hide_frames_public
)


def hiding_frames(fun: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fun`, whose errors are raised without filterjit's frames (`hide_frames`):
    for public functions other than the wrappers' calls, which do it inline."""

    @functools.wraps(fun)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        __tracebackhide__ = True  # noqa: F841 - pytest hides this frame
        try:
            return fun(*args, **kwargs)
        except Exception as error:
            hide_frames(error)
            raise

    return call


class SourceFrame(NamedTuple):
    """A frame of the stack JAX recorded where an equation was bound."""

    file: str
    line: int
    function: str


def source_frames(eqn: object) -> list[SourceFrame]:
    """The frames of the stack JAX recorded where `eqn` was bound, innermost first
    (none where it recorded none)."""
    traceback = getattr(getattr(eqn, "source_info", None), "traceback", None)
    frames = getattr(traceback, "frames", None) or ()
    return [SourceFrame(f.file_name, f.line_num, f.function_name) for f in frames]
