"""`filterjit.patch_equinox()`: `equinox.filter_jit` replaced for every caller, the
wrappers Equinox already made replaced where they are found, the rest reported,
and the undo.

The patch changes global state (Equinox's module, every module that holds an
Equinox wrapper), so each test runs its program in a fresh interpreter: that is
also the only way to control what was imported first.
"""

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import run_program

import filterjit


def _run(tmp_path: Path, source: str, *args: str) -> Any:
    """Runs `source` as a script in a fresh interpreter, with filterjit from this
    checkout and `tmp_path` importable, and returns what its last line printed,
    read as JSON."""
    return run_program(tmp_path, source, args=args)


_LIBRARIES = """
import json
import sys
import warnings

import filterjit

warnings.simplefilter("error")  # patch_equinox warns only if it leaves something
order = sys.argv[1]
if order == "libraries first":
    import diffrax
    import lineax
    import optimistix

    report = filterjit.patch_equinox()
elif order == "patch first":
    report = filterjit.patch_equinox()
    import diffrax
    import lineax
    import optimistix
else:  # lineax before the patch; optimistix, which imports it, and diffrax after
    import lineax

    report = filterjit.patch_equinox()
    import diffrax
    import optimistix

import jax
import jax.numpy as jnp
import numpy as np

entry_points = {
    "diffrax.diffeqsolve": diffrax.diffeqsolve,
    "optimistix.root_find": optimistix.root_find,
    "optimistix.minimise": optimistix.minimise,
    "lineax.linear_solve": lineax.linear_solve,
    # Where the libraries call them from, and a method.
    "optimistix._root_find.root_find": sys.modules["optimistix._root_find"].root_find,
    "lineax._solve.linear_solve": sys.modules["lineax._solve"].linear_solve,
    "diffrax.LinearInterpolation.evaluate": vars(diffrax.LinearInterpolation)[
        "evaluate"
    ],
}
kinds = {name: type(value).__name__ for name, value in entry_points.items()}

# They run, and compute what they should.
solution = diffrax.diffeqsolve(
    diffrax.ODETerm(lambda t, y, args: -y),
    diffrax.Tsit5(),
    t0=0.0,
    t1=1.0,
    dt0=0.1,
    y0=jnp.array(1.0),
    stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6),
)
newton = optimistix.Newton(rtol=1e-5, atol=1e-5)
root = jax.jit(
    lambda y0: optimistix.root_find(lambda y, args: y**2 - 2.0, newton, y0).value
)(jnp.array(1.0))
minimum = optimistix.minimise(
    lambda y, args: jnp.sum((y - 3.0) ** 2),
    optimistix.BFGS(rtol=1e-5, atol=1e-5),
    jnp.zeros(2),
).value
matrix = jnp.array([[3.0, 1.0], [1.0, 2.0]])
x = lineax.linear_solve(
    lineax.MatrixLinearOperator(matrix), jnp.array([9.0, 8.0])
).value
interpolation = diffrax.LinearInterpolation(
    jnp.array([0.0, 1.0]), jnp.array([0.0, 2.0])
)
print(
    json.dumps(
        {
            "kinds": kinds,
            "solution": float(solution.ys[-1]),
            "root": float(root),
            "minimum": np.asarray(minimum).tolist(),
            "x": np.asarray(x).tolist(),
            "interpolated": float(interpolation.evaluate(0.25)),
            "swapped": report.swapped,
            "left": report.left,
        }
    )
)
"""


@pytest.mark.parametrize(
    "order", ["libraries first", "patch first", "lineax, patch, the rest"]
)
def test_library_entry_points_are_filterjit_whichever_was_imported_first(
    tmp_path: Path, order: str
):
    for library in ("diffrax", "optimistix", "lineax"):
        pytest.importorskip(library)
    result = _run(tmp_path, _LIBRARIES, order)
    assert set(result["kinds"].values()) == {"FilterJitWrapper"}, result["kinds"]
    assert result["solution"] == pytest.approx(0.36787944, rel=1e-5)
    assert result["root"] == pytest.approx(2.0**0.5, rel=1e-6)
    assert result["minimum"] == pytest.approx([3.0, 3.0], rel=1e-5)
    assert result["x"] == pytest.approx([2.0, 3.0], rel=1e-6)
    assert result["interpolated"] == pytest.approx(0.5)
    assert result["left"] == []
    # What the patch itself replaced: what was imported before it.
    swapped = set(result["swapped"])
    assert "equinox._errors.branched_error_if_impl" in swapped
    assert ("diffrax._integrate.diffeqsolve" in swapped) == (order == "libraries first")
    assert ("lineax._solve.linear_solve" in swapped) == (order != "patch first")


_HELPER_LIBRARY = """
import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jax import lax

CONFIG = {"n_steps": np.int64(48)}


@eqx.filter_jit
def relax(x, n_steps):
    return lax.fori_loop(0, n_steps, lambda _, y: 0.9 * y + 0.1 * jnp.tanh(y), x)
"""

_HELPER_CALLER = """
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import filterjit

patch_first = sys.argv[1] == "patch first"
if patch_first:
    filterjit.patch_equinox()
import helperlib

undecorated = helperlib.relax.__wrapped__


def loss(w, x):
    return jnp.sum(helperlib.relax(w * x, helperlib.CONFIG["n_steps"]) ** 2)


def reference_loss(w, x):
    return jnp.sum(undecorated(w * x, helperlib.CONFIG["n_steps"]) ** 2)


w, x = jnp.linspace(0.5, 1.5, 8), jnp.linspace(-1.0, 1.0, 8)
error = None
if not patch_first:  # Equinox's wrapper
    try:
        jax.jit(jax.value_and_grad(loss))(w, x)
    except ValueError as e:
        error = str(e)
    swapped = filterjit.patch_equinox().swapped
else:
    swapped = []
value, grad = jax.jit(jax.value_and_grad(loss))(w, x)
reference_value, reference_grad = jax.jit(jax.value_and_grad(reference_loss))(w, x)
print(
    json.dumps(
        {
            "error": error,
            "kind": type(helperlib.relax).__name__,
            "swapped": swapped,
            "value": [float(value), float(reference_value)],
            "grad": [np.asarray(grad).tolist(), np.asarray(reference_grad).tolist()],
        }
    )
)
"""


@pytest.mark.parametrize("order", ["library first", "patch first"])
def test_library_helper_works_nested_under_grad(tmp_path: Path, order: str):
    # jax-ml/jax#9298 inside a library: an `@eqx.filter_jit` helper given a count
    # from a config as a NumPy integer, called inside the user's jit under
    # value_and_grad. Equinox traces the count, so the loop is a while_loop.
    (tmp_path / "helperlib.py").write_text(_HELPER_LIBRARY, encoding="utf-8")
    result = _run(tmp_path, _HELPER_CALLER, order)
    if order == "library first":
        assert result["error"] is not None
        assert (
            "Reverse-mode differentiation does not work for lax.while_loop"
            in (result["error"])
        )
        assert "helperlib.relax" in result["swapped"]
    assert result["kind"] == "FilterJitWrapper"
    # The same program undecorated: the reference.
    assert result["value"][0] == pytest.approx(result["value"][1], rel=1e-6)
    assert result["grad"][0] == pytest.approx(result["grad"][1], rel=1e-6)


_WRAPPERS = """
import json
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
from equinox import filter_jit as imported_filter_jit

import filterjit
from filterjit._jit import FilterJitWrapper
from filterjit._patch import equinox_filter_jit

original = eqx.filter_jit


def add(x, y):  # two outputs, so that both inputs can be donated
    return x + y, x * y


def first(x, y):
    return x


donate_all = eqx.filter_jit(add, donate="all")
donate_rest = eqx.filter_jit(add, donate="all-except-first")
plain = eqx.filter_jit(add)
keep_unused = eqx.filter_jit(first, keep_unused=True)  # a jax.jit keyword


def make_closure():
    inner = eqx.filter_jit(lambda x: x + 1)  # held by a closure only
    return lambda x: inner(x)


closure = make_closure()


@eqx.filter_jit
def increment(x):
    return x + 1


class Plain:
    @eqx.filter_jit
    def double(self, x):
        return 2 * x

    shift = staticmethod(eqx.filter_jit(lambda x: x - 1))

    class Nested:
        @eqx.filter_jit
        def triple(self, x):
            return 3 * x


class Scale(eqx.Module):
    factor: jax.Array

    @eqx.filter_jit
    def __call__(self, x):
        return self.factor * x


before = {
    "increment": increment,
    "double": vars(Plain)["double"],
    "shift": vars(Plain)["shift"],
    "call": vars(Scale)["__call__"],
}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report = filterjit.patch_equinox()
again = filterjit.patch_equinox()  # idempotent: nothing more to replace


def deleted(wrapper):
    x, y = jnp.ones(3), jnp.ones(3)
    out = wrapper(x, y)
    assert (out[0] == 2).all() and (out[1] == 1).all()
    return [x.is_deleted(), y.is_deleted()]


def kind(value):
    return type(value).__name__


two_args = jnp.ones(2), jnp.ones(2)
unused_kept = eqx.filter_jit(first, keep_unused=True)
unused_dropped = eqx.filter_jit(first)
patched = {
    "filter_jit": [
        # filterjit's, with Equinox's meaning of `donate` (test_dropin.py).
        eqx.filter_jit is equinox_filter_jit,
        eqx._jit.filter_jit is equinox_filter_jit,
        imported_filter_jit is equinox_filter_jit,
    ],
    "kinds": [
        kind(increment),
        kind(vars(Plain)["double"]),
        kind(vars(Plain)["shift"].__func__),
        kind(vars(Plain.Nested)["triple"]),
        kind(vars(Scale)["__call__"]),
        kind(keep_unused),
    ],
    "values": [
        float(increment(jnp.array(1.0))),
        float(Plain().double(jnp.array(2.0))),
        float(Plain.shift(jnp.array(3.0))),
        float(Plain.Nested().triple(jnp.array(1.0))),
        float(Scale(jnp.array(2.0))(jnp.array(3.0))),
        float(jax.jit(lambda x: Scale(x)(x))(jnp.array(3.0))),
    ],
    "deleted": [deleted(donate_all), deleted(donate_rest), deleted(plain)],
    # jax.jit keywords of a wrapper made after the patch carry over.
    "keep_unused": [
        unused_kept.lower(*two_args).as_text().count("tensor<2xf32>"),
        unused_dropped.lower(*two_args).as_text().count("tensor<2xf32>"),
    ],
    "left": report.left,
    "warnings": [str(w.message) for w in caught],
    "again": [again.swapped, again.places, again.left],
    "swapped": report.swapped,
    "places": report.places,
}
# filterjit after the patch: Equinox's runtime checks, called eagerly, go through
# the wrapper the patch put in equinox._errors; nothing recurses.
try:
    eqx.error_if(jnp.array(1.0), jnp.array(True), "checked")
except eqx.EquinoxRuntimeError as error:
    patched["error_if"] = "checked" in str(error)
decorated_while_patched = eqx.filter_jit(lambda x: x)

filterjit.unpatch_equinox()
undone = {
    "filter_jit": [
        eqx.filter_jit is original,
        eqx._jit.filter_jit is original,
        imported_filter_jit is original,
    ],
    "restored": [
        increment is before["increment"],
        vars(Plain)["double"] is before["double"],
        vars(Plain)["shift"] is before["shift"],
        vars(Scale)["__call__"] is before["call"],
    ],
    "new": kind(eqx.filter_jit(lambda x: x)),
    "decorated_while_patched": kind(decorated_while_patched),
    "values": [
        float(increment(jnp.array(1.0))),
        float(Scale(jnp.array(2.0))(jnp.array(3.0))),
    ],
}
filterjit.unpatch_equinox()  # without a patch in force: nothing
print(json.dumps({"patched": patched, "undone": undone}))
"""


def test_wrappers_options_report_and_undo(tmp_path: Path):
    result = _run(tmp_path, _WRAPPERS)
    patched, undone = result["patched"], result["undone"]
    assert patched["filter_jit"] == [True, True, True]
    # Module attributes, methods (of a class, a nested class, a Module),
    # staticmethods: replaced, and still bound as methods.
    assert patched["kinds"] == ["FilterJitWrapper"] * 5 + ["_JitWrapper"]
    assert patched["values"] == [2.0, 4.0, 2.0, 3.0, 6.0, 9.0]
    # `donate` carries over.
    assert patched["deleted"] == [[True, True], [False, True], [False, False]]
    assert patched["keep_unused"][0] > patched["keep_unused"][1]
    # What cannot be replaced is named, with why, in the report and a warning.
    left = patched["left"]
    assert len(left) == 2, left
    assert any("__main__.first" in item and "jax.jit keywords" in item for item in left)
    assert any(
        "make_closure.<locals>.<lambda>" in entry and "not an attribute" in entry
        for entry in left
    )
    assert len(patched["warnings"]) == 1
    assert "__main__.first" in patched["warnings"][0]
    assert "make_closure" in patched["warnings"][0]
    assert "__main__.increment" in patched["swapped"]
    assert "__main__.Plain.Nested.triple" in patched["swapped"]
    assert {"equinox.filter_jit", "__main__.imported_filter_jit"} <= set(
        patched["places"]
    )
    assert patched["again"] == [[], [], left]
    assert patched["error_if"] is True
    # The undo.
    assert undone["filter_jit"] == [True, True, True]
    assert undone["restored"] == [True, True, True, True]
    assert undone["new"] == "_JitWrapper"
    assert undone["decorated_while_patched"] == "FilterJitWrapper"
    assert undone["values"] == [2.0, 6.0]


def test_without_equinox_the_error_says_so(monkeypatch: pytest.MonkeyPatch):
    # `None` in sys.modules makes an import fail, as if Equinox were not installed.
    monkeypatch.setitem(sys.modules, "equinox", None)
    monkeypatch.setitem(sys.modules, "equinox._jit", None)
    with pytest.raises(ImportError, match=r"Equinox cannot be imported.*pip install"):
        filterjit.patch_equinox()


_LEFT_IN_A_CLOSURE = """
import json
import warnings

import equinox as eqx

import filterjit


def make():
    return eqx.filter_jit(lambda x: x + 1)


kept = [make()]  # held in a list, not an attribute: left, and warned of
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    filterjit.patch_equinox()  # the warning's line
(warning,) = caught
print(json.dumps({"file": warning.filename, "line": warning.lineno}))
"""


def test_the_warning_for_what_is_left_points_at_the_callers_line(tmp_path: Path):
    where = _run(tmp_path, _LEFT_IN_A_CLOSURE)
    lines = _LEFT_IN_A_CLOSURE.splitlines()
    assert Path(where["file"]) == tmp_path / "program.py", where
    assert lines[where["line"] - 1].endswith("# the warning's line"), where


# A library built on Equinox (as interpax is), decorating with `eqx.filter_jit`
# at import, with a static float, and anew on every call.
_QUIET_LIBRARY = """
import equinox as eqx


@eqx.filter_jit
def evaluate(x, c):
    return x * c


@eqx.filter_jit(donate="all-except-first")
def evaluate_donating(c, x):
    return x * c


def build(x, cs):
    return [eqx.filter_jit(lambda x: x * c)(x) for c in cs]
"""

_QUIET = """
import json
import logging
import sys
import warnings

import jax.numpy as jnp

import filterjit

records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("filterjit").addHandler(handler)
if sys.argv[1] == "patched":
    filterjit.patch_equinox()
else:  # the library decorated with filterjit's own filter_jit
    import equinox

    equinox.filter_jit = filterjit.filter_jit
import quiet_library  # noqa: E402

x = jnp.ones(2)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")  # every warning, as under `-W error`
    for n in range(15):
        c = 0.5 + n  # a Python float: static, each new value traced anew
        quiet_library.evaluate(x, c)
        quiet_library.evaluate_donating(c, jnp.ones(2))
    quiet_library.build(x, [0.5 + n for n in range(15)])
warned = [f"{w.category.__name__}: {w.message}" for w in caught]
kind = type(quiet_library.evaluate).__name__
print(json.dumps({"kind": kind, "warned": warned, "logged": records}))
"""


@pytest.mark.parametrize("explain", [False, True])
def test_patched_wrappers_give_no_retrace_warning_as_equinox_gives_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, explain: bool
):
    # A library run with warnings as errors runs patched as it runs under Equinox.
    if explain:
        monkeypatch.setenv("FILTERJIT_EXPLAIN_RETRACES", "1")
    else:
        monkeypatch.delenv("FILTERJIT_EXPLAIN_RETRACES", raising=False)
    modules = {"quiet_library": _QUIET_LIBRARY}
    result = run_program(tmp_path, _QUIET, modules, args=["patched"])
    assert result["kind"] == "FilterJitWrapper"
    assert result["warned"] == []
    logged = result["logged"]
    if not explain:
        assert logged == []
    else:
        # The retrace log stays: each retrace of the two entry points, and each
        # function made anew in the loop after the first, is logged.
        assert len(logged) == 3 * 14, logged
        assert sum("because c: 0.5 -> 1.5" in line for line in logged) == 2, logged
        made_anew = [line for line in logged if "made anew by the same code" in line]
        assert len(made_anew) == 14, made_anew
        # (`build.<locals>.<listcomp>.<lambda>` before Python 3.12's inlined
        # comprehensions, `build.<locals>.<lambda>` from it.)
        assert re.search(r"`build\.<locals>\.(<listcomp>\.)?<lambda>`", made_anew[0])


def test_filter_jit_itself_warns_where_the_patched_wrappers_do_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # The same library decorated with filterjit's own filter_jit: the warnings the
    # patch quiets are there (and so the test above can fail).
    monkeypatch.delenv("FILTERJIT_EXPLAIN_RETRACES", raising=False)
    modules = {
        "quiet_library": _QUIET_LIBRARY.replace('(donate="all-except-first")', "")
    }
    result = run_program(tmp_path, _QUIET, modules, args=["unpatched"])
    assert result["kind"] == "FilterJitWrapper"
    warned = result["warned"]
    assert len(warned) == 3, warned
    assert all(w.startswith("RetraceWarning: filter_jit: ") for w in warned), warned
    assert sum("`c` changed" in w for w in warned) == 2, warned
    assert sum("<lambda>` made anew" in w for w in warned) == 1, warned
