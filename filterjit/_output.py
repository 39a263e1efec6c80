"""Outputs: only traced leaves leave the jitted function; the rest is known from
the trace.

A jitted function that returns anything but arrays leaves JAX's C++ fast path on
every call. So the jitted function returns the user's output itself when every
leaf of it is traced, and otherwise only the list of traced leaves, while the
trace records an `OutputSpec`: the output's structure and its other leaves. The
call puts the two together again.
"""

from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer


_identity = object.__eq__


class Pure:
    """The output spec of an output whose leaves are all traced: the jitted
    function returns it as it is."""

    __slots__ = ()
    aliases = ()

    def aliases_hold(self, inputs: list[Any]) -> bool:
        return True

    def build(self, out: Any, inputs: list[Any]) -> Any:
        return out

    def same_as(self, other: "OutputSpec | Pure") -> bool:
        return other is self


PURE = Pure()


def _same_leaf(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.all(a == b))
    try:
        return (a == b) is True
    except Exception:
        return False


class OutputSpec:
    """The part of an output that is not traced: its structure, its static leaves,
    and which of them are inputs handed back."""

    __slots__ = (
        "treedef",
        "template",
        "dynamic_positions",
        "passthrough",
        "copies",
        "aliases",
        "build",
    )

    def __init__(self, output: Any, inputs: list[Any]):
        leaves, self.treedef = jtu.tree_flatten(output)
        input_positions: dict[int, list[int]] = {}
        for position, leaf in enumerate(inputs):
            if not isinstance(leaf, Tracer):
                input_positions.setdefault(id(leaf), []).append(position)
        aliases = set()
        dynamic_positions = []
        passthrough = []
        copies = []
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, Tracer):
                dynamic_positions.append(position)
                leaves[position] = None
            elif id(leaf) in input_positions and type(leaf).__eq__ is not _identity:
                # The call's own object comes back, not the traced call's. (Where
                # `==` is identity, as for functions, an equal key is the same
                # object already.)
                positions = input_positions[id(leaf)]
                passthrough.append((position, positions[0]))
                if len(positions) > 1:
                    # One object at several inputs: which one came back is known
                    # only for calls where they are one object again.
                    aliases.add(tuple(positions))
            elif isinstance(leaf, np.ndarray):
                # As without jit, every call gets its own array.
                copies.append(position)
        self.template = leaves
        self.dynamic_positions = tuple(dynamic_positions)
        self.passthrough = tuple(passthrough)
        self.copies = tuple(copies)
        self.aliases = tuple(aliases)
        # `build(out, inputs)`: the user's output, from the traced leaves `out` and
        # this call's leaves. Most outputs need only the traced leaves put in.
        self.build: Callable[[list[Any], list[Any]], Any] = (
            self._build if passthrough or copies else self._builder()
        )

    def _builder(self) -> Callable[[list[Any], list[Any]], Any]:
        template, unflatten = self.template, self.treedef.unflatten
        if len(self.dynamic_positions) == 1:
            (position,) = self.dynamic_positions

            def build_one(out: list[Any], inputs: list[Any]) -> Any:
                leaves = template.copy()
                leaves[position] = out[0]
                return unflatten(leaves)

            return build_one
        positions = self.dynamic_positions

        def build(out: list[Any], inputs: list[Any]) -> Any:
            leaves = template.copy()
            for position, leaf in zip(positions, out):
                leaves[position] = leaf
            return unflatten(leaves)

        return build

    def aliases_hold(self, inputs: list[Any]) -> bool:
        """Whether the inputs that were one object when traced are one now."""
        return all(
            inputs[position] is inputs[group[0]]
            for group in self.aliases
            for position in group[1:]
        )

    def dynamic(self, output: Any) -> list[Any]:
        """The traced leaves of `output` (for which this spec was made)."""
        leaves = jtu.tree_leaves(output)
        return [leaves[position] for position in self.dynamic_positions]

    def _build(self, out: list[Any], inputs: list[Any]) -> Any:
        leaves = list(self.template)
        for position, leaf in zip(self.dynamic_positions, out):
            leaves[position] = leaf
        for out_position, in_position in self.passthrough:
            leaves[out_position] = inputs[in_position]
        for position in self.copies:
            leaves[position] = leaves[position].copy()
        return self.treedef.unflatten(leaves)

    def same_as(self, other: "OutputSpec | Pure") -> bool:
        return (
            type(other) is OutputSpec
            and self.treedef == other.treedef
            and self.dynamic_positions == other.dynamic_positions
            and self.passthrough == other.passthrough
            and all(map(_same_leaf, self.template, other.template))
        )


def output_spec(output: Any, inputs: list[Any]) -> OutputSpec | Pure:
    """The spec of an output traced with `inputs` (the call's leaves, traced ones
    as tracers)."""
    if all(isinstance(leaf, Tracer) for leaf in jtu.tree_leaves(output)):
        return PURE
    return OutputSpec(output, inputs)


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


def in_place(output: Any) -> Any:
    """The output with each non-traced leaf boxed where it is, for
    `out_shardings`. Inputs handed back come back as the objects of the call that
    was traced (equal to this call's, since they are keyed by value)."""
    return jtu.tree_map(
        lambda leaf: leaf if isinstance(leaf, Tracer) else _StaticLeaf(leaf), output
    )
