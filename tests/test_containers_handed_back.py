"""Containers a function hands back, found without reading the arguments again
after it ran (it may have changed them: popped a key, marked an `eqx.nn.State`
used), and a nested function that stores a traced value in a container its caller
passed: a clear error at the call, never a tracer leaked to the caller. Each test
runs on both paths."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import assert_tree_allclose
from helpers import each_path  # noqa: F401 - every test on both paths

from filterjit import filter_jit


class Counter(eqx.Module):
    """The stateful layer of `eqx.nn.StateIndex`'s docstring."""

    index: eqx.nn.StateIndex

    def __init__(self) -> None:
        self.index = eqx.nn.StateIndex(jnp.array(0))

    def __call__(self, x: Any, state: eqx.nn.State) -> Any:
        n = state.get(self.index)
        return x + n, state.set(self.index, n + 1)


def _steps(call: Any, model: Counter, state: eqx.nn.State) -> list[Any]:
    found = []
    for _ in range(3):
        y, state = call(model, jnp.ones(2), state)
        found.append(y)
    return found


@pytest.mark.parametrize("level", ["top", "nested"])
def test_a_stateful_layer_runs_as_under_equinox(level):
    model, state = eqx.nn.make_with_state(Counter)()

    def at_level(jit: Any) -> Any:
        call = jit(lambda m, x, s: m(x, s))
        if level == "top":
            return call
        return lambda m, x, s: jax.jit(lambda x, s: call(m, x, s))(x, s)

    ours = _steps(at_level(filter_jit), model, state)
    for mine, expected in zip(ours, _steps(at_level(eqx.filter_jit), model, state)):
        assert_tree_allclose(mine, expected)


def _pop_and_hand_back(x: Any, table: dict[str, Any], other: dict[str, int]) -> Any:
    table.pop("a")  # a container of its own: those after it would shift
    return x + 1, other


def test_a_container_handed_back_after_popping_another_is_the_callers():
    g = filter_jit(_pop_and_hand_back)
    for _ in range(3):
        seen = []

        def outer(x: Any) -> Any:
            other = {"c": 3}
            y, back = g(x, {"a": {"k": 1}, "b": 2}, other)
            seen.append(back is other)
            return y

        jax.jit(outer)(jnp.ones(2))
        assert seen == [True]


def test_a_nested_function_filling_its_callers_dict_raises_naming_it():
    def f(x: Any, metrics: dict[str, Any]) -> Any:
        metrics["mean"] = jnp.mean(x)
        return x + 1

    def outer(x: Any) -> Any:
        metrics: dict[str, Any] = {}
        return filter_jit(f)(x, metrics) + metrics["mean"]

    with pytest.raises(TypeError, match=r"`metrics\['mean'\]`.*Return the value"):
        jax.jit(outer)(jnp.ones(3))


def test_a_nested_call_aliasing_an_array_leaves_other_calls_keys_alone():
    # One nested call passing one NumPy array twice, to a function handing an input
    # back, keys that call's structure by which inputs are one object; the top
    # level's keys and hits stay as they were.
    from filterjit import _fastpath
    from filterjit._level import TOP

    runs = []

    def f(x: Any, a: Any, b: Any) -> Any:
        runs.append(None)
        return x + 1, b

    g = filter_jit(f)
    x = jnp.ones(2)
    for _ in range(2):
        g(x, 1.0, 2.0)
    assert len(runs) == 1
    array = np.ones(2)
    seen = []
    jax.jit(lambda x: seen.append(g(x, array, array)[1]) or x)(x)
    assert seen[0] is array
    runs.clear()
    for _ in range(3):
        assert_tree_allclose(g(x, 1.0, 2.0)[0], x + 1)
    assert not runs  # no top-level key traced again
    if _fastpath.ENABLED:
        assert g._dispatcher.hits[TOP] is not _fastpath.miss  # pyright: ignore
    # And the nested call tells one array twice from two equal ones.
    other = np.ones(2)
    jax.jit(lambda x: seen.append(g(x, array, other)[1]) or x)(x)
    assert seen[1] is other
