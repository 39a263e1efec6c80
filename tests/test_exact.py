"""Static values that `==` takes for one are keyed apart (`filterjit/_exact.py`):
`key` checked against a reference on generated values, then a Module's
static fields (`scale=1` against `scale=1.0`) on every path a call can take.
"""

import struct
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from differential import assert_tree_allclose
from helpers import property_settings
from hypothesis import assume, given, strategies as st

from filterjit import filter_jit
from filterjit._exact import exact_aux, key


# The scalars, in classes of values that `==` confuses.
_CONFUSED = [
    [0, False, 0.0, -0.0, np.float64(-0.0)],
    [1, True, 1.0, 1 + 0j, np.float32(1.0), np.int32(1)],
    [2, 2.0],
    [float("nan")],
    [1j],
    ["s"],
    [None],
]
_CLASS_OF = {id(x): confused for confused in _CONFUSED for x in confused}
_scalars = st.sampled_from([x for confused in _CONFUSED for x in confused])
_values = st.recursive(
    _scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
    ),
    max_leaves=6,
)


def _reference(x: Any) -> Any:
    """Independently of `key`: a value's types all the way down, floats by
    their bits."""
    if type(x) in (tuple, list):
        return type(x), tuple(map(_reference, x))
    if isinstance(x, np.generic):
        return type(x), x.tobytes()
    if isinstance(x, float | complex):
        parts = (complex(x).real, complex(x).imag)
        return type(x), tuple(struct.pack("<d", part) for part in parts)
    return type(x), repr(x)


def _keyed(x: Any) -> Any:
    """`x` as a cache keys it."""
    return key(x)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except ValueError:  # a NumPy scalar against a sequence: an array of results
        return False


def _confusable(value: Any) -> st.SearchStrategy[Any]:
    """Values of the shape of `value`, each scalar one that `==` confuses with it
    (itself included)."""
    if type(value) in (tuple, list):
        return st.tuples(*map(_confusable, value)).map(type(value))
    return st.sampled_from(_CLASS_OF[id(value)])


# NumPy 2.0 warns where the test compares a drawn pair holding an empty array.
@pytest.mark.filterwarnings("ignore:The truth value of an empty array")
@property_settings()
@given(
    st.one_of(
        st.tuples(_values, _values),
        _values.flatmap(lambda a: st.tuples(st.just(a), _confusable(a))),
    )
)
def test_key_tells_apart_what_eq_confuses(pair):
    a, b = pair
    # Only pairs `==` confuses (or equal by the reference: nan): `==` already
    # tells the others apart.
    assume(_equal(a, b) or _reference(a) == _reference(b))
    assert (_keyed(a) == _keyed(b)) == (_reference(a) == _reference(b))


class Scaled(eqx.Module):
    weight: jax.Array
    scale: Any = eqx.field(static=True)

    @filter_jit
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        scale = jnp.asarray(self.scale)
        return (x * self.weight).astype(scale.dtype) * scale, 1 / scale.astype(float)


_X = jnp.arange(1, 4, dtype=jnp.int32)


def _undecorated(model: Scaled, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    scale = jnp.asarray(model.scale)
    return (x * model.weight).astype(scale.dtype) * scale, 1 / scale.astype(float)


@pytest.mark.parametrize("scales", [(1, 1.0), (1.0, 1), (0.0, -0.0), (True, 1)])
def test_module_static_fields_are_keyed_by_type_and_exact_value(scales):
    weight = jnp.ones(3, dtype=jnp.int32)
    for scale in [*scales, *scales]:
        model = Scaled(weight, scale)
        expected = _undecorated(model, _X)
        # The method (read without flattening), a keyword call (flattened), the
        # Module itself wrapped, and nested.
        assert_tree_allclose(model(_X), expected)
        assert_tree_allclose(model(x=_X), expected)
        assert_tree_allclose(filter_jit(_undecorated)(model, _X), expected)
        assert_tree_allclose(jax.jit(lambda x: model(x))(_X), expected)  # noqa: B023


def test_structures_equal_by_eq_get_their_own_traces():
    # Two structures JAX compares equal: a dict's keys 1 and 1.0.
    @filter_jit
    def key_types(d: dict[Any, Any]) -> list[str]:
        return [type(key).__name__ for key in d]

    assert key_types({1: jnp.ones(1)}) == ["int"]
    assert key_types({1.0: jnp.ones(1)}) == ["float"]
    assert key_types({1: jnp.ones(1)}) == ["int"]
    assert jtu.tree_structure({1: 0}) == jtu.tree_structure({1.0: 0})
    assert exact_aux(jtu.tree_structure({1: 0})) != exact_aux(
        jtu.tree_structure({1.0: 0})
    )


def test_alternating_static_fields_keep_one_trace_each():
    traces = []

    class Counted(eqx.Module):
        scale: Any = eqx.field(static=True)

        @filter_jit
        def __call__(self, x: jax.Array) -> jax.Array:
            traces.append(self.scale)
            return x * self.scale

    x = jnp.ones(2)
    for _ in range(3):
        for scale in (2, 2.0):
            Counted(scale)(x)
    assert [type(scale) for scale in traces] == [int, float]


def test_a_sequence_of_values_that_are_their_own_keys_keys_as_them():
    # Classes, functions and values compared by their own `==` are their own keys
    # (their types beside them), in a sequence as alone: a dict of annotations, say.
    spec = jax.sharding.PartitionSpec("x")
    values = [jax.Array, len, spec, "s", None]
    assert key(values) == (list, (tuple(map(type, values)), tuple(values)))
    assert key(values) != key([jax.Array, len, spec, "s", 0])
    annotations = {"x": jax.Array, "return": jax.Array}
    kinds = (type(jax.Array),) * 2
    assert key(annotations)[1][1] == (kinds, (jax.Array, jax.Array))
