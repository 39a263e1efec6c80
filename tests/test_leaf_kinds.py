"""Which leaves a decorated function sees traced, which static and which as the
very objects passed in, in each context (docs/contract.md, its table): at the top
level arrays (JAX and NumPy) are traced and Python values static; inside a staged
computation (`jit`, `make_jaxpr`, `eval_shape`, `scan`, `while_loop`, `cond`,
`switch`, `checkpoint`, `custom_vjp` rules) concrete leaves reach the function
unchanged; under eager transforms only, concrete arrays are traced; under
`jax.disable_jit()` the function gets the leaves themselves.

Then the no-op matrix: decorating a function must not change what it computes.
Each row is a function `row(x, c)` that only works when `c` is known at trace time
(a loop bound, a shape, a Python `if`, a slice, a concrete output used as a shape,
NumPy applied to it). Each row is run with several kinds of concrete `c`, inside
several transforms ("contexts", the harness's: `differential.CONTEXTS`), once
undecorated and once decorated. A cell agrees when both succeed with equal
results, or both raise.

Inside a staged computation every cell must agree for `filterjit.filter_jit`.
Under eager transforms alone (and at the top level) `filter_jit` traces NumPy
and JAX arrays by contract, like `jax.jit` would; there the cells with an array
`c` must match the top-level reference (the row with `c` passed as a traced
argument of `jax.jit`), and the cells with a Python scalar `c` must agree with
the undecorated function.

Run as a script (`python tests/test_leaf_kinds.py [-v]`), this file prints how
many cells of the matrix agree for `jax.jit`, `equinox.filter_jit` and
`filterjit.filter_jit` (and with `-v`, which cells disagree).

The same over generated pytrees of every kind: test_leaf_kinds_properties.py.
"""

import dataclasses
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import differential
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import agree, Context, Outcome, outcome
from helpers import TraceCounter
from jax import lax
from jax.core import Tracer

import filterjit
from filterjit import filter_jit


def _kinds_seen(fun):
    """A decorated function that records what it was called with."""
    seen = []

    def record(*args):
        seen.append(args)
        return args[0]

    return filter_jit(record), seen


# ------------------------------------------------------------------------ the top level


@pytest.mark.leaks_unchecked  # it keeps the tracers its function sees, on purpose
def test_top_level_traces_arrays_and_keeps_python_values_static():
    seen = []

    @filter_jit
    def f(a, b, c, d, e, g, h, s):
        seen.append((a, b, c, d, e, g, h, s))
        return a

    f(jnp.ones(2), np.ones(2), np.float32(1), True, 2, 3.0, 1j, "s")
    a, b, c, d, e, g, h, s = seen[0]
    for traced in (a, b, c):
        assert isinstance(traced, Tracer)
    assert (d, e, g, h, s) == (True, 2, 3.0, 1j, "s")
    assert [type(v) for v in (d, e, g, h, s)] == [bool, int, float, complex, str]


def test_is_array():
    assert filterjit.is_array(jnp.ones(2))
    assert filterjit.is_array(np.ones(2))
    assert filterjit.is_array(np.int32(1))
    for static in (1, 1.0, True, 1j, "a", None, object(), [1]):
        assert not filterjit.is_array(static)


# ---------------------------------------------------------- inside a staged computation


@pytest.mark.leaks_unchecked  # it keeps the tracers its function sees, on purpose
@pytest.mark.parametrize(
    "stage",
    [
        lambda g: jax.jit(g)(jnp.float32(1)),
        lambda g: jax.make_jaxpr(g)(jnp.float32(1)),
        lambda g: jax.eval_shape(g, jnp.float32(1)),
        lambda g: lax.scan(lambda c, _: (g(c), None), jnp.float32(1), None, length=1),
        lambda g: lax.while_loop(lambda c: c < 2, g, jnp.float32(1)),
        lambda g: lax.cond(jnp.bool_(True), g, lambda c: c, jnp.float32(1)),
        lambda g: lax.switch(jnp.int32(0), [g, lambda c: c], jnp.float32(1)),
        lambda g: jax.checkpoint(g)(jnp.float32(1)),
        lambda g: jax.grad(jax.checkpoint(g))(jnp.float32(1)),
    ],
    ids=[
        "jit",
        "make_jaxpr",
        "eval_shape",
        "scan",
        "while",
        "cond",
        "switch",
        "checkpoint",
        "grad_checkpoint",
    ],
)
def test_staged_concrete_leaves_reach_the_function_unchanged(stage):
    concrete = (
        3,
        2.5,
        True,
        np.int32(4),
        np.arange(3),
        np.float32(0.5),
        jnp.arange(2),
        "mode",
        None,
    )
    f, seen = _kinds_seen(None)

    def body(c):
        f(c, *concrete)
        return c + 1

    stage(body)
    assert seen
    for args in seen:
        assert isinstance(args[0], Tracer)
        for got, want in zip(args[1:], concrete):
            assert got is want


@pytest.mark.leaks_unchecked  # it keeps the tracers its function sees, on purpose
def test_custom_vjp_rules_are_staged():
    f, seen = _kinds_seen(None)
    n = np.int32(3)

    @jax.custom_vjp
    def g(x):
        f(x, n, "primal")
        return x * 2

    def g_fwd(x):
        f(x, n, "fwd")
        return x * 2, None

    def g_bwd(_, ct):
        f(ct, n, "bwd")
        return (ct * 2,)

    g.defvjp(g_fwd, g_bwd)
    assert jax.jit(jax.grad(g))(jnp.float32(1.0)) == 2.0
    # The forward rule and the backward rule, each with the concrete `n`. (Both run
    # in the outer jit's trace. Were their calls identical, JAX <= 0.11.1 would still
    # trace the function twice, as it keys the backward pass's trace by another
    # abstract mesh; newer JAX shares one trace, as for any identical nested calls.)
    assert sorted(args[2] for args in seen) == ["bwd", "fwd"]
    for args in seen:
        assert isinstance(args[0], Tracer)
        assert args[1] is n


def test_print_inside_shows_the_concrete_value(capsys):
    @filter_jit
    def f(x, table):
        print("table:", table)
        return x + table.sum()

    jax.jit(lambda x: f(x, np.array([1.0, 2.0], np.float32)))(jnp.float32(0))
    assert "table: [1. 2.]" in capsys.readouterr().out


def test_a_concrete_loop_bound_stays_concrete_in_jit_of_grad():
    @filter_jit
    def f(init, lower):
        return lax.fori_loop(lower, 1, lambda _, y: y + 1, init)

    assert jax.jit(lambda: jax.grad(f)(0.0, np.int32(0)))() == 1.0
    assert jax.jit(lambda: jax.grad(f)(0.0, 0))() == 1.0
    lower = jnp.int32(0)  # a concrete jax Array, made outside the trace
    assert jax.jit(lambda: jax.grad(f)(0.0, lower))() == 1.0


# ---------------------------------------------------------- under eager transforms only


def test_eager_grad_traces_numpy_batches_once():
    counter = TraceCounter(lambda params, batch: jnp.sum((params["w"] * batch) ** 2))
    loss = filter_jit(counter)
    params = {"w": jnp.ones(3)}
    grads = []
    for i in range(4):
        batch = np.full(3, i, np.float32)
        grads.append(jax.grad(loss)(params, batch))
    assert counter.count == 1
    for i, g in enumerate(grads):
        np.testing.assert_allclose(g["w"], 2.0 * i * i)


@pytest.mark.leaks_unchecked  # it keeps the tracers its function sees, on purpose
def test_eager_vmap_and_jvp_trace_arrays():
    for transform in (
        lambda f: jax.vmap(lambda x: f(x, np.float32(1)))(jnp.ones(3)),
        lambda f: jax.jvp(
            lambda x: f(x, np.float32(1)), (jnp.float32(1),), (jnp.float32(1),)
        ),
    ):
        f, seen = _kinds_seen(None)  # a wrapper per transform: one trace each
        transform(f)
        assert len(seen) == 1
        assert isinstance(seen[0][1], Tracer)


# ---------------------------------------------------------------- under jax.disable_jit


def test_disable_jit_calls_the_function_directly():
    seen = []

    @filter_jit
    def f(x, n):
        seen.append(x)
        return x * n

    x = np.ones(2, np.float32)
    with jax.disable_jit():
        f(x, 2)
        f(x, 2)
    assert len(seen) == 2 and all(s is x for s in seen)


# --------------------------------------------------------------- the no-op matrix: rows


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]
_NOT_HERE = ("jit", "jit(scan body)")
# Results of one program compiled in other ways: equal to float tolerance.
CLOSE: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-6}
# The row's own code around the (possibly decorated) function: `caller(f, x, c)`.
Caller = Callable[[Callable[..., Any], jax.Array, Any], jax.Array]


def _fori_bound(x: jax.Array, c: Any) -> jax.Array:
    # A concrete bound makes fori_loop a scan, which reverse-mode can differentiate.
    return lax.fori_loop(0, c, lambda _, y: jnp.sin(y), x)


def _ones_shape(x: jax.Array, c: Any) -> jax.Array:
    return x * jnp.sum(jnp.ones(c, dtype=x.dtype))


def _python_if(x: jax.Array, c: Any) -> jax.Array:
    if c > 1:
        return jnp.sin(x)
    return jnp.cos(x)


def _static_slice(x: jax.Array, c: Any) -> jax.Array:
    return x * jnp.sum(x[:c])


def _concrete_output(x: jax.Array, c: Any) -> tuple[jax.Array, Any]:
    return x * 2, c + 1


def _numpy_on_argument(x: jax.Array, c: Any) -> jax.Array:
    return x * float(np.sum(np.asarray(c) ** 2))


def _call(f: Callable[..., Any], x: jax.Array, c: Any) -> jax.Array:
    return f(x, c)


def _use_output_as_shape(f: Callable[..., Any], x: jax.Array, c: Any) -> jax.Array:
    # Undecorated caller code: the second output must be concrete to be a shape.
    y, m = f(x, c)
    return y * jnp.sum(jnp.ones(m, dtype=y.dtype))


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    # The function that gets decorated.
    inner: Callable[..., Any]
    caller: Caller = _call


ROWS: tuple[Row, ...] = (
    Row("fori_loop bound", _fori_bound),
    Row("jnp.ones(c)", _ones_shape),
    Row("python if", _python_if),
    Row("static slice", _static_slice),
    Row("output as shape", _concrete_output, _use_output_as_shape),
    Row("numpy on c", _numpy_on_argument),
)


# -------------------------------------------------------------- the no-op matrix: kinds


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    make: Callable[[], Any]
    # Whether filter_jit traces it at the top level and under eager transforms.
    array: bool


KINDS: tuple[Kind, ...] = (
    Kind("int", lambda: 2, array=False),
    Kind("float", lambda: 2.0, array=False),
    Kind("np.int32", lambda: np.int32(2), array=True),
    Kind("np 0-d", lambda: np.array(2), array=True),
    Kind("np (1,)", lambda: np.array([2]), array=True),
    Kind("jax Array", lambda: jnp.asarray(2), array=True),
)


# ----------------------------------------------------------- the no-op matrix: contexts

# The harness's contexts, but a plain `jit` (the rows' staged cells have many).
CONTEXTS = tuple(c for c in differential.CONTEXTS if c.name not in _NOT_HERE)


# ------------------------------------------------------------ the no-op matrix: running

_X = np.array([0.5, -1.0, 2.0], dtype=np.float32)


def run_cell(
    context: Context,
    row: Row,
    kind: Kind,
    f: Callable[..., Any],
    raises: tuple[type[BaseException], ...] = (),
) -> Outcome:
    """Runs `row` with `f` in place of its inner function (`row.inner` itself, or
    it decorated), with `c` of `kind` closed over, inside `context`; `raises` as
    for `outcome`."""
    c = kind.make()
    x = jnp.asarray(_X)
    return outcome(lambda: context.apply(lambda y: row.caller(f, y, c), x), raises)


# The references of a cell, run once for every test that compares with them.
_REFERENCES: dict[tuple[str, str, str, str], Outcome] = {}


def reference_cell(context: Context, row: Row, kind: Kind, which: str) -> Outcome:
    """The cell run undecorated (`which` "undecorated") or with `jax.jit` of
    the row's inner function, `c` traced ("jax.jit")."""
    key = (context.name, row.name, kind.name, which)
    if key not in _REFERENCES:
        f = row.inner if which == "undecorated" else jax.jit(row.inner)
        _REFERENCES[key] = run_cell(context, row, kind, f)
    return _REFERENCES[key]


def check_context(
    context: Context, decorator: Decorator, unstaged: Decorator | None = None
) -> list[str]:
    """The cells of `context` where `decorator` breaks the contract: staged cells
    must agree with the undecorated function. Unstaged cells must agree with
    `unstaged(row.inner)` where given (`filterjit.jit` is `jax.jit` there); else,
    with the undecorated function for Python scalars, and with the top-level
    reference (`jax.jit`, `c` traced) for arrays.

    One wrapper per row serves every kind of `c`, so that its caches see them all.
    """
    failures = []
    references = []
    for row in ROWS:
        decorated = decorator(row.inner)
        unstaged_reference = None if unstaged is None else unstaged(row.inner)
        for kind in KINDS:
            got = run_cell(context, row, kind, decorated)
            if context.staged:
                expected = reference_cell(context, row, kind, "undecorated")
                reference = "undecorated"
            elif unstaged_reference is not None:
                # jax.jit refuses an unhashable static from C++, with no frame
                # of JAX's in the traceback: a program's error all the same.
                expected = run_cell(
                    context, row, kind, unstaged_reference, raises=(ValueError,)
                )
                reference = "jax.jit with the same keywords"
            elif not kind.array:
                expected = reference_cell(context, row, kind, "undecorated")
                reference = "undecorated"
            else:
                expected = reference_cell(context, row, kind, "jax.jit")
                reference = "top-level reference (jax.jit, c traced)"
            references.append(expected)
            why = agree(got, expected, **CLOSE)
            if why is not None:
                failures.append(
                    f"[{context.name} | {row.name} | c: {kind.name}] against the "
                    f"{reference}: {why}"
                )
    # A context in which no reference runs is a broken test, not a passing one.
    assert any(r.error is None for r in references), references
    return failures


# -------------------------------------------------------------- the no-op matrix: tests


@pytest.mark.parametrize("context", CONTEXTS, ids=[c.name for c in CONTEXTS])
def test_filter_jit_is_a_noop(context: Context) -> None:
    failures = check_context(context, filterjit.filter_jit)
    assert not failures, (
        f"filter_jit breaks the contract in {len(failures)} cell(s):\n"
        + "\n".join(failures)
    )


# filterjit.jit with jax.jit's keywords: `c` static, and `x` donated.
JIT_KEYWORDS: dict[str, dict[str, Any]] = {
    "plain": {},
    "static_argnums": {"static_argnums": 1},
    "donate_argnums": {"donate_argnums": 0},
}


# Nested, filterjit.jit is filter_jit's no-op (one dispatcher, its staged path),
# which test_filter_jit_is_a_noop checks in every context: the default tier runs
# filterjit.jit in every unstaged context (where it is jax.jit) and in these staged
# ones, one of each kind of staging; the slow tier in all.
_JIT_STAGED_DEFAULT = ("jit(grad)", "scan body", "cond branch", "eval_shape")
_JIT_CONTEXTS = [
    pytest.param(
        c,
        id=c.name,
        marks=[pytest.mark.slow]
        if c.staged and c.name not in _JIT_STAGED_DEFAULT
        else [],
    )
    for c in CONTEXTS
]


# Donating `x` where no output can take its buffer: JAX warns and copies.
@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
@pytest.mark.parametrize(
    "keywords",
    # The keyword variants in the slow tier: a minute each.
    [
        k if k == "plain" else pytest.param(k, marks=pytest.mark.slow)
        for k in JIT_KEYWORDS
    ],
)
@pytest.mark.parametrize("context", _JIT_CONTEXTS)
def test_jit_is_a_noop(context: Context, keywords: str) -> None:
    # Staged, a no-op; elsewhere, jax.jit with the same keywords.
    options = JIT_KEYWORDS[keywords]
    failures = check_context(
        context,
        lambda f: filterjit.jit(f, **options),
        lambda f: jax.jit(f, **options),
    )
    assert not failures, (
        f"filterjit.jit({options}) breaks the contract in {len(failures)} "
        "cell(s):\n" + "\n".join(failures)
    )


def test_matrix_is_discriminating() -> None:
    # The matrix must catch the bug it is for: jax.jit disagrees in staged cells.
    context = next(c for c in CONTEXTS if c.name == "jit(grad)")
    assert check_context(context, jax.jit)
    # And unstaged cells compared with jax.jit: filter_jit keeps a Python `c`
    # static at the top level, where jax.jit traces it.
    top_level = next(c for c in CONTEXTS if c.name == "top level")
    assert check_context(top_level, filterjit.filter_jit, jax.jit)


# ------------------------------------------------------------- the no-op matrix: script


@dataclasses.dataclass
class _Tally:
    agree: int = 0
    total: int = 0

    def __str__(self) -> str:
        return f"{self.agree:3d}/{self.total:<3d}"


def main() -> None:
    jax.config.update("jax_numpy_dtype_promotion", "strict")  # as in conftest.py
    warnings.simplefilter("error")  # as in pyproject.toml
    decorators: dict[str, Decorator] = {
        "jax.jit": jax.jit,
        "equinox.filter_jit": eqx.filter_jit,
        "filterjit.filter_jit": filterjit.filter_jit,
        "filterjit.jit": filterjit.jit,
    }
    start = time.perf_counter()
    tallies = {
        (name, group): _Tally()
        for name in decorators
        for group in ("all", "staged", "eager", "contract")
    }
    disagreements: dict[str, list[str]] = {name: [] for name in decorators}
    for context in CONTEXTS:
        for row in ROWS:
            wrapped = {name: d(row.inner) for name, d in decorators.items()}
            for kind in KINDS:
                plain = run_cell(context, row, kind, row.inner)
                reference = run_cell(context, row, kind, wrapped["jax.jit"])
                for name in decorators:
                    if name == "jax.jit":
                        got = reference
                    else:
                        got = run_cell(context, row, kind, wrapped[name])
                    same = agree(got, plain, **CLOSE) is None
                    group = "staged" if context.staged else "eager"
                    for g in ("all", group):
                        tallies[name, g].total += 1
                        tallies[name, g].agree += same
                    # filterjit.jit is jax.jit wherever it is not staged.
                    like_jit = kind.array or name == "filterjit.jit"
                    expected = reference if not context.staged and like_jit else plain
                    tallies[name, "contract"].total += 1
                    tallies[name, "contract"].agree += (
                        agree(got, expected, **CLOSE) is None
                    )
                    if not same:
                        disagreements[name].append(
                            f"{context.name} | {row.name} | {kind.name}"
                        )
    print(
        f"{len(CONTEXTS)} contexts ({sum(c.staged for c in CONTEXTS)} staged) x "
        f"{len(ROWS)} rows x {len(KINDS)} kinds of c; cells agreeing with the "
        "undecorated function (both raise, or equal results):\n"
    )
    header = ("decorator", "all", "staged", "eager", "contract*")
    print(f"{header[0]:<22}" + "".join(f"{h:>11}" for h in header[1:]))
    for name in decorators:
        print(
            f"{name:<22}"
            + "".join(
                f"{str(tallies[name, g]):>11}"
                for g in ("all", "staged", "eager", "contract")
            )
        )
    print(
        "\n* contract: staged cells and Python-scalar cells agree with the "
        "undecorated function;\n  eager cells with an array c agree with the "
        "top-level reference (jax.jit, c traced); for filterjit.jit, every\n  "
        "eager cell does."
    )
    if "-v" in sys.argv:
        for name, cells in disagreements.items():
            print(f"\n{name} disagrees in:\n  " + "\n  ".join(cells))
    print(f"\n({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
