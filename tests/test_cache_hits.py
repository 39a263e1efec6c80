"""What a cache hit must read again or tell apart, each against the undecorated
function, at the top level and nested: a Module (or a Module default) changed in
place, callables bound to other receivers, frozensets of equal numbers of other
types; and the table of call structures stays bounded."""

import differential
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

from filterjit import _dispatch, filter_jit


class Weighted(eqx.Module):
    w: jax.Array


def _at(where: str, fun, *args):
    """`fun(*args)` at the top level, or nested in a new outer trace that closes
    over `args` (so that they stay concrete there): the harness's contexts."""
    context = differential.contexts("top level" if where == "top" else "jit")[0]
    return context.apply(lambda _: fun(*args), jnp.zeros(()))


def _times_w(m, x):
    return m.w * x


# Guards: a Module's field set in place is read on the next hit.
@pytest.mark.parametrize("where", ["top", "nested"])
@pytest.mark.parametrize("how", ["object.__setattr__", "__dict__"])
def test_a_module_changed_in_place_is_read_again(where, how):
    x = jnp.ones(3)
    m = Weighted(jnp.ones(3))
    g = filter_jit(_times_w)
    for _ in range(2):  # the second call is a hit, on the fast path
        assert (_at(where, g, m, x) == _at(where, _times_w, m, x)).all()
    if how == "__dict__":
        vars(m)["w"] = 5 * jnp.ones(3)  # pyright: ignore[reportIndexIssue]
    else:
        object.__setattr__(m, "w", 5 * jnp.ones(3))
    expected = _at(where, _times_w, m, x)
    assert (expected == 5.0).all()
    assert (_at(where, g, m, x) == expected).all()


DEFAULT = Weighted(jnp.ones(3))


def _times_default(x, m=DEFAULT):
    return m.w * x


# Guards: a Module default's field set in place is read on the next hit.
@pytest.mark.parametrize("where", ["top", "nested"])
def test_a_module_default_changed_in_place_is_read_again(where):
    x = jnp.ones(3)
    g = filter_jit(_times_default)
    before = DEFAULT.w
    try:
        for _ in range(2):
            assert (_at(where, g, x) == 1.0).all()
        object.__setattr__(DEFAULT, "w", 3 * jnp.ones(3))
        expected = _at(where, _times_default, x)
        assert (expected == 3.0).all()
        assert (_at(where, g, x) == expected).all()
    finally:
        object.__setattr__(DEFAULT, "w", before)


class Scaler:
    def __init__(self, k: int):
        self.k = k


def _scale(scaler: Scaler, x):
    return scaler.k * x


class Bound:
    """A method-like callable that is not a `types.MethodType`."""

    def __init__(self, func, receiver):
        self.__func__, self.__self__ = func, receiver

    def __call__(self, *args):
        return self.__func__(self.__self__, *args)


# Guards: a method-like callable's receiver is part of its call.
@pytest.mark.parametrize("where", ["top", "nested"])
def test_method_like_callables_with_other_receivers_are_other_functions(where):
    x = jnp.ones(2)
    for k in (2, 3, 4):
        bound = Bound(_scale, Scaler(k))
        assert (_at(where, filter_jit(bound), x) == _at(where, bound, x)).all()
        assert (_at(where, filter_jit(bound), x) == k).all()


def _first_tag(tags):
    (tag,) = tags
    return jnp.asarray(tag)


# Guards: frozensets are keyed by their elements' types too.
@pytest.mark.parametrize("where", ["top", "nested"])
def test_frozensets_of_equal_numbers_of_other_types_are_other_keys(where):
    g = filter_jit(_first_tag)

    def at(tags):
        if where == "top":
            return g(tags)
        return jax.jit(lambda: g(tags))()

    for tag in (1, 1.0, True, 1, 1.0):
        tags = frozenset({tag})
        assert at(tags).dtype == _first_tag(tags).dtype


class Tagged(eqx.Module):
    tags: frozenset = eqx.field(static=True)


# Guards: a Module's static frozenset is keyed by its elements' types.
def test_a_module_static_frozenset_is_keyed_by_its_elements_types():
    g = filter_jit(lambda m: _first_tag(m.tags))
    for tag in (1, 1.0, 1):
        m = Tagged(frozenset({tag}))
        assert g(m).dtype == _first_tag(m.tags).dtype


# Guards: the table of call structures forgets, within its bound.
def test_the_table_of_call_structures_is_bounded(monkeypatch):
    monkeypatch.setattr(_dispatch, "TOP_MAXSIZE", 8)
    g = filter_jit(lambda x, d: x)
    x = jnp.ones(1)
    for n in range(20):
        g(x, {f"key{n}": 1})  # a structure of its own each time
    dispatcher = g._dispatcher
    assert len(dispatcher.routes[0]) <= 8
    assert len(dispatcher._programs) <= 8
    assert (g(x, {"key0": 1}) == x).all()  # forgotten, made again
