"""Loading a payload: its header read and checked, its program read by JAX and
checked for custom calls, before anything of it runs."""

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .. import _private_jax as jax_private
from ._exported import Argument, DEFAULTS, Exported, KINDS, Parameters, Template
from ._payload import PayloadError, unpack
from ._program import (
    check_entry_point,
    check_serialized,
    donated_inputs,
    MAX_DERIVATIVES,
)
from ._values import check, decode, Malformed, need, SIZE, TRACED


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

# The custom-call targets `jax.export` exports without `disabled_checks`.
stable_targets_private = isinstance(
    jax_private.STABLE_TARGETS, (set, frozenset)
) and all(isinstance(t, str) for t in jax_private.STABLE_TARGETS)
STABLE_TARGETS = (
    frozenset(jax_private.STABLE_TARGETS)
    if stable_targets_private
    else _STABLE_TARGETS_PUBLIC
)

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
    mlir, ir = jax_private.mlir, jax_private.ir
    found: list[str] = []

    def walk(op: Any) -> None:
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


custom_call_targets_private = hasattr(jax_private.mlir, "make_ir_context") and hasattr(
    jax_private.ir, "Module"
)
# `custom_call_targets(exported)`: the targets a `jax.export.Exported`'s module
# calls, one entry per call.
custom_call_targets: Callable[[jax.export.Exported], list[str]] = (
    _targets_private if custom_call_targets_private else _targets_public
)


# Targets that hold an address in the process that made the program: never valid
# in a payload, whatever the export allowed.
_NEVER_ALLOWED = ("xla_python_", "xla_ffi_python_", "xla_ffi_partitioned_python_")


def _check_custom_calls(exported: jax.export.Exported) -> None:
    """Raises for a custom call outside JAX's stable targets and those the export
    allowed, in one order of the program (the function or a derivative)."""
    allowed = set(STABLE_TARGETS)
    for disabled in exported.disabled_safety_checks:
        target = disabled.is_custom_call()
        if target is not None:
            allowed.add(target)
    for target in custom_call_targets(exported):
        if target.startswith(_NEVER_ALLOWED):
            raise PayloadError(
                "program",
                f"the payload's program calls `{target}`, a host callback of the "
                "process that made it, which no other process can run. It is "
                "refused: such a payload is corrupt or crafted.",
            )
        if target not in allowed and "ALL" not in allowed:
            raise PayloadError(
                "program",
                f"the payload's program calls the custom call `{target}`, which is "
                "not among the targets JAX guarantees stable, and the export did "
                "not allow it. Export with `disabled_checks=[jax.export."
                f"DisabledSafetyCheck.custom_call({target!r})]` if this process "
                "provides it.",
            )


def _check_program(exported: jax.export.Exported, vjp_order: int) -> list[int]:
    """Each order of the program (as many as `check_serialized` found, the header's
    `vjp_order`), read by JAX: its calling convention, its entry point's types
    against its avals, its custom calls. Returns the inputs it donates."""
    donated: list[int] = []
    level = exported
    for order in range(vjp_order + 1):
        count = len(level.in_avals)
        if level.in_tree != jtu.tree_structure((tuple(range(count)), {})):
            raise PayloadError(
                "program",
                "the payload's program does not take its arrays as positional "
                "arguments, as an export of filterjit does (a corrupt or crafted "
                "payload).",
            )
        entry = check_entry_point(level, order)
        if order == 0:
            donated = donated_inputs(level, entry)
        _check_custom_calls(level)
        if order < vjp_order:
            level = level.vjp()
    return donated


@contextlib.contextmanager
def _jax_reading() -> Iterator[None]:
    """Where JAX reads the payload's program: what it raises (`struct.error`, its
    runtime's errors) refused as the payload's."""
    try:
        yield
    except PayloadError:
        raise
    except Exception as error:  # JAX's reader, never user code
        raise PayloadError(
            "program",
            "JAX cannot read the payload's program (a corrupt payload, or one of "
            f"an incompatible JAX): {type(error).__name__}. Export it again.",
        ) from None


def _malformed(part: str) -> PayloadError:
    return PayloadError(
        "header",
        f"the payload's header is not valid (a corrupt or crafted payload): {part} "
        "is not what `Exported.serialize()` writes. Save it again.",
    )


def deserialize(data: bytes | bytearray) -> Exported[..., Any]:
    """Loads what `Exported.serialize()` saved.

    Nothing that the data names is imported, unpickled or initialised: classes of
    static outputs must be registered in this process with
    `filterjit.register_serializable` first (arguments need no registration), and
    their instances are rebuilt without calling `__init__`. Everything the header
    says is checked, and checked against the program: its versions, structure and
    checksum; the functions it names (among those a payload may name); what the
    program donates, returns and differentiates. The program's own parts are read
    within fixed limits before JAX parses any of them (its shapes' text among
    them: the export how-to states the limits), so that loading takes time linear
    in the payload's length; its entry point's types are checked against its
    avals, and it may call no custom call outside JAX's stable targets, at any
    order of derivative it holds, unless the export allowed it
    (`disabled_checks`).

    The checks find damage and refuse what `serialize()` cannot have written, but
    the program's StableHLO is read by JAX, whose reader can abort the process on
    some crafted bytes: load bytes from a source you do not trust in a separate
    process.

    **Arguments:**

    - `data`: the bytes `serialize()` returned.

    **Returns:**

    A `filterjit.Exported`, called with the arguments of the exported function.

    **Raises:**

    A `filterjit.PayloadError` (a `ValueError`) saying where and what is wrong for
    every payload it refuses: truncated, corrupt or crafted, of another format or
    of a newer JAX, or returning a class or function this process has not
    registered (the message names it and how to register it).

    !!! example

        ```python
        exported = filterjit.deserialize(Path("model.bin").read_bytes())
        exported.call(x)
        ```
    """
    header, program = unpack(bytes(data))
    try:
        parts = _read_header(header)
    except PayloadError:
        raise
    except (Malformed, LookupError, TypeError, ValueError, RecursionError):
        raise _malformed("its function, parameters or arguments") from None
    fun_name, parameters, arguments, output_data, donated, vjp_order = parts
    try:
        marked = check(output_data)  # builds nothing: what it marks is counted
    except (Malformed, RecursionError):
        raise _malformed("its output") from None
    check_serialized(program, vjp_order)  # bounded, before JAX reads any of it
    with _jax_reading():  # parses the StableHLO, and its derivatives'
        exported = jax.export.deserialize(bytearray(program))
        program_donates = _check_program(exported, vjp_order)
    if sorted(donated) != program_donates:
        raise PayloadError(
            "header",
            f"the payload's header donates inputs {sorted(donated)[:8]}, and its "
            f"program donates {program_donates[:8]} (a corrupt or crafted "
            "payload): a call would delete arrays its program does not take over.",
        )
    try:
        prototype = decode(output_data)
    except Malformed:
        raise _malformed("its output") from None
    try:  # flattened by JAX (dict keys sorted) and by the classes' registrations
        output = Template(prototype, "output", output_data)
    except (TypeError, ValueError) as error:
        raise _malformed("its output (it cannot be flattened)") from error
    _check_output(output, marked, exported)
    try:
        loaded = Exported(exported, fun_name, parameters, arguments, output, donated)
    except ValueError:
        raise PayloadError(
            "header",
            "the payload's header is not valid (a corrupt or crafted payload): its "
            "arguments and output hold other arrays than its program takes "
            f"({len(exported.in_avals)}) and returns ({len(exported.out_avals)}).",
        ) from None
    return loaded


def _check_output(output: Template, marked: int, exported: jax.export.Exported) -> None:
    """Raises unless each array the output's data marks is a leaf of the output
    rebuilt (not in a static field, a frozenset or a dict's key), and each symbolic
    size is one the program returns as an empty `int8[0, size]`."""
    if output.traced != marked:
        raise _malformed(
            f"its output (it marks {marked} arrays, {output.traced} of them leaves)"
        )
    outputs = [
        i for i, leaf in enumerate(output.leaves) if leaf is TRACED or leaf is SIZE
    ]
    for aval, position in zip(exported.out_avals, outputs):
        if output.leaves[position] is SIZE and not (
            aval.dtype == np.int8 and len(aval.shape) == 2 and aval.shape[0] == 0
        ):
            raise _malformed(f"its output (a size where the program returns {aval})")


def _read_header(
    header: dict[str, Any],
) -> tuple[str, Parameters, list[Argument], Any, list[int], int]:
    """The parts of a payload's header, each checked; raises if one is malformed."""
    need(header["format"] == "filterjit.export")
    fun_name, saved, names = header["fun_name"], header["parameters"], header["names"]
    need(isinstance(fun_name, str))
    need((saved is None or type(saved) is list) and type(names) is list)
    for parameter in [] if saved is None else saved:
        _check_parameter(parameter, 3)
    for parameter in names:
        _check_parameter(parameter, 2)
    arguments = []
    for argument in header["arguments"]:
        parts = ("key", "given", "value", "labels")
        key, given, value, labels = (argument[part] for part in parts)
        default, static = argument["default"], argument["static"]
        need(type(key) in (int, str) and type(given) is bool)
        need(type(default) is bool and (given or not default))
        need(not default or (labels == [] and value is not None))
        need(type(static) is bool and (not static or labels == []))
        need(static == (isinstance(value, list) and value[:1] == ["static"]))
        need(isinstance(labels, list) and all(isinstance(x, str) for x in labels))
        if value is not None:
            check(value)
        arguments.append(Argument(key, given, value, labels, default, static))
    donated, vjp_order = header["donated"], header["vjp_order"]
    need(isinstance(donated, list) and all(type(i) is int for i in donated))
    need(type(vjp_order) is int and 0 <= vjp_order <= MAX_DERIVATIVES)
    parameters = Parameters(fun_name, saved, names)
    # The arguments are those the parameters bind: a call passing each by its key
    # binds to the same keys, in the same order.
    keys = [argument.key for argument in arguments]
    count = sum(type(key) is int for key in keys)
    need(keys[:count] == list(range(count)))
    try:
        positional, keywords = parameters.bind(
            (None,) * count, dict.fromkeys(keys[count:])
        )
    except TypeError:
        raise Malformed from None
    need([*range(len(positional)), *keywords] == keys)
    return fun_name, parameters, arguments, header["output"], donated, vjp_order


def _check_parameter(saved: Any, length: int) -> None:
    """Raises unless `saved` is `[name, kind, default]` (`length` 3) or `[name,
    kind]`, as `Parameters` saves a parameter."""
    need(isinstance(saved, list) and len(saved) == length)
    name, kind, *default = saved
    need(isinstance(name, str) and name.isidentifier() and type(kind) is int)
    need(kind in KINDS and all(isinstance(d, str) and d in DEFAULTS for d in default))
