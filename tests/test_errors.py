"""Bad input gets a clear error naming the user's argument (contract point 14)."""

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import subprocess_env, TraceCounter

import filterjit
from filterjit import filter_jit


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


def test_exception_while_tracing_propagates_and_does_not_poison_the_cache():
    calls = []

    @filter_jit
    def f(x, fail):
        calls.append(fail)
        if fail:
            raise RuntimeError("boom")
        return x + 1

    for _ in range(2):
        with pytest.raises(RuntimeError, match="boom"):
            f(jnp.ones(1), True)
        with pytest.raises(RuntimeError, match="boom"):
            jax.jit(lambda x: f(x, True))(jnp.ones(1))
    assert f(jnp.ones(1), False).tolist() == [2.0]
    assert jax.jit(lambda x: f(x, False))(jnp.ones(1)).tolist() == [2.0]


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


def test_not_callable():
    with pytest.raises(TypeError, match="callable"):
        filter_jit(3)  # pyright: ignore


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


def test_unexpected_jit_keyword_is_python_type_error():
    with pytest.raises(TypeError):
        filter_jit(lambda x: x, not_an_option=1)(jnp.ones(1))


def test_nested_array_exception_leaves_outer_trace_usable():
    counter = TraceCounter(lambda x, n: x.reshape(n))
    f = filter_jit(counter)
    with pytest.raises(TypeError):
        jax.jit(lambda x: f(x, np.int32(5)))(jnp.ones(4))
    assert jax.jit(lambda x: f(x, np.int32(4)))(jnp.ones(4)).shape == (4,)


_NESTED_ERROR = """
import jax, jax.numpy as jnp, filterjit

@filterjit.filter_jit
def helper(x):
    if x.shape[0] == 4:
        raise ValueError("the user's error")
    return x * 2

@jax.jit
def outer(x):
    return helper(x)

outer(jnp.ones(3))
outer(jnp.ones(4))  # the second call takes the latest call's (generated) path
"""


def test_tracebacks_of_nested_calls_show_no_filterjit_frames(tmp_path):
    # JAX removes its own frames from tracebacks, and filterjit's (generated code
    # included) as well, so that a user's error points at the user's code.
    script = tmp_path / "nested_error.py"
    script.write_text(_NESTED_ERROR)
    env = subprocess_env(JAX_TRACEBACK_FILTERING="remove_frames")
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env
    )
    assert "ValueError: the user's error" in result.stderr
    assert 'raise ValueError("the user\'s error")' in result.stderr
    # JAX prints the unfiltered trace first, as the cause; the last is filtered.
    filtered = result.stderr.split("Traceback (most recent call last):")[-1]
    frames = [line for line in filtered.splitlines() if line.startswith("  File ")]
    # Only the user's frames: the script's.
    assert frames, result.stderr
    assert all(str(script) in frame for frame in frames), frames


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


def test_explain_of_a_non_callable_names_explain():
    with pytest.raises(TypeError, match="^explain expects a callable"):
        filterjit.explain(3, jnp.ones(1))  # pyright: ignore[reportArgumentType]


def test_a_wrong_in_shardings_prefix_names_the_argument():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    f = filter_jit(lambda params, x: x, in_shardings=({"w": sharding}, None))
    with pytest.raises(ValueError) as info:
        f({"v": jnp.ones(1)}, jnp.ones(1))
    message = str(info.value)
    assert "in_shardings[0] is not a pytree prefix of argument `params`" in message
    assert "broadcast_prefix" not in message and "prefix_tree" not in message
    with pytest.raises(ValueError, match="one entry per positional argument"):
        filter_jit(lambda x: x, in_shardings=(sharding, sharding))(jnp.ones(1))


def test_unbounded_recursion_names_the_function_and_the_fix():
    @filter_jit
    def countdown(x, n):
        return countdown(x, n - 1)  # no base case

    with pytest.raises(RecursionError) as info:
        countdown(jnp.ones(1), 3)
    notes = [n for n in getattr(info.value, "__notes__", []) if "filter_jit" in n]
    assert len(notes) == 1, notes
    assert (
        "`test_unbounded_recursion_names_the_function_and_the_fix.<locals>."
        in (notes[0])
    )
    assert "countdown`" in notes[0]
    assert "static condition" in notes[0]
    assert "jax.lax.while_loop" in notes[0]

    # With its base case, the same recursion traces and runs.
    @filter_jit
    def countdown_to_zero(x, n):
        return x if n == 0 else countdown_to_zero(x + 1, n - 1)

    assert countdown_to_zero(jnp.zeros(1), 3).tolist() == [3.0]


@pytest.mark.parametrize("make", [np.int32, jnp.int32, lambda n: np.array(n)])
def test_a_numpy_or_jax_integer_in_range_names_the_argument_and_the_fix(make):
    @filter_jit
    def steps(x, count):
        for _ in range(count):
            x = x + 1
        return x

    with pytest.raises(jax.errors.TracerIntegerConversionError) as info:
        steps(jnp.ones(1), make(3))
    notes = [n for n in getattr(info.value, "__notes__", []) if "filter_jit" in n]
    assert len(notes) == 1, notes
    assert "steps` traces NumPy and JAX scalars" in notes[0]
    assert re.search(r"`count`, a (NumPy|JAX) int(32|64)", notes[0]), notes[0]
    assert "Pass a Python int" in notes[0] and "`int(count)`" in notes[0]
    assert steps(jnp.ones(1), 3).tolist() == [4.0]  # as the note says


def test_a_numpy_bool_in_if_names_the_argument():
    @filter_jit
    def choose(x, flag):
        return x + 1 if flag else x

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        choose(jnp.ones(1), np.bool_(True))
    notes = [n for n in getattr(info.value, "__notes__", []) if "filter_jit" in n]
    assert len(notes) == 1 and "`flag`, a NumPy bool" in notes[0], notes
    # A traced integer array that is not a scalar gets JAX's error alone.
    with pytest.raises(jax.errors.TracerIntegerConversionError) as info:
        filter_jit(lambda x, n: x * len(range(n[0])))(jnp.ones(1), np.array([2]))
    assert not [n for n in getattr(info.value, "__notes__", []) if "filter_jit" in n]
