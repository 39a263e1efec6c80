"""Ahead-of-time: lower, compile, trace, eval_shape."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filterjit
from filterjit import filter_jit


@filter_jit
def _f(x, n, tag="a"):
    return x * n, tag, np.arange(n)


def test_lower_with_shape_dtype_structs_and_compile():
    lowered = _f.lower(jax.ShapeDtypeStruct((3,), jnp.float32), 2)
    assert "func.func public @main" in lowered.as_text()
    compiled = lowered.compile()
    y, tag, table = compiled(jnp.ones(3), 2)
    assert y.tolist() == [2.0, 2.0, 2.0] and tag == "a"
    np.testing.assert_array_equal(table, np.arange(2))
    assert compiled(np.ones(3, np.float32), 2, tag="a")[0].tolist() == [2.0] * 3
    assert compiled.as_text()


def test_compiled_rejects_changed_static_arguments():
    compiled = _f.lower(jnp.ones(3), 2).compile()
    with pytest.raises(ValueError, match=r"static argument `n` was 2 when lowered"):
        compiled(jnp.ones(3), 3)
    with pytest.raises(ValueError, match=r"`n` was 2 when lowered and is 2.0 now"):
        compiled(jnp.ones(3), 2.0)
    with pytest.raises(ValueError, match=r"`tag` was 'a'"):
        compiled(jnp.ones(3), 2, tag="b")
    with pytest.raises(TypeError, match=r"`n` was static when lowered and is traced"):
        compiled(jnp.ones(3), jnp.int32(2))
    with pytest.raises(TypeError, match="structure"):
        compiled((jnp.ones(3),), 2)
    with pytest.raises(TypeError, match="float32\\[4\\]"):
        compiled(jnp.ones(4), 2)  # JAX's own check, naming the argument `x`


def test_a_compiled_call_given_a_shape_dtype_struct_says_it_stands_for_an_array():
    # When lowering, a ShapeDtypeStruct is an array's stand-in, traced (jax.jit
    # traces it too, unless it is in `static_argnums`); the compiled function takes
    # the array, and says so where it is given the stand-in again.
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    g = filter_jit(lambda x, s: x.sum() + s.sum())
    compiled = g.lower(jnp.ones(3), spec).compile()
    assert compiled(jnp.ones(3), jnp.ones(2)).tolist() == 5.0
    with pytest.raises(TypeError, match=r"argument `s` is a `jax.ShapeDtypeStruct`"):
        compiled(jnp.ones(3), spec)


def test_a_shape_dtype_struct_named_static_is_a_static_setting():
    # What the error above suggests: named static, it is the setting itself when
    # lowering, as in `jax.jit(f, static_argnames="s")`, whose compiled function
    # takes the traced arguments alone.
    seen = []

    def f(x, s):
        seen.append(type(s))
        return x.sum() + jnp.zeros(s.shape, s.dtype).sum()

    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    for jit in (jax.jit, filterjit.jit):
        g = jit(f, static_argnames="s")
        compiled = g.lower(jnp.ones(3), spec).compile()
        assert compiled(jnp.ones(3)).tolist() == 3.0
        assert g(jnp.ones(3), spec).tolist() == 3.0
    assert seen and set(seen) == {jax.ShapeDtypeStruct}  # one trace, shared
    with pytest.raises(TypeError, match=r"static_argnames='s'"):
        filter_jit(f).lower(jnp.ones(3), spec).compile()(jnp.ones(3), spec)


def test_trace_and_eval_shape():
    traced = _f.trace(jax.ShapeDtypeStruct((3,), jnp.float32), 2)
    assert "mul" in str(traced.jaxpr)
    shape, tag, table = traced.out_info
    assert shape == jax.ShapeDtypeStruct((3,), jnp.float32) and tag == "a"
    assert traced.lower().compile()(jnp.ones(3), 2)[0].tolist() == [2.0] * 3
    shape, tag, _ = _f.eval_shape(jnp.ones(5), 3)
    assert shape.shape == (5,) and tag == "a"


def test_aot_methods_live_on_the_class():
    assert "lower" not in vars(_f) and callable(type(_f).lower)
    assert callable(type(_f).trace) and callable(type(_f).eval_shape)


def test_lower_with_donation():
    f = filter_jit(lambda state, x: state + x, donate="all-except-first")
    text = f.lower(jnp.ones(3), jnp.ones(3)).as_text()
    assert "tf.aliasing_output" in text or "jax.buffer_donor" in text


def test_jax_jit_options_pass_through():
    unused = filter_jit(lambda x, y: x * 2, keep_unused=True)
    assert "%arg1" in unused.lower(jnp.ones(2), jnp.ones(3)).as_text()
    pruned = filter_jit(lambda x, y: x * 2)
    assert "%arg1" not in pruned.lower(jnp.ones(2), jnp.ones(3)).as_text()
    # Passed to jax.jit, which still takes `backend` in jax 0.10 but deprecates it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "backend and device", DeprecationWarning)
        on_cpu = filter_jit(lambda x: x + 1, backend="cpu")
        assert on_cpu(jnp.ones(2)).tolist() == [2.0, 2.0]
        with pytest.raises(RuntimeError, match="nonexistent"):
            filter_jit(lambda x: x + 1, backend="nonexistent")(jnp.ones(2))
    options = filter_jit(
        lambda x: x + 1, compiler_options={"xla_embed_ir_in_executable": True}
    )
    assert options(jnp.ones(2)).tolist() == [2.0, 2.0]
    with pytest.raises(Exception, match="not_an_xla_flag"):
        filter_jit(lambda x: x, compiler_options={"not_an_xla_flag": True})(jnp.ones(2))


def _counted():
    traces = []

    def f(x, n):
        traces.append(x.shape)
        return x * n

    return f, traces


@pytest.mark.parametrize("order", ["lower first", "call first"])
def test_lower_compile_and_calls_share_one_trace_as_under_jax_jit(order):
    counts = {}
    for name, jit in [
        ("jax.jit", lambda f: jax.jit(f, static_argnums=1)),
        ("filter_jit", filter_jit),
    ]:
        # jax.jit's compiled function takes the traced arguments only.
        statics = (2,) if name == "filter_jit" else ()
        f, traces = _counted()
        g = jit(f)
        x = jnp.ones(3)
        if order == "lower first":
            compiled = g.lower(jax.ShapeDtypeStruct((3,), jnp.float32), 2).compile()
            out = g(x, 2)
        else:
            out = g(x, 2)
            compiled = g.lower(x, 2).compile()
        assert out.tolist() == compiled(x, *statics).tolist() == [2.0] * 3
        counts[name] = len(traces)
    assert counts == {"jax.jit": 1, "filter_jit": 1}


def test_eval_shape_and_calls_share_one_trace():
    f, traces = _counted()
    g = filter_jit(f)
    shape = g.eval_shape(jnp.ones(3), 2)
    assert (shape.shape, shape.dtype) == ((3,), jnp.float32)
    assert g(jnp.ones(3), 2).tolist() == [2.0] * 3
    assert g.trace(jnp.ones(3), 2).jaxpr is not None
    assert len(traces) == 1


_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration_secs, **kwargs: _compiles.append(event)
)


@pytest.mark.parametrize("order", ["lower first", "call first"])
def test_lower_compile_and_a_call_compile_once(order):
    g = filter_jit(lambda x, n: x * n)
    x = jax.block_until_ready(jnp.ones(5))
    del _compiles[:]
    if order == "lower first":
        compiled = g.lower(x, 3).compile()
        out = g(x, 3)
    else:
        out = g(x, 3)
        compiled = g.lower(x, 3).compile()
    backend = "/jax/core/compile/backend_compile_duration"
    assert _compiles.count(backend) == 1
    assert out.tolist() == compiled(x, 3).tolist() == [3.0] * 5
