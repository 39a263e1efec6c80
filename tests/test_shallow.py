"""The path that takes the leaves of flat arguments without flattening them
(`filterjit/_shallow.py`), checked against `jax.tree_util` itself.

Whenever `leaves_of` accepts a call for the kinds recorded from another call, JAX's
own flatten of that call must give the recorded structure and leaf types, and the
same leaves in the same order. Calls are generated in pairs, the second often a
near miss of the first (an item of another type, another length, a list for a
tuple, a list subclass, a namedtuple, `None`, a nested sequence, a NumPy array
where a jax Array was, `True` where `1` was).
"""

import collections
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from helpers import property_settings
from hypothesis import given, strategies as st

import filterjit
from filterjit import _dispatch
from filterjit._shallow import argument_kinds, leaves_of


Pair = collections.namedtuple("Pair", "first second")


class MyList(list):
    pass


_leaves = st.sampled_from(
    [
        jnp.ones(2),
        jnp.zeros((), dtype=jnp.int32),
        np.ones(2, dtype=np.float32),
        np.float32(1.0),
        1.0,
        -0.0,
        2,
        True,
        1j,
        "a",
        None,
    ]
)
_same_type_items = st.sampled_from([jnp.ones(2), 1.0, 3, np.ones(1), "s"]).flatmap(
    lambda leaf: st.lists(st.just(leaf), max_size=40)
)


def _arguments(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    items = st.one_of(_same_type_items, st.lists(leaves, max_size=5))
    return st.one_of(
        leaves,
        items,
        items.map(tuple),
        items.map(MyList),
        st.tuples(leaves, leaves).map(lambda t: Pair(*t)),
        st.lists(st.lists(leaves, max_size=2), max_size=2),
        st.dictionaries(st.sampled_from("ab"), leaves, max_size=2),
    )


_calls = st.lists(_arguments(_leaves), max_size=4).map(tuple)

# Calls whose arguments are all leaves or sequences of leaves of one type.
_flat_leaves = _leaves.filter(lambda leaf: leaf is not None)
_flat_calls = st.lists(
    st.one_of(_flat_leaves, _same_type_items, _same_type_items.map(tuple)),
    max_size=4,
).map(tuple)

# A leaf of a type close to a given one's: what an `isinstance` check would let by.
_CLOSE = {int: True, float: np.float64(1.0), bool: 1}


def _twin(arg: Any) -> Any:
    """A container that holds what `arg` holds but flattens otherwise."""
    if type(arg) is list:
        return MyList(arg)
    if len(arg) == 2:
        return Pair(*arg)
    return list(arg)


def _near_miss(args: tuple[Any, ...], data: st.DataObject) -> tuple[Any, ...]:
    """`args` changed in one place."""
    if not args:
        return (data.draw(_arguments(_leaves)),)
    index = data.draw(st.integers(0, len(args) - 1))
    arg = args[index]
    sequence = type(arg) in (list, tuple)
    change = data.draw(st.sampled_from(["argument", "item", "twin", "close", "drop"]))
    if change == "item" and sequence and arg:
        items = list(arg)
        items[data.draw(st.integers(0, len(arg) - 1))] = data.draw(_leaves)
        new = type(arg)(items)
    elif change == "twin" and sequence:
        new = _twin(arg)
    elif change == "close" and type(arg) in _CLOSE:
        new = _CLOSE[type(arg)]
    elif change == "close" and sequence and arg and type(arg[0]) in _CLOSE:
        new = type(arg)([_CLOSE[type(arg[0])], *arg[1:]])
    elif change == "drop" and sequence and arg:
        new = arg[:-1]
    elif change == "drop":
        return args[:index] + args[index + 1 :]
    else:
        new = data.draw(_arguments(_leaves))
    return (*args[:index], new, *args[index + 1 :])


def _check(recorded: tuple[Any, ...], call: tuple[Any, ...]) -> None:
    leaves, treedef = jtu.default_registry.flatten(recorded)
    types = tuple(map(type, leaves))
    kinds = argument_kinds(treedef, types)
    if kinds is None:
        return
    # The recorded call itself is always accepted, with JAX's leaves.
    own = leaves_of(recorded, kinds)
    assert own is not None
    assert len(own) == len(leaves) and all(map(lambda a, b: a is b, own, leaves))
    taken = leaves_of(call, kinds)
    if taken is None:
        return
    jax_leaves, jax_treedef = jtu.default_registry.flatten(call)
    assert jax_treedef == treedef
    assert tuple(map(type, jax_leaves)) == types
    assert len(taken) == len(jax_leaves)
    assert all(map(lambda a, b: a is b, taken, jax_leaves))


@property_settings()
@given(_calls, _calls)
def test_accepts_only_what_jax_flattens_alike(recorded, call):
    _check(recorded, call)


@property_settings()
@given(st.one_of(_flat_calls, _calls), st.data())
def test_near_misses(recorded, data):
    _check(recorded, recorded)
    call = recorded
    for _ in range(3):
        call = _near_miss(call, data)
        _check(recorded, call)


def _all_near_misses(args: tuple[Any, ...]):
    """Every one-place change of `args` that `_near_miss` can make, but drawing
    replacements from a fixed list."""
    replacements = [jnp.ones(2), np.ones(2, dtype=np.float32), 1.0, 1, True, None]
    for index, arg in enumerate(args):
        around = (args[:index], args[index + 1 :])
        yield around[0] + around[1]
        news = list(replacements)
        if type(arg) in _CLOSE:
            news.append(_CLOSE[type(arg)])
        if type(arg) in (list, tuple):
            news += [_twin(arg), list(arg), tuple(arg), arg[:-1], type(arg)([*arg, 1])]
            for item in range(len(arg)):
                for leaf in replacements:
                    news.append(type(arg)([*arg[:item], leaf, *arg[item + 1 :]]))
                if type(arg[item]) in _CLOSE:
                    close = _CLOSE[type(arg[item])]
                    news.append(type(arg)([*arg[:item], close, *arg[item + 1 :]]))
        for new in news:
            yield (*around[0], new, *around[1])


@pytest.mark.parametrize(
    "recorded",
    [
        ([jnp.ones(2)] * 3, 1.0),
        ((1, 2, 3), "s", np.float32(1.0)),
        ([1.0, 2.0], [True, False], 2),
        ((jnp.ones(2), jnp.ones(3)), []),
        (np.ones(2), 1j, ()),
    ],
)
def test_every_near_miss_of_a_flat_call(recorded):
    for call in _all_near_misses(recorded):
        _check(recorded, call)


def test_which_calls_have_kinds():
    array = jnp.ones(2)

    def kinds(*args):
        leaves, treedef = jtu.default_registry.flatten(args)
        return argument_kinds(treedef, tuple(map(type, leaves)))

    assert kinds([array] * 3, 1.0) == ((list, type(array), 3), (float, None, 1))
    assert kinds((1, 2), "s", np.float32(1)) == (
        (tuple, int, 2),
        (str, None, 1),
        (np.float32, None, 1),
    )
    assert kinds([]) is not None
    assert kinds() == ()
    # Mixed item types, nested sequences, other containers and None: flattened.
    assert kinds([array, 1.0]) is None
    assert kinds([[array]]) is None
    assert kinds({"a": array}) is None
    assert kinds(Pair(1, 2)) is None
    assert kinds(MyList([1])) is None
    assert kinds(None) is None
    assert kinds(array, None) is None
    assert kinds(object()) is None  # a static of a type that might be a node


def test_repeated_flat_calls_are_not_flattened(monkeypatch):
    f = filterjit.filter_jit(lambda xs, k: [x * k for x in xs])
    xs = [jnp.ones(2), jnp.full(2, 2.0)]
    f(xs, 3.0)
    flattened = []
    flatten = _dispatch._flatten
    monkeypatch.setattr(
        _dispatch, "_flatten", lambda tree: flattened.append(1) or flatten(tree)
    )
    out = f(xs, 3.0)
    assert flattened == []
    assert [float(o[1]) for o in out] == [3.0, 6.0]
    # A near miss takes the full path, and is right.
    out = f([*xs, np.ones(2, dtype=np.float32)], 3.0)
    assert flattened == [1]
    assert [float(o[1]) for o in out] == [3.0, 6.0, 3.0]


@pytest.mark.parametrize("nested", [False, True])
def test_alternating_near_misses_match_the_undecorated_function(nested):
    def fun(xs, k):
        total = sum(
            jnp.sum(jnp.asarray(x, dtype=jnp.float32)) * (i + 1)
            for i, x in enumerate(xs)
        )
        return total * k

    f = filterjit.filter_jit(fun)
    a, b = jnp.ones(2), jnp.full(2, 3.0)
    calls = [
        ([a, b], 2.0),
        ([a, b], 3),
        ((a, b), 2.0),
        ([a, b, a], 2.0),
        ([a, np.full(2, 3.0, dtype=np.float32)], 2.0),
        ([1.0, 2.0], 2.0),
        ([1.0, 5.0], 2.0),
        ([1, 2], 2.0),
        ([True, False], 2.0),
        (Pair(a, b), 2.0),
        ([b, a], 2.0),
    ]
    for args in calls * 2:
        if nested:
            got = jax.jit(lambda: f(*args))()
        else:
            got = f(*args)
        np.testing.assert_allclose(got, fun(*args))
