"""The messages users get for their mistakes: filterjit's own errors for a wrong
decoration or a wrong call (an unknown keyword or option, a wrong signature or
count, an unhashable or NumPy-string static value, a wrong `in_shardings` prefix,
an array donated or deleted earlier) name the user's argument and the fix."""

import functools
import gc
import re
import sys
import weakref
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import one_device_sharding

from filterjit import filter_jit


def test_not_callable():
    with pytest.raises(TypeError, match="callable"):
        filter_jit(3)  # pyright: ignore


def test_unexpected_decorator_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        filter_jit(lambda x: x, bogus=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        filter_jit(bogus=1)


def test_unexpected_jit_keyword_is_python_type_error():
    with pytest.raises(TypeError):
        filter_jit(lambda x: x, not_an_option=1)(jnp.ones(1))


def test_bad_donate_and_rejected_jit_options_fail_at_decoration():
    with pytest.raises(ValueError, match="donate='everything'"):
        filter_jit(lambda x: x, donate="everything")  # pyright: ignore
    with pytest.raises(ValueError, match="'y'"):
        filter_jit(lambda x: x, donate=("y",))
    with pytest.raises(
        ValueError, match=r"static_argnums.*filterjit\.jit\(fun, static_"
    ):
        filter_jit(lambda x: x, static_argnums=0)
    with pytest.raises(ValueError, match="donate="):
        filter_jit(lambda x: x, donate_argnums=0)


def test_wrong_signature_raises_type_error():
    @filter_jit
    def f(x, n=1):
        return x * n

    with pytest.raises(TypeError, match="f"):
        f()  # pyright: ignore[reportCallIssue]
    with pytest.raises(
        TypeError, match=r"takes 2 positional arguments \(x, n\) but 3 were given"
    ):
        f(jnp.ones(1), 2, 3)  # pyright: ignore[reportCallIssue]
    with pytest.raises(TypeError, match="unexpected keyword argument 'm'"):
        f(jnp.ones(1), m=2)  # pyright: ignore[reportCallIssue]

    @filter_jit
    def h(x, n):
        return x * n

    # The unknown keyword is named, not only the parameter it left missing.
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument 'm'; the parameters are \(x, n\)"
    ):
        h(jnp.ones(1), m=2)  # pyright: ignore[reportCallIssue]
    with pytest.raises(TypeError, match="multiple values"):
        f(jnp.ones(1), x=2)  # pyright: ignore[reportCallIssue]


def test_a_wrong_count_lists_the_positional_parameters_only():
    class M(eqx.Module):
        @filter_jit
        def f(self, x, *, scale=1.0):
            return x * scale

    with pytest.raises(
        TypeError,
        match=re.escape("takes 2 positional arguments (self, x) but 3 were given"),
    ):
        M().f(jnp.ones(2), 2.0)  # pyright: ignore[reportCallIssue]


def test_unhashable_static_names_the_parameter_and_path():
    @filter_jit
    def f(x, config):
        return x

    # A list is a pytree node; a set is a leaf, and unhashable.
    with pytest.raises(TypeError) as info:
        f(jnp.ones(1), {"opts": (1, {2, 3})})
    message = str(info.value)
    assert "config['opts'][1]" in message
    assert "set" in message
    assert "hashable" in message and "jnp.asarray" in message


def test_unhashable_static_by_keyword_and_nested():
    @filter_jit
    def f(x, *, opts):
        return x

    with pytest.raises(TypeError, match=r"`opts\[0\]`"):
        f(jnp.ones(1), opts=[{1}])
    with pytest.raises(TypeError, match=r"`opts\[0\]`"):
        jax.jit(lambda x: f(x, opts=[{1}]))(jnp.ones(1))


def test_a_numpy_string_array_names_the_argument_and_the_fix():
    f = filter_jit(lambda x, names: x)
    f(jnp.ones(2), np.array([1, 2]))  # the same shape, numbers: cached
    for _ in range(2):  # a miss, then a cached entry's call
        with pytest.raises(TypeError) as info:
            f(jnp.ones(2), np.array(["a", "b"]))
        message = str(info.value)
        assert "argument `names` is a NumPy array of dtype <U1" in message
        assert "tuple of Python values" in message
        assert "static_argnums" not in message
    g = filter_jit(lambda x, names: x)
    with pytest.raises(TypeError, match="argument `names` is a NumPy array"):
        g(jnp.ones(2), np.array(["a", "b"]))


def test_a_wrong_in_shardings_prefix_names_the_argument():
    sharding = one_device_sharding(jax.devices()[0])
    f = filter_jit(lambda params, x: x, in_shardings=({"w": sharding}, None))
    with pytest.raises(ValueError) as info:
        f({"v": jnp.ones(1)}, jnp.ones(1))
    message = str(info.value)
    assert "in_shardings[0] is not a pytree prefix of argument `params`" in message
    assert "broadcast_prefix" not in message and "prefix_tree" not in message
    with pytest.raises(ValueError, match="one entry per positional argument"):
        filter_jit(lambda x: x, in_shardings=(sharding, sharding))(jnp.ones(1))


def _donating(a, b):
    return a + b


def test_a_donated_array_passed_again_names_its_donation():
    f = filter_jit(_donating, donate="all")
    x = jnp.ones(3)
    y = f(x, 2.0)  # donates `x`: the next line's number is in the message
    line = sys._getframe().f_lineno - 1
    where = re.escape(f"{__file__}:{line}")
    message = (
        r"_donating\(\): argument `a` is an array that was donated by an earlier "
        rf"call of `_donating` at {where}, through its parameter `a`"
    )
    with pytest.raises(ValueError, match=message):
        f(x, 2.0)  # warm: JAX refuses the deleted buffer when it runs
    with pytest.raises(ValueError, match=message):
        f(x, 3.0)  # cold: a new static value, traced anew
    g = filter_jit(lambda z: z * 2)
    with pytest.raises(ValueError, match=r"<lambda>\(\): argument `z` .* `_donating`"):
        g(x)  # passed to another function
    assert f(y, 2.0).shape == (3,)


def test_an_array_deleted_otherwise_is_named_too():
    f = filter_jit(lambda x: x + 1)
    f(jnp.ones(3))
    x = jnp.ones(3)
    x.delete()
    with pytest.raises(ValueError, match="argument `x` is an array that was deleted"):
        f(x)


def test_the_record_of_donations_keeps_no_array_alive():
    f = filter_jit(_donating, donate="all")
    x = jnp.ones(3)
    f(x, 2.0)
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None
    # A function that donates nothing records nothing: its entries call JAX's
    # jitted function directly (behind a C partial that passes the static
    # `CallUnderWay` of a top-level call).
    g = filter_jit(_donating)
    g(jnp.ones(3), 2.0)
    (entry,) = g._dispatcher.entries[0]._values.values()
    jitted: Any = entry.jitted
    assert type(jitted) is functools.partial
    assert type(jitted.func) is type(jax.jit(_donating))
