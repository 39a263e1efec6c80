"""Outputs: what the jitted function returns. What a trace learned of its output is
kept by JAX with the executable compiled from that trace, in the output's structure
(its nodes' auxiliary data included, rebuilt on JAX's C++ fast path), never in a table
of filterjit's own: JAX reuses executables for reasons filterjit cannot see (x64,
context, shardings). So an output whose leaves are all traced is returned as it is;
any other is `Carried`: its children the traced leaves (only tracers are outputs of
the jit), its auxiliary data the `OutputSpec` that finishes it."""

import collections
import operator
import types
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.core import Tracer

from ._leaves import identity_is_moot, is_array
from ._structure import (
    container_nodes,
    dict_orders,
    hand_back,
    PyTreeDef,
    restore_orders,
    shape_of,
)


def items_getter(keys: Sequence[object]) -> Callable[[Any], tuple[Any, ...]]:
    if len(keys) != 1:
        return operator.itemgetter(*keys) if keys else lambda x: ()
    (key,) = keys
    return lambda x: (x[key],)


class _Static:
    """A static output leaf as a childless node, for `out_shardings` (a prefix of
    the user's output, so the output keeps its structure). Compared by identity."""

    __slots__ = ("value",)

    def __init__(self, value: object):
        self.value = value


jtu.register_pytree_node(
    _Static,
    lambda leaf: ((), leaf),
    lambda leaf, _: leaf.value,  # pyright: ignore[reportArgumentType]
)


def leaf_sources(
    template: Sequence[object],
    dynamic_positions: list[int],
    passthrough: list[tuple[int, int]],
) -> list[tuple[str, Any]]:
    """Where each leaf of an output comes from: `("out", i)`, the traced leaf `i`;
    `("input", p)`, the call's leaf `p`; `("constant", value)`, `template`'s."""
    sources: list[tuple[str, Any]] = [("constant", leaf) for leaf in template]
    for i, position in enumerate(dynamic_positions):
        sources[position] = ("out", i)
    for position, input_position in passthrough:
        sources[position] = ("input", input_position)
    return sources


def _builder(
    treedef: PyTreeDef,
    template: Sequence[object],
    dynamic_positions: list[int],
    passthrough: list[tuple[int, int]],
    copies: list[int],
) -> Callable[[Any, list[Any]], Any]:
    """`build(out, inputs)`: the output's leaves taken at once from a pool of the
    traced leaves `out`, this call's inputs handed back and `template`'s static
    leaves; NumPy arrays at `copies` copied."""
    from_pool = [*dynamic_positions, *(position for position, _ in passthrough)]
    pooled = set(from_pool)
    static = [p for p in range(len(template)) if p not in pooled]
    constants = tuple(template[p] for p in static)
    order = [*from_pool, *static]
    # Each leaf's place in the pool: the inverse of `order`.
    take = items_getter(sorted(range(len(order)), key=order.__getitem__))
    unflatten = treedef.unflatten
    if not passthrough and not copies:
        return lambda out, inputs=None: unflatten(take((*out, *constants)))
    take_inputs = items_getter([position for _, position in passthrough])

    def build(out: Sequence[object], inputs: Sequence[object]) -> Any:
        leaves = take((*out, *take_inputs(inputs), *constants))
        if copies:
            leaves = list(leaves)
            for position in copies:  # nested, as undecorated: each call its own
                leaves[position] = leaves[position].copy()
        return unflatten(leaves)

    return build


class OutputSpec:
    """What of an output the call must finish, made by a trace and carried with it
    as `Carried`'s auxiliary data; compared by identity. One spec serves calls at
    every level, as JAX may reuse a trace made at one level for a call at another:
    a concrete array the function returns is an output of the jit (what a top-level
    call returns, as under `jax.jit`) and kept as it is (what a nested call returns,
    as without the decorator)."""

    __slots__ = (
        "aliases",
        "runtime_check",
        "dynamic_positions",
        "build",
        "build_nested",
        "plain",
        "leaf_sources",
        "handed",
        "orders",
    )

    def __init__(
        self,
        treedef: PyTreeDef,
        leaves: Sequence[object],
        inputs: Sequence[object],
        runtime_check: bool,
        orders: tuple[tuple[object, ...], ...] | None,
        handed: "HandedNodes | None" = None,
    ):
        input_positions: dict[int, list[int]] = {}
        for position, leaf in enumerate(inputs):
            if not isinstance(leaf, Tracer):
                input_positions.setdefault(id(leaf), []).append(position)
        dynamic: list[int] = []
        passthrough: list[tuple[int, int]] = []
        concrete: dict[int, Any] = {}  # by position: a concrete array, kept nested
        aliases: set[tuple[int, ...]] = set()
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, Tracer):
                dynamic.append(position)
            elif id(leaf) in input_positions:
                # The call's own object, not the traced call's, nor held by the spec
                # (JAX keeps it): an object keyed by identity is freed with its caller.
                positions = input_positions[id(leaf)]
                passthrough.append((position, positions[0]))
                # Where `==` is identity, the key already tells aliases apart; an
                # immutable value's identity is nothing a program can rely on.
                if len(positions) > 1 and not identity_is_moot(type(leaf)):
                    aliases.add(tuple(positions))
            elif is_array(leaf):
                dynamic.append(position)
                concrete[position] = leaf
        # Groups of input positions that held one object when traced, of which one
        # came back: its entry serves only calls in which each group holds one object
        # (`Entry.serves`); the others are keyed by which inputs are one object.
        self.aliases = tuple(aliases)
        self.runtime_check = runtime_check
        self.dynamic_positions = tuple(dynamic)
        pooled = {*dynamic, *(position for position, _ in passthrough)}
        template = [None if p in pooled else leaf for p, leaf in enumerate(leaves)]
        # `build(out, inputs)`: a top-level call's output from the traced leaves and
        # the call's leaves.
        self.build = _builder(treedef, template, dynamic, passthrough, [])
        # `build_nested(out, inputs)`: a nested call's, whose concrete arrays are the
        # function's own (a NumPy array copied, each call its own, as undecorated)
        # and whose dicts are in their insertion order, which JAX's rebuild sorts.
        self.build_nested = self.build
        if concrete:
            kept = [i for i, p in enumerate(dynamic) if p not in concrete]
            nested = _builder(
                treedef,
                [concrete.get(p, leaf) for p, leaf in enumerate(template)],
                [dynamic[i] for i in kept],
                passthrough,
                [p for p, leaf in concrete.items() if isinstance(leaf, np.ndarray)],
            )
            take = items_getter(kept)
            self.build_nested = lambda out, inputs: nested(take(out), inputs)
        if runtime_check:  # the traced leaves end with the check's marker
            build, build_nested = self.build, self.build_nested
            self.build = lambda out, inputs: build(out[:-1], inputs)
            self.build_nested = lambda out, inputs: build_nested(out[:-1], inputs)
        if orders is not None and handed is None:
            unordered = self.build_nested
            self.build_nested = lambda out, inputs: restore_orders(
                unordered(out, inputs), orders
            )
        # Nested, the caller's own containers that the function handed back (see
        # `HandedNodes`), found in the call's pytree; then the other dicts ordered.
        self.handed = handed
        self.orders = orders
        # Whether a top-level call needs nothing but `build`; then the output's
        # structure and where its leaves come from, so that a hit may build it
        # inline (see `_fastpath.hit_caller`).
        self.plain = not (aliases or runtime_check)
        self.leaf_sources = None
        if self.plain:
            self.leaf_sources = treedef, leaf_sources(template, dynamic, passthrough)

    def finish_nested(
        self,
        out: object,
        inputs: list[object],
        tree: object,
        nodes: list[object] | None = None,
    ) -> Any:
        """A nested call's output, from the traced leaves `out`, the call's leaves
        `inputs` and its pytree `tree` (whose containers it may hand back), whose
        containers a trace run for this call listed as `nodes` before the function
        ran (`None`: no trace ran, and so nothing changed them)."""
        built = self.build_nested(out, inputs)
        if self.handed is None:
            return built
        view, handed, _ = self.handed
        if nodes is None:
            nodes = container_nodes(tree)
        built = hand_back(built, view, handed, nodes)
        if self.orders is None:
            return built
        skip = frozenset(id(nodes[index]) for index in handed.values())
        return restore_orders(built, self.orders, skip)

    def awaited(self, out: Sequence[object]) -> Any:
        """What of the traced leaves `out` a call outside staged traces waits for:
        with a runtime check, its marker (see `jit_output`)."""
        return [out[-1]] if self.runtime_check else None


class Carried(Exception):
    """An output finished by the caller, `Carried(spec, traced leaves)`. Never
    raised: an `Exception` for its constructor alone, C code, which JAX calls on
    every call (the node's unflatten)."""

    __slots__ = ()

    @property
    def spec(self) -> OutputSpec:
        return self.args[0]

    @property
    def leaves(self) -> Any:
        return self.args[1]


jtu.register_pytree_node(
    Carried,
    lambda carried: (carried.args[1], carried.args[0]),
    Carried,  # pyright: ignore[reportArgumentType]
)


def finish(out: object, inputs: list[object]) -> Any:
    """The user's output from what the jitted function returned (or its shapes,
    from `eval_shape`), for a top-level call with leaves `inputs`."""
    if type(out) is Carried:
        return out.spec.build(out.leaves, inputs)
    return out


class HandedNodes(NamedTuple):
    """Where an output holds containers of the call that the function handed back,
    unchanged (no traced leaf): `view`, the output's structure with each of them a
    leaf, and by leaf position of `view`, the container's index among the call's
    (`_structure.container_nodes`). Nested, such a call's output holds the
    caller's own containers, as the undecorated function's does."""

    view: PyTreeDef
    positions: dict[int, int]
    ids: frozenset[int]  # of the containers handed back, in this trace


class ContainerIndex(NamedTuple):
    """The containers of a call's pytree (`nodes`, see `_structure.container_nodes`),
    listed before the function ran, and by id the index of each that holds no
    tracer and is met once (a container passed at two places is not told apart:
    which one a later call hands back, where they are two, only its trace could
    say); in `nodes`, every other container is `None`."""

    nodes: list[Any]
    positions: dict[int, int]


def container_index(call: object) -> ContainerIndex:
    """The `ContainerIndex` of the pytree `call`, before the function runs."""
    nodes = container_nodes(call)
    counts = collections.Counter(map(id, nodes))
    index = {}
    for position, node in enumerate(nodes):
        if counts[id(node)] == 1 and not any(
            isinstance(leaf, Tracer) for leaf in jtu.tree_leaves(node)
        ):
            index[id(node)] = position
    # Only those indexed are ever handed back: the others, which may hold tracers,
    # are not kept (a trace's record must outlive none of its tracers).
    kept = [node if id(node) in index else None for node in nodes]
    return ContainerIndex(kept, index)


def _handed_nodes(output: object, containers: ContainerIndex) -> HandedNodes | None:
    """The containers of the call that `output` holds (see `HandedNodes`)."""
    index = containers.positions
    if not index:
        return None
    leaves, view = jtu.tree_flatten(output, is_leaf=lambda x: id(x) in index)
    positions = {
        p: index[id(leaf)] for p, leaf in enumerate(leaves) if id(leaf) in index
    }
    if not positions or shape_of(view)[1]:
        return None
    ids = frozenset(id(leaves[p]) for p in positions)
    return HandedNodes(view, positions, ids)


class FilledContainers:
    """The containers a nested call's caller passed or can reach through them (a
    dict, a list, an object's attributes: a Module's fields, a namespace's), each
    with its name in the user's terms and the ids of what it held before the
    function ran: a traced value the function stores in one would leak to the
    caller, a tracer of a trace that has ended."""

    def __init__(self, named: list[tuple[str, Any]]):
        # (label, the argument's label, the container, whether its keys are
        # attributes, the ids it held)
        self.found: list[tuple[str, str, Any, bool, set[int]]] = []
        seen: set[int] = set()
        pending = [(label, label, value) for label, value in named]
        while pending and len(self.found) < _MAX_FILLED:
            label, argument, value = pending.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            opened = _opened(value)
            if opened is None:
                continue
            container, attributes = opened
            items = _items(container)
            if type(container) is not tuple:
                ids = {id(v) for _, v in items}
                self.found.append((label, argument, container, attributes, ids))
            pending += [
                (_at(label, key, attributes), argument, item) for key, item in items
            ]

    def check(self, name: str) -> None:
        """Raises where the function stored a new tracer in one of them."""
        for label, argument, container, attributes, before in self.found:
            for key, value in _items(container):
                if isinstance(value, Tracer) and id(value) not in before:
                    raise TypeError(
                        f"{name} stored a traced value in "
                        f"`{_at(label, key, attributes)}`, a container its caller "
                        f"passed in `{argument}`, inside a nested call: the caller "
                        "would read a tracer of a trace that has ended. Return the "
                        "value instead (`return out, value`), and store it where "
                        "the function is called."
                    )


def _opened(value: object) -> tuple[Any, bool] | None:
    """The container of `value` a function can store into, and whether its keys
    are attribute names: a dict, list or tuple itself; an object's own
    `__dict__` (a Module's fields, a namespace's); `None` for anything else (a
    leaf, a class, a function, a module, an array)."""
    kind = type(value)
    if kind is dict or kind is list or kind is tuple:
        return value, False
    if isinstance(
        value, (type, types.FunctionType, types.ModuleType, Tracer)
    ) or is_array(value):
        return None
    try:
        namespace = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return None
    return (namespace, True) if type(namespace) is dict else None


def _items(container: Any) -> list[tuple[Any, Any]]:
    if type(container) is dict:
        return list(container.items())
    return list(enumerate(container))


def _at(label: str, key: object, attribute: bool) -> str:
    """The name of `label`'s item or attribute `key`."""
    return f"{label}.{key}" if attribute else f"{label}[{key!r}]"


# Containers looked at for values stored in them, per call (a bound on the walk).
_MAX_FILLED = 1000


def jit_output(
    output: object,
    inputs: Sequence[object],
    runtime_check: bool,
    boxed: bool,
    containers: ContainerIndex | None = None,
) -> Any:
    """What the jitted function returns for the user's `output`, traced with
    `inputs` (the call's leaves, tracers for traced ones): every array leaf is an
    output of the jit, as in `jax.jit`. `boxed`: keep the user's structure (for
    `out_shardings`, a prefix of it); inputs handed back are then the traced
    call's (equal to this call's: they are keyed by value). `containers`: the
    call's, which it may hand back."""
    leaves, treedef = jtu.tree_flatten(output)
    handed = None if containers is None else _handed_nodes(output, containers)
    # Dicts whose order JAX's rebuild changes: restored for nested calls (not in
    # the containers handed back, which are the caller's own).
    skip = frozenset() if handed is None else handed.ids
    found = dict_orders(output, skip)
    in_order = not found or found == dict_orders(treedef.unflatten(leaves))
    if not runtime_check and in_order and all(isinstance(x, Tracer) for x in leaves):
        return output
    if boxed:
        return treedef.unflatten(
            [leaf if is_array(leaf) else _Static(leaf) for leaf in leaves]
        )
    orders = None if in_order else found
    spec = OutputSpec(treedef, leaves, inputs, runtime_check, orders, handed)
    traced = [leaves[p] for p in spec.dynamic_positions]
    if runtime_check:
        # A marker for the call to wait for, which raises a check failed in the
        # executable: a constant, neither batched nor differentiated, so a concrete
        # array under eager transforms too (the traced leaves are tracers there).
        traced.append(jnp.zeros((), np.int32))
    return Carried(spec, traced)
