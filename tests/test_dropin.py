"""Drop-in replacement: `patch_equinox()` keeps Equinox's meanings (donation, its
removed keywords, factories it cannot reach named), `filterjit.jit` accepts,
refuses and shares traces as `jax.jit` does, and wrappers pickle as functions do.

The references are Equinox's own `filter_jit` (unpatched) and `jax.jit`, given the
same calls. Programs that patch Equinox run in a fresh interpreter each.
"""

import copy
import inspect
import pickle
import re
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import assert_same_outcome, assert_tree_allclose, JAX_ERRORS, outcome
from helpers import run_program, TraceCounter
from jax.sharding import NamedSharding, PartitionSpec as P

import filterjit
from filterjit import filter_jit


# Finding 1. Every function returns one array per array it is given, of its shape,
# so that every donated buffer is usable and so deleted: which are deleted is which
# were donated. Each case names the role Equinox gives `w`, `x` and `y`: the
# function's own arrays, the call's first argument, the rest, or static (compiled
# in: never donated).
_DONATION = """
import functools as ft
import json
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

import filterjit

OPTIONS = ["none", "all", "all-except-first", "warn", "warn-except-first"]


def triple(w, x, y):
    return w + 1, x * 2, y - 1


def pair(x, y):
    return x * 2, y - 1


def keyword_only(x, *, y):
    return x * 2, y - 1


class Model(eqx.Module):
    w: jax.Array

    def __call__(self, x, y):
        return triple(self.w, x, y)

    def method(self, x, y):
        return triple(self.w, x, y)


class Holder:  # not a pytree: Equinox holds a bound method's `self` static
    def __init__(self, w):
        self.w = w

    def method(self, x, y):
        return triple(self.w, x, y)


def decorated_module(jit, donate):
    class Decorated(eqx.Module):
        w: jax.Array

        @jit(donate=donate)
        def __call__(self, x, y):
            return triple(self.w, x, y)

    return Decorated


def decorated_class(jit, donate):
    class Decorated:
        def __init__(self, w):
            self.w = w

        @jit(donate=donate)
        def method(self, x, y):
            return triple(self.w, x, y)

    return Decorated


# name: (call with jit, donate and the arrays, the roles of w, x and y)
CASES = {
    "function": (lambda j, d, w, x, y: j(pair, donate=d)(x, y), "s1r"),
    "function, by keyword": (lambda j, d, w, x, y: j(pair, donate=d)(x=x, y=y), "s1r"),
    "keyword-only": (lambda j, d, w, x, y: j(keyword_only, donate=d)(x, y=y), "s1r"),
    "module": (lambda j, d, w, x, y: j(Model(w), donate=d)(x, y), "f1r"),
    "module's method": (
        lambda j, d, w, x, y: j(Model(w).method, donate=d)(x, y),
        "f1r",
    ),
    "method decorated in a module": (
        lambda j, d, w, x, y: decorated_module(j, d)(w)(x, y),
        "1rr",
    ),
    "method decorated in a class": (
        lambda j, d, w, x, y: decorated_class(j, d)(w).method(x, y),
        "srr",
    ),
    "bound method": (lambda j, d, w, x, y: j(Holder(w).method, donate=d)(x, y), "s1r"),
    "jtu.Partial": (
        lambda j, d, w, x, y: j(jtu.Partial(triple, w), donate=d)(x, y),
        "f1r",
    ),
    "functools.partial": (
        lambda j, d, w, x, y: j(ft.partial(triple, w), donate=d)(x, y),
        "s1r",
    ),
}
# What each option donates, by role, as Equinox's documentation says.
DONATED_ROLES = {
    "none": "",
    "all": "f1r",
    "all-except-first": "fr",
    "warn": "f1r",
    "warn-except-first": "fr",
}


def deleted(jit):
    found = {}
    for name, (call, _) in CASES.items():
        for donate in OPTIONS:
            w, x, y = jnp.ones(3), jnp.ones(3), jnp.ones(3)
            call(jit, donate, w, x, y)
            found[f"{name}, {donate}"] = [a.is_deleted() for a in (w, x, y)]
    return found


def deleted_by_jax_jit():
    found = {}
    for name, (_, roles) in CASES.items():
        for donate in OPTIONS:
            w, x, y = jnp.ones(3), jnp.ones(3), jnp.ones(3)
            numbers = [i for i, r in enumerate(roles) if r in DONATED_ROLES[donate]]
            jax.jit(triple, donate_argnums=numbers)(w, x, y)
            found[f"{name}, {donate}"] = [a.is_deleted() for a in (w, x, y)]
    return found


def warned(jit):
    # A donation that cannot be used: "warn" says so, "all" does not.
    counts = {}
    for donate in OPTIONS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jit(lambda x, y: (x + y).sum(), donate=donate)(jnp.ones(3), jnp.ones(3))
        counts[donate] = sum("donated buffers" in str(w.message) for w in caught)
    return counts


equinox = deleted(eqx.filter_jit), warned(eqx.filter_jit)
own = deleted(filterjit.filter_jit)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    filterjit.patch_equinox()
patched = deleted(eqx.filter_jit), warned(eqx.filter_jit)
print(
    json.dumps(
        {
            "equinox": equinox,
            "jax.jit": deleted_by_jax_jit(),
            "patched": patched,
            "filterjit": own,
        }
    )
)
"""


def test_patched_donation_deletes_what_equinox_and_jax_jit_delete(tmp_path: Path):
    result = run_program(tmp_path, _DONATION)
    (equinox, equinox_warnings), jax_jit = result["equinox"], result["jax.jit"]
    patched, patched_warnings = result["patched"]
    assert len(equinox) == 50
    for case, flags in equinox.items():
        assert flags == jax_jit[case], (case, flags, jax_jit[case])
        assert patched[case] == flags, (case, patched[case], flags)
    assert patched_warnings == equinox_warnings
    assert equinox_warnings["warn"] > 0 and equinox_warnings["all"] == 0
    # As Equinox means it: a Module's arrays are donated, and its "first" is `x`.
    assert patched["module, all-except-first"] == [True, False, True]
    assert patched["jtu.Partial, all"] == [True, True, True]
    # filterjit.filter_jit keeps its own meaning: a Module is its call's `self`, its
    # first argument; a partial's bindings are never donated (docs/migration.md).
    own = result["filterjit"]
    assert own["module, all-except-first"] == [False, True, True]
    assert own["jtu.Partial, all"] == [False, True, True]
    assert own["function, all-except-first"] == equinox["function, all-except-first"]


# Finding 2.
_FACTORIES = """
import functools
import json
import warnings

import equinox as eqx
import jax.numpy as jnp

import factories
import filterjit

held = [functools.partial(eqx.filter_jit, donate="warn")]  # not a global

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report = filterjit.patch_equinox()


@factories.jit_all
def step(x):
    return x * 2


after = eqx.filter_jit(donate="all")(lambda x: x * 2)
print(
    json.dumps(
        {
            "left": report.left,
            "warnings": [str(w.message) for w in caught],
            "made by the old factory": type(step).__name__,
            "made after the patch": type(after).__name__,
        }
    )
)
"""


def test_a_decorator_factory_made_before_the_patch_is_named(tmp_path: Path):
    factories = """
    import equinox as eqx

    jit_all = eqx.filter_jit(donate="all")
    """
    result = run_program(tmp_path, _FACTORIES, {"factories": factories})
    left = result["left"]
    assert len(left) == 2, left
    assert any(
        "factories.jit_all" in item and "donate='all'" in item and "factory" in item
        for item in left
    ), left
    assert any("donate='warn'" in item for item in left), left
    (warning,) = result["warnings"]
    assert "factories.jit_all" in warning and "donate='warn'" in warning
    # What it names is what keeps Equinox's jit.
    assert result["made by the old factory"] == "_JitWrapper"
    assert result["made after the patch"] == "FilterJitWrapper"


# Finding 3.
@filter_jit
def doubled(x: jax.Array) -> jax.Array:
    return x * 2


class WithMethod:
    @filter_jit
    def halved(self, x: jax.Array) -> jax.Array:
        return x / 2


def test_module_level_wrappers_pickle_by_reference():
    for wrapper in (doubled, WithMethod.halved, vars(WithMethod)["halved"]):
        assert pickle.loads(pickle.dumps(wrapper)) is wrapper
        assert copy.copy(wrapper) is wrapper and copy.deepcopy(wrapper) is wrapper
    assert WithMethod().halved(jnp.float32(4)) == 2
    # A local function's wrapper: by value, through cloudpickle.
    import cloudpickle

    offset = jnp.float32(1)
    local = filter_jit(lambda x: x + offset)
    copied = cloudpickle.loads(cloudpickle.dumps(local))
    assert copied is not local and copied(jnp.float32(1)) == 2


_PICKLES = """
import json
import pickle
import warnings

import equinox as eqx

import before
import filterjit

with warnings.catch_warnings():
    warnings.simplefilter("error")
    filterjit.patch_equinox()

import after
import diffrax
import lineax
import optimistix

wrappers = {
    "diffrax.diffeqsolve": diffrax.diffeqsolve,
    "optimistix.root_find": optimistix.root_find,
    "lineax.linear_solve": lineax.linear_solve,
    "before.doubled": before.doubled,
    "after.doubled": after.doubled,
}
with open("wrappers.pickle", "wb") as file:  # for another process to load
    pickle.dump(wrappers, file)
print(
    json.dumps(
        {
            name: [type(w).__name__, pickle.loads(pickle.dumps(w)) is w]
            for name, w in wrappers.items()
        }
    )
)
"""

# In a fresh process, patched or not: the names' objects there, as for functions.
_UNPICKLES = """
import json
import pickle
import sys
import warnings

import filterjit

if sys.argv[1:] == ["patched"]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        filterjit.patch_equinox()
with open("wrappers.pickle", "rb") as file:
    loaded = pickle.load(file)
modules = {name: sys.modules[name.rpartition(".")[0]] for name in loaded}
print(
    json.dumps(
        {
            name: [type(w).__name__, w is getattr(modules[name], name.split(".")[1])]
            for name, w in loaded.items()
        }
    )
)
"""


def test_patched_wrappers_pickle_by_reference(tmp_path: Path):
    pytest.importorskip("diffrax")  # not in the `test` extra: the matrix legs lack it
    user = """
    import equinox as eqx


    @eqx.filter_jit
    def doubled(x):
        return x * 2
    """
    names = (
        "diffrax.diffeqsolve",
        "optimistix.root_find",
        "lineax.linear_solve",
        "before.doubled",
        "after.doubled",
    )
    result = run_program(tmp_path, _PICKLES, {"before": user, "after": user})
    assert result == {name: ["FilterJitWrapper", True] for name in names}
    patched = run_program(tmp_path, _UNPICKLES, args=["patched"])
    assert patched == {name: ["FilterJitWrapper", True] for name in names}
    unpatched = run_program(tmp_path, _UNPICKLES)
    assert unpatched == {name: ["_JitWrapper", True] for name in names}


# Finding 4.
@pytest.mark.parametrize(
    "jit_kwargs",
    [
        {"static_argnums": ()},
        {"static_argnums": None},
        {"static_argnames": None},
        {"static_argnames": []},
        {"donate_argnums": ()},
        {"donate_argnums": None},
        {"donate_argnames": ()},
        {"in_shardings": None},
        {"out_shardings": None},
        {"static_argnums": (), "donate_argnames": None, "keep_unused": True},
    ],
)
def test_empty_keywords_mean_what_leaving_them_out_means(jit_kwargs):
    # Nested, one trace for the staged calls (filter_jit's no-op, core v6 finding
    # 12) and the jaxpr jax.jit's nested call makes; at the top level jax.jit's.
    x = jnp.arange(3.0)
    counts, jaxprs = [], []
    for jit in (filterjit.jit, jax.jit):
        counter = TraceCounter(lambda y: y * 3)
        g = jit(counter, **jit_kwargs)
        jaxpr = str(jax.make_jaxpr(lambda y: g(y) * 2)(x))
        # The equation's name: jax.jit gives a callable object none of its own.
        jaxprs.append(re.sub(r"name=(<unnamed function>|TraceCounter)", "", jaxpr))
        jax.jit(lambda y: g(y) * 2)(x)
        counts.append(counter.count)
        assert_tree_allclose(g(x), x * 3)
    assert counts[0] == counts[1] == 1
    assert jaxprs[0] == jaxprs[1]


def test_keywords_that_mean_something_nested_do_not_share():
    counter = TraceCounter(lambda y, n: y * n)
    g = filterjit.jit(counter, static_argnums=(1,))
    x = jnp.arange(3.0)
    # Nested, `n` is a tracer jax.jit would refuse as static: the no-op calls.
    assert_tree_allclose(jax.jit(lambda y, n: g(y, n))(x, 2.0), x * 2)


# Finding 5.
@pytest.mark.parametrize(
    "inline", [0, 1, None, np.True_, np.False_, True, False, "yes"]
)
def test_jit_takes_the_inline_values_jax_jit_takes(inline):
    def inner(x, n):
        return x * n

    def equations(jaxpr: Any) -> list[Any]:
        return [(e.primitive.name, e.params.get("inline")) for e in jaxpr.eqns]

    assert_same_outcome(
        lambda: filterjit.jit(inner, inline=inline),
        lambda: jax.jit(inner, inline=inline),
    )
    if outcome(lambda: jax.jit(inner, inline=inline), JAX_ERRORS).error is not None:
        return  # this JAX refuses the value, as filterjit.jit does (checked above)
    ours = filterjit.jit(inner, inline=inline)
    x = jnp.ones(3)
    assert_tree_allclose(ours(x, 2.0), jax.jit(inner, inline=inline)(x, 2.0))
    # Nested (a static `n`, or tracers alone: filter_jit's no-op either way), inlined
    # as jax.jit inlines.
    with_static = jax.jit(lambda y: inner(y, 3.0), inline=inline)
    theirs = jax.jit(inner, inline=inline)
    for static, call, reference in (
        (True, lambda y: ours(y, 3.0), lambda y: with_static(y)),
        (False, lambda y: ours(y, y), lambda y: theirs(y, y)),
    ):
        got = [name for name, _ in equations(jax.make_jaxpr(call)(x).jaxpr)]
        expected = [name for name, _ in equations(jax.make_jaxpr(reference)(x).jaxpr)]
        if inline is True and hasattr(jax, "Inline"):
            # Where JAX reads True as JAX_LATE, filterjit's own nested call inlines
            # while tracing (docs/compatibility.md): no nested equation.
            assert "jit" not in got
        else:
            assert got == expected


# Finding 6.
def _f(x, n=1):
    return x * n


@pytest.mark.parametrize(
    "jit_kwargs",
    [
        {},
        {"static_argnums": 1},
        {"donate_argnum": 0},  # a typo
        {"fun": _f},
        {"static_argnums": "x"},  # refused when given a function
        {"no_such_option": 1},
        {"inline": 0},
    ],
    ids=lambda kwargs: ",".join(
        f"{k}={getattr(v, '__name__', v)}" for k, v in kwargs.items()
    ),
)
def test_keywords_are_accepted_and_refused_as_jax_jit_does(jit_kwargs):
    # The decorator factory, then the factory given the function, then the call;
    # and the direct form.
    stages = [
        lambda jit: jit(**jit_kwargs),
        lambda jit: jit(**jit_kwargs)(_f),
        lambda jit: jit(**jit_kwargs)(_f)(jnp.float32(2), 3),
        lambda jit: jit(_f, **jit_kwargs),
        lambda jit: jit(_f, **jit_kwargs)(jnp.float32(2), 3),
    ]
    for stage in stages:
        assert_same_outcome(lambda: stage(filterjit.jit), lambda: stage(jax.jit))


def test_a_misspelt_keyword_raises_at_once():
    with pytest.raises(TypeError, match="unexpected keyword argument 'donate_argnum'"):
        filterjit.jit(donate_argnum=0)  # pyright: ignore[reportCallIssue]
    with pytest.raises(TypeError, match="positional-only"):
        filterjit.jit(fun=_f)  # pyright: ignore[reportCallIssue]


# Finding 7.
def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])


@pytest.mark.parametrize("sharding", ["named", None])
def test_one_sharding_for_all_arguments(sharding):
    in_shardings = NamedSharding(_mesh(), P("data")) if sharding else None

    def f(x, y):
        return x * y, x + y

    x = jnp.arange(4.0)
    ours = filter_jit(f, in_shardings=in_shardings)
    theirs = jax.jit(f, in_shardings=in_shardings)
    got, expected = ours(x, x), theirs(x, x)
    assert_tree_allclose(got, expected)
    for a, b in zip(got, expected):
        assert a.sharding.is_equivalent_to(b.sharding, 1)
    assert ours.lower(x, x).compile()(x, x)[0].tolist() == (x * x).tolist()
    assert filterjit.jit(f, in_shardings=in_shardings)(x, x)[1].tolist() == [
        0.0,
        2.0,
        4.0,
        6.0,
    ]
    # A static argument beside it: its entry is skipped, as ever.
    with_static = filter_jit(lambda x, k: x * k, in_shardings=in_shardings)
    assert with_static(x, 2.0).tolist() == (x * 2).tolist()


# Finding 8.
def test_the_signature_is_jax_jits():
    def f(x: jax.Array, n: int = 1) -> jax.Array:
        return x * n

    ours, theirs = filterjit.jit(f), jax.jit(f)
    for follow in (False, True):
        assert inspect.signature(ours, follow_wrapped=follow) == inspect.signature(
            theirs, follow_wrapped=follow
        )
    assert ours.__signature__ == theirs.__signature__  # pyright: ignore
    assert ours.__signature__ == inspect.signature(f)  # pyright: ignore
    # On the type, as jax.jit's: a transform's functools.wraps copies none.
    assert "__signature__" not in vars(ours)


# Finding 9.
@pytest.mark.parametrize("keyword", ["fn", "default", "out", "args", "kwargs"])
def test_equinoxs_removed_keywords_point_to_its_release_notes(keyword):
    removed: dict[str, Any] = {keyword: None}
    expected = outcome(lambda: eqx.filter_jit(_f, **removed))
    assert expected.error is ValueError
    assert "releases/tag/v0.10.0" in expected.message
    for make in (lambda: filter_jit(_f, **removed), lambda: filter_jit(**removed)):
        ours = outcome(make)
        assert ours.error is ValueError
        assert (
            f"`{keyword}=`" in ours.message and "releases/tag/v0.10.0" in ours.message
        )
