"""One trace per program across trace levels: a nested call
whose leaves of array types are all tracers is the program that a top-level call
with those avals is, and the two share one trace, whichever comes first; and what
the shared trace returns is what each level returns undecorated (nested) or under
`jax.jit` (top level). Inline calls keep entries of their own, and `num_traces`
counts the traces made at the top level only."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filterjit
from filterjit import filter_jit


def _counted(body):
    """`body`, and a list that grows by one on each of its traces."""
    traces = []

    def counted(*args, **kwargs):
        traces.append(None)
        return body(*args, **kwargs)

    return counted, traces


def _scale(x, n):
    return x * n


def _scale_by_keyword(x, *, n):
    return x * n


class Scaler(eqx.Module):
    w: jax.Array

    def __call__(self, x, n):
        return self.w * x * n


# (what a top-level call does, what a nested call does, the undecorated program).
def _positional(g, x):
    return g(x, 3)


def _keyword(g, x):
    return g(x, n=3)


_CALLS = {
    "positional": (_scale, _positional),
    "keyword": (_scale_by_keyword, _keyword),
}

_OUTER = {
    "jit": lambda call, g, x: jax.jit(lambda x: call(g, x) + 1)(x) - 1,
    "scan": lambda call, g, x: jax.lax.scan(
        lambda c, _: (call(g, c), None), x, length=1
    )[0],
    "grad in jit": lambda call, g, x: jax.jit(jax.grad(lambda x: call(g, x).sum()))(x),
    "vmap in jit": lambda call, g, x: jax.jit(jax.vmap(lambda x: call(g, x)))(x[None])[
        0
    ],
    "checkpoint": lambda call, g, x: jax.jit(jax.checkpoint(lambda x: call(g, x)))(x),
}


@pytest.mark.parametrize("outer", list(_OUTER))
@pytest.mark.parametrize("form", list(_CALLS))
@pytest.mark.parametrize("first", ["nested", "top"])
def test_one_trace_serves_both_levels(first, form, outer):
    body, call = _CALLS[form]
    counted, traces = _counted(body)
    g = filter_jit(counted)
    x = jnp.arange(3.0)
    nested = lambda: _OUTER[outer](call, g, x)  # noqa: E731
    expected_nested = _OUTER[outer](call, body, x)
    expected_top = call(body, x)
    if first == "nested":
        assert jnp.array_equal(nested(), expected_nested)
        assert jnp.array_equal(call(g, x), expected_top)
    else:
        assert jnp.array_equal(call(g, x), expected_top)
        assert jnp.array_equal(nested(), expected_nested)
    assert len(traces) == 1
    # Repeated, from either level: no more traces.
    assert jnp.array_equal(nested(), expected_nested)
    assert jnp.array_equal(call(g, x), expected_top)
    assert len(traces) == 1


@pytest.mark.parametrize("first", ["nested", "top"])
def test_a_module_method_has_one_trace_across_levels(first):
    traces = []

    class Counted(eqx.Module):
        w: jax.Array

        @filter_jit
        def __call__(self, x, n):
            traces.append(None)
            return self.w * x * n

    m, x = Counted(jnp.arange(3.0)), jnp.ones(3)
    calls = [lambda: m(x, 2), lambda: jax.jit(lambda m, x: m(x, 2))(m, x)]
    if first == "nested":
        calls.reverse()
    for _ in range(2):
        for call in calls:
            assert jnp.array_equal(call(), jnp.arange(3.0) * 2)
    assert len(traces) == 1


_FULL = jnp.full(2, 7.0)


def _with_constants(x):
    return x + 1, np.arange(3), _FULL, {"b": 1, "a": 2}


@pytest.mark.leaks_unchecked  # it keeps the tracers its function sees, on purpose
@pytest.mark.parametrize("first", ["nested", "top"])
def test_a_shared_trace_returns_what_each_level_expects(first):
    """Constant arrays in the output are outputs of the jit at the top level (as
    under `jax.jit`) and kept as they are nested (as undecorated); a dict comes
    back in JAX's order at the top level and in its own order nested."""
    g = filter_jit(_with_constants)
    x = jnp.ones(3)
    seen = {}

    def outer(x):
        seen["nested"] = g(x)
        seen["undecorated"] = _with_constants(x)
        return x

    def nested():
        jax.jit(outer)(x)
        y, constant, full, order = seen["nested"]
        _, expected, expected_full, expected_order = seen["undecorated"]
        assert type(constant) is np.ndarray and (constant == expected).all()
        assert full is expected_full is _FULL
        assert list(order) == list(expected_order) == ["b", "a"]

    def top():
        y, constant, full, order = g(x)
        ey, econstant, efull, eorder = jax.jit(_with_constants)(x)
        assert jnp.array_equal(y, ey)
        assert type(constant) is type(econstant) and jnp.array_equal(
            constant, econstant
        )
        assert constant.dtype == econstant.dtype
        assert jnp.array_equal(full, efull) and full is not _FULL
        assert list(order) == list(eorder) == ["a", "b"]

    steps = [nested, top] if first == "nested" else [top, nested]
    for _ in range(2):
        for step in steps:
            step()


def _keys(d, x):
    return list(d), x * 2


def test_a_nested_call_with_dicts_out_of_jax_order_keeps_its_order():
    """A nested call sees its dicts in their own order; a trace made at the top
    level (in JAX's order) is not used for it."""
    g = filter_jit(_keys)
    x = jnp.ones(2)
    assert g({"b": x, "a": x}, x)[0] == ["a", "b"]  # as jax.jit: JAX's order
    seen = []

    def outer(x):
        seen.append(g({"b": x, "a": x}, x)[0])
        seen.append(g({"a": x, "b": x}, x)[0])
        return x

    jax.jit(outer)(x)
    assert seen == [["b", "a"], ["a", "b"]]


def test_a_nested_call_with_concrete_arrays_keeps_them_concrete():
    traces = []

    def body(x, table):
        traces.append(None)
        return x * int(table.sum())  # needs `table` concrete

    g = filter_jit(body)
    x = jnp.ones(2)
    table = np.arange(3)
    out = jax.jit(lambda x: g(x, table))(x)
    assert jnp.array_equal(out, x * 3)
    # At the top level `table` is traced: another program.
    with pytest.raises(jax.errors.ConcretizationTypeError):
        g(x, table)


def test_inline_calls_keep_entries_of_their_own():
    counted, traces = _counted(_scale)
    g = filter_jit(counted, inline=True)
    x = jnp.ones(3)
    jaxpr = jax.make_jaxpr(lambda x: g(x, 3))(x)
    assert not any(e.primitive.name in ("pjit", "jit") for e in jaxpr.eqns)
    assert jnp.array_equal(g(x, 3), x * 3)
    assert len(traces) == 2


def test_a_top_level_trace_serves_nested_calls_with_the_constants_it_returns():
    """A trace made at the top level, whose output holds a constant array (an output
    of the jit there), serves nested calls too: each gets the constant itself, as
    undecorated, and binds one equation into the outer program."""
    counted, traces = _counted(lambda x: (x + 1, np.arange(2)))
    g = filter_jit(counted)
    x = jnp.ones(2)
    top_y, top_constant = g(x)  # the top-level trace
    assert isinstance(top_constant, jax.Array)  # as jax.jit returns it

    def outer(x):
        for _ in range(3):
            y, constant = g(x)
            assert type(constant) is np.ndarray
            assert np.array_equal(constant, np.arange(2))
            x = y
        return x

    jaxpr = jax.make_jaxpr(outer)(x)
    assert sum(e.primitive.name in ("pjit", "jit") for e in jaxpr.eqns) == 3
    assert jnp.array_equal(jax.jit(outer)(x), x + 3)
    assert len(traces) == 1


def test_num_traces_counts_traces_made_at_the_top_level():
    g = filter_jit(_scale)
    x = jnp.ones(3)
    jax.jit(lambda x: g(x, 3))(x)
    g(x, 3)  # served by the trace made nested
    assert filterjit.num_traces(g) == 0
    g(jnp.ones(4), 3)
    assert filterjit.num_traces(g) == 1
