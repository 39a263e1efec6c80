"""What Equinox users rely on from `eqx.filter_jit`: runtime checks raised at the
call, wrappers called exactly as the caller called them."""

import functools as ft
import logging

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.core import Tracer

from filterjit import _trace, filter_jit


def _positive(x):
    return eqx.error_if(x, x < 0, "x must be positive")


def test_a_failed_runtime_check_raises_equinox_runtime_error(caplog):
    f = filter_jit(_positive)
    assert f(jnp.ones(2)).tolist() == [1.0, 1.0]
    with caplog.at_level(logging.ERROR):
        for _ in range(2):  # the first call, and a cached one
            with pytest.raises(eqx.EquinoxRuntimeError, match="x must be positive"):
                f(-jnp.ones(2))
    assert not [r for r in caplog.records if "pure_callback" in r.getMessage()]


def test_a_runtime_check_in_a_nested_call_or_a_branch_is_found():
    inner = filter_jit(_positive)

    @filter_jit
    def outer(x, flag):
        y = inner(x) if flag else x
        return jax.lax.cond(y.sum() < -100, _positive, lambda z: z, y)

    with pytest.raises(eqx.EquinoxRuntimeError, match="x must be positive"):
        outer(-jnp.ones(2), True)
    # In a cond's branch, taken for large negative sums only.
    with pytest.raises(eqx.EquinoxRuntimeError, match="x must be positive"):
        outer(-jnp.full(2, 100.0), False)
    assert outer(-jnp.ones(2), False).tolist() == [-1.0, -1.0]


def test_only_calls_with_a_runtime_check_wait(monkeypatch):
    waits = []
    block_leaves = _trace.block_leaves

    def counting(arrays):
        waits.append(len(arrays))
        block_leaves(arrays)

    monkeypatch.setattr(_trace, "block_leaves", counting)
    checked = filter_jit(_positive)
    plain = filter_jit(lambda x: x + 1)
    for _ in range(2):
        checked(jnp.ones(2))
        plain(jnp.ones(2))
    jax.grad(lambda x: checked(x).sum())(jnp.ones(2))
    jax.grad(lambda x: plain(x).sum())(jnp.ones(2))
    assert waits == [1, 1, 1]  # the marker of each checked call, eager grad's too


@pytest.mark.parametrize(
    "call",
    [
        lambda g, x: jax.grad(lambda x: g(x).sum())(x),
        lambda g, x: jax.vmap(g)(x),
        lambda g, x: jax.jvp(g, (x,), (x,)),
        lambda g, x: jax.vmap(jax.grad(lambda x: g(x).sum()))(x[None]),
    ],
    ids=["grad", "vmap", "jvp", "vmap(grad)"],
)
def test_a_checked_call_under_eager_transforms_waits_at_the_call(monkeypatch, call):
    # On an accelerator a failed check surfaces when the result is waited for, and
    # under eager grad the forward result may never be: so the call waits, as
    # Equinox's does, for a concrete output (its traced leaves are tracers here).
    waits = []
    block_leaves = _trace.block_leaves

    def recording(arrays):
        assert not any(isinstance(array, Tracer) for array in arrays)
        waits.append(len(arrays))
        block_leaves(arrays)

    monkeypatch.setattr(_trace, "block_leaves", recording)
    checked = filter_jit(_positive)
    call(checked, jnp.ones(2))  # traced
    call(checked, jnp.ones(2))  # cached
    assert waits == [1, 1]
    with pytest.raises(eqx.EquinoxRuntimeError, match="x must be positive"):
        call(checked, -jnp.ones(2))


def test_a_checked_call_waits_for_its_marker_alone(monkeypatch):
    # As Equinox waits for one output of its own: the execution's error comes with
    # any of its outputs. A marker the executable computes, not an input handed
    # back, which the executable may not compute.
    waits = []
    block_leaves = _trace.block_leaves

    def recording(arrays):
        waits.append([array.shape for array in arrays])
        block_leaves(arrays)

    monkeypatch.setattr(_trace, "block_leaves", recording)

    @filter_jit
    def f(x, y):
        return x, eqx.error_if(y, y < 0, "y must be non-negative"), y + 1

    x, y = jnp.ones(2), jnp.ones(3)
    for _ in range(2):
        assert f(x, y)[2].tolist() == [2.0, 2.0, 2.0]
    assert waits == [[()], [()]]
    with pytest.raises(eqx.EquinoxRuntimeError, match="must be non-negative"):
        f(x, -y)


def test_filter_vmap_with_a_keyword_default_is_called_as_called():
    def f(x, *, key=None):
        return x * 2 if key is None else x

    vmapped = filter_jit(eqx.filter_vmap(f))
    assert vmapped(jnp.ones((3, 2))).shape == (3, 2)
    assert jnp.allclose(vmapped(jnp.ones((3, 2))), 2.0)


def test_a_wraps_wrapper_taking_args_is_called_as_called():
    def g(x, *, n=2):
        return x * n

    @ft.wraps(g)
    def wrapper(*args):  # advertises (x, *, n=2), accepts no keywords
        return g(*args)

    f = filter_jit(wrapper)
    assert f(jnp.ones(1)).tolist() == [2.0]  # not wrapper(x, n=2)
    assert f(jnp.ones(1)).tolist() == [2.0]


def test_a_failed_check_reads_as_under_equinox(caplog):
    inner = filter_jit(lambda x: eqx.error_if(x, x > 0, "egads"))
    outer = filter_jit(lambda x: inner(x))
    with pytest.raises(eqx.EquinoxRuntimeError) as info:
        outer(jnp.array(1.0))
    message = str(info.value).strip()
    assert message.startswith("Above is the stack outside of JIT")
    assert "egads" in message and "EQX_ON_ERROR" in message
    assert info.value.__cause__ is None
    assert caplog.text == ""
