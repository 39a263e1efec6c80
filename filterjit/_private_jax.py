"""Every import of JAX's private API (`jax._src`), in this one module: a name is
`None` where this JAX lacks it, and the module that reads it then takes its public
fallback. Each has a canary test (`tests/test_private_jax_api.py`). JAX's rules,
modules and classes are read, never replaced (a test there compares them before
and after import)."""

from typing import Any


# The trace stack and `jax.disable_jit()`: a call's level (`_trace`).
try:
    from jax._src.config import disable_jit as disable_jit_state
    from jax._src.core import EvalTrace, trace_ctx
    from jax._src.interpreters.partial_eval import DynamicJaxprTrace
except ImportError:  # pragma: no cover - the tests simulate this by monkeypatching
    disable_jit_state = EvalTrace = trace_ctx = DynamicJaxprTrace = None

try:  # jax >= 0.10: the state behind the `trace_ctx.trace` property
    from jax._src.core import trace_state_strong_ref
except ImportError:  # jax 0.9: `trace_ctx.trace` is an attribute
    trace_state_strong_ref = None

# What `jax.jit`'s boundary does to an exception leaving it (`_tracebacks`).
try:
    from jax._src.traceback_util import (
        _add_call_stack_frames as with_call_stack,
        _add_tracebackhide_to_hidden_frames as mark_hidden_frames,
        _filtering_mode as filtering_mode,
        _is_under_reraiser as is_under_reraiser,
        _simplified_tb_msg as FILTERED_NOTE_TEXT,
        filter_traceback,
        format_exception_only,
        register_exclusion,
        UnfilteredStackTrace,
    )
except ImportError:  # pragma: no cover - the tests simulate this by monkeypatching
    with_call_stack = mark_hidden_frames = filtering_mode = is_under_reraiser = None
    FILTERED_NOTE_TEXT = filter_traceback = format_exception_only = None
    register_exclusion = UnfilteredStackTrace = None

# A `jax.jit` object's call inside a trace (`_nested`).
try:
    from jax._src.interpreters.partial_eval import separate_consts
    from jax._src.pjit import (
        _infer_params as infer_params,  # pyright: ignore[reportPrivateUsage]
        jit_p,
        UNSPECIFIED,  # pyright: ignore[reportPrivateImportUsage]
    )
except ImportError:  # pragma: no cover - the tests simulate it
    separate_consts = infer_params = jit_p = UNSPECIFIED = None

# The box `jtu.Partial(partial)` puts a partial in (`_trace.boxed_partial`).
try:
    from jax._src.tree_util import _HashableCallableShim as PartialBox
except ImportError:  # pragma: no cover - the tests simulate this
    PartialBox = None

# What `jax.block_until_ready` calls for two or more arrays (`_trace.block_leaves`).
try:
    from jax._src.lib import xla_client  # pyright: ignore[reportPrivateImportUsage]
except Exception:  # pragma: no cover
    xla_client = None
batched_block_until_ready: Any = getattr(xla_client, "batched_block_until_ready", None)

# For loading an export (`_export._targets`): the custom-call targets JAX
# guarantees stable, and a parser of StableHLO.
try:
    from jax._src.export._export import (
        _CUSTOM_CALL_TARGETS_GUARANTEED_STABLE as STABLE_TARGETS,
    )
except ImportError:  # pragma: no cover - the canary test says when this happens
    STABLE_TARGETS = None

try:
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir  # pyright: ignore[reportPrivateImportUsage]
except ImportError:  # pragma: no cover
    mlir = ir = None

# For loading an export (`_export._program`): the reader of a serialized
# `jax.export.Exported` (a flatbuffer), so that its parts are checked before JAX
# parses them.
try:
    from jax._src.export import serialization_generated as export_flatbuffers
except ImportError:  # pragma: no cover - the canary test says when this happens
    export_flatbuffers = None
