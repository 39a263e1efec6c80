"""An export's call returns what `filter_jit` of the function returns, once loaded
too: node by node in flatten order, static data included; what cannot be exported
is refused at export, naming the value and the fix."""

import dataclasses
import os
import subprocess
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from differential import assert_tree_allclose
from helpers import subprocess_env

import filterjit


def _both(exported: filterjit.Exported) -> list[filterjit.Exported]:
    """The export as made, and as loaded from its payload."""
    return [exported, filterjit.deserialize(exported.serialize())]


# Declared `mean` then `scale`; flattened `scale` then `mean`.
@dataclasses.dataclass(frozen=True)
class _Statistics:
    mean: jax.Array
    scale: jax.Array
    name: str


jax.tree_util.register_dataclass(
    _Statistics, data_fields=["scale", "mean"], meta_fields=["name"]
)
filterjit.register_serializable(_Statistics)


def _statistics(x: jax.Array) -> _Statistics:
    return _Statistics(x.mean(), x.std(), "x")


def test_a_dataclass_flattened_in_another_order_comes_back_as_returned() -> None:
    # Finding 9: the loaded call filled the fields in declaration order, not in
    # the order the program returns them (flatten order): `mean` and `scale`
    # came back swapped.
    x = jnp.arange(6.0)
    expected = filterjit.filter_jit(_statistics)(x)
    for served in _both(filterjit.export(_statistics)(x)):
        found = served.call(x)
        assert type(found) is _Statistics and found.name == "x"
        assert_tree_allclose(found, expected)
        assert float(found.mean) == float(x.mean())


class _Sized(eqx.Module):
    values: jax.Array
    count: Any = eqx.field(static=True)


def _sized(xs: jax.Array) -> _Sized:
    return _Sized(xs * 2, xs.shape[0])


def test_a_symbolic_size_in_a_static_field_is_refused_at_export() -> None:
    # Finding 10: it came back as JAX's symbolic `b` (`filter_jit` gives 5), and
    # `serialize()` then refused it.
    (batch,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((batch,), jnp.float32)
    with pytest.raises(TypeError, match=r"`output.count` is the symbolic size `b`"):
        filterjit.export(_sized)(spec)
    # As a leaf, it is the call's size.
    counted = filterjit.export(lambda xs: (xs * 2, xs.shape[0]))(spec)
    for served in _both(counted):
        assert served.call(jnp.ones(5))[1] == 5


def _join(x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.concatenate([x, y])


@pytest.mark.parametrize("name", ["in", "None", "if", "lambda", "True"])
def test_dimensions_named_as_python_keywords_check_calls(name: str) -> None:
    # Finding 11: the size check read JAX's text with Python's parser, so that
    # every call of such an export failed, correct ones included.
    (size,) = jax.export.symbolic_shape(name)
    x = jax.ShapeDtypeStruct((size,), jnp.float32)
    y = jax.ShapeDtypeStruct((2 * size,), jnp.float32)
    for served in _both(filterjit.export(_join)(x, y)):
        assert served.call(jnp.ones(3), jnp.ones(6)).shape == (9,)
        with pytest.raises(TypeError, match=rf"`y.shape\[0\]` is 7, .* `{name}` = 3"):
            served.call(jnp.ones(3), jnp.ones(7))


def _with_defaults(x: jax.Array, n: int = 3, mode: Any = None) -> jax.Array:
    return x * n if mode is None else x


def test_defaults_passed_explicitly_are_the_call_that_leaves_them() -> None:
    # Finding 12: exported as `f(x, 3, None)`, `call(x)` was refused, though the
    # reverse works and `filter_jit` treats both as one call.
    x = jnp.arange(3.0)
    for exported in (
        filterjit.export(_with_defaults)(x, 3, None),
        filterjit.export(_with_defaults)(x, n=3),
        filterjit.export(_with_defaults)(x),
    ):
        for served in _both(exported):
            for call in (
                lambda: served.call(x),
                lambda: served.call(x, 3),
                lambda: served.call(x, 3, None),
                lambda: served.call(x, mode=None),
            ):
                assert_tree_allclose(call(), x * 3)
            with pytest.raises(ValueError, match="static argument `n` was 3"):
                served.call(x, 4)


def _checked(x: jax.Array) -> jax.Array:
    return eqx.error_if(x, x < 0, "negative") * 2


def test_a_runtime_check_is_named_at_export_with_the_way_to_export() -> None:
    # Finding 14: JAX's raw `NotImplementedError: serialization of host_callbacks
    # is not yet implemented`, naming neither the check nor the fix.
    with pytest.raises(TypeError) as caught:
        filterjit.export(_checked)(jnp.ones(3))
    message = str(caught.value)
    assert "_checked: cannot export a program that calls back into Python" in message
    assert "an Equinox runtime check (`eqx.error_if`" in message
    assert "EQX_ON_ERROR=nan" in message and "throw=False" in message


# Run with `EQX_ON_ERROR=nan`, as the error says: exported and served.
CHECKS_AS_NANS = """
import equinox as eqx, jax.numpy as jnp
import filterjit

def checked(x):
    return eqx.error_if(x, x < 0, "negative") * 2

served = filterjit.deserialize(filterjit.export(checked)(jnp.ones(3)).serialize())
print(served.call(jnp.ones(3)).tolist(), served.call(-jnp.ones(3)).tolist())
"""


def test_with_equinox_checks_made_nans_the_export_works() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECKS_AS_NANS],
        capture_output=True,
        text=True,
        env=subprocess_env(EQX_ON_ERROR="nan"),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "[2.0, 2.0, 2.0] [nan, nan, nan]"
    assert os.environ.get("EQX_ON_ERROR") != "nan"  # this process's is unchanged
