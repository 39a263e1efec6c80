"""The private JAX that loading an export reads, each access with a public fallback
and a canary test in `tests/test_export.py`: the custom-call targets JAX guarantees
stable, and the targets a StableHLO module calls. (`_trace.py` holds the private
access of the call path; this module is the loader's.)"""

import re
from collections.abc import Callable
from typing import Any


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


def _targets_public(exported: Any) -> list[str]:
    text = exported.mlir_module()
    found = [name.strip('"') for name in _PRETTY.findall(text)]
    found += _GENERIC.findall(text)
    if "custom_call" in text and not found:
        return ["<a custom call this version of filterjit cannot read>"]
    return found


def _targets_private(exported: Any) -> list[str]:
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir  # pyright: ignore[reportPrivateImportUsage]

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


def _choose_targets() -> tuple[Callable[[Any], list[str]], bool]:
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
