"""Outputs: what the jitted function returns, so that what a trace learned about
its output is kept by JAX with the executable compiled from that trace.

JAX keeps a jitted function's output structure per executable, the auxiliary data
of its nodes included, and rebuilds the output from it on its C++ fast path (which
it keeps only while the rebuilt output flattens to arrays alone). So every fact of
a trace that the caller needs rides in the output itself, never in a table of
filterjit's own beside it (JAX reuses executables for reasons filterjit cannot
see: configuration such as x64, context, shardings):

- an output whose leaves are all traced is returned as it is (not nested, every
  array leaf is an output of the jit, as in `jax.jit`);
- any other is `Carried`: its children are the traced leaves and its auxiliary
  data the `OutputSpec` that finishes it (static leaves, inputs handed back, NumPy
  arrays each call gets a copy of, whether the trace holds a runtime check).

Only tracers are outputs of the jit; the rest is what the function returned.
"""

from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer

from ._partition import traced_types
from ._structure import dict_orders, restore_orders
from ._trace import STAGED, TOP


_identity = object.__eq__


class _Static:
    """A static output leaf as a childless node, for `out_shardings` (a prefix of
    the user's output, so the output keeps its structure). Compared by identity."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


jtu.register_pytree_node(
    _Static,
    lambda leaf: ((), leaf),
    lambda leaf, _: leaf.value,  # pyright: ignore[reportArgumentType]
)


class OutputSpec:
    """The part of an output that is not traced, when the call must finish it: its
    structure, its static leaves, which of them are inputs handed back or NumPy
    arrays to copy, and whether the trace holds a runtime check.

    Made during a trace and carried by JAX as the auxiliary data of `Carried`, so
    that it is always that trace's. Compared by identity."""

    __slots__ = (
        "treedef",
        "template",
        "dynamic_positions",
        "passthrough",
        "copies",
        "aliases",
        "runtime_check",
        "plain",
        "build",
        "orders",
    )

    def __init__(
        self,
        treedef: Any,
        template: list[Any],
        dynamic_positions: tuple[int, ...],
        passthrough: tuple[tuple[int, int], ...],
        copies: tuple[int, ...],
        aliases: tuple[tuple[int, ...], ...],
        runtime_check: bool,
        orders: tuple[tuple[Any, ...], ...] | None = None,
    ):
        self.treedef = treedef
        self.template = template
        self.dynamic_positions = dynamic_positions
        self.passthrough = passthrough
        self.copies = copies
        # Groups of input positions that held one object when traced, of which one
        # came back: which one is known only while they are one object again.
        self.aliases = aliases
        self.runtime_check = runtime_check
        # Whether the call needs nothing but `build`.
        self.plain = not (aliases or runtime_check)
        # `build(out, inputs)`: the user's output from the traced leaves `out` and
        # this call's leaves. Most outputs need only the traced leaves put in.
        self.build: Callable[[Any, list[Any]], Any] = (
            self._build if passthrough or copies else self._builder()
        )
        # Nested: the insertion orders of the output's dicts, where JAX's rebuild
        # (in sorted key order) would change them.
        self.orders = orders
        if orders is not None:
            build = self.build
            self.build = lambda out, inputs: restore_orders(build(out, inputs), orders)

    def _builder(self) -> Callable[[Any, list[Any]], Any]:
        template, unflatten = self.template, self.treedef.unflatten
        positions = self.dynamic_positions
        if len(positions) == 1:
            (position,) = positions

            def build_one(out: Any, inputs: list[Any]) -> Any:
                leaves = template.copy()
                leaves[position] = out[0]
                return unflatten(leaves)

            return build_one

        def build(out: Any, inputs: list[Any]) -> Any:
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

    def _build(self, out: Any, inputs: list[Any]) -> Any:
        leaves = list(self.template)
        for position, leaf in zip(self.dynamic_positions, out):
            leaves[position] = leaf
        for out_position, in_position in self.passthrough:
            leaves[out_position] = inputs[in_position]
        for position in self.copies:
            leaves[position] = leaves[position].copy()
        return self.treedef.unflatten(leaves)


class Carried:
    """An output finished by the caller: the traced leaves, and the spec of the
    trace that made them (JAX's auxiliary data, so kept per executable)."""

    __slots__ = ("leaves", "spec")

    def __init__(self, leaves: Any, spec: OutputSpec):
        self.leaves = leaves
        self.spec = spec


jtu.register_pytree_node(
    Carried,
    lambda carried: (carried.leaves, carried.spec),
    lambda spec, leaves: Carried(leaves, spec),  # pyright: ignore[reportArgumentType]
)


def finish(out: Any, inputs: list[Any]) -> Any:
    """The user's output from what the jitted function returned (or its shapes,
    from `eval_shape`), for a call with leaves `inputs`."""
    if type(out) is Carried:
        return out.spec.build(out.leaves, inputs)
    return out


def jit_output(
    output: Any,
    inputs: list[Any],
    runtime_check: bool,
    staged: bool,
    boxed: bool = False,
) -> Any:
    """What the jitted function returns for the user's `output`, traced with
    `inputs` (the call's leaves, traced ones as tracers). Not `staged`, every
    array leaf is an output of the jit, as in `jax.jit`: a NumPy array or a
    concrete `jax.Array` returned as it is comes back as a new JAX array. `boxed`:
    keep the user's structure whatever it takes (for `out_shardings`, a prefix of
    it); inputs handed back are then the traced call's (equal to this call's: they
    are keyed by value)."""
    traced = traced_types(STAGED if staged else TOP)
    leaves, treedef = jtu.tree_flatten(output)
    input_positions: dict[int, list[int]] = {}
    for position, leaf in enumerate(inputs):
        if not isinstance(leaf, Tracer):
            input_positions.setdefault(id(leaf), []).append(position)
    dynamic_positions: list[int] = []
    passthrough: list[tuple[int, int]] = []
    copies: list[int] = []
    aliases: set[tuple[int, ...]] = set()
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, traced):
            dynamic_positions.append(position)
        elif id(leaf) in input_positions and type(leaf).__eq__ is not _identity:
            # The call's own object comes back, not the traced call's. (Where `==`
            # is identity, the key holds the object itself: it is this call's.)
            positions = input_positions[id(leaf)]
            passthrough.append((position, positions[0]))
            if len(positions) > 1:
                aliases.add(tuple(positions))
        elif isinstance(leaf, np.ndarray):
            # Nested, as without the decorator: a NumPy array, every call its own.
            copies.append(position)
    orders = None
    if staged:
        # As the function returned it: a dict in its insertion order.
        found = dict_orders(output)
        if found and found != dict_orders(treedef.unflatten(leaves)):
            orders = found
    if len(dynamic_positions) == len(leaves) and not runtime_check and not orders:
        return output
    if boxed:
        dynamic = set(dynamic_positions)
        return treedef.unflatten(
            [
                leaf if position in dynamic else _Static(leaf)
                for position, leaf in enumerate(leaves)
            ]
        )
    template = list(leaves)
    for position in dynamic_positions:
        template[position] = None
    for position, _ in passthrough:
        template[position] = None  # filled from each call: pins nothing
    spec = OutputSpec(
        treedef,
        template,
        tuple(dynamic_positions),
        tuple(passthrough),
        tuple(copies),
        tuple(aliases),
        runtime_check,
        orders,
    )
    return Carried([leaves[p] for p in dynamic_positions], spec)
