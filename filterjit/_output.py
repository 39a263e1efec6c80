"""Outputs: traced leaves leave the nested jit, everything else rides along unchanged.

The jitted function returns the user's output itself when every leaf is a tracer.
Otherwise it returns an `_OutputBox`: a pytree node whose children are the traced
leaves and whose auxiliary data carries the rest. jax.jit stores that auxiliary
data with its cached trace, so static outputs come back on every call without
re-running Python, and a concrete output stays concrete when nested.
"""

from typing import Any

import jax.tree_util as jtu
from jax.core import Tracer


class _OutputSpec:
    """The non-traced part of an output. Hashed and compared by identity, since
    it may hold NumPy arrays and anything else a function returns."""

    __slots__ = ("treedef", "leaves", "dynamic_positions", "passthrough")

    def __init__(
        self,
        treedef: Any,  # a PyTreeDef
        leaves: list[Any],
        dynamic_positions: tuple[int, ...],
        passthrough: tuple[tuple[int, int], ...],
    ):
        self.treedef = treedef
        self.leaves = leaves
        self.dynamic_positions = dynamic_positions
        # (output position, input position) of inputs handed back unchanged.
        self.passthrough = passthrough

    def build(self, dynamic: Any, inputs: list[Any] | None) -> Any:
        leaves = list(self.leaves)
        for position, leaf in zip(self.dynamic_positions, dynamic):
            leaves[position] = leaf
        if inputs is not None:
            for out_position, in_position in self.passthrough:
                leaves[out_position] = inputs[in_position]
        return jtu.tree_unflatten(self.treedef, leaves)


class PendingOutput:
    """An output that hands back some of the call's own inputs. The wrapper
    resolves it with the current call's leaves: an equal-keyed earlier call's
    objects must not leak into this one's result."""

    __slots__ = ("spec", "dynamic")

    def __init__(self, spec: _OutputSpec, dynamic: Any):
        self.spec = spec
        self.dynamic = dynamic

    def resolve(self, inputs: list[Any]) -> Any:
        return self.spec.build(self.dynamic, inputs)


class _OutputBox:
    __slots__ = ("dynamic", "spec")

    def __init__(self, dynamic: list[Any], spec: _OutputSpec):
        self.dynamic = dynamic
        self.spec = spec


def _unbox(spec: _OutputSpec, dynamic: Any) -> Any:
    if spec.passthrough:
        return PendingOutput(spec, dynamic)
    return spec.build(dynamic, None)


jtu.register_pytree_node(
    _OutputBox,
    lambda box: (box.dynamic, box.spec),
    _unbox,  # pyright: ignore[reportArgumentType]
)


def pack_output(output: Any, inputs: list[Any]) -> tuple[Any, bool]:
    """What the jitted function returns for `output`, traced with `inputs`; and
    whether an input handed back was one object at several input positions, so
    that which one it came from is ambiguous."""
    leaves, treedef = jtu.tree_flatten(output)
    if all(isinstance(leaf, Tracer) for leaf in leaves):
        return output, False
    input_positions: dict[int, int] = {}
    aliased: set[int] = set()
    for position, leaf in enumerate(inputs):
        if not isinstance(leaf, Tracer):
            if id(leaf) in input_positions:
                aliased.add(id(leaf))
            else:
                input_positions[id(leaf)] = position
    dynamic = []
    dynamic_positions = []
    passthrough = []
    static_leaves: list[Any] = []
    ambiguous = False
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, Tracer):
            dynamic.append(leaf)
            dynamic_positions.append(position)
            static_leaves.append(None)
        else:
            in_position = input_positions.get(id(leaf))
            if in_position is not None:
                passthrough.append((position, in_position))
                ambiguous = ambiguous or id(leaf) in aliased
            static_leaves.append(leaf)
    spec = _OutputSpec(
        treedef, static_leaves, tuple(dynamic_positions), tuple(passthrough)
    )
    return _OutputBox(dynamic, spec), ambiguous


class _StaticLeaf:
    """A non-traced output leaf as a childless pytree node, so that the output
    keeps the user's structure: then jax.jit's `out_shardings`, given as a prefix
    of the user's output, applies to it. Hashed and compared by identity."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


jtu.register_pytree_node(
    _StaticLeaf,
    lambda leaf: ((), leaf),
    lambda leaf, _: leaf.value,  # pyright: ignore[reportArgumentType]
)


def pack_output_in_place(output: Any) -> Any:
    """Like `pack_output`, but each non-traced leaf stays where it is in the
    output's structure. Inputs handed back come back as the objects of the call
    that was traced (equal to this call's, since they are keyed by value)."""
    return jtu.tree_map(
        lambda leaf: leaf if isinstance(leaf, Tracer) else _StaticLeaf(leaf), output
    )
