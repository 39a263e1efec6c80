"""Binding arguments to parameters: `filterjit._binding.Binder` against
`inspect.Signature.bind` followed by `apply_defaults`."""

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import one_device_sharding

import filterjit
from filterjit._binding import Binder


_SHARED_DEFAULT: list[int] = []


def positional(a, b, /, c=3):
    pass


def mixed(x, n=2, *rest, mode="a", flag, **extra):
    pass


def keyword_only(*, a, b=_SHARED_DEFAULT):
    pass


def plain(x, y):
    pass


_CALLS: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = [
    (positional, (1, 2), {}),
    (positional, (1, 2, 4), {}),
    (positional, (1, 2), {"c": 5}),
    (mixed, (1,), {"flag": True}),
    (mixed, (1, 5, 6, 7), {"flag": False, "mode": "b"}),
    (mixed, (), {"x": 1, "flag": 0, "z": 9, "not an identifier": 1}),
    (mixed, (1,), {"flag": 0, "n": 4}),
    (keyword_only, (), {"a": 1}),
    (keyword_only, (), {"b": 2, "a": 1}),
    (plain, (1,), {"y": 2}),
    (plain, (), {"y": 2, "x": 1}),
]


def _reference(fun, args, kwargs):
    bound = inspect.signature(fun).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.args, bound.kwargs


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) is int and a == b)


@pytest.mark.parametrize("fun, args, kwargs", _CALLS)
def test_binder_binds_as_inspect_does(fun, args, kwargs):
    binder = Binder(inspect.signature(fun), fun.__name__)
    expected_args, expected_kwargs = _reference(fun, args, kwargs)
    # The first call binds for real and records a plan; later calls use it, with
    # other values in the same shape of call.
    for attempt in range(3):
        values = tuple(object() for _ in args) if attempt == 2 else args
        named = {k: object() for k in kwargs} if attempt == 2 else kwargs
        if attempt == 2:
            expected_args, expected_kwargs = _reference(fun, values, named)
        got_args, got_kwargs = binder(values, named)
        assert type(got_args) is tuple
        assert len(got_args) == len(expected_args)
        assert all(_same(a, b) for a, b in zip(got_args, expected_args))
        assert list(got_kwargs) == list(expected_kwargs)
        assert all(_same(got_kwargs[k], expected_kwargs[k]) for k in expected_kwargs)


def test_defaults_are_the_signatures_own_objects():
    binder = Binder(inspect.signature(keyword_only), "keyword_only")
    for _ in range(2):
        _, kwargs = binder((), {"a": 1})
        assert kwargs["b"] is _SHARED_DEFAULT


@pytest.mark.parametrize(
    "args, kwargs", [((), {}), ((1, 2, 3), {}), ((1,), {"x": 2}), ((1,), {"z": 2})]
)
def test_bad_calls_raise_every_time(args, kwargs):
    binder = Binder(inspect.signature(plain), "plain")
    for _ in range(2):
        with pytest.raises(TypeError, match=r"^plain\(\): "):
            binder(args, kwargs)


def test_many_shapes_of_call_stay_correct():
    binder = Binder(inspect.signature(mixed), "mixed")
    for i in range(200):
        kwargs = {"flag": i, f"name{i}": i}
        args, got = binder((1,), kwargs)
        assert (args, got) == _reference(mixed, (1,), kwargs)


def test_keyword_calls_are_one_call():
    traces = []

    @filterjit.filter_jit
    def f(x, n=2, *, scale=1.0):
        traces.append(None)
        return x * n * scale

    x = jnp.arange(3.0)
    results = [
        f(x),
        f(x, 2),
        f(x, n=2),
        f(x, scale=1.0),
        f(n=2, x=x),
        f(x, 2, scale=1.0),
    ]
    assert len(traces) == 1
    for result in results:
        assert jnp.array_equal(result, x * 2)
    with pytest.raises(TypeError, match=r"f\(\): missing a required argument: 'x'"):
        f(n=2)  # pyright: ignore[reportCallIssue]


def _scale(self, x):
    return self * x


def test_a_parameter_named_self_can_be_passed_by_keyword():
    x = jnp.arange(3.0)
    wrapped = filterjit.filter_jit(_scale)
    assert wrapped(self=2.0, x=x).tolist() == _scale(self=2.0, x=x).tolist()
    assert wrapped.eval_shape(self=2.0, x=x).shape == (3,)
    assert [row.path for row in filterjit.explain(wrapped, self=2.0, x=x).rows] == [
        "self",
        "x",
    ]


def test_a_ufunc_gets_only_the_arguments_given():
    # Its signature describes it; filling in its defaults would pass
    # `signature=None` and `dtype=None` together, which it refuses.
    np_add = filterjit.filter_jit(np.add)
    out = np_add(1, 2)
    assert isinstance(out, jax.Array) and out.tolist() == 3
    assert np_add(1, 2, dtype=np.float32).dtype == jnp.float32
    assert jax.jit(lambda: np_add(1, 2))().tolist() == 3


def test_in_shardings_covers_the_arguments_given():
    # As in jax.jit: a prefix of the positional arguments the caller gave, not of
    # those left to their defaults.
    sharding = one_device_sharding(jax.devices()[0])

    def f(x, scale=2.0):
        return x * scale

    x = jnp.ones(2)
    wrapped = filterjit.filter_jit(f, in_shardings=(sharding,))
    assert wrapped(x).tolist() == jax.jit(f, in_shardings=(sharding,))(x).tolist()
    assert wrapped(x, 3.0).tolist() == [3.0, 3.0]
    with pytest.raises(ValueError, match="one entry per positional argument"):
        filterjit.filter_jit(f, in_shardings=())(x)
