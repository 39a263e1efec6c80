"""The only module that touches private JAX API, each access with a public fallback
and a canary test (`tests/test_private_jax_api.py`, and `tests/test_export.py` for the
loader's): where in JAX's trace stack a call happens, which frames JAX shows, what
a pytree structure holds, the jit equation a nested call emits (its constants the
caller's), waiting for arrays, the partial a `jtu.Partial` boxes, and for
loading an export, the custom-call targets JAX guarantees stable and those a
StableHLO module calls. JAX's rules, modules and classes are read, never
replaced (`tests/test_private_jax_api.py` compares them before and after import)."""

import functools
import inspect
import operator
import os
import re
from collections.abc import Callable
from typing import Any, NamedTuple, ParamSpec, TypeVar

import jax
import jax.extend.core
import jax.extend.source_info_util

from ._level import EAGER, Level, STAGED, TOP
from ._structure import PyTreeDef


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _trace_level_public() -> Level:
    # Public, unstable, TOP under eager transforms; where missing, TOP (as Equinox).
    am_i_under_a_jit = getattr(
        jax.extend.core, "unsafe_am_i_under_a_jit_DO_NOT_USE", lambda: False
    )
    return STAGED if am_i_under_a_jit() else TOP


# JAX attributes operations and cache misses to the user's frame, not filterjit's.
_package_dir = os.path.dirname(os.path.abspath(__file__))
jax.extend.source_info_util.register_exclusion(_package_dir)


def _hide_frames_public(error: BaseException) -> None:
    pass  # JAX's filtering unknown: the traceback is left whole


try:
    from jax._src.traceback_util import (
        _add_call_stack_frames as _with_call_stack,
        _add_tracebackhide_to_hidden_frames as _mark_hidden_frames,
        _filtering_mode,
        _is_under_reraiser,
        _simplified_tb_msg as _FILTERED_NOTE_TEXT,
        filter_traceback as _filter_traceback,
        format_exception_only as _format_exception_only,
        register_exclusion as _register_exclusion,
        UnfilteredStackTrace as _UnfilteredStackTrace,
    )
except ImportError:  # pragma: no cover - the tests simulate this by monkeypatching
    traceback_filtering_available = False
    hide_frames = _hide_frames_public
else:
    traceback_filtering_available = True
    # Below `jax.jit`'s boundary, JAX hides filterjit's frames as it hides its own.
    _register_exclusion(_package_dir)
    _FILTERED_NOTE = "--------------------\n" + _FILTERED_NOTE_TEXT

    def _hide_frames_private(error: BaseException) -> None:
        # What `jax._src.traceback_util.api_boundary` does to an exception leaving
        # `jax.jit`'s wrapper, done where it leaves filterjit's (whose frames sit
        # above JAX's boundary, out of its reach): filterjit's and JAX's frames
        # removed, or marked `__tracebackhide__`, as JAX_TRACEBACK_FILTERING says.
        mode = _filtering_mode()
        tb = error.__traceback__
        if mode == "off" or tb is None or _is_under_reraiser(error):
            return  # shown whole, or filtered by an enclosing JAX boundary
        if mode == "tracebackhide":
            _mark_hidden_frames(tb)
            return
        if mode not in ("quiet_remove_frames", "remove_frames"):
            return  # JAX raises for an unknown mode itself
        error.with_traceback(_filter_traceback(tb))
        if mode == "quiet_remove_frames":
            if _FILTERED_NOTE not in getattr(error, "__notes__", ()):
                error.add_note(_FILTERED_NOTE)
        elif not isinstance(error.__cause__, _UnfilteredStackTrace):
            # `jax.jit`'s boundary made none (the error is filterjit's own): one
            # with the whole stack, as JAX makes it.
            unfiltered = _UnfilteredStackTrace(_format_exception_only(error))
            unfiltered.with_traceback(_with_call_stack(tb))
            unfiltered.__cause__ = error.__cause__
            unfiltered.__context__ = error.__context__
            unfiltered.__suppress_context__ = error.__suppress_context__
            error.__cause__ = unfiltered
            error.__context__ = None

    # `hide_frames(error)`: filterjit's frames (generated code included: it is filed
    # under the package's directory) taken out of `error`'s traceback, as JAX's own.
    hide_frames = _hide_frames_private


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


def _current_equations_public() -> list[Any] | None:
    return None  # unknown: the caller assumes the worst


def _current_trace_public() -> object | None:
    return None


def _current_inputs_public() -> list[Any] | None:
    return None  # unknown


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


class _Outside:
    """The public reader's trace outside any staged trace."""


_OUTSIDE, _INSIDE = _Outside(), object()


def _current_public() -> object:
    return _INSIDE if _trace_level_public() == STAGED else _OUTSIDE


PUBLIC_READER = LevelReader(
    lambda: bool(jax.config.jax_disable_jit),  # pyright: ignore[reportAttributeAccessIssue]
    _current_public,
    _Outside,
    object,
    lambda _: STAGED,
)


try:
    from jax._src.config import disable_jit as _disable_jit_state
    from jax._src.core import EvalTrace as _EvalTrace, trace_ctx as _trace_ctx
    from jax._src.interpreters.partial_eval import (
        DynamicJaxprTrace as _DynamicJaxprTrace,
    )

    try:
        # jax >= 0.10: the state behind the `trace_ctx.trace` property, read
        # without the property's Python call.
        from jax._src.core import trace_state_strong_ref as _current_trace
    except ImportError:  # jax 0.9: `trace_ctx.trace` is an attribute

        class _TraceAttribute:
            __slots__ = ()

            @property
            def value(self) -> object:
                return _trace_ctx.trace

        _current_trace = _TraceAttribute()

    def _getter(state: object) -> Any:
        # `state.value`'s getter, where `value` is a property: called directly, it
        # skips the property's own call (about 20 ns a read, two reads a call).
        found = inspect.getattr_static(type(state), "value", None)
        fget = found.fget if isinstance(found, property) else None
        return fget or operator.attrgetter("value")

    _disable_jit_value = _getter(_disable_jit_state)
    _current_trace_value = _getter(_current_trace)
except ImportError:  # pragma: no cover - the tests simulate this by monkeypatching
    private_api_available = False
    trace_level = _trace_level_public
    current_equations = _current_equations_public
    current_inputs = _current_inputs_public
    current_trace = _current_trace_public
    level_reader = PUBLIC_READER
else:
    private_api_available = True

    def _walk(trace: object) -> Level:
        # Up the `parent_trace` chain, which ends at an `EvalTrace`.
        level = TOP
        while trace is not None:
            if isinstance(trace, _DynamicJaxprTrace):
                return STAGED
            if not isinstance(trace, _EvalTrace):
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

    def _current_trace_private() -> object | None:
        # The innermost trace (transform or staging) the call is made in.
        return _current_trace.value

    trace_level = _trace_level_private
    current_trace = _current_trace_private
    current_equations = _current_equations_private
    current_inputs = _current_inputs_private
    # Each read a C call: the state's getter, bound to it.
    level_reader = LevelReader(
        functools.partial(_disable_jit_value, _disable_jit_state),
        functools.partial(_current_trace_value, _current_trace),
        _EvalTrace,
        _DynamicJaxprTrace,
        _walk,
    )


def jit_cache_size(jitted: object) -> int | None:
    """How many traces the `jax.jit` object `jitted` holds (`None`: JAX won't say)."""
    size: Any = getattr(jitted, "_cache_size", None)
    return None if size is None else int(size())


def _nested_caller_public(jitted: object) -> Any:
    return jitted  # the constants stay in its jit equation's jaxpr


def _choose_nested_caller() -> Callable[[Any], Any]:
    try:
        from jax._src import pjit
        from jax._src.interpreters.partial_eval import separate_consts

        infer_params, jit_p, unspecified = (
            pjit._infer_params,  # pyright: ignore[reportPrivateUsage]
            pjit.jit_p,
            pjit.UNSPECIFIED,  # pyright: ignore[reportPrivateImportUsage]
        )
    except (ImportError, AttributeError):  # pragma: no cover - the tests simulate it
        return _nested_caller_public

    def _nested_caller_private(jitted: object) -> Any:
        fun = getattr(jitted, "_fun", None)
        info = getattr(jitted, "_jit_info", None)
        if fun is None or info is None:
            return jitted  # not a `jax.jit` object as this knows it

        def call_nested(*args: object) -> Any:
            # What `jitted(*args)` does inside a trace (one cached trace, one jit
            # equation), its jaxpr's constants moved to the front of its operands,
            # as JAX moves constants that are tracers: the outer program's
            # constants then, as where undecorated, which a `cond` under `vmap`
            # batches and a rematerialized checkpoint computes again.
            found, operands = infer_params(fun, info, args, {})
            params = found.params
            if params["jaxpr"].consts:
                jaxpr, consts = separate_consts(params["jaxpr"])
                count = len(consts)
                params = dict(
                    params,
                    jaxpr=jaxpr,
                    in_shardings=(unspecified,) * count + tuple(params["in_shardings"]),
                    in_layouts=(None,) * count + tuple(params["in_layouts"]),
                    donated_invars=(False,) * count + tuple(params["donated_invars"]),
                )
                operands = [*consts, *operands]
            out = jit_p.bind(*operands, **params)
            return jax.tree_util.tree_unflatten(found.out_tree, out)

        return call_nested

    return _nested_caller_private


# `nested_caller(jitted)`: what calls the `jax.jit` object `jitted` inside a staged
# trace, as `jitted` itself does but for the constants of its trace, which are the
# caller's (see `_nested_caller_private`).
nested_caller = _choose_nested_caller()


def _aux_data_public(treedef: PyTreeDef) -> list[Any]:
    found: list[Any] = []
    data = treedef.node_data()
    if data is not None:
        for child in treedef.children():
            found += _aux_data_public(child)
        if data[1] is not None:
            found.append(data[1])
    return found


def _aux_data_private(treedef: PyTreeDef) -> list[Any]:
    # The pickled state lists the nodes, children first, as (kind, arity, node
    # data, ...), in one call rather than two per node. Kinds 5 and 6 (dicts,
    # registered nodes) are the ones with data of the user's.
    nodes = treedef.__getstate__()[1]
    return [node[2] for node in nodes if node[0] >= 5 and node[2] is not None]


def _choose_aux_data() -> Callable[[PyTreeDef], list[Any]]:
    probe = jax.tree_util.tree_structure(
        [{"a": 1, "b": (None, 2)}, jax.tree_util.Partial(len, 3), ()]
    )
    try:
        if _aux_data_private(probe) == _aux_data_public(probe):
            return _aux_data_private
    except Exception:
        pass
    return _aux_data_public


# `aux_data(treedef)`: the auxiliary data of its nodes that have some, children first.
aux_data = _choose_aux_data()


def _block_leaves_public(arrays: list[jax.Array]) -> None:
    jax.block_until_ready(arrays)


def _choose_block_leaves() -> Any:
    # What `jax.block_until_ready` calls for two or more arrays, without its
    # flatten and loop (3 µs of 6 for eight arrays). Not tried here: importing
    # filterjit must not start JAX's backends; tests/test_private_jax_api.py tries it.
    try:
        from jax._src.lib import xla_client  # pyright: ignore[reportPrivateImportUsage]
    except Exception:
        return _block_leaves_public
    batched = getattr(xla_client, "batched_block_until_ready", None)
    return batched if callable(batched) else _block_leaves_public


# `block_leaves(arrays)`: waits for a list of `jax.Array`s, raising what one raised.
block_leaves = _choose_block_leaves()


# The logger of JAX's module that logs a failed host callback (named after the
# module, which is private: a rename leaves the log unfiltered, nothing else).
CALLBACK_LOGGER = "jax._src.callback"


def _boxed_partial_public(func: object) -> Any:
    return None  # JAX's box unknown: a `jtu.Partial` of a partial is held as it is


def _choose_boxed_partial() -> Any:
    # `jtu.Partial(partial)` boxes the partial (so that its arguments are not
    # merged), copying its `func`, `args` and `keywords` onto the box.
    try:
        from jax._src.tree_util import _HashableCallableShim as box
    except ImportError:  # pragma: no cover - the tests simulate this
        return _boxed_partial_public

    def _boxed_partial_private(func: object) -> Any:
        if type(func) is not box:
            return None
        boxed: Any = func  # the partial's `func`, `args` and `keywords`, copied
        return functools.partial(boxed.func, *boxed.args, **boxed.keywords)

    return _boxed_partial_private


# `boxed_partial(func)`: the `functools.partial` a `jtu.Partial`'s `func` boxes
# (as `partial(inner.func, *inner.args, **inner.keywords)`), else `None`.
boxed_partial = _choose_boxed_partial()


# Without JAX's list, the targets JAX itself emits for sharding and shape checks
# (anything else is refused, unless the export allowed it).
_STABLE_TARGETS_PUBLIC = frozenset(
    {
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "annotate_device_placement",
        "shape_assertion",
    }
)


def _stable_targets() -> tuple[frozenset[str], bool]:
    try:
        from jax._src.export._export import (
            _CUSTOM_CALL_TARGETS_GUARANTEED_STABLE as targets,
        )
    except ImportError:  # pragma: no cover - the canary test says when this happens
        return _STABLE_TARGETS_PUBLIC, False
    if not isinstance(targets, (set, frozenset)) or not all(
        isinstance(t, str) for t in targets
    ):  # pragma: no cover
        return _STABLE_TARGETS_PUBLIC, False
    return frozenset(targets), True


STABLE_TARGETS, stable_targets_private = _stable_targets()
"""The custom-call targets `jax.export` exports without `disabled_checks`."""


# The textual form's custom calls: `stablehlo.custom_call @target(` (quoted where
# the name needs it) and the generic `call_target_name = "target"`.
_PRETTY = re.compile(r'stablehlo\.custom_call\s+@("(?:[^"\\]|\\.)*"|[^\s(]+)')
_GENERIC = re.compile(r'call_target_name\s*=\s*"((?:[^"\\]|\\.)*)"')


def _targets_public(exported: jax.export.Exported) -> list[str]:
    text = exported.mlir_module()
    found = [name.strip('"') for name in _PRETTY.findall(text)]
    found += _GENERIC.findall(text)
    if "custom_call" in text and not found:
        return ["<a custom call this version of filterjit cannot read>"]
    return found


def _targets_private(exported: jax.export.Exported) -> list[str]:
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir  # pyright: ignore[reportPrivateImportUsage]

    found: list[str] = []

    def walk(op: ir.Operation) -> None:
        if op.operation.name == "stablehlo.custom_call":
            target = op.operation.attributes["call_target_name"]
            found.append(ir.StringAttr(target).value)
        for region in op.operation.regions:
            for block in region:
                for inner in block:
                    walk(inner.operation)

    text = exported.mlir_module()  # StableHLO (the payload holds VHLO)
    with mlir.make_ir_context():
        walk(ir.Module.parse(text).operation)
    # The text's own reading too: a target either reading finds is checked.
    return found + _targets_public(exported)


def _choose_targets() -> tuple[Callable[[jax.export.Exported], list[str]], bool]:
    try:
        from jax._src.interpreters import mlir
        from jax._src.lib.mlir import ir  # pyright: ignore[reportPrivateImportUsage]
    except ImportError:  # pragma: no cover
        return _targets_public, False
    if not (hasattr(mlir, "make_ir_context") and hasattr(ir, "Module")):
        return _targets_public, False  # pragma: no cover
    return _targets_private, True


custom_call_targets, custom_call_targets_private = _choose_targets()
"""`custom_call_targets(exported)`: the targets a `jax.export.Exported`'s module
calls, one entry per call."""


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
