"""Donation at the top level; ignored when nested."""

import gc
import weakref

import jax
import jax.numpy as jnp
import pytest

from filterjit import filter_jit


def _step(state, batch):
    return {"w": state["w"] + batch.sum()}, batch * 2


@pytest.mark.parametrize(
    "donate, state_deleted, batch_deleted",
    [
        ("none", False, False),
        ("all", True, True),
        ("warn", True, True),
        ("all-except-first", False, True),
        ("warn-except-first", False, True),
        (("state",), True, False),
        (("batch",), False, True),
    ],
)
def test_donation_at_the_top_level(donate, state_deleted, batch_deleted):
    f = filter_jit(_step, donate=donate)
    state = {"w": jnp.ones(4)}
    batch = jnp.arange(4.0)
    new_state, out = f(state, batch)
    assert state["w"].is_deleted() == state_deleted
    assert batch.is_deleted() == batch_deleted
    assert new_state["w"].tolist() == [7.0] * 4
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0]


def test_donation_is_ignored_when_nested_and_under_eager_transforms():
    f = filter_jit(lambda x: x * 2, donate="all")
    x = jnp.arange(3.0)
    assert jax.jit(lambda x: f(x) + 1)(x).tolist() == [1.0, 3.0, 5.0]
    assert jax.grad(lambda x: f(x).sum())(x).tolist() == [2.0] * 3
    assert not x.is_deleted()
    f(x)
    assert x.is_deleted()


def test_donating_wrapper_does_not_keep_the_function_alive():
    def make():
        offset = jnp.ones(3)
        return lambda state: state + offset

    fun = make()
    ref = weakref.ref(fun)
    wrapped = filter_jit(fun, donate="all")
    wrapped(jnp.zeros(3))
    del fun, wrapped
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("donate", ["all", "all-except-first", "warn"])
def test_repeated_calls_donate_and_warn_as_the_first(donate):
    # A training loop: every call donates, and only the "warn" options warn about
    # a donated buffer that the output cannot reuse (here `batch`, of which
    # nothing is returned); JAX says so when it compiles, as with jax.jit.
    f = filter_jit(lambda state, batch: {"w": state["w"] + batch.sum()}, donate=donate)
    state = {"w": jnp.ones(4)}
    for step in range(3):
        batch = jnp.arange(4.0)
        old = state["w"]
        if donate == "warn" and step == 0:
            with pytest.warns(
                UserWarning, match="Some donated buffers were not usable"
            ):
                state = f(state, batch)
        else:
            state = f(state, batch)
        assert old.is_deleted() == (donate != "all-except-first")
        assert state["w"].tolist() == [1.0 + 6.0 * (step + 1)] * 4
