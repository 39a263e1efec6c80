"""An error raised in the user's function as filterjit traces or runs it: it
propagates and leaves the cache and an outer trace usable; its traceback holds the
user's frames and none of filterjit's wherever JAX hides its own (as do filterjit's
own errors and those of the ahead-of-time stages); and where a NumPy or JAX scalar
that filterjit traced caused it, or unbounded recursion, a note names the argument
(or the function) and the fix."""

import functools as ft
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from traceback import format_exception
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import subprocess_env, traceback_frames, TraceCounter

import filterjit
from filterjit import _fastpath, filter_jit


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


def test_nested_array_exception_leaves_outer_trace_usable():
    counter = TraceCounter(lambda x, n: x.reshape(n))
    f = filter_jit(counter)
    with pytest.raises(TypeError):
        jax.jit(lambda x: f(x, np.int32(5)))(jnp.ones(4))
    assert jax.jit(lambda x: f(x, np.int32(4)))(jnp.ones(4)).shape == (4,)


_PACKAGE = os.path.dirname(os.path.abspath(filterjit.__file__))
_TESTS = os.path.dirname(os.path.abspath(__file__))


# Raises a shape error in a cold call (traced for the first time, on the reference
# path) and in a warm one (the generated `top` of the latest partition, whose
# entry traces anew for new shapes), each printed as Python prints it uncaught.
_TRACEBACKS = textwrap.dedent(
    """
    import traceback

    import jax.numpy as jnp

    import filterjit


    @filterjit.filter_jit
    def f(a, b):
        return a @ b


    x = jnp.ones((2, 3))
    for call in ("cold", "warm"):
        if call == "warm":
            f(x, x.T)
            f(x, x.T)
        try:
            f(x, jnp.ones((4, 5)))
        except TypeError:
            print(f"=== {call}")
            traceback.print_exc(file=__import__("sys").stdout)
    """
)


def _tracebacks(tmp_path, mode: str | None) -> dict[str, str]:
    """The printed tracebacks of `_TRACEBACKS`, cold and warm, under a
    JAX_TRACEBACK_FILTERING mode (`None`: JAX's default)."""
    script = tmp_path / "script.py"
    script.write_text(_TRACEBACKS)
    env = subprocess_env()
    env.pop("JAX_TRACEBACK_FILTERING", None)
    if mode is not None:
        env["JAX_TRACEBACK_FILTERING"] = mode
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _, cold, warm = re.split(r"^=== (?:cold|warm)\n", done.stdout, flags=re.MULTILINE)
    return {"cold": cold, "warm": warm}


def _filterjit_frames(traceback: str) -> list[str]:
    return [
        line
        for line in traceback.splitlines()
        if line.startswith('  File "') and _PACKAGE + os.sep in line
    ]


@pytest.mark.parametrize("mode", [None, "quiet_remove_frames", "remove_frames"])
def test_tracebacks_hold_no_filterjit_frame_where_jax_hides_its_own(tmp_path, mode):
    for call, traceback in _tracebacks(tmp_path, mode).items():
        if mode == "remove_frames":
            # JAX's own frames are in the unfiltered stack it attaches as the
            # cause; the traceback of the error itself is the one filtered.
            traceback = traceback.rpartition("direct cause of the following")[2]
        assert _filterjit_frames(traceback) == [], (call, traceback)
        assert "line 11, in f\n    return a @ b" in traceback, (call, traceback)
        assert "TypeError: dot_general requires contracting dimensions" in traceback


def test_tracebacks_show_filterjit_frames_with_filtering_off(tmp_path):
    tracebacks = _tracebacks(tmp_path, "off")
    cold, warm = (
        [line.rpartition(os.sep)[2] for line in _filterjit_frames(tracebacks[call])]
        for call in ("cold", "warm")
    )
    assert any(line.startswith("_dispatch.py") for line in cold), tracebacks["cold"]
    # The warm call went through the generated code (where the fast path is on),
    # shown where not filtered.
    shown = "<generated hit" if _fastpath.ENABLED else "_dispatch.py"
    assert any(line.startswith(shown) for line in warm), tracebacks["warm"]


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


def test_under_tracebackhide_filterjit_frames_are_marked_hidden():
    # IPython's mode: frames are kept, and those JAX hides are marked.
    @filter_jit
    def f(a, b):
        return a @ b

    previous = jax.config.jax_traceback_filtering  # pyright: ignore[reportAttributeAccessIssue]
    jax.config.update("jax_traceback_filtering", "tracebackhide")
    try:
        for _ in range(2):  # cold, then warm through the generated code
            f(jnp.ones((2, 3)), jnp.ones((3, 2)))
        with pytest.raises(TypeError) as info:
            f(jnp.ones((2, 3)), jnp.ones((4, 5)))
    finally:
        jax.config.update("jax_traceback_filtering", previous)
    ours = [
        frame
        for frame in traceback_frames(info.value)
        if frame.f_code.co_filename.startswith(_PACKAGE + os.sep)
    ]
    assert ours
    assert all(frame.f_locals.get("__tracebackhide__") for frame in ours)


def test_a_filterjit_error_of_its_own_is_raised_without_its_frames():
    @filter_jit
    def f(x, n):
        return x * n

    with pytest.raises(TypeError, match="takes 2 positional") as info:
        f(jnp.ones(2), 1, 2)  # pyright: ignore[reportCallIssue]
    frames = [frame.f_code.co_filename for frame in traceback_frames(info.value)]
    assert not [name for name in frames if name.startswith(_PACKAGE + os.sep)], frames
    with pytest.raises(TypeError, match="takes 2 positional") as info:
        filterjit.explain(f, jnp.ones(2), 1, 2)
    frames = [frame.f_code.co_filename for frame in traceback_frames(info.value)]
    assert not [name for name in frames if name.startswith(_PACKAGE + os.sep)], frames


def test_ahead_of_time_stages_raise_without_filterjits_frames():
    @filter_jit
    def f(a, b, n=1):
        return a @ b

    bad, good = (
        (jnp.ones((2, 3)), jnp.ones((4, 5))),
        (jnp.ones((2, 3)), jnp.ones((3, 5))),
    )
    compiled = f.lower(*good).compile()
    stages = {
        "lower": (lambda: f.lower(*bad), TypeError),
        "trace": (lambda: f.trace(*bad), TypeError),
        "eval_shape": (lambda: f.eval_shape(*bad), TypeError),
        "Compiled.__call__": (lambda: compiled(*good, n=2), ValueError),
    }
    for name, (stage, error) in stages.items():
        with pytest.raises(error) as info:
            stage()
        files = [frame.f_code.co_filename for frame in traceback_frames(info.value)]
        ours = [file for file in files if file.startswith(_PACKAGE + os.sep)]
        assert ours == [], (name, ours)


# What Python needs the value of a traced scalar for, at the top level.
_NEEDS_A_VALUE: dict[str, Callable[[Any, Any], Any]] = {
    "shape": lambda x, n: jnp.zeros(n),
    "shape in a tuple": lambda x, n: jnp.ones((n, 2)),
    "reshape": lambda x, n: x.reshape(n, -1),
    "arange": lambda x, n: jnp.arange(n),
    "slice": lambda x, n: x[:n],
    "index of a list": lambda x, n: [x, x, x, x][n],
    "range": lambda x, n: [x for _ in range(n)],
    "if": lambda x, n: x if n > 1 else -x,
    "NumPy shape": lambda x, n: np.zeros(n),
    "a primitive's parameter": lambda x, n: jnp.tile(x, n),
}


@pytest.mark.parametrize("scalar", [np.int64(3), jnp.int32(3)], ids=["numpy", "jax"])
@pytest.mark.parametrize("case", list(_NEEDS_A_VALUE))
def test_a_traced_scalar_that_python_needs_gets_the_note(case, scalar):
    f = filter_jit(_NEEDS_A_VALUE[case])
    with pytest.raises(Exception) as info:
        f(jnp.ones(6), scalar)
    notes = [n for n in getattr(info.value, "__notes__", ()) if "filter_jit" in n]
    assert len(notes) == 1, (str(info.value), info.value.__notes__)
    kind = "NumPy" if isinstance(scalar, np.generic) else "JAX"
    assert "was called at the top level" in notes[0]
    assert f"(here `n`, a {kind} int" in notes[0]
    assert "`int(n)`" in notes[0]
    # JAX's advice about an option filter_jit does not take is gone.
    assert "try using `static_argnums`" not in str(info.value)
    # And the note is right: a Python int runs; inside a `jax.jit` holding `n`, the
    # call does what the undecorated one does (a JAX `n > 1` is traced there too).
    f(jnp.ones(6), 3)
    outcomes = []
    for g in (f, _NEEDS_A_VALUE[case]):
        try:
            outcomes.append(jax.jit(lambda x: g(x, scalar))(jnp.ones(6)))
        except Exception as error:
            outcomes.append(type(error))
    assert jax.tree.all(jax.tree.map(np.array_equal, *outcomes)), outcomes


class _Config(eqx.Module):
    n: Any


def _pad_mask(x, n_valid):  # a library's helper: its size a NumPy config value
    mask = jnp.ones(n_valid)  # where Python needs the value
    return jnp.pad(mask, (0, x.shape[0] - n_valid)) * x


# Eager transforms around a loss whose helper needs its size's value.
_EAGER: dict[str, Callable[[Callable[[Any], Any], Any], Any]] = {
    "grad": lambda loss, x: jax.grad(loss)(x),
    "vjp": lambda loss, x: jax.vjp(loss, x)[1](1.0),
    "jvp": lambda loss, x: jax.jvp(loss, (x,), (x,)),
    "vmap": lambda loss, x: jax.vmap(loss)(x[None]),
}


@pytest.mark.parametrize("transform", list(_EAGER))
def test_a_numpy_size_under_an_eager_transform_gets_the_note_and_its_fixes_run(
    transform,
):
    # Debugging a step without its `jax.jit`: the helper's NumPy size, a constant
    # inside the `jax.jit`, is traced under the eager transform, as at the top level.
    run = _EAGER[transform]
    config = _Config(np.int64(12))
    pad_mask = filter_jit(_pad_mask)
    x = jnp.arange(16.0)
    nested = filter_jit(lambda x, config: pad_mask(x, config.n).sum())
    for loss, label, name in [
        (lambda x: pad_mask(x, config.n).sum(), "n_valid", "_pad_mask"),
        (lambda x: nested(x, config), "config.n", "<lambda>"),  # nested helper
    ]:
        with pytest.raises(TypeError, match="Shapes must be") as info:
            run(loss, x)
        notes = [n for n in getattr(info.value, "__notes__", ()) if "filter_jit" in n]
        assert len(notes) == 1, (str(info.value), getattr(info.value, "__notes__", ()))
        assert f"{name}` was called under eager transforms" in notes[0]  # where
        assert "as at the top level" in notes[0]  # and why
        assert f"(here `{label}`, a NumPy int64)" in notes[0]
        assert f"`int({label})`" in notes[0]  # the fixes
        assert f"`jax.jit` (a training step's, say) that holds `{label}`" in notes[0]
        # At the user's line: the innermost frame shown outside JAX is the
        # helper's, and none is filterjit's.
        codes = [frame.f_code for frame in traceback_frames(info.value)]
        ours = [c for c in codes if c.co_filename.startswith(_PACKAGE + os.sep)]
        outside_jax = [c for c in codes if c.co_filename.startswith(_TESTS)]
        assert ours == [] and outside_jax[-1] is _pad_mask.__code__, codes
    # The note is right: a Python int, or the `jax.jit` kept, runs as the
    # undecorated program does.
    reference = run(lambda x: _pad_mask(x, config.n).sum(), x)
    fixed = [
        run(lambda x: pad_mask(x, int(config.n)).sum(), x),
        jax.jit(lambda x: run(lambda x: pad_mask(x, config.n).sum(), x))(x),
    ]
    for out in fixed:
        assert jax.tree.all(jax.tree.map(np.array_equal, out, reference))


def test_a_prng_key_among_the_traced_arguments_leaves_the_users_error_as_it_is():
    # A key's dtype is an extended one, without `.kind`: the note still names `n`.
    f = filter_jit(lambda key, n: jax.random.normal(key, (2,)) + jnp.zeros(n))
    with pytest.raises(TypeError, match="Shapes must be") as info:
        f(jax.random.key(0), np.int32(2))
    (note,) = [n for n in info.value.__notes__ if "filter_jit" in n]
    assert "(here `n`, a NumPy int32)" in note
    assert "`key`" not in note
    g = filter_jit(jax.grad(lambda x, key, lower: _count_up(x, lower)))
    with pytest.raises(ValueError, match="Reverse-mode") as info:
        g(0.0, jax.random.key(0), np.int32(0))
    (note,) = [n for n in info.value.__notes__ if "filter_jit" in n]
    assert "(here `lower`, a scalar of dtype int32)" in note


def _count_up(init, lower):
    return jax.lax.fori_loop(lower, 1, lambda _, y: y + 1.0, init)


def _count_to(init, upper):
    return jax.lax.fori_loop(0, upper, lambda _, y: y * 2.0, init)


# Reverse mode through a function, inside a function filter_jit traces.
_REVERSE_MODE: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "grad": jax.grad,
    "vjp": lambda f: ft.wraps(f)(lambda x, n: jax.vjp(f, x, n)[1](1.0)[0]),
    "jacrev": jax.jacrev,
    "value_and_grad": jax.value_and_grad,
}


@pytest.mark.parametrize("scalar", [np.int32(0), jnp.int32(0)], ids=["numpy", "jax"])
@pytest.mark.parametrize("bound", ["lower", "upper"])
@pytest.mark.parametrize("how", list(_REVERSE_MODE))
def test_the_reverse_mode_loop_error_in_a_trace_names_the_traced_scalar_and_the_fix(
    how, bound, scalar
):
    # Reverse mode inside the function reaches a `fori_loop` whose bounds
    # filter_jit traced: the error passes through filter_jit's trace.
    loop = _count_up if bound == "lower" else _count_to
    f = filter_jit(_REVERSE_MODE[how](loop))
    with pytest.raises(ValueError, match="Reverse-mode differentiation") as info:
        f(1.0, scalar)
    notes = [n for n in getattr(info.value, "__notes__", ()) if "filter_jit" in n]
    assert len(notes) == 1, (str(info.value), getattr(info.value, "__notes__", ()))
    assert f"`{loop.__name__}` traced" in notes[0]
    assert f"(here `{bound}`, a scalar of dtype int32)" in notes[0]
    assert "`jax.grad`" in notes[0]  # why it was traced there
    assert f"`int({bound})`" in notes[0]
    assert f"`jax.jit` (a training step's, say) that holds `{bound}`" in notes[0]
    # Shown once, though JAX quotes the error in the loop's stack it attaches.
    printed = "".join(format_exception(info.value))
    assert printed.count("filter_jit: the `lax.fori_loop`") == 1, printed
    # And the note is right: a Python int, or a `jax.jit` around holding the scalar.
    python, same = (0, scalar) if bound == "lower" else (1, scalar + 1)
    assert all(map(np.isfinite, jax.tree.leaves(f(1.0, python))))
    assert all(map(np.isfinite, jax.tree.leaves(jax.jit(lambda x: f(x, same))(1.0))))


def test_the_reverse_mode_loop_error_around_a_call_is_jaxs_own():
    # `jax.grad` around the call transposes the loop after the call returned, in
    # JAX alone (filterjit changes none of its rules): the error is JAX's, bare.
    f = filter_jit(_count_up)
    with pytest.raises(ValueError, match="Reverse-mode differentiation") as info:
        jax.grad(f)(1.0, np.int32(0))
    assert not [n for n in getattr(info.value, "__notes__", ()) if "filter_jit" in n]
    # What the note says inside a trace holds here too.
    assert jax.grad(f)(1.0, 0) == 1.0
    assert jax.jit(lambda x: jax.grad(f)(x, np.int32(0)))(1.0) == 1.0


def test_the_loop_note_names_only_the_scalars_the_loop_depends_on():
    def f(x, steps, lower):
        y = _count_up(x, lower)
        return jnp.where(steps > 0, y, -y)

    with pytest.raises(ValueError, match="Reverse-mode") as info:
        filter_jit(jax.grad(f))(1.0, np.int32(3), np.int32(0))
    (note,) = [n for n in info.value.__notes__ if "filter_jit" in n]
    assert "(here `lower`, a scalar of dtype int32)" in note, note


def _while_loop(x, n):  # a Python int in place of `n` would not help
    return jax.lax.while_loop(
        lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 2), (0, x)
    )[1]


def test_a_loop_error_no_traced_scalar_caused_gets_no_note():
    def array_bound(x, n):  # not a scalar
        return _count_to(x, n.sum())

    def after_a_fori_loop(x, n):  # it is the `while_loop` that fails
        steps = jax.lax.fori_loop(0, n, lambda _, c: c + 1, 0)
        return _while_loop(x, steps)

    for loop, n in [
        (_while_loop, np.int32(2)),
        (array_bound, np.array([1, 2])),
        (after_a_fori_loop, np.int32(2)),
    ]:
        with pytest.raises(ValueError, match="Reverse-mode") as info:
            filter_jit(jax.grad(loop))(1.0, n)
        notes = [n for n in getattr(info.value, "__notes__", ()) if "filter_jit" in n]
        assert notes == [], notes
    # Without filterjit (`jax.jit` traces `lower`), the error is JAX's alone.
    with pytest.raises(ValueError, match="Reverse-mode") as info:
        jax.jit(jax.grad(_count_up))(1.0, 0)
    assert not [n for n in getattr(info.value, "__notes__", ()) if "filter_jit" in n]


def test_the_note_names_the_argument_that_jax_says_the_value_depends_on():
    @filter_jit
    def f(x, n, m):
        return jnp.zeros(m) + n

    with pytest.raises(TypeError) as info:
        f(jnp.ones(2), np.int32(1), np.int32(2))
    (note,) = [n for n in info.value.__notes__ if "filter_jit" in n]
    assert "`m`, a NumPy int32" in note
    assert "`n`" not in note


def test_an_error_no_scalar_caused_gets_no_note():
    @filter_jit
    def f(a, b, n):
        return a @ b

    with pytest.raises(TypeError) as info:
        f(jnp.ones((2, 3)), jnp.ones((4, 5)), np.int32(2))
    assert not [n for n in getattr(info.value, "__notes__", ()) if "filter_jit" in n]


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
    assert "steps` was called at the top level" in notes[0]
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
