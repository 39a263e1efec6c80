"""Where in JAX's trace stack a call happens.

This is the only module that touches private JAX API. Every private access has a
public fallback, and `tests/test_trace.py` fails loudly if the private path moves.
"""

import enum

import jax
import jax.extend.core


class TraceLevel(enum.IntEnum):
    """Where a call happens, as far as `filter_jit` cares."""

    # No trace at all: a plain Python call.
    TOP = 0
    # Only eager transforms (grad, vjp, jvp, linearize, vmap) around the call.
    EAGER = 1
    # A staged computation (jit, make_jaxpr, scan/while/cond bodies, checkpoint,
    # custom_vjp, ...) somewhere in the trace chain.
    STAGED = 2


def _trace_level_public() -> TraceLevel:
    # Public but explicitly unstable. It cannot tell eager transforms from the top
    # level, so it says TOP for both; that only matters for donation.
    if jax.extend.core.unsafe_am_i_under_a_jit_DO_NOT_USE():  # pyright: ignore[reportPrivateImportUsage]
        return TraceLevel.STAGED
    return TraceLevel.TOP


def _jit_disabled_public() -> bool:
    return bool(jax.config.jax_disable_jit)  # pyright: ignore[reportAttributeAccessIssue]


try:
    from jax._src.config import disable_jit as _disable_jit_state
    from jax._src.core import EvalTrace as _EvalTrace, trace_ctx as _trace_ctx
    from jax._src.interpreters.partial_eval import (
        DynamicJaxprTrace as _DynamicJaxprTrace,
    )
except ImportError:  # pragma: no cover - the tests simulate this by monkeypatching
    private_api_available = False
    trace_level = _trace_level_public
    jit_disabled = _jit_disabled_public
else:
    private_api_available = True

    def _trace_level_private() -> TraceLevel:
        # The current trace points at the one it was opened under through
        # `parent_trace`; the chain ends at an `EvalTrace`, which has none.
        trace = _trace_ctx.trace
        level = TraceLevel.TOP
        while trace is not None:
            if isinstance(trace, _DynamicJaxprTrace):
                return TraceLevel.STAGED
            if not isinstance(trace, _EvalTrace):
                level = TraceLevel.EAGER
            trace = getattr(trace, "parent_trace", None)
        return level

    def _jit_disabled_private() -> bool:
        return _disable_jit_state.value

    trace_level = _trace_level_private
    jit_disabled = _jit_disabled_private
