"""explain() (what it marks against the nearest cached trace, and what it will not
explain), retrace logs, RetraceWarning, num_traces and clear_caches."""

import functools as ft
import gc
import logging
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import filterjit
from filterjit import filter_jit


def _make_f():
    def _f(params, n, opts):
        return params["w"] * n

    return _f


def _f(params, n, opts):
    return params["w"] * n


def test_explain_at_the_top_level():
    f = filter_jit(_make_f())
    params = {"w": jnp.ones(3)}
    explanation = filterjit.explain(f, params, 2, {"mode": "a"})
    assert not explanation.cache_hit
    assert [row[:3] for row in explanation.rows] == [
        ("params['w']", "traced", "f32[3]"),
        ("n", "static", "2"),
        ("opts['mode']", "static", "'a'"),
    ]
    text = str(explanation)
    assert "called at the top level: would trace" in text
    assert re.search(r"params\['w'\] +traced +f32\[3\]", text)
    f(params, 2, {"mode": "a"})
    assert filterjit.explain(f, params, 2, {"mode": "a"}).cache_hit
    assert filterjit.explain(f, {"w": jnp.zeros(3)}, 2, {"mode": "a"}).cache_hit
    assert not filterjit.explain(f, {"w": jnp.ones(4)}, 2, {"mode": "a"}).cache_hit
    assert not filterjit.explain(f, params, 3, {"mode": "a"}).cache_hit
    assert filterjit.num_traces(f) == 1  # explain traces nothing


def test_explain_inside_a_trace_reports_the_nested_roles():
    seen = []

    def outer(x):
        seen.append(filterjit.explain(_f, {"w": x}, np.int32(2), {"mode": np.ones(9)}))
        return x

    jax.jit(outer)(jnp.ones(3))
    (explanation,) = seen
    assert explanation.level == "inside a staged trace"
    assert [row[:2] for row in explanation.rows] == [
        ("params['w']", "traced"),
        ("n", "concrete"),
        ("opts['mode']", "concrete"),
    ]
    assert explanation.rows[2].value == "ndarray(f64[9])"


def test_explain_shows_the_dtype_the_function_sees_of_an_array_passed_on():
    # Inside a staged trace a NumPy array reaches the function as it is: its own
    # dtype, not JAX's 32-bit view of it (x64 off), nor none (objects, strings).
    arrays = {
        "f64[8]": np.ones(8),
        "i64[2,4]": np.ones((2, 4), np.int64),
        "u8[8]": np.ones(8, np.uint8),
        "c128[8]": np.ones(8, np.complex128),
        "bool[8]": np.ones(8, bool),
        "object[8]": np.array([None] * 8),
        "str32[8]": np.array(["a"] * 8),
    }
    seen = {}

    @filter_jit
    def f(x, arrays):
        seen.update({key: (type(a), a.dtype) for key, a in arrays.items()})
        return x

    explained = []

    def outer(x):
        explained.append(filterjit.explain(f, x, arrays))
        return f(x, arrays)

    jax.jit(outer)(jnp.ones(1))
    rows = {row.path: row for row in explained[0].rows}
    for text, array in arrays.items():
        assert seen[text] == (np.ndarray, array.dtype)  # as it is
        assert rows[f"arrays[{text!r}]"][1:3] == ("concrete", f"ndarray({text})")


def test_explain_unwrapped_function_and_modules():
    import equinox as eqx

    linear = eqx.nn.Linear(2, 3, key=jax.random.key(0))
    text = str(filterjit.explain(linear, jnp.ones(2)))
    # Its fields as its `__call__` sees them.
    assert re.search(r"self\.weight +traced +f32\[3,2\]", text)
    assert "x" in text


def test_retrace_log_names_the_changed_argument(monkeypatch, caplog):
    monkeypatch.setenv("FILTERJIT_EXPLAIN_RETRACES", "1")
    f = filter_jit(_make_f())
    params = {"w": jnp.ones(3)}
    with caplog.at_level(logging.WARNING, logger="filterjit"):
        f(params, 2, {"mode": "a"})
        assert not caplog.records
        f(params, 3, {"mode": "a"})
        f({"w": jnp.ones(4)}, 3, {"mode": "a"})
    first, second = [r.getMessage() for r in caplog.records if r.name == "filterjit"]
    assert "_f traced again (trace 2) because n: 2 -> 3" in first
    assert "a Python int is static, and each new value traces anew" in first
    assert "params['w']: f32[3] -> f32[4]" in second
    assert "n:" not in second


def _passes(x, n_passes):
    return jax.lax.fori_loop(0, n_passes, lambda _, y: jnp.sin(y), x)


def _scaled_by(x, factor):
    return x * factor


def test_retrace_advice_keeps_a_loop_bound_static(monkeypatch, caplog):
    """The retrace log's advice for a Python int that changed does not tell a loop
    bound to be traced without its cost: traced, it makes the `fori_loop` a
    `while_loop`, which reverse mode cannot differentiate (checked below). For a
    float, tracing it is the advice."""
    monkeypatch.setenv("FILTERJIT_EXPLAIN_RETRACES", "1")
    passes, scaled = filter_jit(_passes), filter_jit(_scaled_by)
    x = jnp.ones(3)
    with caplog.at_level(logging.WARNING, logger="filterjit"):
        for n in (2, 3):
            passes(x, n)
        for factor in (2.0, 3.0):
            scaled(x, factor)
    logged = [r.getMessage() for r in caplog.records if r.name == "filterjit"]
    for_int, for_float = logged
    assert "n_passes: 2 -> 3" in for_int
    assert (
        "Where it is a count, a shape or an index (`range(n_passes)`, a "
        "`lax.fori_loop` bound, `jnp.zeros(n_passes)`), keep it static" in for_int
    )
    assert "`fori_loop` becomes a `while_loop`, which reverse mode" in for_int
    assert "Where it is only a number in arithmetic, pass jnp.asarray(n_passes)" in (
        for_int
    )
    assert "pass jnp.asarray(factor) to trace it" in for_float
    # What the advice says it costs.
    loss = lambda x, n: jnp.sum(passes(x, n))  # noqa: E731
    assert jax.grad(loss)(x, 3).shape == (3,)
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not"):
        jax.grad(loss)(x, jnp.asarray(3))


def test_retrace_log_follows_jax_explain_cache_misses(caplog):
    f = filter_jit(_make_f())
    params = {"w": jnp.ones(3)}
    with caplog.at_level(logging.WARNING, logger="filterjit"):
        f(params, 2, {"mode": "a"})
        f(params, 2, {"mode": "b"})
        assert not [r for r in caplog.records if r.name == "filterjit"]
        with jax.explain_cache_misses(True):
            f(params, 2, {"mode": "c"})
    messages = [r.getMessage() for r in caplog.records if r.name == "filterjit"]
    assert len(messages) == 1
    assert "opts['mode']: 'b' -> 'c'" in messages[0]


def test_retrace_warning_once_naming_the_argument():
    f = filter_jit(_make_f())
    params = {"w": jnp.ones(3)}
    with pytest.warns(
        filterjit.RetraceWarning,
        match=r"traced 12 times, the last 11 only because a static value took a "
        r"new value; `n` changed in 11",
    ):
        for n in range(12):
            f(params, n, {"mode": "a"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(params, 100, {"mode": "a"})  # once only
    assert filterjit.num_traces(f) == 13


def test_retrace_warning_threshold_is_configurable():
    f = filter_jit(_make_f())
    params = {"w": jnp.ones(3)}
    try:
        filterjit.set_retrace_warning_threshold(2)
        f(params, 1, {"mode": "a"})
        f(params, 2, {"mode": "a"})
        f(params, 3, {"mode": "a"})
        with pytest.warns(filterjit.RetraceWarning, match="traced 4 times"):
            f(params, 4, {"mode": "a"})
        filterjit.set_retrace_warning_threshold(None)
        g = filter_jit(_make_f())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for n in range(15):
                g(params, n, {"mode": "a"})
        with pytest.raises(ValueError, match="positive int"):
            filterjit.set_retrace_warning_threshold(0)
    finally:
        filterjit.set_retrace_warning_threshold(10)


def test_num_traces_and_clear_caches():
    f = filter_jit(lambda x, n: x * n)
    x = jnp.ones(2)
    f(x, 2)
    f(x, 2)
    jax.jit(lambda x: f(x, 2))(x)  # nested traces are not counted
    assert filterjit.num_traces(f) == 1
    filterjit.clear_caches()
    f(x, 2)
    assert filterjit.num_traces(f) == 2
    with pytest.raises(TypeError, match="filter_jit-wrapped"):
        filterjit.num_traces(lambda x: x)  # pyright: ignore[reportArgumentType]


def test_retrace_warning_is_for_avoidable_retraces_only():
    # A library entry point traced for new shapes, structures, strings and
    # functions: its ordinary work, no warning even under -W error.
    f = filter_jit(_make_f())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in range(15):
            f({"w": jnp.ones(n + 1)}, 2, {"mode": "a"})
            f({"w": jnp.ones(1), f"extra{n}": jnp.ones(1)}, 2, {"mode": "a"})
            f({"w": jnp.ones(1)}, 2, {"mode": f"mode{n}"})
    assert filterjit.num_traces(f) == 45
    # Flags toggled and settings revisited: values seen before.
    h = filter_jit(lambda x, flag, tol: x * tol if flag else x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in range(30):
            h(jnp.ones(1), n % 2 == 0, (1e-3, 1e-6, 1e-9)[n % 3])
    # A library entry point traced for one problem after another, some of which
    # differ from the one before only in a closure the caller made (as a test suite
    # parametrized over problems does): the closures are not made anew on every call.
    solve = filter_jit(lambda fn, y: fn(y))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in range(40):
            offset = jnp.ones(())
            solve(lambda y: y + offset, jnp.ones(n % 3 + 1))
            solve(lambda y: y + offset, jnp.ones(n % 3 + 1))
            solve(lambda y: y + offset, jnp.ones(n % 3 + 1))
    # A lambda made anew on every call is the trap.
    g = filter_jit(lambda x, fn: fn(x))
    with pytest.warns(filterjit.RetraceWarning, match="a function made anew"):
        for n in range(12):
            g(jnp.ones(1), lambda x: x + 1)


def test_retrace_warning_for_wrappers_of_a_lambda_made_anew_in_a_loop():
    x = jnp.ones(2)
    with pytest.warns(filterjit.RetraceWarning) as record:
        for c in range(12):
            filter_jit(lambda x: x + c)(x)
    (warning,) = record
    message = str(warning.message)
    assert "12 functions `test_retrace_warning_for_wrappers_of_a_lambda_made_anew" in (
        message
    )
    assert f"made anew by the same code ({__file__}:" in message
    assert "pass what it closes over (`c`) as arguments" in message
    assert "jnp.asarray(value)" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for c in range(12, 20):  # once only
            filter_jit(lambda x: x + c)(x)
    # What the warning says: one function, with `c` an array, traces once.
    add = filter_jit(lambda x, c: x + c)
    for c in range(20):
        add(x, jnp.asarray(c, dtype=x.dtype))
    assert filterjit.num_traces(add) == 1


def test_retrace_warning_for_a_lambda_made_anew_at_a_modules_top_level():
    # A script's, a notebook cell's or the REPL's loop: the lambda closes over
    # nothing (`c` is a global), made by one run of the module's code.
    source = "for c in range(12):\n    filter_jit(lambda x: x + c)(x)\n"
    namespace = {"__name__": "a_script", "filter_jit": filter_jit, "x": jnp.ones(2)}
    with pytest.warns(filterjit.RetraceWarning, match="12 functions `<lambda>` made"):
        exec(compile(source, "a_script.py", "exec"), namespace)


def test_no_retrace_warning_for_functions_made_by_separate_calls():
    # A test parametrized over cases, or a library entry point called for one
    # problem after another, that wraps a function it makes: each call's function
    # is its own, with its own closure (or none), and traces once.
    def case(x, c):
        return filter_jit(lambda x: x * c)(x)

    def double(x):
        return filter_jit(lambda x: x * 2)(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for c in range(15):
            case(jnp.ones(2), float(c))
            double(jnp.ones(2))


def test_retrace_warning_for_lambdas_made_anew_can_be_silenced_per_library():
    try:
        filterjit.set_retrace_warning_threshold(None, module=__name__)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for c in range(15):
                filter_jit(lambda x: x + c)(jnp.ones(2))
    finally:
        filterjit._diagnostics._thresholds.pop(__name__, None)


def test_retrace_warning_can_be_silenced_per_library():
    f = filter_jit(_make_f())
    try:
        filterjit.set_retrace_warning_threshold(None, module=__name__)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for n in range(15):
                f({"w": jnp.ones(1)}, n, {"mode": "a"})
        # A lower threshold for this module alone.
        filterjit.set_retrace_warning_threshold(2, module=__name__)
        g = filter_jit(_make_f())
        with pytest.warns(filterjit.RetraceWarning, match="traced 4 times"):
            for n in range(4):
                g({"w": jnp.ones(1)}, n, {"mode": "a"})
    finally:
        filterjit._diagnostics._thresholds.pop(__name__, None)


class _Model(eqx.Module):
    w: jax.Array

    @filter_jit
    def __call__(self, x, scale=2.0):
        return self.w * x * scale

    def method(self, x, scale=2.0):
        return self.w * x * scale


def test_explain_and_num_traces_of_a_decorated_method():
    model = _Model(jnp.ones(3))
    x = jnp.ones(3)
    model(x)
    expected = [
        ("self.w", "traced", "f32[3]"),
        ("x", "traced", "f32[3]"),
        ("scale", "static", "2.0"),
    ]
    # Bound and through the class: the same wrapper, the same trace.
    for explanation in (
        filterjit.explain(model.__call__, x),
        filterjit.explain(_Model.__call__, model, x),
    ):
        assert explanation.cache_hit, explanation
        assert "would hit the cache" in str(explanation)
        assert [row[:3] for row in explanation.rows] == expected
    assert filterjit.num_traces(model.__call__) == 1
    assert filterjit.num_traces(_Model.__call__) == 1
    assert not filterjit.explain(model.__call__, jnp.ones(4)).cache_hit


def test_explain_of_a_decorated_bound_module_method():
    model = _Model(jnp.ones(3))
    method = filter_jit(model.method)
    x = jnp.ones(3)
    assert not filterjit.explain(method, x).cache_hit
    assert method(x, 3.0).tolist() == model.method(x, 3.0).tolist()
    method(x)
    explanation = filterjit.explain(method, x)
    assert explanation.cache_hit
    # Named as the method sees them; the defaulted parameter is listed.
    assert [row[:3] for row in explanation.rows] == [
        ("self.w", "traced", "f32[3]"),
        ("x", "traced", "f32[3]"),
        ("scale", "static", "2.0"),
    ]
    assert filterjit.num_traces(method) == 2


def test_explain_labels_what_a_partial_binds_by_its_parameter():
    def g(params, x, n):
        return params["w"] * x * n

    explanation = filterjit.explain(
        filter_jit(jax.tree_util.Partial(g, {"w": jnp.ones(2)}, jnp.ones(2))), 3
    )
    assert [row[:2] for row in explanation.rows] == [
        ("params['w']", "traced"),
        ("x", "traced"),
        ("n", "static"),
    ]


def test_explain_of_a_jax_jit_function_names_it():
    def f(x):
        return x + 1

    with pytest.warns(UserWarning, match=r"`jax.jit\(.*f\)`, a jax.jit function"):
        text = str(filterjit.explain(jax.jit(f), jnp.ones(3)))
    assert text.startswith("filter_jit(jax.jit(")
    assert "f)), called at the top level" in text
    assert str(filterjit.explain(f, jnp.ones(3))).startswith("filter_jit(")
    assert "jax.jit" not in str(filterjit.explain(f, jnp.ones(3)))


def test_retrace_warning_for_a_partial_made_anew():
    def scaled(scale, x):
        return x * scale

    @filter_jit
    def apply(fn, x):
        return fn(x)

    with pytest.warns(filterjit.RetraceWarning) as record:
        for n in range(12):
            apply(ft.partial(scaled, 0.1 * n), jnp.ones(1))
    (warning,) = record
    message = str(warning.message)
    assert "apply has been traced 12 times" in message
    assert "`fn` changed" in message
    assert "functools.partial compares by identity" in message
    assert "make it once" in message
    assert "jax.tree_util.Partial" in message
    # What the hint says: a jax.tree_util.Partial over an array traces once.
    traced = filterjit.num_traces(apply)
    for n in range(12):
        apply(jax.tree_util.Partial(scaled, jnp.asarray(0.1 * n)), jnp.ones(1))
    assert filterjit.num_traces(apply) == traced + 1


def _scaled(x: jax.Array, k: float) -> jax.Array:
    return x * k


def test_retrace_warning_for_a_partial_made_anew_over_a_changing_float():
    # Core v6 (open from earlier): what a partial binds is the function's own leaf,
    # and a Python float taking a new value there retraced every call unwarned.
    x = jnp.ones(2)
    with pytest.warns(filterjit.RetraceWarning) as record:
        for k in range(15):
            filter_jit(ft.partial(_scaled, k=float(k)))(x)
    (warning,) = record
    assert "`k` changed in" in str(warning.message)


def test_no_retrace_warning_for_one_function_wrapped_again_and_again():
    # A wrapper whose options share no caches (a `compiler_options` dict) has a
    # trace log of its own: the same function wrapped again is not made anew.
    x = jnp.ones(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(15):
            filter_jit(_scaled, compiler_options={})(x, 2.0)


def test_explain_of_a_non_callable_names_explain():
    with pytest.raises(TypeError, match="^explain expects a callable"):
        filterjit.explain(3, jnp.ones(1))  # pyright: ignore[reportArgumentType]


def test_explain_of_equinox_filter_jit_raises_naming_it():
    def g(x):
        return x + 1

    with pytest.raises(TypeError, match=r"\.g` is wrapped by `equinox.filter_jit`"):
        filterjit.explain(eqx.filter_jit(g), jnp.ones(3))

    class Model(eqx.Module):
        @eqx.filter_jit
        def __call__(self, x):
            return x

    with pytest.raises(TypeError, match="wrapped by `equinox.filter_jit`"):
        filterjit.explain(Model().__call__, jnp.ones(3))


_EXPLAIN_AN_EQUINOX_WRAPPER = """
import json

import equinox as eqx
import jax.numpy as jnp

import filterjit


@eqx.filter_jit
def g(x):
    return x + 1


def explained(wrapper):
    try:
        return str(filterjit.explain(wrapper, jnp.ones(3)))
    except TypeError as error:
        return str(error)


held = [g]  # held in a list too: the patch replaces the attribute alone
before = explained(g)
filterjit.patch_equinox()
print(json.dumps({"before": before, "after": explained(g), "held": explained(held[0])}))
"""


def test_explain_of_an_equinox_wrapper_says_what_patch_equinox_replaces(tmp_path):
    """The advice holds: `patch_equinox()` replaces a wrapper made before it where
    it is a module's attribute, so the same name explains afterwards; the same
    wrapper held in a list stays Equinox's."""
    from helpers import run_program

    said = run_program(tmp_path, _EXPLAIN_AN_EQUINOX_WRAPPER)
    assert "is wrapped by `equinox.filter_jit`" in said["before"]
    assert "before decorating" not in said["before"]
    assert "replaces the Equinox wrappers already made" in said["before"]
    assert "one held elsewhere (a local variable, a list) stays" in said["before"]
    assert said["after"].startswith("filter_jit(g), called at the top level")
    assert said["held"] == said["before"]


def test_explain_of_another_jit_wrapper_warns_naming_it():
    class OtherJit:
        def __init__(self, fun):
            self.fun = fun

        def __call__(self, *args):
            return self.fun(*args)

        def lower(self, *args):
            raise NotImplementedError

    with pytest.warns(UserWarning, match=r"a jit wrapper of type `.*OtherJit`") as seen:
        filterjit.explain(OtherJit(lambda x: x), jnp.ones(3))
    assert [w.filename for w in seen] == [__file__], [str(w.message) for w in seen]
    with pytest.warns(UserWarning, match=r"`jax.jit\(.*\)`, a jax.jit function"):
        filterjit.explain(jax.jit(lambda x: x), jnp.ones(3))


def test_explain_marks_what_differs_from_the_nearest_cached_trace():
    @filter_jit
    def f(x, t):
        return x * t

    f(jnp.ones((32, 3)), 1.0)
    f(jnp.ones((4, 3)), 2.0)
    explanation = filterjit.explain(f, jnp.ones((8, 3)), 1.0)
    assert explanation.cache_hit is False
    assert explanation.misses == ["x"]
    text = str(explanation)
    title, _, _, x_row, t_row, *why = text.splitlines()
    assert title.endswith(
        "would trace: `x` differs from the nearest cached trace (trace 1)"
    )
    assert x_row.split() == ["x", "traced", "f32[8,3]", "<-", "f32[32,3]"]
    assert t_row.split() == ["t", "static", "1.0"]  # as cached: not marked
    assert why[0] == "why:" and "x: f32[32,3] -> f32[8,3]" in why[1]
    # A hit marks nothing.
    hit = filterjit.explain(f, jnp.ones((4, 3)), 2.0)
    assert hit.cache_hit and hit.misses == [] and "<-" not in str(hit)


def test_explain_marks_an_argument_the_nearest_trace_did_not_have():
    @filter_jit
    def f(x, extra=None):
        return x

    f(jnp.ones(3))
    explanation = filterjit.explain(f, jnp.ones(3), extra=(1.0,))
    assert explanation.misses == ["extra[0]"]  # `None` has no leaf
    assert "<- <absent>" in str(explanation)


def _retraces(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "filterjit"]


def test_retrace_log_names_only_what_differs_from_the_nearest_cached_trace(
    monkeypatch, caplog
):
    monkeypatch.setenv("FILTERJIT_EXPLAIN_RETRACES", "1")

    @filter_jit
    def f(x, t):
        return x * t

    with caplog.at_level(logging.WARNING, logger="filterjit"):
        f(jnp.ones((32, 3)), 1.0)
        f(jnp.ones((4, 3)), 1.0)
        f(jnp.ones((32, 3)), 2.0)
    first, second = _retraces(caplog)
    assert first.startswith("filter_jit: ") and "x: f32[32,3] -> f32[4,3]" in first
    # Against trace 1, which differs in `t` only; trace 2 also differs in `x`.
    assert "because t: 1.0 -> 2.0" in second
    assert "x:" not in second
    assert "(against trace 1, the nearest cached)" in second


def test_retrace_log_after_the_caches_are_cleared_says_none_is_cached(
    monkeypatch, caplog
):
    monkeypatch.setenv("FILTERJIT_EXPLAIN_RETRACES", "1")

    @filter_jit
    def f(x, t):
        return x * t

    with caplog.at_level(logging.WARNING, logger="filterjit"):
        f(jnp.ones(3), 1.0)
        filterjit.clear_caches()
        gc.collect()
        f(jnp.ones(3), 1.0)
    (message,) = _retraces(caplog)
    assert "no trace is cached" in message


def _apply(fn, x):
    return fn(x)


def test_static_functions_are_shown_by_their_whole_qualified_names(monkeypatch, caplog):
    monkeypatch.setenv("FILTERJIT_EXPLAIN_RETRACES", "1")
    f = filter_jit(_apply)
    relu = f"{jax.nn.relu.__module__}.{jax.nn.relu.__qualname__}"
    rows = filterjit.explain(f, jax.nn.relu, jnp.ones(2)).rows
    assert rows[0].value == relu
    partial = ft.partial(jnp.clip, min=0.0)
    rows = filterjit.explain(f, partial, jnp.ones(2)).rows
    assert rows[0].value == "functools.partial(jax.numpy.clip, min=0.0)"
    with caplog.at_level(logging.WARNING, logger="filterjit"):
        f(jax.nn.relu, jnp.ones(2))
        f(jax.nn.sigmoid, jnp.ones(2))
    (message,) = _retraces(caplog)
    sigmoid = f"{jax.nn.sigmoid.__module__}.{jax.nn.sigmoid.__qualname__}"
    assert f"fn: {relu} -> {sigmoid} (" in message
