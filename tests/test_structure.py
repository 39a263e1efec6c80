"""Recognising a call's structure again: `filterjit._structure.matcher`, and the
wrapper's latest-call path built on it."""

import collections
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import assert_tree_equal, TraceCounter

import filterjit
from filterjit._partition import MISS, Partition
from filterjit._structure import Keywords, matcher
from filterjit._trace import TOP


Pair = collections.namedtuple("Pair", "first second")
Other = collections.namedtuple("Other", "first second")


class Flat(eqx.Module):
    weight: jax.Array
    bias: jax.Array | np.ndarray
    scale: float = eqx.field(static=True)


class Nested(eqx.Module):
    inner: Flat
    extra: jax.Array | None


class Noisy:
    """A static leaf that records every `repr` of itself."""

    reprs: list[int] = []

    def __repr__(self) -> str:
        Noisy.reprs.append(1)
        return "Noisy()"

    def __hash__(self) -> int:
        return 0

    def __eq__(self, other: object) -> bool:
        return type(other) is Noisy


def _trees() -> list[Any]:
    x = jnp.arange(3.0)
    return [
        (x, 1.0),
        ([x, x], "a"),
        ({"b": x, "a": (None, 2)},),
        (Pair(x, 1),),
        (Flat(x, x, 2.0), x),
        (Nested(Flat(x, x, 2.0), None),),
        Keywords((x,), {"k": 3, "m": [x]}),
        ((), [], {}, None),
        (collections.OrderedDict(b=x, a=1),),
        (jtu.Partial(lambda a, b: a, x),),
    ]


@pytest.mark.parametrize("tree", _trees())
def test_matcher_takes_the_leaves_of_the_same_structure(tree):
    leaves, treedef = jtu.tree_flatten(tree)
    match = matcher(treedef)
    taken = match(tree)
    assert taken is not None
    assert len(taken) == len(leaves)
    assert all(a is b for a, b in zip(taken, leaves))
    # Equal but new containers too.
    rebuilt = jtu.tree_unflatten(treedef, leaves)
    assert match(rebuilt) is not None


def _first(*args: Any) -> Any:
    return args[0]


def _second(*args: Any) -> Any:
    return args[1]


def _mismatches() -> list[tuple[Any, Any]]:
    x = jnp.arange(3.0)
    loud = Noisy()
    return [
        (([x, loud],), ([x, loud, loud],)),  # list length
        (([x, loud],), ((x, loud),)),  # list to tuple
        (((x, loud),), ((x, loud, x),)),  # tuple length
        (({"a": x, "b": loud},), ({"a": x, "c": loud},)),  # dict keys
        (({"a": x},), ({"a": x, "b": loud},)),
        ((jtu.Partial(_first, x, loud),), (jtu.Partial(_second, x, loud),)),
        ((jtu.Partial(_first, x, loud),), (jtu.Partial(_first, x, loud, x),)),
        ((None, x), ([loud], x)),  # None to a container
        ((Pair(x, loud),), (Other(x, loud),)),  # namedtuple type
        ((Pair(x, loud),), ((x, loud),)),
        ((Flat(x, x, 2.0),), ([loud, loud],)),  # Module to something else
        ((Flat(x, x, 2.0),), (Pair(loud, x),)),
        (Keywords((x,), {"k": loud}), Keywords((x,), {"j": loud})),
        (Keywords((x,), {"k": loud}), ((x,), {"k": loud})),
        ((Nested(Flat(x, x, 2.0), None),), (Nested(Flat(x, x, 2.0), x),)),
        ((Nested(Flat(x, x, 2.0), None),), (Nested(Flat(x, x, 3.0), None),)),
    ]


@pytest.mark.parametrize("old, new", _mismatches())
def test_matcher_rejects_other_structures_without_printing_them(old, new):
    # A mismatch must not `repr` the user's values: the repr of a jax Array copies
    # it to the host.
    _, treedef = jtu.tree_flatten(old)
    Noisy.reprs.clear()
    assert matcher(treedef)(new) is None
    assert Noisy.reprs == []


def test_matcher_takes_leaf_positions_as_they_are():
    # A leaf position accepts anything: the partition's `split` checks types.
    x = jnp.arange(3.0)
    _, treedef = jtu.tree_flatten(([x, 1.0],))
    assert matcher(treedef)(([(1, 2), None],)) == [(1, 2), None]


def test_matched_trees_do_not_flatten_anew():
    x = jnp.arange(3.0)
    tree = (
        [x, 1.0],
        {"a": None},
        Nested(Flat(x, x, 2.0), x),
        Pair(x, (x, 2)),
        jtu.Partial(_first, x, k=2),
    )
    leaves, treedef = jtu.tree_flatten(tree)
    match = matcher(treedef)
    # Only the generic code calls `flatten`.
    assert "flatten" not in match.__globals__
    assert "flatten" in matcher(treedef, generic=True).__globals__
    taken = match(tree)
    assert taken is not None
    assert all(a is b for a, b in zip(taken, leaves, strict=True))


def test_module_fields_are_read_without_module_getattribute(monkeypatch):
    # Equinox's Module.__getattribute__ is what makes its flatten slow.
    x = jnp.arange(3.0)
    tree = (Flat(x, x, 2.0),)
    _, treedef = jtu.tree_flatten(tree)
    match = matcher(treedef)
    monkeypatch.setattr(Flat, "__getattribute__", lambda *a: pytest.fail())
    assert match(tree) == [x, x]


def test_unchecked_structures_get_the_generic_matcher():
    x = jnp.arange(3.0)
    # Containers that generated code does not check: too many of them, node
    # types it does not know, or a Module with wrapper fields (Equinox keeps
    # those in its auxiliary data).
    trees = [
        [(x, 1)] * 300,
        {str(i): x for i in range(2000)},
        (collections.OrderedDict(a=x),),
        (eqx.filter_jit(lambda a: a),),
    ]
    for tree in trees:
        leaves, treedef = jtu.tree_flatten(tree)
        match = matcher(treedef)
        assert "flatten" in match.__globals__
        taken = match(tree)
        assert taken is not None
        assert all(a is b for a, b in zip(taken, leaves, strict=True))
        assert match((tree, 1)) is None


def test_module_static_values_compare_like_the_structure():
    x = jnp.arange(3.0)
    _, treedef = jtu.tree_flatten((Flat(x, x, 2.0),))
    match = matcher(treedef)
    assert match((Flat(x, x, 2.0),)) == [x, x]
    # 2 == 2.0, as in comparing structures (and as jax.jit does).
    assert jtu.tree_structure((Flat(x, x, 2),)) == treedef
    assert match((Flat(x, x, 2),)) == [x, x]
    assert match((Flat(x, x, 3.0),)) is None


def test_alternating_structures_give_the_undecorated_results():
    # The wrapper takes the latest call's path first; every kind of change must
    # fall back to a full lookup, with the right result and no extra trace.
    def f(tree, n):
        return jax.tree.map(lambda a: a * n, tree), n

    counter = TraceCounter(f)
    wrapped = filterjit.filter_jit(counter)
    x = jnp.arange(3.0)
    calls = [
        ([x, x], 2),
        ([x, x, x], 2),
        ((x, x), 2),
        ({"a": x}, 2),
        ({"b": x}, 2),
        ({"a": None}, 2),
        (Flat(x, x, 2.0), 2),
        (Flat(x, x, 3.0), 2),
        (Flat(x, np.ones(3, np.float32), 3.0), 2),
        ([x, x], 2.0),
        ([x, 1.0], 2),
        ([x, x], 2),
    ]
    for _ in range(3):
        for tree, n in calls:
            assert_tree_equal(wrapped(tree, n), f(tree, n))
    # One trace per distinct call: the NumPy array takes the trace of the jax
    # Array before it (same aval), and the last call repeats the first.
    assert counter.count == len(calls) - 2


def test_module_calls_alternating_static_fields():
    x = jnp.arange(3.0)

    class Model(eqx.Module):
        weight: jax.Array
        scale: float = eqx.field(static=True)

        @filterjit.filter_jit
        def __call__(self, y):
            return self.weight * y * self.scale

    models = [Model(x, 2.0), Model(x, 3.0)]
    for _ in range(3):
        for model in models:
            np.testing.assert_allclose(model(x), x * x * model.scale)


def test_module_with_other_fields_in_its_dict_is_not_matched():
    x = jnp.arange(3.0)
    _, treedef = jtu.tree_flatten((Flat(x, x, 2.0),))
    odd = Flat(x, x, 2.0)
    fields = object.__getattribute__(odd, "__dict__")
    del fields["bias"]
    fields["other"] = x
    assert matcher(treedef)((odd,)) is None


def test_repeated_calls_take_the_latest_call_path(monkeypatch):
    # Calls repeating the latest call's structure and leaf types neither flatten
    # nor look a partition up: the cheap path that the dispatch benchmark times.
    from filterjit import _jit

    flattened = []
    flatten = _jit._flatten
    monkeypatch.setattr(
        _jit, "_flatten", lambda tree: flattened.append(1) or flatten(tree)
    )

    class Model(eqx.Module):
        weight: jax.Array
        scale: float = eqx.field(static=True)

        @filterjit.filter_jit
        def __call__(self, y, *, mode="a"):
            return self.weight * y * self.scale

    @filterjit.filter_jit
    def f(tree, n):
        return jax.tree.map(lambda a: a * n, tree)

    class Scaler:
        def __init__(self, factor):
            self.factor = factor

        def scale(self, y):
            return y * self.factor

    x = jnp.arange(3.0)
    model = Model(x, 2.0)
    bound = filterjit.filter_jit(Scaler(3.0).scale)  # a jtu.Partial of the method
    calls = [
        lambda: bound(x),
        lambda: f({"a": [x, x], "b": (None, x)}, 2),
        lambda: f({"a": [x, x], "b": (None, np.ones(3, np.float32))}, 3),
        lambda: model(x),
        lambda: Model(x + 1, 2.0)(x),
        lambda: model(x, mode="b"),
    ]
    for call in calls:
        call()
        flattened.clear()
        for _ in range(3):
            call()
        assert flattened == []


def test_latest_call_path_hands_back_this_calls_inputs():
    @filterjit.filter_jit
    def f(x, tag):
        return x * 2, tag

    x = jnp.arange(3.0)
    for _ in range(3):
        tag = "".join(["ta", "g"])  # equal, but a new object every call
        out, got = f(x, tag)
        assert got is tag
        assert jnp.array_equal(out, x * 2)


def test_latest_call_path_names_an_unhashable_static_every_time():
    f = filterjit.filter_jit(lambda x, options: x)
    x = jnp.arange(3.0)
    f(x, "ok")
    for _ in range(3):  # the first call records the partition that the others try
        with pytest.raises(TypeError, match=r"argument `options` is a static value"):
            f(x, {"not", "hashable"})


def _long_trees() -> list[Any]:
    x = jnp.arange(3.0)
    floats = tuple([0.0, -0.0, float("nan"), 1.5] * 6)
    return [
        ([x] * 20, 2.0),  # a long sequence of traced leaves
        (floats,),  # a long sequence of static leaves, keyed exactly
        ([x, 1.0, "a", np.float32(2.0)] * 6,),  # a long mixed sequence
        ({"a": [x] * 17, "b": [1] * 17, "c": (x, 2)},),
        ([x, x, 1.0],),  # a short one, unpacked
    ]


@pytest.mark.parametrize("tree", _long_trees())
def test_partition_call_and_split_agree(tree):
    # The generated code keys and splits a call the same way from the call's
    # pytree (`call`, the latest call's path) as from its flattened leaves
    # (`split`, the full path), and as the partition's positions say.
    leaves, treedef = jtu.tree_flatten(tree)
    partition = Partition(treedef, tuple(map(type, leaves)), TOP)
    split = partition.split(leaves)
    assert split is not None
    dynamic, key = split
    assert [id(a) for a in dynamic] == [
        id(leaves[p]) for p in partition.dynamic_positions
    ]
    assert len(key) == 1 + len(partition.static_positions)
    seen = []

    def get(found):
        seen.append(found)
        return lambda *traced: [id(a) for a in traced]

    assert partition.call(tree, get) == [id(a) for a in dynamic]
    assert seen == [key]
    # And a leaf of another type is a miss for both.
    position = len(leaves) - 1
    other = list(leaves)
    other[position] = object()
    assert partition.split(other) is None
    assert partition.call(jtu.tree_unflatten(treedef, other), get) is MISS


def test_long_static_sequences_are_keyed_exactly():
    base = [1.5] * 20
    keys = []
    for change in (0.0, -0.0, float("nan"), float("nan")):
        tree = (tuple(base[:-1] + [change]),)
        leaves, treedef = jtu.tree_flatten(tree)
        partition = Partition(treedef, tuple(map(type, leaves)), TOP)
        split = partition.split(leaves)
        assert split is not None
        keys.append(split[1][1:])
    assert keys[0] != keys[1]  # 0.0 and -0.0
    assert keys[2] == keys[3]  # NaN is NaN
