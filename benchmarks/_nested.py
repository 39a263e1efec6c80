"""Tracing an outer function that makes many nested calls."""

import time
from collections.abc import Callable
from typing import Any

import _harness as harness
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import filterjit


LIMIT = 1.0  # filterjit ÷ nested jax.jit
CALLS = 100
STEPS = 10
WIDTH = 16


def inner(x: jax.Array, steps: int, c: np.ndarray) -> jax.Array:
    for _ in range(steps):
        x = jnp.sin(x) * c + x
    return x


def inner_int(x: jax.Array, steps: int) -> jax.Array:
    for _ in range(steps):
        x = jnp.sin(x) + x
    return x


def _outer(
    helper: Callable[..., jax.Array], args: tuple[Any, ...]
) -> Callable[..., Any]:
    def outer(x: jax.Array) -> jax.Array:
        for _ in range(CALLS):
            x = helper(x, *args)
        return x

    return outer


def _trace_time(
    helper: Callable[..., Any], args: tuple[Any, ...], x: jax.Array
) -> Callable[[], float]:
    def case() -> float:
        # A fresh outer function every time: make_jaxpr caches its trace on the
        # function object.
        outer = _outer(helper, args)
        start = time.perf_counter_ns()
        jax.make_jaxpr(outer)(x)
        return (time.perf_counter_ns() - start) * 1e-9

    return case


NAMES = [harness.UNDECORATED, harness.JAX, harness.EQX, harness.NNX, harness.FILTERJIT]
RATIOS = (harness.EQX, harness.NNX, harness.FILTERJIT)


def _row(
    settings: harness.Settings,
    label: str,
    function: Callable[..., jax.Array],
    args: tuple[Any, ...],
    x: jax.Array,
) -> tuple[list[str], harness.Target | None]:
    """One row: `function(x, *args)` called nested `CALLS` times, under each
    decorator (its second parameter static for jax.jit and nnx.jit)."""
    # Each decorator is applied once, here; the outer function is made and traced
    # afresh on every measurement.
    helpers: dict[str, Callable[..., Any]] = {
        harness.UNDECORATED: function,
        harness.JAX: jax.jit(function, static_argnums=1),
        harness.EQX: eqx.filter_jit(function),
    }
    nnx = harness.optional_nnx()
    if nnx is not None:
        helpers[harness.NNX] = nnx.jit(function, static_argnums=1)
    helpers[harness.FILTERJIT] = filterjit.filter_jit(function)
    cases = {}
    for name, helper in helpers.items():
        cases[name] = case = _trace_time(helper, args, x)
        case()  # warm: the inner trace is cached after this
    medians = harness.interleave(cases, settings.pick(full=15, quick=2))
    ms = {name: None if name not in medians else medians[name] * 1e3 for name in NAMES}
    row = [label, *(harness.fmt_number(ms[name]) for name in NAMES)]
    row += [harness.fmt_ratio(ms[name], ms[harness.JAX]) for name in RATIOS]
    row += [harness.fmt_ratio(ms[harness.FILTERJIT], ms[harness.UNDECORATED])]
    if not settings.targets:
        return row, None
    value = medians[harness.FILTERJIT] / medians[harness.JAX]
    target = harness.Target(f"nested: {label}", "trace", value, LIMIT, "×")
    return [*row, target.describe(), target.verdict], target


def run(settings: harness.Settings) -> harness.Section:
    c = np.linspace(0.0, 1.0, WIDTH, dtype=np.float32)
    x = jnp.ones((WIDTH,), dtype=jnp.float32)
    measured = [
        _row(settings, f"{CALLS} nested calls", inner, (STEPS, c), x),
        _row(settings, f"{CALLS} nested calls, an int alone", inner_int, (STEPS,), x),
    ]
    headers = ["trace", *(f"{name} (ms)" for name in NAMES)]
    headers += [f"{name} ÷ jax.jit" for name in RATIOS]
    headers += ["filterjit ÷ undecorated"]
    if settings.targets:
        headers += ["target", "result"]
    targets = [target for _, target in measured if target is not None]
    rounds = settings.pick(full=15, quick=2)
    header = (
        f"Median ms to trace (`jax.make_jaxpr`) an outer function that calls a "
        f"helper {CALLS} times; the helper takes a float32[{WIDTH}] tracer, a "
        f"static Python int (`static_argnums=1` for jax.jit and nnx.jit) and, in "
        f"the first row, a NumPy float32[{WIDTH}] constant, and runs {STEPS} "
        "`sin`/`add` steps (`mul` by the constant too). Each decorator is applied "
        "once, outside the outer function, and every implementation is traced "
        f"once before timing (warm). {rounds} interleaved rounds."
    )
    notes = [] if harness.optional_nnx() is not None else [harness.NO_FLAX]
    rows = [row for row, _ in measured]
    return harness.Section(
        "nested", header, harness.markdown_table(headers, rows), targets, notes
    )
