"""Library entry points at the top level: `diffrax.diffeqsolve`,
`optimistix.root_find` and `lineax.linear_solve`, each shipped as an
`eqx.filter_jit` function, called as their users call them."""

import importlib
import types
from collections.abc import Callable
from types import ModuleType
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import filterjit


LIMIT = 1.5  # filterjit ÷ jax.jit, per call
LIBRARIES = ("diffrax", "optimistix", "lineax")
NO_LIBRARIES = (
    f"libraries: skipped, {harness.NA} (diffrax, optimistix or lineax is not "
    "installed, or does not import with this jax)."
)

# A call: the library's entry point (an `eqx.filter_jit` function), its
# positional and its keyword arguments.
Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def optional_libraries() -> dict[str, ModuleType] | None:
    """diffrax, optimistix and lineax, or `None` when one of them is not installed
    (or does not import with this jax): the section is then skipped."""
    try:
        return {name: importlib.import_module(name) for name in LIBRARIES}
    except Exception:  # ImportError, or a release built against another jax
        return None


def undecorated(entry: Callable[..., Any]) -> types.FunctionType:
    """The plain Python function under a library's entry point, following
    `__wrapped__` (`eqx.filter_jit`'s wrapper has one)."""
    fun: Any = entry
    while not isinstance(fun, types.FunctionType):
        fun = fun.__wrapped__
    return fun


def vector_field(t: Any, y: jax.Array, args: jax.Array) -> jax.Array:
    return -args * y


def residual(y: jax.Array, args: jax.Array) -> jax.Array:
    return y**3 + y - args


def _diffeqsolve(libs: dict[str, ModuleType]) -> Call:
    dfx = libs["diffrax"]
    y0 = jnp.linspace(1.0, 2.0, 4)
    a = jnp.linspace(0.5, 1.5, 4)
    kwargs = {
        "t0": 0.0,
        "t1": 1.0,
        "dt0": 0.1,
        "y0": y0,
        "args": a,
        "saveat": dfx.SaveAt(t1=True),
    }
    return dfx.diffeqsolve, (dfx.ODETerm(vector_field), dfx.Tsit5()), kwargs


def _root_find(libs: dict[str, ModuleType]) -> Call:
    optx = libs["optimistix"]
    y0 = jnp.zeros(4)
    a = jnp.linspace(0.5, 2.0, 4)
    solver = optx.Newton(rtol=1e-6, atol=1e-6)
    return optx.root_find, (residual, solver, y0), {"args": a}


def _linear_solve(libs: dict[str, ModuleType]) -> Call:
    lx = libs["lineax"]
    n = 8
    matrix = 4.0 * jnp.eye(n) + jnp.sin(jnp.arange(n * n, dtype=jnp.float32)).reshape(
        n, n
    )
    b = jnp.linspace(-1.0, 1.0, n)
    operator = lx.MatrixLinearOperator(matrix)
    return lx.linear_solve, (operator, b), {"solver": lx.LU()}


CALLS: dict[str, Callable[[dict[str, ModuleType]], Call]] = {
    "diffrax.diffeqsolve": _diffeqsolve,
    "optimistix.root_find": _root_find,
    "lineax.linear_solve": _linear_solve,
}


def _implementations(call: Call) -> dict[str, Callable[[], Any]]:
    """The three implementations of one call, each blocking on its result.

    jax.jit is what a careful user writes by hand: the arguments are partitioned
    once, here, with `eqx.partition(..., eqx.is_array)`; the jitted function takes
    only the arrays, and combines them inside with the rest (Modules' static
    parts, functions, Python floats), which it closes over. It returns the arrays
    of the output (`eqx.filter`): jax.jit cannot return a non-array leaf as it is.
    filterjit wraps the same undecorated function as the library's
    `eqx.filter_jit` does, and is called with the same arguments."""
    entry, args, kwargs = call
    plain = undecorated(entry)
    dynamic, static = eqx.partition((args, kwargs), eqx.is_array)
    leaves, treedef = jax.tree.flatten(dynamic)

    @jax.jit
    def by_hand(*leaves: jax.Array) -> Any:
        args, kwargs = eqx.combine(jax.tree.unflatten(treedef, leaves), static)
        return eqx.filter(plain(*args, **kwargs), eqx.is_array)

    wrapped = filterjit.filter_jit(plain)
    return {
        harness.JAX: lambda: jax.block_until_ready(by_hand(*leaves)),
        harness.EQX: lambda: jax.block_until_ready(entry(*args, **kwargs)),
        harness.FILTERJIT: lambda: jax.block_until_ready(wrapped(*args, **kwargs)),
    }


def _check(name: str, outputs: dict[str, Any]) -> None:
    """The three implementations return the same arrays in the same structure, and
    eqx.filter_jit and filterjit the same non-array leaves, so that the benchmark
    cannot time a wrong program."""
    reference = outputs[harness.JAX]
    expected = jax.tree.structure(reference)
    for impl, output in outputs.items():
        arrays = eqx.filter(output, eqx.is_array)
        if jax.tree.structure(arrays) != expected:
            raise AssertionError(f"{name}: {impl} returns another structure")
        for got, want in zip(jax.tree.leaves(arrays), jax.tree.leaves(reference)):
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"{name}: {impl}")
    not_array = lambda x: not eqx.is_array(x)  # noqa: E731
    if jax.tree.leaves(eqx.filter(outputs[harness.EQX], not_array)) != jax.tree.leaves(
        eqx.filter(outputs[harness.FILTERJIT], not_array)
    ):
        raise AssertionError(f"{name}: filterjit's static outputs differ")


def run(settings: harness.Settings) -> harness.Section:
    libs = optional_libraries()
    if libs is None:
        return harness.Section("libraries", NO_LIBRARIES, "")
    rounds = settings.pick(full=31, quick=3)
    calls = settings.pick(full=100, quick=4)
    names = [harness.JAX, harness.EQX, harness.FILTERJIT]
    headers = ["call", *(f"{name} (µs)" for name in names)]
    headers += [f"{name} ÷ jax.jit" for name in names[1:]]
    if settings.targets:
        headers += ["target", "result"]
    rows = []
    targets = []
    ratios = []
    over_eqx = {}
    for name, make in CALLS.items():
        impls = _implementations(make(libs))
        _check(name, {impl: call() for impl, call in impls.items()})  # and compile
        medians = harness.interleave(
            {impl: harness.time_batch(call, calls) for impl, call in impls.items()},
            rounds,
        )
        us = {impl: medians[impl] * 1e6 for impl in names}
        over_eqx[name] = us[harness.FILTERJIT] / us[harness.EQX]
        row = [name, *(harness.fmt_number(us[impl]) for impl in names)]
        row += [harness.fmt_ratio(us[impl], us[harness.JAX]) for impl in names[1:]]
        ratios.append(
            harness.RatioRow(
                name, {impl: us[impl] / us[harness.JAX] for impl in names}, LIMIT
            )
        )
        if settings.targets:
            target = harness.Target(
                "libraries", name, us[harness.FILTERJIT] / us[harness.JAX], LIMIT, "×"
            )
            targets.append(target)
            row += [target.describe(), target.verdict]
        rows.append(row)
    slowest = max(over_eqx, key=over_eqx.__getitem__)
    notes = [
        "filterjit ÷ eqx.filter_jit: "
        + ", ".join(f"{name} {over_eqx[name]:.2f}" for name in over_eqx)
        + f"; slowest row {slowest} ({over_eqx[slowest]:.2f}×)."
    ]
    if settings.targets:
        targets.append(
            harness.Target(
                "libraries", "slowest ÷ eqx.filter_jit", over_eqx[slowest], 1.0, "×"
            )
        )
    versions = ", ".join(f"{lib} {libs[lib].__version__}" for lib in LIBRARIES)
    header = (
        "Median µs per top-level call of three library entry points, each "
        "blocking on its result (`jax.block_until_ready`), each implementation in "
        f"the same interleaved rounds ({rounds} rounds of {calls} calls); {versions}. "
        "Calls: `diffeqsolve(ODETerm(f), Tsit5(), t0=0.0, t1=1.0, dt0=0.1, y0=y0, "
        "args=a, saveat=SaveAt(t1=True))` with `f = -a * y` on float32[4] (10 "
        "steps); `root_find(fn, Newton(rtol=1e-6, atol=1e-6), y0, args=a)` with "
        "`fn = y**3 + y - a` on float32[4]; `linear_solve(MatrixLinearOperator(A), "
        "b, solver=LU())` with A float32[8, 8]. eqx.filter_jit: the entry point as "
        "shipped. filterjit: `filterjit.filter_jit` of the undecorated function "
        "(`__wrapped__`), called with the same arguments. jax.jit: `jax.jit` of the "
        "undecorated function as a careful user writes it, taking only the arrays "
        "(`eqx.partition(..., eqx.is_array)` once, outside; `eqx.combine` inside, "
        "the Modules' static parts and the Python floats closed over) and "
        "returning the output's arrays. The three results are checked equal before "
        "timing."
    )
    table = harness.markdown_table(headers, rows)
    return harness.Section("libraries", header, table, targets, notes, ratios)
